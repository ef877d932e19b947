"""A WAL is judged by what can be proven, not by a commit flag alone (attack round 35, l F1 F2 F4).

SQLite writes a WAL frame in two writes: its 24-byte header, then its page. After a checkpoint the
log restarts at offset 0 over older frames, so a kill -9 between the two writes of a COMMIT frame
leaves a frame with this generation's salt and commit flag but an older generation's page: its
checksum fails, SQLite stops before it, and that transaction never committed (COMMIT never
returned). gateway.db was moved aside (routes, pairings lost) and appserver.db refused to start for
it (F1). Real damage after a crash, on the other hand, was missed where only the crash-time
wal-index (`-shm`) proves the loss (F2). A `-wal` that is a symbolic link got an error about
permissions (F4).

Each crash is a copy of the database, its -wal and -shm taken while the writer still holds them
(what kill -9 leaves, the -shm as it was at that instant); the torn commit frame is written into the
copy as SQLite's first write would have left it.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from appserver.store import SQLiteStore
from appserver.store.integrity import StoreOpenError, preflight
from gateway.db import CorruptGatewayDB, LedgerFileRefused
from gateway.ledger import Ledger, UpdateKey

SIDES = ("-wal", "-shm")
EARLY, LATE = 40, 2  # commits before the checkpoint restarts the log, and after it


def key(n: int) -> UpdateKey:
    return UpdateKey("telegram", "main", str(n))


def _record(ledger: Ledger, numbers: range) -> None:
    for n in numbers:  # one commit each, as messages arrive
        ledger.record(key(n), chat="c", sender="s", payload={"text": f"message {n} " + "x" * 300})


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *SIDES):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")
    return dst


def _wal(db: Path) -> Path:
    return db.with_name(db.name + "-wal")


# ── the WAL's bytes, read and written as SQLite's file format says (independent of our code) ──


class Wal:
    def __init__(self, db: Path) -> None:
        self.path = _wal(db)
        self.data = bytearray(self.path.read_bytes())
        self.page_size = struct.unpack(">I", self.data[8:12])[0]
        self.frame_size = 24 + self.page_size
        self.salt = bytes(self.data[16:24])
        self.order = "<" if struct.unpack(">I", self.data[:4])[0] == 0x377F0682 else ">"

    def offset(self, i: int) -> int:
        return 32 + i * self.frame_size

    def frames(self) -> int:
        return (len(self.data) - 32) // self.frame_size

    def live(self, i: int) -> bool:
        return bytes(self.data[self.offset(i) + 8 : self.offset(i) + 16]) == self.salt

    def commit(self, i: int) -> int:
        return int(struct.unpack_from(">I", self.data, self.offset(i) + 4)[0])

    def commits(self) -> list[int]:
        """The commit frames of the current generation, in order."""
        return [i for i in range(self.frames()) if self.live(i) and self.commit(i)]

    def checksum(self, data: bytes, seed: bytes) -> bytes:
        s0, s1 = struct.unpack(">2I", seed)
        words = struct.unpack(f"{self.order}{len(data) // 4}I", data)
        for i in range(0, len(words), 2):
            s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
            s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
        return struct.pack(">2I", s0, s1)

    def save(self) -> None:
        self.path.write_bytes(bytes(self.data))


def _tear_commit_frame(db: Path) -> int:
    """The first frame of the older generation gets what SQLite's first write of a new COMMIT
    frame puts there (the header: page number, commit flag, this generation's salt, the checksum
    of the page it was about to write), its page still the older one: the kill came before the
    second write. The -shm stays as the crash left it. Returns the frame's number."""
    wal = Wal(db)
    live = [i for i in range(wal.frames()) if wal.live(i)]
    torn = len(live)
    assert live == list(range(torn)) and torn < wal.frames(), "the control needs older frames after the live ones"
    last = wal.offset(torn - 1)
    new_page = bytearray(wal.data[last + 24 : last + wal.frame_size])
    new_page[200] ^= 0xFF  # the page this commit meant to write, never written
    head = bytes(wal.data[last : last + 8]) + wal.salt  # same page, "database size" commit flag
    assert bytes(new_page) != bytes(wal.data[wal.offset(torn) + 24 : wal.offset(torn) + wal.frame_size])
    cksum = wal.checksum(head[:8] + bytes(new_page), bytes(wal.data[last + 16 : last + 24]))
    wal.data[wal.offset(torn) : wal.offset(torn) + 24] = head + cksum
    wal.save()
    return torn


