"""Keyed copies of one `submit_input` to `new`, sent at once to two servers of one PostgreSQL
store, are one turn and leave no conversation of their own (docs/protocol.md, `submit_input`): the
server whose accept found the key taken had made a conversation for it first, and left it empty
(shown by `list_conversations`).

Two real `appserver serve` on a database of their own, real `websockets` clients. The copies are
made to meet deterministically: the test holds a lock on `idempotency_keys` (reads pass, inserts
wait) until both servers made their conversation and wait in their accept, then lets them go.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[ServeProcess]]]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("opencap_pg")
    with temp_database("opencap") as url:
        nodes: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                nodes.append(start_serve(home, env=cli_env(home, APPSERVER_STORE__URL=url)))
            yield url, nodes
        finally:
            for sp in nodes:
                sp.stop()
            for sp in nodes:
                sp.kill()


def _waiting_inserts(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE c.relname = 'idempotency_keys' AND NOT l.granted"
    ).fetchone()
    return int(row[0]) if row else 0


def _conversations(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT count(*) FROM conversations").fetchone()
    return int(row[0]) if row else 0


async def test_copies_to_new_on_two_servers_leave_one_conversation(cluster: tuple[str, list[ServeProcess]]) -> None:
    url, nodes = cluster
    socks = [await WS.open(sp.url, open_timeout=T) for sp in nodes]
    try:
        with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as locker:
            for round_ in range(2):
                before = _conversations(watch)
                frame = {
                    "type": "submit_input",
                    "agent": "assistant",
                    "conversation": "new",
                    "input": f"hello {round_}",
                    "idempotency_key": f"k-{uuid.uuid4().hex}",
                }
                locker.execute("LOCK TABLE idempotency_keys IN SHARE ROW EXCLUSIVE MODE")
                replies = [asyncio.create_task(ws.request(frame, T)) for ws in socks]
                deadline = time.monotonic() + T
                while _waiting_inserts(watch) < 2:  # both passed the key's look-up and wait to accept
                    assert time.monotonic() < deadline, "the two accepts never met at the lock"
                    await asyncio.sleep(0.02)
                assert _conversations(watch) == before + 2  # each made a conversation for its copy
                locker.rollback()  # the lock goes: one accept wins the key, the other finds it taken
                acks = await asyncio.gather(*replies)
                assert all(a["type"] == "ack" for a in acks), acks
                assert len({(a["turn_id"], a["conversation_id"]) for a in acks}) == 1, acks
                assert sorted(a["duplicate"] for a in acks) == [False, True], acks
                listed = await socks[0].request({"type": "list_conversations", "agent": "assistant"}, T)
                ids = [c["id"] for c in listed["conversations"]]
                assert len(ids) == round_ + 1 and ids[0] == acks[0]["conversation_id"], (ids, acks)
                assert _conversations(watch) == before + 1
                assert (await socks[0].terminal(acks[0]["turn_id"], T))["status"] == "completed"
    finally:
        for ws in socks:
            await ws.close()
