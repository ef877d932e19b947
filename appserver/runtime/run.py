"""Running one turn (segment) through the agent loop, inside the conversation's worker task.

`TurnRunner.run` takes the turn's lease, builds its `TurnWork`, runs `AgentLoop.run` (a cancel
cancels the worker while the loop runs; `run` turns that into the outcome), decides the outcome
with no await after the loop returned, and ends in `finish_turn` (runtime/finish.py). Only the
worker runs it, so only the worker writes a turn's messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from appserver.agent.loop import LoopOutcome, TurnWork
from appserver.providers.base import ToolSpec
from appserver.providers.registry import ModelStringError
from appserver.runtime.board import TurnBoard
from appserver.runtime.deps import RuntimeDeps
from appserver.runtime.finish import Finished, Seat, finish_turn
from appserver.runtime.handle import TurnHandle
from appserver.runtime.history import History, last_input, model_view
from appserver.runtime.lifecycle import Lease, StaleLease, TurnLifecycle
from appserver.runtime.pending import PendingAnswers, Resume
from appserver.runtime.settle import (
    CANCELLED_UNANSWERED,
    LEFT_UNSEEN,
    TurnEnd,
    cancel_ack,
    cancel_wins,
    damaged,
    deleted,
    halted,
    input_messages,
    left_unseen,
    loop_end,
    store_failure,
    withdrawn,
)
from appserver.runtime.snapshot import TurnController
from appserver.store.base import ConversationGone, StoreError, StoreUnavailable, TurnSettledElsewhere
from appserver.store.integrity import damage_text, is_corruption
from appserver.store.records import AgentRecord, MessageRecord, TurnRecord

log = logging.getLogger("appserver.runtime")


async def accept_failure(accepting: asyncio.Task[None] | None) -> BaseException | None:
    """Wait for an overlapped accept (see TurnQueue.enqueue `overlap`): None once committed (or
    when there is none), else why it was not."""
    if accepting is None:
        return None
    try:
        await asyncio.shield(accepting)
    except asyncio.CancelledError:
        if not accepting.cancelled():
            raise  # this worker is being torn down
        return StoreError("the accept was cancelled")
    except Exception as exc:
        return exc
    return None


async def require_accepted(accepting: asyncio.Task[None]) -> None:
    not_accepted = await accept_failure(accepting)
    if not_accepted is not None:
        raise StoreError(f"the turn could not be saved before its tools ran: {not_accepted}")


def rerun_of(record: TurnRecord, history: list[MessageRecord]) -> str | None:
    """The turn whose input `record` re-runs (`Kernel._rerun`), when that input is still the
    history's last: the model answers it, without the cut-off reply before (`model_view`)."""
    earlier = record.input.get("rerun_of")
    if not isinstance(earlier, str) or last_input(history) != earlier:
        return None
    return earlier


def lost_rerun(record: TurnRecord, history: list[MessageRecord], rerun: str | None) -> bool:
    """A re-run accepted right after the input it re-runs that finds another input after it when
    it begins (another server of a cluster accepted one first): its input is written as any
    turn's, or it would answer the other one."""
    if not isinstance(record.input.get("rerun_of"), str) or rerun is not None:
        return False
    return not any(m.turn_id == record.id for m in history)