def _sqlite_keeps(db: Path, tmp: Path, query: str) -> int:
    """What plain SQLite recovers from these files (on a copy: the files under test stay as they are)."""
    copy = _copy(db, tmp / "sqlite-alone" / db.name)
    conn = sqlite3.connect(copy)
    try:
        return int(conn.execute(query).fetchone()[0])
    finally:
        conn.close()


# ── gateway.db ─────────────────────────────────────────────────────────────────────────────────


def _gateway_crash(tmp_path: Path, *, restart: bool) -> Path:
    """gateway.db as kill -9 leaves it; `restart`: the log was checkpointed and restarted before
    the last LATE commits, so older frames follow the live ones."""
    src = tmp_path / "running" / "channels" / "gateway.db"
    ledger = Ledger.open(src, gateway=True)
    try:
        _record(ledger, range(EARLY))
        if restart:
            ledger.connection.execute("PRAGMA wal_checkpoint(RESTART)")
            _record(ledger, range(EARLY, EARLY + LATE))
        return _copy(src, tmp_path / "crashed" / "channels" / "gateway.db")
    finally:
        ledger.close()


def _ledger_rows(db: Path) -> int:
    ledger = Ledger.open(db, gateway=True)
    try:
        return sum(ledger.get(key(n)) is not None for n in range(EARLY + LATE))
    finally:
        ledger.close()


@pytest.mark.parametrize("shm", ["crash-time-shm", "no-shm"])
def test_a_commit_frame_torn_by_a_kill_is_no_damage_for_the_gateway(tmp_path: Path, shm: str) -> None:
    db = _gateway_crash(tmp_path, restart=True)
    _tear_commit_frame(db)
    if shm == "no-shm":  # no crash-time index: judged by the frames' own checksums
        db.with_name("gateway.db-shm").unlink()
    assert _sqlite_keeps(db, tmp_path, "SELECT count(*) FROM ledger") == EARLY + LATE

    assert _ledger_rows(db) == EARLY + LATE, "the ledger must open with every committed row"
    assert not list(db.parent.glob("gateway.db*.corrupt-*")), "a kill -9 mid-commit is no damage"


def _last_commit_flag(wal: Wal) -> None:
    i = wal.commits()[-1]
    wal.data[wal.offset(i) + 4 : wal.offset(i) + 8] = bytes(4)


def _last_salt(wal: Wal) -> None:
    wal.data[wal.offset(wal.commits()[-1]) + 8] ^= 1


