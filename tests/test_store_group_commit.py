"""The store's fast paths keep their guarantees: group commit stays all-or-nothing per turn, the agent
cache sees every writer, and a submit cancelled around its commit never leaves an orphan turn."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from appserver.config import load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store import (
    AgentRecord,
    ConversationRecord,
    MessageRecord,
    PendingCall,
    SQLiteStore,
    TurnCommit,
    TurnRecord,
)
from appserver.store.agentcache import RECHECK_S


@pytest.fixture
async def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = SQLiteStore(tmp_path / "store.db")
    await s.open()
    yield s
    await s.close()


async def _conversation_with_turns(store: SQLiteStore, n: int) -> list[TurnRecord]:
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
    turns = [TurnRecord(id=f"turn_{i}", conversation_id="conv_1", agent_id="agt_1", status="running") for i in range(n)]
    for t in turns:
        await store.accept_turn(t)
    return turns


def _commit(turn_id: str, text: str, pending: list[PendingCall] | None = None) -> TurnCommit:
    status = "awaiting" if pending else "completed"
    return TurnCommit(
        turn_id,
        status,
        "requires_approval" if pending else "end_turn",
        [
            MessageRecord(role="user", content=text),
            MessageRecord(role="assistant", content=f"echo: {text}"),
        ],
        pending=pending or [],
    )


async def test_group_commit_is_one_transaction_yet_all_or_nothing_per_turn(
    store: SQLiteStore,
) -> None:
    ok, bad, ok2 = await _conversation_with_turns(store, 3)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    twice = [
        PendingCall("call_x", "conv_1", bad.id, "clock", "{}", "approval"),
        PendingCall("call_x", "conv_1", bad.id, "clock", "{}", "approval"),
    ]
    results = await asyncio.gather(
        store.commit_turn("conv_1", _commit(ok.id, "one")),
        store.commit_turn("conv_1", _commit(bad.id, "two", twice)),  # duplicate primary key: fails
        store.commit_turn("conv_1", _commit(ok2.id, "three")),
        return_exceptions=True,
    )
    store.db.set_trace_callback(None)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert [s for s in statements if s.startswith("COMMIT")] == ["COMMIT"], (
        "three concurrent commits should share one transaction"
    )
    # the failure undid the group, which ran again with a savepoint per job
    assert [s for s in statements if s.startswith(("BEGIN", "ROLLBACK", "COMMIT"))] == [
        "BEGIN IMMEDIATE",
        "ROLLBACK",
        "BEGIN IMMEDIATE",
        "ROLLBACK TO turn_commit",
        "COMMIT",
    ]
    texts = [m.text() for m in await store.list_messages("conv_1")]
    assert texts == ["one", "echo: one", "three", "echo: three"], "the failed turn must leave no rows behind"
    assert (await store.get_turn(ok.id)).status == "completed"  # type: ignore[union-attr]
    assert (await store.get_turn(bad.id)).status == "running"  # type: ignore[union-attr]
    assert await store.list_pending(bad.id) == []


async def test_a_group_without_failures_runs_no_savepoints(store: SQLiteStore) -> None:
    a, b, c = await _conversation_with_turns(store, 3)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    await asyncio.gather(*(store.commit_turn("conv_1", _commit(t.id, t.id)) for t in (a, b, c)))
    store.db.set_trace_callback(None)
    assert [s for s in statements if s.startswith(("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "COMMIT"))] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    assert len(await store.list_messages("conv_1")) == 6


async def test_a_failed_group_commit_reports_every_turn_failed(store: SQLiteStore) -> None:
    a, b = await _conversation_with_turns(store, 2)
    other = sqlite3.connect(str(store.path), timeout=0.1)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    store.db.execute("PRAGMA busy_timeout=50")
    try:
        results = await asyncio.gather(
            store.commit_turn("conv_1", _commit(a.id, "x")),
            store.commit_turn("conv_1", _commit(b.id, "y")),
            return_exceptions=True,
        )
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert all(isinstance(r, sqlite3.OperationalError) for r in results), results
    assert await store.list_messages("conv_1") == []
    await store.commit_turn("conv_1", _commit(a.id, "again"))  # the store is usable afterwards
    assert [m.text() for m in await store.list_messages("conv_1")] == ["again", "echo: again"]


async def test_a_failed_write_nobody_waits_for_is_logged_and_the_rest_commits(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A deferred write (a new conversation's row, a history point) that fails is logged when its
    group commits; the other writes of the group still commit, and no future is left unretrieved."""
    (a,) = await _conversation_with_turns(store, 1)

    def broken(tx: sqlite3.Connection) -> None:
        tx.execute("INSERT INTO no_such_table VALUES (1)")

    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    caplog.set_level("ERROR", logger="appserver.store")
    deferred = store._writes.submit(broken, defer=True)
    await store.commit_turn("conv_1", _commit(a.id, "kept"))
    assert deferred.done() and deferred.result() is None  # nobody waits: the failure is in the log
    assert [m.text() for m in await store.list_messages("conv_1")] == ["kept", "echo: kept"]
    assert any("a queued write failed" in r.getMessage() and "no_such_table" in r.getMessage() for r in caplog.records)
    del deferred
    import gc

    gc.collect()
    assert unretrieved == []
    assert not store._writes._unwatched


