"""PostgreSQL implementation of the Store (psycopg 3, async, a psycopg_pool pool).

Same records, same ordering, same errors as SQLiteStore (sqlite.py); the contract suite
(tests/test_store_contract.py) runs every method against both. How it keeps SQLite's promises:

- Acknowledged = committed: every write goes through one ordered writer (`_Writer`) and a method
  returns only after the transaction holding its rows committed.
- Writes land in the order they were made (a draft saved before a turn's commit never lands after
  it): the writer runs jobs in submission order. It groups whatever was submitted while the
  previous transaction was in flight into the next one (group commit), each job in a savepoint of
  its own so a failing job rolls back alone; a lone job is the whole transaction. The statements
  of a group are pipelined (psycopg pipeline mode): one round trip per job, not per statement.
- Reads see every write made before them: a read waits until the writes already submitted have
  committed (`_Writer.settle`), then runs on any pooled connection.

Not here, because PostgreSQL has no equivalent: the WAL checkpointer, the free-space check, the
integrity preflight (`accept_data_loss` is accepted and ignored), file permissions. Durability
and disk space are the database server's.

Several servers may share one database (a cluster, appserver/store/cluster.py): `claim_server`
registers this one as an instance, and from then on its turns and HTTP Idempotency-Key claims are
stamped with the instance id, which any server can judge alive or gone through the database.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from contextlib import asynccontextmanager, nullcontext
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from appserver.procid import identity, identity_alive
from appserver.store.base import (
    DELETE_ORPHAN_RESPONSES,
    AgentMissing,
    ConversationGone,
    DuplicateTurn,
    OpenLimitReached,
    Store,
    StoreError,
    StoreUnavailable,
    StoreValueRefused,
    TurnSettledElsewhere,
    conversation_page_ids,
    history_points_read,
    idempotency_cutoff,
)
from appserver.store.cluster import AWAY, LIVE, LIVE_SINCE, Cluster, ClusterError
from appserver.store.integrity import StoreOpenError
from appserver.store.migrations import SchemaTooNew, SchemaUpgradeRefused, upgrade_refused
from appserver.store.pgschema import DATA_TABLES, MIGRATION_LOCK, MIGRATIONS, expected_columns
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    HistoryPoint,
    HttpIdempotency,
    MessageRecord,
    PendingCall,
    ResponseOwner,
    ResponseRecord,
    TurnCommit,
    TurnRecord,
    TurnSettings,
)
from appserver.store.rows import (
    DRAFT_UPDATE,
    OBJECT,
    RESPONSE_OWNER_COLUMNS,
    SIZED_MESSAGE_COLUMNS,
    DamageLog,
    agent_record,
    conversation_record,
    decode_json,
    dump_json,
    http_idempotency,
    message_record,
    pending_call,
    refuse,
    response_owner,
    response_record,
    turn_record,
)
from appserver.store.url import redact_url, scrub

log = logging.getLogger("appserver.store")

Conn = psycopg.AsyncConnection[DictRow]
Row = Mapping[str, Any]
T = TypeVar("T")
Job = Callable[[Conn], Awaitable[T]]

# How long a connection to the database, or a wait for a pooled one, may take before its request
# fails with 503 `store_unavailable`: a request in an outage waits for it once (see `unreachable`).
CONNECT_TIMEOUT_S = 10.0  # [store] connect_timeout_s
POOL_MAX = 10
# A write that got no pooled connection for this long tries a new one of its own (`_connection_within`),
# which may take this long at least to connect.
POOL_SLICE_S = 0.5
FRESH_CONNECT_S = 1.0
# Every wait has a timeout: a statement of the store's pooled connections (its writes, reads and the
# CLI's) that waits this long for a lock another session holds (`LOCK TABLE`, a long migration by
# hand, a stuck transaction) fails, and its request with it: 503 `store_unavailable`, nothing of it
# written. Well above any lock a healthy cluster holds (a group commit's rows: milliseconds), well
# below a client's patience; a group of writes waits for it once, whatever its size.
LOCK_TIMEOUT_S = 10.0  # [store] lock_timeout_s
# A backstop for a statement that runs (not waits) this long: no statement of the store takes more
# than a fraction of a second on a healthy database (a copy into it, `store copy`, runs without it).
STATEMENT_TIMEOUT_S = 120.0  # [store] statement_timeout_s

# ------------------------------------------------------------------ the writer


FIRST_AGENT_LOCK = 0x61707073_61676E74  # pg_advisory_xact_lock: "appsagnt", the default agent's creation
ACCEPT_LOCK_CLASS = 0x61636370  # pg_advisory_xact_lock(class, hashtext(conversation id)): "accp"
HEARTBEAT_S = 2.0  # [store] heartbeat_s: how often a server renews its instance row
INSTANCE_TIMEOUT_S = 30.0  # [store] instance_timeout_s: a server silent this long is gone
# A turn still open: a write of its state (a checkpoint, its end) never changes a settled one.
NOT_SETTLED = "status NOT IN ('completed', 'cancelled', 'failed', 'interrupted')"
# A pending key nobody works on any more whose request may have an answer (its claimant died
# mid-request, or its stored answer could not be written) is released, not deleted: it keeps its
# body's hash, so only a repeat of its request takes it over (`claim_http_idempotency`). Deleted,
# another body could claim it and follow the turn its request left under the key (http/common.py
# `Idempotency.earlier`): the other request's reply. One whose request ended in an error (its
# release could not be written) is deleted, as that release would have.
RELEASE_HTTP_KEY = "UPDATE http_idempotency SET owner=NULL WHERE scope=%s AND key=%s AND state='pending'"
DROP_HTTP_KEY = "DELETE FROM http_idempotency WHERE scope=%s AND key=%s AND state='pending'"
# A claim that takes a key's row over (ON CONFLICT DO UPDATE): the row is the new request's, pending.
RESET_HTTP_KEY = (
    "body_hash=EXCLUDED.body_hash, state='pending', status_code=NULL, content_type=NULL, body=NULL, "
    "conversation_id=NULL, created_at=EXCLUDED.created_at, owner=EXCLUDED.owner"
)
LOST_CONNECTION_RETRIES = 3  # a group of writes whose connection was lost before COMMIT runs again


def _conversation_row(conv: ConversationRecord) -> tuple[Any, ...]:
    """The parameters of `_INSERT_CONVERSATION` for `conv`."""
    return (
        conv.id,
        conv.agent_id,
        conv.is_default,
        conv.title,
        conv.user,
        conv.namespace,
        conv.forked_from,
        dump_json(conv.metadata),
        conv.created_at,
        conv.updated_at,
    )


class _LostBeforeCommit(Exception):
    """The connection broke while a group's statements ran: nothing was committed."""


# The server's own word that it ended the session (pg_terminate_backend, a shutdown, a crash
# restart): it arrives as an error result before the socket closes, so `conn.broken` is still false.
_ENDED_BY_SERVER = (psycopg.errors.AdminShutdown, psycopg.errors.CrashShutdown, psycopg.errors.CannotConnectNow)


# A statement that waited `lock_timeout` for a lock, or ran past `statement_timeout` (or was
# cancelled by an operator): the database is fine, the statement was stopped; nothing it did stays.
TIMED_OUT = (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)


def connection_lost(conn: Conn, exc: BaseException) -> bool:
    """Did `exc` come from the database ending `conn` (not from the statement)?"""
    return conn.closed or conn.broken or isinstance(exc, _ENDED_BY_SERVER)


class _LostAtCommit(Exception):
    """The connection broke after COMMIT was sent: transaction `xid` may or may not have committed.
    `outcomes` are the jobs' results, true if it did."""

    def __init__(self, xid: int | None, outcomes: list[tuple[bool, Any]]) -> None:
        super().__init__(f"connection lost while transaction {xid} committed")
        self.xid = xid
        self.outcomes = outcomes


LIVE_CONNECTION_WAIT_S = 5.0  # how long a group of writes looks for a connection the database has not ended
COMMIT_STATUS_TRIES = 40  # 50 ms apart: the ended backend may still be finishing its commit
LAST_CONNECTION_TRY_S = 0.1  # a write whose connect_timeout_s ran out in the queue still tries this long


