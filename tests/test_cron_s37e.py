"""Attacker E's cron findings (session 37, fixer e), through the real CLI and a real `serve`.

F4. `cron add --tz localtime` / `posixrules` (and `TZ=` either) were accepted and stored as that
    name: a file of the tz database standing for another zone (`localtime` follows whatever the
    firing machine's /etc/localtime says then), not an IANA zone. Now refused as `right/UTC` is.
F5. `cron remove` / `disable` said done (exit 0) before the running scheduler dropped the task's
    queued run: an approval answered right after the command let the run start. Now the command
    says done once the run is dropped (or found started), naming it.
F6. A run queued behind an approval when the server stopped, whose task was then removed or
    disabled, ran after the restart: the restart followed it but never dropped it. Now the
    server drops it as it recovers it (`cancelled`, not started).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cron.schedule import ScheduleError, get_zone
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

PROMPT = "cronprompt-s37e"


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def outcome_of(home: Path, task_id: str) -> dict[str, Any] | None:
    return next((r for r in run_log(home, task_id) if r["event"] == "outcome"), None)


def cron_prompt_ran(home: Path, conversation: str) -> bool:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        rows = c.execute("SELECT content FROM messages WHERE conversation_id=?", (conversation,)).fetchall()
    return any(PROMPT in str(r[0]) for r in rows)


def turn_status(home: Path, turn_id: str) -> tuple[str, Any]:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        row = c.execute("SELECT status, started_at FROM turns WHERE id=?", (turn_id,)).fetchone()
    return str(row[0]), row[1]


@pytest.fixture
def ops(home: Path) -> Path:
    made = run_cli(home, "agents", "create", "--name", "ops", "--tool", "clock=ask")
    assert made.code == 0, made.err
    return home


async def blocked_conversation(sp: ServeProcess) -> tuple[WS, str, str]:
    """A conversation whose turn waits for an approval: (the socket, its id, the call id)."""
    ws = await WS.open(sp.url)
    ack = await ws.request({"type": "submit_input", "agent": "ops", "conversation": "new", "input": "/call clock {}"})
    assert ack["type"] == "ack", ack
    req = await ws.expect(lambda f: f.get("type") == "approval_request", 20)
    return ws, ack["conversation_id"], req["call_id"]


async def approve(ws: WS, conversation: str, call_id: str) -> None:
    decisions = [{"call_id": call_id, "decision": "approve"}]
    got = await ws.request({"type": "approval_response", "conversation": conversation, "decisions": decisions})
    assert got["type"] != "error", got


def queued_cron_run(home: Path, conversation: str) -> tuple[str, str]:
    """A task fired into `conversation` (its run submitted, queued behind the approval): its id
    and its run's turn."""
    made = run_cli(
        home,
        "cron", "add", "--name", "t1", "--agent", "ops", "--conversation", conversation,
        "--in", "1s", "--exact", "--prompt", PROMPT, "--json",
    )  # fmt: skip
    assert made.code == 0, made.err
    task_id = str(made.json()["id"])
    submitted = wait_for(
        lambda: next((r for r in run_log(home, task_id) if r["event"] == "submitted"), None),
        30,
        "the task's run to be submitted",
    )
    turn_id = str(submitted["turn_id"])
    assert turn_status(home, turn_id)[0] == "queued"
    return task_id, turn_id


@pytest.mark.parametrize("command", ["remove", "disable"])
def test_remove_and_disable_say_done_once_the_queued_run_is_dropped(ops: Path, command: str) -> None:
    home = ops
    with serving(home) as sp:

        async def case() -> tuple[Any, str, str, str]:
            ws, conversation, call_id = await blocked_conversation(sp)
            try:
                task_id, turn_id = await asyncio.to_thread(queued_cron_run, home, conversation)
                done = await asyncio.to_thread(run_cli, home, "cron", command, "t1")
                await approve(ws, conversation, call_id)  # right after the command: the queue moves on
                await ws.expect(
                    lambda f: f.get("type") == "turn_updated" and f["snapshot"]["status"] == "completed", 20
                )
            finally:
                await ws.close()
            return done, task_id, turn_id, conversation

        done, task_id, turn_id, conversation = asyncio.run(case())
        assert done.code == 0, (done.out, done.err)
        assert "its queued run #1 was dropped: not started" in done.out, done.out
        status, started_at = turn_status(home, turn_id)
        assert status == "cancelled" and started_at is None, (status, started_at)
        ended = wait_for(lambda: outcome_of(home, task_id), 20, "the run's outcome")
    assert ended["status"] == "cancelled" and "not started" in ended["error"], ended
    assert not cron_prompt_ran(home, conversation)


@pytest.mark.parametrize("command", ["remove", "disable"])
def test_a_run_queued_at_a_stop_is_dropped_after_the_restart_when_its_task_was_stopped(ops: Path, command: str) -> None:
    home = ops
    # no backstop tick during the test: the drop must come with the restart, not a minute later
    env = cli_env(home, APPSERVER_CRON__TICK_S="3600")
    sp = start_serve(home, env=env)
    try:

        async def before() -> tuple[str, str, str]:
            ws, conversation, _ = await blocked_conversation(sp)
            try:
                task_id, turn_id = await asyncio.to_thread(queued_cron_run, home, conversation)
            finally:
                await ws.close()
            return task_id, turn_id, conversation

        task_id, turn_id, conversation = asyncio.run(before())
        assert sp.stop() == 0
        done = run_cli(home, "cron", command, "t1", env=env)
        assert done.code == 0, done.err
        sp = start_serve(home, env=env)
        # the restart drops it without anything else happening: no answer needed to get there
        ended = wait_for(lambda: outcome_of(home, task_id), 10, "the dropped run's outcome")
        assert ended["status"] == "cancelled" and "not started" in ended["error"], ended
        assert turn_status(home, turn_id)[0] == "cancelled"

        async def after() -> None:
            ws = await WS.open(sp.url)
            try:
                state = await ws.request({"type": "subscribe", "conversation": conversation})
                call_id = state["pending_approvals"][0]["call_id"]
                await approve(ws, conversation, call_id)
                await ws.expect(
                    lambda f: f.get("type") == "turn_updated" and f["snapshot"]["status"] == "completed", 20
                )
            finally:
                await ws.close()

        asyncio.run(after())
        assert not cron_prompt_ran(home, conversation)
        assert [r["event"] for r in run_log(home, task_id)].count("outcome") == 1
    finally:
        sp.kill()


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "Factory"])
def test_a_zone_file_that_stands_for_another_zone_is_refused(home: Path, zone: str) -> None:
    with pytest.raises(ScheduleError, match="IANA zone name"):
        get_zone(zone)
    add = ("cron", "add", "--name", "t", "--agent", "assistant", "--cron", "0 9 * * *", "--prompt", "x")
    made = run_cli(home, *add, "--tz", zone)
    assert made.code == 1, (made.code, made.out, made.err)
    assert "IANA" in made.err and "Europe/Paris" in made.err, made.err
    from_env = run_cli(home, *add, env=cli_env(home, TZ=zone))
    assert from_env.code == 1, (from_env.code, from_env.out, from_env.err)
    assert f"TZ={zone!r}" in from_env.err and "--tz" in from_env.err, from_env.err
    listed = run_cli(home, "cron", "list", "--json")
    assert listed.code == 0 and listed.json() == [], listed.out
