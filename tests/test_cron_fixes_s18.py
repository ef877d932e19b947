"""Three cron faults, each through real files on disk, the real CLI (a subprocess) or the real
Scheduler with an injected clock:

1. crons.json never grows past the size it is read with: a user's add is refused (exit != 0, the
   file unchanged) with room kept for the scheduler's own bookkeeping, which always fits; a prompt
   has a size limit, and the `schedule` tool reports both as a tool error (the CLI's refusals and
   the tool's are in tests/test_cron_fixes_s18_b.py, on another worker: each fills a 64 MiB file).
2. The run log of a removed task with a long prompt is still found by its name, and long records at
   a log's end (an older log's) hide neither a removal, nor claims, nor the run counter.
3. After the clock is put back, recurring tasks go on from now (loudly), with run numbers and
   idempotency keys that never repeat; tasks legitimately far away keep their time.
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

from appserver.fsutil import CRONS_MAX_BYTES
from cron.runlog import (
    TAIL_BYTES,
    find_removed,
    read_runs,
    settled_record,
    unsettled_claims,
    used_runs,
)
from cron.runner import CronSubmission
from cron.schedule import ScheduleError, ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import (
    BOOKKEEPING_TASK_BYTES,
    MAX_ERROR_CHARS,
    MAX_PROMPT_BYTES,
    CronFile,
    CronStore,
    CronTask,
    CronTasksTooLarge,
    Occurrence,
    make_task,
    user_limit,
)
from tests.support.cli import CLIResult, run_cli

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Kernel:
    """A fake kernel (the scheduler's injected `fire`): records each submission."""

    def __init__(self) -> None:
        self.fired: list[Occurrence] = []
        self.keys: list[str] = []

    async def __call__(self, task: CronTask, occ: Occurrence) -> str:
        self.fired.append(occ)
        self.keys.append(CronSubmission.of(task, occ).idempotency_key)
        return f"turn_{task.name}_{occ.number}"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args)
    assert r.code == 0, (args[:4], r.out[-500:], r.err[-500:])
    return r


def task(name: str, prompt: str, now: datetime = T0, spec: ScheduleSpec | None = None, **kw: Any) -> CronTask:
    return make_task(
        name=name, agent="assistant", schedule=spec or ScheduleSpec("every", "1h", "UTC"), prompt=prompt, now=now, **kw
    )


# ------------------------------------------------------------------ 1. crons.json size


def fill(home: Path, target: int) -> bytes:
    """crons.json of exactly `target` bytes, of big tasks (a prompt of MAX_PROMPT_BYTES \\x01, 6 MiB
    in JSON) and one filler, written through the store; returns its bytes."""
    store = CronStore(home)
    big = "\x01" * MAX_PROMPT_BYTES
    with store.lock():
        state = store.load()
        assert not state.tasks
        # As many big tasks as stay under target - 100 KB: their lines are all as long (names of one
        # length), so two small renders give the count instead of a 64 MB render per task added.
        state.tasks.append(task("big00", big))
        one = len(store.render_bytes(state))
        state.tasks.append(task("big01", big))
        each = len(store.render_bytes(state)) - one
        count = 1 + (target - 100_000 - one) // each
        state.tasks += [task(f"big{i:02d}", big) for i in range(2, count)]
        state.tasks.append(task("filler", "x"))
        state.tasks[-1].prompt = "x" * (1 + target - len(store.render_bytes(state)))
        store.save(state)
    data = (home / "crons.json").read_bytes()
    assert len(data) == target, (len(data), target)
    return data


async def test_user_adds_keep_room_for_the_scheduler_which_always_fits(home: Path) -> None:
    """An add that would stay under the read limit but eat the scheduler's room is refused; then
    every task fires and records an error at once, and the file still fits and is read back."""
    ok(home, "cron", "list")
    before = fill(home, user_limit(12) - 10_000)  # 10 big tasks and the filler
    state_tasks = before.count(b'"id": "cron_')  # (the file is read back below: the CLI, the scheduler)
    assert state_tasks == 11 and user_limit(12) < len(before) + 20_000 < CRONS_MAX_BYTES
    r = run_cli(home, "cron", "add", "--name", "margin", "--agent", "assistant", "--every", "1h",
                "--prompt", "y" * 20_000)  # fmt: skip
    assert r.code != 0 and "room kept for the scheduler" in r.err, (r.code, r.err)
    assert (home / "crons.json").read_bytes() == before

    # Bookkeeping on the full file: all tasks due together, each run fails, the failure (long, in
    # 4-byte characters) becomes each task's last error; claims, counters, the lease: all saved.
    async def failing(task: CronTask, occ: Occurrence) -> str:
        raise RuntimeError("\U0001f4a5" * 5000)

    clock = Clock(T0 + timedelta(hours=1, minutes=2))  # past every task's jitter
    s = Scheduler(home, fire=failing, clock=clock)
    report = await s.tick()
    assert report.has_lease and len(report.fired) == state_tasks and report.errors == []
    after = (home / "crons.json").read_bytes()
    assert len(before) < len(after) <= CRONS_MAX_BYTES
    tasks = CronStore(home).read().tasks
    assert all(t.occurrence == 1 and t.last_error and len(t.last_error) <= MAX_ERROR_CHARS for t in tasks)
    assert list(home.glob("crons.json.corrupt-*")) == []
    assert ok(home, "cron", "list").code == 0

    # a removal (the file shrinks) is never refused, even above what users may fill
    ok(home, "cron", "remove", "filler")
    await s.close()