class _Writer:
    """Every write, in submission order; what queued while a transaction was in flight commits in
    the next one, each job in its own savepoint. Futures settle after COMMIT returned."""

    def __init__(
        self,
        connection: Callable[[float | None], Any],
        timed_out: Callable[[BaseException], StoreUnavailable] = lambda exc: StoreUnavailable(str(exc)),
    ) -> None:
        # (since) -> async context manager yielding a Conn; `since`: when the oldest job of the
        # group was submitted (None: not for a group)
        self._connection = connection
        self._timed_out = timed_out  # a statement's lock or statement timeout, as the error its group gets
        self._queue: list[tuple[int, Job[Any], asyncio.Future[Any], float]] = []  # (seq, job, fut, submitted at)
        self._since: float | None = None  # when the oldest job of the group in flight was submitted
        self._submitted = 0  # sequence number of the last job submitted
        self._done = 0  # every job up to this number has committed or failed
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._deferred: list[Callable[[], Awaitable[None]]] = []

    async def run(self, job: Job[T]) -> T:
        """Run `job` in the next transaction; its result once committed. Cancelled before the
        transaction started, the job never runs (as SQLite's group commit)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._queue.append((self._submitted, job, fut, time.monotonic()))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return await fut

    async def settle(self) -> None:
        """Return once every write submitted before this call has committed (or failed)."""
        target = self._submitted
        if self._done >= target:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        await fut

    async def flush(self) -> None:
        await self.settle()

    def _advance(self, done: int) -> None:
        self._done = done
        still: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if target <= done:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((target, fut))
        self._waiters = still

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                live = [(job, fut) for _, job, fut, _ in batch if not fut.done()]
                self._since = min((at for _, _, fut, at in batch if not fut.done()), default=None)
                try:
                    if live:
                        await self._commit(live)
                finally:
                    self._advance(batch[-1][0])
        except BaseException as exc:  # the loop is going away: nobody may wait forever
            for _, _, fut, _ in self._queue:
                if not fut.done():
                    fut.set_exception(StoreError(f"store writer stopped: {exc!r}"))
            if self._queue:
                self._advance(self._queue[-1][0])
            self._queue = []
            raise

    def defer(self, fetch: Callable[[], Awaitable[None]]) -> None:
        """Read a job's results (e.g. new message ids) later in the transaction: the statements of
        a whole group then travel in one round trip instead of one per job."""
        self._deferred.append(fetch)

    async def _collect(self) -> None:
        fetches, self._deferred = self._deferred, []
        for fetch in fetches:
            await fetch()

    async def _commit(self, jobs: list[tuple[Job[Any], asyncio.Future[Any]]]) -> None:
        """Fast path: every job in one transaction without savepoints, their statements pipelined,
        one sync before COMMIT. When a job fails there (rare: a duplicate key, a DuplicateTurn),
        nothing was committed; the group runs again with a savepoint per job, so the failing job
        rolls back alone and its caller gets its own error. A connection lost before COMMIT was
        sent committed nothing: the group runs again on another. A failure of COMMIT itself (a lost
        connection: the outcome is unknown) is never retried: every job of the group fails. So does
        every job of a group one statement of which timed out (a lock held elsewhere past
        `lock_timeout`): nothing of it committed, each caller gets StoreUnavailable, and the group
        is not run again job by job (each would wait for the same lock: a wait per job)."""
        outcomes: list[tuple[bool, Any]] | None = None
        # Runs again while the database keeps ending connections, for at least
        # LOST_CONNECTION_RETRIES more tries and LIVE_CONNECTION_WAIT_S (a slow host's group may
        # outlast each of a storm's short-lived connections).
        give_up_after = time.monotonic() + LIVE_CONNECTION_WAIT_S
        try:
            for attempt in itertools.count():
                last = attempt >= LOST_CONNECTION_RETRIES and time.monotonic() >= give_up_after
                try:
                    outcomes = await self._run(jobs, savepoints=False)
                    if outcomes is None:
                        outcomes = await self._run(jobs, savepoints=True)
                    break
                except _LostAtCommit as lost:
                    # Whether the COMMIT took effect, the database says (txid_status): committed,
                    # the group's results stand; aborted, nothing was written and it runs again.
                    status = await self._commit_status(lost.xid)
                    if status == "committed":
                        outcomes = lost.outcomes
                        break
                    if status != "aborted":
                        raise StoreUnavailable(
                            "the database connection was lost while the write committed, and whether it took "
                            f"effect could not be learnt: {lost.__cause__}"
                        ) from lost.__cause__
                    if last:
                        raise StoreUnavailable(
                            f"the database ended {attempt + 1} connections in a row before the "
                            f"write could commit (nothing was written): {lost.__cause__}"
                        ) from lost.__cause__
                except _LostBeforeCommit as lost:
                    # The database ended the connection before COMMIT was sent (a restart, a
                    # terminated backend): nothing of the group was committed, so it runs again.
                    if last:
                        raise StoreUnavailable(
                            f"the database ended {attempt + 1} connections in a row before the "
                            f"write could commit (nothing was written): {lost.__cause__}"
                        ) from lost.__cause__
        except Exception as exc:
            outcomes = [(False, exc)] * len(jobs)
        except BaseException as exc:
            for _, fut in jobs:
                if not fut.done():
                    fut.set_exception(StoreError(f"store write interrupted: {exc!r}"))
            raise
        for (_, fut), (ok, value) in zip(jobs, outcomes or [], strict=True):
            if fut.done() or fut.get_loop().is_closed():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(_refused_value(value))

    async def _run(
        self, jobs: list[tuple[Job[Any], asyncio.Future[Any]]], *, savepoints: bool
    ) -> list[tuple[bool, Any]] | None:
        """One transaction over `jobs`. Without savepoints: None when a job failed before COMMIT
        (a lone job's error is raised instead: it is the whole transaction)."""
        self._deferred = []
        outcomes: list[tuple[bool, Any]] = []
        committing = False
        xid: int | None = None  # the transaction's id, to ask whether a COMMIT cut off took effect
        try:
            async with self._connection(self._since) as conn, conn.pipeline() as pipeline:
                try:
                    async with conn.transaction():
                        marker = await conn.execute("SELECT txid_current() AS xid")  # pipelined: no round trip
                        for job, _ in jobs:
                            if not savepoints:
                                outcomes.append((True, await job(conn)))
                                continue
                            try:
                                async with conn.transaction():  # SAVEPOINT: all-or-nothing per job
                                    value = await job(conn)
                                    await self._collect()
                            except Exception as exc:
                                if isinstance(exc, TIMED_OUT):
                                    raise  # the next jobs would wait for the same lock: the group fails
                                self._deferred = []
                                outcomes.append((False, exc))
                            else:
                                outcomes.append((True, value))
                        await self._collect()
                        await pipeline.sync()  # every statement's error surfaces here, before COMMIT
                        row = await marker.fetchone()
                        xid = int(row["xid"]) if row else None
                        committing = True
                except Exception as exc:
                    self._deferred = []
                    if connection_lost(conn, exc):
                        if not committing:
                            raise _LostBeforeCommit() from exc  # nothing was committed: safe to run again
                        raise _LostAtCommit(xid, outcomes) from exc
                    if not committing and isinstance(exc, TIMED_OUT):
                        raise self._timed_out(exc) from exc  # nothing committed: every job fails, once
                    if committing or savepoints or len(jobs) == 1:
                        raise
                    return None
        except psycopg.OperationalError as exc:
            # Raised as the pipeline ends, where the answer to its COMMIT is read ("cannot exit
            # pipeline mode while busy", "consuming input failed"): the connection went meanwhile.
            if not committing:
                raise _LostBeforeCommit() from exc
            raise _LostAtCommit(xid, outcomes) from exc
        return outcomes

    async def _commit_status(self, xid: int | None) -> str | None:
        """`committed`, `aborted`, or None when the database cannot say (yet)."""
        if xid is None:
            return None
        for _ in range(COMMIT_STATUS_TRIES):
            try:
                async with self._connection(None) as conn:
                    cur = await conn.execute("SELECT txid_status(%s) AS status", (xid,))
                    row = await cur.fetchone()
                status = row["status"] if row else None
            except (psycopg.Error, StoreError):
                status = "in progress"  # no connection to ask on yet: the storm goes on
            if status in ("committed", "aborted"):
                return str(status)
            await asyncio.sleep(0.05)
        return None


def _refused_value(exc: BaseException) -> BaseException:
    """A value the database cannot hold (psycopg.DataError: a NUL character in text, a number out
    of range) as a one-line StoreError naming what was refused; every other error as it is. The
    front ends refuse such input first (a NUL in `user`, a title, ...): this is the backstop."""
    if isinstance(exc, psycopg.DataError):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StoreValueRefused(f"the database refused a value of this request: {first}")
    return exc


def _nul_free(value: str | None) -> str | None:
    """`value` with each NUL as U+FFFD, as `store copy` writes it: PostgreSQL text cannot hold a
    NUL, and one in what a model streamed (its reasoning, a call's name or arguments) must never
    fail a turn's commit. For the raw text columns of messages and pending_calls (JSON columns
    hold a NUL escaped)."""
    return value.replace("\x00", "\ufffd") if value and "\x00" in value else value


# ------------------------------------------------------------------ row → record


def _limit(limit: int | None) -> int | None:
    """SQLite reads a negative LIMIT as "no limit"; PostgreSQL refuses it (NULL is no limit)."""
    return None if limit is None or limit < 0 else limit


_INSERT_MESSAGE = (
    "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, tool_calls, tool_call_id, name, "
    "is_error, reasoning, provider_state, completion_status, source, created_at, meta) "
    "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) RETURNING id"
)
_INSERT_PENDING = (
    "INSERT INTO pending_calls(conversation_id, call_id, turn_id, name, arguments, kind, status, output, is_error, "
    "reason, decided_by, created_at, expires_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
_INSERT_CONVERSATION = (
    'INSERT INTO conversations(id, agent_id, is_default, title, "user", namespace, forked_from, metadata, '
    "created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
_COPY_MESSAGE = (
    "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, tool_calls, tool_call_id, name, "
    "is_error, reasoning, provider_state, completion_status, source, created_at, meta) "
    "SELECT %s, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, reasoning, "
    "provider_state, completion_status, source, created_at, meta FROM messages WHERE id=%s"
)
ENSURE_TRIES = 5  # ensure_conversation: reads of a clashing row deleted meanwhile before it gives up
_VANISHED: DictRow = {}  # ensure_conversation's job: the row it clashed with is gone


async def _count(conn: Conn, query: str, params: tuple[Any, ...]) -> int:
    """Rows a DELETE/UPDATE `query` (without RETURNING) touched."""
    cur = await conn.execute(f"WITH d AS ({query} RETURNING 1) SELECT count(*) AS n FROM d", params)
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


# ------------------------------------------------------------------ the store


class PostgresStore(Store):
    # Several processes use one database at once: only the servers of its cluster (`claim_server`)
    # run, settle or answer turns; another process (a CLI command) reads and administers only
    # (Kernel.runs_turns).
    shared = True

    def __init__(self, url: str, *, pool_max: int = POOL_MAX, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.url = url
        self.shown_url = redact_url(url)  # the only form of the URL that may reach a log or an error
        self._damaged_cells = DamageLog(f"PostgreSQL store {self.shown_url}")  # rows.py decode_json
        self.pool_max = pool_max
        self.connect_timeout_s = connect_timeout_s
        self.fresh = False  # True when open() created the schema (first use of this database)
        self.accept_data_loss = False  # `serve --accept-data-loss`: an SQLite file matter; nothing to accept here
        self.host = socket.gethostname()
        # This process, and the host: a claim stamped by another host is never judged here (see the module doc).
        self.owner = f"{identity()}@{self.host}"
        self._pool: AsyncConnectionPool[Conn] | None = None
        self._writes = _Writer(self._writer_connection, self._timed_out)
        self.lock_timeout_s = LOCK_TIMEOUT_S
        self.statement_timeout_s = STATEMENT_TIMEOUT_S
        self.heartbeat_s = HEARTBEAT_S
        self.instance_timeout_s = INSTANCE_TIMEOUT_S
        self.address = ""  # host:port this server listens on, shown to the others
        # Whether this process may upgrade an older schema that live servers use (make_store: only
        # as its home's `serve`, a rolling upgrade; a command may not); None: always.
        self.may_upgrade_live: Callable[[], bool] | None = None
        self.cluster: Cluster | None = None  # once claim_server joined the cluster (a serve)
        # HTTP Idempotency-Keys this process claimed and whose request still runs here: (scope, key)
        # -> the claim's created_at. A pending key of this process missing here is no longer worked
        # on (its end could not be written): a retry takes it over.
        self._claimed: dict[tuple[str, str], float] = {}
        # What an outage kept from being written, written by `repair` once the database is back
        # (after the cluster's next heartbeat): keys whose request ended here but whose end (the
        # stored answer, or the release) failed, left pending (scope, key) -> created_at; turns
        # whose end failed to commit (ended failed here), left running: turn id -> (error, revision).
        self._loose_keys: dict[tuple[str, str], float] = {}
        # Those of them whose lost end was a stored answer (their turn completed): `repair` releases
        # them (RELEASE_HTTP_KEY) rather than deleting them, as they stay their request's.
        self._loose_answers: set[tuple[str, str]] = set()
        self._loose_turns: dict[str, tuple[str, int]] = {}
        # When a wait for a pooled connection last got one, and when the last wait that got none
        # (for all of connect_timeout_s, nobody else getting one meanwhile) began: see `unreachable`.
        self._reached_at = time.monotonic()
        self._unreached_at: float | None = None
        # Held by a read on a connection of its own (`_connection_within`): one at a time. And when
        # the pool last handed out a connection: a read opens its own only when it has not since
        # the read began (the pool empty after an outage, not busy).
        self._own_read = asyncio.Lock()
        self._pooled_at = time.monotonic()

    def __repr__(self) -> str:
        return f"PostgresStore({self.shown_url!r})"

    # ------------------------------------------------------------ lifecycle

    def _error(self, what: str, exc: BaseException) -> StoreOpenError:
        reason = " ".join(scrub(str(exc), self.url).split()) or type(exc).__name__
        return StoreOpenError(f"PostgreSQL store {self.shown_url}: {what}: {reason}")

    async def open(self) -> None:
        """Connect (a first, direct connection says clearly why it cannot), migrate, start the pool."""
        if self._pool is not None:
            return
        await self.prepare_schema()
        pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
            self.url,
            connection_class=psycopg.AsyncConnection[DictRow],
            # its reconnects too give up after connect_timeout_s (psycopg's default is 130 s: after a
            # network that dropped everything, the pool's attempts made meanwhile held it that long)
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                "connect_timeout": max(1, int(self.connect_timeout_s)),
            },
            min_size=1,
            max_size=self.pool_max,
            open=False,
            name="appserver-store",
            timeout=self.connect_timeout_s,
            configure=self._configure,
        )
        try:
            await pool.open(wait=True, timeout=self.connect_timeout_s)
        except Exception as exc:
            await pool.close()
            raise self._error("cannot open the connection pool", exc) from None
        self._pool = pool

    async def prepare_schema(self) -> None:
        """Bring the database to this code's schema (creating it on a new database) on a direct
        connection of its own: what `open` does first, and what a command that reads or writes
        one table of it without the store (tokens, cron tasks) does before its first statement."""
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, row_factory=dict_row, connect_timeout=max(1, int(self.connect_timeout_s))
            )
        except (psycopg.Error, OSError, ValueError) as exc:
            raise self._error("cannot connect (check [store] url / --store, and that the server runs)", exc) from None
        try:
            self.fresh = await migrate(conn, self._before_upgrade) == 0
            await check_schema(conn)
        except (SchemaTooNew, SchemaDamaged, SchemaUpgradeRefused) as exc:
            raise StoreOpenError(f"PostgreSQL store {self.shown_url}: {exc}") from None
        except psycopg.Error as exc:
            raise self._error("cannot prepare the schema", exc) from None
        finally:
            await conn.close()

    async def _before_upgrade(self, conn: Conn, current: int, known: int) -> None:
        """An older schema that live servers use is upgraded by a server starting (a rolling
        upgrade: the migrations are written for servers of the older version running beside it),
        never as the side effect of a command (`agents list` of a newly installed CLI): that left
        every running server on a schema it was not started with, and refused their restarts."""
        if self.may_upgrade_live is None:
            return
        live = await _live_instances(conn, self.instance_timeout_s, self.heartbeat_s)
        if not live or await asyncio.to_thread(self.may_upgrade_live):
            return
        shown = ", ".join(live[:3]) + (f" and {len(live) - 3} more" if len(live) > 3 else "")
        raise upgrade_refused(
            current,
            known,
            f"live servers of its cluster use it ({shown})",
            "upgrade the servers (start this version's `appserver serve`, which upgrades the schema, then stop the "
            "older ones), then run this command again",
        )

    async def _configure(self, conn: Conn) -> None:
        """Every pooled connection (writes, reads, a CLI command's) waits at most `lock_timeout_s`
        for a lock and runs a statement at most `statement_timeout_s` (session settings: the
        connections are in autocommit, so they last as long as the connection). The migration's
        own connection (`open`) and the cluster's session (cluster.py) have no such limit: a start
        waits for another's migration, and the session's advisory lock is only ever tried."""
        await conn.execute(
            "SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false)",
            (f"{max(1, round(self.lock_timeout_s * 1000))}ms", f"{max(1, round(self.statement_timeout_s * 1000))}ms"),
        )

    def _timed_out(self, exc: BaseException) -> StoreUnavailable:
        """A statement stopped by `lock_timeout` or `statement_timeout`, as a one-line StoreUnavailable."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            why = (
                f"a statement waited {self.lock_timeout_s:g} s for a lock another session holds on the database "
                "([store] lock_timeout_s)"
            )
        else:
            why = f"a statement was stopped after {self.statement_timeout_s:g} s ([store] statement_timeout_s)"
        return StoreUnavailable(f"PostgreSQL store {self.shown_url}: {why}; nothing of it was written: {first}")

    async def claim_server(self) -> None:
        """Join the database's cluster of servers (appserver/store/cluster.py): register this
        server as an instance, hold its session lock, listen for the others. Its turns and claims
        are stamped with the instance id from then on."""
        if self.cluster is not None:
            return
        cluster = Cluster(
            self, heartbeat_s=self.heartbeat_s, instance_timeout_s=self.instance_timeout_s, address=self.address
        )
        try:
            await cluster.start()
        except (psycopg.Error, OSError, ValueError, ClusterError) as exc:
            raise self._error("cannot join the cluster of servers on this database", exc) from None
        self.cluster = cluster
        self.owner = cluster.instance_id
        cluster.after_beat = self.repair

    async def close(self) -> None:
        cluster, self.cluster = self.cluster, None
        try:
            if cluster is not None and self._pool is not None:
                await self._writes.flush()
                await cluster.stop()  # its leases and row go: the others take over at once
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                try:
                    await self._writes.flush()
                finally:
                    await pool.close()

    @asynccontextmanager
    async def _writer_connection(self, since: float | None = None) -> AsyncIterator[Conn]:
        """A pooled connection checked alive first (one round trip per group of writes): a
        connection the database ended (a restart, a failover, an idle reaper) is dropped and
        another taken, instead of failing a whole group of turn commits. Every pooled connection may
        be dead at once (a restart), and new ones ended as they come (a storm of terminated
        sessions): it keeps trying for LIVE_CONNECTION_WAIT_S before the group fails.

        While the database is `unreachable`, a group submitted at `since` waits for a connection
        only what is left of connect_timeout_s from then: the writes queued behind a group that
        waited in vain (a draft's, say, then a turn's commit) do not each wait as long again."""
        deadline = time.monotonic() + LIVE_CONNECTION_WAIT_S
        tries = 0
        while True:
            began = time.monotonic()
            wait_s = self.connect_timeout_s
            if since is not None and self.unreachable:
                wait_s = max(LAST_CONNECTION_TRY_S, since + self.connect_timeout_s - began)
            try:
                async with self._connection_within(wait_s) as conn:
                    try:
                        await AsyncConnectionPool.check_connection(conn)
                    except psycopg.Error:
                        pass  # returned broken: the pool discards it
                    else:
                        self._reached_at = time.monotonic()
                        yield conn
                        return
            except PoolTimeout as exc:
                self._unreached(began)
                raise StoreUnavailable(
                    f"PostgreSQL store {self.shown_url}: no connection to write on within {self.connect_timeout_s:g} s "
                    f"([store] connect_timeout_s): {exc}"
                ) from exc
            tries += 1
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    f"PostgreSQL store {self.shown_url}: no live connection to write on ({tries} ended in "
                    f"{LIVE_CONNECTION_WAIT_S:g} s)"
                )
            if tries > self.pool_max:  # the pool's connections are all new and still dying: pause
                await asyncio.sleep(0.05)

    @asynccontextmanager
    async def _connection_within(self, wait_s: float, own: asyncio.Lock | None = None) -> AsyncIterator[Conn]:
        """A pooled connection within `wait_s`, or else a new one of the writer's own (configured as
        the pool's, closed after use), tried whenever the pool had none for POOL_SLICE_S: after an
        outage the pool reconnects on a backoff of its own (1, 2, 4, 8 s apart), and a write that
        waited for it alone failed although the database was back (a turn's commit: its whole
        answer lost). The writer runs one group at a time, so this opens one connection at most;
        a reader passes `own`, held while it uses a connection of its own (the others wait for the
        pool meanwhile), so the reads open one at most too, and only while the pool hands out none
        (busy, it hands them out to others). PoolTimeout when neither came within `wait_s` (a new
        one is tried at least once, by the writer)."""
        began = time.monotonic()
        deadline = began + wait_s
        while True:
            try:
                pooled = await self.pool.getconn(timeout=max(0.01, min(POOL_SLICE_S, deadline - time.monotonic())))
            except PoolTimeout:
                pass
            else:
                self._pooled_at = time.monotonic()
                try:
                    async with pooled:
                        yield pooled
                finally:
                    await self.pool.putconn(pooled)
                return
            if own is None or (not own.locked() and self._pooled_at < began):
                async with own if own is not None else nullcontext():
                    fresh = await self._fresh_connection(max(FRESH_CONNECT_S, deadline - time.monotonic()))
                    if fresh is not None:
                        async with fresh:  # closed on leaving
                            yield fresh
                        return
            if time.monotonic() >= deadline:
                raise PoolTimeout(f"couldn't get a connection after {wait_s:.2f} sec")

    async def _fresh_connection(self, wait_s: float) -> Conn | None:
        """A new connection, configured as the pool's, when the database lets one be made within
        `wait_s`; None when it does not (refused, or no answer)."""
        try:
            async with asyncio.timeout(wait_s):
                conn = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, row_factory=dict_row, connect_timeout=max(2, round(wait_s))
                )
                try:
                    await self._configure(conn)
                except BaseException:
                    await conn.close()
                    raise
        except (psycopg.Error, OSError):  # OSError: TimeoutError too
            return None
        return conn

    async def _read(self, run: Callable[[Conn], Awaitable[T]]) -> T:
        """`_read_pooled`; on a server of a cluster, given up with 503 `store_unavailable` once the
        database answers neither it nor the heartbeat (it hangs: `Cluster.answered`)."""
        cluster = self.cluster
        if cluster is None:
            return await self._read_pooled(run)
        return await cluster.answered(self._read_pooled(run), f"PostgreSQL store {self.shown_url}: a read")

    async def _read_pooled(self, run: Callable[[Conn], Awaitable[T]]) -> T:
        """`run` on a pooled connection, and again on another while the database had ended the one
        taken (reads are safe to repeat; see `_writer_connection` for writes)."""
        await self._writes.settle()
        attempts = self.pool_max + 1  # every pooled connection may be dead (a restart)
        for attempt in range(attempts):
            began = time.monotonic()
            try:
                # (not the pool's alone: after an outage it waits out its reconnect backoff, and a
                # read, a mirror's of a turn this server could not write, failed although the
                # database was back: `_connection_within`)
                async with self._connection_within(self.connect_timeout_s, self._own_read) as conn:
                    try:
                        result = await run(conn)
                        self._reached_at = time.monotonic()
                        return result
                    except psycopg.DataError as exc:  # a NUL in an id looked up, say: nothing to find
                        raise _refused_value(exc) from exc
                    except TIMED_OUT as exc:  # a lock held elsewhere: 503, not a 500 (nor a wait without end)
                        raise self._timed_out(exc) from exc
                    except psycopg.OperationalError as exc:
                        if not connection_lost(conn, exc):
                            raise
                        if attempt == attempts - 1:
                            raise StoreUnavailable(f"the database ended every connection of the read: {exc}") from exc
            except PoolTimeout as exc:  # the database cannot be reached: 503 store_unavailable, not a 500
                self._unreached(began)
                raise StoreUnavailable(f"PostgreSQL store {self.shown_url}: no connection to read on: {exc}") from exc
        raise AssertionError("unreachable")

    def _unreached(self, began: float) -> None:
        """A wait for a pooled connection that began at `began` got none: the database is
        unreachable, unless another wait got one meanwhile (a pool busy, not cut off)."""
        if began >= self._reached_at:
            self._unreached_at = began

    @property
    def unreachable(self) -> bool:
        """The last wait for a pooled connection got none in connect_timeout_s, nobody has got one
        since, and the pool holds none (its own reconnects found the database back)."""
        if self._unreached_at is None or self._unreached_at < self._reached_at or self._pool is None:
            return False
        return not self._pool.get_stats().get("pool_available", 0)

    @property
    def pool(self) -> AsyncConnectionPool[Conn]:
        if self._pool is None:
            raise StoreError("store is not open")
        return self._pool

    async def _write(self, job: Job[T]) -> T:
        self.pool  # noqa: B018 - a closed store refuses before queueing
        return await self._writes.run(job)

    async def _rows(self, query: str, params: tuple[Any, ...] | Mapping[str, Any] = ()) -> list[DictRow]:
        async def run(conn: Conn) -> list[DictRow]:
            cur = await conn.execute(query, params)
            return await cur.fetchall()

        return await self._read(run)

    async def _row(self, query: str, params: tuple[Any, ...] | Mapping[str, Any] = ()) -> DictRow | None:
        async def run(conn: Conn) -> DictRow | None:
            cur = await conn.execute(query, params)
            return await cur.fetchone()

        return await self._read(run)

    async def check_writable(self, min_free_bytes: int = 0) -> str:
        """Readiness: a real write (the probe row) committed through the writer. `min_free_bytes`
        cannot be checked: the disk is the database server's."""

        async def probe(conn: Conn) -> int:
            cur = await conn.execute(
                "UPDATE store_probe SET writes = writes + 1, written_at = %s WHERE id = 1 RETURNING writes",
                (time.time(),),
            )
            row = await cur.fetchone()
            if row is None:
                raise StoreError("the store_probe row is missing: the schema was changed by hand")
            return int(row["writes"])

        await self._write(probe)
        cluster = self.cluster
        if cluster is not None and cluster.fenced and not cluster.lost:
            raise StoreError(
                f"PostgreSQL store {self.shown_url}: this server ({cluster.instance_id}) has lost its database "
                "session; the others may take its conversations over"
            )
        if cluster is not None and cluster.lost:
            raise StoreError(
                f"PostgreSQL store {self.shown_url}: this server ({cluster.instance_id}) was judged gone by the "
                "others (its heartbeat stopped) and its conversations were taken over: restart it"
            )
        return "writable (PostgreSQL; free disk space is the database server's)"

    # ------------------------------------------------------------ agents

    async def create_agent(self, agent: AgentRecord) -> AgentRecord:
        now = time.time()
        agent.created_at = agent.created_at or now
        agent.updated_at = now

        async def job(conn: Conn) -> None:
            await _insert_agent(conn, agent)

        await self._write(job)
        return agent

    async def create_first_agent(self, agent: AgentRecord) -> bool:
        now = time.time()
        agent.created_at = agent.created_at or now
        agent.updated_at = now

        async def job(conn: Conn) -> bool:
            # Servers starting together each find no agent: the lock makes one of them the first.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (FIRST_AGENT_LOCK,))
            if await (await conn.execute("SELECT 1 FROM agents LIMIT 1")).fetchone() is not None:
                return False
            await _insert_agent(conn, agent)
            return True

        return await self._write(job)

    async def update_agent(self, agent: AgentRecord) -> AgentRecord:
        agent.updated_at = time.time()

        async def job(conn: Conn) -> None:
            n = await _count(
                conn,
                "UPDATE agents SET name=%s, model=%s, system=%s, tools=%s, params=%s, updated_at=%s WHERE id=%s",
                (
                    agent.name,
                    agent.model,
                    agent.system,
                    dump_json(agent.tools),
                    dump_json(agent.params),
                    agent.updated_at,
                    agent.id,
                ),
            )
            if n == 0:
                raise StoreError(f"agent {agent.id} does not exist")

        await self._write(job)
        return agent

    async def delete_agent(self, agent_id: str) -> bool:
        async def job(conn: Conn) -> bool:
            await conn.execute("DELETE FROM turns WHERE agent_id=%s", (agent_id,))
            deleted = await _count(conn, "DELETE FROM agents WHERE id=%s", (agent_id,)) > 0
            await conn.execute(DELETE_ORPHAN_RESPONSES)
            return deleted

        return await self._write(job)

    # No cache (SQLite keeps one, checked against PRAGMA data_version): a point read by key is cheap
    # here, and another process's change is seen without an invalidation channel.

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        row = await self._row("SELECT * FROM agents WHERE id=%s", (agent_id,))
        return agent_record(row, self._damaged_cells) if row else None

    async def find_agents(self, ref: str) -> list[AgentRecord]:
        rows = await self._rows("SELECT * FROM agents WHERE id=%s OR name=%s ORDER BY created_at, id", (ref, ref))
        return [agent_record(r, self._damaged_cells) for r in rows]

    async def list_agents(self) -> list[AgentRecord]:
        return [
            agent_record(r, self._damaged_cells)
            for r in await self._rows("SELECT * FROM agents ORDER BY created_at, id")
        ]

    # ------------------------------------------------------------ conversations

    async def create_conversation(
        self, conv: ConversationRecord, *, copy_messages: Iterable[int] | None = None
    ) -> ConversationRecord:
        now = time.time()
        conv.created_at = conv.created_at or now
        conv.updated_at = now
        ids = list(copy_messages) if copy_messages is not None else []

        async def job(conn: Conn) -> None:
            await conn.execute(
                _INSERT_CONVERSATION,
                _conversation_row(conv),
            )
            for mid in ids:  # one at a time: the copies get ids in the order given
                await conn.execute(_COPY_MESSAGE, (conv.id, mid))

        try:
            await self._write(job)
        except psycopg.errors.ForeignKeyViolation:
            await self._raise_if_agent_missing(conv.agent_id)
            raise
        return conv

    async def _raise_if_agent_missing(self, agent_id: str) -> None:
        """A conversation insert that failed on a foreign key: AgentMissing when its agent is gone
        (deleted meanwhile, by another request or server), else the caller re-raises."""
        if await self.get_agent(agent_id) is None:
            raise AgentMissing(agent_id) from None

    async def ensure_conversation(
        self,
        conv: ConversationRecord,
        *,
        copy_messages: Iterable[int] | None = None,
        messages: list[MessageRecord] | None = None,
    ) -> tuple[ConversationRecord, bool]:
        """One statement decides, whoever else inserts the same row (another request's job in
        this transaction, another server): ON CONFLICT DO NOTHING waits for a clashing insert in
        flight and does nothing once it committed (a unique violation no more), and the row there
        is read back in the same transaction. ON CONFLICT without a target covers both keys a new
        conversation can clash on: its id, and `conversations_default` (one default per agent)."""
        now = time.time()
        conv.created_at = conv.created_at or now
        conv.updated_at = now
        ids = list(copy_messages) if copy_messages is not None else []

        async def job(conn: Conn) -> DictRow | None:
            cur = await conn.execute(
                _INSERT_CONVERSATION + " ON CONFLICT DO NOTHING RETURNING id",
                _conversation_row(conv),
            )
            if await cur.fetchone() is not None:
                for mid in ids:  # as create_conversation: one at a time, the copies keep the order given
                    await conn.execute(_COPY_MESSAGE, (conv.id, mid))
                if messages:
                    await self._insert_messages(conn, conv.id, messages, now)
                return None
            cur = await conn.execute("SELECT * FROM conversations WHERE id=%s", (conv.id,))
            row = await cur.fetchone()
            if row is None and conv.is_default:
                cur = await conn.execute(
                    "SELECT * FROM conversations WHERE agent_id=%s AND is_default", (conv.agent_id,)
                )
                row = await cur.fetchone()
            return row if row is not None else _VANISHED

        for _ in range(ENSURE_TRIES):
            try:
                there = await self._write(job)
            except psycopg.errors.ForeignKeyViolation:
                await self._raise_if_agent_missing(conv.agent_id)
                raise
            if there is None:
                return conv, True
            if there is not _VANISHED:
                return conversation_record(there, self._damaged_cells), False
            # the row it clashed with was deleted before it could be read: try again
        await self._raise_if_agent_missing(conv.agent_id)  # deleted with its agent, again and again
        raise StoreError(f"conversation {conv.id} kept being created and deleted by others; try again")

    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None:
        row = await self._row("SELECT * FROM conversations WHERE id=%s", (conversation_id,))
        return conversation_record(row, self._damaged_cells) if row else None

    async def get_default_conversation(self, agent_id: str) -> ConversationRecord | None:
        row = await self._row("SELECT * FROM conversations WHERE agent_id=%s AND is_default", (agent_id,))
        return conversation_record(row, self._damaged_cells) if row else None

    async def list_conversations(
        self,
        agent_id: str | None = None,
        *,
        limit: int = 100,
        offset: int = 0,
        after: tuple[float, str] | None = None,
        agent_ids: Collection[str] | None = None,
        namespace: str | None = None,
    ) -> list[ConversationRecord]:
        """The page's ids off an index in the list's order (`conversation_page_ids`: no row
        before the page is fetched, whatever the offset), then its rows, in one snapshot."""
        page, params = conversation_page_ids(
            "%s", agent_id, agent_ids, namespace, limit=_limit(limit), offset=max(offset, 0), after=after
        )
        rows = await self._rows(
            f"SELECT c.* FROM ({page}) p JOIN conversations c ON c.id = p.id ORDER BY c.updated_at DESC, c.id",
            tuple(params),
        )
        return [conversation_record(r, self._damaged_cells) for r in rows]

    async def discard_empty_conversation(self, conversation_id: str) -> bool:
        """The row is locked first (FOR UPDATE): an accept into it, which takes a key-share lock
        on it for its foreign key, either committed before (the delete's read sees its turn) or
        waits and then fails on the gone row; never a turn deleted with it (ON DELETE CASCADE)."""

        async def job(conn: Conn) -> bool:
            cur = await conn.execute("SELECT 1 AS found FROM conversations WHERE id=%s FOR UPDATE", (conversation_id,))
            if await cur.fetchone() is None:
                return False
            deleted = await _count(
                conn,
                "DELETE FROM conversations WHERE id=%s AND NOT EXISTS (SELECT 1 FROM turns WHERE conversation_id=%s) "
                "AND NOT EXISTS (SELECT 1 FROM messages WHERE conversation_id=%s)",
                (conversation_id, conversation_id, conversation_id),
            )
            return deleted > 0

        return await self._write(job)

    async def update_conversation(self, conv: ConversationRecord) -> None:
        async def job(conn: Conn) -> None:
            await conn.execute(
                'UPDATE conversations SET title=%s, "user"=%s, metadata=%s, updated_at=%s WHERE id=%s',
                (conv.title, conv.user, dump_json(conv.metadata), time.time(), conv.id),
            )

        await self._write(job)

    # ------------------------------------------------------------ messages

    async def list_messages(
        self, conversation_id: str, *, before_id: int | None = None, limit: int | None = None
    ) -> list[MessageRecord]:
        if before_id is None and limit is None:
            rows = await self._rows("SELECT * FROM messages WHERE conversation_id=%s ORDER BY id", (conversation_id,))
        else:
            rows = await self._rows(
                "SELECT * FROM (SELECT * FROM messages WHERE conversation_id=%s AND id < %s ORDER BY id DESC "
                "LIMIT %s) m ORDER BY id",
                (conversation_id, before_id if before_id is not None else 2**62, _limit(limit)),
            )
        return [message_record(r, self._damaged_cells) for r in rows]

    async def history_page(
        self, conversation_id: str, *, before_id: int | None, limit: int, max_bytes: int
    ) -> tuple[list[MessageRecord], bool]:
        # The sizes first (octet_length reads no text), then only the rows that fit the budget.
        size_sum = " + ".join(f"coalesce(octet_length({c}), 0)" for c in SIZED_MESSAGE_COLUMNS)
        sizes = await self._rows(
            f"SELECT id, {size_sum} AS size FROM messages "  # column names, no input
            "WHERE conversation_id=%s AND id < %s ORDER BY id DESC LIMIT %s",
            (conversation_id, before_id if before_id is not None else 2**62, limit + 1),
        )
        ids: list[int] = []
        size, more = 0, False
        for r in sizes:
            if len(ids) == limit or (ids and size >= max_bytes):
                more = True
                break
            ids.append(int(r["id"]))
            size += int(r["size"])
        if not ids:
            return [], False
        rows = await self._rows("SELECT * FROM messages WHERE id = ANY(%s) ORDER BY id", (ids,))
        return [message_record(r, self._damaged_cells) for r in rows], more

    async def _insert_messages(
        self, conn: Conn, conversation_id: str, messages: list[MessageRecord], now: float
    ) -> None:
        """Pipelined: the inserts are sent now, their ids read with the rest of the group's results."""
        cursors = []
        for m in messages:
            m.conversation_id = conversation_id
            m.created_at = m.created_at or now
            cursors.append(
                await conn.execute(
                    _INSERT_MESSAGE,
                    (
                        conversation_id,
                        m.turn_id,
                        m.iteration,
                        m.role,
                        dump_json(m.content),
                        dump_json(m.tool_calls) if m.tool_calls else None,
                        _nul_free(m.tool_call_id),
                        _nul_free(m.name),
                        m.is_error,
                        _nul_free(m.reasoning),
                        dump_json(m.provider_state) if m.provider_state is not None else None,
                        m.completion_status,
                        dump_json(m.source) if m.source is not None else None,
                        m.created_at,
                        dump_json(m.meta) if m.meta else None,
                    ),
                )
            )

        async def fetch_ids() -> None:
            for m, cur in zip(messages, cursors, strict=True):
                row = await cur.fetchone()
                m.id = int(row["id"]) if row else None

        self._writes.defer(fetch_ids)

    async def append_messages(self, conversation_id: str, messages: list[MessageRecord]) -> None:
        now = time.time()

        async def job(conn: Conn) -> None:
            await conn.execute("UPDATE conversations SET updated_at=%s WHERE id=%s", (now, conversation_id))
            await self._insert_messages(conn, conversation_id, messages, now)

        await self._write(job)

    # ------------------------------------------------------------ turns

    async def accept_turn(self, turn: TurnRecord, idempotency_scope: str | None = None) -> TurnRecord:
        """Record an accepted input. With an idempotency key already used in `scope`, raise DuplicateTurn."""
        now = time.time()
        turn.created_at = turn.created_at or now

        async def job(conn: Conn) -> None:
            await self._insert_turn(conn, turn, idempotency_scope, now)

        try:
            await self._write(job)
        except psycopg.errors.ForeignKeyViolation as exc:
            raise ConversationGone(turn.conversation_id) from exc  # deleted since the request found it
        return turn

    async def accept_in_cluster(
        self, turn: TurnRecord, idempotency_scope: str | None, open_limit: int, *, start_if_free: bool = False
    ) -> list[str]:
        """Accept a turn of a conversation that servers of a cluster share: serialised with every
        other accept of the conversation (a transaction-scoped advisory lock), refused with
        OpenLimitReached when it already has `open_limit` queued or running turns (the queue
        bound, cluster-wide), stamped with the database's clock (acceptance order, whichever
        host accepted). Returns the ids of the turns it waits behind, in order: the one running
        or paused for answers (if any), then the conversation's queued turns accepted before it,
        which the holder runs first; their count is its queue position. `start_if_free`: the
        holder, idle, runs it at once when nothing is open: it is accepted as running (no second
        write to mark it so)."""

        async def job(conn: Conn) -> list[str]:
            await conn.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (ACCEPT_LOCK_CLASS, turn.conversation_id)
            )
            if turn.owner is not None and self.cluster is not None:  # the holder's accept: is it still?
                cur = await conn.execute(
                    "SELECT 1 AS held FROM conversation_owners WHERE conversation_id = %s AND instance_id = %s",
                    (turn.conversation_id, self.cluster.instance_id),
                )
                if await cur.fetchone() is None:
                    raise TurnSettledElsewhere(turn.id)
            cur = await conn.execute(
                "SELECT id, status FROM turns WHERE conversation_id = %s "
                "AND status IN ('queued', 'running', 'awaiting') ORDER BY seq",
                (turn.conversation_id,),
            )
            found = await cur.fetchall()
            rows = [r for r in found if r["status"] != "awaiting"]  # open: a paused turn holds no place
            if len(rows) >= open_limit:
                if turn.idempotency_key and idempotency_scope:  # a retry of an accepted input is no new input
                    cur = await conn.execute(
                        "SELECT t.* FROM idempotency_keys k JOIN turns t ON t.id = k.turn_id "
                        "WHERE k.scope=%s AND k.key=%s AND k.created_at >= %s",
                        (idempotency_scope, turn.idempotency_key, idempotency_cutoff()),
                    )
                    existing = await cur.fetchone()
                    if existing is not None:
                        raise DuplicateTurn(turn_record(existing, self._damaged_cells))
                raise OpenLimitReached(len(rows))
            cur = await conn.execute("SELECT extract(epoch from clock_timestamp()) AS now")
            clock = await cur.fetchone()
            turn.created_at = float(clock["now"]) if clock else time.time()
            if start_if_free and not rows:
                turn.status, turn.started_at = "running", turn.created_at
            await self._insert_turn(conn, turn, idempotency_scope, turn.created_at)
            # ahead of it: the turn running or paused for answers, then the queued ones by acceptance
            return [r["id"] for r in found if r["status"] != "queued"] + [
                r["id"] for r in found if r["status"] == "queued"
            ]

        try:
            return await self._turn_write(job)
        except psycopg.errors.ForeignKeyViolation as exc:
            raise ConversationGone(turn.conversation_id) from exc  # deleted since the request found it

    async def _insert_turn(self, conn: Conn, turn: TurnRecord, idempotency_scope: str | None, now: float) -> None:
        if turn.idempotency_key and idempotency_scope:
            # ON CONFLICT: a concurrent claim of the same key (another process) waits for it, then
            # loses; an expired key (a purge has not removed it yet) is this turn's, in this commit.
            cur = await conn.execute(
                "INSERT INTO idempotency_keys(scope, key, turn_id, conversation_id, created_at) "
                "VALUES (%s,%s,%s,%s,%s) ON CONFLICT (scope, key) DO UPDATE SET turn_id=EXCLUDED.turn_id, "
                "conversation_id=EXCLUDED.conversation_id, created_at=EXCLUDED.created_at "
                "WHERE idempotency_keys.created_at < %s RETURNING turn_id",
                (idempotency_scope, turn.idempotency_key, turn.id, turn.conversation_id, now, idempotency_cutoff(now)),
            )
            if await cur.fetchone() is None:
                cur = await conn.execute(
                    "SELECT t.* FROM idempotency_keys k JOIN turns t ON t.id = k.turn_id WHERE k.scope=%s AND k.key=%s",
                    (idempotency_scope, turn.idempotency_key),
                )
                existing = await cur.fetchone()
                if existing is not None:
                    raise DuplicateTurn(turn_record(existing, self._damaged_cells))
                # the key outlived its turn (deleted with its agent): it is this turn's now
                await conn.execute(
                    "UPDATE idempotency_keys SET turn_id=%s, conversation_id=%s, created_at=%s "
                    "WHERE scope=%s AND key=%s",
                    (turn.id, turn.conversation_id, now, idempotency_scope, turn.idempotency_key),
                )
        await conn.execute(
            "INSERT INTO turns(id, conversation_id, agent_id, status, idempotency_key, source, input, "
            "client_tools, options, owner, created_at, started_at, input_committed) "
            "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
            (
                turn.id,
                turn.conversation_id,
                turn.agent_id,
                turn.status,
                turn.idempotency_key,
                dump_json(turn.source) if turn.source is not None else None,
                dump_json(turn.input),
                dump_json(turn.client_tools),
                dump_json(turn.options),
                turn.owner,
                turn.created_at,
                turn.started_at,  # a turn that runs at once starts as it is accepted
                turn.input_committed,  # a re-run's input is in the history already (Kernel._rerun)
            ),
        )

    async def lookup_idempotency(self, scope: str, key: str) -> TurnRecord | None:
        row = await self._row(
            "SELECT t.* FROM idempotency_keys k JOIN turns t ON t.id = k.turn_id "
            "WHERE k.scope=%s AND k.key=%s AND k.created_at >= %s",
            (scope, key, idempotency_cutoff()),
        )
        return turn_record(row, self._damaged_cells) if row else None

    async def forget_idempotency(self, scope: str, key: str, turn_id: str) -> None:
        async def job(conn: Conn) -> int:
            sql = "DELETE FROM idempotency_keys WHERE scope=%s AND key=%s AND turn_id=%s"
            return await _count(conn, sql, (scope, key, turn_id))

        await self._write(job)

    async def remember_idempotency(self, scope: str, key: str, turn_id: str, conversation_id: str) -> None:
        async def job(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO idempotency_keys(scope, key, turn_id, conversation_id, created_at) "
                "VALUES (%s,%s,%s,%s,%s) ON CONFLICT (scope, key) DO UPDATE SET turn_id=EXCLUDED.turn_id, "
                "conversation_id=EXCLUDED.conversation_id, created_at=EXCLUDED.created_at",
                (scope, key, turn_id, conversation_id, time.time()),
            )

        await self._write(job)

    async def purge_idempotency(self, older_than: float) -> int:
        async def job(conn: Conn) -> int:
            return await _count(conn, "DELETE FROM idempotency_keys WHERE created_at < %s", (older_than,))

        return await self._write(job)

    def _lease_held(self) -> tuple[str, tuple[str, ...]]:
        """A clause for a turn's writes in a cluster: only while this server holds the turn's
        conversation (`turns` in the statement). A server the others judged gone (its session
        away, or the process stopped) may still have the turn in memory and connections that
        work; the lease, which a survivor took, is what says whose the conversation is."""
        cluster = self.cluster
        if cluster is None:
            return "", ()
        return (
            " AND EXISTS (SELECT 1 FROM conversation_owners o WHERE o.conversation_id = turns.conversation_id "
            "AND o.instance_id = %s)",
            (cluster.instance_id,),
        )

    async def _turn_write(self, job: Job[T]) -> T:
        """A write of a turn's state. Refused (TurnSettledElsewhere, once the group's outcome is
        final: a group that failed elsewhere runs again) because its conversation's lease is
        another server's, this server is fenced: its conversations in memory may all be another's
        by now."""
        try:
            return await self._write(job)
        except TurnSettledElsewhere as exc:
            cluster = self.cluster
            if cluster is not None:
                held = await self._row(
                    "SELECT 1 AS held FROM turns t JOIN conversation_owners o ON o.conversation_id = t.conversation_id "
                    "WHERE t.id = %s AND o.instance_id = %s",
                    (exc.turn_id, cluster.instance_id),
                )
                if held is None and await self._row(
                    f"SELECT 1 AS here FROM instances i WHERE i.id = %(id)s AND {LIVE_SINCE}",
                    {**cluster.params, "id": cluster.instance_id},
                ):
                    # This server is live by the others' judgement: nobody could take its leases, so
                    # this one was never its (one refused write, never a reason to stop serving).
                    log.warning("a write of turn %s was refused: its conversation is not this server's", exc.turn_id)
                elif held is None:  # judged gone: its conversation is another server's now, so may all be
                    cluster.judged_gone()
                    # Judged gone just now, the kernel stopped the turns it ran (Kernel._taken_over):
                    # if this write was one of theirs, its cancel lands here, and the turn ends
                    # nothing here (no failure published for a turn the new holder settles).
                    await asyncio.sleep(0)
            raise

    async def _gone_or_taken_over(self, conn: Conn, conversation_id: str, turn_id: str) -> None:
        """A turn's write found no row to change: its conversation was deleted (ConversationGone),
        or the turn is another server's now (settled, or its conversation's lease taken)."""
        if await _turn_exists(conn, turn_id):
            raise TurnSettledElsewhere(turn_id)
        raise ConversationGone(conversation_id)

    async def mark_turn_running(self, turn_id: str, owner: str, revision: int) -> None:
        now = time.time()

        async def job(conn: Conn) -> None:
            # Fenced: a turn another server of the cluster took over (it runs it, or settled it)
            # is not started here too, and a settled turn is never started again (a second queue
            # entry for it would run it twice).
            held, held_args = self._lease_held()
            updated = await conn.execute(
                "UPDATE turns SET status='running', owner=%s, revision=%s, started_at=COALESCE(started_at, %s) "
                "WHERE id=%s AND (status IN ('queued', 'awaiting') OR (status = 'running' AND (owner = %s "
                f"OR owner IS NULL))){held} RETURNING id",
                (owner, revision, now, turn_id, owner, *held_args),
            )

            async def still_ours() -> None:
                if await updated.fetchone() is None:
                    # No row yet is no refusal: a turn started before its accept commits (an
                    # overlapped accept, later in this group or the next) is written running by it.
                    if await _turn_exists(conn, turn_id):
                        raise TurnSettledElsewhere(turn_id)

            self._writes.defer(still_ours)

        await self._turn_write(job)

    async def save_draft(self, turn_id: str, draft: dict[str, Any]) -> None:
        text = dump_json(draft)

        async def job(conn: Conn) -> None:
            await conn.execute(DRAFT_UPDATE, (text, turn_id))

        await self._write(job)

    async def record_cancel(
        self, turn_id: str, cancel_ack: dict[str, Any], *, reason: str, draft: dict[str, Any] | None = None
    ) -> bool:
        """Fenced as `mark_turn_running`: an open turn whose conversation another server of the
        cluster holds now is refused (TurnSettledElsewhere), never marked from here."""
        mark, text = dump_json(cancel_ack), dump_json(draft) if draft is not None else None

        async def job(conn: Conn) -> bool:
            held, held_args = self._lease_held()
            cur = await conn.execute(
                "UPDATE turns SET cancel_ack=%s, draft=COALESCE(%s, draft) "
                f"WHERE id=%s AND status IN ('queued', 'running', 'awaiting'){held} RETURNING id",
                (mark, text, turn_id, *held_args),
            )
            if await cur.fetchone() is None:
                if held:
                    still = await conn.execute(
                        "SELECT 1 FROM turns WHERE id=%s AND status IN ('queued', 'running', 'awaiting')", (turn_id,)
                    )
                    if await still.fetchone() is not None:
                        raise TurnSettledElsewhere(turn_id)
                return False
            await conn.execute(
                "UPDATE pending_calls SET status='cancelled', is_error=TRUE, reason=%s "
                "WHERE turn_id=%s AND status='pending'",
                (_nul_free(reason), turn_id),
            )
            return True

        return await self._turn_write(job)

    async def commit_turn(self, conversation_id: str, commit: TurnCommit) -> None:
        """One turn's rows, atomically, in the next group transaction."""

        async def job(conn: Conn) -> None:
            await self._commit_turn(conn, conversation_id, commit)

        try:
            await self._turn_write(job)
        except psycopg.errors.ForeignKeyViolation as exc:
            # Every row a commit inserts refers to its conversation: deleted meanwhile. (Raised when
            # the group's pipeline syncs, so here rather than inside the job.)
            raise ConversationGone(conversation_id) from exc
        except (ConversationGone, TurnSettledElsewhere):
            raise  # not this server's turn to write any more
        except Exception as exc:
            # The turn ends failed here (runtime/finish.py), but its row still says running (or
            # paused): no sweep settles it while this server lives. `repair` writes that end.
            if self.cluster is not None:
                kind = "store_unavailable" if isinstance(exc, StoreUnavailable) else "store"
                error = {"kind": kind, "message": f"the turn could not be saved: {exc}", "retryable": False}
                self._loose_turns[commit.turn_id] = (dump_json({**error, "status": None}), commit.revision)
            raise

    async def checkpoint_turn(
        self,
        conversation_id: str,
        turn_id: str,
        messages: list[MessageRecord],
        *,
        iteration: int,
        usage: dict[str, int],
    ) -> None:
        """Committed before this returns: a tool may act right after."""
        now = time.time()
        for m in messages:
            m.turn_id = m.turn_id or turn_id

        async def job(conn: Conn) -> None:
            # Before a server tool acts: never on a server whose conversation was taken over.
            held, held_args = self._lease_held()
            updated = await conn.execute(
                "UPDATE turns SET input_committed=TRUE, iteration=%s, usage=%s, draft=NULL "
                f"WHERE id=%s AND {NOT_SETTLED}{held} RETURNING id",
                (iteration, dump_json(usage), turn_id, *held_args),
            )
            await conn.execute("UPDATE conversations SET updated_at=%s WHERE id=%s", (now, conversation_id))
            await self._insert_messages(conn, conversation_id, messages, now)

            async def turn_still_there() -> None:  # gone with its conversation (maybe created again since)
                if await updated.fetchone() is None:
                    await self._gone_or_taken_over(conn, conversation_id, turn_id)

            self._writes.defer(turn_still_there)

        try:
            await self._turn_write(job)
        except psycopg.errors.ForeignKeyViolation as exc:
            raise ConversationGone(conversation_id) from exc

    async def _commit_turn(self, conn: Conn, conversation_id: str, commit: TurnCommit) -> None:
        now = time.time()
        terminal = commit.status in ("completed", "cancelled", "failed", "interrupted")
        for m in commit.messages:
            m.turn_id = m.turn_id or commit.turn_id
        for p in commit.pending:
            await conn.execute(
                _INSERT_PENDING,
                (
                    conversation_id,
                    _nul_free(p.call_id),
                    p.turn_id,
                    _nul_free(p.name),
                    _nul_free(p.arguments),
                    p.kind,
                    p.status,
                    _nul_free(p.output),
                    p.is_error,
                    _nul_free(p.reason),
                    _nul_free(p.decided_by),
                    p.created_at or now,
                    p.expires_at,
                ),
            )
        held, held_args = self._lease_held()
        updated = await conn.execute(
            "UPDATE turns SET status=%s, stop_reason=%s, error=%s, usage=%s, revision=%s, iteration=%s, "
            "input_committed=%s, draft=NULL, ended_at=%s "
            f"WHERE id=%s AND {NOT_SETTLED}{held} RETURNING id",
            (
                commit.status,
                commit.stop_reason,
                dump_json(commit.error) if commit.error is not None else None,
                dump_json(commit.usage),
                commit.revision,
                commit.iteration,
                commit.input_committed,
                now if terminal else None,
                commit.turn_id,
                *held_args,
            ),
        )

        async def turn_still_there() -> None:
            # The turn's row went with its conversation: deleted while the turn ran (maybe created
            # again under the same id since, which must not receive this turn's messages). Or it
            # is settled already: another server of the cluster took the conversation over.
            if await updated.fetchone() is None:
                await self._gone_or_taken_over(conn, conversation_id, commit.turn_id)

        self._writes.defer(turn_still_there)
        if terminal and (commit.iteration > 1 or commit.pending or commit.stop_reason != "end_turn"):
            # Pending calls that never got an answer are closed with the turn.
            await conn.execute(
                "UPDATE pending_calls SET status='cancelled' WHERE turn_id=%s AND status='pending'", (commit.turn_id,)
            )
        await conn.execute("UPDATE conversations SET updated_at=%s WHERE id=%s", (now, conversation_id))
        await self._insert_messages(conn, conversation_id, commit.messages, now)

    async def get_turn(self, turn_id: str) -> TurnRecord | None:
        row = await self._row("SELECT * FROM turns WHERE id=%s", (turn_id,))
        return turn_record(row, self._damaged_cells) if row else None

    async def list_turns(self, conversation_id: str, *, statuses: Iterable[str] | None = None) -> list[TurnRecord]:
        if statuses is None:
            rows = await self._rows("SELECT * FROM turns WHERE conversation_id=%s ORDER BY seq", (conversation_id,))
        else:
            rows = await self._rows(
                "SELECT * FROM turns WHERE conversation_id=%s AND status = ANY(%s) ORDER BY seq",
                (conversation_id, list(statuses)),
            )
        return [turn_record(r, self._damaged_cells) for r in rows]

    async def open_turns(self, statuses: Iterable[str] = ("queued", "running", "awaiting")) -> list[TurnRecord]:
        rows = await self._rows("SELECT * FROM turns WHERE status = ANY(%s) ORDER BY seq", (list(statuses),))
        return [turn_record(r, self._damaged_cells) for r in rows]

    # ------------------------------------------------------------ pending calls

    async def list_pending(self, turn_id: str) -> list[PendingCall]:
        rows = await self._rows("SELECT * FROM pending_calls WHERE turn_id=%s ORDER BY created_at, seq", (turn_id,))
        return [pending_call(r) for r in rows]

    async def get_pending(self, conversation_id: str, call_id: str) -> PendingCall | None:
        row = await self._row(
            "SELECT * FROM pending_calls WHERE conversation_id=%s AND call_id=%s", (conversation_id, call_id)
        )
        return pending_call(row) if row else None

    async def resolve_pending(
        self,
        conversation_id: str,
        call_id: str,
        status: str,
        *,
        output: str | None = None,
        is_error: bool = False,
        reason: str | None = None,
        decided_by: str | None = None,
        settings: TurnSettings | None = None,
    ) -> bool:
        """Answer one pending call. First answer wins: returns False when it was already answered.
        `settings`: written over its paused turn's options and client tools with the answer."""

        async def job(conn: Conn) -> bool:
            n = await _count(
                conn,
                "UPDATE pending_calls SET status=%s, output=%s, is_error=%s, reason=%s, decided_by=%s "
                "WHERE conversation_id=%s AND call_id=%s AND status='pending'",
                (
                    status,
                    _nul_free(output),
                    is_error,
                    _nul_free(reason),
                    _nul_free(decided_by),
                    conversation_id,
                    call_id,
                ),
            )
            if n == 1 and settings is not None:
                await conn.execute(
                    "UPDATE turns SET options=%s, client_tools=%s WHERE status='awaiting' AND id="
                    "(SELECT turn_id FROM pending_calls WHERE conversation_id=%s AND call_id=%s)",
                    (dump_json(settings.options), dump_json(settings.client_tools), conversation_id, call_id),
                )
            return n == 1

        return await self._write(job)

    async def overdue_pending(self, now: float) -> list[PendingCall]:
        rows = await self._rows(
            "SELECT * FROM pending_calls WHERE status='pending' AND expires_at IS NOT NULL AND expires_at <= %s "
            "ORDER BY expires_at, seq",
            (now,),
        )
        return [pending_call(r) for r in rows]

    # ------------------------------------------------------------ OpenAI HTTP surface

    async def last_message_id(self, conversation_id: str) -> int:
        row = await self._row("SELECT MAX(id) AS id FROM messages WHERE conversation_id=%s", (conversation_id,))
        return int(row["id"] or 0) if row else 0

    async def last_message_ids(self, conversation_ids: Collection[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(conversation_ids))
        heads = dict.fromkeys(ids, 0)
        if ids:
            rows = await self._rows(
                "SELECT conversation_id, MAX(id) AS id FROM messages WHERE conversation_id = ANY(%s) "
                "GROUP BY conversation_id",
                (ids,),
            )
            heads.update((r["conversation_id"], int(r["id"] or 0)) for r in rows)
        return heads

    async def save_response(self, response: ResponseRecord) -> None:
        response.created_at = response.created_at or time.time()

        async def job(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO responses(id, agent_id, conversation_id, turn_id, previous_response_id, namespace, "
                "last_message_id, body, input_items, stored, created_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) "
                "ON CONFLICT (id) DO UPDATE SET agent_id=EXCLUDED.agent_id, conversation_id=EXCLUDED.conversation_id, "
                "turn_id=EXCLUDED.turn_id, previous_response_id=EXCLUDED.previous_response_id, "
                "namespace=EXCLUDED.namespace, last_message_id=EXCLUDED.last_message_id, body=EXCLUDED.body, "
                "input_items=EXCLUDED.input_items, stored=EXCLUDED.stored, created_at=EXCLUDED.created_at",
                (
                    response.id,
                    response.agent_id,
                    response.conversation_id,
                    response.turn_id,
                    response.previous_response_id,
                    response.namespace,
                    response.last_message_id,
                    dump_json(response.body),
                    dump_json(response.input_items),
                    response.stored,
                    response.created_at,
                ),
            )

        await self._write(job)

    async def get_response(self, response_id: str) -> ResponseRecord | None:
        row = await self._row("SELECT * FROM responses WHERE id=%s", (response_id,))
        return response_record(row, self._damaged_cells) if row else None

    async def get_response_owner(self, response_id: str) -> ResponseOwner | None:
        row = await self._row(f"SELECT {RESPONSE_OWNER_COLUMNS} FROM responses WHERE id=%s", (response_id,))
        return response_owner(row) if row else None

    async def delete_response(self, response_id: str) -> bool:
        async def job(conn: Conn) -> bool:
            return await _count(conn, "DELETE FROM responses WHERE id=%s", (response_id,)) > 0

        return await self._write(job)

    async def _orphaned(self, conn: Conn, owner: str | None) -> bool:
        """A pending key's claimant is gone (killed mid-request): nobody will ever finish it. A
        server of the cluster (`inst_…`) is judged by its instance row and lock, as the cluster
        judges it; a claim stamped by a process identity (a CLI, or an older server) only on its
        own host."""
        if owner == self.owner:
            return False
        if owner and owner.startswith("inst_"):
            cluster = self.cluster
            judged = (
                cluster.params
                if cluster is not None
                else {"timeout": self.instance_timeout_s, "grace": self.heartbeat_s * 2.5, "back": 0.0, "until": AWAY}
            )
            cur = await conn.execute(
                f"SELECT 1 AS ok FROM instances i WHERE i.id = %(id)s AND {LIVE_SINCE}", {**judged, "id": owner}
            )
            return await cur.fetchone() is None
        ident, at, host = (owner or "").partition("@")
        if at and host != self.host:
            return False
        return not identity_alive(ident or None)

    async def claim_http_idempotency(self, entry: HttpIdempotency) -> HttpIdempotency | None:
        """A pending key whose claimant died is taken over (the retry runs the request), and so is
        one this process claimed but no longer works on (its end could not be written: an outage),
        or one released (owner NULL: `release_orphaned_http_idempotency`, `repair`). Only by a
        repeat of its request: one with another body gets the key's entry (409 from the caller),
        never the claim, whose turn `Idempotency.earlier` would follow (the other request's). An
        expired key is replaced, whatever it holds, in the insert that claims it."""
        entry.created_at = entry.created_at or time.time()
        entry.owner = entry.owner or self.owner
        k = (entry.scope, entry.key)

        async def job(conn: Conn) -> HttpIdempotency | None:
            # `_claimed` is read and written here, in the writer's order: a claim and the end of
            # the request that made it are seen in the order they were made.
            cur = await conn.execute(
                "INSERT INTO http_idempotency(scope, key, body_hash, state, created_at, owner) "
                f"VALUES (%s,%s,%s,'pending',%s,%s) ON CONFLICT (scope, key) DO UPDATE SET {RESET_HTTP_KEY} "
                "WHERE http_idempotency.created_at < %s RETURNING 1",
                (entry.scope, entry.key, entry.body_hash, entry.created_at, entry.owner, idempotency_cutoff()),
            )
            if await cur.fetchone() is not None:
                self._claimed[k] = entry.created_at
                return None
            cur = await conn.execute(
                "SELECT * FROM http_idempotency WHERE scope=%s AND key=%s FOR UPDATE", (entry.scope, entry.key)
            )
            row = await cur.fetchone()
            if row is not None:
                if row["state"] != "pending" or row["body_hash"] != entry.body_hash:
                    return http_idempotency(row)
                if row["owner"] is None:
                    log.warning(
                        "Idempotency-Key %r was released (its request never ended): this repeat takes it over",
                        entry.key,
                    )
                elif row["owner"] == self.owner and self._claimed.get(k) != row["created_at"]:
                    log.warning(
                        "Idempotency-Key %r: its earlier request here ended but its end could not be written "
                        "(the database was away): this request takes it over",
                        entry.key,
                    )
                elif not await self._orphaned(conn, row["owner"]):
                    return http_idempotency(row)
                else:
                    log.warning(
                        "Idempotency-Key %r was claimed by a process that is gone (%s): this request takes it over",
                        entry.key,
                        row["owner"],
                    )
            await conn.execute(
                "INSERT INTO http_idempotency(scope, key, body_hash, state, created_at, owner) "
                f"VALUES (%s,%s,%s,'pending',%s,%s) ON CONFLICT (scope, key) DO UPDATE SET {RESET_HTTP_KEY}",
                (entry.scope, entry.key, entry.body_hash, entry.created_at, entry.owner),
            )
            self._claimed[k] = entry.created_at
            return None

        try:
            return await self._write(job)
        except Exception:
            # Its outcome may be unknown (committed as the connection ended): a key left pending
            # under this process would keep every retry elsewhere waiting.
            if self._claimed.get(k) == entry.created_at:
                del self._claimed[k]
            if entry.owner == self.owner:
                self._loose_keys[k] = entry.created_at
                self._loose_answers.discard(k)
            raise

    async def release_orphaned_http_idempotency(self) -> int:
        async def job(conn: Conn) -> int:
            cur = await conn.execute(
                "SELECT scope, key, owner FROM http_idempotency WHERE state='pending' AND owner IS NOT NULL FOR UPDATE"
            )
            gone = [(r["scope"], r["key"]) for r in await cur.fetchall() if await self._orphaned(conn, r["owner"])]
            for scope, key in gone:
                await conn.execute(RELEASE_HTTP_KEY, (scope, key))
            return len(gone)

        return await self._write(job)

    async def get_http_idempotency(self, scope: str, key: str) -> HttpIdempotency | None:
        row = await self._row(
            "SELECT * FROM http_idempotency WHERE scope=%s AND key=%s AND created_at >= %s",
            (scope, key, idempotency_cutoff()),
        )
        return http_idempotency(row) if row else None

    async def finish_http_idempotency(
        self, scope: str, key: str, status_code: int, content_type: str, body: str, conversation_id: str | None
    ) -> None:
        claim = self._claimed.get((scope, key))

        async def job(conn: Conn) -> None:
            self._ended((scope, key), claim)
            await conn.execute(
                "UPDATE http_idempotency SET state='done', status_code=%s, content_type=%s, body=%s, "
                "conversation_id=%s WHERE scope=%s AND key=%s",
                (status_code, content_type, body, conversation_id, scope, key),
            )

        await self._end_write(job, (scope, key), claim, answered=True)

    async def drop_http_idempotency(self, scope: str, key: str) -> None:
        claim = self._claimed.get((scope, key))

        async def job(conn: Conn) -> None:
            self._ended((scope, key), claim)
            await conn.execute("DELETE FROM http_idempotency WHERE scope=%s AND key=%s", (scope, key))

        await self._end_write(job, (scope, key), claim)

    def _ended(self, k: tuple[str, str], claim: float | None) -> None:
        """The request that claimed `k` (at `claim`) ended: no longer worked on here."""
        if claim is not None and self._claimed.get(k) == claim:
            del self._claimed[k]

    async def _end_write(
        self, job: Job[None], k: tuple[str, str], claim: float | None, *, answered: bool = False
    ) -> None:
        """Write a claimed key's end. One that fails (the database away) leaves the key pending
        under this live server, where every retry, on any server, would wait for it forever: it
        is remembered and released by `repair` once the database is back (a retry then runs the
        request again, or follows its turn: `Idempotency.earlier`). An `answered` end (a stored
        answer: its turn completed) is released for a repeat of its request only, not deleted
        (RELEASE_HTTP_KEY); a release after an error is deleted, as it would have been.

        While the database is `unreachable` the end is not tried: its request already waited
        connect_timeout_s for a connection (its turn's commit), and a second wait, for the same
        outcome, doubled the time to its 503."""
        try:
            if self.unreachable:
                raise StoreUnavailable(
                    f"PostgreSQL store {self.shown_url}: the database could not be reached within "
                    f"{self.connect_timeout_s:g} s ([store] connect_timeout_s), nor since: this request's "
                    "Idempotency-Key is released once it is back"
                )
            await self._write(job)
        except Exception:
            self._ended(k, claim)
            if claim is not None:
                self._loose_keys[k] = claim
                if answered:
                    self._loose_answers.add(k)
                else:
                    self._loose_answers.discard(k)
            raise

    async def repair(self) -> None:
        """Write what an outage kept from being written (see `_loose_keys`, `_loose_turns`): each
        key released only while still pending under this claim, each turn settled failed only
        while it still runs under this server. Run by the cluster after each heartbeat."""
        keys = dict(self._loose_keys)
        answers = set(self._loose_answers)
        turns = dict(self._loose_turns)
        if not keys and not turns:
            return
        owner = self.owner
        now = time.time()

        async def job(conn: Conn) -> tuple[int, int]:
            released = settled = 0
            for (scope, key), created_at in keys.items():
                end = RELEASE_HTTP_KEY if (scope, key) in answers else DROP_HTTP_KEY
                released += await _count(conn, end + " AND owner=%s AND created_at=%s", (scope, key, owner, created_at))
            for turn_id, (error, revision) in turns.items():
                settled += await _count(
                    conn,
                    "UPDATE turns SET status='failed', stop_reason='error', error=%s, draft=NULL, ended_at=%s, "
                    f"revision=GREATEST(revision, %s) WHERE id=%s AND {NOT_SETTLED} AND owner=%s",
                    (error, now, revision, turn_id, owner),
                )
            return released, settled

        released, settled = await self._write(job)
        for k, created_at in keys.items():
            if self._loose_keys.get(k) == created_at:
                del self._loose_keys[k]
                self._loose_answers.discard(k)
        for turn_id in turns:
            self._loose_turns.pop(turn_id, None)
        if released or settled:
            log.warning(
                "the database is back: released %d Idempotency-Key(s) of requests that ended while it was away "
                "(a retry runs them), and settled %d turn(s) as failed whose end could not be saved",
                released,
                settled,
            )

    async def note_http_idempotency(
        self, scope: str, key: str, content_type: str, body: str, conversation_id: str | None
    ) -> None:
        async def job(conn: Conn) -> None:
            await conn.execute(
                "UPDATE http_idempotency SET content_type=%s, body=%s, conversation_id=%s "
                "WHERE scope=%s AND key=%s AND state='pending'",
                (content_type, body, conversation_id, scope, key),
            )

        await self._write(job)

    async def answered_http_idempotency(self, conversation_id: str) -> list[HttpIdempotency]:
        rows = await self._rows(
            "SELECT * FROM http_idempotency WHERE conversation_id=%s AND (state='done' OR body IS NOT NULL)",
            (conversation_id,),
        )
        return [http_idempotency(r) for r in rows]

    async def purge_http_idempotency(self, older_than: float) -> int:
        async def job(conn: Conn) -> int:
            return await _count(conn, "DELETE FROM http_idempotency WHERE created_at < %s", (older_than,))

        return await self._write(job)

    async def add_history_point(self, point: HistoryPoint, *, wait: bool = True) -> None:
        """Committed on return, `wait` or not (a round trip either way)."""
        created = point.created_at or time.time()

        async def job(conn: Conn) -> None:
            # Only while the conversation exists: one deleted since (with its agent) needs no point.
            # With its owner, which a lookup's index holds (`history_points_read`); also over a
            # point an older server wrote without it (rolling upgrade).
            await conn.execute(
                "INSERT INTO history_points(agent_id, prefix_hash, conversation_id, last_message_id, created_at, "
                "namespace) SELECT %s,%s,%s,%s,%s, namespace FROM conversations WHERE id=%s "
                "ON CONFLICT (agent_id, prefix_hash, conversation_id) DO UPDATE SET "
                "last_message_id=EXCLUDED.last_message_id, created_at=EXCLUDED.created_at, "
                "namespace=EXCLUDED.namespace",
                (
                    point.agent_id,
                    point.prefix_hash,
                    point.conversation_id,
                    point.last_message_id,
                    created,
                    point.conversation_id,
                ),
            )

        await self._write(job)

    async def find_history_points(
        self, agent_id: str, prefix_hash: str, *, namespace: str | None = None, limit: int = 100
    ) -> list[HistoryPoint]:
        query, params = history_points_read("%s", agent_id, prefix_hash, namespace, limit)
        rows = await self._rows(query, tuple(params))
        return [
            HistoryPoint(r["agent_id"], r["prefix_hash"], r["conversation_id"], r["last_message_id"], r["created_at"])
            for r in rows
        ]

    # ------------------------------------------------------------ store copy

    async def copy_from_sqlite(
        self,
        source: sqlite3.Connection,
        cron_doc: str | None = None,
        tokens: Iterable[Mapping[str, Any]] = (),
        replaced: dict[str, list[str]] | None = None,
    ) -> dict[str, int]:
        """Copy every data table of an SQLite store (an open connection at the newest SQLite schema)
        into this one, which must be empty: one PostgreSQL transaction (all or nothing) reading one
        SQLite snapshot. Message ids are kept (responses and history points refer to them); the
        rows of each table go in their SQLite insertion order. `cron_doc`: the home's cron tasks
        (crons.json's text), which a database store keeps in `cron_state`; `tokens`: the home's
        capability tokens (tokens.json's entries, hashes only). Returns rows copied per table.

        A text value holding NUL characters (which PostgreSQL text cannot hold; older versions
        stored them as a client sent them) is copied with each NUL replaced by U+FFFD; `replaced`
        (when given) receives `table.column` → the ids of the rows changed. A column the target
        does not have (a store edited by hand or damaged) refuses the copy, naming it."""
        await self._writes.settle()
        counts: dict[str, int] = {}
        async with self.pool.connection() as conn, conn.transaction():
            # A server starting on the database meanwhile finds no agent and creates `assistant`
            # (create_first_agent): under this lock, so it waits for this transaction and then
            # finds the copied agents (LOCK TABLE … EXCLUSIVE does not keep it from reading them).
            await conn.execute("SET LOCAL statement_timeout = 0")  # a large copy's statements may run long
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (FIRST_AGENT_LOCK,))
            await conn.execute(
                sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(sql.SQL(", ").join(map(sql.Identifier, DATA_TABLES)))
            )
            present: dict[str, int] = {}
            for table in DATA_TABLES:
                cur = await conn.execute(sql.SQL("SELECT count(*) AS n FROM {}").format(sql.Identifier(table)))
                row = await cur.fetchone()
                if row and row["n"]:
                    present[table] = int(row["n"])
            cur = await conn.execute("SELECT doc FROM cron_state WHERE id = 1 FOR UPDATE")
            cron_row = await cur.fetchone()
            held = decode_json(str(cron_row["doc"]) or "{}", OBJECT, refuse, "cron_state", 1, "doc") if cron_row else {}
            if isinstance(held, dict) and held.get("tasks"):
                present["cron_state"] = len(held["tasks"])
            cur = await conn.execute("SELECT count(*) AS n FROM tokens")
            row = await cur.fetchone()
            if row and row["n"]:
                present["tokens"] = int(row["n"])
            if present:
                shown = ", ".join(f"{n} {t}" for t, n in present.items())
                raise StoreError(
                    f"{self.shown_url} is not empty ({shown}): `store copy` only fills an empty database; "
                    "point --to at a new database (createdb NAME), or drop this one's data first"
                )
            source.execute("BEGIN")  # one read snapshot of the SQLite store
            try:
                for table in DATA_TABLES:
                    counts[table] = await _copy_table(conn, source, table, replaced if replaced is not None else {})
            finally:
                source.execute("ROLLBACK")
            await conn.execute(
                "SELECT setval(pg_get_serial_sequence('messages', 'id'), COALESCE((SELECT MAX(id) FROM messages), 1), "
                "(SELECT MAX(id) FROM messages) IS NOT NULL)"
            )
            counts["tokens"] = 0
            for t in tokens:
                await conn.execute(
                    "INSERT INTO tokens(id, name, hash, agents, scopes, created_at, expires_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    (
                        t["id"],
                        t["name"],
                        t["hash"],
                        dump_json(t["agents"]) if t.get("agents") is not None else None,
                        dump_json(t.get("scopes") or []),
                        t.get("created_at") or 0.0,
                        t.get("expires_at"),
                    ),
                )
                counts["tokens"] += 1
            if counts["tokens"]:
                await conn.execute(
                    "INSERT INTO token_state(id, version) VALUES (1, 1) "
                    "ON CONFLICT (id) DO UPDATE SET version = token_state.version + 1"
                )
            if cron_doc is not None:
                await conn.execute(
                    "INSERT INTO cron_state(id, doc, version) VALUES (1, %s, 1) "
                    "ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, version = cron_state.version + 1",
                    (cron_doc,),
                )
        return counts


