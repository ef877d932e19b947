"""Issue 14.1, the class of the bug: a `cancel` landing at any point of a turn (before it runs, in
the model call, while a server tool's call is being stored, while a pause is being saved, while
paused, right after an answer) gives every tool call exactly one result, stores each message once,
and returns True exactly when the turn ends cancelled. In-process kernel on a real SQLite file."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from appserver.config import load_config
from appserver.runtime import Decision, SubmitRequest, TurnSnapshot
from appserver.server import Server

LOOP_PASSES = range(0, 30)  # where the cancel lands: after this many event-loop passes


async def _settled(server: Server, sub, cancelled: bool, after: int = -1) -> TurnSnapshot:  # type: ignore[no-untyped-def]
    snap = await sub.handle.wait_settled(5, after_revision=after)
    while snap.status == "awaiting" and cancelled:  # a cancel accepted while the pause was saved
        snap = await sub.handle.wait_settled(5, after_revision=snap.revision)
    return snap


async def _check_history(server: Server, conversation_id: str) -> None:
    messages = await server.store.list_messages(conversation_id)
    calls = [c["id"] for m in messages if m.role == "assistant" for c in m.tool_calls]
    results = [m.tool_call_id for m in messages if m.role == "tool"]
    assert sorted(calls) == sorted(results) and len(set(results)) == len(results), [m.to_dict() for m in messages]
    assert len([m for m in messages if m.role == "user"]) == 1


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_cancel_anywhere_in_a_turn_settles_each_call_once_and_says_the_truth(tmp_path: Path) -> None:
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    kernel = server.kernel
    seen: Counter[str] = Counter()
    try:
        await server.agents.create("runner", "echo", tools={"clock": "allow"})
        await server.agents.create("careful", "echo", tools={"clock": "ask"})
        for agent in ("runner", "careful"):
            for n in LOOP_PASSES:
                sub = await kernel.submit(SubmitRequest(agent=agent, input="/call clock {}", conversation="new"))
                await _passes(n)
                cancelled = await kernel.cancel(sub.conversation_id)
                snap = await _settled(server, sub, cancelled)
                if cancelled:
                    assert snap.status == "cancelled", (agent, n, snap)
                else:
                    assert snap.status in ("completed", "awaiting"), (agent, n, snap)
                if snap.status == "awaiting":  # paused before the cancel: cancel it now
                    assert await kernel.cancel(sub.conversation_id) is True
                    snap = await _settled(server, sub, True)
                    assert snap.status == "cancelled"
                turn = await server.store.get_turn(sub.turn_id)
                assert turn is not None and turn.status == snap.status
                await _check_history(server, sub.conversation_id)
                seen[f"{agent}:{n}:{snap.status}"] += 1
        # answers and cancels of a paused turn, back to back in both orders, in one event-loop pass
        for decision in ("approve", "deny"):
            for answer_first in (True, False):
                for n in (0, 1, 3):
                    sub = await kernel.submit(
                        SubmitRequest(agent="careful", input="/call clock {}", conversation="new")
                    )
                    paused = await sub.handle.wait_settled(5)
                    call_id = paused.pending[0]["call_id"]
                    answer = kernel.respond(sub.conversation_id, [Decision(call_id, decision)])
                    if answer_first:
                        results = await answer
                        await _passes(n)
                        cancelled = await kernel.cancel(sub.conversation_id)
                    else:
                        cancelled = await kernel.cancel(sub.conversation_id)
                        await _passes(n)
                        try:
                            results = await answer
                        except Exception:  # NotAwaiting: the turn is no longer waiting
                            results = [{"accepted": False}]
                    snap = await _settled(server, sub, cancelled, after=paused.revision)
                    assert snap.status == ("cancelled" if cancelled else "completed"), (decision, answer_first, n, snap)
                    assert results[0]["accepted"] is (answer_first or not cancelled)
                    await _check_history(server, sub.conversation_id)
                    seen[f"answer:{answer_first}:{snap.status}"] += 1
    finally:
        await server.close()
    # the cancel really landed in different places
    statuses = {k.rsplit(":", 1)[1] for k in seen}
    assert {"cancelled", "completed"} <= statuses, seen
