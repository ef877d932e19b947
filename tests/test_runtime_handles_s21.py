"""A live turn's handle is never forgotten: with more queued turns than the board keeps settled
ones (`RECENT_HANDLES`), every queued turn still has its handle, and each one that pauses for an
approval is the runtime's `active_handle`, so a watcher sees its pending calls and can answer them.

Before the fix `TurnQueue._queue_accepted` remembered a new turn's handle before putting the turn in
the queue: with the board full of live turns the trim dropped the new handle at once, the turn ran
and paused with `active_handle` None, and no new client could see or answer its approval."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from appserver.runtime import SubmitRequest
from appserver.runtime.board import RECENT_HANDLES
from appserver.runtime.handle import Decision
from appserver.server import Server
from tests.support.kernel import open_server

QUEUED = RECENT_HANDLES + 4


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    s = await open_server(tmp_path / "home")
    await s.agents.update("assistant", tools={"clock": "ask"})
    yield s
    await s.close()


async def test_queued_turns_beyond_the_recent_handles_keep_their_handles_and_pauses(server: Server) -> None:
    kernel = server.kernel
    first = await kernel.submit(SubmitRequest(agent="assistant", input="/call clock {}", conversation="new"))
    snap = await first.wait(30)
    assert snap.status == "awaiting"
    conv = first.conversation_id
    # While the first turn waits for its approval, the others wait in the queue.
    subs = [first]
    for _ in range(QUEUED):
        subs.append(await kernel.submit(SubmitRequest(agent="assistant", input="/call clock {}", conversation=conv)))
    rt = kernel.runtimes[conv]
    assert len(rt.queue) == QUEUED
    missing = [s.turn_id for s in subs if s.turn_id not in rt.handles]
    assert not missing, f"live turns without a handle: {missing}"
    assert all(rt.handles[s.turn_id] is s.handle for s in subs)

    seen: list[str] = []
    async with kernel.watch(conv, lambda h: seen.append(h.turn_id)) as view:
        for sub in subs:
            snap = await sub.wait(30)
            assert snap.status == "awaiting", snap
            # the paused turn is the one a new client finds, with its call to answer
            active = view.active_handle
            assert active is not None and active.turn_id == sub.turn_id
            pending = active.controller.snapshot().pending
            assert len(pending) == 1
            got = await kernel.respond(conv, [Decision(pending[0]["call_id"], "approve")])
            assert got[0]["accepted"] is True, got
            # answered: the turn resumes, and the board still holds every turn that is not over
            live = {*rt.queue.turn_ids(), rt.lifecycle.turn_id} - {None}
            assert live <= set(rt.handles)
            done = await sub.handle.wait_settled(30, after_revision=snap.revision)
            assert done.status == "completed", done
    assert rt.lifecycle.state == "idle"


async def test_an_unknown_or_late_answer_publishes_nothing(server: Server) -> None:
    kernel = server.kernel
    sub = await kernel.submit(SubmitRequest(agent="assistant", input="/call clock {}", conversation="new"))
    snap = await sub.wait(30)
    assert snap.status == "awaiting" and len(snap.pending) == 1
    conv = sub.conversation_id
    got = await kernel.respond(conv, [Decision("call_unknown", "approve")])
    assert got[0]["error"] == "unknown_call"
    again = sub.handle.controller.snapshot()
    assert again.revision == snap.revision and again.pending == snap.pending
    # a real answer still resumes the turn
    got = await kernel.respond(conv, [Decision(snap.pending[0]["call_id"], "approve")])
    assert got[0]["accepted"] is True
    assert (await sub.handle.wait_settled(30, after_revision=snap.revision)).status == "completed"
