"""The send timeout of the HTTP edge (appserver/security/edge.py, `PassWrites`, `[limits]
send_timeout_s`): a client that takes no byte of a reply waiting for it (the transport's buffer above
its low-water mark, or any byte left after a close was asked for) is cut off after the timeout, its
connection aborted and its request disconnected; a slow client that reads, and an SSE stream that
is quiet because nothing is produced, are never cut.

Real sockets on loopback against the edge protocol wrapping a small ASGI app (uvicorn in a thread,
as `serve` runs it), plus the timer logic on a scripted transport.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import operator
import socket
import ssl
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import uvicorn

from appserver.security.edge import EdgeHttpProtocol, EdgeLimits, PassWrites, protocol_class
from tests.support.certs import self_signed

pytestmark = pytest.mark.timeout(120)

SEND_S = 0.5  # the send timeout of these servers
# The slow reader's servers': loopback's TCP reopens a 64 KiB receive window a whole segment (~64 KiB)
# at a time, so at ~160 KB/s its bytes are taken in steps of ~0.4 s or more, too close to 0.5 s.
SLOW_READER_SEND_S = 1.0
CUT_WITHIN = SEND_S * 1.25 + 2.0  # checked every quarter of it; slack for a loaded machine
BIG = 16 << 20  # more than loopback's socket buffers hold (a few MB): the rest waits in the transport
CHUNK = 64 * 1024
ABORT_LINE = "took no byte of its reply"


# ── a server: the edge wrapping a small app ──────────────────────────────────────────────────────


@dataclass
class Edge:
    port: int
    server: uvicorn.Server
    loop: asyncio.AbstractEventLoop
    events: list[str] = field(default_factory=list)  # what the app saw
    log: list[str] = field(default_factory=list)  # appserver.edge's lines
    protocols: list[weakref.ref[EdgeHttpProtocol]] = field(default_factory=list)
    tls: ssl.SSLContext | None = None  # the client's, for a server with a certificate

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)


def _pattern(n: int) -> bytes:
    return (b"0123456789abcdef" * (n // 16 + 1))[:n]


def make_app(edge: Edge) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        if scope["type"] != "http":
            return
        edge.loop = asyncio.get_running_loop()
        query = parse_qs(scope["query_string"].decode())
        path = scope["path"]
        if path == "/big":  # one reply written at once, much bigger than the socket buffers
            n = int(query.get("n", [str(BIG)])[0])
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % n)]})
            await send({"type": "http.response.body", "body": _pattern(n)})
            edge.events.append("/big: written")
        elif path == "/stream":  # streams until the client goes (as the SSE routes do: receive → cancel)
            gone = asyncio.Event()

            async def listen() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()

            listener = asyncio.create_task(listen())
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            while not gone.is_set():
                await send({"type": "http.response.body", "body": _pattern(CHUNK), "more_body": True})
                await asyncio.sleep(0)
            await listener
            edge.events.append("/stream: disconnected")
        elif path == "/sse":  # two events and a quiet spell between them (a slow model)
            idle = float(query["idle"][0])
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await asyncio.sleep(idle)
            await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            edge.events.append("/sse: complete")

    return app


class _Lines(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@pytest.fixture(scope="module")
def servers() -> Iterator[Callable[..., Edge]]:
    """One edge server per kind and send timeout, started when first asked: its event loop
    (`serve`'s `[server] event_loop`), "+tls" for one with a certificate."""
    started: dict[tuple[str, float], tuple[Edge, threading.Thread]] = {}
    logger = logging.getLogger("appserver.edge")
    level = logger.level
    logger.setLevel(logging.INFO)

    def get(kind: str, send_s: float = SEND_S) -> Edge:
        if (kind, send_s) not in started:
            loop, _, tls = kind.partition("+")
            if loop == "uvloop":
                pytest.importorskip("uvloop")
            certs: dict[str, str] = {}
            if tls:
                cert, key = self_signed(Path(tempfile.mkdtemp(prefix="edge-tls-")))
                certs = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
            limits = EdgeLimits(
                head_max_bytes=65536,
                head_timeout_s=10,
                body_timeout_s=10,
                body_min_rate=0,
                keepalive_timeout_s=60,  # so that nothing here is the idle timeout's doing
                max_connections=100,
                send_timeout_s=send_s,
            )
            edge = Edge(port=0, server=None, loop=None)  # type: ignore[arg-type]
            bound = protocol_class(limits)

            def made(self: EdgeHttpProtocol, transport: asyncio.Transport) -> None:
                bound.connection_made(self, transport)
                edge.protocols.append(weakref.ref(self))

            recording = type("RecordingEdgeProtocol", (bound,), {"connection_made": made})
            config = uvicorn.Config(
                make_app(edge),
                host="127.0.0.1",
                port=0,
                http=recording,
                loop=loop,
                lifespan="off",
                log_level="warning",
                **certs,  # type: ignore[arg-type]
            )
            if tls:
                edge.tls = ssl.create_default_context(cafile=certs["ssl_certfile"])
            edge.server = uvicorn.Server(config)
            thread = threading.Thread(target=edge.server.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 10
            while not edge.server.started:
                assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
                time.sleep(0.01)
            edge.port = edge.server.servers[0].sockets[0].getsockname()[1]
            edge.loop = edge.server.servers[0].get_loop()
            handler = _Lines(edge.log)
            logger.addHandler(handler)
            started[kind, send_s] = (edge, thread)
        return started[kind, send_s][0]

    try:
        yield get
    finally:
        for edge, thread in started.values():
            edge.server.should_exit = True
            thread.join(10)
        for h in [h for h in logger.handlers if isinstance(h, _Lines)]:
            logger.removeHandler(h)
        logger.setLevel(level)


def request(edge: Edge, path: str, *headers: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", edge.port))
    if edge.tls is not None:
        s = edge.tls.wrap_socket(s, server_hostname="127.0.0.1")
    lines = "".join(f"{h}\r\n" for h in headers)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{lines}\r\n".encode())
    return s


def wait_until(check: Callable[[], bool], within: float) -> float:
    """Seconds until `check()` holds; fails past `within`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within, f"not within {within:g} s"
        time.sleep(0.02)
    return time.monotonic() - started


def drain(s: socket.socket, limit: int | None = None) -> tuple[bytes, str]:
    """Read until EOF, a reset or `limit` bytes: (bytes, "eof" | "reset" | "limit")."""
    got = bytearray()
    s.settimeout(10)
    try:
        while limit is None or len(got) < limit:
            chunk = s.recv(1 << 20)
            if not chunk:
                return bytes(got), "eof"
            got += chunk
    except OSError:  # a reset (under TLS maybe an SSLError)
        return bytes(got), "reset"
    return bytes(got), "limit"


def settled(edge: Edge) -> None:
    """Connections of earlier tests are gone (the server may notice a close a moment later)."""
    wait_until(lambda: edge.open_connections() == 0, 5)


# ── a client that never reads ────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "asyncio+tls"])
@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
def test_a_client_that_never_reads_a_large_reply_is_cut_off(
    servers: Callable[[str], Edge], loop: str, close: bool
) -> None:
    """A 16 MiB reply, written whole (the app is done), to a client that reads nothing: kept alive
    (the idle timeout's close waited for the buffer to drain, forever) or `Connection: close` (the
    close itself waited). The connection is aborted after the send timeout, the client still
    connected and silent: the server holds neither the connection nor its buffer. Under TLS the
    reply sits encrypted in the socket's own transport, which the TLS transport does not count."""
    edge = servers(loop)
    settled(edge)
    before = len(edge.log)
    s = request(edge, "/big", *(["Connection: close"] if close else []))
    try:
        wait_until(lambda: edge.open_connections() == 1 and "/big: written" in edge.events, 5)
        edge.events.remove("/big: written")
        took = wait_until(lambda: edge.open_connections() == 0, CUT_WITHIN)
        assert took >= SEND_S * 0.5, took  # the timeout, not something sooner
        lines = edge.log[before:]
        assert any(ABORT_LINE in line and "send_timeout_s" in line for line in lines), lines
        got, how = drain(s)
        assert len(got) < BIG, how  # the rest was dropped: reset, or EOF after what the kernel had
    finally:
        s.close()


def test_a_stream_the_client_stops_reading_is_disconnected(servers: Callable[[str], Edge]) -> None:
    """A reply streamed while the app runs (its sends block on flow control once the client stops
    reading): after the send timeout the app's `receive` says `http.disconnect` (what cancels a
    turn on the SSE routes) and the connection is gone."""
    edge = servers("asyncio")
    settled(edge)
    s = request(edge, "/stream")
    try:
        got, _ = drain(s, limit=CHUNK)  # it flows
        assert got.startswith(b"HTTP/1.1 200")
        wait_until(lambda: "/stream: disconnected" in edge.events, CUT_WITHIN + 1)
        edge.events.remove("/stream: disconnected")
        wait_until(lambda: edge.open_connections() == 0, 2)
    finally:
        s.close()


# ── clients that are slow but read, streams that are quiet ───────────────────────────────────────


@pytest.mark.parametrize("loop", ["asyncio", "asyncio+tls"])
def test_a_slow_reader_is_not_cut(servers: Callable[..., Edge], loop: str) -> None:
    """The same 16 MiB reply to a client that takes 16 KiB every 100 ms (~160 KB/s) for three send
    timeouts: megabytes stay in the transport the whole time, but bytes keep leaving, so it is
    never cut; it then reads the rest, every byte in order."""
    edge = servers(loop, SLOW_READER_SEND_S)
    settled(edge)
    before = len(edge.log)
    s = request(edge, "/big", rcvbuf=64 * 1024)
    try:
        wait_until(lambda: "/big: written" in edge.events, 5)
        edge.events.remove("/big: written")
        got = bytearray()
        until = time.monotonic() + 3 * SLOW_READER_SEND_S
        while time.monotonic() < until:
            chunk = s.recv(16 * 1024)
            assert chunk, "cut off"
            got += chunk
            time.sleep(0.1)
        assert len(got) < BIG // 4  # still slow: most of the reply was waiting all along
        assert edge.open_connections() == 1
        body_at = got.index(b"\r\n\r\n") + 4
        assert got.startswith(b"HTTP/1.1 200"), bytes(got[:200])
        s.settimeout(10)
        while len(got) - body_at < BIG:
            chunk = s.recv(1 << 20)
            assert chunk, "cut off"
            got += chunk
        assert got[body_at:] == _pattern(BIG)
        assert not [line for line in edge.log[before:] if ABORT_LINE in line]
    finally:
        s.close()


@pytest.mark.parametrize("reads", [True, False], ids=["reading", "not-reading"])
def test_a_quiet_sse_stream_is_not_cut(servers: Callable[[str], Edge], reads: bool) -> None:
    """An SSE stream quiet for three send timeouts (a slow model) between two events: nothing waits
    in the buffer, so nothing is timed, whether or not the client reads meanwhile."""
    edge = servers("asyncio")
    settled(edge)
    before = len(edge.log)
    s = request(edge, f"/sse?idle={3 * SEND_S}")
    try:
        if reads:
            got = bytearray()
            while b"data: 1" not in got:
                chunk = s.recv(4096)
                assert chunk
                got += chunk
        else:
            got = bytearray()
        time.sleep(3 * SEND_S + 0.3)
        while not got.endswith(b"0\r\n\r\n"):
            chunk = s.recv(4096)
            assert chunk, bytes(got)
            got += chunk
        assert b"data: 1\n\n" in got and b"data: 2\n\n" in got
        wait_until(lambda: "/sse: complete" in edge.events, 2)
        edge.events.remove("/sse: complete")
        assert edge.open_connections() == 1  # still kept alive
        assert not [line for line in edge.log[before:] if ABORT_LINE in line]
    finally:
        s.close()


# ── nothing left behind ──────────────────────────────────────────────────────────────────────────


def test_a_cut_connection_leaves_no_timer_and_no_protocol_behind(servers: Callable[[str], Edge]) -> None:
    """After connections cut by the send timeout (and one served normally), the event loop holds no
    timer of theirs and their protocols are freed by reference counting alone (the cycle between
    the edge's flow control and its protocol once kept them until a rare full collection)."""
    edge = servers("asyncio")
    settled(edge)
    gc.collect()
    gc.disable()
    try:
        first = len(edge.protocols)
        socks = [request(edge, "/big"), request(edge, "/big", "Connection: close"), request(edge, "/stream")]
        try:
            wait_until(lambda: len(edge.protocols) - first == 3 and edge.open_connections() == 3, 5)
            wait_until(lambda: edge.open_connections() == 0, CUT_WITHIN + 1)
        finally:
            for s in socks:
                s.close()
        s = request(edge, "/big?n=1000", "Connection: close")
        got, how = drain(s)
        s.close()
        assert how == "eof" and got.endswith(_pattern(1000))
        wait_until(lambda: edge.open_connections() == 0, 2)
        for kind in ("/big: written", "/big: written", "/big: written", "/stream: disconnected"):
            wait_until(partial(operator.contains, edge.events, kind), 2)
            edge.events.remove(kind)

        live: list[object] = []
        done = threading.Event()

        def look() -> None:
            for handle in edge.loop._scheduled:  # type: ignore[attr-defined]
                owner = getattr(getattr(handle, "_callback", None), "__self__", None)
                if not handle.cancelled() and isinstance(owner, PassWrites | EdgeHttpProtocol):
                    live.append(handle)
            done.set()

        time.sleep(0.1)  # the loop runs the connections' last callbacks
        edge.loop.call_soon_threadsafe(look)
        assert done.wait(5)
        assert live == []
        assert [ref for ref in edge.protocols[first:] if ref() is not None] == []
    finally:
        gc.enable()


# ── the timer on a scripted transport ────────────────────────────────────────────────────────────


class ScriptedTransport(asyncio.Transport):
    """A socket transport whose buffer the test sets: `size` bytes wait, low-water mark 16 KiB."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.calls: list[str] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.calls.append("write")

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True
        self.size = 0

    def write_eof(self) -> None:
        self.calls.append("eof")

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 * 1024, 64 * 1024

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default


TICK = 0.2  # the scripted send timeout


async def _written(t: PassWrites, raw: ScriptedTransport, size: int) -> None:
    t.write(b"x")
    raw.size = size
    await asyncio.sleep(0)  # the pass ends: the write goes out, the buffer is `size`


async def test_an_empty_or_low_buffer_is_never_timed() -> None:
    raw = ScriptedTransport()
    t = PassWrites(raw, asyncio.get_running_loop(), TICK)
    await _written(t, raw, 0)
    assert t._watch is None
    await _written(t, raw, 16 * 1024)  # at the low-water mark: flow control does not block
    assert t._watch is None
    await asyncio.sleep(TICK * 2)
    assert "abort" not in raw.calls


async def test_a_buffer_that_does_not_move_is_aborted_one_that_moves_is_not() -> None:
    loop = asyncio.get_running_loop()
    raw = ScriptedTransport()
    t = PassWrites(raw, loop, TICK)
    await _written(t, raw, 1 << 20)
    assert t._watch is not None
    for _ in range(8):  # two timeouts, bytes leaving all along
        await asyncio.sleep(TICK / 4)
        raw.size -= 1000
    assert "abort" not in raw.calls
    started = loop.time()
    while "abort" not in raw.calls:  # now it stops
        assert loop.time() - started < TICK * 3
        await asyncio.sleep(0.01)
    assert TICK * 0.9 <= loop.time() - started <= TICK * 1.6
    assert t._watch is None


async def test_new_writes_are_not_progress() -> None:
    """The app adding to a buffer the client does not take is no progress (only bytes leaving are)."""
    loop = asyncio.get_running_loop()
    raw = ScriptedTransport()
    t = PassWrites(raw, loop, TICK)
    await _written(t, raw, 1 << 20)
    started = loop.time()
    while "abort" not in raw.calls:
        assert loop.time() - started < TICK * 3
        t.write(b"more")
        await asyncio.sleep(0)
        raw.size += 4
        await asyncio.sleep(0.02)


async def test_a_close_with_bytes_left_is_timed_even_below_low_water() -> None:
    raw = ScriptedTransport()
    t = PassWrites(raw, asyncio.get_running_loop(), TICK)
    await _written(t, raw, 100)
    assert t._watch is None  # open: a few bytes are no stall
    t.close()
    assert t._watch is not None  # closing: they must leave
    await asyncio.sleep(TICK * 1.6)
    assert raw.calls[-1] == "abort"


async def test_a_close_that_drains_and_release_leave_no_timer() -> None:
    loop = asyncio.get_running_loop()
    raw = ScriptedTransport()
    t = PassWrites(raw, loop, TICK)
    await _written(t, raw, 100)
    t.write_eof()
    assert t._watch is not None
    raw.size = 0  # drained
    await asyncio.sleep(TICK / 4 + 0.05)
    assert t._watch is None and "abort" not in raw.calls

    raw2 = ScriptedTransport()
    t2 = PassWrites(raw2, loop, TICK)
    await _written(t2, raw2, 1 << 20)
    handle = t2._watch
    assert handle is not None
    t2.release()  # the connection is gone
    assert t2._watch is None and handle.cancelled()


async def test_after_a_websocket_upgrade_only_a_close_is_timed() -> None:
    raw = ScriptedTransport()
    t = PassWrites(raw, asyncio.get_running_loop(), TICK)
    t.watch_open = False  # the WebSocket protocol has its own send timeout
    await _written(t, raw, 1 << 20)
    assert t._watch is None
    t.close()
    await asyncio.sleep(TICK * 1.6)
    assert raw.calls[-1] == "abort"
