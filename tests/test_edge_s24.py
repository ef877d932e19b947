"""Edge fixes of session 24, against a real `appserver serve` on loopback, with raw sockets.

1. A chunked body made only of one endless chunk extension (`1;x=aaaa…`, no CRLF) decoded to 0
   bytes: `body_max_bytes` (decoded) never applied, it arrived faster than `body_min_rate_bytes_s`,
   and `head_max_bytes` does not cover a body; one request held its connection (and its client's
   slot) open forever. Now a chunk-size line has a cap (400 `chunk_extension_too_long`), and a
   chunked body's wire bytes, framing included, have one too (413 `request_too_large`).
2. A trickled body was judged first at twice `body_timeout_s`: the rate was taken over the time
   past the timeout, not since the body began, as the docs say. Now it is cut once it has taken
   `body_timeout_s` and averages under the rate.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0  # the longest any single wait may take
BODY_TIMEOUT_S = 2.0
BODY_MAX = 4096


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("edge24") / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    env = cli_env(
        home,
        APPSERVER_LIMITS__BODY_MAX_BYTES=str(BODY_MAX),
        APPSERVER_LIMITS__BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
        APPSERVER_LIMITS__BODY_MIN_RATE_BYTES_S="1024",
    )
    with serving(home, env=env) as sp:
        yield sp


def _connect(sp: ServeProcess) -> socket.socket:
    host, port = sp.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=T)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _head(extra: str) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra + "\r\n"
    ).encode()


CHUNKED = _head("Transfer-Encoding: chunked\r\n")


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length framed response."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head; got {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(rest) < need and (chunk := s.recv(65536)):
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:need]


def _send_quietly(s: socket.socket, data: bytes) -> None:
    """Send; a server that answered and closed may reset the rest, which is its right."""
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _assert_error(reply: tuple[int, dict[str, str], bytes], status: int, code: str) -> str:
    got, headers, body = reply
    assert got == status, (got, body)
    assert headers["content-type"] == "application/json"
    assert headers["x-request-id"].startswith("req_")
    error = json.loads(body)["error"]
    assert error["code"] == code, error
    return str(error["message"])


# ── 1. chunk framing is bounded ───────────────────────────────────────────────────────────────


def test_an_endless_chunk_extension_gets_400_not_an_open_request(srv: ServeProcess) -> None:
    with _connect(srv) as s:
        s.sendall(CHUNKED + b"1;x=")
        for _ in range(16):  # 64 KiB of one extension, in reads of its own
            _send_quietly(s, b"a" * 4096)
            time.sleep(0.01)
        message = _assert_error(_read_response(s), 400, "chunk_extension_too_long")
    assert "chunk-size line" in message


def test_an_endless_chunk_extension_in_one_write_gets_400(srv: ServeProcess) -> None:
    with _connect(srv) as s:
        _send_quietly(s, CHUNKED + b"1;x=" + b"a" * (256 * 1024))
        _assert_error(_read_response(s), 400, "chunk_extension_too_long")


def test_chunk_framing_past_the_wire_cap_gets_413(srv: ServeProcess) -> None:
    """Each chunk line under its cap, one byte of data each: 10 bytes decoded, 80 KB on the wire."""
    chunk = b"1;pad=" + b"p" * 8000 + b"\r\n{\r\n"
    with _connect(srv) as s:
        s.sendall(CHUNKED)
        for _ in range(10):
            _send_quietly(s, chunk)
            time.sleep(0.01)
        message = _assert_error(_read_response(s), 413, "request_too_large")
    assert "body_max_bytes" in message


def test_an_ordinary_chunked_body_still_works(srv: ServeProcess) -> None:
    body = json.dumps({"model": "a", "messages": [{"role": "user", "content": "chunked hello"}]}).encode()
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
    framed = b"".join(b"%x;n=v\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: t\r\n\r\n"
    with _connect(srv) as s:
        s.sendall(CHUNKED + framed)
        status, _, reply = _read_response(s)
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["message"]["content"] == "echo: chunked hello"


# ── 2. the minimum rate is judged from body_timeout_s on ─────────────────────────────────────


def test_a_trickle_is_cut_once_it_has_taken_body_timeout_s(srv: ServeProcess) -> None:
    """20 bytes/s, never quiet: under the 1024 bytes/s average as soon as it is judged, at
    `body_timeout_s` (it was 2× that)."""
    with _connect(srv) as s:
        s.sendall(_head("Content-Length: 3000\r\n"))
        started = time.monotonic()
        s.setblocking(False)
        got = b""
        while not got and time.monotonic() - started < 3 * BODY_TIMEOUT_S:
            try:
                got = s.recv(65536)
            except BlockingIOError:
                _send_quietly(s, b" ")
                time.sleep(0.05)
        took = time.monotonic() - started
        s.setblocking(True)
        s.settimeout(T)
        assert got, "the trickle was never cut off"
        while not got.rstrip().endswith(b"}") and (more := s.recv(65536)):
            got += more
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", got
    assert "body_min_rate_bytes_s" in json.loads(body)["error"]["message"]
    assert took < 1.6 * BODY_TIMEOUT_S, f"cut after {took:.1f} s"


def test_a_body_above_the_rate_outlasts_body_timeout_s(srv: ServeProcess) -> None:
    """~1500 bytes/s for ~1.25 × body_timeout_s: re-judged as it goes, never cut."""
    content = "x" * 3600
    body = json.dumps({"model": "a", "messages": [{"role": "user", "content": content}]}).encode()
    assert len(body) <= BODY_MAX
    with _connect(srv) as s:
        s.sendall(_head(f"Content-Length: {len(body)}\r\n"))
        for i in range(0, len(body), 150):
            s.sendall(body[i : i + 150])
            time.sleep(0.1)
        status, _, reply = _read_response(s)
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["message"]["content"] == f"echo: {content}"