async def _copy_table(conn: Conn, source: sqlite3.Connection, table: str, replaced: dict[str, list[str]]) -> int:
    cur = await conn.execute(
        "SELECT column_name, data_type, is_identity, identity_generation FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
        (table,),
    )
    rows = await cur.fetchall()
    known = {r["column_name"] for r in rows}
    target = {
        r["column_name"]: r["data_type"]
        for r in rows
        if not (r["is_identity"] == "YES" and r["identity_generation"] == "ALWAYS")
    }
    have = [r[1] for r in source.execute(f'PRAGMA table_info("{table}")')]
    extra = [c for c in have if c not in known]
    if extra:  # a newer schema is refused before this: a column of no version is a hand edit or damage
        raise StoreError(
            f"the SQLite table {table} has column(s) {', '.join(extra)}, which no appserver schema has "
            "(the store was changed by hand or by another program): nothing was copied; remove them "
            "or restore the store from a backup"
        )
    columns = [c for c in have if c in target]
    booleans = {i for i, c in enumerate(columns) if target[c] == "boolean"}
    key = "id" if "id" in have else "rowid"
    select = "SELECT " + ", ".join([*(f'"{c}"' for c in columns), f'"{key}"']) + f' FROM "{table}" ORDER BY rowid'
    copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    n = 0
    blob: tuple[object, str] | None = None  # (row id, column) of a BLOB found: refused after the COPY
    undecodable = False  # a text value SQLite cannot decode as UTF-8: refused after the COPY, naming its row
    try:
        async with conn.cursor().copy(copy_sql) as copy:
            try:
                for *row, row_id in source.execute(select):
                    values = []
                    for i, v in enumerate(row):
                        if i in booleans and v is not None:
                            v = bool(v)
                        elif isinstance(v, str) and "\x00" in v:
                            v = v.replace("\x00", "\ufffd")
                            replaced.setdefault(f"{table}.{columns[i]}", []).append(str(row_id))
                        elif isinstance(v, bytes):  # no column of appserver's holds binary data
                            blob = (row_id, columns[i])
                        values.append(v)
                    if blob is not None:
                        break
                    await copy.write_row(tuple(values))
                    n += 1
            except sqlite3.OperationalError as exc:  # raised by the fetch, which names no row
                if "UTF-8" not in str(exc):
                    raise
                undecodable = True
    except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:
        raise _copy_refused(table, _refused_row(source, table, key, exc), _pg_reason(exc)) from None
    if undecodable:
        raise _copy_refused(table, *_undecodable_row(source, table, columns, key))
    if blob is not None:
        row = f"the row with {key} {blob[0]}"
        raise _copy_refused(table, row, f"its column {blob[1]} holds binary data (a BLOB), where appserver keeps text")
    return n


