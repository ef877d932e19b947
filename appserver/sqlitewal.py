"""Judging an SQLite write-ahead log before a writer opens it: what SQLite will silently discard.

SQLite drops a WAL whose header is damaged (magic, page size, checksum, cut short) whole, and every
frame from the first one whose checksum fails, committed transactions included, without an error;
its writer then overwrites or deletes the WAL, so nothing is left to look at. `wal_header_problem`
reads the header. The rest is judged by what can be proven:

- The crash-time wal-index (`read_wal_index`, the `-shm` header as the crash left it; read before
  any connection opens the database, whose first read recovers and rewrites it) says how many frames
  were committed (`mxFrame`: SQLite advances it only once a commit is wholly written). A WAL of that
  generation that is shorter, missing or re-headed (`wal_index_problem`), or of which recovery keeps
  fewer frames (`inspect_wal`), lost committed transactions. That holds even when the index says
  every frame was already copied into the database (`nBackfill`): recovery resets that count and
  serves the pages of the frames it keeps, older versions of pages the database holds newer, and
  the next checkpoint copies them back over it. Only a recovery that keeps no frame at all leaves
  such a database as it was. Frames after that `mxFrame` that fail their checksum are a write cut
  off before its commit returned (kill -9, a torn write at power loss): sound.
- Without a usable crash-time index (deleted, of another generation, half written), `inspect_wal`
  scans the frames SQLite discards for commit frames of the current generation whose own checksum
  holds (seeded from the frame before): each is a committed transaction. This finds a damaged frame
  followed by whole commits; it cannot tell a damaged last commit frame (its checksum fails) from a
  commit frame a crash cut off half written, nor a WAL cut short at a frame boundary: those are
  proven only by the crash-time index.

`wal_loss` puts these together (and `wal_header_problem` first, whatever the index says: a log whose
header is damaged is dropped whole, and without a usable index nothing tells what was in it). The
server's store (`appserver/store/integrity.py`) and the gateway's ledger (`gateway/db.py`, which may
import nothing else of the server's) both judge their database with it, so both say the same; so
does `side_link_problem` for a `-wal`/`-shm` that is a symbolic link. Standard library only.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import quote

WAL_MAGICS = (0x377F0682, 0x377F0683)  # little-endian / big-endian checksums
WAL_HEADER = 32
FRAME_HEADER = 24
# How much of a log's end its checksums are computed over (`recovered_frames`): a log checkpointed
# as usual (every 1,000 pages, 4 MiB) is checked whole.
VERIFIED_TAIL_BYTES = 8 * 1024 * 1024
SHM_VERSION = 3007000


log = logging.getLogger("appserver.sqlitewal")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WalReport:
    frames: int  # whole frames in the file
    recovered: int  # frames SQLite uses (the rest it discards)
    lost_commits: int  # committed transactions among the discarded frames
    indexed: int | None = None  # frames the crash-time index says were committed (None: no usable index)
    copied: bool = False  # the index says every one of them was copied into the database already

    @property
    def rolls_back(self) -> bool:
        """SQLite would serve older page versions from the frames it keeps (and checkpoint them
        back over the database's newer ones): what it drops was already copied, not lost alone."""
        return self.copied and self.indexed is not None and 0 < self.recovered < self.indexed


@dataclass(frozen=True, slots=True)
class WalLoss:
    """Committed changes SQLite would drop without a word on opening the database. `problem` says
    how its `-wal` is wrong and what SQLite would do (it follows "the write-ahead log <name> ");
    `label` is a short name for it (the copy of the files a caller keeps)."""

    problem: str
    label: str


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
    words = iter(struct.unpack(f"{order}{len(data) // 4}I", data))
    s0, s1 = seed
    for a, b in zip(words, words, strict=False):  # word pairs (the fastest loop: it runs over every frame)
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
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
    describes: with frames not yet in the database, missing, shorter than those frames, or headed by
    anything but that generation's header; with frames at all, headed by another generation's header
    and holding a frame (SQLite would serve that log's pages over the database). A kill -9 writes
    frames (after the header) before it indexes them, and restarts the index (no frames, a new
    generation) before it writes a log's new header, so none of these is a crash's doing: committed
    transactions were lost after it (deleted, truncated, damaged or replaced). None: no such index,
    or the WAL can be it (a log shorter than an index whose frames were all copied: `inspect_wal`)."""
    if index is None or not index.mx_frame:
        return None
    wal, needed = wal_path(db), index.wal_bytes
    try:
        size = wal.stat().st_size
        if size < needed and index.pending:
            return f"is shorter than it was ({size} of {needed} bytes)", f"wal-{size}-of-{needed}"
        with open(wal, "rb") as f:
            header = f.read(WAL_HEADER)
    except FileNotFoundError:
        return ("is missing", f"wal-missing-of-{needed}") if index.pending else None
    except OSError:  # unreadable: not judged here (SQLite's open fails, naming it)
        return None
    problem = wal_header_problem(header)
    if problem is not None:
        return (problem, f"wal-header-{size}") if index.pending else None
    holds_a_frame = size >= WAL_HEADER + FRAME_HEADER + struct.unpack(">I", header[8:12])[0]
    if header[16:24] != index.salt and (index.pending or holds_a_frame):
        return "has the header of another WAL generation than its index", f"wal-header-{size}"
    return None


def recovered_frames(f: BinaryIO, header: bytes, frames: int, frame_size: int) -> int:
    """How many of a WAL's `frames` SQLite's recovery keeps (its walIndexRecover, as the file format
    says): from the first on, the frames of the header's generation whose checksum, carried on from
    the header's through every frame before, holds, up to the last commit frame among them; none when
    the header's own checksum fails. Read here rather than by letting SQLite recover: its recovery
    rewrites the `-shm`, the crash-time evidence that the next start (and the copy kept of the
    files) needs to see the same loss again.

    The checksums are computed over the last VERIFIED_TAIL_BYTES of the generation's frames, from
    the checksum the frame before them stored: in Python they cost about 0.1-0.3 ms a page, and a
    log a long reader kept from being checkpointed (hundreds of MB) held a start after a crash for
    tens of seconds. What a crash or a power loss damages is the end of the log; the frames before
    the tail are checked by their headers (generation, page number) alone."""
    magic = struct.unpack(">I", header[:4])[0]
    if not header_checksum_ok(header, magic):
        return 0
    order, salt = _order(magic), header[16:24]
    heads = _generation_heads(f, salt, frames, frame_size)
    tail = max(0, len(heads) - max(1, VERIFIED_TAIL_BYTES // frame_size))
    kept = max((i + 1 for i in range(tail) if struct.unpack_from(">I", heads[i], 4)[0]), default=0)
    seed = struct.unpack(">2I", header[24:32] if tail == 0 else heads[tail - 1][16:24])
    for i in range(tail, len(heads)):
        frame = _frame(f, i, frame_size)
        if len(frame) < frame_size:
            break
        seed = _checksum(frame[:8] + frame[FRAME_HEADER:], order, seed)
        if seed != struct.unpack_from(">2I", frame, 16):
            break
        if struct.unpack_from(">I", frame, 4)[0]:
            kept = i + 1
    return kept


def _generation_heads(f: BinaryIO, salt: bytes, frames: int, frame_size: int) -> list[bytes]:
    """The frame headers from the first on while each is of the log's generation (`salt`) and names
    a page: where recovery would stop at the latest (a frame of an earlier generation, reused space)."""
    heads: list[bytes] = []
    for i in range(frames):
        head = _frame(f, i, frame_size, FRAME_HEADER)
        if len(head) < FRAME_HEADER or head[8:16] != salt or not struct.unpack_from(">I", head)[0]:
            break
        heads.append(head)
    return heads


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


def inspect_wal(db: Path, index: WalIndex | None = None) -> WalReport | None:
    """What SQLite will keep of `db`'s WAL (None: no WAL, or nothing to judge: no frames, or a
    header SQLite ignores, which `wal_header_problem` names), read from the files alone: nothing
    is opened through SQLite, nothing written. `index`: the crash-time wal-index (`read_wal_index`);
    when it is of this WAL's generation, recovery keeping fewer frames than it says were committed
    is a loss (also when it says all of them were copied into the database, unless recovery keeps
    none), and frames after it are an uncommitted write. Whole commit frames after what recovery
    keeps are counted either way."""
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
            recovered = recovered_frames(f, header, frames, frame_size)
            lost = _whole_commits(f, header, recovered, frames, frame_size)
            crash = index if index is not None and index.salt == salt and index.page_size in (0, page_size) else None
            # Fewer frames kept than committed lose them, copied or not: recovery serves the older
            # page versions of the frames it keeps (none kept: the database file, which has them all)
            if crash is not None and crash.mx_frame > recovered and (recovered or crash.pending):
                lost = max(lost, _indexed_commits(f, salt, recovered, min(crash.mx_frame, frames), frame_size))
    except FileNotFoundError:
        return None
    if crash is None:
        return WalReport(frames, recovered, lost)
    return WalReport(frames, recovered, lost, crash.mx_frame, copied=not crash.pending)


def wal_loss(db: Path, index: WalIndex | None) -> WalLoss | None:
    """What committed changes SQLite would drop without a word when it next opens `db`, judged
    against its crash-time `index` (`read_wal_index`, read by the caller before anything opened
    `db`); None when it keeps them all, or when a connection has `db` open (its index is the one
    in use: nothing is recovered, nothing dropped). In this order: a non-empty log whose header
    SQLite ignores (whatever the index says: with none, nothing else tells what was in it), a log
    that cannot be the one the index describes (`wal_index_problem`), the frames recovery would
    discard (`inspect_wal`). Read from the files alone: a refused start leaves them, the `-shm`
    included, as they were, so the next one finds the same."""
    if attached_elsewhere(db):
        return None
    wal = wal_path(db)
    try:
        size = wal.stat().st_size
        with open(wal, "rb") as f:
            problem = wal_header_problem(f.read(WAL_HEADER)) if size else None
    except FileNotFoundError:  # none, or removed by another process's last connection (checkpointed)
        size, problem = 0, None
    except OSError:  # unreadable: SQLite's open fails, naming it
        return None
    found = wal_index_problem(db, index) if problem is None else None
    if problem is not None:
        loss: WalLoss | None = _header_loss(db, size, problem, index)
    elif found is not None:
        loss = WalLoss(
            f"{found[0]}, but its index ({shm_path(db).name}) says it held {index.pending if index else 0} "
            "committed frame(s) not yet in the database: SQLite would drop them",
            found[1],
        )
    else:
        loss = _frames_loss(db, index) if size else None
    return None if loss is None or attached_elsewhere(db) else loss  # (one opened meanwhile may have written)


def _header_loss(db: Path, size: int, problem: str, index: WalIndex | None) -> WalLoss:
    """A header SQLite ignores: the whole log is dropped (with the frames a usable index counts)."""
    due = ""
    if index is not None and index.pending:
        shm = shm_path(db).name
        due = f"; its index ({shm}) says it held {index.pending} committed frame(s) not yet in the database"
    return WalLoss(f"({size} bytes) {problem}: SQLite would drop every change in it{due}", f"wal-header-{size}")


def _frames_loss(db: Path, index: WalIndex | None) -> WalLoss | None:
    """The committed transactions recovery would discard, in words; None when it keeps them all."""
    try:
        report = inspect_wal(db, index)
        st = wal_path(db).stat()  # the copy is named after the log's last write: every refusal reuses it
    except OSError:  # unreadable, or gone meanwhile: the next open says which
        return None
    if report is None or not report.lost_commits:
        return None
    label = time.strftime("%Y%m%dT%H%M%S", time.gmtime(st.st_mtime)) + f"-{st.st_size}"
    return WalLoss(_frames_problem(db, report), label)


def _frames_problem(db: Path, report: WalReport) -> str:
    """What recovery would do, in words; a rollback to frames already copied is said as such."""
    kept = f"is damaged: SQLite would keep {report.recovered} of its {report.frames} frames"
    if report.rolls_back:
        return (
            f"{kept}, fewer than the {report.indexed} its index ({shm_path(db).name}) says were committed, all "
            f"already copied into the database: it would serve the older versions of pages the kept frames "
            f"hold (and copy them back over the newer ones), dropping {report.lost_commits} committed "
            "transaction(s)"
        )
    said = "" if report.indexed is None else f" (its index says {report.indexed} were committed)"
    return f"{kept}{said} and drop {report.lost_commits} committed transaction(s) after them"


def side_link_problem(side: Path, db_name: str, role: str) -> str | None:
    """What is wrong with `side`, the file SQLite keeps `db_name`'s `role` in, when it is a symbolic
    link (to a file or to nothing: SQLite opens it only as itself, O_NOFOLLOW, and says just "unable
    to open database file"); None when it is no link. Said the same for every database."""
    try:
        target = os.readlink(side)
    except OSError:  # not a link, or gone
        return None
    nothing = "" if os.path.exists(side) else ", which does not exist"
    return (
        f"a symbolic link to {target}{nothing}, not a regular file: SQLite keeps {db_name}'s {role} here and never "
        "opens it through a link; it was left in place (never moved aside): put the file itself there or move the "
        "link away, then start again"
    )


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
