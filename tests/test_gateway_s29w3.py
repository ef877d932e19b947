"""Gateway and webhook fixes (session 29, W3), through a real `appserver serve --channels webhook`,
real sockets, a loopback `reply_url` receiver and the real route CLI.

1. Outgoing text no platform can encode (a lone surrogate from a tool's `"\\ud800"`) goes out with
   U+FFFD in its place, at once; it used to raise `UnicodeEncodeError` in the webhook's `send`,
   retried as transient for about a minute while the chat's later replies waited. A plugin error no
   retry can fix (`ValueError`, `TypeError`, `UnicodeError`) fails the send at once.
2. Whitespace-only `text` is a 400 (nothing recorded), so the same `id` can be sent again corrected;
   it used to be a 202 that nothing answered, and the corrected retry was dropped as a duplicate.
3. Route keys and webhook chats agree: the webhook refuses a `chat`, `thread` or `sender` with
   whitespace at either end or a control character, and a `chat`/`thread` longer than a route key's
   part; the route CLI refuses a padded key part instead of writing the route for another chat.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from appserver.cli.channels import channels_group
from gateway.db import default_path
from gateway.delivery import DeliveryFailed, Outbox
from gateway.ratelimit import ChatRateLimiter
from gateway.routing import ROUTE_PART_MAX
from plugins.contract import Limits, Target
from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-for-s29w3-webhook"


class Receiver:
    """The app at reply_url: answers 200 to every POST and records it."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with outer._lock:
                    outer.posts.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, chat: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self.posts if p.get("chat") == chat]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Hook:
    def __init__(self, srv: ChannelServer, port: int, receiver: Receiver) -> None:
        self.srv = srv
        self.port = port
        self.receiver = receiver

    def post(self, payload: dict[str, Any]) -> httpx.Response:
        body = json.dumps(payload).encode()
        stamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: stamp,
            SIGNATURE_HEADER: sign(SECRET, stamp, body),
        }
        return httpx.post(f"http://127.0.0.1:{self.port}/", content=body, headers=headers, timeout=10)

    def rows(self, chat: str) -> list[tuple[str, str, str | None]]:
        conn = sqlite3.connect(f"file:{self.srv.home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
        try:
            return conn.execute(
                "SELECT message_id, state, reason FROM ledger WHERE chat = ? ORDER BY id", (chat,)
            ).fetchall()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hook]:
    home = tmp_path_factory.mktemp("s29w3") / "home"
    port = free_port()
    receiver = Receiver()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    try:
        with channel_server(home, env=cli_env(home, WH_SECRET=SECRET)) as srv:
            yield Hook(srv, port, receiver)
    finally:
        receiver.close()


# ----------------------------------------------------------------------------- 1: unencodable text


def test_a_lone_surrogate_sent_by_a_tool_goes_out_replaced_at_once(hook: Hook) -> None:
    call = '/call message_channel {"action":"send","text":"bad \\ud800 half"}'
    began = time.monotonic()
    assert hook.post({"id": "sur-1", "chat": "sur", "sender": "ann", "text": call}).status_code == 202

    def sent() -> list[str] | None:
        texts = [str(p["text"]) for p in hook.receiver.of("sur")]
        return texts if any("bad \ufffd half" in t for t in texts) else None

    wait_for(sent, timeout=20, what="the tool's message, its lone surrogate replaced")
    assert time.monotonic() - began < 20  # not the minute of retries it used to take
    wait_for(lambda: [r for r in hook.rows("sur") if r[1] == "delivered"] or None, timeout=20, what="the reply")


class _Refusing:
    """A platform whose every send raises `error` (a plugin's own bug or bad input)."""

    limits = Limits(max_length=1000, can_edit=False)

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0
        self.is_running = True

    async def send(self, target: Target, text: str) -> list[str]:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize(
    "error",
    [UnicodeEncodeError("utf-8", "x", 0, 1, "surrogates not allowed"), ValueError("bad"), TypeError("bad")],
)
def test_a_plugin_error_no_retry_can_fix_fails_the_send_at_once(error: Exception) -> None:
    adapter = _Refusing(error)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    outbox = Outbox(adapter, ChatRateLimiter(rate=100, burst=100), sleep)  # type: ignore[arg-type]
    with pytest.raises(DeliveryFailed, match=type(error).__name__):
        asyncio.run(outbox.send(Target(chat="c"), "hello"))
    assert adapter.calls == 1 and slept == []


