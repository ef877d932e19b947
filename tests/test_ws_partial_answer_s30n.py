"""A call answered while its turn still waits for another one shows how it was answered.

A turn pauses on two approval calls (two `/call clock` lines: the echo model makes both in one
step) and one `approval_response` answers only the first. `pending` then drops it, and its
`tool_call` block says `approved` (or `denied`) at once, as a whole-snapshot renderer needs: in
the `turn_updated` published after the answer, in a new subscriber's `conversation_state`, and in
the snapshot a restarted server rebuilds from the store. Before, the block still said
`pending_approval` until the last call was answered. Answering the other call then finishes the
turn as usual. A client call answered first (its result given while an approval of the same step
waits) shows `completed` with that result as its output. Through a real `appserver serve`
(SQLite on disk) and real WebSocket clients.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import careful_home, cli_env
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

TWO_CALLS = '/call clock {}\n/call clock {"tz": "UTC"}'
LOOKUP = {
    "name": "lookup",
    "description": "Look something up on the client.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}


def _serve(home: Path) -> ServeProcess:
    """`serve` on a port of 56000-56499, or the next ones while one is taken."""
    return start_serve_at(home, 56011, cli_env(home), last=56490, step=13)


def _calls(snap: dict[str, Any]) -> dict[str, str]:
    """call id → the status its tool_call block shows."""
    return {b["call_id"]: b["status"] for b in snap["blocks"] if b["type"] == "tool_call"}


async def _paused_on_two(ws: WS) -> tuple[str, str, list[str]]:
    """A new conversation's turn paused on two approvals: (conversation, turn, the two call ids)."""
    ack = await ws.request({"type": "submit_input", "agent": "careful", "conversation": "new", "input": TWO_CALLS})
    frame = await ws.expect(
        lambda f: (
            f["type"] == "turn_updated"
            and f["snapshot"]["turn_id"] == ack["turn_id"]
            and f["snapshot"]["status"] == "awaiting"
        )
    )
    calls = [p["call_id"] for p in frame["snapshot"]["pending"]]
    assert len(calls) == 2, frame
    assert _calls(frame["snapshot"]) == {c: "pending_approval" for c in calls}
    return ack["conversation_id"], ack["turn_id"], calls


async def _answer_first(ws: WS, conv: str, turn: str, calls: list[str], decision: str, shown: str) -> None:
    """Answer only the first call: the next snapshot drops it from `pending` and its block shows
    `shown`; the other still waits."""
    ack = await ws.request(
        {"type": "approval_response", "conversation": conv, "decisions": [{"call_id": calls[0], "decision": decision}]}
    )
    assert ack["results"][0]["accepted"] is True, ack
    frame = await ws.expect(
        lambda f: (
            f["type"] == "turn_updated"
            and f["snapshot"]["turn_id"] == turn
            and [p["call_id"] for p in f["snapshot"]["pending"]] == calls[1:]
        )
    )
    snap = frame["snapshot"]
    assert snap["status"] == "awaiting"
    assert _calls(snap) == {calls[0]: shown, calls[1]: "pending_approval"}, snap["blocks"]
    answered = next(b for b in snap["blocks"] if b.get("call_id") == calls[0])
    assert answered["output"] is None  # what it returns comes when the turn runs (or closes) it


async def _state_shows(url: str, conv: str, turn: str, calls: list[str], shown: str) -> None:
    """A new subscriber's `conversation_state` shows the same as the published snapshot."""
    ws = await WS.open(url)
    try:
        state = await ws.request({"type": "subscribe", "conversation": conv})
        active = state["active_turn"]
        assert state["state"] == "awaiting" and active["turn_id"] == turn
        assert [p["call_id"] for p in active["pending"]] == calls[1:]
        assert [p["call_id"] for p in state["pending_approvals"]] == calls[1:]
        assert _calls(active) == {calls[0]: shown, calls[1]: "pending_approval"}, active["blocks"]
    finally:
        await ws.close()


