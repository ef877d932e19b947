"""Two runs of a disabled task asked by hand while its conversation is busy both run (s39
re-attacker RC): whether a queued run asked by hand is dropped for the task being disabled was
judged by the task's `updated_at`, which the second claim moved past the first run (dropped), and
whose drop, a failure recorded, moved again past the second (dropped too). It is judged by when
the task was disabled (`disabled_at`) now."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import ROOT, run_cli
from tests.support.serve import ServeProcess
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen
from tests.test_cron_s39c import T, _busy, _run_log, _tasks, served

__all__ = ["served"]  # the fixture, shared with the module it comes from

pytestmark = pytest.mark.timeout(150)


def test_two_runs_asked_by_hand_of_a_disabled_task_both_run(
    home: Path, served: tuple[ServeProcess, dict[str, str]]
) -> None:
    sp, env = served
    conversation = asyncio.run(_busy(sp, "new", 80))  # 4 s of the echo model's words
    made = run_cli(
        home,
        "cron", "add", "--name", "t2", "--agent", "assistant", "--conversation", conversation,
        "--every", "1h", "--prompt", "TWICE-S39G", "--json",
        env=env,
    )  # fmt: skip
    assert made.code == 0, made.err
    task_id = str(made.json()["id"])
    assert run_cli(home, "cron", "disable", "t2", env=env).code == 0
    runs = []
    for n in (1, 2):
        runs.append(
            appserver_popen(
                ["cron", "run", "t2", "--timeout", "90"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        wait_for(
            lambda n=n: any(r["event"] == "submitted" and r["occurrence"] == n for r in _run_log(home, task_id)),
            T,
            f"run #{n} to queue",
        )
    outs = [p.communicate(timeout=120) for p in runs]
    # before: both exit 1, "cancelled: ... not started: the task was disabled before this run began"
    assert [p.returncode for p in runs] == [0, 0], outs
    ended = {r["occurrence"]: r["status"] for r in _run_log(home, task_id) if r["event"] == "outcome"}
    assert ended == {1: "completed", 2: "completed"}, ended
    assert not _tasks(home)["t2"]["enabled"]