def _refused_row(source: sqlite3.Connection, table: str, key: str, exc: psycopg.Error) -> str:
    """Which SQLite row PostgreSQL refused: the COPY's line (a value of the wrong type), or the rows
    holding the key a foreign key found missing (a message of a conversation that is gone)."""
    line = re.search(r"\bline (\d+)", exc.diag.context or "")
    if line:
        found = source.execute(
            f'SELECT "{key}" FROM "{table}" ORDER BY rowid LIMIT 1 OFFSET ?', (int(line.group(1)) - 1,)
        ).fetchone()
        return f"the row with {key} {found[0]}" if found else f"its row {line.group(1)}"
    missing = re.search(r"Key \((\w+)\)=\((.*)\) is not present", exc.diag.message_detail or "")
    if missing and missing.group(1) in {r[1] for r in source.execute(f'PRAGMA table_info("{table}")')}:
        ids = [
            str(r[0])
            for r in source.execute(
                f'SELECT "{key}" FROM "{table}" WHERE "{missing.group(1)}" = ? ORDER BY rowid LIMIT 6',
                (missing.group(2),),
            )
        ]
        if len(ids) == 1:
            return f"the row with {key} {ids[0]}"
        if ids:
            return f"the rows with {key} " + ", ".join(ids[:5]) + (" and more" if len(ids) > 5 else "")
    return "a row"


