"""`list_conversations`: a page costs what the first one does, however deep it is (s31o).

An outside tester's non-admin token made 48,000 conversations of its own (title and metadata at
their maxima) and listed them from four sockets with limit=1, offset=47000: each page took
0.5–1.6 s on the event loop, because SQLite read every row before the page and sorted them (the
index (namespace, updated_at) lacked id), and another tenant's chats waited 10–25 s. Now the page's
keys come off a covering index in the list's whole order and only the page's rows are read;
`offset` is capped at 10,000 and `after` (the reply's `next`) pages on at the cost of the first page.

Real `serve --auth token` and WebSocket clients; the conversations are made through the store API
between two runs of the server (fast), then put in groups of three sharing one `updated_at`, so
pages end inside a group and the order's tie-break (id) is exercised.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appserver.auth import TokenStore
from appserver.store.records import ConversationRecord
from appserver.store.sqlite import SQLiteStore
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 10.0
MADE = 11_500  # about 10,500 the tenant's own (more than the offset cap), the rest another tenant's
# (every 16th) and unowned ones (the CLI's and cron's, namespace NULL: seen by admin only)


@dataclass
class World:
    sp: ServeProcess
    db: Path
    tenant: str
    other: str
    admin: str
    ns: str


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _ordered(db: Path, where: str = "", params: tuple[Any, ...] = ()) -> list[str]:
    """The ids in the list's documented order, read straight off the file."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(f"SELECT id FROM conversations{where} ORDER BY updated_at DESC, id", params).fetchall()
    return [r[0] for r in rows]


async def _fill(db: Path, ns: str, other_ns: str, agents: tuple[str, str]) -> None:
    store = SQLiteStore(db)
    await store.open()
    try:
        for i in range(MADE):
            owner: str | None = ns
            if i % 16 == 5:
                owner = other_ns
            elif i % 37 == 7:
                owner = None
            cid = f"conv_{hashlib.sha1(str(i).encode()).hexdigest()[:16]}"  # id order is not insertion order
            await store.create_conversation(
                ConversationRecord(id=cid, agent_id=agents[i % 3 == 2], namespace=owner, title=f"t{i}")
            )
        await store.list_conversations(limit=1)  # a read commits the queued inserts
    finally:
        await store.close()
    with sqlite3.connect(db, isolation_level=None) as conn:
        conn.execute("UPDATE conversations SET updated_at = 1767220000.0 + (rowid / 3) * 0.25")  # ties of three


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    home = tmp_path_factory.mktemp("list") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "other", env=env).code == 0
    tokens = TokenStore(home)
    tenant = tokens.create(name="tenant")[1]
    other = tokens.create(name="neighbour")[1]
    admin = tokens.create(name="ops", scopes="openai,ws,admin")[1]
    db = home / "appserver.db"

    async def own_one(sp: ServeProcess, token: str) -> str:
        ws = await WS.open(sp.url, headers=_bearer(token), open_timeout=T)
        try:
            made = await ws.request({"type": "create_conversation", "agent": "assistant"}, T)
            assert made["type"] == "conversation_state", made
            return str(made["conversation"]["id"])
        finally:
            await ws.close()

    with serving(home, "--auth", "token", env=env) as sp:  # the namespaces as the server writes them
        first, second = asyncio.run(own_one(sp, tenant)), asyncio.run(own_one(sp, other))
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        ns = conn.execute("SELECT namespace FROM conversations WHERE id=?", (first,)).fetchone()[0]
        other_ns = conn.execute("SELECT namespace FROM conversations WHERE id=?", (second,)).fetchone()[0]
        agent_ids = dict(conn.execute("SELECT name, id FROM agents").fetchall())
    assert ns and other_ns and ns != other_ns
    asyncio.run(_fill(db, ns, other_ns, (agent_ids["assistant"], agent_ids["other"])))
    with serving(home, "--auth", "token", env=env) as sp:
        yield World(sp, db, tenant, other, admin, ns)


async def _all_pages(ws: WS, limit: int, **frame: Any) -> tuple[list[str], int]:
    """Every page, each asked with the `next` of the one before: (the ids, the pages)."""
    ids: list[str] = []
    after: str | None = None
    for pages in range(1, 100_000):
        ask = {"type": "list_conversations", "limit": limit, **frame}
        if after is not None:
            ask["after"] = after
        page = await ws.request(ask, T)
        assert page["type"] == "conversations", page
        assert "has_more" in page and "next" in page, sorted(page)
        ids += [c["id"] for c in page["conversations"]]
        if not page["has_more"]:
            assert page["next"] is None, page["next"]
            return ids, pages
        assert len(page["conversations"]) == limit and isinstance(page["next"], str), page["next"]
        after = page["next"]
    raise AssertionError("the pages never ended")


