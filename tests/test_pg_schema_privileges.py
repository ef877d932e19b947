"""Preparing the PostgreSQL schema issues DDL only when a migration is due: a role with only data
permissions (USAGE on the schema, DML on the tables) runs a server on a current schema, and a
refused start on a foreign database leaves it as it was."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from appserver.config import load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.integrity import StoreOpenError
from appserver.store.pgschema import MIGRATIONS
from appserver.store.postgres import PostgresStore
from tests.support.pg import ADMIN_URL, temp_database

pytestmark = pytest.mark.timeout(60)


def _as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"{role}@{parts.hostname}:{parts.port or 5432}", parts.path, "", ""))


def _tables(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1").fetchall()
    return [r[0] for r in rows]


@pytest.fixture
def data_only_role() -> Iterator[str]:
    """A login role of its own (roles are cluster-wide), dropped after the test's database."""
    role = f"appserver_test_dml_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _server(home: Path, url: str) -> Server:
    return Server(load_config(home, environ={"APPSERVER_STORE__URL": url, "APPSERVER_LIMITS__RETRY_BASE_MS": "5"}))


async def test_a_data_only_role_serves_on_a_current_schema(tmp_path: Path, data_only_role: str) -> None:
    with temp_database("dml") as url:
        owner = _server(tmp_path / "owner", url)
        await owner.open()  # the owner makes the schema
        await owner.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            role = sql.Identifier(data_only_role)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
            conn.execute(
                sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}").format(role)
            )
            conn.execute(sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {}").format(role))
        server = _server(tmp_path / "dml", _as_role(url, data_only_role))
        await server.open(serve=True)  # as `serve` does: the cluster joined too
        try:
            sub = await server.kernel.submit(SubmitRequest(agent="assistant", input="hi", conversation="new"))
            assert (await sub.wait(10)).text() == "echo: hi"
        finally:
            await server.close()


async def test_a_refused_foreign_database_is_left_as_it_was() -> None:
    with temp_database("foreign") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE agents (x INTEGER)")  # another application's table
        store = PostgresStore(url)
        with pytest.raises(StoreOpenError, match='cannot prepare the schema: relation "agents" already exists'):
            await store.open()
        await store.close()
        assert _tables(url) == ["agents"]  # no schema_version left behind


async def test_concurrent_first_starts_migrate_once() -> None:
    """Each migration applied once (the lock), every start opens: the read before any DDL sees what
    a concurrent start committed while this one waited for the lock."""
    with temp_database("race") as url:
        stores = [PostgresStore(url) for _ in range(6)]
        await asyncio.gather(*(s.open() for s in stores))
        try:
            with psycopg.connect(url) as conn:
                versions = [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY 1").fetchall()]
            assert versions == [v for v, _ in MIGRATIONS]
        finally:
            for s in stores:
                await s.close()
