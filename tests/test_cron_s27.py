"""crons.json tasks that a hand edit gave a lone surrogate (a `\\udc80` escape: valid JSON, but no
text UTF-8 can write back), and `cron list --agent` with an agent that does not exist.

Was: such a task was loaded as valid (only its prompt's check would have caught it, at an add), so
every later write of crons.json raised UnicodeEncodeError: each `cron add`/`disable` of *another*
task failed, the server's scheduler logged a traceback at each tick and fired nothing; `cron remove`
of it rewrote crons.json, then failed to write its `removed` record (exit 1, its run log lost). A
misspelt `--agent` in `cron list` printed "no cron tasks", exit 0. Real files, the real CLI
(CliRunner, in-process) and the real Scheduler."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, AgentDirectory, cron_group
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cron(*args: str, agents: AgentDirectory = ANY_AGENT) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=agents, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def add(name: str) -> None:
    code, _, err = cron("add", "--name", name, "--agent", "echo", "--every", "1m", "--prompt", f"do {name}")
    assert code == 0, err


def with_escape(home: Path, index: int, key: str, escaped: str) -> str:
    """Put `escaped` (JSON text, e.g. `"bad \\udc80"`) as task `index`'s `key`, by hand; its id."""
    path = home / "crons.json"
    data = json.loads(path.read_text())
    data["tasks"][index][key] = "PLACEHOLDER"
    path.write_text(json.dumps(data).replace('"PLACEHOLDER"', escaped))
    return str(data["tasks"][index]["id"])


@pytest.mark.parametrize(("key", "escaped"), [("prompt", '"bad \\udc80 one"'), ("colour", '"\\ud800"')])
def test_a_task_with_a_lone_surrogate_is_invalid_and_the_others_go_on(home: Path, key: str, escaped: str) -> None:
    add("good")
    add("bad")
    bad = with_escape(home, 1, key, escaped)
    code, out, err = cron("list", "--json")
    assert code == 0, err
    listed = {t["name"]: t for t in json.loads(out)}
    assert listed["bad"]["state"] == "invalid" and "lone surrogate" in listed["bad"]["problem"], listed["bad"]
    assert listed["good"]["state"] != "invalid"

    code, _, err = cron("disable", "good")  # a write of the whole file, the bad task in it
    assert code == 0, err
    add("other")
    assert escaped in (home / "crons.json").read_text()  # kept as the hand edit wrote it

    code, out, err = cron("remove", "bad")
    assert code == 0, err
    record = json.loads((home / "cron-runs" / f"{bad}.jsonl").read_text().splitlines()[-1])
    assert record["event"] == "removed"
    code, out, err = cron("logs", "bad")
    assert code == 0 and "removed" in out, (out, err)
    assert sorted(t["name"] for t in json.loads((home / "crons.json").read_text())["tasks"]) == ["good", "other"]


async def test_the_scheduler_fires_the_other_tasks_beside_such_a_task(home: Path) -> None:
    add("good")
    add("bad")
    with_escape(home, 1, "prompt", '"\\udfff"')
    fired: list[str] = []

    async def fire(task: CronTask, occ: Occurrence) -> str:
        fired.append(task.name)
        return f"turn_{task.name}"

    s = Scheduler(home, fire=fire, clock=lambda: datetime.now(UTC) + timedelta(minutes=3))
    try:
        report = await s.tick()
        assert report.errors == [] and fired == ["good"], (report, fired)
    finally:
        await s.close()
    assert [t.name for t in CronStore(home).read().tasks] == ["good"]


def test_list_by_an_agent_that_does_not_exist_is_an_error(home: Path) -> None:
    known = AgentDirectory(lambda cfg, a: a if a == "echo" else (_ for _ in ()).throw(LookupError(a)), lambda cfg: {})
    add("good")
    code, out, err = cron("list", "--agent", "typo_agent", agents=known)
    assert code == 2 and "no agent" in err and "typo_agent" in err, (code, out, err)
    code, out, err = cron("list", "--agent", "echo", agents=known)
    assert code == 0 and "good" in out, err
