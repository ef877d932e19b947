"""ConversationRuntime: one conversation's turns, one at a time, in arrival order.

It wires the pieces, each the only owner of its state, and is the face the kernel and `Watch` use:
`lifecycle`, a `TurnLifecycle` (runtime/lifecycle.py: idle | active | awaiting | cancelling, and
the lease); `queue`, a `TurnQueue` (runtime/queue.py: admission, the FIFO, the worker task; the
kernel submits and requeues through it); `PendingAnswers` (runtime/pending.py: the paused turn,
its answers and deadlines); `TurnRunner` (runtime/run.py: a turn through the agent loop, ended by
`finish_turn` in runtime/finish.py); `TurnBoard` (runtime/board.py: handles and watchers) and
`History` (runtime/history.py: the messages in memory)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from appserver.runtime.board import TurnBoard
from appserver.runtime.deps import RuntimeDeps
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.history import History, last_input
from appserver.runtime.lifecycle import Lease, TurnLifecycle
from appserver.runtime.pending import PendingAnswers
from appserver.runtime.queue import TurnQueue
from appserver.runtime.run import TurnRunner
from appserver.runtime.snapshot import TurnController
from appserver.store.records import MessageRecord, TurnRecord, TurnSettings


class _BackRef:
    """The runtime as its parts call back into it: through a weak reference, so a runtime and its
    parts hold no reference cycle and an evicted runtime is freed at once by reference counting,
    not left for a full garbage collection (which walked every evicted runtime still in memory and
    paused the loop for tens of milliseconds under load)."""

    __slots__ = ("_ref",)

    def __init__(self, runtime: ConversationRuntime) -> None:
        self._ref = weakref.ref(runtime)

    def live_turns(self) -> set[str | None]:
        rt = self._ref()
        return set() if rt is None else rt._live_turns()

    def wake_worker(self) -> None:
        rt = self._ref()
        if rt is not None:
            rt.queue.ensure_worker()

    def stopping(self) -> bool:
        rt = self._ref()
        return rt is None or rt.queue.closed


class ConversationRuntime:
    def __init__(self, deps: RuntimeDeps, conversation_id: str, agent_id: str) -> None:
        self.deps = deps
        self.conversation_id = conversation_id
        self.agent_id = agent_id
        self.pins = 0
        self.lifecycle = TurnLifecycle()
        self._history = History(deps.store, conversation_id)
        back = _BackRef(self)
        self._board = TurnBoard(back.live_turns)
        self._answers = PendingAnswers(
            deps, conversation_id, self.lifecycle, self._board, self._history, back.wake_worker
        )
        self._runner = TurnRunner(
            deps, conversation_id, self.lifecycle, self._board, self._history, self._answers, back.stopping
        )
        self.queue = TurnQueue(deps, conversation_id, self.lifecycle, self._board, self._answers, self._runner)
        self.handles: dict[str, TurnHandle] = self._board.handles
        self.watchers: list[Callable[[TurnHandle], None]] = self._board.watchers

    def _live_turns(self) -> set[str | None]:
        return {*self.queue.turn_ids(), self.lifecycle.turn_id}

    # ------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        queue = self.queue
        return (
            not self.lifecycle.busy and not queue and queue.worker is None and self.pins == 0 and queue.accepting == 0
        )

    @property
    def in_flight(self) -> bool:
        """A turn runs, is being cancelled, or waits in the queue (or for its accept): the
        conversation is moving past its stored head. A turn paused for answers is not in flight."""
        return self.lifecycle.state in ("active", "cancelling") or bool(self.queue) or self.queue.accepting > 0

    @property
    def last_active(self) -> float:
        return self.queue.last_active

    @property
    def active_handle(self) -> TurnHandle | None:
        turn_id = self.lifecycle.turn_id
        return self.handles.get(turn_id) if turn_id else None

    @property
    def awaiting_turn(self) -> TurnRecord | None:
        return self._answers.turn

    @property
    def _worker(self) -> asyncio.Task[None] | None:
        """The worker task, while one runs (tests look at it)."""
        return self.queue.worker

    async def load(self) -> None:
        """Adopt a paused turn from the store (survives restarts and other processes)."""
        await self._answers.load()

    async def ends_with(self, turn_id: str) -> bool:
        """Turn `turn_id`'s input is the history's last (`last_input`), and nothing runs, waits or
        is queued here: a new turn accepted before the next await runs right after it, with no
        other input between (`Kernel._rerun`)."""
        history = await self._history.read()
        return last_input(history) == turn_id and not self.holds_turns

    async def until_left(self, turn_id: str, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until turn `turn_id` no longer runs, waits or is queued
        here. Its end is in the store before its runtime is past it (a cancelled turn still writing
        its cut-off reply): a keyed repeat asks whether to re-run it only once it is out of the
        way (`Kernel._rerunnable`), not while it finishes. False when it is still here."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while turn_id in self._live_turns():
            left = end - loop.time()
            if left <= 0:
                return False
            handle = self.handles.get(turn_id)
            try:
                if handle is not None:
                    await handle.wait_settled(left)  # at once unless it runs
                if turn_id in self._live_turns():  # queued, paused, or settled but not yet let go
                    await asyncio.sleep(min(left, 0.01))
            except TimeoutError:
                return False
        return True

    def adopt_history(self, messages: list[MessageRecord]) -> None:
        """The whole history, from a caller that just wrote it (a new conversation): no store read."""
        self._history.adopt(messages)

    # ------------------------------------------------------------ answers to pending calls

    async def respond(
        self,
        decisions: list[Decision],
        *,
        whole: bool = False,
        settings: TurnSettings | None = None,
        keep: tuple[str, ...] = (),
    ) -> list[dict[str, Any]]:
        return await self._answers.respond(decisions, whole=whole, settings=settings, keep=keep)

    async def expire_overdue(self) -> None:
        await self._answers.expire_overdue()

    # ------------------------------------------------------------ cancel

    async def cancel(self, *, shutdown: bool = False, client_left: bool = False) -> bool:
        """Stop the running turn, close the paused one, or cancel the one about to start: the one
        door every front end's cancel comes through (Kernel.cancel). True only when the turn will
        end cancelled, and then only once that is saved with the turn (`TurnRunner.save_cancel`):
        acknowledged = committed, so a crash right after still ends it cancelled. False when
        nothing ran or its outcome was already decided (being saved). `shutdown`: the server's
        stop, which saves nothing (its turns end interrupted). `client_left`: the running turn's
        HTTP client went away (no client named the cancel): a turn stopped only so, before it
        showed or did anything, leaves nothing in the history (`Lease.left_only`)."""
        if shutdown:
            self.queue.close()
        state = self.lifecycle.state
        lease: Lease | None = None
        if state in ("active", "cancelling"):
            lease = self.lifecycle.request_cancel()
            if lease is not None:
                if not shutdown:  # the first cancel to stop it says; a later one named by a client keeps all
                    lease.left_only = client_left and (state == "active" or lease.left_only)
                self._runner.cancel_loop(self.queue.worker)
            if lease is None or shutdown:
                return lease is not None
        elif shutdown:
            return False
        elif state == "awaiting":
            lease = self._answers.cancel()
        elif state == "idle":
            return await self.queue.cancel_next()
        if lease is None:
            return False
        await self._runner.save_cancel(lease.turn_id, lease)
        return True

    def let_go_unsaved(self, turn_id: str, controller: TurnController) -> list[TurnHandle]:
        """Turn `turn_id` could not be written, this server being cut off from its cluster (which
        may have taken the conversation over): that turn (when `controller` is its handle's here)
        and the queued ones leave this runtime, their handles returned for the caller to follow in
        the store. Forgotten by the board, they are queued (or settled) here again by a catch-up if
        this server, once back, still holds the conversation; the runtime itself stays, and so do
        the watches pinned to it."""
        handles = self.queue.drain()
        own = self.handles.get(turn_id)
        if own is not None and own.controller is controller:
            handles.insert(0, own)
        for handle in handles:
            self.handles.pop(handle.turn_id, None)
        return handles

    @property
    def holds_turns(self) -> bool:
        """A turn runs, waits for answers, or waits in the queue (or for its accept) here."""
        return self.lifecycle.busy or bool(self.queue) or self.queue.accepting > 0

    def end_deleted(self, why: str) -> bool:
        """The conversation is gone from the store (another process deleted its agent): every turn
        held here ends failed, nothing written, so each watcher still gets its final snapshot. The
        running one is cancelled; the paused one and the queued ones end as the worker reaches them.
        False when this was known already."""
        runner = self._runner
        if runner.gone is not None:
            return False
        runner.gone = why
        if self.lifecycle.request_cancel() is not None:
            runner.cancel_loop(self.queue.worker)
        self._answers.abandon()
        self.queue.ensure_worker()
        return True

    async def withdraw(self, turn_id: str, why: str) -> bool:
        """Drop a queued input that has not started (see `TurnQueue.withdraw`)."""
        return await self.queue.withdraw(turn_id, why)

    async def shutdown(self) -> None:
        self.queue.close()
        self._answers.cancel_expiry()
        await self.cancel(shutdown=True)
        worker = self.queue.worker
        if worker is not None:
            try:
                await asyncio.wait_for(asyncio.shield(worker), 10)
            except (TimeoutError, asyncio.CancelledError):
                worker.cancel()


__all__ = ["ConversationRuntime"]
