"""Servers of a cluster through a database that hangs (connections stay open, nothing answers),
and a store whose pool is still reconnecting after an outage. Real PostgreSQL, reached through a
TCP proxy of the test's own that stops forwarding (a hang) or ends every connection (a cut).

- A hang longer than `instance_timeout_s` fences nobody when it ends: not the statement a sweep
  sent as it began (run by the database when it comes back, when every heartbeat is stale), and
  not the server whose connections come back a moment before the others'. A server that really
  stopped answering is still judged gone afterwards.
- While the database hangs, a read is given up (503 `store_unavailable`) instead of waiting as
  long as the hang lasts.
- A write made right after an outage gets a connection although the pool still waits out its
  reconnect backoff (1, 2, 4, 8 s): a turn ending then was not saved, its whole answer lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from appserver.store.base import StoreUnavailable
from appserver.store.postgres import PostgresStore
from tests.support.pg import require_postgres, temp_database

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S, TIMEOUT_S = 0.25, 2.0  # [store] heartbeat_s and instance_timeout_s of the servers here
T = TypeVar("T")


class _Proxy:
    """A TCP proxy to the database in a thread of its own. `hang()`: nothing is forwarded either
    way and new connections are accepted but not answered (a database that hangs); `up()`: all of
    it goes through again; `cut()`: every connection ended and new ones refused."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "up"
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "the proxy did not start"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._flowing.set()
            server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, RuntimeError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    def _set(self, mode: str) -> None:
        def apply() -> None:
            self.mode = mode
            if mode == "hang":
                self._flowing.clear()
                return
            self._flowing.set()
            if mode == "cut":
                for w in list(self._writers):
                    w.transport.abort()
                self._writers.clear()

        self._loop.call_soon_threadsafe(apply)

    def hang(self) -> None:
        self._set("hang")

    def up(self) -> None:
        self._set("up")

    def cut(self) -> None:
        self._set("cut")

    def url(self, url: str) -> str:
        parts = urlsplit(url)
        user = parts.netloc.rpartition("@")[0]
        return urlunsplit((parts.scheme, f"{user}@127.0.0.1:{self.port}", parts.path, parts.query, parts.fragment))

    def close(self) -> None:
        """Every connection ended and every task of the proxy's loop finished before the loop is
        closed: a task left pending is destroyed when collected, in whatever test runs then, whose
        log it fails ("Task was destroyed but it is pending!")."""

        async def shutdown() -> None:
            self.mode = "cut"
            self._flowing.set()
            for w in list(self._writers):
                w.transport.abort()
            self._writers.clear()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextmanager
def _proxies(url: str, n: int) -> Iterator[list[_Proxy]]:
    parts = urlsplit(url)
    upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
    made = [_Proxy(upstream) for _ in range(n)]
    try:
        yield made
    finally:
        for p in made:
            p.close()


async def _server(url: str, **store: Any) -> PostgresStore:
    """A store joined to the cluster as `serve` joins it, with short heartbeats."""
    s = PostgresStore(url, **store)
    s.heartbeat_s, s.instance_timeout_s = HEARTBEAT_S, TIMEOUT_S
    await s.open()
    await s.claim_server()
    return s


