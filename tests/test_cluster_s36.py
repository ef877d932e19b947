"""An instance judged gone that comes back before a survivor's sweep deleted its row.

A's session was away longer than the grace, so B took one of A's conversations; A reconnected
before any sweep deleted its row. A learned it was judged gone (it runs nothing more), but its
heartbeat went on renewing the row: a live member that runs nothing, holding its other
conversations' leases and its channel accounts, which nobody took over until it was restarted
(tests/test_cluster_b.py met it as a second instance row now and then). It now leaves as a
stopping server does: its leases and row are deleted, and stay so.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

from appserver.store.postgres import PostgresStore
from tests.support.pg import require_postgres, temp_database

T = TypeVar("T")

HEARTBEAT_S, TIMEOUT_S = 0.25, 2.0  # [store] heartbeat_s and instance_timeout_s of the servers here


async def _server(url: str) -> PostgresStore:
    """A store joined to the cluster as `serve` joins it, with short heartbeats (no sweep runs:
    nobody deletes a gone instance's row here)."""
    s = PostgresStore(url)
    s.heartbeat_s, s.instance_timeout_s = HEARTBEAT_S, TIMEOUT_S
    await s.open()
    await s.claim_server()
    return s


def _one(url: str, query: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute(query, args).fetchall()


async def _until(check: Callable[[], Awaitable[T]], within: float, what: str) -> T:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_an_instance_judged_gone_leaves_its_row_and_leases_when_it_comes_back() -> None:
    require_postgres()
    role = f"gone_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with temp_database("cluster_gone") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"CREATE ROLE {role} LOGIN")
            c.execute(f"GRANT ALL ON SCHEMA public TO {role}")

        async def go() -> None:
            b = await _server(url)  # creates the schema
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
                c.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
            a = await _server(url.replace("postgres@", f"{role}@", 1))
            try:
                assert a.cluster is not None and b.cluster is not None
                a_id = a.cluster.instance_id
                assert (await a.cluster.take("conv_taken")).token
                assert (await a.cluster.take("conv_kept")).token
                assert await a.cluster.take_channel("telegram:main") is None
                # B cannot take A's conversation while A lives
                assert (await b.cluster.take("conv_taken")).holder == a_id

                with psycopg.connect(url, autocommit=True) as c:  # A is cut off
                    c.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                try:
                    # past A's grace B takes one of its conversations (no sweep deletes A's row)
                    async def taken() -> bool:
                        return (await b.cluster.take("conv_taken")).token is not None

                    await _until(taken, 10, "B never took the conversation of the cut-off A")
                finally:
                    with psycopg.connect(url, autocommit=True) as c:
                        c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")

                async def lost() -> bool:
                    return a.cluster is not None and a.cluster.lost

                await _until(lost, 10, "A never learned it was judged gone")

                def left() -> bool:
                    return (
                        not _one(url, "SELECT 1 FROM instances WHERE id = %s", a_id)
                        and not _one(url, "SELECT 1 FROM conversation_owners WHERE instance_id = %s", a_id)
                        and not _one(url, "SELECT 1 FROM channel_owners WHERE instance_id = %s", a_id)
                    )

                async def has_left() -> bool:
                    return await asyncio.to_thread(left)

                await _until(has_left, 5, f"A, judged gone, kept {_one(url, 'SELECT * FROM instances')}")
                # and stays gone: its heartbeat does not put its row back
                await asyncio.sleep(6 * HEARTBEAT_S)
                assert await asyncio.to_thread(left)
                assert [r[0] for r in await asyncio.to_thread(_one, url, "SELECT id FROM instances")] == [
                    b.cluster.instance_id
                ]
                # what A held is the others' at once: its other conversation, its channel account
                assert (await b.cluster.take("conv_kept")).token is not None
                assert await b.cluster.take_channel("telegram:main") is None
            finally:
                await a.close()
                await b.close()

        try:
            asyncio.run(go())
        finally:
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                c.execute(f"DROP OWNED BY {role}")
                c.execute(f"DROP ROLE {role}")
