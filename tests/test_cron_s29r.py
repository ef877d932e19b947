"""A `run_all` catch-up runs the missed occurrences one after another, never side by side.

Before the fix a tick claimed every overdue occurrence of a `run_all` task and submitted them all at
once (~20 ms apart): the runs of one task overlapped (README: "Runs of one task never overlap"),
and with more than three open at once the tasks stopped following the oldest ("more than 3 of its
runs are open at once; run(s) #… are no longer followed"). Now they are still all claimed (and
logged `fired`) in that tick, so each is claimed and adopted by a take-over once, and each is
submitted once the run before it has its outcome.

Real parts: a real `Scheduler` and `CronStore` on a temporary home with a fake kernel whose turns
end when the test says (as in the other cron tests), and a real `appserver serve` stopped and
started again, read through its run log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(90)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NOT_FOLLOWED = "no longer followed"


class Kernel:
    """A fake kernel: records each submitted turn; a turn ends when `end` is called for it."""

    def __init__(self) -> None:
        self.fired: list[int] = []
        self.ends: dict[str, asyncio.Event] = {}

    def _event(self, turn_id: str) -> asyncio.Event:
        return self.ends.setdefault(turn_id, asyncio.Event())

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        self.fired.append(occ.number)
        return f"turn_{occ.number}"

    async def outcome(self, turn_id: str) -> TurnOutcome:
        await self._event(turn_id).wait()
        return TurnOutcome("completed", reply="ok")

    def end(self, number: int) -> None:
        self._event(f"turn_{number}").set()


async def _until(check: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _catch_up_task(store: CronStore) -> CronTask:
    task = make_task(
        name="catch-up",
        agent="assistant",
        schedule=ScheduleSpec("every", "1m", "UTC"),
        prompt="hi",
        now=T0,
        exact=True,
        misfire="run_all",
        max_lateness_s=3600,
    )
    with store.transaction() as state:
        state.tasks.append(task)
    return task


def _assert_one_after_another(records: list[dict[str, Any]], *, all_ended: bool = True) -> None:
    """Each run fired, submitted and ended once (`all_ended`: the last may still be going); none
    submitted before the one before it ended."""
    by_run: dict[int, list[str]] = {}
    open_runs: set[int] = set()
    for r in records:
        number = r.get("occurrence")
        if not isinstance(number, int):
            continue
        by_run.setdefault(number, []).append(r["event"])
        if r["event"] == "submitted":
            assert not open_runs, f"run #{number} submitted while run(s) {sorted(open_runs)} still open: {records}"
            open_runs.add(number)
        elif r["event"] == "outcome":
            open_runs.discard(number)
    for number, events in by_run.items():
        assert len(events) == len(set(events)), (number, events)
        if all_ended or number != max(by_run):
            assert sorted(events) == ["fired", "outcome", "submitted"], (number, events)


async def test_run_all_catch_up_submits_each_run_after_the_one_before_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CronStore(tmp_path / "home")
    task = _catch_up_task(store)
    kernel = Kernel()
    now = T0 + timedelta(minutes=5, seconds=30)  # five occurrences missed, all within the cap
    scheduler = Scheduler(store, fire=kernel.fire, clock=lambda: now, await_outcome=kernel.outcome)
    with caplog.at_level(logging.WARNING, logger="appserver.cron"):
        try:
            report = await scheduler.tick()
            assert report.missed == 0
            claims = {c["occurrence"]: c["progress"] for c in store.read().tasks[0].claim_records()}
            assert claims == {1: "submitted", 2: "claimed", 3: "claimed", 4: "claimed", 5: "claimed"}
            assert [r["occurrence"] for r in read_runs(store.runs_dir, task.id) if r["event"] == "fired"] == [
                1,
                2,
                3,
                4,
                5,
            ]
            await asyncio.sleep(0.2)
            assert kernel.fired == [1], "a catch-up run was submitted beside the one still running"
            await scheduler.tick()  # a tick meanwhile neither fires them nor skips them
            assert kernel.fired == [1]
            for number in range(1, 6):
                kernel.end(number)
                if number < 5:
                    await _until(lambda n=number: kernel.fired[-1] == n + 1, f"run #{number + 1} to be submitted")
                    await asyncio.sleep(0.05)
                    assert kernel.fired == list(range(1, number + 2))
            await scheduler.wait_outcomes(10)
        finally:
            await scheduler.close()
    _assert_one_after_another(read_runs(store.runs_dir, task.id))
    assert [r.getMessage() for r in caplog.records if NOT_FOLLOWED in r.getMessage()] == []
    assert all(c["progress"] == "done" for c in store.read().tasks[0].claim_records())


async def test_a_catch_up_run_waiting_its_turn_is_not_started_once_its_task_is_disabled(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    task = _catch_up_task(store)
    kernel = Kernel()
    now = T0 + timedelta(minutes=3, seconds=30)
    scheduler = Scheduler(store, fire=kernel.fire, clock=lambda: now, await_outcome=kernel.outcome)
    try:
        await scheduler.tick()
        assert kernel.fired == [1]
        with store.transaction() as state:
            state.tasks[0].enabled = False
        kernel.end(1)
        await scheduler.wait_outcomes(10)
    finally:
        await scheduler.close()
    assert kernel.fired == [1]
    outcomes = {r["occurrence"]: r for r in read_runs(store.runs_dir, task.id) if r["event"] == "outcome"}
    assert outcomes[1]["status"] == "completed"
    for number in (2, 3):
        assert outcomes[number]["status"] == "cancelled"
        assert "disabled before this run began" in outcomes[number]["error"]


async def test_runs_waiting_their_turn_at_a_stop_are_taken_over_one_after_another_each_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler stopped while its catch-up runs wait their turn leaves them claimed; the next one
    adopts them and submits each once (the kernel's key says which never reached it), in turn."""
    store = CronStore(tmp_path / "home")
    task = _catch_up_task(store)
    kernel = Kernel()

    async def claimed_turn(task: CronTask, occ: Occurrence) -> str | None:
        return f"turn_{occ.number}" if occ.number in kernel.fired else None

    now = T0 + timedelta(minutes=4, seconds=30)
    first = Scheduler(store, fire=kernel.fire, clock=lambda: now, await_outcome=kernel.outcome)
    await first.tick()
    await asyncio.sleep(0.1)
    await first.close()  # run #1 still going, #2-#4 waiting their turn
    assert kernel.fired == [1]
    second = Scheduler(
        CronStore(tmp_path / "home"),
        fire=kernel.fire,
        clock=lambda: now,
        await_outcome=kernel.outcome,
        claimed_turn=claimed_turn,
    )
    with caplog.at_level(logging.WARNING, logger="appserver.cron"):
        try:
            await second.tick()
            await asyncio.sleep(0.2)
            assert kernel.fired == [1], "an adopted run was submitted beside the one still running"
            for number in range(1, 5):
                kernel.end(number)
                if number < 4:
                    await _until(lambda n=number: kernel.fired[-1] == n + 1, f"run #{number + 1} to be submitted")
            await second.wait_outcomes(10)
        finally:
            await second.close()
    assert kernel.fired == [1, 2, 3, 4]
    _assert_one_after_another(read_runs(store.runs_dir, task.id))
    assert [r.getMessage() for r in caplog.records if NOT_FOLLOWED in r.getMessage()] == []


