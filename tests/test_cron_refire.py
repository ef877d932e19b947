"""A run claimed before a crash is never submitted again after a restart, however old the claim.

The kernel purges idempotency keys older than 48 h at every start, so "its key is not in the store"
stops meaning "it never reached the kernel" for an old claim. Real `serve` processes on one home
(SQLite on disk): the first fires a task and is killed with SIGKILL; the home is then aged by 49 h
(the key's row and the claim, as the calendar would); a second `serve` takes the lease over from
the dead one and must resolve the claim to its turn (through the run log) or record it as missed
(when the log lost the `submitted` record too), never submit a second turn.
"""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appserver.runtime.kernel import IDEMPOTENCY_TTL_S
from cron.adapter import CLAIM_VERIFIABLE_S
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)
AGE = timedelta(hours=49)  # past the kernel's purge window


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def turns_with_key(home: Path, key: str) -> list[str]:
    conn = sqlite3.connect(home / "appserver.db")
    try:
        # `key` names the run (cron\x1f<task>:<n>); the key also carries its scheduled time (@ms)
        rows = conn.execute("SELECT id, idempotency_key FROM turns").fetchall()
        return [i for i, k in rows if k == key or (k or "").startswith(key + "@")]
    finally:
        conn.close()


def owner_pid(home: Path) -> int | None:
    try:
        owner = json.loads((home / "crons.json").read_text()).get("scheduler_owner")
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return None if owner is None else int(owner["pid"])


def age_home(home: Path, task_id: str) -> None:
    """What 49 h of downtime leave behind: the claim and the idempotency key both that old."""
    conn = sqlite3.connect(home / "appserver.db")
    try:
        with conn:
            conn.execute("UPDATE idempotency_keys SET created_at = created_at - ?", (AGE.total_seconds(),))
    finally:
        conn.close()
    data = json.loads((home / "crons.json").read_text())
    for task in data["tasks"]:
        if task["id"] == task_id:
            claimed = task["last_claimed"]
            for key in ("scheduled_for", "due_at", "fired_at", "claimed_at"):
                claimed[key] = (datetime.fromisoformat(claimed[key]) - AGE).isoformat()
    (home / "crons.json").write_text(json.dumps(data))


def fire_once_then_kill(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """A one-shot fired by a first server, which is then killed: (task id, turn id)."""
    add = run_cli(home, "cron", "add", "--name", "once", "--agent", "assistant",
                  "--in", "1s", "--exact", "--prompt", "wake up", "--json", env=env)  # fmt: skip
    assert add.code == 0, add.err
    task_id = json.loads(add.out)["id"]
    first = start_serve(home, env=env)
    try:
        wait_for(lambda: any(r["event"] == "outcome" for r in run_log(home, task_id)), 20, "the first run")
        turn_id = next(r["turn_id"] for r in run_log(home, task_id) if r["event"] == "submitted")
        key = f"cron\x1f{task_id}:1"
        wait_for(lambda: turns_with_key(home, key) == [turn_id], 10, "the turn to be committed")
    finally:
        first.kill()  # SIGKILL: the lease stays with the dead pid, the claim stays in crons.json
    assert owner_pid(home) == first.proc.pid
    return task_id, turn_id


def restart(home: Path, env: dict[str, str]) -> ServeProcess:
    second = start_serve(home, env=env)
    wait_for(lambda: owner_pid(home) == second.proc.pid, 20, "the restarted server to take the lease")
    time.sleep(1.0)  # several ticks: the take-over tick handled the dead scheduler's claims
    return second


def test_the_kernels_purge_window_is_longer_than_the_window_cron_trusts() -> None:
    assert CLAIM_VERIFIABLE_S < IDEMPOTENCY_TTL_S


def test_an_old_claim_that_reached_the_kernel_resolves_to_its_turn_after_a_restart(home: Path) -> None:
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id, turn_id = fire_once_then_kill(home, env)
    age_home(home, task_id)
    second = restart(home, env)
    try:
        assert turns_with_key(home, f"cron\x1f{task_id}:1") == [turn_id]  # one turn, never a second
        events = [r["event"] for r in run_log(home, task_id)]
        assert events == ["fired", "submitted", "outcome"], events
    finally:
        second.kill()


def test_an_old_claim_whose_submit_was_not_logged_is_recorded_missed_not_refired(home: Path) -> None:
    """The first server died after the kernel took the turn but before the run log said so; two
    days later nobody can look the key up any more: the run is recorded as missed, not refired."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id, turn_id = fire_once_then_kill(home, env)
    log_path = home / "cron-runs" / f"{task_id}.jsonl"
    log_path.write_text(log_path.read_text().splitlines()[0] + "\n")  # only `fired` reached the disk
    age_home(home, task_id)
    second = restart(home, env)
    try:
        assert turns_with_key(home, f"cron\x1f{task_id}:1") == [turn_id]
        records = run_log(home, task_id)
        assert [r["event"] for r in records] == ["fired", "missed"], records
        assert records[1]["occurrence"] == 1 and "not submitted again" in records[1]["reason"]
        logs = run_cli(home, "cron", "logs", "once", env=env)
        assert logs.code == 0 and "LOST" not in logs.out and "not submitted again" in logs.out, logs.out
    finally:
        second.kill()


def test_a_recent_claim_whose_submit_was_not_logged_resolves_by_its_key(home: Path) -> None:
    """Within the window the key still answers: the turn is found, the log completed, no refire."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id, turn_id = fire_once_then_kill(home, env)
    log_path = home / "cron-runs" / f"{task_id}.jsonl"
    log_path.write_text(log_path.read_text().splitlines()[0] + "\n")
    second = restart(home, env)
    try:
        assert turns_with_key(home, f"cron\x1f{task_id}:1") == [turn_id]
        recovered = [r for r in run_log(home, task_id) if r["event"] == "submitted"]
        assert len(recovered) == 1 and recovered[0]["turn_id"] == turn_id and recovered[0]["recovered"] is True
    finally:
        second.kill()


def test_a_claim_an_older_server_keyed_cron_colon_still_resolves_to_its_turn(home: Path) -> None:
    """Occurrence keys now carry a control character no protocol client can send (a local client
    that submitted `cron:<task>:<n>` to the task's conversation took the occurrence: it was acked
    as a duplicate and never ran). A claim an older server left under the old key still finds its
    turn after the upgrade: one turn, never a second."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id, turn_id = fire_once_then_kill(home, env)
    legacy = f"cron:{task_id}:1"
    with sqlite3.connect(home / "appserver.db") as c:  # as an older server wrote it
        c.execute("UPDATE turns SET idempotency_key = ? WHERE id = ?", (legacy, turn_id))
        c.execute("UPDATE idempotency_keys SET key = ? WHERE turn_id = ?", (legacy, turn_id))
    second = restart(home, env)
    try:
        assert turns_with_key(home, legacy) == [turn_id] and turns_with_key(home, f"cron\x1f{task_id}:1") == []
        events = [r["event"] for r in run_log(home, task_id)]
        assert events == ["fired", "submitted", "outcome"], events
    finally:
        second.kill()
