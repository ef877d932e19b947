"""SQLite implementation of the Store (WAL, synchronous=NORMAL, one writer connection).

Calls run inline on the event loop thread: each is a few small statements on a local file in WAL
mode, cheaper than a hop to a worker thread. A PostgreSQL store would await a pool instead; the
interface is async for that reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from appserver.procid import identity, identity_alive
from appserver.store.base import DuplicateTurn, Store, StoreError
from appserver.store.integrity import (
    StoreOpenError,
    check_store_writable,
    create_store,
    messages_seq,
    open_error,
    preflight,
    read_position,
    write_position,
)
from appserver.store.migrations import SchemaTooNew, migrate
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    HistoryPoint,
    HttpIdempotency,
    MessageRecord,
    PendingCall,
    ResponseRecord,
    TurnCommit,
    TurnRecord,
)

log = logging.getLogger("appserver.store")

CHECKPOINT_EVERY_COMMITS = 256  # wake the checkpointer after this many commits
CHECKPOINT_IDLE_S = 5.0  # and at least this often while commits keep coming
WAL_BACKSTOP_PAGES = 10_000  # the writer's own automatic checkpoint (SQLite's default is 1,000)


class _Checkpointer(threading.Thread):
    """Copies the WAL back into the database on its own connection and thread.

    SQLite's automatic checkpoint runs inside whichever COMMIT crosses its threshold, on the event
    loop: page copies and fsyncs that made about every 30th HTTP request several milliseconds
    slower (the p99). PASSIVE checkpoints here never block the writer. The WAL only restarts from
    its beginning when a checkpoint caught up with the writer, which a concurrent one rarely does:
    the writer's own automatic checkpoint, moved out to WAL_BACKSTOP_PAGES, does that, with little
    left to copy.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(name="sqlite-checkpoint", daemon=True)
        self.path = path
        self.wake = threading.Event()
        self.stopping = False
        self.commits = 0  # bumped by the writer; a stale read here only delays a checkpoint
        self.recorded = read_position(path)  # the position sidecar's value (integrity.py)

    def committed(self) -> None:
        self.commits += 1
        if self.commits % CHECKPOINT_EVERY_COMMITS == 0:
            self.wake.set()

    def run(self) -> None:
        db = sqlite3.connect(str(self.path), isolation_level=None, timeout=10.0)
        try:
            done = 0
            while not self.stopping:
                self.wake.wait(CHECKPOINT_IDLE_S)
                self.wake.clear()
                if self.stopping or self.commits == done:
                    continue
                done = self.commits
                try:
                    seq = messages_seq(db)  # read first: the checkpoint then makes it durable
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # all: ends the statement
                except sqlite3.Error:
                    log.exception("WAL checkpoint failed (the next one retries)")
                    continue
                self.record(seq)
        finally:
            db.close()

    def record(self, seq: int) -> None:
        """Write the position sidecar when it moved (off the hot path: this thread, or close)."""
        if seq == self.recorded:
            return
        try:
            write_position(self.path, seq)
            self.recorded = seq
        except OSError as exc:
            log.warning("could not record the store position in %s: %s", self.path, exc)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.join(10)


def _log_deferred_failure(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("a queued write failed: %s", fut.exception())


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # one, not one per call


def _dumps(value: Any) -> str:
    if not value and type(value) in (dict, list):  # options, client tools, ...: mostly empty
        return "{}" if type(value) is dict else "[]"
    return _ENCODE(value)


def _loads(text: str | None, default: Any = None) -> Any:
    if text is None:
        return default
    return json.loads(text)


def _copy_agent(a: AgentRecord) -> AgentRecord:
    """Callers may edit the record they get (`agents update` does): hand out copies of cached ones."""
    params = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in a.params.items()}
    return AgentRecord(a.id, a.name, a.model, a.system, dict(a.tools), params, a.created_at, a.updated_at)


