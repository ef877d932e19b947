"""Session 30, three cron findings from outside attacks.

1. A scheduler holding the lease while crons.json cannot be written (a full disk, an immutable
   file) spun: a tick whose save failed restored the lease renewal time it found, already past, so
   the loop ticked again at once (70-85 % of a core), and logged the same "missed the occurrence"
   warning at every try (~500 lines a second). Now a failed tick is retried after a pause, and what
   it found is said once, by the tick that saves it.
2. `cron logs` marked the runs of a live `run_all` catch-up still waiting their turn "LOST: the
   process died before submitting it", and kept the mark beside their own `outcome … cancelled`
   records once their task was disabled. Now a claimed run is lost only when nobody will submit it.
3. A day-of-week given as the nth (`MON#2`) or last (`L5`) weekday beside a day-of-month that is
   not `*`, or a nearest weekday (`15W`) beside a day-of-week: croniter silently reads one field
   alone (`0 0 13 * MON#2`: second Mondays, never the 13th). Such an expression is refused, by
   `cron add` and by the agent's `schedule` tool alike.

Real parts: a real `Scheduler` and `CronStore` on a temporary home (in a child process whose file
size limit makes every write of crons.json fail with EFBIG, as a full disk does; as root too), a
fake kernel whose turns end when the test says, and the real CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import append_run, read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleError, ScheduleSpec, normalize_cron
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from tests.support.cli import CLIResult, cli_env, run_cli

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
MISSED = "missed the occurrence"

# ------------------------------------------------------------------ 1. no spin while crons.json cannot be written

# The scheduler loop in a child process. Once it holds the lease (lease_ttl_s=3: its renewal is due
# a second later), the file size limit is lowered so every crons.json write fails (EFBIG, SIGXFSZ
# ignored), and its clock moves 90 minutes on, so the hourly task's occurrence is missed at every
# tick that plans it. For FAILING_S it counts the loop's clock readings (every tick and every
# wake-up reads it), then lifts the limit and waits until a tick saves. Prints what it saw as JSON.
FAILING_S = 5.0
SPIN_SCRIPT = r"""
import asyncio, json, logging, resource, signal, sys, time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from cron.scheduler import Scheduler
from cron.store import CronStore

home, failing_s = Path(sys.argv[1]), float(sys.argv[2])
offset = timedelta(0)
readings = [0]

def clock():
    readings[0] += 1
    return datetime.now(UTC) + offset

async def fire(task, occ):
    return None

class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

lines = Lines()
logger = logging.getLogger("appserver.cron")
logger.addHandler(lines)
logger.setLevel(logging.INFO)

async def until(check, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}: {lines.lines}")
        await asyncio.sleep(0.02)

def saved_missed():
    task = CronStore(home).read().tasks[0]
    return bool(task.last_error and "missed" in task.last_error)

async def main():
    global offset
    scheduler = Scheduler(CronStore(home), fire=fire, clock=clock, lease_ttl_s=3)
    stop = asyncio.Event()
    loop = asyncio.create_task(scheduler.run(stop))
    await until(lambda: scheduler.has_lease, "the lease")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # crons.json (over 64 bytes) cannot be written
    offset = timedelta(minutes=90)
    start_lines, start_readings, start_cpu = len(lines.lines), readings[0], time.process_time()
    await asyncio.sleep(failing_s)
    failing = {
        "lines": lines.lines[start_lines:],
        "clock_readings": readings[0] - start_readings,
        "cpu_s": time.process_time() - start_cpu,
    }
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    await until(saved_missed, "a tick that saves")
    stop.set()
    await asyncio.wait_for(loop, 30)
    print(json.dumps({"failing": failing, "lines": lines.lines}))

