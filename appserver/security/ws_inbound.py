"""What the server reads from WebSocket clients before the app takes it: the limits before `hello`,
and the server-wide budget of big inbound frames after it.

uvicorn reads a WebSocket as fast as its client sends and pauses only once a whole message waits
for the app: a frame of 3.9 MB was read and assembled whole (then decoded, then parsed) on every
socket, whether or not it had authenticated. 250 sockets that never sent `hello` held 2.6 GB for
the 5 s of their hello window, over and over; 250 authenticated ones, 2 GB. So the edge's
WebSocket protocol (edge.py `EdgeWebSocketProtocol`) reads frame heads itself (`frame_head`) and:

* before `hello` was accepted, takes one message of at most `PREHELLO_MESSAGE_MAX` bytes at a time
  (a frame that says it is bigger closes the socket with 1009 at its head, before its payload is
  read), and reads nothing more until the app has handled it: frames pipelined behind `hello` stay
  in the kernel's socket buffer until `hello` is through, then are read under the limits below;
* after it, reads a frame bigger than `INBOUND_FREE` (its payload, or what it may inflate to) only
  once the server-wide `InboundBudget` has room for it: all connections together hold at most
  `INBOUND_TOTAL_MAX` bytes of such frames read and not yet taken by the app, one credential's
  connections a quarter of it. A connection that must wait reads nothing until it may (its client
  waits in TCP); smaller frames (every chat message, every `hello`) never wait. A compressed frame
  counts by what it inflates to: one of at most `INBOUND_FREE` on the wire is inflated once ahead
  (`inflated_within`, on a copy of the decoder) and never waits when that is small.
* once a message is whole its reservation shrinks to its size (to nothing when that is at most
  `INBOUND_FREE`, as a small unfragmented message reserves), and what it still holds is given back
  when the app takes it; a reservation must be given back within `INBOUND_MESSAGE_READ_S` of taking
  it, whether the message is slow to arrive or the app does not take it (the app reads no request
  of a client that leaves what it was sent unread), or its connection is closed (1009): 64 sockets
  each starting a fragmented message and adding a byte a second held the whole budget for good, and
  so did four credentials' sockets each holding a whole two-frame message of 100 bytes (4 MiB
  reserved) that the app did not take while their clients read slowly.
  While a connection waits for the budget its unanswered keepalive ping does not close it (its pong
  waits in TCP behind the frame the server will not read yet): the ping's timeout starts anew once
  it reads again. Nor does that clock run while the server holds the connection back behind its
  full downlink and its client takes that downlink at `DRAIN_RATE_MIN` or more (a slow link read
  steadily); a client that leaves it unread, or trickles it, is charged.
* with permessage-deflate, a frame that may inflate past `INBOUND_FREE` is inflated only once the
  server's `InflateGate` lets it: one per event-loop iteration, server-wide.
"""

from __future__ import annotations

import asyncio
import contextvars
import struct
import zlib
from collections.abc import Callable
from typing import Any

# Before its `hello` is accepted a socket's messages are at most this (a hello is a few hundred
# bytes; a JWT in it a few KB): bigger ones close it with 1009.
PREHELLO_MESSAGE_MAX = 64 * 1024
# Frames up to this never wait for the budget: a read of them holds at most what one socket read
# brought (256 KiB), and every chat message is one.
INBOUND_FREE = 64 * 1024
# What all connections may hold together of bigger frames read and not yet taken by the app.
INBOUND_TOTAL_MAX = 256 * 1024 * 1024
GROUP_SHARE = 4  # a credential's (or an address's) connections hold at most 1/GROUP_SHARE of it
# How much a permessage-deflate payload may inflate to, at most (deflate's own bound, ~1032x).
INFLATE_RATIO = 1032

# How long a message may hold a reservation, from when it is taken (waiting for it does not count)
# until the app takes the message: a 4 MiB frame over a 1 Mbit/s link takes ~35 s to arrive.
INBOUND_MESSAGE_READ_S = 60.0
# …except while the server holds the connection back behind its full downlink and that downlink
# drains at this many bytes a second or more, measured every DRAIN_CHECK_S (a real slow link: an
# 8 MiB page takes ~67 s at 1 Mbit/s). A client that leaves it unread, or trickles it, is charged.
DRAIN_RATE_MIN = 64 * 1024
DRAIN_CHECK_S = 2.0

