"""Every line a client without a valid credential can make a real `appserver serve` log goes through
one refusal limit (docs/security.md): the first 10 of every 10 s are written and the rest counted,
the edge's lines and the guard's together. Before, the edge and the guard each had a limit of their
own (20 lines per 10 s from a mixed flood), and lines of the edge's connection code were not limited
at all: a WebSocket that sends a text message that is not UTF-8 (one line per socket: 300 sockets
wrote 300 lines in 1.2 s), a request asking for an upgrade other than WebSocket (uvicorn's
`Unsupported upgrade request.`, a WARNING per request), an upgrade followed by more than the edge
keeps before its answer, and a socket aborted for taking none of its pongs.

Raw sockets on loopback; the server's log read after it stops.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0  # every wait here is bounded
PER_INTERVAL, INTERVAL_S = 10, 10.0  # docs/security.md: the first 10 refusal lines of every 10 s
LINE_MAX = 600  # no line a client can cause is longer
SEND_TIMEOUT_S = 1.0  # [limits] send_timeout_s: a socket that takes none of its pongs is aborted after it
HELD = re.compile(r"(\d+) more refused request\(s\) were not logged")
# The lines of the server's start and stop: none of them is a client's doing.
OWN = ("appserver.serve:", "appserver.cron:", "appserver: permissions")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    env = cli_env(home)
    env["APPSERVER_LIMITS__SEND_TIMEOUT_S"] = str(SEND_TIMEOUT_S)
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp


def _port(sp: ServeProcess) -> int:
    return int(sp.url.rsplit(":", 1)[1].strip("/"))


def _masked(payload: bytes, opcode: int) -> bytes:
    """A client's frame (masked, final) of at most 125 bytes."""
    assert len(payload) <= 125
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return struct.pack("!BB", 0x80 | opcode, 0x80 | len(payload)) + mask + masked


def _upgrade_head(port: int, key: str | None = None) -> bytes:
    key = key or base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


