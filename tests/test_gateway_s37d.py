"""Session 37 outside attack D (Slack and Discord), fixed in the gateway's outbox and limiter.

1. A platform's "wait" answer to one kind of call (the cosmetic 👀 reaction, a history lookup) held
   back every send and edit of the chat (on Slack every thread of the channel) for its Retry-After,
   up to 300 s: Slack limits per API method and Discord per route, so it holds back only that kind
   of call there now, unless the answer says it reaches further (Discord's global flag); the
   gateway's own 👀 is best effort, skipped rather than retried behind minutes.
2. Slack: a reply's final `chat.update` answered `internal_error` (not performed) past the retry
   minute left the chat with a cut-off reply recorded `delivered`: the history lookup now tells
   whether the edit landed; when it did not, the final text is posted anew, and when nothing can
   tell, the reply fails (counted in `channels status`) instead of `delivered`.

The real slack_sdk / discord.py adapters against the loopback fakes (tests/fakes/), the real
`Outbox` / `ReplySink` / `ChatRateLimiter`, and one end-to-end run through `appserver serve`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.delivery import DeliveryFailed, EditUncertain, Outbox, ReplySink
from gateway.ratelimit import LOOKUP, MESSAGE, REACTION, ChatRateLimiter
from plugins.contract import Account, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.discord import DiscordAdapter
from plugins.discord import create_adapter as create_discord
from plugins.slack import SlackAdapter
from plugins.slack import create_adapter as create_slack
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

GENERAL = "300000000000000001"
OTHER = "300000000000000002"


class StandIn:
    """The gateway's side of the contract: `on_message` commits at once."""

    def __init__(self) -> None:
        self.ledger: dict[str, InboundMessage] = {}

    async def on_message(self, msg: InboundMessage) -> None:
        self.ledger.setdefault(msg.message_id, msg)

    def report(self, state: Any, reason: str | None) -> None:
        pass


