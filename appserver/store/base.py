"""The Store interface. SQLite implements it today; a PostgreSQL store can satisfy it later.

No SQLite-only semantics leak through: callers see records, not rows or connections.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from appserver.readiness import CheckResult, Readiness
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

# How long an idempotency key (a turn's: `idempotency_keys`; an HTTP request's: `http_idempotency`)
# names what its first use did (docs/openai.md, docs/protocol.md). An older key is no key, whether
# or not a purge removed it yet: no lookup, accept or claim matches it, and a new use of it takes
# its row over. The purges (`purge_idempotency`, `purge_http_idempotency`) are housekeeping only.
IDEMPOTENCY_TTL_S = 48 * 3600


def idempotency_cutoff(now: float | None = None) -> float:
    """Keys created before this time are expired."""
    return (time.time() if now is None else now) - IDEMPOTENCY_TTL_S


class StoreError(Exception):
    pass


class StoreValueRefused(StoreError):
    """The database cannot hold or look up a value of the request (PostgreSQL: a NUL character in
    text): the client's input, so HTTP says 400 `invalid_request_error` and the protocol `bad_frame`."""


class AgentMissing(StoreError):
    """A conversation could not be created: its agent is gone (deleted meanwhile, by another
    request or another server). The front ends answer as for any request whose agent was deleted
    while it ran."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id} no longer exists")
        self.agent_id = agent_id


class StoreUnavailable(StoreError):
    """The database ended the connection (a restart, a terminated backend, an outage) and the
    operation could not be completed. For a commit cut off mid-way, whether it took effect is
    unknown: a client retries with its idempotency key. HTTP says 503 `store_unavailable`."""


NOTHING_WRITTEN = "nothing of this request was written"


class WriteRefused(StoreUnavailable):
    """The store refused a write as a whole (SQLite: a full disk, the file size limit, the file
    locked by another process): known not written, unlike a commit cut off mid-way. Its message
    says "nothing of this request was written", true of a request's first write only: a later
    one (a turn's reply, after the accept saved its input) says what was saved (`cause`)."""

    @property
    def cause(self) -> str:
        """Why the write was refused and what to do, without the claim about the request."""
        return str(self).replace(f": {NOTHING_WRITTEN};", ";")


class StoreFileGone(StoreUnavailable):
    """The store's file was deleted or replaced while the server runs: a write now would go to a
    file no later start opens, so none is made (nor acknowledged) until an operator acts."""


class TurnSettledElsewhere(StoreError):
    """Another server of the cluster took the turn's conversation over and settled or runs the
    turn: what this server has of it must not be written (a second copy of the turn)."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(f"turn {turn_id} was taken over by another server of the cluster")
        self.turn_id = turn_id


class ConversationGone(StoreError):
    """A turn's rows have nowhere to go: its conversation (or the agent, and with it every
    conversation of the agent) was deleted while the turn ran."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id} was deleted while the turn ran")
        self.conversation_id = conversation_id


class OpenLimitReached(Exception):
    """A conversation already has as many open (queued or running) turns as the caller allows."""

    def __init__(self, open_turns: int) -> None:
        super().__init__(f"{open_turns} open turns")
        self.open_turns = open_turns


class DuplicateTurn(Exception):
    """An idempotency key was already accepted; `turn` is the earlier turn."""

    def __init__(self, turn: TurnRecord) -> None:
        super().__init__(f"idempotency key already accepted as turn {turn.id}")
        self.turn = turn


