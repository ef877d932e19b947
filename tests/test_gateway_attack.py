"""An outsider's attack on "a reply part is sent at most once" (docs/channels.md, "Exactly once").

The real platform libraries (slack_sdk, python-telegram-bot, discord.py) talk to the loopback fakes
through `DropProxy`, a TCP proxy that forwards a matching request to the fake (which performs it) and
then cuts the client's connection before the answer (`abort`), or keeps it open without ever
answering (`hang`, a gateway that dies while the send is in flight: the test cancels the delivery,
which is all a kill -9 leaves behind). A restart is a new adapter and a new `ReplySink` built from
the ledger row, as `gateway/replies.py` builds it. Beside those: Slack's history lookup under rate
limits, missing scopes, threads, pagination and look-alike keys; grapheme-safe splitting at each
platform's limit (in the platform's own unit); two gateway processes on one gateway.db; a corrupt
gateway.db at start; and a kill -9 of the whole `appserver serve` while a Slack post is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path
from gateway.delivery import DeliveryFailed, Outbox, ReplySink
from gateway.ledger import Entry, Ledger, UpdateKey
from gateway.ratelimit import ChatRateLimiter
from gateway.split import split_message
from plugins.contract import Account, Adapter, AdapterContext, InboundMessage, Target, is_grapheme_boundary, shorten
from plugins.discord import DiscordAdapter
from plugins.slack import SlackAdapter
from plugins.slack.adapter import API_TIMEOUT_ENV, REPLY_EVENT
from plugins.telegram import TelegramAdapter
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack
from tests.fakes.telegram_api import FakeTelegram, utf16_len
from tests.support.cli import ROOT

pytestmark = pytest.mark.timeout(60)

log = logging.getLogger("test.attack")


# ---------------------------------------------------------------------- the proxy that loses answers


@dataclass
class _Rule:
    needle: bytes  # matched against the request line
    mode: str  # "abort": cut the connection after the upstream performed it; "hang": never answer
    count: int
    skip: int  # matching requests let through before the rule applies


class DropProxy:
    """HTTP/1.1 on 127.0.0.1 in front of a fake's Web API, in a thread of its own. Every request is
    forwarded as is; one matching a rule is performed by the fake, and then its answer is lost."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.lost: list[str] = []  # request lines whose answer was lost
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drop-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self.on_lost: Callable[[str], None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose(self, needle: str, mode: str = "abort", count: int = 1, skip: int = 0) -> None:
        with self._lock:
            self._rules.append(_Rule(needle.encode(), mode, count, skip))

    def __enter__(self) -> DropProxy:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()

    def _take(self, line: bytes) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.needle in line:
                    if rule.skip > 0:
                        rule.skip -= 1
                        return None
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                    return rule
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                assert b"chunked" not in head.lower(), "the proxy reads Content-Length bodies only"
                body = await reader.readexactly(_length(head))
                line = head.split(b"\r\n", 1)[0]
                rule = self._take(line)
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                up_writer.write(head + body)
                await up_writer.drain()
                answer = await up_reader.readuntil(b"\r\n\r\n")
                answer += await up_reader.readexactly(_length(answer))
                up_writer.close()
                if rule is not None:
                    self.lost.append(line.decode())
                    if self.on_lost is not None:
                        self.on_lost(line.decode())
                    if rule.mode == "hang":
                        await reader.read()  # never answered: until the client goes away
                    writer.transport.abort()  # a reset: the request was performed, its answer is gone
                    return
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def _length(head: bytes) -> int:
    for raw in head.split(b"\r\n")[1:]:
        name, _, value = raw.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


# ---------------------------------------------------------------------- gateway side, in process


def _context(data_dir: Path) -> AdapterContext:
    async def on_message(msg: InboundMessage) -> None:
        if msg.ack is not None:
            await msg.ack()

    return AdapterContext(on_message, lambda state, reason: None, data_dir, log)


def _outbox(adapter: Adapter) -> Outbox:
    async def quick(seconds: float) -> None:
        await asyncio.sleep(min(seconds, 0.05))

    return Outbox(adapter, ChatRateLimiter(rate=100.0, burst=100), quick)


def _ledger_row(ledger: Ledger, channel: str, message_id: str, chat: str, reply: str) -> UpdateKey:
    key = UpdateKey(channel, "main", message_id)
    ledger.record(key, chat=chat, sender="u1")
    ledger.decide(key, "allow", "open")
    ledger.mark_submitted(key, f"turn-{message_id}")
    ledger.mark_finished(key, reply)
    return key


async def _deliver(adapter: Adapter, ledger: Ledger, key: UpdateKey, target: Target) -> Entry:
    """What gateway/replies.py does for a finished reply: resume from the ledger row, note each
    attempt and each id, finish, record delivered (or failed)."""
    entry = ledger.get(key)
    assert entry is not None and entry.reply is not None
    sink = ReplySink.resumed(_outbox(adapter), target, entry.remote_ids, stream=False)
    sink.on_sent = lambda ids: ledger.note_sent(key, ids, None)
    sink.on_attempt = lambda part, at: ledger.note_sending(key, part, at)
    sink.key = str(key)
    if entry.sending is not None:
        sink.attempted[entry.sending[0]] = entry.sending[1]
    try:
        ids = await sink.finish(entry.reply)
        return ledger.mark_delivered(key, ids)
    except DeliveryFailed as exc:
        return ledger.mark_failed(key, f"delivery failed: {exc}")


async def _killed_in_flight(
    proxy: DropProxy, adapter: Adapter, ledger: Ledger, key: UpdateKey, target: Target, nth: int = 1
) -> None:
    """Deliver until the `nth` post was performed and its answer is in flight, then kill the
    'process' there (cancel: nothing after that point runs, as with kill -9)."""
    lost = asyncio.Event()
    loop = asyncio.get_running_loop()
    proxy.on_lost = lambda _line: loop.call_soon_threadsafe(lost.set)
    task = asyncio.ensure_future(_deliver(adapter, ledger, key, target))
    try:
        await asyncio.wait_for(lost.wait(), 10)
    finally:
        proxy.on_lost = None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    entry = ledger.get(key)
    assert entry is not None and entry.state == "finished" and entry.sending is not None
    assert entry.sending[0] == f"{key}:{nth - 1}" and len(entry.remote_ids) == nth - 1
    # A killed process's connections die with it: its Discord gateway session (or Telegram poll)
    # must not go on beside the restarted one's, which the fakes, like the platforms, do not allow.
    await adapter.stop()


def _paragraphs(n: int, words: int) -> str:
    """`n` paragraphs of `words` pairs of words: with a paragraph at most a platform's limit and two
    more than it, each paragraph is one part ("Part i: …")."""
    return "\n\n".join(f"Part {i}: " + "lorem ipsum " * words for i in range(n))


# ---------------------------------------------------------------------- Slack


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture
def slack_proxy(slack: FakeSlack) -> Iterator[DropProxy]:
    with DropProxy(slack.port) as proxy:
        yield proxy


@pytest.fixture
async def slack_adapter(
    slack: FakeSlack, slack_proxy: DropProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[[], Any]]:
    monkeypatch.setenv(API_TIMEOUT_ENV, "2")
    made: list[SlackAdapter] = []

    async def start() -> SlackAdapter:
        secrets = {"bot_token": slack.bot_token, "app_token": slack.app_token}
        adapter = SlackAdapter(Account("slack", "main", {"api_url": slack_proxy.url}, secrets), _context(tmp_path))
        await adapter.start()
        made.append(adapter)
        return adapter

    yield start
    for adapter in made:
        await adapter.stop()


def _slack_keys(slack: FakeSlack, channel: str) -> list[str]:
    return [str((m.metadata or {}).get("event_payload", {}).get("key")) for m in slack.messages(channel)]


async def test_slack_a_post_whose_connection_drops_is_found_not_posted_twice(
    slack: FakeSlack, slack_proxy: DropProxy, slack_adapter: Callable[[], Any], tmp_path: Path
) -> None:
    adapter = await slack_adapter()
    slack.add_channel("D-drop")
    ledger = Ledger.open(tmp_path / "gateway.db")
    text = _paragraphs(3, 400)  # three parts
    key = _ledger_row(ledger, "slack", "D-drop:1.1", "D-drop", text)
    slack_proxy.lose("/chat.postMessage", count=2)  # the first two posts: performed, connection reset
    entry = await _deliver(adapter, ledger, key, Target("D-drop"))
    assert entry.state == "delivered", entry.reason
    keys = _slack_keys(slack, "D-drop")
    assert keys == [f"{key}:{i}" for i in range(len(keys))] and len(keys) >= 3, keys  # each part once
    assert entry.remote_ids == tuple(m.ts for m in slack.messages("D-drop"))
    assert len(slack_proxy.lost) == 2 and len(slack.calls("chat.postMessage", channel="D-drop")) == len(keys)


@pytest.mark.parametrize("where", ["dm", "thread"])
async def test_slack_kill_while_a_later_part_is_in_flight_then_restart_gives_each_part_once(
    slack: FakeSlack, slack_proxy: DropProxy, slack_adapter: Callable[[], Any], tmp_path: Path, where: str
) -> None:
    chat = f"{'D' if where == 'dm' else 'C'}-kill-{where}"
    if where == "dm":
        slack.add_channel(chat)
        target, lookup = Target(chat), "conversations.history"
    else:  # a mention in a channel is answered in its thread: the lookup reads the thread's replies
        target = Target(chat, thread=slack.inject_mention("U2", "<@UBOT> go", channel=chat))
        lookup = "conversations.replies"
    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "slack", f"{chat}:1.2", chat, _paragraphs(3, 400))
    slack_proxy.lose("/chat.postMessage", mode="hang", skip=1)  # the second part's post
    await _killed_in_flight(slack_proxy, await slack_adapter(), ledger, key, target, nth=2)
    entry = await _deliver(await slack_adapter(), ledger, key, target)  # the restarted gateway
    assert entry.state == "delivered", entry.reason
    keys = _slack_keys(slack, chat)
    assert keys == [f"{key}:{i}" for i in range(len(keys))] and len(keys) >= 3, keys
    assert all(m.thread_ts == target.thread for m in slack.messages(chat))
    assert [c.method for c in slack.calls(lookup, channel=chat)] == [lookup]  # looked up once, found, reused