OP_CONT, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
# Compressed frames that may inflate past INBOUND_FREE inflated per event-loop iteration, server-wide
# (`InflateGate`).
INFLATES_PER_ITERATION = 1


def inflated_within(decoder: Any, payload: bytes, cap: int) -> bool:
    """Whether a whole compressed message (`payload`, unmasked: one frame with FIN) inflates to at
    most `cap` bytes, found by inflating at most `cap + 1` of it with `decoder` (a copy of the
    connection's, or a fresh one: the connection's own is left as it is). Any doubt: False."""
    try:
        inflated = decoder.decompress(payload + b"\x00\x00\xff\xff", cap + 1)
        return len(inflated) <= cap and not decoder.unconsumed_tail
    except zlib.error:
        return False


def frame_head(buf: bytes | bytearray | memoryview, at: int = 0) -> tuple[int, int, int] | None:
    """The head of the frame that begins at `buf[at]` (RFC 6455 §5.2): (bytes of its head, the
    masking key included when the mask bit is set; its payload length; its first byte: FIN, RSV
    bits and opcode), or None while the head is incomplete. Nothing is checked here: the parser
    refuses what is malformed once it is fed the head."""
    left = len(buf) - at
    if left < 2:
        return None
    first, second = buf[at], buf[at + 1]
    size, length = 2, second & 0x7F
    if length == 126:
        if left < 4:
            return None
        (length,) = struct.unpack_from("!H", buf, at + 2)
        size = 4
    elif length == 127:
        if left < 10:
            return None
        (length,) = struct.unpack_from("!Q", buf, at + 2)
        size = 10
    if second & 0x80:
        size += 4
    if left < size:
        return None
    return size, length, first


class InflateGate:
    """Inflating big compressed frames, server-wide: at most `per_iteration` of them per event-loop
    iteration; the others wait their turn in order of arrival, one let through per iteration
    (`granted` called, in a pass of its own). Each socket inflated at most one such frame per step,
    but every step of every ready socket ran in the same iteration: 64 sockets each inflating 4 MiB
    (~40 ms) took ~1.5 s per iteration, and /healthz, which needs a few, waited 10-14 s."""

    def __init__(self, per_iteration: int = INFLATES_PER_ITERATION) -> None:
        self.per_iteration = max(1, per_iteration)
        self.used = 0  # let through in this iteration
        self.waits = 0  # frames that had to wait their turn
        self._waiting: dict[Callable[[], None], None] = {}
        self._reset: asyncio.Handle | None = None

    def admit(self, granted: Callable[[], None]) -> bool:
        """Inflate now (True), or queue `granted` to be called once it may (False)."""
        if self._waiting or self.used >= self.per_iteration:
            if granted not in self._waiting:
                self.waits += 1
                self._waiting[granted] = None
            return False
        self._take()
        return True

    def cancel(self, granted: Callable[[], None]) -> None:
        """A waiting connection is gone (or no longer waits): forget it."""
        self._waiting.pop(granted, None)

    def _take(self) -> None:
        self.used += 1
        if self._reset is None:  # the next iteration starts afresh (call_soon: not this one)
            self._reset = asyncio.get_running_loop().call_soon(self._next, context=contextvars.Context())

    def _next(self) -> None:
        self._reset, self.used = None, 0
        while self._waiting and self.used < self.per_iteration:
            granted = next(iter(self._waiting))
            del self._waiting[granted]
            self._take()
            granted()


