"""A WebSocket client that subscribes through one server of a cluster to a conversation another
server holds sees the very next turn, however soon it starts (docs/scale-out.md). The holder was
told of the new follower in the background, after the subscribe was acknowledged: a turn it began
and ended before it heard was never published to the follower, whose client waited for ever (a
loaded machine lost that race now and then; here the follower's database write is held up by a
lock the test takes, which makes it lose it every time).

Real PostgreSQL, two real `appserver serve` processes, real WebSocket clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

ROUNDS = 12


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ServeProcess], str]]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("follow")
    with temp_database("s25_follow") as url:
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home: Path = tmp / f"node{i}"
                env = cli_env(
                    home,
                    APPSERVER_STORE__URL=url,
                    APPSERVER_STORE__HEARTBEAT_S="0.2",
                    APPSERVER_STORE__INSTANCE_TIMEOUT_S="20",
                )
                started.append(start_serve(home, env=env))
            yield started, url
        finally:
            for sp in started:
                try:
                    sp.stop(timeout=10)
                except Exception:
                    pass
                sp.kill()


async def _first_turn(owner: WS) -> str:
    first = await owner.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hi"})
    await owner.terminal(first["turn_id"])  # held by node 0, which ran its turn
    return str(first["conversation_id"])


async def _next_turn_seen(owner: WS, viewer: WS, conv: str, text: str) -> None:
    nxt = await owner.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": text})
    snap = await viewer.terminal(nxt["turn_id"], timeout=10)
    assert snap["status"] == "completed", snap


async def test_the_next_turn_is_seen_though_the_holder_hears_late(nodes: tuple[list[ServeProcess], str]) -> None:
    servers, url = nodes
    owner = await WS.open(servers[0].url)
    viewer = await WS.open(servers[1].url)
    try:
        conv = await _first_turn(owner)
        async with await psycopg.AsyncConnection.connect(url) as db:
            await db.execute("LOCK TABLE conversation_followers IN ACCESS EXCLUSIVE MODE")  # until the commit

            async def release_soon() -> None:
                await asyncio.sleep(0.5)
                await db.commit()

            releasing = asyncio.create_task(release_soon())
            await viewer.request({"type": "subscribe", "conversation": conv}, 10)
            await _next_turn_seen(owner, viewer, conv, "right after the subscribe")
            await releasing
    finally:
        await viewer.close()
        await owner.close()


async def test_a_subscriber_through_another_server_sees_the_next_turn(
    nodes: tuple[list[ServeProcess], str],
) -> None:
    servers, _ = nodes
    owner = await WS.open(servers[0].url)
    try:
        for i in range(ROUNDS):
            conv = await _first_turn(owner)
            viewer = await WS.open(servers[1].url)
            try:
                await viewer.request({"type": "subscribe", "conversation": conv})
                await _next_turn_seen(owner, viewer, conv, f"again {i}")
            finally:
                await viewer.close()
    finally:
        await owner.close()