class TurnRunner:
    def __init__(
        self,
        deps: RuntimeDeps,
        conversation_id: str,
        lifecycle: TurnLifecycle,
        board: TurnBoard,
        history: History,
        answers: PendingAnswers,
        stopping: Callable[[], bool],
    ) -> None:
        self._deps = deps
        self._conversation_id = conversation_id
        self._lifecycle = lifecycle
        self._board = board
        self._history = history
        self._answers = answers
        self._stopping = stopping  # the runtime shuts down: a cancelled turn ends interrupted
        self._seat = Seat(history, lifecycle, answers)
        # The agent loop runs inside the worker task (no task per turn); cancel_loop() cancels the
        # worker while the loop runs, and run() tells that apart from the worker being torn down.
        self._loop_running = False
        self._loop_cancelled = False
        self._draft_base = 0  # visible characters of the running turn already in history
        self._draft_timer: asyncio.TimerHandle | None = None
        # Draft writes in flight: kept here, as the event loop holds a task only weakly (an
        # unreferenced one may be collected mid-write).
        self._draft_writes: set[asyncio.Task[None]] = set()
        self._draft_failed = ""  # the turn whose failed draft was already logged as a warning
        # The segment the agent loop runs now (under `_work_lease`), its overlapped accept, and
        # whether its calls are being saved before its tools run: what a cancel saves
        # (`save_cancel`). Cleared when the loop returns: the work holds this runner (its
        # callbacks), a cycle that must not outlive the turn.
        self._work: TurnWork | None = None
        self._work_lease: Lease | None = None
        self._work_accepting: asyncio.Task[None] | None = None
        self._saving_calls = False
        # Why this conversation no longer exists in the store (its agent was deleted by another
        # process), once known: every turn it still holds ends failed at once, nothing written.
        self.gone: str | None = None

    def cancel_loop(self, worker: asyncio.Task[None] | None) -> None:
        """A cancel was accepted: if the agent loop runs, cancel the worker it runs in (the cancel
        lands inside the loop and becomes the outcome); if not yet, `run` sees the lease cancelled."""
        if self._loop_running and not self._loop_cancelled and worker is not None:
            self._loop_cancelled = True
            worker.cancel()

    async def save_cancel(
        self, turn_id: str, lease: Lease | None = None, accepting: asyncio.Task[None] | None = None
    ) -> None:
        """Save a cancel just accepted for turn `turn_id` with the turn (`Store.record_cancel`), before
        it is acknowledged: a crash from then on leaves the turn to end cancelled at the next start,
        as it ends here (acknowledged = committed). `lease`: the turn's, when it runs or its pause is
        being closed; what its running segment did so far is taken now, before any await (which
        calls began, its text: `cancel_ack`). `accepting`: its overlapped accept, waited for first
        (the turn's row exists once it committed)."""
        work: TurnWork | None = None
        draft: dict[str, Any] | None = None
        unseen = False
        if lease is not None:
            lease.client_cancel = True
            if self._work_lease is lease:
                work, accepting = self._work, self._work_accepting
                handle = self._board.handles.get(turn_id)
                # (while its calls are being saved the stored draft is cleared, its text moving to
                # the history: saved again, that text would be kept twice)
                if work is not None and handle is not None and not self._saving_calls:
                    draft = handle.controller.draft(self._draft_base)
                unseen = (
                    lease.left_only
                    and handle is not None
                    and not self._saving_calls
                    and left_unseen(work, handle.controller.snapshot().blocks)
                )
        ack = cancel_ack(work)
        if unseen:
            ack["withdraw"] = True  # a restart withdraws its input too (kernel `_settle_left`)
        await accept_failure(accepting)  # never accepted: nothing to save (nothing of it is written)
        await self._deps.store.record_cancel(
            turn_id, ack, reason=CANCELLED_UNANSWERED, draft=draft if draft and draft["text"] else None
        )

    async def finish(
        self, record: TurnRecord, controller: TurnController, lease: Lease | None, end: TurnEnd
    ) -> Finished:
        """`finish_turn` in this conversation."""
        deps = self._deps
        return await finish_turn(
            deps.store, deps.settled, record, controller, end, seat=self._seat, lease=lease, cut_off=deps.cut_off
        )

    async def run(
        self,
        record: TurnRecord,
        handle: TurnHandle,
        resume: Resume | None = None,
        accepting: asyncio.Task[None] | None = None,
        agent: AgentRecord | None = None,
        *,
        cancelled: bool = False,
    ) -> None:
        """Run one turn segment: a queued turn (`cancelled`: cancelled before it began), or a
        paused one under the lease `PendingAnswers.take` took for it (resumed, or closed when that
        lease was cancelled). Ends in `finish_turn`."""
        deps = self._deps
        lifecycle = self._lifecycle
        controller = handle.controller
        if resume is None:
            lease = lifecycle.begin(record.id)
            if cancelled:  # by a client (or so acknowledged before a restart: TurnQueue.requeue)
                lifecycle.request_cancel()
                lease.client_cancel = True
            controller.set_queue_position(0)
        else:
            lease = resume.lease
            controller.resume("finalizing" if lease.cancel_event.is_set() else "acting")
            self._board.notify(handle)
        self._draft_base = len(controller.visible_text())  # a resumed turn's earlier text is stored
        if self.gone is not None:
            await accept_failure(accepting)
            try:
                lifecycle.settle(lease, pausing=False)
            except StaleLease:
                return
            await self.finish(record, controller, lease, deleted(self.gone))
            return
        if record.damaged:
            await self._end_damaged(record, controller, lease, resumed=resume is not None)
            return
        work: TurnWork | None = None
        elsewhere: TurnSettledElsewhere | None = None
        self._work_lease, self._work_accepting = lease, accepting
        try:
            if resume is not None or (record.status != "running" and not lease.cancel_event.is_set()):
                # A resumed turn leaves its pause in the store first, even when a cancel already
                # came: a crash from here on settles it (cancelled, when the cancel was saved
                # with it: `save_cancel`), never resumes it.
                record.status = "running"
                await deps.store.mark_turn_running(record.id, deps.owner, controller.revision)
                lifecycle.check(lease)
            history = await self._history.read()
            lifecycle.check(lease)
            if agent is None:
                agent = await deps.store.get_agent(record.agent_id)
                lifecycle.check(lease)
            if agent is None:  # deleted, and the conversation with it (by another process)
                self.gone = f"its agent {record.agent_id} was deleted"
                raise ConversationGone(self._conversation_id)
            rerun = rerun_of(record, history) if resume is None else None
            work = TurnWork(
                agent=agent,
                conversation_id=self._conversation_id,
                turn_id=record.id,
                history=model_view(history, rerun),
                to_chat=self._history.chat,
                client_tools=[ToolSpec.from_record(t) for t in record.client_tools] if record.client_tools else [],
                options=record.options,
                iteration=record.iteration,
                usage=dict(record.usage),
            )
            if not record.input_committed or (resume is None and lost_rerun(record, history, rerun)):
                work.new_messages.extend(input_messages(record))
            if accepting is not None:
                work.before_effects = partial(require_accepted, accepting)
            work.before_tools = partial(self._save_calls, record, controller)
            self._work = work

            def emit(event: Any) -> None:
                lifecycle.check(lease)
                controller.apply(event)

            if lease.cancel_event.is_set():  # cancelled before it ran: nothing may run now
                if resume is not None:
                    await self._answers.close_calls(record, work, emit)
                outcome = halted(self._stopping() and not lease.client_cancel)
            else:
                drafts = self._schedule_draft(lease, controller, record.id, -1)
                self._loop_running = True  # from here a cancel cancels the worker (see cancel_loop)
                try:
                    outcome = await deps.agent_loop.run(work, emit, resume.resolved if resume is not None else None)
                except asyncio.CancelledError:
                    if not self._loop_cancelled:
                        raise  # the worker itself is being torn down
                    outcome = halted(self._stopping() and not lease.client_cancel)
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
        except TurnSettledElsewhere as exc:
            # Another server of the cluster took the conversation over: it runs or settled this
            # turn, and nothing of it may be written from here.
            log.warning("turn %s not run here: %s", record.id, exc)
            elsewhere = exc
            outcome = LoopOutcome("failed", "error", store_failure(exc).error)
        except ModelStringError as exc:
            # The agent names a provider this server did not load: config.toml changed after the
            # start (the CLI reads the new file), or the agent was written by another server.
            why = f"{exc}; providers added to config.toml are loaded at the next start of the server"
            log.error("turn %s not run: %s", record.id, why)
            outcome = LoopOutcome(
                "failed", "error", {"kind": "config", "message": why, "retryable": False, "status": None}
            )
        except (ConversationGone, StoreUnavailable) as exc:
            # Deleted while it ran (a checkpoint before a tool could not be saved): the commit in
            # finish_turn fails the same way and says so in one line.
            outcome = LoopOutcome("failed", "error", store_failure(exc).error)
        except Exception as exc:
            deps.store.note_failure(exc)  # a damaged store file says so in /readyz
            if is_corruption(exc):  # one line: a traceback would only repeat it (with the damaged bytes)
                why = f"the store is damaged: {damage_text(exc)}"
                log.error("turn %s failed: %s", record.id, why)
            else:
                log.exception("turn %s failed inside the server", record.id)
                why = f"{type(exc).__name__}: {exc}"
            outcome = LoopOutcome(
                "failed", "error", {"kind": "internal", "message": why, "retryable": False, "status": None}
            )
        finally:
            self._work = self._work_lease = self._work_accepting = None
        if work is None:
            work = TurnWork(agent=None, conversation_id=self._conversation_id, turn_id=record.id, history=[])  # type: ignore[arg-type]
            if not record.input_committed:
                work.new_messages.extend(input_messages(record))
        # The outcome is decided here, with no await since the loop returned: a cancel accepted
        # until now wins (the ack said so), any later one is refused.
        try:
            if lifecycle.settle(lease, pausing=outcome.status == "awaiting") and outcome.status not in (
                "cancelled",
                "interrupted",
            ):
                outcome = cancel_wins(work)
        except StaleLease:
            return
        not_accepted = await accept_failure(accepting)
        refused: TurnSettledElsewhere | None = None
        if self.gone is not None:
            end = deleted(self.gone)
        elif elsewhere is not None:
            end, refused = store_failure(elsewhere), elsewhere  # ended elsewhere: finish_turn publishes that end
        elif not_accepted is not None:
            # Never accepted, so never acknowledged nor visible: nothing of it may be written.
            log.error("turn %s could not be accepted: %s", record.id, not_accepted)
            end = store_failure(not_accepted)
        elif (
            outcome.status == "cancelled"
            and lease.left_only
            and resume is None
            and not record.input_committed
            and left_unseen(work, controller.snapshot().blocks)
        ):
            # Its HTTP client left before it showed or did anything: nothing of it is kept, as of
            # an input withdrawn from the queue (the client's retry adds the input once).
            log.info("withdrew turn %s of conversation %s: %s", record.id, self._conversation_id, LEFT_UNSEEN)
            end = withdrawn(record.id, controller.revision + 1, LEFT_UNSEEN, usage=work.usage, iteration=work.iteration)
        else:
            end = loop_end(record.id, work, outcome, controller.revision + 1)
        await finish_turn(
            deps.store,
            deps.settled,
            record,
            controller,
            end,
            seat=self._seat,
            lease=lease,
            refused=refused,
            cut_off=deps.cut_off,
        )

    async def _end_damaged(
        self, record: TurnRecord, controller: TurnController, lease: Lease, *, resumed: bool
    ) -> None:
        """End, never run, a turn read back with damaged input, client tools or options (rows.py
        `TurnRecord.damaged`: the stand-ins would be the prompt, the client's tools, the
        instructions): failed through `finish_turn`, naming what is damaged, nothing of those
        values written. Whatever brings it here (requeued at a start or by a cluster take-over,
        or resumed by an answer after a restart) ends it so."""
        history: list[MessageRecord] = []
        if resumed:  # its calls are closed in the history, as every stopped turn's are
            try:
                history = list(await self._history.read())
            except Exception as exc:  # its calls stay open; the commit below says what the store does
                self._deps.store.note_failure(exc)
                log.error("turn %s: its history could not be read: %s", record.id, exc)
        try:
            self._lifecycle.settle(lease, pausing=False)
        except StaleLease:
            return
        store = "the PostgreSQL database" if self._deps.config.store.url else "appserver.db"
        end = damaged(record, history, controller.revision + 1, store)
        log.error("turn %s failed: %s", record.id, (end.error or {}).get("message"))
        await self.finish(record, controller, lease, end)

    async def _save_calls(self, record: TurnRecord, controller: TurnController, work: TurnWork) -> None:
        """Before a server tool acts on the world, make the turn's messages so far (the assistant
        message with the calls about to run) durable: a server killed while the tool runs then
        leaves the call in history, and crash settle closes it ("interrupted, outcome unknown").
        Only turns that run a server tool pay this commit; the moved messages are not written
        again by `finish_turn`."""
        messages = list(work.new_messages)
        if not any(m.role == "assistant" and m.tool_calls for m in messages):
            return
        write = asyncio.ensure_future(
            self._deps.store.checkpoint_turn(
                self._conversation_id, record.id, messages, iteration=work.iteration, usage=dict(work.usage)
            )
        )
        self._saving_calls = True
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait([write])  # a cancel must not leave it unknown whether they are stored
            if not write.cancelled() and write.exception() is None:
                self._saved(record, work, controller, messages)
            raise
        finally:
            self._saving_calls = False
        self._saved(record, work, controller, messages)

    def _saved(
        self, record: TurnRecord, work: TurnWork, controller: TurnController, messages: list[MessageRecord]
    ) -> None:
        record.input_committed = True
        work.history.extend(messages)
        work.new_messages = work.new_messages[len(messages) :]  # (nothing was added meanwhile)
        self._history.extend(messages)
        self._draft_base = len(controller.visible_text())

    def _schedule_draft(
        self, lease: Lease, controller: TurnController, turn_id: str, saved: int
    ) -> asyncio.TimerHandle:
        """Persist the visible text now and then, so a killed server keeps what was shown.

        A timer, not a task: most turns end before the first tick and then cost nothing.
        """
        interval = self._deps.config.limits.draft_interval_s
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if not self._lifecycle.is_current(lease):
                return
            nonlocal_saved = saved
            if controller.revision != saved and controller.visible_text():
                nonlocal_saved = controller.revision
                self._save_draft(turn_id, controller.draft(self._draft_base))
            self._draft_timer = self._schedule_draft(lease, controller, turn_id, nonlocal_saved)

        return loop.call_later(interval, tick)

    def _save_draft(self, turn_id: str, draft: dict[str, Any]) -> None:
        """Write a draft in the background: the turn never waits on a best-effort checkpoint."""
        task = asyncio.get_running_loop().create_task(self._deps.store.save_draft(turn_id, draft))
        self._draft_writes.add(task)
        task.add_done_callback(partial(self._draft_written, turn_id))

    def _draft_written(self, turn_id: str, task: asyncio.Task[None]) -> None:
        """A failed draft is one log line, not an ERROR traceback: the turn goes on and its text is
        stored when it ends. A warning for a turn's first failure; later ones (an outage fails every
        tick) at debug."""
        self._draft_writes.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        level = logging.DEBUG if self._draft_failed == turn_id else logging.WARNING
        self._draft_failed = turn_id
        reason = " ".join(str(exc).split()) or "no detail"
        log.log(level, "turn %s: draft not saved, the turn goes on (%s: %s)", turn_id, type(exc).__name__, reason)


__all__ = ["TurnRunner", "accept_failure", "require_accepted"]