class InboundBudget:
    """Bytes of big inbound frames that all WebSocket connections of a server hold (read, or
    reserved to be read, and not yet taken by the app), bounded in total (`max_bytes`) and per
    group (`group_max_bytes`: a credential's connections, as `connections_per_client` counts them).

    A connection reserves a frame's size at its head (`reserve`), before reading its payload, gives
    back what the message did not need once it is whole, and the rest once the app has taken it
    (`release`); one that finds no room waits (its `granted` is called once it has the bytes): the
    group holding least goes first, each group's in order of arrival, and one whose own group is
    full lets the others pass. Reserving whole frames up front never deadlocks: whoever holds bytes
    can finish its frame whatever the others do."""

    def __init__(self, max_bytes: int = INBOUND_TOTAL_MAX, group_max_bytes: int | None = None) -> None:
        self.max_bytes = max(1, max_bytes)
        self.group_max_bytes = max(1, group_max_bytes or self.max_bytes // GROUP_SHARE)
        self.held = 0
        self.peak = 0  # the most held at once
        self.waits = 0  # reservations that had to wait
        self.groups: dict[str, int] = {}
        # connections waiting, in order of arrival: their `granted` -> (group, bytes)
        self._waiting: dict[Callable[[], None], tuple[str, int]] = {}
        self._queue_on_total = False  # a waiter is held back by the total: newcomers queue behind it
        self.inflates = InflateGate()  # the server's inflating of big compressed frames

    @classmethod
    def for_frames(cls, frame_max: int, max_bytes: int = INBOUND_TOTAL_MAX) -> InboundBudget:
        """A budget in which a group's share takes at least one frame of `frame_max` bytes."""
        return cls(max(max_bytes, GROUP_SHARE * frame_max))

    def need(self, length: int, *, fin: bool, compressed: bool, frame_max: int) -> int:
        """What a message's first frame reserves: its payload (what it may inflate to, when
        compressed; the whole message limit when more fragments follow), or 0 when that is small."""
        if not fin:
            n = frame_max
        elif compressed:
            n = min(frame_max, length * INFLATE_RATIO)
        else:
            n = length
        n = min(n, self.group_max_bytes)
        return n if n > INBOUND_FREE else 0

    def reserve(self, granted: Callable[[], None], group: str, n: int) -> bool:
        """Take `n` bytes for `group` now (True), or queue `granted` to be called once they are
        taken for it (False)."""
        if not self._queue_on_total and self._fits(group, n):
            self._take(group, n)
            return True
        self.waits += 1
        self._waiting[granted] = (group, n)
        return False

    def release(self, group: str, n: int) -> None:
        """Give back `n` bytes of `group` (the app took its message, or the connection is gone)."""
        if n <= 0:
            return
        self.held -= n
        left = self.groups.get(group, 0) - n
        if left > 0:
            self.groups[group] = left
        else:
            self.groups.pop(group, None)
        self._grant()

    def cancel(self, granted: Callable[[], None]) -> None:
        """A waiting connection is gone: forget it (and let those behind it pass)."""
        if self._waiting.pop(granted, None) is not None:
            self._grant()

    def _fits(self, group: str, n: int) -> bool:
        return self.held + n <= self.max_bytes and self.groups.get(group, 0) + n <= self.group_max_bytes

    def _take(self, group: str, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)
        self.groups[group] = self.groups.get(group, 0) + n

    def _grant(self) -> None:
        self._queue_on_total = False
        while self._waiting:
            # The next: of the groups with room in their share, the one holding least, and its first
            # come. In order of arrival alone, a credential's many sockets queued behind its own
            # holders took every reservation given back, wave after wave (each held up to
            # `INBOUND_MESSAGE_READ_S`), ahead of another credential's one frame.
            best: tuple[int, int, Callable[[], None], str, int] | None = None
            for i, (granted, (group, n)) in enumerate(self._waiting.items()):
                holds = self.groups.get(group, 0)
                if holds + n > self.group_max_bytes:
                    continue  # its own group is full: those of other groups go first
                if best is None or holds < best[0]:
                    best = (holds, i, granted, group, n)
            if best is None:
                return
            _, _, granted, group, n = best
            if self.held + n > self.max_bytes:
                self._queue_on_total = True  # it goes first once there is room: newcomers queue too
                return
            del self._waiting[granted]
            self._take(group, n)
            granted()
