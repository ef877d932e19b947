"""Unusual Telegram senders and messages, through a real `appserver serve --channels telegram` with
python-telegram-bot against the loopback fake Bot API (docs/channels.md, "Access" and "The telegram
channel"):

* A message posted as a chat (an anonymous group admin: `sender_chat` the group, `from`
  GroupAnonymousBot; a post sent as a channel: `from` Channel_Bot) is not "a message from a bot": its
  sender is `chat:<chat id>`, which `allow` can name (then it is answered); one nobody let in is told,
  once, why nothing comes (was: denied as a bot's, in silence).
* A location, venue, contact, die or poll reaches the agent as a short description (was: dropped as
  empty, not even a ledger row); a join stays ignored.
* A revoked starter pressing Approve, or typing `/approve ID`, in a DM under `dm_policy = "pairing"` is
  told they are no longer allowed to use the bot (was: a new pairing code); the call stays pending,
  and a new plain message still gets a code.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(150)

ALICE, BOB = 701, 702
CLOSED, OPEN = -100900, -100901  # nobody posting as a chat is let in / the group's anonymous admins are
CHANNEL = -100111
ANON = {"id": 1087968824, "is_bot": True, "first_name": "Group", "username": "GroupAnonymousBot"}
CHANNEL_BOT = {"id": 136817688, "is_bot": True, "first_name": "Channel", "username": "Channel_Bot"}
NOT_LET_IN_ANSWER = "You are no longer allowed to use this bot, so you cannot answer this request."
CODE = re.compile(r"[A-Z2-9]{4}-[A-Z2-9]{4}")


class RawTelegram(FakeTelegram):
    """The fake Bot API, with messages built by hand (fields the fake's `inject` does not make)."""

    def raw_message(self, chat_id: int, kind: str, sender: dict[str, Any], **fields: Any) -> int:
        with self._lock:
            chat = self._ensure_chat(chat_id, kind, None if kind == "private" else "Team", False)
            message_id = chat.next_message_id
            chat.next_message_id += 1
            msg = {"message_id": message_id, "from": dict(sender), "chat": self._chat_json(chat)}
            msg.update(date=int(time.time()), **fields)
            self._user_messages[(chat_id, message_id)] = msg
            self._updates.append({"update_id": self._next_update_id, "message": msg})
            self._next_update_id += 1
        self._notify()
        return message_id

    def mention(self, chat_id: int, sender: dict[str, Any], as_chat: dict[str, Any], words: str) -> int:
        text = f"@{self.username} {words}"
        entity = {"type": "mention", "offset": 0, "length": len(self.username) + 1}
        return self.raw_message(chat_id, "supergroup", sender, sender_chat=as_chat, text=text, entities=[entity])


@pytest.fixture(scope="module")
def tg() -> Iterator[RawTelegram]:
    with RawTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: RawTelegram) -> Iterator[ChannelServer]:
    home: Path = tmp_path_factory.mktemp("tg-s29l") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "pairing",
                "group_policy": "mention", "allow": [str(ALICE), f"chat:{OPEN}"],
                "default_agent": "careful"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    with channel_server(home, "--channels", "telegram", env=cli_env(home, TG_TOKEN=tg.token)) as server:
        yield server


def _ledger(home: Path, chat: int) -> list[tuple[str, str, str, str]]:
    """(sender, state, reason, text) of the chat's ledger rows, oldest first."""
    conn = sqlite3.connect(str(home / "channels" / "gateway.db"))
    try:
        rows = conn.execute(
            "SELECT sender, state, reason, payload FROM ledger WHERE chat=? ORDER BY id", (str(chat),)
        ).fetchall()
    finally:
        conn.close()
    return [(s, st, r or "", str(json.loads(p).get("text") or "")) for s, st, r, p in rows]


def _texts(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.text for m in tg.messages(chat)]


def test_an_anonymous_admin_is_the_group_acting_and_told_why_when_not_let_in(
    srv: ChannelServer, tg: RawTelegram
) -> None:
    group = {"id": CLOSED, "type": "supergroup", "title": "Team"}
    tg.mention(CLOSED, ANON, group, "anon hi")
    notice = tg.wait_for_text(CLOSED, lambda t: "anonymously or as a channel" in t, timeout=20)
    assert f"chat:{CLOSED}" in notice.text
    tg.mention(CLOSED, ANON, group, "anon again")  # told once, not once per message
    deadline = time.time() + 20
    while len(_ledger(srv.home, CLOSED)) < 2 and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    rows = _ledger(srv.home, CLOSED)
    assert [(s, st) for s, st, _, _ in rows] == [(f"chat:{CLOSED}", "denied")] * 2, rows
    assert all("posted as a chat" in r and "bot" not in r.split(":")[0] for _, _, r, _ in rows), rows
    assert len(_texts(tg, CLOSED)) == 1, _texts(tg, CLOSED)


def test_a_chat_on_the_allowlist_is_answered_and_a_channel_is_not_a_bot(srv: ChannelServer, tg: RawTelegram) -> None:
    tg.mention(OPEN, ANON, {"id": OPEN, "type": "supergroup", "title": "Team"}, "anon hi")
    tg.wait_for_text(OPEN, lambda t: t.startswith("echo:") and "anon hi" in t, timeout=20)
    tg.mention(OPEN, CHANNEL_BOT, {"id": CHANNEL, "type": "channel", "title": "Chan"}, "chan hi")
    notice = tg.wait_for_text(OPEN, lambda t: "anonymously or as a channel" in t, timeout=20)
    assert f"chat:{CHANNEL}" in notice.text
    senders = [(s, st) for s, st, _, _ in _ledger(srv.home, OPEN)]
    assert senders[0][0] == f"chat:{OPEN}" and senders[0][1] != "denied", senders
    assert (f"chat:{CHANNEL}", "denied") in senders, senders


