"""Webhook channel fixes (session 21), through a real `appserver serve --channels webhook`, real
sockets and a loopback `reply_url` receiver.

1. A reply_url answering 503 or 429 *with* `Retry-After` (0, or 1 s) is retried within the same
   budget as any other transient error, never lost after 5 quick attempts.
2. Idle connections filling one address's slots (`connections_per_client`), or the listener's slots
   (`max_connections`) with that address among the busiest, do not lock a signed sender from that
   address out: an unsigned connection of its own address that waited past the grace gives way.
3. A reply_url that answers 2xx and then drips its body does not stall its chat (a 2xx head is the
   delivery); a status line that never completes is cut by the send's total deadline and sent again
   with the same `id`; an error answer's body is read only in part, for the reason.
4. A request head over 64 KiB is a 431 however it arrives, in one read too.
"""

from __future__ import annotations

import json
import selectors
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from plugins.webhook.settings import DEFAULT_CONNECTIONS_PER_CLIENT, DEFAULT_MAX_CONNECTIONS
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

SECRET = "s3cret-for-s21-webhook"
ACCOUNT = "main"
SEND_DEADLINE_S = "2"  # APPSERVER_WEBHOOK_SEND_DEADLINE_S for the server under test (default 15 s)


class Receiver:
    """The app at reply_url. How it answers depends on the reply's chat (`plan`): a list of
    answers, used in order, the last one for ever after. Every POST is recorded."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.plan: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with outer._lock:
                    outer.posts.append(body)
                    plan = outer.plan.get(body.get("chat"), ["ok"])
                    seen = sum(1 for p in outer.posts if p.get("chat") == body.get("chat"))
                    answer = plan[min(seen, len(plan)) - 1]
                try:
                    outer.answer(self, answer)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, h: BaseHTTPRequestHandler, answer: str) -> None:
        if answer == "ok":
            h.send_response(200)
            h.send_header("Content-Length", "2")
            h.end_headers()
            h.wfile.write(b"{}")
        elif answer in ("503-ra0", "429-ra1"):
            h.send_response(int(answer[:3]))
            h.send_header("Retry-After", answer[-1])
            h.send_header("Content-Length", "4")
            h.end_headers()
            h.wfile.write(b"busy")
        elif answer in ("drip-200", "drip-400"):  # the head at once, then a body that never ends
            h.send_response(int(answer[-3:]))
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.write(b"9\r\nno thanks\r\n")
            h.wfile.flush()
            while not self._stop.wait(1.0):
                h.wfile.write(b"1\r\n \r\n")
                h.wfile.flush()
        elif answer == "drip-head":  # a status line and headers that never end, a line a second
            h.wfile.write(b"HTTP/1.1 200 OK\r\n")
            h.wfile.flush()
            while not self._stop.wait(0.5):
                h.wfile.write(b"X-Slow: 1\r\n")
                h.wfile.flush()
        else:
            raise AssertionError(answer)

    def of(self, chat: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self.posts if p.get("chat") == chat]

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()


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

    def rows(self, chat: str) -> list[tuple[str, str, str | None]]:
        conn = sqlite3.connect(f"file:{self.srv.home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
        try:
            return conn.execute(
                "SELECT message_id, state, reason FROM ledger WHERE chat = ? ORDER BY id", (chat,)
            ).fetchall()
        finally:
            conn.close()

    def settled(self, chat: str, count: int, timeout: float) -> list[tuple[str, str, str | None]]:
        """The chat's ledger rows once `count` of them are delivered or failed."""

        def done() -> list[tuple[str, str, str | None]] | None:
            rows = self.rows(chat)
            return rows if sum(r[1] in ("delivered", "failed") for r in rows) >= count else None

        return wait_for(done, timeout=timeout, what=f"the replies of chat {chat!r}")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hook]:
    home = tmp_path_factory.mktemp("s21wh") / "home"
    port = free_port()
    receiver = Receiver()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {ACCOUNT: settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET, APPSERVER_WEBHOOK_SEND_DEADLINE_S=SEND_DEADLINE_S)
    try:
        with channel_server(home, env=env) as srv:
            yield Hook(srv, port, receiver)
    finally:
        receiver.close()


