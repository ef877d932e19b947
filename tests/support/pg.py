"""A real PostgreSQL for the tests: a database of its own (unique name), dropped at the end.

The server is `APPSERVER_TEST_PG` (default postgresql://postgres@127.0.0.1:5432/postgres, the
maintenance database the test connects to in order to create and drop its own). Without a
reachable server the PostgreSQL tests skip with the reason, except in CI (`CI=true`), where they
fail: a CI run must never pass by skipping the backend it is meant to check.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

ADMIN_URL = os.environ.get("APPSERVER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
START_HINT = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def url_for(database: str, admin_url: str = ADMIN_URL) -> str:
    parts = urlsplit(admin_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def unavailable() -> str | None:
    """Why PostgreSQL cannot be used for the tests, or None when it can."""
    try:
        import psycopg
    except ImportError as exc:
        return f"the psycopg driver is not installed ({exc}); pip install -e '.[test]'"
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"no PostgreSQL at {ADMIN_URL} ({' '.join(str(exc).split())}); start it: {START_HINT}"
    return None


def require_postgres() -> None:
    """Skip (locally) or fail (CI) when PostgreSQL is not reachable."""
    reason = unavailable()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"PostgreSQL is required in CI: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL tests skipped: {reason}")


@contextmanager
def temp_database(label: str) -> Iterator[str]:
    """Create a database named after `label` plus a random suffix; yield its URL; drop it."""
    import psycopg
    from psycopg import sql

    require_postgres()
    # APPSERVER_TEST_DB_PREFIX: another prefix for the databases made (a shared machine's naming rules)
    prefix = os.environ.get("APPSERVER_TEST_DB_PREFIX") or "appserver_test"
    name = f"{prefix}_{label}_{uuid.uuid4().hex[:10]}".lower()
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield url_for(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def truncate_all(url: str) -> None:
    """Empty every data table (and restart the identities), keeping the schema: between tests."""
    import psycopg

    from appserver.store.pgschema import DATA_TABLES

    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('agents') IS NOT NULL").fetchone()
        if exists and exists[0]:
            conn.execute(f"TRUNCATE {', '.join(DATA_TABLES)} RESTART IDENTITY CASCADE")


def query(url: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """`sql` on its own autocommit connection to `url`: its rows (none for a statement)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(sql, args)
        return cur.fetchall() if cur.description else []
