"""Outside findings on the `telegram` channel (s22): a photo getFile answers without `file_path`, an
update whose reading fails, a photo download that hangs, media albums and stickers.

Most run a real `appserver serve --channels telegram` (its gateway child running the plugin with the
real python-telegram-bot) against the loopback fake Bot API (tests/fakes/telegram_api.py), one
server for the module, each test in chats of its own. The album redelivery test runs the adapter
in-process, as tests/test_telegram.py does, to refuse one update's record once."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugins.contract import Account, AdapterContext, InboundMessage
from plugins.telegram import adapter as telegram_adapter
from plugins.telegram import create_adapter
from tests.fakes.telegram_api import FakeTelegram, Injected
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

# The adapter's download budgets (per message, per getUpdates batch); read so that this file also
# runs against a tree without them, where each of its tests fails on its own finding.
FETCH_BUDGET_S = float(getattr(telegram_adapter, "FETCH_BUDGET_S", 5.0))
BATCH_FETCH_BUDGET_S = float(getattr(telegram_adapter, "BATCH_FETCH_BUDGET_S", 10.0))

JPEG = bytes.fromhex("ffd8ffe000104a46494600010100000100010000ffdb004300") + bytes(range(64)) * 8 + b"\xff\xd9"


def _jpeg(n: int) -> bytes:
    """A distinct small JPEG-looking picture."""
    return JPEG[:-2] + bytes([n]) * (16 + n) + b"\xff\xd9"


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("telegram_s22") / "home"
    settings = {
        "api_url": tg.url,
        "poll_timeout": 1,
        "token_env": "TG_TOKEN",
        "dm_policy": "open",
        "default_agent": "assistant",
    }
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _turns(srv: ChannelServer, fragment: str) -> list[list[dict[str, Any]]]:
    """The user messages in the store (one per turn) whose text holds `fragment`, as content parts."""
    conn = sqlite3.connect(f"file:{srv.home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = [json.loads(c) for (c,) in conn.execute("SELECT content FROM messages WHERE role='user'")]
    finally:
        conn.close()
    out = []
    for row in rows:
        parts = row if isinstance(row, list) else [{"type": "text", "text": str(row)}]
        if any(fragment in str(p.get("text") or "") for p in parts if isinstance(p, dict)):
            out.append(parts)
    return out


def _images(parts: list[dict[str, Any]]) -> list[bytes]:
    urls = [
        str(p.get("url") or (p.get("image_url") or {}).get("url"))
        for p in parts
        if isinstance(p, dict) and p.get("type") in ("image", "image_url")
    ]
    return [base64.b64decode(u.split(",", 1)[1]) for u in urls]


def _ledger(srv: ChannelServer, chat: int) -> list[str]:
    conn = sqlite3.connect(f"file:{srv.home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        return [m for (m,) in conn.execute("SELECT message_id FROM ledger ORDER BY id") if m.startswith(f"{chat}:")]
    finally:
        conn.close()


def _texts(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.text for m in tg.messages(chat)]


# ---------------------------------------------------------------------- 1. getFile without file_path


def test_a_photo_getfile_answers_without_a_path_is_named_and_its_caption_answered(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    """getFile may answer without `file_path` (optional in the Bot API); python-telegram-bot's download
    then raises RuntimeError, and the update was acknowledged and lost (no ledger row, no reply)."""
    sent = tg.dm(None, photo_sizes=[_jpeg(1), _jpeg(2)], pathless=[0, 1], caption="the receipt, please", user_id=7201)  # type: ignore[arg-type]
    tg.dm("and a text after it", user_id=7201)
    reply = tg.wait_for_text(7201, lambda t: "the receipt, please" in t, timeout=20)
    assert "[attachment: photo_" in reply.text and "image/jpeg" in reply.text, reply.text  # named as a file
    tg.wait_for_text(7201, "echo: and a text after it", timeout=20)
    assert tg.acked(sent) and _ledger(srv, 7201)[0] == f"7201:{sent.message_id}"


def test_a_size_getfile_answers_without_a_path_gives_way_to_the_next_size(srv: ChannelServer, tg: FakeTelegram) -> None:
    small, large = _jpeg(3), _jpeg(4) * 3
    tg.dm(None, photo_sizes=[small, large], pathless=[1], caption="which size is this?", user_id=7202)  # type: ignore[arg-type]
    reply = tg.wait_for_text(7202, lambda t: "which size is this?" in t, timeout=20)
    assert "[attachment" not in reply.text, reply.text
    [turn] = _turns(srv, "which size is this?")
    assert _images(turn) == [small]  # the largest could not be fetched: the next one went


# ---------------------------------------------------------------------- 1. an unexpected error while reading


def test_a_message_whose_reading_fails_is_handed_over_not_skipped(srv: ChannelServer, tg: FakeTelegram) -> None:
    """An entity that cuts an emoji in half makes python-telegram-bot's entity parsing raise: the
    update was logged as "skipping it" and acknowledged, the person's message lost."""
    half = [{"type": "mention", "offset": 1, "length": 1}]  # the second UTF-16 unit of 😀
    sent = tg.dm("😀 is anybody there?", user_id=7203, entities=half)
    tg.wait_for_text(7203, "echo: 😀 is anybody there?", timeout=20)
    assert tg.acked(sent)
    # with a photo: the caption goes on, with a note that the attachment could not be read
    tg.dm(None, photo=JPEG, caption="😀 look at this", user_id=7204, entities=half)  # type: ignore[arg-type]
    reply = tg.wait_for_text(7204, lambda t: "look at this" in t, timeout=20)
    assert "could not be read" in reply.text, reply.text


