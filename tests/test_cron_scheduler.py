"""The scheduler with a fake clock: claim before fire (check 5), misfire (check 6), DST through
real ticks (check 7), invalid expressions, run now, outcomes, the run loop."""

from __future__ import annotations

import asyncio
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
from cron.runner import CronSubmission, TurnOutcome, run_task_now
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, OwnerRecord, make_task

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kw: float) -> None:
        self.now += timedelta(**kw)


@dataclass
class Recorder:
    """A fake kernel: records fires, returns turn ids."""

    store: CronStore | None = None
    fired: list[tuple[str, int, datetime, bool]] = field(default_factory=list)
    claim_seen: list[bool] = field(default_factory=list)

    async def __call__(self, task: CronTask, occ: Occurrence) -> str:
        if self.store is not None:  # the claim must already be on disk when fire is called
            on_disk = self.store.read().get(task.id)
            self.claim_seen.append(
                on_disk is not None
                and on_disk.occurrence >= occ.number
                and (on_disk.next_fire_at is None or on_disk.next_fire_at > occ.scheduled_for)
            )
        self.fired.append((task.name, occ.number, occ.scheduled_for, occ.catch_up))
        return f"turn_{task.name}_{occ.number}"


def add(store: CronStore, name: str, spec: ScheduleSpec, now: datetime, **kw: Any) -> CronTask:
    kw.setdefault("exact", True)
    return store.add(make_task(name=name, agent="echo", schedule=spec, prompt=f"do {name}", now=now, **kw))


def events(store: CronStore, task: CronTask, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_runs(store.runs_dir, task.id) if r["event"] == kind]


@pytest.fixture
def store(tmp_path: Path) -> CronStore:
    return CronStore(tmp_path / "home")


# ------------------------------------------------------------------ basics


async def test_fires_when_due_and_claims_first(store: CronStore) -> None:
    clock = FakeClock(T0)
    t = add(store, "hourly", ScheduleSpec("every", "1h", "UTC"), T0)
    rec = Recorder(store)
    s = Scheduler(store, fire=rec, clock=clock)
    assert (await s.tick()).fired == []
    clock.advance(minutes=59, seconds=59)
    assert (await s.tick()).fired == []
    clock.advance(seconds=1)
    rep = await s.tick()
    assert rep.has_lease and rep.fired == [(t.id, 1, "turn_hourly_1")]
    assert rec.claim_seen == [True]
    again = await s.tick()  # same instant: nothing fires twice
    assert again.fired == []
    on_disk = store.read().get(t.id)
    assert on_disk is not None and on_disk.occurrence == 1
    assert on_disk.next_fire_at == T0 + timedelta(hours=2)
    assert on_disk.last_claimed and on_disk.last_claimed["occurrence"] == 1
    assert [r["event"] for r in read_runs(store.runs_dir, t.id)] == ["fired", "submitted"]
    assert events(store, t, "submitted")[0]["turn_id"] == "turn_hourly_1"


async def test_one_shot_fires_once_and_is_done(store: CronStore) -> None:
    clock = FakeClock(T0)
    t = add(store, "remind", ScheduleSpec("in", "2h", "UTC"), T0)
    rec = Recorder()
    s = Scheduler(store, fire=rec, clock=clock)
    for _ in range(5):
        clock.advance(hours=1)
        await s.tick()
    assert [f[1] for f in rec.fired] == [1]
    done = store.read().get(t.id)
    assert done is not None and done.next_fire_at is None and done.state == "done"


async def test_jittered_task_fires_at_its_due_time_not_before(store: CronStore) -> None:
    clock = FakeClock(T0)
    t = add(store, "j", ScheduleSpec("cron", "0 * * * *", "UTC"), T0, exact=False)
    assert t.next_due_at is not None and t.next_fire_at is not None
    late = (t.next_due_at - t.next_fire_at).total_seconds()
    assert 0 <= late <= 59
    rec = Recorder()
    s = Scheduler(store, fire=rec, clock=clock)
    clock.now = t.next_due_at - timedelta(milliseconds=1)
    await s.tick()
    assert rec.fired == []
    clock.now = t.next_due_at
    await s.tick()
    assert [(n, when) for _, n, when, _ in rec.fired] == [(1, t.next_fire_at)]  # "Scheduled for" is nominal


