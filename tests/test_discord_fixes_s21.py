"""Discord fixes from the twenty-first session's outside tests, in-process: the real discord.py client
against the loopback fake of Discord (tests/fakes/discord_api.py), with the stand-in gateway of
tests/test_discord.py.

- Messages written while the gateway was down were answered after a message sent just after it came
  back: the catch-up ran in the background and a caught-up message took its place in its channel's
  line only when its history page arrived, after live messages had taken theirs. Now a channel's
  live messages wait (bounded) until that channel's catch-up has handed its messages over, channels
  with no catch-up pending are not held up, a channel with a live message waiting is caught up
  first, and a message both fetched and live is handed over once.
- A mention of the bot by its managed role (`<@&role>`, which Discord's autocomplete often inserts)
  did not count as a mention (under group_policy "mention": ignored) and stayed in the text.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import plugins.discord.adapter as discord_adapter
from plugins.discord import DiscordAdapter
from tests.fakes.discord_api import FakeDiscord
from tests.test_discord import GENERAL, StandIn, _adapter

pytestmark = pytest.mark.timeout(60)

OTHER = "300000000000000031"
QUIET = "300000000000000032"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        f.add_text_channel(OTHER, "other")
        f.add_text_channel(QUIET, "quiet")
        yield f


@pytest.fixture
async def running(fake: FakeDiscord, tmp_path: Path) -> AsyncIterator[tuple[DiscordAdapter, StandIn]]:
    gw = StandIn()
    adapter = _adapter(fake, gw, tmp_path)
    await adapter.start()
    try:
        yield adapter, gw
    finally:
        await adapter.stop()


async def _seen_once(fake: FakeDiscord, tmp_path: Path, gw: StandIn, messages: list[tuple[str, str]]) -> None:
    """A first run that records one message in each (user, channel) given ("dm" for the user's DM),
    then stops: the catch-up state knows those channels."""
    first = _adapter(fake, gw, tmp_path)
    await first.start()
    try:
        for user, channel in messages:
            if channel == "dm":
                mid = fake.inject_dm(user, "seed")
            else:
                mid = fake.inject_guild_message(user, "seed", channel=channel, mention=True)
            await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 5, "the seed")
    finally:
        await first.stop()


def _order(gw: StandIn, chat: str) -> list[str]:
    return [m.text for m in gw.calls if m.chat == chat and m.text != "seed"]


async def test_messages_written_while_down_come_before_live_ones_each_once(fake: FakeDiscord, tmp_path: Path) -> None:
    """A live message of a channel (seen before, or first written to while the gateway was away)
    waits for that channel's catch-up, which hands it over once (it is on the fetched page too);
    a DM never seen is not held up by the catch-up of the others."""
    gw = StandIn()
    await _seen_once(fake, tmp_path, gw, [("540", "dm"), ("540", GENERAL)])
    dm = fake.dm_channel("540")
    fresh = fake.add_text_channel("300000000000000033", "made-while-away")
    down = [
        fake.inject_dm("540", "A1 written while down"),
        fake.inject_dm("540", "A2 written while down"),
        fake.inject_guild_message("540", "A3 written while down", mention=True),
        fake.inject_guild_message("540", "A4 written while down", channel=fresh, mention=True),
    ]
    fake.hold_history()  # the catch-up's fetches wait: live messages certainly arrive before the pages
    again = _adapter(fake, gw, tmp_path)
    identifies = fake.identifies
    starting = asyncio.create_task(again.start())
    try:
        await fake.wait_for_async(lambda: fake.identifies > identifies, 10, "the new session")
        early = fake.inject_dm("540", "B1 live, before on_ready")  # discord.py hands it over before on_ready
        await starting
        live = [
            early,
            fake.inject_dm("540", "B2 live"),
            fake.inject_guild_message("540", "B3 live", mention=True),
            fake.inject_guild_message("540", "B4 live", channel=fresh, mention=True),
        ]
        stranger = fake.inject_dm("541", "a DM never seen")
        await fake.wait_for_async(lambda: stranger in gw.ledger, 5, "the unheld DM")
        await asyncio.sleep(0.3)
        assert not any(mid in gw.ledger for mid in live), "a live message overtook its channel's catch-up"
        fake.release_history()
        for mid in [*down, *live]:
            await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 10, f"message {mid}")
        await asyncio.sleep(0.3)  # anything handed over twice would show now
        assert _order(gw, dm) == ["A1 written while down", "A2 written while down", "B1 live, before on_ready",
                                  "B2 live"]  # fmt: skip
        assert _order(gw, GENERAL) == ["A3 written while down", "B3 live"]
        assert _order(gw, fresh) == ["A4 written while down", "B4 live"]
        ids = [m.message_id for m in gw.calls]
        assert all(ids.count(mid) == 1 for mid in [*down, *live, stranger]), ids
    finally:
        fake.release_history()
        await asyncio.gather(starting, return_exceptions=True)
        await again.stop()


async def test_a_channel_with_a_live_message_waiting_is_caught_up_first(fake: FakeDiscord, tmp_path: Path) -> None:
    gw = StandIn()
    await _seen_once(fake, tmp_path, gw, [("542", GENERAL), ("542", OTHER), ("542", QUIET), ("542", "dm")])
    dm = fake.dm_channel("542")
    missed = fake.inject_dm("542", "A written while down")
    before = len(fake.calls("GET messages"))
    fake.hold_history()
    adapter = _adapter(fake, gw, tmp_path)
    try:
        await adapter.start()
        # the first channel's fetch is held; the DM channel is planned last
        await fake.wait_for_async(lambda: int(GENERAL) in adapter._gates and adapter._gates[int(GENERAL)].running,
                                  5, "the first fetch")  # fmt: skip
        live = fake.inject_dm("542", "B live")
        await fake.wait_for_async(lambda: bool(adapter._gates[int(dm)].waiters), 5, "the live message waiting")
        fake.release_history()
        for mid in (missed, live):
            await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 10, f"message {mid}")
        fetched = [c.channel for c in fake.calls("GET messages")[before:]]
        assert fetched[:2] == [GENERAL, dm], fetched
        assert _order(gw, dm) == ["A written while down", "B live"]
    finally:
        fake.release_history()
        await adapter.stop()


async def test_a_catch_up_that_takes_too_long_is_waited_for_only_so_long(
    fake: FakeDiscord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gw = StandIn()
    await _seen_once(fake, tmp_path, gw, [("543", "dm")])
    dm = fake.dm_channel("543")
    missed = fake.inject_dm("543", "A written while down")
    monkeypatch.setattr(discord_adapter, "CATCH_UP_WAIT_S", 0.5)
    fake.hold_history()
    adapter = _adapter(fake, gw, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="test.discord"):
            await adapter.start()
            live = fake.inject_dm("543", "B live")
            await fake.wait_for_async(lambda: live in gw.ledger, 10, "the live message, after the wait")
        assert missed not in gw.ledger
        assert "are not handed over after 0.5 s; handing on the ones that came since first" in caplog.text
        fake.release_history()
        await fake.wait_for_async(lambda: missed in gw.ledger, 10, "the missed message, late")
        assert [m.message_id for m in gw.calls].count(live) == 1
        assert _order(gw, dm) == ["B live", "A written while down"]  # late, as the warning said
    finally:
        fake.release_history()
        await adapter.stop()


async def test_a_mention_of_the_bots_managed_role_is_a_mention(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    _, gw = running
    by_role = fake.inject_guild_message("544", "role form hello", mention_role=True)
    other_role = fake.inject_guild_message("544", "<@&200000000000000999> not the bot's role")
    for mid in (by_role, other_role):
        await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 5, f"message {mid}")
    m = gw.ledger[by_role]
    assert (m.mentions_bot, m.text) == (True, "role form hello")
    o = gw.ledger[other_role]
    assert (o.mentions_bot, o.text) == (False, "<@&200000000000000999> not the bot's role")


async def test_a_caught_up_role_mention_is_a_mention(fake: FakeDiscord, tmp_path: Path) -> None:
    gw = StandIn()
    await _seen_once(fake, tmp_path, gw, [("545", GENERAL)])
    missed = fake.inject_guild_message("545", "asked by role while down", mention_role=True)
    adapter = _adapter(fake, gw, tmp_path)
    await adapter.start()
    try:
        await fake.wait_for_async(lambda: missed in gw.ledger, 10, "the caught-up message")
        m = gw.ledger[missed]
        assert (m.mentions_bot, m.text, m.chat) == (True, "asked by role while down", GENERAL)
    finally:
        await adapter.stop()
