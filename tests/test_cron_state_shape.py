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
