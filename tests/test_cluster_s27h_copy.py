"""`appserver store copy` of a SQLite home with damaged rows: one `error:` line naming the table
and the row, exit code 2, the target left empty. Before, a message or turn whose conversation is
gone and text in a number column ended in a psycopg traceback (exit 1), and a BLOB where the store
keeps text was copied as `\\x22…`, which is not the JSON it should hold."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from appserver.config import load_config
from appserver.store import AgentRecord, ConversationRecord, MessageRecord, SQLiteStore
from appserver.store.records import TurnRecord
from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database, truncate_all

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    with temp_database("s27h_copy") as url:
        yield url


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small home: an agent, a conversation, a turn and two messages."""
    home = tmp_path_factory.mktemp("source") / "home"
    db_path = load_config(home, environ={}).db_path

    async def fill() -> None:
        store = SQLiteStore(db_path)
        await store.open()
        try:
            await store.create_agent(AgentRecord(id="agt_1", name="one"))
            await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
            await store.accept_turn(TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", input={}))
            await store.append_messages(
                "conv_1", [MessageRecord(role="user", content="hi"), MessageRecord(role="assistant", content="yo")]
            )
        finally:
            await store.close()

    asyncio.run(fill())
    return home


def _damaged(source: Path, tmp_path: Path, statement: str) -> Path:
    home = tmp_path / "home"
    shutil.copytree(source, home)
    db = sqlite3.connect(home / "appserver.db")
    try:
        db.execute("PRAGMA foreign_keys = OFF")
        db.execute(statement)
        db.commit()
    finally:
        db.close()
    return home


def _rows(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT (SELECT count(*) FROM agents) + (SELECT count(*) FROM conversations) + "
            "(SELECT count(*) FROM messages) + (SELECT count(*) FROM turns)"
        ).fetchone()
        return int(row[0]) if row else -1


@pytest.mark.parametrize(
    ("statement", "table", "row", "says"),
    [
        (
            "INSERT INTO messages(conversation_id, role, content, created_at) VALUES ('conv_nope', 'user', '\"x\"', 1)",
            "messages",
            "the row with id 3",
            "(conversation_id)=(conv_nope) is not present",
        ),
        ("UPDATE turns SET conversation_id = 'conv_gone'", "turns", "the row with id turn_1", "conv_gone"),
        ("UPDATE messages SET created_at = 'yesterday' WHERE id = 2", "messages", "the row with id 2", "yesterday"),
        ("UPDATE messages SET content = x'22686922' WHERE id = 1", "messages", "the row with id 1", "binary data"),
    ],
    ids=["orphan-message", "orphan-turn", "text-in-a-number", "blob"],
)
def test_a_damaged_row_refuses_the_copy_naming_it(
    source: Path, tmp_path: Path, target: str, statement: str, table: str, row: str, says: str
) -> None:
    home = _damaged(source, tmp_path, statement)
    r = run_cli(home, "store", "copy", "--to", target, env=cli_env(home))
    assert r.code == 2, (r.code, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    assert f"the SQLite table {table} cannot be copied: {row}:" in lines[0], lines[0]
    assert says in lines[0] and "nothing was copied" in lines[0], lines[0]
    assert _rows(target) == 0  # the target is left empty


def test_the_undamaged_home_is_copied(source: Path, tmp_path: Path, target: str) -> None:
    home = tmp_path / "home"
    shutil.copytree(source, home)
    try:
        r = run_cli(home, "store", "copy", "--to", target, env=cli_env(home))
        assert r.code == 0, r.err
        assert _rows(target) == 1 + 1 + 2 + 1
    finally:
        truncate_all(target)
