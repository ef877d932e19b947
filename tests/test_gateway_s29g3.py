"""A gateway.db replaced (a backup renamed over it) under a running gateway that has not written
since: a command refuses the new file instead of opening it with the old file's `-wal`/`-shm`
(docs/channels.md, "A corrupt gateway.db").

A command opened the new file with the old file's -wal beside it: SQLite replayed (and
checkpointed) it into the restored backup, so a route added after the backup was made showed up
in it, for good, with integrity_check ok: a silent mix of two ledgers. Now the gateway records the
identity of the file it opened in `channels/gateway.lock`, and a command opening another file at
the path while that gateway runs refuses before SQLite touches anything.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py), the CLI in child processes; SIGSTOP stands in for a gateway
waiting on a long SQLite lock (or simply not writing yet)."""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest

from gateway.db import default_path
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


def _home(tmp_path: Path, tg: FakeTelegram) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": "open"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


def _routes(db: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT key, agent FROM routes ORDER BY key").fetchall()
    finally:
        conn.close()


def _backup(db: Path, to: Path) -> None:
    live, copy = sqlite3.connect(db), sqlite3.connect(to)
    try:
        live.backup(copy)
    finally:
        copy.close()
        live.close()


def test_a_command_refuses_a_ledger_replaced_under_a_paused_gateway(tmp_path: Path) -> None:
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            db = default_path(home)
            assert run_cli(home, "channels", "route", "add", "telegram:main:101", "assistant", env=env).code == 0
            backup, kept = tmp_path / "backup.db", tmp_path / "kept.db"
            _backup(db, backup)
            _backup(backup, kept)  # what the backup holds, to compare with after the restart
            added = run_cli(home, "channels", "route", "add", "telegram:main:202", "assistant", env=env)
            assert added.code == 0, added.err  # in the old file's -wal, not in the backup
            expected = _routes(kept)
            assert [k for k, _ in expected] == ["telegram:main:101:__root__"], expected

            gateway = srv.gateway_pid()
            os.kill(gateway, signal.SIGSTOP)
            try:
                os.replace(backup, db)  # the operator restores the backup (the main file only)
                route_add = ("channels", "route", "add", "telegram:main:303", "assistant")
                for args in (("pairing", "list"), ("channels", "route", "list"), route_add):
                    r = run_cli(home, *args, env=env)
                    assert r.code != 0, (args, r.out)
                    lines = r.err.strip().splitlines()
                    assert len(lines) == 1, r.err
                    assert "replaced" in lines[0] and f"pid {gateway}" in lines[0], lines[0]
                    assert "telegram:main:202" not in r.out
                assert _routes(kept) == expected
            finally:
                os.kill(gateway, signal.SIGCONT)

            tg.dm("wake up", user_id=7401)  # the gateway's next write notices the new file
            wait_for(lambda: "exited with code 4" in srv.log(), 30, "the gateway to notice and exit")
            srv.wait_channels_ready()
            assert srv.gateway_pid() != gateway
            assert _routes(db) == expected  # exactly the backup's routes, never the old file's WAL
            listed = run_cli(home, "channels", "route", "list", env=env)
            assert listed.code == 0, listed.err
            assert "telegram:main:101" in listed.out and "telegram:main:202" not in listed.out
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            finally:
                conn.close()