# ---------------------------------------------------------------------- Telegram


@pytest.fixture(scope="module")
def telegram() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture
async def telegram_adapter(telegram: FakeTelegram, tmp_path: Path) -> AsyncIterator[Callable[[DropProxy], Any]]:
    made: list[TelegramAdapter] = []

    async def start(proxy: DropProxy) -> TelegramAdapter:
        settings = {"api_url": proxy.url, "poll_timeout": 0}
        adapter = TelegramAdapter(Account("telegram", "main", settings, {"token": telegram.token}), _context(tmp_path))
        await adapter.start()
        made.append(adapter)
        return adapter

    yield start
    for adapter in made:
        await adapter.stop()


def _telegram_parts(telegram: FakeTelegram, chat: int) -> list[str]:
    return [m.text.split(":", 1)[0] for m in telegram.messages(chat)]


async def test_telegram_a_send_whose_connection_drops_is_not_repeated_and_the_reply_fails_loudly(
    telegram: FakeTelegram,
    telegram_adapter: Callable[[DropProxy], Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    chat = telegram.chat(5001)
    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "telegram", f"{chat}:1", str(chat), _paragraphs(3, 250))
    with DropProxy(telegram.port) as proxy:
        adapter = await telegram_adapter(proxy)
        proxy.lose("/sendMessage", skip=1)  # the second part: performed, connection reset
        with caplog.at_level(logging.ERROR, logger="gateway.delivery"):
            entry = await _deliver(adapter, ledger, key, Target(str(chat)))
    assert entry.state == "failed" and "may have reached the chat" in str(entry.reason), entry.reason
    assert _telegram_parts(telegram, chat) == ["Part 0", "Part 1"]  # at most once: the lost one is there, once
    assert any("not sent again" in r.getMessage() for r in caplog.records)


async def test_telegram_kill_while_a_send_is_in_flight_then_restart_sends_that_part_again_as_documented(
    telegram: FakeTelegram,
    telegram_adapter: Callable[[DropProxy], Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    chat = telegram.chat(5002)
    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "telegram", f"{chat}:1", str(chat), _paragraphs(3, 250))
    with DropProxy(telegram.port) as proxy:
        proxy.lose("/sendMessage", mode="hang", skip=1)
        await _killed_in_flight(proxy, await telegram_adapter(proxy), ledger, key, Target(str(chat)), nth=2)
        with caplog.at_level(logging.WARNING, logger="gateway.delivery"):
            entry = await _deliver(await telegram_adapter(proxy), ledger, key, Target(str(chat)))
    assert entry.state == "delivered", entry.reason
    # docs/channels.md: after a crash in flight the part goes out again (the one window left), logged.
    assert _telegram_parts(telegram, chat) == ["Part 0", "Part 1", "Part 1", "Part 2"]
    assert any("the one window left" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------- Discord


@pytest.fixture(scope="module")
def discord_fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


@pytest.fixture
async def discord_adapter(discord_fake: FakeDiscord, tmp_path: Path) -> AsyncIterator[Callable[[DropProxy], Any]]:
    made: list[DiscordAdapter] = []

    async def start(proxy: DropProxy) -> DiscordAdapter:
        settings = {"api_url": f"{proxy.url}/api/v10", "gateway_url": discord_fake.gateway_url}
        account = Account("discord", "main", settings, {"token": discord_fake.token})
        adapter = DiscordAdapter(account, _context(tmp_path))
        await adapter.start()
        made.append(adapter)
        return adapter

    yield start
    for adapter in made:
        await adapter.stop()


@pytest.mark.parametrize("crash", [False, True], ids=["dropped", "killed-and-restarted"])
async def test_discord_a_lost_answer_or_a_kill_in_flight_gives_each_part_once(
    discord_fake: FakeDiscord, discord_adapter: Callable[[DropProxy], Any], tmp_path: Path, crash: bool
) -> None:
    channel = discord_fake.add_text_channel(discord_fake.snowflake(), f"attack-{crash}")
    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "discord", f"{channel}-1", channel, _paragraphs(3, 125))
    with DropProxy(discord_fake.port) as proxy:
        adapter = await discord_adapter(proxy)
        if crash:
            proxy.lose(f"POST /api/v10/channels/{channel}/messages", mode="hang", skip=1)
            await _killed_in_flight(proxy, adapter, ledger, key, Target(channel), nth=2)
            adapter = await discord_adapter(proxy)
        else:
            proxy.lose(f"POST /api/v10/channels/{channel}/messages", count=2)
        entry = await _deliver(adapter, ledger, key, Target(channel))
    assert entry.state == "delivered", entry.reason
    parts = [m.content.split(":", 1)[0] for m in discord_fake.messages(channel)]
    assert parts == [f"Part {i}" for i in range(3)], parts
    assert entry.remote_ids == tuple(m.id for m in discord_fake.messages(channel))


# ---------------------------------------------------------------------- webhooks


@contextlib.contextmanager
def _receiver() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """An HTTP endpoint that records every reply POSTed to it (a receiver deduping on `id`)."""
    import http.server

    got: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server hook
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], got
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("crash", [False, True], ids=["dropped", "killed-and-restarted"])
async def test_webhook_a_lost_answer_or_a_kill_in_flight_resends_with_the_same_id(tmp_path: Path, crash: bool) -> None:
    from plugins.webhook.adapter import WebhookAdapter

    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "webhook", "w-1", "home", "the answer")
    with _receiver() as (port, got), DropProxy(port) as proxy:
        settings = {"listen": "127.0.0.1:0", "reply_url": f"{proxy.url}/reply"}
        account = Account("webhook", "main", settings, {"secret": "s3cret-for-attack-tests"})
        adapter = WebhookAdapter(account, _context(tmp_path))
        if crash:
            proxy.lose("/reply", mode="hang")
            await _killed_in_flight(proxy, adapter, ledger, key, Target("home"))
            adapter = WebhookAdapter(account, _context(tmp_path))
        else:
            proxy.lose("/reply")
        entry = await _deliver(adapter, ledger, key, Target("home"))
    assert entry.state == "delivered", entry.reason
    assert [(r["id"], r["text"]) for r in got] == [(f"{key}:0", "the answer")] * 2  # the receiver dedupes on id
    assert entry.remote_ids == (f"{key}:0",)


