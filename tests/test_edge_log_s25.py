"""The edge's own refusals (a bad request line, a bad WebSocket handshake, a conflicting
Transfer-Encoding and Content-Length) write a bounded amount of log, through a real `appserver
serve --auth token` on loopback and raw sockets: the first few lines of an interval are logged,
the rest counted and the count logged (at the latest at the stop). One line per refusal wrote
~360 KiB/s of log from one client before.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from pathlib import Path

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0
EACH = 1000
CONFLICT = b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp


def _refused(host: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=T) as s:
        s.sendall(payload)
        return s.recv(100)


def test_edge_refusals_log_a_bounded_amount_and_count_the_rest(token_server: ServeProcess) -> None:
    sp = token_server
    host, port_s = sp.url.split("//")[1].split(":")
    port = int(port_s)
    h = f"Host: {host}:{port}\r\n".encode()
    ws = b"GET /ws HTTP/1.1\r\n" + h + b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    payloads = {
        "bad handshake": ws + b"Sec-WebSocket-Key: " + b"K" * 200 + b"\r\n\r\n",
        "bad method": b"FOO\x01 / HTTP/1.1\r\n" + h + b"\r\n",
        "bad framing": b"POST /v1/responses HTTP/1.1\r\n"
        + h
        + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    }
    with ThreadPoolExecutor(8) as pool:
        for name, payload in payloads.items():
            answers = list(pool.map(_refused, repeat(host, EACH), repeat(port), repeat(payload)))
            assert all(a.split()[1:2] == [b"400"] for a in answers), (name, {a[:20] for a in answers})
    idle = socket.create_connection((host, port), timeout=T)  # open at the stop: its shutdown flushes
    try:
        assert sp.stop() == 0
    finally:
        idle.close()
    assert sp.proc.stderr is not None
    log = sp.proc.stderr.read()
    assert len(log.encode()) < 100_000, len(log)
    held = sum(int(n) for n in re.findall(r"(\d+) more refused request\(s\) were not logged", log))
    shown = log.count("websocket handshake from") + log.count("Invalid HTTP request received.")
    shown += log.count("Transfer-Encoding")
    assert held > 0 and held + shown == len(payloads) * EACH, (held, shown)
