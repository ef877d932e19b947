"""Preparing the PostgreSQL schema on a database that is not (only) appserver's.

Found from outside: `serve` on another application's database holding a `schema_version(version
integer)` at 1 took it for appserver's schema version 1, committed migration 2 (eight tables) and a
row 2 into the other application's table, then failed on a migration 3 that needs `conversations`
("relation "conversations" does not exist"). A Flyway-style `schema_version` failed with a null
`installed_rank`. Now the database is recognised first (appserver's exact `schema_version`, and the
tables its recorded version implies), a foreign one is refused in one line naming what was found,
and the migrations due run in one transaction: a refusal or a failure leaves the database as it was.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from urllib.parse import urlencode

import psycopg
import pytest
from psycopg import sql

from appserver.store.integrity import StoreOpenError
from appserver.store.pgschema import MIGRATIONS, expected_columns
from appserver.store.postgres import PostgresStore
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(120)

NEWEST = max(v for v, _ in MIGRATIONS)


def _state(url: str) -> tuple[list[tuple[str, str, str]], list[tuple[object, ...]]]:
    """Every relation of every user schema (tables, indexes, sequences, views) and what the
    `schema_version` of the search path's first schema holds: compared before and after a start."""
    with psycopg.connect(url) as c:
        rels = c.execute(
            "SELECT n.nspname::text, c.relname::text, c.relkind::text FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%' "
            "ORDER BY 1, 2"
        ).fetchall()
        present = c.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        rows = c.execute("SELECT * FROM schema_version ORDER BY 1").fetchall() if present and present[0] else []
    return [tuple(r) for r in rels], [tuple(r) for r in rows]  # type: ignore[misc]


def _serve_refused(home: Path, url: str) -> str:
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", env=cli_env(home, APPSERVER_STORE__URL=url), timeout=60)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1, r.err  # one line
    return lines[0]


