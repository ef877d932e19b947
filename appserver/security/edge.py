"""The HTTP/1.1 connection edge: limits and timeouts that must hold before any request reaches the app.

uvicorn's httptools protocol (chosen explicitly by `serve`, never "auto") accepts a request head of
any size and times out nothing but an idle keep-alive gap after a response. This subclass adds, per
connection and before any auth work:

* a cap on the request line + headers (`head_max_bytes`, 431 beyond);
* a head timeout: the head must be complete within `head_timeout_s` of its first byte (408);
* a body-progress timeout: a body that stops arriving for `body_timeout_s` ends the request (408
  if nothing was answered yet; the app sees a disconnect), and so does one that, once it has taken
  longer than that, averages under `body_min_rate_bytes_s` since it began;
* caps on a chunked body's framing, which the guard's `body_max_bytes` (decoded bytes) never sees:
  a chunk-size line (chunk extensions included) of at most `CHUNK_LINE_MAX_BYTES` (400), and at most
  `body_wire_max` bytes on the wire for the whole body (413);
* an idle timeout (`keepalive_timeout_s`) on a fresh connection before its first byte, as uvicorn
  already does between requests;
* a send timeout (`send_timeout_s`): a client that takes no byte of a reply waiting for it (more
  than the low-water mark unsent, or anything once a close was asked for, since a close waits for
  the buffer to drain) is aborted, and the requests on it see a disconnect (`PassWrites`);
* a global connection cap counted at accept (`max_connections`, default derived from the fd
  limit): beyond it a connection gets an immediate 503 and is closed, so descriptors never run out;
  but a newcomer may first take the slot of a connection that has not authenticated yet (no request
  of it, nor its WebSocket's `hello`, carried a valid credential: the guard says when one does,
  `asgi.PROVE`), when that is fair (`fair_slots.SlotGate`), so one client trickling heads, or
  sending refused requests on keep-alive connections, or holding un-greeted WebSockets, cannot hold
  every slot;
* under TLS, the same from the accept, before the handshake, which must be done within
  `head_timeout_s` (`TlsAcceptProtocol`: the edge does the handshake itself).

Pipelining (several requests on a connection before their replies) keeps replies in order:

* a refusal never overtakes a reply in flight: a request refused behind pipelined ones is answered
  after their replies, which get the refused phase's timeout to finish (`_hold_refusal`);
* neither does a WebSocket upgrade: it waits for the replies before it (`_defer_upgrade`);
* a client that goes away disconnects every request in flight, running or queued
  (`_disconnect_all`), and a connection the edge cuts without an answer is aborted, not closed after
  a flush that a client that never reads would hold open (`_hang_up`);
* a head split across reads counts only its own bytes (`_head_bytes_in`), and a body's clocks stop
  while the app is not reading it: queued, or before its `100 Continue` (`_BodyFlow`).

Plus `AcceptErrorThrottle`, which keeps asyncio's "accept out of system resource" error (logged in a
hot loop once descriptors do run out) to one line per interval.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto as sslproto
import contextlib
import contextvars
import fcntl
import json
import logging
import re
import resource
import socket
import ssl
import struct
import sys
import termios
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame
from websockets.http11 import Response as WsResponse
from websockets.protocol import State as WsState
from websockets.utils import apply_mask

from appserver.config import LimitsConfig
from appserver.http.errors import error_body, new_request_id
from appserver.http.sse import WRITE_BODY
from appserver.security.asgi import GREETED, PROVE
from appserver.security.fair_slots import EVICTION_GRACE_S, Evictable, SlotGate, client_group
from appserver.security.ws_inbound import (
    DRAIN_CHECK_S,
    DRAIN_RATE_MIN,
    INBOUND_FREE,
    INBOUND_MESSAGE_READ_S,
    INFLATE_RATIO,
    OP_BINARY,
    OP_TEXT,
    PREHELLO_MESSAGE_MAX,
    InboundBudget,
    frame_head,
    inflated_within,
)
from appserver.ws.connection import WRITE_FRAME

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application, ASGISendEvent

log = logging.getLogger("appserver.edge")

ACCEPT_ERROR_PREFIX = "socket.accept() out of system resource"
# asyncio schedules a retry per failed accept (up to `backlog` per wakeup); once the listening
# socket is closed, each retry fails again with its own traceback.
ACCEPT_RETRY_PREFIX = "Exception in callback BaseSelectorEventLoop._start_serving"


class LogThrottle:
    """At most one notice per `interval_s`; counts what it held back so the next notice says so."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self.suppressed = 0

    def allow(self) -> tuple[bool, int]:
        """(emit now?, how many were held back since the last emitted one)."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return False, 0
        self._last, held = now, self.suppressed
        self.suppressed = 0
        return True, held


REFUSALS_LOGGED = 10  # refusal lines written per interval; the rest are counted
REFUSAL_LOG_INTERVAL_S = 10.0
# A client's text in a refusal line (a path, a header quoted by an error): this many characters of
# it (`refusals.shown`).
TEXT_SHOWN = 120


class RefusalLines:
    """Log lines of refusals, bounded in rate: any client can be refused as fast as it sends (one
    line per bad WebSocket handshake wrote ~360 KiB/s of log). The first `per_interval` lines of
    each interval are logged; the others are counted, and the count is logged once the interval
    is over (or at `flush`). One per server: `serve` hands the guard's (`refusals.RefusalLog`) to
    the edge (`EdgeLimits.from_config`), so the edge's lines and the guard's share the limit (two
    limits let a mixed flood write twice the lines)."""

    def __init__(
        self,
        logger: logging.Logger,
        per_interval: int = REFUSALS_LOGGED,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
    ) -> None:
        self.logger = logger
        self.per_interval = per_interval
        self.window = LogThrottle(interval_s)  # lets one call per interval through: a new interval
        self.logged = 0
        self.held = 0
        self._timer: asyncio.TimerHandle | None = None

    def line(self, level: int, msg: str, *args: object, logger: logging.Logger | None = None) -> None:
        """Log this refusal's line (on `logger`, else this one's) if the interval allows, else count it."""
        if self.window.allow()[0]:
            self.flush()
            self.logged = 0
        if self.logged < self.per_interval:
            self.logged += 1
            (logger or self.logger).log(level, msg, *args)
            return
        self.held += 1
        if self._timer is None:
            self._arm()

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a direct call): the next interval's first refusal says it
            return
        # in a context of its own: the line is no request's (the one that armed it had its id set)
        self._timer = loop.call_later(self.window.interval_s, self.flush, context=contextvars.Context())

    def flush(self) -> None:
        """Log how many refusals were not logged, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.held:
            self.logger.info(
                "%d more refused request(s) were not logged (at most %d are logged every %g s)",
                self.held,
                self.per_interval,
                self.window.interval_s,
            )
            self.held = 0


