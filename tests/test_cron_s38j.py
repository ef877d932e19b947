"""Attacker D's cron finding 1 (session 38, fixer j), through the real CLI and a real `serve`.

A cron run queued behind a running turn when the server stopped (kill -9 or a clean stop), whose
task was then removed or disabled (`cron remove`/`disable` while no server ran), ran at the next
start: the kernel queued it again at once, the cut-off turn's end let the queue begin it, and
cron's outcome recovery, which drops such a run, came only after (on PostgreSQL it skipped a
removed task altogether). Now the kernel asks cron before it queues a turn it takes up from the
store (`Kernel.hold_back_queued`, wired by `build_services`): the run ends cancelled, never
started, on SQLite and PostgreSQL. A queued run of an enabled task still runs.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

PROMPT = "cronprompt-s38j"
BUSY = "/slow 2000"  # the echo provider's 2000 words, 50 ms apart: running through every step here
# Rows of one SQL query ("?" placeholders) against the store of the test's server.
Query = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def outcome_of(home: Path, task_id: str) -> dict[str, Any] | None:
    return next((r for r in run_log(home, task_id) if r["event"] == "outcome"), None)


def sqlite_query(home: Path) -> Query:
    def rows(sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
            return c.execute(sql, args).fetchall()

    return rows


def pg_query(url: str) -> Query:
    from tests.support.pg import query

    return lambda sql, args: query(url, sql.replace("?", "%s"), args)


def turn_state(rows: Query, turn_id: str) -> tuple[str, Any]:
    found = rows("SELECT status, started_at FROM turns WHERE id = ?", (turn_id,))
    return str(found[0][0]), found[0][1]


def cron_prompt_answered(rows: Query, conversation: str) -> bool:
    found = rows("SELECT content FROM messages WHERE conversation_id = ? AND role = 'assistant'", (conversation,))
    return any(PROMPT in str(r[0]) for r in found)


async def busy_conversation(sp: ServeProcess) -> str:
    """A new conversation whose turn runs on (its socket closed: a disconnect cancels nothing)."""
    ws = await WS.open(sp.url)
    try:
        ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": BUSY})
        assert ack["type"] == "ack", ack
        await ws.expect(lambda f: f.get("type") == "turn_updated" and f["snapshot"]["status"] == "running", 20)
    finally:
        await ws.close()
    return str(ack["conversation_id"])


def queued_cron_run(home: Path, conversation: str, env: dict[str, str], rows: Query) -> tuple[str, str]:
    """Task t1 fired into `conversation`, its run queued behind the running turn: (task, turn)."""
    made = run_cli(
        home,
        "cron", "add", "--name", "t1", "--agent", "assistant", "--conversation", conversation,
        "--in", "1s", "--exact", "--prompt", PROMPT, "--json",
        env=env,
    )  # fmt: skip
    assert made.code == 0, made.err
    task_id = str(made.json()["id"])
    submitted = wait_for(
        lambda: next((r for r in run_log(home, task_id) if r["event"] == "submitted"), None),
        30,
        "the task's run to be submitted",
    )
    turn_id = str(submitted["turn_id"])
    assert turn_state(rows, turn_id)[0] == "queued"
    return task_id, turn_id


@pytest.fixture
def servers() -> Iterator[list[ServeProcess]]:
    """The test's servers, each killed at its end."""
    started: list[ServeProcess] = []
    try:
        yield started
    finally:
        for sp in started:
            sp.kill()


def stop_with(sp: ServeProcess, how: str) -> None:
    if how == "kill -9":
        sp.kill()
    else:
        assert sp.stop(timeout=60) == 0


