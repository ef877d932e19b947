"""A crons.json task with one damaged field (a hand edit, another version): it is kept in the file
and never scheduled, and it is *seen*: `cron list` shows it `invalid` with a reason naming the
field (`--json`: `state`, `problem`), `cron show` shows it, and `cron remove` removes it, writing
every other task back as it was.

Was: such a task (`"enabled": "yes"`, `"next_fire_at": "garbage"`, a name that is a number, …) was
left out of `cron list` ("no cron tasks", exit 0, only a warning on stderr) and of `--json`, and
`cron show` / `cron remove` refused it (exit 1: "fix or delete it in crons.json"), although the
README says `cron remove` always works. Real crons.json files, the real CLI (CliRunner, in-process)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, cron_group
from cron.scheduler import Scheduler
from cron.store import CronStore, CronStoreError, CronTask, Occurrence

HUGE = "1" + "0" * 5000  # read as an infinity: no JSON a strict reader takes


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cron(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=ANY_AGENT, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def add(name: str, agent: str = "echo") -> None:
    code, _, err = cron("add", "--name", name, "--agent", agent, "--every", "1h", "--prompt", f"do {name}")
    assert code == 0, err


def tasks_in(home: Path) -> list[dict[str, Any]]:
    return json.loads((home / "crons.json").read_text())["tasks"]


def damage(home: Path, index: int, change: dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    """Edit task `index` of crons.json by hand; its id."""
    data = json.loads((home / "crons.json").read_text())
    task = data["tasks"][index]
    task.update(change)
    for key in drop:
        task.pop(key)
    (home / "crons.json").write_text(json.dumps(data))
    return str(task["id"])


# (what is damaged, the change, a word the reason must hold: the field)
DAMAGES = [
    ("enabled yes", {"enabled": "yes"}, "enabled"),
    ("next_fire_at garbage", {"next_fire_at": "garbage"}, "next_fire_at"),
    ("next_due_at a number", {"next_due_at": 5}, "next_due_at"),
    ("name a number", {"name": 5}, "name"),
    ("schedule an object of nothing", {"schedule": {"every": "5m"}}, "schedule"),
    ("schedule a string", {"schedule": "5m"}, "schedule"),
    ("agent null", {"agent": None}, "agent"),
    ("prompt a list", {"prompt": ["x"]}, "prompt"),
    ("occurrence negative", {"occurrence": -1}, "occurrence"),
    ("max_lateness_s negative", {"max_lateness_s": -5}, "max_lateness_s"),
    ("misfire unknown", {"misfire": "sometimes"}, "misfire"),
    ("exact a string", {"exact": "no"}, "exact"),
    ("last_error a number", {"last_error": 5}, "last_error"),
    ("last_error_at garbage", {"last_error_at": "yesterday"}, "last_error_at"),
    ("last_claimed a list", {"last_claimed": [1]}, "last_claimed"),
    ("updated_at a number", {"updated_at": 7}, "updated_at"),
    ("conversation a number", {"conversation": 5}, "conversation"),
    ("namespace a number", {"namespace": 5}, "namespace"),
    ("a misspelt field", {"enabeld": False}, "enabeld"),
    ("a negative interval", {"schedule": {"kind": "every", "expr": "-5m", "tz": "Etc/UTC"}}, "schedule"),
]


@pytest.mark.parametrize(("what", "change", "field"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_task_with_a_damaged_field_is_listed_shown_and_removable(
    home: Path, what: str, change: dict[str, Any], field: str
) -> None:
    add("kept")
    add("c1")
    tid = damage(home, 1, change)
    kept_before = tasks_in(home)[0]

    code, out, err = cron("list")
    row = next((line for line in out.splitlines() if line.startswith(tid)), None)
    assert code == 0 and row is not None and "invalid" in row.split(), (what, out, err)
    assert "kept" in out and "no cron tasks" not in out

    code, out, err = cron("list", "--json")
    assert code == 0, err
    listed = {t["id"]: t for t in json.loads(out)}
    assert listed[tid]["state"] == "invalid" and field in listed[tid]["problem"], listed[tid]
    assert listed[kept_before["id"]]["state"] == "scheduled"

    code, out, err = cron("show", tid)
    assert code == 0 and "invalid" in out and field in out, (what, code, out, err)
    code, out, err = cron("show", tid, "--json")
    assert code == 0 and json.loads(out)["state"] == "invalid" and field in json.loads(out)["problem"]

    code, out, err = cron("remove", tid)
    assert code == 0 and "removed" in out and tid in out, (what, code, out, err)
    assert tasks_in(home) == [kept_before]  # the other task written back as it was
    assert list(home.glob("crons.json.*.tmp")) == [] and CronStore(home).corrupt_files() == []
    code, out, _ = cron("show", tid)
    assert code == 2  # gone


def test_an_invalid_task_is_removed_by_its_name_and_its_run_log_says_so(home: Path) -> None:
    add("kept")
    add("c1")
    tid = damage(home, 1, {"enabled": "yes"})
    code, out, err = cron("remove", "c1")
    assert code == 0, err
    assert [t["name"] for t in tasks_in(home)] == ["kept"]
    last = json.loads((home / "cron-runs" / f"{tid}.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "removed" and last["task"]["enabled"] == "yes"
    code, out, err = cron("logs", "c1")  # a removed task's log is still found by its name
    assert code == 0 and "removed" in out, (out, err)


def test_a_task_of_an_over_long_number_is_listed_as_json_any_reader_takes(home: Path) -> None:
    add("c1")
    tid = damage(home, 0, {"occurrence": 7})
    path = home / "crons.json"
    path.write_text(path.read_text().replace('"occurrence": 7', f'"occurrence": {HUGE}'))

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is no JSON")

    code, out, err = cron("list", "--json")
    assert code == 0, err
    (entry,) = json.loads(out, parse_constant=strict)
    assert entry["id"] == tid and entry["state"] == "invalid" and "occurrence" in entry["problem"]
    code, out, _ = cron("list")
    assert code == 0 and "Infinity" in out and tid in out
    assert cron("remove", tid)[0] == 0 and tasks_in(home) == []


def test_a_copy_of_a_task_is_removed_by_its_name_and_the_original_keeps_its_log(home: Path) -> None:
    add("a")
    data = json.loads((home / "crons.json").read_text())
    original = data["tasks"][0]
    data["tasks"].append({**original, "name": "copy"})
    (home / "crons.json").write_text(json.dumps(data))
    code, out, _ = cron("list")
    assert code == 0 and "copy" in out and "invalid" in out

    code, out, err = cron("remove", "copy")
    assert code == 0, err
    assert tasks_in(home) == [original]
    assert not (home / "cron-runs" / f"{original['id']}.jsonl").exists()  # no `removed` in a live task's log


def test_list_by_agent_shows_only_that_agents_invalid_tasks(home: Path) -> None:
    add("mine", agent="echo")
    add("theirs", agent="other")
    damage(home, 0, {"enabled": "yes"})
    theirs = damage(home, 1, {"enabled": "no"})
    code, out, _ = cron("list", "--agent", "other", "--json")
    assert code == 0 and [t["id"] for t in json.loads(out)] == [theirs]
    code, out, err = cron("remove", "mine", "--agent", "other")
    assert code == 2, (out, err)
    assert cron("remove", "mine", "--agent", "echo")[0] == 0 and [t["name"] for t in tasks_in(home)] == ["theirs"]


@pytest.mark.parametrize("command", [("run",), ("enable",), ("disable",), ("preview",)])
def test_what_would_use_an_invalid_task_refuses_it_and_says_how_to_remove_it(
    home: Path, command: tuple[str, ...]
) -> None:
    add("c1")
    tid = damage(home, 0, {"next_fire_at": "garbage"})
    before = (home / "crons.json").read_text()
    code, _, err = cron(*command, "c1")
    assert code == 1 and "next_fire_at" in err and f"appserver cron remove {tid}" in err, (command, err)
    assert (home / "crons.json").read_text() == before


def test_the_schedule_tools_removal_never_takes_an_invalid_task(home: Path) -> None:
    """`CronStore.remove` (the `schedule` tool's) refuses an invalid task: it cannot tell whose it is."""
    add("c1")
    damage(home, 0, {"enabled": "yes"})
    with pytest.raises(CronStoreError, match="is invalid"):
        CronStore(home).remove("c1")
    assert len(tasks_in(home)) == 1


async def test_the_scheduler_never_fires_an_invalid_task_and_names_it(home: Path) -> None:
    add("good")
    add("bad")
    bad = damage(home, 1, {"enabled": "yes"})
    fired: list[str] = []

    async def fire(task: CronTask, occ: Occurrence) -> str:
        fired.append(task.id)
        return "turn"

    due = max(datetime.fromisoformat(t["next_due_at"]) for t in tasks_in(home))
    later = due + timedelta(seconds=1)  # both are due, neither late
    s = Scheduler(CronStore(home), fire=fire, clock=lambda: later)
    for _ in range(2):
        report = await s.tick()
        assert report.has_lease
    good = tasks_in(home)[0]["id"]
    assert bad not in fired and good in fired
    problem = s.problem()
    assert problem is not None and bad in problem and "enabled" in problem
    assert tasks_in(home)[1]["enabled"] == "yes"  # kept as it was
