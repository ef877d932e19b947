"""Telegram through a real `appserver serve --channels telegram` against the loopback fake Bot API
(upgradable groups: tests/test_telegram_s29m.py's `UpgradingTelegram`).

* A message of a group upgraded to a supergroup that comes in the same getUpdates batch as the
  upgrade's service messages (a backlog) is answered by the group's route: its agent, its approval
  policy, its conversation (was: recorded under the old id after the move took its route away, so
  the default agent ran the tool at once, in a new conversation). Its answer in the supergroup is
  not threaded under the supergroup's message that has the old message's number.
* The same for one delivered late after the gateway was killed (kill -9): the old → new id map is
  kept on disk (was: in memory only).
* A reply is split by what Telegram counts (the shown text), not by its Markdown's length: a reply
  of links or bold that fits in one message is one message, a longer one needs as few as its shown
  text does (was: 2 and 3 messages for 474 and 806 shown characters).
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.telegram_api import BotMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import READY_LINE, ChannelServer, channel_server, write_config
from tests.test_telegram_s29m import UpgradingTelegram

pytestmark = pytest.mark.timeout(150)

ANN = 3601
BATCHED, BATCHED_SUPER = -3611, -1003611  # the old group's message in the upgrade's batch
LATE, LATE_SUPER = -3612, -1003612  # the old group's message delivered after a kill -9
TELEGRAM_MAX = 4096


@pytest.fixture(scope="module")
def tg() -> Iterator[UpgradingTelegram]:
    with UpgradingTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: UpgradingTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-s36g") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open",
                "group_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for chat in (BATCHED, LATE):
        routed = run_cli(home, "channels", "route", "add", f"telegram:main:{chat}", "careful")
        assert routed.code == 0, routed.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _rows(home: Path) -> dict[str, tuple[str, str, str | None]]:
    """Ledger rows by message id: (chat, state, conversation)."""
    conn = sqlite3.connect(str(home / "channels" / "gateway.db"))
    try:
        rows = conn.execute("SELECT message_id, chat, state, conversation FROM ledger")
        return {mid: (chat, state, conv) for mid, chat, state, conv in rows}
    finally:
        conn.close()


def _texts(tg: UpgradingTelegram, *chats: int) -> list[str]:
    return [m.text for chat in chats for m in tg.messages(chat)]


def _answer(tg: UpgradingTelegram, chat: int) -> BotMessage:
    """The bot's answer to `/call clock {}` in `chat`: an approval prompt, or the tool's result."""
    found: BotMessage = tg.wait_for(
        lambda: next((m for m in tg.messages(chat) if m.reply_markup or m.text.startswith("clock -> ")), None),
        timeout=40,
        what="the /call answered",
    )
    return found


def _first_conversation(srv: ChannelServer, tg: UpgradingTelegram, group: int) -> str:
    """Ann's first message in `group`, answered by its route; the conversation it started."""
    first = tg.inject(group, "hello before", kind="group", sender=tg.user(ANN, "Ann", "ann"))
    tg.wait_for_text(group, "echo: hello before", timeout=30)
    conversation = _rows(srv.home)[f"{group}:{first.message_id}"][2]
    assert conversation, _rows(srv.home)
    return conversation


