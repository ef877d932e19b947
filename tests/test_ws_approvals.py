"""Issue 5 acceptance 3 (approval fan-out, first answer wins) and 4 (pending approval survives a
disconnect and a restart)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import careful_home, cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS


@pytest.fixture(scope="module")
def careful_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One server for the tests that only open their own conversations on it."""
    home = careful_home(tmp_path_factory.mktemp("approvals"))
    with serving(home, env=cli_env(home)) as sp:
        yield sp


def test_approval_reaches_exactly_the_subscribers_first_answer_wins(careful_server: ServeProcess) -> None:
    sp = careful_server

    async def go() -> None:
        a, b, c = await WS.open(sp.url), await WS.open(sp.url), await WS.open(sp.url)
        conv = (await a.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
        other = (await c.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
        assert (await c.request({"type": "subscribe", "conversation": other}))["subscribed"] is True
        await a.request({"type": "subscribe", "conversation": conv})
        await b.request({"type": "subscribe", "conversation": conv})
        ack = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": conv, "input": "/call clock {}"}
        )
        req_a = await a.expect(lambda f: f["type"] == "approval_request")
        req_b = await b.expect(lambda f: f["type"] == "approval_request")
        assert req_a["call_id"] == req_b["call_id"] and req_a["name"] == "clock" and req_a["turn_id"] == ack["turn_id"]
        call_id = req_a["call_id"]
        # the awaiting snapshot (sent just before the request) shows the pending call as well
        awaiting = [f for f in b.seen if f["type"] == "turn_updated" and f["snapshot"]["status"] == "awaiting"]
        assert awaiting and awaiting[-1]["snapshot"]["pending"][0]["kind"] == "approval"
        # b answers first and wins; a is told it was resolved; a's late answer is refused
        won = await b.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "approve"}],
            }
        )
        assert won["type"] == "ack" and won["results"][0]["accepted"] is True
        resolved = await a.expect(lambda f: f["type"] == "approval_resolved")
        assert resolved["call_id"] == call_id and resolved["status"] == "approved"
        late = await a.request(
            {"type": "approval_response", "conversation": conv, "decisions": [{"call_id": call_id, "decision": "deny"}]}
        )
        assert late["results"][0]["accepted"] is False and late["results"][0]["error"] == "already_resolved"
        snap_a = await a.terminal(ack["turn_id"])
        snap_b = await b.terminal(ack["turn_id"])
        assert snap_a["status"] == snap_b["status"] == "completed"
        assert snap_a["blocks"][-1]["text"].startswith("clock -> 20")
        assert not [f for f in b.seen + await b.drain(0.2) if f["type"] == "approval_resolved"]
        # the third connection never saw any of it
        seen_c = c.seen + await c.drain(0.3)
        assert not [f for f in seen_c if f["type"] in ("approval_request", "approval_resolved", "turn_updated")]
        for w in (a, b, c):
            await w.close()

    asyncio.run(go())


def test_pending_approval_survives_disconnect_and_restart(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    env = cli_env(home)
    sp = start_serve(home, env=env)

    async def first() -> tuple[str, str, str]:
        a = await WS.open(sp.url)
        ack = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
        )
        req = await a.expect(lambda f: f["type"] == "approval_request")
        await a.close()  # the approver leaves without answering
        return ack["conversation_id"], ack["turn_id"], req["call_id"]

    try:
        conv, turn_id, call_id = asyncio.run(first())
    finally:
        assert sp.stop() == 0
    sp = start_serve(home, env=env)

    async def second() -> None:
        b = await WS.open(sp.url)
        state = await b.request({"type": "subscribe", "conversation": conv})
        assert state["state"] == "awaiting" and state["active_turn"]["turn_id"] == turn_id
        assert [p["call_id"] for p in state["pending_approvals"]] == [call_id]
        req = await b.expect(lambda f: f["type"] == "approval_request")
        assert req["call_id"] == call_id and req["turn_id"] == turn_id
        ok = await b.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "approve"}],
            }
        )
        assert ok["results"][0]["accepted"] is True
        snap = await b.terminal(turn_id)
        assert snap["status"] == "completed" and snap["stop_reason"] == "end_turn"
        hist = (await b.request({"type": "get_history", "conversation": conv}))["messages"]
        assert hist[-1]["role"] == "assistant" and hist[-1]["content"].startswith("clock -> 20")
        await b.close()

    try:
        asyncio.run(second())
    finally:
        sp.stop()


def test_run_cli_answers_through_the_server(careful_server: ServeProcess) -> None:
    """`appserver run` beside a live server: the turn and its --approve go through /ws."""
    home = careful_server.home
    paused = run_cli(home, "run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}")
    assert paused.code == 0, paused.err
    data = paused.json()
    assert data["status"] == "awaiting" and data["stop_reason"] == "requires_approval"
    call_id = data["pending"][0]["call_id"]
    done = run_cli(
        home, "run", "--agent", "careful", "--conversation", data["conversation_id"], "--approve", call_id, "--json"
    )
    assert done.code == 0, done.err
    assert done.json()["status"] == "completed" and done.json()["text"].startswith("clock -> 20")
    again = run_cli(home, "run", "--agent", "careful", "--conversation", data["conversation_id"], "--approve", call_id)
    assert again.code != 0 and again.err.startswith("error: ")
