"""crons.json holding valid JSON of the wrong shape (`null`, a list, a number, a string, a bool) is
as unusable as torn JSON: a writer sets it aside with a loud error
and writes nothing over it, a reader says so and moves nothing, the scheduler reports it. It is
never read as an empty task list that the next write would then replace."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, cron_group
from appserver.fsutil import CorruptStateFile
from cron.scheduler import Scheduler
from cron.store import CronFileUnreadable, CronStore, CronTask, Occurrence
from tests.support.cli import run_cli

WRONG_SHAPES = [
    "null",
    "[]",
    "[{}]",
    "5",
    '"tasks"',
    "true",
    '{"version": true, "tasks": []}',
]
# An unusable `scheduler_owner` (not an object, a pid os.kill overflows on) is not here: it is read
# as no owner and the tasks stay in use (tests/test_cron_lease_expiry.py).


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cron(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=ANY_AGENT, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize("text", WRONG_SHAPES)
def test_a_reader_reports_the_wrong_shape_and_moves_nothing(home: Path, text: str) -> None:
    (home / "crons.json").write_text(text)
    with pytest.raises(CronFileUnreadable):
        CronStore(home).read()
    code, out, err = cron("list")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "cannot be read" in err, (code, out, err)
    assert (home / "crons.json").read_text() == text and CronStore(home).corrupt_files() == []


@pytest.mark.parametrize("text", WRONG_SHAPES)
def test_a_writer_sets_the_wrong_shape_aside_and_never_overwrites_it(home: Path, text: str) -> None:
    (home / "crons.json").write_text(text)
    code, _, err = cron("add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 1 and "moved aside" in err and len(err.strip().splitlines()) == 1, err
    aside = CronStore(home).corrupt_files()
    assert len(aside) == 1 and aside[0].read_text() == text  # kept exactly as it was
    assert not (home / "crons.json").exists()  # the refused add wrote nothing


async def test_the_scheduler_sets_null_aside_and_reports_it(home: Path) -> None:
    (home / "crons.json").write_text("null")

    async def fire(task: CronTask, occ: Occurrence) -> str:
        return "turn"

    s = Scheduler(CronStore(home), fire=fire, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC) + timedelta(hours=1))
    with pytest.raises(CorruptStateFile):
        await s.tick()
    aside = CronStore(home).corrupt_files()
    assert len(aside) == 1 and aside[0].read_text() == "null"
    problem = s.problem()
    assert problem is not None and aside[0].name in problem


def test_an_empty_task_list_is_still_fine(home: Path) -> None:
    (home / "crons.json").write_text(json.dumps({"version": 1, "scheduler_owner": None, "tasks": []}))
    assert CronStore(home).read().tasks == []
    assert cron("list")[0] == 0


# ── integers too long for int() ───────────────────────────────────────────────────────────────
# json.loads raises a plain ValueError ("Exceeds the limit (4300 digits)") for such an integer,
# which was not caught: `cron list` / `cron add` printed Python's message and the scheduler logged a
# traceback every tick. Now the file parses, and the over-long number is one no field accepts.

HUGE = "1" + "0" * 5000


def _with_a_task(home: Path) -> dict[str, object]:
    code, _, err = cron("add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 0, err
    return json.loads((home / "crons.json").read_text())


def test_an_over_long_owner_pid_is_read_as_no_owner_and_the_tasks_stay(home: Path) -> None:
    data = _with_a_task(home)
    owner = {"pid": 4242, "token": "d" * 32, "started_at": "2026-01-01T00:00:00+00:00"}
    text = json.dumps({**data, "scheduler_owner": owner}).replace('"pid": 4242', f'"pid": {HUGE}')
    (home / "crons.json").write_text(text)
    state = CronStore(home).read()
    assert state.scheduler_owner is None and state.owner_problem is not None and "pid" in state.owner_problem
    assert [t.name for t in state.tasks] == ["a"]
    listed = run_cli(home, "cron", "list", "--json")
    assert listed.code == 0 and [t["name"] for t in listed.json()] == ["a"], listed.err[:300]
    assert "Exceeds the limit" not in listed.err and "Traceback" not in listed.err
    added = run_cli(home, "cron", "add", "--name", "b", "--agent", "assistant", "--every", "1h", "--prompt", "y")
    assert added.code == 0, added.err[:300]
    assert [t.name for t in CronStore(home).read().tasks] == ["a", "b"] and CronStore(home).corrupt_files() == []


def test_a_task_with_an_unknown_schedule_kind_is_invalid_and_the_others_are_listed(home: Path) -> None:
    """A hand edit (`"kind": "weekly"`) made `cron list` and `show` fail for every task with a bare
    KeyError: that task is now kept as invalid, said, and the rest are listed."""
    _with_a_task(home)
    added = run_cli(home, "cron", "add", "--name", "b", "--agent", "assistant", "--every", "1h", "--prompt", "y")
    assert added.code == 0, added.err[:300]
    data = json.loads((home / "crons.json").read_text())
    data["tasks"][0]["schedule"]["kind"] = "weekly"
    (home / "crons.json").write_text(json.dumps(data))
    listed = run_cli(home, "cron", "list", "--json")
    assert listed.code == 0, listed.err[:300]
    assert [t["name"] for t in listed.json() if t["state"] != "invalid"] == ["b"]
    assert [t["name"] for t in listed.json() if t["state"] == "invalid"] == ["a"]
    assert "unknown schedule kind 'weekly'" in listed.err
    shown = run_cli(home, "cron", "show", "a")  # shown as invalid, with its reason
    assert shown.code == 0 and "invalid" in shown.out and "unknown schedule kind 'weekly'" in shown.out, shown.err
    assert "Traceback" not in shown.err


def test_a_copied_task_with_the_same_id_is_invalid_and_the_file_stays(home: Path) -> None:
    """A hand edit that duplicated a task (same id): the first stays in use, the copy is kept as
    invalid and said (was: the whole crons.json set aside, every task stopped)."""
    data = _with_a_task(home)
    tasks = data["tasks"]
    assert isinstance(tasks, list)
    (home / "crons.json").write_text(json.dumps({**data, "tasks": [*tasks, {**tasks[0], "name": "copy"}]}))
    listed = run_cli(home, "cron", "list", "--json")
    assert listed.code == 0, listed.err[:300]
    assert [t["name"] for t in listed.json() if t["state"] != "invalid"] == ["a"]
    assert [t["name"] for t in listed.json() if t["state"] == "invalid"] == ["copy"]
    assert "a second task with the id" in listed.err
    assert CronStore(home).corrupt_files() == []
    added = run_cli(home, "cron", "add", "--name", "b", "--agent", "assistant", "--every", "1h", "--prompt", "y")
    assert added.code == 0, added.err[:300]
    kept = json.loads((home / "crons.json").read_text())["tasks"]
    assert [t["name"] for t in kept] == ["a", "b", "copy"]  # the copy is still in the file, as it was


@pytest.mark.parametrize("field", ["occurrence", "max_lateness_s"])
def test_an_over_long_number_in_a_task_makes_that_task_invalid_not_the_file(home: Path, field: str) -> None:
    data = _with_a_task(home)
    tasks = data["tasks"]
    assert isinstance(tasks, list)
    bad = {**tasks[0], "id": "cron_bad", "name": "bad", field: 7}
    text = json.dumps({**data, "tasks": [*tasks, bad]})
    text = text.replace(f'"{field}": 7', f'"{field}": {HUGE}')
    (home / "crons.json").write_text(text)
    state = CronStore(home).read()
    assert [t.name for t in state.tasks] == ["a"] and [b.id for b in state.invalid] == ["cron_bad"]
    assert field in state.invalid[0].reason
    listed = run_cli(home, "cron", "list")
    assert listed.code == 0 and "cron_bad is invalid and not scheduled" in listed.err, listed.err[:300]
    assert "Exceeds the limit" not in listed.err and "Traceback" not in listed.err
    added = run_cli(home, "cron", "add", "--name", "b", "--agent", "assistant", "--every", "1h", "--prompt", "y")
    assert added.code == 0, added.err[:300]
    after = CronStore(home).read()
    assert [t.name for t in after.tasks] == ["a", "b"] and [b.id for b in after.invalid] == ["cron_bad"]
    assert CronStore(home).corrupt_files() == []


async def test_the_scheduler_ticks_past_over_long_numbers_without_setting_the_file_aside(home: Path) -> None:
    data = _with_a_task(home)
    tasks = data["tasks"]
    assert isinstance(tasks, list)
    owner = {"pid": 4242, "token": "d" * 32, "started_at": "2026-01-01T00:00:00+00:00"}
    bad = {**tasks[0], "id": "cron_bad", "name": "bad", "occurrence": 7}
    text = json.dumps({**data, "scheduler_owner": owner, "tasks": [*tasks, bad]})
    text = text.replace('"pid": 4242', f'"pid": {HUGE}').replace('"occurrence": 7', f'"occurrence": {HUGE}')
    (home / "crons.json").write_text(text)

    async def fire(task: CronTask, occ: Occurrence) -> str:
        return "turn"

    s = Scheduler(CronStore(home), fire=fire, clock=lambda: datetime.now(UTC))
    for _ in range(2):
        report = await s.tick()
        assert report.has_lease  # the unusable owner is no owner: this scheduler takes the lease
    problem = s.problem()
    assert problem is not None and "cron_bad" in problem
    assert CronStore(home).corrupt_files() == []
    assert CronStore(home).read().scheduler_owner is not None


def test_json_nested_too_deeply_is_unreadable_not_a_crash(home: Path) -> None:
    text = "[" * 100_000 + "]" * 100_000
    (home / "crons.json").write_text(text)
    with pytest.raises(CronFileUnreadable, match="nested too deeply"):
        CronStore(home).read()
    code, _, err = cron("add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 1 and "moved aside" in err, err
