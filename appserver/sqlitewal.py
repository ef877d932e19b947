"""Judging an SQLite write-ahead log before a writer opens it: what SQLite will silently discard.

SQLite drops a WAL whose header is damaged (magic, page size, checksum, cut short) whole, and every
frame from the first one whose checksum fails, committed transactions included, without an error;
its writer then overwrites or deletes the WAL, so nothing is left to look at. `wal_header_problem`
reads the header. The rest is judged by what can be proven:

- The crash-time wal-index (`read_wal_index`, the `-shm` header as the crash left it; read before
  any connection opens the database, whose first read recovers and rewrites it) says how many frames
  were committed (`mxFrame`: SQLite advances it only once a commit is wholly written). A WAL of that
  generation that is shorter, missing or re-headed (`wal_index_problem`), or of which recovery keeps
  fewer frames (`inspect_wal`), lost committed transactions. Frames after that `mxFrame` that fail
  their checksum are a write cut off before its commit returned (kill -9, a torn write at power
  loss): sound.
- Without a usable crash-time index (deleted, of another generation, half written), `inspect_wal`
  scans the frames SQLite discards for commit frames of the current generation whose own checksum
  holds (seeded from the frame before): each is a committed transaction. This finds a damaged frame
  followed by whole commits; it cannot tell a damaged last commit frame (its checksum fails) from a
  commit frame a crash cut off half written, nor a WAL cut short at a frame boundary: those are
  proven only by the crash-time index.

Standard library only: the server's store (`appserver/store/integrity.py`) and the gateway's ledger
(`gateway/db.py`, which may import nothing else of the server's) both use it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import quote

WAL_MAGICS = (0x377F0682, 0x377F0683)  # little-endian / big-endian checksums
WAL_HEADER = 32
FRAME_HEADER = 24
SHM_VERSION = 3007000


log = logging.getLogger("appserver.sqlitewal")
T = TypeVar("T")


class WalIndexUnreadable(Exception):
    """The wal-index (`-shm`) could not be read reliably after recovery: the WAL was not judged."""


@dataclass(frozen=True, slots=True)
class WalReport:
    frames: int  # whole frames in the file
    recovered: int  # frames SQLite uses (the rest it discards)
    lost_commits: int  # committed transactions among the discarded frames
    indexed: int | None = None  # frames the crash-time index says were committed (None: no usable index)


@dataclass(frozen=True, slots=True)
class WalIndex:
    """The wal-index header (`-shm`) as a crash left it: what SQLite had committed to the WAL."""

    mx_frame: int  # frames committed (SQLite advances it only once a commit is wholly written)
    backfilled: int  # of those, the frames already copied into the database file
    page_size: int
    salt: bytes  # the WAL generation it describes

    @property
    def pending(self) -> int:
        """Committed frames that are only in the WAL (not yet copied into the database)."""
        return max(0, self.mx_frame - self.backfilled)

    @property
    def wal_bytes(self) -> int:
        """How long the WAL must be to hold them."""
        return WAL_HEADER + self.mx_frame * (FRAME_HEADER + self.page_size)


def beside_file(db: Path, suffix: str) -> Path:
    """SQLite keeps `-wal` and `-shm` beside the database file itself: for a file reached through
    a symbolic link (on another disk, say), beside the link's target, not the link."""
    real = Path(os.path.realpath(db)) if db.is_symlink() else db
    return real.with_name(real.name + suffix)


def wal_path(db: Path) -> Path:
    return beside_file(db, "-wal")


def shm_path(db: Path) -> Path:
    return beside_file(db, "-shm")


# How many times a check that found committed changes lost is made again when the files changed
# under it (another process opened and closed the database meanwhile) before it is given up
JUDGE_TRIES = 3


def files_state(db: Path) -> tuple[tuple[int, ...] | None, ...]:
    """The database's and its `-wal`'s (inode, size, mtime) and the `-shm`'s inode (None for one
    that is not there): what another process's open and close changes (its last close copies the
    log into the database and removes both side files), and a read-only look does not (it may
    rewrite the `-shm`'s content, never replace it). A verdict that committed changes were lost
    stands only when this is the same after it was reached as before: the log found missing or
    short a moment after the index was read may have been copied into the database meanwhile."""
    state: list[tuple[int, ...] | None] = []
    for path in (db, wal_path(db)):
        try:
            st = os.stat(path)
            state.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            state.append(None)
    try:
        state.append((os.stat(shm_path(db)).st_ino,))
    except OSError:
        state.append(None)
    return tuple(state)


