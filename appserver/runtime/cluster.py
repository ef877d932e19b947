"""The kernel's side of a cluster (several servers on one PostgreSQL database, docs/scale-out.md).

A conversation's runtime lives in the one server holding its lease (`Cluster.take`). Here:

- **Elsewhere:** what this server does for a conversation another server holds. An input is
  accepted into the store as a `queued` turn and the holder is told to pull it (`pull`); answers
  to pending calls and cancels are calls to the holder (`respond`, `cancel`), which runs them on
  its runtime. Nothing is forwarded that the store does not already hold.
- **Live views:** the holder publishes the newest snapshot of each turn of a conversation another
  server follows (`Cluster.publish_turn`, latest wins, at most every `PUBLISH_EVERY_S` while it
  runs, at once when it settles, always after its commit); here a *mirror* — a `TurnController`
  that only follows (`mirror`) — stands for each turn someone follows, so a submitter, an SSE
  stream or a WebSocket subscriber on this server sees the turn as if it ran here. A server says
  which conversations it follows (`follow`, renewed every `FOLLOW_EVERY_S`; a `pull` counts), so
  turns nobody elsewhere follows cost nothing. A mirror that heard nothing for a while reads the
  store.
- **Failover:** a sweep takes the conversations whose holder is gone and runs what they left
  (`Kernel.catch_up`), and pulls turns queued here that no notification announced; the turns
  holding a credential's open-turn place move their count along (`Kernel.review_counts`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

from appserver import errors
from appserver.config import Config
from appserver.ids import new_id
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.restore import controller_from_store
from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.runtime.types import TERMINAL_STATUSES, LifecycleState
from appserver.runtime.watch import Watch
from appserver.store.base import OpenLimitReached, Store, StoreUnavailable
from appserver.store.cluster import CALL_TIMEOUT_S, Cluster, ClusterError, PeerError
from appserver.store.records import TurnRecord, TurnSettings

log = logging.getLogger("appserver.cluster")

PUBLISH_EVERY_S = 0.05  # a running turn's snapshots go to the others at most this often
STALE_S = 2.0  # a mirror that heard nothing this long reads the turn from the store
SWEEP_S = 1.0
PULL_AFTER_S = 2.0  # a turn queued this long at a conversation held here is pulled from the store
ENDED_REMEMBERED = 4096  # ended turns whose repeated notices are ignored
MOVED_HOPS = 3  # a pull is passed on to a conversation's new holder at most this many times
HOLDER_CHECK_S = 0.5  # a call to a holder looks this often whether it is still alive
MOVED_WAIT_S = 45.0  # how long an answer follows a conversation that moves or whose holder died
FOLLOW_EVERY_S = 5.0  # a follower renews its interest this often
FOLLOW_ASK_S = 2.0  # a new watch waits this long at most for the holder to hear it is followed
FOLLOW_TTL_S = 15.0  # and the holder forgets an interest not renewed for this long
ANSWERS_REMEMBERED = 4096  # calls settled here by an answer passed on, with that answer's key
ANSWERED_ASK_S = 2.0  # how long an answer waits for a holder to say which answer settled a call


class KernelSide(Protocol):
    """What the link uses of the kernel (the kernel hands itself in; no import back)."""

    store: Store
    config: Config

    @property
    def stopping(self) -> bool: ...

    def holds(self, conversation_id: str) -> bool: ...

    def live_handles(self, conversation_id: str) -> list[TurnHandle]: ...

    def active_turn(self, conversation_id: str) -> str | None: ...

    async def catch_up(self, conversation_id: str) -> None: ...

    async def review_counts(self) -> None: ...

    async def respond(
        self,
        conversation_id: str,
        decisions: list[Decision],
        *,
        here: bool = False,
        whole: bool = False,
        settings: TurnSettings | None = None,
    ) -> list[dict[str, Any]]: ...

    async def cancel(
        self, conversation_id: str, turn_id: str | None = None, *, here: bool = False, client_left: bool = False
    ) -> bool: ...


class OutcomeUnknown(errors.KernelError):
    """A request passed on to the server holding the conversation (an answer to a pending call, a
    cancel) got no reply in time while that server still lives: it is still passed on (to that
    server, or to whoever takes the conversation over if it is judged gone), and run once.
    Sent again, an answer finds its call `already_resolved` if it was applied meanwhile."""

    code = "outcome_unknown"
    http_status = 504


_WHAT = {"respond": "answer", "cancel": "cancel"}
_SETTLED = {"approve": "approved", "deny": "denied", "result": "result"}  # a decision as its call stores it


class _Passing:
    """A request (an answer, a cancel) being passed on to a conversation's holder: to whom now,
    under which key (the holder runs a key once), and each (holder, key) a copy went out to."""

    __slots__ = ("holder", "key", "sent")

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.key = new_id("ans")
        self.sent: set[tuple[str, str]] = set()

    def went(self) -> None:
        self.sent.add((self.holder, self.key))

    def earlier(self, *, here: bool) -> bool:
        """May a run other than the current one have applied it: a copy that went out to another
        holder or under another key (`here`: the current run is this server's own, so any copy)?"""
        return any(here or sent != (self.holder, self.key) for sent in self.sent)

    def keys(self) -> set[str]:
        """Every key it was run under: its runs' own, whatever another answer was run under."""
        return {key for _, key in self.sent} | {self.key}


def _accepted(d: dict[str, Any]) -> dict[str, Any]:
    status = "approved" if d.get("action") == "approve" else _SETTLED.get(str(d.get("action")))
    return {"call_id": d.get("call_id"), "accepted": True, "status": status}


class OwnedElsewhere(Exception):
    """The conversation's runtime lives in another live server of the cluster."""

    def __init__(self, conversation_id: str, holder: str) -> None:
        super().__init__(f"conversation {conversation_id} is held by instance {holder}")
        self.conversation_id = conversation_id
        self.holder = holder


class _Mirror:
    """A turn another server runs, as followed here. `started`: it left the queue (it runs or
    waits for answers there). A snapshot alone does not always say so: one rebuilt from the store
    shows a running turn in phase `queued`, as does the holder's first snapshot of a turn it
    begins (queue position 0, before its first step).

    `after`: the turn let go unsaved just before it in its conversation (`follow_elsewhere`); while
    that one's mirror has not ended, this one's end is `held` (its clients hear the ends in the
    conversation's order, as from a runtime: `ClusterLink._end`)."""

    __slots__ = ("handle", "heard_at", "started", "after", "held", "unsaved")

    def __init__(self, handle: TurnHandle, *, started: bool | None = None, after: str | None = None) -> None:
        self.handle = handle
        self.heard_at = time.monotonic()
        self.started = _started(handle.controller.snapshot()) if started is None else started
        self.after = after
        self.held: TurnSnapshot | None = None
        self.unsaved = False  # let go unsaved while cut off (`follow_elsewhere`)


def _started(snap: TurnSnapshot) -> bool:
    """Does this snapshot (of the holder) show the turn begun: out of phase `queued`, paused or
    ended, or at queue position 0 (the holder numbers a turn waiting behind another from 1, and
    shows 0 only for one it begins now)?"""
    return snap.status != "running" or snap.phase != "queued" or snap.queue_position == 0


class RemoteWatch(Watch):
    """A `Watch` of a conversation another server runs: its turns as mirrors."""

    def __init__(self, link: ClusterLink, conversation_id: str, on_turn: Callable[[TurnHandle], None]) -> None:
        self._link = link
        self._conversation_id = conversation_id
        self._on_turn = on_turn
        self._open = True
        link.watchers.setdefault(conversation_id, []).append(on_turn)

    @property
    def conversation_id(self) -> str:
        return self._conversation_id

    def _mine(self) -> list[TurnHandle]:
        """The conversation's turns this server knows: mirrors, and (once this server took the
        conversation over) the live ones of its runtime here."""
        return [h for h, _ in self._turns()]

    def _turns(self) -> list[tuple[TurnHandle, bool]]:
        """Each turn of `_mine` with whether it left the queue (it runs, or waits for answers):
        what the holder's lifecycle knows, so every server shows the same state and active turn."""
        cid = self._conversation_id
        link = self._link
        local: list[tuple[TurnHandle, bool]] = []
        if link.kernel.holds(cid):
            active = link.kernel.active_turn(cid)
            # a turn mirrored here before this server took the conversation is shown by its
            # mirror, which follows the handle here from then on (`ClusterLink.hand_over`)
            local = [(link.handed.get(h.turn_id, h), h.turn_id == active) for h in link.kernel.live_handles(cid)]
        ids = {h.turn_id for h, _ in local}
        mirrored = [
            (m.handle, m.started)
            for m in link.mirrors.values()
            if m.handle.conversation_id == cid and m.handle.turn_id not in ids  # one turn, counted once
        ]
        return [*mirrored, *local]

    @property
    def state(self) -> LifecycleState:
        active = self.active_handle
        if active is None:
            return "idle"
        return "awaiting" if active.controller.status == "awaiting" else "active"

    @property
    def active_handle(self) -> TurnHandle | None:
        for h, started in self._turns():
            c = h.controller
            if c.status == "awaiting" or (c.status == "running" and started):
                return h
        return None

    @property
    def queued(self) -> int:
        return sum(1 for h, started in self._turns() if h.controller.status == "running" and not started)

    def handles(self) -> list[TurnHandle]:
        return self._mine()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        callbacks = self._link.watchers.get(self._conversation_id, [])
        if self._on_turn in callbacks:
            callbacks.remove(self._on_turn)
        if not callbacks:
            self._link.watchers.pop(self._conversation_id, None)


class ClusterLink:
    def __init__(self, kernel: KernelSide, cluster: Cluster) -> None:
        self.kernel = kernel
        self.cluster = cluster
        self.mirrors: dict[str, _Mirror] = {}
        # turn id -> the mirror of a turn this server took over, following its handle here
        self.handed: dict[str, TurnHandle] = {}
        self.watchers: dict[str, list[Callable[[TurnHandle], None]]] = {}
        self._sent: dict[str, int] = {}  # turn id -> the newest revision published
        self._followed: dict[str, float] = {}  # conversation id -> until when another server follows it
        self._told: dict[str, float] = {}  # conversation id -> when this server last said it follows
        self._publishers: dict[str, asyncio.Task[None]] = {}
        # turns whose end was applied here lately: a repeated notice of it is no new turn
        self._ended: OrderedDict[str, None] = OrderedDict()
        # (conversation id, call id) -> the key of the answer passed on that settled the call here
        self._answer_keys: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        cluster.handle(self.on_message, self.on_notice)
        cluster.on_more_peers = self._more_peers

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="cluster-sweep")

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in [*self._publishers.values(), *self._tasks]:
            task.cancel()

    # ------------------------------------------------------------ publishing (the holder)

    def followed(self, conversation_id: str) -> bool:
        until = self._followed.get(conversation_id)
        if until is None:
            return False
        if until < time.monotonic():
            del self._followed[conversation_id]
            return False
        return True

    def _mark_followed(self, conversation_id: str) -> None:
        """Another server follows the conversation (it said so: a follow, a pull, a renewal, or
        the database's `conversation_followers`). Its turns running here are published from now
        on, whatever this server's count of peers says: that is renewed only at its heartbeat, and
        a server that joined since follows before it is counted (a publisher not started then
        was never started, and its stream heard nothing until the turn ended)."""
        self._followed[conversation_id] = time.monotonic() + FOLLOW_TTL_S
        for handle in self.kernel.live_handles(conversation_id):
            self._start_publishing(handle)

    def on_local_turn(self, handle: TurnHandle) -> None:
        """A turn became visible in a runtime held here: tell the watches opened here while
        another server held the conversation, and publish its snapshots while it runs when
        another server follows the conversation. A turn mirrored here until now (this server took
        the conversation over) is shown by its mirror, which follows this handle from now on."""
        self.hand_over(handle)
        if handle.conversation_id in self.watchers:
            self._tell(self.handed.get(handle.turn_id, handle))
        self._start_publishing(handle)

    def adopt(self, conversation_id: str) -> None:
        """This server now holds the conversation (it took it over, or loaded it): each mirror of a
        turn its runtime here shows follows that turn's handle here (`hand_over`)."""
        for handle in self.kernel.live_handles(conversation_id):
            self.hand_over(handle)

    def hand_over(self, handle: TurnHandle) -> None:
        """The turn a mirror here stands for runs (or waits) in this server's runtime now. The
        clients that hold the mirror (a submitter, an HTTP stream, WebSocket watchers) keep it:
        from now on it takes every snapshot of `handle`, renumbered never to go back a revision,
        and it leaves `mirrors` (no store reads, no count twice). Before, it heard nothing more
        until the turn's end, and its stream got the whole reply in one piece at the end."""
        mirror = self.mirrors.get(handle.turn_id)
        if mirror is None or mirror.handle.controller is handle.controller:
            return  # (a handle of a runtime dropped here is itself the mirror: `follow_elsewhere`)
        del self.mirrors[handle.turn_id]
        self.handed[handle.turn_id] = mirror.handle
        self._spawn(self._forward(handle, mirror.handle))

    async def _forward(self, source: TurnHandle, target: TurnHandle) -> None:
        try:
            controller = target.controller
            seen = -1
            while controller.status not in TERMINAL_STATUSES:
                snap = await source.controller.next_snapshot(seen)
                seen = snap.revision
                controller.mirror(replace(snap, revision=max(snap.revision, controller.revision + 1)))
        finally:
            if self.handed.get(source.turn_id) is target:
                del self.handed[source.turn_id]

    def _start_publishing(self, handle: TurnHandle) -> None:
        """Publish the turn's snapshots while it runs, if another server follows its conversation
        and nothing publishes them yet."""
        if handle.turn_id in self._publishers or not self.followed(handle.conversation_id):
            return
        if handle.controller.status in TERMINAL_STATUSES:
            return
        turn_id = handle.turn_id
        task = asyncio.get_running_loop().create_task(self._publish(handle.controller), name="cluster-publish")
        self._publishers[turn_id] = task

        def done(_: asyncio.Task[None]) -> None:
            if self._publishers.get(turn_id) is task:
                del self._publishers[turn_id]

        task.add_done_callback(done)

    async def _publish(self, controller: TurnController) -> None:
        seen = -1
        while True:
            snap = await controller.next_snapshot(seen)
            seen = snap.revision
            self.publish(snap)
            if snap.settled:
                return  # settled snapshots go out from `settled` (after the commit)
            await asyncio.sleep(PUBLISH_EVERY_S)

    def settled(self, snapshot: TurnSnapshot) -> None:
        """Every settled turn (segment) of this server, committed: its snapshot goes out now, and
        to a mirror here of a turn another server ran (this one took the conversation over and
        closed the turn: its watchers here hear the end now, not when the mirror goes stale)."""
        mirror = self.mirrors.get(snapshot.turn_id)
        if mirror is not None:
            self._take(mirror, snapshot)
        self.publish(snapshot)

    def publish(self, snap: TurnSnapshot) -> None:
        if self._sent.get(snap.turn_id, -1) >= snap.revision:
            return
        if not self.followed(snap.conversation_id):
            return
        if snap.terminal:
            self._sent.pop(snap.turn_id, None)
        else:
            self._sent[snap.turn_id] = snap.revision
        body = json.dumps(snap.to_dict(), separators=(",", ":"))
        self.cluster.publish_turn(snap.conversation_id, snap.turn_id, snap.revision, body)

    # ------------------------------------------------------------ following (everyone else)

    def on_notice(self, conversation_id: str, turn_id: str, revision: int, body: str) -> None:
        if turn_id in self._ended:
            return  # its end was heard already (the same snapshot twice: no second end)
        mirror = self.mirrors.get(turn_id)
        if mirror is None and conversation_id not in self.watchers:
            return
        if mirror is not None and revision <= mirror.handle.controller.revision:
            mirror.heard_at = time.monotonic()
            # An older revision is stale, unless it is the turn's end: a survivor that closed the
            # turn of a killed server numbers it from the store, below what the runner published.
            if not (body.startswith("@") or any(f'"status":"{s}"' in body for s in TERMINAL_STATUSES)):
                return
        if body.startswith("@"):
            self._spawn(self._fetch_and_apply(body))
            return
        self._apply(json.loads(body))

    async def _fetch_and_apply(self, ref: str) -> None:
        self._apply(json.loads(await self.cluster.read_mail(ref)))

    def _apply(self, data: dict[str, Any]) -> None:
        snap = TurnSnapshot.from_dict(data)
        mirror = self.mirrors.get(snap.turn_id)
        if mirror is None:
            if self.kernel.holds(snap.conversation_id):
                return  # our own turn, heard back
            controller = TurnController(snap.turn_id, snap.conversation_id, snap.agent_id)
            mirror = self._track(TurnHandle(snap.turn_id, snap.conversation_id, controller), started=_started(snap))
            self._take(mirror, snap)
            self._tell(mirror.handle)
        else:
            self._take(mirror, snap)

    def _take(self, mirror: _Mirror, snap: TurnSnapshot) -> None:
        mirror.heard_at = time.monotonic()
        if snap.terminal:
            self._end(mirror, snap)
            return
        if mirror.handle.controller.mirror(snap) and _started(snap):
            mirror.started = True

    def _end(self, mirror: _Mirror, snap: TurnSnapshot) -> None:
        """Publish a mirror's end, unless the turn let go before it (`_Mirror.after`) has not
        ended here yet: then it is held, and that turn is read from the store at once (its end is
        there first: the store orders a conversation's turns), and published after it."""
        earlier = self.mirrors.get(mirror.after) if mirror.after is not None else None
        if earlier is not None:
            mirror.held = snap
            self._spawn(self._read_now(earlier))
            return
        mirror.held = None
        controller = mirror.handle.controller
        controller.mirror(replace(snap, revision=max(snap.revision, controller.revision + 1)))
        turn_id = snap.turn_id
        self._drop(turn_id)
        self._ended[turn_id] = None
        if len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def _drop(self, turn_id: str) -> None:
        """Forget a mirror; publish the end a later one held for it (`_end`)."""
        self.mirrors.pop(turn_id, None)
        for later in [m for m in self.mirrors.values() if m.after == turn_id]:
            later.after = None
            if later.held is not None:
                self._end(later, later.held)

    async def _read_now(self, mirror: _Mirror) -> None:
        try:
            mirror.heard_at = time.monotonic()
            await self._refresh(mirror.handle.turn_id, mirror)
        except StoreUnavailable as exc:  # read again by the sweep
            log.info("turn %s could not be read: %s", mirror.handle.turn_id, exc)

    def _track(self, handle: TurnHandle, *, started: bool | None = None) -> _Mirror:
        mirror = self.mirrors.get(handle.turn_id)
        if mirror is None:
            mirror = self.mirrors[handle.turn_id] = _Mirror(handle, started=started)
            self._follow_soon(handle.conversation_id)
        elif started:
            mirror.started = True
        return mirror

    def follow_elsewhere(self, handle: TurnHandle, after: str | None = None) -> None:
        """A turn of a runtime this server had to drop (it was judged gone, and its conversations
        were taken over), or to let go of (cut off from its cluster, it could not write the turn:
        `Kernel._cut_off`): from now on its handle follows the turn as a mirror, which reads the
        turn from the store (the sweep, every `STALE_S`) until it has ended, so the clients here
        hear how it really ended on the server that took it over. The handle's controller must
        no longer be driven by a runtime. `after`: the turn let go just before it in its
        conversation, whose end its clients hear first (`_end`)."""
        if handle.controller.status in TERMINAL_STATUSES or handle.turn_id in self.mirrors:
            return
        mirror = self.mirrors[handle.turn_id] = _Mirror(handle, after=after)
        mirror.unsaved = True
        mirror.heard_at = 0.0  # read at the next sweep

    async def read_unsaved(self, conversation_id: str) -> None:
        """Read the turns of the conversation let go unsaved here (`follow_elsewhere`) from the
        store now, in their order: this server, back and holding it, is about to queue its turns
        again (`Kernel._take_over`), and an end the store already holds (written by the store's
        repair once back) is heard before the turns after it run, not at the next sweep."""
        for turn_id, mirror in list(self.mirrors.items()):
            if mirror.unsaved and mirror.handle.conversation_id == conversation_id and mirror.held is None:
                mirror.heard_at = time.monotonic()
                await self._refresh(turn_id, mirror)

    def give_up_reading(self, handle: TurnHandle, after_s: float | None = None) -> None:
        """A turn let go unsaved while cut off (`Kernel._cut_off`), followed in the store: if its
        end has not been read `Cluster.unread_in` from now and this server is still cut off, a
        request waiting for it is told the end could not be read (`TurnHandle.give_up_reading`:
        http 503 `store_unavailable`, retried with its key on another server), never left waiting
        as long as the cut lasts. Back meanwhile, the mirror reads the end within a few seconds
        (a turn run elsewhere takes as long as it runs): looked at again a read wait later.
        WebSocket subscribers keep following the mirror (they may unsubscribe)."""
        delay = self.cluster.unread_in if after_s is None else after_s

        def due() -> None:
            if handle.controller.status in TERMINAL_STATUSES or handle.unreadable:
                return
            if self.cluster.cut_off:
                log.warning("turn %s: its end could not be read from the database in time", handle.turn_id)
                handle.give_up_reading()
                return
            self.give_up_reading(handle, self.cluster.read_wait_s)

        asyncio.get_running_loop().call_later(delay, due)

    def _follow_soon(self, conversation_id: str) -> None:
        """Tell the holder at once that this server follows the conversation (the sweep renews it)."""
        if conversation_id not in self._told:
            self._told[conversation_id] = time.monotonic()
            self._spawn(self._say_following([conversation_id]))

    async def _say_following(self, conversation_ids: list[str], *, answered: bool = False) -> None:
        """Tell the holders; `answered`: wait (FOLLOW_ASK_S at most) for each to answer, so it
        publishes the conversation's turns from then on (a holder that does not answer in time is
        told again by the sweep, as before)."""
        await self.cluster.note_following(conversation_ids, FOLLOW_TTL_S)
        for conversation_id, holder in (await self.cluster.holders(conversation_ids)).items():
            if holder == self.cluster.instance_id:
                continue
            if not answered:
                await self.cluster.send(holder, "follow", {"conversation": conversation_id})
                continue
            try:
                await self.cluster.call(holder, "follow", {"conversation": conversation_id}, timeout=FOLLOW_ASK_S)
            except (ClusterError, PeerError) as exc:
                log.info("instance %s did not answer that %s is followed here: %s", holder, conversation_id, exc)

    def _following(self) -> set[str]:
        return {m.handle.conversation_id for m in self.mirrors.values()} | set(self.watchers)

    def _tell(self, handle: TurnHandle) -> None:
        for callback in list(self.watchers.get(handle.conversation_id, ())):
            try:
                callback(handle)
            except Exception:
                log.exception("turn watcher failed")

    async def mirror(self, turn: TurnRecord) -> TurnHandle:
        """A following handle for a turn another server runs, seeded from the store."""
        known = self.mirrors.get(turn.id)
        if known is not None:
            return known.handle
        store = self.kernel.store
        fresh = await store.get_turn(turn.id) or turn
        controller = await controller_from_store(store, fresh, await store.list_pending(fresh.id), follower=True)
        known = self.mirrors.get(turn.id)  # another caller made it meanwhile
        if known is not None:
            return known.handle
        handle = TurnHandle(fresh.id, fresh.conversation_id, controller)
        if controller.status not in TERMINAL_STATUSES:
            # rebuilt from the store, a running turn shows phase `queued`: the stored status says it began
            self._track(handle, started=fresh.status != "queued")
        return handle

    async def watch(self, conversation_id: str, on_turn: Callable[[TurnHandle], None]) -> RemoteWatch:
        """Follow a conversation another server holds. The holder is told, and has answered,
        before this returns: told in the background, a turn it began right after (a subscriber's
        next input) could end before it knew of this server, and was never published here."""
        view = RemoteWatch(self, conversation_id, on_turn)
        if conversation_id not in self._told:
            self._told[conversation_id] = time.monotonic()
            await self._say_following([conversation_id], answered=True)
        for turn in await self.kernel.store.list_turns(conversation_id, statuses=("queued", "running", "awaiting")):
            await self.mirror(turn)
        return view

    # ------------------------------------------------------------ work for a conversation held elsewhere

    async def submit(self, record: TurnRecord, scope: str | None, holder: str) -> tuple[TurnHandle, int]:
        """Accept an input for a conversation `holder` runs: queued in the store, then pulled."""
        limit = self.kernel.config.limits.queue_max
        record.status = "queued"
        record.owner = None
        accept = getattr(self.kernel.store, "accept_in_cluster", None)
        if accept is None:
            raise errors.KernelError("this store cannot accept inputs for a conversation another server runs")
        try:
            earlier = await accept(record, scope, limit + 1)  # raises DuplicateTurn
        except OpenLimitReached as full:
            raise errors.QueueFull(
                f"conversation {record.conversation_id} has {full.open_turns - 1} inputs queued (limit {limit}); "
                "try again later"
            ) from None
        # Its queue position, as the holder numbers it: the turns it waits behind (the one running
        # or paused there, the queued ones accepted before it); 0 when the conversation is idle.
        waiting = len(earlier)
        controller = TurnController(
            record.id, record.conversation_id, record.agent_id, phase="queued", queue_position=waiting
        )
        handle = TurnHandle(record.id, record.conversation_id, controller)
        self._track(handle, started=False)  # not begun until the holder pulls it, whatever its position
        self._tell(handle)
        try:
            await self.cluster.send(holder, "pull", {"conversation": record.conversation_id, "hops": 0})
        except Exception as exc:  # the sweep of the holder (or of whoever takes over) pulls it
            log.warning("could not tell instance %s of a queued turn: %s", holder, exc)
        return handle, waiting

    async def call_holder(self, conversation_id: str, holder: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run `op` on the server holding the conversation, following it when it moved (to
        another server, or here); when the holder is gone, this server takes the conversation
        and runs it here, unless yet another server took it first, which is then asked.

        The caller waits CALL_TIMEOUT_S for the outcome while the holder lives (up to
        MOVED_WAIT_S while the conversation is being taken over), then gets OutcomeUnknown; the
        request is still passed on in the background, to the holder or, once it is judged gone,
        to whoever takes the conversation over (this server included), until it is run: a client
        told not to send it again never waits in vain. Every copy carries one key, which the
        holder runs once."""
        passing = _Passing(holder)
        task = asyncio.ensure_future(self._deliver(conversation_id, passing, op, args))
        began = time.monotonic()
        try:
            wait = CALL_TIMEOUT_S
            while True:
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                if time.monotonic() - began >= MOVED_WAIT_S or await self._lives(passing.holder):
                    break
                wait = HOLDER_CHECK_S  # its holder is gone: the conversation is being taken over
        except BaseException:
            task.cancel()
            raise
        self._spawn(self._finish_later(task, conversation_id, op))
        raise OutcomeUnknown(
            f"the server running conversation {conversation_id} did not answer within {CALL_TIMEOUT_S:.0f} s; "
            f"this {_WHAT.get(op, op)} is still being passed on to it (or to the server that takes the "
            "conversation over if it is gone), which applies it once: do not send it again, follow the "
            "conversation (subscribe) for the outcome"
        )

    async def _lives(self, holder: str) -> bool:
        """Is `holder` alive (its session holds its lock)? A database that cannot say: as if it were."""
        try:
            return await self.cluster.owner_alive(holder, strict=True)
        except Exception:
            return True

    async def _deliver(self, conversation_id: str, passing: _Passing, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """`call_holder`'s work: until the request is run, or refused, by the holder of the day.
        Once a copy went out, the database's failures are waited out, not raised: that copy may
        be run, and the outcome the client is told must be the one that holds."""
        deadline = time.monotonic() + self.cluster.instance_timeout_s + MOVED_WAIT_S
        while time.monotonic() < deadline:
            try:
                try:
                    got = await self._call_while_alive(passing, op, {"conversation": conversation_id, **args})
                    return await self._own_answers(conversation_id, op, args, got, passing, here=False)
                except PeerError as exc:
                    if exc.kind == "OwnedElsewhere" and exc.data.get("holder"):
                        passing.holder = str(exc.data["holder"])
                        continue
                    if exc.kind == "NotAwaiting" and passing.earlier(here=False):
                        own = await self._all_own(conversation_id, op, args, passing, here=False)
                        if own is not None:
                            return own
                    if exc.kind == "StoreUnavailable" and op == "respond":
                        # its database failed that run (a session ended): run it again, under a new
                        # key; what that run wrote is recognised as this answer's own
                        passing.key = new_id("ans")
                        await asyncio.sleep(HOLDER_CHECK_S)
                        continue
                    raise _again(exc) from None
                except ClusterError:
                    pass  # no reply: the holder's session is gone, or it does not answer
                if await self.cluster.owner_alive(passing.holder, strict=True):
                    continue  # it lives: the same request again (it runs it once)
                try:
                    got = await self._here(conversation_id, op, {**args, "answer": passing.key})
                    return await self._own_answers(conversation_id, op, args, got, passing, here=True)
                except OwnedElsewhere as moved:
                    if moved.holder == passing.holder:  # dead, but not yet past the grace the others give it
                        await asyncio.sleep(HOLDER_CHECK_S)
                    passing.holder = moved.holder  # or another server took it over first: ask that one
                except errors.NotAwaiting:
                    own = await self._all_own(conversation_id, op, args, passing, here=True)
                    if own is None:
                        raise
                    return own
            except StoreUnavailable:
                if not passing.sent:
                    raise  # nothing went out: the client may send it again
                await asyncio.sleep(HOLDER_CHECK_S)
        raise errors.KernelError(f"conversation {conversation_id} kept moving between servers; try again")

    async def _call_while_alive(self, passing: _Passing, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """`Cluster.call`, given up as soon as the holder's database session is gone (a killed
        server never answers: no need to wait for the whole timeout)."""
        holder = passing.holder
        keyed = {**args, "answer": passing.key}  # the holder notes which answer settled a call
        call = asyncio.ensure_future(self.cluster.call(holder, op, keyed, key=passing.key, on_sent=passing.went))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=HOLDER_CHECK_S)
                if done:
                    return call.result()
                if not await self.cluster.owner_alive(holder, strict=True):
                    raise ClusterError(f"instance {holder} is gone")
        finally:
            if not call.done():
                call.cancel()

    async def _own_answers(
        self,
        conversation_id: str,
        op: str,
        args: dict[str, Any],
        got: dict[str, Any],
        passing: _Passing,
        *,
        here: bool,
    ) -> dict[str, Any]:
        """`got`, with each call it found `already_resolved` by this very answer accepted: an
        earlier run of it (a copy that went to another holder, or under another key; `here`: the
        current run is this server's own) may have applied it before its reply was lost."""
        if op != "respond" or not passing.earlier(here=here):
            return got
        decisions = {str(d.get("call_id")): d for d in args.get("decisions") or []}
        refused = [str(r.get("call_id")) for r in got.get("results") or [] if r.get("error") == "already_resolved"]
        settled_by = await self._settled_by(conversation_id, refused, None if here else passing.holder)
        results: list[dict[str, Any]] = []
        for r in got.get("results") or []:
            d = decisions.get(str(r.get("call_id")))
            if (
                r.get("error") == "already_resolved"
                and d is not None
                and await self._answered_so(conversation_id, d, settled_by.get(str(d.get("call_id"))), passing)
            ):
                r = _accepted(d)
            results.append(r)
        return {**got, "results": results}

    async def _all_own(
        self, conversation_id: str, op: str, args: dict[str, Any], passing: _Passing, *, here: bool
    ) -> dict[str, Any] | None:
        """The results of an answer whose turn has left its pause, when this answer's own earlier
        run is what resumed it (every call settled as it says); else None."""
        decisions = list({str(d.get("call_id")): d for d in args.get("decisions") or []}.values())
        if op != "respond" or not decisions or not passing.earlier(here=here):
            return None
        calls = [str(d.get("call_id")) for d in decisions]
        settled_by = await self._settled_by(conversation_id, calls, None if here else passing.holder)
        for d in decisions:
            if not await self._answered_so(conversation_id, d, settled_by.get(str(d.get("call_id"))), passing):
                return None
        return {"results": [_accepted(d) for d in decisions]}

    async def _answered_so(
        self, conversation_id: str, d: dict[str, Any], settled_by: str | None, passing: _Passing
    ) -> bool:
        """Did this very answer settle the call? Not when the holder names another answer as the
        one that did (a client of the same name answering alike through another server). When
        none is named (the run that settled it was on a holder gone since, or failed after its
        write), the stored decision and who decided, as this answer gives them, tell."""
        if settled_by is not None and settled_by not in passing.keys():
            return False
        p = await self.kernel.store.get_pending(conversation_id, str(d.get("call_id")))
        action = d.get("action")
        if p is None or p.status != _SETTLED.get(str(action)) or p.decided_by != d.get("decided_by"):
            return False
        return action != "result" or (p.output == d.get("output") and p.is_error == bool(d.get("is_error")))

    async def _settled_by(self, conversation_id: str, call_ids: list[str], holder: str | None) -> dict[str, str]:
        """The key of the answer that settled each call, as the server holding the conversation
        noted it (`holder` None: this server); those it did not note are left out."""
        if not call_ids:
            return {}
        if holder is None or holder == self.cluster.instance_id:
            return self._noted_answers(conversation_id, call_ids)
        try:
            got = await self.cluster.call(
                holder, "answered", {"conversation": conversation_id, "calls": call_ids}, ANSWERED_ASK_S
            )
        except Exception as exc:  # (a holder that cannot say names none)
            log.debug("cluster: instance %s did not say which answers settled %s: %s", holder, call_ids, exc)
            return {}
        keys = got.get("keys")
        return {str(c): str(k) for c, k in keys.items()} if isinstance(keys, dict) else {}

    def _noted_answers(self, conversation_id: str, call_ids: list[str]) -> dict[str, str]:
        noted = ((c, self._answer_keys.get((conversation_id, c))) for c in call_ids)
        return {c: key for c, key in noted if key is not None}

    def _note_answer(self, conversation_id: str, results: list[dict[str, Any]], key: Any) -> None:
        """Remember which answer passed on (its key) settled each call it won here."""
        if not isinstance(key, str):
            return
        for r in results:
            if r.get("accepted") is True:
                self._answer_keys[(conversation_id, str(r.get("call_id")))] = key
        while len(self._answer_keys) > ANSWERS_REMEMBERED:
            self._answer_keys.popitem(last=False)

    async def _finish_later(self, task: asyncio.Future[dict[str, Any]], conversation_id: str, op: str) -> None:
        """A request whose caller was told OutcomeUnknown, followed to its end (logged)."""
        what = _WHAT.get(op, op)
        try:
            await task
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "cluster: the %s for conversation %s passed on late was not applied: %s", what, conversation_id, exc
            )
            return
        log.info("cluster: the %s for conversation %s passed on late went through", what, conversation_id)

    async def _here(self, conversation_id: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        handler = self._ops().get(op)
        if handler is None:
            raise errors.InvalidInput(f"unknown cluster operation {op!r}")
        return await handler(conversation_id, args)

    # ------------------------------------------------------------ requests from the others

    async def on_message(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        conversation_id = str(args.get("conversation") or "")
        handler = self._ops().get(op)
        if handler is None or not conversation_id:
            raise errors.InvalidInput(f"unknown cluster request {op!r}")
        return await handler(conversation_id, args)

    def _ops(self) -> dict[str, Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]]:
        return {
            "pull": self._pull,
            "respond": self._respond,
            "cancel": self._cancel,
            "follow": self._follow,
            "answered": self._answered,
        }

    async def taken(self, conversation_id: str) -> None:
        """This server just took the conversation: if another follows it, publish from the start."""
        if self.cluster.peers and await self.cluster.followed_elsewhere(conversation_id):
            self._mark_followed(conversation_id)

    def _more_peers(self) -> None:
        """The heartbeat counts more servers than before: one that joined may follow (it told the
        database) a conversation this server took while it counted nobody (`taken` looked for no
        follower then); its running turns are published from now on."""
        self._spawn(self._publish_followed())

    async def _publish_followed(self) -> None:
        try:
            for conversation_id in self.cluster.held():
                if self.followed(conversation_id):
                    continue
                handles = self.kernel.live_handles(conversation_id)
                if any(h.controller.status not in TERMINAL_STATUSES for h in handles):
                    if await self.cluster.followed_elsewhere(conversation_id):
                        self._mark_followed(conversation_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the follower's renewal (every FOLLOW_EVERY_S) tells this server again
            log.warning("cluster: could not look for followers of the turns running here: %s", exc)

    async def _follow(self, conversation_id: str, args: dict[str, Any]) -> dict[str, Any]:
        if self.kernel.holds(conversation_id):
            self._mark_followed(conversation_id)
        return {}

    async def _pull(self, conversation_id: str, args: dict[str, Any]) -> dict[str, Any]:
        self._mark_followed(conversation_id)  # its submitter follows it
        try:
            await self.kernel.catch_up(conversation_id)
        except OwnedElsewhere as moved:
            hops = int(args.get("hops") or 0)
            if hops < MOVED_HOPS:
                await self.cluster.send(moved.holder, "pull", {"conversation": conversation_id, "hops": hops + 1})
        return {}

    async def _respond(self, conversation_id: str, args: dict[str, Any]) -> dict[str, Any]:
        decisions = [Decision(**d) for d in args.get("decisions") or []]
        given = args.get("settings")
        settings = (
            TurnSettings(dict(given.get("options") or {}), list(given.get("client_tools") or []))
            if isinstance(given, dict)
            else None
        )
        results = await self.kernel.respond(
            conversation_id, decisions, here=True, whole=args.get("whole") is True, settings=settings
        )
        self._note_answer(conversation_id, results, args.get("answer"))
        return {"results": results}

    async def _answered(self, conversation_id: str, args: dict[str, Any]) -> dict[str, Any]:
        """Which answers passed on settled these calls here: a copy of another answer, refused, asks
        (`_settled_by`) before it takes the call's settlement for its own."""
        calls = args.get("calls")
        return {
            "keys": self._noted_answers(conversation_id, [str(c) for c in calls] if isinstance(calls, list) else [])
        }

    async def _cancel(self, conversation_id: str, args: dict[str, Any]) -> dict[str, Any]:
        turn_id = args.get("turn_id")
        left = args.get("client_left") is True
        done = await self.kernel.cancel(conversation_id, str(turn_id) if turn_id else None, here=True, client_left=left)
        return {"cancelled": done}

    # ------------------------------------------------------------ the sweep

    async def _sweep(self) -> None:
        purged_at = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep_once()
                if time.monotonic() - purged_at > 60:
                    purged_at = time.monotonic()
                    await self.cluster.purge_mail()
            except asyncio.CancelledError:
                raise
            except StoreUnavailable as exc:  # the database is away: said once a sweep, no traceback
                log.warning("cluster sweep skipped: %s", exc)
            except Exception:
                log.exception("cluster sweep failed")

    async def sweep_once(self) -> None:
        """Take over what gone servers left, pull what no notification announced, refresh mirrors
        that heard nothing."""
        if self.kernel.stopping:
            return
        if self.cluster.lost:
            # Judged gone: this server takes nothing over and pulls nothing; it only follows the
            # turns its clients still wait for (`follow_elsewhere`) to their real end.
            await self._refresh_stale(time.monotonic())
            return
        gone = await self.cluster.forget_gone()
        for instance in gone:
            log.warning("cluster: instance %s is gone; its conversations are taken over", instance)
        for conversation_id in await self.cluster.orphaned_conversations():
            try:
                await self.kernel.catch_up(conversation_id)
            except OwnedElsewhere:
                pass
        for conversation_id in await self.cluster.waiting_here(PULL_AFTER_S):
            try:
                await self.kernel.catch_up(conversation_id)
            except OwnedElsewhere:
                pass
        await self.kernel.review_counts()  # the open-turn count of what moved between servers
        now = time.monotonic()
        following = self._following()
        for conversation_id in list(self._told):
            if conversation_id not in following:
                del self._told[conversation_id]
        renew = [c for c in following if now - self._told.get(c, 0.0) >= FOLLOW_EVERY_S]
        if renew:
            for conversation_id in renew:
                self._told[conversation_id] = now
            await self._say_following(renew)
        await self._refresh_stale(now)

    async def _refresh_stale(self, now: float) -> None:
        """Read from the store each mirror that heard nothing for `STALE_S`."""
        for turn_id, mirror in list(self.mirrors.items()):
            if now - mirror.heard_at < STALE_S or mirror.held is not None:
                continue
            mirror.heard_at = now
            await self._refresh(turn_id, mirror)

    async def _refresh(self, turn_id: str, mirror: _Mirror) -> None:
        store = self.kernel.store
        turn = await store.get_turn(turn_id)
        if turn is None:
            self._drop(turn_id)
            return
        controller = mirror.handle.controller
        if turn.status in ("running", "awaiting"):
            mirror.started = True
        if turn.status == "running" and controller.status == "running":
            await self._show_draft(turn, controller)
            return
        if turn.status in ("queued", "running") or turn.status == controller.status:
            return
        built = await controller_from_store(store, turn, await store.list_pending(turn.id), follower=True)
        snap = built.snapshot()
        if snap.terminal:
            if self.mirrors.get(turn_id) is mirror:
                self._end(mirror, snap)
            return
        controller.mirror(replace(snap, revision=max(snap.revision, controller.revision + 1)))

    async def _show_draft(self, turn: TurnRecord, controller: TurnController) -> None:
        """A running turn whose holder's snapshots do not reach this server (none for `STALE_S`:
        lost, or not published yet): its draft, the text the holder checkpoints in the store every
        `draft_interval_s`, when it is newer than what the mirror shows and only adds to it (the
        holder's next snapshot takes over from there). The clients here see the reply grow in
        steps of a few seconds at worst, not nothing until the turn ends."""
        seen = turn.draft.get("revision") if isinstance(turn.draft, dict) else None
        if not isinstance(seen, int) or isinstance(seen, bool) or seen <= controller.revision:
            return
        built = (await controller_from_store(self.kernel.store, turn, [], follower=True)).snapshot()
        shown = controller.snapshot()
        if controller.status != "running" or seen <= controller.revision or not _adds_to(shown, built):
            return  # (a snapshot of the holder came meanwhile, or the draft shows the turn otherwise)
        phase = built.phase if built.phase != "queued" else shown.phase
        controller.mirror(replace(built, revision=seen, phase=phase, usage=built.usage or shown.usage))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _adds_to(shown: TurnSnapshot, built: TurnSnapshot) -> bool:
    """Does `built` show all that `shown` does and more: each block in its place (a text only
    grown, a call the same call), and new text or blocks after? A stream here numbers the blocks
    and the characters it has sent: a snapshot that moved or shortened one would garble it."""
    if len(built.blocks) < len(shown.blocks) or built.blocks == shown.blocks:
        return False
    for old, new in zip(shown.blocks, built.blocks, strict=False):
        if old["type"] != new["type"] or bool(old.get("refusal")) != bool(new.get("refusal")):
            return False
        if old["type"] == "tool_call":
            if old.get("call_id") != new.get("call_id"):
                return False
        elif not str(new.get("text", "")).startswith(str(old.get("text", ""))):
            return False
    return True


def decisions_args(
    decisions: list[Decision], *, whole: bool = False, settings: TurnSettings | None = None
) -> dict[str, Any]:
    """The `respond` call's arguments; `settings`: the answering request's options and client tools."""
    args: dict[str, Any] = {"decisions": [asdict(d) for d in decisions], "whole": whole}
    if settings is not None:
        args["settings"] = {"options": settings.options, "client_tools": settings.client_tools}
    return args


def _again(exc: PeerError) -> Exception:
    """The peer's error as this server raises it: the same kernel error class, code and param."""
    cls = getattr(errors, exc.kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.KernelError):
        return cls(str(exc), code=exc.data.get("code"), param=exc.data.get("param"))
    return errors.KernelError(f"the server running this conversation failed: {exc}")


__all__ = ["ClusterLink", "OutcomeUnknown", "OwnedElsewhere", "RemoteWatch", "decisions_args"]
