"""The Store contract: every method, the same observable behaviour on SQLite and on PostgreSQL.

Each test runs once per backend. PostgreSQL: one database for this module (tests/support/pg.py),
emptied between tests; without a PostgreSQL server those runs skip locally and fail in CI.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appserver.store import (
    AgentRecord,
    ConversationRecord,
    DuplicateTurn,
    MessageRecord,
    PendingCall,
    SQLiteStore,
    StoreError,
    TurnCommit,
    TurnRecord,
)
from appserver.store.base import TurnSettledElsewhere
from appserver.store.integrity import StoreOpenError
from appserver.store.postgres import PostgresStore
from appserver.store.records import HistoryPoint, HttpIdempotency, ResponseRecord
from tests.support.pg import temp_database, truncate_all

pytestmark = pytest.mark.timeout(60)

AnyStore = SQLiteStore | PostgresStore
DEAD_OWNER = "999999999:1"  # a pid above any pid_max: a process that is gone


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with temp_database("contract") as url:
        yield url


@dataclass
class Backend:
    kind: str
    make: Callable[[], AnyStore]  # a new store object on the same data (a reopen)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        path = tmp_path / "store.db"
        return Backend("sqlite", lambda: SQLiteStore(path))
    url: str = request.getfixturevalue("pg_url")
    truncate_all(url)
    return Backend("postgresql", lambda: PostgresStore(url))


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[AnyStore]:
    s = backend.make()
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def _agent_and_conversation(store: AnyStore, conv: str = "conv_1", agent: str = "agt_1") -> None:
    if await store.get_agent(agent) is None:
        await store.create_agent(AgentRecord(id=agent, name=agent.replace("agt_", "a")))
    await store.create_conversation(ConversationRecord(id=conv, agent_id=agent))


async def _turn(store: AnyStore, turn_id: str, conv: str = "conv_1", **kw: object) -> TurnRecord:
    t = TurnRecord(id=turn_id, conversation_id=conv, agent_id="agt_1", status="running", **kw)  # type: ignore[arg-type]
    return await store.accept_turn(t)


def _commit(turn_id: str, text: str, pending: list[PendingCall] | None = None, **kw: object) -> TurnCommit:
    return TurnCommit(
        turn_id,
        "awaiting" if pending else "completed",  # type: ignore[arg-type]
        "requires_approval" if pending else "end_turn",
        [MessageRecord(role="user", content=text), MessageRecord(role="assistant", content=f"echo: {text}")],
        pending=pending or [],
        **kw,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------ lifecycle


async def test_open_is_fresh_once_and_a_reopen_keeps_everything(backend: Backend) -> None:
    s = backend.make()
    await s.open()
    assert s.fresh
    await _agent_and_conversation(s)
    await _turn(s, "turn_1")
    await s.commit_turn("conv_1", _commit("turn_1", "kept"))
    await s.close()
    await s.close()  # twice is fine

    again = backend.make()
    await again.open()
    try:
        assert not again.fresh
        assert [a.id for a in await again.list_agents()] == ["agt_1"]
        assert [m.text() for m in await again.list_messages("conv_1")] == ["kept", "echo: kept"]
        turn = await again.get_turn("turn_1")
        assert turn is not None and turn.status == "completed"
    finally:
        await again.close()


async def test_a_closed_store_refuses(backend: Backend) -> None:
    s = backend.make()
    await s.open()
    await s.close()
    with pytest.raises(StoreError, match="not open"):
        await s.create_agent(AgentRecord(id="agt_1", name="a"))


async def test_check_writable_does_a_real_write(store: AnyStore) -> None:
    first = await store.check_writable()
    assert "writable" in first
    assert "writable" in await store.check_writable()


async def test_a_schema_newer_than_the_code_is_refused(backend: Backend, request: pytest.FixtureRequest) -> None:
    s = backend.make()
    await s.open()
    await s.close()
    if backend.kind == "sqlite":
        assert isinstance(s, SQLiteStore) and isinstance(s.path, Path)
        db = sqlite3.connect(s.path)
        db.execute("INSERT INTO schema_version(version) VALUES (999)")
        db.commit()
        db.close()
    else:
        import psycopg

        with psycopg.connect(request.getfixturevalue("pg_url"), autocommit=True) as conn:
            conn.execute("INSERT INTO schema_version(version) VALUES (999)")
    try:
        with pytest.raises(StoreOpenError, match="schema version 999 is newer than this appserver"):
            await backend.make().open()
    finally:
        if backend.kind == "postgresql":
            import psycopg

            with psycopg.connect(request.getfixturevalue("pg_url"), autocommit=True) as conn:
                conn.execute("DELETE FROM schema_version WHERE version = 999")


# ------------------------------------------------------------------ agents


async def test_agents_create_find_list_update_delete(store: AnyStore) -> None:
    b = await store.create_agent(
        AgentRecord(id="agt_b", name="same", tools={"clock": "ask"}, params={"stop": ["x"]}, created_at=5.0)
    )
    assert b.updated_at > 0 and b.created_at == 5.0
    await store.create_agent(AgentRecord(id="agt_a", name="same", created_at=5.0))
    await store.create_agent(AgentRecord(id="agt_Z", name="other", system="be brief", created_at=1.0))
    # (created_at, id), ids compared byte-wise ("Z" < "a" < "b")
    assert [a.id for a in await store.list_agents()] == ["agt_Z", "agt_a", "agt_b"]
    assert [(a.id, a.name) for a in await store.agents_to_read()] == [
        ("agt_Z", "other"),
        ("agt_a", "same"),
        ("agt_b", "same"),
    ]
    assert [a.id for a in await store.find_agents("same")] == ["agt_a", "agt_b"]
    assert [a.id for a in await store.find_agents("agt_Z")] == ["agt_Z"]
    assert await store.find_agents("nobody") == []
    got = await store.get_agent("agt_b")
    assert got is not None
    assert (got.name, got.model, got.tools, got.params, got.created_at) == (
        "same",
        "echo",
        {"clock": "ask"},
        {"stop": ["x"]},
        5.0,
    )
    got.params["stop"].append("edited in memory only")
    again = await store.get_agent("agt_b")
    assert again is not None and again.params == {"stop": ["x"]}

    again.model = "echo:other"
    again.name = "renamed"
    await store.update_agent(again)
    updated = await store.get_agent("agt_b")
    assert updated is not None and (updated.model, updated.name) == ("echo:other", "renamed")
    with pytest.raises(StoreError, match="does not exist"):
        await store.update_agent(AgentRecord(id="agt_missing", name="x"))
    with pytest.raises(Exception):  # noqa: B017 - the driver's integrity error: the id is taken
        await store.create_agent(AgentRecord(id="agt_a", name="dup"))
    assert await store.get_agent("agt_missing") is None

    assert await store.delete_agent("agt_b") is True
    assert await store.delete_agent("agt_b") is False
    assert await store.get_agent("agt_b") is None
    assert [a.id for a in await store.list_agents()] == ["agt_Z", "agt_a"]
    assert [a.id for a in await store.agents_to_read()] == ["agt_Z", "agt_a"]  # no stale cache


async def test_deleting_an_agent_deletes_its_conversations_turns_and_messages(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await _turn(store, "turn_1", idempotency_key="k1")
    await store.commit_turn("conv_1", _commit("turn_1", "x"))
    await store.add_history_point(HistoryPoint("agt_1", "h", "conv_1", 2))
    assert await store.delete_agent("agt_1")
    assert await store.get_conversation("conv_1") is None
    assert await store.get_turn("turn_1") is None
    assert await store.list_messages("conv_1") == []
    assert await store.find_history_points("agt_1", "h") == []
    assert await store.last_message_id("conv_1") == 0


async def test_a_turn_whose_agent_was_deleted_meanwhile_fails_as_conversation_gone(store: AnyStore) -> None:
    """The agent (and with it the conversation) deleted while a turn ran: its commit fails with
    `ConversationGone`, which the runtime logs without a traceback, and writes nothing; a turn of
    another conversation committed in the same group is kept."""
    from appserver.store.base import ConversationGone

    await _agent_and_conversation(store)
    await _agent_and_conversation(store, "conv_2", "agt_2")
    await _turn(store, "turn_1")
    await store.accept_turn(TurnRecord(id="turn_2", conversation_id="conv_2", agent_id="agt_2", status="running"))
    assert await store.delete_agent("agt_1")
    gone, kept = await asyncio.gather(
        store.commit_turn("conv_1", _commit("turn_1", "lost")),
        store.commit_turn("conv_2", _commit("turn_2", "kept")),
        return_exceptions=True,
    )
    assert isinstance(gone, ConversationGone) and gone.conversation_id == "conv_1", gone
    assert kept is None
    assert await store.list_messages("conv_1") == []
    assert [m.content for m in await store.list_messages("conv_2")] == ["kept", "echo: kept"]


async def test_accepting_a_turn_into_a_conversation_deleted_meanwhile_fails_as_conversation_gone(
    store: AnyStore,
) -> None:
    """The accept of an input whose conversation went with its agent a moment before: on both
    backends `ConversationGone` (the kernel tells the client "not found"), nothing written, and an
    accept of another conversation in the same group is kept."""
    from appserver.store.base import ConversationGone

    await _agent_and_conversation(store)
    await _agent_and_conversation(store, "conv_2", "agt_2")
    assert await store.delete_agent("agt_1")
    gone, kept = await asyncio.gather(
        store.accept_turn(TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", status="queued")),
        store.accept_turn(TurnRecord(id="turn_2", conversation_id="conv_2", agent_id="agt_2", status="queued")),
        return_exceptions=True,
    )
    assert isinstance(gone, ConversationGone) and gone.conversation_id == "conv_1", gone
    assert isinstance(kept, TurnRecord) and kept.id == "turn_2", kept
    assert await store.get_turn("turn_1") is None and await store.get_turn("turn_2") is not None


async def test_a_history_point_of_a_conversation_deleted_meanwhile_is_dropped_quietly(store: AnyStore) -> None:
    """A reply's point is written after the reply went out; the conversation (its agent) deleted
    in between: nothing is written and nothing fails, not even a write nobody waits for."""
    await _agent_and_conversation(store)
    assert await store.delete_agent("agt_1")
    await store.add_history_point(HistoryPoint("agt_1", "h", "conv_1", 2))
    await _agent_and_conversation(store, "conv_2", "agt_2")
    await store.add_history_point(HistoryPoint("agt_2", "h", "conv_2", 1))
    assert await store.find_history_points("agt_1", "h") == []
    assert [p.conversation_id for p in await store.find_history_points("agt_2", "h")] == ["conv_2"]


async def test_a_turn_of_a_deleted_conversation_never_lands_in_one_created_again_under_its_id(
    store: AnyStore,
) -> None:
    """The conversation deleted (with its agent) while a turn ran, then created again under the same
    id by another agent: the old turn's commit fails with `ConversationGone` (its turn row is gone)
    and writes nothing into the new conversation."""
    from appserver.store.base import ConversationGone

    await _agent_and_conversation(store)
    await _turn(store, "turn_1")
    assert await store.delete_agent("agt_1")
    await _agent_and_conversation(store, "conv_1", "agt_2")
    with pytest.raises(ConversationGone):
        await store.checkpoint_turn(
            "conv_1", "turn_1", [MessageRecord(role="user", content="before a tool")], iteration=1, usage={}
        )
    with pytest.raises(ConversationGone):
        await store.commit_turn("conv_1", _commit("turn_1", "from the deleted agent"))
    assert await store.list_messages("conv_1") == []
    await store.delete_agent("agt_2")
    with pytest.raises(ConversationGone):  # and with no conversation of that id at all
        await store.checkpoint_turn(
            "conv_1", "turn_1", [MessageRecord(role="user", content="x")], iteration=1, usage={}
        )


# ------------------------------------------------------------------ conversations


async def test_conversations_create_get_default_list_update(store: AnyStore) -> None:
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    await store.create_agent(AgentRecord(id="agt_2", name="b"))
    made = await store.create_conversation(
        ConversationRecord(
            id="conv_d",
            agent_id="agt_1",
            is_default=True,
            title="t",
            user="u",
            namespace="ns",
            metadata={"k": [1, "é"]},
        )
    )
    assert made.created_at > 0 and made.updated_at >= made.created_at
    got = await store.get_conversation("conv_d")
    assert got == made
    assert await store.get_default_conversation("agt_1") == made
    assert await store.get_default_conversation("agt_2") is None
    assert await store.get_conversation("nope") is None

    for i in range(5):
        await store.create_conversation(ConversationRecord(id=f"conv_{i}", agent_id="agt_2", forked_from="conv_d"))
        await asyncio.sleep(0.002)  # distinct updated_at
    # most recently updated first
    listed = [c.id for c in await store.list_conversations("agt_2")]
    assert listed == ["conv_4", "conv_3", "conv_2", "conv_1", "conv_0"]
    assert [c.id for c in await store.list_conversations("agt_2", limit=2, offset=1)] == ["conv_3", "conv_2"]
    assert [c.id for c in await store.list_conversations("agt_2", limit=10, offset=4)] == ["conv_0"]
    assert await store.list_conversations("agt_2", limit=0) == []
    assert [c.id for c in await store.list_conversations(limit=2)] == ["conv_4", "conv_3"]
    assert len(await store.list_conversations()) == 6
    assert len(await store.list_conversations(limit=-1)) == 6  # SQLite: a negative limit is none

    conv = await store.get_conversation("conv_0")
    assert conv is not None and conv.forked_from == "conv_d"
    conv.title, conv.user, conv.metadata = "new title", "someone", {"a": 1}
    await store.update_conversation(conv)
    updated = await store.get_conversation("conv_0")
    assert updated is not None
    assert (updated.title, updated.user, updated.metadata) == ("new title", "someone", {"a": 1})
    assert updated.updated_at > conv.created_at
    assert (await store.list_conversations("agt_2"))[0].id == "conv_0"  # updating it moved it first


async def test_conversations_listed_by_namespace_and_agents_in_the_query(store: AnyStore) -> None:
    """A namespaced credential's page is filtered by the store: `offset` counts its own only, and
    the read uses the namespace index, not a walk over every conversation (a WebSocket client that
    owned none of 20,000 conversations stalled the server for seconds per frame)."""
    for agent in ("agt_1", "agt_2", "agt_3"):
        await store.create_agent(AgentRecord(id=agent, name=agent))
    for i in range(30):
        owner = "ns_a" if i % 3 == 0 else "ns_b" if i % 3 == 1 else None
        await store.create_conversation(
            ConversationRecord(id=f"conv_{i:02d}", agent_id=f"agt_{1 + i % 2}", namespace=owner)
        )
        await asyncio.sleep(0.002)  # distinct updated_at
    own = [c.id for c in await store.list_conversations(namespace="ns_a", limit=100)]
    assert own == [f"conv_{i:02d}" for i in range(27, -1, -3)]
    assert [c.id for c in await store.list_conversations(namespace="ns_a", limit=2, offset=3)] == own[3:5]
    assert await store.list_conversations(namespace="ns_a", offset=1_000_000_000) == []
    assert await store.list_conversations(namespace="nobody") == []
    only_1 = [c.id for c in await store.list_conversations(namespace="ns_a", agent_ids={"agt_1"})]
    assert only_1 == [c for c in own if int(c[5:]) % 2 == 0]
    assert await store.list_conversations(namespace="ns_a", agent_ids=set()) == []
    assert await store.list_conversations("agt_2", namespace="ns_a", agent_ids={"agt_1"}) == []
    both = await store.list_conversations(agent_ids={"agt_1", "agt_3"}, limit=100)
    assert [c.id for c in both] == [f"conv_{i:02d}" for i in range(28, -1, -2)]
    if isinstance(store, SQLiteStore):
        plan = store.db.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM conversations WHERE namespace = ? ORDER BY updated_at DESC, id",
            ("ns_a",),
        ).fetchall()
        assert any("conversations_namespace" in str(tuple(row)) for row in plan), plan


async def test_a_conversation_can_start_with_copies_of_messages(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    msgs = [MessageRecord(role="user", content=f"m{i}", meta={"i": i}) for i in range(4)]
    await store.append_messages("conv_1", msgs)
    ids = [m.id for m in msgs]
    assert all(isinstance(i, int) for i in ids)
    fork = ConversationRecord(id="conv_fork", agent_id="agt_1", forked_from="conv_1")
    await store.create_conversation(fork, copy_messages=[ids[2], ids[0]])  # in the order given
    copied = await store.list_messages("conv_fork")
    assert [m.text() for m in copied] == ["m2", "m0"]
    assert [m.meta for m in copied] == [{"i": 2}, {"i": 0}]
    assert all(m.conversation_id == "conv_fork" for m in copied)
    assert min(m.id or 0 for m in copied) > max(i or 0 for i in ids)
    assert [m.text() for m in await store.list_messages("conv_1")] == ["m0", "m1", "m2", "m3"]


# ------------------------------------------------------------------ messages


async def test_messages_round_trip_every_field(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    before = await store.get_conversation("conv_1")
    assert before is not None
    await asyncio.sleep(0.002)
    parts = [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    written = [
        MessageRecord(role="user", content=parts, source={"channel": "cli"}),
        MessageRecord(
            role="assistant",
            content="calling",
            turn_id="turn_x",
            iteration=2,
            tool_calls=[{"id": "call_1", "name": "clock", "arguments": '{"tz": "UTC"}', "kind": "server"}],
            reasoning="thinking…",
            provider_state={"z": 1, "a": [None, True]},
            completion_status="incomplete",
            meta={"context_tokens": 42},
            created_at=123.5,
        ),
        MessageRecord(role="tool", content="12:00", tool_call_id="call_1", name="clock", is_error=True),
    ]
    await store.append_messages("conv_1", written)
    ids = [m.id for m in written]
    assert all(isinstance(i, int) for i in ids) and ids == sorted(ids) and len(set(ids)) == 3
    read = await store.list_messages("conv_1")
    assert read == written  # same records: every field, JSON key order included
    assert list((read[1].provider_state or {}).keys()) == ["z", "a"]
    assert read[1].created_at == 123.5 and read[0].created_at > 0
    assert await store.last_message_id("conv_1") == ids[-1]
    assert await store.last_message_id("conv_none") == 0
    after = await store.get_conversation("conv_1")
    assert after is not None and after.updated_at > before.updated_at


async def test_list_messages_pages_backwards(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await _agent_and_conversation(store, "conv_2")
    for i in range(6):
        await store.append_messages("conv_1", [MessageRecord(role="user", content=f"m{i}")])
        await store.append_messages("conv_2", [MessageRecord(role="user", content=f"other{i}")])
    all_ = await store.list_messages("conv_1")
    assert [m.text() for m in all_] == [f"m{i}" for i in range(6)]
    assert [m.text() for m in await store.list_messages("conv_1", limit=2)] == ["m4", "m5"]
    before = all_[3].id
    assert [m.text() for m in await store.list_messages("conv_1", before_id=before)] == ["m0", "m1", "m2"]
    assert [m.text() for m in await store.list_messages("conv_1", before_id=before, limit=2)] == ["m1", "m2"]
    assert await store.list_messages("conv_1", limit=0) == []
    assert await store.list_messages("conv_1", before_id=all_[0].id) == []
    # ids increase across the whole store, not per conversation
    ids = [m.id or 0 for m in (await store.list_messages("conv_2"))]
    assert ids == sorted(ids) and not set(ids) & {m.id for m in all_}


async def test_a_history_page_stops_at_its_size_and_says_more_remain(store: AnyStore) -> None:
    """Pages by count and by stored size (about `max_bytes`, at least one message), with
    `more` saying whether older messages remain: how a client reads a conversation of any size."""
    await _agent_and_conversation(store)
    for i in range(5):
        await store.append_messages("conv_1", [MessageRecord(role="user", content=f"{i}" * 1000)])
    page, more = await store.history_page("conv_1", before_id=None, limit=10, max_bytes=2500)
    assert [m.text()[0] for m in page] == ["2", "3", "4"] and more
    page, more = await store.history_page("conv_1", before_id=page[0].id, limit=10, max_bytes=2500)
    assert [m.text()[0] for m in page] == ["0", "1"] and not more
    page, more = await store.history_page("conv_1", before_id=None, limit=2, max_bytes=10**9)
    assert [m.text()[0] for m in page] == ["3", "4"] and more
    page, more = await store.history_page("conv_1", before_id=None, limit=5, max_bytes=1)
    assert [m.text()[0] for m in page] == ["4"] and more  # one message always, whatever its size
    assert await store.history_page("conv_1", before_id=page[0].id - 4, limit=5, max_bytes=1) == ([], False)


# ------------------------------------------------------------------ turns


async def test_accept_turn_round_trip_and_duplicate_idempotency_key(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    t = TurnRecord(
        id="turn_1",
        conversation_id="conv_1",
        agent_id="agt_1",
        status="queued",
        idempotency_key="key-1",
        source={"channel": "ws", "peer": "p"},
        input={"content": "hi", "instructions": "x"},
        client_tools=[{"name": "local", "parameters": {}}],
        options={"temperature": 0.5},
        owner="123:456",
    )
    accepted = await store.accept_turn(t, "scope-a")
    assert accepted is t and t.created_at > 0
    got = await store.get_turn("turn_1")
    assert got == t  # every field as written
    assert await store.lookup_idempotency("scope-a", "key-1") == got
    assert await store.lookup_idempotency("scope-b", "key-1") is None

    again = TurnRecord(
        id="turn_2", conversation_id="conv_1", agent_id="agt_1", idempotency_key="key-1", input={"content": "hi"}
    )
    with pytest.raises(DuplicateTurn) as dup:
        await store.accept_turn(again, "scope-a")
    assert dup.value.turn == got
    assert await store.get_turn("turn_2") is None  # nothing of the refused turn was stored
    # another scope, or no scope at all, is not a duplicate
    await store.accept_turn(again, "scope-b")
    await store.accept_turn(
        TurnRecord(id="turn_3", conversation_id="conv_1", agent_id="agt_1", idempotency_key="key-1")
    )
    assert [x.id for x in await store.list_turns("conv_1")] == ["turn_1", "turn_2", "turn_3"]
    assert await store.get_turn("nope") is None


async def test_duplicates_in_one_group_commit_and_a_key_whose_turn_is_gone(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    turns = [
        TurnRecord(id=f"turn_{i}", conversation_id="conv_1", agent_id="agt_1", idempotency_key="same") for i in range(3)
    ]
    results = await asyncio.gather(*(store.accept_turn(t, "s") for t in turns), return_exceptions=True)
    assert results[0] is turns[0]
    assert all(isinstance(r, DuplicateTurn) and r.turn.id == "turn_0" for r in results[1:]), results
    # the key's turn disappears with its agent; the key is free again
    await store.create_agent(AgentRecord(id="agt_2", name="b"))
    await store.create_conversation(ConversationRecord(id="conv_2", agent_id="agt_2"))
    await store.accept_turn(
        TurnRecord(id="turn_x", conversation_id="conv_2", agent_id="agt_2", idempotency_key="k"), "s"
    )
    await store.delete_agent("agt_2")
    assert await store.lookup_idempotency("s", "k") is None
    await store.accept_turn(
        TurnRecord(id="turn_y", conversation_id="conv_1", agent_id="agt_1", idempotency_key="k"), "s"
    )
    found = await store.lookup_idempotency("s", "k")
    assert found is not None and found.id == "turn_y"


async def test_purge_idempotency_counts_what_it_removed(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    for i in range(3):
        await store.accept_turn(
            TurnRecord(id=f"turn_{i}", conversation_id="conv_1", agent_id="agt_1", idempotency_key=f"k{i}"), "s"
        )
    assert await store.purge_idempotency(time.time() - 3600) == 0
    assert await store.purge_idempotency(time.time() + 1) == 3
    assert await store.lookup_idempotency("s", "k0") is None
    assert await store.get_turn("turn_0") is not None  # the turns stay


async def test_a_draft_after_the_turn_ended_changes_nothing(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await store.accept_turn(
        TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", status="running", input={"content": "q"})
    )
    await store.save_draft("turn_1", {"text": "so far"})
    await store.commit_turn("conv_1", TurnCommit("turn_1", "completed", "end_turn", [], usage={}, revision=2))
    await store.save_draft("turn_1", {"text": "late"})  # a checkpoint scheduled before the commit
    t = await store.get_turn("turn_1")
    assert t is not None and (t.status, t.draft) == ("completed", None)


async def test_a_settled_turn_is_never_marked_running_again(store: AnyStore) -> None:
    """Its own server included: a turn queued twice in memory (two submitters of a cluster each
    requeued one another server accepted, under a storm of ended connections) ran twice and was
    committed twice, because the owner's mark set a completed turn back to running."""
    await _agent_and_conversation(store)
    await store.accept_turn(
        TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", status="queued", input={"content": "q"})
    )
    await store.mark_turn_running("turn_1", "owner-a", 3)
    await store.commit_turn("conv_1", TurnCommit("turn_1", "completed", "end_turn", [], usage={}, revision=4))
    if isinstance(store, PostgresStore):
        with pytest.raises(TurnSettledElsewhere):
            await store.mark_turn_running("turn_1", "owner-a", 5)
    else:
        await store.mark_turn_running("turn_1", "owner-a", 5)
    t = await store.get_turn("turn_1")
    assert t is not None and (t.status, t.revision) == ("completed", 4)


