"""Per-connection state of the WebSocket protocol and its bounded outbound buffer.

The buffer holds already-encoded text frames in the order the server produced them. Turn snapshots
coalesce latest-wins per turn (a newer snapshot of a turn replaces the queued older one and moves to
the back), every other frame is kept. A buffer that grows past its bound, or a single send that does
not complete in time, marks the client as unable to keep up: it is closed with a reason, and nobody
else waits for it (fan-out only ever appends to buffers, it never awaits a socket). The bound is
in frames and in bytes (the memory the queued text holds): a 100-byte `get_history` answered by
an 8 MiB page made frames a poor measure, 150 of them held 1.5 GB for one client that read nothing.
One frame above the byte budget still goes when nothing is queued (a big history page), and the
endpoint reads no further frame from a client while its buffer holds more than half the budget
(`has_room`): its own requests wait for its downlink instead of piling up replies.

A frame finds nothing queued ahead of it most of the time: then it is written to the socket at once
(`write_frame`, which the edge's WebSocket protocol puts in the scope), framed by `text_frame`,
with no task switch per frame and, for a snapshot fanned out to many, framed once for all of them.
A socket that cannot take it now (flow control paused it, or compression frames each connection
apart) leaves the frame to the queue and the writer task, as before.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from appserver import fastjson
from appserver.ws.codes import CLOSE_SLOW_CONSUMER

if TYPE_CHECKING:
    from appserver.auth import Principal

log = logging.getLogger("appserver.ws")

WRITE_FRAME = "appserver.write_frame"
"""The ASGI scope extension under which the edge's WebSocket protocol offers `write_frame(bytes) ->
bool`: write a framed message now if the connection can take it as it is, else False."""


def text_frame(payload: bytes) -> bytes:
    """A server's WebSocket text message as one unmasked, unfragmented frame (RFC 6455 §5.2)."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65536:
        return b"\x81\x7e" + n.to_bytes(2, "big") + payload
    return b"\x81\x7f" + n.to_bytes(8, "big") + payload


def encode(frame: dict[str, Any]) -> str:
    """A frame as JSON text that always goes out as UTF-8 (what a WebSocket text frame is)."""
    try:
        return orjson.dumps(frame, str).decode()  # fastjson.dumps's fast path, spelled out
    except TypeError:
        return _encode_slow(frame)


def _encode_slow(frame: dict[str, Any]) -> str:
    """What orjson refuses (integers beyond 64 bits, keys that are not strings, lone surrogates):
    the standard library writes it, but it writes a lone surrogate as is, and such text cannot be
    encoded as UTF-8, so sending it would fail. Client input never holds one (strictjson refuses
    them), but text from elsewhere (an upstream's reply) may: it goes out as U+FFFD, as a decoder
    shows bytes it cannot read, rather than failing the frame."""
    text = fastjson.dumps(frame, default=str)
    if _SURROGATE.search(text) is None:
        return text
    log.warning("a %r frame held a lone UTF-16 surrogate; it is sent as U+FFFD", frame.get("type"))
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


_SURROGATE = re.compile("[\ud800-\udfff]")
_FRAME_TYPE = re.compile(r'"type":"([a-z_]{1,32})"')


def _unsendable(text: str) -> str:
    """The error frame sent in place of one that could not be sent (a bug: `encode` makes text
    that always can be)."""
    m = _FRAME_TYPE.search(text, 0, 200)
    kind = m.group(1) if m else "unknown"
    return encode(
        {
            "type": "error",
            "code": "internal_error",
            "message": f"the server could not send a {kind!r} frame to this connection; it was left out",
        }
    )


class _Entry:
    __slots__ = ("text", "turn_id", "dead", "size")

    def __init__(self, text: str, turn_id: str | None) -> None:
        self.text = text
        self.turn_id = turn_id
        self.dead = False
        self.size = sys.getsizeof(text)  # the memory the text holds (4 bytes a character for emoji)


class Overflow(Exception):
    pass


OUTBOUND_MAX_BYTES = 16 * 1024 * 1024  # `[limits] ws_outbound_max_bytes`'s default


class Outbound:
    """An ordered buffer of encoded frames with per-turn snapshot coalescing and a hard bound, in
    frames (`limit`) and in bytes (`max_bytes`; one frame above it is taken when nothing is queued)."""

    def __init__(self, limit: int, max_bytes: int = OUTBOUND_MAX_BYTES) -> None:
        self.limit = max(1, limit)
        self.max_bytes = max(1, max_bytes)
        self.bytes = 0  # held by the queued frames now
        self.peak_bytes = 0  # the most they ever held: what this client cost at worst
        self._entries: deque[_Entry] = deque()
        self._by_turn: dict[str, _Entry] = {}
        self._live = 0
        self._dead = 0  # replaced snapshots still in _entries (emptied: only their place is kept)
        self._ready = asyncio.Event()
        self._roomy = asyncio.Event()  # set while `has_room`
        self._roomy.set()
        self.closed = False

    def __len__(self) -> int:
        return self._live

    @property
    def empty(self) -> bool:
        """Nothing queued, dropped or not: a frame written past the queue now keeps its order."""
        return not self._entries and not self.closed

    @property
    def has_room(self) -> bool:
        """At most half the byte budget queued: the client's next request may be read."""
        return self.bytes <= self.max_bytes // 2

    async def wait_for_room(self) -> None:
        """Return once `has_room` (or the buffer is closed): backpressure on the client's requests."""
        while not self.has_room and not self.closed:
            self._roomy.clear()
            await self._roomy.wait()

    def put(self, text: str) -> None:
        """Queue a frame that must never be dropped; raises Overflow when the buffer is full."""
        if self.closed:
            return
        self._append(_Entry(text, None))

    def put_snapshot(self, turn_id: str, text: str) -> None:
        """Queue a turn snapshot; a queued older snapshot of the same turn is dropped (latest wins)."""
        if self.closed:
            return
        entry = _Entry(text, turn_id)
        old = self._by_turn.get(turn_id)
        if old is not None and not old.dead:
            # Let go of the replaced text now, not when the writer reaches its place: a client
            # that does not read would otherwise hold every revision of a long reply until it is
            # closed (each one the whole text so far: hundreds of MB for a 400 KB reply).
            self._check_bytes(entry.size - old.size, others=self._live - 1)
            old.dead = True
            old.text = ""
            self._live -= 1
            self._dead += 1
            self._release(old.size)
            if self._dead > 64 and self._dead > self._live:
                self._entries = deque(e for e in self._entries if not e.dead)
                self._dead = 0
            self._take(entry)
            return
        self._append(entry)

    def _append(self, entry: _Entry) -> None:
        if self._live >= self.limit:
            raise Overflow(f"outbound buffer full ({self.limit} frames): the client is not reading")
        self._check_bytes(entry.size, others=self._live)
        self._take(entry)

    def _check_bytes(self, growth: int, *, others: int) -> None:
        """Overflow when `growth` more bytes pass the budget, unless no `others` frames are queued
        (a frame bigger than the budget goes on its own)."""
        if others and self.bytes + growth > self.max_bytes:
            raise Overflow(f"outbound buffer full ({self.max_bytes} bytes): the client is not reading")

    def _take(self, entry: _Entry) -> None:
        if entry.turn_id is not None:
            self._by_turn[entry.turn_id] = entry
        self._entries.append(entry)
        self._live += 1
        self.bytes += entry.size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if not self.has_room:
            self._roomy.clear()
        self._ready.set()

    def _release(self, size: int) -> None:
        self.bytes -= size
        if self.has_room:
            self._roomy.set()

    async def get(self) -> str:
        while True:
            while self._entries:
                entry = self._entries.popleft()
                if entry.dead:
                    self._dead -= 1
                    continue
                self._live -= 1
                self._release(entry.size)
                if entry.turn_id is not None and self._by_turn.get(entry.turn_id) is entry:
                    del self._by_turn[entry.turn_id]
                return entry.text
            if self.closed:
                raise asyncio.CancelledError
            self._ready.clear()
            await self._ready.wait()

    def close(self, *, drop: bool = True) -> None:
        """Refuse new frames; `drop` also discards the queued ones (else they still drain)."""
        self.closed = True
        if drop:
            self._entries.clear()
            self._by_turn.clear()
            self._live = 0
            self._dead = 0
            self.bytes = 0
        self._ready.set()
        self._roomy.set()


REVISIONS_KEPT = 256  # turns a connection remembers the last revision it was sent of (live turns it watched)


class Connection:
    """One client connection: identity, principal, outbound buffer, declared client tools."""

    def __init__(
        self,
        send_text: Callable[[str], Awaitable[None]],
        *,
        outbound_max: int,
        send_timeout_s: float,
        outbound_max_bytes: int = OUTBOUND_MAX_BYTES,
        write_frame: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.id = f"wsc_{secrets.token_hex(6)}"
        self.principal: Principal | None = None
        self.client_name: str | None = None
        self.greeted = False
        self.outbound = Outbound(outbound_max, outbound_max_bytes)
        self.send_timeout_s = send_timeout_s
        self._send_text = send_text
        self._write_frame = write_frame
        self._in_flight = False  # the writer task took a frame and has not finished sending it
        self.subscriptions: set[str] = set()
        # turn_id -> the revision of the last `turn_updated` of that turn sent here (queued or
        # written), so that none goes out twice or older (see `send_snapshot`); forgotten once the
        # turn's terminal snapshot is sent, and past REVISIONS_KEPT turns the oldest goes first.
        self.revisions: dict[str, int] = {}
        self.close_request: tuple[int, str] | None = None
        self.closing = asyncio.Event()
        self.sent = 0

    @property
    def alive(self) -> bool:
        return self.close_request is None

    # ------------------------------------------------------------ enqueue (never awaits)

    def send(self, frame: dict[str, Any]) -> None:
        if "request_id" in frame and frame["request_id"] is None:
            frame = {k: v for k, v in frame.items() if k != "request_id"}
        try:
            text = encode(frame)
        except Exception:  # a bug (a value JSON cannot hold): one frame must not end the connection
            log.exception("websocket %s: could not encode a %r frame", self.id, frame.get("type"))
            rid = frame.get("request_id")
            text = encode(
                {
                    "type": "error",
                    **({"request_id": rid} if isinstance(rid, str) else {}),
                    "code": "internal_error",
                    "message": f"the server could not encode its {frame.get('type')!r} frame; it was left out",
                }
            )
        self.send_encoded(text)

    def send_encoded(self, text: str, frame: bytes | None = None) -> None:
        """`frame`: `text` already framed (`text_frame`), when one text goes to many connections."""
        if self._write_now(text, frame):
            return
        try:
            self.outbound.put(text)
        except Overflow as exc:
            self.kill(CLOSE_SLOW_CONSUMER, str(exc))

    def send_snapshot(
        self, turn_id: str, text: str, frame: bytes | None = None, *, revision: int | None = None, final: bool = False
    ) -> bool:
        """Send a turn's snapshot (`revision`: its revision, `final`: its terminal one). Revisions of a
        turn strictly rise on a connection, whoever sends them (a follower's round, a catch-up after
        a submit, a new follower after an unsubscribe released the watch): one not above the last
        sent here is left out (False). A terminal snapshot always goes (its turn then is forgotten
        here): it is the last of its turn, and a settled turn shown again (a `duplicate` ack)
        repeats it, as docs/protocol.md says."""
        if revision is not None:
            seen = self.revisions.pop(turn_id, None)
            if final:
                pass  # forgotten: nothing of this turn follows its end
            elif seen is not None and revision <= seen:
                self.revisions[turn_id] = seen
                return False
            else:
                self.revisions[turn_id] = revision  # moved to the end: the oldest go first
                if len(self.revisions) > REVISIONS_KEPT:
                    del self.revisions[next(iter(self.revisions))]
        self._put_snapshot(turn_id, text, frame)
        return True

    def _put_snapshot(self, turn_id: str, text: str, frame: bytes | None) -> None:
        if self._write_now(text, frame):
            return
        try:
            self.outbound.put_snapshot(turn_id, text)
        except Overflow as exc:
            self.kill(CLOSE_SLOW_CONSUMER, str(exc))

    def _write_now(self, text: str, frame: bytes | None) -> bool:
        """Write the frame to the socket now if nothing is queued ahead of it nor held by the writer
        task (a frame it took while the socket was paused: the socket may take frames again before
        the task has run) and the socket takes it as it is."""
        if self._write_frame is None or self._in_flight or not self.outbound.empty or self.close_request is not None:
            return False
        if frame is None:
            try:
                frame = text_frame(text.encode())
            except UnicodeEncodeError:  # the writer task sends an error in its place
                return False
        if not self._write_frame(frame):
            return False
        self.sent += 1
        return True

    def kill(self, code: int, reason: str, *, flush: bool = False) -> None:
        """Ask the endpoint to close this connection (idempotent); `flush` lets queued frames go first."""
        if self.close_request is None:
            log.info("closing websocket %s: %s %s", self.id, code, reason)
            self.close_request = (code, reason[:120])
        self.outbound.close(drop=not flush)
        self.closing.set()

    # ------------------------------------------------------------ the writer task

    async def run_sender(self) -> None:
        while True:
            try:
                text = await self.outbound.get()
            except asyncio.CancelledError:
                if self.outbound.closed:
                    return
                raise
            self._in_flight = True
            try:
                async with asyncio.timeout(self.send_timeout_s):  # no task per frame, unlike wait_for
                    try:
                        await self._send_text(text)
                    except UnicodeEncodeError:  # nothing was written: the frame failed, not the socket
                        log.error("websocket %s: a frame could not be encoded as UTF-8; sent an error instead", self.id)
                        await self._send_text(_unsendable(text))
            except TimeoutError:
                self.kill(
                    CLOSE_SLOW_CONSUMER,
                    f"slow consumer: a frame could not be delivered within {self.send_timeout_s:g} s",
                )
                return
            except Exception as exc:  # the socket is gone: the endpoint closes this connection
                # A client that left is no news (a thousand of them leaving made a thousand lines).
                gone = type(exc).__name__ in ("WebSocketDisconnect", "ClientDisconnected")
                log.log(
                    logging.DEBUG if gone else logging.INFO, "websocket %s: sending failed, closing: %r", self.id, exc
                )
                raise
            finally:
                self._in_flight = False
            self.sent += 1
