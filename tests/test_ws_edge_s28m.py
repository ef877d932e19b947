"""Session 28, an outside tester's two findings on what the WebSocket edge reads (helper M).

1. A whole message the app had not taken kept its inbound budget with no time limit. Four
   credentials' sockets each asked for a big history page and read it very slowly, so the app read
   no further request of theirs (ws/connection.py `wait_for_room`); each then sent a message of
   100 bytes as two frames. The first frame reserved the whole frame limit (fragments followed),
   the message arrived whole at once (ending the 60 s bound), and its reservation went back only
   when the app took it: the 256 MiB budget was full, and another credential's 100 KB frame
   waited over 300 s. Now a whole message holds only its size (nothing when that is small), and
   what it holds must be given back within the bound, whatever holds the message up (1009).
2. With `[server] ws_compression`, one socket's read of 64 frames of 4 KB, each inflating to
   4 MiB, was inflated and handled in one event-loop step (~1.4 s): a taken message let the next
   be parsed, and the app's read loop took it at once. Eight such sockets held /healthz 13 s.

Real sockets against the app behind uvicorn and the edge, in this test's loop (the budget is
inspected), with a small inbound budget and outbound buffer; the order of what arrives is checked,
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from appserver.auth import Authenticator
from appserver.http.app import build_app
from appserver.security.edge import EdgeLimits, EdgeWebSocketProtocol, protocol_class
from appserver.security.guard import SecurityGuard
from appserver.security.ws_inbound import InboundBudget
from appserver.services import build_services
from tests.support.kernel import open_server
from tests.test_edge_s27a import MiB, T, close_code, compressed, connect, hello, masked, serving, upgrade
from tests.test_edge_s27a2 import Client

pytestmark = pytest.mark.timeout(120)

OUTBOUND = MiB  # a connection's outbound buffer: no request of it is read past half of it
PAGE_INPUT = "y" * 600_000  # echoed: a history page of ~1.2 MB, over half the buffer


@dataclass
class Served:
    port: int
    holder_token: str
    victim_token: str
    budget: InboundBudget


@asynccontextmanager
async def edge(tmp_path: Path, *, message_read_s: float, ping: tuple[float, float] | None) -> AsyncIterator[Served]:
    """The app behind the guard and the edge (as `serve` runs it), in token mode with two
    credentials, an inbound budget that one 2 MiB reservation fills, and a 1 MiB outbound buffer."""
    server = await open_server(
        tmp_path / "home", APPSERVER_AUTH__MODE="token", APPSERVER_LIMITS__WS_OUTBOUND_MAX_BYTES=str(OUTBOUND)
    )
    authenticator = Authenticator(server.config)
    assert authenticator.tokens is not None
    holder_token = authenticator.tokens.create(name="holder")[1]
    victim_token = authenticator.tokens.create(name="victim")[1]
    services = build_services(server)
    app = SecurityGuard(build_app(server, services), server.config, authenticator)
    budget = InboundBudget(2 * MiB, group_max_bytes=2 * MiB)
    limits = dataclasses.replace(
        EdgeLimits.from_config(server.config.limits, refusal_lines=app.refusals),
        inbound=budget,
        ws_message_read_s=message_read_s,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(
        app,
        http=protocol_class(limits),
        ws=EdgeWebSocketProtocol,
        ws_max_size=server.config.limits.ws_frame_max_bytes,
        ws_ping_interval=ping[0] if ping else None,
        ws_ping_timeout=ping[1] if ping else None,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    web = uvicorn.Server(config)
    task = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield Served(sock.getsockname()[1], holder_token, victim_token, budget)
    finally:
        web.should_exit = True
        await asyncio.wait_for(task, T)
        authenticator.close()
        await server.close()


def _greeted(port: int, token: str, *, rcvbuf: int = 0) -> tuple[socket.socket, Client]:
    s = socket.socket()
    if rcvbuf:  # before connecting: a small window, so the server's unsent bytes stay its own
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.settimeout(3 * T)
    s.sendall(upgrade(port, token) + hello())
    client = Client(s)
    assert client.head().startswith(b"HTTP/1.1 101 ")
    assert client.answer("h")["type"] == "welcome"
    return s, client


def _text(frame: dict[str, object]) -> bytes:
    return masked(json.dumps(frame).encode())


def _big_conversation(port: int, token: str) -> str:
    """A conversation of the holder's credential whose history page is ~1.2 MB."""
    s, client = _greeted(port, token)
    with s:
        submit = {"type": "submit_input", "request_id": "s", "agent": "assistant", "conversation": "new"}
        s.sendall(_text({**submit, "input": PAGE_INPUT}))
        ack = client.answer("s")
        assert ack["type"] == "ack", ack
        while True:
            opcode, payload = client.next_frame()
            frame = json.loads(payload) if opcode == 0x1 else {}
            snap = frame.get("snapshot") or {}
            if frame.get("type") == "turn_updated" and snap.get("status") in ("completed", "failed"):
                assert snap["status"] == "completed", snap
                return str(ack["conversation_id"])


