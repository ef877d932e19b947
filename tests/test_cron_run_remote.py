"""`appserver cron run` beside a live server goes through the /ws `cron_run` frame (issue 5, issue 6
check 4 via the server): the serve process runs the turn, the run log holds fire and outcome, and the
frame needs the `admin` scope."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.ws import WS


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def turn_owner(home: Path, turn_id: str) -> str:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        return str(c.execute("SELECT owner FROM turns WHERE id=?", (turn_id,)).fetchone()[0])


def test_cron_run_goes_through_the_live_server(home: Path) -> None:
    env = cli_env(home)
    add = run_cli(home, "cron", "add", "--name", "brief", "--agent", "assistant", "--cron", "0 8 * * *",
                  "--tz", "Europe/Paris", "--prompt", "morning brief", "--json", env=env)  # fmt: skip
    assert add.code == 0, add.err
    task_id = json.loads(add.out)["id"]
    made_admin = run_cli(home, "token", "create", "--name", "ops", "--scopes", "ws,admin", "--json", env=env)
    made_plain = run_cli(home, "token", "create", "--name", "app", "--scopes", "ws", "--json", env=env)
    admin, plain = made_admin.json()["token"], made_plain.json()["token"]
    sp = start_serve(home, "--auth", "token", env=env)
    try:
        server = json.loads((home / "server.json").read_text())

        # without the admin scope: refused, and nothing was claimed
        r = run_cli(home, "cron", "run", "brief", env=cli_env(home, APPSERVER_TOKEN=plain))
        assert r.code == 2 and "admin" in r.err, (r.code, r.err)
        assert run_log(home, task_id) == []
        # an unknown task is a usage error, named by the server
        r = run_cli(home, "cron", "run", "nope", env=cli_env(home, APPSERVER_TOKEN=admin))
        assert r.code == 2 and "no cron task 'nope'" in r.err, (r.code, r.err)

        r = run_cli(home, "cron", "run", "brief", "--json", env=cli_env(home, APPSERVER_TOKEN=admin))
        assert r.code == 0, r.err
        out = r.json()
        assert out["server"] == sp.url and out["outcome"] == "completed"
        assert out["task"]["id"] == task_id and out["occurrence"]["manual"] is True
        text = "".join(b.get("text") or "" for b in out["snapshot"]["blocks"] if b["type"] == "text")
        for needle in ("brief", "Scheduled for", "Current time", "Europe/Paris", "morning brief"):
            assert needle in text, needle
        # the serve process ran the turn (the CLI process opened no kernel)
        assert turn_owner(home, out["turn_id"]) == server["identity"]

        # the run log: fired, submitted, then (written by the server when the turn ended) outcome
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "outcome" not in [x["event"] for x in run_log(home, task_id)]:
            time.sleep(0.05)
        events = [(x["event"], x.get("occurrence")) for x in run_log(home, task_id)]
        assert events == [("fired", 1), ("submitted", 1), ("outcome", 1)], events
        assert run_log(home, task_id)[-1]["status"] == "completed"
        assert run_log(home, task_id)[-1]["turn_id"] == out["turn_id"]

        # and the server's history has the cron_prompt message of that turn
        async def history() -> list[dict[str, Any]]:
            ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {admin}"})
            try:
                conv = out["snapshot"]["conversation_id"]
                return (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
            finally:
                await ws.close()

        messages = asyncio.run(history())
        user = [m for m in messages if m["role"] == "user"]
        assert len(user) == 1 and user[0]["turn_id"] == out["turn_id"]
        assert user[0]["source"]["kind"] == "cron_prompt" and user[0]["source"]["manual"] is True
    finally:
        assert sp.stop() == 0
