"""Cron fixes of s23: a missed one-shot shows `missed` (not `done`) and is logged once; a run
longer than its interval skips the occurrences that come due meanwhile instead of piling them up;
a removed or disabled task's queued runs are dropped; a tick's submitted runs are saved in one
write; a miss while the scheduler ran does not blame downtime; a delivery failure shows its reason
without Python class names.

The scheduler is the real one on a real crons.json with a fake clock and a fake kernel (as in
tests/test_cron_scheduler.py); the queued-run drop through `KernelAdapter` uses a real kernel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appserver.runtime import SubmitRequest
from cron.adapter import KernelAdapter
from cron.runlog import read_runs
from cron.runner import CronSubmission, TurnOutcome
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.kernel import open_server

T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Kernel:
    """A fake kernel whose turns wait in a queue until `start`ed, then run until `finish`ed."""

    def __init__(self) -> None:
        self.fired: list[tuple[str, int]] = []
        self.ends: dict[str, asyncio.Future[TurnOutcome]] = {}
        self.started: set[str] = set()
        self.withdrawn: list[tuple[str, str]] = []

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        turn = f"turn_{task.name}_{occ.number}"
        self.fired.append((task.name, occ.number))
        self.ends[turn] = asyncio.get_running_loop().create_future()
        return turn

    async def outcome(self, turn_id: str) -> TurnOutcome:
        return await self.ends[turn_id]

    def finish(self, turn_id: str) -> None:
        self.ends[turn_id].set_result(TurnOutcome("completed", reply="ok"))

    async def withdraw(self, turn_id: str, why: str) -> bool:
        if turn_id in self.started or self.ends[turn_id].done():
            return False
        self.withdrawn.append((turn_id, why))
        self.ends[turn_id].set_result(TurnOutcome("cancelled", "a cancel named it before it started"))
        return True


def add(store: CronStore, name: str, spec: ScheduleSpec, **kw: Any) -> CronTask:
    return store.add(make_task(name=name, agent="echo", schedule=spec, prompt=f"do {name}", now=T0, exact=True, **kw))


def runs(store: CronStore, task: CronTask, event: str) -> list[dict[str, Any]]:
    return [r for r in read_runs(store.runs_dir, task.id) if r["event"] == event]


def warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


@pytest.fixture
def store(tmp_path: Path) -> CronStore:
    return CronStore(tmp_path / "home")


# ------------------------------------------------------------------ 1. a missed one-shot


async def test_a_one_shot_missed_while_the_server_was_down_is_missed_not_done(
    store: CronStore, caplog: pytest.LogCaptureFixture
) -> None:
    task = add(store, "remind", ScheduleSpec("in", "2s", "UTC"), max_lateness_s=1.0)
    clock = Clock(T0 + timedelta(seconds=8))  # the server starts 6 s after it was due
    s = Scheduler(store, fire=Kernel().fire, clock=clock)
    caplog.set_level(logging.WARNING, logger="appserver.cron")
    await s.tick()
    clock.now += timedelta(seconds=5)
    await s.tick()  # nothing new: no second warning
    shown = store.read().get(task.id)
    assert shown is not None and shown.state == "missed" and shown.occurrence == 0
    assert shown.last_error is not None and shown.last_error.startswith("missed the run scheduled for")
    assert "the scheduler was not running" in shown.last_error
    assert len(runs(store, task, "missed")) == 1
    assert len(warnings(caplog, "missed the occurrence")) == 1
    await s.close()


async def test_a_later_good_run_clears_the_missed_note_of_a_recurring_task(store: CronStore) -> None:
    kernel = Kernel()
    task = add(store, "hourly", ScheduleSpec("every", "1h", "UTC"), max_lateness_s=60.0)
    clock = Clock(T0 + timedelta(hours=2, minutes=30))  # #1 (01:00) and 02:00 missed while down
    s = Scheduler(store, fire=kernel.fire, clock=clock, await_outcome=kernel.outcome)
    await s.tick()
    shown = store.read().get(task.id)
    assert shown is not None and shown.state == "scheduled" and (shown.last_error or "").startswith("missed ")
    clock.now = T0 + timedelta(hours=3)
    await s.tick()
    kernel.finish("turn_hourly_1")
    await s.wait_outcomes(5)
    shown = store.read().get(task.id)
    assert shown is not None and shown.last_error is None
    await s.close()


# ------------------------------------------------------------------ 2. overlap


async def test_an_occurrence_due_while_the_previous_run_runs_is_skipped_and_said_once(
    store: CronStore, caplog: pytest.LogCaptureFixture
) -> None:
    kernel = Kernel()
    task = add(store, "slow", ScheduleSpec("every", "2s", "UTC"), conversation="default")
    clock = Clock(T0 + timedelta(seconds=2))
    s = Scheduler(store, fire=kernel.fire, clock=clock, await_outcome=kernel.outcome)
    caplog.set_level(logging.WARNING, logger="appserver.cron")
    await s.tick()
    assert kernel.fired == [("slow", 1)]
    for _ in range(3):  # run #1 still going: 3 occurrences skipped, not queued behind it
        clock.now += timedelta(seconds=2)
        await s.tick()
    assert kernel.fired == [("slow", 1)]
    skipped = runs(store, task, "missed")
    assert [r["reason"] for r in skipped] == ["skipped (previous run #1 still queued or running)"] * 3
    assert len(warnings(caplog, "still queued or running")) == 1
    shown = store.read().get(task.id)  # a run that never ends (behind a pending approval) shows
    assert shown is not None and shown.state == "scheduled"
    assert "previous run #1 still queued" in (shown.last_error or "")
    kernel.finish("turn_slow_1")
    await s.wait_outcomes(5)
    clock.now += timedelta(seconds=2)
    await s.tick()
    assert kernel.fired == [("slow", 1), ("slow", 2)]
    clock.now += timedelta(seconds=2)
    await s.tick()  # run #2 too is slower than the interval: not said again
    assert len(runs(store, task, "missed")) == 4 and len(warnings(caplog, "still queued or running")) == 1
    await s.close()


@pytest.mark.parametrize("how", ["remove", "disable"])
async def test_a_removed_or_disabled_task_drops_its_queued_run_and_lets_a_running_one_finish(
    store: CronStore, how: str
) -> None:
    kernel = Kernel()
    a = add(store, "a", ScheduleSpec("every", "1h", "UTC"))
    b = add(store, "b", ScheduleSpec("every", "1h", "UTC"))
    clock = Clock(T0 + timedelta(hours=1))
    s = Scheduler(store, fire=kernel.fire, clock=clock, await_outcome=kernel.outcome, withdraw=kernel.withdraw)
    await s.tick()
    kernel.started.add("turn_b_1")  # b's run has started, a's waits in its queue
    for task in (a, b):
        store.remove(task.id) if how == "remove" else store.set_enabled(task.id, False)
    clock.now += timedelta(seconds=1)
    await s.tick()
    why = f"not started: the task was {how}d before this run began"
    assert kernel.withdrawn == [("turn_a_1", why)]
    kernel.finish("turn_b_1")
    await s.wait_outcomes(5)
    assert [(r["status"], r["error"]) for r in runs(store, a, "outcome")] == [("cancelled", why)]
    assert [r["status"] for r in runs(store, b, "outcome")] == ["completed"]
    await s.close()


async def test_the_kernel_adapter_drops_a_queued_cron_turn_but_not_a_running_one(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "home")
    try:
        kernel = server.kernel
        adapter = KernelAdapter(kernel, server.store)
        busy = await kernel.submit(SubmitRequest(agent="assistant", input="/slow 400", conversation="new"))
        task = make_task(name="q", agent="assistant", schedule=ScheduleSpec("every", "1h", "UTC"), prompt="p", now=T0)
        task.conversation = busy.conversation_id
        occ = Occurrence(task.id, 1, T0, T0, T0)
        queued = await adapter.submit(CronSubmission.of(task, occ))
        assert queued is not None
        for _ in range(200):  # until the busy turn runs (no timing asserted: it only has to start)
            if kernel.active_turn(busy.conversation_id) == busy.turn_id:
                break
            await asyncio.sleep(0.01)
        assert not await adapter.withdraw(busy.turn_id, "x")  # running: left to finish
        assert await adapter.withdraw(queued, "the task was removed")
        ended = await asyncio.wait_for(adapter.outcome(queued), 10)
        assert ended.status == "cancelled"
        await kernel.cancel(busy.conversation_id)
    finally:
        await server.close()


# ------------------------------------------------------------------ 3. one save per tick, true reasons


_SAVES: list[str] = []
_WATCHED: list[str] = []


def _count_saves(event: str, args: tuple[Any, ...]) -> None:
    if event == "os.rename" and _WATCHED and os.fspath(args[1]) == _WATCHED[0]:
        _SAVES.append(event)


sys.addaudithook(_count_saves)  # observes only: counts crons.json replacements while a test asks


async def test_a_tick_that_submits_thirty_runs_saves_crons_json_at_most_twice(store: CronStore) -> None:
    tasks = [add(store, f"s{i}", ScheduleSpec("every", "1s", "UTC")) for i in range(30)]
    kernel = Kernel()
    s = Scheduler(store, fire=kernel.fire, clock=Clock(T0 + timedelta(seconds=1)))
    _WATCHED[:] = [str(store.path)]
    _SAVES.clear()
    try:
        report = await s.tick()
    finally:
        _WATCHED.clear()
    assert len(report.fired) == 30
    assert 1 <= len(_SAVES) <= 2, _SAVES  # the claims, then every run's `submitted` step
    assert all(store.claim_progress(t.id, 1) == (True, "submitted") for t in tasks)
    await s.close()


async def test_an_occurrence_missed_while_the_scheduler_ran_does_not_blame_downtime(store: CronStore) -> None:
    task = add(store, "fast", ScheduleSpec("every", "1s", "UTC"))
    clock = Clock(T0 + timedelta(milliseconds=500))
    s = Scheduler(store, fire=Kernel().fire, clock=clock)
    await s.tick()  # holds the lease from here on
    clock.now = T0 + timedelta(seconds=3, milliseconds=100)  # a slow tick: 1 s and 2 s passed unrun
    await s.tick()
    reasons = [r["reason"] for r in runs(store, task, "missed")]
    assert len(reasons) == 2
    assert all("downtime" not in r and "not running" not in r and "fell behind" in r for r in reasons), reasons
    await s.close()


# ------------------------------------------------------------------ 4. the delivery failure's reason


async def test_a_delivery_failure_shows_its_reason_without_class_names(store: CronStore) -> None:
    kernel = Kernel()
    task = add(store, "d", ScheduleSpec("every", "1h", "UTC"), deliver="webhook:home:kitchen")

    async def deliver(target: str, text: str) -> list[str]:
        raise RuntimeError("reply_url answered 503: ok (after 8 attempts over 61 s)")

    s = Scheduler(
        store, fire=kernel.fire, clock=Clock(T0 + timedelta(hours=1)), await_outcome=kernel.outcome, deliver=deliver
    )
    await s.tick()
    kernel.finish("turn_d_1")
    await s.wait_outcomes(5)
    assert [r["error"] for r in runs(store, task, "delivery_failed")] == [
        "reply_url answered 503: ok (after 8 attempts over 61 s)"
    ]
    await s.close()
