"""A newly installed CLI never upgrades a store under a live server of the older version.

An older `serve` still ran on the home when the user upgraded and typed `appserver agents list`:
the command opened appserver.db and migrated it to the new schema under the running server, whose
own CLI and restart were then refused ("database schema version 5 is newer than this appserver").
Now a command (not `serve`) that finds the store older than its code while a live server uses it
is refused with one line naming the server and saying to start the new `serve`; once the server
is stopped the same command upgrades the store, as on any stopped home. On PostgreSQL the live
servers are the cluster's instances; a new `serve` starting beside older ones (a rolling upgrade)
still upgrades the schema.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from appserver.store.migrations import MIGRATIONS
from appserver.store.pgschema import MIGRATIONS as PG_MIGRATIONS
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)

NEWEST = MIGRATIONS[-1][0]
PG_NEWEST = PG_MIGRATIONS[-1][0]


def _undo(script: str) -> list[str]:
    """Statements that take back what one migration script adds (newest first), so the store looks
    as the version before it left it. A migration of another kind: teach this function."""
    undo: list[str] = []
    for statement in re.sub(r"--[^\n]*", "", script).split(";"):
        text = " ".join(statement.split())
        if not text:
            continue
        if m := re.match(r"CREATE (?:UNIQUE )?INDEX (\w+)", text):
            undo.append(f"DROP INDEX {m[1]}")
        elif m := re.match(r"CREATE TABLE (\w+)", text):
            undo.append(f"DROP TABLE {m[1]}")
        elif m := re.match(r"ALTER TABLE (\w+) ADD COLUMN (\w+)", text):
            undo.append(f"ALTER TABLE {m[1]} DROP COLUMN {m[2]}")
        elif re.match(r"ALTER TABLE \w+ ALTER COLUMN \w+ TYPE", text):
            continue  # applying it again to the new type changes nothing
        elif m := re.match(r"DROP INDEX (\w+)", text):
            undo.append(_created(m[1]))
        elif re.match(r"UPDATE \w+ ", text):
            continue  # the backfill of a column the same migration adds: taken back with the column
        else:
            pytest.fail(f"_undo does not know how to take back {text!r}")
    return undo[::-1]


def _created(index: str) -> str:
    """The statement an earlier migration created `index` with: what takes back its drop."""
    for _, script in MIGRATIONS[:-1]:
        if m := re.search(rf"CREATE (?:UNIQUE )?INDEX {index} ON [^;]+", script):
            return m[0]
    pytest.fail(f"_undo finds no migration that created {index}")


def _sqlite_version(home: Path) -> int:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as db:
        return int(db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0])


def _make_sqlite_older(home: Path) -> None:
    """The home's store as the version before the newest migration left it."""
    db = sqlite3.connect(home / "appserver.db", isolation_level=None, timeout=10)
    try:
        for statement in _undo(MIGRATIONS[-1][1]):
            db.execute(statement)
        db.execute("DELETE FROM schema_version WHERE version = ?", (NEWEST,))
    finally:
        db.close()


def _refused_naming(result: object, pid: int) -> str:
    code, err = result.code, result.err  # type: ignore[attr-defined]
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, (code, err)
    line = lines[0]
    assert f"older than this appserver's ({NEWEST if 'appserver.db' in line else PG_NEWEST})" in line, line
    assert f"pid {pid}" in line and "appserver serve" in line, line
    return line


def test_a_command_does_not_upgrade_the_store_under_the_homes_live_server(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home) as sp:
        _make_sqlite_older(home)  # as an older server's store; that server still serving
        refused = run_cli(home, "agents", "list")
        line = _refused_naming(refused, sp.proc.pid)
        assert "server running on this home" in line, line
        assert _refused_naming(run_cli(home, "conversations", "list"), sp.proc.pid)
        assert _sqlite_version(home) == NEWEST - 1  # nothing changed under the server
    assert sp.proc.returncode is not None
    after = run_cli(home, "agents", "list")  # no server: the command upgrades, as on any stopped home
    assert after.code == 0 and "assistant" in after.out, after.err
    assert _sqlite_version(home) == NEWEST


