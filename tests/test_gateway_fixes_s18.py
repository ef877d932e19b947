"""Gateway fixes (session 18), through a real `appserver serve --channels webhook` and real sockets.

1. Every message the webhook answers 202 gets its turn: the idempotency key the gateway sends is
   always one the server takes (at most 256 characters, no control character), so an `id` of 244 to
   1,024 characters or one with a newline no longer fails at the server, nor sinks the debounced
   burst it heads; a message too big for one protocol frame fails alone instead of blocking its
   chat forever.
2. Nobody who can merely connect locks signed senders out of the listener: a connection must send a
   complete request head within a few seconds, one client address gets only part of the slots, and
   a refusal is the documented JSON 503.
"""

from __future__ import annotations

import hashlib
import json
import selectors
import socket
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from appserver.ws.frames import SubmitInput
from gateway.ledger import UpdateKey
from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from plugins.webhook.edge import HEAD_TIMEOUT_S
from plugins.webhook.settings import DEFAULT_CONNECTIONS_PER_CLIENT
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-for-s18"
ACCOUNT = "main"
PREFIX = f"webhook:{ACCOUNT}:"


# ----------------------------------------------------------------------------- the key itself


@pytest.mark.parametrize(
    "message_id",
    ["evt-1", "1234567890", "x" * (256 - len(PREFIX)), "é" * 200, "\u2028 sep \x85"],
)
def test_a_key_the_server_takes_stays_exactly_as_it_was(message_id: str) -> None:
    key = UpdateKey("webhook", ACCOUNT, message_id)
    assert key.idempotency_key == f"{PREFIX}{message_id}"  # rows of older versions keep matching
    SubmitInput(type="submit_input", agent="a", input="x", idempotency_key=key.idempotency_key)


@pytest.mark.parametrize(
    "message_id",
    ["x" * (257 - len(PREFIX)), "Z" * 300, "a" * 1024, "line\nbreak", "nul\x00", "del\x7f", "tab\there"],
)
def test_a_key_the_server_would_refuse_becomes_a_stable_digest(message_id: str) -> None:
    key = UpdateKey("webhook", ACCOUNT, message_id)
    digest = hashlib.sha256(f"{PREFIX}{message_id}".encode()).hexdigest()
    assert key.idempotency_key == f"{PREFIX}h:{digest}"
    assert UpdateKey("webhook", ACCOUNT, message_id).idempotency_key == key.idempotency_key  # a redelivery
    frame = SubmitInput(type="submit_input", agent="a", input="x", idempotency_key=key.idempotency_key)
    assert frame.idempotency_key == key.idempotency_key


def test_even_absurd_channel_and_account_names_give_a_key_the_server_takes() -> None:
    key = UpdateKey("c" * 200, "a" * 200, "m\n")
    SubmitInput(type="submit_input", agent="a", input="x", idempotency_key=key.idempotency_key)
    assert key.idempotency_key == UpdateKey("c" * 200, "a" * 200, "m\n").idempotency_key
    assert key.idempotency_key != UpdateKey("c" * 200, "a" * 200, "m\r").idempotency_key


# ----------------------------------------------------------------------------- one server for the file


class Receiver:
    """The app that gets the replies (a plain socket server is enough: it only counts them)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread

        self.posts: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


class Hook:
    def __init__(self, srv: ChannelServer, port: int, receiver: Receiver) -> None:
        self.srv = srv
        self.port = port
        self.receiver = receiver

    def post(self, payload: dict[str, Any], source: str = "127.0.0.1") -> httpx.Response:
        body = json.dumps(payload).encode()
        stamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: stamp,
            SIGNATURE_HEADER: sign(SECRET, stamp, body),
        }
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as client:
            return client.post(f"http://127.0.0.1:{self.port}/", content=body, headers=headers)

    def rows(self, chat: str) -> list[tuple[str, str, str | None, str | None]]:
        conn = sqlite3.connect(f"file:{self.srv.home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
        try:
            return conn.execute(
                "SELECT message_id, state, reason, turn_id FROM ledger WHERE chat = ? ORDER BY id", (chat,)
            ).fetchall()
        finally:
            conn.close()

    def answered(self, chat: str, count: int) -> list[tuple[str, str, str | None, str | None]]:
        """The chat's ledger rows once `count` of them are past submission (or any failed)."""

        def settled() -> list[tuple[str, str, str | None, str | None]] | None:
            rows = self.rows(chat)
            done = [r for r in rows if r[1] in ("submitted", "finished", "delivered", "failed")]
            return rows if len(done) >= count or any(r[1] == "failed" for r in rows) else None

        return wait_for(settled, timeout=30, what=f"the turns of chat {chat!r}")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hook]:
    home = tmp_path_factory.mktemp("s18") / "home"
    port = free_port()
    receiver = Receiver()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
        "debounce_ms": 400,
        "max_body_bytes": 8 << 20,
    }
    write_config(home, {"webhook": {ACCOUNT: settings}}, ["webhook"])
    try:
        with channel_server(home, env=cli_env(home, WH_SECRET=SECRET)) as srv:
            yield Hook(srv, port, receiver)
    finally:
        receiver.close()


# ----------------------------------------------------------------------------- 1: every 202 gets its turn