def test_bookkeeping_of_a_task_fits_the_room_kept_for_it() -> None:
    """The most the scheduler's writes can add to one task: a claim with the largest run number and
    a lease token, the longest last error (in 4-byte characters), all time stamps."""
    store = CronStore(Path("/nonexistent"))
    fresh = task("t" * 64, "p", spec=ScheduleSpec("cron", "0 8 * * *", "Europe/Paris"), deliver="a:b:c")
    fresh.next_fire_at = fresh.next_due_at = None
    full = task("t" * 64, "p", spec=ScheduleSpec("cron", "0 8 * * *", "Europe/Paris"), deliver="a:b:c")
    full.id = fresh.id
    stamp = datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    for _ in range(3):
        full.claim(stamp, stamp, stamp, by="x" * 64, floor=2**53 - 10, catch_up=True, manual=True)
    full.set_error('\U0001f4a5\x01"' * 10_000, stamp)
    full.enabled = False
    full.next_fire_at = full.next_due_at = full.updated_at = stamp
    grew = len(store.render(CronFile(tasks=[full])).encode()) - len(store.render(CronFile(tasks=[fresh])).encode())
    assert 0 < grew <= BOOKKEEPING_TASK_BYTES, grew


def test_a_prompt_has_a_size_limit_and_a_write_over_the_read_limit_never_happens(home: Path) -> None:
    with pytest.raises(ScheduleError, match="prompt too long"):
        task("huge", "z" * (MAX_PROMPT_BYTES + 1))
    task("largest", "z" * MAX_PROMPT_BYTES)  # the limit itself is fine
    store = CronStore(home)
    state = CronFile(tasks=[task(f"t{i}", "\x01" * MAX_PROMPT_BYTES) for i in range(11)])
    with store.lock():
        with pytest.raises(CronTasksTooLarge, match="nothing was written"):
            store.save(state)  # 66 MB: no writer (scheduler, agents delete, …) may write that
    assert not store.path.exists()


# ------------------------------------------------------------------ 2. run logs with long records


def test_removed_task_with_a_long_prompt_is_found_by_name(home: Path) -> None:
    r = ok(home, "cron", "add", "--name", "b70", "--agent", "assistant", "--every", "1h",
           "--prompt", "w" * 70_000, "--json")  # fmt: skip
    task_id = r.json()["id"]
    ok(home, "cron", "run", "b70")
    ok(home, "cron", "remove", "b70")
    for ref in ("b70", task_id):
        r = ok(home, "cron", "logs", ref)
        assert f"task b70 ({task_id}) was removed" in r.err, r.err
        assert r.out.splitlines()[-1].split()[3] == "removed", r.out
    removed = [x for x in read_runs(home / "cron-runs", task_id) if x["event"] == "removed"]
    assert len(json.dumps(removed[0])) < 10_000 and removed[0]["task"]["prompt_chars"] == 70_000


