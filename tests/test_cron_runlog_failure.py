"""A run log the disk refuses never loses a claimed run, its own or another task's.

Real files: a directory squats on one task's run-log path (the write fails with EISDIR, as a full
or broken disk would fail it). The claims are saved first, every due task still fires exactly
once, the refused records are kept and retried in order once the path is writable again, and the
problem is reported (for /readyz and the log) while it lasts.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cron.runlog import read_runs
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Kernel:
    """The injected `fire` (the kernel's seam): records what was submitted."""

    def __init__(self) -> None:
        self.fired: list[tuple[str, int]] = []

    async def __call__(self, task: CronTask, occ: Occurrence) -> str:
        self.fired.append((task.name, occ.number))
        return f"turn_{task.name}_{occ.number}"


def add(store: CronStore, name: str) -> CronTask:
    spec = ScheduleSpec("every", "1h", "UTC")
    return store.add(make_task(name=name, agent="echo", schedule=spec, prompt="p", now=T0, exact=True))


@pytest.fixture
def store(tmp_path: Path) -> CronStore:
    return CronStore(tmp_path / "home")


async def test_a_refused_run_log_write_loses_no_run_and_is_retried(store: CronStore) -> None:
    broken, fine = add(store, "broken"), add(store, "fine")
    blocker = store.runs_dir / f"{broken.id}.jsonl"
    blocker.mkdir(parents=True)  # every write to this task's log fails
    kernel = Kernel()
    clock = Clock(T0 + timedelta(hours=1))
    s = Scheduler(store, fire=kernel, clock=clock)

    report = await s.tick()
    assert sorted(kernel.fired) == [("broken", 1), ("fine", 1)]  # both fired, neither lost
    assert sorted(report.fired) == sorted([(broken.id, 1, "turn_broken_1"), (fine.id, 1, "turn_fine_1")])
    assert [r["event"] for r in read_runs(store.runs_dir, fine.id)] == ["fired", "submitted"]
    assert store.read().get(broken.id).occurrence == 1  # type: ignore[union-attr]  # the claim is saved
    problem = s.problem()
    assert problem is not None and "run-log record(s) could not be written" in problem

    await s.tick()  # still refused: nothing fires twice, nothing is dropped
    assert len(kernel.fired) == 2

    blocker.rmdir()  # the disk recovers
    await s.tick()
    records = read_runs(store.runs_dir, broken.id)
    assert [(r["event"], r.get("occurrence")) for r in records] == [("fired", 1), ("submitted", 1)]
    assert records[1]["turn_id"] == "turn_broken_1"
    assert s.problem() is None
    clock.now += timedelta(hours=1)
    await s.tick()
    assert sorted(kernel.fired) == [("broken", 1), ("broken", 2), ("fine", 1), ("fine", 2)]


def test_a_line_cut_short_by_a_full_disk_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    """The disk filled in the middle of a record: the next write starts on a line of its own, so
    only the torn line is unreadable (was: the next good record was glued onto it and lost too)."""
    from cron.runlog import append_run, run_log_path

    runs = tmp_path / "cron-runs"
    append_run(runs, "cron_torn", "fired", occurrence=1)
    with open(run_log_path(runs, "cron_torn"), "ab") as f:
        f.write(b'{"task_id": "cron_torn", "event": "fir')  # what a short write left
    append_run(runs, "cron_torn", "fired", occurrence=2)
    assert [(r["event"], r.get("occurrence")) for r in read_runs(runs, "cron_torn")] == [("fired", 1), ("fired", 2)]


def test_records_the_disk_still_refuses_at_stop_go_whole_into_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cron.runlog import RunLog

    runs = tmp_path / "cron-runs"
    runs.write_text("a file where the directory should be: every write fails")
    writer = RunLog(runs)
    writer.record("cron_lost", "fired", occurrence=7)
    assert writer.problem() is not None
    writer.close()
    lines = [r.getMessage() for r in caplog.records if "never written" in r.getMessage()]
    assert len(lines) == 1 and '"task_id": "cron_lost"' in lines[0] and '"occurrence": 7' in lines[0]
    assert writer.problem() is None


async def test_a_crons_json_the_disk_will_not_replace_is_one_line_not_a_traceback_a_tick(
    store: CronStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An immutable (or read-only) crons.json: the claim cannot be saved, so nothing fires (a run
    it could not claim must not run), and the log says so in one line naming crons.json itself,
    not a traceback per tick naming a temporary file with a new random name each time."""
    add(store, "due")
    path = store.path
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    kernel = Kernel()
    s = Scheduler(store, fire=kernel, clock=Clock(T0 + timedelta(hours=1)), tick_s=0.1, watch_s=0.05)
    stop = asyncio.Event()
    try:
        with caplog.at_level(logging.INFO, logger="appserver.cron"):
            loop = asyncio.create_task(s.run(stop))
            await asyncio.sleep(0.8)  # several ticks
            stop.set()
            await asyncio.wait_for(loop, 10)
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    assert kernel.fired == []
    # the scheduler's own lines: a foreign task an earlier test left behind logs on asyncio's logger
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("appserver.cron")]
    assert all(r.exc_info is None for r in errors), [r.getMessage() for r in errors]
    assert [r.getMessage() for r in errors] == [f"cron: tick skipped: Operation not permitted: {path}"]