class Store(ABC):
    @abstractmethod
    async def open(self) -> None: ...
    @abstractmethod
    async def close(self) -> None: ...

    async def claim_server(self) -> None:
        """Before a server uses this store: make sure no other server does. A SQLite store is one
        home's file, which the home's `serve.lock` already gives to one server; a shared database
        needs its own claim (postgres.py)."""
        return None

    # readiness
    @abstractmethod
    async def check_writable(self, min_free_bytes: int = 0) -> str:
        """A real write, and room on the disk (`min_free_bytes`, 0 = unchecked): what was checked,
        or an exception saying why the store cannot take writes."""

    def note_failure(self, exc: BaseException) -> None:
        """An operation on this store failed where the caller could only log it (a request's 500, a
        turn failing inside the server): a store that can tell its file is damaged from the error
        says so and fails readiness from then on (sqlite.py). Nothing by default."""
        return None

    def register_readiness(self, readiness: Readiness, *, min_free_bytes: int = 0) -> None:
        """Add the store's own `/readyz` check, named `store`: `check_writable`."""

        async def check() -> CheckResult:
            return CheckResult("ok", await self.check_writable(min_free_bytes))

        readiness.register("store", check)

    # agents
    @abstractmethod
    async def create_agent(self, agent: AgentRecord) -> AgentRecord: ...
    @abstractmethod
    async def update_agent(self, agent: AgentRecord) -> AgentRecord: ...
    @abstractmethod
    async def delete_agent(self, agent_id: str) -> bool: ...
    @abstractmethod
    async def get_agent(self, agent_id: str) -> AgentRecord | None: ...
    @abstractmethod
    async def find_agents(self, ref: str) -> list[AgentRecord]: ...
    @abstractmethod
    async def list_agents(self) -> list[AgentRecord]: ...

    async def create_first_agent(self, agent: AgentRecord) -> bool:
        """Create `agent` if the store has no agent at all; True if it did. A store several
        processes share makes the check and the insert one step (servers starting together on a
        new database made one `assistant` each)."""
        if await self.list_agents():
            return False
        await self.create_agent(agent)
        return True

    async def agents_to_read(self) -> Sequence[AgentRecord]:
        """Every agent, in `list_agents` order, for a caller that only reads them and never
        changes them: a store with a cache hands out its own records rather than a copy of each (a
        request resolving its model copied every agent)."""
        return await self.list_agents()

    # conversations
    @abstractmethod
    async def create_conversation(
        self, conv: ConversationRecord, *, copy_messages: Iterable[int] | None = None
    ) -> ConversationRecord: ...
    @abstractmethod
    async def ensure_conversation(
        self,
        conv: ConversationRecord,
        *,
        copy_messages: Iterable[int] | None = None,
        messages: list[MessageRecord] | None = None,
    ) -> tuple[ConversationRecord, bool]:
        """`conv` created (with `copy_messages`, as `create_conversation`, then `messages` appended,
        all in one step: nobody sees it without them) unless a conversation
        it would clash with is there: one with its id, or, for a default (`is_default`), the
        agent's default. (the conversation, True) when this call created it; else (the one there,
        False), which may belong to another agent or namespace: the caller checks that before it
        uses it (adopting someone else's conversation would leak it). Atomic against every other
        caller, in this process or another server on the same database: requests that race to
        use a conversation "created when unknown" (an unseen `X-Conversation-Id`, an agent's or a
        credential's default) create it once and all find that one, where a look-up followed by
        `create_conversation` made each of them insert and all but one fail on the unique key."""

    @abstractmethod
    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None: ...
    @abstractmethod
    async def get_default_conversation(self, agent_id: str) -> ConversationRecord | None: ...
    @abstractmethod
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
        """Newest first (updated_at, then id). `agent_ids` (when given) and `namespace` (when
        given: only conversations owned by it) narrow the list in the query, so a credential that
        sees few of many conversations costs one indexed read, not a walk over every conversation.
        `after` (the updated_at and id of the last conversation of the page before) starts the page
        right after it: a seek, what the page costs wherever it is. `offset` skips index entries
        only (`conversation_page_ids`), still one per conversation skipped."""

    @abstractmethod
    async def update_conversation(self, conv: ConversationRecord) -> None: ...
    @abstractmethod
    async def discard_empty_conversation(self, conversation_id: str) -> bool:
        """Delete the conversation if it holds no turn and no message, in one step against every
        writer (an accept committing at once makes it not empty, never a turn deleted with it);
        True when it was deleted. For a conversation a submit made and no turn landed in."""

    # messages
    @abstractmethod
    async def list_messages(
        self, conversation_id: str, *, before_id: int | None = None, limit: int | None = None
    ) -> list[MessageRecord]: ...
    @abstractmethod
    async def history_page(
        self, conversation_id: str, *, before_id: int | None, limit: int, max_bytes: int
    ) -> tuple[list[MessageRecord], bool]:
        """The newest `limit` messages before `before_id` (oldest first) that fit in about
        `max_bytes` of stored text (at least one), and whether older ones remain: a client pages
        back through a conversation of any size without one reply holding all of it."""

    @abstractmethod
    async def append_messages(self, conversation_id: str, messages: list[MessageRecord]) -> None: ...

    # turns
    @abstractmethod
    async def accept_turn(self, turn: TurnRecord, idempotency_scope: str | None = None) -> TurnRecord:
        """Record an accepted input. Its key already names a turn in `scope`: DuplicateTurn, unless
        the key is expired (IDEMPOTENCY_TTL_S), which this turn then takes over in the same commit."""

    @abstractmethod
    async def lookup_idempotency(self, scope: str, key: str) -> TurnRecord | None:
        """The turn a key of `scope` names, unless the key is older than IDEMPOTENCY_TTL_S."""

    @abstractmethod
    async def forget_idempotency(self, scope: str, key: str, turn_id: str) -> None:
        """Drop the key of `scope` if it still names `turn_id` (a turn that is no answer: the
        request runs again, and its new turn takes the key, so a later repeat follows that one)."""

    @abstractmethod
    async def remember_idempotency(self, scope: str, key: str, turn_id: str, conversation_id: str) -> None:
        """File the key of `scope` under turn `turn_id`, which it did not start (a request that
        answered the turn's calls resumed it): a repeat after a crash follows that turn. Replaces
        whatever the key named."""

    @abstractmethod
    async def purge_idempotency(self, older_than: float) -> int: ...
    @abstractmethod
    async def mark_turn_running(self, turn_id: str, owner: str, revision: int) -> None: ...
    @abstractmethod
    async def save_draft(self, turn_id: str, draft: dict[str, Any]) -> None: ...
    @abstractmethod
    async def record_cancel(
        self, turn_id: str, cancel_ack: dict[str, Any], *, reason: str, draft: dict[str, Any] | None = None
    ) -> bool:
        """A cancel of an open turn, saved before it is acknowledged (`TurnRecord.cancel_ack`), in
        one transaction with its calls still pending answered `cancelled` (`reason`) and, when
        given, the turn's `draft` (its text then): a restart after a crash ends the turn
        cancelled. False when the turn is settled (or not accepted yet): nothing written."""

    @abstractmethod
    async def commit_turn(self, conversation_id: str, commit: TurnCommit) -> None: ...
    @abstractmethod
    async def checkpoint_turn(
        self,
        conversation_id: str,
        turn_id: str,
        messages: list[MessageRecord],
        *,
        iteration: int,
        usage: dict[str, int],
    ) -> None:
        """Store a running turn's messages so far (its input is then committed), in one transaction,
        before its server tools run; the turn stays running."""

    @abstractmethod
    async def get_turn(self, turn_id: str) -> TurnRecord | None: ...
    @abstractmethod
    async def list_turns(self, conversation_id: str, *, statuses: Iterable[str] | None = None) -> list[TurnRecord]: ...
    @abstractmethod
    async def open_turns(self, statuses: Iterable[str] = ("queued", "running", "awaiting")) -> list[TurnRecord]: ...

    # pending tool calls
    @abstractmethod
    async def list_pending(self, turn_id: str) -> list[PendingCall]: ...
    @abstractmethod
    async def get_pending(self, conversation_id: str, call_id: str) -> PendingCall | None: ...
    @abstractmethod
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
        `settings` (a request answering the call brings them): the options and client tools its
        paused turn's model calls get from now on, written over the turn's in the same
        transaction as the answer, when the answer is written."""

    @abstractmethod
    async def overdue_pending(self, now: float) -> list[PendingCall]: ...

    # OpenAI HTTP surface: stored responses, HTTP idempotency keys, history-prefix points
    @abstractmethod
    async def last_message_id(self, conversation_id: str) -> int: ...
    @abstractmethod
    async def last_message_ids(self, conversation_ids: Collection[str]) -> dict[str, int]:
        """`last_message_id` of each conversation (0: no message), in one read: the heads of a
        prefix match's candidates, not a round trip each."""

    @abstractmethod
    async def save_response(self, response: ResponseRecord) -> None: ...
    @abstractmethod
    async def get_response(self, response_id: str) -> ResponseRecord | None: ...
    @abstractmethod
    async def get_response_owner(self, response_id: str) -> ResponseOwner | None:
        """Whose response `response_id` is (its agent and conversation), without reading its body:
        what an ownership check reads before `get_response`, for the caller it allows only."""

    @abstractmethod
    async def delete_response(self, response_id: str) -> bool: ...
    @abstractmethod
    async def claim_http_idempotency(self, entry: HttpIdempotency) -> HttpIdempotency | None:
        """Insert a pending key; if the key exists already return the existing entry instead. A
        pending key nobody works on (its claimant gone, or released) is taken over, but only by a
        request with its body hash: another body gets the entry (the caller's 409). An expired key
        (IDEMPOTENCY_TTL_S) is no entry: the claim replaces it, whatever its state or body."""

    @abstractmethod
    async def get_http_idempotency(self, scope: str, key: str) -> HttpIdempotency | None: ...
    @abstractmethod
    async def finish_http_idempotency(
        self, scope: str, key: str, status_code: int, content_type: str, body: str, conversation_id: str | None
    ) -> None: ...
    @abstractmethod
    async def drop_http_idempotency(self, scope: str, key: str) -> None: ...
    @abstractmethod
    async def note_http_idempotency(
        self, scope: str, key: str, content_type: str, body: str, conversation_id: str | None
    ) -> None:
        """While the key is still pending: what its request already told its client (a stream's
        `response.created`), kept with the claim, which stays pending. Deleting that response finds
        it (`answered_http_idempotency`) even when the request never ends (its server killed)."""

    @abstractmethod
    async def answered_http_idempotency(self, conversation_id: str) -> list[HttpIdempotency]:
        """The keys whose stored answer went into `conversation_id`, done ones and pending ones
        with a noted start (`note_http_idempotency`): deleting a response finds the replays that
        would serve it again, and the repeats that would follow its turn."""

    @abstractmethod
    async def purge_http_idempotency(self, older_than: float) -> int: ...
    @abstractmethod
    async def release_orphaned_http_idempotency(self) -> int:
        """Release pending keys whose claiming process is gone (a server killed mid-request): owner
        NULL, so a retry runs the request (or follows its turn) instead of waiting for a reply that
        will never be stored. Not deleted: the key keeps its body's hash, and a request with another
        body is still refused (`claim_http_idempotency`)."""

    @abstractmethod
    async def add_history_point(self, point: HistoryPoint, *, wait: bool = True) -> None:
        """Record a point; committed on return unless `wait` is false (a point that serves only a
        retry of the request that placed it: the store may let it join a later group)."""

    @abstractmethod
    async def find_history_points(
        self, agent_id: str, prefix_hash: str, *, namespace: str | None = None, limit: int = 100
    ) -> list[HistoryPoint]:
        """Points with that hash of the agent's conversations that `namespace` owns (None: every
        namespace's, as admin and the local owner see them): the `limit` most recently recorded,
        most recently active conversation first (`history_points_read`)."""


