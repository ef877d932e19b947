"""Judging an SQLite write-ahead log before a writer opens it: what SQLite will silently discard.

SQLite drops a WAL whose header is damaged (magic, page size, checksum, cut short) whole, and every
frame from the first one whose checksum fails, committed transactions included, without an error;
its writer then overwrites or deletes the WAL, so nothing is left to look at. `wal_header_problem`
reads the header; `inspect_wal` lets a read-only connection recover the WAL, reads how many frames
SQLite kept (`mxFrame`, in the wal-index header of `-shm`) and counts the commit frames of the
current generation after them. A kill -9 leaves none (at most an uncommitted tail), and frames of an
older generation (after a checkpoint restarted the log) are not counted: no false alarm there.

Standard library only: the server's store (`appserver/store/integrity.py`) and the gateway's ledger
(`gateway/db.py`, which may import nothing else of the server's) both use it.
"""

from __future__ import annotations

import os
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

WAL_MAGICS = (0x377F0682, 0x377F0683)  # little-endian / big-endian checksums
WAL_HEADER = 32
FRAME_HEADER = 24
SHM_VERSION = 3007000


class WalIndexUnreadable(Exception):
    """The wal-index (`-shm`) could not be read reliably after recovery: the WAL was not judged."""


@dataclass(frozen=True, slots=True)
class WalReport:
    frames: int  # whole frames in the file
    recovered: int  # frames SQLite uses (the rest it discards)
    lost_commits: int  # committed transactions among the discarded frames


def beside_file(db: Path, suffix: str) -> Path:
    """SQLite keeps `-wal` and `-shm` beside the database file itself: for a file reached through
    a symbolic link (on another disk, say), beside the link's target, not the link."""
    real = Path(os.path.realpath(db)) if db.is_symlink() else db
    return real.with_name(real.name + suffix)


def wal_path(db: Path) -> Path:
    return beside_file(db, "-wal")


def shm_path(db: Path) -> Path:
    return beside_file(db, "-shm")


def open_read_only(db: Path, timeout: float = 10.0) -> sqlite3.Connection:
    """A read-only connection: its first read recovers the WAL into `-shm`; it never writes,
    checkpoints, resets or deletes the WAL, not even when it closes."""
    return sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True, isolation_level=None, timeout=timeout)


def header_checksum_ok(header: bytes, magic: int) -> bool:
    """SQLite's WAL checksum over the first 24 header bytes, compared with bytes 24..32."""
    words = struct.unpack(("<" if magic == WAL_MAGICS[0] else ">") + "6I", header[:24])
    s0 = s1 = 0
    for i in range(0, 6, 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return (s0, s1) == struct.unpack(">2I", header[24:32])


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


def recovered_frames(db: Path, conn: sqlite3.Connection, salt: bytes) -> int | None:
    """mxFrame from the wal-index header (two identical 48-byte copies at the start of -shm),
    read after `conn` made SQLite recover the WAL. None when it cannot be read reliably."""
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # a read: SQLite recovers the WAL
    try:
        with open(shm_path(db), "rb") as f:
            head = f.read(96)
    except OSError:
        return None
    if len(head) < 96 or head[:48] != head[48:96]:
        return None
    version, _unused, _change, is_init = struct.unpack_from("=IIIB", head, 0)
    if version != SHM_VERSION or not is_init:
        return None
    if head[32:40] != salt:  # the index describes another WAL generation: SQLite ignored this one
        return 0
    return int(struct.unpack_from("=I", head, 16)[0])


def inspect_wal(db: Path, conn: sqlite3.Connection) -> WalReport | None:
    """What SQLite will keep of `db`'s WAL (None: no WAL, or nothing to judge: no frames, or a
    header SQLite ignores, which `wal_header_problem` names). Call with `conn` (read-only, just
    opened) being the only connection: its first read runs the recovery. `WalIndexUnreadable`
    when the recovered index cannot be read."""
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
            lost = 0
            for i in range(recovered, frames):
                f.seek(WAL_HEADER + i * frame_size)
                frame = f.read(FRAME_HEADER)
                if len(frame) < FRAME_HEADER:
                    break
                _page, commit = struct.unpack(">2I", frame[:8])
                if commit and frame[8:16] == salt:  # a commit frame of this WAL generation
                    lost += 1
    except FileNotFoundError:
        return None
    return WalReport(frames, recovered, lost)


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