# ----------------------------------------------------------------------------- 1: Retry-After


def test_a_reply_url_asking_to_wait_again_and_again_gets_the_transient_budget(hook: Hook) -> None:
    # Five answers asking to wait (0 s, and 1 s) used to end the reply within 0.2 s / 4 s, while the
    # same 503 without Retry-After was retried for about a minute. The sixth attempt is answered.
    hook.receiver.plan["ra0"] = ["503-ra0"] * 5 + ["ok"]
    hook.receiver.plan["ra1"] = ["429-ra1"] * 5 + ["ok"]
    for chat in ("ra0", "ra1"):
        assert hook.post({"id": f"{chat}-1", "chat": chat, "sender": "ann", "text": f"wait {chat}"}).status_code == 202
    for chat in ("ra0", "ra1"):
        rows = hook.settled(chat, 1, timeout=60)
        assert [r[1] for r in rows] == ["delivered"], rows
        posts = hook.receiver.of(chat)
        assert len(posts) == 6, [p["id"] for p in posts]
        assert len({p["id"] for p in posts}) == 1  # the same reply part, sent again with its id


# ----------------------------------------------------------------------------- 2: the listener's slots


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


def test_idle_connections_of_one_address_do_not_lock_its_signed_sender_out(hook: Hook) -> None:
    source = "127.0.0.77"
    idle = [_connect(hook.port, source) for _ in range(DEFAULT_CONNECTIONS_PER_CLIENT)]
    try:
        # A burst does not evict its own fresh connections: past the cap at once, refused.
        burst = _connect(hook.port, source)
        refused = _answered([burst], 1.0).get(burst, b"")
        burst.close()
        assert refused.startswith(b"HTTP/1.1 503") and b"connections_per_client" in refused, refused
        assert _answered(idle, 1.0) == {}, "all held"  # and older than the grace (EVICTION_GRACE_S)
        # Past the grace, a signed sender from the same address is served: the oldest idle
        # connection of that address gives way (and only one).
        answer = hook.post({"id": "own-1", "chat": "own", "sender": "ann", "text": "same address"}, source)
        assert answer.status_code == 202, answer.text
        evicted = _answered(idle, 0.5)
        assert list(evicted) == [idle[0]], [idle.index(s) for s in evicted]
        assert b"evicted to make room" in evicted[idle[0]], evicted[idle[0]]
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: store_turns(hook.srv.home, "same address") == 1, timeout=20, what="the turn")


def test_at_the_total_cap_a_signed_sender_of_a_busiest_address_is_served(hook: Hook) -> None:
    time.sleep(0.5)  # the previous test's connections are gone
    # Every slot held by idle connections: three addresses at their cap, one one short of it (the
    # signed sender's), one more elsewhere. Evicting elsewhere would not make the slots fairer.
    sources = ["127.0.0.80"] * 16 + ["127.0.0.81"] * 16 + ["127.0.0.82"] * 16 + ["127.0.0.83"] * 15 + ["127.0.0.84"]
    assert len(sources) == DEFAULT_MAX_CONNECTIONS
    idle = [_connect(hook.port, s) for s in sources]
    try:
        assert _answered(idle, 1.2) == {}, "all held"
        answer = hook.post({"id": "cap-1", "chat": "cap", "sender": "ann", "text": "at the cap"}, "127.0.0.83")
        assert answer.status_code == 202, answer.text
        evicted = _answered(idle, 0.5)
        assert [sources[idle.index(s)] for s in evicted] == ["127.0.0.83"], [sources[idle.index(s)] for s in evicted]
        assert b"max_connections" in next(iter(evicted.values()))
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: store_turns(hook.srv.home, "at the cap") == 1, timeout=20, what="the turn")


