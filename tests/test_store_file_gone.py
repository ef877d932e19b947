"""The store file deleted or replaced under a running server, or missing at a start while its
position record says it held messages: nothing more is acknowledged (was: turns answered 200 into a
file no later start opens), and the next start refuses instead of making a new, empty store (was:
a warning, and every conversation gone). Real `appserver serve` processes and SQLite files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import chat, one_error_line, serve_refused, store_behind_symlink


def _ask(url: str, text: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
        timeout=15,
    )


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_store_file_gone_under_the_server_takes_no_more_turns(home: Path, tmp_path: Path, how: str) -> None:
    sp = start_serve(home)
    try:
        for i in range(5):
            chat(sp, f"kept {i}")
        db = home / "appserver.db"
        if how == "deleted":
            db.unlink()
        else:
            shutil.copyfile(db, tmp_path / "copy.db")
            (tmp_path / "copy.db").replace(db)  # another file under the same name
        r = _ask(sp.url, "after")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "store_unavailable" and "was deleted or replaced" in r.text
        assert _ask(sp.url, "again").status_code == 503  # every write, not only the first
        ready = httpx.get(sp.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "deleted or replaced" in ready.text
    finally:
        sp.stop()
    assert sp.proc.stderr is not None
    assert "Traceback" not in sp.proc.stderr.read()
    if how == "deleted":
        line = one_error_line(serve_refused(home))
        assert "appserver.db is missing but its write-ahead log" in line, line
        for leftover in ("appserver.db-wal", "appserver.db-shm"):  # moved away, as that refusal says
            (home / leftover).unlink(missing_ok=True)
        line = one_error_line(serve_refused(home))
        assert "appserver.db is missing, but appserver.db.position records that it held messages" in line, line
        assert not (home / "appserver.db").exists()  # no new, empty store made in its place


def test_a_store_that_is_a_dangling_symlink_is_refused(home: Path, tmp_path: Path) -> None:
    assert run_cli(home, "agents", "list").code == 0
    (home / "appserver.db").unlink()
    (home / "appserver.db.position").unlink(missing_ok=True)
    (home / "appserver.db").symlink_to(tmp_path / "unmounted" / "appserver.db")
    line = one_error_line(serve_refused(home))
    assert "is a symbolic link to" in line and "does not exist" in line, line
    assert not (tmp_path / "unmounted").exists()  # nothing written through the link


@pytest.mark.parametrize("linked", [False, True], ids=["file", "symlink"])
def test_a_second_serve_is_refused_while_the_first_keeps_the_store_open(
    home: Path, tmp_path: Path, linked: bool
) -> None:
    """serve.lock and server.json deleted by hand (a "stale lock" clean-up) let a second `serve`
    start beside the live one (was: both ran); the store's own lock names the first, also when
    `appserver.db` is a symbolic link (its -shm lies beside the target)."""
    if linked:
        assert run_cli(home, "agents", "list").code == 0
        store_behind_symlink(home, tmp_path / "data")
    env = cli_env(home, PYTHONFAULTHANDLER="1")  # a new interpreter, `python -m appserver serve`, not a fork
    sp = start_serve(home, env=env)
    try:
        chat(sp, "first")
        (home / "serve.lock").unlink()
        (home / "server.json").unlink()
        line = one_error_line(serve_refused(home))
        assert "is open in another `appserver serve`" in line and f"pid {sp.proc.pid}" in line, line
        chat(sp, "the first goes on")
    finally:
        sp.stop()


def test_a_position_record_that_is_a_fifo_is_refused_without_hanging(home: Path) -> None:
    assert run_cli(home, "agents", "list").code == 0
    position = home / "appserver.db.position"
    position.unlink(missing_ok=True)
    os.mkfifo(position)
    line = one_error_line(serve_refused(home))  # was: serve waited for a writer for ever
    assert "appserver.db.position" in line and "FIFO" in line, line
    assert position.is_fifo()  # left where it is


def test_a_store_locked_by_another_writer_is_explained() -> None:
    """SQLite's "database is locked" (another process holds a write transaction past the busy
    timeout) says what to do, rather than a bare "store error"."""
    import sqlite3

    from appserver.cli.common import explain

    line = explain(sqlite3.OperationalError("database is locked"))
    assert line is not None and "locked by another process" in line and "try again" in line


def test_a_schema_version_older_than_its_tables_is_named_not_upgraded(home: Path) -> None:
    """schema_version rows lost or edited: the upgrade met its own changes already made ("duplicate
    column name") and said only that; now it says the store's version record is damaged."""
    import sqlite3

    assert run_cli(home, "agents", "list").code == 0
    with sqlite3.connect(home / "appserver.db") as db:
        newest = db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
        db.execute("DELETE FROM schema_version WHERE version > ?", (newest - 3,))
    line = one_error_line(serve_refused(home))
    assert "schema_version table was changed or damaged" in line and "restore the store" in line, line
