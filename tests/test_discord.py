"""The Discord plugin (issue 19) in-process: the real discord.py client against the loopback fake of
Discord's REST API and gateway WebSocket (tests/fakes/discord_api.py), with a stand-in for the gateway's
`on_message` that commits like the real one. The end-to-end tests through `appserver serve --channels
discord` are in tests/test_discord_e2e.py."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import operator
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugins.contract import Account, AccountError, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.discord import MAX_LENGTH, DiscordAdapter, create_adapter, nonce_for, to_discord
from tests.fakes.discord_api import FakeDiscord

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
GENERAL = "300000000000000001"


class StandIn:
    """The gateway's side of the contract: `on_message` commits (a dict of ids)."""

    def __init__(self) -> None:
        self.calls: list[InboundMessage] = []
        self.ledger: dict[str, InboundMessage] = {}
        self.states: list[tuple[str, str | None]] = []
        self.fail = 0

    async def on_message(self, msg: InboundMessage) -> None:
        self.calls.append(msg)
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("ledger unavailable")
        self.ledger.setdefault(msg.message_id, msg)

    def report(self, state: Any, reason: str | None) -> None:
        self.states.append((state, reason))


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


def _adapter(fake: FakeDiscord, gw: StandIn, data_dir: Path, token: str | None = None) -> DiscordAdapter:
    ctx = AdapterContext(gw.on_message, gw.report, data_dir, logging.getLogger("test.discord"))
    settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url}
    secrets = {"token": token if token is not None else fake.token}
    account = Account("discord", "main", settings, secrets, {"token": "environment variable DISCORD_TOKEN"})
    adapter = create_adapter(account, ctx)
    assert isinstance(adapter, DiscordAdapter)
    return adapter


@pytest.fixture
async def running(fake: FakeDiscord, tmp_path: Path) -> AsyncIterator[tuple[DiscordAdapter, StandIn]]:
    gw = StandIn()
    adapter = _adapter(fake, gw, tmp_path)
    await adapter.start()
    try:
        yield adapter, gw
    finally:
        await adapter.stop()


def test_format_passes_markdown_and_drops_control_characters() -> None:
    assert to_discord("**bold** `code` @everyone\r\nnext\x00\x07") == "**bold** `code` @everyone\nnext"
    assert len(nonce_for("discord:main:123:0")) == 25 and nonce_for("a") == nonce_for("a") != nonce_for("b")


