"""A gateway.db deleted or replaced under a running gateway: the restarted gateway's ledger is
exactly the file now at the path (docs/channels.md, "A corrupt gateway.db").

The gateway exited (code 4) on noticing, but left the old file's `-wal`/`-shm` at the path, and
SQLite replayed that WAL onto the new file: a restored backup did not take effect (a sender it
never approved stayed approved), and a deleted ledger came back with its old rows while the log
said "starting a new, empty ledger". Now the gateway sets its own -wal/-shm aside before exiting,
and any opener that finds a missing gateway.db with a -wal beside it sets that aside, loudly.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py), the CLI and a writer in child processes."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.db import default_path, open_db
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def _home(tmp_path: Path, tg: FakeTelegram, policy: str) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": policy}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _pairing_codes(tg: FakeTelegram, chat: int) -> list[str]:
    return [m.group(1) for msg in tg.messages(chat) if (m := re.search(r"approve (\w{8})", msg.text))]


def _orphans(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir() if ".orphaned-" in p.name)


def test_a_restored_backup_takes_effect_not_the_old_files_wal(tmp_path: Path) -> None:
    sender = 7291
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg, "pairing")
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            db = default_path(home)
            backup = tmp_path / "backup.db"
            live, copy = sqlite3.connect(db), sqlite3.connect(backup)
            live.backup(copy)  # before the sender is approved
            copy.close()
            live.close()

            tg.dm("let me in", user_id=sender)
            code = re.search(r"approve (\w{8})", tg.wait_for_text(sender, lambda t: "approve" in t, 30).text)
            assert code
            assert run_cli(home, "pairing", "approve", code.group(1), env=env).code == 0
            tg.wait_for_text(sender, "echo: let me in", 30)
            first = srv.gateway_pid()

            os.replace(backup, db)  # the operator restores the backup (the main file only)
            tg.dm("still in?", user_id=sender)
            wait_for(lambda: "exited with code 4" in srv.log(), 30, "the gateway to notice and exit")
            srv.wait_channels_ready()
            assert srv.gateway_pid() != first

            # the restored file is the ledger: the sender it never approved is asked to pair again
            wait_for(lambda: len(_pairing_codes(tg, sender)) == 2, 30, "a second pairing code")
            assert not any(m.text == "echo: still in?" for m in tg.messages(sender))
            assert _rows(db, "SELECT sender FROM approved_senders") == []
            assert len(_rows(db, f"SELECT id FROM ledger WHERE sender = '{sender}'")) <= 1  # "still in?" only
            assert any(name.startswith("gateway.db-wal.orphaned-") for name in _orphans(db)), _orphans(db)
            assert "gateway.db-wal belonged to the file that is gone: moved aside" in srv.log()


def test_a_ledger_deleted_alone_restarts_empty_without_its_old_rows(tmp_path: Path) -> None:
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg, "open")
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            db = default_path(home)
            for i in range(3):
                tg.dm(f"before{i}", user_id=7300 + i)
                tg.wait_for_text(7300 + i, f"echo: before{i}", 30)
            first = srv.gateway_pid()

            db.unlink()  # `rm gateway.db`: its -wal and -shm stay
            tg.dm("after", user_id=7310)
            wait_for(lambda: "exited with code 4" in srv.log(), 30, "the gateway to notice and exit")
            srv.wait_channels_ready()
            assert srv.gateway_pid() != first
            tg.wait_for_text(7310, "echo: after", 30)

            senders = [s for (s,) in _rows(db, "SELECT sender FROM ledger")]
            assert senders == ["7310"], senders
            assert any(name.startswith("gateway.db-wal.orphaned-") for name in _orphans(db)), _orphans(db)


_WRITER = """
import os, sys
from pathlib import Path
from gateway.db import open_db, transaction
conn = open_db(Path(sys.argv[1]))
with transaction(conn):
    conn.execute("INSERT INTO routes (key, agent, created_at) VALUES ('old-route', 'assistant', 0)")
os._exit(0)  # killed, in effect: the -wal is left beside the file, holding the write
"""


def test_a_wal_left_beside_a_missing_ledger_is_set_aside_not_replayed(tmp_path: Path) -> None:
    db = tmp_path / "channels" / "gateway.db"
    subprocess.run([sys.executable, "-c", _WRITER, str(db)], cwd=ROOT, check=True, timeout=60)
    wal = db.with_name("gateway.db-wal")
    assert wal.stat().st_size > 0
    db.unlink()

    conn = open_db(db)
    try:
        assert conn.execute("SELECT key FROM routes").fetchall() == []
    finally:
        conn.close()
    assert any(name.startswith("gateway.db-wal.orphaned-") for name in _orphans(db)), _orphans(db)
