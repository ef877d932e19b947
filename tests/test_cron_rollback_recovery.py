"""Run numbers and claims that must survive what operators and crashes do to the files.

A restored older crons.json (docs/security.md tells operators to restore one after a repair) rolls
each task's run counter back; the next run must not reuse an earlier run's number, whose
idempotency key would make the kernel answer with that earlier turn (nothing would run). A kill -9
in the middle of a `run_all` catch-up leaves several claimed-but-unsubmitted runs; the next
scheduler resolves every one of them (exactly once), also when the lease record was nulled or
damaged. Real crons.json and run logs on disk, the real scheduler, a fake clock and a fake kernel
that answers by idempotency key as the real one does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import read_runs
from cron.runner import CronSubmission, run_task_now
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@dataclass
class Kernel:
    """A fake kernel with the real one's idempotency: a key it has seen returns that key's turn
    (a duplicate), so a reused key means nothing ran."""

    turns: dict[str, str] = field(default_factory=dict)  # idempotency key -> turn id
    ran: list[int] = field(default_factory=list)  # occurrence numbers that really started a turn

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        key = CronSubmission.of(task, occ).idempotency_key
        if key not in self.turns:
            self.turns[key] = f"turn_{len(self.turns) + 1}"
            self.ran.append(occ.number)
        return self.turns[key]

    async def claimed_turn(self, task: CronTask, occ: Occurrence) -> str | None:
        return self.turns.get(CronSubmission.of(task, occ).idempotency_key)


def add(store: CronStore, name: str, every: str, **kw: Any) -> CronTask:
    task = make_task(name=name, agent="echo", schedule=ScheduleSpec("every", every, "UTC"), prompt="p", now=T0,
                     exact=True, **kw)  # fmt: skip
    return store.add(task)


def restore(store: CronStore, text: str, *, owner: Any = "keep") -> None:
    """What an operator does: put the backup back in place (atomically, as `cp x.new; mv`)."""
    data = json.loads(text)
    if owner != "keep":
        data["scheduler_owner"] = owner
    tmp = store.path.with_name("crons.json.new")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, store.path)


def submitted(store: CronStore, task: CronTask) -> list[tuple[int, str]]:
    return [(r["occurrence"], r["turn_id"]) for r in read_runs(store.runs_dir, task.id) if r["event"] == "submitted"]


# ------------------------------------------------------------------ item 1: a rolled-back counter


async def test_a_restored_older_crons_json_never_reuses_a_run_number(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    task = add(store, "r", "1h")
    kernel = Kernel()
    clock = FakeClock(T0 + timedelta(hours=1, seconds=1))
    s = Scheduler(store, fire=kernel.fire, clock=clock)
    await s.tick()
    backup = store.path.read_text()  # after run #1
    for hours in (2, 3):
        clock.now = T0 + timedelta(hours=hours, seconds=1)
        await s.tick()
    restore(store, backup)  # the counter says 1 again, and the schedule is back at 02:00
    clock.now = T0 + timedelta(hours=3, minutes=30)  # the restore wakes the scheduler: nothing is due
    await s.tick()
    clock.now = T0 + timedelta(hours=4, seconds=1)
    await s.tick()
    assert kernel.ran == [1, 2, 3, 4]  # run #4 really ran: no old turn came back as a duplicate
    turns = submitted(store, task)
    assert [n for n, _ in turns] == [1, 2, 3, 4]
    assert len({t for _, t in turns}) == 4, turns
    assert store.read().get(task.id).occurrence == 4  # type: ignore[union-attr]
    # every occurrence ran once, and none that ran is called missed
    log = read_runs(store.runs_dir, task.id)
    hours = [datetime.fromisoformat(r["scheduled_for"]) - T0 for r in log if r["event"] == "fired"]
    assert hours == [timedelta(hours=h) for h in (1, 2, 3, 4)], hours
    assert [r for r in log if r["event"] == "missed"] == []
    await s.close()


async def test_a_restore_with_the_run_log_lost_too_still_runs_every_occurrence(tmp_path: Path) -> None:
    """Nothing on disk says which numbers were used (the run log deleted, as docs/security.md
    suggests for a damaged one): a number used again is another occurrence, so another turn."""
    store = CronStore(tmp_path / "home")
    add(store, "r", "1h")
    kernel = Kernel()
    clock = FakeClock(T0 + timedelta(hours=1, seconds=1))
    s = Scheduler(store, fire=kernel.fire, clock=clock)
    await s.tick()
    backup = store.path.read_text()  # after run #1
    clock.now = T0 + timedelta(hours=2, seconds=1)
    await s.tick()
    await s.close()
    restore(store, backup, owner=None)
    for record in store.runs_dir.iterdir():
        record.unlink()
    restarted = Scheduler(store, fire=kernel.fire, clock=FakeClock(T0 + timedelta(hours=3, seconds=1)))
    await restarted.tick()
    assert kernel.ran == [1, 2, 2]  # #2 again, for 03:00: a turn of its own, not 02:00's
    assert len(set(kernel.turns.values())) == 3
    await restarted.close()


async def test_after_a_restore_and_a_restart_numbering_goes_on_past_the_run_log(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    task = add(store, "r", "1h")
    kernel = Kernel()
    clock = FakeClock(T0 + timedelta(hours=1, seconds=1))
    s = Scheduler(store, fire=kernel.fire, clock=clock)
    await s.tick()
    backup = store.path.read_text()
    clock.now = T0 + timedelta(hours=2, seconds=1)
    await s.tick()
    await s.close()
    restore(store, backup, owner=None)  # restored while no server ran
    restarted = Scheduler(store, fire=kernel.fire, clock=FakeClock(T0 + timedelta(hours=2, minutes=30)))
    await restarted.tick()  # the restored schedule says 02:00 is due: it ran already
    restarted.clock = FakeClock(T0 + timedelta(hours=3, seconds=1))
    await restarted.tick()
    # and `cron run` (a manual run, no lease) after the restore takes a fresh number too
    manual = await run_task_now(store, "r", fire=kernel.fire, clock=FakeClock(T0 + timedelta(hours=3, minutes=5)))
    assert kernel.ran == [1, 2, 3, 4], kernel.ran
    assert manual.occurrence.number == 4
    assert len({t for _, t in submitted(store, task)}) == 4
    log = read_runs(store.runs_dir, task.id)
    hours = [datetime.fromisoformat(r["scheduled_for"]) - T0 for r in log if r["event"] == "fired" and not r["manual"]]
    assert hours == [timedelta(hours=h) for h in (1, 2, 3)], hours
    assert [r for r in log if r["event"] == "missed"] == []
    await restarted.close()


# ------------------------------------------------------------------ item 2: every orphan of a crash

CRASH_SCRIPT = r"""
import asyncio, os, signal, sys
from datetime import datetime
from pathlib import Path
from cron.scheduler import Scheduler