async def test_changes_by_other_processes_are_seen_between_ticks(store: CronStore) -> None:
    clock = FakeClock(T0)
    add(store, "a", ScheduleSpec("every", "1h", "UTC"), T0)
    rec = Recorder()
    s = Scheduler(store, fire=rec, clock=clock)
    await s.tick()  # the scheduler now caches the parsed file
    other = CronStore(store.home)  # e.g. `appserver cron add` in another process
    other.add(
        make_task(
            name="b",
            agent="echo",
            schedule=ScheduleSpec("every", "30m", "UTC"),
            prompt="p",
            now=T0,
            exact=True,
        )
    )
    other.set_enabled("a", False)
    clock.advance(hours=1)
    await s.tick()
    assert sorted(f[0] for f in rec.fired) == ["b"]


# ------------------------------------------------------------------ check 6: misfire


@pytest.mark.parametrize(
    ("policy", "n_fired", "n_missed"),
    [("skip", 0, 3), ("run_once", 1, 2), ("run_all", 3, 0)],
)
async def test_misfire_policy_after_downtime(store: CronStore, policy: str, n_fired: int, n_missed: int) -> None:
    t = add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0, misfire=policy, max_lateness_s=300)
    # the server was down from T0 until T0+3h30m: occurrences at +1h, +2h, +3h were missed
    clock = FakeClock(T0 + timedelta(hours=3, minutes=30))
    rec = Recorder(store)
    rep = await Scheduler(store, fire=rec, clock=clock).tick()
    assert len(rec.fired) == n_fired and rep.missed == n_missed
    assert all(rec.claim_seen)
    missed = events(store, t, "missed")
    assert len(missed) == n_missed
    assert all(m["reason"] for m in missed)
    if policy == "skip":
        assert [m["scheduled_for"] for m in missed] == [(T0 + timedelta(hours=h)).isoformat() for h in (1, 2, 3)]
        assert "misfire=skip" in missed[0]["reason"] and "late by" in missed[0]["reason"]
    if policy == "run_once":
        assert rec.fired[0][2] == T0 + timedelta(hours=3) and rec.fired[0][3] is True  # the latest, catch-up
    if policy == "run_all":
        assert [f[2] for f in rec.fired] == [T0 + timedelta(hours=h) for h in (1, 2, 3)]
        assert [f[1] for f in rec.fired] == [1, 2, 3]
    after = store.read().get(t.id)
    assert after is not None and after.next_fire_at == T0 + timedelta(hours=4)
    rep2 = await Scheduler(store, fire=rec, clock=clock).tick()  # a restart: nothing again
    assert rep2.fired == [] and rep2.missed == 0


@pytest.mark.parametrize(("policy", "fired_minutes"), [("skip", [4]), ("run_once", [4]), ("run_all", [1, 2, 3, 4])])
async def test_short_downtime_inside_the_lateness(store: CronStore, policy: str, fired_minutes: list[int]) -> None:
    """Issue 14.15: every minute, default 5 min lateness, down for 4 min. `skip` (and `run_once`)
    run only the most recent occurrence, not a burst of four; every run after the downtime is
    labelled catch-up in the run log."""
    t = add(store, "m", ScheduleSpec("every", "1m", "UTC"), T0, misfire=policy)
    assert t.max_lateness_s == 300
    rec = Recorder(store)
    clock = FakeClock(T0 + timedelta(minutes=4, seconds=10))
    rep = await Scheduler(store, fire=rec, clock=clock).tick()
    assert [(f[2], f[3]) for f in rec.fired] == [(T0 + timedelta(minutes=m), True) for m in fired_minutes]
    fired = events(store, t, "fired")
    assert [f["catch_up"] for f in fired] == [True] * len(fired_minutes)
    missed = events(store, t, "missed")
    assert rep.missed == len(missed) == 4 - len(fired_minutes)
    assert all("most recent" in m["reason"] for m in missed)
    after = store.read().get(t.id)
    assert after is not None and after.next_fire_at == T0 + timedelta(minutes=5)