def _older_tree(dest: Path) -> Path:
    """This repository as of the commit before the newest migration (git archive), or a skip
    when its history is not at hand (an exported tree, a shallow clone)."""
    first = next(line.strip() for line in MIGRATIONS[-1][1].splitlines() if line.strip() and "--" not in line)
    try:
        log = subprocess.run(
            ["git", "-C", str(ROOT), "log", "--format=%H", "-S", first, "--", "appserver/store/migrations.py"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", f"{log[-1]}^", "appserver", "cron", "gateway", "plugins"],
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError, IndexError) as exc:
        pytest.skip(f"the commit before migration {NEWEST} is not in reach of git: {exc}")
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
    return dest


def _older(tree: Path, home: Path, *args: str, **kw: object) -> subprocess.Popen[str]:
    env = {**cli_env(home), "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        [sys.executable, "-m", "appserver", *args], cwd=tree, env=env, text=True, start_new_session=True, **kw
    )  # type: ignore[call-overload]


def _older_cli(tree: Path, home: Path, *args: str) -> tuple[int, str]:
    proc = _older(tree, home, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def _wait_server_json(home: Path, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the older serve exited"
        try:
            if json.loads((home / "server.json").read_text()).get("pid") == proc.pid:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.02)
    pytest.fail("the older serve wrote no server.json in time")


def _tree_newest(tree: Path) -> int:
    """The newest SQLite migration of an older tree (one commit may have added several)."""
    probe = "from appserver.store.migrations import MIGRATIONS; print(MIGRATIONS[-1][0])"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        env={"PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_the_new_cli_leaves_a_live_older_server_its_schema(tmp_path: Path) -> None:
    tree = _older_tree(tmp_path / "older")
    older = _tree_newest(tree)
    assert older < NEWEST
    home = tmp_path / "home"
    code, out = _older_cli(tree, home, "agents", "list")  # the older appserver makes the home
    assert code == 0, out
    assert _sqlite_version(home) == older
    server = _older(
        tree, home, "serve", "--listen", "127.0.0.1:0", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_server_json(home, server)
        _refused_naming(run_cli(home, "agents", "list"), server.pid)
        assert _sqlite_version(home) == older
        code, out = _older_cli(tree, home, "agents", "list")  # the older version's own CLI still works
        assert code == 0 and "assistant" in out, out
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    after = run_cli(home, "agents", "list")
    assert after.code == 0 and "assistant" in after.out, after.err
    assert _sqlite_version(home) == NEWEST


def _pg_version(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row else 0


def _make_pg_older(url: str) -> None:
    import psycopg

    with psycopg.connect(url) as conn:  # one transaction
        for statement in _undo(PG_MIGRATIONS[-1][1]):
            conn.execute(statement)
        conn.execute("DELETE FROM schema_version WHERE version = %s", (PG_NEWEST,))


def test_a_command_does_not_upgrade_a_postgresql_schema_its_cluster_runs_on(tmp_path: Path) -> None:
    with temp_database("upgrade_s25") as url:
        homes = {name: tmp_path / name for name in ("a", "b", "c")}
        env = {name: cli_env(home, APPSERVER_STORE__URL=url) for name, home in homes.items()}
        with serving(homes["a"], env=env["a"]) as a:
            _make_pg_older(url)  # as the older servers of a cluster left it
            for args in (("agents", "list"), ("token", "list")):  # opens the store / only its schema
                line = _refused_naming(run_cli(homes["c"], *args, env=env["c"]), a.proc.pid)
                assert "live servers of its cluster use it" in line, line
            assert _pg_version(url) == PG_NEWEST - 1
            with serving(homes["b"], env=env["b"]):  # a rolling upgrade: a new server upgrades beside it
                assert _pg_version(url) == PG_NEWEST
                assert run_cli(homes["c"], "agents", "list", env=env["c"]).code == 0
        _make_pg_older(url)  # no server left on the database: a command upgrades it
        after = run_cli(homes["c"], "agents", "list", env=env["c"])
        assert after.code == 0 and "assistant" in after.out, after.err
        assert _pg_version(url) == PG_NEWEST