def _undecodable_row(source: sqlite3.Connection, table: str, columns: list[str], key: str) -> tuple[str, str]:
    """(the row, why) of the first value of `table` that is not UTF-8, found by reading every value
    as its bytes (sqlite3's decode error names the column and the text, never the row)."""
    as_bytes = ", ".join(f'CAST("{c}" AS BLOB)' for c in columns)
    query = f'SELECT CAST("{key}" AS BLOB), {as_bytes} FROM "{table}" ORDER BY rowid'
    for raw_key, *values in source.execute(query):
        for column, value in zip(columns, values, strict=True):
            if not isinstance(value, bytes):
                continue
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as bad:
                shown = raw_key.decode("utf-8", "backslashreplace") if isinstance(raw_key, bytes) else raw_key
                return (
                    f"the row with {key} {shown}",
                    f"its column {column} holds text that is not UTF-8 (byte {value[bad.start]:#04x} at offset "
                    f"{bad.start})",
                )
    return "a row", "a text value is not UTF-8"


def _copy_refused(table: str, row: str, why: str) -> StoreError:
    """The copy refused for a damaged SQLite row, naming it: nothing was copied (the transaction is
    rolled back), and the operator knows what to repair."""
    return StoreError(
        f"the SQLite table {table} cannot be copied: {row}: {why}; nothing was copied: repair or delete that row "
        "in the SQLite store (or restore the store from a backup), then copy again"
    )


