"""A long log's checksums are computed over its end (a re-attack of the WAL judge, session 36).

The judge computed SQLite's WAL checksum over every frame in Python (about 0.1-0.3 ms a page): a
log a long reader had kept from being checkpointed (200 MB) held a start after a kill -9 for 20 s,
1.4 GB for 75 s, before the server listened. It now computes them over the log's last
VERIFIED_TAIL_BYTES, seeded by the checksum the frame before stored, and checks the frames before
by their headers. These cases run on a log longer than that tail, so the seeded path is the one
judged: an undamaged crash opens as it is; a damaged last commit, and a frame of another
generation before the tail, are still losses."""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

from appserver.sqlitewal import FRAME_HEADER, VERIFIED_TAIL_BYTES, WAL_HEADER, read_wal_index, wal_loss
from tests.test_wal_s36f import CHILD_WAIT_S, ROOT, STORE_WRITER

ROWS = 7000  # some 14,000 frames (about 58 MB), written as one commit per row, never checkpointed


def _crashed_log(tmp: Path) -> Path:
    db = tmp / "crash" / "appserver.db"
    db.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", STORE_WRITER, str(db), str(ROWS), "pending"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"idle", (line, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=CHILD_WAIT_S)
    wal = db.with_name(db.name + "-wal")
    assert wal.stat().st_size > 2 * VERIFIED_TAIL_BYTES
    return db


def _copy(db: Path, to: Path) -> Path:
    to.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copyfile(f"{db}{suffix}", to / f"{db.name}{suffix}")
    return to / db.name


def _frame_offset(db: Path, frame: int) -> int:
    """Where frame `frame` (0-based) of `db`'s log begins."""
    with open(f"{db}-wal", "rb") as f:
        page_size = struct.unpack(">I", f.read(WAL_HEADER)[8:12])[0]
    return WAL_HEADER + frame * (FRAME_HEADER + page_size)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_long_log_is_judged_by_its_end(tmp_path: Path) -> None:
    db = _crashed_log(tmp_path)
    index = read_wal_index(db)
    assert index is not None and index.mx_frame > 2 * VERIFIED_TAIL_BYTES // 4096
    assert wal_loss(db, index) is None  # an undamaged kill -9: nothing to say

    last = _copy(db, tmp_path / "last")  # a byte of the last commit's page
    _flip(f"{last}-wal", _frame_offset(last, index.mx_frame - 1) + FRAME_HEADER + 100)
    loss = wal_loss(last, read_wal_index(last))
    assert loss is not None and "damaged" in loss.problem, loss

    early = _copy(db, tmp_path / "early")  # the generation of a frame long before the tail
    _flip(f"{early}-wal", _frame_offset(early, 10) + 8)
    loss = wal_loss(early, read_wal_index(early))
    assert loss is not None and "would keep" in loss.problem and "committed transaction" in loss.problem, loss
    kept = int(loss.problem.split("would keep ")[1].split()[0])
    assert kept <= 10, loss  # recovery stops at the frame of another generation
