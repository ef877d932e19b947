"""Cron attacked from outside, as a user would: the real CLI and real `serve` processes on one home.

What broke (each test below failed before its fix):
* a claim orphaned by two crashes in a row was lost without a word: the server that took the lease
  over from the first crash died before resolving its claim, and the next one only looked at the
  claims of its direct predecessor (cron/scheduler.py `_adopt`);
* croniter 7 reads a range of one value (`5-5`, `3-3`, `mon-mon`) as the whole field, so
  `0 0 3-3 * *` fired every day and `5-5 * * * *` every minute (cron/schedule.py), and the hint of
  a refused reversed range could itself be refused (`7-1` → "7-6,0-1") or mean every day ("0-0");
* a task name, id or deliver target ending in a newline passed its `^…$` check (`re.match` lets `$`
  match before a final newline): `cron add --name $'nightly\\n'` made a second "nightly";
* a run-log record with a value of the wrong type (an `at` that is no date, an occurrence that is a
  list) made `cron logs` fail with a traceback or an error instead of showing the history, and made
  the start-up scan for unrecorded outcomes raise.

The rest guards properties that held when attacked: `cron run` while the task fires on schedule,
and a crons.json damaged before `serve` starts.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import filelock
import httpx
import pytest

from cron.runlog import unrecorded_turns
from cron.schedule import ScheduleError, ScheduleSpec, normalize_cron, upcoming
from cron.store import CronFile
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def events(home: Path, task_id: str) -> list[str]:
    return [r["event"] + ("(recovered)" if r.get("recovered") else "") for r in run_log(home, task_id)]


def turns_with_key(home: Path, key: str) -> list[tuple[str, str]]:
    conn = sqlite3.connect(home / "appserver.db")
    try:
        # `key` names the run (cron\x1f<task>:<n>); the key also carries its scheduled time (@ms)
        rows = conn.execute("SELECT id, status, idempotency_key FROM turns").fetchall()
        return [(i, s) for i, s, k in rows if k == key or (k or "").startswith(key + "@")]
    finally:
        conn.close()


def add_task(home: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--prompt", "wake up", "--json", *args, env=env)
    assert r.code == 0, r.err
    task: dict[str, Any] = json.loads(r.out)
    return task


# ------------------------------------------------------------------ kill -9 twice in a row


def test_a_claim_orphaned_by_two_crashes_in_a_row_still_runs_exactly_once(home: Path) -> None:
    """Server 1 claims a run and dies before submitting it; server 2 takes the lease over, starts
    to resubmit that claim and dies too; server 3 must still run it, once. The crashes are made
    deterministic with locks a user could hold: the SQLite write lock keeps a submit from
    committing, crons.json.lock keeps server 2's first tick waiting until that lock is held."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="1")
    home.mkdir(parents=True)
    servers: list[ServeProcess] = []
    db = None
    try:
        servers.append(start_serve(home, env=env))
        task = add_task(home, env, "--name", "soon", "--in", "2s", "--exact")
        tid, key = task["id"], f"cron\x1f{task['id']}:1"
        db = sqlite3.connect(home / "appserver.db", isolation_level=None, timeout=10)

        db.execute("BEGIN IMMEDIATE")  # server 1's submit cannot commit
        wait_for(lambda: "fired" in events(home, tid), 15, "server 1 to claim the run")
        time.sleep(0.2)
        servers[0].kill()  # SIGKILL between the claim and the submit
        db.execute("ROLLBACK")
        assert events(home, tid) == ["fired"] and turns_with_key(home, key) == []

        lock = filelock.FileLock(str(home / "crons.json.lock"))
        lock.acquire()  # server 2 starts, its first tick waits for this lock
        try:
            servers.append(start_serve(home, env=env))
            db.execute("BEGIN IMMEDIATE")  # server 2's resubmit cannot commit either
        finally:
            lock.release()
        said = servers[1].proc.stderr.seen  # type: ignore[union-attr]
        wait_for(lambda: said("submitting it now") or None, 15, "server 2 to resubmit the claim")
        time.sleep(0.2)
        servers[1].kill()  # SIGKILL while it resubmits
        db.execute("ROLLBACK")
        # the claim's own `fired` line is there: the resubmit adds no second one
        assert events(home, tid) == ["fired"] and turns_with_key(home, key) == []

        servers.append(start_serve(home, env=env))
        wait_for(lambda: "outcome" in events(home, tid), 15, "server 3 to run the twice-orphaned claim")
        time.sleep(1.2)  # a tick more: nothing else fires
        turns = turns_with_key(home, key)
        assert len(turns) == 1 and turns[0][1] == "completed", turns
        log = events(home, tid)
        assert log == ["fired", "submitted(recovered)", "outcome"], log  # one line of each
        shown = run_cli(home, "cron", "logs", "soon", env=env)
        assert shown.code == 0 and "LOST" not in shown.out, shown.out
        assert shown.out.count("recovered: claimed by a scheduler that stopped") == 1, shown.out
    finally:
        if db is not None:
            db.close()
        for sp in servers:
            sp.kill()


