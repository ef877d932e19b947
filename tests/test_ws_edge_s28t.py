"""Session 28, an outside tester's two findings on what the WebSocket edge reads (helper T).

1. With `[server] ws_compression`, WS_STEP_BYTES bounded what one socket inflated in a step, but
   every ready socket ran its step in the same event-loop iteration: 64 sockets each sending frames
   of ~4 KB that inflate to 4 MiB made each iteration ~1.5 s long, and /healthz waited 10-14 s.
   Now a frame that may inflate past 64 KiB is inflated only once the server's inflate gate lets
   it: one per iteration, server-wide; the others wait their turn.
2. A client on a slow link that reads steadily was closed 1009 for the server's own pause: it asked
   for a big history page and then sent a message; the server read nothing more of it while its
   downlink was full (ws/connection.py `wait_for_room`), and charged that to the message's
   reservation (`message_read_s`). Now the clock does not run while the server holds it back behind
   a downlink that drains at 64 KiB/s or more; one that stops reading is still closed.

Real sockets against the app behind uvicorn and the edge, in this test's loop; the order of what
arrives is checked, every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from appserver.security.ws_inbound import InboundBudget
from tests.test_edge_s27a import MiB, T, compressed, connect, hello, serving, upgrade
from tests.test_edge_s27a2 import Client
from tests.test_ws_edge_s28m import BIG_PROBE, _big_conversation, _drain, _text, _until, edge

pytestmark = pytest.mark.timeout(180)


# ── 1. many sockets' compressed bombs and everyone else ──────────────────────────────────────

SOCKETS = 20
BOMBS = 6  # per socket


def _bomber(port: int, token: str, done: list[int], lock: threading.Lock, ready: threading.Barrier) -> None:
    """BOMBS frames of ~1 KB on the wire that each inflate to 1 MiB (far past the 64 KiB the inflate
    gate lets through freely, and one WS_STEP_BYTES step: before the fix, every ready bomber finished
    one in each loop iteration), sent in one write once every bomber is greeted; each answer counted
    in `done` as it arrives."""
    filler = "a" * (MiB - 200)
    with connect(port) as s:
        s.settimeout(12 * T)
        s.sendall(upgrade(port, token, deflate=True) + hello())
        client = Client(s)
        assert client.head().startswith(b"HTTP/1.1 101 ")
        assert client.answer("h")["type"] == "welcome"
        pings = b"".join(
            compressed(json.dumps({"type": "ping", "request_id": f"b{i}", "pad": filler}).encode())
            for i in range(BOMBS)
        )
        ready.wait(3 * T)
        s.sendall(pings)
        for i in range(BOMBS):
            assert client.answer(f"b{i}")["type"] == "pong"
            with lock:
                done[0] += 1


def _healthz(port: int) -> bytes:
    with connect(port) as s:
        s.settimeout(12 * T)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


async def test_many_sockets_compressed_bombs_inflate_one_per_loop_iteration(tmp_path: Path) -> None:
    budget = InboundBudget(256 * MiB, group_max_bytes=256 * MiB)
    async with serving(tmp_path, deflate=True, inbound=budget) as sv:
        done, lock = [0], threading.Lock()
        ready = threading.Barrier(SOCKETS + 1)
        bombers = [
            threading.Thread(target=_bomber, args=(sv.port, sv.token, done, lock, ready), daemon=True)
            for _ in range(SOCKETS)
        ]
        for t in bombers:
            t.start()
        await asyncio.to_thread(ready.wait, 3 * T)
        await _until(lambda: done[0] >= SOCKETS, "no bombs were answered", 6 * T)
        # The server is inflating every bomber's frames now. Before: each loop iteration ran one step
        # of every bomber, each inflating 4 MiB, and the probe (a few iterations) waited for
        # SOCKETS of them per iteration; now one per iteration, server-wide.
        with lock:
            before = done[0]
        reply = await asyncio.to_thread(_healthz, sv.port)
        with lock:
            during = done[0] - before
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        assert before + during < SOCKETS * BOMBS, "the probe was answered after every bomb"
        for t in bombers:
            await asyncio.to_thread(t.join, 12 * T)
            assert not t.is_alive()
        assert done[0] == SOCKETS * BOMBS
    # the probe needs a handful of iterations: as many bombs, not SOCKETS per iteration
    print("bombs answered while the probe waited:", during)
    assert during < SOCKETS, during
    assert budget.inflates.waits > 0


# ── 2. a client on a slow link that reads steadily ───────────────────────────────────────────


class Paced(Client):
    """A client that reads at most `step` bytes at a time, `rate` bytes a second, for `paced_s`
    seconds (for ever when None), then as fast as it can."""

    def __init__(self, sock: socket.socket, *, rate: float, step: int, paced_s: float | None) -> None:
        super().__init__(sock)
        self.rate, self.step = rate, step
        self.until = None if paced_s is None else time.monotonic() + paced_s

    def _more(self) -> None:
        if self.until is not None and time.monotonic() >= self.until:
            super()._more()
            return
        chunk = self.sock.recv(self.step)
        if not chunk:
            raise EOFError("closed")
        self.buf += chunk
        time.sleep(len(chunk) / self.rate)


def _slow_link(
    port: int, token: str, conversation: str, *, rate: float, paced_s: float | None
) -> list[tuple[str, object]]:
    """Asks for the big page (~1.2 MB, over half the outbound buffer: the app reads no further
    request until it drains) and sends a message of 900 KB (a reservation) right behind it, then
    reads what it is sent at `rate`: what it got."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what it took is what it read
    s.connect(("127.0.0.1", port))
    s.settimeout(3 * T)
    with s:
        s.sendall(upgrade(port, token) + hello())
        client = Client(s)
        assert client.head().startswith(b"HTTP/1.1 101 ")
        assert client.answer("h")["type"] == "welcome"
        page = {"type": "get_history", "request_id": "page", "conversation": conversation, "limit": 100}
        s.sendall(_text(page) + BIG_PROBE)
        paced = Paced(s, rate=rate, step=min(20_000, int(rate / 5)), paced_s=paced_s)
        paced.buf = client.buf
        return _drain(paced)


