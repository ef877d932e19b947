"""Issue 5 acceptance 8 (200 subscribers, one that never reads) and the keepalive."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import time
from pathlib import Path

import websockets

from tests.support.cli import cli_env
from tests.support.serve import start_serve
from tests.support.ws import WS, ws_url


async def _stalled_client(http_url: str) -> websockets.ClientConnection:
    """A client that never reads: tiny receive buffer, and its library stops reading after 1 frame."""
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return await websockets.connect(ws_url(http_url), sock=sock, max_queue=1, max_size=None, ping_interval=None)


async def read_to_close(ws: websockets.ClientConnection) -> websockets.ConnectionClosed:
    """Read everything a client was sent, up to the close: the close it got."""
    try:
        while True:
            await ws.recv()
    except websockets.ConnectionClosed as exc:
        return exc


def test_two_hundred_subscribers_and_one_that_never_reads(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__WS_OUTBOUND_MAX="8", APPSERVER_LIMITS__WS_SEND_TIMEOUT_S="1")
    sp = start_serve(home, env=env)

    async def go() -> None:
        boss = await WS.open(sp.url)
        conv = (await boss.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
        # a conversation with a large history: replies to get_history are big, non-droppable frames
        big = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": " ".join(["x" * 99] * 2000)}
        )
        await boss.terminal(big["turn_id"])
        await boss.request({"type": "subscribe", "conversation": conv})

        subs = await asyncio.gather(*(WS.open(sp.url) for _ in range(200)))
        for ws in subs:
            await ws.send({"type": "subscribe", "conversation": conv})
        for ws in subs:
            assert (await ws.recv())["type"] == "conversation_state"

        stalled = await _stalled_client(sp.url)
        await stalled.send('{"type":"hello","protocol":1}')
        await stalled.send(f'{{"type":"subscribe","conversation":"{conv}"}}')
        # ~12 MB of replies it will never read: frames are written straight to the socket while it
        # takes them (a few MB, into the kernel's buffers), then queue up to the bound (8)
        for _ in range(30):
            await stalled.send(f'{{"type":"get_history","conversation":"{big["conversation_id"]}"}}')
        await asyncio.sleep(0.3)

        t0 = time.monotonic()
        ack = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "to everyone"}
        )
        snaps = await asyncio.gather(*(ws.terminal(ack["turn_id"], timeout=20) for ws in subs))
        elapsed = time.monotonic() - t0
        assert all(s["status"] == "completed" and s["blocks"][-1]["text"] == "echo: to everyone" for s in snaps)
        assert elapsed < 5, f"fan-out to 200 took {elapsed:.2f} s"
        for ws in subs:  # none of the readers was disconnected
            assert (await ws.request({"type": "ping"}))["type"] == "pong"

        # the stalled client was disconnected: once it reads, it finds the close after its backlog
        closed = await asyncio.wait_for(read_to_close(stalled), 15)
        # the bound, or (on a slow host) the send timeout of the frame the writer task holds
        assert closed.rcvd is not None and closed.rcvd.code == 4408, closed
        assert "not reading" in closed.rcvd.reason or "could not be delivered" in closed.rcvd.reason, closed
        await asyncio.gather(*(ws.close() for ws in subs))
        await boss.close()

    try:
        asyncio.run(go())
    finally:
        sp.stop()


def _raw_upgrade(http_url: str) -> socket.socket:
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    return sock


def test_keepalive_closes_a_silent_peer(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(
        home, env=cli_env(home, APPSERVER_LIMITS__WS_PING_INTERVAL_S="0.3", APPSERVER_LIMITS__WS_PING_TIMEOUT_S="1")
    )

    async def polite() -> None:
        ws = await WS.open(sp.url)  # the websockets client answers pings by itself
        await asyncio.sleep(2.0)
        assert (await ws.request({"type": "ping"}))["type"] == "pong"
        await ws.close()

    try:
        silent = _raw_upgrade(sp.url)  # upgrades, then never answers a ping
        asyncio.run(polite())
        data = b""
        silent.settimeout(5)
        while True:
            chunk = silent.recv(65536)
            if not chunk:
                break
            data += chunk
        assert data.startswith(b"HTTP/1.1 101")
        assert b"\x89" in data  # a ping frame was sent
        assert b"keepalive ping timeout" in data  # then a close frame with the reason
    finally:
        sp.stop()


def test_a_large_audience_gets_a_short_turn_in_one_round(tmp_path: Path) -> None:
    """With many subscribers (PACE_SUBSCRIBERS) each round of sends is costly, so the hub lets a
    turn move on before a round and sends its newest state: a short turn reaches everyone once,
    finished, instead of snapshot after snapshot. A small audience still sees it run."""
    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home))

    async def frames_per_subscriber(n: int) -> list[int]:
        boss = await WS.open(sp.url)
        conv = (await boss.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
        subs = await asyncio.gather(*(WS.open(sp.url) for _ in range(n)))
        for ws in subs:
            await ws.send({"type": "subscribe", "conversation": conv})
        for ws in subs:
            assert (await ws.recv())["type"] == "conversation_state"
        ack = await boss.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "hi"})
        snaps = await asyncio.gather(*(ws.terminal(ack["turn_id"]) for ws in subs))
        assert all(s["status"] == "completed" and s["blocks"][-1]["text"] == "echo: hi" for s in snaps)
        counts = [sum(1 for f in ws.seen if f["type"] == "turn_updated") for ws in subs]
        await asyncio.gather(*(ws.close() for ws in subs))
        await boss.close()
        return counts

    try:
        alone = asyncio.run(frames_per_subscriber(1))
        crowd = asyncio.run(frames_per_subscriber(80))
    finally:
        sp.stop()
    assert alone[0] >= 3  # queued/running snapshots, then the finished one
    assert max(crowd) < alone[0], (alone, sorted(set(crowd)))


def test_a_slow_consumer_finds_its_close_after_its_backlog_however_late_it_reads(tmp_path: Path) -> None:
    """The close goes behind the backlog at once, not when the paused socket drains: the endpoint
    gives up on a close after a few seconds (CLOSE_WAIT_S), and a client that only then read found
    its data end with no close frame."""
    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home, APPSERVER_LIMITS__WS_OUTBOUND_MAX="4"))

    async def go() -> None:
        boss = await WS.open(sp.url)
        big = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": " ".join(["x" * 99] * 2000)}
        )
        await boss.terminal(big["turn_id"])
        stalled = await _stalled_client(sp.url)
        await stalled.send('{"type":"hello","protocol":1}')
        for _ in range(30):
            await stalled.send(f'{{"type":"get_history","conversation":"{big["conversation_id"]}"}}')
        await asyncio.sleep(6.5)  # longer than the endpoint waits for a close to be written
        closed = await asyncio.wait_for(read_to_close(stalled), 15)
        assert closed.rcvd is not None and closed.rcvd.code == 4408, closed
        await boss.close()

    try:
        asyncio.run(go())
    finally:
        sp.stop()


def test_a_stop_does_not_wait_for_a_client_that_reads_nothing(tmp_path: Path) -> None:
    """A client whose socket is full never takes the server's close: the stop drops it after a
    short drain instead of waiting out its whole grace and logging an ERROR."""
    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home))

    async def fill() -> websockets.ClientConnection:
        boss = await WS.open(sp.url)
        big = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": " ".join(["x" * 99] * 2000)}
        )
        await boss.terminal(big["turn_id"])
        await boss.close()
        stalled = await _stalled_client(sp.url)
        await stalled.send('{"type":"hello","protocol":1}')
        for _ in range(30):  # ~12 MB it never reads: more than the kernel's buffers hold
            await stalled.send(f'{{"type":"get_history","conversation":"{big["conversation_id"]}"}}')
        await asyncio.sleep(1.0)
        return stalled

    async def go() -> None:
        stalled = await fill()
        t0 = time.monotonic()
        sp.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(sp.proc.wait, 20)
        took = time.monotonic() - t0
        err = sp.proc.stderr.read() if sp.proc.stderr else ""
        assert code == 0, err[-2000:]
        assert "graceful shutdown exceeded" not in err, err[-2000:]
        assert took < 5, f"the stop took {took:.1f} s"
        stalled.transport.abort()

    try:
        asyncio.run(go())
    finally:
        sp.kill()