async def test_agent_cache_sees_other_writers_and_hands_out_copies(store: SQLiteStore) -> None:
    await store.create_agent(AgentRecord(id="agt_1", name="a", params={"stop": ["x"]}))
    first = await store.get_agent("agt_1")
    assert first is not None
    first.name = "edited in memory only"
    first.params["stop"].append("y")
    again = await store.get_agent("agt_1")
    assert again is not None and again.name == "a" and again.params == {"stop": ["x"]}, (
        "a caller's edits leaked into the cache"
    )
    # another process (its own connection) renames the agent and adds one
    other = sqlite3.connect(str(store.path))
    other.execute("UPDATE agents SET name='renamed' WHERE id='agt_1'")
    other.execute("INSERT INTO agents(id, name, model, created_at, updated_at) VALUES ('agt_2', 'b', 'echo', 1, 1)")
    other.commit()
    other.close()
    await asyncio.sleep(2 * RECHECK_S)  # the cache looks at the data version at most once a millisecond
    assert [a.name for a in await store.find_agents("renamed")] == ["renamed"]
    assert {a.id for a in await store.list_agents()} == {"agt_1", "agt_2"}
    # our own writes
    await store.delete_agent("agt_2")
    assert await store.get_agent("agt_2") is None
    renamed = await store.get_agent("agt_1")
    assert renamed is not None
    renamed.model = "echo:other"
    await store.update_agent(renamed)
    assert (await store.find_agents("agt_1"))[0].model == "echo:other"


async def test_submit_cancelled_around_its_commit_leaves_no_orphan_turn(tmp_path: Path) -> None:
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    try:
        kernel = server.kernel
        loop = asyncio.get_running_loop()
        warm = await kernel.submit(SubmitRequest(agent="assistant", input="warm", conversation="new"))
        await warm.wait(5)
        conv = warm.conversation_id

        # Cancelled before the group commit ran: nothing is written, the conversation stays usable.
        early = asyncio.create_task(kernel.submit(SubmitRequest(agent="assistant", input="never", conversation=conv)))
        await asyncio.sleep(0)  # the submit queues its accept and waits for the group commit
        early.cancel()
        with pytest.raises(asyncio.CancelledError):
            await early
        # Cancelled after the commit landed but before the submit resumed: the turn still runs.
        late = asyncio.create_task(kernel.submit(SubmitRequest(agent="assistant", input="landed", conversation=conv)))
        await asyncio.sleep(0)  # the submit queues its accept for a group commit of its own

        def cancel_once_committed(statement: str) -> None:
            if statement == "COMMIT":  # queued before the commit's futures wake `late`
                loop.call_soon(late.cancel)

        server.store.db.set_trace_callback(cancel_once_committed)
        try:
            with pytest.raises(asyncio.CancelledError):
                await late
        finally:
            server.store.db.set_trace_callback(None)
        after = await kernel.submit(SubmitRequest(agent="assistant", input="/recall", conversation=conv))
        snap = await after.wait(5)
        assert snap.text() == "warm | landed"
        turns = await server.store.list_turns(conv)
        assert [t.input["content"] for t in turns] == ["warm", "landed", "/recall"]
        assert all(t.status == "completed" for t in turns)
        assert kernel.runtimes[conv].idle
    finally:
        await server.close()


