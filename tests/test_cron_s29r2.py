"""A take-over that adopts a `run_all` catch-up still waiting its turn skips an occurrence due then.

Before the fix the scheduler taking the lease over from one stopped partway through a catch-up
(runs #1 going, the rest claimed and waiting their turn) judged the occurrence due at that moment
against the runs it followed itself, none yet: the adopted claims were resolved only after the
planning. So the new occurrence was claimed and logged `fired`, queued behind the adopted runs, and
the occurrences after it were skipped behind it: one run more than without the stop, where an
occurrence due while a catch-up is queued is skipped ("skipped (previous run #N still queued or
running)"). Now the claims a take-over adopts count as queued while its tick plans.

Real parts: a real `Scheduler` and `CronStore` on a temporary home with the fake kernel of
tests/test_cron_s29r.py (turns end when the test says).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from cron.runlog import read_runs
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence
from tests.test_cron_s29r import T0, Kernel, _assert_one_after_another, _catch_up_task, _until

pytestmark = pytest.mark.timeout(60)


async def test_an_occurrence_due_as_a_take_over_adopts_a_waiting_catch_up_is_skipped_not_fired(
    tmp_path: Path,
) -> None:
    store = CronStore(tmp_path / "home")
    task = _catch_up_task(store)
    kernel = Kernel()

    async def claimed_turn(task: CronTask, occ: Occurrence) -> str | None:
        return f"turn_{occ.number}" if occ.number in kernel.fired else None

    first_now = T0 + timedelta(minutes=4, seconds=30)  # runs #1-#4 caught up, one after another
    first = Scheduler(store, fire=kernel.fire, clock=lambda: first_now, await_outcome=kernel.outcome)
    await first.tick()
    await asyncio.sleep(0.1)
    await first.close()  # stopped partway: run #1 still going, #2-#4 claimed, waiting their turn
    assert kernel.fired == [1]

    now = T0 + timedelta(minutes=5, seconds=1)  # the take-over's tick: the 5-minute occurrence is due
    second = Scheduler(
        CronStore(tmp_path / "home"),
        fire=kernel.fire,
        clock=lambda: now,
        await_outcome=kernel.outcome,
        claimed_turn=claimed_turn,
    )
    try:
        report = await second.tick()
        assert report.missed == 1
        for number in range(1, 5):
            kernel.end(number)
            if number < 4:
                await _until(lambda n=number: kernel.fired[-1] == n + 1, f"run #{number + 1} to be submitted")
        await second.wait_outcomes(10)
        await asyncio.sleep(0.1)
    finally:
        await second.close()
    assert kernel.fired == [1, 2, 3, 4], "an occurrence due at the take-over ran behind the adopted catch-up"
    records = read_runs(store.runs_dir, task.id)
    assert [r["occurrence"] for r in records if r["event"] == "fired"] == [1, 2, 3, 4]
    missed = [r for r in records if r["event"] == "missed"]
    assert len(missed) == 1, records
    assert missed[0]["scheduled_for"] == (T0 + timedelta(minutes=5)).isoformat()
    assert "still queued or running" in missed[0]["reason"]
    _assert_one_after_another(records)