async def test_a_dm_maps_to_a_dm_and_own_messages_are_skipped(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    adapter, gw = running
    assert gw.states[-1] == ("running", None) and adapter.is_running
    mid = fake.inject_dm("501", "hello there", name="Ann")
    await fake.wait_for_async(lambda: mid in gw.ledger, 5, "the DM")
    msg = gw.ledger[mid]
    dm = fake.dm_channel("501")
    assert (msg.chat, msg.chat_type, msg.sender, msg.sender_name, msg.text) == (dm, "dm", "501", "Ann", "hello there")
    assert msg.thread is None and not msg.mentions_bot and not msg.sender_is_bot
    [sent] = await adapter.send(Target(dm, key="discord:main:1:0"), "hi back")
    await asyncio.sleep(0.3)  # the bot's own MESSAGE_CREATE comes back: it is not handed over
    assert sent not in gw.ledger and [m.message_id for m in gw.calls] == [mid]


async def test_guild_mentions_replies_threads_and_bots(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    adapter, gw = running
    mention = fake.inject_guild_message("502", "what now?", mention=True)
    plain = fake.inject_guild_message("502", "chatter")
    [bot_msg] = await adapter.send(Target(GENERAL, key="k-guild"), "an answer")
    reply = fake.inject_guild_message("503", "and this?", reply_to=bot_msg)
    thread = fake.add_thread(GENERAL)
    in_thread = fake.inject_guild_message("502", "in a thread", channel=thread, mention=True)
    other_bot = fake.inject_guild_message("504", "beep", bot=True)
    for mid in (mention, plain, reply, in_thread, other_bot):
        await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 5, f"message {mid}")
    m = gw.ledger[mention]
    assert (m.chat, m.chat_type, m.mentions_bot, m.text, m.thread) == (GENERAL, "group", True, "what now?", None)
    assert gw.ledger[plain].mentions_bot is False
    r = gw.ledger[reply]
    assert r.mentions_bot and r.reply_to == bot_msg
    t = gw.ledger[in_thread]
    assert (t.chat, t.thread, t.mentions_bot) == (GENERAL, thread, True)
    assert gw.ledger[other_bot].sender_is_bot


async def test_a_thread_never_announced_is_still_a_thread_of_its_channel(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    """With no THREAD_CREATE seen, a thread's message was taken as a chat of its own: it escaped its
    channel's route. Now the channel is looked up once (then known from the catch-up state)."""
    _, gw = running
    thread = fake.add_thread(GENERAL, announce=False)
    first = fake.inject_guild_message("507", "in a quiet thread", channel=thread, mention=True)
    await fake.wait_for_async(lambda: first in gw.ledger, 5, "the first message")
    second = fake.inject_guild_message("507", "and again", channel=thread, mention=True)
    await fake.wait_for_async(lambda: second in gw.ledger, 5, "the second message")
    for mid in (first, second):
        m = gw.ledger[mid]
        assert (m.chat, m.thread, m.chat_type) == (GENERAL, thread, "group")
    assert len([c for c in fake.calls("GET channels") if c.path == f"channels/{thread}"]) == 1


async def test_system_notices_are_not_handed_over(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    """Under group_policy "open" a channel rename (type 4) or "started a thread" (type 18) became a turn."""
    _, gw = running
    notices = [fake.inject_guild_message("508", "new-name", message_type=t) for t in (4, 6, 7, 18)]
    person = fake.inject_guild_message("508", "a person wrote this")
    await fake.wait_for_async(lambda: person in gw.ledger, 5, "the person's message")
    assert not any(n in gw.ledger for n in notices)
    assert [m.message_id for m in gw.calls if m.sender == "508"] == [person]


async def test_an_image_is_fetched_and_a_file_named(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    _, gw = running
    image = fake.add_attachment("cat.png", PNG)
    doc = fake.add_attachment("notes.pdf", b"%PDF-1.4", "application/pdf")
    mid = fake.inject_dm("505", "look", attachments=[image, doc])
    await fake.wait_for_async(lambda: mid in gw.ledger, 5, "the message")
    first, second = gw.ledger[mid].attachments
    assert (first.kind, first.name, first.mime, first.data) == ("image", "cat.png", "image/png", PNG)
    assert (second.kind, second.name, second.data, second.size) == ("file", "notes.pdf", None, 8)


async def test_send_edit_react_typing_without_pings(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    adapter, _ = running
    assert adapter.limits.max_length == MAX_LENGTH <= 2000 and adapter.limits.can_edit and adapter.limits.can_react
    asker = fake.inject_guild_message("506", "ping them", mention=True)
    [mid] = await adapter.send(Target(GENERAL, reply_to=asker, key="discord:main:x:0"), "@everyone look <@506>")
    await adapter.edit(Target(GENERAL), mid, "@here edited")
    await adapter.react(Target(GENERAL), asker, "👀")
    await adapter.typing(Target(GENERAL))
    [msg] = [m for m in fake.messages(GENERAL) if m.id == mid]
    assert msg.history == ["@everyone look <@506>", "@here edited"] and msg.reference == asker
    assert msg.allowed_mentions == {"parse": []}
    patch = fake.calls("PATCH messages", channel=GENERAL)[-1]
    assert patch.body["allowed_mentions"] == {"parse": []}
    assert fake.reactions(GENERAL, asker) == ["👀"] and GENERAL in fake.typing()


async def test_a_thread_target_must_be_a_thread_of_its_chat(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    """`Target(chat, thread)` posts to the thread's channel id: unchecked, any channel or DM id in the
    thread part was posted to. The adapter checks the thread's parent, even for a thread never seen."""
    adapter, _ = running
    other = fake.add_text_channel("300000000000000078", "elsewhere")
    stranger = fake.dm_channel("689")
    seen = fake.add_thread(GENERAL)
    unseen = fake.add_thread(GENERAL, announce=False)  # not in discord.py's cache: looked up
    elsewhere = fake.add_thread(other)
    for thread in (other, stranger, elsewhere, GENERAL, "not-an-id"):
        assert not await adapter.thread_in_chat(GENERAL, thread), thread
        with pytest.raises(DeliveryError, match="is not a thread of channel|not a channel id") as refused:
            await adapter.send(Target(GENERAL, thread, key=f"k-{thread}"), "leak")
        assert refused.value.permanent
    assert fake.messages(other) == [] and fake.messages(stranger) == [] and fake.messages(elsewhere) == []
    for thread in (seen, unseen):
        assert await adapter.thread_in_chat(GENERAL, thread)
        [mid] = await adapter.send(Target(GENERAL, thread, key=f"k-{thread}"), "in the thread")
        assert [m.id for m in fake.messages(thread)] == [mid]


async def test_the_same_key_is_the_same_message(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    adapter, _ = running
    target = Target(GENERAL, key="discord:main:777:0")
    first = await adapter.send(target, "once")
    again = await adapter.send(target, "once")
    assert first == again
    assert [m.id for m in fake.messages(GENERAL)].count(first[0]) == 1
    posts = [
        c for c in fake.calls("POST messages", channel=GENERAL) if c.body.get("nonce") == nonce_for(target.key or "")
    ]
    assert len(posts) == 2 and all(c.body.get("enforce_nonce") is True for c in posts)


async def test_a_429_is_slept_out_by_discord_py(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    adapter, _ = running
    fake.fail_next("POST messages", status=429, retry_after=1.0)
    t0 = time.monotonic()
    [mid] = await adapter.send(Target(GENERAL), "after the wait")
    assert time.monotonic() - t0 >= 1.0
    statuses = [c.status for c in fake.calls("POST messages", channel=GENERAL)][-2:]
    assert statuses == [429, 200] and [m.content for m in fake.messages(GENERAL) if m.id == mid] == ["after the wait"]
    fake.fail_next("POST messages", status=429, retry_after=0.5, is_global=True)
    await adapter.send(Target(GENERAL), "after a global limit")


async def test_a_long_429_comes_back_as_retry_after(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    adapter, _ = running
    fake.fail_next("POST messages", status=429, retry_after=120.0)
    with pytest.raises(DeliveryError) as err:
        await adapter.send(Target(GENERAL), "not now")
    assert err.value.retry_after is not None and err.value.retry_after >= 100 and not err.value.permanent


async def test_forbidden_and_unknown_are_permanent(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    adapter, _ = running
    locked = fake.add_text_channel("300000000000000099", "locked")
    fake.forbid(locked)
    with pytest.raises(DeliveryError) as err:
        await adapter.send(Target(locked), "hi")
    assert err.value.permanent and "Missing Permissions" in err.value.reason
    with pytest.raises(DeliveryError) as err:
        await adapter.send(Target("399999999999999999"), "hi")
    assert err.value.permanent and "Unknown Channel" in err.value.reason


async def test_a_bad_token_is_an_account_error_naming_the_variable(fake: FakeDiscord, tmp_path: Path) -> None:
    gw = StandIn()
    adapter = _adapter(fake, gw, tmp_path, token="wrong")
    with pytest.raises(AccountError, match="DISCORD_TOKEN"):
        await adapter.start()
    assert not adapter.is_running


async def test_without_the_message_content_intent_the_reason_is_clear(tmp_path: Path) -> None:
    with FakeDiscord(message_content=False) as f:
        gw = StandIn()
        adapter = _adapter(f, gw, tmp_path)
        with pytest.raises(AccountError, match="Message Content"):
            await adapter.start()
        assert gw.states[-1][0] == "error"
        assert any(s == "error" and r and "Message Content" in r for s, r in gw.states)


async def test_a_drop_resumes_and_replays(fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]) -> None:
    _, gw = running
    resumes = fake.resumes
    fake.drop()
    mid = fake.inject_dm("507", "while dropped")
    await fake.wait_for_async(lambda: mid in gw.ledger, 10, "the replayed message")
    assert fake.resumes == resumes + 1 and fake.heartbeats >= 1
    assert [m.message_id for m in gw.calls].count(mid) == 1
    await fake.wait_for_async(lambda: gw.states[-1][0] == "running", 5, "running again (RESUMED)")
    assert "backoff" in [s for s, _ in gw.states], gw.states


async def test_an_invalid_session_reidentifies_and_catches_up(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn], tmp_path: Path
) -> None:
    """Also a message not taken (its hand-over failed) before the new session is caught up then: one
    invalid session for both, as discord.py waits 5 s before every IDENTIFY but the first."""
    adapter, gw = running
    first = fake.inject_guild_message("508", "before", mention=True)
    await fake.wait_for_async(lambda: first in gw.ledger, 5, "the first message")
    await fake.wait_for_async(lambda: (tmp_path / "last_seen.json").exists(), 5, "the saved position")
    assert json.loads((tmp_path / "last_seen.json").read_text())[GENERAL]["last"] == first
    seen = fake.inject_dm("510", "seen")
    await fake.wait_for_async(lambda: seen in gw.ledger, 5, "the first DM")
    gw.fail = 1
    lost = fake.inject_dm("510", "not recorded the first time")
    await fake.wait_for_async(lambda: any(m.message_id == lost for m in gw.calls), 5, "the failed hand-over")
    assert lost not in gw.ledger
    identifies = fake.identifies
    fake.hold()
    fake.invalidate()  # a new session: the catch-up from the last recorded id brings the lost one again
    await fake.wait_for_async(lambda: not fake.connected, 5, "the session to end")
    missed = [fake.inject_guild_message("508", f"missed {i}", mention=True) for i in range(3)]
    fake.release()
    for mid in missed:
        await fake.wait_for_async(functools.partial(operator.contains, gw.ledger, mid), 10, f"caught-up {mid}")
    await fake.wait_for_async(lambda: lost in gw.ledger, 10, "the catch-up of the lost DM")
    assert fake.identifies == identifies + 1
    ids = [m.message_id for m in gw.calls]
    assert all(ids.count(mid) == 1 for mid in missed) and ids.count(first) == 1
    assert [gw.ledger[m].text for m in missed] == ["missed 0", "missed 1", "missed 2"]
    assert adapter.is_running


async def test_an_approval_button_is_acknowledged_and_handed_over(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    adapter, gw = running
    [mid] = await adapter.prompt_approval(
        Target(GENERAL), "🔐 shell?\nReply /approve ab12cd34 or /deny ab12cd34", "ab12cd34"
    )
    [prompt] = [m for m in fake.messages(GENERAL) if m.id == mid]
    buttons = [c["custom_id"] for row in prompt.components for c in row["components"]]
    assert buttons == ["approve:ab12cd34", "deny:ab12cd34"]
    iid = fake.click("509", GENERAL, mid, "approve:ab12cd34", name="Bo")
    key = f"interaction:{iid}"
    await fake.wait_for_async(lambda: key in gw.ledger, 5, "the press")
    press = gw.ledger[key]
    assert (press.text, press.sender, press.chat, press.mentions_bot) == ("/approve ab12cd34", "509", GENERAL, True)
    # acknowledged once recorded (tests/test_discord_s28r.py): the callback follows the commit
    await fake.wait_for_async(lambda: [i for i, _ in fake.interaction_callbacks() if i == iid], 5, "the callback")
    assert [b.get("type") for i, b in fake.interaction_callbacks() if i == iid] == [6]
    await adapter.edit(Target(GENERAL), mid, "🔐 shell?\nApproved by Bo")
    [decided] = [m for m in fake.messages(GENERAL) if m.id == mid]
    assert decided.components == [] and decided.content.endswith("Approved by Bo")


async def test_a_channel_first_written_to_while_away_is_caught_up(fake: FakeDiscord, tmp_path: Path) -> None:
    """The catch-up walked only channels seen before: a message in a channel the gateway had never
    seen, sent while it was down, was lost. Now a server channel whose last message is newer than
    the newest one recorded is caught up too (an older one, from before any record, is not)."""
    before = fake.add_text_channel("300000000000000081", "quiet-before")
    old = fake.inject_guild_message("512", "from before the first run", channel=before)
    gw = StandIn()
    first = _adapter(fake, gw, tmp_path)
    await first.start()
    try:
        seen = fake.inject_guild_message("512", "recorded", mention=True)
        await fake.wait_for_async(lambda: seen in gw.ledger, 5, "the recorded message")
    finally:
        await first.stop()
    fresh = fake.add_text_channel("300000000000000082", "made-while-away")
    missed = fake.inject_guild_message("513", "written while the gateway was down", channel=fresh)
    again = _adapter(fake, gw, tmp_path)
    await again.start()
    try:
        await fake.wait_for_async(lambda: missed in gw.ledger, 10, "the missed message")
        m = gw.ledger[missed]
        assert (m.chat, m.thread, m.chat_type, m.text) == (fresh, None, "group", "written while the gateway was down")
        await asyncio.sleep(0.3)
        assert old not in gw.ledger
    finally:
        await again.stop()


async def test_a_failed_message_is_caught_up_even_after_a_later_one_and_on_resume(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    """A later recorded message must not move the catch-up past an earlier one that failed, and
    a RESUME (not only a new session) fetches it again."""
    _, gw = running
    seen = fake.inject_dm("511", "seen")
    await fake.wait_for_async(lambda: seen in gw.ledger, 5, "the first")
    gw.fail = 1
    lost = fake.inject_dm("511", "A: not recorded the first time")
    await fake.wait_for_async(lambda: any(m.message_id == lost for m in gw.calls), 5, "the failed hand-over")
    later = fake.inject_dm("511", "B: recorded")
    await fake.wait_for_async(lambda: later in gw.ledger, 5, "the later one")
    assert lost not in gw.ledger
    fake.drop()  # RESUME
    await fake.wait_for_async(lambda: lost in gw.ledger, 10, "the catch-up after the resume")


async def test_a_send_answered_after_the_timeout_is_repeated_with_its_nonce_and_stays_one_message(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's outbox repeats a send whose answer did not come in time: Discord dedupes it by
    the nonce (`dedupes_sends`), so the reply is one message and continues in it."""
    import plugins.discord.adapter as discord_adapter
    from gateway.delivery import Outbox, ReplySink
    from gateway.ratelimit import ChatRateLimiter

    adapter, _ = running
    monkeypatch.setattr(discord_adapter, "SEND_TIMEOUT_S", 0.5)
    fake.delay_next_post(2.0)  # recorded at once, answered after the timeout
    before = len(fake.messages(GENERAL))
    sink = ReplySink(
        Outbox(adapter, ChatRateLimiter(50.0, 50), asyncio.sleep), Target(GENERAL), key="discord:main:late:1"
    )
    sink.interval = 0.0
    [mid] = await sink.show("the answer")
    assert await sink.finish("the answer is 42") == [mid]
    mine = fake.messages(GENERAL)[before:]
    assert [(m.id, m.content) for m in mine] == [(mid, "the answer is 42")]
    posts = [
        c
        for c in fake.calls("POST messages", channel=GENERAL)
        if c.body.get("nonce") == nonce_for("discord:main:late:1:0")
    ]
    assert len(posts) == 2  # the late one, then its repeat, answered with the same message


async def test_a_repeat_past_the_nonce_window_looks_for_the_message_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Discord enforces a nonce for a few minutes only: a part whose first attempt (before a crash)
    is older than that was posted a second time on the nonce's word. Now the adapter looks for it."""
    from gateway.delivery import Outbox
    from gateway.ratelimit import ChatRateLimiter

    caplog.set_level(logging.INFO, logger="gateway.delivery")
    with FakeDiscord(nonce_window=0.1) as short:
        gw = StandIn()
        adapter = _adapter(short, gw, tmp_path)
        await adapter.start()
        try:
            outbox = Outbox(adapter, ChatRateLimiter(50.0, 50), asyncio.sleep)
            [mid] = await adapter.send(Target(GENERAL, key="discord:main:old:0"), "sent before the crash")
            await asyncio.sleep(0.3)  # the fake forgets the nonce
            long_ago = time.time() - 10 * adapter.dedupe_window_s
            again = await outbox.send_part(Target(GENERAL, key="discord:main:old:0"), "sent before the crash",
                                           since=long_ago)  # fmt: skip
            assert again.ids == [mid] and again.found
            assert [m.id for m in short.messages(GENERAL)] == [mid]
            assert "may show twice" not in caplog.text
            fresh = await outbox.send_part(Target(GENERAL, key="discord:main:new:0"), "never sent", since=long_ago)
            assert not fresh.found and [m.id for m in short.messages(GENERAL)] == [mid, *fresh.ids]
            assert "past the platform's dedupe window (120 s), so it may show twice" in caplog.text
        finally:
            await adapter.stop()


@pytest.mark.parametrize("damage", ["torn", "not an object", "not utf-8"])
async def test_a_damaged_catch_up_state_is_moved_aside_loudly_not_overwritten(
    fake: FakeDiscord, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """A `last_seen.json` that cannot be read as what the adapter writes is set aside as
    `last_seen.json.corrupt-<time>` (its bytes kept) with an error naming both files; the adapter
    then starts a fresh one, written atomically, instead of silently overwriting the damaged one."""
    state = tmp_path / "last_seen.json"
    good = json.dumps({GENERAL: {"last": "300000000000000100", "chat": GENERAL, "thread": None}})
    damaged = {
        "torn": good[: len(good) // 2].encode(),
        "not an object": b'["300000000000000100"]',
        "not utf-8": b'{"\xff": 1}',
    }[damage]
    state.write_bytes(damaged)
    gw = StandIn()
    with caplog.at_level(logging.ERROR, logger="test.discord"):
        adapter = _adapter(fake, gw, tmp_path)
    [aside] = list(tmp_path.glob("last_seen.json.corrupt-*"))
    assert aside.read_bytes() == damaged and not state.exists()
    assert any(str(state) in r.getMessage() and str(aside) in r.getMessage() for r in caplog.records), caplog.text
    await adapter.start()
    try:
        mid = fake.inject_guild_message("512", "after the damage", mention=True)
        await fake.wait_for_async(lambda: mid in gw.ledger, 5, "the message")
        await fake.wait_for_async(lambda: state.exists(), 5, "the new state")
        assert json.loads(state.read_text())[GENERAL]["last"] == mid
        assert aside.read_bytes() == damaged  # the moved copy is never touched again
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last_seen.json", aside.name]  # no temporary left
    finally:
        await adapter.stop()


def test_a_catch_up_state_that_cannot_be_read_is_left_alone(fake: FakeDiscord, tmp_path: Path) -> None:
    """Unreadable (here: a directory where the file should be) is not damaged: nothing is moved, and
    nothing is written over it."""
    (tmp_path / "last_seen.json").mkdir()
    adapter = _adapter(fake, StandIn(), tmp_path)
    msg = InboundMessage("discord", "main", GENERAL, "group", "u", "300000000000000200", "hi")
    adapter._note_seen(int(GENERAL), 300000000000000200, msg)
    assert (tmp_path / "last_seen.json").is_dir() and list(tmp_path.iterdir()) == [tmp_path / "last_seen.json"]


async def test_a_catch_up_entry_of_the_wrong_shape_is_set_aside_and_its_channel_still_caught_up(
    fake: FakeDiscord, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry with a usable `last` but no usable chat / thread / chat_type (a hand edit, a partial
    tool) used to pass the load check and then fail every caught-up message of its channel in
    `_inbound` (a KeyError: skipped, and lost once a live message moved `last` past them). The file is
    set aside loudly, the good entries are kept, and the channel is still caught up (where it is
    looked up from discord.py's cache)."""
    before = fake.inject_guild_message("520", "seen before", mention=True)
    missed = fake.inject_guild_message("520", "sent while the gateway was away", mention=True)
    good = {"last": before, "chat": GENERAL, "thread": None, "chat_type": "group"}
    state = tmp_path / "last_seen.json"
    damaged = {
        GENERAL: {"last": before},
        "300000000000000077": {"last": before, "chat": ["x"], "thread": None, "chat_type": "group"},
        "300000000000000078": {"last": before, "chat": "300000000000000078", "thread": 5.5, "chat_type": "group"},
        "300000000000000079": {"last": before, "chat": "300000000000000079", "thread": None, "chat_type": "channel"},
        "300000000000000080": good | {"chat": "300000000000000080"},
    }
    state.write_text(json.dumps(damaged))
    gw = StandIn()
    with caplog.at_level(logging.ERROR, logger="test.discord"):
        adapter = _adapter(fake, gw, tmp_path)
    [aside] = list(tmp_path.glob("last_seen.json.corrupt-*"))
    assert json.loads(aside.read_text()) == damaged
    assert any("4 channel(s) without a usable chat" in r.getMessage() for r in caplog.records), caplog.text
    assert adapter._seen["300000000000000080"] == good | {"chat": "300000000000000080"}  # a good entry is kept
    assert adapter._seen[GENERAL] == {"last": before}  # its catch-up point too
    await adapter.start()
    try:
        await fake.wait_for_async(lambda: missed in gw.ledger, 10, "the missed message caught up")
        m = gw.ledger[missed]
        assert (m.chat, m.chat_type, m.thread, m.mentions_bot) == (GENERAL, "group", None, True)
        assert before not in gw.ledger
    finally:
        await adapter.stop()
    assert json.loads(state.read_text())[GENERAL] == {
        "last": missed,
        "chat": GENERAL,
        "thread": None,
        "chat_type": "group",
    }


async def test_the_catch_up_state_is_written_at_most_once_a_second_off_the_loop_and_at_stop(
    fake: FakeDiscord, tmp_path: Path
) -> None:
    """Writing the whole state (two fsyncs) for every message, on the event loop, grew with every
    channel ever seen. Noting a message now only marks it; the file follows within a second, once for
    a burst, and at stop. (A crash may lose that second: the catch-up fetches those messages again,
    and the ledger, keyed by message id, knows them.)"""
    state = tmp_path / "last_seen.json"
    adapter = _adapter(fake, StandIn(), tmp_path)
    for i in range(50):
        msg = InboundMessage("discord", "main", GENERAL, "group", "u", str(300000000000000300 + i), "hi")
        adapter._note_seen(int(GENERAL), 300000000000000300 + i, msg)
    assert not state.exists()  # nothing written on the loop, for any of them
    await asyncio.sleep(1.5)
    first = json.loads(state.read_text())
    assert first[GENERAL]["last"] == "300000000000000349"
    written = state.stat().st_mtime_ns
    msg = InboundMessage("discord", "main", GENERAL, "group", "u", "300000000000000400", "hi")
    adapter._note_seen(int(GENERAL), 300000000000000400, msg)
    assert state.stat().st_mtime_ns == written
    await adapter.stop()  # never started: stop still writes what is noted
    assert json.loads(state.read_text())[GENERAL]["last"] == "300000000000000400"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_seen.json"]  # no temporary left


async def test_a_token_reset_while_running_names_the_refusal_once_and_ends_when_it_works(
    fake: FakeDiscord, running: tuple[DiscordAdapter, StandIn]
) -> None:
    """Discord's own message for a 401 is "401: Unauthorized": the reason shown (channels status,
    /readyz, the ledger) said "discord send: 401 401: Unauthorized" (found by an outside test)."""
    adapter, gw = running
    dm = Target(fake.dm_channel("958"))
    token = fake.token
    fake.token = "reset.in.the.portal"
    try:
        with pytest.raises(DeliveryError) as err:
            await adapter.send(dm, "hi")
    finally:
        fake.token = token
    assert err.value.permanent and err.value.reason == "discord send: 401: Unauthorized", err.value.reason
    state, reason = gw.states[-1]
    assert state == "error" and reason is not None and reason.count("401") == 1, gw.states[-1]
    await adapter.send(dm, "hi again")
    assert gw.states[-1] == ("running", None), gw.states[-1]
