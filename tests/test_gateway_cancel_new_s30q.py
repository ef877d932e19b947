"""`/cancel` keeps a waiting message from the agent; `/new` is not held behind a paused turn (session 30).

`/cancel` flushed the sender's debounce buffer before acting (the secret they meant to take back was
submitted and answered), and it stopped only the running turn, so a message queued behind it ran
next: either way a secret pasted by mistake reached the agent and the store. Now `/cancel` drops the
sender's buffered messages (never submitted) and withdraws their turns still queued on the server,
and says so. After `/new`, replies of the new conversation waited behind the previous one's turn
paused for an approval (up to ten minutes); the chat order is now per conversation, and `/new` and
`/status` say the old turn waits for an approval and who can cancel it.
Real `appserver serve` with the fakechat channel; the store and gateway.db read from disk.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import channel_server, fakechat_home
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


def _row(home: Path, message_id: str) -> tuple[str | None, str | None]:
    """(state, reason) of an inbound message's ledger row."""
    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return (entry.state, entry.reason) if entry is not None else (None, None)
    finally:
        ledger.close()


def _in_history(home: Path, word: str) -> int:
    """How many stored conversation messages (what the agent is given) contain `word`."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return sum(word in content for (content,) in conn.execute("SELECT content FROM messages"))
    finally:
        conn.close()


def _anywhere_in_store(home: Path, word: str) -> bool:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return any(word in line for line in conn.iterdump())
    finally:
        conn.close()


def test_cancel_drops_a_message_held_by_debounce(tmp_path: Path, chat: FakeChat) -> None:
    home = fakechat_home(tmp_path / "home", chat, debounce_ms=3000)
    with channel_server(home) as srv:
        secret = chat.inject("deb", "my password is SECRET-deb-1")
        chat.inject("deb", "/cancel")
        answer = chat.wait_for_text("deb", lambda t: "waiting message" in t or "echo:" in t, timeout=15).text
        assert answer == "Dropped 1 waiting message before its turn started: the agent never gets it.", answer
        # a later message is buffered and answered after the dropped one's quiet time has passed
        chat.inject("deb", "after the cancel")
        chat.wait_for_text("deb", lambda t: t.startswith("echo: after the cancel"), timeout=20)
        assert not any("SECRET" in m.text for m in chat.messages("deb"))
        assert _row(srv.home, secret) == ("failed", "dropped by the sender's /cancel before it was submitted")
        assert not _anywhere_in_store(srv.home, "SECRET-deb-1")  # never submitted at all


def test_cancel_withdraws_the_senders_queued_turn_and_leaves_others(tmp_path: Path, chat: FakeChat) -> None:
    home = fakechat_home(tmp_path / "home", chat, group_policy="open")
    with channel_server(home) as srv:
        chat.inject("queue", "/slow 2000", sender="alice", chat_type="group")
        chat.wait_for(lambda: chat.messages("queue") or None, timeout=15, what="Alice's reply to start")
        bobs = chat.inject("queue", "bob asks", sender="bob", chat_type="group")
        secret = chat.inject("queue", "my password is SECRET-q-2", sender="alice", chat_type="group")
        wait_for(lambda: _row(srv.home, secret)[0] == "submitted", 15, "the secret to be queued on the server")
        assert _row(srv.home, bobs)[0] == "submitted"
        chat.inject("queue", "/cancel", sender="alice", chat_type="group")
        answer = chat.wait_for_text("queue", lambda t: t.startswith("⏹ Cancelled") and "w2" not in t, timeout=15)
        assert "Dropped 1 waiting message" in answer.text, answer.text
        chat.wait_for_text("queue", "echo: bob asks", timeout=15)  # not Alice's to drop: it runs
        wait_for(lambda: _row(srv.home, secret)[0] == "failed", 15, "the withdrawn row to settle")
        assert _row(srv.home, secret) == ("failed", "withdrawn by /cancel before its turn started")
        chat.inject("queue", "later", sender="alice", chat_type="group")
        chat.wait_for_text("queue", "echo: later", timeout=15)
        assert not any("SECRET" in m.text for m in chat.messages("queue"))
        assert _in_history(srv.home, "SECRET-q-2") == 0  # the agent never got it
        assert _in_history(srv.home, "bob asks") >= 1


def test_new_is_answered_while_the_old_conversation_waits_for_an_approval(tmp_path: Path, chat: FakeChat) -> None:
    home = fakechat_home(tmp_path / "home", chat, group_policy="open")
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask").code == 0
    assert run_cli(home, "channels", "route", "add", "fakechat:main:appr", "careful").code == 0
    with channel_server(home):
        chat.inject("appr", "/call clock {}", sender="alice", chat_type="group")
        prompt = chat.wait_for_text("appr", lambda t: t.startswith("🔐"), timeout=15).text
        found = re.search(r"/approve (\w+)", prompt)
        assert found, prompt
        request = found.group(1)

        chat.inject("appr", "/new", sender="bob", chat_type="group")
        new = chat.wait_for_text("appr", lambda t: t.startswith("🆕"), timeout=15).text
        chat.inject("appr", "what is 2+2", sender="bob", chat_type="group")
        chat.wait_for_text("appr", "echo: what is 2+2", timeout=15)  # the old approval still waits
        assert f"waits for an approval (request `{request}`)" in new, new
        assert "/cancel stops it" not in new and "only the person who started it, or an admin" in new, new

        chat.inject("appr", "/status", sender="bob", chat_type="group")
        bobs = chat.wait_for_text("appr", lambda t: t.startswith("Agent: careful"), timeout=15).text
        assert "A reply from before /new waits for an approval" in bobs and f"`{request}`" in bobs, bobs
        assert "(only the person who started it, or an admin, can cancel it)" in bobs, bobs
        chat.inject("appr", "/status", sender="alice", chat_type="group")
        alices = chat.wait_for(
            lambda: [m.text for m in chat.messages("appr") if m.text.startswith("Agent: careful")][1:] or None,
            timeout=15,
            what="Alice's status",
        )[0]
        assert "(/cancel stops it)" in alices, alices
