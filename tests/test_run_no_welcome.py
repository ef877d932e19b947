"""A server that takes the WebSocket connection but never answers `hello`.

`appserver run` said "the turn did not settle within N s": the client's wait for the welcome
(appserver/client/connection.py `connect`) raised a bare TimeoutError, which the CLI took for the
turn's. Now the client raises `ConnectError` `welcome_timeout` naming what happened, the CLI prints
it as one line with exit code 1, and a short `--timeout` bounds that wait too. A server that closes
the connection before its welcome is `Closed`, with its close code, not a traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from appserver.client import Closed, ConnectError, ProtocolClient
from appserver.serverinfo import write_server_json
from tests.support.cli import run_cli

pytestmark = pytest.mark.timeout(60)


async def _silent(ws: ServerConnection) -> None:
    """Reads what comes (hello included) and never says a word."""
    async for _ in ws:
        pass


async def _closes(ws: ServerConnection) -> None:
    await ws.recv()  # the hello
    await ws.close(4000, "not today")


@asynccontextmanager
async def ws_server(handler: Callable[[ServerConnection], Awaitable[Any]]) -> AsyncIterator[str]:
    async with serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"http://127.0.0.1:{port}"


async def test_the_client_says_the_welcome_never_came() -> None:
    async with ws_server(_silent) as url:
        started = time.monotonic()
        with pytest.raises(ConnectError) as info:
            await ProtocolClient.connect(url, open_timeout=0.3)
        assert time.monotonic() - started < 5
    assert info.value.code == "welcome_timeout", info.value
    assert "sent no welcome within 0.3 s" in info.value.message and url in info.value.message


async def test_a_server_that_closes_before_its_welcome_is_closed_not_a_traceback() -> None:
    async with ws_server(_closes) as url:
        with pytest.raises(Closed) as info:
            await ProtocolClient.connect(url, open_timeout=5)
    assert info.value.code == "connection_closed" and "before its welcome (4000 not today)" in info.value.message


async def test_appserver_run_says_no_welcome_came_not_that_the_turn_timed_out(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    async with ws_server(_silent) as url:
        # This process stands in for the home's server: server.json names it (and it is alive).
        write_server_json(home / "server.json", url, "none", home=str(home))
        started = time.monotonic()
        r = await asyncio.to_thread(run_cli, home, "run", "--timeout", "1", "--reconnect-wait", "0", "hi")
        took = time.monotonic() - started
    assert r.code == 1, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "accepted the WebSocket connection but sent no welcome within 1 s" in lines[0], lines
    assert "did not settle" not in r.err and "Traceback" not in r.err
    assert took < 15, took  # --timeout 1 bounds the wait for the welcome (not the 10 s default)
