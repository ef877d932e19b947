"""A JSON cell of the store that is no JSON, or not of its column's shape (session 25): real SQLite
homes made by the real CLI, cells damaged with sqlite3, then the real CLI and a real `serve`.

As for stored text that is no UTF-8 (tests/test_state_fixes_s19.py): the damage is said in one line
naming the table, the row and the column and saying to restore the store, /readyz `store` fails, and
what holds the cell stays usable (was: a JSONDecodeError traceback from `agents list`,
`conversations list/show/history` and `run`, one conversation's metadata breaking the list of all,
and `serve` not starting over one agent's row or a crashed turn's usage). A table missing a column
is refused naming it (was: an IndexError traceback).
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import serving
from tests.support.state import check, one_error_line, serve_refused, wait_ready
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(60)


def _sql(home: Path, statement: str, *params: object) -> None:
    with contextlib.closing(sqlite3.connect(home / "appserver.db")) as db, db:
        db.execute(statement, params)


def _one(home: Path, query: str, *params: object) -> object:
    with contextlib.closing(sqlite3.connect(home / "appserver.db")) as db:
        row = db.execute(query, params).fetchone()
    return row[0] if row else None


def _said(r: CLIResult, *names: str) -> None:
    """Exit 0, no traceback, and the damage said once: what is damaged, where, and what to do."""
    assert r.code == 0, r.err[-1500:]
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err[-1500:]
    lines = [line for line in r.err.splitlines() if "is damaged" in line]
    assert len(lines) == 1, r.err[-1500:]
    assert "restore it from a backup" in lines[0], lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_a_damaged_message_or_metadata_keeps_every_conversation_readable(home: Path) -> None:
    assert run_cli(home, "run", "--conversation", "new", "hi").code == 0
    assert run_cli(home, "run", "--conversation", "new", "other").code == 0
    ids = run_cli(home, "conversations", "list", "--json").json()
    first, second = (
        str(_one(home, "SELECT id FROM conversations ORDER BY created_at LIMIT 1 OFFSET ?", i)) for i in (0, 1)
    )
    assert {c["id"] for c in ids} == {first, second}
    mid = _one(home, "SELECT id FROM messages WHERE conversation_id=? AND role='assistant'", first)
    _sql(home, "UPDATE messages SET content=? WHERE id=?", '"echo: hi', mid)  # UTF-8, but no JSON any more
    _sql(home, "UPDATE conversations SET metadata=? WHERE id=?", '{"x":1', second)

    history = run_cli(home, "conversations", "history", first)
    _said(history, "messages row", f"row {mid}", "'content'")
    assert '"echo: hi' in history.out and "user: hi" in history.out  # shown as stored, the rest as it was

    listed = run_cli(home, "conversations", "list", "--json")
    _said(listed, "conversations row", second, "'metadata'")
    assert {c["id"] for c in listed.json()} == {first, second}  # one damaged row hides no other

    shown = run_cli(home, "conversations", "show", second)
    _said(shown, "'metadata'")
    assert second in shown.out

    again = run_cli(home, "run", "--conversation", first, "again")
    _said(again, "'content'")
    assert "echo: again" in again.out and "failed" not in again.err


def test_a_damaged_agent_row_lets_serve_start_and_fails_readyz(home: Path) -> None:
    assert run_cli(home, "agents", "create", "--name", "bob").code == 0
    _sql(home, "UPDATE agents SET params=? WHERE name='assistant'", '{"temperature":0.5')
    _sql(home, "UPDATE agents SET tools=? WHERE name='bob'", "[1]")  # valid JSON, wrong shape

    listed = run_cli(home, "agents", "list")
    _said(listed, "agents row", "'params'")
    assert "assistant" in listed.out and "bob" in listed.out

    r = run_cli(home, "run", "--agent", "bob", "hi")
    _said(r, "agents row")
    assert "echo: hi" in r.out
    # its lost policies may have denied a tool allowed by default: every tool is denied instead
    called = run_cli(home, "run", "--agent", "bob", "/call clock {}")
    assert "policy denies this tool" in called.out, called.out
    assert "*=deny" in run_cli(home, "agents", "show", "bob").out

    with serving(home) as sp:
        store = check(wait_ready(sp.url, 503), "store")
        assert store["status"] == "fail" and "agents row" in store["detail"], store
        r = run_cli(home, "run", "--agent", "bob", "again")
        assert r.code == 0 and "echo: again" in r.out, r.err[-1500:]
        stderr = sp.proc.stderr
        assert stderr is not None
        assert "Traceback" not in stderr.so_far()  # type: ignore[attr-defined]


def _crash_a_turn(home: Path) -> str:
    """A turn left running by a `run` killed with SIGKILL while its reply streams."""
    assert run_cli(home, "agents", "list").code == 0
    proc = appserver_popen(
        ["run", "/slow 100"], env=cli_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )
    try:
        deadline = time.monotonic() + 15
        while (turn := _one(home, "SELECT id FROM turns WHERE status='running'")) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no turn ran"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    return str(turn)


def test_a_crashed_turn_with_damaged_usage_does_not_stop_serve(home: Path) -> None:
    turn = _crash_a_turn(home)
    _sql(home, "UPDATE turns SET usage=? WHERE id=?", '{"in":1', turn)
    with serving(home) as sp:
        store = check(wait_ready(sp.url, 503), "store")
        assert "turns row" in store["detail"] and turn in store["detail"] and "'usage'" in store["detail"], store
        deadline = time.monotonic() + 10
        while _one(home, "SELECT status FROM turns WHERE id=?", turn) == "running":
            assert time.monotonic() < deadline, "the crashed turn was never settled"
            time.sleep(0.05)
        assert _one(home, "SELECT status FROM turns WHERE id=?", turn) == "interrupted"
        stderr = sp.proc.stderr
        assert stderr is not None
        log = stderr.so_far()  # type: ignore[attr-defined]
        assert "Traceback" not in log and "restore it from a backup" in log, log[-1500:]


def test_a_table_missing_a_column_is_refused_naming_it(home: Path) -> None:
    assert run_cli(home, "agents", "list").code == 0
    _sql(home, "ALTER TABLE agents DROP COLUMN params")
    line = one_error_line(run_cli(home, "agents", "list"))
    assert "agents table has no column 'params'" in line and "restore it from a backup" in line, line
    line = one_error_line(serve_refused(home))
    assert "agents table has no column 'params'" in line, line


def test_postgresql_reads_a_damaged_cell_as_sqlite_does(tmp_path: Path) -> None:
    """The PostgreSQL store converts its rows with the same code (rows.py): a damaged cell is said
    once, naming it, and the agent and the history stay readable."""
    import psycopg

    with temp_database("damaged_rows") as url:
        home = tmp_path / "home"
        env = cli_env(home, APPSERVER_STORE__URL=url)
        with serving(home, env=env):  # turns of a PostgreSQL store run in its servers
            assert run_cli(home, "run", "hi", env=env).code == 0
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE agents SET params = %s", ('{"temperature":0.5',))
            conn.execute("UPDATE messages SET content = %s WHERE role = 'assistant'", ('"echo: hi',))
            conv = conn.execute("SELECT id FROM conversations").fetchone()
        assert conv is not None
        listed = run_cli(home, "agents", "list", env=env)
        _said(listed, "PostgreSQL store", "agents row", "'params'")
        assert "assistant" in listed.out
        history = run_cli(home, "conversations", "history", str(conv[0]), env=env)
        _said(history, "messages row", "'content'")
        assert '"echo: hi' in history.out
