"""A gateway.db that is a symbolic link (the ledger on another disk): the gateway and the commands
agree that the ledger is the file the link leads to now (docs/channels.md, "A corrupt gateway.db",
"The state database").

The gateway checked, at each write, the link's target as it was at open: a link re-pointed at a
backup went unnoticed (it wrote on in the old file while every command refused the new one, for
good). And a corrupt target was moved aside, leaving the link pointing at nothing, which every
later open refused as an unmounted disk: the gateway never started again. Now the check follows
the link each time, and a link whose target we moved aside as corrupt leads to where the new,
empty ledger is made; a link to nothing else is still refused.

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py), the CLI in child processes, SQLite files on disk."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from gateway.db import LedgerFileRefused, default_path, open_db
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)


def _home(tmp_path: Path, tg: FakeTelegram) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": "open"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


def _link_ledger(home: Path, target: Path) -> Path:
    link = default_path(home)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def _senders(db: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # applies the file's own -wal
    try:
        return [s for (s,) in conn.execute("SELECT sender FROM ledger ORDER BY id")]
    finally:
        conn.close()


def _repoint(link: Path, target: Path) -> None:
    tmp = link.with_name("gateway.db.repoint")
    tmp.symlink_to(target)
    os.replace(tmp, link)  # atomically: the link leads to the old file or the new one


def test_a_link_repointed_at_a_backup_restarts_the_gateway_on_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    old, backup = store / "a.db", store / "b.db"
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        open_db(old).close()
        link = _link_ledger(home, old)
        with channel_server(home, "--channels", "telegram", env=env) as srv:
            tg.dm("one", user_id=7501)
            tg.wait_for_text(7501, "echo: one", 30)
            first = srv.gateway_pid()

            live, copy = sqlite3.connect(old), sqlite3.connect(backup)
            live.backup(copy)
            copy.close()
            live.close()
            _repoint(link, backup)

            tg.dm("two", user_id=7502)  # the gateway's next write notices the link leads elsewhere
            wait_for(lambda: "exited with code 4" in srv.log(), 30, "the gateway to notice and exit")
            srv.wait_channels_ready(restarts=1)  # the restarted gateway's
            assert srv.gateway_pid() != first
            tg.wait_for_text(7502, "echo: two", 30)

            for args in (("channels", "route", "list"), ("pairing", "list")):
                r = run_cli(home, *args, env=env)
                assert r.code == 0, (args, r.err)
            assert os.readlink(link) == str(backup)
            assert _senders(backup) == ["7501", "7502"]  # the backup is the ledger now
            assert _senders(old) == ["7501"]  # the old file kept as it was, with its own -wal
            assert not [p.name for p in store.iterdir() if ".orphaned-" in p.name]
            assert "a symbolic link, now to" in srv.log()


def test_a_corrupt_target_moved_aside_by_a_command_gets_a_new_ledger_behind_the_link(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    target = store / "a.db"
    target.write_bytes(b"this is not a database at all" * 200)
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        link = _link_ledger(home, target)

        first = run_cli(home, "channels", "status", env=env)
        assert first.code == 1 and "moved aside" in first.err, first.err
        assert [p.name for p in store.iterdir() if p.name.startswith("a.db.corrupt-")], list(store.iterdir())
        again = run_cli(home, "channels", "status", env=env)
        assert again.code == 0, again.err  # no ledger yet, as for a gateway.db moved aside in place
        added = run_cli(home, "channels", "route", "add", "telegram:main:101", "assistant", env=env)
        assert added.code == 0, added.err
        assert link.is_symlink() and target.is_file()  # made where the link leads, the link kept

        with channel_server(home, "--channels", "telegram", env=env):
            tg.dm("hello", user_id=7503)
            tg.wait_for_text(7503, "echo: hello", 30)
        listed = run_cli(home, "channels", "route", "list", env=env)
        assert listed.code == 0 and "telegram:main:101" in listed.out, (listed.out, listed.err)
        assert _senders(target) == ["7503"]


@pytest.mark.parametrize("content", [b"", b"this is not a database at all" * 200], ids=["empty", "garbage"])
def test_a_corrupt_target_found_by_the_gateway_at_start_is_replaced_by_a_new_ledger(
    tmp_path: Path, content: bytes
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    target = store / "a.db"
    target.write_bytes(content)
    with FakeTelegram() as tg:
        home = _home(tmp_path, tg)
        env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
        link = _link_ledger(home, target)
        with channel_server(home, "--channels", "telegram", env=env):
            tg.dm("hello", user_id=7504)
            tg.wait_for_text(7504, "echo: hello", 30)
            moved = [p for p in store.iterdir() if p.name.startswith("a.db.corrupt-")]
            assert len(moved) == 1 and moved[0].read_bytes() == content
            assert link.is_symlink() and _senders(target) == ["7504"]
            listed = run_cli(home, "pairing", "list", env=env)
            assert listed.code == 0, listed.err


def test_a_link_to_nothing_is_still_refused_unless_we_moved_its_target_aside(tmp_path: Path) -> None:
    """An unmounted disk: the target's directory missing, or there but empty (a mount point), or
    holding only another file's moved-aside copy. Nothing is created where the link points."""
    link = tmp_path / "channels" / "gateway.db"
    link.parent.mkdir()
    mount = tmp_path / "mnt"
    mount.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.db.corrupt-20240101T000000Z").write_bytes(b"x")
    for target in (tmp_path / "gone" / "a.db", mount / "a.db", other / "a.db"):
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(LedgerFileRefused, match="does not exist"):
            open_db(link)
        assert not target.exists()
