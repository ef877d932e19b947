"""A turn whose stored input, client tools or options are damaged never runs with stand-ins; wrongly
typed agent params are dropped as damage; a home that is a loop of symbolic links is one error line
(session 25, second round). Real SQLite homes made by the real CLI, cells damaged with sqlite3
while the server is down, a real `serve` and real WebSocket and HTTP clients.

Was: a queued turn whose `client_tools` cell was damaged was requeued at the next start and ran with
none, so the model's call of the client's `clock` ran the server's `clock`; a damaged `input` was
sent to the model as its raw JSON text (and kept in history), damaged `options` dropped the
request's instructions; the same when a paused turn was resumed by an answer. `agents.params`
holding `{"context_window": [1]}` answered HTTP 500 (`TypeError: int() argument …`) with /readyz
ready. `APPSERVER_HOME` set to a loop of symbolic links gave a `RuntimeError: Symlink loop`
traceback, exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.state import check, one_error_line, wait_ready
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(60)

# a server of a cluster judged gone within seconds (defaults: 2 s and 30 s)
FAST_CLUSTER = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}
CLIENT_CLOCK = [{"name": "clock", "description": "the client's clock", "parameters": {"type": "object"}}]


def _sql(home: Path, statement: str, *params: object) -> None:
    with contextlib.closing(sqlite3.connect(home / "appserver.db")) as db, db:
        db.execute(statement, params)


def _rows(home: Path, query: str, *params: object) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(home / "appserver.db")) as db:
        return db.execute(query, params).fetchall()


def _settled(home: Path, turn: str, timeout: float = 10) -> tuple[str, str | None]:
    """The turn's status and error once it left queued/running/awaiting."""
    deadline = time.monotonic() + timeout
    while True:
        [(status, error)] = _rows(home, "SELECT status, error FROM turns WHERE id=?", turn)
        if status not in ("queued", "running", "awaiting"):
            return status, error
        assert time.monotonic() < deadline, f"turn {turn} still {status}"
        time.sleep(0.05)


def _log(sp: ServeProcess) -> str:
    assert sp.proc.stderr is not None
    return sp.proc.stderr.so_far()  # type: ignore[attr-defined,no-any-return]


def _queue_behind_a_slow_turn(sp: ServeProcess) -> str:
    """A `/call clock {}` input with the client's own `clock` tool, queued behind a slow turn."""

    async def go() -> str:
        ws = await WS.open(sp.url)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            first = await ws.request(
                {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 400"}
            )
            assert first["type"] == "ack", first
            queued = await ws.request(
                {
                    "type": "submit_input",
                    "agent": "assistant",
                    "conversation": conv,
                    "input": "/call clock {}",
                    "client_tools": CLIENT_CLOCK,
                }
            )
            assert queued["type"] == "ack" and queued["queue_position"] == 1, queued
            return str(queued["turn_id"])
        finally:
            await ws.close()

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("column", "damage", "words"),
    [
        ("client_tools", '"x"', "its stored client tools are damaged"),
        ("input", '{"content":', "its stored input is damaged"),
        ("options", "[1]", "its stored request options are damaged"),
    ],
)
def test_a_queued_turn_with_a_damaged_cell_fails_after_a_kill_instead_of_running(
    home: Path, column: str, damage: str, words: str
) -> None:
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        turn = _queue_behind_a_slow_turn(sp)
    finally:
        sp.kill()  # SIGKILL: the queued turn stays queued in the store
    assert _rows(home, "SELECT status FROM turns WHERE id=?", turn) == [("queued",)]
    _sql(home, f"UPDATE turns SET {column}=? WHERE id=?", damage, turn)

    with serving(home, env=env) as sp:
        status, error = _settled(home, turn)
        assert status == "failed", (status, error, _log(sp))
        assert error is not None and words in error and turn in error and "restore appserver.db" in error, error
        # nothing of it was written: no user message (the raw text), no call, no server clock output
        assert _rows(home, "SELECT role, content FROM messages WHERE turn_id=?", turn) == []
        assert _rows(home, "SELECT call_id FROM pending_calls WHERE turn_id=?", turn) == []
        store = check(wait_ready(sp.url, 503), "store")
        assert f"'{column}'" in store["detail"] and turn in store["detail"], store
        # the turn shows as today: its history and state read, its end says why
        shown = run_cli(home, "conversations", "history", "--json", _conversation(home, turn), env=env)
        assert shown.code == 0 and "Traceback" not in shown.err, shown.err[-1500:]
        assert "Traceback" not in _log(sp)


