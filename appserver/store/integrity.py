"""Opening an SQLite store file without losing data quietly.

Only a missing file is a new store (created under a temporary name and renamed, so a half-made
store never looks like a real one). An empty, truncated, foreign or damaged file is refused.

A write-ahead log damaged after a crash (a bad byte, a torn sector) makes SQLite drop every frame
from the first bad one on, committed transactions included, without an error; a log whose header
is damaged it drops whole. Before the writer connection opens (its first write or its close would
overwrite or delete the WAL), `check_wal_index` judges it with appserver/sqlitewal.py's `wal_loss`,
the check gateway.db's uses too: a header SQLite ignores; a log missing, shorter or re-headed
although the crash-time wal-index (`-shm`, read before any connection opens the store: the first one
recovers and rewrites it) says it held frames not yet in the database; fewer frames kept (read as
SQLite's recovery reads them, from the files alone: a refused start changes nothing, and the next one
finds the same) than that index says were committed, even all copied into the database already
(SQLite would serve older page versions from the frames it keeps); or whole commit frames (their own
checksum holds) after what it keeps. A commit frame a kill -9 cut off half written fails its
checksum and lies past the index: an uncommitted write, so this never refuses a store that a kill -9
left behind.

A second, independent record: `<db>.position` holds the highest message rowid ever issued
(`sqlite_sequence`, which only grows), written by the checkpointer after a checkpoint has made it
durable. A store that opens behind it lost data some other way (a WAL deleted after a crash, an
old copy put back); that is refused too. Either refusal keeps a copy of the files and says how to
accept the loss deliberately (`appserver serve --accept-data-loss`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path

from appserver.fsutil import (
    POSITION_MAX_BYTES,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_json,
    file_kind,
    fsync_dir,
    move_aside,
    read_state_bytes,
)
from appserver.sqlitewal import (
    WAL_HEADER,
    attached_elsewhere,
    judged_while_still,
    open_read_only,
    read_wal_index,
    shm_path,
    wal_loss,
    wal_path,
)
from appserver.sqlitewal import shm_lock_holders as shm_lock_holders  # store/sqlite.py's import
from appserver.store.base import StoreError
from appserver.store.groupcommit import FSIZE_MARGIN, file_size_limit, size_limit_cause

log = logging.getLogger("appserver.store")

SQLITE_MAGIC = b"SQLite format 3\x00"
ACCEPT_HINT = "appserver serve --accept-data-loss"
# A store up to this size is checked page by page (`PRAGMA quick_check`, well under a second) at
# every start: damaged pages were found only when a request touched them, each one failing while
# /readyz said ready. A bigger store is checked the same way after the start (`background_check`).
QUICK_CHECK_MAX_BYTES = 256 * 1024 * 1024
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26


class StoreOpenError(StoreError):
    """The store file cannot be used as it is; the message says what happened and what to do."""


def position_path(db: Path) -> Path:
    return db.with_name(db.name + ".position")


def wal_index_claim(db: Path) -> tuple[int, int, bytes] | None:
    """(frames the crash-time `-shm` wal-index says the WAL holds that are not yet copied into the
    database, bytes the WAL must have for them, the salt of that WAL generation); None when there
    is no usable index or nothing un-copied (appserver/sqlitewal.py's `read_wal_index`)."""
    index = read_wal_index(db)
    if index is None or not index.pending:
        return None
    return index.pending, index.wal_bytes, index.salt


def check_wal_index(db: Path, accept_loss: bool) -> None:
    """Refuse a store whose WAL SQLite would silently drop committed changes of (`wal_loss`, judged
    against the crash-time wal-index; a verdict of loss stands only while the files stayed as they
    were: `judged_while_still`). Call it before any connection opens the store, which would recover
    the WAL and rewrite the index; with `accept_loss`, the loss is logged and the start goes on."""
    loss = judged_while_still(db, lambda: wal_loss(db, read_wal_index(db)), lambda found: found is not None)
    if loss is None:
        return
    what = f"the write-ahead log {wal_path(db)} {loss.problem}: committed conversations would be lost"
    kept = keep_copy(db, loss.label)
    if accept_loss:
        log.warning("accepted data loss: %s; the store and WAL as they were are kept in %s", what, kept)
        return
    raise StoreOpenError(
        f"{what}. Nothing was changed; a copy of the store and its WAL is kept in {kept}. Put the WAL back if you "
        f"have a sound one, or recover what you can from that copy, or accept the loss and start with `{ACCEPT_HINT}`"
    )


def read_position(db: Path) -> int | None:
    """The recorded position, or None when there is none. An unreadable one is moved aside with a
    loud error (and /readyz warns while it lies there): it is not "no position", but this start
    cannot tell whether the store fell behind it, and the next write would overwrite the evidence."""
    path = position_path(db)
    try:
        data = json.loads(read_state_bytes(path, POSITION_MAX_BYTES).decode("utf-8"))
        seq = data["messages_seq"]
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:  # 1e400, true, "5", 1.9: damage
            raise ValueError(f"messages_seq is {seq!r}, not a message number")
        return seq
    except FileNotFoundError:
        return None
    except StateFileTooLarge as exc:
        _position_unreadable(db, path, exc.reason)
        return None
    except StateFileRefused as exc:  # a FIFO, a device, a link to nothing: left where it is
        raise StoreOpenError(f"{exc}; the store's position record cannot be checked") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError, RecursionError) as exc:
        why = "invalid JSON: nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        _position_unreadable(db, path, why)
        return None