def legacy_line(path: Path, record: dict[str, Any]) -> None:
    """A record as an older appserver wrote it: whole, however long."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("prompt_chars", [70_000, 3_000_000])  # longer than the tail; than a line is read
def test_an_older_removed_record_with_the_whole_prompt_is_found(home: Path, prompt_chars: int) -> None:
    ok(home, "cron", "list")
    t = task("old", "v")
    t.prompt = "v" * prompt_chars  # as long as an older appserver let it be
    path = home / "cron-runs" / f"{t.id}.jsonl"
    legacy_line(path, {"event": "fired", "at": T0.isoformat(), "task_id": t.id, "occurrence": 1,
                       "scheduled_for": T0.isoformat(), "manual": True})  # fmt: skip
    legacy_line(path, {"event": "removed", "at": T0.isoformat(), "task_id": t.id, "task": t.to_dict()})
    legacy_line(path, {"event": "outcome", "at": T0.isoformat(), "task_id": t.id, "occurrence": 1,
                       "turn_id": "turn_1", "status": "completed", "error": None})  # fmt: skip
    found = find_removed(home / "cron-runs", "old")
    assert [f["id"] for f in found] == [t.id] and found[0]["name"] == "old"
    r = ok(home, "cron", "logs", "old")
    assert f"task old ({t.id}) was removed" in r.err, r.err
    # a task never removed, with a long record at its end, is no removed task of that name
    other = task("live", "v")
    other_path = home / "cron-runs" / f"{other.id}.jsonl"
    legacy_line(other_path, {"event": "fired", "at": T0.isoformat(), "task_id": other.id, "occurrence": 1})
    legacy_line(other_path, {"event": "outcome", "at": T0.isoformat(), "task_id": other.id, "occurrence": 1,
                             "status": "failed", "error": "e" * prompt_chars})  # fmt: skip
    assert find_removed(home / "cron-runs", "live") == []


def test_long_records_at_a_logs_end_hide_no_claim_nor_the_run_counter(tmp_path: Path) -> None:
    """A dead scheduler claimed #5-#7 (run_all) and submitted #5; then #4's outcome, with a long
    error, was logged (an older server wrote it whole). Before the fix only that record's cut end
    was in view: no claim seen (a run lost), run counter 0 (numbers used again)."""
    runs = tmp_path / "cron-runs"
    tid = "cron_0123456789ab"
    path = runs / f"{tid}.jsonl"
    for n in (5, 6, 7):
        when = (T0 + timedelta(hours=n)).isoformat()
        claim = {"occurrence": n, "scheduled_for": when, "due_at": when, "fired_at": when, "catch_up": True}
        legacy_line(path, {"event": "fired", "at": when, "task_id": tid, **claim, "manual": False, "by": "dead"})
    legacy_line(path, {"event": "submitted", "at": T0.isoformat(), "task_id": tid, "occurrence": 5, "turn_id": "t5"})
    legacy_line(path, {"event": "outcome", "at": T0.isoformat(), "task_id": tid, "occurrence": 4, "turn_id": "t4",
                       "status": "failed", "error": "E" * (3 * TAIL_BYTES)})  # fmt: skip
    assert [r["occurrence"] for r in unsettled_claims(runs, tid, "mine")] == [6, 7]
    assert used_runs(runs, tid) == (7, T0 + timedelta(hours=7))
    assert settled_record(runs, tid, 5) is not None and settled_record(runs, tid, 6) is None
    assert settled_record(runs, tid, 4)["status"] == "failed"  # type: ignore[index]


# ------------------------------------------------------------------ 3. the clock put back


async def test_clock_put_back_while_running_goes_on_from_now(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tester's repro: one tick with the clock a day ahead, then 20 real hours. Before the fix
    nothing fired and next_fire_at stayed a day ahead."""
    store = CronStore(home)
    t = store.add(task("hourly", "p", exact=True, misfire="run_once"))
    kernel = Kernel()
    clock = Clock(T0 + timedelta(days=1, minutes=30))
    s = Scheduler(home, fire=kernel, clock=clock)
    await s.tick()  # the clock is a day ahead: a catch-up run, claimed for tomorrow 12:00
    assert [o.scheduled_for for o in kernel.fired] == [T0 + timedelta(days=1)]
    caplog.set_level(logging.WARNING, logger="appserver.cron")
    for h in range(1, 21):
        clock.now = T0 + timedelta(hours=h, minutes=1)
        await s.tick()
    await s.close()
    later = kernel.fired[1:]
    assert [o.scheduled_for for o in later] == [T0 + timedelta(hours=h) for h in range(2, 21)], later
    numbers = [o.number for o in kernel.fired]
    assert numbers == list(range(1, len(numbers) + 1))  # never a number twice
    assert len(set(kernel.keys)) == len(kernel.keys)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("hourly" in m and t.id in m and "put back" in m for m in warned), warned
    assert store.read().tasks[0].next_fire_at == T0 + timedelta(hours=21)