def _pg_reason(exc: psycopg.Error) -> str:
    """PostgreSQL's reason, with its detail (the missing key), on one line."""
    reason = (exc.diag.message_primary or str(exc)).strip()
    detail = (exc.diag.message_detail or "").strip()
    return " ".join(f"{reason} ({detail})".split()) if detail else " ".join(reason.split())


async def _insert_agent(conn: Conn, agent: AgentRecord) -> None:
    await conn.execute(
        "INSERT INTO agents(id, name, model, system, tools, params, created_at, updated_at) "
        "VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
        (
            agent.id,
            agent.name,
            agent.model,
            agent.system,
            dump_json(agent.tools),
            dump_json(agent.params),
            agent.created_at,
            agent.updated_at,
        ),
    )


async def migrate(conn: Conn, before_upgrade: Callable[[Conn, int, int], Awaitable[None]] | None = None) -> int:
    """Bring the database to the newest schema; returns the version it had (0: none). A schema
    newer than this code raises SchemaTooNew; one that is not appserver's (another application's
    `schema_version`, or a recorded version whose tables are not there) raises SchemaDamaged,
    before anything is written. `before_upgrade(conn, current, known)` is asked first when an
    existing schema is older than this code; it raises (SchemaUpgradeRefused) to leave it as it is.

    One transaction, under an advisory lock (so processes starting together migrate once, and
    only the one that created the schema finds the database new): the database is recognised, then
    every migration due is applied, and all of it commits or none does (PostgreSQL's DDL is
    transactional), so a refused start (e.g. a foreign database with its own `agents`, or a
    migration that fails half way) leaves the database as it was.

    DDL only when a migration is due: on a current schema a role with only data permissions
    (no CREATE on the schema) starts."""
    known = max(v for v, _ in MIGRATIONS)
    async with conn.transaction():
        # Each statement's snapshot taken after the lock, whatever the database's default
        # isolation: what a concurrent start committed while this one waited is seen.
        await conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        current = await _schema_version(conn)
        if current > known:
            raise SchemaTooNew(
                f"database schema version {current} is newer than this appserver ({known}); upgrade appserver"
            )
        if current:
            await _recognise(conn, current)
        due = [(version, script) for version, script in MIGRATIONS if version > current]
        if due and current and before_upgrade is not None:
            await before_upgrade(conn, current, known)
        if due and not current:
            await conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version, script in due:
            await conn.execute(script)  # several statements: no parameters, so the simple query protocol
            await conn.execute("INSERT INTO schema_version(version) VALUES (%s)", (version,))
    return current