def _position_unreadable(db: Path, path: Path, why: str) -> None:
    """A damaged position record (a regular file): moved aside loudly, no position at this start."""
    with contextlib.suppress(OSError):
        move_aside(
            path,
            f"unreadable ({why}): whether {db.name} fell behind its last recorded position cannot be checked at "
            "this start",
        )


def write_position(db: Path, seq: int) -> None:
    """Record that the store holds every message up to rowid `seq` (call only once that is durable)."""
    atomic_write_json(position_path(db), {"messages_seq": seq, "written_at": time.time()}, indent=None)


def messages_seq(conn: sqlite3.Connection) -> int:
    """The highest message rowid ever issued (AUTOINCREMENT: never decreases, even on deletes)."""
    try:
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
    except sqlite3.OperationalError:  # no AUTOINCREMENT table yet
        return 0
    return int(row[0]) if row else 0


def keep_copy(db: Path, label: str) -> Path:
    """Copy the store and its WAL into `<db>.damaged-<label>/` (once per label) before anything
    may change them, so the operator (or a recovery tool) still has every byte."""
    target = db.with_name(f"{db.name}.damaged-{label}")
    if target.is_dir():
        return target
    tmp = db.with_name(f".{db.name}.damaged-{label}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        for src in (db, wal_path(db), shm_path(db)):
            if src.exists():
                shutil.copyfile(src, tmp / src.name)
                os.chmod(tmp / src.name, 0o600)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def preflight(db: Path, *, accept_loss: bool) -> bool:
    """Check an existing store file before the writer opens it; True when it does not exist yet
    (a new store). Raises StoreOpenError with the operator's next step when it must not be used."""
    wal = wal_path(db)
    if db.is_symlink() and not db.exists():
        raise StoreOpenError(
            f"{db} is a symbolic link to {os.readlink(db)}, which does not exist (a disk not mounted?): make the "
            "file it points to available, or remove the link to start a new, empty store"
        )
    if not db.exists():
        if wal.exists() and wal.stat().st_size > WAL_HEADER:
            raise StoreOpenError(
                f"{db} is missing but its write-ahead log {wal.name} ({wal.stat().st_size} bytes) is still there: "
                f"the store was removed with unsaved changes; put {db.name} back, "
                f"or move {wal.name} away to start a new store"
            )
        seq = read_position(db)
        if seq:
            raise StoreOpenError(
                f"{db} is missing, but {position_path(db).name} records that it held messages up to #{seq}: the store "
                "was deleted or moved, or its disk is not mounted; put it back, or remove "
                f"{position_path(db).name} to start a new, empty store"
            )
        position_path(db).unlink(missing_ok=True)  # a store that held nothing: nothing to lose
        return True
    st = db.stat()
    if stat.S_ISDIR(st.st_mode):
        raise StoreOpenError(f"{db} is a directory, not a store: move it away")
    if not stat.S_ISREG(st.st_mode):
        raise StoreOpenError(
            f"{db} is a {file_kind(st.st_mode)}, not a store (a store is a regular file); it was left in place: "
            "put the store back, or move this away to start a new, empty store"
        )
    size = st.st_size
    if size == 0:
        raise StoreOpenError(
            f"{db} is empty (0 bytes), not a store: restore it from a backup, or delete it to start a new, empty store"
        )
    # Our own reads of the files only while nobody has the store open: closing a descriptor we
    # opened would drop the POSIX locks of any SQLite connection of this process on that file.
    first = not attached_elsewhere(db)
    if first:
        with open(db, "rb") as f:
            magic = f.read(len(SQLITE_MAGIC))
        if magic != SQLITE_MAGIC:
            raise StoreOpenError(
                f"{db} is not an SQLite database ({size} bytes, unknown header): restore it from a backup, "
                "or move it away to start a new, empty store"
            )
        check_wal_index(db, accept_loss)  # the crash-time index: before anything opens the store
    # The recorded position before the messages are counted: a server running on this store
    # records newer positions as it goes (its checkpointer), and one recorded after the count (a
    # quick_check of a big file takes seconds) read as a store behind its position, a false alarm.
    recorded = read_position(db)
    try:
        conn = open_read_only(db)
    except sqlite3.Error as exc:
        raise open_error(db, exc) from None
    try:
        try:
            row = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
            ).fetchone()
            version = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] if row else None
            seq = messages_seq(conn)
            # through SQLite, so also while another process has the store open (an operator's shell)
            problem = quick_check(conn) if version and size <= QUICK_CHECK_MAX_BYTES else None
        except sqlite3.Error as exc:
            raise open_error(db, exc) from None
        if problem is not None:
            raise damaged_error(db, problem)
    finally:
        conn.close()  # read-only: closing it checkpoints nothing and keeps the WAL
    if not version:
        raise StoreOpenError(
            f"{db} holds no appserver data (no schema version: another program's database, or an interrupted "
            "first start): move it away or delete it to start a new, empty store"
        )
    if recorded is not None and seq < recorded:
        if not accept_loss:
            kept = keep_copy(db, f"behind-{seq}-of-{recorded}")
            raise StoreOpenError(
                f"{db} is behind its last recorded position (messages up to #{seq}, but #{recorded} were stored "
                f"before): committed conversations are missing (a write-ahead log lost after a crash, or an older "
                f"copy put back). Nothing was changed; a copy is kept in {kept}. Restore the newer store, or "
                f"accept the loss and start with `{ACCEPT_HINT}`"
            )
        log.warning("accepted: %s is behind its last recorded position (#%d < #%d)", db, seq, recorded)
        write_position(db, seq)
    return False


