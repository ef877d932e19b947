"""Cron wired to the kernel: `cron run` submits a cron_prompt turn; the `schedule` tool; the lease across serves."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.support.cli import cli_env
from tests.support.serve import start_serve


def test_cron_run_submits_a_cron_prompt_turn_and_logs_the_outcome(home: Path, cli) -> None:
    assert (
        cli(
            "cron",
            "add",
            "--name",
            "brief",
            "--agent",
            "assistant",
            "--cron",
            "0 8 * * *",
            "--tz",
            "Europe/Paris",
            "--prompt",
            "morning brief",
            "--conversation",
            "default",
        ).code
        == 0
    )
    r = cli("cron", "run", "brief", "--json")
    assert r.code == 0, r.err
    out = r.json()
    assert out["outcome"] == "completed"
    text = "".join(b.get("text", "") for b in out["snapshot"]["blocks"] if b["type"] == "text")
    for needle in ("brief", "Scheduled for", "Current time", "Europe/Paris", "morning brief"):
        assert needle in text, needle
    hist = cli("conversations", "history", out["snapshot"]["conversation_id"], "--json").json()
    assert hist[0]["role"] == "user" and hist[0]["source"]["kind"] == "cron_prompt"
    runs = [json.loads(line) for line in (home / "cron-runs" / f"{out['task']['id']}.jsonl").read_text().splitlines()]
    kinds = [r.get("event") or r.get("kind") or r.get("type") for r in runs]
    assert kinds.index("fired") < kinds.index("outcome"), kinds
    assert runs[-1]["status"] == "completed" and runs[-1]["turn_id"] == out["turn_id"]


def test_agent_schedule_tool_creates_a_task(cli) -> None:
    r = cli("run", "--json", '/call schedule {"action":"create","name":"remind","in":"2h","prompt":"stretch"}')
    assert r.code == 0, r.err
    assert "created task remind" in r.json()["text"]
    listed = cli("cron", "list", "--json").json()
    tasks = listed if isinstance(listed, list) else listed.get("tasks", listed)
    assert [t["name"] for t in tasks] == ["remind"]
    r = cli("run", "--json", '/call schedule {"action":"cancel","name":"remind"}')
    assert "cancelled task remind" in r.json()["text"]


def test_a_new_serve_takes_the_lease_from_a_killed_holder_and_fires(home: Path, cli) -> None:
    env = cli_env(home, APPSERVER_CRON_TICK_S="1")
    first = start_serve(home, env=env)
    second = None
    try:
        deadline = time.monotonic() + 10
        owner = None
        while time.monotonic() < deadline and not owner:
            if (home / "crons.json").exists():
                owner = json.loads((home / "crons.json").read_text()).get("scheduler_owner")
            time.sleep(0.1)
        assert owner and owner["pid"] == first.proc.pid, owner
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        assert (
            cli(
                "cron",
                "add",
                "--name",
                "soon",
                "--agent",
                "assistant",
                "--in",
                "2s",
                "--exact",
                "--prompt",
                "wake up",
                "--misfire",
                "run_once",
            ).code
            == 0
        )
        second = start_serve(home, env=env)
        task = json.loads((home / "crons.json").read_text())["tasks"]
        task_id = (task[0] if isinstance(task, list) else next(iter(task.values())))["id"]
        log = home / "cron-runs" / f"{task_id}.jsonl"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (log.exists() and '"outcome"' in log.read_text()):
            time.sleep(0.2)
        data = json.loads((home / "crons.json").read_text())
        assert data["scheduler_owner"]["pid"] == second.proc.pid
        assert '"outcome"' in log.read_text(), log.read_text() if log.exists() else "no run log"
        assert second.stop(signal.SIGTERM) == 0
        assert json.loads((home / "crons.json").read_text()).get("scheduler_owner") is None
    finally:
        for sp in (first, second):
            if sp is not None and sp.proc.poll() is None:
                sp.proc.kill()
