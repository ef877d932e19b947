"""The cron CLI as a user reads it (issue 14.14, 14.17): the run log of a removed task, agents by
name, one spelling, `add` and `preview` agreeing on the next fire time, and a run-now envelope
that does not contradict itself."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, cron_group
from cron.envelope import build_envelope
from cron.schedule import ScheduleSpec
from cron.store import CronStore, make_task
from tests.support.cli import cli_env, run_cli


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cron(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=ANY_AGENT, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def test_logs_of_a_removed_task_by_name_and_id(home: Path) -> None:
    code, out, _ = cron("add", "--name", "gone", "--agent", "echo", "--every", "1h",
                        "--tz", "Europe/Paris", "--prompt", "p", "--json")  # fmt: skip
    assert code == 0
    task_id = json.loads(out)["id"]
    store = CronStore(home)
    from cron.runlog import append_run

    append_run(store.runs_dir, task_id, "missed", scheduled_for="2026-01-01T07:00:00+00:00", reason="down")  # fmt: skip
    code, out, _ = cron("remove", "gone")
    assert code == 0 and task_id in out
    assert (store.runs_dir / f"{task_id}.jsonl").exists()  # named by id, kept

    for ref in ("gone", task_id):
        code, out, err = cron("logs", ref)
        assert code == 0, err
        assert "missed" in out and "down" in out and "removed" in out
        assert "08:00:00 CET" in out  # shown in the removed task's own timezone
        assert "was removed" in err
        code, out, _ = cron("logs", ref, "--json")
        assert [r["event"] for r in json.loads(out)] == ["missed", "removed"]

    code, _, err = cron("logs", "never-existed")
    assert code == 2 and err.startswith("error: no cron task 'never-existed'")

    # a name reused after removal: the live task wins; two removed ones by one name: ask for an id
    assert cron("add", "--name", "gone", "--agent", "echo", "--every", "2h", "--prompt", "p")[0] == 0
    code, out, _ = cron("logs", "gone")
    assert code == 0 and out.strip().startswith("no runs yet")
    assert cron("remove", "gone")[0] == 0
    code, _, err = cron("logs", "gone")
    assert code == 1 and "several removed tasks" in err and task_id in err


def test_agent_names_one_spelling_and_add_agrees_with_preview(home: Path) -> None:
    """Through the real `appserver` CLI (agents resolved in the store)."""
    # hourly: up to 59 s of jitter, so the fire time differs from the nominal one
    add = run_cli(home, "cron", "add", "--name", "hourly", "--agent", "assistant",
                  "--cron", "0 * * * *", "--tz", "UTC", "--prompt", "p")  # fmt: skip
    assert add.code == 0, add.err
    assert add.out.startswith("added cron task hourly (cron_") and "for agent assistant;" in add.out
    assert "agt_" not in add.out
    next_run = re.search(r"next run (\S+ \S+ \S+)", add.out)
    assert next_run is not None

    listed = run_cli(home, "cron", "list")
    assert listed.code == 0 and "agt_" not in listed.out
    row = listed.out.splitlines()[1].split()
    assert row[1:3] == ["hourly", "assistant"]
    task = CronStore(home).read().tasks[0]
    assert task.agent.startswith("agt_") and task.next_due_at is not None
    assert next_run.group(1) == task.next_due_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert next_run.group(1) in listed.out.splitlines()[1]  # list shows the same fire time

    preview = run_cli(home, "cron", "preview", "hourly", "--count", "2")
    assert preview.code == 0
    assert preview.out.splitlines()[0].startswith(next_run.group(1))


def test_run_now_envelope_does_not_claim_the_scheduler_started_it() -> None:
    now = datetime(2026, 1, 1, 8, 0, tzinfo=UTC)
    task = make_task(
        name="brief", agent="agt_1", schedule=ScheduleSpec("cron", "0 8 * * *", "UTC"), prompt="p", now=now
    )
    manual = task.claim(now, now, now, manual=True)
    text = build_envelope(task, manual, "assistant")
    assert "Started by hand" in text and "by the scheduler" not in text
    assert "agent assistant" in text and "agt_1" not in text
    assert "do not ask questions" in text  # still: nobody answers during the run
    scheduled = task.claim(now, now, now)
    text = build_envelope(task, scheduled)
    assert "started by the scheduler" in text and "by hand" not in text


def test_out_of_range_schedules_are_one_line_errors_never_tracebacks(home: Path) -> None:
    """Durations and dates past what a datetime holds are refused in words (exit 1, one line);
    a schedule that runs off the end of the calendar just has no more occurrences; a duplicate
    name is reported with the agent as the user typed it (not its id)."""
    for args in (
        ["--in", "99999999d"],
        ["--every", "99999999999999999999999d"],
        ["--in", "1h", "--max-lateness", "999999999d"],
        ["--at", "9999-12-31 23:59", "--tz", "America/Los_Angeles"],
        ["--at", "9999-12-31T23:59-05:00"],
    ):
        code, _, err = cron("add", "--name", "far", "--agent", "assistant", "--prompt", "x", *args)
        assert code == 1 and err.strip().startswith("error: invalid "), (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)
    code, _, err = cron("add", "--name", "century", "--agent", "assistant", "--every", "36500d", "--prompt", "x")
    assert code == 0, err
    code, out, err = cron("preview", "century", "--count", "200")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("99"), out  # it stops before the year 10000
    code, _, err = cron("add", "--name", "century", "--agent", "assistant", "--in", "1h", "--prompt", "x")
    assert code == 1 and err.strip() == "error: agent 'assistant' already has a cron task named 'century'", err


def test_an_empty_timezone_is_refused_not_read_as_the_machines(home: Path) -> None:
    """`--tz "$TZ"` with TZ unset gives `--tz ""`: a mistake to say, not a wish for the default zone."""
    for tz in ("", " ", "Mars/Olympus"):
        args = ("--name", "t", "--agent", "assistant", "--cron", "0 9 * * *", "--tz", tz, "--prompt", "x")
        code, _, err = cron("add", *args)
        assert code == 1 and err.strip().startswith("error: unknown timezone"), (tz, err)
    code, out, _ = cron("list")
    assert code == 0 and "no cron tasks" in out


def test_a_task_whose_agent_was_deleted_is_not_enabled_again(tmp_path: Path) -> None:
    """Enabled, it would fail at every fire: `cron enable` said "next run …" and exited 0."""
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "gone", env=env).code == 0
    add = run_cli(
        home, "cron", "add", "--name", "t", "--agent", "gone", "--every", "1h", "--prompt", "p", "--json", env=env
    )
    assert add.code == 0, add.err
    task_id = json.loads(add.out)["id"]
    assert run_cli(home, "agents", "delete", "gone", env=env).code == 0  # the task is disabled with it
    again = run_cli(home, "cron", "enable", task_id, env=env)
    assert again.code == 2 and "was deleted" in again.err and again.err.count("\n") == 1, (again.code, again.err)
    shown = json.loads(run_cli(home, "cron", "show", task_id, "--json", env=env).out)
    assert shown["enabled"] is False


@pytest.mark.parametrize(("misfire", "runs"), [("skip", 1), ("run_once", 1), ("run_all", 10)])
def test_preview_shows_times_that_came_due_while_no_scheduler_ran_as_the_policy_treats_them(
    home: Path, misfire: str, runs: int
) -> None:
    """`preview` listed times already past as "the next fire times" (and `list` a past next run)
    after a server was down; they are shown as the misfire policy will treat them."""
    from datetime import timedelta

    from cron.store import CronFile

    now = datetime.now(UTC)
    task = make_task(name="often", agent="agt_1", schedule=ScheduleSpec("every", "1m", "UTC"), prompt="p",
                     now=now - timedelta(hours=2), misfire=misfire, max_lateness_s=120, exact=True)  # fmt: skip
    store = CronStore(home)
    with store.lock():
        store.save(CronFile(tasks=[task]))
    code, out, err = cron("preview", "often", "--count", "3", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert [s["overdue"] for s in shown] == [True] * runs + [False] * 3, shown
    for s in shown[runs:]:
        assert datetime.fromisoformat(s["fires_at"]) > now  # the upcoming ones are all to come
    for s in shown[:runs]:
        assert datetime.fromisoformat(s["fires_at"]) <= datetime.now(UTC)
    code, out, _ = cron("preview", "often", "--count", "3")
    lines = out.splitlines()
    assert code == 0 and "came due while no scheduler ran" in lines[0] and f"misfire={misfire}" in lines[0]
    assert sum("(overdue" in line for line in lines) == runs and len(lines) == 1 + runs + 3
    code, out, _ = cron("list")
    assert code == 0 and "(overdue)" in out.splitlines()[1]
    code, out, _ = cron("show", "often")
    assert code == 0 and "(overdue)" in out
