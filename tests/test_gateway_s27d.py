"""Restarts neither let a revoked sender's queued turn through nor take back text a chat showed
(docs/channels.md, "Who may use the bot" and "Delivery").

* A paired sender's message queued behind their running turn was answered after `pairing revoke`
  when the server was stopped around the revoke: the restarted server started the queued turn at
  once, before its gateway was back, and the gateway asked access again only for a turn it had seen
  waiting. It now asks again about every turn it picks back up of whose reply the chat shows
  nothing yet: the queued turn is cancelled (or, ended already, not delivered), its row `failed`.
* After a kill -9 of the server mid-reply, the "interrupted" reply was edited down to the server's
  last draft, which lags the stream: words the chat had shown went away. The text the chat showed
  is kept, the saved text only taken where it goes further.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback
fake Bot API (tests/fakes/telegram_api.py), the CLI, gateway.db and the store read with sqlite3."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from gateway.replies import final_text, unproven
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, gateway_children, store_turns, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

# the restarted server ran the queued turn before its gateway was back: the row says it had started
NO_LONGER_LET_IN = "the sender's access was taken away; the turn had started when the gateway saw it"
INTERRUPTED = "⚠ The reply was interrupted (the server stopped while it was being written)."


def _home(tmp_path: Path, tg: FakeTelegram, **extra: Any) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant", **extra}
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


def _row(home: Path, message_id: str) -> tuple[str, str | None] | None:
    """(state, reason) of the ledger row of Telegram message `message_id` (keyed `chat:message`)."""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, reason FROM ledger WHERE message_id LIKE ?", (f"%:{message_id}",)).fetchone()
    finally:
        conn.close()
    return (str(row[0]), row[1]) if row else None


def _draft(home: Path) -> str:
    """The running turn's last checkpoint in the server's store (what a kill -9 keeps of it)."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT draft FROM turns WHERE draft IS NOT NULL").fetchone()
    finally:
        conn.close()
    return str(json.loads(row[0]).get("text") or "") if row else ""


def test_a_queued_message_of_a_sender_revoked_while_the_server_was_stopped_is_never_answered(tmp_path: Path) -> None:
    user = 7100
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg, dm_policy="pairing")
        env = cli_env(home, TG_TOKEN=tg.token)
        with channel_server(home, "--channels", "telegram", env=env):
            tg.dm("hello", user_id=user)
            code = re.search(r"approve (\w{8})", tg.wait_for_text(user, lambda t: "approve" in t, 30).text)
            assert code and run_cli(home, "pairing", "approve", code.group(1), env=env).code == 0
            tg.wait_for_text(user, "echo: hello", 30)
            tg.dm("/slow 150", user_id=user)
            tg.wait_for_text(user, lambda t: t.startswith("w1 "), 30)
            queued = tg.dm("queued please", user_id=user).message_id
            assert queued is not None
            wait_for(lambda: tg.reactions(user, queued), 15, "the 👀 of a message waiting in the queue")
            assert _row(home, str(queued)) == ("submitted", "dm: approved sender")
        # stopped (SIGTERM): the revoke is made while no gateway runs to see it
        assert run_cli(home, "pairing", "revoke", str(user), env=env).code == 0
        with channel_server(home, "--channels", "telegram", env=env):
            # the restarted server starts the queued turn before its gateway is back to ask
            settled = wait_for(
                lambda: (r := _row(home, str(queued))) and r[0] in ("failed", "delivered") and r,
                30,
                "the queued message to settle",
            )
            assert settled == ("failed", NO_LONGER_LET_IN)
            assert store_turns(home, "queued please") == 1  # it did start: the agent read it
            slow = tg.wait_for_text(user, lambda t: t.endswith(INTERRUPTED), 30)  # it was shown: it goes on
            assert slow.text.startswith("w1 w2 ")
            texts = [m.text for m in tg.messages(user)]
            assert not any("queued please" in t for t in texts), texts


def test_a_reply_cut_by_a_server_kill_keeps_every_word_the_chat_showed(tmp_path: Path) -> None:
    user = 7200
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg, dm_policy="open")
        # a draft every 2 s: the chat (edited about once a second) shows more than the last one most of the time
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_LIMITS__DRAFT_INTERVAL_S="2")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            child = srv.gateway_pid()
            tg.dm("/slow 150", user_id=user)

            def ahead_of_the_draft() -> str | None:
                shown = [m.text for m in tg.messages(user)]
                draft = _draft(home)
                ahead = shown and draft and shown[-1].startswith(draft) and len(shown[-1]) > len(draft)
                return shown[-1] if ahead else None

            def frozen_ahead() -> str | None:
                """Stop the server (no draft after this one) where the chat shows more than its draft."""
                if ahead_of_the_draft() is None:
                    return None
                os.kill(srv.proc.pid, signal.SIGSTOP)
                shown = ahead_of_the_draft()
                if shown is None:
                    os.kill(srv.proc.pid, signal.SIGCONT)
                return shown

            shown = wait_for(frozen_ahead, 30, "the chat to show more than the server's last draft")
            srv.kill()
            wait_for(lambda: child not in gateway_children(srv.proc.pid), 15, "the gateway child to exit")
            draft = _draft(home)
            assert draft and shown.startswith(draft) and len(draft) < len(shown), (draft, shown)
        with channel_server(home, "--channels", "telegram", env=env):
            final = tg.wait_for_text(user, lambda t: t.endswith(INTERRUPTED), 30)
            body = final.text[: -len(INTERRUPTED)].rstrip()
            assert body.startswith(shown), (body, shown)  # not cut back to the draft
            assert len(tg.messages(user)) == 1


def test_the_final_text_of_a_cut_reply_keeps_what_the_chat_read() -> None:
    def cut(text: str, status: str = "cancelled") -> dict[str, Any]:
        error = {"kind": "interrupted"}
        return {"status": status, "error": error, "blocks": [{"type": "text", "text": text}] if text else []}

    assert final_text(cut("w1 w2"), "w1 w2 w3") == f"w1 w2 w3\n\n{INTERRUPTED}"  # the draft lagged
    assert final_text(cut("w1 w2 w3 w4"), "w1 w2") == f"w1 w2 w3 w4\n\n{INTERRUPTED}"  # it went further
    assert final_text(cut("**w1** w2 w3"), "w1 w2") == f"w1 w2\n\n{INTERRUPTED}"  # otherwise: what was read
    assert final_text(cut(""), "w1") == f"w1\n\n{INTERRUPTED}"
    done = {"status": "completed", "blocks": [{"type": "text", "text": "the answer"}]}
    assert final_text(done, "the ans wer draft") == "the answer"  # a completed turn's text is the reply


def test_a_resumed_turn_is_asked_again_until_its_reply_was_shown(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "gateway.db")
    try:
        keys = [UpdateKey("telegram", "main", f"1:{i}") for i in range(4)]
        for key in keys:
            ledger.record(key, chat="1", sender="7")
            ledger.decide(key, "allow", "dm: approved sender")
            ledger.mark_submitted(key, f"turn_{key.message_id}", "conv")
        ledger.note_sending(keys[1], "k:0", 1.0)  # its first part was being sent
        ledger.note_sent(keys[2], ["55"], "w1")
        ledger.mark_finished(keys[3], "done")
        assert [unproven(e) for e in (ledger.get(k) for k in keys) if e is not None] == [True, False, False, False]
    finally:
        ledger.close()
