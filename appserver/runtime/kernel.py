"""The kernel call every front end ends in: submit input to a conversation of an agent.

`Kernel` owns the per-conversation runtimes (created on demand, evicted when idle), settles turns
left running by a dead process, and answers pending calls, cancels and snapshot lookups.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from appserver.agent.loop import AgentLoop
from appserver.agent.tools import reap_orphaned_tools
from appserver.config import Config
from appserver.errors import AgentGone, Conflict, InvalidInput, NotAwaiting, NotFound, Unavailable
from appserver.ids import new_id
from appserver.procid import identity, identity_alive
from appserver.providers.base import ToolSpec
from appserver.runtime.cluster import ClusterLink, OwnedElsewhere, decisions_args
from appserver.runtime.conversation import ConversationRuntime
from appserver.runtime.deps import RuntimeDeps
from appserver.runtime.finish import finish_turn
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.restore import controller_from_store, restart_revision
from appserver.runtime.settle import (
    INPUT_SYSTEM_ROLES,
    LEFT_UNSEEN,
    TurnEnd,
    acked_unseen,
    answered_result,
    call_result,
    cancelled_results,
    close_unanswered,
    input_messages,
    server_stopped,
    withdrawn,
)
from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.runtime.types import TERMINAL_STATUSES
from appserver.runtime.watch import Watch
from appserver.shown import shown
from appserver.store.base import IDEMPOTENCY_TTL_S as IDEMPOTENCY_TTL_S  # the store's: an expired key never matches
from appserver.store.base import (
    AgentMissing,
    ConversationGone,
    DuplicateTurn,
    Store,
    StoreUnavailable,
    TurnSettledElsewhere,
)
from appserver.store.cluster import Cluster
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    MessageRecord,
    PendingCall,
    TurnCommit,
    TurnRecord,
    TurnSettings,
    TurnStatus,
)

NAMESPACE_DEFAULT_NAME = "conv_default"
NAMESPACE_DEFAULT_PREFIX = NAMESPACE_DEFAULT_NAME + "~"  # a namespace's own default conversation (default_conversation)
NAMESPACE_TAG_LEN = 24  # hex digits of the tag after the '~' of a namespace's conversation id


@contextmanager
def agent_missing_is_gone(agent: AgentRecord) -> Iterator[None]:
    """A conversation of `agent` could not be created because the agent was deleted meanwhile (by
    another request or server): said as the agent gone, as every front end words it."""
    try:
        yield
    except AgentMissing:
        raise AgentGone(f"agent {agent.name!r} was deleted while the request ran", param="agent") from None


def namespace_tag(namespace: str, agent_id: str | None = None) -> str:
    """The stable tag of a namespace's conversation names (a digest of the namespace), or with
    `agent_id` of one agent's (a digest of both: a namespace's own default of that agent)."""
    key = namespace if agent_id is None else f"{agent_id}\n{namespace}"
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:NAMESPACE_TAG_LEN]


def namespaced_id(name: str, namespace: str, agent_id: str | None = None) -> str:
    """The id of a namespace's conversation `name`: `name~<tag>`. A namespace's own default of an
    agent is `conv_default~<tag of both>`; an `X-Conversation-Id` name a namespaced credential
    chooses is `<name>~<tag>` (conversation_match.by_header). Client-chosen ids have no '~', so
    nobody creates another namespace's ids ahead of it, and two namespaces' equal names are two
    conversations."""
    return f"{name}~{namespace_tag(namespace, agent_id)}"


log = logging.getLogger("appserver.kernel")

# How often a running server removes expired idempotency keys (both tables): their rows only.
IDEMPOTENCY_PURGE_EVERY_S = 3600.0
# A `SubmitRequest.options` entry: whose open-turn place (the WebSocket's `[limits]
# open_turns_per_client`) the turn holds. Stored with the turn (never shown, never sent to a model),
# so that a server taking it up later (a restart, a cluster server taking over a dead one's) counts
# it against that credential again (`Kernel.count_open_turns`).
COUNTED_FOR = "counted_for"
# Stored beside it by `submit`: the server (its owner id) whose endpoint counts the turn from its
# accept on. Another server taking the turn up counts it only once that one is gone.
COUNTED_AT = "counted_at"
DELETED_AGENT_CHECK_S = 1.0  # how soon turns held here end after another process deleted their agent

SettledListener = Callable[[TurnRecord, TurnSnapshot], None]
# The open-turn count (`Kernel.count_open_turns`): count a turn for a credential, watching its
# handle until it ends (a second call for one turn watches the newer handle, counted once);
# let a turn's place go (the turn moved to another server).
CountOpen = Callable[[str, TurnHandle], None]
LetGo = Callable[[str], None]
# A hold-back check (`Kernel.hold_back_queued`): of the queued turns this server takes up from the
# store, the ones that must not run, each with why (turn id -> why).
HoldBack = Callable[[Sequence[TurnRecord]], Awaitable[Mapping[str, str]]]
UNCOUNTED_PRUNE_AT = 64  # turns noted before a count was registered: ended ones are dropped from here on


def interrupted_text(name: str) -> str:
    """The result of a call whose server died before it returned: it may have run, or not."""
    return (
        f"The server stopped while the call to {name} was in progress: "
        "it was interrupted and its outcome is unknown (it may or may not have taken effect)."
    )


def delivered_results(
    assistant: MessageRecord, turn_id: str, answered: set[str | None], pending: dict[str, PendingCall], config: Config
) -> list[MessageRecord]:
    """The results of `assistant`'s calls answered before its turn resumed and its server died
    (`pending`: the turn's pending calls by id), for those not in `answered` (which it extends):
    a client's result, a denial, an expiry. Each was stored before it was acknowledged, and none
    ran here: what they say is known, never "outcome unknown" (an approved call may have run)."""
    out: list[MessageRecord] = []
    for c in assistant.tool_calls if assistant.role == "assistant" else ():
        p = pending.get(c["id"])
        if c["id"] in answered or p is None or p.status not in ("result", "denied", "expired"):
            continue
        answered.add(c["id"])
        text, is_error = answered_result(p, config)
        out.append(call_result(assistant, turn_id, c, text, is_error=is_error))
    return out


# How a turn ended that answered nothing, whose input a keyed retry may re-run (`Kernel._rerun`).
RERUNNABLE = ("cancelled", "failed", "interrupted")
# How long a keyed repeat's re-run waits for the earlier turn to leave its runtime (`Kernel._rerunnable`).
RERUN_SETTLE_S = 5.0


@dataclass(slots=True)
class SubmitRequest:
    agent: str  # agent id or name
    input: str | list[dict[str, Any]]
    conversation: str = "default"  # default | new | <id>
    # System/developer messages sent with the input ([{"role": "system" | "developer", "text": …}],
    # a Responses request's): kept in the conversation before the user message (settle.input_messages).
    system: list[dict[str, str]] = field(default_factory=list)
    source: dict[str, Any] | None = None
    idempotency_key: str | None = None
    # Where the key is unique: the conversation (or `new:<agent>`) unless the caller names a scope
    # of its own (the OpenAI routes: one per credential, whichever conversation the request lands in).
    idempotency_scope: str | None = None
    client_tools: list[ToolSpec] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # instructions, sampling overrides, timeouts
    conversation_fields: dict[str, Any] = field(default_factory=dict)  # user, namespace, metadata for new ones
    # The agent `agent` names, when the caller has just read it (spares a second lookup).
    resolved: AgentRecord | None = None
    # The caller acknowledges nothing before the turn settles: its accept may commit while the
    # model call is in flight (TurnQueue.enqueue `overlap`).
    overlap_accept: bool = False
    # A turn that ran this same input and ended without an answer (a keyed HTTP repeat of a request
    # whose turn a stop, a crash, a failure or a cancel ended): when the input lands right after it
    # in its conversation, the new turn re-runs that turn's input instead of adding it again
    # (`Kernel._rerun`).
    rerun_of: str | None = None
    # Only as that re-run (a keyed repeat of tool results whose resumed turn answered nothing:
    # http/common.py `rerun_answers`): NotAwaiting when it cannot be, never a new turn of the input.
    rerun_only: bool = False


@dataclass(slots=True)
class Submission:
    turn_id: str
    conversation_id: str
    agent_id: str
    queue_position: int
    duplicate: bool
    handle: TurnHandle

    async def wait(self, timeout: float | None = None) -> TurnSnapshot:
        """The snapshot once the turn is terminal or paused for an answer."""
        return await self.handle.wait_settled(timeout)


# Inputs answered only by the reply to the HTTP request that sent them (no background jobs): a
# queued one whose process died has nobody to answer, and its client retries.
REQUEST_BOUND_SOURCES = frozenset({"openai_chat", "openai_responses"})


def awaited_by_a_request(turn: TurnRecord) -> bool:
    return isinstance(turn.source, dict) and turn.source.get("kind") in REQUEST_BOUND_SOURCES


class Kernel:
    def __init__(self, config: Config, store: Store, agent_loop: AgentLoop) -> None:
        self.config = config
        self.store = store
        self.agent_loop = agent_loop
        self.owner = identity()
        self._deps = RuntimeDeps(store, config, agent_loop, self.owner, self._turn_settled)
        self.runtimes: dict[str, ConversationRuntime] = {}
        self._settled_listeners: list[SettledListener] = []
        # called once this server learns it was judged gone (`_taken_over`): the WebSocket hub
        # tells its clients, whose subscriptions here would otherwise hear nothing more
        self._gone_listeners: list[Callable[[], None]] = []
        self._loading: dict[str, asyncio.Future[ConversationRuntime]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        # Several servers on one database (a PostgreSQL store that joined its cluster at start).
        self._link: ClusterLink | None = None
        self._cancelling: set[asyncio.Future[Any]] = set()
        # When the next trim scan may run (see _trim_idle): runtimes loaded, or a monotonic time.
        self._trim_after_count = 0
        self._trim_after_time = 0.0
        # The open-turn count (`count_open_turns`), and what it is told of: taken up before it was
        # registered (turn id -> credential, handle); held here but counted by the live server that
        # accepted them (turn id -> credential, that server, handle); counted here while no live
        # server holds them (turn id -> conversation id). Each holds open turns only.
        self._counter: tuple[CountOpen, LetGo] | None = None
        self._uncounted: dict[str, tuple[str, TurnHandle]] = {}
        self._uncounted_prune_at = UNCOUNTED_PRUNE_AT
        self._counted_elsewhere: dict[str, tuple[str, str, TurnHandle]] = {}
        self._counted_unheld: dict[str, str] = {}
        self._hold_backs: list[HoldBack] = []  # `hold_back_queued`: registered at wiring

    # ------------------------------------------------------------ start / stop

    @property
    def runs_turns(self) -> bool:
        """May this process run, settle or answer turns? On a store several processes share (a
        PostgreSQL database: a cluster), only a server that joined its cluster may: a CLI command
        or any other process that did not has no lease and cannot tell which servers are alive,
        so it never touches a turn (docs/scale-out.md)."""
        return self._link is not None or not getattr(self.store, "shared", False)

    async def start(self, *, serve: bool = False) -> None:
        """Settle turns of dead processes; in a server, resume queued turns and watch deadlines.

        On a shared store (PostgreSQL) a process that did not join the cluster (`serve` joins it,
        `PostgresStore.claim_server`; a CLI command does not) settles, requeues and releases
        nothing: the turns there are the servers', and only a server of the cluster judges
        whether another is gone and takes its work over."""
        cluster: Cluster | None = getattr(self.store, "cluster", None)
        if cluster is None and getattr(self.store, "shared", False):
            return  # not a member: reads and admin writes only (see runs_turns)
        if cluster is not None:
            # A server of a cluster: its turns are stamped with its instance id, and what other
            # servers hold is theirs (docs/scale-out.md).
            self.owner = cluster.instance_id
            accept = getattr(self.store, "accept_in_cluster", None)
            self._deps = RuntimeDeps(
                self.store,
                self.config,
                self.agent_loop,
                self.owner,
                self._turn_settled,
                cluster_accept=accept,
                cut_off=self._cut_off,
            )
            self._link = ClusterLink(self, cluster)
            cluster.on_lost = self._taken_over
        reaped = reap_orphaned_tools(self.config.home, self.owner)
        if reaped:
            log.warning("killed %d tool process(es) left running by a server of this home that died", reaped)
        if self._link is not None:
            await self._link.sweep_once()  # takes what gone servers left: settled, requeued
        else:
            await self.settle_crashed(requeue=serve)
        await self.purge_expired_keys()
        released = await self.store.release_orphaned_http_idempotency()
        if released:
            log.warning(
                "released %d Idempotency-Key(s) of requests a stopped server never finished; a retry runs them",
                released,
            )
        if serve:
            for turn in await self.store.open_turns(["awaiting"]):
                try:
                    await self.runtime(turn.conversation_id)  # loading it counts it (`_took_up`)
                except OwnedElsewhere:
                    pass  # paused in a runtime another server holds
            if self._link is not None:
                await self._count_unheld()
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            if self._link is not None:
                self._link.start()

    def hold_back_queued(self, check: HoldBack) -> None:
        """Register a check of the queued turns this server takes up from the store (at its start,
        or from a gone server of its cluster), asked before any of them is queued again: a turn it
        names ends cancelled, never started (a cron run whose task was removed or disabled while no
        server ran, which its queue would otherwise begin at once). Given by the services at
        wiring, before `start`: the kernel knows no service."""
        self._hold_backs.append(check)

    # ------------------------------------------------------------ the open-turn count

    def count_open_turns(self, count: CountOpen, let_go: LetGo) -> None:
        """Register the open-turn count (the WebSocket endpoint's `[limits] open_turns_per_client`).
        It is told of each open turn holding a place (`COUNTED_FOR`) that this server takes up
        (queued again, adopted paused: at its start, a catch-up, a take-over) or finds open at its
        start in no live server's hands, unless the server that accepted it counts it (this one, or
        another that lives): `count(credential, handle)`; and of each such turn that moves to
        another server: `let_go(turn id)`. What was taken up before is handed over now."""
        self._counter = (count, let_go)
        found, self._uncounted = self._uncounted, {}
        for cap_key, handle in found.values():
            if handle.controller.status not in TERMINAL_STATUSES:
                count(cap_key, handle)

    def _count(self, cap_key: str, handle: TurnHandle) -> None:
        if self._counter is not None:
            self._counter[0](cap_key, handle)
            return
        # Kept for the count to come; bounded by the turns still open (ended ones are dropped
        # whenever the notes have doubled since the last look).
        self._uncounted[handle.turn_id] = (cap_key, handle)
        if len(self._uncounted) >= self._uncounted_prune_at:
            self._uncounted = {
                t: e for t, e in self._uncounted.items() if e[1].controller.status not in TERMINAL_STATUSES
            }
            self._uncounted_prune_at = max(UNCOUNTED_PRUNE_AT, 2 * len(self._uncounted))

    def _let_go(self, turn_id: str) -> None:
        """The turn moved to another server: this one counts it no more (that one does)."""
        self._counted_elsewhere.pop(turn_id, None)
        self._counted_unheld.pop(turn_id, None)
        if self._counter is not None:
            self._counter[1](turn_id)
        else:
            self._uncounted.pop(turn_id, None)

    async def _took_up(self, turn: TurnRecord, handle: TurnHandle | None) -> None:
        """A turn this server took up open (queued again, adopted paused) holding a place: counted
        against its credential, on this handle, unless the server that accepted it counts it: this
        one (its own submit, counted since), or another that lives (`review_counts` looks again)."""
        cap_key = turn.options.get(COUNTED_FOR)
        if not isinstance(cap_key, str) or not cap_key or handle is None:
            return
        at = turn.options.get(COUNTED_AT)
        if at == self.owner:
            return
        if self._counted_unheld.pop(turn.id, None) is None and self._link is not None:
            if isinstance(at, str) and at and await self._alive_or_unknown(at):
                self._counted_elsewhere[turn.id] = (cap_key, at, handle)
                return
        self._counted_elsewhere.pop(turn.id, None)
        self._count(cap_key, handle)  # (counted already when found unheld: it watches this handle now)

    async def _alive_or_unknown(self, owner: str) -> bool:
        """`_counting`, or True when the store cannot say now: the turn is counted here once a
        later sweep finds that server gone (`review_counts`)."""
        try:
            return await self._counting(owner)
        except Exception as exc:
            log.warning("could not tell whether server %s lives (asked again at the next sweep): %r", owner, exc)
            return True

    async def _counting(self, server: str) -> bool:
        """Does the cluster server `server` live to count (or hold) a turn? Judged strictly: a
        killed server, whose database session ended, is gone at once, though its heartbeat (and
        its leases) outlive it for a few seconds."""
        if server == self.owner:
            return True
        assert self._link is not None
        return await self._link.cluster.owner_alive(server, strict=True)

    async def _count_unheld(self) -> None:
        """At a start in a cluster: count the open turns holding a place that no live server holds
        or counts. A server killed just before keeps its leases (and looks alive by its heartbeat)
        for a few seconds, so neither the sweep nor this start could take its turns up yet, and no
        sweep ever takes up a paused turn; each counts here until it ends, this server takes it up
        (`_took_up`), or another live server does (`review_counts`)."""
        link = self._link
        assert link is not None
        found = [
            t
            for t in await self.store.open_turns(["queued", "running", "awaiting"])
            if isinstance(t.options.get(COUNTED_FOR), str) and not self.holds(t.conversation_id)
        ]
        if not found:
            return
        holders = await link.cluster.holders(sorted({t.conversation_id for t in found}))
        alive: dict[str, bool] = {}
        for turn in found:
            at = turn.options.get(COUNTED_AT)
            holder = holders.get(turn.conversation_id)
            live = False
            for server in (at, holder):
                if isinstance(server, str) and server and server != self.owner:
                    if server not in alive:
                        alive[server] = await self._counting(server)
                    live = live or alive[server]
            if live:
                continue  # counted by the server that accepted it, or by the one that holds it
            controller = TurnController(turn.id, turn.conversation_id, turn.agent_id)
            self._counted_unheld[turn.id] = turn.conversation_id
            self._count(str(turn.options[COUNTED_FOR]), TurnHandle(turn.id, turn.conversation_id, controller))

    async def review_counts(self) -> None:
        """Each cluster sweep: a turn held here that a live server counted is counted here once
        that server is gone; one counted here while no live server held it is let go once another
        live server holds its conversation (which counts it). Ended ones are forgotten."""
        link = self._link
        if link is None:
            return
        elsewhere = self._counted_elsewhere
        for turn_id, (_, _, handle) in list(elsewhere.items()):
            if handle.controller.status in TERMINAL_STATUSES:
                del elsewhere[turn_id]
        alive: dict[str, bool] = {}
        for turn_id, (cap_key, at, handle) in list(elsewhere.items()):
            if at not in alive:
                alive[at] = await self._counting(at)
            if not alive[at] and elsewhere.pop(turn_id, None) is not None:
                self._count(cap_key, handle)
        unheld = self._counted_unheld
        if not unheld:
            return
        holders = await link.cluster.holders(sorted(set(unheld.values())))
        for turn_id, conversation_id in list(unheld.items()):
            holder = holders.get(conversation_id)
            if holder is None or holder == self.owner:
                continue
            if holder not in alive:
                alive[holder] = await self._counting(holder)
            if alive[holder] and unheld.get(turn_id) == conversation_id:
                self._let_go(turn_id)

    @property
    def stopping(self) -> bool:
        """True once `stop` began: readiness fails so a balancer sends no new work."""
        return self._stopping

    async def stop(self) -> None:
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._link is not None:
            self._link.stop()
        await asyncio.gather(*(rt.shutdown() for rt in list(self.runtimes.values())), return_exceptions=True)

    async def _sweep(self) -> None:
        """Evict idle runtimes; expire approvals of conversations not in memory; each second, end
        the turns of conversations whose agent another process deleted; each hour, remove expired
        idempotency keys."""
        interval = max(0.5, min(self.config.limits.idle_evict_s / 2, 30.0))
        next_full = time.monotonic() + interval
        next_purge = time.monotonic() + IDEMPOTENCY_PURGE_EVERY_S  # the start purged
        while True:
            await asyncio.sleep(min(DELETED_AGENT_CHECK_S, interval))
            try:
                await self.end_deleted_agents_turns()
            except StoreUnavailable as exc:  # the database is away: one line a try, no traceback
                log.warning("the check for deleted agents skipped: %s", exc)
            except Exception:
                log.exception("the check for deleted agents failed")
            if time.monotonic() < next_full:
                continue
            next_full = time.monotonic() + interval
            try:
                self.evict_idle()
                for p in await self.store.overdue_pending(time.time()):
                    try:
                        rt = await self.runtime(p.conversation_id)
                    except OwnedElsewhere:
                        continue  # its holder expires it
                    await rt.expire_overdue()
            except StoreUnavailable as exc:
                log.warning("runtime sweep skipped: %s", exc)
            except Exception:
                log.exception("runtime sweep failed")
            if time.monotonic() >= next_purge:
                next_purge = time.monotonic() + IDEMPOTENCY_PURGE_EVERY_S
                try:
                    await self.purge_expired_keys()
                except StoreUnavailable as exc:
                    log.warning("the purge of expired idempotency keys skipped: %s", exc)
                except Exception:
                    log.exception("the purge of expired idempotency keys failed")

    async def purge_expired_keys(self) -> None:
        """Housekeeping: remove the rows of expired idempotency keys (turns' and HTTP requests').
        No key older than IDEMPOTENCY_TTL_S matches, removed or not (store/base.py): this only
        keeps the tables from growing on a server that runs for weeks."""
        older_than = time.time() - IDEMPOTENCY_TTL_S
        await self.store.purge_idempotency(older_than)
        await self.store.purge_http_idempotency(older_than)

    async def end_deleted_agents_turns(self) -> int:
        """`appserver agents delete` runs in a process of its own and deletes the agent's
        conversations and turns in the store; the turns held here (running, paused for an answer,
        queued) would otherwise never end. Each runtime with turns whose agent is gone ends them
        (failed, nothing written). With no turn held here it costs nothing; else one look at the
        agents (cached in SQLite's store)."""
        holding = [rt for rt in self.runtimes.values() if rt.holds_turns]
        if not holding:
            return 0
        agents = {a.id for a in await self.store.agents_to_read()}
        ended = 0
        for rt in holding:
            if rt.agent_id in agents or self.runtimes.get(rt.conversation_id) is not rt:
                continue
            if rt.end_deleted(f"its agent {rt.agent_id} was deleted"):
                log.warning("conversation %s: its agent %s was deleted; its turns end", rt.conversation_id, rt.agent_id)
                ended += 1
        return ended

    def evict_idle(self, older_than_s: float | None = None) -> int:
        limit = self.config.limits.idle_evict_s if older_than_s is None else older_than_s
        now = time.monotonic()
        gone = [cid for cid, rt in self.runtimes.items() if rt.idle and now - rt.last_active >= limit]
        for cid in gone:
            self._drop(cid)
        return len(gone)

    def _drop(self, conversation_id: str) -> None:
        """Unload an idle runtime; in a cluster, let go of its lease so any server may take it."""
        del self.runtimes[conversation_id]
        if self._link is not None:
            self._link.cluster.release(conversation_id)

    async def owner_alive(self, owner: str | None, *, strict: bool = False) -> bool:
        """Does the server stamped `owner` (on a turn) still run: a process of this host, or in a
        cluster a live instance (`strict`: one whose database session is up right now)."""
        if owner == self.owner:
            return True
        if self._link is not None and owner and owner.startswith("inst_"):
            return await self._link.cluster.owner_alive(owner, strict=strict)
        return identity_alive(owner)

    def live_handles(self, conversation_id: str) -> list[TurnHandle]:
        """The turns the conversation's runtime here still shows (none when it is not here)."""
        rt = self.runtimes.get(conversation_id)
        return list(rt.handles.values()) if rt is not None else []

    def active_turn(self, conversation_id: str) -> str | None:
        """The turn the conversation's runtime here runs or holds paused (None when none, or when
        the conversation is not held here)."""
        rt = self.runtimes.get(conversation_id)
        return rt.lifecycle.turn_id if rt is not None else None

    def holds(self, conversation_id: str) -> bool:
        """This server runs the conversation (its runtime is loaded here)."""
        return conversation_id in self.runtimes

    def _trim_idle(self, keep_id: str) -> None:
        """Drop the least recently used idle runtimes (never `keep_id`, just loaded for a caller),
        down to 90 % of `idle_runtimes_max`.

        Every runtime kept is a few dozen objects that each full garbage collection walks: at
        hundreds of new conversations a second, `idle_evict_s` alone kept enough of them to make
        collections pause the loop for 100 ms and more. Trimming to 90 % makes the scan rare. A
        caller that holds a runtime across an await re-checks that it is still the loaded one
        (`submit`), as the style says of leases.

        Busy runtimes stay (a thousand streams at once are a thousand busy runtimes): after a
        scan, the next waits for a tenth of the limit more runtimes or a second, or every new
        conversation would scan them all again and find nothing to drop."""
        limit = self.config.limits.idle_runtimes_max
        keep = limit * 9 // 10
        excess = len(self.runtimes) - keep
        gone = []
        for cid, rt in self.runtimes.items():
            if excess <= 0:
                break
            if rt.idle and cid != keep_id:
                gone.append(cid)
                excess -= 1
        for cid in gone:
            self._drop(cid)
        self._trim_after_count = len(self.runtimes) + max(1, limit // 10)
        self._trim_after_time = time.monotonic() + 1.0

    async def settle_crashed(self, *, requeue: bool) -> int:
        """Close turns left `running` by a process that died (kill -9, power loss) as interrupted,
        or cancelled when a cancel of one was acknowledged (`_settle_left`); queue the queued ones
        again (`requeue`: a server's start), a cancelled one to end so as the worker begins it."""
        settled = 0
        turns = await self.store.open_turns(["running", "queued"])
        held = await self._held_back(turns) if requeue else {}
        for turn in turns:
            if turn.owner and turn.owner != self.owner and identity_alive(turn.owner):
                continue  # another live process runs it
            if turn.status == "queued":
                if requeue and awaited_by_a_request(turn):
                    await self._settle_withdrawn(turn)
                elif requeue and turn.id in held:
                    await self._settle_held_back(turn, held[turn.id])
                elif requeue:
                    rt = await self.runtime(turn.conversation_id)
                    if rt.queue.requeue(turn):
                        await self._took_up(turn, rt.handles.get(turn.id))
                continue
            await self._settle_left(turn)
            settled += 1
        return settled

    async def catch_up(self, conversation_id: str) -> None:
        """Run what the store holds for a conversation and its runtime here does not: turns
        another server of the cluster accepted for it, or left when it died. Loads (takes) the
        conversation; raises OwnedElsewhere when another live server holds it."""
        rt = self.runtimes.get(conversation_id)
        if rt is None:
            await self.runtime(conversation_id)  # loading takes over (`_take_over`)
            return
        await self._take_over(rt)

    async def _take_over(self, rt: ConversationRuntime) -> None:
        """Settle the conversation's turns left running by a server that is gone (as a restart
        does) and queue the ones accepted but not queued here, in the order they were accepted."""
        link = self._link
        assert link is not None
        await link.taken(rt.conversation_id)
        await link.read_unsaved(rt.conversation_id)  # their ends first, in the conversation's order
        turns = await self.store.list_turns(rt.conversation_id, statuses=("running", "queued"))
        held = await self._held_back([t for t in turns if not rt.queue.knows(t.id)])
        for turn in turns:
            # asked now, not before the read: an input this server accepts meanwhile is its own
            # (running, if accepted into an idle conversation), and its queue is about to hold it
            if rt.queue.knows(turn.id):
                continue
            if turn.status == "running":
                if turn.owner != self.owner and await link.cluster.owner_alive(turn.owner):
                    log.warning(
                        "turn %s runs on live instance %s, which no longer holds its conversation", turn.id, turn.owner
                    )
                    continue
                await self._settle_left(turn)
            elif turn.id in held:
                await self._settle_held_back(turn, held[turn.id])
            elif not rt.queue.closed and self.runtimes.get(rt.conversation_id, rt) is rt:
                # (an HTTP input too: its client's retry, sent to this server before the dead
                # one was judged gone, may already follow it by its Idempotency-Key)
                if rt.queue.requeue(turn):
                    await self._took_up(turn, rt.handles.get(turn.id))

    async def _settle_unheld(
        self, turn: TurnRecord, end: TurnEnd, shown: list[MessageRecord] | None = None, revision: int | None = None
    ) -> bool:
        """End a turn no runtime holds through `finish_turn`, like every turn: a controller of its
        own, holding `shown` (the turn's messages, kept and new), publishes the settled snapshot at
        `revision` (default: the stored one + 1), the one `end` stores; a commit that fails here
        fails the start (or the take-over). False when the turn had ended elsewhere meanwhile (a
        server judged gone committed its end after this one read it open): the stored end is
        published instead (`finish_turn`), and the take-over goes on with the next turn."""
        published = revision if revision is not None else turn.revision + 1
        controller = TurnController(turn.id, turn.conversation_id, turn.agent_id, revision=published - 1)
        if shown:
            controller.load_messages(shown)
        finished = await finish_turn(self.store, self._turn_settled, turn, controller, end, cut_off=self._deps.cut_off)
        if finished.elsewhere:
            return False
        if finished.commit_error is not None:
            raise finished.commit_error
        return True

    async def _settle_withdrawn(self, turn: TurnRecord) -> None:
        """Drop a queued input whose only answer was the reply to the HTTP request that sent it:
        that connection died with the process, and the client's retry must not find it run as well
        (as when a client leaves before its input starts; DESIGN §13)."""
        # A restart revision (restore.py): a dead process showed its queue positions, never stored.
        revision = restart_revision(turn)
        if not await self._settle_unheld(
            turn,
            withdrawn(turn.id, revision, "its HTTP request was cut off by a stop before it started"),
            revision=revision,
        ):
            return
        log.warning(
            "dropped queued turn %s of conversation %s: its HTTP request ended with the process",
            turn.id,
            turn.conversation_id,
        )

    async def _held_back(self, turns: Sequence[TurnRecord]) -> dict[str, str]:
        """Which of the queued `turns` (an HTTP request's excepted: dropped anyway) must not run,
        turn id -> why, as the registered checks say (`hold_back_queued`). A check that fails is
        logged and holds nothing back: its turns run, as they would without it."""
        queued = [t for t in turns if t.status == "queued" and not awaited_by_a_request(t)]
        held: dict[str, str] = {}
        for check in self._hold_backs if queued else ():
            try:
                held.update(await check(queued))
            except Exception:
                log.exception("could not check %d queued turn(s) before queueing them again", len(queued))
        return held

    async def _settle_held_back(self, turn: TurnRecord, why: str) -> None:
        """Drop a queued turn a hold-back check named (`hold_back_queued`) before its queue reaches
        it: cancelled, error kind `withdrawn` saying `why`, nothing of it written."""
        revision = restart_revision(turn)
        if not await self._settle_unheld(turn, withdrawn(turn.id, revision, why), revision=revision):
            return
        log.warning("dropped queued turn %s of conversation %s: %s", turn.id, turn.conversation_id, why)

    async def _settle_left_unseen(self, turn: TurnRecord) -> None:
        """Withdraw a turn a dead process left running whose cancel it acknowledged as its client's
        leaving before the turn showed or did anything (`settle.acked_unseen`): cancelled, error
        kind `withdrawn`, nothing of it written, as that process would have ended it."""
        revision = restart_revision(turn)
        end = withdrawn(turn.id, revision, LEFT_UNSEEN, usage=turn.usage, iteration=turn.iteration)
        if not await self._settle_unheld(turn, end, revision=revision):
            return
        log.warning(
            "dropped turn %s of conversation %s, cancelled before a stop: %s",
            turn.id,
            turn.conversation_id,
            LEFT_UNSEEN,
        )

    async def _settle_left(self, turn: TurnRecord) -> None:
        """Close a turn a dead process left running: interrupted, keeping its input and the text
        it checkpointed, each dangling call given a result: the answer it got while paused (a
        client's result, stored before it was acknowledged: `delivered_results`), else "outcome
        unknown". A turn whose cancel was acknowledged (`TurnRecord.cancel_ack`, saved before the acknowledgement) ends
        cancelled instead, as promised: its text kept as cancelled text, each dangling call's
        result saying what became of it (`cancelled_results`: never run, stopped, answered).
        Ends in `finish_turn` like every turn; a commit that fails here fails the start."""
        history = await self.store.list_messages(turn.conversation_id)
        if acked_unseen(turn, history):  # its client left before it showed anything: dropped, as it would have been
            await self._settle_left_unseen(turn)
            return
        ack = turn.cancel_ack
        pending = {p.call_id: p for p in await self.store.list_pending(turn.id)}
        messages: list[MessageRecord] = []
        # a damaged input (rows.py `TurnRecord.damaged`) reads as its raw stored text: never the user's message
        writes_input = not turn.input_committed and "input" not in turn.damaged
        if writes_input:
            messages.extend(input_messages(turn))
        text = (turn.draft or {}).get("text") or ""
        answered = {m.tool_call_id for m in history if m.role == "tool"}
        for m in history:
            if m.role == "assistant" and m.turn_id == turn.id:
                if ack is None:
                    messages.extend(delivered_results(m, turn.id, answered, pending, self.config))
                    messages.extend(close_unanswered(m, turn.id, answered, interrupted_text))
                else:
                    messages.extend(cancelled_results(m, turn.id, answered, ack, pending, self.config))
        status: TurnStatus = "interrupted" if ack is None else "cancelled"
        if text:
            messages.append(
                MessageRecord(
                    role="assistant",
                    content=text,
                    turn_id=turn.id,
                    iteration=turn.iteration,
                    completion_status=status,
                )
            )
        error = server_stopped() if ack is None else None
        # Its snapshot shows what history keeps (was: no blocks, wiping a client's partial reply),
        # at a restart revision (restore.py `restart_revision`, the clock): above any the dead
        # process published and never stored, so a client that saw them takes this end. Stored as
        # published (a BIGINT column), so a later rebuild shows the same revision.
        published = restart_revision(turn)
        commit = TurnCommit(
            turn.id,
            status,
            "cancelled",
            messages,
            error=error,
            usage=turn.usage,
            revision=published,
            iteration=turn.iteration,
            input_committed=turn.input_committed or writes_input,
        )
        shown = [m for m in history if m.turn_id == turn.id] + messages
        if not await self._settle_unheld(turn, TurnEnd(status, "cancelled", error, commit), shown, published):
            return
        log.warning(
            "turn %s of conversation %s was %s; kept %d characters of its text",
            turn.id,
            turn.conversation_id,
            "interrupted by a stop" if ack is None else "cancelled before a stop (its cancel was acknowledged)",
            len(text),
        )

    # ------------------------------------------------------------ lookups

    async def resolve_agent(self, ref: str) -> AgentRecord:
        if not ref:
            raise InvalidInput("an agent is required", param="agent")
        found = await self.store.find_agents(ref)
        by_id = [a for a in found if a.id == ref]
        if by_id:
            return by_id[0]
        if len(found) == 1:
            return found[0]
        if not found:
            raise NotFound(f"unknown agent {shown(ref)}", code="agent_not_found", param="agent")
        raise InvalidInput(
            f"agent name {shown(ref)} is ambiguous; use one of the ids {', '.join(a.id for a in found)}",
            code="agent_ambiguous",
            param="agent",
        )

    async def default_conversation(self, agent: AgentRecord, namespace: str | None) -> ConversationRecord:
        """`default` as a credential means it: the agent's shared default for admin and the local
        owner (`namespace` None), else that namespace's own default, created on first use, under
        an id derived from the agent and the namespace, `conv_default~<tag>` (`namespaced_id`: two
        credentials never share a default, and only that namespace may make an id with its tag, so
        nobody can create it ahead)."""
        if namespace is None:
            return await self.resolve_conversation(agent, "default")
        cid = namespaced_id(NAMESPACE_DEFAULT_NAME, namespace, agent.id)
        conv = await self.store.get_conversation(cid)
        if conv is None:
            # Several requests (on several servers) may use it first at once: one creates it, the
            # others get that one (never a unique violation, DESIGN §13 / docs/scale-out.md).
            with agent_missing_is_gone(agent):
                conv, _ = await self.store.ensure_conversation(
                    ConversationRecord(id=cid, agent_id=agent.id, title="default", namespace=namespace)
                )
        if conv.agent_id != agent.id or conv.namespace != namespace:  # pragma: no cover - ids are derived
            raise NotFound(f"unknown conversation {shown(cid)}", code="conversation_not_found", param="conversation")
        return conv

    async def resolve_conversation(
        self, agent: AgentRecord, spec: str, *, create: bool = True, fields: dict[str, Any] | None = None
    ) -> ConversationRecord:
        spec = (spec or "default").strip()
        if spec == "default":
            conv = await self.store.get_default_conversation(agent.id)
            if conv is None:
                if not create:
                    raise NotFound(f"agent {agent.name} has no default conversation yet", code="conversation_not_found")
                # created once however many requests and servers use it first at once: the
                # others get the one created (the store keeps one default per agent)
                with agent_missing_is_gone(agent):
                    conv, _ = await self.store.ensure_conversation(
                        ConversationRecord(id=new_id("conv"), agent_id=agent.id, is_default=True, title="default")
                    )
                if conv.agent_id != agent.id or not conv.is_default:  # pragma: no cover - a random id taken
                    raise Unavailable(f"could not create the default conversation of agent {agent.name}; try again")
            return conv
        if spec == "new":
            if not create:
                raise InvalidInput("'new' is not an existing conversation")
            with agent_missing_is_gone(agent):
                return await self.store.create_conversation(
                    ConversationRecord(id=new_id("conv"), agent_id=agent.id, **(fields or {}))
                )
        conv = await self.store.get_conversation(spec)
        if conv is None or conv.agent_id != agent.id:
            raise NotFound(
                f"unknown conversation {shown(spec)} for agent {agent.name}",
                code="conversation_not_found",
                param="conversation",
            )
        return conv

    async def runtime(
        self,
        conversation_id: str,
        *,
        conv: ConversationRecord | None = None,
        fresh: bool = False,
        history: list[MessageRecord] | None = None,
    ) -> ConversationRuntime:
        """The conversation's runtime, loaded on first use. `conv` spares a lookup the caller already
        made; `fresh` (a conversation created just now) spares looking for a paused turn, and
        `history` (all its messages, when the caller knows them) spares reading them.

        The runtime returned is the loaded one at the moment this returns (no await follows the
        check), so a caller that pins it or queues on it before its own next await cannot end up
        on a runtime `_trim_idle` dropped meanwhile: one that waited on another caller's load
        looks again after that wait."""
        self._check_not_fenced()
        runtimes = self.runtimes
        while True:
            rt = runtimes.get(conversation_id)
            if rt is not None:
                runtimes[conversation_id] = runtimes.pop(conversation_id)  # most recently used last
                return rt
            loading = self._loading.get(conversation_id)
            if loading is None:
                break
            await asyncio.shield(loading)  # then look again: it may have been trimmed since
        fut: asyncio.Future[ConversationRuntime] = asyncio.get_running_loop().create_future()
        self._loading[conversation_id] = fut
        try:
            if conv is None or conv.id != conversation_id:
                conv = await self.store.get_conversation(conversation_id)
            if conv is None:
                raise NotFound(f"unknown conversation {shown(conversation_id)}", code="conversation_not_found")
            link = self._link
            if link is not None:
                lease = await link.cluster.take(conversation_id)
                if lease.holder is not None:
                    raise OwnedElsewhere(conversation_id, lease.holder)
            rt = ConversationRuntime(self._deps, conv.id, conv.agent_id)
            if link is not None:
                rt.watchers.append(link.on_local_turn)  # the other servers see its turns
            try:
                if not fresh:
                    await rt.load()
                if history is not None:
                    rt.adopt_history(history)
                if link is not None and not fresh:
                    await self._take_over(rt)
            except BaseException:
                if link is not None:
                    link.cluster.release(conversation_id)
                raise
            self.runtimes[conversation_id] = rt
            if link is not None:
                link.adopt(conversation_id)  # the turns mirrored here follow their handles here
            paused = rt.awaiting_turn
            if paused is not None and not fresh:
                await self._took_up(paused, rt.handles.get(paused.id))  # adopted paused
            if len(self.runtimes) > self.config.limits.idle_runtimes_max and (
                len(self.runtimes) > self._trim_after_count or time.monotonic() >= self._trim_after_time
            ):
                self._trim_idle(conversation_id)
            fut.set_result(rt)
            return rt
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved
            raise
        finally:
            del self._loading[conversation_id]

    async def hold(self, conversation_id: str) -> None:
        """Take the conversation's cluster lease before writing a turn of it outside its runtime (a
        new conversation written paused at tool calls): a store of a cluster takes turn writes only
        from the conversation's holder, and a refused one reads as this server judged gone.
        OwnedElsewhere when another live server holds it; nothing to do without a cluster."""
        self._check_not_fenced()
        link = self._link
        if link is None:
            return
        lease = await link.cluster.take(conversation_id)
        if lease.holder is not None:
            raise OwnedElsewhere(conversation_id, lease.holder)

    # ------------------------------------------------------------ the kernel call

    def refuse_if_fenced(self) -> None:
        """Unavailable (`server_unavailable`) when this server may serve nothing from its view of a
        conversation: a front end asks it before it answers from a view it keeps (a WebSocket
        subscription's), which a server judged gone no longer updates."""
        self._check_not_fenced()

    def on_judged_gone(self, listener: Callable[[], None]) -> None:
        """Call `listener` once this server learns it was judged gone (after its turns moved to
        mirrors, so what its clients still follow reads its end from the store)."""
        self._gone_listeners.append(listener)

    def _check_not_fenced(self) -> None:
        """A cluster member judged gone by the others runs nothing more: they took its
        conversations over, and a runtime still loaded here would run a second copy of one. A
        process that is no member of its store's cluster (a CLI command on a PostgreSQL store)
        runs no turn at all: it holds no lease, so its runtime would run beside the server's."""
        link = self._link
        if link is None and not self.runs_turns:
            raise Conflict(
                "turns of a PostgreSQL store run only in its servers (appserver serve), and this process is not "
                "one: send the input to a server (appserver run --url http://HOST:PORT …, or the HTTP and "
                "WebSocket APIs)"
            )
        if link is None or not link.cluster.fenced:
            return
        if link.cluster.lost:
            raise Unavailable(
                f"this server ({link.cluster.instance_id}) was judged gone by the others of its cluster and "
                "its conversations were taken over: send the request to another server (this one needs a restart)"
            )
        raise Unavailable(
            f"this server ({link.cluster.instance_id}) has lost its database session; the others may take "
            "its conversations over: send the request to another server"
        )

    def _taken_over(self) -> None:
        """Judged gone: the conversations held here are other servers' now, which settled or run
        their turns. Each runtime is dropped and its worker stopped where it is (cancelled as a
        task, not as a turn: so it calls its model and tools no more, and ends nothing, since what
        it would write is refused in the database and what it would publish is not what happened).
        The turns its clients here still follow (running, queued, paused) become mirrors that
        read their outcome from the store, so each client hears how its turn really ended
        (interrupted by the survivor's takeover, or run and completed there), never a failure
        of a turn that another server completed."""
        link = self._link
        for conversation_id, rt in list(self.runtimes.items()):
            del self.runtimes[conversation_id]  # no release: the lease is another server's now
            rt.queue.close()
            rt._answers.cancel_expiry()  # a deadline here would close calls another server holds
            worker = rt.queue.worker
            if worker is not None:
                worker.cancel()
                self._cancelling.add(worker)  # the loop holds a task only weakly
                worker.add_done_callback(self._cancelling.discard)
            for handle in list(rt.handles.values()):
                self._let_go(handle.turn_id)  # another server counts it now, if any does
                if link is not None:
                    link.follow_elsewhere(handle)
        for listener in list(self._gone_listeners):
            try:
                listener()
            except Exception:
                log.exception("a listener for this server being judged gone failed")

    def _cut_off(self, record: TurnRecord, controller: TurnController) -> bool:
        """A turn's write failed (runtime/finish.py): is this server cut off from its cluster (its
        session away, or fenced), so that the others may have taken the conversation over? Then
        the turn and those queued behind it leave its runtime here and follow the store as mirrors
        (`ClusterLink.follow_elsewhere`), as a server judged gone follows its turns: each client
        hears how its turn really ended (interrupted by a take-over, or run and completed there, or
        failed as this server writes it once back and still holding the conversation), never a
        failure of a turn another server settled. Nothing starts in the meantime: the runtime
        holds no turn until a catch-up queues them again (once back, if still its holder)."""
        link = self._link
        if link is None or not link.cluster.cut_off:
            return False
        rt = self.runtimes.get(record.conversation_id)
        if rt is not None:
            before: str | None = None  # its clients hear the ends in the conversation's order
            for handle in rt.let_go_unsaved(record.id, controller):
                link.follow_elsewhere(handle, after=before)
                link.give_up_reading(handle)
                before = handle.turn_id
        return True

    async def submit(self, req: SubmitRequest) -> Submission:
        self._check_not_fenced()
        known = req.resolved
        agent = known if known is not None and known.id == req.agent else await self.resolve_agent(req.agent)
        content = req.input
        if isinstance(content, str):
            if not content.strip():
                raise InvalidInput("input is empty", param="input")
        elif not isinstance(content, list) or not content:
            raise InvalidInput("input must be text or a non-empty list of parts", param="input")
        elif all(blank_text_part(part) for part in content):
            # parts with no text to read and no image or file: as empty as "" (HTTP: missing_input)
            raise InvalidInput("input is empty: its parts hold no text, image or file", param="input")
        if any(m.get("role") not in INPUT_SYSTEM_ROLES or not isinstance(m.get("text"), str) for m in req.system):
            raise InvalidInput("system messages are {role: system | developer, text: string}", param="input")
        key = req.idempotency_key or None
        spec = (req.conversation or "default").strip()
        if key and (spec == "new" or req.idempotency_scope):
            earlier = await self.store.lookup_idempotency(req.idempotency_scope or f"new:{agent.id}", key)
            if earlier is not None:
                return await self._duplicate(earlier)
        conv: ConversationRecord | None = None
        rt = self.runtimes.get(spec) if spec not in ("default", "new") else None
        if rt is not None and rt.agent_id == agent.id:
            conv_id = spec  # loaded, so it exists: no lookup on the hot path
            self.runtimes[spec] = self.runtimes.pop(spec)  # most recently used last
        else:
            conv = await self.resolve_conversation(agent, spec, fields=req.conversation_fields)
            conv_id = conv.id
            rt = None
        if spec != "new":
            return await self._submit_into(req, agent, content, key, spec, conv, conv_id, rt)
        # A conversation made for this submit alone: should no turn of it land there (a copy of a
        # keyed input accepted at once by another server, a failure), it is removed again, never
        # left empty (docs/protocol.md: copies sent at once leave no conversation of their own).
        try:
            sub = await self._submit_into(req, agent, content, key, spec, conv, conv_id, rt)
        except asyncio.CancelledError:
            self.keep_until_done(asyncio.get_running_loop().create_task(self._discard_unused(conv_id)))
            raise
        except Exception:
            await self._discard_unused(conv_id)
            raise
        if sub.duplicate:
            await self._discard_unused(conv_id)
        return sub

    async def _submit_into(
        self,
        req: SubmitRequest,
        agent: AgentRecord,
        content: str | list[dict[str, Any]],
        key: str | None,
        spec: str,
        conv: ConversationRecord | None,
        conv_id: str,
        rt: ConversationRuntime | None,
    ) -> Submission:
        """The accept of `submit`, into the conversation it found or made (`conv_id`)."""
        scope = (req.idempotency_scope or (f"new:{agent.id}" if spec == "new" else conv_id)) if key else None
        if key and spec != "new" and not req.idempotency_scope:
            earlier = await self.store.lookup_idempotency(scope, key)  # type: ignore[arg-type]
            if earlier is not None:
                return await self._duplicate(earlier)
        holder: str | None = None
        try:
            if rt is None:
                new = spec == "new"
                rt = await self.runtime(conv_id, conv=conv, fresh=new, history=[] if new else None)
            if self.runtimes.get(conv_id) is not rt:  # evicted while we awaited: use the loaded one
                rt = await self.runtime(conv_id)
        except OwnedElsewhere as elsewhere:
            rt, holder = None, elsewhere.holder
        # (no await from here to the enqueue: a re-run is the next turn of its conversation)
        rerun = await self._rerun(req, agent, content, rt) if req.rerun_of and rt is not None else None
        record = TurnRecord(
            id=new_id("turn"),
            conversation_id=conv_id,
            agent_id=agent.id,
            idempotency_key=key,
            source=req.source,
            input={"content": content, "system": [dict(m) for m in req.system]} if req.system else {"content": content},
            client_tools=[t.to_record() for t in req.client_tools] if req.client_tools else [],
            options=dict(req.options),
        )
        if rerun is None and req.rerun_only:
            raise NotAwaiting(f"turn {req.rerun_of} can no longer be re-run: its conversation moved on")
        if rerun is not None:  # its input is in the history already, once: this turn answers it
            record.input["rerun_of"] = rerun
            record.input_committed = True
        if COUNTED_FOR in record.options:
            record.options[COUNTED_AT] = self.owner  # this server's endpoint counts it
        try:
            if rt is None:
                assert holder is not None and self._link is not None
                handle, position = await self._link.submit(record, scope, holder)
            else:
                handle, position = await rt.queue.enqueue(record, scope, overlap=req.overlap_accept, agent=agent)
        except DuplicateTurn as dup:
            return await self._duplicate(dup.turn)
        except ConversationGone:
            raise await self._gone(agent, conv_id) from None
        except TurnSettledElsewhere:  # its conversation was taken over meanwhile: this server is fenced
            self._check_not_fenced()
            raise
        return Submission(record.id, conv_id, agent.id, position, False, handle)

    async def _rerun(
        self, req: SubmitRequest, agent: AgentRecord, content: str | list[dict[str, Any]], rt: ConversationRuntime
    ) -> str | None:
        """The turn whose input the new turn re-runs rather than adding it again: turn
        `req.rerun_of` ran the same input (`content`, system messages) for this agent in this
        conversation and ended without an answer (stopped, crashed, failed, cancelled); its input
        (its own, or the one it re-ran in turn: the turn that wrote it) is the history's last,
        with nothing running, waiting or queued (checked last, with no await before the enqueue).
        So a keyed retry leaves the input in its conversation once, answered by the new turn
        (docs/openai.md, Idempotency-Key); the cut-off reply stays in the history, out of the
        model's view (`history.model_view`). None: the input is added as any other."""
        earlier = await self._rerunnable(req.rerun_of, agent.id, rt) if req.rerun_of else None
        if (
            earlier is None
            or earlier.input.get("content") != content
            or (earlier.input.get("system") or []) != [dict(m) for m in req.system]
        ):
            return None
        return await self._rerun_point(earlier, rt)

    async def _rerunnable(self, turn_id: str, agent_id: str, rt: ConversationRuntime) -> TurnRecord | None:
        """Turn `turn_id` as stored, when a keyed repeat may re-run its input in `rt`'s
        conversation: that agent's turn there, ended without an answer, its input whole. Its end
        is written before its runtime is past it (a cancelled turn writing its cut-off reply, as a
        repeat waiting on the key claims it): it is waited for (`RERUN_SETTLE_S`) to leave the
        runtime, so the decision follows that turn's finish instead of seeing it still held."""
        await rt.until_left(turn_id, RERUN_SETTLE_S)
        earlier = await self.store.get_turn(turn_id)
        if (
            earlier is None
            or earlier.conversation_id != rt.conversation_id
            or earlier.agent_id != agent_id
            or earlier.status not in RERUNNABLE
            or "input" in earlier.damaged
        ):
            return None
        return earlier

    async def _rerun_point(self, earlier: TurnRecord, rt: ConversationRuntime) -> str | None:
        """The turn that wrote `earlier`'s input (itself, or the one it re-ran in turn), when that
        input is still the history's last with nothing held in `rt`, the loaded runtime."""
        wrote = earlier.input.get("rerun_of")
        wrote = wrote if isinstance(wrote, str) else earlier.id
        if not await rt.ends_with(wrote) or self.runtimes.get(rt.conversation_id) is not rt:
            return None
        return wrote

    async def rerun_conversation(self, turn_id: str, agent_id: str) -> str | None:
        """The conversation a keyed repeat that names none (an OpenAI request matched by its history
        or previous response, or `new`) re-runs turn `turn_id` in: its own, when that turn of
        `agent_id` ended without an answer and its input is still the history's last there, with
        nothing held (`_rerunnable`). The same request matched that conversation then; its cut-off
        reply now stands in the way of the match, which would fork and add the input again. None
        when it cannot be re-run there (the conversation moved on, or another server of a cluster
        holds it: that server would add the input as any other): the request is placed as ever.
        A keyed repeat's cost only: no unkeyed request asks."""
        turn = await self.store.get_turn(turn_id)
        if turn is None or turn.agent_id != agent_id:
            return None
        try:
            rt = await self.runtime(turn.conversation_id)
        except OwnedElsewhere:
            return None
        earlier = await self._rerunnable(turn_id, agent_id, rt)
        if earlier is None or await self._rerun_point(earlier, rt) is None:
            return None
        return earlier.conversation_id

    async def _discard_unused(self, conversation_id: str) -> None:
        """Remove a conversation `submit` made ("new") into which no turn landed: only while it is
        still empty (the store checks, atomically with the delete) and its runtime here holds
        nothing; its runtime is unloaded (in a cluster its lease let go). Its id was never given
        out, so nobody else uses it. A failure is logged: the conversation stays, empty, as before."""
        rt = self.runtimes.get(conversation_id)
        if rt is not None and not rt.idle:
            return  # an accept landed after all (the commit came before a cancel): it runs
        try:
            removed = await self.store.discard_empty_conversation(conversation_id)
        except Exception as exc:
            log.warning("could not remove conversation %s, left empty by its submit: %r", conversation_id, exc)
            return
        if not removed:
            return
        rt = self.runtimes.get(conversation_id)
        if rt is not None:
            self._drop(conversation_id)
            await rt.shutdown()

    async def _gone(self, agent: AgentRecord, conversation_id: str) -> NotFound:
        """The accept found the conversation gone: deleted, or its agent (and with it the
        conversation) deleted, since the request found them. Said so to every front end."""
        if await self.store.get_agent(agent.id) is None:
            return AgentGone(f"agent {agent.name!r} was deleted while the input was accepted", param="agent")
        return NotFound(
            f"conversation {shown(conversation_id)} was deleted while the input was accepted",
            code="conversation_not_found",
            param="conversation",
        )

    async def _duplicate(self, turn: TurnRecord) -> Submission:
        handle = await self.handle_for(turn)
        return Submission(turn.id, turn.conversation_id, turn.agent_id, handle.controller.queue_position, True, handle)

    async def respond(
        self,
        conversation_id: str,
        decisions: list[Decision],
        *,
        here: bool = False,
        whole: bool = False,
        settings: TurnSettings | None = None,
    ) -> list[dict[str, Any]]:
        """Answer pending calls of the conversation's paused turn (on the server that holds it;
        `here`: asked by another server, so never passed on). `whole`: all of them or none
        (see PendingAnswers.respond). `settings`: the options and client tools of the request that
        answers (an OpenAI-surface request is its own model call), which the turn's model calls
        after the answers get: stored with the answers, over the turn's own but for the entries
        the kernel keeps with it (its open-turn count). None (the WebSocket protocol's answers,
        which bring none): the turn keeps its options."""
        try:
            rt = await self.runtime(conversation_id)
        except OwnedElsewhere as elsewhere:
            if here or self._link is None:
                raise
            args = decisions_args(decisions, whole=whole, settings=settings)
            got = await self._link.call_holder(conversation_id, elsewhere.holder, "respond", args)
            return list(got.get("results") or [])
        return await rt.respond(decisions, whole=whole, settings=settings, keep=(COUNTED_FOR, COUNTED_AT))

    def keep_until_done(self, task: asyncio.Future[Any]) -> None:
        """Hold a reference to `task` (a cancel its caller stopped waiting for) until it ends: the
        event loop holds tasks only weakly."""
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def cancel(
        self, conversation_id: str, turn_id: str | None = None, *, here: bool = False, client_left: bool = False
    ) -> bool:
        """Cancel the conversation's current turn. With `turn_id`, only that turn: cancelled if it
        is the current one, or dropped from the queue if it has not started (DESIGN §13), saying
        why: its client went away (`client_left`), or a cancel named it. A running turn stopped
        only because its client went away, before it showed or did anything, is dropped too
        (`ConversationRuntime.cancel`)."""
        try:
            rt = await self.runtime(conversation_id)
        except OwnedElsewhere as elsewhere:
            if here or self._link is None:
                raise
            args = {"turn_id": turn_id, "client_left": client_left}
            got = await self._link.call_holder(conversation_id, elsewhere.holder, "cancel", args)
            return bool(got.get("cancelled"))
        if turn_id is None or rt.lifecycle.turn_id == turn_id:
            return await rt.cancel(client_left=client_left and turn_id is not None)
        why = "the client went away before this input started" if client_left else "a cancel named it before it started"
        if await rt.withdraw(turn_id, why):
            log.info("dropped queued turn %s of conversation %s: %s", turn_id, conversation_id, why)
            return True
        return False

    async def awaiting(self, conversation_id: str) -> TurnRecord | None:
        """The conversation's turn paused for answers to its pending calls, if any."""
        try:
            return (await self.runtime(conversation_id)).awaiting_turn
        except OwnedElsewhere:
            paused = await self.store.list_turns(conversation_id, statuses=("awaiting",))
            return paused[-1] if paused else None

    def in_flight(self, conversation_id: str) -> bool:
        """A turn of this conversation runs or waits in the queue (it is moving past its stored
        head); a conversation not in memory has none."""
        rt = self.runtimes.get(conversation_id)
        return rt is not None and rt.in_flight

    def turn_active(self, conversation_id: str) -> bool:
        """A turn of this conversation runs here right now (begun or resumed, not merely queued or
        paused): a call it approved may be running."""
        rt = self.runtimes.get(conversation_id)
        return rt is not None and rt.lifecycle.state in ("active", "cancelling")

    async def in_flight_elsewhere(self, conversation_id: str) -> bool:
        """In a cluster, a turn of this conversation runs or waits on another server (the
        conversation is not loaded here; `in_flight` answers for one that is)."""
        if self._link is None or conversation_id in self.runtimes:
            return False
        return bool(await self.store.list_turns(conversation_id, statuses=("queued", "running")))

    async def adopt(
        self, conv: ConversationRecord, *, paused: bool = False, history: list[MessageRecord] | None = None
    ) -> None:
        """Load a conversation the caller just wrote, so the submit that follows finds it ready.
        `paused`: it holds a paused turn to adopt; else it has no turns yet, and `history` (all its
        messages, when the caller knows them) spares reading them."""
        stale = self.runtimes.get(conv.id)
        if stale is not None:
            # No row had this id until the caller wrote it, so a runtime loaded under it belongs to
            # a conversation deleted since (by another process: the CLI, with its agent). Its
            # history and turns must not carry over into the new conversation: end it first.
            log.warning("conversation %s was deleted and created again: ending its old runtime here", conv.id)
            self._drop(conv.id)
            await stale.shutdown()
        if paused:
            try:
                await self.runtime(conv.id, conv=conv)
            except OwnedElsewhere:
                pass  # another server holds it: the submit that follows goes through it
        else:
            try:
                await self.runtime(conv.id, conv=conv, fresh=True, history=history)
            except OwnedElsewhere:
                # Another server found it the moment it was written (a request with the same
                # client-chosen id) and holds it now: the submit that follows goes through it.
                pass

    # ------------------------------------------------------------ watching

    async def open_watch(self, conversation_id: str, on_turn: Callable[[TurnHandle], None]) -> Watch:
        """Pin the conversation and hear of its turns until the watch is closed."""
        try:
            return Watch(await self.runtime(conversation_id), on_turn)
        except OwnedElsewhere:
            assert self._link is not None
            return await self._link.watch(conversation_id, on_turn)

    @asynccontextmanager
    async def watch(self, conversation_id: str, on_turn: Callable[[TurnHandle], None]) -> AsyncIterator[Watch]:
        """`open_watch` for a scope: closed when the block ends."""
        w = await self.open_watch(conversation_id, on_turn)
        try:
            yield w
        finally:
            w.close()

    # ------------------------------------------------------------ in-memory gauges

    @property
    def runtime_count(self) -> int:
        return len(self.runtimes)

    def queue_depth(self) -> int:
        """Inputs queued across the conversations in memory."""
        return sum(len(rt.queue) for rt in list(self.runtimes.values()))

    # ------------------------------------------------------------ snapshots

    async def handle_for(self, turn: TurnRecord) -> TurnHandle:
        """The live handle of a turn, or a settled one rebuilt from the store."""
        rt = self.runtimes.get(turn.conversation_id)
        if rt is not None and turn.id in rt.handles:
            return rt.handles[turn.id]
        if turn.status in ("queued", "running", "awaiting"):
            try:
                rt = await self.runtime(turn.conversation_id)
            except OwnedElsewhere:
                assert self._link is not None
                return await self._link.mirror(turn)
            if turn.id in rt.handles:
                return rt.handles[turn.id]
        fresh = await self.store.get_turn(turn.id) or turn
        controller = await controller_from_store(self.store, fresh, await self.store.list_pending(fresh.id))
        return TurnHandle(fresh.id, fresh.conversation_id, controller)

    async def turn_snapshot(self, turn_id: str) -> TurnSnapshot:
        turn = await self.store.get_turn(turn_id)
        if turn is None:
            raise NotFound(f"unknown turn {shown(turn_id)}", code="turn_not_found")
        return (await self.handle_for(turn)).controller.snapshot()

    def on_settled(self, listener: SettledListener) -> Callable[[], None]:
        """Call `listener` each time a turn (segment) settles; returns the unregister call."""
        self._settled_listeners.append(listener)

        def remove() -> None:
            if listener in self._settled_listeners:
                self._settled_listeners.remove(listener)

        return remove

    def _turn_settled(self, record: TurnRecord, snapshot: TurnSnapshot) -> None:
        if self._link is not None:
            self._link.settled(snapshot)
        for listener in list(self._settled_listeners):
            try:
                listener(record, snapshot)
            except Exception:
                log.exception("settled listener failed")


def blank_input(content: Any) -> bool:
    """Input with nothing in it, which `Kernel.submit` refuses: text that is empty or only
    whitespace, an empty list of parts, or parts that are all blank text parts (no image or file).
    Front ends that must refuse it before they write anything (the HTTP routes place or create a
    conversation first) ask this same rule."""
    if isinstance(content, str):
        return not content.strip()
    return isinstance(content, list) and (not content or all(blank_text_part(part) for part in content))


def blank_text_part(part: Any) -> bool:
    """A text part whose text is empty or only whitespace (any other part, an image or a file,
    is input)."""
    if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
        return False
    text = part.get("text")
    return not isinstance(text, str) or not text.strip()
