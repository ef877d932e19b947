"""Cron ↔ kernel: firing is a kernel `submit` of a `cron_prompt` turn; outcomes come from its snapshot."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from appserver.procid import identity_alive
from appserver.runtime.kernel import SubmitRequest
from appserver.server import Server
from cron.runner import (
    AgentNameFn,
    AwaitOutcomeFn,
    CronSubmission,
    RunNowResult,
    SubmitFn,
    TurnOutcome,
    make_fire,
    record_outcome,
)
from cron.scheduler import Scheduler

log = logging.getLogger("appserver.cron")


def kernel_submit(server: Server) -> SubmitFn:
    async def submit(sub: CronSubmission) -> str | None:
        source: dict[str, Any] = {"kind": sub.kind, "deliver": sub.deliver, **sub.metadata}
        submission = await server.kernel.submit(
            SubmitRequest(
                agent=sub.agent,
                input=sub.input_text,
                conversation=sub.conversation,
                source=source,
                # one occurrence is one turn, even if the submit is retried
                idempotency_key=f"cron:{sub.task_id}:{sub.occurrence.number}",
            )
        )
        return submission.turn_id

    return submit


def kernel_await_outcome(server: Server) -> AwaitOutcomeFn:
    async def wait(turn_id: str) -> TurnOutcome:
        turn = await server.store.get_turn(turn_id)
        if turn is None:
            return TurnOutcome("unknown", f"turn {turn_id} not found")
        snap = await (await server.kernel.handle_for(turn)).wait_settled()
        error = (snap.error or {}).get("message") if snap.status != "completed" else None
        return TurnOutcome(
            snap.status,
            error,
            {"stop_reason": snap.stop_reason, "conversation_id": snap.conversation_id},
        )

    return wait


def kernel_agent_name(server: Server) -> AgentNameFn:
    """The agent's name for the envelope (None when the agent is gone: the id is shown)."""

    async def name(agent_id: str) -> str | None:
        agent = await server.store.get_agent(agent_id)
        return None if agent is None else agent.name

    return name


SERVICE_KEY = "cron"  # server.services[SERVICE_KEY] while `serve` runs


class CronService:
    """The scheduler inside `serve`: one per home, guarded by the crons.json lease. Also "run now"
    for clients of the server (the `cron_run` frame), with or without the lease or the loop."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.scheduler = Scheduler.from_config(
            server.config,
            fire=make_fire(kernel_submit(server), kernel_agent_name(server)),
            await_outcome=kernel_await_outcome(server),
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[int] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self.scheduler.run(self._stop), name="cron-scheduler"
        )

    def problem(self) -> str | None:
        """One line saying why cron cannot do its job (a crons.json set aside as corrupt and not
        yet dealt with, a tick that keeps failing), or None. Cheap and synchronous: for /readyz."""
        return self.scheduler.problem()

    def start_recovery(self) -> None:
        self._recovery = asyncio.get_running_loop().create_task(
            self.recover_outcomes(), name="cron-recover-outcomes"
        )

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
            if turn.owner and turn.owner != self.server.kernel.owner and identity_alive(turn.owner):
                continue  # another live process runs it and will record it
            self.scheduler.watch(task_id, occurrence, turn_id)
            watched += 1
        if pending:
            log.info(
                "cron: recovering the outcome of %d turn(s) of a previous server", len(pending)
            )
        return watched

    async def run_now(self, ref: str, *, agent: str | None = None) -> RunNowResult:
        """Fire task `ref` now in this server: the same claim, envelope, run log and outcome watch
        as `appserver cron run` in-process (the outcome is logged when the turn ends)."""
        return await self.scheduler.run_now(ref, agent=agent)

    async def stop(self) -> None:
        self._stop.set()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:
                log.exception("cron scheduler stopped with an error")
        await self.scheduler.close()


@asynccontextmanager
async def cron_background(server: Server) -> AsyncIterator[None]:
    """The scheduler as a background service of `serve` (its loop is off with
    APPSERVER_DISABLE_CRON=1; "run now" through the server works either way)."""
    service = CronService(server)
    server.services[SERVICE_KEY] = service
    service.start_recovery()  # this process owns the home's turns, scheduler or not
    if server.config.cron.enabled:
        service.start()
    try:
        yield
    finally:
        server.services.pop(SERVICE_KEY, None)
        await service.stop()
