"""A task's run log (`cron-runs/<task id>.jsonl`) stays under a size bound; a removed task's log goes
30 days after its removal.

Before the fix nothing ever trimmed or deleted a run log: a task run every minute appended ~790
bytes a run for ever (a `schedule`-tool token's 100 tasks: ~114 MB a day), `cron logs` read only
the last 16 MiB of it, and the logs of removed tasks stayed for good. Now a write that would take a
log past its bound (2 MiB; `RunLog.max_bytes`) first drops the oldest records of runs that ended,
writing the log anew atomically, and keeps what recovery and numbering read: the records of a run
with no outcome yet, the highest run number, the newest scheduled claim. Every writer appends
under the log's flock to the file its path names then, so a record is never lost to a trim that
replaced the log meanwhile.

Real parts: a real `Scheduler` and `CronStore` on a temporary home with a fake kernel (as in the
other cron tests), the real CLI as a subprocess, real processes writing one log together, a real
SIGKILL in the middle of a trim.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import (
    RunLog,
    append_run,
    has_fired,
    highest_occurrence,
    outcome_record,
    prune_removed_logs,
    read_run_log,
    run_record,
    settled_record,
    used_runs,
    utf8_json,
)
from cron.runner import TurnOutcome
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.cli import run_cli

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
CAP = 2 * MIB  # the documented bound of a run log (docs/configuration.md, [cron])
T0 = datetime(2026, 1, 1, tzinfo=UTC)
WAIT_S = 20.0


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def every_second(store: CronStore, name: str) -> CronTask:
    spec = ScheduleSpec("every", "1s", "UTC")
    return store.add(make_task(name=name, agent="echo", schedule=spec, prompt="p", now=T0, exact=True))


async def fire(task: CronTask, occ: Occurrence) -> str:
    return f"turn_{task.name}_{occ.number}"


async def completed(turn_id: str) -> TurnOutcome:
    return TurnOutcome("completed", reply="ok")


def log_of(runs_dir: Path, task_id: str) -> Path:
    return runs_dir / f"{task_id}.jsonl"


def ended_run_lines(task_id: str, first: int, last: int) -> bytes:
    """The records of finished scheduled runs `first`..`last`, as the scheduler writes them."""
    out = []
    for n in range(first, last + 1):
        when = (T0 + timedelta(minutes=n)).isoformat()
        turn = f"turn_{n:024d}"
        out += [
            run_record(task_id, "fired", occurrence=n, scheduled_for=when, due_at=when, fired_at=when, by="lease-b"),
            run_record(task_id, "submitted", occurrence=n, turn_id=turn),
            run_record(
                task_id,
                "outcome",
                occurrence=n,
                turn_id=turn,
                status="completed",
                error=None,
                detail={"usage": {"input_tokens": 1200, "output_tokens": 300}},
            ),
        ]
    return b"".join(utf8_json(r) + b"\n" for r in out)


def many_ended_runs(task_id: str, first: int, last: int) -> bytes:
    """`ended_run_lines`, fast (a log an older version let grow to tens of MiB)."""
    one = ended_run_lines(task_id, 1, 1).decode()
    when = (T0 + timedelta(minutes=1)).isoformat()
    template = (
        one.replace("{", "{{")
        .replace("}", "}}")
        .replace('"occurrence": 1,', '"occurrence": {n},')
        .replace(f"turn_{1:024d}", "turn_{n:024d}")
        .replace(when, "{when}")
    )
    return "".join(
        template.format(n=n, when=(T0 + timedelta(minutes=n)).isoformat()) for n in range(first, last + 1)
    ).encode()


def records_of(path: Path) -> list[dict[str, Any]]:
    """Every line of the file parsed (a cut line fails the test: a trim never leaves one)."""
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def numbers(records: list[dict[str, Any]], event: str) -> list[int]:
    return [r["occurrence"] for r in records if r.get("event") == event]


# ------------------------------------------------------------------ the trim, on the log's functions


def test_a_log_past_its_bound_drops_ended_runs_and_keeps_what_recovery_reads(tmp_path: Path) -> None:
    """A log near 2 MiB (runs 3..N ended) that holds, oldest, a claim never submitted (#1, a
    scheduler killed before it submitted) and a turn whose outcome was never recorded (#2): the
    writes past the bound leave it under the bound, readable whole by `cron logs`, with #1 and #2
    untouched and the newest ended runs kept in one unbroken run of numbers up to the last."""
    runs_dir = tmp_path / "cron-runs"
    runs_dir.mkdir()
    task_id = "t_trim"
    when = T0.isoformat()
    head = [
        run_record(task_id, "fired", occurrence=1, scheduled_for=when, due_at=when, fired_at=when, by="lease-a"),
        run_record(task_id, "fired", occurrence=2, scheduled_for=when, due_at=when, fired_at=when, by="lease-a"),
        run_record(task_id, "submitted", occurrence=2, turn_id="turn_two"),
    ]
    body = ended_run_lines(task_id, 3, 3000)
    path = log_of(runs_dir, task_id)
    path.write_bytes(b"".join(utf8_json(r) + b"\n" for r in head) + body)
    assert CAP - 200_000 < path.stat().st_size < CAP  # near the bound, not past it yet

    writer = RunLog(runs_dir)
    last = 3000
    while last < 4000:  # ~800 KB more: past the bound, and trimmed as it goes
        last += 1
        lines = ended_run_lines(task_id, last, last).splitlines()
        for rec in (json.loads(line) for line in lines):
            fields = {k: v for k, v in rec.items() if k not in ("event", "at", "task_id")}
            writer.record(task_id, rec["event"], **fields)
        assert path.stat().st_size <= CAP, last
    assert writer.problem() is None

    found = read_run_log(runs_dir, task_id)
    assert found.skipped == 0 and found.unreadable == []  # read whole: nothing cut, nothing skipped
    records = found.records
    assert [(r["event"], r["occurrence"]) for r in records[:3]] == [("fired", 1), ("fired", 2), ("submitted", 2)]
    ended = numbers(records, "outcome")
    assert ended[-1] == last and ended == list(range(ended[0], last + 1))  # the newest runs, no gap
    assert ended[0] > 3  # the oldest ended runs went
    assert numbers(records, "fired") == [1, 2, *ended]
    assert outcome_record(runs_dir, task_id, 3) is None
    # what a take-over and a restart read is still there
    assert has_fired(runs_dir, task_id, 1) and settled_record(runs_dir, task_id, 1) is None
    settled = settled_record(runs_dir, task_id, 2)
    assert settled is not None and settled["event"] == "submitted" and settled["turn_id"] == "turn_two"
    assert highest_occurrence(runs_dir, task_id) == last
    assert used_runs(runs_dir, task_id)[1] == T0 + timedelta(minutes=last)


def test_a_kill_during_a_trim_leaves_the_old_log_or_the_new_one_whole(tmp_path: Path) -> None:
    """A process killed (SIGKILL) while it trims an 8 MiB log an older version let grow leaves
    either that log, byte for byte, or the trimmed one: never a cut one. The temporary file of a
    trim killed before its rename is swept by the next trim; the log is read as it was meanwhile."""
    runs_dir = tmp_path / "cron-runs"
    runs_dir.mkdir(mode=0o700)
    task_id = "t_kill"
    path = log_of(runs_dir, task_id)
    when = T0.isoformat()
    unended = utf8_json(
        run_record(task_id, "fired", occurrence=1, scheduled_for=when, due_at=when, fired_at=when, by="lease-a")
    )
    old = unended + b"\n" + many_ended_runs(task_id, 2, 13_000)
    assert json.loads(old.splitlines()[-3])["scheduled_for"] == (T0 + timedelta(minutes=13_000)).isoformat()
    path.write_bytes(old)
    assert len(old) > 8 * MIB
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from cron.runlog import append_run\n"
            "print('go', flush=True)\n"
            "append_run(Path(sys.argv[1]), sys.argv[2], 'error', error='after the trim')\n"
            "print('done', flush=True)\n",
            str(runs_dir),
            task_id,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "go\n"
    time.sleep(random.uniform(0.05, 0.5))  # somewhere in its trim (or after it: the new log)
    child.send_signal(signal.SIGKILL)
    child.wait(WAIT_S)
    data = path.read_bytes()
    if data != old:  # the trim's rename came before the kill: the new log, whole
        records = records_of(path)
        assert len(data) <= CAP and records[0]["occurrence"] == 1 and records[-1]["event"] == "error"
    assert read_run_log(runs_dir, task_id).unreadable == []

    # a trim killed after it wrote its temporary file (before the rename) left this beside the log
    left = runs_dir / f".{task_id}.jsonl.{child.pid}-0.abcd1234.tmp"
    left.write_bytes(old[: len(old) // 3])
    stale = time.time() - 600
    os.utime(left, (stale, stale))
    assert [p.name for p in runs_dir.glob("*.jsonl")] == [path.name]
    if data == old:
        assert read_run_log(runs_dir, task_id).records[-1]["occurrence"] == 13_000  # the old log, read as it is

    append_run(runs_dir, task_id, "error", error="the next write")
    records = records_of(path)
    assert path.stat().st_size <= CAP
    assert records[0]["occurrence"] == 1  # the run never submitted is kept through every trim
    assert records[-1]["error"] == "the next write"
    assert numbers(records, "outcome")[-1] == 13_000
    if data != old:  # the killed trim had replaced the log: this write trims nothing; the hourly sweep goes
        prune_removed_logs(runs_dir, {task_id}, datetime.now(UTC))
    assert not left.exists()


# ------------------------------------------------------------------ the scheduler and the CLI


def test_runs_past_the_bound_keep_their_numbers_and_cron_logs_reads_the_whole_log(tmp_path: Path) -> None:
    """A task run every second by the real scheduler, its log bound set to 16 KiB: after 80 runs
    the log is under the bound, its runs numbered without a gap up to #80, `cron logs` shows all of
    it; and with an older crons.json restored (its counter at 10), the next run is #81 and no
    occurrence runs again: the trim kept what numbering reads."""
    home = tmp_path / "home"
    store = CronStore(home)
    task = every_second(store, "tick")
    clock = Clock(T0)
    sizes: list[int] = []
    saved = tmp_path / "crons-at-10.json"

    async def main() -> None:
        s = Scheduler(store, fire=fire, clock=clock, await_outcome=completed)
        s.store.runlog.max_bytes = 16 * 1024
        for i in range(1, 81):
            clock.now = T0 + timedelta(seconds=i)
            await s.tick()
            await s.wait_outcomes(WAIT_S)
            sizes.append(log_of(store.runs_dir, task.id).stat().st_size)
            if i == 10:
                shutil.copy2(store.path, saved)
        await s.close()

    asyncio.run(main())
    assert max(sizes) <= 16 * 1024
    records = records_of(log_of(store.runs_dir, task.id))
    ended = numbers(records, "outcome")
    assert ended[-1] == 80 and ended == list(range(ended[0], 81)) and ended[0] > 1
    assert numbers(records, "fired") == ended
    assert store.read().tasks[0].occurrence == 80

    r = run_cli(home, "cron", "logs", task.id, "--json", "--limit", "10000")
    assert r.code == 0, r.err
    assert r.err == ""  # nothing skipped, nothing unreadable
    assert [(x["event"], x.get("occurrence")) for x in r.json()] == [(x["event"], x.get("occurrence")) for x in records]

    # an older crons.json restored: the counter says 10 (its lease, this process's then, released)
    older = json.loads(saved.read_text())
    older["scheduler_owner"] = None
    store.path.write_text(json.dumps(older))
    restored = CronStore(home)
    assert restored.read().tasks[0].occurrence == 10
    fired: list[tuple[int, datetime]] = []

    async def noting(t: CronTask, occ: Occurrence) -> str:
        fired.append((occ.number, occ.scheduled_for))
        return f"turn_again_{occ.number}"

    async def again() -> None:
        clock.now = T0 + timedelta(seconds=81)
        s = Scheduler(restored, fire=noting, clock=clock, await_outcome=completed)
        await s.tick()
        await s.wait_outcomes(WAIT_S)
        await s.close()

    asyncio.run(again())
    assert fired and fired[0][0] == 81
    assert all(when > T0 + timedelta(seconds=80) for _, when in fired)


def test_writers_in_two_processes_lose_no_record_to_a_trim(tmp_path: Path) -> None:
    """Two processes append to one log at once (a server's scheduler and a `cron run`, or the two
    servers of one home), one of them writing enough ended runs to trim it again and again: every
    record of the other's runs that have not ended is in the log at the end, and the log is under
    its bound (a record appended to a log a trim had just replaced would be lost)."""
    runs_dir = tmp_path / "cron-runs"
    runs_dir.mkdir(mode=0o700)
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from cron.runlog import RunLog\n"
        "log = RunLog(Path(sys.argv[1]))\n"
        "log.max_bytes = 32 * 1024\n"
        "kind, first, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])\n"
        "for n in range(first, first + count):\n"
        "    log.record('t_two', 'fired', occurrence=n, by=kind, scheduled_for='2026-01-01T00:00:00+00:00')\n"
        "    if kind == 'open':\n"
        "        time.sleep(0.01)  # spread over the other's writes and trims\n"
        "    else:\n"
        "        log.record('t_two', 'submitted', occurrence=n, turn_id=f'turn_{n}')\n"
        "        log.record('t_two', 'outcome', occurrence=n, turn_id=f'turn_{n}', status='completed')\n"
        "assert log.unwritten() == (0, None)\n"
    )

    def writer(kind: str, first: int, count: int) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-c", script, str(runs_dir), kind, str(first), str(count)]
        return subprocess.Popen(args, cwd=REPO)

    procs = [writer("ends", 1000, 800), writer("open", 1, 40)]
    for p in procs:
        assert p.wait(WAIT_S * 3) == 0
    path = log_of(runs_dir, "t_two")
    records = records_of(path)
    assert path.stat().st_size <= 32 * 1024
    open_runs = sorted(r["occurrence"] for r in records if r.get("by") == "open")
    assert open_runs == list(range(1, 41))
    ended = numbers(records, "outcome")
    assert ended[-1] == 1799 and ended == list(range(ended[0], 1800))


def test_a_removed_tasks_log_goes_30_days_after_its_removal(tmp_path: Path) -> None:
    """The scheduler's first tick deletes the log of a task removed 31 days ago; it keeps the log of
    one removed 29 days ago (`cron logs` still finds it by name), the log of a task that is still
    there however old, and a log that says no removal (crons.json lost: it is the only history)."""
    home = tmp_path / "home"
    store = CronStore(home)
    gone, recent, kept = (every_second(store, n) for n in ("gone", "recent", "kept"))
    for t in (gone, recent, kept):
        append_run(store.runs_dir, t.id, "error", error="a visible failure")
    store.remove("gone")
    store.remove("recent")
    append_run(store.runs_dir, "t_nofile", "error", error="a task crons.json lost")

    def age(task_id: str, days: float) -> None:
        path = log_of(store.runs_dir, task_id)
        back = datetime.now(UTC) - timedelta(days=days)
        lines = []
        for rec in records_of(path):
            rec["at"] = back.isoformat()
            lines.append(json.dumps(rec) + "\n")
        path.write_text("".join(lines))
        os.utime(path, (back.timestamp(), back.timestamp()))

    age(gone.id, 31)
    age(recent.id, 29)
    age(kept.id, 400)
    age("t_nofile", 400)

    async def main() -> None:
        s = Scheduler(store, fire=fire, clock=Clock(T0), await_outcome=completed)
        await s.tick()
        await s.close()

    asyncio.run(main())
    assert not log_of(store.runs_dir, gone.id).exists()
    assert log_of(store.runs_dir, recent.id).exists()
    assert log_of(store.runs_dir, kept.id).exists()
    assert log_of(store.runs_dir, "t_nofile").exists()
    assert run_cli(home, "cron", "logs", "gone").code == 2  # no such task any more
    r = run_cli(home, "cron", "logs", "recent", "--json")
    assert r.code == 0, r.err
    assert [x["event"] for x in r.json()] == ["error", "removed"]