def judged_while_still(db: Path, judge: Callable[[], T], damning: Callable[[T], bool]) -> T | None:
    """`judge()`'s result; one that is `damning` (committed changes lost) stands only when the files
    stayed as they were while it was reached (`files_state`), else `db` is judged again, up to
    `JUDGE_TRIES` times. None when they kept changing: another process is at work on it, and its own
    open recovers what is there."""
    for _ in range(JUDGE_TRIES):
        before = files_state(db)
        result = judge()
        if not damning(result) or files_state(db) == before:
            return result
        log.info("%s changed while its write-ahead log was checked (another process opened it): checked again", db)
    log.warning("%s kept changing while its write-ahead log was checked: not judged", db)
    return None


def open_read_only(db: Path, timeout: float = 10.0) -> sqlite3.Connection:
    """A read-only connection: its first read recovers the WAL into `-shm`; it never writes,
    checkpoints, resets or deletes the WAL, not even when it closes."""
    return sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True, isolation_level=None, timeout=timeout)


def _checksum(data: bytes, order: str, seed: tuple[int, int]) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (words in `order`: "<" or ">"), continuing from `seed`."""
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    s0, s1 = seed
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _order(magic: int) -> str:
    return "<" if magic == WAL_MAGICS[0] else ">"


def header_checksum_ok(header: bytes, magic: int) -> bool:
    """SQLite's WAL checksum over the first 24 header bytes, compared with bytes 24..32."""
    return _checksum(header[:24], _order(magic), (0, 0)) == struct.unpack(">2I", header[24:32])


def _page_size_ok(page_size: int) -> bool:
    return 512 <= page_size <= 65536 and not page_size & (page_size - 1)


def wal_header_problem(header: bytes) -> str | None:
    """Why SQLite would ignore a WAL that begins with `header` (its first 32 bytes, or fewer when
    the file is shorter), dropping every frame in it; None when the header is sound."""
    if len(header) < WAL_HEADER:
        return "has a header cut short"
    magic, _version, page_size = struct.unpack(">3I", header[:12])
    if magic not in WAL_MAGICS:
        return "has a damaged header (not a WAL's magic number)"
    if not _page_size_ok(page_size):
        return "has a damaged header (page size)"
    if not header_checksum_ok(header, magic):
        return "has a damaged header (checksum)"
    return None


