"""Cron expressions croniter accepts but a schedule must not mean: `R` (a random value drawn anew at
every parse, so each restart and each host would fire at another time) and reversed ranges
(`5-1`, which croniter wraps around). Refused with a clear reason when added; a task that already
carries one becomes a visible error instead of firing at a random time."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, cron_group
from cron.schedule import ScheduleError, ScheduleSpec, normalize_cron
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("R * * * *", "random"),
        ("r 8 * * *", "random"),
        ("R(0-5) * * * *", "random"),
        ("0 R * * *", "random"),
        ("5-1 * * * *", "backwards"),
        ("0 23-1 * * *", "backwards"),
        ("0 0 31-1 * *", "backwards"),
        ("0 0 * dec-jan *", "backwards"),
        ("0 0 * 12-1 *", "backwards"),
        ("0 0 * * 5-1", "backwards"),
        ("0 0 * * sat-mon", "backwards"),
        ("10-5/2 * * * *", "backwards"),
        ("0,30-10 * * * *", "backwards"),
    ],
)
def test_random_values_and_reversed_ranges_are_refused(expr: str, why: str) -> None:
    with pytest.raises(ScheduleError, match=why) as err:
        normalize_cron(expr)
    assert repr(expr) in str(err.value)


@pytest.mark.parametrize(
    "expr",
    ["0 8 * * 1-5", "*/15 2 * * *", "0 0 * jan-mar *", "0 0 * * mon-fri", "0 0 * * 0-7", "1,2,3-5/2 * * * *",
     "0 0 L * *", "0 0 * * 5#3", "5-5 * * * *", "@daily", "0-59/90 * * * *"],
)  # fmt: skip
def test_ordinary_expressions_still_pass(expr: str) -> None:
    normalize_cron(expr)


@pytest.mark.parametrize("expr", ["R * * * *", "5-1 * * * *"])
def test_cron_add_refuses_them_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expr: str) -> None:
    monkeypatch.setenv("APPSERVER_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(
        cron_group, ["add", "--name", "x", "--agent", "echo", "--cron", expr, "--tz", "UTC", "--prompt", "p"],
        obj=ANY_AGENT,
    )  # fmt: skip
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1 and "invalid cron" in res.stderr
    assert not (tmp_path / "home" / "crons.json").exists()


async def test_a_stored_random_expression_is_an_error_not_a_random_fire(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home")
    task = make_task(name="r", agent="echo", schedule=ScheduleSpec("every", "1h", "UTC"), prompt="p", now=T0)
    store.add(task)
    data = json.loads(store.path.read_text())
    data["tasks"][0]["schedule"] = {"kind": "cron", "expr": "R * * * *", "tz": "UTC"}  # hand-edited
    data["tasks"][0]["next_fire_at"] = data["tasks"][0]["next_due_at"] = None
    store.path.write_text(json.dumps(data))
    fired: list[int] = []

    async def fire(t: CronTask, occ: Occurrence) -> str:
        fired.append(occ.number)
        return "turn"

    report = await Scheduler(store, fire=fire, clock=lambda: T0).tick()
    assert fired == [] and report.errors and "random" in report.errors[0]
    assert store.read().tasks[0].state == "error"
