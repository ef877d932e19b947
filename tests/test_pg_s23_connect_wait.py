"""A request during a database outage waits for the store's pool once, not once per write.

A request with an Idempotency-Key whose turn's commit found no connection within
`connect_timeout_s` then ended its key: that write waited for the pool as long again, for the same
outcome, so its 503 came after twice the timeout (and the commit itself waited twice when it was
queued behind a write, a draft's, that waited in vain). Now, while the database is unreachable, the
key's end is not tried (it is remembered and released once the database is back: `repair`), and a
write waits only what is left of the timeout since it was made. Real PostgreSQL; the outage is the
database refusing connections, every session ended.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from appserver.store.base import StoreUnavailable
from appserver.store.postgres import PostgresStore
from appserver.store.records import HttpIdempotency
from tests.support.pg import require_postgres, temp_database, url_for

pytestmark = pytest.mark.timeout(60)


@contextmanager
def _unreachable(url: str) -> Iterator[None]:
    """The database refuses connections, and every session of it is ended, until the block ends."""
    db = url.rsplit("/", 1)[1]
    with psycopg.connect(url_for("postgres"), autocommit=True) as c:
        c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
        try:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))
            yield
        finally:
            c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')


def _pool_requests(store: PostgresStore) -> int:
    """How many times the store has asked its pool for a connection."""
    return store.pool.get_stats().get("requests_num", 0)


async def _until_back(store: PostgresStore, within: float = 30.0) -> None:
    """Until a read gets a connection again (the pool reconnects with a backoff of its own)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await store.get_http_idempotency("s", "probe")
            return
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the database did not come back"
            await asyncio.sleep(0.2)


async def _scenario(url: str) -> None:
    store = PostgresStore(url, connect_timeout_s=1.0)
    await store.open()
    try:
        assert await store.claim_http_idempotency(HttpIdempotency("s", "key", "hash")) is None
        with _unreachable(url):
            with pytest.raises(StoreUnavailable):  # the request's first write (its turn's commit) waits
                await store.check_writable()
            asked = _pool_requests(store)
            with pytest.raises(StoreUnavailable):
                await store.drop_http_idempotency("s", "key")
            assert _pool_requests(store) == asked  # the key's end waited for no connection
        pending = await _pending_after(store)
        assert pending is not None and pending.state == "pending"  # not written: nothing was
        await store.repair()  # what the cluster runs after its next heartbeat
        assert await store.get_http_idempotency("s", "key") is None
        # Reached again: a key's end is written at once, as before the outage.
        assert await store.claim_http_idempotency(HttpIdempotency("s", "later", "hash")) is None
        await store.drop_http_idempotency("s", "later")
        assert await store.get_http_idempotency("s", "later") is None
    finally:
        await store.close()


async def _pending_after(store: PostgresStore) -> HttpIdempotency | None:
    await _until_back(store)
    return await store.get_http_idempotency("s", "key")


async def _queued_behind_a_wait(url: str) -> str:
    """The error of a write queued behind one that waits for a connection in vain."""
    store = PostgresStore(url, connect_timeout_s=2.0)
    await store.open()
    try:
        with _unreachable(url):
            first = asyncio.ensure_future(store.check_writable())
            while not store.pool.get_stats().get("requests_waiting", 0):  # the first write waits
                await asyncio.sleep(0.01)
            with pytest.raises(StoreUnavailable) as queued:
                await store.check_writable()
            with pytest.raises(StoreUnavailable):
                await first
        return str(queued.value)
    finally:
        await store.close()


def test_a_write_queued_behind_a_vain_wait_does_not_wait_as_long_again() -> None:
    require_postgres()
    with temp_database("s23_queued_wait") as url:
        error = asyncio.run(_queued_behind_a_wait(url))
    given = re.search(r"couldn't get a connection after ([0-9.]+) sec", error)
    assert given is not None, error
    assert float(given.group(1)) < 2.0, error  # what the pool was told to wait: the rest of the 2 s


def test_a_key_ended_while_the_database_is_unreachable_waits_for_no_second_connection() -> None:
    require_postgres()
    with temp_database("s23_connect_wait") as url:
        asyncio.run(_scenario(url))
