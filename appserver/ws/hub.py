"""Subscriptions, snapshot fan-out, approval fan-out and client-tool routing for `/ws`.

One `ConversationWatch` per conversation that someone cares about (subscribers, or a live turn
whose client tools a connection executes). It pins the runtime (so it is not evicted), registers
a watcher for new/resumed turns, and runs one follower task per live turn: the follower waits on
the turn's latest-value snapshot cell, encodes each newest snapshot once and appends it to every
subscriber's outbound buffer (never awaiting a socket). The terminal snapshot is published by the
kernel only after the store commit, so `completed` always means "already in history".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from appserver.errors import NotAwaiting
from appserver.runtime import (
    TERMINAL_STATUSES,
    Decision,
    TurnController,
    TurnHandle,
    TurnSnapshot,
    Watch,
)
from appserver.shown import clipped
from appserver.store.records import PendingCall
from appserver.ws.connection import Connection, OutboundBudget, encode, text_frame

if TYPE_CHECKING:
    from appserver.server import Server

log = logging.getLogger("appserver.ws")

PACE_SUBSCRIBERS = 64  # from this many subscribers on, a turn's snapshots go out one round at a time
PACE_MAX_S = 0.25  # a round never holds the next one back longer than this (a stuck client)
PACE_DELAY_S = 0.01  # and a turn's state waits this long before a round, to go out as new as it gets
PACE_POLL_S = 0.002
# An answer refused because the turn left its pause (`NotAwaiting`) whose calls still read pending:
# a cancel took the turn and is writing their results (on the holder; in a cluster this server may
# read the database before that write). How long the store is read for them, first how often.
CLOSING_WAIT_S = 10.0
CLOSING_POLL_S = 0.02
# A server judged gone by its cluster closes its sockets once the turns they follow here ended
# (docs/protocol.md, close codes): 1012, as a server that stops, so clients reconnect elsewhere.
CLOSE_JUDGED_GONE = 1012
JUDGED_GONE_REASON = "server_unavailable: this server was judged gone by its cluster; reconnect to another server"


class Shown:
    """The connections shown one approval request (`approval_request`), for their
    `approval_resolved`, and the turn it belongs to: only that turn's snapshots settle it
    (`ConversationWatch.reconcile`); a snapshot of another turn never touches it."""

    __slots__ = ("turn_id", "conns")

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.conns: set[str] = set()


class ConversationWatch:
    """One conversation's subscribers and what they were shown.

    Shared state (`subscribers`, `announced`, `last`) is only ever read and written in one go, with
    no await in between: the store (PostgreSQL) suspends on every query, and whatever another task
    did meanwhile (a subscribe, a follower's round, an answer) must not be overwritten by a value
    read before the await. After an await, it is read again."""

    def __init__(self, hub: Hub, conversation_id: str) -> None:
        self.hub = hub
        self.conversation_id = conversation_id
        self.view: Watch | None = None  # the kernel's watch, once attached
        self.subscribers: dict[str, Connection] = {}
        # turn_id -> connection executing its client tools (None once it disconnected)
        self.tool_owners: dict[str, Connection | None] = {}
        self.tool_names: dict[str, set[str]] = {}
        self.followers: dict[str, tuple[TurnController, asyncio.Task[None]]] = {}
        self.announced: dict[str, Shown] = {}  # approval call_id -> who was told about it
        # approval call_id -> answers to it in flight here (reconcile leaves it to them), and the
        # newest snapshot a reconcile left it to them for (reconciled again once they are done)
        self.resolving: dict[str, int] = {}
        self.deferred: dict[str, TurnSnapshot] = {}
        self.requested: set[str] = set()  # client call ids routed (or answered) already
        self.last: dict[str, TurnSnapshot] = {}
        self.pins = 0  # answers in flight through this watch: it is not released under them

    def attach(self, view: Watch) -> None:
        """Start following the conversation's turns through the kernel's watch."""
        self.view = view
        for handle in view.handles():
            self.follow(handle)

    @property
    def active_handle(self) -> TurnHandle | None:
        return self.view.active_handle if self.view is not None else None

    @property
    def refs(self) -> int:
        return len(self.subscribers) + len(self.tool_owners) + self.pins

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
        for _, task in self.followers.values():
            task.cancel()
        self.followers.clear()

    # ------------------------------------------------------------ following turns

    def on_handle(self, handle: TurnHandle) -> None:
        self.follow(handle)

    def follow(self, handle: TurnHandle) -> None:
        current = self.followers.get(handle.turn_id)
        if current is not None:
            if current[0] is handle.controller and not current[1].done():
                return
            current[1].cancel()
        if handle.controller.status in TERMINAL_STATUSES and handle.turn_id not in self.followers:
            return  # an old settled turn: nothing to follow
        task = asyncio.get_running_loop().create_task(
            self._follow(handle.controller), name=f"ws-follow:{handle.turn_id}"
        )
        self.followers[handle.turn_id] = (handle.controller, task)

    async def _follow(self, controller: TurnController) -> None:
        seen = -1
        try:
            while True:
                snap = await controller.next_snapshot(seen)
                paced = len(self.subscribers) >= PACE_SUBSCRIBERS
                if paced and not snap.terminal:
                    # A round to many subscribers is expensive: let the turn move on for a moment
                    # and send its newest state (a short turn then goes out once, finished); a turn
                    # that ends (or stops for an answer) meanwhile goes out at once.
                    with contextlib.suppress(TimeoutError):
                        await controller.wait_settled(PACE_DELAY_S)
                    snap = controller.snapshot()
                seen = snap.revision
                await self.publish(snap)
                if snap.terminal:
                    break
                if paced:
                    await self._round_sent()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("following turn %s failed", controller.turn_id)
        finally:
            entry = self.followers.get(controller.turn_id)
            if entry is not None and entry[0] is controller:
                del self.followers[controller.turn_id]
            if controller.status in TERMINAL_STATUSES:
                self.last.pop(controller.turn_id, None)
                if controller.turn_id in self.tool_owners:
                    del self.tool_owners[controller.turn_id]
                    self.tool_names.pop(controller.turn_id, None)
                    self.hub.maybe_release(self)

    async def _round_sent(self) -> None:
        """Wait until (nearly) every subscriber took the frames queued so far, at most PACE_MAX_S.

        With a thousand subscribers one round of sends takes tens of milliseconds, and every loop
        pass spent on it is a pass the turn itself does not advance: publishing each snapshot as it
        came made every subscriber receive every snapshot, one slow round after another. Waiting for
        the round lets the turn move on, and the next round carries its newest state (latest wins)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PACE_MAX_S
        while loop.time() < deadline:
            behind = sum(1 for c in list(self.subscribers.values()) if len(c.outbound))
            if behind <= len(self.subscribers) // 100:
                return
            await asyncio.sleep(PACE_POLL_S)

    async def publish(self, snap: TurnSnapshot) -> None:
        published = self.last.get(snap.turn_id)
        if published is None or published.revision <= snap.revision:
            self.last[snap.turn_id] = snap
        text = encode({"type": "turn_updated", "snapshot": snap.to_dict()})
        frame = text_frame(text.encode())  # framed once for every subscriber that can take it now
        subscribers = list(self.subscribers.values())
        for conn in subscribers:
            conn.send_snapshot(snap.turn_id, text, frame, revision=snap.revision, final=snap.terminal)
        # Every approval request goes out with its snapshot, before any await: routing a client
        # call awaits (an answer for a client gone), and a request sent after it could be one
        # answered meanwhile.
        client_calls: list[dict[str, Any]] = []
        if snap.status == "awaiting":
            for p in snap.pending:
                if p["kind"] == "approval":
                    self.announce_to(subscribers, snap, p)
                elif p["kind"] == "client" and p["call_id"] not in self.requested:
                    self.requested.add(p["call_id"])
                    client_calls.append(p)
        for p in client_calls:
            await self.route_client_call(snap, p)
        await self.reconcile(snap)

    def shown(self, call_id: str, turn_id: str) -> set[str]:
        """The connections shown approval `call_id` (of turn `turn_id`), to add to."""
        entry = self.announced.get(call_id)
        if entry is None:
            entry = self.announced[call_id] = Shown(turn_id)
        return entry.conns

    def announce_to(self, conns: list[Connection], snap: TurnSnapshot, p: dict[str, Any]) -> None:
        """One `approval_request` for pending approval `p` to each of `conns` not shown it yet on
        this connection; `announced` remembers who was, for their `approval_resolved`. A connection
        that joins later (a submit, a re-sent duplicate after a reconnect) is shown it then."""
        told = self.shown(p["call_id"], snap.turn_id)
        request: str | None = None
        framed: bytes | None = None
        for conn in conns:
            if conn.id in told:
                continue
            if request is None:
                request = encode(approval_request(snap, p))
                framed = text_frame(request.encode())  # framed once for all of them
            told.add(conn.id)
            conn.send_encoded(request, framed)

    def catch_up(self, conn: Connection, controller: TurnController) -> None:
        """Show a connection that just became a subscriber (by a submit) what the others were shown
        of a turn: its current snapshot and pending approvals. Only what it missed: a snapshot the
        follower has not published yet reaches it there (it is a subscriber now), so no revision
        goes to it twice; a settled turn nobody follows any more is shown as it ended."""
        snap = controller.snapshot()
        published = self.last.get(controller.turn_id)
        if published is None:
            following = self.followers.get(controller.turn_id)
            if not snap.terminal or (following is not None and not following[1].done()):
                return  # its follower publishes it (to this connection too)
        elif published.revision < snap.revision:
            return  # a newer one is on its way from the follower
        # Revisions strictly rise on the connection (Connection.send_snapshot): one it was sent
        # before it left (an unsubscribe) is not sent again.
        text = encode({"type": "turn_updated", "snapshot": snap.to_dict()})
        conn.send_snapshot(snap.turn_id, text, revision=snap.revision, final=snap.terminal)
        if snap.status == "awaiting":
            for p in snap.pending:
                if p["kind"] == "approval":
                    self.announce_to([conn], snap, p)

    def begin_answer(self, ids: set[str]) -> None:
        """An answer to calls `ids` is applied from here on: reconcile leaves them to it."""
        for call_id in ids:
            self.resolving[call_id] = self.resolving.get(call_id, 0) + 1

    def end_answer(self, ids: set[str]) -> list[TurnSnapshot]:
        """The answer to calls `ids` is done. The snapshots a reconcile left those calls to it for
        (no other answer to them still in flight), to reconcile again: an answer that lost, or
        failed, settles nothing, and the turn's last snapshot may be long gone from `last`."""
        snaps: dict[str, TurnSnapshot] = {}
        for call_id in ids:
            left = self.resolving.get(call_id, 0) - 1
            if left > 0:
                self.resolving[call_id] = left
                continue
            self.resolving.pop(call_id, None)
            snap = self.deferred.pop(call_id, None)
            if snap is not None:
                seen = snaps.get(snap.turn_id)
                if seen is None or seen.revision < snap.revision:
                    snaps[snap.turn_id] = snap
        return list(snaps.values())

    def _defer(self, call_id: str, snap: TurnSnapshot) -> None:
        seen = self.deferred.get(call_id)
        if seen is None or seen.turn_id != snap.turn_id or seen.revision <= snap.revision:
            self.deferred[call_id] = snap

    async def reconcile(self, snap: TurnSnapshot) -> None:
        """Tell the connections shown an approval request of this snapshot's turn that it was
        answered elsewhere (or timed out, or the turn ended). A call of another turn is not this
        snapshot's to settle (a queued turn's snapshot says nothing of the paused turn's calls).

        The store is read before anything is taken out of `announced`, and `announced` is read
        again after that await: a connection added to a call's viewers meanwhile (a subscribe, a
        catch-up) is told with the others, and a call another task settled meanwhile (an answer
        here, another reconcile) is told once. A call an answer here is being applied to is left
        to that answer, with this snapshot (`deferred`): it tells them, or reconciles it again."""
        open_calls = {p["call_id"] for p in snap.pending} if snap.status == "awaiting" else set()
        for call_id, entry in list(self.announced.items()):
            if entry.turn_id != snap.turn_id or call_id in open_calls:
                continue
            if call_id in self.resolving:
                self._defer(call_id, snap)
                continue
            p = await self.hub.server.store.get_pending(self.conversation_id, call_id)
            if call_id in self.resolving:
                self._defer(call_id, snap)  # an answer here is being applied: Hub.approve tells them
                continue
            if p is not None and p.status == "pending" and not snap.terminal:
                continue  # still open: a snapshot older than the one that showed it
            told = self.announced.pop(call_id, None)
            if told is None:
                continue  # told meanwhile
            # No row: the conversation was deleted (with its agent) and its paused turn ended
            # without an answer, so the request those connections hold is void: cancelled (so is a
            # call its ended turn left unanswered).
            self.tell_resolved(call_id, told, p, resolved_status(p.status if p is not None else None))

    def tell_resolved(
        self, call_id: str, told: Shown, p: PendingCall | None, status: str | None, *, skip: str | None = None
    ) -> None:
        """One `approval_resolved` for call `call_id` (taken out of `announced`: `told`) to each
        connection shown it still subscribed, but `skip` (whose own answer settled it)."""
        frame = encode(
            {
                "type": "approval_resolved",
                "conversation_id": self.conversation_id,
                "turn_id": p.turn_id if p is not None else told.turn_id,
                "call_id": call_id,
                "status": status,
                "decided_by": p.decided_by if p is not None else None,
            }
        )
        for cid in told.conns:
            if cid == skip:
                continue
            conn = self.subscribers.get(cid)
            if conn is not None:
                conn.send_encoded(frame)

    async def route_client_call(self, snap: TurnSnapshot, p: dict[str, Any]) -> None:
        """Send a client call to the connection that supplied its tool. Closed as gone only when
        that owner is known to be gone: a connection of this server that disconnected, or (one
        server on its own store) a connection of the process before a restart. A call supplied by
        an HTTP request, or by a connection of another server of a cluster, is its owner's: a
        subscriber (or a submit) here never closes it."""
        owner = self.tool_owners.get(snap.turn_id)
        if owner is None and snap.turn_id not in self.tool_owners:
            if await self.left_to_its_owner(snap.turn_id):
                return  # its owner answers it (or it expires after its timeout)
        elif owner is not None and owner.alive and p["name"] in self.tool_names.get(snap.turn_id, set()):
            self.hub.client_calls[p["call_id"]] = (owner.id, self.conversation_id, p["name"])
            timeout = (
                max(0.0, (p.get("expires_at") or 0) - time.time())
                if p.get("expires_at")
                else self.hub.server.config.limits.client_tool_timeout_s
            )
            owner.send(
                {
                    "type": "tool_call_request",
                    "conversation_id": self.conversation_id,
                    "turn_id": snap.turn_id,
                    "call_id": p["call_id"],
                    "name": p["name"],
                    "arguments": p["arguments"],
                    "timeout_s": round(timeout, 3),
                }
            )
            return
        # Nobody connected executes this tool. Known here (its owner is a connection of this
        # process): the request was never sent, so the tool did not run. Not known (a restart): the
        # process before may have sent it, so the tool may have acted.
        maybe_sent = snap.turn_id not in self.tool_owners
        await self.hub.answer_gone(self.conversation_id, p["call_id"], p["name"], maybe_sent=maybe_sent)

    async def left_to_its_owner(self, turn_id: str) -> bool:
        """Whether the client calls of turn `turn_id`, whose tools no connection of this server
        supplied, stay open for their owner: an HTTP request's client (the turn's source names no
        WebSocket connection; it answers with a later request), or a WebSocket connection that may
        live on another server sharing the store (its server routes them). Only a connection of
        this server's earlier process, on a store no other server shares, is known to be gone."""
        turn = await self.hub.server.store.get_turn(turn_id)
        if turn is None:
            return True  # deleted with its conversation: nothing to close
        source = turn.source if isinstance(turn.source, dict) else {}
        if "connection" not in source:  # not submitted over the WebSocket
            return True
        return bool(getattr(self.hub.server.store, "shared", False))

    # ------------------------------------------------------------ subscribers

    def state_frame(self, conn: Connection, conversation: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        view = self.view
        assert view is not None, "a watch is attached before anyone reads it"
        handle = view.active_handle
        active = handle.controller.snapshot() if handle is not None else None
        pending = [
            p
            for p in (active.pending if active is not None and active.status == "awaiting" else ())
            if p["kind"] == "approval"
        ]
        return {
            "type": "conversation_state",
            "request_id": request_id,
            "conversation": conversation,
            "state": view.state,
            "subscribed": conn.id in self.subscribers,
            "active_turn": active.to_dict() if active is not None else None,
            "pending_approvals": [dict(p) for p in pending],
            "queued": view.queued,
        }


def resolved_status(stored: str | None) -> str:
    """A settled call's stored status as `approval_resolved` says it: a call gone from the store
    (its conversation was deleted) or left open by its ended turn is `cancelled`; one answered with
    a result (an approval resent in a fork, where it had run) was `approved`."""
    if stored is None or stored == "pending":
        return "cancelled"
    return "approved" if stored == "result" else stored


def gone_error(conversation_id: str) -> dict[str, Any]:
    """What a subscriber of a server judged gone is told of each conversation it subscribed to:
    no more of it reaches this server; subscribe through another one."""
    return {
        "type": "error",
        "request_id": None,
        "code": "server_unavailable",
        "conversation_id": conversation_id,
        "param": "conversation",
        "message": (
            f"this server was judged gone by the others of its cluster and hears nothing more of conversation "
            f"{conversation_id}: subscribe to it through another server (this one needs a restart)"
        ),
    }


def approval_request(snap: TurnSnapshot, p: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "approval_request",
        "conversation_id": snap.conversation_id,
        "turn_id": snap.turn_id,
        "call_id": p["call_id"],
        "name": p["name"],
        "arguments": p["arguments"],
        "expires_at": p.get("expires_at"),
    }


class Hub:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.watches: dict[str, ConversationWatch] = {}
        self.connections: dict[str, Connection] = {}
        self.client_calls: dict[
            str, tuple[str, str, str]
        ] = {}  # call_id -> (connection id, conversation id, tool name)
        self._lock = asyncio.Lock()
        # what all connections hold for their clients, bounded together (`[limits] ws_outbound_total_max_bytes`)
        self.outbound_budget = OutboundBudget(int(server.config.limits.ws_outbound_total_max_bytes))
        self._farewells: set[asyncio.Task[None]] = set()  # closes after followed turns (`judged_gone`)
        self._gone = False  # judged gone by its cluster: new connections are closed at once
        server.kernel.on_judged_gone(self.judged_gone)

    async def watch(self, conversation_id: str) -> ConversationWatch:
        w = self.watches.get(conversation_id)
        if w is not None:
            return w
        fresh = ConversationWatch(self, conversation_id)
        view = await self.server.kernel.open_watch(conversation_id, fresh.on_handle)
        w = self.watches.get(conversation_id)
        if w is not None:  # another caller attached one while the runtime loaded
            view.close()
            return w
        self.watches[conversation_id] = fresh
        fresh.attach(view)
        return fresh

    def maybe_release(self, w: ConversationWatch) -> None:
        if w.refs == 0 and self.watches.get(w.conversation_id) is w:
            del self.watches[w.conversation_id]
            w.close()

    # ------------------------------------------------------------ connections

    def register(self, conn: Connection) -> None:
        self.connections[conn.id] = conn
        if self._gone:  # judged gone: nothing this server could answer from would ever change again
            conn.kill(CLOSE_JUDGED_GONE, JUDGED_GONE_REASON)

    def broadcast_event(self, name: str, data: dict[str, Any]) -> int:
        """An `event` frame to every authenticated connection; returns how many were told."""
        told = 0
        text = encode({"type": "event", "name": name, "data": data})
        frame = text_frame(text.encode())
        for conn in list(self.connections.values()):
            if conn.principal is not None and conn.alive:
                conn.send_encoded(text, frame)
                told += 1
        return told

    async def subscribe(
        self, conn: Connection, conversation_id: str, conversation: dict[str, Any], request_id: str | None
    ) -> None:
        # A watch kept here (another subscriber's) is no view of the conversation once this server
        # is fenced: judged gone, it hears nothing of the turns the survivor runs.
        self.server.kernel.refuse_if_fenced()
        w = await self.watch(conversation_id)
        try:
            self.server.kernel.refuse_if_fenced()  # fenced while the runtime loaded
        except Exception:
            self.maybe_release(w)  # not kept for nobody
            raise
        w.subscribers[conn.id] = conn
        conn.subscriptions.add(conversation_id)
        # All synchronous from here: the state frame is queued before any later turn_updated.
        frame = w.state_frame(conn, conversation, request_id)
        conn.send(frame)
        # One approval_request per pending approval, also on a connection subscribed already (by an
        # earlier subscribe or a submit): a subscribe asks for the current state, prompts included.
        # Clients take a request for a call they show as the same prompt (chat, gateway).
        handle = w.active_handle
        if frame["pending_approvals"] and handle is not None:
            snap = handle.controller.snapshot()
            for p in frame["pending_approvals"]:
                w.shown(p["call_id"], snap.turn_id).add(conn.id)
                conn.send(approval_request(snap, p))

    def subscribe_now(self, conn: Connection, w: ConversationWatch) -> bool:
        """Subscribe `conn`; False when it was subscribed already."""
        if conn.id in w.subscribers:
            return False
        w.subscribers[conn.id] = conn
        conn.subscriptions.add(w.conversation_id)
        return True

    def unsubscribe(self, conn: Connection, conversation_id: str) -> bool:
        conn.subscriptions.discard(conversation_id)
        w = self.watches.get(conversation_id)
        if w is None or conn.id not in w.subscribers:
            return False
        del w.subscribers[conn.id]
        for told in w.announced.values():
            told.conns.discard(conn.id)
        self.maybe_release(w)
        return True

    # ------------------------------------------------------------ judged gone

    def judged_gone(self) -> None:
        """This server was judged gone by its cluster (the kernel's `on_judged_gone`): nothing
        more of its conversations reaches it, so every connection is told. A subscription with no
        turn still followed here gets `server_unavailable` at once and ends; the turns still
        followed deliver their end (read from the store), then the connection is closed
        (CLOSE_JUDGED_GONE) after a `server_unavailable` for each subscription left."""
        self._gone = True
        loop = asyncio.get_running_loop()
        for conn in list(self.connections.values()):
            if not conn.alive:
                continue
            following: list[asyncio.Task[None]] = []
            for conversation_id in sorted(conn.subscriptions):
                tasks = self._followed(conversation_id)
                if tasks:
                    following.extend(tasks)
                else:
                    conn.send(gone_error(conversation_id))
                    self.unsubscribe(conn, conversation_id)
            task = loop.create_task(self._farewell(conn, following), name=f"ws-gone:{conn.id}")
            self._farewells.add(task)
            task.add_done_callback(self._farewells.discard)

    def _followed(self, conversation_id: str) -> list[asyncio.Task[None]]:
        """The follower tasks of the conversation's turns still live here (mirrors now)."""
        w = self.watches.get(conversation_id)
        if w is None:
            return []
        return [task for _, task in w.followers.values() if not task.done()]

    async def _farewell(self, conn: Connection, following: list[asyncio.Task[None]]) -> None:
        """Close `conn` once the turns it followed here delivered their end."""
        if following:
            await asyncio.wait(following)
        if not conn.alive:
            return
        for conversation_id in sorted(conn.subscriptions):
            conn.send(gone_error(conversation_id))
        conn.kill(CLOSE_JUDGED_GONE, JUDGED_GONE_REASON, flush=True)

    async def disconnect(self, conn: Connection) -> None:
        """A disconnect never cancels a turn; its client tool calls get a readable error."""
        self.connections.pop(conn.id, None)
        for cid in list(conn.subscriptions):
            self.unsubscribe(conn, cid)
        for w in list(self.watches.values()):
            for turn_id, owner in list(w.tool_owners.items()):
                if owner is conn:
                    w.tool_owners[turn_id] = None
        for call_id, (owner_id, conv_id, name) in list(self.client_calls.items()):
            # read again: an await of an earlier call lets others change the routes
            if owner_id == conn.id and self.client_calls.get(call_id, (None,))[0] == conn.id:
                del self.client_calls[call_id]
                await self.answer_gone(conv_id, call_id, name)

    async def answer_gone(self, conversation_id: str, call_id: str, name: str, *, maybe_sent: bool = True) -> None:
        """Close client call `call_id` whose client is gone, with an error result the model reads.
        `maybe_sent`: its tool_call_request may have reached the client (the tool may have acted);
        False when it was never sent to anyone (the client left before the call was made): the tool
        certainly did not run, and the model must not be told to check whether it did."""
        if maybe_sent:
            text = (
                f"The client that runs the tool {name} disconnected before returning a result, so the outcome"
                " is unknown: the tool may have acted before the client disconnected. Check whether it did"
                " before retrying the call."
            )
        else:
            text = (
                f"The tool {name} was not executed: the client that supplies it is gone (it left before this"
                " call was made), so the call was never sent to it and the tool did not run."
            )
        try:
            await self.server.kernel.respond(
                conversation_id, [Decision(call_id, "result", output=text, is_error=True, decided_by="server")]
            )
        except Exception as exc:  # already answered, timed out or the turn was cancelled
            log.debug("could not close client call %s: %r", call_id, exc)

    # ------------------------------------------------------------ turns started here

    async def adopt_submission(
        self, conn: Connection, conversation_id: str, handle: TurnHandle, tool_names: set[str], duplicate: bool
    ) -> None:
        """Subscribe the submitting connection (after its ack) and show it the turn. A connection
        that was not subscribed yet missed what was published before (a duplicate re-sent after a
        reconnect while another connection watches; a turn that ran before the ack): it gets the
        turn's current snapshot and an approval_request per pending approval, whatever other
        connections watch. A settled turn is shown as it ended."""
        w = await self.watch(conversation_id)
        joined = self.subscribe_now(conn, w)
        if tool_names and not duplicate:
            w.tool_owners[handle.turn_id] = conn
            w.tool_names[handle.turn_id] = set(tool_names)
        w.follow(handle)
        if joined:
            w.catch_up(conn, handle.controller)
            active = w.active_handle
            if active is not None and active.turn_id != handle.turn_id:
                w.catch_up(conn, active.controller)  # the turn ahead of it: a pending approval holds both
        elif handle.controller.status in TERMINAL_STATUSES and handle.turn_id not in w.followers:
            snap = handle.controller.snapshot()  # a duplicate of a finished turn: show its result
            text = encode({"type": "turn_updated", "snapshot": snap.to_dict()})
            conn.send_snapshot(snap.turn_id, text, revision=snap.revision, final=True)

    # ------------------------------------------------------------ answers

    async def approve(self, conn: Connection, conversation_id: str, decisions: list[Decision]) -> list[dict[str, Any]]:
        w = await self.watch(conversation_id)
        w.pins += 1  # not released (its `resolving`, `announced` dropped) while the answer is applied
        try:
            return await self._approve(w, conn, conversation_id, decisions)
        finally:
            w.pins -= 1
            self.maybe_release(w)

    async def _approve(
        self, w: ConversationWatch, conn: Connection, conversation_id: str, decisions: list[Decision]
    ) -> list[dict[str, Any]]:
        ids = {d.call_id for d in decisions}
        w.begin_answer(ids)
        results: list[dict[str, Any]] | None = None
        try:
            results = await self._answer(conversation_id, decisions)
        finally:
            deferred = w.end_answer(ids)
            # Who was shown each call this answer found settled, taken at once (before any await
            # lets a reconcile tell them too): they, and only they, get approval_resolved, except
            # the one whose answer won (its ack says it). An answer that lost (another answer or a
            # cancel settled the call first, on whichever server) settled nothing for its sender:
            # it is told too.
            settled: list[tuple[dict[str, Any], Shown]] = []
            for r in results or ():
                if r.get("accepted") is not True and r.get("error") != "already_resolved":
                    continue  # unknown here, or still open
                entry = w.announced.pop(r["call_id"], None)
                if entry is not None:
                    settled.append((r, entry))
            try:
                for r, entry in settled:
                    p = await self.server.store.get_pending(conversation_id, r["call_id"])
                    if r.get("accepted") is True:
                        w.tell_resolved(r["call_id"], entry, p, r.get("status"), skip=conn.id)
                    else:
                        status = resolved_status(p.status if p is not None else r.get("status"))
                        w.tell_resolved(r["call_id"], entry, p, status)
                # What a reconcile left to this answer (the turn may have ended meanwhile: its last
                # snapshot is gone from `last`), and the turns followed here.
                for snap in [*deferred, *list(w.last.values())]:
                    await w.reconcile(snap)
            except Exception:
                if results is not None:
                    raise
                log.exception("telling the viewers of calls %s failed", sorted(ids))  # the answer's error wins
        return results

    async def _answer(self, conversation_id: str, decisions: list[Decision]) -> list[dict[str, Any]]:
        """The kernel's results for an answer; when its turn already left the pause (`NotAwaiting`),
        one `already_resolved` per call answered meanwhile. A call that still reads pending is being
        closed by a cancel, which took the turn at once and writes its calls' results right after
        (on the server holding the conversation: this one may read the database first): its result
        is waited for, up to CLOSING_WAIT_S. A call with no row, one its ended turn left open, or one
        still open then: `NotAwaiting`."""
        try:
            return await self.server.kernel.respond(conversation_id, decisions)
        except NotAwaiting as refused:
            store = self.server.store
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CLOSING_WAIT_S
            results: list[dict[str, Any]] = []
            for call_id in dict.fromkeys(d.call_id for d in decisions):
                pause = CLOSING_POLL_S
                while True:
                    p = await store.get_pending(conversation_id, call_id)
                    if p is None:
                        raise refused from None
                    if p.status != "pending":
                        break
                    turn = await store.get_turn(p.turn_id)
                    if turn is None or turn.status in TERMINAL_STATUSES or loop.time() >= deadline:
                        raise refused from None  # nothing is closing it
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 0.25)
                results.append(
                    {
                        "call_id": call_id,
                        "accepted": False,
                        "error": "already_resolved",
                        "status": p.status,
                        "message": f"call {clipped(call_id)} was already answered ({p.status})",
                    }
                )
            return results

    async def tool_result(self, conn: Connection, call_id: str, output: str, is_error: bool) -> list[dict[str, Any]]:
        routed = self.client_calls.get(call_id)
        if routed is None or routed[0] != conn.id:
            return [
                {
                    "call_id": call_id,
                    "accepted": False,
                    "error": "unknown_call",
                    "message": f"no tool call {clipped(call_id)} is waiting for this connection",
                }
            ]
        del self.client_calls[call_id]
        gone = [
            {
                "call_id": call_id,
                "accepted": False,
                "error": "unknown_call",
                "message": (
                    f"tool call {clipped(call_id)} is no longer waiting for a result: "
                    "it timed out or its turn ended or was cancelled"
                ),
            }
        ]
        try:
            results = await self.server.kernel.respond(
                routed[1], [Decision(call_id, "result", output=output, is_error=is_error, decided_by=conn.id)]
            )
        except NotAwaiting:  # the turn moved on (the call timed out, the turn was cancelled)
            return gone
        if results and results[0].get("error") == "already_resolved":  # timed out, another call still open
            return gone
        return results