def test_any_other_plugin_error_is_still_retried() -> None:
    adapter = _Refusing(RuntimeError("blip"))
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    outbox = Outbox(adapter, ChatRateLimiter(rate=100, burst=100), sleep)  # type: ignore[arg-type]
    with pytest.raises(DeliveryFailed):
        asyncio.run(outbox.send(Target(chat="c"), "hello"))
    assert adapter.calls > 1 and slept


# ----------------------------------------------------------------------------- 2: blank text


def test_whitespace_only_text_is_400_and_the_id_can_be_sent_again(hook: Hook) -> None:
    answer = hook.post({"id": "ws-1", "chat": "ws", "sender": "ann", "text": "   \n\t"})
    assert answer.status_code == 400 and "text" in answer.json()["error"], answer.text
    assert hook.rows("ws") == []  # nothing recorded
    assert hook.post({"id": "ws-1", "chat": "ws", "sender": "ann", "text": "now with text"}).status_code == 202
    wait_for(lambda: hook.receiver.of("ws") or None, timeout=20, what="the reply to the corrected message")
    # the ledger says delivered once the receiver's answer is back (it records the post before answering)
    wait_for(lambda: [r[1] for r in hook.rows("ws")] == ["delivered"] or None, timeout=20, what="delivered")


def test_a_used_id_is_answered_as_a_duplicate_not_as_accepted(hook: Hook) -> None:
    """Re-attack: the same `id` in another chat with other text got the same 202 as a first message
    and vanished; now 200 with `duplicate`, and nothing is done again."""
    first = hook.post({"id": "dup-1", "chat": "dupa", "sender": "ann", "text": "first"})
    assert first.status_code == 202 and "duplicate" not in first.json(), first.text
    wait_for(lambda: hook.receiver.of("dupa") or None, timeout=20, what="the reply to the first")
    again = hook.post({"id": "dup-1", "chat": "dupb", "sender": "ann", "text": "another message"})
    assert again.status_code == 200, again.text
    assert again.json() == {"accepted": True, "duplicate": True, "id": "dup-1"}
    assert hook.rows("dupb") == []


# ----------------------------------------------------------------------------- 3: route keys


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("chat", " kit ", "whitespace"),
        ("chat", "kit\u2003", "whitespace"),
        ("chat", "living room", "whitespace"),  # re-attack: accepted, answered, never routable
        ("chat", "a\u00a0b", "whitespace"),
        ("thread", "a\u3000b", "whitespace"),
        ("thread", " t1", "whitespace"),
        ("sender", "ann\n", "control"),
        ("sender", " ann", "whitespace"),
        ("chat", "c" * (ROUTE_PART_MAX + 1), f"{ROUTE_PART_MAX} characters"),
        ("thread", "t" * (ROUTE_PART_MAX + 1), f"{ROUTE_PART_MAX} characters"),
    ],
)
def test_webhook_refuses_ids_no_route_or_allow_entry_could_name(hook: Hook, field: str, value: str, said: str) -> None:
    payload = {"id": f"bad-{field}-{len(value)}", "chat": "okchat", "sender": "ann", "text": "hi", field: value}
    answer = hook.post(payload)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"] and said in answer.json()["error"], answer.text


def test_webhook_takes_a_chat_as_long_as_a_route_key_part(hook: Hook) -> None:
    chat = "c" * ROUTE_PART_MAX
    assert hook.post({"id": "long-ok", "chat": chat, "sender": "ann", "text": "hi"}).status_code == 202


@pytest.mark.parametrize(
    "key", ["webhook:main: kit :__root__", "webhook:main:kit\n", "webhook:main:kit: t1", " webhook:main:kit"]
)
def test_route_cli_refuses_a_padded_key_part_rather_than_strip_it(home: Path, key: str) -> None:
    res = CliRunner().invoke(channels_group, ["route", "add", key, "assistant"], catch_exceptions=False)
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert not default_path(home).exists()  # nothing written