# ---------------------------------------------------------------------- 2. a download that hangs


def test_a_hanging_photo_download_delays_other_chats_only_by_the_budget(srv: ChannelServer, tg: FakeTelegram) -> None:
    """Downloads hung for 15 s per photo size in the poll loop: three photos of a hanging file server
    held every other chat of the bot for over two minutes. Now a batch's downloads end within
    BATCH_FETCH_BUDGET_S, and each photo is named as a file, its caption answered."""
    with tg.together():  # one getUpdates batch: three photos, then somebody else's text
        for user in (7211, 7212, 7213):
            tg.dm(None, photo_sizes=[_jpeg(5), _jpeg(6)], hanging=[0, 1], caption=f"stuck {user}", user_id=user)  # type: ignore[arg-type]
        t0 = time.monotonic()
        tg.dm("is the bot alive?", user_id=7214)
    tg.wait_for_text(7214, "echo: is the bot alive?", timeout=BATCH_FETCH_BUDGET_S + 15)
    took = time.monotonic() - t0
    assert took < BATCH_FETCH_BUDGET_S + 8, took  # was 3 photos x 2 sizes x 15 s
    for user in (7211, 7212, 7213):
        reply = tg.wait_for_text(user, lambda t, u=user: f"stuck {u}" in t, timeout=10)  # type: ignore[misc]
        assert "[attachment: photo_" in reply.text, reply.text  # named, not lost
    # a photo of its own after that: its download gets the message budget again
    tg.dm(None, photo_sizes=[_jpeg(7)], hanging=[0], caption="stuck again", user_id=7215)  # type: ignore[arg-type]
    t1 = time.monotonic()
    tg.dm("still there?", user_id=7216)
    tg.wait_for_text(7216, "echo: still there?", timeout=FETCH_BUDGET_S + 15)
    assert time.monotonic() - t1 < FETCH_BUDGET_S + 8


# ---------------------------------------------------------------------- 3. albums


def _album(tg: FakeTelegram, chat: int, group: str, photos: list[bytes], caption: str) -> list[Injected]:
    return [
        tg.dm(None, photo=p, caption=caption if i == 0 else None, user_id=chat, media_group=group)  # type: ignore[arg-type]
        for i, p in enumerate(photos)
    ]


