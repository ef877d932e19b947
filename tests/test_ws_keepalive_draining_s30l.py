"""Session 30, an outside tester's finding: a WebSocket client that reads steadily was closed 1011
"keepalive ping timeout" while it took a big `get_history` page.

The server's keepalive ping, written behind the page, reached the client only once the client had
taken the page; uvicorn timed its pong from when it was written, so a client reading a 4.6 MB page
at 300 KB/s (ping 2 s, timeout 5 s), or an 8 MB page at 73 KiB/s (the defaults), got the whole page,
then the ping, then the close. Now such a ping is timed from when the client took it, and a client
that takes no byte for the timeout is closed as before (security/edge.py `_pong_deferred`). The
client library had the same fault the other way round: the server's pong waits behind the page
too, and it closed a server that was sending it the page steadily (client/connection.py
`_Connection`).

A real `appserver serve` with short keepalive settings; raw sockets that read at a set pace and
answer pings, and the client library behind a loopback proxy that passes the server's bytes at a
set pace. Every wait is bounded; what arrives, and in which order, is checked.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest

from appserver.client.connection import ProtocolClient
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.test_edge_s27a import close_code, hello, masked, upgrade
from tests.test_edge_s27a2 import Client

pytestmark = pytest.mark.timeout(120)

T = 30.0  # every blocking read's bound
PING_INTERVAL_S, PING_TIMEOUT_S = "0.25", "1.25"  # uvicorn waits 1 s for a pong (cli/serve.py `pong_wait`, its least)
PAGE_INPUT = "y" * 600_000  # echoed by the default agent: a history page of ~1.2 MB
RATE = 500_000  # bytes a second: the page takes ~2.4 s, over twice the pong's wait
# A paced reader's receive buffer: what its kernel took and it has not read yet is at most that
# (the server counts it taken), a fraction of a second at RATE.
PACED_RCVBUF = 16 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("keepalive") / "home"
    env = cli_env(
        home, APPSERVER_LIMITS__WS_PING_INTERVAL_S=PING_INTERVAL_S, APPSERVER_LIMITS__WS_PING_TIMEOUT_S=PING_TIMEOUT_S
    )
    with serving(home, env=env) as sp:
        yield sp


@pytest.fixture(scope="module")
def conversation(server: ServeProcess) -> str:
    """A conversation whose history page is ~1.2 MB."""
    s, client = _greeted(_port(server))
    with s:
        submit = {"type": "submit_input", "request_id": "s", "agent": "assistant", "conversation": "new"}
        s.sendall(_text({**submit, "input": PAGE_INPUT}))
        ack = client.answer("s")
        assert ack["type"] == "ack", ack
        while True:
            opcode, payload = client.next_frame()
            assert opcode == 0x1, (opcode, payload[:200])
            frame = json.loads(payload)
            snap = frame.get("snapshot") or {}
            if frame.get("type") == "turn_updated" and snap.get("status") in ("completed", "failed", "cancelled"):
                assert snap["status"] == "completed", snap
                return str(ack["conversation_id"])


def _port(server: ServeProcess) -> int:
    port = urlsplit(server.url).port
    assert port is not None
    return port


def _text(frame: dict[str, object]) -> bytes:
    return masked(json.dumps(frame).encode())


def _greeted(port: int, *, rcvbuf: int = 0) -> tuple[socket.socket, Client]:
    s = socket.socket()
    if rcvbuf:  # before connecting: what its kernel takes without its reading stays small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.settimeout(T)
    s.sendall(upgrade(port) + hello())
    client = Client(s)
    assert client.head().startswith(b"HTTP/1.1 101 ")
    assert client.answer("h")["type"] == "welcome"
    return s, client


class Paced(Client):
    """A raw client that reads `rate` bytes a second; answers the server's pings as it reads
    them when `pongs` (as any WebSocket library does), and counts them."""

    def __init__(self, sock: socket.socket, buf: bytes, *, rate: float, pongs: bool = True) -> None:
        super().__init__(sock)
        self.buf, self.rate, self.pongs, self.pings = buf, rate, pongs, 0

    def _more(self) -> None:
        chunk = self.sock.recv(4096)
        if not chunk:
            raise EOFError("closed")
        self.buf += chunk
        time.sleep(len(chunk) / self.rate)

    def next_frame(self) -> tuple[int, bytes]:
        while True:
            opcode, payload = self.frame()
            if opcode != 0x9:
                return opcode, payload
            self.pings += 1
            if self.pongs:
                self.sock.sendall(masked(payload, opcode=0xA))


def _what(opcode: int, payload: bytes) -> tuple[str, object]:
    """(type, request id) of a text frame; ("close", code) of a close."""
    if opcode == 0x8:
        return "close", close_code(payload)
    frame = json.loads(payload)
    return str(frame["type"]), frame.get("request_id")


def _read_page_then_ping(port: int, conversation: str) -> tuple[list[tuple[str, object]], int, int]:
    """Asks for the page, reads it at RATE answering pings, then sends a `ping` request: what it
    got (up to the answer or a close), the page's size, and how many pings came meanwhile."""
    s, greeted = _greeted(port, rcvbuf=PACED_RCVBUF)
    with s:
        s.sendall(_text({"type": "get_history", "request_id": "page", "conversation": conversation}))
        client = Paced(s, greeted.buf, rate=RATE)
        got: list[tuple[str, object]] = []
        size = 0
        while True:
            try:
                opcode, payload = client.next_frame()
            except (EOFError, OSError) as exc:
                got.append(("gone", type(exc).__name__))
                return got, size, client.pings
            got.append(_what(opcode, payload))
            if got[-1] == ("history", "page"):
                size = len(payload)
                s.sendall(_text({"type": "ping", "request_id": "after"}))
            if got[-1][0] == "close" or got[-1] == ("pong", "after"):
                return got, size, client.pings