# ------------------------------------------------------------------ cron expressions


@pytest.mark.parametrize(
    ("expr", "field", "value"),
    [("5-5 * * * *", "minute", 5), ("0 0 3-3 * *", "day", 3), ("0 0 * * 0-0", "weekday", 6),
     ("0 0 * * 7-7", "weekday", 6), ("0 0 * * mon-mon", "weekday", 0), ("0 0 * jan-jan *", "month", 1),
     ("1-1/3 * * * *", "minute", 1)],
)  # fmt: skip
def test_a_range_of_one_value_means_that_value_not_the_whole_field(expr: str, field: str, value: int) -> None:
    """As standard cron reads it; croniter 7 alone would fire every minute / every day. The
    scheduler evaluates a stored expression through the same path, so hand-written ones too."""
    start = datetime(2026, 12, 2, 1, 3, tzinfo=UTC)
    times = upcoming(ScheduleSpec("cron", expr, "UTC"), start, start, 4)
    got = {"minute": [t.minute for t in times], "day": [t.day for t in times],
           "weekday": [t.weekday() for t in times], "month": [t.month for t in times]}[field]  # fmt: skip
    assert len(times) == 4 and set(got) == {value}, (expr, times)


def test_cron_add_stores_a_range_of_one_value_as_the_value(home: Path) -> None:
    task = add_task(home, cli_env(home), "--name", "five", "--cron", "5-5 * * * *", "--tz", "UTC", "--exact")
    assert task["schedule"]["expr"] == "5 * * * *"
    preview = run_cli(home, "cron", "preview", "five", "--count", "3", "--json")
    assert preview.code == 0, preview.err
    fires = [datetime.fromisoformat(x["fires_at"]) for x in preview.json()]
    assert [t.minute for t in fires] == [5, 5, 5] and fires[1] - fires[0] == timedelta(hours=1), fires


@pytest.mark.parametrize(
    ("expr", "index", "expected"),
    [("0 0 * * 7-1", 4, {6, 0}), ("0 0 * * 6-0", 4, {5, 6}), ("0 0 * * 7-0", 4, {6}),
     ("59-0 * * * *", 0, {59, 0}), ("0 23-1 * * *", 1, {23, 0, 1})],
)  # fmt: skip
def test_the_hint_for_a_reversed_range_is_an_expression_that_means_it(
    expr: str, index: int, expected: set[int]
) -> None:
    """The refusal suggests a rewrite; pasted back, it must be accepted and mean what the user meant
    (weekdays as Python counts them: Monday 0 … Sunday 6)."""
    with pytest.raises(ScheduleError, match="backwards") as err:
        normalize_cron(expr)
    hint = re.search(r"\(e\.g\. ([^)]+)\)", str(err.value))
    assert hint is not None, str(err.value)
    fields = expr.split()
    fields[index] = hint.group(1)
    fixed = normalize_cron(" ".join(fields))
    start = datetime(2026, 12, 2, tzinfo=UTC)
    times = upcoming(ScheduleSpec("cron", fixed, "UTC"), start, start, 60)
    got = {0: [t.minute for t in times], 1: [t.hour for t in times], 4: [t.weekday() for t in times]}[index]
    assert set(got) == expected, (fixed, times[:8])


