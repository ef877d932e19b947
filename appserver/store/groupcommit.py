"""Group commit for the single SQLite writer: writes made during one event-loop pass share one
transaction.

Under load this turns N turn commits (and their WAL writes) into one. The engine knows nothing of
the tables: a job is any `Callable[[sqlite3.Connection], None]`; the queries live in sqlite.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from appserver.fsutil import os_error_line
from appserver.store.base import NOTHING_WRITTEN, StoreUnavailable, WriteRefused

log = logging.getLogger("appserver.store")

Job = Callable[[sqlite3.Connection], None]

# Under load a group stays open while the loop has other work to run, since that work may add to
# it, up to this long or this many jobs: each COMMIT writes the tables' and indexes' last pages to
# the WAL whatever the group's size, so at concurrency 64 groups about twice as large (~40 jobs,
# ~10 turns) cost about a fifth less CPU per request (bench/ab.py). A lone write still commits at
# once: with nothing else runnable, nothing could join it.
GROUP_WINDOW_S = 0.005
GROUP_MAX_JOBS = 512

# Every wait has a timeout, and this one blocks the event loop (SQLite's calls are synchronous):
# a write waits this long for the file's write lock another process holds before it fails with
# StoreUnavailable (HTTP 503 `store_unavailable`). A CLI command of this home usually holds it for
# milliseconds, but one that changes much at once (`agents delete` of an agent with 200,000
# conversations: 5-7 s) holds it for seconds, and 2 s turned such a command into a run of 503s
# for requests that used to wait; a lock held past this is someone else's doing (another
# program's transaction, `BEGIN EXCLUSIVE` in an `sqlite3` shell) and gets a clear error, not a
# server that stalls 10 s per queued write (LOCKED_TRY_S).
LOCK_WAIT_S = 5.0
# Once a write found the file locked, the next ones only try (this long) until one gets through:
# the writes queued behind it fail at once instead of waiting LOCK_WAIT_S each.
LOCKED_TRY_S = 0.05
_BUSY = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (the low byte of an extended code)


class StoreFull(WriteRefused, sqlite3.OperationalError):
    """The disk holding the SQLite file is full (SQLITE_FULL), or a write went past this process's
    file size limit (`ulimit -f`, EFBIG): nothing of the write stayed; the store is unavailable
    until there is room (HTTP 503 `store_unavailable`), not broken."""

    def __init__(self, why: str, remedy: str = "free some space (the server goes on once there is room)") -> None:
        super().__init__(f"{why}: {NOTHING_WRITTEN}; {remedy}")


SQLITE_FULL = 13
SQLITE_IOERR = 10  # the low byte of every "disk I/O error" (a write past RLIMIT_FSIZE fails with EFBIG)
# A write past the file size limit writes up to it, then fails: a store file this close to the
# limit is at it (a WAL frame is a page and its header; a commit of big messages, a few pages).
FSIZE_MARGIN = 256 * 1024


def is_full(exc: BaseException) -> bool:
    """`exc` is SQLite's "database or disk is full"."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and isinstance(code, int) and code & 0xFF == SQLITE_FULL


def is_io_error(exc: BaseException) -> bool:
    """`exc` is SQLite's "disk I/O error" (of any kind: a write, a truncate, the shared memory)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and isinstance(code, int) and code & 0xFF == SQLITE_IOERR


def file_size_limit() -> int | None:
    """This process's file size limit (`ulimit -f`) in bytes; None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def over_size_limit(files: Sequence[Path]) -> Path | None:
    """The first of `files` within FSIZE_MARGIN of the file size limit, or None: SQLite says only
    "disk I/O error" for a write the limit refused (EFBIG), so the sizes tell it from a failing disk."""
    limit = file_size_limit()
    if limit is None:
        return None
    for path in files:
        with suppress(OSError):
            if path.stat().st_size + FSIZE_MARGIN >= limit:
                return path
    return None


def size_limit_cause(path: Path) -> str:
    """`path` cannot grow past the file size limit, as every command words it (fsutil.py), without
    its "try again" (the caller says what to do)."""
    line = os_error_line(OSError(errno.EFBIG, "File too large", str(path))) or str(path)
    return line.split("; ")[0]


class StoreLocked(WriteRefused, sqlite3.OperationalError):
    """Another process holds the SQLite file's write lock past LOCK_WAIT_S: the store is
    unavailable (HTTP 503 `store_unavailable`), and still SQLite's own OperationalError to code
    that knows that one."""