def read_wal_index(db: Path) -> WalIndex | None:
    """The wal-index header in `db`'s `-shm` (two identical 48-byte copies, then the checkpoint's
    `nBackfill`); None when there is none or it is not whole. Read it BEFORE any connection opens
    `db`: the first one recovers the WAL and rewrites it, and the crash-time one is the evidence."""
    try:
        with open(shm_path(db), "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 100 or head[:48] != head[48:96]:
        return None  # missing, or a crash between the two copies' writes: unusable
    version, _unused, _change, is_init, _big_end, page = struct.unpack_from("=IIIBBH", head, 0)
    page_size = 65536 if page == 1 else page
    mx_frame = int(struct.unpack_from("=I", head, 16)[0])
    if version != SHM_VERSION or not is_init or (mx_frame and not _page_size_ok(page_size)):
        return None  # (an index of no frames has no page size yet)
    backfilled = int(struct.unpack_from("=I", head, 96)[0])
    return WalIndex(mx_frame, backfilled, page_size, head[32:40])


def wal_index_problem(db: Path, index: WalIndex | None) -> tuple[str, str] | None:
    """(what is wrong, a short label) when `db`'s WAL cannot be the one its crash-time `index`
    describes with frames not yet in the database: missing, shorter than those frames, or headed by
    anything but that generation's header. A kill -9 writes frames (after the header) before it
    indexes them, so none of these is a crash's doing: committed transactions were lost after it
    (deleted, truncated, damaged or replaced). None: no such index, or the WAL can be it."""
    if index is None or not index.pending:
        return None
    wal, needed = wal_path(db), index.wal_bytes
    try:
        size = wal.stat().st_size
        if size < needed:
            return f"is shorter than it was ({size} of {needed} bytes)", f"wal-{size}-of-{needed}"
        with open(wal, "rb") as f:
            header = f.read(WAL_HEADER)
    except FileNotFoundError:
        return "is missing", f"wal-missing-of-{needed}"
    except OSError:  # unreadable: not judged here (SQLite's open fails, naming it)
        return None
    problem = wal_header_problem(header)
    if problem is None and header[16:24] != index.salt:
        problem = "has the header of another WAL generation than its index"
    return None if problem is None else (problem, f"wal-header-{size}")


def recovered_frames(db: Path, conn: sqlite3.Connection, salt: bytes) -> int | None:
    """mxFrame from the wal-index header read after `conn` made SQLite recover the WAL. None when
    it cannot be read reliably."""
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # a read: SQLite recovers the WAL
    index = read_wal_index(db)
    if index is None:
        return None
    if index.salt != salt:  # the index describes another WAL generation: SQLite ignored this one
        return 0
    return index.mx_frame


def _frame(f: BinaryIO, i: int, frame_size: int, length: int | None = None) -> bytes:
    """Frame `i` (its first `length` bytes; all of it by default), short when the file ends."""
    f.seek(WAL_HEADER + i * frame_size)
    return f.read(frame_size if length is None else length)


def _whole_commits(f: BinaryIO, header: bytes, start: int, frames: int, frame_size: int) -> int:
    """Commit frames of this generation from frame `start` on whose own checksum holds (seeded
    from the checksum stored in the frame before): each was written whole, so it committed. A
    commit frame cut off between its header and its page (the page still an older generation's)
    fails it: a write whose commit never returned, not a lost one."""
    order, salt, count = _order(struct.unpack(">I", header[:4])[0]), header[16:24], 0
    for i in range(start, frames):
        frame = _frame(f, i, frame_size)
        if len(frame) < frame_size:
            break
        if not struct.unpack_from(">I", frame, 4)[0] or frame[8:16] != salt:
            continue
        seed = header[24:32] if i == 0 else _frame(f, i - 1, frame_size, FRAME_HEADER)[16:24]
        if _checksum(frame[:8] + frame[FRAME_HEADER:], order, struct.unpack(">2I", seed)) == struct.unpack(
            ">2I", frame[16:24]
        ):
            count += 1
    return count


def _indexed_commits(f: BinaryIO, salt: bytes, start: int, end: int, frame_size: int) -> int:
    """Commits the crash-time index proves among frames `start`..`end`: at least one (the index
    moved past them), each commit flag of this generation still there counting one."""
    flagged = 0
    for i in range(start, end):
        frame = _frame(f, i, frame_size, FRAME_HEADER)
        flagged += len(frame) == FRAME_HEADER and bool(struct.unpack_from(">I", frame, 4)[0]) and frame[8:16] == salt
    return max(1, flagged)


def inspect_wal(db: Path, conn: sqlite3.Connection, index: WalIndex | None = None) -> WalReport | None:
    """What SQLite will keep of `db`'s WAL (None: no WAL, or nothing to judge: no frames, or a
    header SQLite ignores, which `wal_header_problem` names). Call with `conn` (read-only, just
    opened) being the only connection: its first read runs the recovery. `index`: the crash-time
    wal-index (`read_wal_index`, read before `conn` opened); when it is of this WAL's generation,
    recovery keeping fewer frames than it says were committed is a loss, and frames after it are
    an uncommitted write. Whole commit frames after what recovery keeps are counted either way.
    `WalIndexUnreadable` when the recovered index cannot be read."""
    wal = wal_path(db)
    try:
        size = wal.stat().st_size
        with open(wal, "rb") as f:
            header = f.read(WAL_HEADER)
            if len(header) < WAL_HEADER:
                return None
            magic, _version, page_size = struct.unpack(">3I", header[:12])
            if magic not in WAL_MAGICS or not _page_size_ok(page_size):
                return None
            frame_size = FRAME_HEADER + page_size
            frames = (size - WAL_HEADER) // frame_size
            if frames <= 0:
                return None
            salt = header[16:24]
            recovered = recovered_frames(db, conn, salt) if header_checksum_ok(header, magic) else 0
            if recovered is None:
                raise WalIndexUnreadable(f"could not read the WAL index of {db}")
            lost = _whole_commits(f, header, recovered, frames, frame_size)
            crash = index if index is not None and index.salt == salt and index.page_size in (0, page_size) else None
            if crash is not None and crash.mx_frame > max(recovered, crash.backfilled):
                lost = max(lost, _indexed_commits(f, salt, recovered, min(crash.mx_frame, frames), frame_size))
    except FileNotFoundError:
        return None
    return WalReport(frames, recovered, lost, None if crash is None else crash.mx_frame)


def shm_lock_holders(db: Path) -> set[int]:
    """The processes (pids) holding a lock on `db`'s `-shm` file: each SQLite connection to the
    database holds one while it is open (read from /proc/locks; empty where there is none)."""
    try:
        st = os.stat(shm_path(db))
        text = Path("/proc/locks").read_text()
    except OSError:
        return set()  # no -shm: nobody attached (or no /proc: checked as if first)
    holders: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        for n, token in enumerate(fields):
            parts = token.split(":")
            if len(parts) == 3 and parts[2].isdigit() and int(parts[2]) == st.st_ino:
                try:
                    if (int(parts[0], 16), int(parts[1], 16)) == (os.major(st.st_dev), os.minor(st.st_dev)):
                        holders.add(int(fields[n - 1]) if n and fields[n - 1].lstrip("-").isdigit() else -1)
                except ValueError:
                    pass
    return holders


def attached_elsewhere(db: Path) -> bool:
    """Whether some connection (another process, or another one of ours) has `db` open: each
    holds a lock on its `-shm` file. Then no recovery happens at our open (the WAL index in use
    is authoritative and nothing is discarded), and we must not open and close the `-shm` file
    ourselves: closing any descriptor of a file drops this process's POSIX locks on it."""
    return bool(shm_lock_holders(db))
