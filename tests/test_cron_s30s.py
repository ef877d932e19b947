"""Session 30, two cron findings from an outside attack.

1. A `run_all` catch-up's runs still waiting their turn when their scheduler was killed were not
   dropped when their task was disabled or removed while no scheduler ran. `cron disable` said
   nothing, and the server that took the scheduler over submitted every one of them ("claimed by a
   scheduler that stopped before submitting it; submitting it now") while `cron list` showed the
   task disabled; after `cron remove` nobody settled them and `cron logs` called them LOST. The same
   happened to runs a live take-over had adopted when their task was disabled or removed before
   they were submitted. Now each ends `cancelled`, "not started", and is never submitted: `cron
   remove`/`disable` settle the runs no running scheduler has in hand, and a scheduler resolving a
   stopped one's claims cancels those of a task removed or disabled since.
2. The `schedule` tool capped prompts but not the cron expression: a 480 KB `* * * * 0-6,0-6,…` was
   accepted and then re-parsed by croniter at every fire and in every `cron list` (seconds each),
   and a 20,000-character `every` too. Now an expression is at most 512 characters (checked before
   croniter reads it), a value listed twice is listed once, a field's list is no longer than the
   field has values, a duration or an `at` time is at most 64 characters, and what croniter cannot
   read says why.

Real parts: a real `Scheduler` and `CronStore` on a temporary home, the real CLI in a subprocess, a
fake kernel whose turns end when the test says. The state a killed scheduler leaves (its claims in
crons.json, its `fired` records, the lease of a pid that no longer runs) is written as it wrote it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.runlog import append_run, read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleError, ScheduleSpec, normalize_cron, validate_new
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, OwnerRecord, make_task, utcnow
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)

RUNS = (1, 2, 3, 4, 5)
WAITING = (2, 3, 4, 5)
MAX_CRON_CHARS = 512  # cron.schedule.MAX_CRON_CHARS


class Kernel:
    """A fake kernel: a turn ends when `end` is called for it; `known` are the turns a stopped
    scheduler submitted (found by their idempotency key)."""

    def __init__(self, known: dict[int, str] | None = None) -> None:
        self.fired: list[int] = []
        self.ends: dict[str, asyncio.Event] = {}
        self.known = dict(known or {})

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        self.fired.append(occ.number)
        return f"turn_{occ.number}"

    async def claimed_turn(self, task: CronTask, occ: Occurrence) -> str | None:
        return self.known.get(occ.number)

    async def outcome(self, turn_id: str) -> TurnOutcome:
        await self.ends.setdefault(turn_id, asyncio.Event()).wait()
        return TurnOutcome("completed", reply="ok")

    def end(self, number: int) -> None:
        self.ends.setdefault(f"turn_{number}", asyncio.Event()).set()


def _killed_catch_up(home: Path) -> CronTask:
    """What a scheduler killed in the middle of a `run_all` catch-up leaves: runs #1-#5 claimed in one
    tick (open claims, `fired` records naming its lease), #1 submitted and running, #2-#5 waiting
    their turn, and the lease record of a process that no longer runs."""
    store = CronStore(home)
    now = utcnow().replace(microsecond=0)
    start = now - timedelta(minutes=5)
    task = store.add(
        make_task(
            name="ch",
            agent="assistant",
            schedule=ScheduleSpec("every", "1m", "UTC"),
            prompt="x",
            now=start,
            exact=True,
            misfire="run_all",
            max_lateness_s=3600,
        )
    )
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid: the killed scheduler
    dead = "d" * 32
    with store.transaction() as state:
        state.scheduler_owner = OwnerRecord(gone.pid, dead, start, None, socket.gethostname())
        t = state.tasks[0]
        for n in RUNS:
            when = start + timedelta(minutes=n)
            t.claim(when, when, now, catch_up=True, by=dead)
        t.advance_claim(1, "submitted")
        t.next_fire_at = t.next_due_at = now + timedelta(minutes=1)
    for n in RUNS:
        when = start + timedelta(minutes=n)
        append_run(
            store.runs_dir,
            task.id,
            "fired",
            occurrence=n,
            scheduled_for=when,
            due_at=when,
            fired_at=now,
            manual=False,
            catch_up=True,
            by=dead,
        )
    append_run(store.runs_dir, task.id, "submitted", occurrence=1, turn_id="turn_1")
    store.close()
    return task


def _cli(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args, env=cli_env(home))
    assert r.code == 0, (args, r.out, r.err)
    return r


def _records(home: Path, task_id: str, event: str) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for r in read_runs(home / "cron-runs", task_id):
        if r["event"] == event:
            found.setdefault(r["occurrence"], []).append(r)
    return found


def _fired_flags(home: Path, name: str) -> dict[int, dict[str, Any]]:
    records = _cli(home, "cron", "logs", name, "--json").json()
    return {r["occurrence"]: r for r in records if r["event"] == "fired"}


# ------------------------------------------------------------------ 1. removed or disabled while no scheduler runs


@pytest.mark.parametrize("action", ["disable", "remove"])
async def test_waiting_runs_of_a_killed_catch_up_end_cancelled_when_the_task_is_stopped_while_no_server_runs(
    tmp_path: Path, action: str
) -> None:
    home = tmp_path / "home"
    task = _killed_catch_up(home)
    before = await asyncio.to_thread(_fired_flags, home, "ch")
    assert all(before[n].get("unresolved") for n in WAITING), before  # the attack's starting point

    await asyncio.to_thread(_cli, home, "cron", action, "ch")

    why = f"not started: the task was {action}d before this run began"
    outcomes = _records(home, task.id, "outcome")
    assert {n: [r["status"] for r in outcomes[n]] for n in outcomes} == {n: ["cancelled"] for n in WAITING}
    assert all(outcomes[n][0]["error"] == why for n in WAITING), outcomes
    text = await asyncio.to_thread(_cli, home, "cron", "logs", task.id)
    assert "LOST" not in text.out and "not submitted yet" not in text.out, text.out
    assert text.out.count(f"cancelled: {why}") == len(WAITING), text.out
    flags = await asyncio.to_thread(_fired_flags, home, task.id)
    assert not any(flags[n].get(k) for n in WAITING for k in ("lost", "queued", "unresolved")), flags

    # the next server takes the scheduler over: it follows #1 (submitted), and submits nothing else
    kernel = Kernel(known={1: "turn_1"})
    scheduler = Scheduler(
        CronStore(home), fire=kernel.fire, await_outcome=kernel.outcome, claimed_turn=kernel.claimed_turn
    )
    try:
        report = await scheduler.tick()
        assert report.has_lease
        kernel.end(1)
        await scheduler.wait_outcomes(10)
        await scheduler.tick()
        await scheduler.wait_outcomes(10)
    finally:
        await scheduler.close()
    assert kernel.fired == [], kernel.fired
    assert not any(n in _records(home, task.id, "submitted") for n in WAITING)
    outcomes = _records(home, task.id, "outcome")
    assert all([r["status"] for r in outcomes[n]] == ["cancelled"] for n in WAITING), outcomes
    if action == "disable":
        assert [r["status"] for r in outcomes[1]] == ["completed"], outcomes
        listed = await asyncio.to_thread(_cli, home, "cron", "show", "ch", "--json")
        assert listed.json()["enabled"] is False


@pytest.mark.parametrize("action", ["disable", "remove"])
async def test_runs_a_take_over_adopted_are_not_submitted_once_their_task_is_stopped(
    tmp_path: Path, action: str
) -> None:
    """A live scheduler adopted the killed one's runs (#2-#5 wait for #1, still running); the task is
    disabled or removed meanwhile: the CLI leaves them to the scheduler, which never submits them."""
    home = tmp_path / "home"
    task = _killed_catch_up(home)
    kernel = Kernel(known={1: "turn_1"})
    scheduler = Scheduler(
        CronStore(home), fire=kernel.fire, await_outcome=kernel.outcome, claimed_turn=kernel.claimed_turn
    )
    try:
        report = await scheduler.tick()
        assert report.has_lease and kernel.fired == []
        queued = await asyncio.to_thread(_fired_flags, home, "ch")
        assert all(queued[n].get("queued") for n in WAITING), queued

        await asyncio.to_thread(_cli, home, "cron", action, "ch")
        assert _records(home, task.id, "outcome") == {}  # a live scheduler has them in hand

        kernel.end(1)
        await wait_until(
            lambda: all(n in _records(home, task.id, "outcome") for n in WAITING), 20, "the waiting runs to end"
        )
        await scheduler.wait_outcomes(10)
    finally:
        await scheduler.close()
    assert kernel.fired == [], kernel.fired
    outcomes = _records(home, task.id, "outcome")
    why = f"not started: the task was {action}d before this run began"
    for n in WAITING:
        assert [(r["status"], r["error"]) for r in outcomes[n]] == [("cancelled", why)], outcomes
    text = await asyncio.to_thread(_cli, home, "cron", "logs", task.id)
    assert "LOST" not in text.out and "queued" not in text.out, text.out


# ------------------------------------------------------------------ 2. bounded schedule expressions

HUGE_CRON = "* * * * " + ",".join(["0-6"] * 120_000)  # the attack's 480 KB expression
# 80 KB: one argument of a command line may not hold more than 128 KiB
LONG_CRON = "* * * * " + ",".join(["0-6"] * 20_000)


def test_an_over_long_cron_expression_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(ScheduleError, match=f"at most {MAX_CRON_CHARS}") as refused:
        normalize_cron(HUGE_CRON)
    assert len(str(refused.value)) < 400, str(refused.value)  # the message does not hold the expression
    with pytest.raises(ScheduleError, match=f"at most {MAX_CRON_CHARS}"):
        normalize_cron("0 0 1 1 " + ",".join(["1"] * 300))


def test_every_value_of_every_field_still_fits() -> None:
    every_value = " ".join(
        [
            ",".join(map(str, range(60))),
            ",".join(map(str, range(24))),
            ",".join(map(str, range(1, 32))),
            "jan,feb,mar,apr,may,jun,jul,aug,sep,oct,nov,dec",
            "sun,mon,tue,wed,thu,fri,sat",
        ]
    )
    assert normalize_cron(every_value) == every_value


@pytest.mark.parametrize(
    ("expr", "kept"),
    [
        ("0 0 1 1 1,1,1", "0 0 1 1 1"),
        ("0,0,30 9,9 * * mon,mon,fri", "0,30 9 * * mon,fri"),
        ("* * * * *,*", "* * * * *"),
    ],
)
def test_a_value_listed_twice_is_listed_once(expr: str, kept: str) -> None:
    assert normalize_cron(expr) == kept


def test_a_field_cannot_list_more_items_than_it_has_values() -> None:
    minutes = ",".join(f"0-{n}" for n in range(1, 62))  # 61 different ranges
    with pytest.raises(ScheduleError, match="61 items in its list, more than the 60 values the field has"):
        normalize_cron(f"{minutes} * * * *")


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("0 0 5L * *", "day-of-month field '5L': not a value, range, step or list cron can read"),
        ("0 0 LW * *", "day-of-month field 'LW': not a value, range, step or list cron can read"),
        ("0 0 * * FRI#1,MON", "day-of-week field 'FRI#1,MON': day-of-week field does not support mixing literal"),
        ("0 0 32 * *", "day-of-month field '32': a value out of range (the field takes 1-31)"),
        ("*/0 * * * *", "minute field '*/0': step '0' is not acceptable"),
    ],
)
def test_what_croniter_cannot_read_says_why(expr: str, reason: str) -> None:
    with pytest.raises(ScheduleError) as refused:
        normalize_cron(expr)
    assert reason in str(refused.value), str(refused.value)


def test_a_new_task_refuses_an_over_long_duration_or_time() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for kind, text in (
        ("every", "0" * 20_000 + "61m"),
        ("in", "0" * 100 + "1h"),
        ("at", "2026-12-01 08:00" + " " * 100),
    ):
        with pytest.raises(ScheduleError, match="characters, at most 64") as refused:
            validate_new(ScheduleSpec(kind, text, "UTC"), now)
        assert len(str(refused.value)) < 300, str(refused.value)
    longest = timedelta(days=1, hours=23, minutes=59, seconds=59)
    assert validate_new(ScheduleSpec("every", "1d23h59m59s", "UTC"), now) == now + longest


def test_cron_add_and_the_schedule_tool_refuse_an_over_long_schedule(home: Path, cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("cron", "add", "--name", "a", "--agent", "assistant", "--cron", LONG_CRON, "--prompt", "x")
    assert r.code == 1 and f"at most {MAX_CRON_CHARS}" in r.err and len(r.err) < 1000, (r.code, r.err[:500])
    for call in (
        {"action": "create", "name": "huge", "cron": LONG_CRON, "prompt": "x"},
        {"action": "create", "name": "long", "every": "0" * 20_000 + "61m", "prompt": "x"},
    ):
        r = cli("run", "--json", f"/call schedule {json.dumps(call)}")
        assert r.code == 0, r.err[:500]
        text = r.json()["text"]
        assert "schedule create failed" in text and "at most" in text and len(text) < 1000, text[:500]
    listed = cli("cron", "list", "--json").json()
    assert listed == [], listed


def test_a_stored_over_long_expression_is_shown_invalid_and_short(home: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """A task an older version (or a hand edit) wrote with a 480 KB expression: listed as invalid,
    its expression shown by its start and length, not printed whole."""
    store = CronStore(home)
    store.add(
        make_task(
            name="huge",
            agent="assistant",
            schedule=ScheduleSpec("cron", "* * * * *", "UTC"),
            prompt="x",
            now=datetime.now(UTC),
        )
    )
    with store.transaction() as state:
        state.tasks[0].schedule = ScheduleSpec("cron", HUGE_CRON, "UTC")
    store.close()
    r = cli("cron", "list")
    assert r.code == 0, r.err[:500]
    assert "invalid" in r.out and f"({len(HUGE_CRON)} characters)" in r.out and len(r.out) < 2000, r.out[:1000]
    assert f"at most {MAX_CRON_CHARS}" in r.err and len(r.err) < 1000, r.err[:1000]