def _cut_mid_last(wal: Wal) -> None:
    del wal.data[wal.offset(wal.commits()[-1]) + 24 + wal.page_size // 2 :]


def _cut_before_last(wal: Wal) -> None:
    del wal.data[wal.offset(wal.commits()[-2] + 1) :]


DAMAGE: dict[str, Callable[[Wal], None]] = {
    "last_commit_flag": _last_commit_flag,
    "last_salt": _last_salt,
    "cut_mid_last": _cut_mid_last,
    "cut_before_last": _cut_before_last,
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_lost_last_commit_moves_the_ledger_aside(tmp_path: Path, how: str) -> None:
    db = _gateway_crash(tmp_path, restart=False)
    wal = Wal(db)
    DAMAGE[how](wal)
    wal.save()
    assert _sqlite_keeps(db, tmp_path, "SELECT count(*) FROM ledger") == EARLY - 1, "SQLite drops the last commit"

    with pytest.raises(CorruptGatewayDB) as info:
        Ledger.open(db, gateway=True)

    assert "gateway.db-wal" in info.value.reason and "committed" in info.value.reason, info.value.reason
    assert _wal(info.value.moved_to).read_bytes() == bytes(wal.data), "the damaged WAL is kept as it was"


def test_without_an_index_whole_commits_after_a_damaged_frame_still_move_it_aside(tmp_path: Path) -> None:
    """No crash-time -shm: the commit frames after a damaged one still prove their own checksum."""
    db = _gateway_crash(tmp_path, restart=False)
    db.with_name("gateway.db-shm").unlink()
    wal = Wal(db)
    wal.data[wal.offset(2) + 24 + 100] ^= 0xFF
    wal.save()

    with pytest.raises(CorruptGatewayDB) as info:
        Ledger.open(db, gateway=True)

    assert "committed transaction(s)" in info.value.reason, info.value.reason


def test_a_wal_that_is_a_symbolic_link_is_refused_naming_it(tmp_path: Path) -> None:
    db = _gateway_crash(tmp_path, restart=False)
    elsewhere = tmp_path / "elsewhere-wal"
    _wal(db).rename(elsewhere)
    _wal(db).symlink_to(elsewhere)

    with pytest.raises(LedgerFileRefused) as info:
        Ledger.open(db, gateway=True)

    text = str(info.value)
    assert "gateway.db-wal" in text and "symbolic link" in text and str(elsewhere) in text, text
    assert "permission" not in text.lower() and "writable" not in text, text
    assert _wal(db).is_symlink() and elsewhere.exists(), "left in place"


# ── appserver.db ───────────────────────────────────────────────────────────────────────────────


def _store_crash(tmp_path: Path, *, restart: bool) -> Path:
    """appserver.db (a real store) as kill -9 leaves it after EARLY commits, `restart`: and LATE
    more after a checkpoint restarted the log (rows of a table of the test's own: the frames are
    what is judged)."""
    src = tmp_path / "running" / "appserver.db"
    store = SQLiteStore(src)
    store.open_sync()  # a new store, with its schema
    asyncio.run(store.close())
    conn = sqlite3.connect(src, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE IF NOT EXISTS filler (n INTEGER PRIMARY KEY, text TEXT)")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for n in range(EARLY):
            conn.execute("INSERT INTO filler VALUES (?, ?)", (n, "x" * 3000))
        if restart:
            conn.execute("PRAGMA wal_checkpoint(RESTART)")
            for n in range(EARLY, EARLY + LATE):
                conn.execute("INSERT INTO filler VALUES (?, ?)", (n, "x" * 3000))
        return _copy(src, tmp_path / "crashed" / "appserver.db")
    finally:
        conn.close()


@pytest.mark.parametrize("shm", ["crash-time-shm", "no-shm"])
def test_a_commit_frame_torn_by_a_kill_is_no_damage_for_the_store(tmp_path: Path, shm: str) -> None:
    db = _store_crash(tmp_path, restart=True)
    _tear_commit_frame(db)
    if shm == "no-shm":
        db.with_name("appserver.db-shm").unlink()
    assert _sqlite_keeps(db, tmp_path, "SELECT count(*) FROM filler") == EARLY + LATE

    assert preflight(db, accept_loss=False) is False, "a kill -9 mid-commit must not refuse the store"
    assert not list(db.parent.glob("appserver.db.damaged-*"))


def test_a_lost_last_commit_refuses_the_store(tmp_path: Path) -> None:
    db = _store_crash(tmp_path, restart=False)
    wal = Wal(db)
    _last_commit_flag(wal)
    wal.save()
    assert _sqlite_keeps(db, tmp_path, "SELECT count(*) FROM filler") == EARLY - 1, "SQLite drops the last commit"

    with pytest.raises(StoreOpenError, match=r"committed transaction\(s\)") as info:
        preflight(db, accept_loss=False)

    assert "write-ahead log" in str(info.value) and "--accept-data-loss" in str(info.value)
