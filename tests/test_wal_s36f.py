"""A write-ahead log damaged after a kill -9 is judged the same for appserver.db and gateway.db, by
what SQLite would then serve (re-attack s36, F F1-F3).

F1: a log whose crash-time index (`-shm`) says every committed frame was already copied into the
database (nBackfill == mxFrame: the state ~1 s after the server goes idle) was taken for one that
could lose nothing. But SQLite's recovery after the crash resets that count and serves the pages of
the frames it still keeps, older versions of pages the database holds newer: a flipped byte in the
last commit, or the log cut inside or just before it, silently rolled back the last acknowledged
commit (the next checkpoint copies the older pages back over the file). F2: appserver.db ignored a
log with a damaged header (magic number, page size) when there was no usable index (deleted,
empty, the two files swapped): every change not yet copied was dropped; gateway.db caught it. F3:
gateway.db called a `-wal` that is a link to an existing file "a symbolic link to …, which does not
exist … is its disk mounted?".

Every crash here is real: a child process writes the database (raw SQLite on a real store, the
gateway's own `Ledger`) and is killed with SIGKILL, the files then damaged as an operator, a disk or
a restore would, and judged through the real opens (`SQLiteStore.open_sync`, `Ledger.open`). What
plain SQLite keeps of the damaged files (on a copy) is the oracle: a refusal is due whenever it
differs from what it keeps of the undamaged crash, and the undamaged crash always opens.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from appserver.store import SQLiteStore
from appserver.store.integrity import StoreOpenError
from gateway.db import CorruptGatewayDB, LedgerFileRefused
from gateway.ledger import Ledger, UpdateKey

ROOT = Path(__file__).resolve().parents[1]
ROWS = 12
SIDES = ("-wal", "-shm")
CHILD_WAIT_S = 60.0

# A real writer on a real store file: one commit per row, as turns are stored, then (`caught-up`) a
# checkpoint that copies every frame into the database (the store's checkpointer does this ~1 s
# after the last commit), then idle until killed. `pending`: no checkpoint (frames only in the log).
# `loop`: bursts of commits, each followed by a checkpoint and a short pause, until killed.
STORE_WRITER = """
import random, sqlite3, sys, time
db, rows, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
conn = sqlite3.connect(db, isolation_level=None)
conn.execute("PRAGMA journal_mode=WAL")
conn.execute("PRAGMA synchronous=NORMAL")
conn.execute("PRAGMA wal_autocheckpoint=0")
conn.execute("CREATE TABLE IF NOT EXISTS filler (n INTEGER PRIMARY KEY, text TEXT)")
conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
def insert(n):
    conn.execute("INSERT INTO filler VALUES (?, ?)", (n, f"row {n} " + "x" * random.randrange(100, 3000)))
if mode == "loop":
    n = 0
    print("writing", flush=True)
    while True:
        for _ in range(random.randrange(1, 6)):
            insert(n)
            n += 1
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        time.sleep(random.choice((0, 0.001, 0.01)))
for n in range(rows):
    insert(n)
if mode == "caught-up":
    busy, logged, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and logged == copied > 0, (busy, logged, copied)
print("idle", flush=True)
time.sleep(600)
"""

# The gateway's own ledger, written as messages arrive, then the same.
GATEWAY_WRITER = """
import sys, time
from pathlib import Path
from gateway.ledger import Ledger, UpdateKey
ledger = Ledger.open(Path(sys.argv[1]), gateway=True)
for n in range(int(sys.argv[2])):
    ledger.record(UpdateKey("telegram", "main", str(n)), chat="c", sender="s", payload={"text": f"m{n} " + "x" * 300})
if sys.argv[3] == "caught-up":
    busy, logged, copied = ledger.connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and logged == copied > 0, (busy, logged, copied)
print("idle", flush=True)
time.sleep(600)
"""


def _kill9(script: str, db: Path, mode: str, *, after: float | None = None) -> None:
    """Run the writer on `db` and SIGKILL it: once it is idle, or `after` seconds into its writing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(db), str(ROWS), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], CHILD_WAIT_S)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() in (b"idle", b"writing"), (line, proc.stderr.read() if proc.poll() is not None else "")
        if after is not None:
            select.select([], [], [], after)
        assert proc.poll() is None, "the writer must still be running when it is killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=CHILD_WAIT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *SIDES):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")
    return dst


def _side(db: Path, suffix: str) -> Path:
    return db.with_name(db.name + suffix)


