"""A revoke made while the gateway's submit is on its way is never answered (docs/channels.md, "Who
may use the bot").

Access was asked once, before the submit's retry loop: a `pairing revoke` made while the gateway
retried (the server's store locked by another process) or while the submit waited on a stalled
server (SIGSTOP) was never asked about again, since a turn acked with `queue_position` 0 was taken
as let in; the revoked sender's message ran and was answered. Access is now asked again before each
resubmit (refused: nothing is submitted) and as the submit is acked (refused: the turn is cancelled
before anything reaches the chat); either way the row ends `failed` with the reason.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback
fake Bot API (tests/fakes/telegram_api.py), the CLI, appserver.db locked by a real second SQLite
connection, gateway.db read with sqlite3."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from gateway.db import default_path
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

NO_LONGER_LET_IN = "the sender's access was taken away before the turn started"


def _home(tmp_path: Path, tg: FakeTelegram) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": "pairing"}  # fmt: skip
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


def _pair(home: Path, tg: FakeTelegram, user: int, env: dict[str, str]) -> None:
    tg.dm("hello", user_id=user)
    code = re.search(r"approve (\w{8})", tg.wait_for_text(user, lambda t: "approve" in t, 30).text)
    assert code and run_cli(home, "pairing", "approve", code.group(1), env=env).code == 0
    tg.wait_for_text(user, "echo: hello", 30)


def _settled(home: Path, message_id: str, timeout: float) -> tuple[str, str | None]:
    found = wait_for(
        lambda: (r := _row(home, message_id)) and r[0] in ("failed", "delivered") and r,
        timeout,
        f"message {message_id} to settle",
    )
    return tuple(found)  # type: ignore[return-value]


def test_a_revoke_while_the_submit_is_retried_against_a_locked_store_is_never_answered(tmp_path: Path) -> None:
    user = 7150
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token)
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            _pair(home, tg, user, env)
            lock = sqlite3.connect(str(home / "appserver.db"), timeout=1, isolation_level=None)
            try:
                lock.execute("BEGIN EXCLUSIVE")  # another process holds the store: submits are refused, retried
                secret = tg.dm("secret question", user_id=user).message_id
                assert secret is not None
                wait_for(lambda: "submit failed" in srv.log(), 20, "the gateway to retry the submit")
                assert _row(home, str(secret)) == ("allowed", "dm: approved sender")
                assert run_cli(home, "pairing", "revoke", str(user), env=env).code == 0
                # asked again before the next resubmit: given up while the store is still locked
                assert _settled(home, str(secret), 15) == ("failed", NO_LONGER_LET_IN)
            finally:
                if lock.in_transaction:
                    lock.execute("COMMIT")
                lock.close()
            time.sleep(3)  # a resubmit and its reply would be through by now
            assert _row(home, str(secret)) == ("failed", NO_LONGER_LET_IN)
            texts = [m.text for m in tg.messages(user)]
            assert not any("secret question" in t for t in texts), texts


def test_a_revoke_while_the_submit_waits_on_a_stopped_server_is_never_answered(tmp_path: Path) -> None:
    user = 7100
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token)
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            _pair(home, tg, user, env)
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                secret = tg.dm("secret question", user_id=user).message_id
                assert secret is not None
                # let in and submitted: the submit waits for the stopped server's ack
                let_in = ("allowed", "dm: approved sender")
                wait_for(lambda: _row(home, str(secret)) == let_in, 15, "the message let in")
                time.sleep(1.5)
                assert run_cli(home, "pairing", "revoke", str(user), env=env).code == 0
                time.sleep(1.5)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            # the ack comes after the revoke: the turn is cancelled before anything reaches the chat
            assert _settled(home, str(secret), 30) == ("failed", NO_LONGER_LET_IN)
            time.sleep(2)
            texts = [m.text for m in tg.messages(user)]
            assert not any("secret question" in t for t in texts), texts