@pytest.mark.parametrize("how", ["kill -9", "clean stop"])
@pytest.mark.parametrize("command", ["remove", "disable"])
def test_a_run_queued_behind_a_cut_off_turn_never_starts_once_its_task_was_stopped(
    home: Path, servers: list[ServeProcess], command: str, how: str
) -> None:
    env = cli_env(home, APPSERVER_CRON__TICK_S="3600")  # no backstop tick: the restart alone decides
    rows = sqlite_query(home)
    servers.append(start_serve(home, env=env))
    conversation = asyncio.run(busy_conversation(servers[-1]))
    task_id, turn_id = queued_cron_run(home, conversation, env, rows)
    stop_with(servers[-1], how)
    done = run_cli(home, "cron", command, "t1", env=env)
    assert done.code == 0, (done.out, done.err)
    servers.append(start_serve(home, env=env))
    ended = wait_for(lambda: outcome_of(home, task_id), 20, "the dropped run's outcome")
    assert ended["status"] == "cancelled" and "not started" in ended["error"], ended
    assert turn_state(rows, turn_id) == ("cancelled", None)
    assert not cron_prompt_answered(rows, conversation)


def test_a_run_queued_behind_a_cut_off_turn_still_runs_when_its_task_is_enabled(
    home: Path, servers: list[ServeProcess]
) -> None:
    env = cli_env(home, APPSERVER_CRON__TICK_S="3600")
    rows = sqlite_query(home)
    servers.append(start_serve(home, env=env))
    conversation = asyncio.run(busy_conversation(servers[-1]))
    task_id, turn_id = queued_cron_run(home, conversation, env, rows)
    servers[-1].kill()
    servers.append(start_serve(home, env=env))
    ended = wait_for(lambda: outcome_of(home, task_id), 20, "the run's outcome")
    assert ended["status"] == "completed", ended
    assert turn_state(rows, turn_id)[0] == "completed"
    assert cron_prompt_answered(rows, conversation)


@pytest.mark.parametrize(("command", "how"), [("remove", "kill -9"), ("disable", "kill -9"), ("remove", "clean stop")])
def test_on_postgresql_a_run_queued_at_a_stop_never_starts_once_its_task_was_stopped(
    home: Path, servers: list[ServeProcess], command: str, how: str
) -> None:
    from tests.support.pg import temp_database

    with temp_database("cron_s38j") as url:
        # a killed server is judged gone (its conversations taken over) within a few seconds here
        env = cli_env(
            home,
            APPSERVER_STORE__URL=url,
            APPSERVER_STORE__HEARTBEAT_S="1",
            APPSERVER_STORE__INSTANCE_TIMEOUT_S="6",
            APPSERVER_CRON__TICK_S="3600",
        )
        rows = pg_query(url)
        servers.append(start_serve(home, env=env))
        conversation = asyncio.run(busy_conversation(servers[-1]))
        task_id, turn_id = queued_cron_run(home, conversation, env, rows)
        stop_with(servers[-1], how)
        # The command saves the change, then waits (15 s at most) for a server to drop the run:
        # the server starts as soon as the change is saved, as an operator's restart would.
        with appserver_popen(
            ["cron", command, "t1"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as cmd:
            wait_for(lambda: task_stopped(rows, task_id, command), 30, f"cron {command} to be saved")
            servers.append(start_serve(home, env=env))
            wait_for(lambda: turn_state(rows, turn_id)[0] != "queued", 30, "the queued run to be taken up")
            cmd.communicate(timeout=30)
        assert turn_state(rows, turn_id) == ("cancelled", None)
        assert not cron_prompt_answered(rows, conversation)
        if how == "clean stop":  # taken up at the start, before the outcome recovery: which records it
            ended = wait_for(lambda: outcome_of(home, task_id), 20, "the dropped run's outcome")
            assert ended["status"] == "cancelled" and "not started" in ended["error"], ended
        servers[-1].kill()  # before its database is dropped


def task_stopped(rows: Query, task_id: str, command: str) -> bool:
    """Does the database's crons.json document say task `task_id` is removed (or disabled)?"""
    (doc,) = rows("SELECT doc FROM cron_state", ())[0]
    task = next((t for t in json.loads(doc)["tasks"] if t["id"] == task_id), None)
    return task is None if command == "remove" else task is not None and not task.get("enabled", True)
