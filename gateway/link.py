"""The gateway's one connection to the server: the protocol client plus a frame dispatcher.

Everything the gateway asks of the server goes through here, over the public WebSocket protocol
(`appserver.client`), exactly as a desktop app would: create a conversation, submit an input with
its idempotency key, follow a turn's snapshots, answer a client-tool call. One reader task hands
each `turn_updated` to the follower of that turn (latest wins) and each `tool_call_request` to the
tool handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from appserver.client import TERMINAL, Closed, ProtocolClient, ProtocolError, settled_from_history
from plugins.contract import image_budget

log = logging.getLogger("gateway.link")

ToolHandler = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]
REQUEST_TIMEOUT_S = 30.0
UNCLAIMED_MAX = 4096  # snapshots of turns nobody follows yet (an ack can trail its first frames)


class TurnFollower:
    """The newest snapshot of one turn; `next()` waits for a newer revision."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.latest: dict[str, Any] | None = None
        self._changed = asyncio.Event()
        self._seen = -1

    def offer(self, snapshot: dict[str, Any]) -> None:
        if self.latest is None or int(snapshot.get("revision", -1)) >= int(self.latest.get("revision", -1)):
            self.latest = snapshot
            self._changed.set()

    async def arrived(self) -> None:
        """Until a first snapshot is here (`next` still returns it)."""
        while self.latest is None:
            self._changed.clear()
            await self._changed.wait()

    async def next(self) -> dict[str, Any]:
        while self.latest is None or int(self.latest.get("revision", -1)) <= self._seen:
            self._changed.clear()
            await self._changed.wait()
        self._seen = int(self.latest.get("revision", -1))
        return self.latest


