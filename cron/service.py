"""The cron service inside `serve`: the scheduler loop, "run now" for the server's clients, and the
outcomes a previous server left unrecorded. It reaches the kernel only through `cron.adapter`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from appserver.readiness import CheckResult
from appserver.server import Server
from cron.adapter import KernelAdapter
from cron.runner import DeliverFn, RunNowResult, TurnOutcome, record_outcome
from cron.scheduler import Scheduler

log = logging.getLogger("appserver.cron")


READINESS_CHECK = "cron"  # its name in /readyz while `serve` runs the service


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
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[int] | None = None

    def start(self) -> None:
        config = self.server.config
        if self.server.kernel.owner.startswith("inst_"):  # a server of a cluster: tasks in the database
            self.scheduler.store.join_cluster(
                self.server.kernel.owner, config.store.instance_timeout_s, config.store.heartbeat_s
            )
        self._task = asyncio.get_running_loop().create_task(self.scheduler.run(self._stop), name="cron-scheduler")

    def problem(self) -> str | None:
        """One line saying why cron cannot do its job (a crons.json set aside as corrupt and not
        yet dealt with, a tick that keeps failing), or None. Cheap and synchronous: for /readyz."""
        return self.scheduler.problem()

    async def readiness(self) -> CheckResult:
        """The `cron` check of /readyz: a problem warns (the server still serves; the operator
        has something to look at), it never makes the server unready."""
        problem = self.problem()
        return CheckResult("warn", problem) if problem else CheckResult("ok")

    def start_recovery(self) -> None:
        self._recovery = asyncio.get_running_loop().create_task(self.recover_outcomes(), name="cron-recover-outcomes")

    async def recover_outcomes(self) -> int:
        """Record the outcomes of cron turns that a previous server submitted but did not see end
        (killed, or stopped while they were queued or running): this process settles or runs
        them now. Each is watched until it ends, then logged like any other; returns how many."""
        pending = await asyncio.to_thread(self.scheduler.unrecorded_turns)
        watched = 0
        for task_id, occurrence, turn_id in pending:
            turn = await self.server.store.get_turn(turn_id)
            if turn is None:  # accepted by a process that died before its store commit
                await asyncio.to_thread(
                    record_outcome,
                    self.scheduler.store,
                    task_id,
                    occurrence,
                    turn_id,
                    TurnOutcome("lost", "the turn never reached the store (its server died)"),
                )
                continue
            if (
                turn.owner
                and turn.owner != self.server.kernel.owner
                and await self.server.kernel.owner_alive(turn.owner)
            ):
                continue  # another live process runs it and will record it
            self.scheduler.watch(task_id, occurrence, turn_id)
            watched += 1
        if pending:
            log.info("cron: recovering the outcome of %d turn(s) of a previous server", len(pending))
        return watched

    async def run_now(self, ref: str, *, agent: str | None = None) -> RunNowResult:
        """Fire task `ref` now in this server: the same claim, envelope, run log and outcome watch
        as `appserver cron run` in-process (the outcome is logged when the turn ends)."""
        return await self.scheduler.run_now(ref, agent=agent)

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
    try:
        yield
    finally:
        server.readiness.unregister(READINESS_CHECK)
        await service.stop()