async def test_clock_put_back_before_a_restart_goes_on_from_now(home: Path) -> None:
    """The scheduler that ran with the clock ahead is gone; a new one (a restart) sees tasks whose
    stamps and run log are a day ahead of its clock: rescheduled, run numbers above those used."""
    store = CronStore(home)
    hourly = store.add(task("hourly", "p", exact=True, misfire="run_once"))
    daily = store.add(task("daily", "p", spec=ScheduleSpec("cron", "0 9 * * *", "UTC"), exact=True))
    yearly = store.add(task("yearly", "p", spec=ScheduleSpec("cron", "0 0 1 1 *", "UTC"), exact=True))
    at = store.add(task("at", "p", spec=ScheduleSpec("at", "2027-06-01 10:00", "UTC"), exact=True))
    # added while the clock was ahead: its creation time (the interval's anchor) is tomorrow
    ahead = store.add(task("ahead", "p", now=T0 + timedelta(days=1, minutes=15), exact=True))
    first = Kernel()
    s1 = Scheduler(home, fire=first, clock=Clock(T0 + timedelta(days=1, minutes=30)))
    await s1.tick()
    await s1.close()
    assert [o.number for o in first.fired] == [1]

    kernel = Kernel()
    clock = Clock(T0 + timedelta(minutes=5))
    s2 = Scheduler(home, fire=kernel, clock=clock)
    await s2.tick()
    by_name = {x.name: x for x in store.read().tasks}
    assert by_name["hourly"].next_fire_at == T0 + timedelta(hours=1)
    assert by_name["daily"].next_fire_at == datetime(2026, 12, 4, 9, 0, tzinfo=UTC)
    assert by_name["yearly"].next_fire_at == datetime(2027, 1, 1, tzinfo=UTC)  # far, and right
    assert by_name["at"].next_fire_at == datetime(2027, 6, 1, 10, 0, tzinfo=UTC)  # a one-shot keeps its time
    assert by_name["ahead"].next_fire_at == T0 + timedelta(minutes=15)  # its phase kept
    for m in range(10, 205, 5):
        clock.now = T0 + timedelta(minutes=m)
        await s2.tick()
    await s2.close()
    runs = [(o.task_id, o.number, o.scheduled_for) for o in kernel.fired]
    assert [r for r in runs if r[0] == hourly.id] == [(hourly.id, n, T0 + timedelta(hours=n - 1)) for n in (2, 3, 4)]
    assert [r for r in runs if r[0] == ahead.id] == [
        (ahead.id, n, T0 + timedelta(hours=n - 1, minutes=15)) for n in (1, 2, 3, 4)
    ]
    assert not [r for r in runs if r[0] in (daily.id, yearly.id, at.id)]
    keys = first.keys + kernel.keys
    assert len(set(keys)) == len(keys)


async def test_a_task_far_away_by_its_schedule_is_left_alone_when_the_clock_goes_back(home: Path) -> None:
    store = CronStore(home)
    yearly = store.add(task("yearly", "p", spec=ScheduleSpec("cron", "0 0 1 1 *", "UTC"), exact=True))
    weekly = store.add(task("weekly", "p", spec=ScheduleSpec("every", "7d", "UTC"), exact=True))
    clock = Clock(T0 + timedelta(hours=5))
    s = Scheduler(home, fire=Kernel(), clock=clock)
    await s.tick()
    clock.now = T0 + timedelta(hours=1)  # put back by 4 hours: both next times are still the schedule's
    await s.tick()
    await s.close()
    got = {x.id: x.next_fire_at for x in store.read().tasks}
    assert got == {yearly.id: datetime(2027, 1, 1, tzinfo=UTC), weekly.id: T0 + timedelta(days=7)}


async def test_run_loop_wakes_at_once_after_the_clock_goes_back(home: Path) -> None:
    """The sleeping loop must not wait for a wake time set by the clock that was ahead (before the
    fix, it slept until its next lease renewal: here 20 minutes)."""
    offset = [timedelta(days=1)]
    s = Scheduler(home, fire=Kernel(), clock=lambda: datetime.now(UTC) + offset[0], tick_s=60, lease_ttl_s=3600)
    stop = asyncio.Event()
    loop = asyncio.create_task(s.run(stop))
    try:
        deadline = time.monotonic() + 30  # "at once" against 20 minutes: a loaded machine may take seconds
        while s._last_tick is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        first = s._last_tick
        assert first is not None and s.has_lease
        offset[0] = timedelta(0)  # NTP puts the clock back a day
        deadline = time.monotonic() + 30
        while not (s._last_tick is not None and s._last_tick < first) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert s._last_tick is not None and s._last_tick < first, "no tick after the clock went back"
    finally:
        stop.set()
        await asyncio.wait_for(loop, 10)
