"""The cron service inside `serve`: the scheduler loop, "run now" for the server's clients, and the
outcomes a previous server left unrecorded. It reaches the kernel only through `cron.adapter`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from appserver.channels import READINESS_CHECK as CHANNELS_CHECK
from appserver.readiness import CheckResult
from appserver.server import Server
from appserver.shown import shown
from appserver.store.records import TurnRecord
from cron.adapter import KernelAdapter, task_run_of
from cron.runner import DeliverFn, RunNowResult, TurnOutcome, deliver_reply, settle
from cron.scheduler import Scheduler
from cron.store import (
    NOT_STARTED_DISABLED,
    NOT_STARTED_REMOVED,
    CorruptStateFile,
    CronNotFound,
    CronStoreError,
    CronTask,
)

log = logging.getLogger("appserver.cron")


READINESS_CHECK = "cron"  # its name in /readyz while `serve` runs the service
STALL_AFTER_TICKS = 3  # a loop silent for this many ticks (and at least STALL_MIN_S) is stuck
STALL_MIN_S = 120.0
# How long the reply of a run recovered at start waits for the channel gateway to run (it starts
# with the server); the delivery is then tried whatever the state, and its failure logged.
RECOVERED_DELIVERY_WAIT_S = 30.0


def recovered_delivery(
    source: dict[str, Any] | None, task: CronTask | None, *, removed: bool
) -> tuple[str | None, str | None]:
    """(target, why it is not sent) for the reply of a run recovered after a restart. The target
    is the one the turn was fired with (its `source`, which the envelope announced to the agent),
    else the task's. The reply of a task removed since is not sent (its owner removed it; the
    reply stays in the conversation) and the run log says so."""
    if isinstance(source, dict) and source.get("kind") == "cron_prompt":
        fired_with = source.get("deliver")
        target = fired_with if isinstance(fired_with, str) and fired_with else None
    else:
        target = task.deliver if task is not None else None
    if target and removed:
        return target, (
            "not delivered: the task was removed before this run's outcome was recovered after a restart "
            "(the reply is in the conversation)"
        )
    return target, None


class CronService:
    """The scheduler inside `serve`: one per home, guarded by the crons.json lease. Also "run now"
    for clients of the server (the `cron_run` frame), with or without the lease or the loop."""

    def __init__(self, server: Server, deliver: DeliverFn | None = None) -> None:
        self.server = server
        adapter = KernelAdapter(server.kernel, server.store)
        self.scheduler = Scheduler.from_config(
            server.config,
            fire=adapter.fire,
            await_outcome=adapter.outcome,
            deliver=deliver,
            claimed_turn=adapter.claimed_turn,
            agent_names=adapter.agent_names,
            # the reply of a run taken over from a server that stopped waits for the channels too
            before_recovered_delivery=self._channels_up,
            withdraw=adapter.withdraw,
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[int] | None = None
        # turn id -> why: the queued runs this server's kernel dropped as it took them up before
        # its outcome recovery ended (`held_back`): that recovery records them
        self._held: dict[str, str] = {}

    def start(self) -> None:
        config = self.server.config
        if self.server.kernel.owner.startswith("inst_"):  # a server of a cluster: tasks in the database
            self.scheduler.store.join_cluster(
                self.server.kernel.owner, config.store.instance_timeout_s, config.store.heartbeat_s
            )
        self._task = asyncio.get_running_loop().create_task(self.scheduler.run(self._stop), name="cron-scheduler")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The loop ended: expected after `stop`; otherwise cron is dead in this server, which is
        logged as an error here (not left to a never-retrieved exception) and fails /readyz."""
        if self._stop.is_set():
            return
        exc = None if task.cancelled() else task.exception()
        log.error(
            "cron: the scheduler stopped unexpectedly (%s); no cron task fires in this server",
            "cancelled" if exc is None else f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )

    def stopped(self) -> str | None:
        """Why the scheduler loop is not running although it should, or None."""
        if self._task is None or self._stop.is_set():
            return None
        if self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            why = "it was cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
            return f"the scheduler stopped unexpectedly ({why}); restart the server"
        silent = time.monotonic() - self.scheduler.alive_at
        if silent > max(STALL_AFTER_TICKS * self.scheduler.tick_s, STALL_MIN_S):
            return f"the scheduler loop has not run for {silent:.0f} s"
        return None

    def problem(self) -> str | None:
        """One line saying why cron cannot do its job (a crons.json set aside as corrupt and not
        yet dealt with, a tick that keeps failing), or None. Cheap and synchronous: for /readyz."""
        return self.scheduler.problem()

    async def readiness(self) -> CheckResult:
        """The `cron` check of /readyz. A scheduler loop that died or is stuck fails it (this
        server was meant to run cron and runs none); a problem cron works around warns (the
        server still serves; the operator has something to look at). Not holding the lease
        while a live peer does is fine, and said; not holding it without a working tick warns."""
        dead = self.stopped()
        if dead:
            return CheckResult("fail", dead)
        problem = self.problem()
        sched = self.scheduler
        standby = self._task is not None and not sched.has_lease
        if problem:
            if standby:
                lease = sched.lease_state or "no scheduler could be seen holding the lease"
                problem = f"{problem}; this server does not hold the scheduler lease: {lease}"
            return CheckResult("warn", problem)
        if standby and sched.lease_state:
            return CheckResult("ok", f"standby: {sched.lease_state}")
        return CheckResult("ok")

    def start_recovery(self) -> None:
        self._recovery = asyncio.get_running_loop().create_task(self.recover_outcomes(), name="cron-recover-outcomes")

    async def recover_outcomes(self) -> int:
        """Record the outcomes of cron turns that a previous server submitted but did not see end
        (killed, or stopped while they were queued or running): this process settles or runs
        them now. Each is watched until it ends, then logged like any other, and its reply sent
        where the run was to deliver it (`delivered` or `delivery_failed`, as for any run); one
        still queued whose task was removed or disabled meanwhile (`cron remove`/`disable` while no
        server ran: its claim is gone with a removed task, so no take-over finds it) is dropped
        from its queue, `cancelled`, not started, as a running scheduler drops it; returns how many."""
        pending = await asyncio.to_thread(self.scheduler.unrecorded_turns)
        if not pending:
            return 0
        tasks = await asyncio.to_thread(self._current_tasks)
        watched = 0
        for task_id, occurrence, turn_id in pending:
            task = None if tasks is None else tasks.get(task_id)
            if task is not None and self._resolved_elsewhere(task, occurrence):
                continue
            if task is None and tasks is not None and self.scheduler.store.shared and turn_id not in self._held:
                # removed since, on a cluster's database: the tasks no longer say whether another
                # server finished the run (the one that took the scheduler over recorded it if so);
                # one this server's kernel dropped at its start never ran: its outcome is recorded here
                continue
            turn = await self.server.store.get_turn(turn_id)
            if turn is None:  # accepted by a process that died before its store commit
                lost = TurnOutcome("lost", "the turn never reached the store (its server died)")
                store, target = self.scheduler.store, task.deliver if task is not None else None
                # recorded once, whoever else follows the run (the scheduler's take-over of its claim)
                ours = await settle(store, task_id, occurrence, turn_id, lost, final=not target)
                if target:  # nothing to send: say so where a delivery goes
                    await deliver_reply(
                        store, task_id, occurrence, turn_id, lost, target, self.scheduler.deliver, outcome_ours=ours
                    )
                continue
            if (
                turn.owner
                and turn.owner != self.server.kernel.owner
                and await self.server.kernel.owner_alive(turn.owner)
            ):
                continue  # another live process runs it and will record it
            removed = tasks is not None and task is None
            target, why_not = recovered_delivery(turn.source, task, removed=removed)
            self.scheduler.watch(
                task_id, occurrence, turn_id, target, not_delivered=why_not, before_delivery=self._channels_up
            )
            watched += 1
            disabled = task is not None and task.drops_run(turn.source)  # (not a run asked by hand since)
            stopped = NOT_STARTED_REMOVED if removed else NOT_STARTED_DISABLED if disabled else None
            if stopped is not None and turn.status == "queued":
                # removed or disabled while no server ran: dropped now, before its queue reaches it
                await self.scheduler.withdraw_run(task_id, occurrence, turn_id, stopped)
        log.info("cron: recovering the outcome of %d turn(s) of a previous server", len(pending))
        return watched

    async def held_back(self, turns: Sequence[TurnRecord]) -> dict[str, str]:
        """The kernel's check of the queued turns it takes up from the store (`Kernel.hold_back_queued`,
        wired by `build_services`): the cron runs among them whose task was removed or disabled
        meanwhile (`cron remove`/`disable` while no server ran), each with why; the kernel drops
        them, never started. Asked by the kernel itself, before it queues them again: the outcome
        recovery above runs later, after a run queued behind a turn the stop cut off had begun.
        Tasks that cannot be read hold nothing back (logged): the runs go on, as a scheduler that
        cannot read them lets them."""
        runs = {t.id: (task_id, t.source) for t in turns if (task_id := task_run_of(t)) is not None}
        if not runs:
            return {}
        tasks = await asyncio.to_thread(self._current_tasks, "check the queued runs a start takes up")
        if tasks is None:
            return {}
        held: dict[str, str] = {}
        for turn_id, (task_id, source) in runs.items():
            task = tasks.get(task_id)
            if task is None:
                held[turn_id] = NOT_STARTED_REMOVED
            elif task.drops_run(source):  # (a run asked by hand after it was disabled goes ahead)
                held[turn_id] = NOT_STARTED_DISABLED
        if self._recovery is None or not self._recovery.done():
            self._held.update(held)
        return held

    def _resolved_elsewhere(self, task: CronTask, occurrence: int) -> bool:
        """Did another process finish run `occurrence` (its outcome recorded, its reply sent)? As
        the tasks say (the progress kept with each claim, and the runs known done since; a run
        still open is followed here, and of the processes following it only one records and
        delivers it): on a cluster's database,
        a run they no longer follow that is older than the task's last claim was finished by the
        server that took the scheduler over (its run log has it); on one home's crons.json, this
        server's run log is everyone's and decides."""
        followed, stage = task.claim_progress(occurrence)
        if followed:
            return stage == "done"
        last = task.last_claimed or {}
        number = last.get("occurrence")
        return (
            self.scheduler.store.shared and task.tracks_progress() and isinstance(number, int) and occurrence < number
        )

    async def _channels_up(self) -> None:
        """Wait (at most RECOVERED_DELIVERY_WAIT_S) until the channels run: the gateway starts
        with this server, after the turns it recovers, and a reply sent before it runs would fail
        though nothing is wrong. Then the delivery is tried whatever the state, and its failure
        recorded. Without channels in this server there is nothing to wait for."""
        if self.scheduler.deliver is None:
            return
        deadline = time.monotonic() + RECOVERED_DELIVERY_WAIT_S
        while time.monotonic() < deadline:
            _, body = await self.server.readiness.report()
            if any(c.get("name") == CHANNELS_CHECK and c.get("status") == "ok" for c in body.get("checks", [])):
                return
            await asyncio.sleep(0.2)

    def _current_tasks(self, purpose: str = "recover the delivery of their runs") -> dict[str, CronTask] | None:
        """The tasks by id now, for the delivery targets of recovered runs; None (logged, saying
        what for) when crons.json cannot be read: the turns' own record of their target is used then."""
        try:
            state = self.scheduler.store.read()
        except (CronStoreError, CorruptStateFile, OSError) as exc:
            log.warning("cron: cannot read the tasks to %s: %s", purpose, exc)
            return None
        return {t.id: t for t in state.tasks}

    async def run_now(self, ref: str, *, agent: str | None = None) -> RunNowResult:
        """Fire task `ref` now in this server: the same claim, envelope, run log and outcome watch
        as `appserver cron run` in-process (the outcome is logged when the turn ends). A task whose
        agent was deleted is refused (CronNotFound) before a run number is used up."""
        task = (await asyncio.to_thread(self.scheduler.store.read)).find(ref, agent)
        record = await self.server.store.get_agent(task.agent)
        if record is None:
            raise CronNotFound(
                f"task {shown(task.name)} ({task.id}) cannot run: its agent {task.agent} was deleted; remove the task "
                f"(appserver cron remove {task.id}) or add a new one for an existing agent"
            )
        gone = await asyncio.to_thread(self.scheduler.credential_problem, task, record.name)
        if gone is not None:  # as `appserver cron run` in-process refuses it
            raise CronNotFound(f"task {shown(task.name)} ({task.id}) cannot run: {gone}")
        return await self.scheduler.run_now(task.id, agent=task.agent)

    async def stop(self) -> None:
        """Stop the loop, which closes the scheduler as it ends (lease released, outcome watchers
        cancelled); when the loop never ran, close the scheduler here: either way, once."""
        self._stop.set()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        if self._task is None:
            await self.scheduler.close()
            return
        try:
            await asyncio.wait_for(self._task, 10)  # on timeout the loop is cancelled and closes
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        except Exception:
            log.exception("cron scheduler stopped with an error")


@asynccontextmanager
async def cron_background(service: CronService) -> AsyncIterator[None]:
    """The scheduler as a background service of `serve` (its loop is off with
    APPSERVER_DISABLE_CRON=1; "run now" through the server works either way). While it runs,
    `/readyz` lists its `cron` check."""
    server = service.server
    server.readiness.register(READINESS_CHECK, service.readiness)
    service.start_recovery()  # this process owns the home's turns, scheduler or not
    if server.config.cron.enabled:
        service.start()
    else:
        log.info(
            "cron: the scheduler is off in this server (APPSERVER_DISABLE_CRON or [cron] enabled = false); "
            "no task fires here, `appserver cron run` still works"
        )
    try:
        yield
    finally:
        server.readiness.unregister(READINESS_CHECK)
        await service.stop()