class Ws:
    """A raw WebSocket client: the upgrade, frames sent as they are, the server's frames read."""

    def __init__(self, port: int, rcvbuf: int = 0) -> None:
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(T)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(_upgrade_head(port))
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].split()[1] == b"101", head

    def _more(self) -> None:
        got = self.sock.recv(65536)
        if not got:
            raise ConnectionError("closed without a close frame")
        self.buf += got

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self) -> tuple[int, bytes]:
        b0, b1 = self._take(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._take(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._take(8))[0]
        return b0 & 0x0F, self._take(n)

    def close_code(self) -> int:
        """The code of the server's close frame (the frames before it skipped)."""
        while True:
            opcode, payload = self.frame()
            if opcode == 8:
                return int(struct.unpack("!H", payload[:2])[0])

    def close(self) -> None:
        self.sock.close()


def _exchange(port: int, payload: bytes) -> bytes:
    """Send `payload` on a new connection: → what came back before the server closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=T) as s:
        got = b""
        try:
            s.sendall(payload)
            while chunk := s.recv(65536):
                got += chunk
        except (ConnectionResetError, BrokenPipeError):  # cut off (an answer may have come first)
            pass
        return got


def _not_utf8(port: int) -> None:
    ws = Ws(port)
    try:
        ws.sock.sendall(_masked(b"\xff" + b"A" * 100, opcode=1))
        assert ws.close_code() == 1007
    finally:
        ws.close()


def _made_up_hello(port: int, i: int) -> None:
    ws = Ws(port)
    try:
        hello = {"type": "hello", "protocol": 1, "client": "x", "token": f"aps_{i:040d}", "request_id": "h"}
        ws.sock.sendall(_masked(json.dumps(hello).encode(), opcode=1))
        opcode, payload = ws.frame()
        assert opcode == 1 and json.loads(payload)["code"] == "invalid_api_key", payload
        assert ws.close_code() == 4401
    finally:
        ws.close()


def _takes_no_pong(port: int) -> None:
    """A socket that pings without end and reads nothing: aborted by the send timeout."""
    ws = Ws(port, rcvbuf=4096)
    ping = _masked(b"p" * 125, opcode=9)
    ws.sock.setblocking(False)
    deadline = time.monotonic() + T
    try:
        while time.monotonic() < deadline:
            try:
                ws.sock.send(ping)
            except BlockingIOError:
                time.sleep(0.02)
            except OSError:  # reset: the server aborted it
                return
        raise AssertionError("the server did not abort a socket that took none of its pongs")
    finally:
        ws.close()


def _status(answer: bytes) -> bytes:
    return answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.1 ") else answer[:40]


def _flood(port: int) -> dict[str, tuple[int, Callable[[int], None]]]:
    """The kinds of refusal lines a client without a credential can cause: (how many, one of them)."""
    host = f"Host: 127.0.0.1:{port}\r\n"

    def garbage(i: int) -> None:
        assert _status(_exchange(port, b"\x16\x03\x01garbage %d\r\n\r\n" % i)) == b"400"

    def bad_key(i: int) -> None:
        assert _status(_exchange(port, _upgrade_head(port, key="K" * 300))) == b"400"

    def made_up_token(i: int) -> None:
        head = f"GET /v1/models HTTP/1.1\r\n{host}Authorization: Bearer aps_{i:040d}\r\nConnection: close\r\n\r\n"
        assert _status(_exchange(port, head.encode())) == b"401"

    def h2c(i: int) -> None:
        head = (
            f"GET /healthz HTTP/1.1\r\n{host}Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            "HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", port), timeout=T) as s:
            s.sendall(head.encode())
            assert _status(s.recv(65536)) == b"200"

    def early(i: int) -> None:
        # an upgrade pipelined behind a request, and more after it than the edge keeps for it
        probe = f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode()
        _exchange(port, probe + _upgrade_head(port) + b"x" * 70_000)

    return {
        "garbage": (15, garbage),
        "bad_key": (15, bad_key),
        "made_up_token": (15, made_up_token),
        "made_up_hello": (15, lambda i: _made_up_hello(port, i)),
        "not_utf8": (15, lambda i: _not_utf8(port)),
        "h2c": (15, h2c),
        "early": (15, early),
        "takes_no_pong": (5, lambda i: _takes_no_pong(port)),
    }


def _client_lines(sp: ServeProcess) -> tuple[list[str], list[str]]:
    """Stop the server: → (the lines a client caused, the lines counting those not logged)."""
    assert sp.stop() == 0
    assert sp.proc.stderr is not None
    lines = sp.proc.stderr.read().splitlines()
    long = [line[:200] for line in lines if len(line) > LINE_MAX]
    assert not long, long
    counts = [line for line in lines if HELD.search(line)]
    caused = [line for line in lines if line not in counts and not any(own in line for own in OWN)]
    return caused, counts


def _check_one_limit(caused: list[str], counts: list[str], events: int, elapsed_s: float) -> None:
    """Every event is a line written or counted once; at most PER_INTERVAL written, and one count
    line, per interval begun."""
    held = sum(int(n) for line in counts for n in HELD.findall(line))
    intervals = math.floor(elapsed_s / INTERVAL_S) + 1
    assert len(caused) <= PER_INTERVAL * intervals, (len(caused), intervals, caused)
    assert len(counts) <= intervals, counts
    assert len(caused) + held == events, (len(caused), held, events, caused)


def test_text_that_is_not_utf8_from_sockets_that_never_said_hello_is_a_bounded_log(server: ServeProcess) -> None:
    port = _port(server)
    started = time.monotonic()
    n = 40
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: _not_utf8(port), range(n)))
    caused, counts = _client_lines(server)
    assert caused and all("not UTF-8: closing (1007)" in line for line in caused), caused
    _check_one_limit(caused, counts, n, time.monotonic() - started)


def test_a_mixed_flood_shares_one_limit_of_the_edge_and_the_guard(server: ServeProcess) -> None:
    """Edge refusals (a bad request line, a bad WebSocket handshake, an h2c upgrade, bytes before an
    upgrade's answer, text that is not UTF-8, a socket aborted for its pongs) and the guard's (a
    made-up token, on a request and in a hello) in one go: 10 lines per 10 s in all, the rest counted."""
    port = _port(server)
    kinds = _flood(port)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        rounds = max(n for n, _ in kinds.values())  # the kinds interleaved
        waits = [pool.submit(one, i) for i in range(rounds) for n, one in kinds.values() if i < n]
        for w in waits:
            w.result(timeout=3 * T)
    caused, counts = _client_lines(server)
    _check_one_limit(caused, counts, sum(n for n, _ in kinds.values()), time.monotonic() - started)
