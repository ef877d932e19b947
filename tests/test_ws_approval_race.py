"""Issue 14.1: an approval answer and a `cancel`, back to back on one connection, settle the call
exactly once, and the cancel ack tells the truth. Hammered over a real WebSocket against a real
`appserver serve`. Issue 14.5: the approval hint of `appserver run` works as printed."""

from __future__ import annotations

import asyncio
import itertools
import re
import shlex
import sqlite3
from pathlib import Path
from typing import Any

from tests.support.cli import careful_home, cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.ws import WS

ROUNDS_PER_CONNECTION = 12
CONNECTIONS = 4
COMBOS = list(itertools.product(("approve", "deny"), ("answer_first", "cancel_first")))


def _turn_status(home: Path, turn_id: str) -> str:
    with sqlite3.connect(home / "appserver.db") as c:
        return c.execute("SELECT status FROM turns WHERE id=?", (turn_id,)).fetchone()[0]


async def _one_round(ws: WS, decision: str, order: str) -> dict[str, Any]:
    ack = await ws.request(
        {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
    )
    conv, turn_id = ack["conversation_id"], ack["turn_id"]
    req = await ws.expect(lambda f: f["type"] == "approval_request" and f["turn_id"] == turn_id)
    answer = {
        "type": "approval_response",
        "conversation": conv,
        "decisions": [{"call_id": req["call_id"], "decision": decision}],
        "request_id": f"a-{turn_id}",
    }
    cancel = {"type": "cancel", "conversation": conv, "request_id": f"c-{turn_id}"}
    first, second = (answer, cancel) if order == "answer_first" else (cancel, answer)
    await ws.send(first)
    await ws.send(second)  # back to back: no wait for the first reply
    replies: dict[str, dict[str, Any]] = {}
    while len(replies) < 2:
        f = await ws.recv()
        if f.get("request_id") in (answer["request_id"], cancel["request_id"]):
            replies[f["request_id"]] = f
    snap = await ws.terminal(turn_id)
    history = (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
    return {
        "turn_id": turn_id,
        "call_id": req["call_id"],
        "answer": replies[answer["request_id"]],
        "cancel": replies[cancel["request_id"]],
        "snap": snap,
        "history": history,
        "decision": decision,
    }


def _check(home: Path, r: dict[str, Any]) -> str:
    """Exactly one outcome per call, and every view of the turn agrees on it. Returns the outcome."""
    snap, history, cancel_ack, answer = r["snap"], r["history"], r["cancel"], r["answer"]
    tools = [m for m in history if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == [r["call_id"]], history  # one result, for that call
    assert cancel_ack["type"] == "ack", cancel_ack
    status = snap["status"]
    assert status in ("completed", "cancelled"), snap
    # the ack tells the truth, and the store agrees with the snapshot
    assert cancel_ack["cancelled"] is (status == "cancelled"), (cancel_ack, snap)
    assert _turn_status(home, r["turn_id"]) == status
    replies = [m for m in history if m["role"] == "assistant" and not m.get("tool_calls")]
    if status == "completed":
        # the answer won: it was accepted, and the turn ran to its end with that answer
        assert answer["type"] == "ack" and answer["results"][0]["accepted"] is True, answer
        assert len(replies) == 1 and replies[0]["completion_status"] == "completed", history
        if r["decision"] == "approve":
            assert tools[0]["content"].startswith("20") and not tools[0]["is_error"], tools
        else:
            assert "denied" in tools[0]["content"] and tools[0]["is_error"], tools
    else:
        # the cancel won: nothing of the turn after it claims to be completed
        assert all(m["completion_status"] == "cancelled" for m in replies), history
        if answer["type"] == "ack" and answer["results"][0]["accepted"]:
            pass  # the answer was recorded first; the call then ran (or not) and the turn stopped
        else:
            assert answer["type"] == "error" or answer["results"][0]["error"] == "already_resolved", answer
            assert tools[0]["is_error"] and "cancel" in tools[0]["content"], tools
    return f"{r['decision']}:{status}"


def test_approval_and_cancel_back_to_back_settle_each_call_once(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    sp = start_serve(home, env=cli_env(home))

    async def client(n: int) -> list[dict[str, Any]]:
        ws = await WS.open(sp.url)
        out = []
        try:
            for i in range(ROUNDS_PER_CONNECTION):
                decision, order = COMBOS[(i + n) % len(COMBOS)]
                out.append(await _one_round(ws, decision, order))
        finally:
            await ws.close()
        return out

    async def go() -> list[dict[str, Any]]:
        rounds = await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(CONNECTIONS))), 60)
        return [r for rs in rounds for r in rs]

    try:
        results = asyncio.run(go())
    finally:
        sp.stop()
    outcomes = [_check(home, r) for r in results]
    assert len(outcomes) == CONNECTIONS * ROUNDS_PER_CONNECTION
    # both frames win sometimes: the race is really exercised, not one side every time
    assert any(o.endswith(":cancelled") for o in outcomes), outcomes


# ---------------------------------------------------------------- 14.5: the hint of `appserver run`


def test_run_approval_hint_works_as_printed_for_a_non_default_agent(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    paused = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "/call clock {}")
    assert paused.code == 0, paused.err
    call_id = re.search(r"awaiting approval: (\S+) clock", paused.out).group(1)  # type: ignore[union-attr]
    hint = re.search(r"answer with: (appserver run .*?--approve) CALL_ID", paused.out)
    assert hint is not None, paused.out
    args = shlex.split(hint.group(1))[1:] + [call_id, "--json"]
    done = run_cli(home, *args)  # no server runs: the hint must name the agent itself
    assert done.code == 0, (args, done.err)
    assert done.json()["status"] == "completed" and done.json()["text"].startswith("clock -> 20")
