"""SQLite implementation of the Store (WAL, synchronous=NORMAL, one writer connection).

Calls run inline on the event loop thread: each is a few small statements on a local file in WAL
mode, cheaper than a hop to a worker thread. A PostgreSQL store would await a pool instead; the
interface is async for that reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

import orjson
from filelock import FileLock, Timeout

from appserver.fsutil import StateFileRefused, check_sqlite_side_files
from appserver.procid import identity, identity_alive
from appserver.sqlitewal import wal_path
from appserver.store.agentcache import AgentCache, copy_agent
from appserver.store.base import (
    DELETE_ORPHAN_RESPONSES,
    ConversationGone,
    DuplicateTurn,
    Store,
    StoreError,
    StoreFileGone,
    conversation_page_ids,
    history_points_read,
    idempotency_cutoff,
)
from appserver.store.checkpointer import WAL_BACKSTOP_PAGES, Checkpointer
from appserver.store.groupcommit import GroupCommit, over_size_limit
from appserver.store.integrity import (
    QUICK_CHECK_MAX_BYTES,
    StoreOpenError,
    background_check,
    check_store_writable,
    create_store,
    damage_text,
    is_corruption,
    is_text_damage,
    messages_seq,
    open_error,
    preflight,
    shm_lock_holders,
)
from appserver.store.migrations import SchemaMismatch, SchemaTooNew, SchemaUpgradeRefused, migrate, upgrade_refused
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
    RESPONSE_OWNER_COLUMNS,
    agent_record,
    conversation_record,
    dump_json,
    http_idempotency,
    message_record,
    pending_call,
    response_owner,
    response_record,
    stored_size,
    turn_record,
)
from appserver.textparts import release_freed_memory

log = logging.getLogger("appserver.store")

_DRAFT_UPDATE = DRAFT_UPDATE.replace("%s", "?")  # the shared statement in SQLite's placeholders

# A message or draft whose text passes this many characters is written the big way (`_Bound`): a
# runaway answer (answer_max_bytes, 64 MiB by default) was held 8 times over while it was stored.
BIG_TEXT = 1024 * 1024
# A big draft is written again only once its text grew by a quarter: each draft rewrites the whole
# text, so one every half second made a long answer's drafts quadratic (a 64 MiB answer wrote GBs).
BIG_DRAFT_GROWTH = 4  # grown by 1/4
BIG_DRAFTS_MAX = 256  # turns whose last big draft size is kept
_MESSAGE_COLUMNS = (
    "conversation_id, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, reasoning, "
    "provider_state, completion_status, source, created_at, meta"
)
_MESSAGE_INSERT = f"INSERT INTO messages({_MESSAGE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
# The big way: text given as UTF-8 bytes and cast, and the last `?` says whether to insert at all;
# run again with nothing to insert, the statement drops the copy SQLite keeps of what it was bound
# (sqlite3's statement cache keeps a statement's bindings until the next run: 64 MiB, for good).
_BIG_MESSAGE_INSERT = (
    f"INSERT INTO messages({_MESSAGE_COLUMNS}) "
    "SELECT ?,?,?,?,CAST(? AS TEXT),CAST(? AS TEXT),?,?,?,CAST(? AS TEXT),?,?,?,?,? WHERE ?"
)
_BIG_MESSAGE_RELEASE = (None,) * 15 + (0,)
_BIG_DRAFT_UPDATE = _DRAFT_UPDATE.replace("draft=?", "draft=CAST(? AS TEXT)")
_BIG_DRAFT_RELEASE = (None, "")  # no turn has the id ""


class _Bound:
    """A big text value made only as SQLite binds it (sqlite3 calls `__conform__` then), as UTF-8
    bytes that the statement casts to TEXT. So the encoded copy lives while SQLite copies it, not
    through the whole write, and no `str` of it gets a UTF-8 copy of its own for the bind:
    SQLite's copy and the row it builds are then the only ones (a JSON `str` made beforehand was a
    third, its UTF-8 form a fourth). `json`: the value as JSON (what `dump_json` writes), else a
    `str` as it is."""

    __slots__ = ("value", "json")

    def __init__(self, value: Any, *, json: bool = True) -> None:
        self.value = value
        self.json = json

    def __conform__(self, protocol: object) -> bytes | str:
        if not self.json:
            return self.value.encode("utf-8")  # type: ignore[no-any-return]
        try:
            return orjson.dumps(self.value)  # = dump_json's text (fastjson), encoded
        except TypeError:  # what orjson refuses: dump_json's own fallback
            return dump_json(self.value)


def _text_size(value: Any) -> int:
    """About how many characters the strings in `value` hold (a message's content, calls, text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_size(v) for v in value)
    return 0


def _replace_bad_utf8(raw: bytes) -> str:
    """The text_factory of a read that met damaged text: U+FFFD for each byte that is no UTF-8."""
    return raw.decode("utf-8", "replace")


def conversation_page_query(
    agent_id: str | None,
    agent_ids: Collection[str] | None,
    namespace: str | None,
    *,
    limit: int,
    offset: int,
    after: tuple[float, str] | None,
) -> tuple[str, list[Any]]:
    """The read of a `list_conversations` page's rowids (base.py `conversation_page_ids`): a
    covering index of migration 8 serves it in order, with no temp B-tree."""
    return conversation_page_ids(
        "?", agent_id, agent_ids, namespace, limit=limit, offset=offset, after=after, key="rowid"
    )


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _serves(pid: int) -> bool:
    """Process `pid` is an `appserver serve` (`appserver [--home H] serve …`, `python -m appserver
    serve …`): its command, the first word after the program and its options, is `serve` (not a
    later argument: `appserver run serve` is a turn of an agent named so)."""
    args = _argv(pid)
    program = next((i for i, a in enumerate(args) if os.path.basename(a) == "appserver"), None)
    if program is None:
        return False
    rest = iter(args[program + 1 :])
    for word in rest:
        if word == "--home":
            next(rest, None)
        elif not word.startswith("-"):
            return word == "serve"
    return False


def _process(pid: int) -> str:
    """`pid 123 (appserver serve …)`, as far as /proc tells."""
    cmd = " ".join(_argv(pid)).strip()
    return f"pid {pid}" + (f" ({cmd[:80]})" if cmd else "")


OPEN_LOCK_TIMEOUT_S = 30.0  # another process opening or closing the store this long: refused
CLOSE_LOCK_TIMEOUT_S = 5.0  # at close, past this the connection closes without the lock
UNSAVED_MAX = 1024  # conversations whose queued insert failed, kept for their next accept


@contextmanager
def handoff(path: Path | str, timeout: float, *, required: bool = True) -> Iterator[None]:
    """Held while this process opens the store (until its connection holds the `-shm` lock) and
    while it closes it. Another process's preflight reads the files only when nobody has the store
    open (integrity.py), and a process half way through creating, opening or closing it had no lock
    yet or any more: two commands on a new home read the other's fresh WAL as a lost one and
    refused the store. A home where the lock file cannot be made (read-only) goes without it."""
    if not isinstance(path, Path):
        yield
        return
    lock = FileLock(str(path.with_name(path.name + ".open-lock")), timeout=timeout, mode=0o600)
    try:
        lock.acquire()
    except Timeout:
        if required:
            raise StoreOpenError(
                f"another process has been opening or closing {path} for {timeout:g} s "
                f"({path.name}.open-lock): try again; if it stays, look for a hung appserver command"
            ) from None
        yield
        return
    except OSError:
        yield  # (a read-only home: nothing can be written there anyway)
        return
    try:
        yield
    finally:
        lock.release()


class SQLiteStore(Store):
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path) if path != ":memory:" else path
        self._db: sqlite3.Connection | None = None
        self.fresh = False  # True when open() created the schema (first use of this home)
        self._agent_cache = AgentCache(self._load_agents)
        # The single writer: grouped turn commits and plain transactions, in order (groupcommit.py).
        self._writes = GroupCommit(
            self._writer, self._committed, self.note_failure, name=f"the store {self.path}", files=self._files()
        )
        self.damage: str | None = None  # what SQLite found damaged while the server runs
        # Conversations whose queued insert (create_conversation) did not commit (a full disk, the
        # file locked by another process): the kernel holds them already, so the next accept in
        # one writes them first (`_accept_turn`) rather than failing as if they had been deleted.
        self._unsaved: dict[str, ConversationRecord] = {}
        # The text size of the last big draft written per running turn (BIG_DRAFT_GROWTH).
        self._big_drafts: dict[str, int] = {}
        self._checkpointer: Checkpointer | None = None
        self.owner = identity()  # this process: stamped on the HTTP idempotency keys it claims
        # The HTTP idempotency keys a request of this store still works on (claimed, not yet
        # finished or dropped): (scope, key) → the claim's created_at. A pending key of this
        # process that is not here lost its end to a refused write (a full disk): nobody will
        # finish it, and a repeat of its request takes it over (`claim_http_idempotency`).
        self._claimed: dict[tuple[str, str], float] = {}
        # Set by `serve --accept-data-loss`: open a store whose WAL was damaged or that is behind
        # its recorded position (integrity.py), after keeping a copy, instead of refusing.
        self.accept_data_loss = False
        self._write_probe = 0
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened
        self._file_gone: str | None = None  # why writes are refused: the file was deleted or replaced
        # Why an older schema may not be upgraded now (a live server of the home uses it), or None:
        # asked only when one is due; make_store sets serverinfo.upgrade_refusal for the home.
        self.upgrade_refusal: Callable[[], str | None] | None = None

    # ------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        self.open_sync()

    def open_sync(self) -> None:
        """Open the file (only a missing one is a new store: see integrity.py); an unusable one
        raises StoreOpenError naming the file and what to do, and is left as it was."""
        if self._db is not None:
            return
        with handoff(self.path, OPEN_LOCK_TIMEOUT_S):
            self._open_held()

    def _open_held(self) -> None:
        created = False
        if isinstance(self.path, Path):
            try:
                check_sqlite_side_files(self.path)
            except StateFileRefused as exc:
                raise StoreOpenError(str(exc)) from None
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
        except (SchemaTooNew, SchemaMismatch, SchemaUpgradeRefused) as exc:
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
            self._checkpointer = Checkpointer(self.path)
            self._checkpointer.start()
            if not created and st.st_size > QUICK_CHECK_MAX_BYTES:  # checked before the start when smaller
                # _damaged only sets a field and logs: safe from this thread
                threading.Thread(
                    target=background_check, args=(self.path, self._damaged), name="sqlite-quick-check", daemon=True
                ).start()

    def _open_error(self, exc: sqlite3.Error) -> StoreOpenError:
        return open_error(Path(str(self.path)), exc)

    async def close(self) -> None:
        self._writes.flush()
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
            with handoff(self.path, CLOSE_LOCK_TIMEOUT_S, required=False):
                self._db.close()  # the last connection to close checkpoints what is left
            self._db = None
            if checkpointer is not None and seq is not None:
                checkpointer.record(seq)
        self._agent_cache.drop()

    async def claim_server(self) -> None:
        """`serve.lock` gives the home to one server, but a lock file deleted by hand (a "stale
        lock" clean-up) let a second `serve` start beside a live one. The store's own `-shm` lock
        says who else has it open; another `appserver serve` among them is refused by pid (readers
        are not: a command of the CLI, a backup, an `sqlite3` shell)."""
        if not isinstance(self.path, Path):
            return
        servers = [pid for pid in sorted(shm_lock_holders(self.path) - {os.getpid()}) if _serves(pid)]
        if servers:
            raise StoreOpenError(
                f"{self.path} is open in another `appserver serve` ({', '.join(_process(p) for p in servers)}), "
                "which runs without holding this home's serve.lock (deleted by hand?); stop it, then start again"
            )

    async def check_writable(self, min_free_bytes: int = 0) -> str:
        """Readiness: a real write transaction, and room on the disk. In WAL mode a small write
        reuses WAL space already allocated, so it succeeds on a full disk; growing the database
        at the next checkpoint would not. The free-space check is what sees a full disk."""
        self._check_file()
        if self.damage is not None:
            raise StoreError(f"{self.path} is damaged ({self.damage}): stop the server and restore it from a backup")
        if isinstance(self.path, Path) and min_free_bytes:
            free = shutil.disk_usage(self.path.parent).free
            if free < min_free_bytes:
                raise StoreError(
                    f"disk nearly full: {free:,} bytes free for {self.path.parent} (needs {min_free_bytes:,}; "
                    "[limits] min_free_disk_bytes)"
                )
        at_limit = over_size_limit(self._files())
        if at_limit is not None:  # writes that grow it fail (EFBIG) while small ones still go through
            raise StoreError(
                f"{at_limit} is at this process's file size limit (ulimit -f): writes that grow it fail; raise the "
                "limit of the server's process"
            )
        self._write_probe = (self._write_probe + 1) % 1_000_000
        with self._tx() as tx:
            tx.execute(f"PRAGMA user_version = {self._write_probe + 1}")  # header page only; no table
        return "writable" + (
            f", {shutil.disk_usage(self.path.parent).free:,} bytes free" if isinstance(self.path, Path) else ""
        )

    def _files(self) -> tuple[Path, ...]:
        """The store's files that writes grow (none in memory): a file size limit is told by their sizes."""
        return (self.path, wal_path(self.path)) if isinstance(self.path, Path) else ()

    def _writer(self) -> sqlite3.Connection:
        """The connection every write transaction runs on, once the file it opened is still the
        store's (one stat per transaction; a group of commits shares one)."""
        self._check_file()
        return self.db

    def _check_file(self) -> None:
        """A store file deleted or replaced under a running server still takes writes, into a file
        nobody will open again: everything from then on would be lost at the next start, after
        being acknowledged. While it is so, every write is refused (StoreFileGone, HTTP 503) and
        readiness fails; the same file put back under its name takes writes again."""
        if not isinstance(self.path, Path) or self._file_id is None:
            return
        try:
            st = self.path.stat()
            same = (st.st_dev, st.st_ino) == self._file_id
        except FileNotFoundError:
            same = False
        if same:
            if self._file_gone is not None:
                log.warning("%s is back: writes go on", self.path)
                self._file_gone = None
            return
        if self._file_gone is None:
            self._file_gone = (
                f"{self.path} was deleted or replaced while the server runs: nothing more is written (what would "
                "be goes to a file no later start will open); put the file back, or stop the server and accept "
                "the loss"
            )
            log.error("%s", self._file_gone)
        raise StoreFileGone(self._file_gone)

    def _committed(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.committed()

    def note_failure(self, exc: BaseException) -> None:
        """Writes that failed come here from the group commit; reads, from the front ends."""
        if is_corruption(exc):
            self._damaged(damage_text(exc))

    def _damaged(self, problem: str) -> None:
        """The file is damaged (a write met a malformed page, or the check after the start found
        one): said once, loudly, and /readyz fails from now on (check_writable)."""
        if self.damage is None:
            self.damage = problem
            log.error(
                "%s is damaged (%s): stop the server and restore it "
                "from a backup (`sqlite3 %s .recover` can often save what is readable)",
                self.path,
                problem,
                self.path,
            )

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return self._writes.transaction()

    def _migrate(self) -> None:
        self.fresh = migrate(self.db, self._before_upgrade) == 0

    def _before_upgrade(self, current: int, known: int) -> None:
        """An older store is upgraded by the home's owner, never under a live server's feet."""
        why = self.upgrade_refusal() if self.upgrade_refusal is not None else None
        if why is not None:
            raise upgrade_refused(
                current, known, why, "stop it, then start this version's `appserver serve`, which upgrades the store"
            )

    # ------------------------------------------------------------ agents

    async def create_agent(self, agent: AgentRecord) -> AgentRecord:
        now = time.time()
        agent.created_at = agent.created_at or now
        agent.updated_at = now
        self._agent_cache.drop()
        with self._tx() as tx:
            tx.execute(
                "INSERT INTO agents(id, name, model, system, tools, params, created_at, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?)",
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
        return agent

    async def update_agent(self, agent: AgentRecord) -> AgentRecord:
        agent.updated_at = time.time()
        self._agent_cache.drop()
        with self._tx() as tx:
            cur = tx.execute(
                "UPDATE agents SET name=?, model=?, system=?, tools=?, params=?, updated_at=? WHERE id=?",
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
            if cur.rowcount == 0:
                raise StoreError(f"agent {agent.id} does not exist")
        return agent

    async def delete_agent(self, agent_id: str) -> bool:
        self._agent_cache.drop()
        with self._tx() as tx:
            tx.execute("DELETE FROM turns WHERE agent_id=?", (agent_id,))
            cur = tx.execute("DELETE FROM agents WHERE id=?", (agent_id,))
            tx.execute(DELETE_ORPHAN_RESPONSES)
            return cur.rowcount > 0

    def _load_agents(self, db: sqlite3.Connection) -> Iterable[AgentRecord]:
        assert db is self.db  # the agent cache reads through this store's connection
        rows = self._rows("SELECT * FROM agents ORDER BY created_at, id", (), "in the agents")
        return [agent_record(r, self._damaged) for r in rows]

    def _agents(self) -> dict[str, AgentRecord]:
        """The cached agents (agentcache.py)."""
        return self._agent_cache.agents(self.db)

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        agent = self._agents().get(agent_id)
        return copy_agent(agent) if agent is not None else None

    async def find_agents(self, ref: str) -> list[AgentRecord]:
        return [copy_agent(a) for a in self._agents().values() if a.id == ref or a.name == ref]

    async def list_agents(self) -> list[AgentRecord]:
        return [copy_agent(a) for a in self._agents().values()]

    async def agents_to_read(self) -> Sequence[AgentRecord]:
        return tuple(self._agents().values())

    # ------------------------------------------------------------ conversations

    async def create_conversation(
        self, conv: ConversationRecord, *, copy_messages: Iterable[int] | None = None
    ) -> ConversationRecord:
        """Without messages to copy, the row is queued (see GroupCommit.submit `defer`): it commits together
        with the first turn's accept instead of in a transaction of its own. Reads of conversations
        and every other write commit queued writes first, so nobody sees the difference."""
        now = time.time()
        conv.created_at = conv.created_at or now
        conv.updated_at = now
        if copy_messages is None:
            self._writes.submit(
                lambda tx: self._insert_conversation(tx, conv), defer=True, on_failure=lambda _: self._not_saved(conv)
            )
            return conv
        with self._tx() as tx:
            self._insert_conversation(tx, conv)
            if copy_messages is not None:
                ids = list(copy_messages)
                for mid in ids:
                    tx.execute(
                        "INSERT INTO messages(conversation_id, turn_id, iteration, role, content, tool_calls, "
                        "tool_call_id, name, is_error, reasoning, provider_state, completion_status, source, "
                        "created_at, meta) "
                        "SELECT ?, turn_id, iteration, role, content, tool_calls, tool_call_id, name, is_error, "
                        "reasoning, provider_state, completion_status, source, created_at, meta "
                        "FROM messages WHERE id=?",
                        (conv.id, mid),
                    )
        return conv

    @staticmethod
    def _insert_conversation(tx: sqlite3.Connection, conv: ConversationRecord) -> None:
        tx.execute(
            "INSERT INTO conversations(id, agent_id, is_default, title, user, namespace, forked_from, metadata, "
            "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                conv.id,
                conv.agent_id,
                int(conv.is_default),
                conv.title,
                conv.user,
                conv.namespace,
                conv.forked_from,
                dump_json(conv.metadata),
                conv.created_at,
                conv.updated_at,
            ),
        )

    async def ensure_conversation(
        self,
        conv: ConversationRecord,
        *,
        copy_messages: Iterable[int] | None = None,
        messages: list[MessageRecord] | None = None,
    ) -> tuple[ConversationRecord, bool]:
        """The look-up and the (queued) insert run with no suspension between them, and one
        server owns a home's file (serve.lock): nobody can create the conversation in between."""
        self._writes.settle()
        row = self._row("SELECT * FROM conversations WHERE id=?", (conv.id,), "in the conversations")
        if row is None and conv.is_default:
            row = self._row(
                "SELECT * FROM conversations WHERE agent_id=? AND is_default=1",
                (conv.agent_id,),
                "in the conversations",
            )
        if row is not None:
            return conversation_record(row, self._damaged), False
        unsaved = self._unsaved_like(conv.id, conv.agent_id if conv.is_default else None)
        if unsaved is not None and not copy_messages and not messages:
            return unsaved, False  # made already; its row comes with its next accept
        await self.create_conversation(conv, copy_messages=copy_messages)
        if messages:
            await self.append_messages(conv.id, messages)
        return conv, True

    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None:
        self._writes.settle()
        row = self._row("SELECT * FROM conversations WHERE id=?", (conversation_id,), "in the conversations")
        return conversation_record(row, self._damaged) if row else self._unsaved_like(conversation_id, None)

    async def get_default_conversation(self, agent_id: str) -> ConversationRecord | None:
        self._writes.settle()
        row = self._row(
            "SELECT * FROM conversations WHERE agent_id=? AND is_default=1", (agent_id,), "in the conversations"
        )
        return conversation_record(row, self._damaged) if row else self._unsaved_like(None, agent_id)

    def _unsaved_like(self, conversation_id: str | None, default_of: str | None) -> ConversationRecord | None:
        """A conversation made here whose queued insert did not commit (`_unsaved`): by id, or the
        default one of agent `default_of`. Shown as it was made: the kernel holds it already."""
        if not self._unsaved:
            return None
        if conversation_id is not None and conversation_id in self._unsaved:
            return self._unsaved[conversation_id]
        if default_of is not None:
            for conv in self._unsaved.values():
                if conv.is_default and conv.agent_id == default_of:
                    return conv
        return None

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
        """The page's rowids off an index alone (`conversation_page_query`), then its rows by
        rowid: no row before the page is read, whatever the offset."""
        self._writes.settle()
        query, params = conversation_page_query(agent_id, agent_ids, namespace, limit=limit, offset=offset, after=after)
        keys = [r[0] for r in self._rows(query, params, "in the conversations")]
        if not keys:
            return []
        rows = self._rows(
            "SELECT rowid AS page_key, * FROM conversations WHERE rowid IN (SELECT value FROM json_each(?))",
            (orjson.dumps(keys).decode(),),
            "in the conversations",
        )
        by_key = {r["page_key"]: r for r in rows}
        return [conversation_record(by_key[k], self._damaged) for k in keys if k in by_key]

    async def discard_empty_conversation(self, conversation_id: str) -> bool:
        """After whatever is queued (a deferred insert of the conversation, an accept into it)."""
        if self._unsaved and self._unsaved.pop(conversation_id, None) is not None:
            return True  # its insert failed and no accept carried it (that pops it): nothing stored
        with self._tx() as tx:
            return (
                tx.execute(
                    "DELETE FROM conversations WHERE id=? AND NOT EXISTS (SELECT 1 FROM turns WHERE conversation_id=?) "
                    "AND NOT EXISTS (SELECT 1 FROM messages WHERE conversation_id=?)",
                    (conversation_id, conversation_id, conversation_id),
                ).rowcount
                > 0
            )

    async def update_conversation(self, conv: ConversationRecord) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE conversations SET title=?, user=?, metadata=?, updated_at=? WHERE id=?",
                (conv.title, conv.user, dump_json(conv.metadata), time.time(), conv.id),
            )

    # ------------------------------------------------------------ messages

    async def list_messages(
        self, conversation_id: str, *, before_id: int | None = None, limit: int | None = None
    ) -> list[MessageRecord]:
        if before_id is None and limit is None:
            rows = self._rows(
                "SELECT * FROM messages WHERE conversation_id=? ORDER BY id",
                (conversation_id,),
                f"in conversation {conversation_id}",
            )
        else:
            rows = self._rows(
                "SELECT * FROM messages WHERE conversation_id=? AND id < ? ORDER BY id DESC LIMIT ?",
                (conversation_id, before_id if before_id is not None else 2**62, limit if limit is not None else -1),
                f"in conversation {conversation_id}",
            )
            rows.reverse()
        return [message_record(r, self._damaged) for r in rows]

    def _rows(self, sql: str, params: Sequence[Any] = (), where: str = "") -> list[Any]:
        """The rows of a read. Text that is not UTF-8 (bytes changed inside a page) is damage:
        said once, loudly, and /readyz fails from then on; the rows are read again with U+FFFD in
        place of the bad bytes, so what holds them (an agent, a conversation, its history) stays
        usable until the store is restored. The usual read costs nothing more: the slower decoding
        is only set for that second read (on this connection, on the one thread that uses it, and
        put back)."""
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if not is_text_damage(exc):
                raise
            problem = damage_text(exc)
        self._damaged(f"{problem}, {where}" if where else problem)
        with self._lenient_text():
            return self.db.execute(sql, params).fetchall()

    @contextmanager
    def _lenient_text(self) -> Iterator[None]:
        """Reads inside decode text that is no UTF-8 with U+FFFD (a read that met damage, again)."""
        db = self.db
        db.text_factory = _replace_bad_utf8
        try:
            yield
        finally:
            db.text_factory = str

    def _row(self, sql: str, params: Sequence[Any] = (), where: str = "") -> Any:
        """The first row of a read (`_rows`), or None."""
        rows = self._rows(sql, params, where)
        return rows[0] if rows else None

    async def history_page(
        self, conversation_id: str, *, before_id: int | None, limit: int, max_bytes: int
    ) -> tuple[list[MessageRecord], bool]:
        # Rows are read one by one, newest first, and the read stops at the budget: a page never
        # pulls more than about `max_bytes` (plus one message) off the disk onto the event loop.
        cur = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id=? AND id < ? ORDER BY id DESC LIMIT ?",
            (conversation_id, before_id if before_id is not None else 2**62, limit + 1),
        )
        rows: list[Any] = []  # sqlite3.Row, read as a mapping
        size, more = 0, False
        try:
            for row in cur:
                if len(rows) == limit or (rows and size >= max_bytes):
                    more = True
                    break
                rows.append(row)
                size += stored_size(row)
        except sqlite3.OperationalError as exc:
            if not is_text_damage(exc):
                raise
            # damaged text (see _rows): this page is read again, each row decoded with U+FFFD
            cur.close()
            self._damaged(f"{damage_text(exc)}, in conversation {conversation_id}")
            with self._lenient_text():
                return await self.history_page(conversation_id, before_id=before_id, limit=limit, max_bytes=max_bytes)
        finally:
            cur.close()
        rows.reverse()
        return [message_record(r, self._damaged) for r in rows], more

    @staticmethod
    def _insert_message(tx: sqlite3.Connection, conversation_id: str, m: MessageRecord, now: float) -> None:
        m.conversation_id = conversation_id
        m.created_at = m.created_at or now
        big = _text_size(m.content) + _text_size(m.tool_calls) + _text_size(m.reasoning) >= BIG_TEXT
        values = (
            conversation_id,
            m.turn_id,
            m.iteration,
            m.role,
            _Bound(m.content) if big else dump_json(m.content),
            (_Bound(m.tool_calls) if big else dump_json(m.tool_calls)) if m.tool_calls else None,
            m.tool_call_id,
            m.name,
            int(m.is_error),
            _Bound(m.reasoning, json=False) if big and m.reasoning else m.reasoning,
            dump_json(m.provider_state) if m.provider_state is not None else None,
            m.completion_status,
            dump_json(m.source) if m.source is not None else None,
            m.created_at,
            dump_json(m.meta) if m.meta else None,
        )
        if not big:
            m.id = tx.execute(_MESSAGE_INSERT, values).lastrowid
            return
        release_freed_memory()
        m.id = tx.execute(_BIG_MESSAGE_INSERT, (*values, 1)).lastrowid
        tx.execute(_BIG_MESSAGE_INSERT, _BIG_MESSAGE_RELEASE)

    async def append_messages(self, conversation_id: str, messages: list[MessageRecord]) -> None:
        now = time.time()
        with self._tx() as tx:
            for m in messages:
                self._insert_message(tx, conversation_id, m, now)
            tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    # ------------------------------------------------------------ turns

    async def accept_turn(self, turn: TurnRecord, idempotency_scope: str | None = None) -> TurnRecord:
        """Record an accepted input (in the next group transaction, groupcommit.py). With an idempotency
        key already used in `scope`, raise DuplicateTurn."""
        now = time.time()
        turn.created_at = turn.created_at or now
        await self._writes.submit(lambda tx: self._accept_turn(tx, turn, idempotency_scope, now))
        if self._unsaved:
            self._unsaved.pop(turn.conversation_id, None)  # committed with this turn, if it was not before
        return turn

    def _not_saved(self, conv: ConversationRecord) -> None:
        self._unsaved[conv.id] = conv
        while len(self._unsaved) > UNSAVED_MAX:  # oldest first: a bound on what repeated failures keep
            del self._unsaved[next(iter(self._unsaved))]

    def _accept_turn(self, tx: sqlite3.Connection, turn: TurnRecord, idempotency_scope: str | None, now: float) -> None:
        unsaved = self._unsaved.get(turn.conversation_id) if self._unsaved else None
        if unsaved is not None and not tx.execute("SELECT 1 FROM conversations WHERE id=?", (unsaved.id,)).fetchone():
            self._insert_conversation(tx, unsaved)  # commits with this turn, or not at all
        try:
            self._insert_turn(tx, turn, idempotency_scope, now)
        except sqlite3.IntegrityError as exc:
            # The turn's conversation (or its agent, and with it the conversation) was deleted
            # after the request found it: said as such, not a 500.
            if "FOREIGN KEY" in str(exc):
                raise ConversationGone(turn.conversation_id) from exc
            raise

    def _insert_turn(self, tx: sqlite3.Connection, turn: TurnRecord, idempotency_scope: str | None, now: float) -> None:
        if turn.idempotency_key and idempotency_scope:
            row = tx.execute(
                "SELECT turn_id, created_at FROM idempotency_keys WHERE scope=? AND key=?",
                (idempotency_scope, turn.idempotency_key),
            ).fetchone()
            if row is not None:
                # an expired key (a purge has not removed it yet) is this turn's now, as is one
                # that outlived its turn (deleted with its agent)
                live = row["created_at"] >= idempotency_cutoff(now)
                existing = tx.execute("SELECT * FROM turns WHERE id=?", (row["turn_id"],)).fetchone() if live else None
                if existing is not None:
                    raise DuplicateTurn(turn_record(existing, self._damaged))
                tx.execute(
                    "DELETE FROM idempotency_keys WHERE scope=? AND key=?", (idempotency_scope, turn.idempotency_key)
                )
            tx.execute(
                "INSERT INTO idempotency_keys(scope, key, turn_id, conversation_id, created_at) VALUES (?,?,?,?,?)",
                (idempotency_scope, turn.idempotency_key, turn.id, turn.conversation_id, now),
            )
        tx.execute(
            "INSERT INTO turns(id, conversation_id, agent_id, status, idempotency_key, source, input, client_tools, "
            "options, owner, created_at, started_at, input_committed) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                int(turn.input_committed),  # a re-run's input is in the history already (Kernel._rerun)
            ),
        )

    async def lookup_idempotency(self, scope: str, key: str) -> TurnRecord | None:
        row = self._row(
            "SELECT t.* FROM idempotency_keys k JOIN turns t ON t.id = k.turn_id "
            "WHERE k.scope=? AND k.key=? AND k.created_at >= ?",
            (scope, key, idempotency_cutoff()),
            "in the turns",
        )
        return turn_record(row, self._damaged) if row else None

    async def forget_idempotency(self, scope: str, key: str, turn_id: str) -> None:
        with self._tx() as tx:
            tx.execute("DELETE FROM idempotency_keys WHERE scope=? AND key=? AND turn_id=?", (scope, key, turn_id))

    async def remember_idempotency(self, scope: str, key: str, turn_id: str, conversation_id: str) -> None:
        with self._tx() as tx:
            tx.execute(
                "INSERT OR REPLACE INTO idempotency_keys(scope, key, turn_id, conversation_id, created_at) "
                "VALUES (?,?,?,?,?)",
                (scope, key, turn_id, conversation_id, time.time()),
            )

    async def purge_idempotency(self, older_than: float) -> int:
        with self._tx() as tx:
            return tx.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (older_than,)).rowcount

    async def mark_turn_running(self, turn_id: str, owner: str, revision: int) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE turns SET status='running', owner=?, revision=?, started_at=COALESCE(started_at, ?) "
                "WHERE id=? AND status NOT IN ('completed', 'cancelled', 'failed', 'interrupted')",  # never again
                (owner, revision, time.time(), turn_id),
            )

    async def save_draft(self, turn_id: str, draft: dict[str, Any]) -> None:
        """In the next group transaction (hundreds of streaming turns each checkpoint twice a
        second); a draft that arrives after its turn ended changes nothing. A big one (BIG_TEXT)
        is written only once it grew by a quarter since the last (BIG_DRAFT_GROWTH), the big way
        (`_Bound`, then SQLite's copy dropped)."""
        size = _text_size(draft.get("text"))
        if size < BIG_TEXT:
            text = dump_json(draft)

            def write(tx: sqlite3.Connection) -> None:
                tx.execute(_DRAFT_UPDATE, (text, turn_id))

            await self._writes.submit(write)
            return
        last = self._big_drafts.get(turn_id)
        if last is not None and last <= size < last + last // BIG_DRAFT_GROWTH:
            return
        self._big_drafts.pop(turn_id, None)
        self._big_drafts[turn_id] = size
        while len(self._big_drafts) > BIG_DRAFTS_MAX:  # oldest first (a turn that never committed here)
            del self._big_drafts[next(iter(self._big_drafts))]

        def write_big(tx: sqlite3.Connection) -> None:
            release_freed_memory()
            tx.execute(_BIG_DRAFT_UPDATE, (_Bound(draft), turn_id))
            tx.execute(_BIG_DRAFT_UPDATE, _BIG_DRAFT_RELEASE)

        await self._writes.submit(write_big)

    async def record_cancel(
        self, turn_id: str, cancel_ack: dict[str, Any], *, reason: str, draft: dict[str, Any] | None = None
    ) -> bool:
        """Committed before this returns (queued writes first: a draft saved earlier lands before)."""
        with self._tx() as tx:
            marked = tx.execute(
                "UPDATE turns SET cancel_ack=? WHERE id=? AND status IN ('queued', 'running', 'awaiting')",
                (dump_json(cancel_ack), turn_id),
            ).rowcount
            if not marked:
                return False
            tx.execute(
                "UPDATE pending_calls SET status='cancelled', is_error=1, reason=? "
                "WHERE turn_id=? AND status='pending'",
                (reason, turn_id),
            )
            if draft is not None:
                self._big_drafts.pop(turn_id, None)
                if _text_size(draft.get("text")) < BIG_TEXT:
                    tx.execute(_DRAFT_UPDATE, (dump_json(draft), turn_id))
                else:
                    tx.execute(_BIG_DRAFT_UPDATE, (_Bound(draft), turn_id))
                    tx.execute(_BIG_DRAFT_UPDATE, _BIG_DRAFT_RELEASE)
            return True

    async def commit_turn(self, conversation_id: str, commit: TurnCommit) -> None:
        """One turn's rows, atomically, in the next group transaction (groupcommit.py)."""
        self._big_drafts.pop(commit.turn_id, None)  # the commit clears the draft
        await self._writes.submit(lambda tx: self._commit_turn(tx, conversation_id, commit))

    async def checkpoint_turn(
        self,
        conversation_id: str,
        turn_id: str,
        messages: list[MessageRecord],
        *,
        iteration: int,
        usage: dict[str, int],
    ) -> None:
        """Committed before this returns (queued writes first): a tool may act right after."""
        now = time.time()
        self._big_drafts.pop(turn_id, None)  # the draft is cleared: the next one starts anew
        with self._tx() as tx:
            try:
                for m in messages:
                    m.turn_id = m.turn_id or turn_id
                    self._insert_message(tx, conversation_id, m, now)
            except sqlite3.IntegrityError as exc:
                if "FOREIGN KEY" in str(exc):
                    raise ConversationGone(conversation_id) from exc
                raise
            updated = tx.execute(
                "UPDATE turns SET input_committed=1, iteration=?, usage=?, draft=NULL WHERE id=?",
                (iteration, dump_json(usage), turn_id),
            ).rowcount
            if updated == 0:  # gone with its conversation (maybe created again under its id since)
                raise ConversationGone(conversation_id)
            tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    def _commit_turn(self, tx: sqlite3.Connection, conversation_id: str, commit: TurnCommit) -> None:
        try:
            self._write_turn(tx, conversation_id, commit)
        except sqlite3.IntegrityError as exc:
            # Every row a commit inserts refers to its conversation (turns and pending calls go
            # with it by cascade): a foreign key that fails here is a conversation deleted meanwhile.
            if "FOREIGN KEY" in str(exc):
                raise ConversationGone(conversation_id) from exc
            raise

    def _write_turn(self, tx: sqlite3.Connection, conversation_id: str, commit: TurnCommit) -> None:
        now = time.time()
        terminal = commit.status in ("completed", "cancelled", "failed", "interrupted")
        for m in commit.messages:
            m.turn_id = m.turn_id or commit.turn_id
            self._insert_message(tx, conversation_id, m, now)
        for p in commit.pending:
            tx.execute(
                "INSERT INTO pending_calls(conversation_id, call_id, turn_id, name, arguments, kind, status, output, "
                "is_error, reason, decided_by, created_at, expires_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    conversation_id,
                    p.call_id,
                    p.turn_id,
                    p.name,
                    p.arguments,
                    p.kind,
                    p.status,
                    p.output,
                    int(p.is_error),
                    p.reason,
                    p.decided_by,
                    p.created_at or now,
                    p.expires_at,
                ),
            )
        updated = tx.execute(
            "UPDATE turns SET status=?, stop_reason=?, error=?, usage=?, revision=?, iteration=?, input_committed=?, "
            "draft=NULL, ended_at=? WHERE id=?",
            (
                commit.status,
                commit.stop_reason,
                dump_json(commit.error) if commit.error is not None else None,
                dump_json(commit.usage),
                commit.revision,
                commit.iteration,
                int(commit.input_committed),
                now if terminal else None,
                commit.turn_id,
            ),
        ).rowcount
        if updated == 0:
            # The turn's row went with its conversation: deleted while the turn ran (maybe created
            # again under the same id since, which must not receive this turn's messages).
            raise ConversationGone(conversation_id)
        if terminal and (commit.iteration > 1 or commit.pending or commit.stop_reason != "end_turn"):
            # Pending calls that never got an answer are closed with the turn.
            tx.execute(
                "UPDATE pending_calls SET status='cancelled' WHERE turn_id=? AND status='pending'", (commit.turn_id,)
            )
        tx.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))

    async def get_turn(self, turn_id: str) -> TurnRecord | None:
        row = self._row("SELECT * FROM turns WHERE id=?", (turn_id,), "in the turns")
        return turn_record(row, self._damaged) if row else None

    async def list_turns(self, conversation_id: str, *, statuses: Iterable[str] | None = None) -> list[TurnRecord]:
        if statuses is None:
            rows = self._rows(
                "SELECT * FROM turns WHERE conversation_id=? ORDER BY rowid", (conversation_id,), "in the turns"
            )
        else:
            st = list(statuses)
            rows = self._rows(
                f"SELECT * FROM turns WHERE conversation_id=? AND status IN ({','.join('?' * len(st))}) ORDER BY rowid",
                (conversation_id, *st),
                "in the turns",
            )
        return [turn_record(r, self._damaged) for r in rows]

    async def open_turns(self, statuses: Iterable[str] = ("queued", "running", "awaiting")) -> list[TurnRecord]:
        st = list(statuses)
        rows = self._rows(
            f"SELECT * FROM turns WHERE status IN ({','.join('?' * len(st))}) ORDER BY rowid", st, "in the turns"
        )
        return [turn_record(r, self._damaged) for r in rows]

    # ------------------------------------------------------------ pending calls

    async def list_pending(self, turn_id: str) -> list[PendingCall]:
        rows = self._rows(
            "SELECT * FROM pending_calls WHERE turn_id=? ORDER BY created_at, rowid", (turn_id,), "in the pending calls"
        )
        return [pending_call(r) for r in rows]

    async def get_pending(self, conversation_id: str, call_id: str) -> PendingCall | None:
        row = self._row(
            "SELECT * FROM pending_calls WHERE conversation_id=? AND call_id=?",
            (conversation_id, call_id),
            "in the pending calls",
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
        with self._tx() as tx:
            cur = tx.execute(
                "UPDATE pending_calls SET status=?, output=?, is_error=?, reason=?, decided_by=? "
                "WHERE conversation_id=? AND call_id=? AND status='pending'",
                (status, output, int(is_error), reason, decided_by, conversation_id, call_id),
            )
            won = cur.rowcount == 1
            if won and settings is not None:
                tx.execute(
                    "UPDATE turns SET options=?, client_tools=? WHERE status='awaiting' AND id="
                    "(SELECT turn_id FROM pending_calls WHERE conversation_id=? AND call_id=?)",
                    (dump_json(settings.options), dump_json(settings.client_tools), conversation_id, call_id),
                )
            return won

    async def overdue_pending(self, now: float) -> list[PendingCall]:
        rows = self._rows(
            "SELECT * FROM pending_calls WHERE status='pending' AND expires_at IS NOT NULL AND expires_at <= ? "
            "ORDER BY expires_at",
            (now,),
            "in the pending calls",
        )
        return [pending_call(r) for r in rows]

    # ------------------------------------------------------------ OpenAI HTTP surface

    async def last_message_id(self, conversation_id: str) -> int:
        row = self.db.execute("SELECT MAX(id) FROM messages WHERE conversation_id=?", (conversation_id,)).fetchone()
        return int(row[0] or 0)

    async def last_message_ids(self, conversation_ids: Collection[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(conversation_ids))
        heads = dict.fromkeys(ids, 0)
        for at in range(0, len(ids), 500):  # well under SQLite's bound on parameters
            part = ids[at : at + 500]
            rows = self.db.execute(
                "SELECT conversation_id, MAX(id) FROM messages WHERE conversation_id IN "
                f"({','.join('?' * len(part))}) GROUP BY conversation_id",
                part,
            ).fetchall()
            heads.update((r[0], int(r[1] or 0)) for r in rows)
        return heads

    async def save_response(self, response: ResponseRecord) -> None:
        response.created_at = response.created_at or time.time()
        with self._tx() as tx:
            tx.execute(
                "INSERT OR REPLACE INTO responses(id, agent_id, conversation_id, turn_id, previous_response_id, "
                "namespace, last_message_id, body, input_items, stored, created_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
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
                    int(response.stored),
                    response.created_at,
                ),
            )

    async def get_response(self, response_id: str) -> ResponseRecord | None:
        row = self._row("SELECT * FROM responses WHERE id=?", (response_id,), "in the responses")
        return response_record(row, self._damaged) if row else None

    async def get_response_owner(self, response_id: str) -> ResponseOwner | None:
        row = self._row(
            f"SELECT {RESPONSE_OWNER_COLUMNS} FROM responses WHERE id=?", (response_id,), "in the responses"
        )
        return response_owner(row) if row else None

    async def delete_response(self, response_id: str) -> bool:
        with self._tx() as tx:
            return tx.execute("DELETE FROM responses WHERE id=?", (response_id,)).rowcount > 0

    def _orphaned(self, owner: str | None) -> bool:
        """A pending key's claimant is gone (killed mid-request): nobody will ever finish it."""
        return owner != self.owner and not identity_alive(owner)

    def _unheld(self, row: sqlite3.Row) -> bool:
        """A pending key this process claimed that no request of it works on any more: its end
        (the answer kept, or the key let go) was refused by the store (a full disk)."""
        k = (row["scope"], row["key"])
        return bool(row["owner"] == self.owner and self._claimed.get(k) != row["created_at"])

    async def claim_http_idempotency(self, entry: HttpIdempotency) -> HttpIdempotency | None:
        """A pending key whose claimant died (or released: owner NULL), or that this process
        claimed but whose end could not be written (`_unheld`), is taken over by a repeat of its
        request, which runs it again or follows its turn. One with another body gets the key's
        entry (409 from the caller), never the claim: `Idempotency.earlier` would follow the turn
        the key's request left, and answer it with the other request's reply. An expired key is
        replaced, whatever it holds."""
        entry.created_at = entry.created_at or time.time()
        entry.owner = entry.owner or self.owner
        with self._tx() as tx:
            row = tx.execute(
                "SELECT * FROM http_idempotency WHERE scope=? AND key=?", (entry.scope, entry.key)
            ).fetchone()
            if row is not None and row["created_at"] < idempotency_cutoff():
                tx.execute("DELETE FROM http_idempotency WHERE scope=? AND key=?", (entry.scope, entry.key))
            elif row is not None:
                if row["state"] != "pending" or row["body_hash"] != entry.body_hash:
                    return http_idempotency(row)
                if self._unheld(row):
                    log.warning(
                        "Idempotency-Key %r: its earlier request here ended but its end could not be written "
                        "(the store refused it): this request takes it over",
                        entry.key,
                    )
                elif self._orphaned(row["owner"]):
                    log.warning(
                        "Idempotency-Key %r was claimed by a process that is gone (%s): this request takes it over",
                        entry.key,
                        row["owner"],
                    )
                else:
                    return http_idempotency(row)
                tx.execute("DELETE FROM http_idempotency WHERE scope=? AND key=?", (entry.scope, entry.key))
            tx.execute(
                "INSERT INTO http_idempotency(scope, key, body_hash, state, created_at, owner) VALUES (?,?,?,?,?,?)",
                (entry.scope, entry.key, entry.body_hash, "pending", entry.created_at, entry.owner),
            )
        if entry.owner == self.owner:
            self._claimed[(entry.scope, entry.key)] = entry.created_at
        return None

    async def release_orphaned_http_idempotency(self) -> int:
        """Released, not deleted: the key keeps its body's hash, so only a repeat of its request
        takes it over (`claim_http_idempotency`)."""
        with self._tx() as tx:
            rows = tx.execute(
                "SELECT scope, key, owner FROM http_idempotency WHERE state='pending' AND owner IS NOT NULL"
            ).fetchall()
            gone = [(r["scope"], r["key"]) for r in rows if self._orphaned(r["owner"])]
            tx.executemany("UPDATE http_idempotency SET owner=NULL WHERE scope=? AND key=? AND state='pending'", gone)
        return len(gone)

    async def get_http_idempotency(self, scope: str, key: str) -> HttpIdempotency | None:
        row = self._row(
            "SELECT * FROM http_idempotency WHERE scope=? AND key=? AND created_at >= ?",
            (scope, key, idempotency_cutoff()),
            "in the idempotency keys",
        )
        return http_idempotency(row) if row else None

    async def finish_http_idempotency(
        self, scope: str, key: str, status_code: int, content_type: str, body: str, conversation_id: str | None
    ) -> None:
        # The request ends here, written or not: refused, its key is left pending under this
        # process, unheld, for a repeat to take over (`_unheld`), never waited for.
        self._claimed.pop((scope, key), None)
        with self._tx() as tx:
            tx.execute(
                "UPDATE http_idempotency SET state='done', status_code=?, content_type=?, body=?, conversation_id=? "
                "WHERE scope=? AND key=?",
                (status_code, content_type, body, conversation_id, scope, key),
            )

    async def drop_http_idempotency(self, scope: str, key: str) -> None:
        self._claimed.pop((scope, key), None)  # as in finish_http_idempotency
        with self._tx() as tx:
            tx.execute("DELETE FROM http_idempotency WHERE scope=? AND key=?", (scope, key))

    async def note_http_idempotency(
        self, scope: str, key: str, content_type: str, body: str, conversation_id: str | None
    ) -> None:
        with self._tx() as tx:
            tx.execute(
                "UPDATE http_idempotency SET content_type=?, body=?, conversation_id=? "
                "WHERE scope=? AND key=? AND state='pending'",
                (content_type, body, conversation_id, scope, key),
            )

    async def answered_http_idempotency(self, conversation_id: str) -> list[HttpIdempotency]:
        rows = self._rows(
            "SELECT * FROM http_idempotency WHERE conversation_id=? AND (state='done' OR body IS NOT NULL)",
            (conversation_id,),
            "in the idempotency keys",
        )
        return [http_idempotency(r) for r in rows]

    async def purge_http_idempotency(self, older_than: float) -> int:
        with self._tx() as tx:
            return tx.execute("DELETE FROM http_idempotency WHERE created_at < ?", (older_than,)).rowcount

    async def add_history_point(self, point: HistoryPoint, *, wait: bool = True) -> None:
        """Through the group transaction (one per request in a transaction of its own was a fifth
        of the server's time at concurrency 64). A reply's point is waited for: the client's next
        request, after a kill -9 or on another server of a cluster, must find it (it is part of what
        the reply acknowledges). `wait=False` (the point a request's placement records, which
        serves only its own retry): queued, not waited for; `find_history_points` commits queued
        writes first, and a point lost to a crash only means that retry starts anew."""
        row = (
            point.agent_id,
            point.prefix_hash,
            point.conversation_id,
            point.last_message_id,
            point.created_at or time.time(),
            point.conversation_id,
        )

        def write(tx: sqlite3.Connection) -> None:
            # Only while the conversation exists: one deleted since (with its agent, from the CLI)
            # needs no point, and the insert would fail its foreign key. With its owner, which a
            # lookup's index holds (`history_points_read`).
            tx.execute(
                "INSERT OR REPLACE INTO history_points(agent_id, prefix_hash, conversation_id, last_message_id, "
                "created_at, namespace) SELECT ?,?,?,?,?, namespace FROM conversations WHERE id=?",
                row,
            )

        if wait:
            await self._writes.submit(write)
        else:
            self._writes.submit(write, defer=True)

    async def find_history_points(
        self, agent_id: str, prefix_hash: str, *, namespace: str | None = None, limit: int = 100
    ) -> list[HistoryPoint]:
        self._writes.settle()  # a point still queued is found too
        rows = self.db.execute(*history_points_read("?", agent_id, prefix_hash, namespace, limit)).fetchall()
        return [
            HistoryPoint(r["agent_id"], r["prefix_hash"], r["conversation_id"], r["last_message_id"], r["created_at"])
            for r in rows
        ]
