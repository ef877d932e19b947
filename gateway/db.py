"""The gateway's one SQLite database: open it in WAL, migrate it, and move a corrupt file aside.

Ledger, routes, pairing and approval prompts live in `$APPSERVER_HOME/channels/gateway.db` (DESIGN §13). A file
that is not a readable database is renamed to `gateway.db.corrupt-<timestamp>` with a loud error and
never emptied: the records in it may be the only trace of messages a person sent. So is one whose
write-ahead log is damaged (`_wal_damage`): SQLite would drop the log's commits without a word.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appserver.sqlitewal import judged_while_still, read_wal_index, side_link_problem, wal_loss, wal_path
from gateway.sqlstore import is_pg
from plugins.contract import env_seconds
from plugins.loader import atomic_write_text, move_aside

log = logging.getLogger("gateway.db")

# Append a new entry to add a version; never edit a released one.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE ledger (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            channel TEXT NOT NULL,
            account TEXT NOT NULL,
            message_id TEXT NOT NULL,
            chat TEXT NOT NULL,
            thread TEXT,
            sender TEXT NOT NULL,
            payload TEXT NOT NULL DEFAULT '{}',
            state TEXT NOT NULL,
            decision TEXT,
            reason TEXT,
            turn_id TEXT,
            reply TEXT,
            remote_ids TEXT NOT NULL DEFAULT '[]',
            received_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            UNIQUE (channel, account, message_id)
        );
        CREATE INDEX ledger_state ON ledger(state, id);

        CREATE TABLE routes (
            key TEXT PRIMARY KEY,
            agent TEXT NOT NULL,
            conversation TEXT,
            created_at REAL NOT NULL
        );

        CREATE TABLE route_conversations (
            key TEXT PRIMARY KEY,
            conversation TEXT NOT NULL,
            bound_at REAL NOT NULL
        );
        """,
    ),
    (
        2,
        """
        ALTER TABLE ledger ADD COLUMN conversation TEXT;

        CREATE TABLE account_status (
            channel TEXT NOT NULL,
            account TEXT NOT NULL,
            state TEXT NOT NULL,
            reason TEXT,
            last_inbound REAL,
            last_outbound REAL,
            messages_in INTEGER NOT NULL DEFAULT 0,
            turns INTEGER NOT NULL DEFAULT 0,
            replies INTEGER NOT NULL DEFAULT 0,
            failures INTEGER NOT NULL DEFAULT 0,
            updated_at REAL NOT NULL,
            PRIMARY KEY (channel, account)
        );
        """,
    ),
    (
        3,
        """
        CREATE TABLE pairing_codes (
            code TEXT PRIMARY KEY,
            channel TEXT NOT NULL,
            account TEXT NOT NULL,
            sender TEXT NOT NULL,
            sender_name TEXT,
            chat TEXT NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL NOT NULL,
            status TEXT NOT NULL,
            decided_at REAL,
            handled INTEGER NOT NULL DEFAULT 0
        );
        CREATE INDEX pairing_pending ON pairing_codes(channel, account, status);

        CREATE TABLE approved_senders (
            channel TEXT NOT NULL,
            account TEXT NOT NULL,
            sender TEXT NOT NULL,
            approved_at REAL NOT NULL,
            code TEXT,
            PRIMARY KEY (channel, account, sender)
        );
        """,
    ),
    (
        4,
        """
        ALTER TABLE ledger ADD COLUMN batch TEXT;
        CREATE INDEX ledger_batch ON ledger(channel, account, batch);
        """,
    ),
    (
        5,
        """
        ALTER TABLE ledger ADD COLUMN sending TEXT;
        """,
    ),
    (
        6,
        """
        CREATE TABLE approval_prompts (
            call_id TEXT PRIMARY KEY,
            account TEXT NOT NULL,
            part_key TEXT NOT NULL,
            attempted_at REAL NOT NULL,
            message_ids TEXT NOT NULL DEFAULT '[]'
        );
        """,
    ),
    (
        7,
        """
        ALTER TABLE approval_prompts ADD COLUMN conversation TEXT;
        ALTER TABLE approval_prompts ADD COLUMN turn_id TEXT;
        ALTER TABLE approval_prompts ADD COLUMN chat TEXT;
        ALTER TABLE approval_prompts ADD COLUMN thread TEXT;
        ALTER TABLE approval_prompts ADD COLUMN reply_to TEXT;
        ALTER TABLE approval_prompts ADD COLUMN starter TEXT;
        ALTER TABLE approval_prompts ADD COLUMN name TEXT;
        ALTER TABLE approval_prompts ADD COLUMN arguments TEXT;
        """,
    ),
    (
        8,
        """
        CREATE INDEX ledger_chat ON ledger(channel, account, chat);
        """,
    ),
    (
        9,
        """
        ALTER TABLE account_status ADD COLUMN last_failure_at REAL;
        ALTER TABLE account_status ADD COLUMN last_failure_reason TEXT;
        """,
    ),
    (
        10,
        """
        CREATE TABLE pairing_revokes (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            made INTEGER NOT NULL,
            applied INTEGER NOT NULL
        );
        INSERT INTO pairing_revokes (id, made, applied) VALUES (1, 0, 0);
        """,
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]