# ---------------------------------------------------------------------- Slack: the history lookup


async def test_slack_a_rate_limited_lookup_is_waited_out_then_the_lost_post_is_found(
    slack: FakeSlack, slack_proxy: DropProxy, slack_adapter: Callable[[], Any]
) -> None:
    adapter = await slack_adapter()
    slack.add_channel("D-429")
    slack_proxy.lose("/chat.postMessage")
    slack.fail_next("conversations.history", "ratelimited", retry_after=1)
    began = time.monotonic()
    ids = await Outbox(adapter, ChatRateLimiter(rate=100.0, burst=100), asyncio.sleep).send(
        Target("D-429", key="slack:main:D-429:9.9:0"), "hello"
    )
    [message] = slack.messages("D-429")
    assert ids == [message.ts] and len(slack.calls("chat.postMessage", channel="D-429")) == 1
    lookups = slack.calls("conversations.history", channel="D-429")
    assert [c.status for c in lookups] == [429, 200]
    assert lookups[1].t - lookups[0].t >= 0.95 and time.monotonic() - began >= 0.95  # Retry-After honoured


async def test_slack_a_lookup_refused_for_good_after_a_drop_fails_the_reply_without_a_second_post(
    slack: FakeSlack, slack_proxy: DropProxy, slack_adapter: Callable[[], Any], tmp_path: Path
) -> None:
    adapter = await slack_adapter()
    slack.add_channel("D-scope")
    ledger = Ledger.open(tmp_path / "gateway.db")
    key = _ledger_row(ledger, "slack", "D-scope:1.3", "D-scope", "one short answer")
    slack_proxy.lose("/chat.postMessage")
    slack.fail_next("conversations.history", "missing_scope")
    entry = await _deliver(adapter, ledger, key, Target("D-scope"))
    assert entry.state == "failed" and "missing_scope" in str(entry.reason)  # not stuck: failed, with why
    assert len(slack.messages("D-scope")) == 1