def _ok(home: Path, env: dict[str, str], *args: str) -> CLIResult:
    r = run_cli(home, *args, env=env)
    assert r.code == 0, (args, r.out, r.err)
    return r


def test_a_server_down_for_a_while_catches_a_run_all_task_up_one_run_after_another(tmp_path: Path) -> None:
    """The outside tester's case (`--every 2s --misfire run_all`, the server down ~9 s), at twice the
    pace: `--every 1s`, the server down ~5 s."""
    home = tmp_path / "home"
    env = cli_env(home)
    _ok(home, env, "run", "hi")
    task_id = _ok(
        home, env, "cron", "add", "--name", "ca", "--agent", "assistant", "--every", "1s", "--exact",
        "--misfire", "run_all", "--max-lateness", "1h", "--prompt", "hi", "--json",
    ).json()["id"]  # fmt: skip
    runs = home / "cron-runs" / f"{task_id}.jsonl"

    def records() -> list[dict[str, Any]]:
        text = runs.read_text() if runs.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    first = start_serve(home, env=env)
    try:
        deadline = time.monotonic() + 20
        while not any(r["event"] == "outcome" for r in records()):
            assert time.monotonic() < deadline, "the task never ran"
            time.sleep(0.05)
    finally:
        first.stop()
        first.kill()
    before = len(records())
    time.sleep(5)  # four or more occurrences come due while no server runs
    second = start_serve(home, env=env)
    try:
        time.sleep(4)
    finally:
        second.stop()
        second.kill()
        log = second.proc.stderr.read() if second.proc.stderr else ""  # type: ignore[union-attr]
    caught_up = [r for r in records()[before:] if r["event"] == "fired" and r.get("catch_up")]
    assert len(caught_up) >= 3, records()
    _assert_one_after_another(records(), all_ended=False)
    assert NOT_FOLLOWED not in log, log
