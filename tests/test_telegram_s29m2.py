"""A Telegram group upgraded to a supergroup while one of its messages waits out its debounce: the
message is answered as the chat is now (its new id's route, agent, conversation and approval policy).
A real `appserver serve --channels telegram` against the loopback fake Bot API that can upgrade a
group (tests/test_telegram_s29m.py's `UpgradingTelegram`).

* The group is routed to `careful` (clock=ask): a `/call clock {}` held by debounce when the group is
  upgraded asks for approval in the supergroup, in the group's conversation (was: run at once by the
  default agent, in a new conversation under the old id, with no prompt).
* A message of the old group delivered after the upgrade goes on in that same conversation.
* `Ledger.move_chat` moves the messages not submitted yet, never one already answered.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ledger import Ledger, UpdateKey
from tests.fakes.telegram_api import BotMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.test_telegram_s29m import UpgradingTelegram

pytestmark = pytest.mark.timeout(120)

ANN = 500
GROUP, SUPERGROUP = -558, -100558
DEBOUNCE_MS = 4000


@pytest.fixture(scope="module")
def tg() -> Iterator[UpgradingTelegram]:
    with UpgradingTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: UpgradingTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-upgrade-debounce") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open",
                "group_policy": "open", "default_agent": "assistant", "debounce_ms": DEBOUNCE_MS}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", f"telegram:main:{GROUP}", "careful")
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


def test_a_message_held_by_debounce_is_answered_by_the_routed_agent_in_the_groups_conversation(
    srv: ChannelServer, tg: UpgradingTelegram
) -> None:
    ann = tg.user(ANN, "Ann", "ann")
    first = tg.inject(GROUP, "remember: banana", kind="group", sender=ann)
    tg.wait_for(lambda: tg.messages(GROUP) or None, timeout=30, what="the first reply")
    conversation = _rows(srv.home)[f"{GROUP}:{first.message_id}"][2]
    assert conversation, _rows(srv.home)

    held = tg.inject(GROUP, "/call clock {}", kind="group", sender=ann)
    tg.wait_for(lambda: tg.acked(held) or None, 10, "the held message recorded")
    started = time.monotonic()
    tg.upgrade(GROUP, SUPERGROUP)
    last = tg.service_messages(GROUP, SUPERGROUP, ann)
    tg.wait_for(lambda: tg.acked_offset > last or None, 20, "the service messages handled")
    assert time.monotonic() - started < DEBOUNCE_MS / 1000, "the upgrade came after the debounce: no test"

    prompt: BotMessage = tg.wait_for(
        lambda: (
            next((m for m in tg.messages(SUPERGROUP) if m.reply_markup), None)
            or next((m for m in tg.messages(SUPERGROUP) if m.text.startswith("clock -> ")), None)
        ),
        timeout=30,
        what="the held message answered",
    )
    assert prompt.reply_markup and "/approve" in prompt.text, _texts(tg, SUPERGROUP, GROUP)  # careful's policy
    row = _rows(srv.home)[f"{GROUP}:{held.message_id}"]
    assert row == (str(SUPERGROUP), "submitted", conversation), row  # the group's conversation, under its new id

    late = tg.inject(GROUP, "late from the old group", kind="group", sender=ann)  # delivered after the upgrade
    tg.wait_for(
        lambda: _rows(srv.home).get(f"{GROUP}:{late.message_id}", ("", "", None))[2] or None,
        timeout=30,
        what="the late message submitted",
    )
    assert _rows(srv.home)[f"{GROUP}:{late.message_id}"][::2] == (str(SUPERGROUP), conversation)
    assert not any(t.startswith("clock -> ") for t in _texts(tg, SUPERGROUP, GROUP)), "the tool ran unapproved"
    assert "1 waiting message(s)" in srv.log(), srv.log()[-3000:]


def test_moving_a_chat_moves_its_messages_not_submitted_yet_only(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "channels" / "gateway.db")
    keys = [UpdateKey("telegram", "main", f"-7:{n}") for n in range(1, 5)]
    for key in keys:
        ledger.record(key, chat="-7", sender="500", payload={"text": "hi"})
    other = UpdateKey("telegram", "other", "-7:1")
    ledger.record(other, chat="-7", sender="500", payload={"text": "hi"})
    ledger.decide(keys[1], "allow", "open")  # held by debounce
    ledger.decide(keys[2], "allow", "open")
    ledger.mark_submitted(keys[2], "turn_1", "conv_1")  # answered where it was asked
    ledger.decide(keys[3], "deny", "empty")

    moved = ledger.move_chat("telegram", "main", "-7", "-1007")
    assert moved.messages == 2 and moved
    chats = [(ledger.get(k) or pytest.fail(str(k))).chat for k in [*keys, other]]
    assert chats == ["-1007", "-1007", "-7", "-7", "-7"]
    assert not ledger.move_chat("telegram", "main", "-7", "-1007")  # once