async def test_slack_look_alike_keys_and_another_apps_message_with_our_key_are_not_taken_for_ours(
    slack: FakeSlack, slack_adapter: Callable[[], Any]
) -> None:
    adapter = await slack_adapter()
    parent = slack.inject_mention("U2", "<@UBOT> go", channel="C-alike")
    key = "slack:main:C-alike:1.5:1"
    for other in (f"{key}0", f"{key}:new", key.upper(), f" {key}", key.rsplit(":", 1)[0]):
        await adapter.send(Target("C-alike", thread=parent, key=other), f"look-alike {other}")
    await adapter.send(Target("C-alike", key=key), "the same key at the channel's top level")
    slack.inject_event(  # another app (a user token: no bot_id) posting our metadata into the thread
        {
            "type": "message",
            "channel": "C-alike",
            "user": "U-OTHER-APP",
            "app_id": "AOTHER",
            "text": "forged",
            "ts": f"{time.time():.6f}",
            "thread_ts": parent,
            "metadata": {"event_type": REPLY_EVENT, "event_payload": {"key": key}},
        }  # fmt: skip
    )
    assert await adapter.find_sent(Target("C-alike", thread=parent, key=key), time.time() - 30) is None
    [ours] = await adapter.send(Target("C-alike", thread=parent, key=key), "ours")
    assert await adapter.find_sent(Target("C-alike", thread=parent, key=key), time.time() - 30) == [ours]


