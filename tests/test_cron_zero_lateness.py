"""`--max-lateness 0s` means "never run late", not "never run": a run the scheduler starts on
time (a few ms past its due time, as every real wake-up is) runs; one after downtime is missed.
The real scheduler on a real crons.json with a fake clock; the CLI accepts the value."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cron.runlog import read_runs
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.cli import run_cli

T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


async def test_zero_max_lateness_runs_on_time_and_misses_late(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    task = store.add(make_task(name="z", agent="echo", schedule=ScheduleSpec("every", "1h", "UTC"), prompt="p",
                               now=T0, exact=True, max_lateness_s=0))  # fmt: skip
    fired: list[int] = []

    async def fire(t: CronTask, occ: Occurrence) -> str:
        fired.append(occ.number)
        return f"turn_{occ.number}"

    now = T0 + timedelta(hours=1, milliseconds=300)  # a normal wake-up, just past the due time
    s = Scheduler(store, fire=fire, clock=lambda: now)
    await s.tick()
    assert fired == [1], [r for r in read_runs(store.runs_dir, task.id)]
    now = T0 + timedelta(hours=2, minutes=10)  # after downtime: late, so missed
    await s.tick()
    assert fired == [1]
    assert [r["event"] for r in read_runs(store.runs_dir, task.id)] == ["fired", "submitted", "missed"]
    await s.close()


def test_the_cli_accepts_a_zero_max_lateness(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "cron", "add", "--name", "z", "--agent", "assistant", "--every", "5s", "--exact",
                "--max-lateness", "0s", "--prompt", "z", "--json")  # fmt: skip
    assert r.code == 0, r.err
    assert json.loads(r.out)["max_lateness_s"] == 0
