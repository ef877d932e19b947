"""Discord: three failures of one REST call that used to cost far more than the call (session 33, a).

1. A channel whose catch-up fetch (`GET channels/{id}/messages`) failed once was given up: the message
   written while the gateway was away was never answered, and the next live message moved the
   channel's saved position past it. Now the fetch is tried again after a bounded backoff.
2. A button press whose acknowledgement (the interaction callback) kept failing held the approval's
   decision and the channel's next messages for the whole of discord.py's retries (9-25 s). Now the
   acknowledgement is given up at the end of Discord's 3 s window.
3. A thread discord.py never saw created, whose lookup (`GET channels/{id}`) failed once, was taken
   for a chat of its own (the default agent, not its parent channel's) and that guess was saved. Now
   the lookup is asked again, and a guess is never saved.

End to end: `appserver serve --channels discord` (the real discord.py in the gateway child) against
the loopback fake of Discord (tests/fakes/discord_api.py); one server for the module."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.fakes.discord_api import BotMessage, FakeDiscord
from tests.support.gateway import ChannelServer, discord_server, store_turns

pytestmark = pytest.mark.timeout(120)

GENERAL = "300000000000000001"
APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("discord_s33a") / "home"
    with discord_server(home, fake, {APPROVALS: "approvals"}, careful_in=APPROVALS) as server:
        yield server


def test_a_message_missed_while_away_is_answered_after_its_catch_up_fetch_failed_once(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    dm = fake.dm_channel("901")
    fake.inject_dm("901", "before")
    fake.wait_for_text(dm, "echo: before", timeout=20)
    fake.hold()
    assert fake.invalidate()  # a new session follows: the adapter catches up on what it missed
    fake.wait_for(lambda: not fake.connected, timeout=10, what="the session to end")
    missed = fake.inject_dm("901", "missed while away")
    fake.fail_next("GET messages", status=503)  # discord.py does not retry a 503: the fetch fails
    fake.release()
    fake.wait_for_text(dm, "echo: missed while away", timeout=20)
    live = fake.inject_dm("901", "a live message")
    fake.wait_for_text(dm, "echo: a live message", timeout=20)
    assert [c.status for c in fake.calls("GET messages", channel=dm)][:2] == [503, 200]
    time.sleep(0.5)  # a duplicate would show up by now
    assert [m.content for m in fake.messages(dm)] == ["echo: before", "echo: missed while away", "echo: a live message"]
    assert store_turns(srv.home, f'message_id="{missed}"') == 1
    assert store_turns(srv.home, f'message_id="{live}"') == 1
    assert f"catch-up of channel {dm} failed (DiscordServerError: 503" in srv.log()


def test_an_unannounced_thread_whose_lookup_failed_once_keeps_its_parent_channels_route(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    thread = fake.add_thread(APPROVALS, announce=False)  # discord.py first hears of it from a message
    fake.fail_next("GET channels", status=503)
    fake.inject_guild_message("902", "/status", channel=thread, mention=True)
    first = fake.wait_for_text(thread, lambda t: t.startswith("Agent"), timeout=20)
    assert first.content.startswith("Agent: careful"), first.content
    fake.inject_guild_message("902", "/status", channel=thread, mention=True)
    fake.wait_for(lambda: len(fake.messages(thread)) >= 2 or None, timeout=20, what="the second answer")
    assert fake.messages(thread)[-1].content.startswith("Agent: careful"), fake.messages(thread)[-1].content
    log = srv.log()
    assert f"could not look channel {thread} up (DiscordServerError: 503" in log, log[-2000:]


def _prompt(fake: FakeDiscord, channel: str) -> BotMessage | None:
    return next((m for m in fake.messages(channel) if m.components), None)


def test_a_failing_press_acknowledgement_does_not_hold_the_decision_or_the_channel(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    fake.inject_guild_message("903", "/call clock {}", channel=APPROVALS, mention=True)
    shown = fake.wait_for(lambda: _prompt(fake, APPROVALS), timeout=20, what="the approval prompt")
    short = re.search(r"/approve (\w+)", shown.content)
    assert short, shown
    fake.fail_next("POST interactions", status=500, count=4)  # discord.py retries a 500 at 1, 4, 9 s
    try:
        pressed = time.monotonic()
        fake.click("903", APPROVALS, shown.id, f"approve:{short.group(1)}", name="ann")
        time.sleep(0.1)
        fake.inject_guild_message("904", "after the press", channel=APPROVALS, mention=True)
        fake.wait_for_text(APPROVALS, lambda t: t.startswith("🔐") and "Approved by" in t, timeout=30)
        decided = time.monotonic() - pressed
        fake.wait_for_text(APPROVALS, "echo: after the press", timeout=30)
        answered = time.monotonic() - pressed
    finally:
        fake.clear_failures("POST interactions")
    assert decided < 6.0, decided  # Discord's 3 s window, and the edit after it
    assert answered < 7.0, answered
    fake.wait_for_text(APPROVALS, lambda t: t.startswith("clock -> "), timeout=20)
