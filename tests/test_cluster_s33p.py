"""A hang of the whole database beside servers of mixed timings, with real PostgreSQL and real
`serve` processes, each reaching the database through a TCP proxy of the test's own that can
stop forwarding (a hang: connections open, nothing answered).

- A server with a long timeout stopped trusting its own view only after half of its own timeout
  (5 s here), while it judges a quick peer by the peer's 1.5 s: a 3 s hang of the whole database
  made it judge the healthy quick peer gone when it ended, and the peer was fenced for good.
- It still judges the quick peer gone within that peer's timeout and a few heartbeats once it
  really stops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.support.pg import ADMIN_URL, query, temp_database
from tests.support.serve import killed_at_exit, log_so_far, ready_status, serve_with_timings
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(90)


class _FreezableProxy:
    """A TCP proxy to PostgreSQL in a thread of its own; `freeze()` stops forwarding either way
    (sockets stay open), `thaw()` lets everything through again."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
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
        try:
            up = urlsplit(ADMIN_URL)
            up_reader, up_writer = await asyncio.open_connection(up.hostname or "127.0.0.1", up.port or 5432)
        except OSError:
            writer.transport.abort()
            return
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
            writer.transport.abort()

    def freeze(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def thaw(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    def url(self, url: str) -> str:
        parts = urlsplit(url)
        user = parts.netloc.rpartition("@")[0]
        return urlunsplit((parts.scheme, f"{user}@127.0.0.1:{self.port}", parts.path, parts.query, parts.fragment))

    def close(self) -> None:
        self.thaw()
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_a_hang_of_the_whole_database_fences_no_quick_peer_and_a_dead_one_is_still_judged_gone(
    tmp_path: Path,
) -> None:
    slow_proxy, quick_proxy = _FreezableProxy(), _FreezableProxy()
    try:
        with temp_database("s33p_hang") as url, killed_at_exit() as nodes:
            slow = serve_with_timings(tmp_path / "slow", slow_proxy.url(url), 1, 10)
            nodes.append(slow)
            quick = serve_with_timings(tmp_path / "quick", quick_proxy.url(url), 0.3, 1.5)
            nodes.append(quick)
            ids = [r[0] for r in query(url, "SELECT id FROM instances ORDER BY started_at")]
            assert len(ids) == 2
            time.sleep(1.5)  # each has seen the other at a heartbeat
            slow_proxy.freeze()
            quick_proxy.freeze()
            time.sleep(3)  # past the quick one's timeout, short of half the slow one's
            slow_proxy.thaw()  # the slow one's connections come back a moment first
            time.sleep(0.5)
            quick_proxy.thaw()
            assert eventually(lambda: ready_status(slow) == 200 and ready_status(quick) == 200, 10), log_so_far(quick)
            time.sleep(3)  # the slow one's sweeps after the hang
            assert sorted(r[0] for r in query(url, "SELECT id FROM instances")) == sorted(ids), log_so_far(slow)
            assert "is gone" not in log_so_far(slow), log_so_far(slow)
            assert "judged gone" not in log_so_far(quick), log_so_far(quick)
            assert ready_status(quick) == 200, log_so_far(quick)

            # A quick peer that really stops is judged gone by the slow one within its own timeout
            # (1.5 s) and a few heartbeats, though the slow one renews its own only every second.
            quick.kill()
            assert eventually(lambda: len(query(url, "SELECT id FROM instances")) == 1, 5), log_so_far(slow)
            assert ready_status(slow) == 200, log_so_far(slow)
    finally:
        slow_proxy.close()
        quick_proxy.close()