async def test_within_max_lateness_is_not_a_misfire(store: CronStore) -> None:
    """Within the lateness it runs (not missed), labelled catch-up: it fired after downtime."""
    add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0, misfire="skip", max_lateness_s=600)
    rec = Recorder()
    clock = FakeClock(T0 + timedelta(hours=1, minutes=9))
    s = Scheduler(store, fire=rec, clock=clock)
    rep = await s.tick()
    assert len(rec.fired) == 1 and rep.missed == 0 and rec.fired[0][3] is True
    clock.now = T0 + timedelta(hours=2)
    await s.tick()
    assert rec.fired[1][3] is False  # fired at its due time: not a catch-up


async def test_run_all_is_capped(store: CronStore) -> None:
    t = add(store, "m", ScheduleSpec("every", "1m", "UTC"), T0, misfire="run_all", max_lateness_s=0)
    rec = Recorder()
    rep = await Scheduler(store, fire=rec, clock=FakeClock(T0 + timedelta(minutes=30, seconds=30))).tick()
    assert len(rec.fired) == 10 and rep.missed == 20
    assert rec.fired[-1][2] == T0 + timedelta(minutes=30)  # the most recent ones are kept
    assert "cap" in events(store, t, "missed")[0]["reason"]


@pytest.mark.parametrize("policy", ["skip", "run_once", "run_all"])
async def test_long_outage_is_summarised_and_bounded(store: CronStore, policy: str) -> None:
    t = add(store, "s", ScheduleSpec("every", "1s", "UTC"), T0, misfire=policy, max_lateness_s=0)
    clock = FakeClock(T0 + timedelta(days=1, milliseconds=500))  # 86,400 occurrences came due
    rec = Recorder()
    rep = await Scheduler(store, fire=rec, clock=clock).tick()
    missed = events(store, t, "missed")
    assert "not listed one by one" in missed[0]["reason"]
    assert rep.missed == len(missed) < 30
    latest = T0 + timedelta(days=1)
    if policy == "skip":  # the latest is 0.5 s late: on time, even with a max lateness of 0
        assert [f[2] for f in rec.fired] == [latest]
        assert missed[-1]["scheduled_for"] == (latest - timedelta(seconds=1)).isoformat()
    elif policy == "run_once":
        assert [f[2] for f in rec.fired] == [latest]
    else:
        assert len(rec.fired) == 10 and rec.fired[-1][2] == latest
    after = store.read().get(t.id)
    assert after is not None and after.next_fire_at == latest + timedelta(seconds=1)


# ------------------------------------------------------------------ check 7 through real ticks


@pytest.mark.parametrize(
    ("expr", "tz", "start", "expected_local"),
    [
        ("30 1 * * *", "America/New_York", datetime(2026, 11, 1, 3, 0, tzinfo=UTC), ["01:30-0400"]),
        ("30 2 * * *", "America/New_York", datetime(2026, 3, 8, 4, 0, tzinfo=UTC), ["03:00-0400"]),
        ("0 0 * * *", "Asia/Hebron", datetime(2022, 3, 26, 19, 0, tzinfo=UTC), ["01:00+0300"]),
        ("30 2 * * *", "Europe/Paris", datetime(2026, 3, 28, 23, 0, tzinfo=UTC), ["03:00+0200"]),
    ],
)
async def test_dst_day_minute_by_minute(
    store: CronStore, expr: str, tz: str, start: datetime, expected_local: list[str]
) -> None:
    from zoneinfo import ZoneInfo

    clock = FakeClock(start)
    add(store, "dst", ScheduleSpec("cron", expr, tz), start)
    rec = Recorder()
    s = Scheduler(store, fire=rec, clock=clock)
    for _ in range(6 * 60):  # six hours of minute ticks
        clock.advance(minutes=1)
        await s.tick()
    got = [f[2].astimezone(ZoneInfo(tz)).strftime("%H:%M%z") for f in rec.fired]
    assert got == expected_local


# ------------------------------------------------------------------ invalid expressions, lease