def _index(db: Path) -> tuple[int, int]:
    """(mxFrame, nBackfill) of the crash-time wal-index, read from the `-shm` bytes as SQLite's file
    format lays them out (independent of the code under test)."""
    head = _side(db, "-shm").read_bytes()[:100]
    assert len(head) == 100 and head[:48] == head[48:96], "a whole index"
    return struct.unpack_from("=I", head, 16)[0], struct.unpack_from("=I", head, 96)[0]


class Wal:
    def __init__(self, db: Path) -> None:
        self.path = _side(db, "-wal")
        self.data = bytearray(self.path.read_bytes())
        self.page_size = struct.unpack(">I", self.data[8:12])[0]
        self.frame_size = 24 + self.page_size

    def offset(self, i: int) -> int:
        return 32 + i * self.frame_size

    def commit(self, i: int) -> bool:
        return struct.unpack_from(">I", self.data, self.offset(i) + 4)[0] != 0

    def save(self) -> bytes:
        self.path.write_bytes(bytes(self.data))
        return bytes(self.data)


def _flip_last_commit(wal: Wal, mx: int) -> None:
    wal.data[wal.offset(mx - 1) + 24 + 200] ^= 0xFF  # one byte in the page of the last committed frame


def _cut_mid_last_commit(wal: Wal, mx: int) -> None:
    del wal.data[wal.offset(mx - 1) + 24 + wal.page_size // 2 :]


def _cut_before_last_commit(wal: Wal, mx: int) -> None:
    first = max(i for i in range(mx - 1) if wal.commit(i)) + 1  # the first frame of the last commit
    del wal.data[wal.offset(first) :]


LAST_COMMIT_DAMAGE: dict[str, Callable[[Wal, int], None]] = {
    "flip-last-commit": _flip_last_commit,
    "cut-mid-last-commit": _cut_mid_last_commit,
    "cut-before-last-commit": _cut_before_last_commit,
}


def _sqlite_sees(db: Path, tmp: Path, query: str) -> list[object]:
    """What plain SQLite serves from these files (on a copy: the files under test stay as they are)."""
    copy = _copy(db, tmp / f"sqlite-alone-{random.randrange(1 << 30)}" / db.name)
    conn = sqlite3.connect(copy)
    try:
        return [tuple(r) for r in conn.execute(query).fetchall()]
    except sqlite3.DatabaseError as exc:
        return [f"error: {exc}"]
    finally:
        conn.close()


def _hashes(db: Path) -> dict[str, bytes]:
    return {s: Path(f"{db}{s}").read_bytes() for s in ("", *SIDES) if Path(f"{db}{s}").exists()}


# ── appserver.db ───────────────────────────────────────────────────────────────────────────────

ROWS_QUERY = "SELECT n, length(text) FROM filler ORDER BY n"


def _new_store(tmp_path: Path, name: str = "running") -> Path:
    db = tmp_path / name / "appserver.db"
    db.parent.mkdir(parents=True)
    store = SQLiteStore(db)
    store.open_sync()  # a new store with its schema, closed cleanly (no WAL left)
    asyncio.run(store.close())
    return db


def _store_crash_with_frames_pending(tmp_path: Path) -> Path:
    db = _new_store(tmp_path)
    _kill9(STORE_WRITER, db, "pending")
    mx, backfilled = _index(db)
    assert mx > backfilled, "the commits must be only in the log"
    return db


def _store_opens(db: Path) -> None:
    store = SQLiteStore(db)
    store.open_sync()
    asyncio.run(store.close())


def _store_refuses(db: Path) -> str:
    before = _hashes(db)
    with pytest.raises(StoreOpenError) as info:
        SQLiteStore(db).open_sync()
    assert _hashes(db) == before, "nothing may be changed by a refused start (its -shm is the evidence)"
    text = str(info.value)
    assert "write-ahead log" in text and "--accept-data-loss" in text and "Nothing was changed" in text, text
    kept = [d for d in db.parent.glob("appserver.db.damaged-*") if str(d) in text]
    assert len(kept) == 1 and _hashes(kept[0] / db.name) == before, "a copy of the files as they were is kept"
    return text


@pytest.mark.parametrize("how", sorted(LAST_COMMIT_DAMAGE))
def test_store_a_damaged_last_commit_is_refused_although_every_frame_was_copied(tmp_path: Path, how: str) -> None:
    db = _new_store(tmp_path)
    _kill9(STORE_WRITER, db, "caught-up")
    mx, backfilled = _index(db)
    assert mx == backfilled > 0, "the crash must leave every committed frame copied, the log not restarted"
    clean = _copy(db, tmp_path / "clean" / "appserver.db")
    _store_opens(clean)  # the kill -9 alone: no alarm, every row
    assert _sqlite_sees(clean, tmp_path, "SELECT count(*) FROM filler") == [(ROWS,)]

    wal = Wal(db)
    LAST_COMMIT_DAMAGE[how](wal, mx)
    wal.save()
    assert _sqlite_sees(db, tmp_path, "SELECT count(*) FROM filler") == [(ROWS - 1,)], "SQLite rolls back the last"

    text = _store_refuses(db)
    assert "committed transaction(s)" in text and "already copied into the database" in text, text
    assert _store_refuses(db) == text, "every start refuses the same way"


def test_store_a_damaged_last_commit_not_yet_copied_is_refused_at_every_start(tmp_path: Path) -> None:
    """The check let SQLite recover the log read-only, which rewrote the -shm: the first start was
    refused, the second found an index that agreed with the damage and started without the commit."""
    db = _store_crash_with_frames_pending(tmp_path)
    mx, _ = _index(db)
    wal = Wal(db)
    _flip_last_commit(wal, mx)
    wal.save()
    assert _sqlite_sees(db, tmp_path, "SELECT count(*) FROM filler") == [(ROWS - 1,)], "SQLite drops the last"

    text = _store_refuses(db)
    assert "committed transaction(s)" in text, text
    assert _store_refuses(db) == text, "every start refuses the same way"


def test_store_kill9_at_any_moment_never_alarms_and_damage_to_its_last_commit_always_does(tmp_path: Path) -> None:
    """Kills at random moments of a writer that checkpoints as it goes (mid-commit, a torn frame,
    every frame copied or not), the last one while idle after a checkpoint. Each crash opens as it
    is, with what plain SQLite recovers of it; the same crash with a byte of its last committed frame
    flipped is refused whenever plain SQLite would then serve anything else."""
    rng = random.Random()
    states = []
    for round_ in range(8):
        db = _new_store(tmp_path, f"r{round_}")
        idle = round_ == 7
        _kill9(STORE_WRITER, db, "caught-up" if idle else "loop", after=None if idle else rng.uniform(0.05, 0.4))
        mx, backfilled = _index(db)
        states.append((mx, backfilled))
        clean = _copy(db, tmp_path / f"r{round_}-clean" / "appserver.db")
        kept = _sqlite_sees(clean, tmp_path, ROWS_QUERY)
        _store_opens(clean)
        assert _sqlite_sees(clean, tmp_path, ROWS_QUERY) == kept, f"round {round_} {states[-1]}: a row changed"
        if not mx:
            continue
        wal = Wal(db)
        _flip_last_commit(wal, mx)
        wal.save()
        if _sqlite_sees(db, tmp_path, ROWS_QUERY) != kept:  # (the same: a checkpoint had copied the frame,
            _store_refuses(db)  # its count of copied frames not yet updated; refusing a damaged frame is fine)
    assert any(mx == backfilled > 0 for mx, backfilled in states), states


# ── gateway.db ─────────────────────────────────────────────────────────────────────────────────


def key(n: int) -> UpdateKey:
    return UpdateKey("telegram", "main", str(n))


def _gateway_crash(tmp_path: Path, mode: str) -> Path:
    db = tmp_path / "gw" / "channels" / "gateway.db"
    db.parent.mkdir(parents=True)
    _kill9(GATEWAY_WRITER, db, mode)
    return db


def _ledger_rows(db: Path) -> int:
    ledger = Ledger.open(db, gateway=True)
    try:
        return sum(ledger.get(key(n)) is not None for n in range(ROWS))
    finally:
        ledger.close()


def _ledger_moved_aside(db: Path) -> str:
    damaged = _side(db, "-wal").read_bytes() if _side(db, "-wal").exists() else None
    with pytest.raises(CorruptGatewayDB) as info:
        Ledger.open(db, gateway=True)
    moved = info.value.moved_to
    if damaged is not None:
        assert _side(moved, "-wal").read_bytes() == damaged, "the damaged log is kept as it was"
    return info.value.reason


@pytest.mark.parametrize("how", sorted(LAST_COMMIT_DAMAGE))
def test_gateway_a_damaged_last_commit_moves_the_ledger_aside_although_every_frame_was_copied(
    tmp_path: Path, how: str
) -> None:
    db = _gateway_crash(tmp_path, "caught-up")
    mx, backfilled = _index(db)
    assert mx == backfilled > 0, "the crash must leave every committed frame copied, the log not restarted"
    clean = _copy(db, tmp_path / "clean" / "channels" / "gateway.db")
    assert _ledger_rows(clean) == ROWS  # the kill -9 alone: no alarm, every row

    wal = Wal(db)
    LAST_COMMIT_DAMAGE[how](wal, mx)
    wal.save()
    assert _sqlite_sees(db, tmp_path, "SELECT count(*) FROM ledger") == [(ROWS - 1,)], "SQLite rolls back the last"

    reason = _ledger_moved_aside(db)
    assert "gateway.db-wal" in reason and "committed transaction(s)" in reason, reason


# ── a damaged header without a usable index, judged the same for both ──────────────────────────


def _zero_magic(db: Path) -> None:
    with open(_side(db, "-wal"), "r+b") as f:
        f.write(bytes(4))


def _bad_page_size(db: Path) -> None:
    with open(_side(db, "-wal"), "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0x20]))  # 4096 → 12288: no power of two


def _no_shm(db: Path) -> None:
    _side(db, "-shm").unlink()


def _empty_shm(db: Path) -> None:
    os.truncate(_side(db, "-shm"), 0)


def _swap(db: Path) -> None:
    wal, shm, tmp = _side(db, "-wal"), _side(db, "-shm"), _side(db, "-swap")
    wal.rename(tmp)
    shm.rename(wal)
    tmp.rename(shm)


HEADER_DAMAGE: dict[str, tuple[tuple[Callable[[Path], None], ...], str]] = {
    "no-shm-magic": ((_no_shm, _zero_magic), "has a damaged header (not a WAL's magic number)"),
    "empty-shm-magic": ((_empty_shm, _zero_magic), "has a damaged header (not a WAL's magic number)"),
    "no-shm-page-size": ((_no_shm, _bad_page_size), "has a damaged header (page size)"),
    "swapped": ((_swap,), "has a damaged header (not a WAL's magic number)"),
}


@pytest.mark.parametrize("how", sorted(HEADER_DAMAGE))
def test_a_damaged_wal_header_without_a_usable_index_is_refused_by_both(tmp_path: Path, how: str) -> None:
    steps, said = HEADER_DAMAGE[how]
    store = _store_crash_with_frames_pending(tmp_path)
    ledger = _gateway_crash(tmp_path, "pending")
    for db in (store, ledger):
        for step in steps:
            step(db)
    assert _sqlite_sees(store, tmp_path, "SELECT count(*) FROM filler") == [(0,)], "SQLite drops the whole log"

    text = _store_refuses(store)
    reason = _ledger_moved_aside(ledger)

    what = f"{said}: SQLite would drop every change in it"
    assert "appserver.db-wal" in text and what in text, text
    assert "gateway.db-wal" in reason and what in reason, reason


# ── a -wal that is a symbolic link to a file that exists ───────────────────────────────────────


def test_a_wal_linked_to_an_existing_file_is_named_the_same_for_both(tmp_path: Path) -> None:
    store = _store_crash_with_frames_pending(tmp_path)
    ledger = _gateway_crash(tmp_path, "pending")
    texts = []
    for db in (store, ledger):
        real = db.with_name("wal.real")
        _side(db, "-wal").rename(real)
        _side(db, "-wal").symlink_to(real)
        texts.append((db, real))

    with pytest.raises(StoreOpenError) as refused:
        SQLiteStore(store).open_sync()
    with pytest.raises(LedgerFileRefused) as ledger_refused:
        Ledger.open(ledger, gateway=True)

    said = []
    for (db, real), text in zip(texts, (str(refused.value), str(ledger_refused.value)), strict=True):
        assert text.startswith(f"{_side(db, '-wal')}: a symbolic link to {real}, not a regular file"), text
        assert "does not exist" not in text and "mounted" not in text, text
        assert _side(db, "-wal").is_symlink() and real.exists(), "left in place"
        said.append(text.replace(str(_side(db, "-wal")), "WAL").replace(str(real), "TARGET").replace(db.name, "DB"))
    assert said[0] == said[1], said
    assert "never opens it through a link" in said[0], said[0]