def _answered_after(tg: FakeTelegram, chat: int) -> Injected:
    """A text in `chat` and its answer. A chat's turns are answered in the order its messages came
    (gateway/app.py, per-chat worker): any reply to an earlier message is in the chat before it."""
    after = tg.dm(f"a text after it in {chat}", user_id=chat)
    tg.wait_for_text(chat, f"echo: a text after it in {chat}", timeout=20)
    return after


def _one_reply(tg: FakeTelegram, chat: int, fragment: str) -> tuple[str, Injected]:
    """The album's one reply; then a text (returned), whose answer comes after any other part's reply."""
    reply = tg.wait_for_text(chat, lambda t: fragment in t, timeout=20)
    after = _answered_after(tg, chat)  # the other parts' replies, if any, came before its answer
    assert _texts(tg, chat) == [reply.text, f"echo: a text after it in {chat}"], _texts(tg, chat)
    return reply.text, after


def test_an_album_in_one_batch_is_one_turn_with_every_photo(srv: ChannelServer, tg: FakeTelegram) -> None:
    photos = [_jpeg(10), _jpeg(11), _jpeg(12)]
    with tg.together():
        parts = _album(tg, 7221, "album-7221", photos, "what do these have in common?")
    _, after = _one_reply(tg, 7221, "what do these have in common?")
    [turn] = _turns(srv, "what do these have in common?")
    assert _images(turn) == photos
    # the first message stands for the album (the other row is the text sent after it)
    assert _ledger(srv, 7221) == [f"7221:{parts[0].message_id}", f"7221:{after.message_id}"]
    assert all(tg.acked(p) for p in parts)


def test_an_album_split_over_two_batches_is_one_turn(srv: ChannelServer, tg: FakeTelegram) -> None:
    photos = [_jpeg(13), _jpeg(14), _jpeg(15)]
    with tg.together():
        first = _album(tg, 7222, "album-7222", photos[:2], "split album")
    wait_for(lambda: tg.deliveries(first[1]) >= 1, 10, "the first two parts delivered")
    time.sleep(0.3)
    last = tg.dm(None, photo=photos[2], user_id=7222, media_group="album-7222")  # type: ignore[arg-type]
    _, after = _one_reply(tg, 7222, "split album")
    [turn] = _turns(srv, "split album")
    assert _images(turn) == photos
    assert _ledger(srv, 7222) == [f"7222:{first[0].message_id}", f"7222:{after.message_id}"]
    assert tg.acked(last)


def test_an_album_past_a_full_batch_is_one_turn(srv: ChannelServer, tg: FakeTelegram) -> None:
    """A backlog (after downtime): 98 updates, then a 3-photo album. getUpdates answers at most 100,
    so the album's last part lay beyond the first batch, and polling again at the same offset only
    answered the same batch: two turns (a re-attack found it). The batch is now handed over up to
    the album, and the next poll starts at it."""
    photos = [_jpeg(18), _jpeg(19), _jpeg(20)]
    senders = range(7600, 7614)  # 14 chats of 7 messages: 98 updates before the album (ids no other test uses)
    with tg.together():
        for i in range(7):
            for user in senders:
                tg.dm(f"backlog {i}", user_id=user)
        _album(tg, 7620, "album-7620", photos, "backlog album")
    _one_reply(tg, 7620, "backlog album")
    [turn] = _turns(srv, "backlog album")
    assert _images(turn) == photos
    for user in senders:  # and every message of the backlog is answered
        tg.wait_for_text(user, "echo: backlog 6", timeout=60)


def test_an_albums_caption_on_a_later_part_still_makes_one_turn(srv: ChannelServer, tg: FakeTelegram) -> None:
    """The caption may sit on any part; the album is one turn, and a text after it another."""
    with tg.together():
        tg.dm(None, photo=_jpeg(16), user_id=7223, media_group="album-7223")  # type: ignore[arg-type]
        tg.dm(None, photo=_jpeg(17), caption="second caption", user_id=7223, media_group="album-7223")  # type: ignore[arg-type]
    tg.wait_for_text(7223, lambda t: "second caption" in t, timeout=20)
    tg.dm("and now a text", user_id=7223)
    tg.wait_for_text(7223, "echo: and now a text", timeout=20)
    assert len(_texts(tg, 7223)) == 2, _texts(tg, 7223)


