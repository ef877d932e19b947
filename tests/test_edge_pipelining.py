"""Pipelining at the HTTP edge (appserver/security/edge.py), beyond refusals: what an outside attack
on the held-refusal change found, each through a real `appserver serve` over raw loopback sockets.

* A WebSocket upgrade pipelined behind a request waits for that request's reply: the reply first,
  whole, then the `101` (or the upgrade's refusal); nothing interleaves.
* A client that closes its connection while one request runs and others are queued (or a refusal
  is held) disconnects every one of them: the running app stops and the client's slot is freed.
* A connection the edge cuts without an answer (a held refusal whose reply before it never ends)
  is aborted, not closed after a flush a client that never reads would hold open forever.
* A head split across writes counts only its own bytes, not the requests before it in the write.
* The body clock of a request queued behind a reply (or waiting for `100 Continue`) starts when the
  app asks for the body, not when its head arrived.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.test_edge_pipelined_refusals import (
    HEAD_MAX,
    HEALTHZ,
    OVERSIZED,
    QUICK,
    T,
    Wire,
    assert_refusal,
    assert_slow_reply,
    chat,
    connect,
)

pytestmark = pytest.mark.timeout(90)

# head_timeout_s and body_timeout_s of these servers (test_edge_pipelined_refusals' are 2 s): the
# tests here that sit out a timeout sit out this one.
TIMEOUT_S = 1.0
OVER_TIMEOUT = 30  # echo's `/slow 30`: a reply that takes about 1.5 s, over TIMEOUT_S


def _home(parent: Path) -> Path:
    home = parent / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    return home


def _limits(home: Path, **extra: str) -> dict[str, str]:
    return cli_env(
        home,
        APPSERVER_LIMITS__HEAD_MAX_BYTES=str(HEAD_MAX),
        APPSERVER_LIMITS__HEAD_TIMEOUT_S=str(TIMEOUT_S),
        APPSERVER_LIMITS__BODY_TIMEOUT_S=str(TIMEOUT_S),
        APPSERVER_LIMITS__KEEPALIVE_TIMEOUT_S="5",
        **extra,
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = _home(tmp_path_factory.mktemp("pipelining"))
    with serving(home, env=_limits(home)) as sp:
        yield sp


class Conn(Wire):
    """`Wire` plus heads without a body (`100 Continue`, `101`) and server WebSocket frames."""

    def head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        return int(lines[0].split()[1]), {
            k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])
        }

    def frame(self) -> tuple[int, bytes]:
        """One unmasked frame from the server: (opcode, payload)."""
        while len(self.buf) < 2:
            self._more()
        opcode, size = self.buf[0] & 0x0F, self.buf[1] & 0x7F
        at = 2
        if size == 126:
            while len(self.buf) < 4:
                self._more()
            size, at = struct.unpack("!H", self.buf[2:4])[0], 4
        elif size == 127:
            while len(self.buf) < 10:
                self._more()
            size, at = struct.unpack("!Q", self.buf[2:10])[0], 10
        while len(self.buf) < at + size:
            self._more()
        payload, self.buf = self.buf[at : at + size], self.buf[at + size :]
        return opcode, payload


def upgrade(srv: ServeProcess, origin: str | None = None) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    host = srv.url.split("//")[1].split("/")[0]
    extra = f"Origin: {origin}\r\n" if origin else ""
    return (
        f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


def text_frame(obj: object) -> bytes:
    """A masked (client) text frame."""
    payload = json.dumps(obj).encode()
    mask = os.urandom(4)
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def assert_websocket_works(conn: Conn) -> None:
    """After the 101: the session answers `hello` with `welcome`."""
    conn.sock.sendall(text_frame({"type": "hello", "protocol": 1, "client": "test", "request_id": "h"}))
    opcode, payload = conn.frame()
    assert opcode == 1, payload
    assert json.loads(payload)["type"] == "welcome", payload


# ── 1. a WebSocket upgrade pipelined behind a request ────────────────────────────────────────────


@pytest.mark.parametrize("same_write", [True, False], ids=["same-write", "next-write"])
def test_an_upgrade_waits_for_the_reply_before_it(srv: ServeProcess, same_write: bool) -> None:
    """Request 1 (~1 s) and a WebSocket upgrade: reply 1 whole, then the 101, then a working session
    (the 101 used to go out at once, reply 1 landing inside the WebSocket byte stream)."""
    with connect(srv) as s:
        conn = Conn(s)
        if same_write:
            s.sendall(chat(f"/slow {QUICK}") + upgrade(srv))
        else:
            s.sendall(chat(f"/slow {QUICK}"))
            time.sleep(0.3)  # request 1 is running
            s.sendall(upgrade(srv))
        status, _, body = conn.response()
        assert_slow_reply(status, body, QUICK)
        status, headers = conn.head()
        assert status == 101, (status, headers)
        assert headers["upgrade"].lower() == "websocket"
        assert conn.buf == b""  # nothing after the 101 but what the session says
        assert_websocket_works(conn)


def test_an_upgrade_waits_for_every_queued_reply(srv: ServeProcess) -> None:
    """Two requests (the second queued behind the first), then an upgrade: both replies, in order,
    then the 101."""
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(chat(f"/slow {QUICK}") + chat("second") + upgrade(srv))
        status, _, body = conn.response()
        assert_slow_reply(status, body, QUICK)
        status, _, body = conn.response()
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"] == "echo: second"
        assert conn.head()[0] == 101
        assert_websocket_works(conn)


def test_a_refused_upgrade_is_answered_after_the_reply_before_it(srv: ServeProcess) -> None:
    """An upgrade from a foreign origin (403) behind request 1: reply 1 whole, then the 403 (only the
    403 used to arrive: reply 1 was lost)."""
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(chat(f"/slow {QUICK}") + upgrade(srv, origin="http://evil.example"))
        status, _, body = conn.response()
        assert_slow_reply(status, body, QUICK)
        status, _, body = conn.response()
        assert status == 403, body
        assert json.loads(body)["error"]["code"] == "origin_not_allowed"
        assert conn.closed_within(T)
        assert conn.buf == b""


def test_an_upgrade_with_nothing_before_it_is_immediate(srv: ServeProcess) -> None:
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(HEALTHZ)
        assert conn.response()[0] == 200
        s.sendall(upgrade(srv))
        assert conn.head()[0] == 101
        assert_websocket_works(conn)


def test_frames_sent_before_the_101_reach_the_session(srv: ServeProcess) -> None:
    """A client that does not wait for the 101 (RFC 6455 says it must): its `hello`, in the same write
    as the upgrade head, reaches the session, whether the upgrade is immediate or waits for a reply."""
    hello = text_frame({"type": "hello", "protocol": 1, "client": "test", "request_id": "h"})
    for before in (b"", chat(f"/slow {QUICK}")):
        with connect(srv) as s:
            conn = Conn(s)
            s.sendall(before + upgrade(srv) + hello)
            if before:
                status, _, body = conn.response()
                assert_slow_reply(status, body, QUICK)
            assert conn.head()[0] == 101
            opcode, payload = conn.frame()
            assert opcode == 1, payload
            assert json.loads(payload)["type"] == "welcome", payload


def test_a_flood_before_the_101_closes_the_connection(srv: ServeProcess) -> None:
    """More than 64 KiB after an upgrade head that waits: not a WebSocket client, the connection is
    cut (no 101), and the server stays well."""
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(chat("/slow 60") + upgrade(srv) + b"x" * (200 * 1024))
        assert conn.closed_within(T)
        assert b"HTTP/1.1 101" not in conn.buf
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(HEALTHZ)
        assert conn.response()[0] == 200


# ── 4. a head split across writes ────────────────────────────────────────────────────────────────


def _post(i: int) -> bytes:
    """A complete ~1.2 KB chat request."""
    return chat(f"r{i} " + "x" * 1100)


@pytest.mark.parametrize("split", [20, 30], ids=["in-request-line", "in-a-header-line"])
def test_a_head_split_after_pipelined_requests_counts_only_its_own_bytes(srv: ServeProcess, split: int) -> None:
    """Four complete requests (~5 KB, over head_max_bytes together) and the first bytes of a small
    head in one write, the rest of that head in the next: five replies (the earlier requests used
    to count against the new head: 431)."""
    n = 4
    first = b"".join(_post(i) for i in range(n)) + HEALTHZ[:split]
    assert len(first) > HEAD_MAX
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(first)
        time.sleep(0.3)
        s.sendall(HEALTHZ[split:])
        for i in range(n):
            status, _, body = conn.response()
            assert status == 200, body
            assert json.loads(body)["choices"][0]["message"]["content"].startswith(f"echo: r{i} ")
        status, _, body = conn.response()
        assert status == 200, body
        assert json.loads(body) == {"status": "ok"}


def test_an_oversized_line_begun_after_pipelined_requests_is_still_refused_at_once(srv: ServeProcess) -> None:
    """The other side of counting only the new head: a header line over the cap that begins after a
    complete request in the same write is refused (431) without waiting for more of it."""
    line = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (HEAD_MAX + 100)
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(HEALTHZ + line)  # no end of line: the parser buffers it without a callback
        assert conn.response()[0] == 200
        assert_refusal(conn, 431, "request_header_fields_too_large", "head_max_bytes")


# ── 5. the body clock of a queued request ────────────────────────────────────────────────────────


def _expect_head(body: bytes) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()


SECOND = json.dumps({"model": "a", "messages": [{"role": "user", "content": "second"}]}).encode()


def test_a_queued_expect_request_has_the_whole_body_timeout_after_its_100_continue(srv: ServeProcess) -> None:
    """Request 1 takes ~1.5 s (over body_timeout_s, 1 s); request 2 (`Expect: 100-continue`) is queued
    behind it, gets its 100 Continue after reply 1 and sends its body 0.5 s later, within
    body_timeout_s: answered (the time it spent queued used to count: 408 "no bytes for 1 s" at
    once after the 100)."""
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(chat(f"/slow {OVER_TIMEOUT}") + _expect_head(SECOND))
        status, _, body = conn.response()
        assert_slow_reply(status, body, OVER_TIMEOUT)
        assert conn.head()[0] == 100
        time.sleep(TIMEOUT_S * 0.5)
        s.sendall(SECOND)
        status, _, body = conn.response()
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"] == "echo: second"


def test_a_body_that_never_follows_its_100_continue_still_times_out(srv: ServeProcess) -> None:
    """The clock starts at the 100 Continue, and then runs: no body, 408 about body_timeout_s later."""
    with connect(srv) as s:
        conn = Conn(s)
        s.sendall(chat(f"/slow {OVER_TIMEOUT}") + _expect_head(SECOND))
        status, _, body = conn.response()
        assert_slow_reply(status, body, OVER_TIMEOUT)
        assert conn.head()[0] == 100
        started = time.monotonic()
        assert_refusal(conn, 408, "request_timeout", "body_timeout_s")
        assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 3


# ── 2. a client that closes while requests are in flight ─────────────────────────────────────────

SLOTS = 2  # connections_per_client


@pytest.fixture
def tight(tmp_path: Path) -> Iterator[ServeProcess]:
    """A server of its own (a failing test here leaks slots or connections)."""
    home = _home(tmp_path)
    env = _limits(home, APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT=str(SLOTS), APPSERVER_LIMITS__MAX_CONNECTIONS="2")
    with serving(home, env=env) as sp:
        yield sp


def _address(srv: ServeProcess) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def _probe(srv: ServeProcess, within: float) -> tuple[int, bytes]:
    """A chat request, repeated until answered 200 or `within` seconds pass: (last status, body)."""
    deadline = time.monotonic() + within
    while True:
        with connect(srv) as s:
            conn = Conn(s)
            s.sendall(chat("probe"))
            try:
                status, _, body = conn.response()
            except ConnectionError as exc:  # a 503 at accept may be cut by the close
                status, body = 0, str(exc).encode()
        if status == 200 or time.monotonic() > deadline:
            return status, body
        time.sleep(0.2)


STALLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{"
)
BEHIND = {
    "queued-request": (chat("queued"), 0.3),
    "queued-request-and-refused-head": (chat("queued") + OVERSIZED, 0.3),
    "refused-body": (STALLED, TIMEOUT_S + 0.5),  # closed once its 408 is held for the stream
}


@pytest.mark.parametrize("behind", list(BEHIND))
def test_a_client_closing_early_disconnects_the_running_request(tight: ServeProcess, behind: str) -> None:
    """A never-ending stream with a request queued behind it (or a refusal held for it); the client
    closes while it streams. Every request in flight sees the disconnect, the running one too: its
    app stops and the client's slot is free (the running one used to stream into the closed socket
    forever, and every later request from the client got 429 too_many_connections)."""
    second, wait_s = BEHIND[behind]
    with contextlib.ExitStack() as open_now:  # every slot at once, so that one wait serves them all
        for _ in range(SLOTS):
            s = open_now.enter_context(connect(tight))
            conn = Conn(s)
            s.sendall(chat("/slow 100000", stream=True) + second)
            while b"data: " not in conn.buf:  # the stream is flowing
                conn._more()
        time.sleep(wait_s)
    status, body = _probe(tight, within=5)
    assert status == 200, body


# ── 3. a connection cut without an answer is aborted ─────────────────────────────────────────────


def test_a_held_refusal_that_times_out_aborts_a_connection_nobody_reads(tight: ServeProcess) -> None:
    """A big streamed reply and an oversized head; the client never reads, so the stream blocks on a
    full send buffer and the 431 is held until head_timeout_s, then the connection is cut. It is
    gone then, buffer and all (a close waited for the buffer to drain, forever: with the connection
    cap reached, every new client got 503 server_busy)."""
    # 5 MB echoed back: more than the socket's send buffer takes (~3 MB on loopback), so the rest
    # waits in the transport's buffer and the stream blocks.
    flood = chat(("x" * 99 + " ") * 50_000, stream=True)
    socks = []
    try:
        for _ in range(2):  # max_connections
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(T)
            s.connect(_address(tight))
            s.sendall(flood + OVERSIZED)
            socks.append(s)
        started = time.monotonic()
        status, body = _probe(tight, within=TIMEOUT_S + 8)
        assert status == 200, body
        assert time.monotonic() - started < TIMEOUT_S + 5
    finally:
        for s in socks:
            s.close()