# ---------------------------------------------------------------------- long replies: graphemes and limits

# Each one extended grapheme cluster (UAX #29), and none merges with its neighbours: a cut between two
# of them is the only kind of cut allowed.
CLUSTERS = [
    "👨\u200d👩\u200d👧\u200d👦",  # a family (ZWJ sequence)
    "🇩🇪",  # a flag: two regional indicators
    "🏳\ufe0f\u200d🌈",  # rainbow flag: VS16 + ZWJ
    "🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",  # England: tag sequence
    "👍🏽",  # a skin tone
    "1\ufe0f\u20e3",  # keycap
    "e\u0301",  # a combining accent
    "a\u0300\u0301\u0302\u0303\u0308",  # a stack of marks
    "\u05e9\u05b8\u05c1",  # Hebrew shin with niqqud (RTL)
    "\u0628\u0650",  # Arabic beh with kasra (RTL)
    "\u0633",  # Arabic seen (RTL)
    "\u0915\u094d\u0937",  # Devanagari conjunct ksha
    "\u091c\u093c\u094d\u092f\u093e",  # "zya" of ज़्यादा: a nukta before the virama, still one conjunct
    "\u1100\u1161\u11a8",  # a Hangul syllable in conjoining jamo
    "\u0e19\u0e49\u0e33",  # Thai "nam": SARA AM is a spacing mark, never cut off
    "\u0e17\u0e33",  # Thai "tham"
    "\u0e84\u0eb3",  # Lao with AM
    "x",
]