def test_a_long_id_heading_a_debounced_burst_gives_the_burst_its_turn(hook: Hook) -> None:
    long_id = "Z" * 300
    assert hook.post({"id": long_id, "chat": "lb", "sender": "ann", "text": "first, long id"}).status_code == 202
    assert hook.post({"id": "lb-ok", "chat": "lb", "sender": "ann", "text": "second, normal id"}).status_code == 202
    rows = hook.answered("lb", 2)
    assert [r[1] for r in rows if r[1] == "failed"] == [], rows
    assert {r[0] for r in rows} == {long_id, "lb-ok"}
    assert len({r[3] for r in rows}) == 1, rows  # one turn for the burst
    wait_for(lambda: store_turns(hook.srv.home, "second, normal id") == 1, timeout=20, what="the batch's turn")
    assert store_turns(hook.srv.home, "first, long id") == 1
    wait_for(lambda: [p for p in hook.receiver.posts if p["chat"] == "lb"], timeout=20, what="the reply")


@pytest.mark.parametrize(
    ("chat", "message_id"),
    [
        ("edge244", "e" * (256 - len(PREFIX) + 1)),  # one character past the server's 256
        ("max1024", "m" * 1024),  # the longest the webhook takes
        ("newline", "evt\nwith a newline"),
        ("nul", "evt\x00nul"),
    ],
)
def test_an_id_the_server_would_refuse_as_a_key_still_makes_exactly_one_turn(
    hook: Hook, chat: str, message_id: str
) -> None:
    text = f"hello from {chat}"
    answer = hook.post({"id": message_id, "chat": chat, "sender": "ann", "text": text})
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"accepted": True, "id": message_id}
    rows = hook.answered(chat, 1)
    assert [(r[0], r[1]) for r in rows if r[1] == "failed"] == [], rows
    wait_for(lambda: store_turns(hook.srv.home, text) == 1, timeout=20, what="the turn")
    # The sender retries the same delivery: recognised, no second turn.
    assert hook.post({"id": message_id, "chat": chat, "sender": "ann", "text": text}).status_code == 202
    time.sleep(0.5)
    assert store_turns(hook.srv.home, text) == 1
    assert len(hook.rows(chat)) == 1


def test_a_message_too_big_for_one_frame_fails_alone_and_its_chat_goes_on(hook: Hook) -> None:
    # 5 MB of text is within this account's max_body_bytes (8 MiB) but over the server's frame
    # (4 MiB): the client refuses to send it, on every retry. It used to be retried forever, and
    # every later message of the chat waited behind it.
    big = hook.post({"id": "big-1", "chat": "big", "sender": "ann", "text": "a" * 5_000_000})
    assert big.status_code == 202
    wait_for(lambda: hook.rows("big")[0][1] == "failed", timeout=20, what="the big message to fail")
    assert "frame" in str(hook.rows("big")[0][2]), hook.rows("big")
    assert hook.post({"id": "big-2", "chat": "big", "sender": "ann", "text": "after the big one"}).status_code == 202
    wait_for(lambda: store_turns(hook.srv.home, "after the big one") == 1, timeout=20, what="the next turn")


# ----------------------------------------------------------------------------- 2: the listener's edge


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _answered(socks: list[socket.socket], wait_s: float) -> dict[socket.socket, bytes]:
    """What each socket got within `wait_s` (b"" for a close), for the ones that got anything."""
    got: dict[socket.socket, bytes] = {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + wait_s
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                got[sock] = got.get(sock, b"") + data
                if not data or b"\r\n\r\n" in got[sock] and got[sock].endswith(b"}"):
                    sel.unregister(sock)
    return got


def _status_and_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_idle_and_slow_connections_cannot_lock_signed_senders_out(hook: Hook) -> None:
    port = hook.port
    idle = [_connect(port, "127.0.0.1") for _ in range(64)]
    slow = _connect(port, "127.0.0.3")
    try:
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        started = time.monotonic()
        # One address gets its share of the slots; past it, an immediate 503 in the channel's shape.
        refused = _answered(idle, 1.0)
        assert len(refused) == 64 - DEFAULT_CONNECTIONS_PER_CLIENT, len(refused)
        for raw in refused.values():
            status, body = _status_and_body(raw)
            assert status == 503 and body["accepted"] is False and "connections_per_client" in body["error"], raw
            assert b"retry-after: 1" in raw.lower()
        # Meanwhile a signed sender from another address is served at once.
        other = hook.post({"id": "edge-1", "chat": "edge", "sender": "ann", "text": "through the crowd"}, "127.0.0.2")
        assert other.status_code == 202, other.text
        # The idle connections are closed once the head deadline passes, and the slow head gets a 408.
        while time.monotonic() - started < HEAD_TIMEOUT_S - 1:  # a byte now and then resets nothing
            slow.sendall(b"X-Slow: 1\r\n")
            time.sleep(0.5)
        held = [s for s in idle if s not in refused]
        closed = _answered([*held, slow], HEAD_TIMEOUT_S + 2 - (time.monotonic() - started))
        assert all(closed.get(s) == b"" for s in held), [closed.get(s) for s in held]
        status, body = _status_and_body(closed[slow])
        assert status == 408 and body["accepted"] is False and "head" in body["error"], closed[slow]
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 2
        # And the address that held them is served again.
        again = hook.post({"id": "edge-2", "chat": "edge", "sender": "ann", "text": "after the crowd"})
        assert again.status_code == 202, again.text
    finally:
        for s in [*idle, slow]:
            s.close()
    wait_for(lambda: store_turns(hook.srv.home, "after the crowd") == 1, timeout=20, what="the turn")


def test_an_error_answer_closes_its_connection(hook: Hook) -> None:
    sock = _connect(hook.port, "127.0.0.4")
    try:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        got = _answered([sock], 5.0)[sock]
        status, body = _status_and_body(got)
        assert status == 401 and body["accepted"] is False
        assert b"connection: close" in got.lower()
        assert _answered([sock], 2.0).get(sock) == b""  # closed by the server
    finally:
        sock.close()