# ----------------------------------------------------------------------------- 3: slow receivers


def test_a_2xx_whose_body_drips_is_delivered_and_the_chat_goes_on(hook: Hook) -> None:
    hook.receiver.plan["drip"] = ["drip-200"]
    assert hook.post({"id": "drip-1", "chat": "drip", "sender": "ann", "text": "first drip"}).status_code == 202
    assert hook.post({"id": "drip-2", "chat": "drip", "sender": "ann", "text": "second drip"}).status_code == 202
    rows = hook.settled("drip", 2, timeout=30)
    assert [r[1] for r in rows] == ["delivered", "delivered"], rows
    ids = [p["id"] for p in hook.receiver.of("drip")]
    assert len(ids) == len(set(ids)), ids  # a 2xx head is the delivery: nothing was sent twice


def test_a_head_that_never_completes_is_cut_by_the_deadline_and_sent_again(hook: Hook) -> None:
    hook.receiver.plan["slowhead"] = ["drip-head", "ok"]
    assert hook.post({"id": "sh-1", "chat": "slowhead", "sender": "ann", "text": "slow head"}).status_code == 202
    rows = hook.settled("slowhead", 1, timeout=40)
    assert [r[1] for r in rows] == ["delivered"], rows
    posts = hook.receiver.of("slowhead")
    assert len(posts) == 2 and posts[0]["id"] == posts[1]["id"], posts  # the same id: the receiver dedupes
    assert "did not answer within" in hook.srv.log(), hook.srv.log()[-3000:]


def test_an_error_answer_whose_body_drips_fails_with_its_start(hook: Hook) -> None:
    hook.receiver.plan["bad"] = ["drip-400"]
    assert hook.post({"id": "bad-1", "chat": "bad", "sender": "ann", "text": "refused"}).status_code == 202
    rows = hook.settled("bad", 1, timeout=30)
    assert rows[0][1] == "failed" and "reply_url answered 400: no thanks" in str(rows[0][2]), rows
    assert len(hook.receiver.of("bad")) == 1  # a 4xx is permanent


# ----------------------------------------------------------------------------- 4: the head's size


def _signed_raw(payload: dict[str, Any], pad: int) -> bytes:
    body = json.dumps(payload).encode()
    stamp = str(int(time.time()))
    head = (
        f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{TIMESTAMP_HEADER}: {stamp}\r\n{SIGNATURE_HEADER}: {sign(SECRET, stamp, body)}\r\n"
        f"X-Pad: {'a' * pad}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("pad", [70_000, 200_000])
@pytest.mark.parametrize("pieces", [1, 16])
def test_a_head_over_64_kib_is_431_however_it_arrives(hook: Hook, pad: int, pieces: int) -> None:
    raw = _signed_raw(
        {"id": f"big-{pad}-{pieces}", "chat": f"bh-{pad}-{pieces}", "sender": "ann", "text": "big head"}, pad
    )
    sock = _connect(hook.port, "127.0.0.90")
    try:
        step = -(-len(raw) // pieces)
        for at in range(0, len(raw), step):
            try:
                sock.sendall(raw[at : at + step])
            except OSError:
                break  # answered and closed before the rest went
            if pieces > 1:
                time.sleep(0.02)
        got = _answered([sock], 5.0).get(sock, b"")
    finally:
        sock.close()
    assert got.startswith(b"HTTP/1.1 431"), got[:200]
    assert b'"accepted": false' in got
    assert hook.rows(f"bh-{pad}-{pieces}") == []
    # A head just under the limit, in one read, is served.
    sock = _connect(hook.port, "127.0.0.90")
    try:
        sock.sendall(
            _signed_raw({"id": f"near-{pad}-{pieces}", "chat": "nearhead", "sender": "ann", "text": "near"}, 60_000)
        )
        got = _answered([sock], 5.0).get(sock, b"")
    finally:
        sock.close()
    assert got.startswith(b"HTTP/1.1 202"), got[:200]
