"""ConversationRuntime: one FIFO queue and one TurnLifecycle per conversation.

One turn at a time, in arrival order. A turn finishes exactly once, through `_finish`, and only
the worker task writes a turn's messages: answers and cancels of a paused turn take its lease
synchronously and hand it to the worker, so no two paths can both settle one call. Pending calls
live in the store; answers resume the same turn with tool results as the next messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from appserver.agent.events import ToolCallStatus
from appserver.agent.loop import LoopOutcome, TurnWork, resolution_text
from appserver.errors import InvalidInput, NotAwaiting, NotFound, QueueFull
from appserver.providers.base import ToolSpec
from appserver.runtime.chatcache import ChatCache
from appserver.runtime.deps import RuntimeDeps
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.lifecycle import Lease, StaleLease, TurnLifecycle
from appserver.runtime.restore import controller_from_store
from appserver.runtime.settle import TurnEnd, cancel_wins, loop_end, store_failure
from appserver.runtime.snapshot import TurnController
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS
from appserver.store.base import StoreError
from appserver.store.records import AgentRecord, MessageRecord, PendingCall, TurnCommit, TurnRecord

log = logging.getLogger("appserver.runtime")

RECENT_HANDLES = 16
CANCELLED_UNANSWERED = "The turn was cancelled before this call was answered; it was not executed."


@dataclass(slots=True)
class _Queued:
    record: TurnRecord
    handle: TurnHandle
    # An overlapped accept still committing (see enqueue `overlap`); None once it committed first.
    accepting: asyncio.Task[None] | None = None
    agent: AgentRecord | None = None  # the agent as the submitter just read it (overlapped only)
    cancelled: bool = False  # cancelled as the next turn to run, before the worker began it


@dataclass(slots=True)
class _Resume:
    """A paused turn taken over (lease held) for the worker: resumed with `resolved`, or, when
    its lease was cancelled, closed with one result per call."""

    record: TurnRecord
    lease: Lease
    resolved: list[PendingCall] | None


class ConversationRuntime:
    def __init__(self, deps: RuntimeDeps, conversation_id: str, agent_id: str) -> None:
        self.deps = deps
        self.conversation_id = conversation_id
        self.agent_id = agent_id
        self.lifecycle = TurnLifecycle()
        self.queue: deque[_Queued] = deque()
        self.handles: dict[str, TurnHandle] = {}
        self.watchers: list[Callable[[TurnHandle], None]] = []
        self.pins = 0
        self.last_active = time.monotonic()
        self._history: list[MessageRecord] | None = None
        self._chat = ChatCache()  # provider messages of _history, converted once (cleared with it)
        self._worker: asyncio.Task[None] | None = None
        # The agent loop runs inside the worker task (no task per turn); cancel() cancels the worker
        # while the loop runs, and _run tells that apart from the worker being torn down.
        self._loop_running = False
        self._loop_cancelled = False
        self._awaiting: TurnRecord | None = None
        self._resume: _Resume | None = None
        self._draft_base = 0  # visible characters of the running turn already in history
        self._expiry: asyncio.TimerHandle | None = None
        self._draft_timer: asyncio.TimerHandle | None = None
        self._shutdown = False
        self._accepting = 0  # inputs waiting for their accept to commit (they hold a queue place)

    # ------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        return (
            not self.lifecycle.busy
            and not self.queue
            and self._worker is None
            and self.pins == 0
            and self._accepting == 0
        )

    @property
    def in_flight(self) -> bool:
        """A turn runs, is being cancelled, or waits in the queue (or for its accept): the
        conversation is moving past its stored head. A turn paused for answers is not in flight."""
        return self.lifecycle.state in ("active", "cancelling") or bool(self.queue) or self._accepting > 0

    @property
    def active_handle(self) -> TurnHandle | None:
        turn_id = self.lifecycle.turn_id
        return self.handles.get(turn_id) if turn_id else None

    @property
    def awaiting_turn(self) -> TurnRecord | None:
        return self._awaiting if self.lifecycle.state == "awaiting" else None

    async def load(self) -> None:
        """Adopt a paused turn from the store (survives restarts and other processes)."""
        awaiting = await self.deps.store.list_turns(self.conversation_id, statuses=["awaiting"])
        if not awaiting:
            return
        turn = awaiting[-1]
        pending = await self.deps.store.list_pending(turn.id)
        controller = await controller_from_store(self.deps.store, turn, pending)
        self.handles[turn.id] = TurnHandle(turn.id, self.conversation_id, controller)
        self.lifecycle.restore_awaiting(turn.id)
        self._awaiting = turn
        await self.expire_overdue()
        if self.lifecycle.state == "awaiting" and self._resume is None:
            await self._maybe_resume()
            if self.lifecycle.state == "awaiting":
                self._arm_expiry(pending)

    def adopt_history(self, messages: list[MessageRecord]) -> None:
        """The whole history, from a caller that just wrote it (a new conversation): no store read."""
        if self._history is None:
            self._history = list(messages)

    async def history(self) -> list[MessageRecord]:
        if self._history is None:
            self._history = await self.deps.store.list_messages(self.conversation_id)
        return self._history

    def _notify(self, handle: TurnHandle) -> None:
        for watcher in list(self.watchers):
            try:
                watcher(handle)
            except Exception:  # a broken watcher must not break the turn
                log.exception("turn watcher failed")

    def _remember(self, handle: TurnHandle) -> None:
        self.handles[handle.turn_id] = handle
        if len(self.handles) > RECENT_HANDLES:
            live = {q.handle.turn_id for q in self.queue} | {self.lifecycle.turn_id}
            for turn_id in list(self.handles):
                if len(self.handles) <= RECENT_HANDLES:
                    break
                if turn_id not in live:
                    del self.handles[turn_id]

    # ------------------------------------------------------------ submit

    async def enqueue(
        self,
        record: TurnRecord,
        idempotency_scope: str | None,
        *,
        overlap: bool = False,
        agent: AgentRecord | None = None,
    ) -> tuple[TurnHandle, int]:
        """Queue an input once its accept committed.

        `overlap`: the caller acknowledges nothing before the turn settles (a non-stream HTTP
        reply), so a turn that runs at once may start before its accept commits: the accept then
        commits while the model call is in flight, the turn becomes visible (handles, watchers)
        only after it, and the turn's own commit waits for it. Without an idempotency scope only
        (a duplicate must be found before anything runs). `agent`: the record the submitter read
        just now, which such a turn then runs with instead of reading it again.
        """
        waiting = len(self.queue) + self._accepting
        if waiting >= self.deps.config.limits.queue_max:
            raise QueueFull(
                f"conversation {self.conversation_id} has {waiting} inputs queued (limit {self.deps.config.limits.queue_max}); try again later"
            )
        position = waiting + (1 if self.lifecycle.busy else 0)
        record.status = "queued" if position else "running"
        record.owner = self.deps.owner
        if position == 0:
            record.started_at = time.time()
        if overlap and position == 0 and idempotency_scope is None and self._worker is None and not self._shutdown:
            return self._queue_overlapped(record, agent), 0
        # The accept commits with the next group commit: until then this input holds its place.
        self._accepting += 1
        try:
            await self.deps.store.accept_turn(record, idempotency_scope)  # raises DuplicateTurn
        except asyncio.CancelledError:
            # The commit may have landed just before the cancel reached us: queue the turn all the
            # same, or it would sit in the store as accepted with nobody to run it.
            self._accepting -= 1
            if await self.deps.store.get_turn(record.id) is not None:
                self._queue_accepted(record, position)
            raise
        except BaseException:
            self._accepting -= 1
            raise
        self._accepting -= 1
        return self._queue_accepted(record, position), position

    def _queue_overlapped(self, record: TurnRecord, agent: AgentRecord | None) -> TurnHandle:
        controller = TurnController(record.id, self.conversation_id, record.agent_id, phase="queued", queue_position=0)
        handle = TurnHandle(record.id, self.conversation_id, controller)
        item = _Queued(record, handle, agent=agent if agent is not None and agent.id == record.agent_id else None)
        self.queue.append(item)
        # The worker's first step is scheduled first: it runs up to the model call, then the
        # accept commits while the model works.
        self._ensure_worker()
        item.accepting = asyncio.get_running_loop().create_task(self._accept_overlapped(record, handle))
        item.accepting.add_done_callback(_retrieved)  # the worker reports a failure (see _run)
        return handle

    async def _accept_overlapped(self, record: TurnRecord, handle: TurnHandle) -> None:
        await self.deps.store.accept_turn(record, None)
        self._remember(handle)
        self._notify(handle)

    async def _accepted(self, item_accepting: asyncio.Task[None] | None) -> BaseException | None:
        """Wait for an overlapped accept: None once committed, else why it was not."""
        if item_accepting is None:
            return None
        try:
            await asyncio.shield(item_accepting)
        except asyncio.CancelledError:
            if not item_accepting.cancelled():
                raise  # this worker is being torn down
            return StoreError("the accept was cancelled")
        except Exception as exc:
            return exc
        return None

    async def _require_accepted(self, accepting: asyncio.Task[None]) -> None:
        not_accepted = await self._accepted(accepting)
        if not_accepted is not None:
            raise StoreError(f"the turn could not be saved before its tools ran: {not_accepted}")

    def _queue_accepted(self, record: TurnRecord, position: int) -> TurnHandle:
        controller = TurnController(
            record.id, self.conversation_id, record.agent_id, phase="queued", queue_position=position
        )
        handle = TurnHandle(record.id, self.conversation_id, controller)
        self._remember(handle)
        self.queue.append(_Queued(record, handle))
        self._notify(handle)
        self._ensure_worker()
        return handle

    def requeue(self, record: TurnRecord) -> None:
        """Queue a turn a dead process accepted but never began (server start)."""
        record.owner = self.deps.owner
        controller = TurnController(
            record.id, self.conversation_id, record.agent_id, phase="queued", queue_position=len(self.queue) + 1
        )
        handle = TurnHandle(record.id, self.conversation_id, controller)
        self.handles[record.id] = handle
        self.queue.append(_Queued(record, handle))
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        if self._worker is None and not self._shutdown:
            self._worker = asyncio.get_running_loop().create_task(
                self._work(), name=f"conversation:{self.conversation_id}"
            )

    async def _work(self) -> None:
        try:
            while not self._shutdown:
                resume = self._resume
                if resume is not None:
                    self._resume = None
                    record = resume.record
                    handle = self.handles.get(record.id)
                    if handle is None:
                        controller = await controller_from_store(
                            self.deps.store, record, await self.deps.store.list_pending(record.id)
                        )
                        handle = TurnHandle(record.id, self.conversation_id, controller)
                        self._remember(handle)
                    await self._run(record, handle, resume)
                    continue
                if self.lifecycle.state == "awaiting" or not self.queue:
                    break
                item = self.queue.popleft()
                for i, q in enumerate(self.queue):
                    q.handle.controller.set_queue_position(i + 1)
                await self._run(item.record, item.handle, None, item.accepting, item.agent, cancelled=item.cancelled)
        finally:
            self._worker = None
            self.last_active = time.monotonic()

    # ------------------------------------------------------------ run one turn (segment)

    async def _run(
        self,
        record: TurnRecord,
        handle: TurnHandle,
        resume: _Resume | None = None,
        accepting: asyncio.Task[None] | None = None,
        agent: AgentRecord | None = None,
        *,
        cancelled: bool = False,
    ) -> None:
        """Run one turn segment: a queued turn (`cancelled`: cancelled before it began), or a
        paused one under the lease `_take_paused` took for it (resumed, or closed when that lease
        was cancelled). Ends in `_finish`."""
        deps = self.deps
        controller = handle.controller
        if resume is None:
            lease = self.lifecycle.begin(record.id)
            if cancelled:
                self.lifecycle.request_cancel()
            controller.set_queue_position(0)
        else:
            lease = resume.lease
            controller.resume("finalizing" if lease.cancel_event.is_set() else "acting")
            self._notify(handle)
        self._draft_base = len(controller.visible_text())  # a resumed turn's earlier text is stored
        work: TurnWork | None = None
        try:
            if (record.status != "running" or resume is not None) and not lease.cancel_event.is_set():
                record.status = "running"
                await deps.store.mark_turn_running(record.id, deps.owner, controller.revision)
                self.lifecycle.check(lease)
            history = await self.history()
            self.lifecycle.check(lease)
            if agent is None:
                agent = await deps.store.get_agent(record.agent_id)
                self.lifecycle.check(lease)
            if agent is None:
                raise NotFound(f"agent {record.agent_id} was deleted")
            work = TurnWork(
                agent=agent,
                conversation_id=self.conversation_id,
                turn_id=record.id,
                history=list(history),
                to_chat=self._chat,
                client_tools=[
                    ToolSpec(
                        t["name"], t.get("description", ""), t.get("parameters") or {"type": "object", "properties": {}}
                    )
                    for t in record.client_tools
                ],
                options=record.options,
                iteration=record.iteration,
                usage=dict(record.usage),
            )
            if not record.input_committed:
                work.new_messages.append(
                    MessageRecord(
                        role="user", content=record.input.get("content", ""), turn_id=record.id, source=record.source
                    )
                )
            if accepting is not None:
                work.before_effects = partial(self._require_accepted, accepting)
            work.before_tools = partial(self._save_calls, record, work, controller)

            def emit(event: Any) -> None:
                self.lifecycle.check(lease)
                controller.apply(event)

            if lease.cancel_event.is_set():  # cancelled before it ran: nothing may run now
                if resume is not None:
                    await self._close_calls(record, work, emit)
                outcome = LoopOutcome("interrupted" if self._shutdown else "cancelled", "cancelled")
            else:
                drafts = self._schedule_draft(lease, controller, record.id, -1)
                self._loop_running = True  # from here a cancel cancels the worker (see cancel)
                try:
                    outcome = await deps.agent_loop.run(work, emit, resume.resolved if resume is not None else None)
                except asyncio.CancelledError:
                    if not self._loop_cancelled:
                        raise  # the worker itself is being torn down
                    outcome = LoopOutcome("interrupted" if self._shutdown else "cancelled", "cancelled")
                finally:
                    self._loop_running = False
                    if self._loop_cancelled:
                        self._loop_cancelled = False
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]  # ours, handled
                    drafts.cancel()
                    if self._draft_timer is not None:
                        self._draft_timer.cancel()
                        self._draft_timer = None
        except StaleLease:
            return
        except Exception as exc:
            log.exception("turn %s failed inside the server", record.id)
            outcome = LoopOutcome(
                "failed",
                "error",
                {"kind": "internal", "message": f"{type(exc).__name__}: {exc}", "retryable": False, "status": None},
            )
        if work is None:
            work = TurnWork(agent=None, conversation_id=self.conversation_id, turn_id=record.id, history=[])  # type: ignore[arg-type]
            if not record.input_committed:
                work.new_messages.append(
                    MessageRecord(
                        role="user", content=record.input.get("content", ""), turn_id=record.id, source=record.source
                    )
                )
        # The outcome is decided here, with no await since the loop returned: a cancel accepted
        # until now wins (the ack said so), any later one is refused.
        try:
            if self.lifecycle.settle(lease, pausing=outcome.status == "awaiting") and outcome.status not in (
                "cancelled",
                "interrupted",
            ):
                outcome = cancel_wins(work)
        except StaleLease:
            return
        not_accepted = await self._accepted(accepting)
        if not_accepted is not None:
            # Never accepted, so never acknowledged nor visible: nothing of it may be written.
            log.error("turn %s could not be accepted: %s", record.id, not_accepted)
            await self._finish(record, controller, lease, store_failure(not_accepted))
            return
        await self._finish(record, controller, lease, loop_end(record.id, work, outcome, controller.revision + 1))

    async def _save_calls(self, record: TurnRecord, work: TurnWork, controller: TurnController) -> None:
        """Before a server tool acts on the world, make the turn's messages so far (the assistant
        message with the calls about to run) durable: a server killed while the tool runs then
        leaves the call in history, and crash settle closes it ("interrupted, outcome unknown").
        Only turns that run a server tool pay this commit; the moved messages are not written
        again by `_finish`."""
        messages = list(work.new_messages)
        if not any(m.role == "assistant" and m.tool_calls for m in messages):
            return
        write = asyncio.ensure_future(
            self.deps.store.checkpoint_turn(
                self.conversation_id, record.id, messages, iteration=work.iteration, usage=dict(work.usage)
            )
        )
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait([write])  # a cancel must not leave it unknown whether they are stored
            if not write.cancelled() and write.exception() is None:
                self._saved(record, work, controller, messages)
            raise
        self._saved(record, work, controller, messages)

    def _saved(
        self, record: TurnRecord, work: TurnWork, controller: TurnController, messages: list[MessageRecord]
    ) -> None:
        record.input_committed = True
        work.history.extend(messages)
        work.new_messages = work.new_messages[len(messages) :]  # (nothing was added meanwhile)
        if self._history is not None:
            self._history.extend(messages)
        self._draft_base = len(controller.visible_text())

    async def _close_calls(self, record: TurnRecord, work: TurnWork, emit: Callable[[Any], None]) -> None:
        """A paused turn cancelled before it resumed: each of its calls gets its one result, from
        the answer it got, or saying it was cancelled."""
        await self._cancel_open_calls(record.id)
        answered = {m.tool_call_id for m in work.history if m.role == "tool"}
        for p in await self.deps.store.list_pending(record.id):
            if p.call_id in answered:
                continue
            if p.status == "approved":
                text, is_error = (
                    f"The call to {p.name} was approved, but the turn was cancelled before it ran; it was not executed.",
                    True,
                )
            else:
                text, is_error = resolution_text(p, self.deps.config), p.status != "result" or p.is_error
            emit(
                ToolCallStatus(
                    p.call_id,
                    "denied" if p.status == "denied" else "failed" if is_error else "completed",
                    text,
                    is_error,
                )
            )
            work.new_messages.append(
                MessageRecord(
                    role="tool",
                    content=text,
                    turn_id=record.id,
                    iteration=work.iteration,
                    tool_call_id=p.call_id,
                    name=p.name,
                    is_error=is_error,
                )
            )

    async def _cancel_open_calls(self, turn_id: str) -> None:
        store = self.deps.store
        for p in await store.list_pending(turn_id):
            if p.status == "pending":
                await store.resolve_pending(
                    self.conversation_id, p.call_id, "cancelled", reason=CANCELLED_UNANSWERED, is_error=True
                )

    def _schedule_draft(
        self, lease: Lease, controller: TurnController, turn_id: str, saved: int
    ) -> asyncio.TimerHandle:
        """Persist the visible text now and then, so a killed server keeps what was shown.

        A timer, not a task: most turns end before the first tick and then cost nothing.
        """
        interval = self.deps.config.limits.draft_interval_s
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if not self.lifecycle.is_current(lease):
                return
            nonlocal_saved = saved
            if controller.revision != saved and controller.visible_text():
                nonlocal_saved = controller.revision
                loop.create_task(self.deps.store.save_draft(turn_id, controller.draft(self._draft_base)))
            self._draft_timer = self._schedule_draft(lease, controller, turn_id, nonlocal_saved)

        return loop.call_later(interval, tick)

    async def _finish(self, record: TurnRecord, controller: TurnController, lease: Lease | None, end: TurnEnd) -> None:
        """The one place a turn (segment) ends: commit, then settle, then publish. `lease` is None
        only for a queued turn that never began (withdrawn): it holds no lifecycle."""
        commit = end.commit
        if commit is not None:
            try:
                await self.deps.store.commit_turn(self.conversation_id, commit)
            except Exception as exc:
                log.exception("could not commit turn %s", record.id)
                end = store_failure(exc)
                self._history = None
                self._chat.clear()
            else:
                record.input_committed = record.input_committed or commit.input_committed
                record.iteration = commit.iteration
                record.usage = dict(commit.usage)
                if self._history is not None:
                    self._history.extend(commit.messages)
        record.status = end.status
        if end.status == "awaiting" and commit is not None and lease is not None:
            self._awaiting = record
            controller.mark_pending_blocks(commit.pending)
            controller.pause(end.stop_reason, commit.pending)
            self.lifecycle.pause(lease)
            self._arm_expiry(commit.pending)
        else:
            controller.finish(SETTLED_SNAPSHOT_STATUS[end.status], end.stop_reason, end.error)
            if lease is not None:
                self.lifecycle.finish(lease)
        self.deps.settled(record, controller.snapshot())
        if end.status == "awaiting" and lease is not None and lease.cancel_event.is_set():
            self._take_paused(record, None)  # a cancel accepted while the pause was being saved

    # ------------------------------------------------------------ answers to pending calls

    async def respond(self, decisions: list[Decision]) -> list[dict[str, Any]]:
        if self.lifecycle.state != "awaiting" or self._awaiting is None:
            raise NotAwaiting(f"conversation {self.conversation_id} has no turn waiting for an answer")
        turn = self._awaiting
        results: list[dict[str, Any]] = []
        store = self.deps.store
        for d in decisions:
            p = await store.get_pending(self.conversation_id, d.call_id)
            if p is None or p.turn_id != turn.id:
                results.append(
                    {
                        "call_id": d.call_id,
                        "accepted": False,
                        "error": "unknown_call",
                        "message": f"no pending call {d.call_id} in this conversation",
                    }
                )
                continue
            if d.action in ("approve", "deny") and p.kind != "approval":
                raise InvalidInput(
                    f"call {d.call_id} is a client tool call: answer it with a tool result, not an approval"
                )
            if d.action == "result" and p.kind != "client":
                raise InvalidInput(f"call {d.call_id} needs an approval decision, not a tool result")
            if d.action not in ("approve", "deny", "result"):
                raise InvalidInput(f"unknown decision {d.action!r}: use approve, deny or a tool result")
            status = {"approve": "approved", "deny": "denied", "result": "result"}[d.action]
            won = await store.resolve_pending(
                self.conversation_id,
                d.call_id,
                status,
                output=d.output,
                is_error=d.is_error,
                reason=d.reason,
                decided_by=d.decided_by,
            )
            if won:
                results.append({"call_id": d.call_id, "accepted": True, "status": status})
            else:
                current = await store.get_pending(self.conversation_id, d.call_id)
                results.append(
                    {
                        "call_id": d.call_id,
                        "accepted": False,
                        "error": "already_resolved",
                        "status": current.status if current else None,
                        "message": f"call {d.call_id} was already answered ({current.status if current else 'gone'})",
                    }
                )
        await self._maybe_resume()
        return results

    async def _maybe_resume(self) -> None:
        """Resume the paused turn once every pending call is answered. The lease is taken with no
        await after the last read, so a cancel from then on cancels the resumed turn."""
        turn = self._awaiting
        if turn is None or self._resume is not None or self.lifecycle.state != "awaiting":
            return
        pending = await self.deps.store.list_pending(turn.id)
        if any(p.status == "pending" for p in pending):
            handle = self.handles.get(turn.id)
            if handle is not None:
                handle.controller.set_pending(pending)
            return
        done = {m.tool_call_id for m in await self.history() if m.role == "tool"}
        if self._awaiting is turn and self._resume is None and self.lifecycle.state == "awaiting":
            self._take_paused(turn, [p for p in pending if p.call_id not in done])

    def _take_paused(self, turn: TurnRecord, resolved: list[PendingCall] | None) -> None:
        """awaiting → active, synchronously: the paused turn now belongs to the worker, resumed
        with `resolved`, or (None) cancelled. Nothing else writes its results."""
        lease = self.lifecycle.begin(turn.id)
        if resolved is None:
            self.lifecycle.request_cancel()
        self._awaiting = None
        self._cancel_expiry()
        self._resume = _Resume(turn, lease, resolved)
        self._ensure_worker()

    def _arm_expiry(self, pending: list[PendingCall]) -> None:
        self._cancel_expiry()
        deadlines = [p.expires_at for p in pending if p.status == "pending" and p.expires_at is not None]
        if not deadlines:
            return
        delay = max(0.0, min(deadlines) - time.time()) + 0.01
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_later(delay, lambda: loop.create_task(self._on_expiry()))

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _on_expiry(self) -> None:
        self._expiry = None
        await self.expire_overdue()
        if self._awaiting is not None and self._resume is None and self.lifecycle.state == "awaiting":
            self._arm_expiry(await self.deps.store.list_pending(self._awaiting.id))

    async def expire_overdue(self) -> None:
        turn = self._awaiting
        if turn is None:
            return
        now = time.time()
        changed = False
        for p in await self.deps.store.list_pending(turn.id):
            if p.status == "pending" and p.expires_at is not None and p.expires_at <= now:
                reason = None
                if p.kind == "client":
                    reason = f"The client did not return a result for {p.name} within the tool timeout; the call has no result."
                changed |= await self.deps.store.resolve_pending(
                    self.conversation_id, p.call_id, "expired", reason=reason, is_error=True
                )
        if changed:
            await self._maybe_resume()

    # ------------------------------------------------------------ cancel

    async def cancel(self, *, shutdown: bool = False) -> bool:
        """Stop the running turn, or close the paused one. True only when the turn will end
        cancelled; False when nothing ran or its outcome was already decided (being saved)."""
        if shutdown:
            self._shutdown = True
        if self.lifecycle.state in ("active", "cancelling"):
            if self.lifecycle.request_cancel() is None:
                return False
            if self._loop_running and not self._loop_cancelled and self._worker is not None:
                self._loop_cancelled = True
                self._worker.cancel()  # lands inside the agent loop: _run turns it into the outcome
            return True  # not in the loop yet: _run sees the lease cancelled before it starts
        if self.lifecycle.state == "awaiting" and self._awaiting is not None and not shutdown:
            turn = self._awaiting
            self._take_paused(turn, None)
            # The open calls are answered now, so an answer that comes after this hears so.
            await self._cancel_open_calls(turn.id)
            return True
        if self.lifecycle.state == "idle" and self.queue and not shutdown:
            self.queue[0].cancelled = True  # the turn about to start (acknowledged as running)
            return True
        return False

    async def withdraw(self, turn_id: str) -> bool:
        """Drop a queued input that has not started (its HTTP client went away, DESIGN §13): closed
        as cancelled, nothing of it written to the history. False when it started or is unknown."""
        item = next((q for q in self.queue if q.record.id == turn_id and q.accepting is None), None)
        if item is None:
            return False
        self.queue.remove(item)  # before any await: the worker can no longer pick it
        for i, q in enumerate(self.queue):
            q.handle.controller.set_queue_position(i + 1)
        controller = item.handle.controller
        commit = TurnCommit(
            turn_id, "cancelled", "cancelled", [], revision=controller.revision + 1, input_committed=False
        )
        error = {
            "kind": "withdrawn",
            "message": "the client went away before this input started; it was dropped",
            "retryable": False,
            "status": None,
        }
        await self._finish(item.record, controller, None, TurnEnd("cancelled", "cancelled", error, commit))
        return True

    async def shutdown(self) -> None:
        self._shutdown = True
        self._cancel_expiry()
        await self.cancel(shutdown=True)
        worker = self._worker
        if worker is not None:
            try:
                await asyncio.wait_for(asyncio.shield(worker), 10)
            except (TimeoutError, asyncio.CancelledError):
                worker.cancel()


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


__all__ = ["ConversationRuntime"]