# The files SQLite keeps beside the ledger (beside the file itself, for one reached through a link)
SIDE_FILES = (("-wal", "write-ahead log"), ("-shm", "shared-memory index"), ("-journal", "rollback journal"))
NEW_LEDGER_AFTER_REMOVAL = " (the gateway then starts a new, empty ledger)"
EXIT_LEDGER_GONE = 4  # the gateway's exit code when its open ledger file was deleted under it
# How long a write waits for another process's write lock (a backup tool, an `sqlite3` shell) before
# it is refused and tried again later; a test shortens it through the environment.
BUSY_TIMEOUT_S = 5.0
BUSY_TIMEOUT_ENV = "APPSERVER_GATEWAY_DB_BUSY_TIMEOUT_S"
ORPHAN_LOCK_WAIT_S = 2.0  # how long a command waits for another one setting a gone file's -wal aside


class CorruptGatewayDB(Exception):
    """gateway.db could not be read as a database; it was moved aside to `moved_to`."""

    def __init__(self, path: Path, moved_to: Path, reason: str) -> None:
        super().__init__(f"{path} is not a readable database ({reason}); moved aside to {moved_to}")
        self.path = path
        self.moved_to = moved_to
        self.reason = reason


class CorruptGatewayDBInUse(Exception):
    """gateway.db could not be read, but a running gateway holds it (`channels/gateway.lock`): left
    where it is. Moved aside under it, the gateway would go on in the renamed file while every
    command after this one read and wrote a new, empty one that the gateway never reads."""

    def __init__(self, path: Path, reason: str, holder: str) -> None:
        super().__init__(
            f"{path} is not a readable database ({reason}), but the running gateway ({holder}) holds it: "
            "it was left in place; stop the server (or restart its gateway), which moves it aside and "
            "starts a new, empty ledger"
        )
        self.path = path
        self.reason = reason
        self.holder = holder


class _LedgerConnection(sqlite3.Connection):
    """A connection that remembers the file it opened (the path it was asked for, gateway.db, with
    the device and inode of the file that path led to), so a write can tell that the path no longer
    leads to it: deleted, replaced, or a symbolic link re-pointed (`_check_still_there`). None: not
    watched. `opened_file`: that file's own path (the link's target). And the `-wal`/`-shm` it uses
    (same triple), beside that file: set aside once that file is gone from there, never replayed
    by SQLite onto the file now at its path."""

    opened: tuple[Path, int, int] | None = None
    opened_file: Path | None = None
    sidecars: tuple[tuple[Path, int, int], ...] = ()


class SchemaTooNew(Exception):
    """The file was written by a newer gateway; refuse rather than guess."""