@pytest.mark.parametrize("reads", ["steadily", "a_trickle"])
async def test_a_reservation_is_not_charged_while_a_steadily_read_downlink_holds_it_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reads: str
) -> None:
    """message_read_s is 2 s here; the page takes ~6 s at 200 KB/s (over 64 KiB/s): the steady
    reader is not closed and gets its answer. One that reads 2 KB every half second for 6 s (its
    downlink all but unread) is closed 1009 as before."""
    caplog.set_level(logging.INFO, logger="appserver")
    async with edge(tmp_path, message_read_s=2.0, ping=None) as sv:
        budget = sv.budget
        conversation = await asyncio.to_thread(_big_conversation, sv.port, sv.holder_token)
        started = time.monotonic()
        if reads == "steadily":
            got = await asyncio.to_thread(
                _slow_link, sv.port, sv.holder_token, conversation, rate=200_000, paced_s=None
            )
        else:
            got = await asyncio.to_thread(_slow_link, sv.port, sv.holder_token, conversation, rate=4_000, paced_s=6.0)
        took = time.monotonic() - started
        await _until(lambda: budget.held == 0, "the reservation was not given back")
    lines = [r.getMessage() for r in caplog.records if "inbound budget: closing (1009)" in r.getMessage()]
    if reads == "steadily":
        # Before: closed 1009 two seconds in ("had a message the server did not take"), page and
        # message lost.
        assert took > 4.0, took  # it did hold its reservation past message_read_s
        assert got == [("history", "page"), ("pong", "probe")], got
        assert not lines, lines
    else:
        assert got[-1] == ("close", 1009), got
        assert ("pong", "probe") not in got, got
        assert len(lines) == 1 and "had a message the server did not take in 2 s" in lines[0], lines