async def test_invalid_expression_keeps_task_and_records_failure(store: CronStore) -> None:
    bad = add(store, "bad", ScheduleSpec("every", "1h", "UTC"), T0)
    add(store, "good", ScheduleSpec("every", "1h", "UTC"), T0)
    raw = json.loads(store.path.read_text())
    for t in raw["tasks"]:
        if t["id"] == bad.id:
            t["schedule"] = {"kind": "cron", "expr": "99 * * * *", "tz": "UTC"}  # hand-edited
    store.path.write_text(json.dumps(raw))
    rec = Recorder()
    clock = FakeClock(T0 + timedelta(hours=1))
    rep = await Scheduler(store, fire=rec, clock=clock).tick()
    assert [f[0] for f in rec.fired] == ["good"]
    assert rep.errors and "invalid schedule" in rep.errors[0]
    kept = store.read().get(bad.id)
    assert kept is not None and kept.state == "error" and "99 * * * *" in (kept.last_error or "")
    assert len(events(store, bad, "error")) == 1
    clock.advance(hours=1)
    await Scheduler(store, fire=rec, clock=clock).tick()
    assert len(events(store, bad, "error")) == 1  # recorded once, not every tick


async def test_without_the_lease_nothing_fires_but_run_now_works(store: CronStore) -> None:
    parent = os.getppid()
    from cron.lease import process_start

    add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0)
    with store.transaction() as state:
        state.scheduler_owner = OwnerRecord(parent, "x" * 32, T0, process_start(parent), os.uname().nodename)
    rec = Recorder()
    clock = FakeClock(T0 + timedelta(hours=1))
    s = Scheduler(store, fire=rec, clock=clock)
    rep = await s.tick()
    assert not rep.has_lease and rec.fired == []
    res = await s.run_now("h")
    assert res.turn_id == "turn_h_1" and res.occurrence.manual
    t = store.read().find("h")
    assert t.occurrence == 1 and t.next_fire_at == T0 + timedelta(hours=1)  # the schedule is untouched
    assert [r["event"] for r in read_runs(store.runs_dir, t.id)] == ["fired", "submitted"]


async def test_fire_failure_is_logged_and_not_retried(store: CronStore) -> None:
    async def broken(task: CronTask, occ: Occurrence) -> str:
        raise RuntimeError("kernel says no")

    t = add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0)
    clock = FakeClock(T0 + timedelta(hours=1))
    s = Scheduler(store, fire=broken, clock=clock)
    rep = await s.tick()
    assert rep.fired == [(t.id, 1, None)]
    failed = events(store, t, "fire_failed")
    assert failed and "kernel says no" in failed[0]["error"]
    assert "kernel says no" in (store.read().get(t.id).last_error or "")  # type: ignore[union-attr]
    assert (await s.tick()).fired == []


# ------------------------------------------------------------------ check 5: kill -9 after claim

CRASH_SCRIPT = r"""
import asyncio, os, signal, sys
from datetime import datetime
from pathlib import Path
from cron.scheduler import Scheduler

async def die(task, occ):
    os.kill(os.getpid(), signal.SIGKILL)  # between the claim and the submit

now = datetime.fromisoformat(sys.argv[2])
asyncio.run(Scheduler(Path(sys.argv[1]), fire=die, clock=lambda: now).tick())
"""


async def test_kill9_between_claim_and_submit_never_fires_again(store: CronStore) -> None:
    t = add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0)
    when = T0 + timedelta(hours=1, seconds=5)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(store.home), when.isoformat()],
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert proc.returncode == -9
    claimed = store.read().get(t.id)
    assert claimed is not None and claimed.occurrence == 1
    assert claimed.next_fire_at == T0 + timedelta(hours=2)
    assert [r["event"] for r in read_runs(store.runs_dir, t.id)] == ["fired"]

    rec = Recorder()
    s = Scheduler(store, fire=rec, clock=FakeClock(when + timedelta(seconds=30)))  # the restart
    rep = await s.tick()
    assert rep.has_lease  # took over from the dead process
    assert rec.fired == []  # the claimed occurrence is not fired again
    s.clock = FakeClock(T0 + timedelta(hours=2))
    await s.tick()
    assert [(n, when_) for _, n, when_, _ in rec.fired] == [(2, T0 + timedelta(hours=2))]
    assert read_runs(store.runs_dir, t.id)[0].get("lost") is True


# ------------------------------------------------------------------ outcomes, the runner, the loop