async def _finish(url: str, conv: str, turn: str, calls: list[str], first: str) -> None:
    """Deny the call still waiting: the turn completes, the first call as it was answered."""
    ws = await WS.open(url)
    try:
        await ws.request({"type": "subscribe", "conversation": conv})
        deny = [{"call_id": calls[1], "decision": "deny"}]
        ack = await ws.request({"type": "approval_response", "conversation": conv, "decisions": deny})
        assert ack["results"][0]["accepted"] is True, ack
        snap = await ws.terminal(turn)
        assert snap["status"] == "completed"
        assert _calls(snap) == {calls[0]: first, calls[1]: "denied"}, snap["blocks"]
        assert all(b["output"] for b in snap["blocks"] if b["type"] == "tool_call")
    finally:
        await ws.close()


async def _client_result_first(url: str) -> None:
    """A step with a client call and an approval: the client's result, given first, is its block's
    output at once (`completed`), while the approval still waits; approving it finishes the turn."""
    ws = await WS.open(url)
    try:
        ack = await ws.request(
            {
                "type": "submit_input",
                "agent": "careful",
                "conversation": "new",
                "input": '/call lookup {"q": "x"}\n/call clock {}',
                "client_tools": [LOOKUP],
            }
        )
        conv, turn = ack["conversation_id"], ack["turn_id"]
        for kind in ("tool_call_request", "approval_request"):  # both come, in either order
            if not any(f["type"] == kind for f in ws.seen):
                await ws.expect(lambda f, kind=kind: f["type"] == kind)
        asked = next(f for f in ws.seen if f["type"] == "tool_call_request")
        approval = next(f for f in ws.seen if f["type"] == "approval_request")
        reply = await ws.request({"type": "tool_result", "call_id": asked["call_id"], "output": "x is 42"})
        assert reply["results"][0]["accepted"] is True, reply
        frame = await ws.expect(
            lambda f: (
                f["type"] == "turn_updated"
                and f["snapshot"]["turn_id"] == turn
                and [p["call_id"] for p in f["snapshot"]["pending"]] == [approval["call_id"]]
            )
        )
        snap = frame["snapshot"]
        assert _calls(snap) == {asked["call_id"]: "completed", approval["call_id"]: "pending_approval"}
        answered = next(b for b in snap["blocks"] if b.get("call_id") == asked["call_id"])
        assert answered["output"] == "x is 42" and answered["is_error"] is False
        await ws.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": approval["call_id"], "decision": "approve"}],
            }
        )
        snap = await ws.terminal(turn)
        assert snap["status"] == "completed"
        assert _calls(snap) == {asked["call_id"]: "completed", approval["call_id"]: "completed"}
    finally:
        await ws.close()


def test_answered_call_block_shows_its_answer_while_the_other_waits(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    sp = _serve(home)
    try:

        async def before_restart() -> list[tuple[str, str, list[str]]]:
            ws = await WS.open(sp.url)
            try:
                paused = []
                for decision, shown in (("approve", "approved"), ("deny", "denied")):
                    conv, turn, calls = await _paused_on_two(ws)
                    await _answer_first(ws, conv, turn, calls, decision, shown)
                    await _state_shows(sp.url, conv, turn, calls, shown)
                    paused.append((conv, turn, calls))
                await _client_result_first(sp.url)
                return paused
            finally:
                await ws.close()

        (approved, denied) = asyncio.run(before_restart())
        assert sp.stop() == 0
        sp = _serve(home)

        async def after_restart() -> None:
            # rebuilt from the store: the answered block still shows its answer, not pending
            await _state_shows(sp.url, *approved, "approved")
            await _state_shows(sp.url, *denied, "denied")
            await _finish(sp.url, *approved, "completed")  # the approved call ran
            await _finish(sp.url, *denied, "denied")

        asyncio.run(after_restart())
    finally:
        stop_all(sp)