async def _live_instances(conn: Conn, timeout_s: float, heartbeat_s: float) -> list[str]:
    """The live servers of the cluster on this database (`host pid N at ADDRESS`), judged as a
    server judges the others after its start (cluster.LIVE); none on a schema without `instances`."""
    cur = await conn.execute("SELECT to_regclass('instances') IS NOT NULL AS here")
    row = await cur.fetchone()
    if not row or not row["here"]:
        return []
    cur = await conn.execute(
        f"SELECT host, pid, address FROM instances i WHERE {LIVE} ORDER BY started_at, id",
        {"timeout": timeout_s, "grace": heartbeat_s * 2.5},
    )
    return [
        f"{r['host']} pid {r['pid']}" + (f" at {r['address']}" if r["address"] else "") for r in await cur.fetchall()
    ]


async def _turn_exists(conn: Conn, turn_id: str) -> bool:
    cur = await conn.execute("SELECT 1 AS here FROM turns WHERE id=%s", (turn_id,))
    return await cur.fetchone() is not None


# The one shape of appserver's `schema_version` (pg_class.relkind, then each column's name, type
# and NOT NULL): a table of that name in any other shape is another application's.
_OUR_SCHEMA_VERSION = ("r", (("version", "integer", True),))

_NOT_OURS_HINT = (
    "give appserver a database of its own (createdb appserver), or a schema of its own "
    "(?options=-csearch_path%3Dappserver in the URL); if it is appserver's, restore it from a backup"
)


