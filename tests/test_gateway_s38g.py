"""Session 38 outside attack C (the channel gateway), fixed in gateway/chatops.py, channeltool.py, ledger.py.

1. A turn in a chat's conversation that no message of the chat started (a run of a task the chat
   scheduled, a turn another client submitted there) paused for an approval unseen: the chat got no
   prompt, `/approve` found nothing, `/cancel` refused ("only the person who started…") and withdrew
   the sender's own queued message, and the chat's messages waited behind it for the approval
   timeout. Now its prompt is shown in the chat; in a DM its sender (and an admin) may answer or
   cancel it, in a group only an admin.
2. A 429 on the agent's own `message_channel` reaction held the turn (and the chat) for the whole
   retry_after: it now fails at once with "rate limited, retry after N s".
3. A stranger refused by access (allowlist, silent) became a `message_channel` target by writing to
   the bot once: only chats access let a message in from (or routed ones) are reachable now, and
   the ledger's pruning keeps each chat's newest such row.

A real `appserver serve --channels telegram` (python-telegram-bot) against the loopback fake Bot API,
a protocol client submitting into a chat's conversation as a desktop app does; gateway.db read from disk.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.client import ProtocolClient
from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.telegram_api import BotMessage, FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

ANN, CAT, DAN, EVE, BEN, BOSS, MALLORY, NEVER = 8001, 8002, 8003, 8004, 8005, 8006, 8066, 8067
GROUP = -100880001
WAIT_S = 20.0


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-s38g") / "home"
    allowed = [str(u) for u in (ANN, CAT, DAN, EVE, BEN)]
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "allowlist",
                "allow": allowed, "admins": [str(BOSS)], "unpaired": "silent", "group_policy": "open",
                "default_agent": "careful"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _texts(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.text for m in tg.messages(chat)]


def _conversation_of(home: Path, chat: int) -> str:
    """The conversation the chat's last submitted message went to (gateway.db's ledger)."""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute(
            "SELECT conversation FROM ledger WHERE chat=? AND conversation IS NOT NULL ORDER BY id DESC LIMIT 1",
            (str(chat),),
        ).fetchone()
    finally:
        conn.close()
    assert row is not None, f"no conversation for chat {chat}"
    return str(row[0])


def _row_of(home: Path, chat: int, text: str) -> tuple[str | None, str | None]:
    """(state, reason) of the chat's inbound message reading `text` ((None, None): not recorded yet)."""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT payload, state, reason FROM ledger WHERE chat=?", (str(chat),)).fetchall()
    finally:
        conn.close()
    found = [(state, reason) for payload, state, reason in rows if json.loads(payload).get("text") == text]
    return found[-1] if found else (None, None)


def _submit_elsewhere(srv: ChannelServer, conversation: str, text: str) -> str:
    """A turn submitted into the chat's conversation by another client (a desktop app): no chat
    message started it, as a scheduled run's. Returns its turn id."""

    async def submit() -> str:
        client = await ProtocolClient.connect(srv.url, token="", client="desktop")
        try:
            ack = await client.request(
                {"type": "submit_input", "agent": "careful", "conversation": conversation, "input": text}
            )
            assert ack.get("type") != "error", ack
            return str(ack["turn_id"])
        finally:
            await client.close()

    return asyncio.run(submit())


def _prompt(tg: FakeTelegram, chat: int) -> BotMessage:
    return tg.wait_for(
        lambda: next((m for m in tg.messages(chat) if m.text.startswith("🔐") and "/approve" in m.text), None),
        timeout=WAIT_S,
        what=f"an approval prompt in {chat}",
    )


def _settled(tg: FakeTelegram, chat: int, message_id: int, ending: str) -> None:
    tg.wait_for(
        lambda: tg.message(chat, message_id).text.endswith(ending) or None, timeout=WAIT_S, what=f"prompt {ending}"
    )


def _opened(tg: FakeTelegram, chat: int, *, kind: str = "private", sender: int | None = None) -> None:
    """A first message in `chat`, answered: the chat has a conversation."""
    if kind == "private":
        tg.dm("hello there", user_id=chat)
    else:
        assert sender is not None
        tg.inject(chat, "hello there", kind=kind, sender=tg.user(sender, "Ben"))
    tg.wait_for_text(chat, lambda t: "hello there" in t, timeout=WAIT_S)


# ---------------------------------------------------------------------- 1. a turn no chat message started


def test_a_dm_sees_and_answers_the_approval_of_a_turn_it_did_not_start(srv: ChannelServer, tg: FakeTelegram) -> None:
    _opened(tg, ANN)
    conversation = _conversation_of(srv.home, ANN)
    _submit_elsewhere(srv, conversation, "/call clock {}")
    prompt = _prompt(tg, ANN)
    assert "clock" in prompt.text, prompt.text
    tg.dm("are you still there", user_id=ANN, first_name="Ann")  # queued behind the paused turn
    tg.wait_for(lambda: _row_of(srv.home, ANN, "are you still there")[0] == "submitted" or None, WAIT_S, "queued")
    tg.dm("/approve", user_id=ANN, first_name="Ann")
    _settled(tg, ANN, prompt.message_id, "✅ Approved by Ann")
    tg.wait_for_text(ANN, lambda t: "are you still there" in t, timeout=WAIT_S)  # the chat goes on
    assert not [t for t in _texts(tg, ANN) if "No request waiting" in t]