class SQLiteStore(Store):
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path) if path != ":memory:" else path
        self._db: sqlite3.Connection | None = None
        self.fresh = False  # True when open() created the schema (first use of this home)
        # Every agent by id, sorted by (created_at, id): read on every turn, changed rarely.
        self._agent_cache: dict[str, AgentRecord] | None = None
        self._data_version = -1
        # Turn commits waiting for the next group transaction (see _flush).
        self._group: list[tuple[Callable[[sqlite3.Connection], None], asyncio.Future[None]]] = []
        self._checkpointer: _Checkpointer | None = None
        self._flush_handle: asyncio.Handle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self.owner = identity()  # this process: stamped on the HTTP idempotency keys it claims
        # Set by `serve --accept-data-loss`: open a store whose WAL was damaged or that is behind
        # its recorded position (integrity.py), after keeping a copy, instead of refusing.
        self.accept_data_loss = False
        self._write_probe = 0
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened

    # ------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        self.open_sync()

    def open_sync(self) -> None:
        """Open the file (only a missing one is a new store: see integrity.py); an unusable one
        raises StoreOpenError naming the file and what to do, and is left as it was."""
        if self._db is not None:
            return
        created = False
        if isinstance(self.path, Path):
            check_store_writable(self.path)
            try:
                if preflight(self.path, accept_loss=self.accept_data_loss):
                    created = create_store(self.path, migrate)
            except sqlite3.OperationalError as exc:
                raise self._open_error(exc) from None
        try:
            db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10.0)
            try:
                db.row_factory = sqlite3.Row
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("PRAGMA foreign_keys=ON")
                db.execute("PRAGMA busy_timeout=10000")
                self._db = db
                self._migrate()
            except BaseException:
                self._db = None
                db.close()
                raise
        except SchemaTooNew as exc:
            raise StoreOpenError(f"{self.path}: {exc}") from None
        except sqlite3.Error as exc:
            raise self._open_error(exc) from None
        if created:
            self.fresh = True
        if isinstance(self.path, Path):
            st = self.path.stat()
            self._file_id = (st.st_dev, st.st_ino)
            try:  # owner-only, never more than the owner had (a deliberate 0400 stays read-only)
                mode = st.st_mode & 0o777
                if mode & 0o077:
                    self.path.chmod(mode & 0o700)
            except OSError:
                pass
            # The thread copies the WAL back; our own automatic checkpoint stays as a far backstop.
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
            self._checkpointer = _Checkpointer(self.path)
            self._checkpointer.start()

    def _open_error(self, exc: sqlite3.Error) -> StoreOpenError:
        return open_error(Path(str(self.path)), exc)

    async def close(self) -> None:
        self._flush()
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        if self._db is not None:
            seq = None
            if checkpointer is not None:
                with suppress(sqlite3.Error):
                    seq = messages_seq(self._db)
                    # Syncs the WAL even when another process keeps the store open (then the
                    # close below checkpoints nothing): what `seq` counts is durable.
                    self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self._db.close()  # the last connection to close checkpoints what is left
            self._db = None
            if checkpointer is not None and seq is not None:
                checkpointer.record(seq)
        self._agent_cache = None

    async def check_writable(self, min_free_bytes: int = 0) -> str:
        """Readiness: a real write transaction, and room on the disk. In WAL mode a small write
        reuses WAL space already allocated, so it succeeds on a full disk; growing the database
        at the next checkpoint would not. The free-space check is what sees a full disk."""
        if isinstance(self.path, Path) and self._file_id is not None:
            # A store file deleted or replaced under a running server still takes writes, into a
            # file nobody will open again: everything from then on is lost at the next start.
            try:
                st = self.path.stat()
                same = (st.st_dev, st.st_ino) == self._file_id
            except FileNotFoundError:
                same = False
            if not same:
                raise StoreError(
                    f"{self.path} was deleted or replaced while the server runs: what it writes now goes to a file "
                    "no later start will open; stop the server, put the store back (or accept the loss), and start again"
                )
        if isinstance(self.path, Path) and min_free_bytes:
            free = shutil.disk_usage(self.path.parent).free
            if free < min_free_bytes:
                raise StoreError(
                    f"disk nearly full: {free:,} bytes free for {self.path.parent} (needs {min_free_bytes:,}; "
                    "[limits] min_free_disk_bytes)"
                )
        self._write_probe = (self._write_probe + 1) % 1_000_000
        with self._tx() as tx:
            tx.execute(f"PRAGMA user_version = {self._write_probe + 1}")  # header page only; no table
        return "writable" + (f", {shutil.disk_usage(self.path.parent).free:,} bytes free" if isinstance(self.path, Path) else "")

    def _committed(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.committed()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        if self._group:
            self._flush()  # queued writes first: writes land in the order they were made
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._committed()

    def _grouped(self, job: Callable[[sqlite3.Connection], None], *, defer: bool = False) -> asyncio.Future[None]:
        """Queue `job` for the next group transaction; the future settles once it is committed.

        `defer`: nobody waits for it, so let the next write join it rather than commit it alone
        (it still commits by the second loop pass; a failure is logged). Two passes, not one: a
        turn that starts in this pass may run up to its model call and overlap the accept that
        joins this write with that call (ConversationRuntime.enqueue `overlap`).
        """
        loop = asyncio.get_running_loop()
        if self._flush_handle is not None and self._flush_loop is not loop:
            self._flush()  # left over from an event loop that ended before it ran: commit it now
        fut: asyncio.Future[None] = loop.create_future()
        self._group.append((job, fut))
        self._flush_loop = loop
        if defer:
            fut.add_done_callback(_log_deferred_failure)
            if self._flush_handle is None:
                self._flush_handle = loop.call_soon(self._flush_next_pass)
            return fut
        ready = getattr(loop, "_ready", None)  # asyncio's run queue (absent on other loops)
        if ready is not None and (not ready or (len(ready) == 1 and ready[0] is self._flush_handle)):
            # Nothing else is runnable, so nothing could join this group: commit now rather
            # than pay two loop passes (the common case for a lone turn).
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        return fut

    def _flush_next_pass(self) -> None:
        assert self._flush_loop is not None
        self._flush_handle = self._flush_loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Group commit: the turn commits queued during one event-loop pass share one transaction.

        Each job runs inside its own savepoint, so a turn's rows stay all-or-nothing: a job that
        fails is rolled back alone and its caller gets the error. Futures settle only after COMMIT
        returns, so no turn is reported done before its rows are durable; if COMMIT fails, every
        job of the group fails. Under load this turns N commits (and their WAL writes) into one.
        """
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        jobs = [(job, fut) for job, fut in self._group if not fut.cancelled()]
        self._group = []
        if not jobs:
            return
        errors: list[BaseException | None] = []
        lone = len(jobs) == 1  # a lone job is the whole transaction: no savepoint needed
        try:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                for job, _ in jobs:
                    if not lone:
                        db.execute("SAVEPOINT turn_commit")
                    try:
                        job(db)
                    except Exception as exc:
                        if not lone:
                            db.execute("ROLLBACK TO turn_commit")
                        errors.append(exc)
                    else:
                        errors.append(None)
                    if not lone:
                        db.execute("RELEASE turn_commit")
                if lone and errors[0] is not None:
                    db.execute("ROLLBACK")
                else:
                    db.execute("COMMIT")
                    self._committed()
            except BaseException:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except Exception as exc:
            errors = [exc] * len(jobs)
        for (_, fut), err in zip(jobs, errors, strict=True):
            if fut.cancelled() or fut.get_loop().is_closed():
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)

    def _migrate(self) -> None:
        self.fresh = migrate(self.db) == 0

    # ------------------------------------------------------------ agents

    @staticmethod
    def _agent(row: sqlite3.Row) -> AgentRecord:
        return AgentRecord(
            id=row["id"],
            name=row["name"],
            model=row["model"],
            system=row["system"],
            tools=_loads(row["tools"], {}),
            params=_loads(row["params"], {}),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )

    async def create_agent(self, agent: AgentRecord) -> AgentRecord:
        now = time.time()
        agent.created_at = agent.created_at or now
        agent.updated_at = now
        self._agent_cache = None
        with self._tx() as tx:
            tx.execute(
                "INSERT INTO agents(id, name, model, system, tools, params, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?)",
                (agent.id, agent.name, agent.model, agent.system, _dumps(agent.tools), _dumps(agent.params), agent.created_at, agent.updated_at),
            )
        return agent

    async def update_agent(self, agent: AgentRecord) -> AgentRecord:
        agent.updated_at = time.time()
        self._agent_cache = None
        with self._tx() as tx:
            cur = tx.execute(
                "UPDATE agents SET name=?, model=?, system=?, tools=?, params=?, updated_at=? WHERE id=?",
                (agent.name, agent.model, agent.system, _dumps(agent.tools), _dumps(agent.params), agent.updated_at, agent.id),
            )
            if cur.rowcount == 0:
                raise StoreError(f"agent {agent.id} does not exist")
        return agent

    async def delete_agent(self, agent_id: str) -> bool:
        self._agent_cache = None
        with self._tx() as tx:
            tx.execute("DELETE FROM turns WHERE agent_id=?", (agent_id,))
            cur = tx.execute("DELETE FROM agents WHERE id=?", (agent_id,))
            return cur.rowcount > 0

    def _agents(self) -> dict[str, AgentRecord]:
        """The cached agents. Our own writes drop the cache; another connection's commit (e.g.
        `appserver agents update` in another process) changes `PRAGMA data_version`."""
        db = self.db
        version = db.execute("PRAGMA data_version").fetchone()[0]
        cache = self._agent_cache
        if cache is None or version != self._data_version:
            self._data_version = version
            cache = self._agent_cache = {a.id: a for a in map(self._agent, db.execute("SELECT * FROM agents ORDER BY created_at, id"))}
        return cache

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        agent = self._agents().get(agent_id)
        return _copy_agent(agent) if agent is not None else None

    async def find_agents(self, ref: str) -> list[AgentRecord]:
        return [_copy_agent(a) for a in self._agents().values() if a.id == ref or a.name == ref]

    async def list_agents(self) -> list[AgentRecord]:
        return [_copy_agent(a) for a in self._agents().values()]

    # ------------------------------------------------------------ conversations

    @staticmethod
    def _conversation(row: sqlite3.Row) -> ConversationRecord:
        return ConversationRecord(
            id=row["id"],
            agent_id=row["agent_id"],
            is_default=bool(row["is_default"]),
            title=row["title"],
            user=row["user"],
            namespace=row["namespace"],
            forked_from=row["forked_from"],
            metadata=_loads(row["metadata"], {}),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )

    async def create_conversation(self, conv: ConversationRecord, *, copy_messages: Iterable[int] | None = None) -> ConversationRecord:
        """Without messages to copy, the row is queued (see _grouped `defer`): it commits together
        with the first turn's accept instead of in a transaction of its own. Reads of conversations
        and every other write commit queued writes first, so nobody sees the difference."""
        now = time.time()
        conv.created_at = conv.created_at or now
        conv.updated_at = now
        if copy_messages is None:
            self._grouped(lambda tx: self._insert_conversation(tx, conv), defer=True)
            return conv
        with self._tx() as tx:
            self._insert_conversation(tx, conv)
            if copy_messages is not None:
                ids = list(copy_messages)
                for mid in ids:
                    tx.execute(
                        "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, reasoning, provider_state, completion_status, source, created_at, meta) "
                        "SELECT ?, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, reasoning, provider_state, completion_status, source, created_at, meta FROM messages WHERE id=?",
                        (conv.id, mid),
                    )
        return conv

    @staticmethod
    def _insert_conversation(tx: sqlite3.Connection, conv: ConversationRecord) -> None:
        tx.execute(
            "INSERT INTO conversations(id, agent_id, is_default, title, user, namespace, forked_from, metadata, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (conv.id, conv.agent_id, int(conv.is_default), conv.title, conv.user, conv.namespace, conv.forked_from, _dumps(conv.metadata), conv.created_at, conv.updated_at),
        )

    def _settle_queued(self) -> None:
        """Commit queued writes before a read that could miss them (a conversation created just now)."""
        if self._group:
            self._flush()

    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None:
        self._settle_queued()
        row = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return self._conversation(row) if row else None

    async def get_default_conversation(self, agent_id: str) -> ConversationRecord | None:
        self._settle_queued()
        row = self.db.execute("SELECT * FROM conversations WHERE agent_id=? AND is_default=1", (agent_id,)).fetchone()
        return self._conversation(row) if row else None

    async def list_conversations(self, agent_id: str | None = None, *, limit: int = 100, offset: int = 0) -> list[ConversationRecord]:
        self._settle_queued()
        if agent_id is None:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id LIMIT ? OFFSET ?", (limit, offset))
        else:
            rows = self.db.execute(
                "SELECT * FROM conversations WHERE agent_id=? ORDER BY updated_at DESC, id LIMIT ? OFFSET ?", (agent_id, limit, offset)
            )
        return [self._conversation(r) for r in rows]

    async def update_conversation(self, conv: ConversationRecord) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE conversations SET title=?, user=?, metadata=?, updated_at=? WHERE id=?",
                (conv.title, conv.user, _dumps(conv.metadata), time.time(), conv.id),
            )

    # ------------------------------------------------------------ messages

    @staticmethod
    def _message(row: sqlite3.Row) -> MessageRecord:
        return MessageRecord(
            id=row["id"],
            conversation_id=row["conversation_id"],
            turn_id=row["turn_id"],
            iteration=row["iteration"],
            role=row["role"],
            content=_loads(row["content"], ""),
            tool_calls=_loads(row["tool_calls"], []) or [],
            tool_call_id=row["tool_call_id"],
            name=row["name"],
            is_error=bool(row["is_error"]),
            reasoning=row["reasoning"],
            provider_state=_loads(row["provider_state"]),
            completion_status=row["completion_status"],
            source=_loads(row["source"]),
            created_at=row["created_at"],
            meta=_loads(row["meta"]) or {},
        )

    async def list_messages(self, conversation_id: str, *, before_id: int | None = None, limit: int | None = None) -> list[MessageRecord]:
        if before_id is None and limit is None:
            rows = self.db.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,)).fetchall()
        else:
            rows = self.db.execute(
                "SELECT * FROM messages WHERE conversation_id=? AND id < ? ORDER BY id DESC LIMIT ?",
                (conversation_id, before_id if before_id is not None else 2**62, limit if limit is not None else -1),
            ).fetchall()
            rows.reverse()
        return [self._message(r) for r in rows]

    @staticmethod
    def _insert_message(tx: sqlite3.Connection, conversation_id: str, m: MessageRecord, now: float) -> None:
        m.conversation_id = conversation_id
        m.created_at = m.created_at or now
        cur = tx.execute(
            "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, reasoning, provider_state, completion_status, source, created_at, meta) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                conversation_id,
                m.turn_id,
                m.iteration,
                m.role,
                _dumps(m.content),
                _dumps(m.tool_calls) if m.tool_calls else None,
                m.tool_call_id,
                m.name,
                int(m.is_error),
                m.reasoning,
                _dumps(m.provider_state) if m.provider_state is not None else None,
                m.completion_status,
                _dumps(m.source) if m.source is not None else None,
                m.created_at,
                _dumps(m.meta) if m.meta else None,
            ),
        )
        m.id = cur.lastrowid

    async def append_messages(self, conversation_id: str, messages: list[MessageRecord]) -> None:
        now = time.time()
        with self._tx() as tx:
            for m in messages:
                self._insert_message(tx, conversation_id, m, now)
            tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    # ------------------------------------------------------------ turns

    @staticmethod
    def _turn(row: sqlite3.Row) -> TurnRecord:
        return TurnRecord(
            id=row["id"],
            conversation_id=row["conversation_id"],
            agent_id=row["agent_id"],
            status=row["status"],
            stop_reason=row["stop_reason"],
            error=_loads(row["error"]),
            idempotency_key=row["idempotency_key"],
            source=_loads(row["source"]),
            input=_loads(row["input"], {}),
            input_committed=bool(row["input_committed"]),
            client_tools=_loads(row["client_tools"], []),
            options=_loads(row["options"], {}),
            owner=row["owner"],
            draft=_loads(row["draft"]),
            usage=_loads(row["usage"], {}),
            revision=row["revision"],
            iteration=row["iteration"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
        )

    async def accept_turn(self, turn: TurnRecord, idempotency_scope: str | None = None) -> TurnRecord:
        """Record an accepted input (in the next group transaction, see _flush). With an idempotency
        key already used in `scope`, raise DuplicateTurn."""
        now = time.time()
        turn.created_at = turn.created_at or now
        await self._grouped(lambda tx: self._accept_turn(tx, turn, idempotency_scope, now))
        return turn

    def _accept_turn(self, tx: sqlite3.Connection, turn: TurnRecord, idempotency_scope: str | None, now: float) -> None:
        if turn.idempotency_key and idempotency_scope:
            row = tx.execute(
                "SELECT turn_id FROM idempotency_keys WHERE scope=? AND key=?", (idempotency_scope, turn.idempotency_key)
            ).fetchone()
            if row is not None:
                existing = tx.execute("SELECT * FROM turns WHERE id=?", (row["turn_id"],)).fetchone()
                if existing is not None:
                    raise DuplicateTurn(self._turn(existing))
                tx.execute("DELETE FROM idempotency_keys WHERE scope=? AND key=?", (idempotency_scope, turn.idempotency_key))
            tx.execute(
                "INSERT INTO idempotency_keys(scope, key, turn_id, conversation_id, created_at) VALUES (?,?,?,?,?)",
                (idempotency_scope, turn.idempotency_key, turn.id, turn.conversation_id, now),
            )
        tx.execute(
            "INSERT INTO turns(id, conversation_id, agent_id, status, idempotency_key, source, input, client_tools, options, owner, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                turn.id,
                turn.conversation_id,
                turn.agent_id,
                turn.status,
                turn.idempotency_key,
                _dumps(turn.source) if turn.source is not None else None,
                _dumps(turn.input),
                _dumps(turn.client_tools),
                _dumps(turn.options),
                turn.owner,
                turn.created_at,
            ),
        )

    async def lookup_idempotency(self, scope: str, key: str) -> TurnRecord | None:
        row = self.db.execute(
            "SELECT t.* FROM idempotency_keys k JOIN turns t ON t.id = k.turn_id WHERE k.scope=? AND k.key=?", (scope, key)
        ).fetchone()
        return self._turn(row) if row else None

    async def purge_idempotency(self, older_than: float) -> int:
        with self._tx() as tx:
            return tx.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (older_than,)).rowcount

    async def mark_turn_running(self, turn_id: str, owner: str, revision: int) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE turns SET status='running', owner=?, revision=?, started_at=COALESCE(started_at, ?) WHERE id=?",
                (owner, revision, time.time(), turn_id),
            )

    async def save_draft(self, turn_id: str, draft: dict[str, Any]) -> None:
        self._settle_queued()
        self.db.execute("UPDATE turns SET draft=? WHERE id=?", (_dumps(draft), turn_id))
        self._committed()

    async def commit_turn(self, conversation_id: str, commit: TurnCommit) -> None:
        """One turn's rows, atomically, in the next group transaction (see _flush)."""
        await self._grouped(lambda tx: self._commit_turn(tx, conversation_id, commit))

    async def checkpoint_turn(self, conversation_id: str, turn_id: str, messages: list[MessageRecord], *, iteration: int, usage: dict[str, int]) -> None:
        """Committed before this returns (queued writes first): a tool may act right after."""
        now = time.time()
        with self._tx() as tx:
            for m in messages:
                m.turn_id = m.turn_id or turn_id
                self._insert_message(tx, conversation_id, m, now)
            tx.execute("UPDATE turns SET input_committed=1, iteration=?, usage=?, draft=NULL WHERE id=?", (iteration, _dumps(usage), turn_id))
            tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    def _commit_turn(self, tx: sqlite3.Connection, conversation_id: str, commit: TurnCommit) -> None:
        now = time.time()
        terminal = commit.status in ("completed", "cancelled", "failed", "interrupted")
        for m in commit.messages:
            m.turn_id = m.turn_id or commit.turn_id
            self._insert_message(tx, conversation_id, m, now)
        for p in commit.pending:
            tx.execute(
                "INSERT INTO pending_calls(conversation_id, call_id, turn_id, name, arguments, kind, status, output, is_error, reason, decided_by, created_at, expires_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (conversation_id, p.call_id, p.turn_id, p.name, p.arguments, p.kind, p.status, p.output, int(p.is_error), p.reason, p.decided_by, p.created_at or now, p.expires_at),
            )
        tx.execute(
            "UPDATE turns SET status=?, stop_reason=?, error=?, usage=?, revision=?, iteration=?, input_committed=?, draft=NULL, ended_at=? WHERE id=?",
            (
                commit.status,
                commit.stop_reason,
                _dumps(commit.error) if commit.error is not None else None,
                _dumps(commit.usage),
                commit.revision,
                commit.iteration,
                int(commit.input_committed),
                now if terminal else None,
                commit.turn_id,
            ),
        )
        if terminal and (commit.iteration > 1 or commit.pending or commit.stop_reason != "end_turn"):
            # Pending calls that never got an answer are closed with the turn.
            tx.execute("UPDATE pending_calls SET status='cancelled' WHERE turn_id=? AND status='pending'", (commit.turn_id,))
        tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    async def get_turn(self, turn_id: str) -> TurnRecord | None:
        row = self.db.execute("SELECT * FROM turns WHERE id=?", (turn_id,)).fetchone()
        return self._turn(row) if row else None

    async def list_turns(self, conversation_id: str, *, statuses: Iterable[str] | None = None) -> list[TurnRecord]:
        if statuses is None:
            rows = self.db.execute("SELECT * FROM turns WHERE conversation_id=? ORDER BY rowid", (conversation_id,))
        else:
            st = list(statuses)
            rows = self.db.execute(
                f"SELECT * FROM turns WHERE conversation_id=? AND status IN ({','.join('?' * len(st))}) ORDER BY rowid",
                (conversation_id, *st),
            )
        return [self._turn(r) for r in rows]

    async def open_turns(self, statuses: Iterable[str] = ("queued", "running", "awaiting")) -> list[TurnRecord]:
        st = list(statuses)
        rows = self.db.execute(f"SELECT * FROM turns WHERE status IN ({','.join('?' * len(st))}) ORDER BY rowid", st)
        return [self._turn(r) for r in rows]

    # ------------------------------------------------------------ pending calls

    @staticmethod
    def _pending(row: sqlite3.Row) -> PendingCall:
        return PendingCall(
            call_id=row["call_id"],
            conversation_id=row["conversation_id"],
            turn_id=row["turn_id"],
            name=row["name"],
            arguments=row["arguments"],
            kind=row["kind"],
            status=row["status"],
            output=row["output"],
            is_error=bool(row["is_error"]),
            reason=row["reason"],
            decided_by=row["decided_by"],
            created_at=row["created_at"],
            expires_at=row["expires_at"],
        )

    async def list_pending(self, turn_id: str) -> list[PendingCall]:
        rows = self.db.execute("SELECT * FROM pending_calls WHERE turn_id=? ORDER BY created_at, rowid", (turn_id,))
        return [self._pending(r) for r in rows]

    async def get_pending(self, conversation_id: str, call_id: str) -> PendingCall | None:
        row = self.db.execute("SELECT * FROM pending_calls WHERE conversation_id=? AND call_id=?", (conversation_id, call_id)).fetchone()
        return self._pending(row) if row else None

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
    ) -> bool:
        """Answer one pending call. First answer wins: returns False when it was already answered."""
        with self._tx() as tx:
            cur = tx.execute(
                "UPDATE pending_calls SET status=?, output=?, is_error=?, reason=?, decided_by=? WHERE conversation_id=? AND call_id=? AND status='pending'",
                (status, output, int(is_error), reason, decided_by, conversation_id, call_id),
            )
            return cur.rowcount == 1

    async def overdue_pending(self, now: float) -> list[PendingCall]:
        rows = self.db.execute(
            "SELECT * FROM pending_calls WHERE status='pending' AND expires_at IS NOT NULL AND expires_at <= ? ORDER BY expires_at", (now,)
        )
        return [self._pending(r) for r in rows]

    # ------------------------------------------------------------ OpenAI HTTP surface

    async def last_message_id(self, conversation_id: str) -> int:
        row = self.db.execute("SELECT MAX(id) FROM messages WHERE conversation_id=?", (conversation_id,)).fetchone()
        return int(row[0] or 0)

    @staticmethod
    def _response(row: sqlite3.Row) -> ResponseRecord:
        return ResponseRecord(
            id=row["id"],
            agent_id=row["agent_id"],
            conversation_id=row["conversation_id"],
            body=_loads(row["body"], {}),
            turn_id=row["turn_id"],
            previous_response_id=row["previous_response_id"],
            namespace=row["namespace"],
            last_message_id=row["last_message_id"],
            input_items=_loads(row["input_items"], []),
            stored=bool(row["stored"]),
            created_at=row["created_at"],
        )

    async def save_response(self, response: ResponseRecord) -> None:
        response.created_at = response.created_at or time.time()
        with self._tx() as tx:
            tx.execute(
                "INSERT OR REPLACE INTO responses(id, agent_id, conversation_id, turn_id, previous_response_id, namespace, last_message_id, body, input_items, stored, created_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    response.id,
                    response.agent_id,
                    response.conversation_id,
                    response.turn_id,
                    response.previous_response_id,
                    response.namespace,
                    response.last_message_id,
                    _dumps(response.body),
                    _dumps(response.input_items),
                    int(response.stored),
                    response.created_at,
                ),
            )

    async def get_response(self, response_id: str) -> ResponseRecord | None:
        row = self.db.execute("SELECT * FROM responses WHERE id=?", (response_id,)).fetchone()
        return self._response(row) if row else None

    async def delete_response(self, response_id: str) -> bool:
        with self._tx() as tx:
            return tx.execute("DELETE FROM responses WHERE id=?", (response_id,)).rowcount > 0

    @staticmethod
    def _idem(row: sqlite3.Row) -> HttpIdempotency:
        return HttpIdempotency(
            scope=row["scope"],
            key=row["key"],
            body_hash=row["body_hash"],
            state=row["state"],
            status_code=row["status_code"],
            content_type=row["content_type"],
            body=row["body"],
            conversation_id=row["conversation_id"],
            created_at=row["created_at"],
            owner=row["owner"],
        )

    def _orphaned(self, owner: str | None) -> bool:
        """A pending key's claimant is gone (killed mid-request): nobody will ever finish it."""
        return owner != self.owner and not identity_alive(owner)

    async def claim_http_idempotency(self, entry: HttpIdempotency) -> HttpIdempotency | None:
        """A pending key whose claimant died is taken over (the retry runs the request)."""
        entry.created_at = entry.created_at or time.time()
        entry.owner = entry.owner or self.owner
        with self._tx() as tx:
            row = tx.execute("SELECT * FROM http_idempotency WHERE scope=? AND key=?", (entry.scope, entry.key)).fetchone()
            if row is not None:
                if row["state"] != "pending" or not self._orphaned(row["owner"]):
                    return self._idem(row)
                log.warning("Idempotency-Key %r was claimed by a process that is gone (%s): this request takes it over", entry.key, row["owner"])
                tx.execute("DELETE FROM http_idempotency WHERE scope=? AND key=?", (entry.scope, entry.key))
            tx.execute(
                "INSERT INTO http_idempotency(scope, key, body_hash, state, created_at, owner) VALUES (?,?,?,?,?,?)",
                (entry.scope, entry.key, entry.body_hash, "pending", entry.created_at, entry.owner),
            )
        return None

    async def release_orphaned_http_idempotency(self) -> int:
        with self._tx() as tx:
            rows = tx.execute("SELECT scope, key, owner FROM http_idempotency WHERE state='pending'").fetchall()
            gone = [(r["scope"], r["key"]) for r in rows if self._orphaned(r["owner"])]
            tx.executemany("DELETE FROM http_idempotency WHERE scope=? AND key=?", gone)
        return len(gone)

    async def get_http_idempotency(self, scope: str, key: str) -> HttpIdempotency | None:
        row = self.db.execute("SELECT * FROM http_idempotency WHERE scope=? AND key=?", (scope, key)).fetchone()
        return self._idem(row) if row else None

    async def finish_http_idempotency(self, scope: str, key: str, status_code: int, content_type: str, body: str, conversation_id: str | None) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE http_idempotency SET state='done', status_code=?, content_type=?, body=?, conversation_id=? WHERE scope=? AND key=?",
                (status_code, content_type, body, conversation_id, scope, key),
            )

    async def drop_http_idempotency(self, scope: str, key: str) -> None:
        with self._tx() as tx:
            tx.execute("DELETE FROM http_idempotency WHERE scope=? AND key=?", (scope, key))

    async def purge_http_idempotency(self, older_than: float) -> int:
        with self._tx() as tx:
            return tx.execute("DELETE FROM http_idempotency WHERE created_at < ?", (older_than,)).rowcount

    async def add_history_point(self, point: HistoryPoint) -> None:
        with self._tx() as tx:
            tx.execute(
                "INSERT OR REPLACE INTO history_points(agent_id, prefix_hash, conversation_id, last_message_id, created_at) VALUES (?,?,?,?,?)",
                (point.agent_id, point.prefix_hash, point.conversation_id, point.last_message_id, point.created_at or time.time()),
            )

    async def find_history_points(self, agent_id: str, prefix_hash: str) -> list[HistoryPoint]:
        rows = self.db.execute(
            "SELECT p.* FROM history_points p JOIN conversations c ON c.id = p.conversation_id "
            "WHERE p.agent_id=? AND p.prefix_hash=? ORDER BY c.updated_at DESC, p.created_at DESC",
            (agent_id, prefix_hash),
        ).fetchall()
        return [
            HistoryPoint(r["agent_id"], r["prefix_hash"], r["conversation_id"], r["last_message_id"], r["created_at"]) for r in rows
        ]