def _torture(n: int) -> tuple[str, set[int]]:
    """`n` clusters in a fixed, uneven order (no space, no newline: every cut is a hard cut), and
    the offsets where a cut may fall."""
    text, cuts = "", {0}
    for i in range(n):
        text += CLUSTERS[(i * 7 + i // 5) % len(CLUSTERS)]
        cuts.add(len(text))
    return text, cuts


def test_thai_and_lao_am_is_never_cut_off_its_syllable() -> None:
    # U+0E33 / U+0EB3 are letters (Lo) but Grapheme_Cluster_Break=SpacingMark: nothing may cut before them.
    for am in ("\u0e33", "\u0eb3"):
        assert not is_grapheme_boundary("\u0e17" + am, 1)
        assert not is_grapheme_boundary("\u0e19\u0e49" + am, 2)
    for limit in (100, 101, 102):
        parts = split_message("\u0e19\u0e49\u0e33" * 400, limit)  # Thai is written without spaces
        assert "".join(parts) == "\u0e19\u0e49\u0e33" * 400
        assert all(p.startswith("\u0e19\u0e49\u0e33") and len(p) <= limit for p in parts), limit
    assert shorten("\u0e17\u0e33" * 10, 4) == "\u0e17\u0e33…"


def test_a_nukta_before_the_virama_keeps_the_indic_conjunct_together() -> None:
    # UAX #29 GB9c: consonant [Extend | Linker]* Linker [Extend | Linker]* × consonant. A nukta (an
    # Extend) between the consonant and the virama is the normal, NFC spelling of Hindi ज़्यादा.
    for word in ("\u091c\u093c\u094d\u092f", "\u0915\u093c\u094d\u0937", "\u09a1\u09bc\u09cd\u09af"):
        assert not any(is_grapheme_boundary(word, k) for k in range(1, len(word))), word
    assert is_grapheme_boundary("\u0915\u093c\u0937", 2)  # no virama: two clusters
    assert shorten("ab \u091c\u093c\u094d\u092f\u093e\u0926\u093e", 7) == "ab …"  # not "ab ज़्…"


def test_the_splitter_cuts_only_between_clusters_for_every_limit() -> None:
    text, cuts = _torture(900)
    for limit in range(32, 140, 7):
        parts = split_message(text, limit)
        assert "".join(parts) == text
        offset = 0
        for part in parts:
            assert len(part) <= limit
            offset += len(part)
            assert offset in cuts, (limit, offset, part[-3:])
        assert shorten(text, limit)[:-1] == text[: len(shorten(text, limit)) - 1]
        assert len(shorten(text, limit)) - 1 in cuts


@pytest.mark.parametrize("platform", ["slack", "telegram", "discord"])
async def test_a_very_long_reply_is_split_within_each_platforms_limit_and_never_inside_a_cluster(
    platform: str,
    slack: FakeSlack,
    slack_adapter: Callable[[], Any],
    telegram: FakeTelegram,
    telegram_adapter: Callable[[DropProxy], Any],
    discord_fake: FakeDiscord,
    discord_adapter: Callable[[DropProxy], Any],
) -> None:
    text, cuts = _torture(5000)  # about 12,000 code points, 20,000 UTF-16 units
    with contextlib.ExitStack() as stack:
        if platform == "slack":
            slack.add_channel("D-long")
            adapter, target = await slack_adapter(), Target("D-long")
            limit, unit = 3900, len  # the plugin's cap (Slack's own is 40,000)
        elif platform == "telegram":
            adapter = await telegram_adapter(stack.enter_context(DropProxy(telegram.port)))
            target, limit, unit = Target(str(telegram.chat(5003))), 4096, utf16_len
        else:
            adapter = await discord_adapter(stack.enter_context(DropProxy(discord_fake.port)))
            channel = discord_fake.add_text_channel(discord_fake.snowflake(), "long")
            target, limit, unit = Target(channel), 2000, len
        sink = ReplySink(_outbox(adapter), target, stream=False, key=f"{platform}:main:long")
        ids = await sink.finish(text)
    if platform == "slack":
        shown = [m.text for m in slack.messages("D-long")]
    elif platform == "telegram":
        shown = [m.text for m in telegram.messages(int(target.chat))]
    else:
        shown = [m.content for m in discord_fake.messages(target.chat)]
    assert len(shown) == len(ids) >= 3
    assert "".join(shown) == text
    offset = 0
    for part in shown:
        assert unit(part) <= limit, (platform, unit(part))
        offset += len(part)
        assert offset in cuts, (platform, offset, part[-4:])


# ---------------------------------------------------------------------- gateway processes and gateway.db


@contextlib.contextmanager
def _blackhole() -> Iterator[str]:
    """A ws:// address whose connections are taken by the kernel and never answered: a gateway
    child started against it stays up, waiting for the server, with its ledger open."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"ws://127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    err: Path
    out: Path

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _gateway_child(home: Path, url: str, name: str) -> _Child:
    """`python -m gateway` as the supervisor runs it (start envelope on stdin, no accounts)."""
    err, out = home.parent / f"{name}.err", home.parent / f"{name}.out"
    env = {**os.environ, "APPSERVER_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    with open(err, "wb") as e, open(out, "wb") as o:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway"], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=o, stderr=e
        )
    assert proc.stdin is not None
    start = {"op": "start", "url": url, "token": None, "home": str(home), "accounts": []}
    proc.stdin.write((json.dumps(start) + "\n").encode())
    proc.stdin.flush()  # stdin stays open: closing it is the signal to stop
    return _Child(proc, err, out)


def _until(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_second_gateway_process_on_the_same_gateway_db_waits_for_the_first_and_never_runs_beside_it(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    lock = default_path(home).with_name("gateway.lock")
    with _blackhole() as url:
        first = _gateway_child(home, url, "first")
        second: _Child | None = None
        try:
            _until("the first gateway to hold gateway.db", lambda: lock.exists() and lock.read_text().strip())
            assert lock.read_text().strip() == str(first.proc.pid)
            second = _gateway_child(home, url, "second")
            _until("the second to say whom it waits for", lambda: f"pid {first.proc.pid}" in second.stderr())
            time.sleep(0.3)
            assert second.proc.poll() is None and lock.read_text().strip() == str(first.proc.pid)
            first.kill()  # e.g. the orphan of a killed serve, done stopping
            _until("the second to take over", lambda: lock.read_text().strip() == str(second.proc.pid))
            assert second.proc.poll() is None and "refus" not in second.stderr()
        finally:
            first.kill()
            if second is not None:
                second.kill()


async def test_a_gateway_that_cannot_get_the_ledger_in_time_refuses_clearly(tmp_path: Path) -> None:
    import fcntl

    from gateway.main import lock_ledger

    path = default_path(tmp_path)
    path.parent.mkdir(parents=True)
    events: list[tuple[str, dict[str, Any]]] = []

    class Control:
        def event(self, kind: str, payload: dict[str, Any]) -> None:
            events.append((kind, payload))

    held = os.open(path.with_name("gateway.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        os.write(held, b"4242\n")
        began = time.monotonic()
        assert await lock_ledger(tmp_path, Control(), wait_s=0.3) is None  # type: ignore[arg-type]
        assert 0.3 <= time.monotonic() - began < 2
        [(kind, payload)] = events
        assert kind == "gateway_error" and "another gateway process (pid 4242)" in payload["message"]
        fcntl.flock(held, fcntl.LOCK_UN)
        fd = await lock_ledger(tmp_path, Control(), wait_s=0.3)  # type: ignore[arg-type]
        assert fd is not None
        os.close(fd)
    finally:
        os.close(held)


def test_a_corrupt_gateway_db_at_start_is_set_aside_loudly_and_kept_byte_for_byte(tmp_path: Path) -> None:
    home = tmp_path / "home"
    path = default_path(home)
    path.parent.mkdir(parents=True)
    garbage = b"SQLite format 3\x00" + os.urandom(3000)  # the magic, then noise: truncated, garbled
    path.write_bytes(garbage)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{closed.getsockname()[1]}"  # nothing listens: the child exits after the ledger
    child = _gateway_child(home, url, "corrupt")
    try:
        assert child.proc.wait(30) == 3  # EXIT_SERVER_GONE: it got past the ledger
    finally:
        child.kill()
    [moved] = list(path.parent.glob("gateway.db.corrupt-*"))
    assert moved.read_bytes() == garbage  # never emptied, never overwritten
    assert "gateway.db is corrupt" in child.stderr() and str(moved) in child.stderr()
    event = [json.loads(line.split(" ", 1)[1]) for line in child.stdout().splitlines() if "gateway_error" in line]
    assert event and str(moved) in event[0]["message"]  # the supervisor logs it as an error
    ledger = Ledger.open(path)  # a new, working ledger; the old one waits beside it
    try:
        assert ledger.counts() == {}
    finally:
        ledger.close()


# ---------------------------------------------------------------------- kill -9 of the whole serve


def test_kill_9_of_the_whole_serve_while_a_later_slack_part_is_in_flight_then_restart_gives_each_part_once(
    tmp_path: Path, slack: FakeSlack
) -> None:
    from tests.support.cli import cli_env
    from tests.support.gateway import start_channel_server, write_config

    home = tmp_path / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token, **{API_TIMEOUT_ENV: "2"})
    text = "\n\n".join(f"Paragraph {i}: " + "word & more " * 60 for i in range(12))  # 3+ parts
    servers = []
    killed = threading.Event()
    try:
        srv = start_channel_server(home, "--channels", "slack", env=env)
        servers.append(srv)
        srv.wait_channels_ready()
        posts: list[str] = []

        def on_answer(call: Any) -> None:  # on the fake's loop: the 2nd part performed, its answer not out
            if call.method == "chat.postMessage" and call.channel == "D-serve" and call.status == 200:
                posts.append(call.response.get("ts"))
                if len(posts) == 2 and not killed.is_set():
                    killed.set()
                    os.kill(srv.proc.pid, signal.SIGKILL)

        slack.on_answer = on_answer
        slack.hold_answers("chat.postMessage", 5.0, channel="D-serve", count=2)
        ts = slack.inject_dm("U1", text.replace("&", "&amp;"), channel="D-serve")
        _until("the kill at the second part", killed.is_set, timeout=30)
        slack.on_answer = None
        srv.proc.wait(10)
        # Restarted at once, as systemd or a standby would: the old child may still be stopping.
        srv2 = start_channel_server(home, "--channels", "slack", env=env)
        servers.append(srv2)
        key = UpdateKey("slack", "main", f"D-serve:{ts}")

        def delivered() -> Entry | None:
            ledger = Ledger.open(default_path(home))
            try:
                entry = ledger.get(key)
            finally:
                ledger.close()
            return entry if entry is not None and entry.state in ("delivered", "failed") else None

        entry = _until("the reply settled in the ledger", delivered, timeout=40)
        time.sleep(1.0)  # a duplicate would show up by now
    finally:
        slack.on_answer = None
        for server in servers:
            server.kill()
    assert entry.state == "delivered", entry.reason
    parts = slack.messages("D-serve")
    assert _slack_keys(slack, "D-serve") == [f"{key}:{i}" for i in range(len(parts))]  # each part once
    assert len(parts) >= 3 and "".join(m.text for m in parts).count("word &amp; more") == 12 * 60
    assert entry.remote_ids == tuple(m.ts for m in parts)
