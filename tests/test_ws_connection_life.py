"""A connection's life (issue 5): keepalive closes a silent peer; a stopping server says so first."""

from __future__ import annotations

import base64
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.support.cli import cli_env
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(30)


def test_a_peer_that_never_answers_pings_is_closed_after_the_timeout(home: Path) -> None:
    env = cli_env(home, APPSERVER_LIMITS__WS_PING_INTERVAL_S="1", APPSERVER_LIMITS__WS_PING_TIMEOUT_S="3")
    sp = start_serve(home, env=env)
    try:
        url = urlparse(sp.url)
        sock = socket.create_connection((url.hostname, url.port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            (
                f"GET /ws HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        start = time.monotonic()
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 101"), data[:80]
        buffer = data.split(b"\r\n\r\n", 1)[1]
        opcodes: list[int] = []
        # Read (never answer) until the server closes: pings are opcode 9, the close frame 8.
        while 8 not in opcodes:
            chunk = sock.recv(4096)
            if not chunk:
                break
            buffer += chunk
            while len(buffer) >= 2 and len(buffer) >= 2 + (buffer[1] & 0x7F):  # server frames: unmasked, short
                opcodes.append(buffer[0] & 0x0F)
                buffer = buffer[2 + (buffer[1] & 0x7F) :]
        elapsed = time.monotonic() - start
        sock.close()
    finally:
        sp.stop()
    assert 9 in opcodes, "the server sent no ping"
    assert opcodes[-1] == 8, f"the server did not end with a close frame: {opcodes}"
    # One ping after 1 s, then 2 s waiting for its pong: closed 3 s after the last sign of life.
    assert 2.5 <= elapsed <= 3.8, f"closed after {elapsed:.1f} s, expected 3 s of silence"


async def test_clients_are_told_before_the_server_stops(home: Path) -> None:
    from appserver.client import ProtocolClient

    sp = start_serve(home)
    try:
        client = await ProtocolClient.connect(sp.url)
        await client.request({"type": "ping"})
        sp.proc.send_signal(signal.SIGTERM)
        frame = await client.next_frame(timeout=10)
        assert frame == {"type": "event", "name": "server_stopping", "data": {"reason": "shutdown"}}
        await client.close()
        assert sp.proc.wait(15) == 0
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