async def _where(conn: Conn) -> str:
    cur = await conn.execute("SELECT current_database() AS db, current_schema() AS schema")
    row = await cur.fetchone()
    return f"database {row['db']!s} (schema {row['schema']!s})" if row else "the database"


async def _schema_version(conn: Conn) -> int:
    """The newest applied migration, 0 when `schema_version` does not exist; reads, creates nothing.
    A `schema_version` that is not appserver's (another shape, empty, no version number) raises
    SchemaDamaged naming what it is.

    Asked of the catalog under this statement's snapshot (taken after the migration lock), not
    with to_regclass: that looks the name up without a lock, in a catalog cache that may not yet
    know of the table a concurrent start just committed."""
    cur = await conn.execute(
        "SELECT c.relkind::text AS kind, a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type, "
        "a.attnotnull AS not_null "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
        "WHERE c.relname = 'schema_version' AND n.nspname = current_schema() ORDER BY a.attnum"
    )
    rows = await cur.fetchall()
    if not rows:
        return 0
    kind = str(rows[0]["kind"])
    columns = tuple((str(r["name"]), str(r["type"]), bool(r["not_null"])) for r in rows if r["name"] is not None)
    if (kind, columns) != _OUR_SCHEMA_VERSION:
        holding = await _holding(conn) if any(name == "version" for name, _, _ in columns) else ""
        shown = ", ".join(f"{n} {t}{' not null' if nn else ''}" for n, t, nn in columns[:4]) or "no column"
        if len(columns) > 4:
            shown += f" and {len(columns) - 4} more columns"
        what = {"r": "", "p": "partitioned ", "v": "view ", "m": "materialized view "}.get(kind, f"relation ({kind}) ")
        raise SchemaDamaged(
            f"{await _where(conn)} holds a schema_version {what or 'table '}that is not appserver's "
            f"({shown}{holding}; appserver's has one column, version integer not null): "
            f"another application's, or changed by hand; nothing was changed; {_NOT_OURS_HINT}"
        )
    cur = await conn.execute("SELECT MAX(version) AS v, COUNT(*) AS n FROM schema_version")
    row = await cur.fetchone()
    value = row["v"] if row else None
    if value is None or int(value) < 1:
        raise SchemaDamaged(
            f"{await _where(conn)} holds a schema_version table that is not appserver's "
            f"({'empty' if value is None else f'holding {value}'}; appserver's records each schema version it "
            f"applied, from 1): another application's, or changed by hand; nothing was changed; {_NOT_OURS_HINT}"
        )
    return int(value)


async def _holding(conn: Conn) -> str:
    """'; holding X': the newest value of a foreign schema_version's `version` column, shown with
    its refusal ('' when it cannot be read: a savepoint keeps the transaction usable)."""
    try:
        async with conn.transaction():
            cur = await conn.execute("SELECT MAX(version)::text AS v FROM schema_version")
            row = await cur.fetchone()
    except psycopg.Error:
        return ""
    value = row["v"] if row else None
    return "; empty" if value is None else f"; holding {str(value)[:40]!r}"


async def _recognise(conn: Conn, version: int) -> None:
    """The tables and columns the migrations up to `version` create are all there (one catalog
    read): a `schema_version` of appserver's shape that says `version` over a schema that is not
    (another application's, or one changed by hand) is refused before any later migration runs."""
    cur = await conn.execute(
        "SELECT c.relname::text AS t, a.attname::text AS c "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
        "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')"
    )
    present = {(str(r["t"]), str(r["c"])) for r in await cur.fetchall()}
    missing = _missing(expected_columns(version), present)
    if missing:
        raise SchemaDamaged(
            f"{await _where(conn)} holds a schema_version table that says appserver schema version {version}, "
            f"but not that schema: it lacks {_shown(missing)}; another application's schema_version, or a "
            f"database changed by hand; nothing was changed; {_NOT_OURS_HINT}"
        )


def _missing(expected: Mapping[str, Iterable[str]], present: Collection[tuple[str, str]]) -> list[str]:
    tables = {t for t, _ in present}
    missing: list[str] = []
    for table, columns in expected.items():
        if table not in tables:
            missing.append(f"table {table}")
            continue
        missing.extend(f"{table}.{c}" for c in columns if (table, c) not in present)
    return missing


def _shown(missing: list[str]) -> str:
    return ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")


class SchemaDamaged(Exception):
    """The database's schema is not one this appserver made (a table or column missing, a bad
    schema_version): refused at start with one line, before any request meets it."""


async def check_schema(conn: Conn) -> None:
    """Every table and column the migrations create is there (one catalog read at start): a
    database changed by hand is refused with what it lacks, not served until the first request
    fails on a missing column."""
    cur = await conn.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = current_schema()"
    )
    present = {(str(r["table_name"]), str(r["column_name"])) for r in await cur.fetchall()}
    missing = _missing(expected_columns(), present)
    if missing:
        raise SchemaDamaged(
            f"its schema (version {max(v for v, _ in MIGRATIONS)}) lacks {_shown(missing)}: the database was changed "
            "by hand or by another program; restore it from a backup, or copy what it holds into a new database"
        )
