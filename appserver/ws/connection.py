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

What a connection holds is more than its queue: the frame the writer task took and the bytes handed
to the socket's transport and not yet sent (`unsent`, the edge's write buffer). A non-reading
client's 8 MiB page left the queue at once and sat in the transport, uncounted, while a second one
queued: both the byte budget and the backpressure count all three (`Connection.held`). And one
connection's budget times 256 connections per credential times any number of credentials is no
bound for a server: `OutboundBudget` bounds what all connections hold together, and what the
connections of one credential (or address, as `connections_per_client` groups them) hold. A frame
that would pass either closes the connection whose client took the fewest bytes of late (4408, its
backlog dropped: a client that reads nothing never gets to a close frame behind it), and
while either is over half full, no further request is read from the clients concerned that hold
more than READ_ALLOWANCE themselves (backpressure, not a close): a client holding next to nothing
(a new one's `hello`, one that keeps up) is never held back by others that do not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import re
import secrets
import sys
import time
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


def _nothing() -> int:
    return 0


OUTBOUND_MAX_BYTES = 16 * 1024 * 1024  # `[limits] ws_outbound_max_bytes`'s default


class Outbound:
    """An ordered buffer of encoded frames with per-turn snapshot coalescing and a hard bound, in
    frames (`limit`) and in bytes (`max_bytes`; one frame above it is taken when nothing is queued)."""

    def __init__(
        self, limit: int, max_bytes: int = OUTBOUND_MAX_BYTES, outside: Callable[[], int] | None = None
    ) -> None:
        self.limit = max(1, limit)
        self.max_bytes = max(1, max_bytes)
        # what the connection holds past the queue (the frame being sent, its transport's unsent
        # bytes): the budget and `has_room` see it too
        self.outside = outside or _nothing
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
    def held(self) -> int:
        """Bytes queued, and held past the queue (in flight, unsent in the transport)."""
        return self.bytes + self.outside()

    @property
    def has_room(self) -> bool:
        """At most half the byte budget held: the client's next request may be read."""
        return self.held <= self.max_bytes // 2

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
        if others and self.held + growth > self.max_bytes:
            raise Overflow(f"outbound buffer full ({self.max_bytes} bytes): the client is not reading")

    def _take(self, entry: _Entry) -> None:
        if entry.turn_id is not None:
            self._by_turn[entry.turn_id] = entry
        self._entries.append(entry)
        self._live += 1
        self.bytes += entry.size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if self.bytes > self.max_bytes // 2:
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


OUTBOUND_TOTAL_MAX_BYTES = 256 * 1024 * 1024  # `[limits] ws_outbound_total_max_bytes`'s default
GROUP_SHARE = 4  # one credential's (or address's) connections together hold at most this share of the total
SWEEP_EVERY_S = 0.01  # what transports hold is read again at most this often when a bound is near
ROOM_POLL_FIRST_S = 0.005  # a held-back reader looks again after this, then twice as long each time…
ROOM_POLL_MAX_S = 0.25  # …up to this: transports drain without telling anyone
# A connection holding at most this (about what a socket its client reads holds: WS_UNSENT_MAX)
# has its next frame read however full its group or the server is: the budget stays bounded by
# evicting those that take nothing (`OutboundBudget.admit`), not by starving those that keep up.
READ_ALLOWANCE = 64 * 1024


# What a client took of late is a rate of bytes decaying with this time constant: a client that
# keeps reading holds a rate about its speed (between the window-sized steps in which a socket
# drains, a second or more apart for a slow one), one that stopped falls by e every TAKEN_TAU_S.
# What the transport holds shows those steps as they come; the kernel's unacknowledged bytes
# (SIOCOUTQ) would show no finer ones (the client's TCP acknowledges what its window lets in, and
# the window opens in the same steps), for a system call per look.
TAKEN_TAU_S = 10.0


class Charge:
    """What one connection holds of the server-wide budget (`OutboundBudget`), and how fast its
    client took bytes of late. It outlives its connection while the transport still holds bytes of
    it (a close waits behind them): `measure` then reads the transport alone, and nothing here
    refers to the connection any more."""

    __slots__ = ("group", "amount", "score", "taken", "since", "measure", "evict")

    def __init__(
        self, group: str, measure: Callable[[int | None], tuple[int, int]], evict: Callable[[str], None]
    ) -> None:
        self.group = group
        self.amount = 0  # as last measured
        # ln(the decaying rate of bytes its client took, at its last credit) + that time / TAKEN_TAU_S:
        # ordering charges by it orders them by their rates at any one moment, and it changes only
        # when a client takes bytes (no per-charge work as time passes). -inf: took nothing yet.
        self.score = -math.inf
        # bytes its client took not yet in `score` (a measure of each frame adds them; only one
        # that knows the time folds them in), and when the first of them was seen taken
        self.taken = 0
        self.since = 0.0
        # (bytes held now, bytes its client took since the last call); its argument: None right
        # after the connection wrote to its socket what a fall cannot be told apart from
        # (`Connection._look`), else 0
        self.measure = measure
        self.evict = evict  # close 4408 with this reason and drop what it holds

    def fold(self, now: float) -> None:
        """Add the bytes taken since `since` to the rate, as if taken evenly over that time: a
        look long after bytes left sees no burst, a look every few ms sees each step as it comes."""
        span = (now - self.since) / TAKEN_TAU_S
        gain = self.taken / TAKEN_TAU_S
        if span > 1e-9:
            gain *= -math.expm1(-span) / span
        rate = math.exp(self.score - now / TAKEN_TAU_S) if self.score > -math.inf else 0.0
        self.score = math.log(rate + gain) + now / TAKEN_TAU_S
        self.taken = 0


class OutboundBudget:
    """The bytes all WebSocket connections of a server hold for their clients (queued, being sent,
    unsent in their transports), bounded in total (`max_bytes`) and per group (`group_max_bytes`:
    a credential's connections, or an address's, as `connections_per_client` counts them).

    Amounts are measured when their connection queues, sends or writes, and all of them again
    (`sweep`) when a bound is near: a transport drains without telling anyone, so between two
    measures an amount may be too high, never too low for long. What left a transport other than
    by its connection's doing (a fall, and what the kernel took of a write at once: the socket
    takes only what the client's window lets through) is bytes its client took (`Charge.fold`).

    A frame that would pass a bound evicts, until it fits, the connection (in the group, or on the
    server; the asking one included) whose client took the fewest bytes of late (`Charge.score`):
    first those that took none (the one holding more first), then the slowest takers. Not the one
    holding the most, which was a client that reads everything and is sent big replies; and not
    the one stalled longest, since a reader's transport drains in window-sized steps about a
    second apart, and every connection opened since its last step looked younger than it. A frame
    alone is taken (over the bound by one frame at most)."""

    def __init__(self, max_bytes: int = OUTBOUND_TOTAL_MAX_BYTES, group_max_bytes: int | None = None) -> None:
        self.max_bytes = max(1, max_bytes)
        self.group_max_bytes = max(1, group_max_bytes or self.max_bytes // GROUP_SHARE)
        self.held = 0
        self.peak = 0  # the most all connections held together, as measured
        self.evictions = 0
        self.groups: dict[str, int] = {}
        self._holders: set[Charge] = set()  # charges holding anything
        self._swept = -math.inf

    def update(self, charge: Charge, amount: int, taken: int = 0, now: float | None = None) -> None:
        """`charge` holds `amount` bytes now, and its client took `taken` since the last measure;
        `now` (time.monotonic), when known: its score is brought up to date. The measure of a frame
        to a client that keeps up (whose bytes the socket takes at once) adds to a sum, no more."""
        if amount > 0 >= charge.amount:  # it begins to hold bytes (a burst, a big reply)
            now = time.monotonic() if now is None else now
            if charge.taken:
                charge.fold(now)  # what it took before, over the time it took it: not this burst's
        if taken > 0:
            if not charge.taken:
                charge.since = time.monotonic() if now is None else now
            charge.taken += taken
        if now is not None and charge.taken:
            charge.fold(now)
        growth = amount - charge.amount
        if not growth:
            return
        charge.amount = amount
        self.held += growth
        self.peak = max(self.peak, self.held)
        self._add(charge.group, growth)
        if amount > 0:
            self._holders.add(charge)
        else:
            self._holders.discard(charge)

    def _add(self, group: str, growth: int) -> None:
        left = self.groups.get(group, 0) + growth
        if left > 0:
            self.groups[group] = left
        else:
            self.groups.pop(group, None)

    def regroup(self, charge: Charge, group: str) -> None:
        """The connection's credential became known (its `hello`): its bytes count for that group."""
        self._add(charge.group, -charge.amount)
        charge.group = group
        self._add(group, charge.amount)

    def measure(self, charge: Charge, *, progress: bool = True, now: float | None = None) -> None:
        """Measure what `charge` holds; `progress`: False right after its connection wrote to its
        socket itself, where a fall is none of its client's doing."""
        amount, taken = charge.measure(0 if progress else None)
        self.update(charge, max(0, amount), taken, now)

    def sweep(self, *, now: float | None = None) -> None:
        """Measure every charge holding anything (at most every SWEEP_EVERY_S)."""
        now = asyncio.get_running_loop().time() if now is None else now
        if now - self._swept < SWEEP_EVERY_S:
            return
        self._swept = now
        seen = time.monotonic()
        for charge in list(self._holders):
            self.measure(charge, now=seen)

    def tight(self, group: str) -> bool:
        """Over half the total, or half the group's share: requests of that group wait (backpressure)."""
        return self.held > self.max_bytes // 2 or self.groups.get(group, 0) > self.group_max_bytes // 2

    def _over(self, group: str, growth: int) -> str | None:
        if self.groups.get(group, 0) + growth > self.group_max_bytes:
            return group
        if self.held + growth > self.max_bytes:
            return ""
        return None

    def admit(self, charge: Charge, growth: int) -> bool:
        """Make room for `growth` more bytes of `charge`'s connection: while they would pass a bound,
        the connection whose client took the fewest bytes of late (of the group over its share,
        else of the server; of two equal, the one holding more) is evicted. Each is measured again
        before it goes: one whose client took bytes since its last measure moves back in line.
        False: the asking one went (evicted too)."""
        over = self._over(charge.group, growth)
        if over is None:
            return True
        self.sweep()
        evicted: set[Charge] = set()
        looked: set[Charge] = set()  # measured in this call: their score is current
        line: list[tuple[float, int, int, Charge]] = []  # the candidates, the least taking first
        scope: str | None = None
        now = time.monotonic()
        while (over := self._over(charge.group, growth)) is not None:
            if over != scope:
                scope = over
                line = [
                    (c.score, -c.amount, id(c), c)
                    for c in self._holders
                    if c not in evicted and (not over or c.group == over)
                ]
                heapq.heapify(line)
            if not line:
                return True  # nothing else to let go of: a frame alone goes
            victim = heapq.heappop(line)[3]
            if victim.amount <= 0:
                continue
            if victim not in looked:
                looked.add(victim)
                self.measure(victim, now=now)
                if victim.amount > 0:
                    heapq.heappush(line, (victim.score, -victim.amount, id(victim), victim))
                continue
            evicted.add(victim)
            self.evictions += 1
            whose = "this credential's connections" if over else "the server's connections"
            limit = self.group_max_bytes if over else self.max_bytes
            victim.evict(f"slow consumer: {whose} hold over {limit} bytes not yet taken; this one took least lately")
            self.measure(victim, progress=False)  # (what its abort dropped is not taken)
            if victim is charge:
                return False
        return True

    def release(self, charge: Charge) -> None:
        self.update(charge, 0)


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
        unsent: Callable[[], int] | None = None,
        abort: Callable[[], None] | None = None,
        budget: OutboundBudget | None = None,
        address: str | None = None,
    ) -> None:
        """`unsent`: the bytes the socket's transport holds not yet sent; `abort`: drop them and the
        socket; `budget`: the server's (`OutboundBudget`), which this connection's bytes count in
        (grouped by its credential once known, by its `address` until then)."""
        self.id = f"wsc_{secrets.token_hex(6)}"
        self._principal: Principal | None = None
        self.client_name: str | None = None
        self.greeted = False
        self._unsent = unsent or _nothing
        self._abort = abort
        self._in_flight_bytes = 0  # the frame the writer task took, until the transport has it
        self._mark = 0  # what the transport held unsent at the last measure (`_look`)
        self.outbound = Outbound(outbound_max, outbound_max_bytes, self._outside)
        self.send_timeout_s = send_timeout_s
        self._send_text = send_text
        self._write_frame = write_frame
        self._in_flight = False  # the writer task took a frame and has not finished sending it
        self._address = address
        self.budget = budget
        self.charge = Charge(self._group(), self._look, self._evict) if budget is not None else None
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

    @property
    def principal(self) -> Principal | None:
        return self._principal

    @principal.setter
    def principal(self, principal: Principal | None) -> None:
        self._principal = principal
        if self.budget is not None and self.charge is not None:
            self.budget.regroup(self.charge, self._group())

    def _group(self) -> str:
        """Whose share of the server's budget this connection's bytes take: its credential's, else
        its address's (as `connections_per_client` groups connections: `security.limits.slot_key`)."""
        p = self._principal
        if p is not None and p.kind in ("token", "jwt"):
            return f"{p.kind}:{p.subject}"
        return f"address:{self._address}"

    @property
    def group(self) -> str:
        """Whose share of the server's budgets this connection takes (`_group`): the edge's inbound
        budget groups its big frames by it too (`security.asgi.greeted`)."""
        return self._group()

    # ------------------------------------------------------------ what it holds

    @property
    def held(self) -> int:
        """The bytes this connection holds for its client: queued, being sent, unsent in the transport."""
        return self.outbound.bytes + self._outside()

    def _outside(self) -> int:
        return self._in_flight_bytes + self._unsent()

    def _look(self, written: int | None = 0) -> tuple[int, int]:
        """The budget's measure (`Charge.measure`): what it holds, and what its client took since
        the last look: what left the transport (its queue changes by this connection's doing
        alone), the `written` bytes this connection wrote to it since included (what the kernel
        took of them at once, the client took: the socket takes only what its window lets in).
        None: it wrote what cannot be told apart from a fall (the writer task's frame, through
        the WebSocket protocol, of a size only that knows): no fall is counted."""
        unsent = self._unsent()
        fell = 0 if written is None else self._mark + written - unsent
        self._mark = unsent
        return self.outbound.bytes + self._in_flight_bytes + unsent, fell if fell > 0 else 0

    def _settle(self, written: int | None = 0) -> None:
        """Measure what it holds after a change of its own: a frame queued, replaced, or `written`
        to the transport (`_look`)."""
        budget, charge = self.budget, self.charge
        if budget is not None and charge is not None:
            held, taken = self._look(written)
            budget.update(charge, held, taken)

    def _before_send(self) -> None:
        """What the client took before the writer task sends a frame is counted first: after it,
        a fall can no longer be told from the frame's own growth (`_settle(None)`). Nothing can
        have fallen from an empty transport: then no look."""
        if self._mark:
            self._settle()

    def _admit(self, size: int) -> bool:
        """Room in the server's budget for a frame of `size` bytes (others may be evicted for it);
        False: this connection was the one to go."""
        if self.budget is None or self.charge is None:
            return True
        return self.budget.admit(self.charge, size)

    def _evict(self, reason: str) -> None:
        """Closed for the server's budget: its backlog is dropped at once, the transport's too (a
        client that reads nothing would never reach a close frame written behind it)."""
        self.kill(CLOSE_SLOW_CONSUMER, reason)
        if self._abort is not None:
            self._abort()

    def detach(self) -> None:
        """The endpoint is done: what the transport still holds keeps counting until it is sent or
        dropped, and nothing in the budget refers to this connection any more."""
        # Its queue measured what it holds past it through a method of this connection: a cycle
        # that kept every closed connection (its socket's protocol, scope, session) until a full
        # collection, which the server makes rare (cli/serve.py). Nothing is in flight any more.
        self.outbound.outside = self._unsent
        charge, budget = self.charge, self.budget
        if charge is None or budget is None:
            return
        self.charge = None
        charge.measure = _transport_look(self._unsent, self._mark)
        charge.evict = _aborter(self._abort)
        budget.measure(charge)

    async def wait_for_room(self) -> None:
        """Return once this client's next request may be read: its own bytes at most half its
        budget, and (with a server budget) neither its group nor the server over half theirs, or
        it holds at most READ_ALLOWANCE itself. Transports drain without telling anyone: looked
        at again, less often the longer it waits."""
        pause = ROOM_POLL_FIRST_S
        while not self.outbound.closed and not self._may_read():
            if self.outbound.has_room:
                await asyncio.sleep(pause)
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self.outbound.wait_for_room()
            pause = min(pause * 2, ROOM_POLL_MAX_S)

    def _may_read(self) -> bool:
        budget, charge = self.budget, self.charge
        if budget is not None and charge is not None:
            budget.measure(charge)
            # Others' bytes hold back only a connection holding some itself: 40 local clients that
            # read nothing held every new local client's `hello` unread until it was closed 4401,
            # and every request of clients that keep up, for the 30 s until they were closed.
            if charge.amount > READ_ALLOWANCE and budget.tight(charge.group):
                budget.sweep()
                if budget.tight(charge.group):
                    return False
        return self.outbound.has_room

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
        if self.outbound.closed or not self._admit(sys.getsizeof(text)):
            return
        if (written := self._write_now(text, frame)) is not None:
            self._settle(written)
            return
        try:
            self.outbound.put(text)
        except Overflow as exc:
            self.kill(CLOSE_SLOW_CONSUMER, str(exc))
        self._settle()

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
        if self.outbound.closed or not self._admit(sys.getsizeof(text)):
            return
        if (written := self._write_now(text, frame)) is not None:
            self._settle(written)
            return
        try:
            self.outbound.put_snapshot(turn_id, text)
        except Overflow as exc:
            self.kill(CLOSE_SLOW_CONSUMER, str(exc))
        self._settle()

    def _write_now(self, text: str, frame: bytes | None) -> int | None:
        """Write the frame to the socket now if nothing is queued ahead of it nor held by the writer
        task (a frame it took while the socket was paused: the socket may take frames again before
        the task has run) and the socket takes it as it is: the bytes written, else None."""
        if self._write_frame is None or self._in_flight or not self.outbound.empty or self.close_request is not None:
            return None
        if frame is None:
            try:
                frame = text_frame(text.encode())
            except UnicodeEncodeError:  # the writer task sends an error in its place
                return None
        if not self._write_frame(frame):
            return None
        self.sent += 1
        return len(frame)

    def kill(self, code: int, reason: str, *, flush: bool = False) -> None:
        """Ask the endpoint to close this connection (idempotent); `flush` lets queued frames go first."""
        if self.close_request is None:
            reason = close_reason(reason)
            # A connection that never authenticated is any client's: the guard logs its close
            # among its bounded refusals (security/ws_session.py), not here once per socket.
            level = logging.INFO if self._principal is not None else logging.DEBUG
            log.log(level, "closing websocket %s: %s %s", self.id, code, reason)
            self.close_request = (code, reason)
        self.outbound.close(drop=not flush)
        self.closing.set()
        self._settle()

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
            self._in_flight_bytes = sys.getsizeof(text)  # out of the queue, not yet in the transport
            self._before_send()
            try:
                await self._send_in_time(text)
            except TimeoutError:
                self.kill(
                    CLOSE_SLOW_CONSUMER,
                    f"slow consumer: the client took no byte of its frames for {self.send_timeout_s:g} s",
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
                self._in_flight_bytes = 0
                self._settle(None)
            self.sent += 1

    async def _send_in_time(self, text: str) -> None:
        """Send one frame, timed by progress: `send_timeout_s` is how long the client may take no
        byte, not how long a frame may wait behind earlier ones still draining (a steady 70 KB/s
        reader of two 10 MB pages was closed once the second page had waited 30 s behind the first)."""
        async with asyncio.timeout(self.send_timeout_s) as deadline:  # no task per frame, unlike wait_for
            progress = _Progress(self._unsent, deadline, self.send_timeout_s) if self._unsent() > 0 else None
            try:
                try:
                    await self._send_text(text)
                except UnicodeEncodeError:  # nothing was written: the frame failed, not the socket
                    log.error("websocket %s: a frame could not be encoded as UTF-8; sent an error instead", self.id)
                    await self._send_text(_unsendable(text))
            finally:
                if progress is not None:
                    progress.cancel()


CLOSE_REASON_MAX_BYTES = 123  # RFC 6455 §5.5: a control frame's 125 bytes, less the code's 2


def close_reason(reason: str) -> str:
    """A close reason that fits its frame (`Connection.kill`): cut to CLOSE_REASON_MAX_BYTES of
    UTF-8, never inside a character. Cut by characters, "é"×120 (240 bytes) made the close fail
    and the client saw 1006 instead of 4401."""
    data = reason.encode("utf-8", "replace")  # (a lone surrogate, which cannot go out: `?`)
    return data[:CLOSE_REASON_MAX_BYTES].decode("utf-8", "ignore")  # a cut character's bytes: dropped


PROGRESS_CHECKS = 4  # how often a waiting send looks for progress, per send timeout


class _Progress:
    """Moves a waiting send's deadline on each time the transport's unsent bytes went down."""

    __slots__ = ("_unsent", "_deadline", "_timeout_s", "_loop", "_last", "_handle")

    def __init__(self, unsent: Callable[[], int], deadline: asyncio.Timeout, timeout_s: float) -> None:
        self._unsent = unsent
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._last = unsent()
        self._handle = self._loop.call_later(timeout_s / PROGRESS_CHECKS, self._check)

    def _check(self) -> None:
        if self._deadline.expired():
            return
        now = self._unsent()
        if now < self._last:
            self._deadline.reschedule(self._loop.time() + self._timeout_s)
        self._last = now
        self._handle = self._loop.call_later(self._timeout_s / PROGRESS_CHECKS, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


def _transport_look(unsent: Callable[[], int], mark: int) -> Callable[[int | None], tuple[int, int]]:
    """A detached charge's measure (`Connection._look`, the transport alone: nothing writes to it)."""
    last = mark

    def look(written: int | None) -> tuple[int, int]:
        nonlocal last
        now = unsent()
        fell = 0 if written is None else last - now
        last = now
        return now, fell if fell > 0 else 0

    return look


def _aborter(abort: Callable[[], None] | None) -> Callable[[str], None]:
    """A detached charge's eviction: drop what its transport still holds."""

    def evict(reason: str) -> None:
        if abort is not None:
            abort()

    return evict