def _at_version(url: str, upto: int) -> None:
    """A database as a server of schema version `upto` left it (its migrations, each recorded)."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version, script in MIGRATIONS:
            if version > upto:
                break
            c.execute(script)  # type: ignore[arg-type]
            c.execute("INSERT INTO schema_version VALUES (%s)", (version,))


async def _open_close(url: str) -> bool:
    store = PostgresStore(url)
    try:
        await store.open()
        return store.fresh
    finally:
        await store.close()


def _versions(url: str) -> list[int]:
    with psycopg.connect(url) as c:
        return [int(r[0]) for r in c.execute("SELECT version FROM schema_version ORDER BY 1").fetchall()]


# ------------------------------------------------------------------ another application's database


def test_serve_refuses_another_applications_schema_version_and_writes_nothing(tmp_path: Path) -> None:
    """The tester's case: a homegrown app's `schema_version(version integer)` at 1, and its
    `customers`. Before: eight tables committed, a row 2 in its schema_version, and the error
    `relation "conversations" does not exist`."""
    with temp_database("s21_foreign_int") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE schema_version (version integer)")
            c.execute("INSERT INTO schema_version VALUES (1)")
            c.execute("CREATE TABLE customers (id int)")
        before = _state(url)
        line = _serve_refused(tmp_path / "home", url)
        assert _state(url) == before  # no table of ours, no row 2 in theirs
        assert "holds a schema_version table that is not appserver's" in line, line
        assert "version integer" in line and "holding '1'" in line, line  # what was found
        assert "does not exist" not in line, line


def test_serve_refuses_a_flyway_schema_version_and_names_it(tmp_path: Path) -> None:
    """Flyway's history table (NOT NULL columns): refused for what it is, not with the insert's
    `null value in column "installed_rank"`."""
    with temp_database("s21_flyway") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(
                "CREATE TABLE schema_version (installed_rank INT NOT NULL PRIMARY KEY, version VARCHAR(50), "
                "description VARCHAR(200) NOT NULL, type VARCHAR(20) NOT NULL, script VARCHAR(1000) NOT NULL, "
                "checksum INT, installed_by VARCHAR(100) NOT NULL, installed_on TIMESTAMP NOT NULL DEFAULT now(), "
                "execution_time INT NOT NULL, success BOOLEAN NOT NULL)"
            )
            c.execute(
                "INSERT INTO schema_version VALUES (1, '1', 'init', 'SQL', 'V1__init.sql', 0, 'me', now(), 5, true)"
            )
        before = _state(url)
        line = _serve_refused(tmp_path / "home", url)
        assert _state(url) == before
        assert "not appserver's" in line and "installed_rank integer not null" in line, line
        assert "null value" not in line, line


async def test_a_schema_version_of_our_shape_over_a_schema_not_ours_is_refused() -> None:
    """The same shape as appserver's (`version integer not null`) at 1, but none of version 1's
    tables: recognised as not ours from the tables the recorded version implies."""
    with temp_database("s21_shape") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            c.execute("INSERT INTO schema_version VALUES (1)")
            c.execute("CREATE TABLE agents (id TEXT PRIMARY KEY)")  # theirs, with a name we use
        before = _state(url)
        with pytest.raises(StoreOpenError) as info:
            await _open_close(url)
        assert _state(url) == before
        msg = str(info.value)
        assert "says appserver schema version 1, but not that schema" in msg, msg
        assert "agents.name" in msg and "table conversations" in msg, msg


@pytest.mark.parametrize(
    ("ddl", "shown"),
    [
        ("CREATE TABLE schema_version (version INTEGER NOT NULL)", "empty"),  # no version recorded
        ("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (0)", "0"),
        ("CREATE VIEW schema_version AS SELECT 1 AS version", "view"),
    ],
)
async def test_other_schema_versions_that_are_not_ours_are_refused(ddl: str, shown: str) -> None:
    with temp_database("s21_other") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(ddl)  # type: ignore[arg-type]
        before = _state(url)
        with pytest.raises(StoreOpenError, match="not appserver's") as info:
            await _open_close(url)
        assert shown in str(info.value)
        assert _state(url) == before


async def test_a_foreign_agents_table_is_refused_and_left_as_it_was() -> None:
    with temp_database("s21_agents") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE agents (x INTEGER)")
            c.execute("CREATE TABLE customers (id int)")
        before = _state(url)
        with pytest.raises(StoreOpenError, match='relation "agents" already exists'):
            await _open_close(url)
        assert _state(url) == before


async def test_unrelated_tables_share_the_schema_and_a_schema_of_its_own_keeps_them_apart() -> None:
    """An unrelated table (`customers`) is no reason to refuse (databases that worked before still
    do); docs/scale-out.md recommends a database, or a schema (search_path), of appserver's own,
    which the URL's `options` selects, away from another application's `schema_version`."""
    with temp_database("s21_shared") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE customers (id int)")
        assert await _open_close(url) is True
        assert _versions(url) == [v for v, _ in MIGRATIONS]
    with temp_database("s21_own_schema") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE schema_version (version integer)")
            c.execute("INSERT INTO schema_version VALUES (1)")
            c.execute("CREATE SCHEMA appserver")
        own = url + "?" + urlencode({"options": "-csearch_path=appserver"})
        assert await _open_close(own) is True
        assert await _open_close(own) is False
        with psycopg.connect(url) as c:
            theirs = c.execute("SELECT version FROM public.schema_version").fetchall()
            ours = c.execute("SELECT version FROM appserver.schema_version ORDER BY 1").fetchall()
            agents = c.execute("SELECT to_regclass('appserver.agents'), to_regclass('public.agents')").fetchone()
        assert theirs == [(1,)]
        assert [r[0] for r in ours] == [v for v, _ in MIGRATIONS]
        assert agents == ("appserver.agents", None)


# ------------------------------------------------------------------ our own schemas, forward


@pytest.mark.parametrize("upto", range(1, NEWEST + 1))
async def test_our_older_schemas_migrate_forward_keeping_their_rows(upto: int) -> None:
    with temp_database(f"s21_v{upto}") as url:
        _at_version(url, upto)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("INSERT INTO agents(id, name, model, created_at, updated_at) VALUES ('agt_x', 'x', 'echo', 1, 1)")
        assert await _open_close(url) is False  # not a new database
        assert _versions(url) == [v for v, _ in MIGRATIONS]
        store = PostgresStore(url)
        await store.open()
        try:
            assert [a.id for a in await store.list_agents()] == ["agt_x"]
        finally:
            await store.close()


async def test_our_schema_missing_a_table_its_version_implies_is_refused_before_migrating() -> None:
    with temp_database("s21_damaged") as url:
        _at_version(url, 2)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("DROP TABLE cron_state")
        before = _state(url)
        with pytest.raises(StoreOpenError, match="lacks table cron_state"):
            await _open_close(url)
        assert _state(url) == before  # migrations 3 and 4 not applied


async def test_a_migration_failing_half_way_leaves_the_database_as_it_was() -> None:
    """A version 2 database with a view on `turns.revision` (a report someone added): migration 3
    (an index) succeeds, migration 4 (the column's type) fails. Before, migration 3 stayed
    committed; now neither is."""
    with temp_database("s21_halfway") as url:
        _at_version(url, 2)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE VIEW turn_revisions AS SELECT id, revision FROM turns")
        before = _state(url)
        with pytest.raises(StoreOpenError, match="cannot prepare the schema"):
            await _open_close(url)
        assert _state(url) == before
        assert _versions(url) == [1, 2]


def test_migrations_are_transactional_ddl() -> None:
    """They run in one transaction: a statement PostgreSQL refuses inside one can never be in them."""
    for version, script in MIGRATIONS:
        text = re.sub(r"--[^\n]*", "", script).upper()
        for word in ("CONCURRENTLY", "VACUUM", "ALTER SYSTEM", "CREATE DATABASE", "COMMIT", "BEGIN", "ROLLBACK"):
            assert not re.search(rf"\b{word}\b", text), (version, word)


def test_expected_columns_up_to_a_version() -> None:
    assert set(expected_columns(1)) == {
        "agents",
        "conversations",
        "turns",
        "messages",
        "pending_calls",
        "idempotency_keys",
        "responses",
        "http_idempotency",
        "history_points",
        "store_probe",
    }
    assert set(expected_columns(2)) - set(expected_columns(1)) == {
        "instances",
        "conversation_owners",
        "conversation_followers",
        "channel_owners",
        "cluster_mail",
        "tokens",
        "token_state",
        "cron_state",
    }
    assert expected_columns(NEWEST) == expected_columns()


# ------------------------------------------------------------------ starts at once


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
async def test_starts_at_once_make_one_schema(isolation: str) -> None:
    """Several first starts on a new database (and on a version 1 one): each migration applied
    once, one start finds the database new; also when the database's default isolation is
    REPEATABLE READ (the read after the lock must see what another start committed)."""
    require_postgres()
    for upto in (0, 1):
        with temp_database("s21_race") as url:
            with psycopg.connect(url, autocommit=True) as c:
                name = c.execute("SELECT current_database()").fetchone()
                assert name is not None
                c.execute(
                    sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
                        sql.Identifier(name[0]), sql.Literal(isolation)
                    )
                )
            if upto:
                _at_version(url, upto)
            fresh = await asyncio.gather(*(_open_close(url) for _ in range(6)))
            assert sum(fresh) == (1 if upto == 0 else 0), fresh
            assert _versions(url) == [v for v, _ in MIGRATIONS]