def _instances(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as c:
        return {r[0] for r in c.execute("SELECT id FROM instances").fetchall()}


async def _until(check: Callable[[], Awaitable[T]], within: float, what: str) -> T:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def _id(store: PostgresStore) -> str:
    assert store.cluster is not None
    return store.cluster.instance_id


async def _hang_scenario(url: str, pa: _Proxy, pb: _Proxy) -> None:
    a = await _server(pa.url(url))
    b = await _server(pb.url(url))
    try:
        assert a.cluster is not None and b.cluster is not None
        # A few pooled connections, idle when the hang begins (as on a server in use)
        await asyncio.gather(*(a._rows("SELECT pg_sleep(0.2)") for _ in range(3)))
        await asyncio.sleep(4 * HEARTBEAT_S)
        both = {_id(a), _id(b)}
        assert await asyncio.to_thread(_instances, url) == both

        pa.hang()
        pb.hang()
        hung_at = time.monotonic()
        # A's sweep, as the database begins to hang: its statement waits in the hang, and runs
        # when the database answers again (every heartbeat is stale by then).
        sweep = asyncio.ensure_future(a.cluster.forget_gone())
        # A read while the database hangs is given up, however long the hang lasts (it lasts
        # until the read ended, and 20 s at most).
        read = asyncio.ensure_future(a.list_agents())
        await asyncio.wait({read}, timeout=20)
        assert read.done(), "a read waited as long as the database hung"
        assert isinstance(read.exception(), StoreUnavailable), read.exception()
        assert "the database answered neither it nor this server's heartbeat" in str(read.exception())

        await asyncio.sleep(max(0.0, hung_at + TIMEOUT_S + 1.5 - time.monotonic()))  # every heartbeat stale
        pa.up()  # A's connections come back a moment before B's
        await asyncio.wait({sweep}, timeout=20)
        judged: list[str] = []
        if sweep.done() and not sweep.cancelled() and sweep.exception() is None:
            judged += sweep.result()
        skew_end = time.monotonic() + 1.0
        while time.monotonic() < skew_end:  # A sweeps while B's connections still hang
            judged += await a.cluster.forget_gone()
            await asyncio.sleep(0.1)
        pb.up()
        for _ in range(10):
            judged += await a.cluster.forget_gone()
            judged += await b.cluster.forget_gone()
            await asyncio.sleep(0.1)
        assert judged == [], judged
        assert await asyncio.to_thread(_instances, url) == both
        assert not a.cluster.lost and not b.cluster.lost
        await _until(lambda: _ready(a, b), 10, "the servers did not take up work again")

        # B alone stops answering (its host gone, its connections open): A still judges it gone.
        pb.hang()
        gone = await _until(a.cluster.forget_gone, 20, "a server that stopped answering was never judged gone")
        assert gone == [_id(b)]
        assert await asyncio.to_thread(_instances, url) == {_id(a)}
    finally:
        pb.cut()  # B's session and pool end: its close does not wait for the hang
        await a.close()
        await b.close()


async def _ready(*stores: PostgresStore) -> bool:
    return all(s.cluster is not None and not s.cluster.fenced for s in stores)


def test_a_hang_of_the_whole_database_longer_than_the_timeout_fences_nobody() -> None:
    """Before, A's sweep statement sent as the hang began ran when it ended and deleted B's row
    (B fenced), and so did A's next sweeps until B's connections were back: A judged by heartbeats
    nobody could renew, since only an error of its session counted as being away."""
    require_postgres()
    with temp_database("s27h_hang") as url, _proxies(url, 2) as (pa, pb):
        asyncio.run(_hang_scenario(url, pa, pb))


async def _after_outage(url: str, proxy: _Proxy) -> None:
    store = PostgresStore(proxy.url(url), connect_timeout_s=1.0)
    await store.open()
    try:
        assert await store.check_writable()
        proxy.cut()
        cut_at = time.monotonic()
        with pytest.raises(StoreUnavailable):  # found no connection: the pool reconnects on a backoff
            await store.check_writable()
        # Its attempts (about 0, 1 and 3 s after the first failure, as the cut is found) all fail;
        # the next comes about 7 s after (6.3 s at the earliest: 10 % jitter). A write made in that
        # gap while the database is still away, and the database back before that write's
        # connect_timeout_s (1 s) ran out, well before the pool's next attempt: it is written.
        await asyncio.sleep(max(0.0, cut_at + 3.6 - time.monotonic()))
        write = asyncio.ensure_future(store.check_writable())
        await asyncio.sleep(0.4)
        proxy.up()
        assert await write
        assert await store.check_writable()  # and the next one
    finally:
        await store.close()


def test_a_write_made_as_the_database_comes_back_is_written_while_the_pool_still_reconnects() -> None:
    """Before, the write waited for the pool alone, whose next reconnect came after the write's
    connect_timeout_s: `no connection to write on within 1 s ([store] connect_timeout_s)`."""
    require_postgres()
    with temp_database("s27h_pool_backoff") as url, _proxies(url, 1) as (proxy,):
        asyncio.run(_after_outage(url, proxy))
