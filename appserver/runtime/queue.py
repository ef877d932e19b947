"""Admission, the FIFO queue and the worker task of one conversation.

An input is admitted against `limits.queue_max`, recorded in the store (`Store.accept_turn`) and
queued; one worker task per conversation, started on demand, runs the turns one at a time in
arrival order (and a paused turn handed to it by `PendingAnswers.take` before any queued one).

Arrival order is the order inputs are given their queue positions (a ticket each, before their
accept commits), not the order their accepts return: one group commit settles several accepts, and
the submitter whose write closed the group goes on at once while the others wait for the loop. So
an accepted input takes its place by ticket, and the worker never begins one while an input with
an earlier ticket is still being accepted: the input acknowledged at position 0 runs first.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass

from appserver.errors import QueueFull
from appserver.runtime.board import TurnBoard
from appserver.runtime.deps import ClusterAccept, RuntimeDeps
from appserver.runtime.handle import TurnHandle
from appserver.runtime.lifecycle import TurnLifecycle
from appserver.runtime.pending import PendingAnswers
from appserver.runtime.restore import controller_from_store, restart_revision
from appserver.runtime.run import TurnRunner
from appserver.runtime.settle import withdrawn
from appserver.runtime.snapshot import TurnController
from appserver.store.base import DuplicateTurn, OpenLimitReached
from appserver.store.records import AgentRecord, TurnRecord


@dataclass(slots=True)
class Queued:
    record: TurnRecord
    handle: TurnHandle
    # An overlapped accept still committing (see enqueue `overlap`); None once it committed first.
    accepting: asyncio.Task[None] | None = None
    agent: AgentRecord | None = None  # the agent as the submitter just read it (overlapped only)
    cancelled: bool = False  # cancelled as the next turn to run, before the worker began it
    ticket: int = -1  # arrival order among inputs accepted here (-1: requeued, placed by its time)


class TurnQueue:
    def __init__(
        self,
        deps: RuntimeDeps,
        conversation_id: str,
        lifecycle: TurnLifecycle,
        board: TurnBoard,
        answers: PendingAnswers,
        runner: TurnRunner,
    ) -> None:
        self._deps = deps
        self._conversation_id = conversation_id
        self._lifecycle = lifecycle
        self._board = board
        self._answers = answers
        self._runner = runner
        self._items: deque[Queued] = deque()
        self._tickets = itertools.count()
        self._accepting: set[int] = set()  # tickets of inputs whose accept has not returned yet
        self._accepted = asyncio.Event()  # set whenever one of them returns (the worker may go on)
        self._cancel_ticket = -1  # an input cancelled by cancel_next while still being accepted
        self._cancelled_turns: dict[int, str] = {}  # its turn, once accepted, for cancel_next to save
        # Turns of a cluster's accept here not queued yet: a pull meanwhile must not queue them too.
        self._arriving: set[str] = set()
        # (scope, idempotency key) of inputs being accepted → the turn once its accept committed,
        # None if it did not: a copy sent meanwhile waits for it instead of holding a place.
        self._keyed: dict[tuple[str, str], asyncio.Future[TurnRecord | None]] = {}
        self.worker: asyncio.Task[None] | None = None
        self.closed = False  # see close()
        self.last_active = time.monotonic()

    def close(self) -> None:
        """Shutting down: no worker starts any more; the running one stops after its turn."""
        self.closed = True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def accepting(self) -> int:
        """Inputs waiting for their accept to commit (they hold a queue place)."""
        return len(self._accepting)

    def turn_ids(self) -> set[str]:
        return {q.record.id for q in self._items}

    # ------------------------------------------------------------ admission

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

        A copy of an input whose accept is still committing (the same idempotency key, sent at
        once by a client's resend or two relays) waits for that accept and gets its turn as a
        duplicate: it neither holds a queue place nor is refused as over the limit.
        """
        key = (idempotency_scope, record.idempotency_key) if idempotency_scope and record.idempotency_key else None
        while key is not None and key in self._keyed:
            earlier = await asyncio.shield(self._keyed[key])  # the copy's own cancel leaves the first alone
            if earlier is not None:
                raise DuplicateTurn(earlier)
        if key is None:
            return await self._admit(record, idempotency_scope, overlap, agent)
        accepted: asyncio.Future[TurnRecord | None] = asyncio.get_running_loop().create_future()
        self._keyed[key] = accepted
        try:
            admitted = await self._admit(record, idempotency_scope, overlap, agent)
        except BaseException:
            accepted.set_result(record if self.knows(record.id) else None)
            raise
        finally:
            del self._keyed[key]
        accepted.set_result(record)
        return admitted

    async def _admit(
        self, record: TurnRecord, idempotency_scope: str | None, overlap: bool, agent: AgentRecord | None
    ) -> tuple[TurnHandle, int]:
        waiting = len(self._items) + self.accepting
        limit = self._deps.config.limits.queue_max
        if waiting >= limit:
            raise QueueFull(
                f"conversation {self._conversation_id} has {waiting} inputs queued (limit {limit}); try again later"
            )
        if self._deps.cluster_accept is not None:
            return await self._enqueue_in_cluster(record, idempotency_scope, self._deps.cluster_accept)
        position = waiting + (1 if self._lifecycle.busy else 0)
        record.status = "queued" if position else "running"
        record.owner = self._deps.owner
        if position == 0:
            record.started_at = time.time()
        if overlap and position == 0 and idempotency_scope is None and self.worker is None and not self.closed:
            return self._queue_overlapped(record, agent), 0
        # The accept commits with the next group commit: until then this input holds its place.
        ticket = next(self._tickets)
        self._accepting.add(ticket)
        try:
            await self._deps.store.accept_turn(record, idempotency_scope)  # raises DuplicateTurn
        except asyncio.CancelledError:
            # The commit may have landed just before the cancel reached us: queue the turn all the
            # same, or it would sit in the store as accepted with nobody to run it.
            self._accept_returned(ticket)
            if await self._deps.store.get_turn(record.id) is not None:
                self._queue_accepted(record, position, ticket)
            raise
        except BaseException:
            self._accept_returned(ticket)
            raise
        self._accept_returned(ticket)
        return self._queue_accepted(record, position, ticket), position

    def _accept_returned(self, ticket: int) -> None:
        self._accepting.discard(ticket)
        self._accepted.set()

    async def _enqueue_in_cluster(
        self,
        record: TurnRecord,
        idempotency_scope: str | None,
        accept: ClusterAccept,
    ) -> tuple[TurnHandle, int]:
        """A server of a cluster: the accept counts the conversation's open turns in the database
        (the bound holds across servers) and names the queued turns other servers accepted
        before this one, which are queued here first, so turns run in acceptance order."""
        limit = self._deps.config.limits.queue_max
        record.status = "queued"  # marked running when the worker begins it, unless accepted so
        record.owner = self._deps.owner
        free = not self._lifecycle.busy and not self._items and not self.accepting and self.worker is None
        ticket = next(self._tickets)
        self._accepting.add(ticket)
        self._arriving.add(record.id)
        # The ticket is held until the input is queued: the worker starts no turn a pull queued
        # meanwhile (maybe accepted after this one) before it knows where this one goes.
        try:
            try:
                earlier = await accept(record, idempotency_scope, limit + 1, start_if_free=free)  # raises DuplicateTurn
            except OpenLimitReached as full:
                raise QueueFull(
                    f"conversation {self._conversation_id} has {full.open_turns - 1} inputs queued (limit {limit}); "
                    "try again later"
                ) from None
            for turn_id in earlier:
                if self.knows(turn_id):
                    continue
                turn = await self._deps.store.get_turn(turn_id)
                # asked again after the await: another submitter may have queued it, and the worker
                # begun or even finished it, meanwhile (it would run twice)
                if turn is not None and turn.status == "queued":
                    self.requeue(turn)
            # by acceptance (the database's clock, under the conversation's accept lock): a turn
            # another server accepted after this one, queued here by a pull meanwhile, goes after it
            items = self._items
            at = next((i for i, q in enumerate(items) if q.record.created_at > record.created_at), len(items))
            position = at + (1 if self._lifecycle.busy else 0)
            return self._queue_accepted(record, position, ticket, placed=at), position
        finally:
            self._arriving.discard(record.id)
            self._accept_returned(ticket)

    def knows(self, turn_id: str) -> bool:
        """The turn is queued, running, being accepted here, or was shown here lately (its handle
        is on the board): nothing may queue it again."""
        return (
            turn_id == self._lifecycle.turn_id
            or turn_id in self._board.handles
            or turn_id in self._arriving
            or any(q.record.id == turn_id for q in self._items)
        )

    def _queue_overlapped(self, record: TurnRecord, agent: AgentRecord | None) -> TurnHandle:
        controller = TurnController(record.id, self._conversation_id, record.agent_id, phase="queued", queue_position=0)
        handle = TurnHandle(record.id, self._conversation_id, controller)
        item = Queued(
            record,
            handle,
            agent=agent if agent is not None and agent.id == record.agent_id else None,
            ticket=next(self._tickets),
        )
        self._items.append(item)
        # The worker's first step is scheduled first: it runs up to the model call, then the
        # accept commits while the model works.
        self.ensure_worker()
        item.accepting = asyncio.get_running_loop().create_task(self._accept_overlapped(record, handle))
        item.accepting.add_done_callback(_retrieved)  # the worker reports a failure (see TurnRunner.run)
        return handle

    async def _accept_overlapped(self, record: TurnRecord, handle: TurnHandle) -> None:
        await self._deps.store.accept_turn(record, None)
        self._board.remember(handle)
        self._board.notify(handle)

    def _queue_accepted(self, record: TurnRecord, position: int, ticket: int, placed: int | None = None) -> TurnHandle:
        controller = TurnController(
            record.id, self._conversation_id, record.agent_id, phase="queued", queue_position=position
        )
        handle = TurnHandle(record.id, self._conversation_id, controller)
        items = self._items
        at = placed
        if at is None:
            # by ticket: an input given its place earlier, whose accept returned later, goes first
            at = len(items)
            while at > 0 and items[at - 1].ticket > ticket:
                at -= 1
        cancelled = ticket == self._cancel_ticket  # cancelled as the next to run while it was accepted
        if cancelled:
            self._cancelled_turns[ticket] = record.id
        items.insert(at, Queued(record, handle, ticket=ticket, cancelled=cancelled))
        self._board.remember(handle)  # queued first: a live turn, so no trim of the board drops it
        if placed is not None and at < len(items) - 1:
            self._renumber()
        self._board.notify(handle)
        self.ensure_worker()
        return handle

    def requeue(self, record: TurnRecord) -> bool:
        """Queue a turn accepted but never begun here: a dead process's (server start), or one
        another server of the cluster accepted for this conversation. It takes its place by the
        time it was accepted, before any queued input accepted later. False (nothing done) when
        this queue knows the turn already: a second entry would run it twice."""
        if self.knows(record.id):
            return False
        record.owner = self._deps.owner
        items = self._items
        at = next((i for i, q in enumerate(items) if q.record.created_at > record.created_at), len(items))
        # Another process (the dead one, the server that accepted it) may have shown it, at queue
        # positions it never stored: it goes on from a restart revision (restore.py), above them.
        # Its position: the turns ahead of it; 0 at the head of an idle queue, which begins it now
        # (unless an input being accepted here may go first: that one counts).
        controller = TurnController(
            record.id,
            self._conversation_id,
            record.agent_id,
            revision=restart_revision(record),
            phase="queued",
            queue_position=at + (1 if self._lifecycle.busy or self._accepting else 0),
        )
        handle = TurnHandle(record.id, self._conversation_id, controller)
        # a cancel of it acknowledged before a crash: it ends cancelled as the worker begins it
        items.insert(at, Queued(record, handle, cancelled=record.cancel_ack is not None))
        self._board.remember(handle)
        if at < len(items) - 1:
            self._renumber()
        self._board.notify(handle)
        self.ensure_worker()
        return True

    # ------------------------------------------------------------ leaving the queue early

    async def cancel_next(self) -> bool:
        """Cancel the turn about to start (acknowledged as running): it ends cancelled when the
        worker begins it, also when its accept has not returned yet (it goes before the queued
        ones). Returns once the cancel is saved with the turn (`TurnRunner.save_cancel`), after
        its accept. False when nothing is queued."""
        if self._accepting and (not self._items or min(self._accepting) < self._items[0].ticket):
            ticket = self._cancel_ticket = min(self._accepting)
            try:
                while ticket in self._accepting:  # its row exists once the accept returned
                    self._accepted.clear()
                    await self._accepted.wait()
                turn_id = self._cancelled_turns.get(ticket)
                if turn_id is not None:  # (else its accept failed: nothing to save, nothing runs)
                    await self._runner.save_cancel(turn_id)
            finally:
                self._cancelled_turns.pop(ticket, None)
            return True
        if not self._items:
            return False
        item = self._items[0]
        item.cancelled = True
        await self._runner.save_cancel(item.record.id, accepting=item.accepting)
        return True

    async def withdraw(self, turn_id: str, why: str) -> bool:
        """Drop a queued input that has not started (its HTTP client went away, DESIGN §13, or a
        cancel named it): closed as cancelled, `why` its error, nothing of it written to the
        history. False when it started or is unknown."""
        item = next((q for q in self._items if q.record.id == turn_id and q.accepting is None), None)
        if item is None:
            return False
        self._items.remove(item)  # before any await: the worker can no longer pick it
        self._renumber()
        controller = item.handle.controller
        end = withdrawn(turn_id, controller.revision + 1, why)
        finished = await self._runner.finish(item.record, controller, None, end)
        if not finished.published and finished.commit_error is not None:
            # not saved, this server cut off from its cluster: the turn may run elsewhere (its
            # clients here follow it in the store), so no cancel is acknowledged
            raise finished.commit_error
        return True

    def drain(self) -> list[TurnHandle]:
        """Take out every queued turn whose accept committed, and return their handles: this
        server is cut off from its cluster and another may run them (`Kernel._cut_off`). Their
        rows stay queued in the store, so a server holding the conversation queues them again (this
        one too, once back and still holding it: they are unknown here from now on). An overlapped
        accept still committing stays: not in the store, its turn ends here as it fails."""
        taken = [q for q in self._items if q.accepting is None]
        self._items = deque(q for q in self._items if q.accepting is not None)
        self._renumber()
        return [q.handle for q in taken]

    def _renumber(self) -> None:
        for i, q in enumerate(self._items):
            q.handle.controller.set_queue_position(i + 1)

    # ------------------------------------------------------------ the worker

    def ensure_worker(self) -> None:
        if self.worker is None and not self.closed:
            self.worker = asyncio.get_running_loop().create_task(
                self._work(), name=f"conversation:{self._conversation_id}"
            )

    async def _work(self) -> None:
        runner = self._runner
        try:
            while not self.closed:
                resume = self._answers.take_resume()
                if resume is not None:
                    record = resume.record
                    handle = self._board.handles.get(record.id)
                    if handle is None:
                        store = self._deps.store
                        controller = await controller_from_store(store, record, await store.list_pending(record.id))
                        handle = TurnHandle(record.id, self._conversation_id, controller)
                        self._board.remember(handle)
                    await runner.run(record, handle, resume)
                    continue
                if self._lifecycle.state == "awaiting" or not self._items:
                    break
                head = self._items[0].ticket
                if self._accepting and (
                    min(self._accepting) < head or (head < 0 and self._deps.cluster_accept is not None)
                ):
                    # an input given an earlier place is still being accepted: it runs first (in a
                    # cluster, one accepted here may precede a turn another server accepted)
                    self._accepted.clear()
                    await self._accepted.wait()
                    continue
                item = self._items.popleft()
                if self._items:
                    self._renumber()
                await runner.run(item.record, item.handle, None, item.accepting, item.agent, cancelled=item.cancelled)
        finally:
            self.worker = None
            self.last_active = time.monotonic()


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


__all__ = ["Queued", "TurnQueue"]
