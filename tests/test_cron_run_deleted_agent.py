"""`cron run` of a task whose agent was deleted is refused like `cron enable` refuses it: exit 2,
one line, and nothing consumed (no run number, no run-log record). In-process and through a live
server (the `cron_run` frame). Real CLI processes on a real home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)


def ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args)
    assert r.code == 0, (args, r.out, r.err)
    return r


def task_state(home: Path) -> dict[str, object]:
    return dict(json.loads((home / "crons.json").read_text())["tasks"][0])


@pytest.mark.parametrize("through_server", [False, True])
async def test_cron_run_of_a_task_whose_agent_was_deleted_consumes_nothing(
    tmp_path: Path, through_server: bool
) -> None:
    home = tmp_path / "home"
    ok(home, "agents", "create", "--name", "doomed")
    task_id = ok(home, "cron", "add", "--name", "t", "--agent", "doomed", "--every", "1h", "--prompt", "p",
                 "--json").json()["id"]  # fmt: skip
    ok(home, "agents", "delete", "doomed")
    if through_server:
        env = cli_env(home, APPSERVER_DISABLE_CRON="1")
        with serving(home, env=env) as sp:
            r = run_cli(home, "cron", "run", "t", env=env)
            ws = await WS.open(sp.url)  # a protocol client that asks the server directly
            try:
                answer = await ws.request({"type": "cron_run", "task": "t"})
            finally:
                await ws.close()
            assert answer["type"] == "error" and "deleted" in json.dumps(answer), answer
    else:
        r = run_cli(home, "cron", "run", "t")
    assert r.code == 2, (r.code, r.out, r.err)
    assert "agent" in r.err and "deleted" in r.err and r.err.count("\n") == 1, r.err
    assert task_state(home)["occurrence"] == 0  # no run number used up
    assert not (home / "cron-runs" / f"{task_id}.jsonl").exists()  # no fire_failed record
