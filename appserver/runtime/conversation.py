"""ConversationRuntime: one FIFO queue and one TurnLifecycle per conversation.

One turn at a time, in arrival order. A turn finishes exactly once, through `_finish`. Pending
calls live in the store; answers resume the same turn with tool results as the next messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from appserver.agent.loop import LoopOutcome, TurnWork, resolution_text
from appserver.errors import InvalidInput, NotAwaiting, NotFound, QueueFull
from appserver.providers.base import ToolSpec
from appserver.runtime.chatcache import ChatCache
from appserver.runtime.lifecycle import Lease, StaleLease, TurnLifecycle
from appserver.runtime.snapshot import TurnController
from appserver.store.base import DuplicateTurn, StoreError
from appserver.store.records import AgentRecord, MessageRecord, PendingCall, TurnCommit, TurnRecord

if TYPE_CHECKING:
    from appserver.runtime.kernel import Kernel

log = logging.getLogger("appserver.runtime")

SNAPSHOT_STATUS = {"completed": "completed", "cancelled": "cancelled", "failed": "failed", "interrupted": "cancelled"}
RECENT_HANDLES = 16


@dataclass(slots=True)
class TurnHandle:
    turn_id: str
    conversation_id: str
    controller: TurnController

    async def wait_settled(self, timeout: float | None = None, *, after_revision: int = -1) -> Any:
        return await self.controller.wait_settled(timeout, after_revision=after_revision)


@dataclass(slots=True, frozen=True)
class Decision:
    """An answer to a pending call: approve/deny (approvals) or a result (client tools)."""

    call_id: str
    action: str  # approve | deny | result
    output: str | None = None
    is_error: bool = False
    reason: str | None = None
    decided_by: str | None = None


@dataclass(slots=True)
class _Queued:
    record: TurnRecord
    handle: TurnHandle
    # An overlapped accept still committing (see enqueue `overlap`); None once it committed first.
    accepting: asyncio.Task[None] | None = None
    agent: AgentRecord | None = None  # the agent as the submitter just read it (overlapped only)


class ConversationRuntime:
    def __init__(self, kernel: Kernel, conversation_id: str, agent_id: str) -> None:
        self.kernel = kernel
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
        self._resume_ready: list[PendingCall] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._draft_timer: asyncio.TimerHandle | None = None
        self._shutdown = False
        self._accepting = 0  # inputs waiting for their accept to commit (they hold a queue place)

    # ------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        return not self.lifecycle.busy and not self.queue and self._worker is None and self.pins == 0 and self._accepting == 0

    @property
    def active_handle(self) -> TurnHandle | None:
        turn_id = self.lifecycle.turn_id
        return self.handles.get(turn_id) if turn_id else None

    @property
    def awaiting_turn(self) -> TurnRecord | None:
        return self._awaiting if self.lifecycle.state == "awaiting" else None

    async def load(self) -> None:
        """Adopt a paused turn from the store (survives restarts and other processes)."""
        awaiting = await self.kernel.store.list_turns(self.conversation_id, statuses=["awaiting"])
        if not awaiting:
            return
        turn = awaiting[-1]
        pending = await self.kernel.store.list_pending(turn.id)
        controller = await self.kernel.controller_from_store(turn, pending)
        self.handles[turn.id] = TurnHandle(turn.id, self.conversation_id, controller)
        self.lifecycle.restore_awaiting(turn.id)
        self._awaiting = turn
        await self._expire_overdue()
        if self.lifecycle.state == "awaiting" and self._resume_ready is None:
            await self._maybe_resume()
            self._arm_expiry(pending)

    def adopt_history(self, messages: list[MessageRecord]) -> None:
        """The whole history, from a caller that just wrote it (a new conversation): no store read."""
        if self._history is None:
            self._history = list(messages)

    async def history(self) -> list[MessageRecord]:
        if self._history is None:
            self._history = await self.kernel.store.list_messages(self.conversation_id)
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

    async def enqueue(self, record: TurnRecord, idempotency_scope: str | None, *, overlap: bool = False, agent: AgentRecord | None = None) -> tuple[TurnHandle, int]:
        """Queue an input once its accept committed.

        `overlap`: the caller acknowledges nothing before the turn settles (a non-stream HTTP
        reply), so a turn that runs at once may start before its accept commits: the accept then
        commits while the model call is in flight, the turn becomes visible (handles, watchers)
        only after it, and the turn's own commit waits for it. Without an idempotency scope only
        (a duplicate must be found before anything runs). `agent`: the record the submitter read
        just now, which such a turn then runs with instead of reading it again.
        """
        waiting = len(self.queue) + self._accepting
        if waiting >= self.kernel.config.limits.queue_max:
            raise QueueFull(f"conversation {self.conversation_id} has {waiting} inputs queued (limit {self.kernel.config.limits.queue_max}); try again later")
        position = waiting + (1 if self.lifecycle.busy else 0)
        record.status = "queued" if position else "running"
        record.owner = self.kernel.owner
        if position == 0:
            record.started_at = time.time()
        if overlap and position == 0 and idempotency_scope is None and self._worker is None and not self._shutdown:
            return self._queue_overlapped(record, agent), 0
        # The accept commits with the next group commit: until then this input holds its place.
        self._accepting += 1
        try:
            await self.kernel.store.accept_turn(record, idempotency_scope)  # raises DuplicateTurn
        except asyncio.CancelledError:
            # The commit may have landed just before the cancel reached us: queue the turn all the
            # same, or it would sit in the store as accepted with nobody to run it.
            self._accepting -= 1
            if await self.kernel.store.get_turn(record.id) is not None:
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
        await self.kernel.store.accept_turn(record, None)
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
        controller = TurnController(record.id, self.conversation_id, record.agent_id, phase="queued", queue_position=position)
        handle = TurnHandle(record.id, self.conversation_id, controller)
        self._remember(handle)
        self.queue.append(_Queued(record, handle))
        self._notify(handle)
        self._ensure_worker()
        return handle

    def _ensure_worker(self) -> None:
        if self._worker is None and not self._shutdown:
            self._worker = asyncio.get_running_loop().create_task(self._work(), name=f"conversation:{self.conversation_id}")

    async def _work(self) -> None:
        try:
            while not self._shutdown:
                if self.lifecycle.state == "awaiting":
                    if self._resume_ready is None or self._awaiting is None:
                        break
                    resolved, self._resume_ready = self._resume_ready, None
                    record = self._awaiting
                    handle = self.handles.get(record.id)
                    if handle is None:
                        controller = await self.kernel.controller_from_store(record, await self.kernel.store.list_pending(record.id))
                        handle = TurnHandle(record.id, self.conversation_id, controller)
                        self._remember(handle)
                    await self._run(record, handle, resolved)
                    continue
                if not self.queue:
                    break
                item = self.queue.popleft()
                for i, q in enumerate(self.queue):
                    q.handle.controller.set_queue_position(i + 1)
                await self._run(item.record, item.handle, None, item.accepting, item.agent)
        finally:
            self._worker = None
            self.last_active = time.monotonic()

    # ------------------------------------------------------------ run one turn (segment)

    async def _run(self, record: TurnRecord, handle: TurnHandle, resolutions: list[PendingCall] | None, accepting: asyncio.Task[None] | None = None, agent: AgentRecord | None = None) -> None:
        kernel = self.kernel
        controller = handle.controller
        lease = self.lifecycle.begin(record.id)
        if resolutions is not None:
            self._cancel_expiry()
            self._awaiting = None
            controller.resume()
            self._notify(handle)
        else:
            controller.set_queue_position(0)
        work: TurnWork | None = None
        try:
            if record.status != "running" or resolutions is not None:
                record.status = "running"
                await kernel.store.mark_turn_running(record.id, kernel.owner, controller.revision)
                self.lifecycle.check(lease)
            history = await self.history()
            self.lifecycle.check(lease)
            if agent is None:
                agent = await kernel.store.get_agent(record.agent_id)
                self.lifecycle.check(lease)
            if agent is None:
                raise NotFound(f"agent {record.agent_id} was deleted")
            work = TurnWork(
                agent=agent,
                conversation_id=self.conversation_id,
                turn_id=record.id,
                history=list(history),
                to_chat=self._chat,
                client_tools=[ToolSpec(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object", "properties": {}}) for t in record.client_tools],
                options=record.options,
                iteration=record.iteration,
                usage=dict(record.usage),
            )
            if not record.input_committed:
                work.new_messages.append(
                    MessageRecord(role="user", content=record.input.get("content", ""), turn_id=record.id, source=record.source)
                )
            if accepting is not None:
                work.before_effects = partial(self._require_accepted, accepting)

            def emit(event: Any) -> None:
                self.lifecycle.check(lease)
                controller.apply(event)

            drafts = self._schedule_draft(lease, controller, record.id, -1)
            self._loop_running = True
            try:
                outcome = await kernel.agent_loop.run(work, emit, resolutions)
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
            outcome = LoopOutcome("failed", "error", {"kind": "internal", "message": f"{type(exc).__name__}: {exc}", "retryable": False, "status": None})
        if work is None:
            work = TurnWork(agent=None, conversation_id=self.conversation_id, turn_id=record.id, history=[])  # type: ignore[arg-type]
            if not record.input_committed:
                work.new_messages.append(MessageRecord(role="user", content=record.input.get("content", ""), turn_id=record.id, source=record.source))
        not_accepted = await self._accepted(accepting)
        if not_accepted is not None:
            # Never accepted, so never acknowledged nor visible: nothing of it may be written.
            log.error("turn %s could not be accepted: %s", record.id, not_accepted)
            controller.finish("failed", "error", {"kind": "store", "message": f"the turn could not be saved: {not_accepted}", "retryable": False, "status": None})
            self.lifecycle.finish(lease)
            return
        await self._finish(lease, record, work, controller, outcome)

    def _schedule_draft(self, lease: Lease, controller: TurnController, turn_id: str, saved: int) -> asyncio.TimerHandle:
        """Persist the visible text now and then, so a killed server keeps what was shown.

        A timer, not a task: most turns end before the first tick and then cost nothing.
        """
        interval = self.kernel.config.limits.draft_interval_s
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if not self.lifecycle.is_current(lease):
                return
            nonlocal_saved = saved
            if controller.revision != saved and controller.visible_text():
                nonlocal_saved = controller.revision
                loop.create_task(self.kernel.store.save_draft(turn_id, controller.draft()))
            self._draft_timer = self._schedule_draft(lease, controller, turn_id, nonlocal_saved)

        return loop.call_later(interval, tick)

    async def _finish(self, lease: Lease, record: TurnRecord, work: TurnWork, controller: TurnController, outcome: LoopOutcome) -> None:
        """The one place a turn (segment) ends: commit, then publish, then release the lifecycle."""
        status, stop_reason, error = outcome.status, outcome.stop_reason, outcome.error
        messages = work.new_messages
        if status in ("cancelled", "interrupted", "failed"):
            messages = settle_messages(work, "interrupted" if status == "interrupted" else "cancelled" if status == "cancelled" else "incomplete")
        if stop_reason == "end_turn" and messages:
            last = [m for m in messages if m.role == "assistant"]
            if last and last[-1].tool_calls:
                status, stop_reason = "failed", "error"
                error = {"kind": "internal", "message": "the turn streamed a tool call but tried to end with end_turn", "retryable": False, "status": None}
        pending = work.pending if status == "awaiting" else []
        commit = TurnCommit(
            turn_id=record.id,
            status=status,  # type: ignore[arg-type]
            stop_reason=stop_reason,
            messages=messages,
            pending=pending,
            error=error,
            usage=dict(work.usage),
            revision=controller.revision + 1,
            iteration=work.iteration,
        )
        try:
            await self.kernel.store.commit_turn(self.conversation_id, commit)
        except Exception as exc:
            log.exception("could not commit turn %s", record.id)
            controller.finish("failed", "error", {"kind": "store", "message": f"the turn could not be saved: {exc}", "retryable": False, "status": None})
            self.lifecycle.finish(lease)
            self._history = None
            self._chat.clear()
            return
        record.input_committed = True
        record.iteration = work.iteration
        record.usage = dict(work.usage)
        record.status = status  # type: ignore[assignment]
        if self._history is not None:
            self._history.extend(messages)
        if status == "awaiting":
            self._awaiting = record
            controller.mark_pending_blocks(pending)
            controller.pause(stop_reason, pending)
            self.lifecycle.pause(lease)
            self._arm_expiry(pending)
        else:
            controller.finish(SNAPSHOT_STATUS[status], stop_reason, error)
            self.lifecycle.finish(lease)
        self.kernel.turn_settled(record, controller.snapshot())

    # ------------------------------------------------------------ answers to pending calls

    async def respond(self, decisions: list[Decision]) -> list[dict[str, Any]]:
        if self.lifecycle.state != "awaiting" or self._awaiting is None:
            raise NotAwaiting(f"conversation {self.conversation_id} has no turn waiting for an answer")
        turn = self._awaiting
        results: list[dict[str, Any]] = []
        store = self.kernel.store
        for d in decisions:
            p = await store.get_pending(self.conversation_id, d.call_id)
            if p is None or p.turn_id != turn.id:
                results.append({"call_id": d.call_id, "accepted": False, "error": "unknown_call", "message": f"no pending call {d.call_id} in this conversation"})
                continue
            if d.action in ("approve", "deny") and p.kind != "approval":
                raise InvalidInput(f"call {d.call_id} is a client tool call: answer it with a tool result, not an approval")
            if d.action == "result" and p.kind != "client":
                raise InvalidInput(f"call {d.call_id} needs an approval decision, not a tool result")
            if d.action not in ("approve", "deny", "result"):
                raise InvalidInput(f"unknown decision {d.action!r}: use approve, deny or a tool result")
            status = {"approve": "approved", "deny": "denied", "result": "result"}[d.action]
            won = await store.resolve_pending(self.conversation_id, d.call_id, status, output=d.output, is_error=d.is_error, reason=d.reason, decided_by=d.decided_by)
            if won:
                results.append({"call_id": d.call_id, "accepted": True, "status": status})
            else:
                current = await store.get_pending(self.conversation_id, d.call_id)
                results.append({"call_id": d.call_id, "accepted": False, "error": "already_resolved", "status": current.status if current else None, "message": f"call {d.call_id} was already answered ({current.status if current else 'gone'})"})
        await self._maybe_resume()
        return results

    async def _maybe_resume(self) -> None:
        turn = self._awaiting
        if turn is None or self._resume_ready is not None or self.lifecycle.state != "awaiting":
            return
        pending = await self.kernel.store.list_pending(turn.id)
        handle = self.handles.get(turn.id)
        if any(p.status == "pending" for p in pending):
            if handle is not None:
                handle.controller.set_pending(pending)
            return
        done = {m.tool_call_id for m in await self.history() if m.role == "tool"}
        self._resume_ready = [p for p in pending if p.call_id not in done]
        self._cancel_expiry()
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
        await self._expire_overdue()
        if self._awaiting is not None and self._resume_ready is None:
            self._arm_expiry(await self.kernel.store.list_pending(self._awaiting.id))

    async def _expire_overdue(self) -> None:
        turn = self._awaiting
        if turn is None:
            return
        now = time.time()
        changed = False
        for p in await self.kernel.store.list_pending(turn.id):
            if p.status == "pending" and p.expires_at is not None and p.expires_at <= now:
                reason = None
                if p.kind == "client":
                    reason = f"The client did not return a result for {p.name} within the tool timeout; the call has no result."
                changed |= await self.kernel.store.resolve_pending(self.conversation_id, p.call_id, "expired", reason=reason, is_error=True)
        if changed:
            await self._maybe_resume()

    # ------------------------------------------------------------ cancel

    async def cancel(self, *, shutdown: bool = False) -> bool:
        if shutdown:
            self._shutdown = True
        if self.lifecycle.state in ("active", "cancelling"):
            self.lifecycle.request_cancel()
            if self._loop_running and not self._loop_cancelled and self._worker is not None:
                self._loop_cancelled = True
                self._worker.cancel()  # lands inside the agent loop: _run turns it into the outcome
            return True
        if self.lifecycle.state == "awaiting" and self._awaiting is not None and not shutdown:
            await self._cancel_awaiting(self._awaiting)
            return True
        return False

    async def _cancel_awaiting(self, turn: TurnRecord) -> None:
        store = self.kernel.store
        for p in await store.list_pending(turn.id):
            if p.status == "pending":
                await store.resolve_pending(self.conversation_id, p.call_id, "cancelled", reason="The turn was cancelled before this call was answered; it was not executed.", is_error=True)
        pending = await store.list_pending(turn.id)
        done = {m.tool_call_id for m in await self.history() if m.role == "tool"}
        messages = [
            MessageRecord(role="tool", content=resolution_text(p, self.kernel.config), turn_id=turn.id, iteration=turn.iteration, tool_call_id=p.call_id, name=p.name, is_error=True)
            for p in pending
            if p.call_id not in done
        ]
        handle = self.handles.get(turn.id)
        controller = handle.controller if handle else await self.kernel.controller_from_store(turn, pending)
        await store.commit_turn(self.conversation_id, TurnCommit(turn.id, "cancelled", "cancelled", messages, revision=controller.revision + 1, iteration=turn.iteration, usage=dict(turn.usage)))
        if self._history is not None:
            self._history.extend(messages)
        self._cancel_expiry()
        self._awaiting = None
        self._resume_ready = None
        self.lifecycle.drop_awaiting(turn.id)
        controller.finish("cancelled", "cancelled")
        turn.status = "cancelled"
        self.kernel.turn_settled(turn, controller.snapshot())
        self._ensure_worker()

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


def settle_messages(work: TurnWork, completion_status: str) -> list[MessageRecord]:
    """Messages to keep from a turn that stopped early, valid for every provider.

    Visible assistant text is kept (marked with `completion_status`); reasoning-only output is not;
    every tool call without a result gets a synthetic error result.
    """
    messages = list(work.new_messages)
    partial = work.partial
    if partial is not None and "".join(partial.text):
        messages.append(
            MessageRecord(role="assistant", content="".join(partial.text), turn_id=work.turn_id, iteration=work.iteration, completion_status=completion_status)
        )
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    answered |= {m.tool_call_id for m in work.history if m.role == "tool"}
    out: list[MessageRecord] = []
    for m in work.history:  # a resumed turn: calls committed at the pause, answered but never run
        if m.role == "assistant" and m.turn_id == work.turn_id:
            for c in m.tool_calls:
                if c["id"] not in answered:
                    answered.add(c["id"])
                    out.append(
                        MessageRecord(role="tool", content=f"The call to {c['name']} was stopped before it returned a result.", turn_id=work.turn_id, iteration=m.iteration, tool_call_id=c["id"], name=c["name"], is_error=True)
                    )
    for m in messages:
        out.append(m)
        if m.role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                if c["id"] not in answered:
                    answered.add(c["id"])
                    out.append(
                        MessageRecord(role="tool", content=f"The call to {c['name']} was stopped before it returned a result.", turn_id=work.turn_id, iteration=m.iteration, tool_call_id=c["id"], name=c["name"], is_error=True)
                    )
    # Results that were produced for calls of this turn stay after their call, in order.
    return out


__all__ = ["ConversationRuntime", "Decision", "DuplicateTurn", "TurnHandle", "settle_messages"]