def _hold(port: int, token: str, conversation: str, message: bytes) -> tuple[socket.socket, Client]:
    """A socket that asks for the big page, reads none of it (the app then reads no further
    request of it), and sends `message` right behind the request."""
    s, client = _greeted(port, token, rcvbuf=4096)
    page = {"type": "get_history", "request_id": "page", "conversation": conversation, "limit": 100}
    s.sendall(_text(page) + message)
    return s, client


def _victim(port: int, token: str) -> dict[str, object]:
    """Another credential's message of 1.5 MiB (it must wait while the holder holds over half a
    MiB), pings answered: what answers it."""
    s, client = _greeted(port, token)
    with s:
        s.sendall(_text({"type": "ping", "request_id": "big", "pad": "v" * (3 * MiB // 2)}))
        return client.answer("big")


def _drain(client: Client) -> list[tuple[str, object]]:
    """Everything the holder was sent, read now: (type or "close", request id or close code)."""
    got: list[tuple[str, object]] = []
    while True:
        try:
            opcode, payload = client.next_frame()
        except (EOFError, OSError):
            return got
        if opcode == 0x8:
            got.append(("close", close_code(payload)))
            return got
        frame = json.loads(payload)
        got.append((str(frame["type"]), frame.get("request_id")))
        if frame.get("request_id") == "probe":
            return got


async def _until(check: object, what: str, bound: float = T) -> None:
    for _ in range(int(bound / 0.01)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


# ── 1. a whole message the app has not taken ─────────────────────────────────────────────────

# a ping of ~40 bytes as two frames: text with FIN=0, then a continuation with FIN
FRAGMENTED = masked(b'{"type":"ping",', first=0x01) + masked(b'"request_id":"probe"}', first=0x80)


async def test_a_small_fragmented_message_the_app_has_not_taken_holds_no_budget(tmp_path: Path) -> None:
    async with edge(tmp_path, message_read_s=60.0, ping=None) as sv:
        budget = sv.budget
        conversation = await asyncio.to_thread(_big_conversation, sv.port, sv.holder_token)
        h_sock, h_client = await asyncio.to_thread(_hold, sv.port, sv.holder_token, conversation, FRAGMENTED)
        with h_sock:
            # its first frame reserved the frame limit (the whole budget here): fragments followed
            await _until(lambda: budget.peak == 2 * MiB, "the fragmented message reserved nothing")
            victim = asyncio.create_task(asyncio.to_thread(_victim, sv.port, sv.victim_token))
            # Before: held until the app took it, which it did not while the page was unread: the
            # victim's frame waited until the holder was closed as a slow consumer (30 s).
            answered = await asyncio.wait_for(victim, T)
            assert answered["type"] == "pong", answered
            assert budget.held == 0, budget.held  # whole and small: it holds nothing
            # the holder is not closed for it: once it reads, it has its page and its answer
            got = await asyncio.to_thread(_drain, h_client)
    assert got == [("history", "page"), ("pong", "probe")], got


# (under 1 MiB: the server reads that much of a client that leaves its downlink unread)
BIG_PROBE = _text({"type": "ping", "request_id": "probe", "pad": "p" * 900_000})


@pytest.mark.parametrize("pings", [False, True], ids=["no_pings", "pings"])
async def test_a_big_message_the_app_has_not_taken_is_bounded_in_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pings: bool
) -> None:
    """Whole, it holds its size (900 KB) until the app takes it: within `message_read_s`, or the
    holder is closed (1009). With pings, the holder (which reads nothing) is closed by its keepalive
    first, and still holds the budget while its close waits behind what it did not read: given back
    at the bound; the victim, waiting for the budget meanwhile, is not closed by its own keepalive."""
    caplog.set_level(logging.INFO, logger="appserver")
    async with edge(tmp_path, message_read_s=2.0, ping=(0.2, 0.6) if pings else None) as sv:
        budget = sv.budget
        conversation = await asyncio.to_thread(_big_conversation, sv.port, sv.holder_token)
        h_sock, h_client = await asyncio.to_thread(_hold, sv.port, sv.holder_token, conversation, BIG_PROBE)
        with h_sock:
            await _until(lambda: budget.peak >= 900_000, "the big message reserved nothing")
            victim = asyncio.create_task(asyncio.to_thread(_victim, sv.port, sv.victim_token))
            await _until(lambda: budget.waits >= 1, "the victim's frame did not wait for the budget")
            # Before: the holder's message, whole, held its 900 KB for as long as the app did not
            # take it, and the victim waited until the holder was closed as a slow consumer (30 s).
            answered = await asyncio.wait_for(victim, T)
            assert answered["type"] == "pong", answered  # not closed 1011 while it waited
            got = await asyncio.to_thread(_drain, h_client)
        await _until(lambda: budget.held == 0, "the holder's reservation was not given back")
    assert ("pong", "probe") not in got, got  # its message was never handled
    lines = [r.getMessage() for r in caplog.records if "inbound budget: closing (1009)" in r.getMessage()]
    if pings:
        assert got[-1] == ("close", 1011), got  # its keepalive, first
    else:
        assert got[-1] == ("close", 1009), got
        assert len(lines) == 1 and "had a message the server did not take in 2 s" in lines[0], lines


# ── 2. a compressed bomb and everyone else ───────────────────────────────────────────────────

BOMBS = 24


def _bomb(port: int, token: str, events: list[str], first: threading.Event) -> None:
    """BOMBS frames of ~4 KB on the wire that each inflate to just under the frame limit, sent in one
    write; each answer is recorded in `events` as it arrives (`first` set at the first)."""
    filler = "a" * (4 * MiB - 200)
    with connect(port) as s:
        s.settimeout(6 * T)
        s.sendall(upgrade(port, token, deflate=True) + hello())
        client = Client(s)
        assert client.head().startswith(b"HTTP/1.1 101 ")
        assert client.answer("h")["type"] == "welcome"
        pings = ({"type": "ping", "request_id": f"b{i}", "pad": filler} for i in range(BOMBS))
        s.sendall(b"".join(compressed(json.dumps(ping).encode()) for ping in pings))
        for i in range(BOMBS):
            assert client.answer(f"b{i}")["type"] == "pong"
            events.append(f"b{i}")
            first.set()


def _healthz(port: int) -> bytes:
    with connect(port) as s:
        s.settimeout(6 * T)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


async def test_a_compressed_bomb_does_not_hold_the_event_loop(tmp_path: Path) -> None:
    async with serving(tmp_path, deflate=True) as sv:
        events: list[str] = []
        first = threading.Event()
        bomb = asyncio.create_task(asyncio.to_thread(_bomb, sv.port, sv.token, events, first))
        assert await asyncio.to_thread(first.wait, 3 * T), "no bomb was answered"
        # The server is inflating and answering the bombs now. Before: the app took every message
        # of the socket's read in one step, inflating each as it took the one before; the probe
        # was answered after all of them.
        started = time.monotonic()
        reply = await asyncio.to_thread(_healthz, sv.port)
        events.append("healthz")
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        await asyncio.wait_for(bomb, 6 * T)
    assert events.index("healthz") < len(events) - 1, (events, time.monotonic() - started)


def test_a_group_holding_least_is_granted_first() -> None:
    """Given back, the budget goes first to the group holding least: in order of arrival alone, a
    credential's sockets queued behind its own holders took each reservation given back (each
    holding it up to the bound), wave after wave, ahead of another credential's one frame."""
    budget = InboundBudget(8 * MiB, group_max_bytes=8 * MiB)
    granted: list[str] = []
    for _ in range(4):
        assert budget.reserve(lambda: granted.append("a-holder"), "a", 2 * MiB)
    a1, a2, v = (lambda: granted.append("a1")), (lambda: granted.append("a2")), (lambda: granted.append("v"))
    assert not budget.reserve(a1, "a", 2 * MiB)
    assert not budget.reserve(a2, "a", 2 * MiB)
    assert not budget.reserve(v, "v", 100_000)  # another credential, behind them
    budget.release("a", 2 * MiB)  # one of a's holders is closed (or its message taken)
    assert granted == ["v"], granted  # v holds nothing: first; a1 waits for room on the total
    budget.release("a", 2 * MiB)
    assert granted == ["v", "a1"], granted
    budget.release("v", 100_000)
    budget.release("a", 2 * MiB)
    assert granted == ["v", "a1", "a2"], granted
    assert budget.held == 6 * MiB and budget.groups == {"a": 6 * MiB}