class ServerLink:
    def __init__(self, client: ProtocolClient) -> None:
        self.client = client
        self._followers: dict[str, TurnFollower] = {}
        self._unclaimed: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._tool_handler: ToolHandler | None = None
        self._approval_handler: ToolHandler | None = None
        self._reconnected: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()
        # Set by the child (gateway/redact.py): the accounts' secrets masked in what the gateway itself
        # says to the server (a tool result quoting a platform's error that echoes a token)
        self.redact: Callable[[Any], Any] | None = None

    @classmethod
    async def open(cls, url: str, token: str | None) -> ServerLink:
        client = await ProtocolClient.connect(
            url, token=token or "", client="appserver-gateway", reconnect=True, reconnect_s=60.0, max_buffered=100_000
        )
        link = cls(client)
        link._reader = asyncio.get_running_loop().create_task(link._read())
        return link

    @property
    def max_frame_bytes(self) -> int:
        """The biggest frame the server takes (its welcome's `max_frame_bytes`, else 4 MiB): a turn's
        input, its images base64-encoded inside, must fit in one."""
        return int(self.client.max_frame_bytes)

    def image_budget(self) -> int:
        """The biggest image (bytes as fetched) that can reach the model in a turn, now."""
        return image_budget(self.max_frame_bytes)

    def on_tool_call(self, handler: ToolHandler) -> None:
        self._tool_handler = handler

    def on_approval(self, handler: ToolHandler) -> None:
        """`approval_request` and `approval_resolved` frames of the conversations followed."""
        self._approval_handler = handler

    def on_reconnected(self, handler: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Called after the client reconnected (and resubscribed): frames sent meanwhile were lost."""
        self._reconnected = handler

    async def close(self) -> None:
        await self.client.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---------------------------------------------------------------- requests

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send `frame`, masked (`redact`) unless it is an input: a sender's words go as they were sent."""
        if self.redact is not None and frame.get("type") != "submit_input":
            frame = self.redact(frame)
        reply = await self.client.request(frame, timeout=REQUEST_TIMEOUT_S)
        if reply.get("type") == "error":
            raise ProtocolError(str(reply.get("code")), str(reply.get("message")), reply.get("param"))
        return reply

    async def create_conversation(self, agent: str, title: str, metadata: dict[str, Any]) -> str:
        reply = await self.request(
            {"type": "create_conversation", "agent": agent, "title": title[:200], "metadata": metadata}
        )
        return str(reply["conversation"]["id"])

    async def submit(self, frame: dict[str, Any]) -> dict[str, Any]:
        """`submit_input`; returns the ack (`turn_id`, `conversation_id`, `duplicate`)."""
        return await self.request({"type": "submit_input", **frame})

    async def tool_result(self, call_id: str, output: str, is_error: bool) -> None:
        await self.request({"type": "tool_result", "call_id": call_id, "output": output, "is_error": is_error})

    # ---------------------------------------------------------------- following turns

    def follow(self, turn_id: str) -> TurnFollower:
        follower = self._followers.get(turn_id)
        if follower is None:
            follower = self._followers[turn_id] = TurnFollower(turn_id)
            early = self._unclaimed.pop(turn_id, None)
            if early is not None:
                follower.offer(early)
        return follower

    def unfollow(self, turn_id: str) -> None:
        self._followers.pop(turn_id, None)

    async def recover(self, conversation: str, turn_id: str) -> dict[str, Any] | None:
        """After a gateway restart: subscribe and find where a turn stands. Returns its terminal
        snapshot when it already ended, else None (its snapshots will arrive live: it runs, or it may
        still wait in the queue). A turn that is not active, has nothing in the history and cannot be
        waiting (no input is queued) ended without a trace: a `cancel` withdrew it before it started
        (docs/protocol.md: nothing of it is written, and no snapshot of it comes again), or the server
        no longer knows it; it is answered `untraced` (`is_untraced`), which the caller confirms by
        asking again, as one seen in the moment between leaving the queue and starting looks the same."""
        state = await self.request({"type": "subscribe", "conversation": conversation})
        active = state.get("active_turn")
        if active and active.get("turn_id") == turn_id:
            self.follow(turn_id).offer(active)
            return active if active.get("status") in TERMINAL else None
        history = await self.request({"type": "get_history", "conversation": conversation, "limit": 200})
        messages = list(history.get("messages") or [])
        mine = [m for m in messages if m.get("turn_id") == turn_id]
        busy = state.get("state") != "idle" or int(state.get("queued") or 0) > 0
        agent = str((state.get("conversation") or {}).get("agent_id") or "")
        if not mine:
            # waiting in the queue only while some input is (`queued` counts those behind the active turn)
            waiting = int(state.get("queued") or 0) > 0
            return None if waiting else _ended_unknown(turn_id, conversation, agent)
        if busy and all(m.get("role") == "user" for m in mine):
            return None  # its input is in, it ends as the conversation goes on: it reports live
        snap = settled_from_history(turn_id, conversation, agent, messages, revision=1_000_000)
        return dict(snap) if snap is not None else _ended_unknown(turn_id, conversation, agent)

    # ---------------------------------------------------------------- the reader

    async def _read(self) -> None:
        try:
            async for frame in self.client.frames():
                kind = frame.get("type")
                if kind == "turn_updated":
                    self._snapshot(frame.get("snapshot") or {})
                elif kind == "tool_call_request" and self._tool_handler is not None:
                    self._spawn(self._tool_handler(frame))
                elif kind in ("approval_request", "approval_resolved") and self._approval_handler is not None:
                    self._spawn(self._approval_handler(frame))
                elif kind == "event":
                    if frame.get("local") and frame.get("name") == "reconnected" and self._reconnected is not None:
                        self._spawn(self._reconnected())
                    log.info("server event %s %s", frame.get("name"), frame.get("data") or "")
        except Closed:
            pass
        finally:
            log.warning("the connection to the server is gone: %s", self.client.closed_message())
            self.closed.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _snapshot(self, snap: dict[str, Any]) -> None:
        turn_id = str(snap.get("turn_id") or "")
        follower = self._followers.get(turn_id)
        if follower is not None:
            follower.offer(snap)
            return
        self._unclaimed[turn_id] = snap
        self._unclaimed.move_to_end(turn_id)
        while len(self._unclaimed) > UNCLAIMED_MAX:
            self._unclaimed.popitem(last=False)


def is_untraced(snapshot: dict[str, Any]) -> bool:
    """A snapshot `recover` made up for a turn the server shows no trace of (`_ended_unknown`)."""
    return bool(snapshot.get("untraced"))


def _ended_unknown(turn_id: str, conversation: str, agent: str) -> dict[str, Any]:
    """A turn that ended without anything of it in the history, or that the server no longer knows."""
    return {
        "untraced": True,
        "turn_id": turn_id,
        "conversation_id": conversation,
        "agent_id": agent,
        "revision": 1_000_000,
        "status": "failed",
        "phase": "finalizing",
        "stop_reason": "error",
        "blocks": [],
        "pending": [],
        "usage": {},
        "error": {"kind": "unknown", "message": "the turn ended without a reply", "retryable": False},
        "queue_position": 0,
        "attempt": 1,
        "updated_at": 0.0,
    }
