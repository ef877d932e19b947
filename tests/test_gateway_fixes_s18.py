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
import re
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
from tests.support.net import SSL, free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-for-s18-webhook"
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
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source, verify=SSL), timeout=10) as client:
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
        "debounce_ms": 1000,  # the burst test posts twice in a row: room for a loaded machine
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
    # The sender retries the same delivery: recognised (200, duplicate), no second turn.
    again = hook.post({"id": message_id, "chat": chat, "sender": "ann", "text": text})
    assert again.status_code == 200 and again.json()["duplicate"] is True, again.text
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


# ----------------------------------------------------------------------------- 3: round 3 of the tester
#
# F1: a delivery too big for the control line must not kill the gateway child; F2: a local user
# holding every slot from several loopback addresses does not lock signed senders out; F3: refused
# connections whose client is gone write no traceback each; F4: an id crafted as `h:<digest>` gets
# its own key; and a cron prompt with a lone surrogate is refused clearly.


def _gateway_pid(srv: ChannelServer) -> str:
    return (srv.home / "channels" / "gateway.lock").read_text().strip()


def test_a_cron_reply_too_big_for_the_control_line_is_cut_and_the_gateway_lives_on(hook: Hook) -> None:
    from cron.schedule import ScheduleSpec
    from cron.store import CronStore, make_task, utcnow
    from gateway.split import DELIVER_MAX_CHARS
    from tests.support.cli import run_cli

    home = hook.srv.home
    pid = _gateway_pid(hook.srv)
    env = cli_env(home, WH_SECRET=SECRET)
    seed = run_cli(
        home,
        "cron",
        "add",
        "--name",
        "seed",
        "--agent",
        "assistant",
        "--every",
        "1h",
        "--prompt",
        "s",
        "--json",
        env=env,
    )
    assert seed.code == 0, (seed.out, seed.err)
    # 1,000,000 control characters: the echoed reply JSON-escaped is ~6 MB on the command line,
    # over the 4 MiB the child reads (it used to exit with ValueError, taking every channel along).
    task = make_task(
        name="big-reply",
        agent=str(seed.json()["agent"]),
        schedule=ScheduleSpec.from_dict(seed.json()["schedule"]),
        prompt="\x01" * 1_000_000,
        now=utcnow(),
        deliver=f"webhook:{ACCOUNT}:bigcron",
    )
    CronStore(home).add(task)
    r = run_cli(home, "cron", "run", "big-reply", "--json", env=env, timeout=90)
    assert r.code == 0, (r.out[:500], r.err[:500])

    def delivered() -> list[dict[str, Any]] | None:
        path = home / "cron-runs" / f"{task.id}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [x for x in rows if x["event"] in ("delivered", "delivery_failed")] or None

    verdict = wait_for(delivered, timeout=60, what="the delivery's verdict")
    assert [v["event"] for v in verdict] == ["delivered"], verdict
    posts = wait_for(lambda: [p for p in hook.receiver.posts if p["chat"] == "bigcron"], timeout=20, what="the post")
    text = "".join(p["text"] for p in posts)
    assert (
        len(text) <= DELIVER_MAX_CHARS + 100 and "Cut here" in text and re.search(r"has 1,000,\d{3} characters", text)
    ), text[-200:]
    assert _gateway_pid(hook.srv) == pid  # the same child: it never exited
    assert "exited with code" not in hook.srv.log()
    answer = hook.post({"id": "after-big-cron", "chat": "bigcron2", "sender": "ann", "text": "still here"})
    assert answer.status_code == 202, answer.text


def _start_envelope(srv: ChannelServer, home: Any) -> bytes:
    return (
        json.dumps({"op": "start", "url": srv.url, "token": None, "home": str(home), "accounts": []}) + "\n"
    ).encode()


def test_the_child_skips_an_over_long_command_line_and_answers_it(hook: Hook, tmp_path: Any) -> None:
    """The child's own guard (a writer other than the supervisor, or a bug): the line is skipped up to
    its newline, answered with an error when its id can be read, and the next command is served."""
    import subprocess
    import sys

    from gateway.stdio import COMMAND_MAX_LINE, parse_line

    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(tmp_path / "h"),
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(_start_envelope(hook.srv, tmp_path / "h"))
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"GATEWAY_READY"
        huge = json.dumps({"id": "r7", "op": "deliver", "target": "webhook:x:y", "text": "\x01" * COMMAND_MAX_LINE})
        proc.stdin.write(huge.encode() + b"\n" + b'{"id": "r8", "op": "ping"}\n')
        proc.stdin.flush()
        first, second = parse_line(proc.stdout.readline()), parse_line(proc.stdout.readline())
        assert first is not None and first.payload["id"] == "r7" and first.payload["ok"] is False, first
        assert "over the gateway's" in first.payload["error"]
        assert second is not None and second.payload == {"ok": True, "id": "r8"}, second
        assert proc.poll() is None
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""
    assert err.count("skipped a command line") == 1 and "Traceback" not in err, err[-2000:]