# ------------------------------------------------------------------ names with a trailing newline


def test_a_name_or_target_ending_in_a_newline_is_refused(home: Path) -> None:
    env = cli_env(home)
    add_task(home, env, "--name", "nightly", "--in", "1h")
    r = run_cli(home, "cron", "add", "--name", "nightly\n", "--agent", "assistant", "--in", "1h",
                "--prompt", "p", env=env)  # fmt: skip
    assert r.code == 1 and "invalid task name" in r.err, (r.code, r.err)
    r = run_cli(home, "cron", "add", "--name", "other", "--agent", "assistant", "--in", "1h",
                "--prompt", "p", "--deliver", "webhook:home\n:kitchen", env=env)  # fmt: skip
    assert r.code == 1 and "invalid deliver target" in r.err, (r.code, r.err)
    names = [t["name"] for t in json.loads(run_cli(home, "cron", "list", "--json", env=env).out)]
    assert names == ["nightly"], names


def test_a_name_shaped_like_a_task_id_is_refused(home: Path) -> None:
    """Commands take an id or a name: a task named like another's id could never be reached by
    its name (`cron show cron_…` answered with the other task)."""
    env = cli_env(home)
    first = add_task(home, env, "--name", "first", "--in", "1h")
    r = run_cli(home, "cron", "add", "--name", first["id"], "--agent", "assistant", "--in", "1h",
                "--prompt", "p", env=env)  # fmt: skip
    assert r.code == 1 and "shape of a task id" in r.err, (r.code, r.err)
    add_task(home, env, "--name", "cron_nightly", "--in", "1h")  # the prefix alone is a fine name


def test_a_stored_id_ending_in_a_newline_is_an_invalid_task() -> None:
    """The id names the run-log file: `cron_x\\n.jsonl` is not a name cron should ever write."""
    good = {"id": "cron_x", "name": "x", "agent": "a", "prompt": "p", "created_at": "2026-01-01T00:00:00+00:00",
            "schedule": {"kind": "every", "expr": "1h", "tz": "UTC"}}  # fmt: skip
    state = CronFile.from_dict({"version": 1, "tasks": [{**good, "id": "cron_x\n"}]})
    assert state.tasks == [] and [bad.id for bad in state.invalid] == ["cron_x\n"]
    assert [t.id for t in CronFile.from_dict({"version": 1, "tasks": [good]}).tasks] == ["cron_x"]


# ------------------------------------------------------------------ a run log with foreign values