async def test_mark_running_draft_checkpoint_and_commit(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await store.accept_turn(
        TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", status="queued", input={"content": "q"})
    )
    await store.mark_turn_running("turn_1", "owner-a", 3)
    t = await store.get_turn("turn_1")
    assert t is not None and (t.status, t.owner, t.revision) == ("running", "owner-a", 3)
    started = t.started_at
    assert started is not None and t.ended_at is None
    await asyncio.sleep(0.002)
    await store.mark_turn_running("turn_1", "owner-a", 4)
    t = await store.get_turn("turn_1")
    assert t is not None and t.started_at == started and t.revision == 4  # started_at kept
    if isinstance(store, PostgresStore):  # a cluster: another server never starts a turn one runs
        with pytest.raises(TurnSettledElsewhere):
            await store.mark_turn_running("turn_1", "owner-b", 5)
        t = await store.get_turn("turn_1")
        assert t is not None and (t.owner, t.revision) == ("owner-a", 4)

    await store.save_draft("turn_1", {"text": "partial", "n": 1})
    t = await store.get_turn("turn_1")
    assert t is not None and t.draft == {"text": "partial", "n": 1}

    conv_before = await store.get_conversation("conv_1")
    assert conv_before is not None
    await asyncio.sleep(0.002)
    call = MessageRecord(
        role="assistant", content="", tool_calls=[{"id": "c1", "name": "clock", "arguments": "{}", "kind": "server"}]
    )
    await store.checkpoint_turn("conv_1", "turn_1", [call], iteration=1, usage={"input_tokens": 5})
    t = await store.get_turn("turn_1")
    assert t is not None
    assert (t.input_committed, t.iteration, t.usage, t.draft, t.status) == (
        True,
        1,
        {"input_tokens": 5},
        None,
        "running",
    )
    stored = await store.list_messages("conv_1")
    assert [(m.role, m.turn_id) for m in stored] == [("assistant", "turn_1")]
    assert call.id == stored[0].id and call.conversation_id == "conv_1"
    conv_after = await store.get_conversation("conv_1")
    assert conv_after is not None and conv_after.updated_at > conv_before.updated_at

    commit = TurnCommit(
        "turn_1",
        "completed",
        "end_turn",
        [MessageRecord(role="tool", content="12:00", tool_call_id="c1", name="clock")],
        usage={"input_tokens": 9, "output_tokens": 2},
        revision=7,
        iteration=2,
    )
    await store.commit_turn("conv_1", commit)
    t = await store.get_turn("turn_1")
    assert t is not None
    assert (t.status, t.stop_reason, t.usage, t.revision, t.iteration, t.input_committed, t.draft) == (
        "completed",
        "end_turn",
        {"input_tokens": 9, "output_tokens": 2},
        7,
        2,
        True,
        None,
    )
    assert t.ended_at is not None and t.error is None
    assert [m.role for m in await store.list_messages("conv_1")] == ["assistant", "tool"]
    assert commit.messages[0].turn_id == "turn_1" and commit.messages[0].id is not None
    if isinstance(store, PostgresStore):  # a cluster: a turn settled (by a survivor) is not written again
        again = TurnCommit("turn_1", "completed", "end_turn", [MessageRecord(role="assistant", content="twice")])
        with pytest.raises(TurnSettledElsewhere):
            await store.commit_turn("conv_1", again)
        assert [m.role for m in await store.list_messages("conv_1")] == ["assistant", "tool"]


async def test_commit_with_pending_calls_then_terminal_commit_cancels_unanswered(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await _turn(store, "turn_1")
    now = time.time()
    pending = [
        PendingCall("call_b", "conv_1", "turn_1", "clock", "{}", "approval", created_at=now, expires_at=now + 60),
        PendingCall("call_a", "conv_1", "turn_1", "local", '{"x": 1}', "client", created_at=now, expires_at=None),
    ]
    await store.commit_turn("conv_1", _commit("turn_1", "wait", pending))
    t = await store.get_turn("turn_1")
    assert t is not None and t.status == "awaiting" and t.ended_at is None
    assert [p.call_id for p in await store.list_pending("turn_1")] == ["call_b", "call_a"]  # created_at, then insertion
    got = await store.get_pending("conv_1", "call_a")
    assert got is not None and (got.kind, got.arguments, got.status, got.expires_at) == (
        "client",
        '{"x": 1}',
        "pending",
        None,
    )
    assert await store.get_pending("conv_1", "call_zzz") is None

    await store.commit_turn(
        "conv_1",
        TurnCommit("turn_1", "failed", "error", error={"kind": "provider", "message": "x"}, iteration=2),
    )
    t = await store.get_turn("turn_1")
    assert t is not None and t.status == "failed" and t.error == {"kind": "provider", "message": "x"}
    assert t.ended_at is not None
    assert {p.status for p in await store.list_pending("turn_1")} == {"cancelled"}


async def test_a_failing_commit_in_a_group_leaves_no_rows_and_spares_the_others(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    for i in range(3):
        await _turn(store, f"turn_{i}")
    twice = [
        PendingCall("call_x", "conv_1", "turn_1", "clock", "{}", "approval"),
        PendingCall("call_x", "conv_1", "turn_1", "clock", "{}", "approval"),  # duplicate key: fails
    ]
    results = await asyncio.gather(
        store.commit_turn("conv_1", _commit("turn_0", "one")),
        store.commit_turn("conv_1", _commit("turn_1", "two", twice)),
        store.commit_turn("conv_1", _commit("turn_2", "three")),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Exception) and not isinstance(results[1], StoreError)
    assert [m.text() for m in await store.list_messages("conv_1")] == ["one", "echo: one", "three", "echo: three"]
    statuses = [t.status for t in await store.list_turns("conv_1")]
    assert statuses == ["completed", "running", "completed"]
    assert await store.list_pending("turn_1") == []
    # a lone failing commit too, and the store goes on
    with pytest.raises(Exception):  # noqa: B017
        await store.commit_turn("conv_1", _commit("turn_1", "two", twice))
    await store.commit_turn("conv_1", _commit("turn_1", "again"))
    assert [m.text() for m in await store.list_messages("conv_1")][-2:] == ["again", "echo: again"]


async def test_list_turns_and_open_turns_keep_insertion_order(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await _agent_and_conversation(store, "conv_2")
    # ids out of alphabetical order: the order is the order of acceptance
    for tid, conv, status in (
        ("turn_c", "conv_1", "queued"),
        ("turn_a", "conv_2", "running"),
        ("turn_b", "conv_1", "awaiting"),
        ("turn_d", "conv_1", "completed"),
    ):
        await store.accept_turn(TurnRecord(id=tid, conversation_id=conv, agent_id="agt_1", status=status))  # type: ignore[arg-type]
    assert [t.id for t in await store.list_turns("conv_1")] == ["turn_c", "turn_b", "turn_d"]
    assert [t.id for t in await store.list_turns("conv_1", statuses=["awaiting", "completed"])] == ["turn_b", "turn_d"]
    assert await store.list_turns("conv_1", statuses=[]) == []
    assert [t.id for t in await store.open_turns()] == ["turn_c", "turn_a", "turn_b"]
    assert [t.id for t in await store.open_turns(["running"])] == ["turn_a"]


async def test_many_concurrent_writes_are_all_acknowledged_and_readable(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    turns = [TurnRecord(id=f"turn_{i:03}", conversation_id="conv_1", agent_id="agt_1") for i in range(50)]
    await asyncio.gather(*(store.accept_turn(t) for t in turns))
    await asyncio.gather(*(store.commit_turn("conv_1", _commit(t.id, t.id)) for t in turns))
    listed = await store.list_turns("conv_1")
    assert [t.id for t in listed] == [t.id for t in turns]
    assert all(t.status == "completed" for t in listed)
    msgs = await store.list_messages("conv_1")
    assert len(msgs) == 100 and [m.id for m in msgs] == sorted(m.id or 0 for m in msgs)


# ------------------------------------------------------------------ pending calls


async def test_resolve_pending_first_answer_wins_and_overdue(store: AnyStore) -> None:
    await _agent_and_conversation(store)
    await _turn(store, "turn_1")
    now = time.time()
    pending = [
        PendingCall("late", "conv_1", "turn_1", "clock", "{}", "approval", expires_at=now - 10),
        PendingCall("later", "conv_1", "turn_1", "clock", "{}", "approval", expires_at=now + 3600),
        PendingCall("earliest", "conv_1", "turn_1", "clock", "{}", "approval", expires_at=now - 20),
        PendingCall("never", "conv_1", "turn_1", "local", "{}", "client"),
    ]
    await store.commit_turn("conv_1", _commit("turn_1", "w", pending))
    assert [p.call_id for p in await store.overdue_pending(now)] == ["earliest", "late"]
    assert [p.call_id for p in await store.overdue_pending(now + 7200)] == ["earliest", "late", "later"]

    assert await store.resolve_pending("conv_1", "late", "approved", decided_by="ops") is True
    assert await store.resolve_pending("conv_1", "late", "denied", reason="too late") is False
    got = await store.get_pending("conv_1", "late")
    assert got is not None and (got.status, got.decided_by, got.reason) == ("approved", "ops", None)
    assert await store.resolve_pending("conv_1", "never", "result", output="42", is_error=True) is True
    got = await store.get_pending("conv_1", "never")
    assert got is not None and (got.status, got.output, got.is_error) == ("result", "42", True)
    assert await store.resolve_pending("conv_1", "missing", "approved") is False
    assert [p.call_id for p in await store.overdue_pending(now)] == ["earliest"]


# ------------------------------------------------------------------ OpenAI HTTP surface


async def test_deleting_an_agent_deletes_its_stored_responses(store: AnyStore) -> None:
    """Its conversations cascade away; its responses (no foreign key) went nowhere, unreachable."""
    await _agent_and_conversation(store)
    await _agent_and_conversation(store, conv="conv_2", agent="agt_2")
    for i, (agent, conv) in enumerate([("agt_1", "conv_1"), ("agt_1", "conv_1"), ("agt_2", "conv_2")]):
        await store.save_response(ResponseRecord(id=f"resp_{i}", agent_id=agent, conversation_id=conv, body={"i": i}))
    await store.save_response(ResponseRecord(id="resp_old", agent_id="agt_gone", conversation_id="c", body={}))
    assert await store.delete_agent("agt_1") is True
    assert [await store.get_response(f"resp_{i}") is None for i in range(3)] == [True, True, False]
    assert await store.get_response("resp_old") is None  # an orphan an older version left


async def test_responses_save_replace_get_delete(store: AnyStore) -> None:
    body = {"id": "resp_1", "object": "response", "output": [{"b": 1, "a": 2}]}
    r = ResponseRecord(
        id="resp_1",
        agent_id="agt_1",
        conversation_id="conv_1",
        body=body,
        turn_id="turn_1",
        previous_response_id="resp_0",
        namespace="ns",
        last_message_id=7,
        input_items=[{"type": "message", "content": "hi"}],
        stored=False,
    )
    await store.save_response(r)
    assert r.created_at > 0
    got = await store.get_response("resp_1")
    assert got == r and list(got.body["output"][0]) == ["b", "a"]
    r2 = ResponseRecord(id="resp_1", agent_id="agt_1", conversation_id="conv_2", body={"v": 2}, created_at=5.0)
    await store.save_response(r2)  # the same id again replaces it
    assert await store.get_response("resp_1") == r2
    assert await store.delete_response("resp_1") is True
    assert await store.delete_response("resp_1") is False
    assert await store.get_response("resp_1") is None


async def test_http_idempotency_claim_finish_drop_purge(store: AnyStore) -> None:
    first = HttpIdempotency("scope", "key-1", "hash-a")
    assert await store.claim_http_idempotency(first) is None
    assert first.owner == store.owner and first.created_at > 0
    existing = await store.claim_http_idempotency(HttpIdempotency("scope", "key-1", "hash-b"))
    assert existing is not None
    assert (existing.state, existing.body_hash, existing.owner) == ("pending", "hash-a", store.owner)
    assert await store.get_http_idempotency("scope", "key-1") == existing
    assert await store.get_http_idempotency("other", "key-1") is None

    await store.finish_http_idempotency("scope", "key-1", 200, "application/json", '{"ok":true}', "conv_1")
    done = await store.get_http_idempotency("scope", "key-1")
    assert done is not None
    assert (done.state, done.status_code, done.content_type, done.body, done.conversation_id) == (
        "done",
        200,
        "application/json",
        '{"ok":true}',
        "conv_1",
    )
    assert await store.claim_http_idempotency(HttpIdempotency("scope", "key-1", "hash-a")) == done

    await store.drop_http_idempotency("scope", "key-1")
    assert await store.get_http_idempotency("scope", "key-1") is None
    assert await store.claim_http_idempotency(HttpIdempotency("scope", "key-1", "hash-c")) is None

    await store.claim_http_idempotency(HttpIdempotency("scope", "old", "h", created_at=time.time() - 7200))
    assert await store.purge_http_idempotency(time.time() - 3600) == 1
    assert await store.get_http_idempotency("scope", "old") is None
    assert await store.get_http_idempotency("scope", "key-1") is not None


async def test_orphaned_http_idempotency_keys_are_released_or_taken_over(store: AnyStore) -> None:
    await store.claim_http_idempotency(HttpIdempotency("s", "dead", "h", owner=DEAD_OWNER))
    await store.claim_http_idempotency(HttpIdempotency("s", "dead-done", "h", owner=DEAD_OWNER))
    await store.finish_http_idempotency("s", "dead-done", 200, "text/plain", "x", None)
    await store.claim_http_idempotency(HttpIdempotency("s", "mine", "h"))
    await store.claim_http_idempotency(HttpIdempotency("s", "dead-2", "h-old", owner=DEAD_OWNER))

    # a pending key whose claimant is gone is taken over by a repeat of its request only: another
    # body gets the entry (the caller's 409 idempotency_key_reused), which keeps its body
    refused = await store.claim_http_idempotency(HttpIdempotency("s", "dead-2", "h-new"))
    assert refused is not None and (refused.owner, refused.body_hash) == (DEAD_OWNER, "h-old")
    assert await store.claim_http_idempotency(HttpIdempotency("s", "dead-2", "h-old")) is None
    taken = await store.get_http_idempotency("s", "dead-2")
    assert taken is not None and (taken.owner, taken.body_hash, taken.state) == (store.owner, "h-old", "pending")

    assert await store.release_orphaned_http_idempotency() == 1  # "dead" only: done keys and ours stay
    released = await store.get_http_idempotency("s", "dead")  # kept with its body, nobody's
    assert released is not None and (released.owner, released.body_hash, released.state) == (None, "h", "pending")
    assert await store.claim_http_idempotency(HttpIdempotency("s", "dead", "h-other")) is not None
    assert await store.claim_http_idempotency(HttpIdempotency("s", "dead", "h")) is None
    assert await store.get_http_idempotency("s", "dead-done") is not None
    assert await store.get_http_idempotency("s", "mine") is not None
    assert await store.release_orphaned_http_idempotency() == 0


async def test_history_points_most_recently_active_conversation_first(store: AnyStore) -> None:
    await _agent_and_conversation(store, "conv_old")
    await asyncio.sleep(0.002)
    await _agent_and_conversation(store, "conv_new")
    await store.add_history_point(HistoryPoint("agt_1", "h1", "conv_old", 3, created_at=10.0))
    await store.add_history_point(HistoryPoint("agt_1", "h1", "conv_new", 5, created_at=11.0))
    await store.add_history_point(HistoryPoint("agt_1", "h2", "conv_new", 6))
    points = await store.find_history_points("agt_1", "h1")
    assert [(p.conversation_id, p.last_message_id, p.created_at) for p in points] == [
        ("conv_new", 5, 11.0),
        ("conv_old", 3, 10.0),
    ]
    await asyncio.sleep(0.002)
    await store.append_messages("conv_old", [MessageRecord(role="user", content="activity")])
    assert [p.conversation_id for p in await store.find_history_points("agt_1", "h1")] == ["conv_old", "conv_new"]
    # the same point again replaces it
    await store.add_history_point(HistoryPoint("agt_1", "h1", "conv_old", 9, created_at=12.0))
    points = await store.find_history_points("agt_1", "h1")
    assert (points[0].conversation_id, points[0].last_message_id, points[0].created_at) == ("conv_old", 9, 12.0)
    assert len(points) == 2
    assert await store.find_history_points("agt_1", "nope") == []
    assert await store.find_history_points("agt_2", "h1") == []
    assert points[0].created_at == 12.0 and (await store.find_history_points("agt_1", "h2"))[0].created_at > 0


# ------------------------------------------------------------------ PostgreSQL only


async def test_postgres_never_releases_a_claim_stamped_by_another_host(
    backend: Backend,
) -> None:
    if backend.kind != "postgresql":
        pytest.skip("host-stamped owners are the PostgreSQL store's (several hosts may share a database)")
    s = backend.make()
    await s.open()
    try:
        assert isinstance(s, PostgresStore) and s.owner.endswith("@" + s.host)
        await s.claim_http_idempotency(HttpIdempotency("s", "elsewhere", "h", owner=f"{DEAD_OWNER}@another-host"))
        await s.claim_http_idempotency(HttpIdempotency("s", "here", "h", owner=f"{DEAD_OWNER}@{s.host}"))
        assert await s.release_orphaned_http_idempotency() == 1
        assert await s.get_http_idempotency("s", "elsewhere") is not None
        here = await s.get_http_idempotency("s", "here")
        assert here is not None and here.owner is None  # released: kept with its body, nobody's
        # nor is such a pending key taken over by a claim
        existing = await s.claim_http_idempotency(HttpIdempotency("s", "elsewhere", "h2"))
        assert existing is not None and existing.owner == f"{DEAD_OWNER}@another-host"
    finally:
        await s.close()


async def test_postgresql_connections_killed_under_the_store_are_replaced_not_failed(pg_url: str) -> None:
    """A database restart (or a failover, or an idle-connection reaper) leaves the pool holding dead
    connections: the next reads and writes must get fresh ones, not fail once per dead connection."""
    import psycopg

    truncate_all(pg_url)
    store = PostgresStore(pg_url)
    await store.open()
    try:
        await _agent_and_conversation(store)
        await asyncio.gather(*(store.list_agents() for _ in range(8)))  # several pooled connections
        with psycopg.connect(pg_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert killed is not None and killed[0] >= 1
        for i in range(12):
            assert [a.id for a in await store.list_agents()] == ["agt_1"]
            await _turn(store, f"turn_{i}")
        assert len(await store.list_turns("conv_1")) == 12
    finally:
        await store.close()


async def test_a_turn_accepted_running_keeps_its_start_time(store: AnyStore) -> None:
    """A turn that runs at once is accepted already `running` (mark_turn_running is not called for
    it): its start time must be stored with it, or [started_at, ended_at] cannot be checked."""
    await _agent_and_conversation(store)
    started = time.time()
    await _turn(store, "turn_now", started_at=started)
    await store.accept_turn(
        TurnRecord(id="turn_later", conversation_id="conv_1", agent_id="agt_1", status="queued", input={})
    )
    now, later = await store.get_turn("turn_now"), await store.get_turn("turn_later")
    assert now is not None and now.started_at == pytest.approx(started)
    assert later is not None and later.started_at is None


async def test_a_history_page_counts_bytes_not_characters(store: AnyStore) -> None:
    """Text of 4-byte characters fills a page four times faster than ASCII: the budget is bytes, on
    both backends alike."""
    await _agent_and_conversation(store)
    for _ in range(4):
        await store.append_messages("conv_1", [MessageRecord(role="user", content="😀" * 250)])  # ~1,000 bytes each
    page, more = await store.history_page("conv_1", before_id=None, limit=10, max_bytes=2500)
    assert len(page) == 3 and more, [len(m.text()) for m in page]