@pytest.mark.parametrize(
    ("fields", "described"),
    [
        ({"location": {"latitude": 48.5, "longitude": 2.25}}, "[location: 48.5, 2.25]"),
        (
            {
                "location": {"latitude": 1.5, "longitude": 2.5},
                "venue": {"location": {"latitude": 1.5, "longitude": 2.5}, "title": "Cafe", "address": "1 Main St"},
            },
            "[venue: Cafe, 1 Main St (1.5, 2.5)]",
        ),
        (
            {"contact": {"phone_number": "+15550100", "first_name": "Xi", "last_name": "Lo"}},
            "[contact: Xi Lo, +15550100]",
        ),
        ({"dice": {"emoji": "🎲", "value": 3}}, "[dice 🎲: 3]"),
        (
            {
                "poll": {
                    "id": "p1", "question": "Lunch?", "total_voter_count": 0, "is_closed": False,
                    "is_anonymous": True, "type": "regular", "allows_multiple_answers": False, "allows_revoting": True,
                    "members_only": False,
                    "options": [{"text": "yes", "voter_count": 0, "persistent_id": "o1"},
                                {"text": "no", "voter_count": 0, "persistent_id": "o2"}],
                }
            },
            "[poll: Lunch? (yes / no)]",
        ),
    ],
)  # fmt: skip
def test_a_message_without_text_that_says_something_reaches_the_agent_described(
    srv: ChannelServer, tg: RawTelegram, fields: dict[str, Any], described: str
) -> None:
    tg.raw_message(ALICE, "private", tg.user(ALICE, "Alice", "alice"), **fields)
    tg.wait_for_text(ALICE, f"echo: {described}", timeout=20)
    assert _ledger(srv.home, ALICE)[-1][3] == described


def test_a_join_stays_ignored(srv: ChannelServer, tg: RawTelegram) -> None:
    join = -100902
    tg.raw_message(join, "supergroup", tg.user(ALICE, "Alice", "alice"), new_chat_members=[tg.user(801, "Zed")])
    tg.inject(join, f"@{tg.username} after the join", kind="supergroup", sender=tg.user(ALICE, "Alice", "alice"))
    tg.wait_for_text(join, lambda t: "after the join" in t, timeout=20)
    assert [r[3] for r in _ledger(srv.home, join)] == [f"@{tg.username} after the join"]


def test_a_revoked_starter_answering_a_prompt_in_a_dm_is_told_so_not_given_a_code(
    srv: ChannelServer, tg: RawTelegram
) -> None:
    bob = tg.user(BOB, "Bob", "bob")
    tg.inject(BOB, "hi", sender=bob)
    first = tg.wait_for_text(BOB, lambda t: bool(CODE.search(t)), timeout=20)
    code = CODE.search(first.text)
    assert code is not None
    approved = run_cli(srv.home, "pairing", "approve", code.group(0).replace("-", ""))
    assert approved.code == 0, approved.err
    tg.wait_for_text(BOB, "echo: hi", timeout=20)
    tg.inject(BOB, "/call clock {}", sender=bob)
    prompt = tg.wait_for_text(BOB, lambda t: t.startswith("🔐"), timeout=20)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    revoked = run_cli(srv.home, "pairing", "revoke", str(BOB))
    assert revoked.code == 0, revoked.err
    before = len(tg.messages(BOB))

    tg.press(BOB, prompt.message_id, f"approve:{short.group(1)}", sender=bob)
    tg.wait_for_text(BOB, NOT_LET_IN_ANSWER, timeout=20)
    tg.inject(BOB, f"/approve {short.group(1)}", sender=bob)  # within the minute: no second refusal
    deadline = time.time() + 20
    while len(_ledger(srv.home, BOB)) < 4 and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)
    after = _texts(tg, BOB)[before:]
    assert after.count(NOT_LET_IN_ANSWER) == 1, after
    assert not [t for t in after if CODE.search(t)], after  # no new pairing code for an answer
    assert "✅" not in tg.message(BOB, prompt.message_id).text  # the call stays pending

    tg.inject(BOB, "me again", sender=bob)  # a new plain message: a new code, as documented
    again = tg.wait_for_text(BOB, lambda t: bool(CODE.search(t)) and t != first.text, timeout=20)
    assert CODE.search(again.text)


def test_a_revoked_starters_bare_deny_in_a_dm_is_told_so(srv: ChannelServer, tg: RawTelegram) -> None:
    """Re-attack: a bare `/deny` (or `/approve`), which answers the prompt waiting there, got the
    pairing path, not the refusal `/approve ID` gets."""
    carol_id = 703
    carol = tg.user(carol_id, "Carol", "carol")
    tg.inject(carol_id, "hi", sender=carol)
    first = tg.wait_for_text(carol_id, lambda t: bool(CODE.search(t)), timeout=20)
    code = CODE.search(first.text)
    assert code is not None
    assert run_cli(srv.home, "pairing", "approve", code.group(0).replace("-", "")).code == 0
    tg.wait_for_text(carol_id, "echo: hi", timeout=20)
    tg.inject(carol_id, "/call clock {}", sender=carol)
    prompt = tg.wait_for_text(carol_id, lambda t: t.startswith("🔐"), timeout=20)
    assert run_cli(srv.home, "pairing", "revoke", str(carol_id)).code == 0
    tg.inject(carol_id, "/deny", sender=carol)
    tg.wait_for_text(carol_id, NOT_LET_IN_ANSWER, timeout=20)
    assert "❌" not in tg.message(carol_id, prompt.message_id).text  # the call stays pending