def is_corruption(exc: BaseException) -> bool:
    """An SQLite error that says the file itself is damaged (not busy, full or refused), or stored
    text that is not UTF-8 (bytes changed inside a page, which `quick_check` does not read)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        (code is not None and code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB))
        or "malformed" in str(exc)
        or is_text_damage(exc)
    )


_TEXT_DAMAGE = "Could not decode to UTF-8"  # sqlite3's message for a text value that is no UTF-8


def is_text_damage(exc: BaseException) -> bool:
    """sqlite3 could not read a stored text value as UTF-8 (appserver writes only UTF-8: damage)."""
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(_TEXT_DAMAGE)


def damage_text(exc: BaseException) -> str:
    """The damage an error shows, in one short line: a text that is no UTF-8 is named by its column,
    never quoted (sqlite3's message holds the whole damaged value, raw bytes and all)."""
    text = str(exc)
    if is_text_damage(exc):
        column = text[len(_TEXT_DAMAGE) :].split(" with text ", 1)[0].strip()
        return f"stored text in {column[:80] or 'a column'} is not valid UTF-8: bytes inside a page were changed"
    return text if len(text) <= 300 else text[:300] + "…"


def quick_check(conn: sqlite3.Connection) -> str | None:
    """What `PRAGMA quick_check` found wrong (its first lines), or None for a sound store."""
    rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
    return None if rows == ["ok"] else "; ".join(rows)


def background_check(db: Path, on_damage: Callable[[str], None]) -> None:
    """`quick_check` of a store too big to check before the start, on a connection of its own
    (this is a thread's body): damage found goes to `on_damage`."""
    try:
        conn = open_read_only(db)
        try:
            problem = quick_check(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        problem = str(exc) if is_corruption(exc) else None
        if problem is None:
            log.warning("could not check %s for damage: %s", db, exc)
    if problem is not None:
        on_damage(problem)


def damaged_error(db: Path, problem: str) -> StoreOpenError:
    return StoreOpenError(
        f"{db} is damaged (SQLite's check found: {problem}): restore it from a backup; the file is left as it is. "
        "(`sqlite3 appserver.db .recover` can often save what is readable into a new file)"
    )


def check_store_writable(db: Path) -> None:
    """SQLite opens a file it may not write read-only, without a word, and the first write fails
    with "attempt to write a readonly database": refuse here instead, naming the file. Call before
    anything opens the store: SQLite gives a new `-wal`/`-shm` the database file's mode."""
    for path in (db, db.parent):
        if path.exists() and not os.access(path, os.W_OK):
            what = "directory" if path == db.parent else "file"
            raise StoreOpenError(
                f"cannot write the store's {what} {path} (permission denied or read-only): it must be writable "
                "by the user running appserver; check its owner and mode"
            )
    for path in (wal_path(db), shm_path(db)):
        if path.exists() and not os.access(path, os.W_OK):
            try:  # ours, made read-only by a start on a read-only database file: SQLite's to use
                if path.stat().st_uid != os.geteuid():
                    raise PermissionError
                path.chmod(0o600)
                log.warning("made %s writable again (0600): SQLite needs to write it", path)
            except OSError:
                raise StoreOpenError(
                    f"cannot write the store's file {path} (permission denied or read-only): it must be writable "
                    "by the user running appserver; check its owner and mode"
                ) from None


def open_error(db: Path, exc: sqlite3.Error) -> StoreOpenError:
    """An SQLite error at open, in the operator's terms: full disk, permissions, or damage."""
    text = str(exc)
    try:
        free = shutil.disk_usage(db.parent).free
    except OSError:
        free = None
    if "disk is full" in text or (free is not None and free < 1024 * 1024 and ("I/O" in text or "SHMSIZE" in text)):
        return StoreOpenError(
            f"no space left to open {db} ({free if free is not None else '?'} bytes free; SQLite: {text}): "
            "free some space on that device and start again"
        )
    if "I/O" in text and at_size_limit(db):
        return StoreOpenError(f"{size_limit_cause(db)}; raise the limit and start again (SQLite: {text})")
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        return StoreOpenError(
            f"cannot open {db} ({text}): check the owner and permissions of the file and its directory"
        )
    if "malformed" in text or "not a database" in text or "encrypted" in text:
        return StoreOpenError(f"{db} is damaged ({text}): restore it from a backup (the file is left as it is)")
    return StoreOpenError(f"cannot open {db}: {text}")


def at_size_limit(db: Path) -> bool:
    """The store's files (none yet: a new store) are at this process's file size limit (`ulimit -f`):
    SQLite's "disk I/O error" is then the limit's EFBIG, not a failing disk."""
    limit = file_size_limit()
    if limit is None:
        return False
    sizes = [0]
    for path in (db, wal_path(db)):
        with contextlib.suppress(OSError):
            sizes.append(path.stat().st_size)
    return max(sizes) + FSIZE_MARGIN >= limit


def create_store(db: Path, migrate: Callable[[sqlite3.Connection], object]) -> bool:
    """Make a new store under a temporary name and link it into place: a start that fails half
    way (a full disk) leaves no file that the next start would take for a damaged store. False
    when another process created it meanwhile (theirs is kept, ours dropped)."""
    tmp = db.with_name(f".{db.name}.new-{os.getpid()}")
    for leftover in (tmp, wal_path(tmp), tmp.with_name(tmp.name + "-shm")):
        leftover.unlink(missing_ok=True)
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # SQLite's -wal/-shm copy its mode
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate(conn)
        finally:
            conn.close()  # the only connection: checkpoints everything and removes the WAL
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, db)  # never replaces: a store another process just made stays
            created = True
        except FileExistsError:
            created = False
        except OSError:  # a file system without hard links
            os.replace(tmp, db)
            created = True
    finally:
        for leftover in (tmp, wal_path(tmp), tmp.with_name(tmp.name + "-shm")):
            leftover.unlink(missing_ok=True)
    fsync_dir(db.parent)
    return created