def _conversation(home: Path, turn: str) -> str:
    [(conv,)] = _rows(home, "SELECT conversation_id FROM turns WHERE id=?", turn)
    return str(conv)


def test_a_paused_turn_with_damaged_client_tools_fails_when_an_answer_resumes_it(home: Path) -> None:
    """Paused for an approval of the server's `clock`, with a client tool of its own; stopped;
    its client tools damaged; approved after the restart: it ends failed, the clock never runs,
    and its call gets one result so the history stays valid."""
    env = cli_env(home)
    made = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env)
    assert made.code == 0, made.err
    other = [{"name": "other", "description": "a client tool", "parameters": {"type": "object"}}]

    async def pause(sp: ServeProcess) -> tuple[str, str, str]:
        ws = await WS.open(sp.url)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
            await ws.request({"type": "subscribe", "conversation": conv})
            ack = await ws.request(
                {
                    "type": "submit_input",
                    "agent": "careful",
                    "conversation": conv,
                    "input": "/call clock {}",
                    "client_tools": other,
                }
            )
            request = await ws.expect(lambda f: f["type"] == "approval_request")
            return conv, str(ack["turn_id"]), str(request["call_id"])
        finally:
            await ws.close()

    with serving(home, env=env) as sp:
        conv, turn, call = asyncio.run(pause(sp))
    assert _rows(home, "SELECT status FROM turns WHERE id=?", turn) == [("awaiting",)]
    _sql(home, "UPDATE turns SET client_tools=? WHERE id=?", '{"name":', turn)

    async def approve(sp: ServeProcess) -> dict[str, Any]:
        ws = await WS.open(sp.url)
        try:
            await ws.request({"type": "subscribe", "conversation": conv})
            answered = await ws.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [{"call_id": call, "decision": "approve"}],
                }
            )
            assert answered["type"] == "ack", answered
            return await ws.terminal(turn)
        finally:
            await ws.close()

    with serving(home, env=env) as sp:
        snap = asyncio.run(approve(sp))
        assert snap["status"] == "failed", snap
        assert "its stored client tools are damaged" in snap["error"]["message"], snap
        status, _ = _settled(home, turn)
        assert status == "failed"
        results = _rows(home, "SELECT content, is_error FROM messages WHERE tool_call_id=?", call)
        assert len(results) == 1 and results[0][1] == 1, results  # one result: it never ran
        assert "stored data is damaged" in results[0][0], results
        assert "Traceback" not in _log(sp)


def test_a_queued_turn_with_damaged_client_tools_fails_when_a_cluster_takes_it_over(tmp_path: Path) -> None:
    """PostgreSQL: the server holding the queued turn is killed; the next server of the cluster
    takes its conversation over (requeues its queued turns) and ends the damaged one failed."""
    import psycopg

    with temp_database("damaged_turns") as url:
        home = tmp_path / "home"
        env = cli_env(home, APPSERVER_STORE__URL=url, **FAST_CLUSTER)
        sp = start_serve(home, env=env)
        try:
            turn = _queue_behind_a_slow_turn(sp)
        finally:
            sp.kill()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE turns SET client_tools = %s WHERE id = %s", ('"x"', turn))

        with serving(home, env=env) as sp, psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 20
            while True:
                row = conn.execute("SELECT status, error FROM turns WHERE id = %s", (turn,)).fetchone()
                assert row is not None
                if row[0] not in ("queued", "running"):
                    break
                assert time.monotonic() < deadline, f"turn {turn} still {row[0]}"
                time.sleep(0.1)
            assert row[0] == "failed", (row, _log(sp))
            assert "its stored client tools are damaged" in row[1] and "PostgreSQL database" in row[1], row
            kept = conn.execute("SELECT role, name FROM messages WHERE turn_id = %s", (turn,)).fetchall()
            assert kept == [], kept  # the server's clock never ran for it
            assert "Traceback" not in _log(sp)


