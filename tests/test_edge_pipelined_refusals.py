"""A refusal at the HTTP edge (appserver/security/edge.py) never overtakes a reply in flight.

On a kept-alive connection a client may pipeline: send request 1 and, before its reply, the head
of request 2. When the edge refuses request 2 (a head over `head_max_bytes`: 431; a head that
stalls: 408; a body that stalls: 408; a malformed head: 400), every request accepted before it
still gets its whole reply, in order, then the refusal follows and the connection closes. A reply
that never ends does not hold the refusal forever: the replies before it get the refused phase's
timeout (`head_timeout_s`, `body_timeout_s` for a body) to finish. Raw sockets against a real
`appserver serve`.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

T = 10.0  # the longest any single wait here may take
HEAD_MAX = 4096
TIMEOUT_S = 2.0  # head_timeout_s and body_timeout_s
QUICK = 20  # echo's `/slow 20`: a reply that takes about 1 s (50 ms a word), well within TIMEOUT_S
LONG = 60  # about 3 s: outlives a timeout that fires while it runs, ends within the wait after it


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("pipelined") / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    env = cli_env(
        home,
        APPSERVER_LIMITS__HEAD_MAX_BYTES=str(HEAD_MAX),
        APPSERVER_LIMITS__HEAD_TIMEOUT_S=str(TIMEOUT_S),
        APPSERVER_LIMITS__BODY_TIMEOUT_S=str(TIMEOUT_S),
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="5",
    )
    with serving(home, env=env) as sp:
        yield sp


def connect(srv: ServeProcess) -> socket.socket:
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    return socket.create_connection((host, int(port)), timeout=T)


def chat(text: str, *, stream: bool = False) -> bytes:
    body = json.dumps({"model": "a", "stream": stream, "messages": [{"role": "user", "content": text}]})
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
OVERSIZED = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (2 * HEAD_MAX) + b"\r\n\r\n"


class Wire:
    """Content-Length framed responses read off one socket, in order, and then its end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> None:
        got = self.sock.recv(65536)
        if not got:
            raise ConnectionError(f"closed; unread: {self.buf[:300]!r}")
        self.buf += got

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        need = int(headers["content-length"])
        while len(self.buf) < len(head) + 4 + need:
            self._more()
        body = self.buf[len(head) + 4 : len(head) + 4 + need]
        self.buf = self.buf[len(head) + 4 + need :]
        return int(lines[0].split()[1]), headers, body

    def closed_within(self, seconds: float) -> bool:
        """The server ends the connection (EOF or reset) within `seconds`; what came first is kept."""
        self.sock.settimeout(seconds)
        try:
            while got := self.sock.recv(65536):
                self.buf += got
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def assert_slow_reply(status: int, body: bytes, words: int) -> None:
    assert status == 200, body
    content = json.loads(body)["choices"][0]["message"]["content"]
    assert content == " ".join(f"w{i}" for i in range(1, words + 1))


def assert_refusal(wire: Wire, status: int, code: str, names: str) -> None:
    got, headers, body = wire.response()
    assert got == status, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == code
    assert names in error["message"]
    assert wire.closed_within(T)
    assert wire.buf == b""  # nothing after the refusal


@pytest.mark.parametrize("same_write", [True, False], ids=["same-write", "next-write"])
def test_431_waits_for_the_reply_in_flight(srv: ServeProcess, same_write: bool) -> None:
    """Request 1 (a reply that takes ~1 s) and an oversized head: reply 1 whole, then the 431."""
    with connect(srv) as s:
        wire = Wire(s)
        if same_write:
            s.sendall(chat(f"/slow {QUICK}") + OVERSIZED)
        else:
            s.sendall(chat(f"/slow {QUICK}"))
            time.sleep(0.3)  # request 1 is running
            s.sendall(OVERSIZED)
        status, _, body = wire.response()
        assert_slow_reply(status, body, QUICK)
        assert_refusal(wire, 431, "request_header_fields_too_large", "head_max_bytes")


def test_431_behind_a_quick_request_in_the_same_write(srv: ServeProcess) -> None:
    """GET /healthz and an oversized head in one write: the refusal is decided before the app
    even ran for request 1; its reply still comes first."""
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(HEALTHZ + OVERSIZED)
        status, _, body = wire.response()
        assert status == 200, body
        assert_refusal(wire, 431, "request_header_fields_too_large", "head_max_bytes")


def test_every_accepted_request_is_answered_in_order_before_the_431(srv: ServeProcess) -> None:
    """Two pipelined requests (the second queued behind the first), then an oversized head."""
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(chat(f"/slow {QUICK}") + chat("second") + OVERSIZED)
        status, _, body = wire.response()
        assert_slow_reply(status, body, QUICK)
        status, _, body = wire.response()
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"] == "echo: second"
        assert_refusal(wire, 431, "request_header_fields_too_large", "head_max_bytes")


def test_a_stalled_second_head_gets_its_408_after_the_reply_in_flight(srv: ServeProcess) -> None:
    """The second head stops half way: its 408 is due after 2 s, reply 1 ends after ~3 s."""
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(chat(f"/slow {LONG}") + b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        status, _, body = wire.response()
        assert_slow_reply(status, body, LONG)
        assert_refusal(wire, 408, "request_timeout", "head_timeout_s")


def test_a_stalled_second_body_gets_its_408_after_the_reply_in_flight(srv: ServeProcess) -> None:
    """The second request's body stops after 1 of 100 bytes (its 408 may be due while reply 1,
    ~3 s, still runs): reply 1 whole, then the 408."""
    stalled = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(chat(f"/slow {LONG}") + stalled)
        status, _, body = wire.response()
        assert_slow_reply(status, body, LONG)
        assert_refusal(wire, 408, "request_timeout", "body_timeout_s")


def test_a_malformed_second_head_gets_its_400_after_the_reply_in_flight(srv: ServeProcess) -> None:
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(chat(f"/slow {QUICK}") + b"G\x01T / HTTP/1.1\r\n\r\n")
        status, _, body = wire.response()
        assert_slow_reply(status, body, QUICK)
        assert_refusal(wire, 400, "invalid_http", "Invalid HTTP request")


def test_a_reply_that_never_ends_does_not_hold_the_refusal_forever(srv: ServeProcess) -> None:
    """Request 1 streams for hours: the refused connection is still closed, once the head
    timeout has passed since the refusal (not sooner: the stream had that long to end), with no 431
    mixed into the stream; the server stays well."""
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(chat("/slow 100000", stream=True))
        while b"data: " not in wire.buf:  # the stream is flowing
            wire._more()
        started = time.monotonic()
        s.sendall(OVERSIZED)
        assert wire.closed_within(T)
        waited = time.monotonic() - started
        assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 3
        assert b"HTTP/1.1 431" not in wire.buf
        assert not wire.buf.endswith(b"0\r\n\r\n")  # the stream was cut, not finished
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(HEALTHZ)
        assert wire.response()[0] == 200


def test_a_refusal_with_nothing_in_flight_is_immediate(srv: ServeProcess) -> None:
    """A reply that is complete does not delay the refusal of the next head."""
    with connect(srv) as s:
        wire = Wire(s)
        s.sendall(HEALTHZ)
        assert wire.response()[0] == 200
        started = time.monotonic()
        s.sendall(OVERSIZED)
        assert_refusal(wire, 431, "request_header_fields_too_large", "head_max_bytes")
        assert time.monotonic() - started < 1.0