def test_a_message_in_the_upgrades_own_batch_is_answered_by_the_groups_route(
    srv: ChannelServer, tg: UpgradingTelegram
) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    conversation = _first_conversation(srv, tg, BATCHED)
    # The supergroup already holds messages numbered like the old group's (another bot's, ignored):
    # an answer threaded by the old message's number would hang under one of them.
    other_bot = tg.user(3699, "Other", "other_bot", is_bot=True)
    chatter = [tg.inject(BATCHED_SUPER, f"chatter {n}", kind="supergroup", sender=other_bot) for n in range(8)]
    tg.wait_for(lambda: tg.acked(chatter[-1]) or None, 20, "the other bot's chatter passed over")

    with tg.together():  # one getUpdates answer: the message, then the upgrade's two service messages
        call = tg.inject(BATCHED, "/call clock {}", kind="group", sender=ann)
        tg.upgrade(BATCHED, BATCHED_SUPER)
        tg.service_messages(BATCHED, BATCHED_SUPER, ann)

    answer = _answer(tg, BATCHED_SUPER)
    assert answer.reply_markup and "/approve" in answer.text, _texts(tg, BATCHED_SUPER, BATCHED)  # careful's policy
    row = _rows(srv.home)[f"{BATCHED}:{call.message_id}"]
    assert row == (str(BATCHED_SUPER), "submitted", conversation), row  # the group's conversation, new id
    assert (call.message_id or 0) <= len(chatter) and answer.reply_to is None, answer  # not under "chatter 3"
    assert not any(t.startswith("clock -> ") for t in _texts(tg, BATCHED_SUPER, BATCHED)), "ran unapproved"


def test_a_message_of_the_old_group_after_a_gateway_kill_is_answered_by_the_groups_route(
    srv: ChannelServer, tg: UpgradingTelegram
) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    conversation = _first_conversation(srv, tg, LATE)
    tg.upgrade(LATE, LATE_SUPER)
    last = tg.service_messages(LATE, LATE_SUPER, ann)
    tg.wait_for(lambda: tg.acked_offset > last or None, 20, "the service messages handled")
    readies = srv.log().count(READY_LINE)
    os.kill(srv.gateway_pid(), signal.SIGKILL)
    srv.wait_channels_ready(timeout=60, restarts=readies)

    late = tg.inject(LATE, "/call clock {}", kind="group", sender=ann)  # delivered late, to the new gateway
    answer = _answer(tg, LATE_SUPER)
    assert answer.reply_markup and "/approve" in answer.text, _texts(tg, LATE_SUPER, LATE)
    row = _rows(srv.home)[f"{LATE}:{late.message_id}"]
    assert row == (str(LATE_SUPER), "submitted", conversation), row
    found = re.search(r"/approve (\w+)", answer.text)
    assert found, answer.text
    tg.inject(LATE_SUPER, f"/approve {found.group(1)}", kind="supergroup", sender=ann)
    tg.wait_for_text(LATE_SUPER, lambda t: t.startswith("clock -> "), timeout=30)  # answerable there


def _shown_units(m: BotMessage) -> int:
    return len(m.text.encode("utf-16-le")) // 2


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


LINKS = "\n".join(f"- [Result {i}](https://example.com/search/results/2026/12/07/{'a' * 120}?q={i})" for i in range(40))


@pytest.mark.parametrize(
    ("chat", "text", "parts"),
    [
        (3621, LINKS, 1),  # 7,465 characters of Markdown, 474 shown
        (3622, "[a](https://x.y/q?a=1&b=2) " * 400, 1),  # 10,806 characters, 806 shown
        (3623, "**bold** " * 700, 1),  # 6,306 characters, 3,506 shown
        (3624, "**bold** " * 1300, 2),  # 11,706 characters, 6,506 shown: two messages, not three
    ],
)
def test_a_reply_is_split_only_where_telegram_would_refuse_it(
    srv: ChannelServer, tg: UpgradingTelegram, chat: int, text: str, parts: int
) -> None:
    tg.dm(text, user_id=chat)
    shown = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("**", "")  # links by their labels
    expected = _squeezed(re.sub(r"(?m)^- ", "• ", "echo: " + shown))

    def whole() -> list[BotMessage] | None:
        got = tg.messages(chat)
        return got if _squeezed("".join(m.text for m in got)) == expected else None

    messages = tg.wait_for(whole, timeout=40, what="the whole reply")
    assert all(_shown_units(m) <= TELEGRAM_MAX for m in messages)
    assert [m.parse_mode for m in messages] == ["HTML"] * len(messages)  # formatted, links kept as links
    assert len(messages) == parts, [_shown_units(m) for m in messages]
