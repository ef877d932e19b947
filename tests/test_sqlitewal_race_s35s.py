"""A crash-time index read a moment before another process opened and closed the database (its
last close copies the log into the database and removes -wal and -shm) no longer reads as a log
that went missing with committed frames (re-attack s35 s S1): the gateway moved a sound ledger
aside, and appserver.db refused to start. A verdict of loss stands only while the files stayed as
they were (`files_state`); else the check is made again. The other process is real (a `sqlite3`
connection in a child interpreter); the test only times it to the moment the index was read."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import appserver.store.integrity as integrity
import gateway.db as gateway_db
from appserver.sqlitewal import files_state, read_wal_index
from appserver.store.integrity import check_wal_index
from gateway.ledger import Ledger, UpdateKey

OPEN_AND_CLOSE = (
    "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
    "c.execute('SELECT count(*) FROM sqlite_master').fetchone(); c.close()"
)


def _other_process_opens_and_closes(db: Path) -> None:
    subprocess.run([sys.executable, "-c", OPEN_AND_CLOSE, str(db)], check=True, timeout=30)


def _crashed_ledger(tmp_path: Path) -> Path:
    """gateway.db as kill -9 leaves it: committed rows only in the -wal, the -shm counting them."""
    src = tmp_path / "running" / "gateway.db"
    ledger = Ledger.open(src, gateway=True)
    crash = tmp_path / "crashed" / "gateway.db"
    crash.parent.mkdir(parents=True)
    try:
        for n in range(8):
            ledger.record(UpdateKey("telegram", "main", str(n)), chat="c", sender="s", payload={"text": "x" * 300})
        for suffix in ("", "-wal", "-shm"):
            shutil.copyfile(f"{src}{suffix}", f"{crash}{suffix}")
    finally:
        ledger.close()
    return crash


def _crashed_store(tmp_path: Path) -> Path:
    src = tmp_path / "running" / "appserver.db"
    src.parent.mkdir(parents=True)
    conn = sqlite3.connect(src, isolation_level=None)
    crash = tmp_path / "crashed" / "appserver.db"
    crash.parent.mkdir(parents=True)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE t(x)")
        for _ in range(8):
            conn.execute("INSERT INTO t VALUES (?)", ("x" * 300,))
        for suffix in ("", "-wal", "-shm"):
            shutil.copyfile(f"{src}{suffix}", f"{crash}{suffix}")
    finally:
        conn.close()
    return crash


def _index_read_then_other_process(module: object, monkeypatch: pytest.MonkeyPatch, db: Path) -> list[int]:
    """The real `read_wal_index` of `module`, after which, the first time, another process opens
    and closes `db` (the interleaving a paused checker meets)."""
    raced: list[int] = []

    def read_then_race(path: Path):  # type: ignore[no-untyped-def]
        index = read_wal_index(path)
        if not raced:
            raced.append(1)
            _other_process_opens_and_closes(db)
        return index

    monkeypatch.setattr(module, "read_wal_index", read_then_race)
    return raced


def test_files_state_sees_another_process_open_and_close_a_crashed_database(tmp_path: Path) -> None:
    db = _crashed_ledger(tmp_path)
    before = files_state(db)
    assert before == files_state(db)
    _other_process_opens_and_closes(db)
    assert files_state(db) != before and not db.with_name("gateway.db-wal").exists()


def test_a_ledger_copied_and_closed_by_another_process_during_the_check_is_not_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = _crashed_ledger(tmp_path)
    raced = _index_read_then_other_process(gateway_db, monkeypatch, db)
    conn = gateway_db.open_db(db, gateway=True)
    try:
        rows = conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
    finally:
        conn.close()
    assert raced and rows == 8  # the check met the race, and the ledger kept every row
    assert not list(db.parent.glob("*.corrupt-*"))


def test_a_store_copied_and_closed_by_another_process_during_the_check_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = _crashed_store(tmp_path)
    raced = _index_read_then_other_process(integrity, monkeypatch, db)
    check_wal_index(db, accept_loss=False)  # raised StoreOpenError: "the write-ahead log … is missing"
    assert raced
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 8
    finally:
        conn.close()
