"""Non-finite and absurd numbers (NaN, Infinity, 1e999, negative counters) in a task: refused where
a task is made, and in crons.json confined to the one task that carries them. The bad task is
skipped with a loud, lasting report and kept in the file as it was; every other task keeps firing;
the CLI answers in one line and never with a traceback."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, cron_group
from cron.runlog import read_runs
from cron.schedule import ScheduleError, ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BAD_VALUES: list[tuple[str, Any]] = [
    ("max_lateness_s", math.nan),
    ("max_lateness_s", math.inf),
    ("max_lateness_s", -5.0),
    ("max_lateness_s", 1e300),
    ("occurrence", math.inf),
    ("occurrence", -1),
    ("occurrence", 2.5),
    ("occurrence", True),
    ("enabled", "false"),
    ("exact", 1),
    ("last_claimed", [1]),
]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cron(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=ANY_AGENT, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def good_task(name: str) -> CronTask:
    spec = ScheduleSpec("every", "1h", "UTC")
    return make_task(name=name, agent="echo", schedule=spec, prompt="p", now=T0, exact=True)


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_from_dict_refuses_the_value(key: str, value: Any) -> None:
    raw = {**good_task("t").to_dict(), key: value}
    with pytest.raises(ValueError, match=key):
        CronTask.from_dict(raw)


@pytest.mark.parametrize("lateness", [math.nan, math.inf, -1.0, 1e999])
def test_make_task_refuses_a_non_finite_lateness(lateness: float) -> None:
    with pytest.raises(ScheduleError, match="max lateness"):
        make_task(
            name="t",
            agent="echo",
            schedule=ScheduleSpec("every", "1h", "UTC"),
            prompt="p",
            now=T0,
            max_lateness_s=lateness,
        )


def write_with_bad_task(home: Path, text_value: str) -> tuple[CronTask, str]:
    """crons.json with one good task and one whose max_lateness_s is `text_value` as written."""
    good = good_task("good")
    bad = good_task("bad").to_dict()
    bad_line = json.dumps(bad).replace('"max_lateness_s": 300.0', f'"max_lateness_s": {text_value}')
    home.mkdir(parents=True, exist_ok=True)
    (home / "crons.json").write_text(
        '{"version": 1, "scheduler_owner": null, "tasks": [' + json.dumps(good.to_dict()) + ", " + bad_line + "]}"
    )
    return good, bad["id"]


@pytest.mark.parametrize("text_value", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_a_bad_task_in_the_file_does_not_stall_the_others(home: Path, text_value: str) -> None:
    good, bad_id = write_with_bad_task(home, text_value)
    fired: list[str] = []

    async def fire(task: CronTask, occ: Occurrence) -> str:
        fired.append(task.name)
        return f"turn_{task.name}"

    store = CronStore(home)
    s = Scheduler(store, fire=fire, clock=lambda: T0 + timedelta(hours=1))
    await s.tick()
    assert fired == ["good"]  # the good task fires; the bad one is skipped
    problem = s.problem()
    assert problem is not None and bad_id in problem and "max_lateness_s" in problem
    assert store.corrupt_files() == []  # nothing was set aside
    kept = json.loads((home / "crons.json").read_text())["tasks"]  # (json reads NaN and Infinity)
    assert [t["id"] for t in kept] == [good.id, bad_id]
    value = kept[1]["max_lateness_s"]
    expected = float(text_value.replace("Infinity", "inf"))
    assert (math.isnan(value) and math.isnan(expected)) or value == expected  # kept as it was
    assert [r["event"] for r in read_runs(store.runs_dir, good.id)] == ["fired", "submitted"]


def test_the_cli_names_a_bad_task_in_one_line(home: Path) -> None:
    good, bad_id = write_with_bad_task(home, "1e999")
    data = json.loads((home / "crons.json").read_text())
    data["tasks"][1]["occurrence"] = 10**400  # an integer no float can hold
    (home / "crons.json").write_text(json.dumps(data))
    code, out, err = cron("list")
    assert code == 0 and "good" in out and bad_id in err and "invalid" in err, (code, out, err)
    code, out, err = cron("show", bad_id)  # shown as invalid, with its reason
    assert code == 0 and "state     invalid" in out and "max_lateness_s" in out, (code, out, err)
    assert "Traceback" not in err
    code, out, err = cron("add", "--name", "more", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 0, err
    tasks = json.loads((home / "crons.json").read_text())["tasks"]
    assert [t["name"] for t in tasks] == ["good", "more", "bad"]  # the bad task is kept, untouched
    assert tasks[2]["occurrence"] == 10**400


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "0", "-1", "1e9", "ten"])
def test_cron_run_refuses_a_bad_timeout_in_one_line(home: Path, value: str) -> None:
    code, out, err = cron("run", "anything", "--timeout", value)
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and "--timeout" in err, (code, err)
    assert "Traceback" not in err


async def test_a_task_whose_times_overflow_the_calendar_does_not_stall_the_others(home: Path) -> None:
    """Values that parse but break the date arithmetic (a next run at the end of the year 9999 in
    a zone ahead of UTC) turn that task into a visible error; the others fire."""
    store = CronStore(home)
    good = store.add(good_task("good"))
    spec = ScheduleSpec("cron", "0 * * * *", "Asia/Tokyo")
    bad = store.add(make_task(name="bad", agent="echo", schedule=spec, prompt="p", now=T0))
    data = json.loads(store.path.read_text())
    data["tasks"][1]["next_fire_at"] = "9999-12-31T23:00:00+00:00"
    data["tasks"][1]["next_due_at"] = T0.isoformat()
    store.path.write_text(json.dumps(data))
    fired: list[str] = []

    async def fire(task: CronTask, occ: Occurrence) -> str:
        fired.append(task.name)
        return "turn"

    report = await Scheduler(store, fire=fire, clock=lambda: T0 + timedelta(hours=1)).tick()
    assert fired == ["good"]
    assert report.errors and bad.id in report.errors[0] and "OverflowError" in report.errors[0]
    state = store.read()
    assert state.get(bad.id).state == "error" and state.get(bad.id).occurrence == 0  # type: ignore[union-attr]
    assert state.get(good.id).occurrence == 1  # type: ignore[union-attr]