async def test_outcome_is_recorded_after_the_fire(store: CronStore) -> None:
    submitted: list[CronSubmission] = []

    async def fire(task: CronTask, occ: Occurrence) -> str:  # what KernelAdapter.fire submits
        submitted.append(CronSubmission.of(task, occ))
        return "turn_1"

    async def await_outcome(turn_id: str) -> TurnOutcome:
        await asyncio.sleep(0)
        return TurnOutcome(status="completed")

    t = add(store, "h", ScheduleSpec("every", "1h", "UTC"), T0, conversation="default")
    s = Scheduler(
        store,
        fire=fire,
        clock=FakeClock(T0 + timedelta(hours=1)),
        await_outcome=await_outcome,
    )
    await s.tick()
    await s.wait_outcomes(5)
    assert [r["event"] for r in read_runs(store.runs_dir, t.id)] == [
        "fired",
        "submitted",
        "outcome",
    ]
    sub = submitted[0]
    assert sub.kind == "cron_prompt" and sub.agent == "echo" and sub.conversation == "default"
    assert "Scheduled for:" in sub.input_text and "Current time:" in sub.input_text
    assert "Timezone: UTC" in sub.input_text and sub.input_text.endswith("do h")
    assert sub.metadata["cron_task_id"] == t.id and sub.metadata["occurrence"] == 1
    # one occurrence is one turn: its run number and scheduled time
    assert sub.idempotency_key == f"cron\x1f{t.id}:1@{int(sub.occurrence.scheduled_for.timestamp() * 1000)}"
    assert sub.source == {"kind": "cron_prompt", "deliver": None, **sub.metadata}


async def test_run_task_now_in_process_waits_for_outcome(store: CronStore) -> None:
    add(store, "r", ScheduleSpec("cron", "0 8 * * *", "Europe/Paris"), T0)

    async def fire(task: CronTask, occ: Occurrence) -> str:
        sub = CronSubmission.of(task, occ)
        assert "r" in sub.input_text and "Timezone: Europe/Paris" in sub.input_text
        return "turn_x"

    async def await_outcome(turn_id: str) -> TurnOutcome:
        return TurnOutcome(status="failed", error="model down")

    res = await run_task_now(store.home, "r", fire=fire, await_outcome=await_outcome, clock=lambda: T0)
    assert res.turn_id == "turn_x" and res.outcome is not None and res.outcome.status == "failed"
    recs = read_runs(store.runs_dir, res.task.id)
    assert [r["event"] for r in recs] == ["fired", "submitted", "outcome"]
    assert recs[0]["manual"] is True and recs[2]["error"] == "model down"
    assert "model down" in (store.read().find("r").last_error or "")


async def test_run_loop_ticks_and_stops(store: CronStore) -> None:
    add(store, "fast", ScheduleSpec("every", "1s", "UTC"), datetime.now(UTC))
    rec = Recorder()
    s = Scheduler(store, fire=rec, tick_s=0.2)
    delay = s.seconds_to_next_tick()
    assert 0 < delay <= 0.21
    stop = asyncio.Event()
    runner = asyncio.create_task(s.run(stop))
    await asyncio.sleep(2.5)
    stop.set()
    await asyncio.wait_for(runner, timeout=5)
    assert 1 <= len(rec.fired) <= 4
    assert store.read().scheduler_owner is None  # released on stop


async def test_minute_alignment() -> None:
    s = Scheduler(
        Path("/nonexistent"),
        fire=Recorder(),
        clock=lambda: datetime(2026, 1, 1, 8, 0, 45, tzinfo=UTC),
    )
    assert abs(s.seconds_to_next_tick() - 15) < 0.01


async def test_service_stop_closes_the_scheduler_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12: the loop closes the scheduler as it ends; the service does not close it again,
    and closes it itself only when the loop never ran."""
    from appserver.config import load_config
    from appserver.server import Server
    from cron.service import CronService

    closes: list[int] = []
    real_close = Scheduler.close

    async def counting_close(self: Scheduler, timeout_s: float = 5.0) -> None:
        closes.append(1)
        await real_close(self, timeout_s)

    monkeypatch.setattr(Scheduler, "close", counting_close)
    config = load_config(tmp_path / "home", environ={})
    running = CronService(Server(config))
    running.start()
    await asyncio.sleep(0.05)
    await running.stop()
    assert len(closes) == 1
    assert not running.scheduler.has_lease  # released on stop

    idle = CronService(Server(config))  # the loop never started (APPSERVER_DISABLE_CRON=1)
    await idle.stop()
    assert len(closes) == 2
