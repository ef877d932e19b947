"""Pending answers and their deadlines: the turn paused for approvals or client-tool results.

The paused turn, the resume handed to the worker and the expiry timer belong here, and nothing
else changes them. Pending calls live in the store (first answer wins); once every call is
answered, or the paused turn is cancelled, `take` moves it awaiting → active synchronously and
hands it to the worker, so an answer and a cancel racing for one turn cannot both act on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appserver.agent.events import ToolCallStatus
from appserver.agent.loop import ANSWERED_AT, TurnWork
from appserver.errors import InvalidInput, NotAwaiting
from appserver.runtime.board import TurnBoard
from appserver.runtime.deps import RuntimeDeps
from appserver.runtime.handle import Decision, TurnHandle
from appserver.runtime.history import History
from appserver.runtime.lifecycle import Lease, TurnLifecycle
from appserver.runtime.restore import controller_from_store
from appserver.runtime.settle import CANCELLED_UNANSWERED, answered_result
from appserver.shown import clipped, shown
from appserver.store.records import MessageRecord, PendingCall, TurnRecord, TurnSettings


@dataclass(slots=True)
class Resume:
    """A paused turn taken over (lease held) for the worker: resumed with `resolved`, or, when
    its lease was cancelled, closed with one result per call."""

    record: TurnRecord
    lease: Lease
    resolved: list[PendingCall] | None


class PendingAnswers:
    def __init__(
        self,
        deps: RuntimeDeps,
        conversation_id: str,
        lifecycle: TurnLifecycle,
        board: TurnBoard,
        history: History,
        wake: Callable[[], None],
    ) -> None:
        self._deps = deps
        self._conversation_id = conversation_id
        self._lifecycle = lifecycle
        self._board = board
        self._history = history
        self._wake = wake  # start the worker for a taken turn
        self._awaiting: TurnRecord | None = None
        self._resume: Resume | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._answering = asyncio.Lock()

    @property
    def turn(self) -> TurnRecord | None:
        """The turn paused for answers, if any."""
        return self._awaiting if self._lifecycle.state == "awaiting" else None

    def take_resume(self) -> Resume | None:
        """For the worker: the paused turn handed to it, once."""
        resume, self._resume = self._resume, None
        return resume

    async def load(self) -> None:
        """Adopt a paused turn from the store (survives restarts and other processes)."""
        store = self._deps.store
        awaiting = await store.list_turns(self._conversation_id, statuses=["awaiting"])
        if not awaiting:
            return
        turn = awaiting[-1]
        pending = await store.list_pending(turn.id)
        controller = await controller_from_store(store, turn, pending)
        self._lifecycle.restore_awaiting(turn.id)
        self._board.remember(TurnHandle(turn.id, self._conversation_id, controller))
        self._awaiting = turn
        if turn.cancel_ack is not None:
            # A cancel of it was acknowledged before a crash: it ends cancelled, as it would have
            # then (the worker closes its calls), never resumed.
            self.take(turn, None).client_cancel = True
            return
        await self.expire_overdue()
        if self._lifecycle.state == "awaiting" and self._resume is None:
            await self._maybe_resume()
            if self._lifecycle.state == "awaiting":
                self._arm_expiry(pending)

    def paused(self, record: TurnRecord, pending: list[PendingCall]) -> None:
        """A turn just paused (its lease released to awaiting): wait for answers until the deadlines."""
        self._awaiting = record
        self._arm_expiry(pending)

    # ------------------------------------------------------------ answers

    async def respond(
        self,
        decisions: list[Decision],
        *,
        whole: bool = False,
        settings: TurnSettings | None = None,
        keep: tuple[str, ...] = (),
    ) -> list[dict[str, Any]]:
        """Answer pending calls; one result per distinct call. Every decision is checked before any
        is written, so a malformed one (a wrong kind, an unknown action, two different answers to
        one call) refuses them all. `whole` (one HTTP request): a call that is unknown or already
        answered refuses them all too, instead of the others being applied. `settings`: the
        answering request's options and client tools, for the turn's model calls after its
        answers: they replace the turn's with each answer written (`Store.resolve_pending`), but
        for the turn's own entries named by `keep` (the kernel's, never a request's)."""
        async with self._answering:  # two inputs answering at once are checked and written in turn
            return await self._respond(decisions, whole, settings, keep)

    async def _respond(
        self, decisions: list[Decision], whole: bool, settings: TurnSettings | None, keep: tuple[str, ...]
    ) -> list[dict[str, Any]]:
        if self._lifecycle.state != "awaiting" or self._awaiting is None:
            raise NotAwaiting(f"conversation {self._conversation_id} has no turn waiting for an answer")
        turn = self._awaiting
        store = self._deps.store
        distinct: dict[str, Decision] = {}
        for d in decisions:
            if d.action not in ("approve", "deny", "result"):
                raise InvalidInput(f"unknown decision {shown(d.action)}: use approve, deny or a tool result")
            seen = distinct.get(d.call_id)
            if seen is None:
                distinct[d.call_id] = d
            elif (seen.action, seen.output or "", seen.is_error) != (d.action, d.output or "", d.is_error):
                raise InvalidInput(f"call {clipped(d.call_id)} is answered twice in this input, differently")
        refused: list[dict[str, Any]] = []
        ready: list[tuple[Decision, PendingCall]] = []
        for d in distinct.values():
            p = await store.get_pending(self._conversation_id, d.call_id)
            if p is None or p.turn_id != turn.id:
                refused.append(
                    {
                        "call_id": d.call_id,
                        "accepted": False,
                        "error": "unknown_call",
                        "message": f"no pending call {clipped(d.call_id)} in this conversation",
                    }
                )
                continue
            if d.action in ("approve", "deny") and p.kind != "approval":
                raise InvalidInput(
                    f"call {clipped(d.call_id)} is a client tool call: answer it with a tool result, not an approval"
                )
            if d.action == "result" and p.kind != "client":
                raise InvalidInput(f"call {clipped(d.call_id)} needs an approval decision, not a tool result")
            if whole and p.status != "pending":
                refused.append(_already(d.call_id, p.status))
                continue
            ready.append((d, p))
        if whole and refused:
            return refused
        results = list(refused)
        # a turn read back damaged ends failed when it would run (run.py): its values stay as read
        settings = turn_settings(turn, settings, keep) if settings is not None and not turn.damaged else None
        replaced = False
        for d, p in ready:
            status = {"approve": "approved", "deny": "denied", "result": "result"}[d.action]
            output, is_error = d.output, d.is_error
            reason, decided_by = d.reason, d.decided_by
            if d.action == "approve" and p.output is not None:
                # it ran in the conversation this one was forked from (the same approval resent):
                # approved, it is answered with that result instead of running a second time
                status, output, is_error = "result", p.output, p.is_error
            elif d.action == "deny" and p.decided_by is not None:
                reason, decided_by = p.reason, p.decided_by  # denied there: the fork keeps who and why
            won = await store.resolve_pending(
                self._conversation_id,
                d.call_id,
                status,
                output=output,
                is_error=is_error,
                reason=reason,
                decided_by=decided_by,
                settings=settings,
            )
            if won:
                replaced = settings is not None
                said = "approved" if d.action == "approve" else status
                results.append({"call_id": d.call_id, "accepted": True, "status": said})
            else:
                current = await store.get_pending(self._conversation_id, d.call_id)
                results.append(_already(d.call_id, current.status if current else None))
        if replaced and settings is not None:  # as the store now holds them (a load reads the same)
            turn.options, turn.client_tools = settings.options, settings.client_tools
        await self._maybe_resume()
        return results

    async def _maybe_resume(self) -> None:
        """Resume the paused turn once every pending call is answered. The lease is taken with no
        await after the last read, so a cancel from then on cancels the resumed turn."""
        turn = self._awaiting
        if turn is None or self._resume is not None or self._lifecycle.state != "awaiting":
            return
        pending = await self._deps.store.list_pending(turn.id)
        if any(p.status == "pending" for p in pending):
            handle = self._board.handles.get(turn.id)
            # only a change is published: a late or unknown answer changes nothing to show
            if handle is not None and handle.controller.pending != [
                p.to_dict() for p in pending if p.status == "pending"
            ]:
                handle.controller.set_pending(pending)
            return
        done = {m.tool_call_id for m in await self._history.read() if m.role == "tool"}
        if self._awaiting is turn and self._resume is None and self._lifecycle.state == "awaiting":
            self.take(turn, [p for p in pending if p.call_id not in done])

    def take(self, turn: TurnRecord, resolved: list[PendingCall] | None) -> Lease:
        """awaiting → active, synchronously: the paused turn now belongs to the worker, resumed
        with `resolved`, or (None) cancelled. Nothing else writes its results. Its lease."""
        lease = self._lifecycle.begin(turn.id)
        if resolved is None:
            self._lifecycle.request_cancel()
        self._awaiting = None
        self.cancel_expiry()
        self._resume = Resume(turn, lease, resolved)
        self._wake()
        return lease

    # ------------------------------------------------------------ cancel

    def cancel(self) -> Lease | None:
        """Take the paused turn to close it (the worker gives each call its one result): its lease,
        or None when none is paused. The caller saves the cancel before acknowledging it
        (`TurnRunner.save_cancel`), which answers the open calls in the store: an answer that comes
        after hears so, and a crash after leaves the turn to end cancelled, never resumed."""
        if self._lifecycle.state != "awaiting" or self._awaiting is None:
            return None
        return self.take(self._awaiting, None)

    def abandon(self) -> None:
        """The conversation is gone from the store: hand the paused turn to the worker to end it,
        with no store call here (its rows, and its calls', no longer exist)."""
        turn = self._awaiting
        if turn is not None and self._resume is None and self._lifecycle.state == "awaiting":
            self.take(turn, None)
        self.cancel_expiry()

    async def _cancel_open_calls(self, turn_id: str) -> None:
        store = self._deps.store
        for p in await store.list_pending(turn_id):
            if p.status == "pending":
                await store.resolve_pending(
                    self._conversation_id, p.call_id, "cancelled", reason=CANCELLED_UNANSWERED, is_error=True
                )

    async def close_calls(self, record: TurnRecord, work: TurnWork, emit: Callable[[Any], None]) -> None:
        """A paused turn cancelled before it resumed: each of its calls gets its one result, from
        the answer it got, or saying it was cancelled."""
        await self._cancel_open_calls(record.id)
        answered = {m.tool_call_id for m in work.history if m.role == "tool"}
        for p in await self._deps.store.list_pending(record.id):
            if p.call_id in answered:
                continue
            text, is_error = answered_result(p, self._deps.config)
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

    # ------------------------------------------------------------ deadlines

    def _arm_expiry(self, pending: list[PendingCall]) -> None:
        self.cancel_expiry()
        deadlines = [p.expires_at for p in pending if p.status == "pending" and p.expires_at is not None]
        if not deadlines:
            return
        delay = max(0.0, min(deadlines) - time.time()) + 0.01
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_later(delay, lambda: loop.create_task(self._on_expiry()))

    def cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _on_expiry(self) -> None:
        self._expiry = None
        await self.expire_overdue()
        if self._awaiting is not None and self._resume is None and self._lifecycle.state == "awaiting":
            self._arm_expiry(await self._deps.store.list_pending(self._awaiting.id))

    async def expire_overdue(self) -> None:
        turn = self._awaiting
        if turn is None:
            return
        now = time.time()
        changed = False
        for p in await self._deps.store.list_pending(turn.id):
            if p.status == "pending" and p.expires_at is not None and p.expires_at <= now:
                reason = None
                if p.kind == "client":
                    reason = (
                        f"The client did not return a result for {p.name} within the tool timeout; "
                        "the call has no result."
                    )
                changed |= await self._deps.store.resolve_pending(
                    self._conversation_id, p.call_id, "expired", reason=reason, is_error=True
                )
        if changed:
            await self._maybe_resume()


def turn_settings(turn: TurnRecord, settings: TurnSettings, keep: tuple[str, ...]) -> TurnSettings:
    """The options and client tools paused turn `turn` runs with once a request's answers bring
    `settings`: the request's, with the turn's own entries named by `keep`, and marked as brought
    with the answers to the calls it paused at (loop.ANSWERED_AT: the request's tool_choice is
    then its first model call's)."""
    options = {k: v for k, v in settings.options.items() if k not in keep and k != ANSWERED_AT}
    options.update({k: turn.options[k] for k in keep if k in turn.options})
    options[ANSWERED_AT] = turn.iteration
    return TurnSettings(options, [dict(t) for t in settings.client_tools])


def _already(call_id: str, status: str | None) -> dict[str, Any]:
    return {
        "call_id": call_id,
        "accepted": False,
        "error": "already_resolved",
        "status": status,
        "message": f"call {clipped(call_id)} was already answered ({status or 'gone'})",
    }


__all__ = ["CANCELLED_UNANSWERED", "PendingAnswers", "Resume", "turn_settings"]
