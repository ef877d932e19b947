"""One function finishes a turn (runtime/finish.py `finish_turn`): every end commits, settles and
publishes through it, so every end reaches the settle listeners: a crash-settled turn, a turn
whose commit failed. And the store registers its own readiness check."""

from __future__ import annotations

from pathlib import Path

import pytest

from appserver.readiness import Readiness
from appserver.runtime import SubmitRequest, TurnSnapshot
from appserver.server import Server
from appserver.store.records import TurnCommit, TurnRecord
from tests.support.kernel import open_server

DEAD_OWNER = "999999999:1"  # no such process


@pytest.fixture
async def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = await open_server(tmp_path / "home")
    yield s
    await s.close()


def listen(server: Server) -> list[tuple[TurnRecord, TurnSnapshot]]:
    seen: list[tuple[TurnRecord, TurnSnapshot]] = []
    server.kernel.on_settled(lambda record, snap: seen.append((record, snap)))
    return seen


async def left_running(server: Server, text: str) -> TurnRecord:
    """A turn a dead process accepted and began, then died."""
    first = await server.kernel.submit(SubmitRequest(agent="assistant", input="hello", conversation="new"))
    await first.wait(5)
    turn = TurnRecord(
        id="turn_crashed",
        conversation_id=first.conversation_id,
        agent_id=first.agent_id,
        status="running",
        owner=DEAD_OWNER,
        input={"content": text},
    )
    await server.store.accept_turn(turn)
    return turn


async def test_crash_settle_finishes_the_turn_through_the_one_door(server: Server) -> None:
    turn = await left_running(server, "lost in the crash")
    seen = listen(server)
    assert await server.kernel.settle_crashed(requeue=False) == 1
    [(record, snap)] = seen
    assert record.id == turn.id and record.status == "interrupted"
    assert (snap.status, snap.stop_reason, snap.phase) == ("cancelled", "cancelled", "finalizing")
    assert snap.error is not None and snap.error["kind"] == "interrupted"
    stored = await server.store.get_turn(turn.id)
    assert stored is not None and stored.status == "interrupted"
    # Published above any revision the dead process may have sent and never stored (restore.py
    # `restart_revision`, the clock), and stored as published (a PostgreSQL BIGINT column).
    assert stored.revision == snap.revision and snap.revision > 10**15
    messages = await server.store.list_messages(turn.conversation_id)
    assert [m.text() for m in messages if m.turn_id == turn.id] == ["lost in the crash"]
    # The settled turn reads back as it was published, never at a lower revision.
    again = await server.kernel.turn_snapshot(turn.id)
    assert again.status == "cancelled" and again.revision == snap.revision


async def test_crash_settle_whose_commit_fails_still_fails_the_start(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    turn = await left_running(server, "x")

    async def broken(conversation_id: str, commit: TurnCommit) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(server.store, "commit_turn", broken)
    with pytest.raises(OSError, match="disk on fire"):
        await server.kernel.settle_crashed(requeue=False)
    monkeypatch.undo()
    stored = await server.store.get_turn(turn.id)
    assert stored is not None and stored.status == "running"  # settled at the next start


async def test_a_turn_whose_commit_fails_ends_failed_and_is_reported_settled(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await server.kernel.submit(SubmitRequest(agent="assistant", input="one", conversation="new"))
    await first.wait(5)
    conv = first.conversation_id
    seen = listen(server)
    real = server.store.commit_turn

    async def broken_once(conversation_id: str, commit: TurnCommit) -> None:
        monkeypatch.setattr(server.store, "commit_turn", real)
        raise OSError("disk on fire")

    monkeypatch.setattr(server.store, "commit_turn", broken_once)
    sub = await server.kernel.submit(SubmitRequest(agent="assistant", input="two", conversation=conv))
    snap = await sub.wait(5)
    assert (snap.status, snap.stop_reason) == ("failed", "error")
    assert snap.error is not None and snap.error["kind"] == "store" and "disk on fire" in snap.error["message"]
    assert [(r.id, r.status) for r, _ in seen] == [(sub.turn_id, "failed")]
    assert not server.kernel.in_flight(conv)
    # The runtime read its history again: the next turn sees only what was stored.
    after = await server.kernel.submit(SubmitRequest(agent="assistant", input="three", conversation=conv))
    assert (await after.wait(5)).status == "completed"
    texts = [m.text() for m in await server.store.list_messages(conv) if m.role == "user"]
    assert texts == ["one", "three"]


async def test_the_store_registers_its_own_write_check(server: Server) -> None:
    assert server.readiness.names[0] == "store"
    readiness = Readiness()
    server.store.register_readiness(readiness)
    assert readiness.names == ["store"]
    ready, body = await readiness.report()
    assert ready and body["checks"][0]["name"] == "store" and body["checks"][0]["detail"].startswith("writable")
    full = Readiness()
    server.store.register_readiness(full, min_free_bytes=1 << 62)
    ready, body = await full.report()
    assert not ready and "disk nearly full" in body["checks"][0]["detail"]