asyncio.run(main())
"""


def test_a_scheduler_that_cannot_write_crons_json_retries_after_a_pause_and_warns_once(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    now = datetime.now(UTC)
    store.add(
        make_task(
            name="hourly",
            agent="assistant",
            schedule=ScheduleSpec("every", "1h", "UTC"),
            prompt="later",
            now=now,
            exact=True,
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", SPIN_SCRIPT, str(store.home), str(FAILING_S)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    failing = seen["failing"]
    shown = f"{failing['clock_readings']} clock readings, {failing['cpu_s']:.2f} s CPU; lines: {failing['lines'][:5]}"
    # A loop that waits between tries ticks about once per FAILED_TICK_RETRY_S (2 s) and reads the
    # clock a few times per tick and per watch (0.25 s); a spinning one reads it thousands of times.
    assert failing["clock_readings"] < 300, shown
    assert [line for line in failing["lines"] if MISSED in line] == [], shown  # nothing saved, nothing said
    assert len([line for line in failing["lines"] if "tick skipped" in line]) == 1, shown
    # once crons.json can be written, the tick that saves says the missed occurrence once
    assert len([line for line in seen["lines"] if MISSED in line]) == 1, seen["lines"]
    assert len([line for line in seen["lines"] if "now runs the scheduler" in line]) == 1, seen["lines"]


# ------------------------------------------------------------------ 2. `cron logs`: queued, not lost


class Kernel:
    """A fake kernel: a turn ends when `end` is called for it."""

    def __init__(self) -> None:
        self.fired: list[int] = []
        self.ends: dict[str, asyncio.Event] = {}

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        self.fired.append(occ.number)
        return f"turn_{occ.number}"

    async def outcome(self, turn_id: str) -> TurnOutcome:
        await self.ends.setdefault(turn_id, asyncio.Event()).wait()
        return TurnOutcome("completed", reply="ok")

    def end(self, number: int) -> None:
        self.ends.setdefault(f"turn_{number}", asyncio.Event()).set()


def _add_catch_up(store: CronStore, name: str) -> CronTask:
    task = make_task(
        name=name,
        agent="assistant",
        schedule=ScheduleSpec("every", "1m", "UTC"),
        prompt="hi",
        now=T0,
        exact=True,
        misfire="run_all",
        max_lateness_s=3600,
    )
    return store.add(task)


async def _logs(home: Path, name: str) -> tuple[CLIResult, dict[int, dict[str, Any]]]:
    """`cron logs NAME` as text, and its `--json` fired records by run number."""
    env = cli_env(home)
    text = await asyncio.to_thread(run_cli, home, "cron", "logs", name, env=env)
    as_json = await asyncio.to_thread(run_cli, home, "cron", "logs", name, "--json", env=env)
    assert text.code == 0 and as_json.code == 0, (text.err, as_json.err)
    return text, {r["occurrence"]: r for r in as_json.json() if r["event"] == "fired"}


async def test_cron_logs_shows_the_runs_of_a_live_catch_up_waiting_their_turn_as_queued(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = CronStore(home)
    task = _add_catch_up(store, "catch-up")
    kernel = Kernel()
    now = T0 + timedelta(minutes=3, seconds=30)  # three occurrences missed: #1 runs, #2 and #3 wait
    scheduler = Scheduler(store, fire=kernel.fire, clock=lambda: now, await_outcome=kernel.outcome)
    try:
        await scheduler.tick()
        assert kernel.fired == [1]
        text, fired = await _logs(home, "catch-up")
        assert "LOST" not in text.out, text.out
        assert not any(r.get("lost") for r in fired.values()), fired
        assert fired[2].get("queued") is True and fired[3].get("queued") is True, fired
        assert text.out.count("queued: not submitted yet") == 2, text.out

        with store.transaction() as state:  # `cron disable` meanwhile: the waiting runs never start
            state.tasks[0].enabled = False
        kernel.end(1)
        await scheduler.wait_outcomes(10)
    finally:
        await scheduler.close()
    outcomes = {r["occurrence"]: r["status"] for r in read_runs(store.runs_dir, task.id) if r["event"] == "outcome"}
    assert outcomes == {1: "completed", 2: "cancelled", 3: "cancelled"}
    text, fired = await _logs(home, "catch-up")
    assert "LOST" not in text.out and "queued" not in text.out, text.out
    assert not any(r.get("lost") or r.get("queued") for r in fired.values()), fired


async def test_cron_logs_still_says_lost_of_a_run_nobody_will_submit(tmp_path: Path) -> None:
    """A run a dead scheduler claimed whose claim the tasks no longer hold is lost; one whose claim
    they still hold waits for the scheduler that takes over (no server runs now)."""
    home = tmp_path / "home"
    store = CronStore(home)
    task = _add_catch_up(store, "orphan")
    dead = "0" * 32  # the lease token of a scheduler long gone
    with store.transaction() as state:
        t = state.tasks[0]
        t.occurrence = 3
        t.last_claimed = {
            "occurrence": 3,
            "scheduled_for": (T0 + timedelta(minutes=3)).isoformat(),
            "due_at": (T0 + timedelta(minutes=3)).isoformat(),
            "claimed_at": (T0 + timedelta(minutes=3)).isoformat(),
            "by": dead,
            "progress": "claimed",
        }
    for number in (1, 2, 3):
        when = (T0 + timedelta(minutes=number)).isoformat()
        append_run(store.runs_dir, task.id, "fired", occurrence=number, scheduled_for=when, by=dead)
    append_run(store.runs_dir, task.id, "submitted", occurrence=1, turn_id="turn_1")
    text, fired = await _logs(home, "orphan")
    assert "lost" not in fired[1], fired
    assert fired[2].get("lost") is True, fired  # its claim is gone: nobody submits it
    assert "lost" not in fired[3] and fired[3].get("unresolved") is True, fired
    assert text.out.count("LOST") == 1, text.out
    assert "the server that takes the scheduler over resolves it" in text.out, text.out


# ------------------------------------------------------------------ 3. nth / last weekday beside a day-of-month

REFUSED = [
    "0 0 13 * MON#2",  # croniter: second Mondays only, never the 13th
    "0 0 1 * MON#1",
    "0 0 29 2 MON#5",
    "0 0 13 * L5",  # croniter: never fires
    "0 0 L * L5",  # croniter: last Fridays only
    "0 0 */2 * 1#1",
    "0 0 15W * MON",  # croniter: the weekday nearest the 15th only, never a Monday
]
KEPT = ["0 0 * * MON#2", "0 0 ? * MON#2", "0 0 * * L5", "0 0 13 * MON", "0 0 L * MON", "0 0 15W * *", "0 0 13 * ?"]


@pytest.mark.parametrize("expr", REFUSED)
def test_an_nth_or_last_weekday_beside_the_other_day_field_is_refused(expr: str) -> None:
    with pytest.raises(ScheduleError, match="cannot be combined with a day-of-"):
        normalize_cron(expr)


@pytest.mark.parametrize("expr", KEPT)
def test_the_day_fields_croniter_reads_right_are_kept(expr: str) -> None:
    assert normalize_cron(expr) == expr


def test_cron_add_and_the_schedule_tool_refuse_an_nth_weekday_beside_a_day_of_month(home: Path, cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("cron", "add", "--name", "a", "--agent", "assistant", "--cron", "0 0 13 * MON#2", "--prompt", "x")
    assert r.code != 0 and "cannot be combined with a day-of-month" in r.err, (r.out, r.err)
    call = {"action": "create", "name": "b", "cron": "0 0 1 * MON#1", "prompt": "x"}
    r = cli("run", "--json", f"/call schedule {json.dumps(call)}")
    assert r.code == 0, r.err
    assert "cannot be combined with a day-of-month" in r.json()["text"], r.out
    listed = cli("cron", "list", "--json").json()
    tasks = listed if isinstance(listed, list) else listed.get("tasks", listed)
    assert tasks == [], tasks
    ok = cli("cron", "add", "--name", "c", "--agent", "assistant", "--cron", "0 0 * * MON#2", "--prompt", "x")
    assert ok.code == 0, ok.err