class _Gateway:
    """What the gateway does for the adapter: record (here: keep), then ack; a refused message is not
    acknowledged (the ledger could not commit it), so Telegram delivers it again."""

    def __init__(self, refuse_once: str) -> None:
        self.messages: list[InboundMessage] = []
        self.refuse_once: str | None = refuse_once

    async def on_message(self, msg: InboundMessage) -> None:
        self.messages.append(msg)
        if msg.text == self.refuse_once:
            self.refuse_once = None
            raise RuntimeError("ledger unavailable")
        assert msg.ack is not None
        await msg.ack()

    def context(self, data_dir: Path) -> AdapterContext:
        return AdapterContext(
            on_message=self.on_message,
            report=lambda state, reason: None,
            data_dir=data_dir,
            log=logging.getLogger("test.telegram_s22"),
        )

    async def wait(self, text: str, count: int = 1) -> None:
        deadline = time.monotonic() + 15
        while sum(m.text == text for m in self.messages) < count:
            assert time.monotonic() < deadline, [(m.message_id, m.text) for m in self.messages]
            await asyncio.sleep(0.01)


async def test_an_album_part_delivered_again_is_not_a_message_of_its_own(tmp_path: Path) -> None:
    """The album's parts are acknowledged with it, but the offset stops at an update between them
    that was not recorded: Telegram delivers the later parts again, and after a crash a new process
    gets them too. They are known as recorded under the album's first message, not answered anew."""
    with FakeTelegram() as tg:
        gw = _Gateway(refuse_once="between the parts")
        account = Account("telegram", "main", tg.settings(), {"token": tg.token})
        adapter = create_adapter(account, gw.context(tmp_path))
        await adapter.start()
        try:
            with tg.together():
                first = tg.dm(None, photo=_jpeg(20), caption="album", user_id=7231, media_group="a")  # type: ignore[arg-type]
                tg.dm("between the parts", user_id=7232)
                second = tg.dm(None, photo=_jpeg(21), user_id=7231, media_group="a")  # type: ignore[arg-type]
            await gw.wait("between the parts", 2)  # refused, delivered again, recorded
            await tg.wait_for_async(lambda: tg.acked(second), 10, "the offset past the album")
        finally:
            await adapter.stop()
        albums = [m for m in gw.messages if m.chat == "7231"]
        assert {m.message_id for m in albums} == {f"7231:{first.message_id}"}, [m.message_id for m in albums]
        assert len(albums[0].attachments) == 2

        # a new process (after a crash) that is given the second part again passes it over
        again = create_adapter(account, gw.context(tmp_path))
        await again.start()
        try:
            tg.redeliver(second)
            tg.dm("after the crash", user_id=7232)
            await gw.wait("after the crash")
        finally:
            await again.stop()
        assert [m.message_id for m in gw.messages if m.chat == "7231"] == [f"7231:{first.message_id}"]


# ---------------------------------------------------------------------- 4. stickers


def test_a_sticker_comes_as_its_emoji_and_one_without_is_ignored(srv: ChannelServer, tg: FakeTelegram) -> None:
    """docs/channels.md said a sticker alone never gets through, yet it started a turn as a file."""
    bare = tg.dm(None, user_id=7241, sticker="")  # type: ignore[arg-type]
    thumbs = tg.dm(None, user_id=7241, sticker="👍")  # type: ignore[arg-type]
    tg.wait_for_text(7241, "echo: 👍", timeout=20)
    after = _answered_after(tg, 7241)  # a reply to the bare sticker, if any, came before its answer
    assert _texts(tg, 7241) == ["echo: 👍", "echo: a text after it in 7241"]
    assert tg.acked(bare) and tg.acked(thumbs)
    assert _ledger(srv, 7241) == [f"7241:{thumbs.message_id}", f"7241:{after.message_id}"]