def is_locked(exc: BaseException) -> bool:
    """`exc` is SQLite's "database is locked" (another connection holds the lock it needs)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, sqlite3.OperationalError) and isinstance(code, int):
        return code & 0xFF in _BUSY
    return isinstance(exc, sqlite3.OperationalError) and "database is locked" in str(exc)


def _rollback(db: sqlite3.Connection) -> None:
    """ROLLBACK, unless SQLite ended the transaction itself: a full disk (SQLITE_FULL), an I/O
    error or an interrupt rolls the whole transaction back, and a ROLLBACK then would fail with
    "no transaction is active", hiding why."""
    if db.in_transaction:
        db.execute("ROLLBACK")


class GroupCommit:
    """The writer's queue: grouped jobs, and plain transactions that commit queued jobs first so
    that writes land in the order they were made.

    `connection` returns the open writer connection (raising when the store is closed);
    `committed` is called after every COMMIT (the checkpointer counts them); `failed` with each
    error a group met (the store watches for damage).
    """

    def __init__(
        self,
        connection: Callable[[], sqlite3.Connection],
        committed: Callable[[], None],
        failed: Callable[[BaseException], None] = lambda exc: None,
        name: str = "the database",
        files: Sequence[Path] = (),
    ) -> None:
        self._connection = connection
        self._name = name  # the store's file, as an error names it
        self._files = tuple(files)  # the store's files on disk (a file size limit is told by their sizes)
        self._locked = False  # the last write found the file locked by another process
        self._busy_ms: tuple[int, int] | None = None  # (id of the connection, its busy_timeout set here)
        self._committed = committed
        self._failed = failed
        self._group: list[tuple[Job, asyncio.Future[None]]] = []
        self._unwatched: set[asyncio.Future[None]] = set()  # deferred: a failure is logged, not raised
        self._on_failure: dict[asyncio.Future[None], Callable[[BaseException], None]] = {}  # of deferred ones
        self._handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opened = 0.0  # loop time the open group was scheduled to commit

    @property
    def pending(self) -> bool:
        """Jobs are queued and not yet committed."""
        return bool(self._group)

    def settle(self) -> None:
        """Commit queued writes before a read that could miss them (a conversation created just now)."""
        if self._group:
            self.flush()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One immediate write transaction of its own, after whatever is queued."""
        if self._group:
            self.flush()  # queued writes first: writes land in the order they were made
        db = self._connection()
        self._begin(db)
        try:
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            with suppress(sqlite3.Error):
                _rollback(db)
            error = self._as_store_error(exc)
            self._failed(error if error is not None else exc)
            if error is not exc and error is not None:
                raise error from exc
            raise
        self._committed()

    def _as_store_error(self, exc: BaseException | None) -> BaseException | None:
        """A full disk, or a write past the file size limit, as StoreFull (503 `store_unavailable`,
        saying so, one log line and no traceback); every other error as it is."""
        if exc is None or isinstance(exc, StoreUnavailable):
            return exc
        if is_full(exc):
            return StoreFull(f"the disk holding {self._name} is full")
        if is_io_error(exc):
            at_limit = over_size_limit(self._files)
            if at_limit is not None:
                return StoreFull(
                    size_limit_cause(at_limit),
                    "raise the limit of the server's process (the server goes on once writes fit)",
                )
        return exc

    def submit(
        self, job: Job, *, defer: bool = False, on_failure: Callable[[BaseException], None] | None = None
    ) -> asyncio.Future[None]:
        """Queue `job` for the next group transaction; the future settles once it is committed.

        `defer`: nobody waits for it, so let the next write join it rather than commit it alone
        (it still commits once the loop runs dry after the second pass, within GROUP_WINDOW_S; a
        failure is logged when the group commits, not by a done callback, which would cost a loop
        callback per write). Two passes at least: a turn that starts in this pass may run up to its
        model call and overlap the accept that joins this write with that call
        (ConversationRuntime.enqueue `overlap`). `on_failure`: told the error of a deferred job
        that did not commit (nobody else is).
        """
        loop = asyncio.get_running_loop()
        if self._handle is not None and self._loop is not loop:
            self.flush()  # left over from an event loop that ended before it ran: commit it now
        fut: asyncio.Future[None] = loop.create_future()
        self._group.append((job, fut))
        self._loop = loop
        if defer:
            self._unwatched.add(fut)
            if on_failure is not None:
                self._on_failure[fut] = on_failure
            if self._handle is None:
                self._handle = loop.call_soon(self._flush_next_pass)
            return fut
        ready = getattr(loop, "_ready", None)  # asyncio's run queue (absent on other loops)
        if ready is not None and (not ready or (len(ready) == 1 and ready[0] is self._handle)):
            # Nothing else is runnable, so nothing could join this group: commit now rather
            # than pay two loop passes (the common case for a lone turn).
            self.flush()
        elif self._handle is None:
            self._opened = loop.time()
            self._handle = loop.call_soon(self._flush_when_idle)
        return fut

    def _flush_next_pass(self) -> None:
        assert self._loop is not None
        self._opened = self._loop.time()
        self._handle = self._loop.call_soon(self._flush_when_idle)

    def _flush_when_idle(self) -> None:
        """Commit once nothing else is runnable, or the group is GROUP_WINDOW_S old or full."""
        loop = self._loop
        assert loop is not None
        ready = getattr(loop, "_ready", None)  # None on other loops: commit now (one pass later)
        if ready and len(self._group) < GROUP_MAX_JOBS and loop.time() - self._opened < GROUP_WINDOW_S:
            self._handle = loop.call_soon(self._flush_when_idle)
            return
        self.flush()

    def flush(self) -> None:
        """Commit every queued job in one transaction.

        A turn's rows stay all-or-nothing: the jobs run one after another in one transaction, and
        if one fails the transaction is rolled back and run again with each job in its own
        savepoint, so only the failing job is undone and its caller gets the error (jobs are pure
        SQL, so running one twice writes the same rows; failures are rare, savepoints for every
        job were two statements more per job on every group). Futures settle only after COMMIT
        returns, so no turn is reported done before its rows are durable; if COMMIT fails, every
        job of the group fails.
        """
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        jobs = [(job, fut) for job, fut in self._group if not fut.cancelled()]
        if len(jobs) < len(self._group):
            self._unwatched.difference_update(fut for _, fut in self._group if fut.cancelled())
        self._group = []
        if not jobs:
            return
        errors: list[BaseException | None]
        try:
            db = self._connection()
            self._begin(db)
            try:
                errors = self._run_all(db, jobs)
                if len(jobs) == 1 and errors[0] is not None:
                    _rollback(db)  # a lone job is the whole transaction
                else:
                    db.execute("COMMIT")
                    self._committed()
            except BaseException:
                with suppress(sqlite3.Error):
                    _rollback(db)
                raise
        except Exception as exc:
            errors = [exc] * len(jobs)
        errors = [self._as_store_error(e) for e in errors]
        for failure in {id(e): e for e in errors if e is not None}.values():
            self._failed(failure)
        unwatched = self._unwatched
        for (_, fut), err in zip(jobs, errors, strict=True):
            if unwatched and fut in unwatched:
                unwatched.discard(fut)
                hook = self._on_failure.pop(fut, None) if self._on_failure else None
                if err is not None:
                    log.error("a queued write failed: %s", err)
                    if hook is not None:
                        hook(err)
                fut.set_result(None)  # nobody waits for it: the failure is logged above
                continue
            if fut.cancelled() or fut.get_loop().is_closed():
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)

    def _begin(self, db: sqlite3.Connection) -> None:
        """BEGIN IMMEDIATE, waiting at most LOCK_WAIT_S for the write lock (LOCKED_TRY_S while the
        last write found it taken); a lock held longer by another process is a StoreUnavailable
        that says so."""
        wait_s = LOCKED_TRY_S if self._locked else LOCK_WAIT_S
        busy = (id(db), round(wait_s * 1000))
        if self._busy_ms != busy:
            db.execute(f"PRAGMA busy_timeout={busy[1]}")
            self._busy_ms = busy
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if not is_locked(exc):
                raise
            if not self._locked:
                self._locked = True
                log.warning("%s is locked by another process: writes fail until it lets go", self._name)
            raise StoreLocked(
                f"{self._name} is locked by another process (a write waited {wait_s:g} s for it): "
                f"{NOTHING_WRITTEN}; retry once that process lets go of the database"
            ) from exc
        if self._locked:
            self._locked = False
            log.warning("%s is no longer locked: writes go on", self._name)

    def _run_all(
        self, db: sqlite3.Connection, jobs: list[tuple[Job, asyncio.Future[None]]]
    ) -> list[BaseException | None]:
        """Run the jobs inside the open transaction; → each job's error (None when it succeeded)."""
        try:
            for job, _ in jobs:
                job(db)
        except Exception as exc:
            if len(jobs) == 1:
                return [exc]
            _rollback(db)  # undo the whole group, then again with one savepoint per job
            self._begin(db)
        else:
            return [None] * len(jobs)
        errors: list[BaseException | None] = []
        for job, _ in jobs:
            db.execute("SAVEPOINT turn_commit")
            try:
                job(db)
            except Exception as exc:
                if not db.in_transaction:
                    raise  # SQLite rolled the whole transaction back (a full disk): every job fails with it
                db.execute("ROLLBACK TO turn_commit")
                errors.append(exc)
            else:
                errors.append(None)
            db.execute("RELEASE turn_commit")
        return errors