class LedgerFileRefused(OSError):
    """gateway.db, or a file SQLite keeps beside it (`-wal`, `-shm`, `-journal`), that the gateway
    will not use as it is: a symbolic link to nothing (an unmounted disk: never "not yet", never
    replaced by a new, empty ledger), not a regular file, or one SQLite cannot write. Left in place,
    never moved aside. An OSError naming the file, so every handler shows it as one line. (The
    gateway's copy of appserver/fsutil.py's `StateFileRefused`: it imports nothing of the server's.)"""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(errno.EINVAL, problem, str(path))
        self.path = Path(path)
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


class LedgerMissingInUse(LedgerFileRefused):
    """gateway.db is missing (deleted), but a running gateway holds `channels/gateway.lock`: it
    still writes to the deleted file, so a new, empty ledger made here would be one it never reads
    (a stranger's pairing code that `pairing list` never shows). Nothing is created."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(
            path,
            f"the file is missing, but the running gateway ({holder}) still has the deleted ledger open: "
            "nothing was created; restart the server (or kill its gateway child, which the server restarts), "
            "which starts a new, empty ledger (what the deleted one held is lost)",
        )
        self.holder = holder


class LedgerReplacedInUse(LedgerFileRefused):
    """gateway.db is another file (a backup renamed over it) than the one the running gateway opened
    (its identity, recorded in `channels/gateway.opened`): the `-wal`/`-shm` at the path are still the
    old file's, and SQLite would replay them into this one (a silent mix of two ledgers). Refused
    before SQLite touches anything; the gateway exits at its next write and restarts on the file."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(
            path,
            f"the file was replaced while the running gateway ({holder}) still has the old one open: "
            "nothing was read or written; restart the server (or kill its gateway child, which the server "
            "restarts) to use the new file",
        )
        self.holder = holder


def default_path(home: Path | None = None) -> Path:
    """`$APPSERVER_HOME/channels/gateway.db` (home defaults to the environment, then ~/.appserver)."""
    if home is None:
        home = Path(os.environ.get("APPSERVER_HOME") or Path.home() / ".appserver")
    return home / "channels" / "gateway.db"


def ledger_exists(path: Path) -> bool:
    """Whether gateway.db exists. A symbolic link to nothing is not "no ledger yet" (its disk may
    not be mounted): `LedgerFileRefused`, naming the link and its target, unless the file it named
    was moved aside as corrupt (`_ledger_stat`). Nor is a file deleted under a running gateway
    (`LedgerMissingInUse`): it still holds everything, in the deleted file."""
    if _ledger_stat(path) is not None:
        return True
    _refuse_missing_in_use(path, path.with_name("gateway.lock"))
    return False