def test_a_dm_can_cancel_a_paused_turn_it_did_not_start(srv: ChannelServer, tg: FakeTelegram) -> None:
    _opened(tg, CAT)
    conversation = _conversation_of(srv.home, CAT)
    _submit_elsewhere(srv, conversation, "/call clock {}")
    prompt = _prompt(tg, CAT)
    tg.dm("/cancel", user_id=CAT)
    tg.wait_for_text(CAT, "⏹ Cancelled.", timeout=WAIT_S)
    _settled(tg, CAT, prompt.message_id, "⏹ Cancelled")
    tg.dm("next question", user_id=CAT)
    tg.wait_for_text(CAT, lambda t: "next question" in t, timeout=WAIT_S)
    assert not [t for t in _texts(tg, CAT) if "Only the person who started" in t]


def test_in_a_group_only_an_admin_answers_or_cancels_it(srv: ChannelServer, tg: FakeTelegram) -> None:
    ben, boss = tg.user(BEN, "Ben"), tg.user(BOSS, "Boss")
    _opened(tg, GROUP, kind="supergroup", sender=BEN)
    conversation = _conversation_of(srv.home, GROUP)
    _submit_elsewhere(srv, conversation, "/call clock {}")
    prompt = _prompt(tg, GROUP)
    tg.inject(GROUP, "/approve", kind="supergroup", sender=ben)
    tg.wait_for_text(GROUP, lambda t: "only an admin of this bot can answer it" in t, timeout=WAIT_S)
    tg.inject(GROUP, "/cancel", kind="supergroup", sender=ben)
    tg.wait_for_text(GROUP, lambda t: t.startswith("Only the person who started"), timeout=WAIT_S)
    tg.inject(GROUP, "a question from ben", kind="supergroup", sender=ben)
    tg.wait_for(lambda: _row_of(srv.home, GROUP, "a question from ben")[0] == "submitted" or None, WAIT_S, "queued")
    tg.inject(GROUP, "/approve", kind="supergroup", sender=boss)
    _settled(tg, GROUP, prompt.message_id, "✅ Approved by Boss")
    tg.wait_for_text(GROUP, lambda t: "a question from ben" in t, timeout=WAIT_S)


# ---------------------------------------------------------------------- 2. a rate limited reaction


def test_a_rate_limited_reaction_the_agent_asked_for_fails_at_once(srv: ChannelServer, tg: FakeTelegram) -> None:
    _opened(tg, DAN)
    tg.fail_next("setMessageReaction", 429, retry_after=40)
    tg.dm('/call message_channel {"action": "react", "emoji": "👍"}', user_id=DAN)
    said = tg.wait_for_text(DAN, lambda t: t.startswith("message_channel ->"), timeout=WAIT_S)
    assert "rate limited, retry after" in said.text, said.text
    tg.dm("and a send goes on", user_id=DAN)
    tg.wait_for_text(DAN, lambda t: "and a send goes on" in t, timeout=WAIT_S)
    assert len(tg.calls("setMessageReaction", chat_id=DAN)) == 1  # never retried behind the wait


# ---------------------------------------------------------------------- 3. a refused stranger is no target


def test_a_chat_access_only_refused_is_no_message_channel_target(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("hello bot", user_id=MALLORY, first_name="Mallory")
    tg.wait_for(lambda: _row_of(srv.home, MALLORY, "hello bot")[0] == "denied" or None, WAIT_S, "refused")
    _opened(tg, EVE)
    _opened(tg, DAN)  # admitted here, not by another test: each test stands alone (xdist may split them)
    for chat, text in ((MALLORY, "the owner's secret"), (NEVER, "control"), (DAN, "to an admitted chat")):
        call = json.dumps({"action": "send", "text": text, "target": f"telegram:main:{chat}"})
        tg.dm(f"/call message_channel {call}", user_id=EVE)
        tg.wait_for_text(EVE, lambda t, chat=chat: t.startswith("message_channel ->") and str(chat) in t, WAIT_S)
    results = [t for t in _texts(tg, EVE) if t.startswith("message_channel ->")]
    assert "is not a chat this account has talked to" in results[0], results
    assert "is not a chat this account has talked to" in results[1], results
    assert "sent to telegram:main:" in results[2], results
    assert _texts(tg, MALLORY) == [] and _texts(tg, NEVER) == []
    tg.wait_for_text(DAN, "to an admitted chat", timeout=WAIT_S)


def test_pruning_keeps_the_newest_admitted_row_of_a_chat(tmp_path: Path) -> None:
    """A chat whose newest row was refused (a member not let in) stays reachable once its older
    admitted rows are past their retention."""
    now = [1000.0]
    ledger = Ledger.open(tmp_path / "gateway.db", clock=lambda: now[0])
    try:
        first, later = UpdateKey("telegram", "main", "1"), UpdateKey("telegram", "main", "2")
        ledger.record(first, chat="42", sender="7", payload={"text": "hi", "chat_type": "group"})
        ledger.decide(first, "allow", "group: listed")
        ledger.mark_submitted(first, "turn_1", "conv_1")
        ledger.mark_finished(first, "hello")
        ledger.mark_delivered(first, ["5"])
        ledger.record(later, chat="42", sender="9", payload={"text": "me too", "chat_type": "group"})
        ledger.decide(later, "deny", "group: not listed")
        now[0] = 10_000.0
        ledger.prune(5000.0)
        admitted = ledger.connection.execute(
            "SELECT COUNT(*) FROM ledger WHERE chat='42' AND decision='allow'"
        ).fetchone()[0]
        assert admitted == 1
    finally:
        ledger.close()