def conversations_where(
    mark: str,
    agent_id: str | None,
    agent_ids: Collection[str] | None,
    namespace: str | None,
) -> tuple[str, list[Any]]:
    """The WHERE clause (empty, or starting with " WHERE") and its parameters for
    `list_conversations`; `mark` is the driver's placeholder ("?" or "%s"). One agent of a
    credential limited to some is an equality, which an index in the list's order serves; an IN of
    several reads each agent's range and sorts what they hold (the caller's own conversations,
    never the others': filtering an index in the list's order instead walked every conversation of
    the store before the page of an agent with few)."""
    clauses: list[str] = []
    params: list[Any] = []
    if agent_id is not None:
        clauses.append(f"agent_id = {mark}")
        params.append(agent_id)
    if agent_ids is not None:
        if not agent_ids:
            clauses.append("0 = 1")
        else:
            if len(agent_ids) == 1:
                clauses.append(f"agent_id = {mark}")
            else:
                clauses.append(f"agent_id IN ({', '.join([mark] * len(agent_ids))})")
            params.extend(sorted(agent_ids))
    if namespace is not None:
        clauses.append(f"namespace = {mark}")
        params.append(namespace)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def conversation_page_ids(
    mark: str,
    agent_id: str | None,
    agent_ids: Collection[str] | None,
    namespace: str | None,
    *,
    limit: int | None,
    offset: int,
    after: tuple[float, str] | None,
    key: str = "id",
) -> tuple[str, list[Any]]:
    """The query for the keys (column `key`: id, or SQLite's rowid) of a `list_conversations`
    page, and its parameters. It reads keys only, off an index in the list's whole order that
    holds the columns it filters by (conversations_namespace_recent and the others of the
    schema): the conversations skipped to reach the page (`offset`) cost an index entry each, and
    their rows (up to 17 KB: title and metadata) are never read. `SELECT *` with an OFFSET read
    every one of them, and sorted them when the index lacked id. `after` is a seek: `updated_at
    <= u` is the index range, the rest sorts out the few of that same time."""
    where, params = conversations_where(mark, agent_id, agent_ids, namespace)
    if after is not None:
        where += (" AND " if where else " WHERE ") + f"updated_at <= {mark} AND (updated_at < {mark} OR id > {mark})"
        params.extend([after[0], after[0], after[1]])
    query = f"SELECT {key} FROM conversations{where} ORDER BY updated_at DESC, id LIMIT {mark} OFFSET {mark}"
    return query, [*params, limit, offset]