def test_a_client_reading_a_big_page_steadily_is_not_closed_by_its_keepalive(
    server: ServeProcess, conversation: str
) -> None:
    got, size, pings = _read_page_then_ping(_port(server), conversation)
    # Before: [("history", "page"), ("close", 1011)], the close right behind the page and its ping.
    assert got == [("history", "page"), ("pong", "after")], got
    assert size > 1_000_000, size
    assert pings >= 1, pings  # a ping did wait behind the page


def _read_page_ignoring_pings(port: int, conversation: str) -> list[tuple[str, object]]:
    """Asks for the page and reads it, and what follows, at RATE, never answering a ping."""
    s, greeted = _greeted(port, rcvbuf=PACED_RCVBUF)
    with s:
        s.sendall(_text({"type": "get_history", "request_id": "page", "conversation": conversation}))
        client = Paced(s, greeted.buf, rate=RATE, pongs=False)
        got: list[tuple[str, object]] = []
        while not got or got[-1][0] != "close":
            got.append(_what(*client.next_frame()))
        assert client.pings >= 1
        return got


def test_a_client_that_takes_the_page_but_never_answers_the_ping_is_closed(
    server: ServeProcess, conversation: str
) -> None:
    """The ping is timed once it is taken: a client that reads on but does not answer it is closed."""
    got = _read_page_ignoring_pings(_port(server), conversation)
    assert got == [("history", "page"), ("close", 1011)], got


def _stop_reading(port: int, conversation: str) -> list[tuple[str, object]]:
    """Asks for the page and reads none of it for a while (its small receive buffer fills at once,
    so the server's ping waits behind bytes nobody takes), then reads everything it was sent."""
    s, greeted = _greeted(port, rcvbuf=4096)
    with s:
        s.sendall(_text({"type": "get_history", "request_id": "page", "conversation": conversation}))
        time.sleep(3 * float(PING_TIMEOUT_S))  # past the pong's wait, well within the send timeout (30 s)
        client = Paced(s, greeted.buf, rate=10 * RATE)
        got: list[tuple[str, object]] = []
        while not got or got[-1][0] != "close":
            got.append(_what(*client.next_frame()))
        return got


def test_a_client_that_stops_reading_is_still_closed_by_its_keepalive(server: ServeProcess, conversation: str) -> None:
    got = _stop_reading(_port(server), conversation)
    assert got == [("history", "page"), ("close", 1011)], got


# ── the client library, on a slow link ───────────────────────────────────────────────────────


class QuickPings(ProtocolClient):
    PING_INTERVAL_S = 0.25
    PING_TIMEOUT_S = 1.0


@asynccontextmanager
async def slow_link(port: int, rate: float) -> AsyncIterator[int]:
    """A loopback proxy to `port` that passes what the server sends at `rate` bytes a second (and
    what the client sends at once): its port."""
    pipes: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, paced: bool) -> None:
        try:
            while chunk := await reader.read(4096):
                writer.write(chunk)
                await writer.drain()
                if paced:
                    await asyncio.sleep(len(chunk) / rate)
        except OSError:
            pass
        finally:
            writer.close()

    async def accepted(down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        up = socket.create_connection(("127.0.0.1", port))
        up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # what the proxy took, it passed on
        up.setblocking(False)
        up_reader, up_writer = await asyncio.open_connection(sock=up, limit=8 * 1024)
        for task in (pipe(down_reader, up_writer, False), pipe(up_reader, down_writer, True)):
            pipes.add(asyncio.create_task(task))

    proxy = await asyncio.start_server(accepted, "127.0.0.1", 0)
    try:
        yield proxy.sockets[0].getsockname()[1]
    finally:
        proxy.close()
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        await proxy.wait_closed()


async def test_the_client_library_does_not_close_a_server_sending_it_a_big_page_steadily(
    server: ServeProcess, conversation: str
) -> None:
    """Its pings are answered behind the page (~2.4 s here, its pong timeout 1 s): the page, then
    a request's answer, on the same connection."""
    async with slow_link(_port(server), RATE) as port:
        client = await QuickPings.connect(f"http://127.0.0.1:{port}", open_timeout=T)
        try:
            started = time.monotonic()
            page = await asyncio.wait_for(client.request({"type": "get_history", "conversation": conversation}), T)
            took = time.monotonic() - started
            pong = await asyncio.wait_for(client.request({"type": "ping"}), T)
        finally:
            await client.close()
    assert page["type"] == "history" and page["messages"], page.get("type")
    assert took > 2 * QuickPings.PING_TIMEOUT_S, took  # the link was as slow as meant
    assert pong["type"] == "pong", pong
    assert client.reconnects == 0