def test_the_supervisor_refuses_a_command_the_child_could_not_read(hook: Hook, tmp_path: Any) -> None:
    import asyncio

    from gateway.stdio import COMMAND_MAX_LINE
    from gateway.supervisor import CommandTooLarge, Credential, GatewaySupervisor

    async def go() -> None:
        sup = GatewaySupervisor(
            home=tmp_path / "h",
            url=lambda: hook.srv.url,
            accounts=[],
            credential=lambda: Credential(None, lambda: None),
            env=cli_env(tmp_path / "h"),
        )
        await sup.start()
        try:
            assert sup.view.state == "running", sup.view
            pid = sup.view.pid
            with pytest.raises(CommandTooLarge, match="not sent"):
                await sup.command("deliver", target="webhook:x:y", text="\x01" * (COMMAND_MAX_LINE // 5))
            assert await sup.command("ping") == {"ok": True, "id": "r2"}
            assert sup.view.pid == pid and sup.view.restarts == 0
        finally:
            await sup.stop()

    asyncio.run(go())


def _held_body(port: int, source: str) -> socket.socket:
    """A connection that sent a complete head and keeps its body coming (not yet verifiable)."""
    sock = _connect(port, source)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    return sock


def _signed_request(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    stamp = str(int(time.time()))
    head = (
        f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{TIMESTAMP_HEADER}: {stamp}\r\n{SIGNATURE_HEADER}: {sign(SECRET, stamp, body)}\r\n\r\n"
    )
    return head.encode() + body


def _read_response(sock: socket.socket, wait_s: float = 5.0) -> bytes:
    sock.settimeout(wait_s)
    got = b""
    while b"\r\n\r\n" not in got or not got.endswith(b"}"):
        data = sock.recv(65536)
        if not data:
            break
        got += data
    return got


def test_unsigned_connections_from_several_addresses_cannot_lock_signed_senders_out(hook: Hook) -> None:
    port = hook.port
    # A signed sender already talking over a kept-alive connection keeps it: never evicted.
    kept = _connect(port, "127.0.0.1")
    holders: list[socket.socket] = []
    try:
        kept.sendall(_signed_request({"id": "keep-1", "chat": "fair", "sender": "ann", "text": "kept alive 1"}))
        assert _read_response(kept).startswith(b"HTTP/1.1 202"), "the first signed request"
        # One local user takes every other slot from 4 loopback addresses (16 each, the per-client
        # cap), each with a complete head and a body that never ends.
        address: dict[socket.socket, str] = {}
        for n in range(63):
            holders.append(_held_body(port, f"127.0.0.{10 + n // 16}"))
            address[holders[-1]] = f"127.0.0.{10 + n // 16}"
        time.sleep(0.3)
        assert _answered(holders, 0.3) == {}, "all 63 held"
        # A signed sender on another address is served: room is made by evicting the oldest
        # unsigned connection of the largest group, with a 503 or a cut.
        for i in range(3):
            answer = hook.post(
                {"id": f"fair-{i}", "chat": "fair", "sender": "ann", "text": f"through {i}"}, "127.0.0.2"
            )
            assert answer.status_code == 202, answer.text
        evicted = _answered(holders, 1.0)
        assert 1 <= len(evicted) <= 3, len(evicted)
        assert evicted.get(holders[0]) is not None  # the oldest of its group went first
        # Full again, an attacker connecting from an address that holds about as many unsigned
        # connections as any other evicts nobody else: it can only take the place of its own
        # address's oldest unsigned connection (s21: so one address cannot lock its own signed
        # senders out either).
        holders = [h for h in holders if h not in evicted]
        while len(holders) < 63:
            holders.append(_held_body(port, "127.0.0.10"))
            address[holders[-1]] = "127.0.0.10"
        # (the kept-alive connection idles at most 5 s between requests: used here, and again below)
        kept.sendall(_signed_request({"id": "keep-mid", "chat": "fair", "sender": "ann", "text": "kept alive mid"}))
        assert _read_response(kept).startswith(b"HTTP/1.1 202"), "a request on the kept connection"
        time.sleep(1.1)  # past the eviction grace of the newest
        extra = _held_body(port, "127.0.0.13")
        assert _answered([extra], 0.5) == {}, "the newcomer is held like the others"
        gone = _answered(holders, 1.0)
        assert len(gone) == 1 and {address[h] for h in gone} == {"127.0.0.13"}, [address[h] for h in gone]
        [reply] = gone.values()
        assert reply.startswith(b"HTTP/1.1 503") or reply == b"", reply
        holders = [h for h in holders if h not in gone] + [extra]
        # The kept-alive signed connection is still open and served.
        kept.sendall(_signed_request({"id": "keep-2", "chat": "fair", "sender": "ann", "text": "kept alive 2"}))
        assert _read_response(kept).startswith(b"HTTP/1.1 202"), "the second request on the same connection"
    finally:
        for s in [kept, *holders]:
            s.close()
    wait_for(lambda: store_turns(hook.srv.home, "through 2") == 1, timeout=20, what="the turn")


def test_refused_connections_whose_client_is_gone_log_nothing_each(hook: Hook) -> None:
    port = hook.port
    before = hook.srv.log()
    held = [_connect(port, "127.0.0.30") for _ in range(DEFAULT_CONNECTIONS_PER_CLIENT)]
    try:
        time.sleep(0.2)
        for _ in range(300):  # over the per-client cap, closed (FIN) before the server answers
            s = _connect(port, "127.0.0.30")
            s.close()
        time.sleep(1.5)
    finally:
        for s in held:
            s.close()
    added = hook.srv.log()[len(before) :]
    assert "Traceback" not in added and "Exception in callback" not in added, added[:3000]
    assert added.count("refusing a connection") <= 2, added[:3000]
    assert (
        hook.post({"id": "after-flood", "chat": "flood", "sender": "ann", "text": "after the flood"}).status_code == 202
    )


def test_an_id_crafted_as_another_ids_digest_gets_its_own_key() -> None:
    long_id = "L" * 300
    crafted = "h:" + hashlib.sha256(f"{PREFIX}{long_id}".encode()).hexdigest()
    a, b = UpdateKey("webhook", ACCOUNT, long_id), UpdateKey("webhook", ACCOUNT, crafted)
    assert a.idempotency_key == f"{PREFIX}{crafted}"
    assert b.idempotency_key != a.idempotency_key
    assert b.idempotency_key == f"{PREFIX}h:" + hashlib.sha256(f"{PREFIX}{crafted}".encode()).hexdigest()
    # The two spaces never meet: a natural key's id part never starts with "h:", a digest's always does.
    for mid in ["h:", "h:x", "H:abc", "evt-h:1", "xh:" + "0" * 64, "a" * 300, "nl\n", "h", ""]:
        key = UpdateKey("webhook", ACCOUNT, mid).idempotency_key
        assert key.startswith(PREFIX)
        rest = key[len(PREFIX) :]
        if rest == mid:
            assert not mid.startswith("h:")
        else:
            assert rest == "h:" + hashlib.sha256(f"{PREFIX}{mid}".encode()).hexdigest()


def test_a_crafted_digest_id_is_a_turn_of_its_own(hook: Hook) -> None:
    long_id = "C" * 300
    crafted = "h:" + hashlib.sha256(f"{PREFIX}{long_id}".encode()).hexdigest()
    assert hook.post({"id": long_id, "chat": "coll", "sender": "ann", "text": "FIRST long id"}).status_code == 202
    hook.answered("coll", 1)
    assert hook.post({"id": crafted, "chat": "coll", "sender": "ann", "text": "SECOND crafted id"}).status_code == 202
    rows = hook.answered("coll", 2)
    assert len(rows) == 2 and len({r[3] for r in rows}) == 2, rows
    wait_for(lambda: store_turns(hook.srv.home, "SECOND crafted id") == 1, timeout=20, what="the second turn")
    wait_for(lambda: len([p for p in hook.receiver.posts if p["chat"] == "coll"]) >= 2, timeout=20, what="both replies")


def test_a_cron_prompt_with_a_lone_surrogate_is_refused_clearly(tmp_path: Any) -> None:
    """What the schedule tool hands over (JSON `"\\ud800"` decodes to a lone surrogate): refused by
    the validation with a clear message, nothing written; it used to pass and fail at the save with
    a raw codec error."""
    from cron.schedule import ScheduleError, ScheduleSpec
    from cron.store import CronStore, make_task, utcnow

    home = tmp_path / "home"
    home.mkdir()
    spec = ScheduleSpec.from_dict({"kind": "every", "expr": "1h", "tz": "Etc/UTC"})
    with pytest.raises(ScheduleError, match=r"lone surrogate \(U\+D800 at character 4\)") as refused:
        make_task(name="sur", agent="agt_x", schedule=spec, prompt="say \ud800 hi", now=utcnow())
    assert "codec" not in str(refused.value)
    assert not (home / "crons.json").exists()
    ok = make_task(name="ok", agent="agt_x", schedule=spec, prompt="say 😀 hi", now=utcnow())
    CronStore(home).add(ok)  # a real astral character is text, as before
    assert "😀" in (home / "crons.json").read_text(encoding="utf-8")