calls = []

async def fire(task, occ):
    calls.append(occ.number)
    if len(calls) == 2:  # the first run was submitted; die before the second one is
        os.kill(os.getpid(), signal.SIGKILL)
    return f"turn_first_{occ.number}"

now = datetime.fromisoformat(sys.argv[2])
asyncio.run(Scheduler(Path(sys.argv[1]), fire=fire, clock=lambda: now).tick())
"""


@pytest.mark.parametrize("owner", ["dead", "null", "unusable"])
async def test_every_run_a_killed_run_all_catch_up_claimed_is_recovered_once(
    tmp_path: Path, owner: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CronStore(tmp_path / "home")
    task = add(store, "ra", "1h", misfire="run_all")
    crashed_at = T0 + timedelta(hours=5, seconds=5)  # five runs came due: all claimed in one tick
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(store.home), crashed_at.isoformat()],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert proc.returncode == -9
    fired = [r["occurrence"] for r in read_runs(store.runs_dir, task.id) if r["event"] == "fired"]
    assert fired == [1, 2, 3, 4, 5] and [n for n, _ in submitted(store, task)] == [1]
    if owner != "dead":  # the lease record was nulled or damaged by hand before the restart
        restore(store, store.path.read_text(), owner=None if owner == "null" else 42)

    kernel = Kernel(turns={CronSubmission.of(task, Occurrence(task.id, 1, T0, T0, T0)).idempotency_key: "turn_1"})
    clock = FakeClock(crashed_at + timedelta(seconds=30))
    s = Scheduler(store, fire=kernel.fire, clock=clock, claimed_turn=kernel.claimed_turn)
    with caplog.at_level("WARNING", logger="appserver.cron"):
        rep = await s.tick()
        await s.tick()  # nothing is resolved twice
    assert rep.has_lease
    assert kernel.ran == [2, 3, 4, 5], kernel.ran
    turns = submitted(store, task)
    assert sorted(n for n, _ in turns) == [1, 2, 3, 4, 5], turns
    assert "#2, #3, #4, #5" in caplog.text  # what was recovered is said, not done silently
    await s.close()
    # a later restart finds nothing left to recover
    again = Scheduler(store, fire=kernel.fire, clock=FakeClock(clock.now), claimed_turn=kernel.claimed_turn)
    await again.tick()
    assert kernel.ran == [2, 3, 4, 5]
    await again.close()
