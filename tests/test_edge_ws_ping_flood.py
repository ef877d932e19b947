"""A WebSocket client that pings and never reads (issue: a server's memory grew by hundreds of MB in
seconds, even before `hello`): every ping gets a pong the client never takes, so once the socket is
over its high-water mark the server reads nothing more from it, and the edge's send timeout aborts
the connection when no byte is taken. Real `serve`, raw frames on a real socket."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

SEND_TIMEOUT_S = 2.0


@pytest.fixture
def sp(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__SEND_TIMEOUT_S=str(SEND_TIMEOUT_S))
    with serving(home, env=env) as server:
        yield server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def ping(payload: bytes) -> bytes:
    """A masked client PING frame (opcode 9) with a zero mask: the payload goes as it is."""
    return struct.pack("!BB", 0x89, 0x80 | len(payload)) + b"\0\0\0\0" + payload


def upgraded(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def test_a_client_that_pings_and_never_reads_costs_bounded_memory_and_is_cut_off(sp: ServeProcess) -> None:
    port = int(sp.url.rsplit(":", 1)[1])
    pid = sp.proc.pid
    before = rss_mb(pid)
    s = upgraded(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes (almost) nothing of the pongs
    s.settimeout(1.0)
    burst = ping(b"x" * 125) * 1000
    sent, started, stalled = 0, time.monotonic(), False
    try:
        while sent < 100 * 1024 * 1024 and time.monotonic() - started < 20:
            s.sendall(burst)
            sent += len(burst)
    except TimeoutError:
        stalled = True  # the server stopped reading from a client that takes nothing
    except (BrokenPipeError, ConnectionResetError):
        stalled = True
    grown = rss_mb(pid) - before
    assert stalled, f"the server kept reading: {sent / 1e6:.0f} MB of pings taken in {time.monotonic() - started:.0f} s"
    assert sent < 32 * 1024 * 1024, f"{sent / 1e6:.0f} MB of pings taken from a client that reads nothing"
    assert grown < 40, f"the server grew by {grown:.0f} MB"
    # past the send timeout without a byte taken, the connection is aborted
    deadline = time.monotonic() + 4 * SEND_TIMEOUT_S
    gone = False
    while not gone and time.monotonic() < deadline:
        try:
            s.send(burst[:131])
            time.sleep(0.1)
        except TimeoutError:
            time.sleep(0.1)
        except OSError:
            gone = True
    s.close()
    assert gone, "a client that took no byte for the send timeout was not cut off"
    assert httpx.get(sp.url + "/healthz", timeout=5).status_code == 200  # everyone else is served
    assert os.path.exists(f"/proc/{pid}")
