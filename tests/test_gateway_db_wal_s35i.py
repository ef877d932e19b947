"""A damaged gateway.db-wal is moved aside with its ledger, loudly; never opened as if empty.

SQLite drops a write-ahead log whose header is damaged or cut short, and every frame after one
whose checksum fails, committed transactions included, without an error, then overwrites it. After
a kill -9 the ledger's latest commits (a message acknowledged to its platform, an approval prompt,
a conversation binding) are only in that log: the gateway started with them gone and no log line
(attack round 35, b F2). The crash is a copy of gateway.db, its -wal and -shm taken while the
writer still holds them (what kill -9 leaves), then damaged; `gateway/db.py` opens the copy.
"""

from __future__ import annotations

import logging
import shutil
import struct
from pathlib import Path

import pytest

from gateway.db import CorruptGatewayDB
from gateway.ledger import Ledger, UpdateKey
from tests.test_import_rules import all_modules

ROWS = 12
SIDES = ("-wal", "-shm")


def key(n: int) -> UpdateKey:
    return UpdateKey("telegram", "main", str(n))


def _record(ledger: Ledger, numbers: range) -> None:
    for n in numbers:  # one commit each, as messages arrive
        ledger.record(key(n), chat="c", sender="s", payload={"text": f"message {n} " + "x" * 300})


def _crash_copy(tmp_path: Path, *, restart_first: bool = False) -> Path:
    """gateway.db as kill -9 leaves it: the rows committed but only in the -wal (copied, with the
    -shm, while the writer has them open). `restart_first`: the log was checkpointed and restarted
    before the last commit, so frames of the older generation follow the live ones."""
    src = tmp_path / "running" / "channels" / "gateway.db"
    ledger = Ledger.open(src, gateway=True)
    try:
        if restart_first:
            _record(ledger, range(ROWS))
            ledger.connection.execute("PRAGMA wal_checkpoint(RESTART)")
            _record(ledger, range(ROWS, ROWS + 1))
        else:
            _record(ledger, range(ROWS))
        crash = tmp_path / "crashed" / "channels" / "gateway.db"
        crash.parent.mkdir(parents=True)
        for suffix in ("", *SIDES):
            shutil.copyfile(f"{src}{suffix}", f"{crash}{suffix}")
    finally:
        ledger.close()
    assert _frames(crash, live=True) >= (1 if restart_first else ROWS), "the commits should be in the -wal"
    return crash


def _wal(db: Path) -> Path:
    return db.with_name(db.name + "-wal")


def _frames(db: Path, *, live: bool) -> int:
    """Frames in the WAL whose salt is (live) or is not (older generation) the header's."""
    data = _wal(db).read_bytes()
    page_size = struct.unpack(">I", data[8:12])[0]
    size = 24 + page_size
    salts = [data[32 + i * size + 8 : 32 + i * size + 16] for i in range((len(data) - 32) // size)]
    return sum((s == data[16:24]) == live for s in salts)


def _damage(db: Path, how: str) -> bytes:
    wal = _wal(db)
    data = bytearray(wal.read_bytes())
    if how == "header-garbage":
        data[0:32] = bytes(range(0xA0, 0xC0))
    elif how == "whole-file-garbage":
        data[:] = (bytes(range(256)) * (len(data) // 256 + 1))[: len(data)]
    elif how == "truncated-to-16":
        del data[16:]
    elif how == "header-checksum":
        data[16] ^= 0x5A  # a salt byte: the header's checksum no longer fits
    elif how == "frame-checksum":  # a byte inside the page of an early frame: the later commits fail
        page_size = struct.unpack(">I", data[8:12])[0]
        data[32 + 2 * (24 + page_size) + 24 + 100] ^= 0xFF
    wal.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("header-garbage", "has a damaged header (not a WAL's magic number)"),
        ("whole-file-garbage", "has a damaged header (not a WAL's magic number)"),
        ("truncated-to-16", "has a header cut short"),
        ("header-checksum", "has a damaged header (checksum)"),
        ("frame-checksum", "committed transaction(s)"),
    ],
)
def test_a_damaged_wal_moves_the_ledger_aside_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, said: str
) -> None:
    db = _crash_copy(tmp_path)
    main_bytes = db.read_bytes()
    damaged = _damage(db, how)
    caplog.set_level(logging.ERROR, logger="gateway.db")

    with pytest.raises(CorruptGatewayDB) as info:
        Ledger.open(db, gateway=True)

    moved = info.value.moved_to
    assert "gateway.db-wal" in info.value.reason and said in info.value.reason, info.value.reason
    assert moved.name.startswith("gateway.db.corrupt-")
    assert moved.read_bytes() == main_bytes
    assert _wal(moved).read_bytes() == damaged, "the damaged WAL must be kept as it was, for recovery"
    assert not db.exists() and not _wal(db).exists()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(str(moved) in e and f"{moved.name}-wal" in e and said in e for e in errors), errors
    fresh = Ledger.open(db, gateway=True)  # what the gateway does next: a new, empty ledger
    try:
        assert fresh.get(key(0)) is None
    finally:
        fresh.close()
    assert _wal(moved).read_bytes() == damaged


@pytest.mark.parametrize("restart_first", [False, True], ids=["live-frames", "older-generation-after-them"])
def test_an_intact_wal_opens_with_its_rows_and_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, restart_first: bool
) -> None:
    db = _crash_copy(tmp_path, restart_first=restart_first)
    if restart_first:
        assert _frames(db, live=False) > 0, "the control needs frames of an older generation"
    caplog.set_level(logging.WARNING, logger="gateway.db")
    ledger = Ledger.open(db, gateway=True)
    try:
        last = ROWS if restart_first else ROWS - 1
        assert all(ledger.get(key(n)) is not None for n in range(last + 1))
    finally:
        ledger.close()
    assert not list(db.parent.glob("gateway.db*.corrupt-*"))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_an_empty_wal_is_no_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "channels" / "gateway.db"
    ledger = Ledger.open(db)
    _record(ledger, range(3))
    ledger.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    ledger.close()
    _wal(db).write_bytes(b"")
    caplog.set_level(logging.WARNING, logger="gateway.db")
    ledger = Ledger.open(db)
    try:
        assert ledger.get(key(2)) is not None
    finally:
        ledger.close()
    assert not list(db.parent.glob("gateway.db*.corrupt-*")) and caplog.records == []


def test_the_shared_wal_check_imports_nothing_of_the_server() -> None:
    """gateway/ may import appserver.sqlitewal only because it is the standard library alone."""
    assert all_modules()["appserver.sqlitewal"] == set()