class Clock:
    """A monotonic clock the limiter's and outbox's sleeps move on at once (the retry minute in a blink)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)


def outbox(adapter: Any, clock: Clock | None = None) -> Outbox:
    if clock is None:
        return Outbox(adapter, ChatRateLimiter(rate=20.0, burst=20), asyncio.sleep)
    limiter = ChatRateLimiter(rate=20.0, burst=20, clock=clock, sleep=clock.sleep)
    return Outbox(adapter, limiter, clock.sleep, clock=clock)


async def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------- the limiter


async def test_a_wait_on_one_kind_of_call_holds_back_only_that_kind() -> None:
    clock = Clock()
    rl = ChatRateLimiter(rate=10.0, burst=5, clock=clock, sleep=clock.sleep)
    rl.retry_after("c", 30.0, REACTION)
    assert await rl.acquire("c") == 0.0  # sends and edits go on
    assert await rl.acquire("c", LOOKUP) == 0.0
    assert rl.blocked_for("c", REACTION) == pytest.approx(30.0) and rl.blocked_for("c") == 0.0
    assert await rl.acquire("c", REACTION) == pytest.approx(30.0)
    rl.retry_after("c", 20.0, LOOKUP, "chat")  # the answer said: the whole chat
    assert rl.blocked_for("c", MESSAGE) == pytest.approx(20.0) and rl.blocked_for("d") == 0.0
    rl.retry_after("c", 50.0, MESSAGE, "account")  # a global limit: every chat of the account
    assert rl.blocked_for("d", REACTION) == pytest.approx(50.0)
    assert await rl.acquire("d") == pytest.approx(50.0)


async def test_a_side_kind_waits_out_its_block_outside_the_chats_queue() -> None:
    """A reaction waiting out its own 30 s block never sits in the chat's FIFO queue: a send that
    comes after it goes at once."""
    rl = ChatRateLimiter(rate=100.0, burst=5)
    rl.retry_after("c", 30.0, REACTION)
    reaction = asyncio.ensure_future(rl.acquire("c", REACTION))
    await asyncio.sleep(0.05)
    assert await asyncio.wait_for(rl.acquire("c"), 1.0) == 0.0
    assert not reaction.done()
    reaction.cancel()


# ---------------------------------------------------------------------- Slack


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=0.6) as fake:
        yield fake


@pytest.fixture
async def slack_adapter(slack: FakeSlack, tmp_path: Path) -> AsyncIterator[SlackAdapter]:
    gw = StandIn()
    ctx = AdapterContext(gw.on_message, gw.report, tmp_path, logging.getLogger("test.s37d.slack"))
    tokens = {"bot_token": slack.bot_token, "app_token": slack.app_token}
    adapter = create_slack(Account("slack", "main", {"api_url": slack.url}, tokens), ctx)
    assert isinstance(adapter, SlackAdapter)
    await adapter.start()
    try:
        yield adapter
    finally:
        await adapter.stop()


async def test_slack_a_rate_limited_reaction_holds_no_send_or_edit(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    out = outbox(slack_adapter)
    chat = "C-s37d-react"
    asker = slack.inject_mention("U1", "<@UBOT> hi", channel=chat)
    [mid] = await out.send(Target(chat, thread=asker), "first words")
    slack.fail_next("reactions.add", "ratelimited", retry_after=25)
    # The model's `message_channel` react: retried, but only reactions wait for the 25 s.
    reaction = asyncio.ensure_future(out.react(Target(chat, thread=asker), f"{chat}:{asker}", "👀"))
    await wait_until(lambda: out.last_error is not None, 10, "the 429 on reactions.add, taken in")
    t0 = time.monotonic()
    await asyncio.wait_for(out.edit(Target(chat, thread=asker), mid, "first words and more"), 5)
    await asyncio.wait_for(out.send(Target(chat, thread=asker), "another message"), 5)
    assert time.monotonic() - t0 < 3.0
    assert [m.text for m in slack.messages(chat)] == ["first words and more", "another message"]
    assert not reaction.done()
    reaction.cancel()


async def test_slack_the_gateways_own_reaction_is_skipped_on_a_rate_limit(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    out = outbox(slack_adapter)
    chat = "D-s37d-eyes"
    queued = slack.inject_dm("U1", "a second question", channel=chat)
    slack.fail_next("reactions.add", "ratelimited", retry_after=25)
    t0 = time.monotonic()
    with pytest.raises(DeliveryFailed, match="skipped"):
        await asyncio.wait_for(out.react(Target(chat), f"{chat}:{queued}", "👀", best_effort=True), 5)
    with pytest.raises(DeliveryFailed, match="skipped"):  # within the wait: not even asked
        await asyncio.wait_for(out.react(Target(chat), f"{chat}:{queued}", "👀", best_effort=True), 5)
    assert time.monotonic() - t0 < 3.0
    assert [c.status for c in slack.calls("reactions.add", channel=chat)] == [429]
    await asyncio.wait_for(out.send(Target(chat), "the reply goes out"), 5)


def _sink(out: Outbox, target: Target, key: str) -> ReplySink:
    sink = ReplySink(out, target, interval=0.0)
    sink.key = key
    return sink


async def test_slack_a_final_edit_that_did_not_land_is_posted_anew(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    clock = Clock()
    out = outbox(slack_adapter, clock)
    chat = "D-s37d-cut"
    slack.add_channel(chat)
    reply = _sink(out, Target(chat), "slack:main:D-s37d-cut:1")
    await reply.show("w1 w2")
    slack.fail_next("chat.update", "internal_error", count=1000)  # not performed, for minutes
    try:
        ids = await asyncio.wait_for(reply.finish("w1 w2 w3 w4 w5"), 30)
    finally:
        slack.clear_failures()
    texts = [m.text for m in slack.messages(chat)]
    assert texts == ["w1 w2", "w1 w2 w3 w4 w5"], texts
    assert ids == [slack.messages(chat)[-1].ts]
    assert clock.now - 1000.0 >= 50  # the edit was retried for about the minute first


async def test_slack_a_final_edit_that_landed_despite_the_error_is_not_posted_again(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    out = outbox(slack_adapter, Clock())
    chat = "D-s37d-landed"
    slack.add_channel(chat)
    reply = _sink(out, Target(chat), "slack:main:D-s37d-landed:1")
    await reply.show("w1 w2")
    slack.perform_then_fail("chat.update", "internal_error", count=1000)  # performed, answered an error
    try:
        await asyncio.wait_for(reply.finish("w1 w2 w3"), 30)
    finally:
        slack.clear_failures()
    assert [m.text for m in slack.messages(chat)] == ["w1 w2 w3"]


async def test_slack_a_final_edit_nobody_can_vouch_for_fails_the_reply(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    out = outbox(slack_adapter, Clock())
    chat = "D-s37d-unsure"
    slack.add_channel(chat)
    reply = _sink(out, Target(chat), "slack:main:D-s37d-unsure:1")
    await reply.show("w1 w2")
    slack.fail_next("chat.update", "internal_error", count=1000)
    slack.fail_next("conversations.history", "missing_scope", count=1000)  # the lookup cannot tell
    try:
        with pytest.raises(EditUncertain, match="may not have landed"):
            await asyncio.wait_for(reply.finish("w1 w2 w3"), 30)
    finally:
        slack.clear_failures()
    assert [m.text for m in slack.messages(chat)] == ["w1 w2"]  # not posted twice on a guess


# ---------------------------------------------------------------------- Discord


@pytest.fixture(scope="module")
def discord_fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


@pytest.fixture
async def discord_adapter(discord_fake: FakeDiscord, tmp_path: Path) -> AsyncIterator[DiscordAdapter]:
    gw = StandIn()
    ctx = AdapterContext(gw.on_message, gw.report, tmp_path, logging.getLogger("test.s37d.discord"))
    settings = {"api_url": discord_fake.api_url, "gateway_url": discord_fake.gateway_url}
    adapter = create_discord(Account("discord", "main", settings, {"token": discord_fake.token}), ctx)
    assert isinstance(adapter, DiscordAdapter)
    await adapter.start()
    try:
        yield adapter
    finally:
        await adapter.stop()


async def test_discord_a_long_429_on_a_reaction_holds_no_send_or_edit(
    discord_fake: FakeDiscord, discord_adapter: DiscordAdapter
) -> None:
    out = outbox(discord_adapter)
    asker = discord_fake.inject_guild_message("506", "hello", mention=True)
    [mid] = await out.send(Target(GENERAL), "first words")
    discord_fake.fail_next("PUT messages", status=429, retry_after=40.0)  # over the 30 s discord.py sleeps
    reaction = asyncio.ensure_future(out.react(Target(GENERAL), asker, "👀"))
    await wait_until(lambda: out.last_error is not None, 10, "the 429 on the reaction, taken in")
    t0 = time.monotonic()
    await asyncio.wait_for(out.edit(Target(GENERAL), mid, "first words and more"), 5)
    await asyncio.wait_for(out.send(Target(GENERAL), "another message"), 5)
    assert time.monotonic() - t0 < 3.0
    assert not reaction.done()
    reaction.cancel()
    with pytest.raises(DeliveryFailed, match="skipped"):  # the gateway's own 👀 meanwhile: skipped
        await asyncio.wait_for(out.react(Target(GENERAL), asker, "👀", best_effort=True), 5)


async def test_discord_a_global_429_holds_every_chat_of_the_account(
    discord_fake: FakeDiscord, discord_adapter: DiscordAdapter
) -> None:
    discord_fake.fail_next("POST messages", status=429, retry_after=40.0, is_global=True)
    with pytest.raises(DeliveryError) as err:
        await discord_adapter.send(Target(GENERAL), "not now")
    assert err.value.retry_scope == "account" and err.value.retry_after == pytest.approx(40.0)
    discord_fake.fail_next("POST messages", status=429, retry_after=40.0)
    with pytest.raises(DeliveryError) as per_route:
        await discord_adapter.send(Target(OTHER), "not now either")
    assert per_route.value.retry_scope == "account"  # still within the global wait
    out = outbox(discord_adapter)
    discord_fake.fail_next("POST messages", status=429, retry_after=40.0, is_global=True)
    sending = asyncio.ensure_future(out.send(Target(GENERAL), "later"))
    await wait_until(lambda: out.limiter.blocked_for(OTHER) > 30, 10, "the global wait on every chat")
    sending.cancel()


# ---------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def slack_e2e() -> Iterator[FakeSlack]:
    """A fake of its own: the server's gateway stays connected while other tests of the worker run."""
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack_e2e: FakeSlack) -> Iterator[ChannelServer]:
    slack = slack_e2e
    home = tmp_path_factory.mktemp("s37d") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def test_e2e_a_429_on_the_queued_messages_eyes_does_not_freeze_the_replies(
    srv: ChannelServer, slack_e2e: FakeSlack
) -> None:
    """The attacker's repro: a follow-up sent while the reply is being written gets 👀, Slack answers
    `ratelimited` (Retry-After 25); the reply being written and the next one still end in seconds."""
    slack = slack_e2e
    chat = "D-s37d-e2e"
    slack.fail_next("reactions.add", "ratelimited", retry_after=25)
    t0 = time.monotonic()
    slack.inject_dm("U1", "/slow 40", channel=chat)
    slack.wait_for(lambda: slack.messages(chat) or None, timeout=20, what="the first post")
    slack.inject_dm("U1", "second question", channel=chat)
    slack.wait_for_text(chat, " ".join(f"w{i}" for i in range(1, 41)), timeout=60)
    first = time.monotonic() - t0
    slack.wait_for_text(chat, "echo: second question", timeout=60)
    second = time.monotonic() - t0
    assert [c.status for c in slack.calls("reactions.add", channel=chat)] == [429]
    assert first < 12 and second < 14, (first, second)
