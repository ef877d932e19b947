"""Discord: a slow catch-up fetch and two kinds of code block (session 33, n).

1. One channel's catch-up fetch that discord.py kept retrying (a 5xx, retried for ~25 s; a 429 slept
   out up to 30 s, five times) held every other channel's catch-up: a healthy channel's missed
   message was answered that late, after its newer live message. Now each page is waited for at
   most `CATCH_UP_FETCH_S` and one that runs out is fetched again later; the others go on at once.
   End to end: `appserver serve --channels discord` against the loopback fake of Discord.
2. Discord has no `~~~` fences: such a block's code showed as Markdown. Its fences are now ```.
3. A code line of two backtick runs (``` ``` ```) was split into ```` ``` ```` (a fence line of its
   own, closing the block) and a closer that opened a new block around the prose after it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gateway.split import fences_on_own_lines
from plugins.discord.format import to_discord
from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import ChannelServer, discord_server, store_turns

pytestmark = pytest.mark.timeout(120)

FAILING = "300000000000000041"  # seen first: caught up first
HEALTHY = "300000000000000042"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("discord_s33n") / "home"
    with discord_server(home, fake, {FAILING: "failing", HEALTHY: "healthy"}) as server:
        yield server


def test_a_channel_whose_catch_up_fetch_is_retried_does_not_hold_another_channels_catch_up(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    for channel in (FAILING, HEALTHY):
        fake.inject_guild_message("911", "before", channel=channel, mention=True)
        fake.wait_for_text(channel, "echo: before", timeout=20)
    fake.hold()
    assert fake.invalidate()  # a new session follows: both channels are caught up, FAILING first
    fake.wait_for(lambda: not fake.connected, timeout=10, what="the session to end")
    missed_failing = fake.inject_guild_message("911", "missed failing", channel=FAILING, mention=True)
    missed = fake.inject_guild_message("911", "missed healthy", channel=HEALTHY, mention=True)
    # discord.py retries a 500 itself (after 1, 3, 5, 7 s): five of them held the catch-up ~25 s
    fake.fail_next("GET messages", status=500, count=5, channel=FAILING)
    try:
        fake.release()
        released = time.monotonic()
        time.sleep(1.0)
        live = fake.inject_guild_message("911", "live healthy", channel=HEALTHY, mention=True)
        fake.wait_for_text(HEALTHY, "echo: live healthy", timeout=15)
        answered = time.monotonic() - released
        fake.wait_for_text(FAILING, "echo: missed failing", timeout=30)
    finally:
        fake.clear_failures(f"GET messages in {FAILING}")
    assert answered < 12.0, answered
    time.sleep(0.5)  # a duplicate would show up by now
    contents = [m.content for m in fake.messages(HEALTHY)]
    assert contents == ["echo: before", "echo: missed healthy", "echo: live healthy"], contents
    assert [m.content for m in fake.messages(FAILING)] == ["echo: before", "echo: missed failing"]
    for message_id in (missed_failing, missed, live):
        assert store_turns(srv.home, f'message_id="{message_id}"') == 1
    assert f"catch-up of channel {FAILING} failed (TimeoutError: no answer within 5 s)" in srv.log()


def test_a_tilde_block_is_written_with_discords_own_fences() -> None:
    text = "tilde:\n~~~md\n```py\nx = a*b*c\n```\n~~~~\n**after**\n  ~~~ py `x`\ny = 1\n  ~~~"
    shown = "tilde:\n```md\n``\u200b`py\nx = a*b*c\n``\u200b`\n```\n**after**\n  ``` py x\ny = 1\n  ```"
    assert to_discord(text) == shown
    assert to_discord("a ~~~ in prose") == "a ~~~ in prose"


def test_a_code_line_of_two_backtick_runs_does_not_close_the_block_into_a_new_one() -> None:
    text = "Run this:\n```\necho hi\n``` ```\nThat prints **hi**."
    assert fences_on_own_lines(text) == text  # no piece ``` that a platform reads as a fence line
    assert fences_on_own_lines("```\nprint(x)```\nprose") == "```\nprint(x)\n```\nprose"
    # the later line no longer counts as the closer of a mid-line opener: that opener is literal
    assert fences_on_own_lines("see ```py\ncode\n``` ```") == "see ```py\ncode\n``` ```"