class AcceptErrorThrottle(logging.Filter):
    """On the `asyncio` logger: asyncio logs EMFILE on accept once per pending connection, every
    retry (92 MB of log in 30 s was measured), and each retry scheduled then fails with a traceback
    after the listener closes; one line per interval (per kind) says the same."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.throttles = {ACCEPT_ERROR_PREFIX: LogThrottle(interval_s), ACCEPT_RETRY_PREFIX: LogThrottle(interval_s)}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if not msg.startswith(("socket.", "Exception in callback")):
            return True
        for prefix, throttle in self.throttles.items():
            if msg.startswith(prefix):
                emit, held = throttle.allow()
                if emit and held:
                    record.msg = f"{msg}\n({held} more like this in the last {throttle.interval_s:g} s were not logged)"
                    record.args = None
                return emit
        return True


def raise_fd_limit(ceiling: int = 1 << 20) -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (at most `ceiling`), as Go's runtime does
    at start: every client connection and every model call in flight holds a descriptor, and many
    systems start processes with a soft limit of 1,024 under a much higher hard one. (before, after)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(ceiling, hard if hard != resource.RLIM_INFINITY else ceiling)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def fd_limit() -> int:
    """The soft limit on open file descriptors of this process."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(configured: int, nofile: int | None = None) -> int:
    """`max_connections`, or (0) three quarters of the fd limit less 32: the rest stays free for the
    store, logs, upstream model calls and the gateway, so accept never fails with EMFILE."""
    if configured > 0:
        return configured
    n = fd_limit() if nofile is None else nofile
    return max(8, n * 3 // 4 - 32)


def accept_backlog(max_connections: int, nofile: int | None = None) -> int:
    """The listen backlog for a server capped at `max_connections`. asyncio takes it also as how
    many connections to accept in one go, each a descriptor before any protocol (and so the cap)
    sees it: a burst of 300 connects at a cap of 160 under an fd limit of 256 reached the limit.
    The loop takes about three passes to show an accepted connection to its protocol, and accepts
    again in each: at most a quarter of the descriptors the cap leaves free is accepted in one go
    (uvicorn's 2048 where there are plenty, or where the cap is at or above the fd limit anyway)."""
    n = fd_limit() if nofile is None else nofile
    if max_connections >= n:
        return 2048
    return max(16, min(2048, (n - max_connections) // 4))


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    head_max_bytes: int
    head_timeout_s: float
    body_timeout_s: float
    body_min_rate: int
    keepalive_timeout_s: float
    max_connections: int
    send_timeout_s: float = 30.0
    body_max_bytes: int = 20 * 1024 * 1024
    refusals: LogThrottle = field(default_factory=LogThrottle, compare=False)
    # the lines of the refusals the edge answers itself (bad heads, bad WebSocket handshakes) and of
    # what connections that never authenticated do (`EdgeSlot.say`): the guard's, in `serve`
    refusal_lines: RefusalLines = field(default_factory=lambda: RefusalLines(log), compare=False)
    # the connections that may give up their slot at the cap, and the throttle of that notice
    slots: SlotGate = field(default_factory=SlotGate, compare=False)
    evictions: LogThrottle = field(default_factory=LogThrottle, compare=False)
    # TLS connections accepted whose handshake is not done (`TlsAcceptProtocol`): counted by the cap
    handshakes: set[Any] = field(default_factory=set, compare=False)
    # big WebSocket frames read and not yet taken by the app, all connections together (ws_inbound.py)
    inbound: InboundBudget = field(default_factory=InboundBudget, compare=False)
    # how long a WebSocket message may hold some of `inbound` until the app takes it (ws_inbound.py)
    ws_message_read_s: float = INBOUND_MESSAGE_READ_S

    @property
    def body_wire_max(self) -> int:
        """The most bytes a chunked body may take on the wire, its framing included: the decoded
        limit, as much again for framing (a chunk of ~10 bytes of data or more on average), and
        one chunk-size line."""
        return 2 * self.body_max_bytes + CHUNK_LINE_MAX_BYTES

    @classmethod
    def from_config(cls, limits: LimitsConfig, refusal_lines: RefusalLines | None = None) -> EdgeLimits:
        """The limits of `[limits]`; `refusal_lines`: the server's one refusal limit (the guard's),
        else one of the edge's own."""
        return cls(
            head_max_bytes=int(limits.head_max_bytes),
            head_timeout_s=float(limits.head_timeout_s),
            body_timeout_s=float(limits.body_timeout_s),
            body_min_rate=int(limits.body_min_rate_bytes_s),
            keepalive_timeout_s=float(limits.keepalive_timeout_s),
            max_connections=connection_cap(int(limits.max_connections)),
            send_timeout_s=float(limits.send_timeout_s),
            body_max_bytes=int(limits.body_max_bytes),
            slots=SlotGate(grace_s=min(EVICTION_GRACE_S, float(limits.head_timeout_s) / 2)),
            refusal_lines=refusal_lines if refusal_lines is not None else RefusalLines(log),
            inbound=InboundBudget.for_frames(int(limits.ws_frame_max_bytes)),
        )


def raw_error(status: int, code: str, message: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[bytes, str]:
    """A complete `Connection: close` response with an OpenAI error body, written by the protocol
    itself (no request reached the app); → (bytes, its request id)."""
    rid = new_request_id()
    body = json.dumps(error_body(status, message, code=code)).encode()
    lines = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
        b"x-request-id: " + rid.encode() + b"\r\n",
        *(name + b": " + value + b"\r\n" for name, value in extra),
        b"\r\n",
        body,
    ]
    return b"".join(lines), rid


class _HeadTooLarge(Exception):
    pass


class _TooManyPipelined(Exception):
    pass


# What a refusal quotes of a transfer coding it names (a token, maybe with `;name=value` parameters):
# anything else is shown as `?`, as the message goes into the server's log as well.
CODING_UNSHOWN = re.compile(r"[^A-Za-z0-9!#$%&*+.^_`|~;= -]")


class _UnappliedCoding(Exception):
    """A request's `Transfer-Encoding` names a coding besides `chunked` (`codings`, as sent)."""

    def __init__(self, codings: list[str]) -> None:
        super().__init__(", ".join(codings))
        self.codings = codings


def unapplied_codings(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The transfer codings of a request's `Transfer-Encoding` fields (all of them, in order, as one
    list: RFC 9110 §5.3) that this server does not undo: every one but `chunked`. llhttp parses a
    body whose last coding is `chunked` and leaves the others on it, so a `gzip, chunked` body
    would reach the app still compressed, or be taken as it is when it was not; `identity` is no
    coding any more (RFC 9112 dropped it from the registry) and is refused with the rest. Empty
    list elements (`, chunked`) are no coding (RFC 9110 §5.6.1). Empty when the last is not
    `chunked`: the body's length is then unknown, which llhttp refuses (400, RFC 9112 §6.3)."""
    split = (c.strip() for name, value in headers if name == b"transfer-encoding" for c in value.split(b","))
    codings = [c for c in split if c]
    if not codings or codings[-1].lower() != b"chunked":
        return []
    return [c.decode("latin-1") for c in codings if c.lower() != b"chunked"]


# Requests a client may send ahead of their replies on one connection (pipelining). Each one parsed
# is a queued request (its scope, headers, cycle) until its turn: a client that sends thousands in
# one write and never reads a reply held all of them in memory.
PIPELINE_MAX = 64


LINGER_S = 2.0
LINGER_MAX_BYTES = 1 << 20
# The header of a refusal that answers the same to the same request, which the OpenAI SDKs would
# otherwise retry (they retry any 5xx): a 501.
NOT_RETRIED = ((b"x-should-retry", b"false"),)
# What a client may send after a pipelined WebSocket upgrade head before its 101 (RFC 6455: nothing).
UPGRADE_EARLY_MAX_BYTES = HIGH_WATER_LIMIT
# The kernel's unsent bytes of a WebSocket, at most (TCP_NOTSENT_LOWAT; see `limit_unsent`).
WS_UNSENT_MAX = 64 * 1024
# What a WebSocket client may send while it leaves the server's writes untaken (its pongs, ...).
WS_READ_WHILE_BLOCKED = 1 << 20
# With permessage-deflate: bytes of a read given to the parser at a time (EdgeWebSocketProtocol._feedable).
# Deflate inflates at most ~1032×, so a slice holds at most a frame or two that inflate to the
# frame limit.
WS_INFLATE_SLICE = 4096
# What a WebSocket's messages may bring its app (inflated) before the app's next `receive` lets the
# event loop run others (EdgeWebSocketProtocol.receive): 64 frames of 4 KB that each inflated to
# 4 MiB, in one socket read, were inflated and handled in one task step (~1.4 s), and every other
# client of the server waited for it.
WS_STEP_BYTES = 1 << 20
# What a WebSocket may have read and not given to its parser (`_unfed`): a read (256 KiB) comes only
# while it may be fed or while a frame head is incomplete, so this is a safety net, never reached.
WS_UNFED_MAX = 1 << 20

# A chunk-size line, its chunk extensions included (Node.js allows 16 KiB of extensions): httptools
# reports none of it, so a body of one endless extension decoded to 0 bytes, passed every size limit
# and, arriving fast, the minimum rate too.
CHUNK_LINE_MAX_BYTES = 16 * 1024
# How often, at most, a body's average rate is judged once it is due (`_next_body_check`).
BODY_RATE_TICK_S = 1.0

# Where the parser is in the current message.
IDLE, HEAD, BODY = 0, 1, 2


# Linux's SIOCOUTQ (= TIOCOUTQ): the bytes a TCP socket holds that its peer has not acknowledged.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform.startswith("linux") else None
# How often a stalled send is looked at, per `send_timeout_s`: a stall is cut within 1¼ of it.
SEND_CHECKS = 4


class PassWrites:
    """A connection's transport whose writes made in one event-loop pass go out as one send.

    uvicorn writes a reply's head and its body separately, and on loopback a send costs about as
    much CPU as a small request's JSON work: combined, every small reply is one send instead of
    two. The first write of a pass is held and the rest appended; the whole goes out when the pass
    ends (`call_soon`), or at once when the connection is closed or handed on, so nothing waits
    longer than the pass that wrote it.

    It also bounds how long a client that does not read can hold the connection (`send_timeout_s`,
    0 = never): while the transport's buffer stays above its low-water mark (a reply blocked on
    flow control, or one complete but not taken), or any byte of it stays unsent after a close was
    asked for (a close waits for the buffer to drain), the client must take bytes: past
    `send_timeout_s` without one, the connection is aborted, its buffer dropped, and the protocol's
    `connection_lost` disconnects the requests on it. Taken means acknowledged by the client's TCP
    (`_taken`), not time passing: a slow reader moves it at every window it opens. An empty buffer
    (an SSE stream waiting for a slow model) is never timed. `watch_open` (the HTTP protocol's)
    turns the check of an open connection off once it is handed to the WebSocket protocol, which
    has its own (`ws_send_timeout_s`, pings); a close is watched for both. One timer at most, only
    while stalled; `release` (from `connection_lost`) cancels it.
    """

    __slots__ = (
        "raw",
        "_loop",
        "_held",
        "sent",
        "send_timeout_s",
        "watch_open",
        "_closing",
        "_watch",
        "_mark",
        "_since",
        "_under",
        "slot",
    )

    def __init__(self, raw: asyncio.Transport, loop: asyncio.AbstractEventLoop, send_timeout_s: float = 0.0) -> None:
        self.raw = raw
        self._loop = loop
        self._held: list[bytes] | None = None
        self.sent = 0  # bytes handed to the transport
        self.send_timeout_s = send_timeout_s
        self.watch_open = True
        self._closing = False  # a close (or EOF) was asked for: every byte must still leave
        self._watch: asyncio.TimerHandle | None = None
        self._mark = 0  # bytes the client had taken at the last progress
        self._since = 0.0  # when that was
        # Under TLS (asyncio's), the socket's own transport: a reply written at once is encrypted
        # straight into its buffer, which the TLS transport's size does not count.
        self._under: asyncio.Transport | None = getattr(getattr(raw, "_ssl_protocol", None), "_transport", None)
        # the connection's place (`EdgeHttpProtocol._begin`): its abort is logged by `EdgeSlot.say`
        self.slot: EdgeSlot | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            held.append(bytes(data))
            return
        if self.raw.is_closing():
            self.sent += len(data)
            self.raw.write(data)  # asyncio's own handling of a write after close
            return
        self._held = [bytes(data)]
        self._loop.call_soon(self.flush)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            data = held[0] if len(held) == 1 else b"".join(held)
            self.sent += len(data)
            self.raw.write(data)
            if self._watch is None and self.send_timeout_s > 0 and self._stalled():
                self._arm()

    def write_now(self, data: bytes) -> None:
        """Write at once, after anything held: for a message complete by itself (a WebSocket frame
        fanned out to many connections), where waiting for the loop's next pass joins nothing."""
        held = self._held
        if held is not None:
            held.append(data)
            self.flush()  # the pass's scheduled flush then finds nothing held
            return
        self.sent += len(data)
        self.raw.write(data)
        if self._watch is None and self.send_timeout_s > 0 and self._stalled():
            self._arm()

    def close(self) -> None:
        self._closing = True
        self.flush()
        self.raw.close()
        if self._watch is None and self.send_timeout_s > 0 and self._stalled():
            self._arm()

    def abort(self) -> None:
        self._held = None
        self.release()
        self.raw.abort()

    def write_eof(self) -> None:
        self._closing = True
        self.flush()
        self.raw.write_eof()
        if self._watch is None and self.send_timeout_s > 0 and self._stalled():
            self._arm()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size() + sum(map(len, self._held or ()))

    def release(self) -> None:
        """Stop watching for good (the connection is gone): the timer, and its reference to this, go."""
        self.send_timeout_s = 0.0  # nothing arms it again (uvicorn closes a lost transport once more)
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # ── the send timeout ──────────────────────────────────────────────────────────────────────

    def _stalled(self) -> bool:
        """Whether what waits in the transport is the client's to take: anything, once a close
        was asked for; above the low-water mark (where flow control blocks a reply) otherwise."""
        size = self._buffered()
        if size <= 0:
            return False
        if self._closing:
            return True
        return self.watch_open and size > self.raw.get_write_buffer_limits()[0]

    def _buffered(self) -> int:
        under = self._under
        try:
            size = self.raw.get_write_buffer_size()
            return size if under is None else size + under.get_write_buffer_size()
        except AttributeError:  # asyncio's TLS transport, once its connection is lost
            return 0

    def _arm(self) -> None:
        self._mark = self._taken()
        self._since = self._loop.time()
        self._watch = self._loop.call_later(self.send_timeout_s / SEND_CHECKS, self._check)

    def _check(self) -> None:
        self._watch = None
        if not self._stalled():  # drained (below low water), or the connection is gone
            return
        now = self._loop.time()
        taken = self._taken()
        if taken > self._mark:
            self._mark, self._since = taken, now
        elif now - self._since >= self.send_timeout_s * 0.999:  # timers may fire a tick early
            peer = self.raw.get_extra_info("peername")
            say = self.slot.say if self.slot is not None else log.log
            say(
                logging.INFO,
                "%s took no byte of its reply for %g s ([limits] send_timeout_s), %d bytes unsent: "
                "aborting the connection",
                f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client",
                self.send_timeout_s,
                self._buffered(),
            )
            sock = self.raw.get_extra_info("socket")
            if sock is not None:  # a reset: the kernel drops what it holds for the client too
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.abort()  # the protocol's connection_lost disconnects what runs on it
            return
        tick = self.send_timeout_s / SEND_CHECKS
        self._watch = self._loop.call_later(min(tick, self._since + self.send_timeout_s - now), self._check)

    def taken(self) -> int:
        """Bytes the client has taken (`_taken`): how fast it reads (EdgeWebSocketProtocol `_drained`)."""
        return self._taken()

    def written(self) -> int:
        """Bytes written so far, held ones included: where in the stream the next write starts, so
        that `taken` tells when the client has had a write (EdgeWebSocketProtocol `_pong_deferred`)."""
        return self.sent + sum(map(len, self._held or ()))

    def _taken(self) -> int:
        """Bytes the client has taken: handed over, less what the transport still holds and what
        the kernel holds unacknowledged (Linux; elsewhere what left the transport)."""
        return self.sent - self._buffered() - self._unacked()

    def _unacked(self) -> int:
        if _OUTQ is None:
            return 0
        sock = self.raw.get_extra_info("socket")
        try:
            fd = sock.fileno() if sock is not None else -1
            if fd < 0:
                return 0
            return int(struct.unpack("i", fcntl.ioctl(fd, _OUTQ, b"\0\0\0\0"))[0])
        except (OSError, ValueError, AttributeError):
            return 0

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, set_protocol, …
        return getattr(self.raw, name)


class _BodyFlow(FlowControl):
    """uvicorn's flow control of one connection, which also tells the edge when the app asks for the
    request body: its `receive` resumes reading (and first sends `100 Continue` if one is due), and
    so does the end of the reply a queued request waited for. Until then the client cannot send the
    body (reading is paused, or it waits for the 100), so the body's clocks must not run."""

    def __init__(self, transport: asyncio.Transport, on_body_wanted: Callable[[], None]) -> None:
        super().__init__(transport)
        self.expecting = False  # the request being read waits for a `100 Continue`
        self._on_body_wanted: Callable[[], None] | None = on_body_wanted

    def resume_reading(self) -> None:
        if self.read_paused or self.expecting:
            if self._on_body_wanted is not None:
                self._on_body_wanted()
        super().resume_reading()

    def release(self) -> None:
        """Call back no more (the connection is gone)."""
        self._on_body_wanted = None


def limit_unsent(transport: asyncio.BaseTransport) -> None:
    """Keep at most `WS_UNSENT_MAX` bytes not yet sent in the kernel's buffer of a WebSocket.

    A turn's snapshots go out as whole texts and a newer one replaces an older one still queued
    (ws/connection.py), but only while it is queued here: the kernel's send buffer grows to
    megabytes for a slow reader, and every snapshot already in it is delivered, and every ping waits
    behind them. A reader of 20 KB/s was minutes behind and was cut by its own keepalive. With the
    unsent part small, the socket stops taking frames early and the queue keeps only the latest."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_NOTSENT_LOWAT"):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, WS_UNSENT_MAX)
    except OSError:  # not TCP (a Unix socket), or a kernel without it: the buffer stays as it was
        pass


def _close_delimited(cycle: RequestResponseCycle) -> None:
    """HTTP/1.0 has no chunked encoding, and a server must not send it to a 1.0 client (RFC 9112
    §7.1; nginx proxies as 1.0 by default): uvicorn would, for every reply of unknown length (the
    streams). Such a reply goes out as it is written and ends when the connection closes, which a
    1.0 reply always does. The cycle's own length check is given the last write's length, so its
    bookkeeping ends the reply as for one of known length."""
    send = cycle.send
    unbounded = False

    async def send_to_http10(message: ASGISendEvent) -> None:
        nonlocal unbounded
        if message["type"] == "http.response.start":
            named = {name.lower() for name, _ in message.get("headers", [])}
            if (
                not named & {b"content-length", b"transfer-encoding"}
                and cycle.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
            ):
                unbounded = True
                cycle.chunked_encoding = False  # (None would make uvicorn add chunked)
                cycle.expected_content_length = _UNBOUNDED_LENGTH
        elif unbounded and message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_to_http10  # type: ignore[method-assign]


_UNBOUNDED_LENGTH = 1 << 62


def peer_group(transport: asyncio.BaseTransport) -> str:
    """The `client_group` of a connection's peer."""
    peer = transport.get_extra_info("peername")
    host = peer[0] if isinstance(peer, tuple) and peer and isinstance(peer[0], str) else None
    return client_group(host)


def body_writer(cycle: RequestResponseCycle) -> Callable[[bytes], bool]:
    """The `WRITE_BODY` scope extension of a request: `write_body(piece)` writes a piece of its
    streamed body now (a chunk of the chunked encoding), as the cycle's `send` would, if the
    connection takes it as it is: the reply has begun, is chunked and not complete (so it is the
    one on the wire), its client is there and flow control does not hold it. Asked for by an SSE
    stream for each token (`appserver/http/sse.py`): a token costs no task switch of the stream's
    and no pass of the loop. False: it did nothing (`send` is the way then). It holds the cycle
    weakly: the scope that holds it makes no reference cycle with its request or connection."""
    ref = weakref.ref(cycle)

    def write_body(body: bytes) -> bool:
        c = ref()
        if (
            c is None
            or c.chunked_encoding is not True
            or not c.response_started
            or c.response_complete
            or c.disconnected
            or c.flow.write_paused
        ):
            return False
        transport: Any = c.transport  # PassWrites, in serve
        if transport.is_closing():
            return False
        data = b"%x\r\n%b\r\n" % (len(body), body)
        if isinstance(transport, PassWrites):
            transport.write_now(data)
        else:
            transport.write(data)
        return True

    return write_body


class EdgeSlot:
    """A connection's place in the `SlotGate` until it authenticates (`prove`, called by the guard
    through the `asgi.PROVE` scope extension); it follows the connection from HTTP to WebSocket.

    And how the edge logs what the connection does (`say`): until it authenticated, any client can
    make it happen on as many connections as it opens, so through the server's refusal limit."""

    __slots__ = ("gate", "conn", "unproven", "authenticated", "lines")

    def __init__(self, gate: SlotGate, conn: Evictable, group: str, lines: RefusalLines) -> None:
        self.gate = gate
        self.conn: Evictable | None = conn
        self.unproven = True  # evictable: not authenticated, nor evicted or gone
        self.authenticated = False
        self.lines = lines
        gate.admitted(self, group)

    def evict(self, reason: str) -> None:
        self.unproven = False
        if self.conn is not None:
            self.conn.evict(reason)

    def prove(self) -> None:
        if self.unproven:
            self.unproven = False
            self.authenticated = True
            self.gate.proven(self)

    def say(self, level: int, msg: str, *args: object) -> None:
        """Log a line about this connection (its parts a client chose, bounded by the caller): as
        it is once a request or `hello` of it authenticated, else as a refusal line (bounded in
        rate, `RefusalLines`)."""
        if self.authenticated:
            log.log(level, msg, *args)
        else:
            self.lines.line(level, msg, *args, logger=log)

    def gone(self) -> None:
        self.unproven = False
        self.gate.gone(self)
        self.conn = None  # the protocol holds its slot: no cycle left for the collector to find


class EdgeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; `protocol_class` binds the limits."""

    limits: ClassVar[EdgeLimits]
    ws_class: ClassVar[type[EdgeWebSocketProtocol] | None] = None  # EdgeWebSocketProtocol bound to them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ws_class is not None and self.ws_protocol_class is EdgeWebSocketProtocol:
            self.ws_protocol_class = self.ws_class  # its refusal lines share the limits' bound
        self.timeout_keep_alive = self.limits.keepalive_timeout_s  # type: ignore[assignment]
        self._phase = IDLE
        self._head_raw = 0  # bytes of the current head in the reads that ended inside it
        self._head_began = False  # the current head began in the read being parsed
        self._head_parsed = 0  # bytes of its request line and complete header lines
        self._last_data = 0.0
        self._body_clock = self._body_checked = 0.0  # when the body began (less time not read)
        self._body_bytes = 0
        self._chunked = False  # the body being read is chunked
        self._chunk_line: int | None = None  # bytes of the chunk-size line being read, if in one
        self._body_wire = 0  # bytes of the chunked body on the wire so far (`_check_chunk_framing`)
        self._head_ended = False  # a head ended in the read being parsed
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._linger_left: int | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._running: RequestResponseCycle | None = None  # the request whose app runs (one at a time)
        self._held_refusal: tuple[int, str, str] | None = None  # a refusal waiting for the replies before it
        self._held_timer: asyncio.TimerHandle | None = None
        self._upgrade_early: bytearray | None = None  # an upgrade waits for replies; what came after it
        self._body_flow: _BodyFlow  # set by connection_made, before any byte is parsed
        self._slot: EdgeSlot  # set by connection_made: evictable at the cap until it authenticates
        # under TLS, the socket's protocol, which admitted the connection at its accept
        self._tls_accept: TlsAcceptProtocol | None = None

    # ── connection ────────────────────────────────────────────────────────────────────────────

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._tls_accept is not None:  # a TLS handshake done: admitted at its accept already
            self._begin(transport, self._tls_accept.handshake_done())
            return
        group = peer_group(transport)
        if self._at_cap(group):
            self._refused = True
            self.transport = transport
            data, _ = raw_error(
                503,
                "server_busy",
                f"the server has {self.limits.max_connections} connections open, "
                "its limit ([limits] max_connections); retry shortly",
                ((b"retry-after", b"1"),),
            )
            transport.write(data)
            transport.close()
            return
        self._begin(transport, EdgeSlot(self.limits.slots, self, group, self.limits.refusal_lines))

    def _at_cap(self, group: str) -> bool:
        """Whether a connection accepted now must be refused: the cap is reached (TLS connections
        still in their handshake count, `TlsAcceptProtocol`) and no connection that never
        authenticated gave up its slot to it (`_made_room`); the refusal is logged, at most once per
        interval."""
        limits = self.limits
        # Evicted connections are still in `connections` (or `handshakes`) until their
        # `connection_lost`, a loop pass later; their slots are free already.
        open_now = len(self.connections) + len(limits.handshakes) - limits.slots.leaving
        if open_now < limits.max_connections or self._made_room(group):
            return False
        emit, held = limits.refusals.allow()
        if emit:
            more = f" ({held} more since the last notice)" if held else ""
            log.warning(
                "connection limit %d reached: refusing new connections with 503 (under TLS: closed at accept)%s",
                limits.max_connections,
                more,
            )
        return True

    def _begin(self, transport: asyncio.Transport, slot: EdgeSlot) -> None:
        """Serve an admitted connection (its TLS handshake done, if any); `slot` is its place in the
        `SlotGate`, evictable until it authenticates."""
        super().connection_made(transport)
        writes = PassWrites(transport, self.loop, self.limits.send_timeout_s)
        writes.slot = slot
        self.transport = writes  # type: ignore[assignment]
        self.flow = self._body_flow = _BodyFlow(transport, self._body_wanted)
        slot.conn = self
        self._slot = slot
        # uvicorn arms its keep-alive timer only after a response; a fresh connection gets it too.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _made_room(self, group: str) -> bool:
        """At the cap: whether a connection that never authenticated gave up its slot to this
        newcomer (`SlotGate.make_room`); logged at most once per interval."""
        cap = self.limits.max_connections
        eviction = self.limits.slots.make_room(
            group,
            f"the server has {cap} connections open, its limit ([limits] max_connections), and this one "
            "had not authenticated (no request with a valid credential yet): its slot went to a newer "
            "connection; retry shortly",
        )
        if eviction is None:
            return False
        emit, held = self.limits.evictions.allow()
        if emit:
            more = f" ({held} more since the last notice)" if held else ""
            log.warning(
                "connection limit %d reached: closed a connection from %s that had not authenticated "
                "in %.1f s (%d such from it) to admit one from %s%s",
                cap,
                eviction.victim_group,
                eviction.victim_age_s,
                eviction.victim_group_unproven,
                group,
                more,
            )
        return True

    def evict(self, reason: str) -> None:
        """Give up this connection's slot at once (`SlotGate.make_room`; it never authenticated): a
        503 and closed, or aborted when something is still owed to it (replies it has not taken,
        one under way); a request of it still running (a refused one's answer, a public path) sees
        a disconnect. Never lingered: its descriptor is free within a loop pass, so evictions never
        hold more descriptors than the cap allows. Not logged here: `_made_room` logs at most one
        line per interval, however many are evicted."""
        self._cancel_timers()
        self._disconnect_all()
        self._linger_left = LINGER_MAX_BYTES  # whatever still arrives is dropped
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() > 0 or self._replying():
            # Answered already (a 400, a 408, lingering), replies its client has not taken, or a
            # reply under way: a close would wait for the client to take them, its descriptor held
            # past the cap. Go now.
            transport.abort()
            return
        # Nothing is owed to it: the 503 says why (a client whose request was still on its way
        # gets an answer, not a reset).
        transport.write(raw_error(503, "server_busy", reason, ((b"retry-after", b"1"),))[0])
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._slot.gone()
        self._cancel_timers()
        for timer in (self._linger_timer, self._held_timer):
            if timer is not None:
                timer.cancel()
        self._linger_timer = self._held_timer = None
        self._upgrade_early = None
        cast(PassWrites, self.transport).release()  # its send timeout's timer
        self._disconnect_all()
        super().connection_lost(exc)
        # The flow control calls back into this protocol: a reference cycle that would keep the
        # connection's last request (scope, reply, what it references) until a full collection,
        # which the server makes rare (cli/serve.py). Nothing reads from it after this.
        self._body_flow.release()
        self._running = None

    def _replying(self) -> bool:
        """A response on this connection has begun and is not complete."""
        cycle = self._running
        return cycle is not None and cycle.response_started and not cycle.response_complete

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._linger_left is not None:  # refused (answered, or held for replies before it): drop the rest
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self._hang_up()
            return
        if self._upgrade_early is not None:  # an upgrade waits for the replies before it
            self._keep_early(data)
            return
        self._unset_keepalive_if_required()
        if self._phase == BODY and self._chunk_line is not None and not self._chunk_line_fits(data):
            return
        self._head_ended = False  # set by on_headers_complete, if a head ends in this read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._cancel_timers()
            if not self._should_upgrade():
                self._unsupported_upgrade_warning()
                return
            rest = data[upgrade.args[0] :]  # what follows the upgrade head is the WebSocket's
            if self.cycle is not None and not self.cycle.response_complete:
                self._defer_upgrade(rest)
            else:
                self._upgrade(rest)
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse_head()
            elif isinstance(exc.__context__, _UnappliedCoding):
                self._refuse_coding(exc.__context__.codings)
            elif isinstance(exc.__context__, _TooManyPipelined):
                self._close_with(
                    429,
                    "too_many_pipelined_requests",
                    f"more than {PIPELINE_MAX} requests queued behind the one being answered on one connection; "
                    "read the replies, or open another connection",
                )
            else:
                self._refusal_line(logging.WARNING, "Invalid HTTP request received.", logger=self.logger)
                self.send_400_response("Invalid HTTP request received.")
            return
        phase = self._phase
        if phase == HEAD:
            # Inside a header line httptools buffers without calling back: count raw bytes too.
            if self._head_began:
                self._head_began = False
                self._head_raw = self._head_bytes_in(data)
            else:
                self._head_raw += len(data)
            if self._head_raw > self.limits.head_max_bytes:
                self._refuse_head()
                return
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._on_head_timeout)
        elif phase == BODY:
            if self._chunked and not self._check_chunk_framing(data):
                return
            self._last_data = self.loop.time()
            self._body_bytes += len(data)
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._on_body_timeout)

    def _chunk_line_fits(self, data: bytes) -> bool:
        """Before a read is parsed, inside a chunk-size line that began in an earlier read: the
        line ends at the read's first LF (it holds none: the parser ends it there, or fails), and
        it may not grow past the cap; refused otherwise (False)."""
        end = data.find(b"\n")
        line = cast(int, self._chunk_line) + (len(data) if end < 0 else end)
        if line <= CHUNK_LINE_MAX_BYTES:
            return True
        self._refuse_chunk_line()
        return False

    def _check_chunk_framing(self, data: bytes) -> bool:
        """After a read was parsed inside a chunked body: count its wire bytes (all of it, except
        in the read where the head ended, which is not counted at all: at most one read under) and
        the chunk-size line it ends in, if any (what follows its last LF); refuse either past its
        cap (False). A whole line between two LFs of one read is bounded by the read, and counts
        towards the body's wire bytes."""
        if not self._head_ended:
            self._body_wire += len(data)
        wire_max = self.limits.body_wire_max
        if self._body_wire > wire_max:
            self._close_with(
                413,
                "request_too_large",
                f"the chunked request body exceeds {wire_max} bytes on the wire, its framing included "
                "(twice [limits] body_max_bytes, plus one chunk-size line)",
            )
            return False
        if self._chunk_line is not None:
            last = data.rfind(b"\n")
            self._chunk_line = self._chunk_line + len(data) if last < 0 else len(data) - last - 1
            if self._chunk_line > CHUNK_LINE_MAX_BYTES:
                self._refuse_chunk_line()
                return False
        return True

    def _refuse_coding(self, codings: list[str]) -> None:
        """501 and close (RFC 9112 §6.1: a transfer coding the server does not understand), before
        the body is read: its framing is the client's coding, which nothing here undoes."""
        shown = ", ".join(f"'{CODING_UNSHOWN.sub('?', c[:40])}'" for c in codings[:4])
        self._close_with(
            501,
            "unsupported_transfer_encoding",
            f"the request's Transfer-Encoding has {shown}, which this server does not apply: send the body "
            "with Transfer-Encoding: chunked alone, or with a Content-Length",
        )

    def _refuse_chunk_line(self) -> None:
        self._close_with(
            400,
            "chunk_extension_too_long",
            f"a chunk-size line of the request body (its chunk extensions included) exceeds "
            f"{CHUNK_LINE_MAX_BYTES} bytes",
        )

    def _head_bytes_in(self, data: bytes) -> int:
        """The bytes of `data` from the start of the head being parsed, which began inside it (after
        requests before it in the same read, which are not its bytes). The head is found by its URL
        so far, which `on_url` reported as a slice of `data`: its last occurrence, since an earlier
        one may be in a body before the head; a later one, in the head's own header values, only
        undercounts this read, and the reads after it count in full."""
        url = self.url
        if not url:  # the read ended in the method
            return 0
        at = data.rfind(url)
        return len(data) - at + len(self.parser.get_method()) + 1 if at >= 0 else len(data)

    def handle_websocket_upgrade(self) -> None:
        # The WebSocket protocol writes through the same `PassWrites`: a reply to a request sent
        # before the upgrade on this connection may still be held, and must go out before the 101.
        # Its send timeout keeps watching a close; an open WebSocket has its own (ws_send_timeout_s).
        self._cancel_timers()
        cast(PassWrites, self.transport).watch_open = False
        limit_unsent(self.transport)
        super().handle_websocket_upgrade()
        slot = self._slot
        ws = self.transport.get_protocol()
        if isinstance(ws, EdgeWebSocketProtocol):
            ws.take_slot(slot)  # evictable until its `hello` authenticates, if it has not yet
        elif slot.unproven:  # not ours (a test's bare uvicorn): nothing would ever free the slot
            slot.gone()

    def shutdown(self) -> None:
        # the server stops: the count of the refusal lines not logged yet, which its timer would say
        self.limits.refusal_lines.flush()
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return
        if self._behind_a_reply():
            self._cancel_timers()
            self._hold_refusal(400, "invalid_http", msg)
            return
        data, _ = raw_error(400, "invalid_http", msg)
        self.transport.write(data)
        self._linger_close()

    # ── parser callbacks ──────────────────────────────────────────────────────────────────────

    def on_message_begin(self) -> None:
        self._phase = HEAD
        self._head_raw = self._head_parsed = 0
        self._head_began = True
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        # The whole request line: METHOD SP url SP HTTP/1.1 CRLF (the method is parsed by now);
        # a URL that arrives in pieces calls this once per piece.
        line = 0 if self._head_parsed else len(self.parser.get_method()) + len(b"  HTTP/1.1\r\n")
        self._count_head(line + len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > self.limits.head_max_bytes:
            raise _HeadTooLarge()

    def on_headers_complete(self) -> None:
        self._count_head(2)  # the empty line that ends the head
        if len(self.pipeline) >= PIPELINE_MAX:
            raise _TooManyPipelined()
        unapplied = unapplied_codings(self.headers)
        if unapplied:
            raise _UnappliedCoding(unapplied)
        if self._slot.unproven:  # the guard proves it if this request authenticates
            cast(dict[str, Any], self.scope)["extensions"] = {PROVE: self._slot.prove}
        if self.url[:1] != b"/":
            self._authority_from_target()
        self._phase = BODY
        self._head_ended = True
        self._body_clock = self._body_checked = self.loop.time()
        self._body_bytes = self._body_wire = 0
        # llhttp takes a request with any Transfer-Encoding only when its last coding is chunked
        self._chunked = any(name == b"transfer-encoding" for name, _ in self.headers)
        self._chunk_line = 0 if self._chunked else None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body_flow.expecting = self.expect_100_continue
        super().on_headers_complete()

    def _authority_from_target(self) -> None:
        """A request target in absolute form (`GET http://host/path`, as clients send to proxies)
        names its host itself, and the Host header is then to be ignored (RFC 9112 §3.2.2): the
        target's authority replaces it, so the host check judges the host the request is for."""
        try:
            url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # uvicorn refuses it
        if not url.host:
            return
        host = b"[" + url.host + b"]" if b":" in url.host else url.host
        authority = host if url.port is None else host + b":" + str(url.port).encode()
        self.headers[:] = [(n, v) for n, v in self.headers if n != b"host"]
        self.headers.append((b"host", authority))

    def on_chunk_header(self) -> None:
        """A chunk-size line is complete (the last chunk's too: its trailers count with the head
        towards `head_max_bytes`, and on the wire towards `body_wire_max`)."""
        self._chunk_line = None

    def on_chunk_complete(self) -> None:
        """A chunk's data and its CRLF are in: the next chunk-size line begins."""
        self._chunk_line = 0

    def on_message_complete(self) -> None:
        self._phase = IDLE
        self._chunked = False
        self._chunk_line = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # ── replies ───────────────────────────────────────────────────────────────────────────────

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        # uvicorn keeps only the newest cycle (`self.cycle`, maybe still queued); a refusal held
        # for the replies before it must know the one being written, to cut it if it never ends.
        self._running = cycle
        if cycle.scope["http_version"] == "1.0":
            _close_delimited(cycle)
        scope = cast(dict[str, Any], cycle.scope)
        extensions = scope.get("extensions")
        if extensions is None:
            extensions = scope["extensions"] = {}
        extensions[WRITE_BODY] = body_writer(cycle)
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next queued request, if any
        if (self._held_refusal is None and self._upgrade_early is None) or self.transport.is_closing():
            return
        if self._running is None or not self._running.response_complete:  # more replies before it
            if self._upgrade_early is not None:
                self.flow.pause_reading()  # resumed to start the next one; the upgrade still waits
            return
        # The last reply before the refusal or the upgrade is complete.
        self._unset_keepalive_if_required()
        # Called from inside the last reply's task: run outside its context, so the refusal's log
        # line (or the WebSocket session's task) does not carry that request's id.
        if self._held_refusal is not None:
            status, code, message = self._held_refusal
            self._held_refusal = None
            if self._held_timer is not None:
                self._held_timer.cancel()
                self._held_timer = None
            contextvars.Context().run(self._answer, status, code, message)
        elif self._upgrade_early is not None:
            contextvars.Context().run(self._upgrade, bytes(self._upgrade_early))

    def _body_wanted(self) -> None:
        """The app asks for the body being read (`_BodyFlow`): from now the client can send it, so
        the stall clock restarts, and the time until now does not count against the rate."""
        cycle = self.cycle
        if cycle is None or not cycle.waiting_for_100_continue:  # its 100 Continue is out (or not due)
            self._body_flow.expecting = False
        if self._phase != BODY:
            return
        now = self.loop.time()
        self._body_clock += now - self._body_checked
        self._body_checked = self._last_data = now

    # ── WebSocket upgrades ────────────────────────────────────────────────────────────────────

    def _defer_upgrade(self, rest: bytes) -> None:
        """A WebSocket upgrade pipelined behind a request whose reply is not complete: a 101 now
        would land in the middle of that reply, and the session's frames with it. Parse nothing
        more; upgrade once the replies before it are complete (`on_response_complete`), as if it
        had been sent then. No timeout: like a queued request, it lasts as long as those replies.
        What the client sends meanwhile (RFC 6455: nothing, until the 101) is kept for the
        WebSocket protocol, up to UPGRADE_EARLY_MAX_BYTES."""
        self._phase = IDLE
        self._upgrade_early = bytearray()
        self._keep_early(rest)

    def _keep_early(self, data: bytes) -> None:
        """Keep bytes that came after a waiting upgrade head, and read no more for now; past the
        cap, this is no WebSocket client: cut the connection."""
        early = cast(bytearray, self._upgrade_early)
        early += data
        if len(early) > UPGRADE_EARLY_MAX_BYTES:
            self._refusal_line(
                logging.INFO,
                "%s sent %d bytes before the answer to its WebSocket upgrade: closing",
                self._peer(),
                len(early),
            )
            self._hang_up()
            return
        self.flow.pause_reading()  # an app's `receive` resumes it; what comes is kept

    def _upgrade(self, rest: bytes) -> None:
        """Hand the connection to the WebSocket protocol, with what the client sent after the
        upgrade head (uvicorn drops it)."""
        self._upgrade_early = None
        self.handle_websocket_upgrade()
        self.flow.resume_reading()  # paused while the upgrade waited; the WebSocket reads now
        if rest:
            cast(asyncio.Protocol, self.transport.get_protocol()).data_received(rest)
        self._handed_over()

    def _handed_over(self) -> None:
        """This protocol's part ends at the upgrade: the socket's protocol is the WebSocket's now,
        and this one's `connection_lost` never comes. Its parser and flow control call back into
        it: reference cycles that kept every WebSocket's upgrade request (its protocol, scope and
        slot) until a full collection, which the server makes rare (cli/serve.py)."""
        self._body_flow.release()
        self.parser = None  # type: ignore[assignment]  # as uvicorn's connection_lost does

    # ── refusals ──────────────────────────────────────────────────────────────────────────────

    def _close_with(self, status: int, code: str, message: str) -> None:
        """Answer (when the wire is free for an answer) and close the connection; a request
        pipelined behind a reply in flight is answered once that reply is complete."""
        self._cancel_timers()
        if self.transport.is_closing():
            return
        if self._behind_a_reply():
            self._hold_refusal(status, code, message)
            return
        cycle = self.cycle
        if self._phase == BODY:  # the current request's cycle: answer unless its response began
            free = cycle is not None and not cycle.response_started
        else:  # a new head: `cycle` is the previous request's, whose response must be complete
            free = cycle is None or cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # what the app still sends goes nowhere; its receive says disconnect
            cycle.message_event.set()
        if free:
            self._answer(status, code, message)
        else:
            self._refusal_line(
                logging.INFO, "%s from %s: closing a connection whose response had started", message, self._peer()
            )
            self._hang_up()

    def _answer(self, status: int, code: str, message: str) -> None:
        """Write the refusal and close."""
        data, rid = raw_error(status, code, message, NOT_RETRIED if status == 501 else ())
        self.transport.write(data)
        self._refusal_line(logging.INFO, "[%s] %s from %s: %d %s", rid, message, self._peer(), status, code)
        self._linger_close()

    def _behind_a_reply(self) -> bool:
        """Whether the request being refused was pipelined behind one whose reply is not complete."""
        cycle = self.cycle
        if cycle is None:
            return False
        if self._phase == BODY:  # the refused request's own cycle: still queued behind a running one?
            return bool(self.pipeline) and self.pipeline[0][0] is cycle
        return not cycle.response_complete  # a new head: `cycle` is the previous request's

    def _hold_refusal(self, status: int, code: str, message: str) -> None:
        """Answering now would cut off the replies to requests accepted before the refused one
        (pipelining): read no more requests (what arrives is dropped, as while lingering), let those
        replies finish in order, then answer (`on_response_complete`). They get the refused phase's
        timeout (`head_timeout_s`, or `body_timeout_s` for a body) to finish; past it the connection
        is closed without the answer, as before, so a reply that never ends holds nothing forever."""
        if self._phase == BODY:  # the refused request is queued: it never runs
            self.pipeline.popleft()
        self._held_refusal = (status, code, message)
        self._linger_left = LINGER_MAX_BYTES
        wait_s = self.limits.body_timeout_s if self._phase == BODY else self.limits.head_timeout_s
        self._held_timer = self.loop.call_later(wait_s, self._on_held_timeout, wait_s)

    def _on_held_timeout(self, wait_s: float) -> None:
        self._held_timer = None
        if self._held_refusal is None or self.transport.is_closing():
            return
        _, _, message = self._held_refusal
        self._refusal_line(
            logging.INFO,
            "%s from %s: closing, a reply before it did not finish within %g s",
            message,
            self._peer(),
            wait_s,
        )
        self._hang_up()

    def _hang_up(self) -> None:
        """Cut the connection without an answer: replies still in flight are cut and their apps
        see a disconnect. An abort: what waits unsent is thrown away, where a close would first wait
        for the client to take it, forever if it never reads (the connection, and its slot, held)."""
        self._disconnect_all()
        self.transport.abort()

    def _disconnect_all(self) -> None:
        """Every request in flight on this connection sees the client gone: its `receive` says
        disconnect and what it still sends goes nowhere. uvicorn tells only its newest cycle, which
        may be one queued behind the running one (or refused, never to run): the running app would
        stream into the closed socket forever, its client's slot held."""
        for cycle in (self._running, self.cycle, *(c for c, _ in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def _linger_close(self) -> None:
        """Close after an error answer without losing it. Closing with unread input makes the
        kernel reset the connection, and a reset can discard the answer before the client reads
        it; so stop writing (FIN), drop what still arrives (at most LINGER_MAX_BYTES, for at most
        LINGER_S), then close. The client's own close ends it sooner."""
        self._cancel_timers()
        self._linger_left = LINGER_MAX_BYTES
        self.flow.resume_reading()
        if not self.transport.can_write_eof():  # TLS: no half-close; close at once
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _refusal_line(self, level: int, msg: str, *args: object, logger: logging.Logger = log) -> None:
        """The line of a request or connection the edge refuses or cuts: any client can be refused as
        fast as it sends, so through the server's refusal limit (its parts a client chose, bounded by
        the caller: here only the peer's address, counts and the edge's own messages)."""
        self.limits.refusal_lines.line(level, msg, *args, logger=logger)

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn's, unbounded: one WARNING per request asking for any upgrade but WebSocket (h2c…),
        # which any client can send as fast as it likes. A refusal line instead.
        self._refusal_line(logging.WARNING, "Unsupported upgrade request.", logger=self.logger)

    def _refuse_head(self) -> None:
        self._close_with(
            431,
            "request_header_fields_too_large",
            f"the request line and headers exceed {self.limits.head_max_bytes} bytes ([limits] head_max_bytes)",
        )

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self._phase != HEAD or self.transport.is_closing():
            return
        if self.flow.read_paused:  # a pipelined head waits for the response before it: not its fault
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._on_head_timeout)
            return
        self._close_with(
            408,
            "request_timeout",
            f"the request head did not arrive within {self.limits.head_timeout_s:g} s ([limits] head_timeout_s)",
        )

    def _on_body_timeout(self) -> None:
        """The body's check: a stall (no byte for `body_timeout_s`), or a trickle (`_too_slow`),
        ends the request with 408; else the next check is armed (`_next_body_check`)."""
        self._body_timer = None
        if self._phase != BODY or self.transport.is_closing():
            return
        cycle = self.cycle
        timeout = self.limits.body_timeout_s
        waiting = self.flow.read_paused or (
            cycle is not None and cycle.waiting_for_100_continue and not cycle.response_complete
        )
        now = self.loop.time()
        if waiting:  # time the app is not reading counts neither as a stall nor against the rate
            self._body_clock += now - self._body_checked
        self._body_checked = now
        if waiting:
            self._body_timer = self.loop.call_later(timeout, self._on_body_timeout)
            return
        quiet = now - self._last_data
        if quiet >= timeout * 0.999:  # timers may fire a tick early
            self._close_with(
                408,
                "request_timeout",
                f"the request body stalled: no bytes for {timeout:g} s ([limits] body_timeout_s)",
            )
            return
        if self._too_slow(now):
            rate = self.limits.body_min_rate
            self._close_with(
                408,
                "request_timeout",
                f"the request body arrives slower than {rate} bytes/s on average ([limits] body_min_rate_bytes_s)",
            )
            return
        self._body_timer = self.loop.call_later(self._next_body_check(now, quiet), self._on_body_timeout)

    def _too_slow(self, now: float) -> bool:
        """A trickle (a byte just before every body timeout) would hold a slot forever: once the
        body has taken `body_timeout_s`, it must average `body_min_rate` bytes a second since it
        began (less the time the app was not reading)."""
        rate = self.limits.body_min_rate
        elapsed = now - self._body_clock
        return rate > 0 and elapsed >= self.limits.body_timeout_s * 0.999 and self._body_bytes < rate * elapsed

    def _next_body_check(self, now: float, quiet: float) -> float:
        """Seconds until the body could be stalled (no byte since, for `body_timeout_s`) or, with
        nothing more arriving, under its minimum average (judged from `body_timeout_s` on); the
        latter at most once per `BODY_RATE_TICK_S`, so a body just above the rate wakes no loop
        pass after pass, and a trickle is cut within a tick of falling under."""
        timeout = self.limits.body_timeout_s
        stall_in = timeout - quiet
        rate = self.limits.body_min_rate
        if rate <= 0:
            return stall_in
        rate_due = self._body_clock + max(timeout, self._body_bytes / rate)
        return min(stall_in, max(rate_due - now, min(BODY_RATE_TICK_S, timeout / 4)))


class TlsAcceptProtocol(asyncio.BufferedProtocol):
    """The protocol of a TLS connection's socket, from its accept: counted by the cap and timed
    from then on, its TLS done by asyncio's TLS protocol (`sslproto.SSLProtocol`, the one
    `create_server(ssl=…)` and `start_tls` use) under it, and then its `EdgeHttpProtocol`.

    With `create_server(ssl=…)` the edge saw a connection only once its handshake was done: one
    that never sent a ClientHello was neither counted by the cap nor timed (asyncio's 60 s handshake
    timeout only), and a few hundred ran the server out of descriptors, every client locked out. So
    the listener is plain TCP and this protocol, made at accept, checks the cap as the HTTP protocol
    does (`EdgeLimits.handshakes` counts it; at the cap, when no connection that never
    authenticated gives up its slot, it is closed at once: no 503 can be written before a
    handshake), takes an evictable place in the `SlotGate`, and starts the TLS protocol at once,
    with `head_timeout_s` for the handshake. It stays the socket's protocol, passing every call to
    the TLS protocol (which passes the decrypted bytes to the HTTP protocol): so it hears when the
    socket is gone before the handshake is done, which the TLS protocol tells nobody. (`start_tls`
    would do the same from a task a loop pass later, and uvloop reads a new socket whatever its
    protocol asked: the ClientHello went to the wrong protocol.) The HTTP protocol's
    `connection_made`, once the handshake is done, takes over the place (`_tls_accept`)."""

    limits: ClassVar[EdgeLimits]
    http_class: ClassVar[type[EdgeHttpProtocol]]
    tls: ClassVar[ssl.SSLContext]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.http = self.http_class(*args, **kwargs)  # uvicorn's arguments (config, server_state, …)
        self.raw: asyncio.Transport | None = None
        self.ssl: asyncio.BufferedProtocol | None = None
        self.slot: EdgeSlot | None = None  # while the handshake is under way

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = cast(asyncio.Transport, transport)
        group = peer_group(raw)
        if self.http._at_cap(group):
            raw.abort()
            return
        self.raw = raw
        self.limits.handshakes.add(self)
        self.slot = EdgeSlot(self.limits.slots, self, group, self.limits.refusal_lines)
        self.http._tls_accept = self
        # (no waiter: the HTTP protocol's connection_made says the handshake is done; typeshed
        # wants one, and an int timeout)
        self.ssl = tls = cast(Any, sslproto.SSLProtocol)(
            self.http.loop,
            self.http,
            self.tls,
            None,
            server_side=True,
            ssl_handshake_timeout=self.limits.head_timeout_s,
        )
        tls.connection_made(raw)

    def handshake_done(self) -> EdgeSlot:
        """The HTTP protocol's connection begins (`EdgeHttpProtocol.connection_made`): its place."""
        slot = cast(EdgeSlot, self.slot)
        self.slot = None
        self.limits.handshakes.discard(self)
        return slot

    def evict(self, reason: str) -> None:
        """Give up the place of a connection still in its handshake (`SlotGate.make_room`)."""
        if self.raw is not None:
            self.raw.abort()  # connection_lost frees it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ssl is not None:
            self.ssl.connection_lost(exc)  # the HTTP protocol's own, if its connection began
        if self.slot is not None:  # the handshake was not done: failed, timed out, evicted, or gone
            self.limits.handshakes.discard(self)
            self.slot.gone()
            self.slot = None
        self.raw = self.ssl = None
        self.http._tls_accept = None

    # the socket's calls, for the TLS protocol

    def get_buffer(self, sizehint: int) -> Any:
        return cast(asyncio.BufferedProtocol, self.ssl).get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        cast(asyncio.BufferedProtocol, self.ssl).buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return cast(asyncio.BufferedProtocol, self.ssl).eof_received()

    def pause_writing(self) -> None:
        if self.ssl is not None:
            self.ssl.pause_writing()

    def resume_writing(self) -> None:
        if self.ssl is not None:
            self.ssl.resume_writing()


def protocol_class(limits: EdgeLimits, tls: ssl.SSLContext | None = None) -> type[asyncio.Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to these limits; with `tls`,
    the listener is plain TCP and the edge does the handshake (`TlsAcceptProtocol`): give uvicorn
    no certificate then."""
    ws = type(
        "BoundEdgeWebSocketProtocol",
        (EdgeWebSocketProtocol,),
        {"refusal_lines": limits.refusal_lines, "inbound": limits.inbound, "message_read_s": limits.ws_message_read_s},
    )
    http = type("BoundEdgeHttpProtocol", (EdgeHttpProtocol,), {"limits": limits, "ws_class": ws})
    if tls is None:
        return http
    return type("BoundTlsAcceptProtocol", (TlsAcceptProtocol,), {"limits": limits, "http_class": http, "tls": tls})


WS_SHUTDOWN_DRAIN_S = 2.0  # how long a stop waits for a WebSocket client to take its close


class EdgeWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (the one "auto" picks) whose own handshake refusals (a bad
    `Sec-WebSocket-Version`, a missing `Sec-WebSocket-Key`, a 500 before accept) carry an
    `x-request-id` and the OpenAI error JSON like every other answer. Responses the app made
    (accepts, the guard's refusals) already carry their id and are left alone. Their log lines
    are bounded by `refusal_lines` (`protocol_class` binds the server's)."""

    refusal_lines: ClassVar[RefusalLines | None] = None
    inbound: ClassVar[InboundBudget | None] = None  # the server's (`protocol_class` binds it)
    message_read_s: ClassVar[float] = INBOUND_MESSAGE_READ_S  # (`protocol_class` binds the server's)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot: EdgeSlot | None = None  # upgraded without a credential: evictable until `hello`
        self._origin: EdgeSlot | None = None  # the connection's place, evictable or not: its lines (_say)
        self._writes_blocked = False  # over the high-water mark: see pause_writing
        self._inflates = bool(self.config.ws_per_message_deflate)  # see _feedable
        self._unfed = bytearray()  # read from the socket, not yet given to the parser (_pump)
        self._read_while_blocked = 0  # bytes read from the client since then
        # ── what is read, and when (`_pump`) ──
        # The frame limit (`ws_max_size`); before `hello` the parser's is PREHELLO_MESSAGE_MAX.
        self._message_max: int | None = self.conn.max_message_size
        if self._message_max is None or self._message_max > PREHELLO_MESSAGE_MAX:
            self.conn.max_message_size = PREHELLO_MESSAGE_MAX
        self._greeted = False  # the app accepted its `hello` (`_greet`)
        self._group = ""  # whose share of the inbound budget its big frames take (given with the hello)
        self._handling = False  # before `hello`: the app took a message and has not asked for the next
        self._frame_left = 0  # payload bytes of the frame being fed that the parser has not had yet
        self._frame_first = 0  # that frame's first byte (FIN, RSV bits, opcode)
        self._compressed = False  # the message being fed is compressed (RSV1 on its first frame)
        self._message_reserved = 0  # inbound budget reserved for the message being fed
        self._message_since = 0.0  # …since when
        # (bytes, since) of the inbound budget for each message fed whole: until the parser has
        # given it to uvicorn (`_ended`: its real size is known then), then until the app takes it
        self._ended: deque[tuple[int, float]] = deque()
        self._reserved: deque[tuple[int, float]] = deque()
        self._wanted = 0  # what it waits for, while it waits for the budget (`_waiting`)
        self._granted = 0  # what the budget gave it while it waited, for the frame head next in `_unfed`
        self._granted_since = 0.0
        self._waiting = False
        self._read_timer: asyncio.TimerHandle | None = None  # the oldest reservation it holds (`_held_too_long`)
        self._handed = 0  # bytes of messages given to the app since its `receive` last let others run
        self._pong_overdue = False  # its keepalive ping timed out while it waited for the budget
        # A keepalive ping written behind bytes the client had not taken yet (`_pong_deferred`): where
        # it ends in the stream (0: it was behind nothing), when the client last took bytes ahead of
        # it and how many it had taken then, and when it was seen taken itself.
        self._ping_end = 0
        self._ping_progress = (0.0, 0)
        self._ping_reached: float | None = None
        self._frame_gated = False  # the frame being fed inflates only once the inflate gate lets it
        self._gate_wait = False  # it waits for the inflate gate (`_inflate_admitted`)
        self._gate_pass = False  # the gate let it through: its next gated frame inflates
        # Time its reservations are not charged for (`_clock`): the server held it back while its
        # downlink, full, drained at DRAIN_RATE_MIN or more; (when, bytes taken) at the last look.
        self._excused = 0.0
        self._drain_at: tuple[float, int] | None = None
        send_response = self.conn.send_response

        def stamped(response: WsResponse) -> None:
            if "x-request-id" not in response.headers:
                rid = new_request_id()
                response.headers["x-request-id"] = rid
                if response.status_code != 101 and response.headers.get("content-type", "").startswith("text/plain"):
                    text = bytes(response.body).decode("utf-8", "replace").strip() or response.reason_phrase
                    body = json.dumps(
                        error_body(response.status_code, text, code="websocket_handshake_failed")
                    ).encode()
                    for name in ("content-type", "content-length"):
                        if name in response.headers:
                            del response.headers[name]
                    response.headers["content-type"] = "application/json"
                    response.headers["content-length"] = str(len(body))
                    response.body = body
                    self._log_refusal(
                        "[%s] websocket handshake from %s refused: %d %r",
                        rid,
                        self._peer(),
                        response.status_code,
                        text[:TEXT_SHOWN],  # it may quote the client's header
                    )
            send_response(response)

        self.conn.send_response = stamped  # type: ignore[method-assign]

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _log_refusal(self, msg: str, *args: object, level: int = logging.INFO) -> None:
        """A refused handshake's line: bounded by the server's limits, when `protocol_class` bound them."""
        if self.refusal_lines is None:
            log.log(level, msg, *args)
        else:
            self.refusal_lines.line(level, msg, *args, logger=log)

    def _say(self, msg: str, *args: object, level: int = logging.INFO) -> None:
        """A line about this socket (`EdgeSlot.say`: through the refusal limit until its `hello`, or
        a request before the upgrade, authenticated); a refusal line when it came with no slot."""
        if self._origin is not None:
            self._origin.say(level, msg, *args)
        else:
            self._log_refusal(msg, *args, level=level)

    async def send(self, message: Any) -> None:
        transport = self.transport
        if (
            isinstance(transport, PassWrites)
            and transport.get_write_buffer_size() >= transport.get_write_buffer_limits()[1]
        ):
            # Frames written in one pass wait in PassWrites until the pass ends, and flow control
            # hears of them only then: the writer task (ws/connection.py) sent its whole queue in
            # one pass, megabytes past the high-water mark, where no newer snapshot replaces an
            # older one and every ping waits behind them all. Handed on now, they pause it now.
            transport.flush()
        # A close waits for no flow control: behind the backlog of a client that does not read (a
        # slow consumer closed with 4408), it is what that client finds once it reads, and the
        # edge's send timeout ends the connection if it never does. uvicorn would wait for the
        # paused socket, and the endpoint gives up on a close after a few seconds.
        lift = message["type"] == "websocket.close" and self.handshake_complete and not self.writable.is_set()
        if lift:
            self.writable.set()  # super().send does not yield once it is set: no one else sees this
        try:
            await super().send(message)
        finally:
            if lift:
                self.writable.clear()  # still paused: resume_writing sets it
        if message["type"] in ("websocket.accept", "websocket.close"):
            self._pump()  # what came before the 101 may go to the parser now; after a close, its answer
        if self.initial_response is not None and self.close_sent and not self.handshake_complete:
            # A refusal answered over HTTP (the `websocket.http.response` extension, which the
            # guard uses: a 403 for a foreign Origin, …) is the handshake's end, as an accept or a
            # close before accept is; uvicorn does not mark it so, and once the app returned it
            # logged "ASGI callable returned without completing handshake." for every one.
            self.handshake_complete = True

    # ── a client that does not take what it is sent ──────────────────────────────────────────
    # Every ping gets a pong, written whether or not the client reads: a client that pings and
    # never reads grew the server's buffer without end (hundreds of MB in seconds, even before
    # `hello`). While the socket is over its high-water mark the server reads at most
    # `WS_READ_WHILE_BLOCKED` bytes more from that client (then its pings wait in TCP, on its
    # side), and the edge's send timeout watches the connection as it watches an HTTP reply: no
    # byte taken for `send_timeout_s`, it is aborted. Not reading at all while blocked starved a
    # slow reader that keeps the socket full: its pongs were never read, and its keepalive cut it.

    def pause_writing(self) -> None:
        super().pause_writing()
        self._writes_blocked = True
        self._read_while_blocked = 0
        if isinstance(self.transport, PassWrites):
            self.transport.watch_open = True  # PassWrites arms its timer after the write that got here

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writes_blocked = False
        if isinstance(self.transport, PassWrites):
            self.transport.watch_open = False  # open and draining: ws_send_timeout_s and pings again
        self._pump()  # reads again, unless a message waits for the app (uvicorn's pause) or more

    def _over_blocked(self) -> bool:
        return self._writes_blocked and self._read_while_blocked > WS_READ_WHILE_BLOCKED

    # ── what is read from the client, and when ───────────────────────────────────────────────
    # uvicorn hands every byte read to its parser at once and pauses only once a whole message
    # waits for the app: a socket read and assembled any frame up to the frame limit (4 MiB),
    # before its `hello` too, and every frame of a read was parsed whatever the app had taken.
    # Here the bytes read go to the parser only as far as they may (`_feedable`, which follows the
    # frames' heads): before the handshake's 101 nothing (the parser would judge frames of a
    # connection not yet open: an unmasked one escaped as an AssertionError, an asyncio traceback
    # per connection); before `hello`, one message of at most PREHELLO_MESSAGE_MAX, and the next
    # once the app has handled it; after it, a big frame once the server's inbound budget has room
    # for it (security/ws_inbound.py). What may not go yet waits in `_unfed`, and the socket is not
    # read meanwhile: the client's further frames wait in TCP.
    # With permessage-deflate, a read goes to the parser a slice at a time: uvicorn inflated every
    # frame of a read before its pause took effect, and one 256 KiB read of 4 KB frames that each
    # inflate to just under the frame limit queued ~250 MB for the app (a compression bomb).

    def data_received(self, data: bytes) -> None:
        try:
            if not self.handshake_initiated:  # the upgrade request, replayed by the HTTP protocol
                if not self.transport.is_closing():
                    super().data_received(data)
                return
            if self._writes_blocked:
                self._read_while_blocked += len(data)
            if self.transport.is_closing():
                return
            if self._unfed or not self._may_feed():
                self._unfed += data
                if len(self._unfed) > WS_UNFED_MAX:
                    self._drop("sent %d bytes the server could not take yet", len(self._unfed))
                    return
            else:
                n = self._feedable(data)
                if n < len(data):
                    self._unfed += memoryview(data)[n:]
                if n:
                    super().data_received(data if n == len(data) else data[:n])
            self._pump()
        except Exception as exc:  # never asyncio's fatal-error traceback, which any client could cause
            self._broken(exc)

    async def receive(self) -> Any:
        # (uvicorn's, which resumed reading whenever the queue was empty)
        self._handling = False  # it asks for the next message: it is done with the one before
        if self._handed >= WS_STEP_BYTES:
            # A message waiting in the queue is taken without a pause, and taking it parses (and
            # inflates) the next: the app's read loop handled every message of a read in one
            # step. Past WS_STEP_BYTES the others run first.
            self._handed = 0
            await asyncio.sleep(0)
        self._pump()
        if self.queue.empty():
            self._handed = 0  # the get below waits: the others run
        message = await self.queue.get()
        if message["type"] == "websocket.receive":
            self._handling = True
            if self._reserved:
                self._release(self._reserved.popleft()[0])
                if self._read_timer is not None and self._oldest_hold() is None:
                    self._stop_read_timer()  # it holds nothing now
        if self.read_paused and self.queue.empty():
            self.read_paused = False
        self._pump()
        return message

    def _may_feed(self) -> bool:
        """Whether the parser may be given more now."""
        if not self.handshake_complete or self.initial_response is not None or self.transport.is_closing():
            return False  # before the 101 (or refused)
        if self.close_sent:
            return True  # its close is awaited, and uvicorn drops what comes before it
        return not (self.read_paused or self._waiting or self._gate_wait or (self._handling and not self._greeted))

    def _pump(self) -> None:
        """Feed the parser what it may take now (`_feedable`), then read on, or hold the reads."""
        try:
            while self._unfed and self._may_feed():
                n = self._feedable(self._unfed)
                if n == 0:
                    break
                piece = bytes(self._unfed[:n])
                del self._unfed[:n]
                super().data_received(piece)
            if self.transport.is_closing():
                self._unfed.clear()
                return
            if not self._may_feed() or self._over_blocked():
                self.transport.pause_reading()
            else:  # nothing waits to be fed, or only a frame head that is not complete yet
                self.transport.resume_reading()
        except Exception as exc:
            self._broken(exc)

    def _feedable(self, buf: bytes | bytearray) -> int:
        """How many bytes at the start of `buf` go to the parser now, following the frames' heads;
        they must then be fed (the frames walked are counted as fed). All of them, or up to a head
        not complete yet, or one that must wait for the inbound budget; before `hello`, up to the
        end of the first message; with permessage-deflate, about a slice (`WS_INFLATE_SLICE`)."""
        n, end = 0, len(buf)
        stop = min(end, WS_INFLATE_SLICE) if self._inflates else end
        while n < stop:
            if self._frame_left:
                step = min(self._frame_left, stop - n)
                if step == self._frame_left and self._frame_gated:  # its last byte inflates it
                    if not self._inflate_admitted():
                        step -= 1  # all but that byte: the parser waits for it
                        self._frame_left -= step
                        return n + step
                    self._frame_gated = False
                n += step
                self._frame_left -= step
                if not self._frame_left and self._frame_ends_message() and not self._greeted:
                    return n  # before `hello`, one message at a time
                continue
            head = frame_head(buf, n)
            if head is None:
                return n
            size, length, first = head
            limit = self.conn.max_message_size
            if limit is not None and length > limit:
                return n + size  # the parser refuses it at its head (1009), its payload unread
            small: bool | None = False
            if (first & 0x0F) in (OP_TEXT, OP_BINARY):
                small = self._small_compressed(buf, n, size, length, first)
                if small is None:
                    return n  # what comes before it is parsed first, or its payload is not all here
                if not self._begin_message(length, first, small=small):
                    return n  # waits for the budget
            n += size
            self._frame_left, self._frame_first = length, first
            self._frame_gated = (
                (first & 0x0F) <= OP_BINARY
                and self._compressed
                and not small
                and self._greeted
                and self.inbound is not None
                and length * INFLATE_RATIO > INBOUND_FREE
            )
            if not length and self._frame_ends_message() and not self._greeted:
                return n
        return n

    # ── inflating, server-wide ───────────────────────────────────────────────────────────────
    # WS_STEP_BYTES bounds what one socket inflates in a step, but every ready socket ran its step
    # in the same event-loop iteration: 64 sockets each inflating a 4 KB frame to 4 MiB (~40 ms)
    # made every iteration ~1.5 s long, and /healthz (a few iterations) waited 10-14 s. A compressed
    # frame that may inflate past INBOUND_FREE (and is not known to stay under it) is given its last
    # byte, which inflates it, only once the server's inflate gate (`InboundBudget.inflates`) lets it:
    # one per iteration, the others in order of arrival, reading nothing meanwhile (their reservations
    # still bounded in time: `_held_too_long`).

    def _inflate_admitted(self) -> bool:
        if self._gate_pass:
            self._gate_pass = False
            return True
        if self.inbound is None or self.close_sent or self.inbound.inflates.admit(self._on_inflate):
            return True
        self._gate_wait = True
        return False

    def _on_inflate(self) -> None:
        """The inflate gate lets its frame through now (this iteration's one): feed on at once."""
        self._gate_wait, self._gate_pass = False, True
        self._pump()

    def _small_compressed(self, buf: bytes | bytearray, at: int, size: int, length: int, first: int) -> bool | None:
        """Whether the compressed message whose only frame begins at `buf[at]` (its head `size`
        bytes) inflates to at most INBOUND_FREE, so that it never waits for the budget: inflated
        once ahead on a copy of the decoder, once what comes before it is parsed (None until then,
        or until its whole payload is read). False for any other frame, or when in doubt."""
        if (
            first & 0xC0 != 0xC0  # not compressed, or fragments follow
            or length > INBOUND_FREE
            or length * INFLATE_RATIO <= INBOUND_FREE  # small whatever it inflates to
            or self.inbound is None
            or not self._greeted
            or self.close_sent
        ):
            return False
        deflate = next((e for e in self.conn.extensions if isinstance(e, PerMessageDeflate)), None)
        if deflate is None:
            return False
        if at or len(buf) < at + size + length:
            return None  # the decoder must have had what comes before; the payload must be here
        payload = bytes(buf[at + size : at + size + length])
        if buf[at + 1] & 0x80:
            payload = apply_mask(payload, bytes(buf[at + size - 4 : at + size]))
        if deflate.remote_no_context_takeover:
            decoder = zlib.decompressobj(wbits=-deflate.remote_max_window_bits)
        else:
            decoder = deflate.decoder.copy()
        return inflated_within(decoder, payload, INBOUND_FREE)

    def _begin_message(self, length: int, first: int, *, small: bool = False) -> bool:
        """A text or binary frame begins a message: reserve what it may take of the inbound budget
        (after `hello`; nothing for a small one, nor a compressed one that inflates to a small one:
        `small`). False: it must wait for the budget."""
        self._compressed = bool(first & 0x40)
        budget = self.inbound
        need = 0
        if budget is not None and self._greeted and not self.close_sent and not small:
            frame_max = self._message_max or length
            need = budget.need(length, fin=bool(first & 0x80), compressed=self._compressed, frame_max=frame_max)
        if need and self._granted:  # it waited, and the budget reserved it
            need, self._granted = self._granted, 0
            since = self._granted_since
        elif need and budget is not None and not budget.reserve(self._on_granted, self._group, need):
            self._waiting, self._wanted = True, need
            return False
        else:
            since = self._clock()
        if need and not self._message_reserved:
            self._message_since = since
        self._message_reserved += need  # (a message begun inside another fails at the parser: kept till the end)
        if need:
            self._watch_held()
        return True

    # ── how long a connection may hold part of the inbound budget ───────────────────────────
    # Each reservation is given back once the app has taken its message, and must be within
    # `message_read_s` of when it was taken (waiting for it does not count), whatever holds it up:
    # its client sending the message slowly, or the app not taking it, which it does not while the
    # client leaves what it was sent unread (ws/connection.py `wait_for_room`). Bounded only until
    # the message was whole, four credentials' sockets whose clients read their downlink slowly each
    # held a whole message of two small frames (4 MiB reserved at the first: fragments followed),
    # untaken, for good: the whole budget, and another credential's big frame waited for ever.
    # Its clock (`_clock`) does not run while the server holds it back behind its full downlink and
    # that downlink drains at DRAIN_RATE_MIN or more (`_drained`): a client on a 1 Mbit/s link that
    # read its 8 MiB page steadily (~67 s) was closed for the server's own pause, and lost page and
    # upload. One that leaves its downlink unread, or trickles it, is charged as before.

    def _clock(self) -> float:
        """The time its reservations are charged by: the loop's, less what it was excused."""
        return self.loop.time() - self._excused

    def _drain_check_s(self) -> float:
        return min(DRAIN_CHECK_S, self.message_read_s / 4)

    def _drained(self) -> None:
        """Since the last look: excuse the time when the server held it back (a message waits for
        the app, or it is not read while its downlink is full), its downlink still full, and the
        client took at least DRAIN_RATE_MIN a second of it."""
        taken = getattr(self.transport, "taken", None)
        if taken is None:
            return
        now, got = self.loop.time(), int(taken())
        last, self._drain_at = self._drain_at, (now, got)
        if last is None or now <= last[0]:
            return
        held_back = self.read_paused or self._over_blocked() or bool(self._reserved) or bool(self._ended)
        busy = self._writes_blocked or self.transport.get_write_buffer_size() > 0
        if held_back and busy and got - last[1] >= DRAIN_RATE_MIN * (now - last[0]):
            self._excused += now - last[0]

    def _oldest_hold(self) -> float | None:
        """Since when it holds its oldest reservation (None: it holds none)."""
        held = [since for n, since in self._reserved if n] + [since for n, since in self._ended if n]
        if self._message_reserved:
            held.append(self._message_since)
        if self._granted:
            held.append(self._granted_since)
        return min(held) if held else None

    def _watch_held(self) -> None:
        """Arm the timer for its oldest reservation, unless it is armed (it re-arms itself)."""
        if self._read_timer is not None:
            return
        since = self._oldest_hold()
        if since is not None:
            if self._drain_at is None:
                self._drained()  # the first look: from now on
            delay = max(0.0, since + self.message_read_s - self._clock())
            self._read_timer = self.loop.call_later(min(delay, self._drain_check_s()), self._held_too_long)

    def _held_too_long(self) -> None:
        """The oldest reservation it holds is `message_read_s` old: close (1009: too big for the
        link it came on, or for the pace its client reads at); one that is closing already gives
        back what it holds now."""
        self._read_timer = None
        since = self._oldest_hold()
        if since is None:
            self._drain_at = None
            return
        self._drained()
        if self._clock() < since + self.message_read_s * 0.999:  # (timers may fire a tick early)
            self._watch_held()
            return
        held = self._held_bytes()
        if not self.close_sent and not self.transport.is_closing():
            # the client's own pace (a message not sent whole), or the server's (a message it does
            # not take, or read on: it waits for its client to read what it was sent)
            sending = self._message_reserved and self._message_since <= since
            slow = sending and self._may_feed() and not self._over_blocked()
            self._say(
                "websocket from %s "
                + (
                    "sent less than a message in %g s"
                    if slow
                    else "had a message the server did not take in %g s (it reads no more of a client "
                    "that leaves what it was sent unread)"
                )
                + " while it held %d bytes of the inbound budget: closing (1009)",
                self._peer(),
                self.message_read_s,
                held,
            )
            reason = "not received whole" if slow else "not handled"
            self.conn.send_close(1009, f"message {reason} within {self.message_read_s:g} s")
            self.handle_parser_exception()
        self._let_go()

    def _held_bytes(self) -> int:
        """What it holds of the inbound budget."""
        return (
            sum(n for n, _ in self._reserved) + sum(n for n, _ in self._ended) + self._message_reserved + self._granted
        )

    def _let_go(self) -> None:
        """Its server's close is sent: what it holds of the inbound budget goes back now, with the
        messages the app has not taken (never handled now: the app finds the disconnect next),
        whenever its transport ends (a client that does not read keeps it open until the send
        timeout, and one that takes a byte now and then, longer)."""
        kept = []
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if message["type"] != "websocket.receive":
                kept.append(message)
        for message in kept:
            self.queue.put_nowait(message)
        if self._waiting and self.inbound is not None:
            self.inbound.cancel(self._on_granted)
            self._waiting = False
        if self._gate_wait and self.inbound is not None:
            self.inbound.inflates.cancel(self._on_inflate)
            self._gate_wait = False
        held = self._held_bytes()
        self._reserved.clear()
        self._ended.clear()
        self._message_reserved = self._granted = 0
        self._release(held)

    def _stop_read_timer(self) -> None:
        self._drain_at = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    # ── a keepalive ping behind what the client is still taking ─────────────────────────────────
    # uvicorn times a ping's pong from when the ping is written; written behind a big frame (an 8 MiB
    # `get_history` page) it waits in the transport until the client has taken that frame: a client
    # reading the page steadily at 73 KiB/s got it whole, then the ping, then the close 1011, and
    # lost the page it had read. Such a ping is timed from when the client has taken it; until then,
    # a client that takes no byte for `ping_timeout` is closed as a silent one is.

    def send_keepalive_ping(self) -> None:
        transport = self.transport
        ahead = transport.written() - transport.taken() if isinstance(transport, PassWrites) else 0
        super().send_keepalive_ping()
        self._ping_end, self._ping_reached = 0, None
        if ahead > 0 and self.pong_timer is not None and self.ping_timeout and isinstance(transport, PassWrites):
            self._ping_end = transport.written()
            self._ping_progress = (self.loop.time(), transport.taken())
            self.pong_timer.cancel()
            self.pong_timer = self.loop.call_later(self.ping_timeout / SEND_CHECKS, self.keepalive_timeout)

    def _pong_deferred(self) -> bool:
        """Whether the pong of a ping written behind untaken bytes is not due yet: `ping_timeout`
        after the client took the ping, or, while it has not, after it last took a byte ahead of
        it. True: the next look is armed (as `pong_timer`, which a pong cancels)."""
        transport, timeout = self.transport, self.ping_timeout
        if not self._ping_end or not timeout or not isinstance(transport, PassWrites) or transport.is_closing():
            return False
        now, taken = self.loop.time(), transport.taken()
        if taken >= self._ping_end:
            if self._ping_reached is None:
                self._ping_reached = now  # seen now: it got there since the last look
            due = self._ping_reached + timeout
        else:
            since, before = self._ping_progress
            if taken > before:
                self._ping_progress = since, before = now, taken
            due = since + timeout
        if now >= due - timeout * 0.001:  # (timers may fire a tick early)
            return False
        self.pong_timer = self.loop.call_later(min(timeout / SEND_CHECKS, due - now), self.keepalive_timeout)
        return True

    def keepalive_timeout(self) -> None:
        # A connection the server stopped reading for the budget has its pong behind the frame it
        # does not read yet (in TCP): it was closed 1011 for the server's own pause. Its ping's
        # timeout starts anew once it reads again (`_on_granted`).
        if self._waiting:
            self.pong_timer = None
            self._pong_overdue = True
            return
        if self._pong_deferred():
            return
        super().keepalive_timeout()

    def _frame_ends_message(self) -> bool:
        """The frame just walked ends a message (a data frame with FIN): the app gets it once it
        is parsed (what it reserved shrinks to its size then: `send_receive_event_to_app`), and
        what it holds is given back once the app takes it (`receive`)."""
        first = self._frame_first
        if first & 0x0F > OP_BINARY or not first & 0x80:
            return False  # a control frame, or fragments follow
        self._ended.append((self._message_reserved, self._message_since))
        self._message_reserved = 0
        return True

    def _on_granted(self) -> None:
        """The inbound budget took what this connection waited for: feed on (in a pass of its own)."""
        self._granted, self._waiting = self._wanted, False
        self._granted_since = self._clock()
        self._watch_held()
        if self._pong_overdue and self.ping_timeout is not None and not self.close_sent:
            self._pong_overdue = False  # its pong may come now: as long to wait for it as for any
            self._ping_end = 0  # (timed from now, wherever the ping is)
            self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
        self.loop.call_soon(self._pump, context=contextvars.Context())

    def _release(self, n: int) -> None:
        if n and self.inbound is not None:
            self.inbound.release(self._group, n)

    def _greet(self, group: str) -> None:
        """The app accepted its `hello` (`asgi.greeted`): the limits before it end, and its big
        frames take `group`'s share of the inbound budget. Read on at the app's next `receive`."""
        self._greeted, self._group = True, group
        self.conn.max_message_size = self._message_max

    def _drop(self, why: str, *args: object) -> None:
        """Abort the connection, with a line saying `why` (the edge's own words, and `args`)."""
        self._unfed.clear()
        self._say("websocket from %s " + why + ": dropped", self._peer(), *args, level=logging.WARNING)
        self.transport.abort()

    def _broken(self, exc: Exception) -> None:
        """What a client sent made the protocol fail (a bug, never the client's fault): one bounded
        line and the connection dropped, never asyncio's traceback for each connection."""
        self._drop("broke the server's reading of its frames (%s)", repr(exc)[:TEXT_SHOWN])

    def handle_parser_exception(self) -> None:
        close = self.conn.close_sent
        failed = self.conn.parser_exc
        if failed is not None:
            code, reason = (close.code, close.reason) if close is not None else (1006, str(failed))
            self._say(
                "websocket from %s sent an invalid frame%s (%s): closing (%d)",
                self._peer(),
                "" if self._greeted else " before its hello",
                reason[:TEXT_SHOWN],
                code,
            )
        if close is None:  # not open (uvicorn asserted it was, and the AssertionError escaped)
            self.queue.put_nowait({"type": "websocket.disconnect", "code": 1006})
            self.close_sent = True
            self.transport.close()
            return
        super().handle_parser_exception()

    def take_slot(self, slot: EdgeSlot) -> None:
        """The place of the HTTP connection this socket was upgraded from; when that had not
        authenticated, its slot is this socket's now, evictable at the cap until the guard proves
        it (`hello`)."""
        self._origin = slot
        if not slot.unproven:  # authenticated (or on its way out): nothing to evict
            return
        if self.transport is None or self.transport.is_closing():  # refused handshake, or gone already
            slot.gone()
            return
        slot.conn = self
        self._slot = slot

    def evict(self, reason: str) -> None:
        """Give up the slot of a socket still waiting for its `hello` (`SlotGate.make_room`): closed
        at once (aborted: a close would wait for the client to take what is still unsent, its
        descriptor held past the cap); the app sees a disconnect. Logged by `_made_room`, at most
        once per interval."""
        self.transport.abort()

    def _prove(self) -> None:
        if self._slot is not None:
            self._slot.prove()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # none when the handshake was refused
        if scope is not None:
            scope["extensions"][WRITE_FRAME] = self.write_frame
            scope["extensions"][PROVE] = self._prove
            scope["extensions"][GREETED] = self._greet

    def shutdown(self) -> None:
        super().shutdown()  # the close (1012) is written and the transport asked to close
        # A client that does not read never lets the close (nor the frames before it) leave, and the
        # server's stop waited out its whole grace for it, then logged an ERROR: past a short
        # drain such a connection is dropped.
        self.loop.call_later(WS_SHUTDOWN_DRAIN_S, self._drop_if_stuck)

    def _drop_if_stuck(self) -> None:
        if self in self.connections and self.transport is not None:
            self._say(
                "websocket from %s took nothing for %g s after the server's close: dropped",
                self._peer(),
                WS_SHUTDOWN_DRAIN_S,
            )
            self.transport.abort()

    # websockets' parser keeps the last frame it parsed (a local of its generator) until it parses
    # the next: each socket held its last message's payload (up to 4 MiB; 250 sockets, ~700 MB)
    # for as long as its client sent nothing more, after the app had long taken it. uvicorn has
    # taken the payload once these return (joined, decoded or queued): the frame lets it go.

    def handle_text(self, event: Frame) -> None:
        super().handle_text(event)
        event.data = b""

    def handle_bytes(self, event: Frame) -> None:
        super().handle_bytes(event)
        event.data = b""

    def handle_cont(self, event: Frame) -> None:
        super().handle_cont(event)
        event.data = b""

    def send_receive_event_to_app(self) -> None:
        # A whole message: what its first frame reserved (the frame limit, when fragments followed;
        # what it might inflate to, when compressed) shrinks to its size, or to nothing when that is
        # small, as a small unfragmented message reserves: four credentials' sockets whose app did
        # not take their two-frame messages of 100 bytes held 4 MiB each.
        size = sum(map(len, self.frames))
        self._handed += size
        reserved, since = self._ended.popleft() if self._ended else (0, 0.0)
        keep = min(reserved, size) if size > INBOUND_FREE else 0
        self._release(reserved - keep)
        # A text message that is not UTF-8 is the client's fault, closed with 1007; uvicorn logged
        # each one as an ERROR with a traceback, so any client could fill the log (and stall a
        # server whose stderr is a pipe read slower than that). One INFO line instead, through the
        # refusal limit until the socket authenticated (`_say`): one per socket is unbounded too.
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            self.frames = [data]  # joined once: uvicorn's own path below takes it as it is
            if not data.isascii():
                try:
                    data.decode()
                except UnicodeDecodeError:
                    self.frames = []
                    self._release(keep)
                    self._say("websocket from %s sent a text message that is not UTF-8: closing (1007)", self._peer())
                    self.conn.send_close(1007)
                    self.handle_parser_exception()
                    return
        if self.close_sent:
            self._release(keep)  # uvicorn drops it
        else:
            self._reserved.append((keep, since))
        super().send_receive_event_to_app()

    def write_frame(self, frame: bytes) -> bool:
        """Write a framed server message (`appserver/ws/connection.py` `text_frame`) now, as
        `send` would, if the connection takes it as it is: open, with no extension (permessage-deflate
        frames each connection apart), not paused by flow control and not about to be: what waits
        unsent (PassWrites holds a write until the loop's next pass) is under the high-water mark,
        so a burst of frames written in one pass queues behind it as it would behind `send`.
        False: it did nothing."""
        transport: Any = self.transport  # PassWrites, in serve; asyncio's in a test's bare uvicorn
        if (
            not self.handshake_complete
            or self.close_sent
            or self.disconnected
            or self.conn.extensions
            or not self.writable.is_set()
            or self.conn.state is not WsState.OPEN
            or transport.is_closing()
            or transport.get_write_buffer_size() >= transport.get_write_buffer_limits()[1]
        ):
            return False
        if isinstance(transport, PassWrites):
            transport.write_now(frame)
        else:
            transport.write(frame)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._slot is not None:
            self._slot.gone()
        self._unfed = bytearray()
        self._stop_read_timer()
        if self.inbound is not None:  # what it held of the inbound budget, and its place in the queue
            self.inbound.cancel(self._on_granted)
            self.inbound.inflates.cancel(self._on_inflate)
            held = self._held_bytes()
            self._reserved.clear()
            self._ended.clear()
            self._message_reserved = self._granted = 0
            self._release(held)
        release = getattr(self.transport, "release", None)  # PassWrites: its send timeout's timer
        if release is not None:
            release()
        super().connection_lost(exc)
        # The stamping `send_response` and the scope's extensions (bound methods) refer back to this
        # protocol: reference cycles that kept each closed socket (its scope, the app's connection,
        # what they reference) until a full collection, which the server makes rare (cli/serve.py):
        # ~0.5 KB per WebSocket never given back. The app, if it still runs, holds what it took.
        vars(self.conn).pop("send_response", None)
        # websockets' parser is a generator of its protocol's: one waiting for an end of stream
        # that uvicorn never feeds it (`eof_received`) holds the protocol for good. Nothing is
        # parsed after the socket is gone.
        self.conn.parser.close()
        extensions = getattr(self, "scope", {}).get("extensions") or {}  # no scope: refused handshake
        extensions.pop(WRITE_FRAME, None)
        extensions.pop(PROVE, None)
        extensions.pop(GREETED, None)