def test_a_crashed_turn_with_a_damaged_input_keeps_no_raw_text_as_the_prompt(home: Path) -> None:
    """A turn left running by a killed `run`, its input damaged: settled interrupted at the next
    start, without its stored text written as the user's message."""
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    proc = appserver_popen(
        ["run", "/slow 100"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )
    try:
        deadline = time.monotonic() + 15
        while not (running := _rows(home, "SELECT id FROM turns WHERE status='running'")):
            assert time.monotonic() < deadline and proc.poll() is None, "no turn ran"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    [(turn,)] = running
    _sql(home, "UPDATE turns SET input=? WHERE id=?", '{"content":"/slow 100"', turn)
    with serving(home, env=env) as sp:
        status, _ = _settled(home, turn)
        assert status == "interrupted", (status, _log(sp))
        users = _rows(home, "SELECT content FROM messages WHERE turn_id=? AND role='user'", turn)
        assert users == [], users
        assert "Traceback" not in _log(sp)


@pytest.mark.parametrize(
    ("params", "bad"),
    [
        ('{"context_window":[1],"max_steps":3}', "context_window"),
        ('{"context_window":{"a":1},"max_steps":3}', "context_window"),
        ('{"max_tokens":"lots","max_steps":3}', "max_tokens"),
        ('{"temperature":"hot","max_steps":3}', "temperature"),
    ],
)
def test_a_wrongly_typed_agent_param_is_damage_never_a_500(home: Path, params: str, bad: str) -> None:
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    _sql(home, "UPDATE agents SET params=? WHERE name='assistant'", params)

    shown = run_cli(home, "agents", "show", "assistant", env=env)
    assert shown.code == 0 and "Traceback" not in shown.err, shown.err[-1500:]
    assert "max_steps=3" in shown.out and bad not in shown.out, shown.out  # only the bad key is left out
    said = [line for line in shown.err.splitlines() if "is damaged" in line]
    assert len(said) == 1 and "agents row" in said[0] and "'params'" in said[0] and repr(bad) in said[0], shown.err

    with serving(home, env=env) as sp:
        r = httpx.post(
            f"{sp.url}/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "echo: hi"
        store = check(wait_ready(sp.url, 503), "store")
        assert "'params'" in store["detail"] and repr(bad) in store["detail"], store
        assert "Traceback" not in _log(sp)


def test_a_setting_refused_by_the_command_is_still_refused(home: Path) -> None:
    """The table is shared: the command keeps its own messages."""
    r = run_cli(home, "agents", "update", "assistant", "--param", "context_window=12")
    assert r.code != 0 and "must be between 512 and 1e+08" in r.err, r.err
    r = run_cli(home, "agents", "update", "assistant", "--param", "max_tokens=lots")
    assert r.code != 0 and "expected an integer" in r.err, r.err
    ok = run_cli(home, "agents", "update", "assistant", "--param", "temperature=0.5", "--param", "reasoning=hidden")
    assert ok.code == 0, ok.err
    assert "temperature=0.5" in ok.out and "is damaged" not in ok.err, (ok.out, ok.err)


def test_a_home_that_is_a_loop_of_symbolic_links_is_one_error_line(tmp_path: Path) -> None:
    os.symlink("la", tmp_path / "lb")
    os.symlink("lb", tmp_path / "la")
    loop = tmp_path / "la"

    listed = one_error_line(run_cli(loop, "agents", "list", env=cli_env(loop)))
    assert str(loop) in listed and "symbolic link loop" in listed, listed

    under = loop / "sub"
    serve = one_error_line(run_cli(under, "--home", str(under), "serve", "--listen", "127.0.0.1:0", env=cli_env(under)))
    assert str(loop) in serve and "symbolic link loop" in serve, serve

    home = tmp_path / "h"
    home.mkdir()
    os.symlink("../la", home / "auth")
    tokens = one_error_line(run_cli(home, "token", "list", env=cli_env(home)))
    assert str(home / "auth") in tokens and "symbolic link loop" in tokens, tokens