async def test_the_cursor_pages_through_every_conversation_once_in_order(world: World) -> None:
    mine = _ordered(world.db, " WHERE namespace = ?", (world.ns,))
    assert len(mine) > 10_001
    with sqlite3.connect(f"file:{world.db}?mode=ro", uri=True) as conn:
        when = dict(conn.execute("SELECT id, updated_at FROM conversations").fetchall())
    assert any(when[mine[k - 1]] == when[mine[k]] for k in range(1000, len(mine), 1000))  # a page ends in a tie
    tenant = await WS.open(world.sp.url, headers=_bearer(world.tenant), open_timeout=T)
    admin = await WS.open(world.sp.url, headers=_bearer(world.admin), open_timeout=T)
    try:
        ids, pages = await _all_pages(tenant, 1000)
        assert pages == -(-len(mine) // 1000) and ids == mine  # each once, in order; pages end inside groups of ties
        few, _ = await _all_pages(tenant, 50, agent="other")
        with sqlite3.connect(f"file:{world.db}?mode=ro", uri=True) as conn:
            agent = dict(conn.execute("SELECT name, id FROM agents").fetchall())
        assert few == _ordered(world.db, " WHERE namespace = ? AND agent_id = ?", (world.ns, agent["other"]))
        everyone, _ = await _all_pages(admin, 1000)  # admin: no namespace, every conversation
        assert everyone == _ordered(world.db) and len(everyone) == MADE + 2
        by_agent, _ = await _all_pages(admin, 997, agent="assistant")
        assert by_agent == _ordered(world.db, " WHERE agent_id = ?", (agent["assistant"],))
    finally:
        await tenant.close()
        await admin.close()


async def test_an_offset_past_the_cap_is_a_bad_frame_that_points_at_the_cursor(world: World) -> None:
    mine = _ordered(world.db, " WHERE namespace = ?", (world.ns,))
    ws = await WS.open(world.sp.url, headers=_bearer(world.tenant), open_timeout=T)
    try:
        past = await ws.request({"type": "list_conversations", "limit": 1, "offset": 10_001}, T)
        assert past["type"] == "error" and past["code"] == "bad_frame", past
        assert past["param"] == "offset" and "after" in past["message"] and "10000" in past["message"], past

        at_cap = await ws.request({"type": "list_conversations", "limit": 2, "offset": 10_000}, T)
        assert [c["id"] for c in at_cap["conversations"]] == mine[10_000:10_002]  # offset still works
        assert at_cap["has_more"] is True
        resumed = await ws.request({"type": "list_conversations", "limit": 3, "after": at_cap["next"]}, T)
        assert [c["id"] for c in resumed["conversations"]] == mine[10_002:10_005]

        forged = await ws.request({"type": "list_conversations", "after": "not-a-cursor"}, T)
        assert forged["type"] == "error" and forged["code"] == "bad_frame" and forged["param"] == "after", forged
        # a number no float holds, an escaped lone surrogate: refused with the request's id, never an internal error
        for raw in (b"[" + b"9" * 320 + b', "a"]', b'[1e12, "\\ud800"]'):
            cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
            bad = await ws.request({"type": "list_conversations", "after": cursor}, T)
            assert bad["type"] == "error" and bad["code"] == "bad_frame" and bad["param"] == "after", bad
        both = await ws.request({"type": "list_conversations", "offset": 5, "after": at_cap["next"]}, T)
        assert both["type"] == "error" and both["code"] == "bad_frame", both
        assert (await ws.request({"type": "ping"}, T))["type"] == "pong"  # the connection goes on
    finally:
        await ws.close()


def _plans(db: Path, statements: list[str]) -> list[list[str]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return [[row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}")] for sql in statements]


async def test_a_page_reads_an_index_in_the_lists_order_and_only_its_own_rows(world: World, tmp_path: Path) -> None:
    """The statements the store runs for a page (traced on a copy of the served file) read the
    conversations off a covering index with no temp B-tree, and the rows by key."""
    copy = tmp_path / "copy.db"
    with sqlite3.connect(f"file:{world.db}?mode=ro", uri=True) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    with sqlite3.connect(f"file:{copy}?mode=ro", uri=True) as conn:
        agent_ids = [r[0] for r in conn.execute("SELECT id FROM agents ORDER BY name")]
    store = SQLiteStore(copy)
    await store.open()
    statements: list[str] = []
    try:
        store.db.set_trace_callback(statements.append)
        calls: list[dict[str, Any]] = [
            {"namespace": world.ns},  # a tenant
            {"agent_id": agent_ids[0], "namespace": world.ns},  # a tenant, one agent
            {"agent_ids": set(agent_ids), "namespace": world.ns},  # an agent-restricted tenant
            {"agent_id": agent_ids[1]},  # admin, one agent
            {},  # admin
            {"agent_ids": {agent_ids[0]}},  # agent-restricted, no namespace
        ]
        for call in calls:
            statements.clear()
            got = await store.list_conversations(limit=51, offset=9_000, **call)
            read = [s for s in statements if "conversations" in s and s.lstrip().upper().startswith("SELECT")]
            assert read, statements
            plans = _plans(copy, read)
            for sql, plan in zip(read, plans, strict=True):
                assert not any("TEMP B-TREE" in step for step in plan), (call, sql, plan)
                assert not any(step.startswith("SCAN conversations") and "COVERING" not in step for step in plan), (
                    call,
                    sql,
                    plan,
                )
            ordered = [p for s, p in zip(read, plans, strict=True) if "ORDER BY" in s]
            assert ordered and all(any("COVERING INDEX" in step for step in p) for p in ordered), (call, plans)
            if call == {"agent_ids": {agent_ids[0]}}:  # one agent is a seek on its index, not a walk of all
                assert any(step.startswith("SEARCH") and "agent_id=?" in step for p in ordered for step in p), plans
            if call == {"namespace": world.ns}:
                assert [c.id for c in got] == _ordered(copy, " WHERE namespace = ?", (world.ns,))[9_000:9_051]
        page = await store.list_conversations(namespace=world.ns, limit=5, offset=9_000)
        statements.clear()
        after = (page[-1].updated_at, page[-1].id)
        nxt = await store.list_conversations(namespace=world.ns, limit=5, after=after)
        mine = _ordered(copy, " WHERE namespace = ?", (world.ns,))
        assert [c.id for c in page + nxt] == mine[9_000:9_010]
        for plan in _plans(copy, [s for s in statements if s.lstrip().upper().startswith("SELECT")]):
            assert not any("TEMP B-TREE" in step for step in plan), plan
    finally:
        store.db.set_trace_callback(None)
        await store.close()
