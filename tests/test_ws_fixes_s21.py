"""A connection that submits is shown the turn and its pending approvals whatever other connections
watch (a duplicate re-sent after a reconnect while another client stays subscribed), a `subscribe`
on a connection already subscribed is followed by its approval requests (docs/protocol.md), and
`approval_resolved` goes to the connections that were shown the request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cli import careful_home, cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = careful_home(tmp_path_factory.mktemp("ws_s21"))
    with serving(home, env=cli_env(home)) as sp:
        yield sp


def of_type(ws: WS, kind: str, call_id: str | None = None) -> list[dict[str, Any]]:
    return [f for f in ws.seen if f["type"] == kind and (call_id is None or f.get("call_id") == call_id)]


async def resolution(ws: WS, call_id: str) -> dict[str, Any]:
    """The call's approval_resolved, whether it came already (before a reply awaited) or is to come."""
    for f in of_type(ws, "approval_resolved", call_id):
        return f
    return await ws.expect(lambda f: f["type"] == "approval_resolved" and f["call_id"] == call_id)


def assert_revisions_rise(ws: WS, turn_id: str) -> None:
    revisions = [s["revision"] for s in ws.snapshots(turn_id)]
    assert revisions == sorted(set(revisions)), revisions


def test_duplicate_resent_on_a_new_connection_while_another_watches(server: ServeProcess) -> None:
    async def go() -> None:
        a, b = await WS.open(server.url), await WS.open(server.url)
        conv = (await a.request({"type": "create_conversation", "agent": "careful"}))["conversation"]["id"]
        await b.request({"type": "subscribe", "conversation": conv})
        submit = {
            "type": "submit_input",
            "agent": "careful",
            "conversation": conv,
            "input": "/call clock {}",
            "idempotency_key": "s21-dup",
        }
        ack = await a.request(submit)
        call_id = (await a.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        await b.expect(lambda f: f["type"] == "approval_request")
        await a.close()  # leaves without answering; b stays subscribed

        a2 = await WS.open(server.url)
        again = await a2.request(submit)
        assert again["duplicate"] is True and again["turn_id"] == ack["turn_id"], again
        # the ack is followed by the turn's current (awaiting) snapshot, then the request it shows
        snap = (await a2.recv())["snapshot"]
        assert snap["turn_id"] == ack["turn_id"] and snap["status"] == "awaiting", snap
        assert [p["call_id"] for p in snap["pending"]] == [call_id]
        request = await a2.recv()
        assert request["type"] == "approval_request" and request["call_id"] == call_id, request

        won = await b.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "approve"}],
            }
        )
        assert won["results"][0]["accepted"] is True
        resolved = await resolution(a2, call_id)
        assert resolved["call_id"] == call_id and resolved["status"] == "approved"
        assert (await a2.terminal(ack["turn_id"]))["status"] == "completed"
        assert (await b.terminal(ack["turn_id"]))["status"] == "completed"
        # one request and one resolution on a2; the winner is told by its ack only
        assert len(of_type(a2, "approval_request", call_id)) == 1
        assert len(of_type(a2, "approval_resolved", call_id)) == 1
        assert of_type(b, "approval_resolved") == []
        assert_revisions_rise(a2, ack["turn_id"])
        for ws in (a2, b):
            await ws.close()

    asyncio.run(go())


def test_submit_on_a_new_connection_shows_the_approval_the_turn_ahead_waits_for(server: ServeProcess) -> None:
    async def go() -> None:
        a, c = await WS.open(server.url), await WS.open(server.url)
        first = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
        )
        conv = first["conversation_id"]
        call_id = (await a.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        # c's input queues behind the paused turn: c is shown that turn and the approval it waits for
        second = await c.request({"type": "submit_input", "agent": "careful", "conversation": conv, "input": "hi"})
        assert second["queue_position"] == 1, second
        await c.expect(
            lambda f: (
                f["type"] == "turn_updated"
                and f["snapshot"]["turn_id"] == first["turn_id"]
                and f["snapshot"]["status"] == "awaiting"
            )
        )
        request = await c.expect(lambda f: f["type"] == "approval_request")
        assert request["call_id"] == call_id and request["turn_id"] == first["turn_id"]
        ok = await c.request(
            {"type": "approval_response", "conversation": conv, "decisions": [{"call_id": call_id, "decision": "deny"}]}
        )
        assert ok["results"][0]["accepted"] is True
        resolved = await resolution(a, call_id)
        assert resolved["call_id"] == call_id and resolved["status"] == "denied"
        assert (await c.terminal(second["turn_id"]))["status"] == "completed"
        assert len(of_type(c, "approval_request", call_id)) == 1 and of_type(c, "approval_resolved") == []
        for ws in (a, c):
            assert_revisions_rise(ws, first["turn_id"])
            await ws.close()

    asyncio.run(go())


def test_subscribe_again_is_followed_by_the_pending_requests(server: ServeProcess) -> None:
    async def go() -> None:
        a = await WS.open(server.url)
        ack = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
        )
        conv = ack["conversation_id"]
        call_id = (await a.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        for _ in range(2):  # subscribed by the submit, then by the first subscribe
            state = await a.request({"type": "subscribe", "conversation": conv})
            assert [p["call_id"] for p in state["pending_approvals"]] == [call_id]
            request = await a.recv()
            assert request["type"] == "approval_request" and request["call_id"] == call_id, request
        # a cancel is no answer: the canceller's prompt is closed by approval_resolved too
        cancelled = await a.request({"type": "cancel", "conversation": conv})
        assert cancelled["cancelled"] is True
        resolved = await resolution(a, call_id)
        assert resolved["call_id"] == call_id and resolved["status"] == "cancelled", resolved
        assert (await a.terminal(ack["turn_id"]))["status"] == "cancelled"
        assert len(of_type(a, "approval_resolved", call_id)) == 1
        await a.close()

    asyncio.run(go())