def test_a_run_log_with_foreign_values_still_shows_its_history(home: Path) -> None:
    env = cli_env(home)
    tid = add_task(home, env, "--name", "a", "--in", "1h")["id"]
    runs = home / "cron-runs"
    runs.mkdir(exist_ok=True)
    at = "2026-12-01T00:00:00+00:00"
    lines = [
        {"event": "fired", "at": at, "task_id": tid, "occurrence": 1, "scheduled_for": at},
        {"event": "submitted", "at": at, "task_id": tid, "occurrence": 1, "turn_id": "turn_good"},
        {"event": "missed", "at": "not a date", "task_id": tid, "scheduled_for": "yesterday"},
        {"event": "outcome", "at": at, "task_id": tid, "occurrence": [1], "status": "completed"},
        {"event": "fired", "at": at, "task_id": tid, "occurrence": {"n": 2}},
        {"event": ["odd"], "at": "0001-01-01T00:00:00", "task_id": tid},
    ]
    (runs / f"{tid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    shown = run_cli(home, "cron", "logs", "a", env=env)
    assert shown.code == 0, shown.err
    assert "turn_good" in shown.out and "not a date" in shown.out and len(shown.out.splitlines()) == 3, shown.out
    # the lines whose run number or event is no record's are skipped, said once (docs/security.md)
    assert "skipped 3 unreadable line(s)" in shown.err and "line 4, 5, 6" in shown.err, shown.err
    assert run_cli(home, "cron", "logs", "a", "--json", env=env).code == 0
    # the start-up scan for outcomes a dead server never recorded reads every log: one odd record
    # must neither raise nor hide the real finding (turn_good has no outcome of its own)
    assert unrecorded_turns(runs, datetime.now(UTC) + timedelta(days=1)) == [(tid, 1, "turn_good")]


# ------------------------------------------------------------------ guards


def test_cron_run_while_the_task_fires_on_schedule_never_shares_an_occurrence(home: Path) -> None:
    """Two bursts of six `cron run` at once through the server while the task fires every second: every run has
    its own number and its own turn, and removing the task mid-stream loses no outcome."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="1")
    sp = start_serve(home, env=env)
    try:
        tid = add_task(home, env, "--name", "tick", "--every", "1s", "--exact")["id"]
        wait_for(lambda: "fired" in events(home, tid), 10, "the first scheduled run")
        results: list[CLIResult] = []
        with ThreadPoolExecutor(6) as pool:
            for _ in range(2):  # two bursts a scheduled fire apart
                results += pool.map(lambda _: run_cli(home, "cron", "run", "tick", "--json", env=env), range(6))
                time.sleep(1.1)
        assert [r.code for r in results] == [0] * 12, [r.err for r in results]
        manual = [r.json()["occurrence"]["occurrence"] for r in results]
        assert len(set(manual)) == 12, manual
        removed = run_cli(home, "cron", "remove", "tick", env=env)
        assert removed.code == 0, removed.err

        def settled() -> list[dict[str, Any]] | None:
            log = run_log(home, tid)
            fired = [r for r in log if r["event"] == "fired"]
            outcomes = [r for r in log if r["event"] == "outcome"]
            return log if len(outcomes) == len(fired) else None

        log = wait_for(settled, 15, "every fired run to end")
    finally:
        sp.kill()
    numbers = sorted(r["occurrence"] for r in log if r["event"] == "fired")
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    scheduled = [r for r in log if r["event"] == "fired" and not r["manual"]]
    assert len(scheduled) >= 2 and len(numbers) == 12 + len(scheduled), log
    submitted = [r for r in log if r["event"] == "submitted"]
    assert sorted(r["occurrence"] for r in submitted) == numbers
    assert len({r["turn_id"] for r in submitted}) == len(numbers)
    assert {r["status"] for r in log if r["event"] == "outcome"} == {"completed"}
    for n in numbers:
        assert len(turns_with_key(home, f"cron\x1f{tid}:{n}")) == 1, n


def test_a_crons_json_damaged_before_serve_is_set_aside_loudly_and_cron_goes_on(home: Path) -> None:
    """Never read as "no tasks" in silence, never a crash loop: the file is kept aside untouched,
    /readyz and `cron list` say so, and a task added afterwards fires."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="1")
    home.mkdir(parents=True)
    damaged = b'{"version": 1, "tasks": [{"id": "cron_lost", "name": "lo'
    (home / "crons.json").write_bytes(damaged)
    sp = start_serve(home, env=env)
    try:
        aside = wait_for(lambda: sorted(home.glob("crons.json.corrupt-*")), 10, "the file to be set aside")
        assert len(aside) == 1 and aside[0].read_bytes() == damaged

        def cron_check() -> dict[str, Any] | None:
            checks = httpx.get(sp.url + "/readyz", timeout=5).json().get("checks", [])
            found = [c for c in checks if c.get("name") == "cron"]
            return found[0] if found and found[0]["status"] != "ok" else None

        check = wait_for(cron_check, 10, "/readyz to report the set-aside file")
        assert check["status"] == "warn" and aside[0].name in check["detail"], check
        listed = run_cli(home, "cron", "list", env=env)
        assert aside[0].name in listed.err, listed.err

        tid = add_task(home, env, "--name", "after", "--in", "1s", "--exact")["id"]
        wait_for(lambda: "outcome" in events(home, tid), 15, "the new task to fire")
        assert events(home, tid) == ["fired", "submitted", "outcome"]
        assert sp.proc.poll() is None and aside[0].read_bytes() == damaged
    finally:
        sp.kill()