def open_db(path: Path, *, gateway: bool = False) -> sqlite3.Connection:
    """Open (creating if needed) and migrate the database; raise `CorruptGatewayDB` after moving a
    corrupt file aside. A database that is only busy, unreadable for its permissions or on a failing
    disk raises its `sqlite3.Error` and stays where it is: moving a healthy ledger aside because
    another process held its lock would split the gateway's state in two. So does a corrupt one
    that a running gateway holds, when anyone but that gateway (`gateway=True`, holding
    `gateway.lock`) opens it: `CorruptGatewayDBInUse`; and a missing one it holds open, deleted:
    `LedgerMissingInUse`, never a new, empty ledger beside it. A link to nothing, a file that is no
    regular file (itself or its `-wal`/`-shm`/`-journal`) or one SQLite can only read:
    `LedgerFileRefused`. The gateway's own connection is watched: see `transaction`."""
    lock = None if gateway else Path(path).with_name("gateway.lock")
    asked = Path(path).absolute()  # gateway.db, perhaps a link: what a command opens is where it leads then
    path = _ledger_file(asked)
    if not os.path.lexists(path):
        _begin_new_ledger(path, lock)
    elif lock is not None:
        _refuse_replaced_in_use(path, lock)
    _create_whole(path)
    if path.is_file() and path.stat().st_size == 0:
        # SQLite opens an empty file as a new database, but a ledger never has 0 bytes (it is
        # created whole, above): this one was truncated, and its -wal may hold the rest.
        raise _move_aside(path, "the file is empty (0 bytes)", lock)
    wal_damage = _wal_damage(path)
    if wal_damage is not None:
        raise _move_aside(path, wal_damage, lock)
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=_LedgerConnection)
    except sqlite3.OperationalError as exc:
        raise _not_writable(path, exc) or exc from None
    damage: str | None = None
    try:
        conn.execute(f"PRAGMA busy_timeout = {round(env_seconds(BUSY_TIMEOUT_ENV, BUSY_TIMEOUT_S) * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        row = conn.execute("PRAGMA quick_check").fetchone()
        if row is None or row[0] != "ok":
            damage = f"quick_check: {row[0] if row else 'no answer'}"
        else:
            _migrate(conn)
            _check_writable(conn)
    except sqlite3.DatabaseError as exc:
        if not _corrupt(exc):
            conn.close()
            refused = _not_writable(path, exc)
            if refused is not None:
                raise refused from None
            raise
        damage = str(exc)
    except BaseException:
        conn.close()
        raise
    if damage is not None:
        conn.close()
        raise _move_aside(path, damage, lock)
    os.chmod(path, 0o600)
    if gateway:
        _watch(conn, asked, path)
    return conn


def _wal_damage(path: Path) -> str | None:
    """`_wal_damage_now`, a verdict of damage standing only while the files stayed as they were
    (`judged_while_still`): a CLI command that opened and closed the ledger meanwhile copied the log
    into it and removed it, which read as a log missing although its index counted frames."""
    return judged_while_still(path, lambda: _wal_damage_now(path), lambda damage: damage is not None)


def _wal_damage_now(path: Path) -> str | None:
    """What is wrong with the ledger's `-wal`, when SQLite would drop changes committed in it
    without a word (appserver/sqlitewal.py's `wal_loss`, which judges appserver.db the same way);
    None when it keeps them all, or when a connection has the ledger open. Judged before a writer
    opens the ledger, against the crash-time index (`-shm`), read first: the first connection
    recovers the WAL and rewrites it."""
    loss = wal_loss(path, read_wal_index(path))
    return None if loss is None else f"its write-ahead log {wal_path(path).name} {loss.problem}"


def _watch(conn: _LedgerConnection, asked: Path, file: Path) -> None:
    """Remember the file the gateway's connection opened (`file`, which `asked` led to) and the
    -wal/-shm it uses (both exist once WAL mode is on and the file was read, as it was above), for
    `_check_still_there`. The path kept is `asked`, not the link's target: a command resolves the
    link again each time it opens the ledger, so the gateway's check must too."""
    st = os.stat(file)
    conn.opened = (asked, st.st_dev, st.st_ino)
    conn.opened_file = file
    sidecars = []
    for side in _sidecars(file)[:2]:
        try:
            side_st = os.stat(side)
        except FileNotFoundError:
            continue
        sidecars.append((side, side_st.st_dev, side_st.st_ino))
    conn.sidecars = tuple(sidecars)


def _begin_new_ledger(path: Path, lock: Path | None) -> None:
    """gateway.db is missing. A command (`lock`: gateway.lock) refuses while a running gateway still
    has the deleted file open (`LedgerMissingInUse`). A `-wal`/`-shm`/`-journal` left beside the
    missing file belongs to the file that is gone (deleted or moved away, its gateway killed):
    SQLite would replay its writes onto the new ledger (old rows in a "new, empty" ledger, or a
    mix of two files), so it is set aside first, loudly, and the new ledger is made meanwhile
    under gateway.lock (a second opener then finds the file, never the new ledger's own -wal)."""
    if lock is None:  # the gateway, which holds gateway.lock
        _set_aside_orphans(path)
        log.info(  # a loss under a running gateway was logged as an error when it ended
            "%s does not exist: starting a new, empty ledger (a first start, or the old one was moved or deleted)",
            path,
        )
        return
    _refuse_missing_in_use(path, lock)
    if not any(os.path.lexists(side) for side in _sidecars(path)):
        return
    with _holding_lock(path, lock):
        if not os.path.lexists(path):
            _set_aside_orphans(path)
            _create_whole(path)


@contextmanager
def _holding_lock(path: Path, lock: Path) -> Iterator[None]:
    """Hold gateway.lock (flock) for a moment, as the gateway does; another command holding it is
    waited for (`ORPHAN_LOCK_WAIT_S`), a gateway is named (`LedgerMissingInUse`). No lock file: no
    gateway ever ran here, nothing to take."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + ORPHAN_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerMissingInUse(path, _holder_name(fd)) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _set_aside_orphans(path: Path) -> None:
    """Rename each `-wal`/`-shm`/`-journal` beside the missing `path` to
    `<name>.orphaned-<UTC timestamp>` (kept: it may hold the gone file's last writes)."""
    for side in _sidecars(path):
        if os.path.lexists(path):  # another opener made the new ledger meanwhile: its own files
            return
        moved_to = _rename_orphan(side)
        if moved_to is not None:
            log.error(
                "%s does not exist, but %s was left beside it (the write-ahead state of a file deleted or replaced): "
                "moved aside to %s, so SQLite does not replay it onto the new, empty ledger",
                path,
                side.name,
                moved_to,
            )


def _rename_orphan(side: Path) -> Path | None:
    """`side` renamed to `<name>.orphaned-<UTC timestamp>` (never over a file); None if it is gone."""
    try:
        return move_aside(side, "orphaned")
    except FileNotFoundError:
        return None


def gateway_running(path: Path) -> bool:
    """Whether a gateway runs on the ledger at `path` now: it holds `gateway.lock` beside it."""
    return _lock_holder(Path(path).with_name("gateway.lock")) is not None


def _refuse_missing_in_use(path: Path, lock: Path) -> None:
    """`LedgerMissingInUse` when a running gateway holds `lock` (the ledger at `path` is missing)."""
    holder = _lock_holder(lock)
    if holder is not None:
        raise LedgerMissingInUse(path, holder)


def _lock_holder(lock: Path) -> str | None:
    """Who holds `lock` (flock), in words; None when nobody does (or there is no lock file)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_name(fd)
        return None
    finally:
        os.close(fd)  # releases the lock


def _holder_name(fd: int) -> str:
    pid = lock_pid(fd)
    return f"pid {pid}" if pid is not None else "a gateway process"


def lock_pid(fd: int) -> str | None:
    """The pid the gateway holding gateway.lock wrote in it (its first line)."""
    first = os.pread(fd, 32, 0).decode("ascii", "replace").split("\n", 1)[0].strip()
    return first if first.isdigit() else None


def opened_record(lock: Path) -> Path:
    """`channels/gateway.opened`: "<pid> <st_dev> <st_ino>" of the ledger file the gateway with that
    pid opened. Beside gateway.lock, which keeps only the pid (people and scripts read it)."""
    return lock.with_name("gateway.opened")


def record_opened_ledger(lock: Path, conn: sqlite3.Connection) -> None:
    """Record (atomically: `atomic_write_text`) the identity of the file the gateway's
    connection opened, so a command can tell, without opening it with SQLite, that the file now at
    the path is another one (`LedgerReplacedInUse`). Called by the gateway holding `lock`."""
    opened = getattr(conn, "opened", None)
    if opened is None:
        return
    _, dev, ino = opened
    record = opened_record(lock)
    try:
        atomic_write_text(record, f"{os.getpid()} {dev} {ino}\n")
    except OSError as exc:  # commands then cannot tell a replaced file: logged, the gateway runs on
        log.warning("could not record the ledger's identity in %s: %s", record, exc)


def _recorded_ledger(lock: Path, holder_pid: str | None) -> tuple[int, int] | None:
    """The (device, inode) the gateway with `holder_pid` recorded; None when there is no record,
    or it is another (earlier) gateway's, or not whole."""
    try:
        words = opened_record(lock).read_text(encoding="ascii", errors="replace").split()
    except OSError:
        return None
    if len(words) != 3 or not all(w.isdigit() for w in words) or words[0] != holder_pid:
        return None
    return int(words[1]), int(words[2])


def _refuse_replaced_in_use(path: Path, lock: Path) -> None:
    """`LedgerReplacedInUse` when the file at `path` is not the one the gateway holding `lock`
    opened. Checked before SQLite opens it: it would use the old file's -wal/-shm with it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # no lock file: no gateway ever ran here
        return
    try:
        recorded = _recorded_ledger(lock, lock_pid(fd))
        if recorded is None:
            return
        try:
            st = os.stat(path)
        except OSError:  # gone meanwhile: SQLite's own error (or the next open) says more
            return
        if (st.st_dev, st.st_ino) == recorded:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LedgerReplacedInUse(path, _holder_name(fd)) from None
    finally:
        os.close(fd)  # releases the lock, if we took it (no gateway runs: the record is stale)


def _check_still_there(conn: sqlite3.Connection) -> None:
    """End the gateway when its path (gateway.db) no longer leads to the file its connection
    opened (deleted, replaced by another, or a symbolic link re-pointed at another): every write
    would go to a file no command reads (a stranger's pairing code that `pairing list` never shows).
    The stat(2) follows the link as it is now, as a command's open does (`_refuse_replaced_in_use`):
    one per write transaction (microseconds); reads are not checked. The process exits at once
    (`EXIT_LEDGER_GONE`), before the write begins: not an exception, which the gateway's loops catch
    to keep its channels running, nor a shutdown that writes more. An update not recorded is not
    acknowledged, so its platform delivers it again to the gateway the supervisor restarts, on the
    file now at the path."""
    opened = getattr(conn, "opened", None)
    if opened is None:
        return
    path, dev, ino = opened
    try:
        st = os.stat(path)
    except FileNotFoundError:
        what = "deleted"
    except OSError:  # unreadable for a moment: SQLite's own error says more
        return
    else:
        if (st.st_dev, st.st_ino) == (dev, ino):
            return
        what = "replaced by another file"
    log.error(
        "%s was %s while the gateway had it open: exiting (code %d) to restart on a new ledger; what the old "
        "file held (history, routes, approvals, pairing codes) is lost unless it is put back, the server stopped",
        _described(path),
        what,
        EXIT_LEDGER_GONE,
    )
    opened_file = getattr(conn, "opened_file", None)
    if opened_file is not None and _is_file(opened_file, dev, ino):
        # only a link was re-pointed: the file it led to is still at its own path, with its own
        # -wal/-shm beside it (its last writes), which SQLite never opens with another file
        log.error("%s, the file it led to, is still there with its -wal and -shm: left as it is", opened_file)
    else:
        _set_aside_own_sidecars(getattr(conn, "sidecars", ()))
    logging.shutdown()  # flushes the log before the abrupt exit
    os._exit(EXIT_LEDGER_GONE)


def _described(path: Path) -> str:
    """`path`, and where it leads now when it is a symbolic link."""
    try:
        return f"{path} (a symbolic link, now to {os.readlink(path)})"
    except OSError:  # not a link, or gone
        return str(path)


def _is_file(path: Path, dev: int, ino: int) -> bool:
    """Whether `path` is (still) the file with this device and inode."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _set_aside_own_sidecars(sidecars: tuple[tuple[Path, int, int], ...]) -> None:
    """The -wal/-shm at the path that are still the ones the gateway's connection used hold the
    gone file's writes: set aside (`<name>.orphaned-<timestamp>`), so the restarted gateway's SQLite
    never replays them onto the file now at the path (a restored backup undone, a deleted ledger
    back in a "new, empty" one). Another file there (a restored -wal of its own) is left alone."""
    for side, dev, ino in sidecars:
        try:
            st = os.stat(side)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) != (dev, ino):
            continue
        moved_to = _rename_orphan(side)
        if moved_to is not None:
            log.error("%s belonged to the file that is gone: moved aside to %s", side, moved_to)


def _ledger_file(path: Path) -> Path:
    """The file the ledger is in: `path`, or the existing file its symbolic link names (on another
    disk, say; where it will be made, when a corrupt one was moved aside from there). Only the home's
    own `channels/` directory is made: never the directories a link points into (a disk not mounted
    would get a new, empty ledger on the root file system)."""
    _make_channels_dir(path.parent)
    st = _ledger_stat(path)
    if st is not None:
        _check_regular(path, st, "the gateway keeps its ledger only in a regular file")
    real = Path(os.path.realpath(path))
    for suffix, role in SIDE_FILES:
        side = real.with_name(real.name + suffix)
        st = _side_stat(side, real.name, role)
        if st is not None:  # SQLite would open the ledger read-only in silence, or fail naming no file
            _check_regular(side, st, f"SQLite keeps {real.name}'s {role} here and cannot use this one")
    return real


def _make_channels_dir(folder: Path) -> None:
    """`channels/` (0700); one that is a symbolic link to nothing is named as such."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        _refuse_dangling(folder)
        raise


def _ledger_stat(path: Path) -> os.stat_result | None:
    """stat(2) of gateway.db through links; None when there is no ledger yet. A link to nothing is
    refused (`_refuse_dangling`: its disk may not be mounted), except one whose target was moved
    aside here as corrupt (`<target>.corrupt-<timestamp>` beside where it was, in a directory that
    is there): that is where the new, empty ledger is made, as for a gateway.db that is no link."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if not _target_moved_aside(path):
            _refuse_dangling(path, NEW_LEDGER_AFTER_REMOVAL)
        return None


def _target_moved_aside(path: Path) -> bool:
    """Whether `path` is a link whose missing target has a `.corrupt-*` file of ours beside it (an
    unmounted disk's mount point shows neither: the file set aside is on that disk)."""
    if not os.path.islink(path):
        return False
    target = Path(os.path.realpath(path))
    try:
        names = os.listdir(target.parent)
    except OSError:
        return False
    return any(name.startswith(f"{target.name}.corrupt-") for name in names)


def _side_stat(side: Path, db_name: str, role: str) -> os.stat_result | None:
    """lstat(2) of a file SQLite keeps beside the ledger: it opens them only when they are no link
    (O_NOFOLLOW), and fails naming no file. A link is refused here, naming it and where it leads
    (`side_link_problem`: said as for appserver.db's)."""
    try:
        st = os.lstat(side)
    except FileNotFoundError:
        return None
    problem = side_link_problem(side, db_name, role) if stat.S_ISLNK(st.st_mode) else None
    if problem is not None:
        raise LedgerFileRefused(side, problem)
    return st


def _refuse_dangling(path: Path, after_removal: str = "") -> None:
    try:
        target = os.readlink(path)
    except OSError:  # not a link, or gone
        return
    raise LedgerFileRefused(
        path,
        f"a symbolic link to {target}, which does not exist: make the file it points to available "
        f"(is its disk mounted?), or remove the link{after_removal}",
    )


def _check_regular(path: Path, st: os.stat_result, why: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise LedgerFileRefused(
            path,
            f"a {_kind(st.st_mode)}, not a regular file: {why}; it was left in place (never moved aside): "
            "move it away, then start again",
        )


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


def _check_writable(conn: sqlite3.Connection) -> None:
    """SQLite opens a ledger it may not write read-only without a word; the first write (the
    gateway's, seconds later, as a traceback) failed with "attempt to write a readonly database".
    A write lock taken and dropped here makes that an error at open, naming the file."""
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("ROLLBACK")


def _not_writable(path: Path, exc: sqlite3.DatabaseError) -> LedgerFileRefused | None:
    """SQLite's "read-only" and "cannot open" in the operator's terms, naming the file."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None or code & 0xFF not in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
        return None
    return LedgerFileRefused(
        path,
        f"SQLite cannot open it for writing ({exc}): the file, its -wal and -shm beside it and its directory must be "
        "writable by the user running appserver; it was left as it is",
    )


def _corrupt(exc: sqlite3.DatabaseError) -> bool:
    """SQLite says the file is damaged or no database at all (not: busy, locked, read-only, I/O)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _create_whole(path: Path) -> None:
    """A missing gateway.db appears with its header already written (made under another name, then
    linked into place), so a process that opens it meanwhile never sees a 0-byte file, which is
    what a truncated ledger looks like. Where hard links are not supported, SQLite creates it."""
    _drop_stale_temporaries(path)
    if os.path.lexists(path):
        return
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # writes the header; the mode is kept in it
        finally:
            conn.close()
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)  # never over a file another process created meanwhile
        except FileExistsError:
            pass
        except OSError as exc:
            log.debug("could not link %s into place (%s); SQLite creates it", path, exc)
    finally:
        for leftover in (tmp, *_sidecars(tmp)):
            leftover.unlink(missing_ok=True)


def _drop_stale_temporaries(path: Path) -> None:
    """The temporaries of creators that died before cleaning up (a kill -9 mid-creation): each
    name carries its creator's pid, so a live creator's file is left alone."""
    for tmp in path.parent.glob(f".{path.name}.new-*"):
        pid = tmp.name[len(f".{path.name}.new-") :].split("-", 1)[0]
        if not (pid.isascii() and pid.isdigit() and len(pid) < 10) or _alive(int(pid)):
            continue
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """The gateway's own check (it imports nothing of the server's but the client)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _sidecars(path: Path) -> tuple[Path, Path, Path]:
    return tuple(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal"))  # type: ignore[return-value]


@contextmanager
def transaction(conn: sqlite3.Connection, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
    """One write transaction, taken up front (IMMEDIATE) so readers never upgrade mid-way.

    `durable` commits with an fsync (`synchronous = FULL`): the write survives a power loss. Without
    it (`NORMAL`, in WAL) the commit survives the process being killed but may be rolled back by a
    power loss, at a fortieth of the cost; the ledger uses that for the steps after receipt, whose
    loss only repeats a step (an idempotent submit, or a reply sent again). The gateway's own
    connection first checks its file is still the one at the path (`_check_still_there`). On the
    server's PostgreSQL database (`gateway/sqlstore.py`) the same block is one PostgreSQL
    transaction, under the gateway's write lock and fenced by the cluster's `channel_owners`."""
    if is_pg(conn):
        with conn.transaction() as pg:  # type: ignore[attr-defined]
            yield pg
        return
    _check_still_there(conn)
    conn.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _migrate(conn: sqlite3.Connection) -> None:
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise SchemaTooNew(f"gateway.db has schema {current}; this gateway knows up to {SCHEMA_VERSION}")
    for version, script in MIGRATIONS:
        if version <= current:
            continue
        # Another process (the CLI beside a starting gateway) may be migrating the same file: take
        # the write lock first, then look again, so a version is never applied twice.
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            if version <= current:
                conn.execute("COMMIT")
                continue
            for statement in _statements(script):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        current = version


def _statements(script: str) -> list[str]:
    """The statements of a migration script (no statement of ours contains a ';' in a literal)."""
    return [s.strip() for s in script.split(";") if s.strip()]


def _move_aside(path: Path, reason: str, lock: Path | None) -> CorruptGatewayDB | CorruptGatewayDBInUse:
    """Move the damaged ledger aside, unless a running gateway holds `lock` (then leave it: the
    gateway moves it aside itself when it next starts). The lock is held while moving, so a gateway
    starting meanwhile opens the new file, not the one being moved."""
    if lock is None:
        return _moved(path, reason)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # no lock file (no gateway ever ran here), or none that a gateway could hold
        return _moved(path, reason)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_name(fd)
            log.error("gateway.db is corrupt (%s); the running gateway (%s) holds it: left in place", reason, holder)
            return CorruptGatewayDBInUse(path, reason, holder)
        return _moved(path, reason)
    finally:
        os.close(fd)  # releases the lock


def _moved(path: Path, reason: str) -> CorruptGatewayDB:
    """`path` is the ledger's own file (a link's target): set aside beside itself, so a link to it
    then leads to where the new ledger is made (`_ledger_stat`), never dangling for good."""
    moved_to = move_aside(path)
    sides = []
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, moved_to.with_name(moved_to.name + suffix))
            sides.append(moved_to.name + suffix)
    log.error(
        "gateway.db is corrupt (%s): moved aside to %s%s; a new ledger starts empty",
        reason,
        moved_to,
        f" (with {' and '.join(sides)} beside it)" if sides else "",
    )
    return CorruptGatewayDB(path, moved_to, reason)