async def test_checkpoints_run_on_their_own_thread_and_stop_with_the_store(tmp_path: Path) -> None:
    from appserver.store.checkpointer import CHECKPOINT_EVERY_COMMITS

    store = SQLiteStore(tmp_path / "store.db")
    await store.open()
    thread = store._checkpointer
    assert thread is not None and thread.is_alive()
    db_file = tmp_path / "store.db"
    before = db_file.stat().st_size
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
    for i in range(CHECKPOINT_EVERY_COMMITS + 1):  # one commit each
        await store.append_messages("conv_1", [MessageRecord(role="user", content=f"m{i}")])
    deadline = asyncio.get_running_loop().time() + 5
    while db_file.stat().st_size <= before:  # pages copied from the WAL into the database file
        assert asyncio.get_running_loop().time() < deadline, "no checkpoint within 5 s"
        await asyncio.sleep(0.02)
    await store.close()
    assert not thread.is_alive()
    check = sqlite3.connect(str(db_file))
    assert check.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == CHECKPOINT_EVERY_COMMITS + 1
    check.close()


async def test_a_new_conversation_commits_with_its_first_turn_and_is_never_invisible(
    store: SQLiteStore,
) -> None:
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
    await store.accept_turn(TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1"))
    store.db.set_trace_callback(None)
    assert [s for s in statements if s.startswith(("BEGIN", "COMMIT"))] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    # A conversation nobody writes to right away: our reads see it at once, others once the loop
    # runs dry after the second pass (a turn started in the first may reach its model call before
    # the write commits), or within the group window while the loop stays busy.
    await store.create_conversation(ConversationRecord(id="conv_2", agent_id="agt_1"))
    found = await store.get_conversation("conv_2")
    assert found is not None and found.agent_id == "agt_1"
    await store.create_conversation(ConversationRecord(id="conv_3", agent_id="agt_1"))
    other = sqlite3.connect(str(store.path))
    await asyncio.sleep(0)
    assert other.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 2  # not alone in a pass
    await asyncio.sleep(0.001)  # the loop runs dry (its only task sleeps): committed, within 1 ms
    assert other.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 3
    other.close()


async def test_a_group_stays_open_while_the_loop_is_busy_but_no_longer_than_its_window(
    store: SQLiteStore,
) -> None:
    from appserver.store.groupcommit import GROUP_WINDOW_S

    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
    commits: list[str] = []
    store.db.set_trace_callback(lambda s: commits.append(s) if s == "COMMIT" else None)
    loop = asyncio.get_running_loop()
    busy_until = loop.time() + 1.0  # the loop never runs dry for a second, as under load

    # Two concurrent writers through the group: each waits for its own commit.
    async def writer(tag: str) -> float:
        start = loop.time()
        await store.save_draft(f"turn_{tag}", {"text": tag})
        return loop.time() - start

    spin = asyncio.create_task(_spin(loop, busy_until))
    waits = await asyncio.gather(*(writer(str(i)) for i in range(20)))
    await spin
    store.db.set_trace_callback(None)
    assert len(commits) == 1  # twenty writes, one group, though the loop never ran dry
    # committed by the window, not earlier (the loop was never idle), nor once the loop went idle
    assert 0.9 * GROUP_WINDOW_S <= max(waits) < 0.5


async def _spin(loop: asyncio.AbstractEventLoop, until: float) -> None:
    while loop.time() < until:
        await asyncio.sleep(0)


async def test_cancel_lands_in_the_loop_and_the_same_worker_runs_the_next_turn(
    tmp_path: Path,
) -> None:
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    try:
        kernel = server.kernel
        slow = await kernel.submit(SubmitRequest(agent="assistant", input="/slow 300", conversation="new"))
        queued = await kernel.submit(SubmitRequest(agent="assistant", input="after", conversation=slow.conversation_id))
        assert queued.queue_position == 1
        ctl = slow.handle.controller
        seen = -1
        while "w2" not in ctl.visible_text():
            seen = (await ctl.next_snapshot(seen, 5)).revision
        worker = kernel.runtimes[slow.conversation_id]._worker
        assert await kernel.cancel(slow.conversation_id)
        assert (await slow.wait(5)).status == "cancelled"
        done = await queued.wait(5)
        assert done.status == "completed" and done.text() == "echo: after"
        assert worker is not None and worker.done() and not worker.cancelled()
        assert kernel.runtimes[slow.conversation_id].idle
    finally:
        await server.close()