# Run as an agent is deleted. Stored responses have no foreign key to their conversation: without
# this, a deleted agent's responses (bodies and inputs, the user's text) stayed on disk, unreachable
# through the API. Orphans an older version left go with the next deletion of any agent.
DELETE_ORPHAN_RESPONSES = "DELETE FROM responses WHERE agent_id NOT IN (SELECT id FROM agents)"


def history_points_read(
    mark: str, agent_id: str, prefix_hash: str, namespace: str | None, limit: int
) -> tuple[str, list[Any]]:
    """`find_history_points`' query and its parameters (`mark`: the driver's placeholder). Many
    conversations reach one history (every request of a client that opens with the same few
    messages forks another), and the points table only grows with them: the newest `limit`
    points come off an index on (agent, hash[, owner], time), so a lookup never walks the points
    of the other conversations, the caller's or another credential's. The join checks the
    conversation's agent and owner again (`ConversationMatcher.visible`).

    A point without an owner (namespace NULL: one an older server wrote after the upgrade's
    migration filled the column in, during a rolling upgrade) is its conversation's: read in a
    second indexed branch, (agent, hash, NULL, time), that checks its conversation's owner. Such
    points are only ever written by an older server: with none, that branch is one index probe."""
    if namespace is None:
        query = (
            "SELECT p.agent_id, p.prefix_hash, p.conversation_id, p.last_message_id, p.created_at FROM ("
            f"SELECT * FROM history_points WHERE agent_id = {mark} AND prefix_hash = {mark} "
            f"ORDER BY created_at DESC LIMIT {mark}) p JOIN conversations c ON c.id = p.conversation_id "
            f"WHERE c.agent_id = {mark} ORDER BY c.updated_at DESC, p.created_at DESC"
        )
        return query, [agent_id, prefix_hash, limit, agent_id]
    columns = "h.agent_id, h.prefix_hash, h.conversation_id, h.last_message_id, h.created_at"
    query = (
        "SELECT p.agent_id, p.prefix_hash, p.conversation_id, p.last_message_id, p.created_at FROM ("
        f"SELECT * FROM (SELECT {columns} FROM history_points h WHERE h.agent_id = {mark} "
        f"AND h.prefix_hash = {mark} AND h.namespace = {mark} ORDER BY h.created_at DESC LIMIT {mark}) owned "
        f"UNION ALL SELECT * FROM (SELECT {columns} FROM history_points h JOIN conversations o "
        f"ON o.id = h.conversation_id WHERE h.agent_id = {mark} AND h.prefix_hash = {mark} "
        f"AND h.namespace IS NULL AND o.namespace = {mark} ORDER BY h.created_at DESC LIMIT {mark}) unowned "
        f"ORDER BY created_at DESC LIMIT {mark}) p JOIN conversations c ON c.id = p.conversation_id "
        f"WHERE c.agent_id = {mark} AND c.namespace = {mark} ORDER BY c.updated_at DESC, p.created_at DESC"
    )
    branch = [agent_id, prefix_hash, namespace, limit]
    return query, [*branch, *branch, limit, agent_id, namespace]
