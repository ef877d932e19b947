"""An error never carries a client's megabyte back whole. A `get_turn` for a 1 MB turn id, a
`get_history` of a 1 MB conversation reference and a `submit_input` to a 1 MB agent name were
answered with an `error` frame quoting each whole (a 3 MB id gave a 3 MB message); the OpenAI
surface builds its error objects in one place too. Real `appserver serve`, a raw WebSocket, httpx."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

BIG = "q" * 1_000_000
BOUND = 5000  # a few kilobytes: the cut keeps the head and says the length


def test_error_frames_quote_a_huge_id_cut_short(serve: ServeProcess) -> None:
    async def go() -> None:
        ws = await WS.open(serve.url)
        try:
            ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hi"})
            assert ack["type"] == "ack", ack
            conv = str(ack["conversation_id"])
            frames = [
                ({"type": "get_turn", "conversation": conv, "turn_id": BIG}, "turn_not_found"),
                ({"type": "get_history", "conversation": BIG}, "conversation_not_found"),
                ({"type": "submit_input", "agent": BIG, "conversation": "new", "input": "hi"}, None),
            ]
            for frame, code in frames:
                reply = await ws.request(frame, 20)  # the reply to its own request id
                assert reply["type"] == "error", str(reply)[:300]
                if code is not None:
                    assert reply["code"] == code, reply["code"]
                message = reply["message"]
                assert len(message) <= BOUND, (reply["code"], len(message))
                assert "qqqq" in message  # still says what it was about
        finally:
            await ws.close()

    asyncio.run(go())


def test_openai_error_objects_quote_a_huge_value_cut_short(serve: ServeProcess) -> None:
    with httpx.Client(base_url=serve.url, timeout=30) as http:
        bodies = [
            {"model": BIG, "messages": [{"role": "user", "content": "hi"}]},
            {"model": "assistant", "messages": [{"role": BIG, "content": "hi"}]},
        ]
        for body in bodies:
            r = http.post("/v1/chat/completions", json=body)
            assert 400 <= r.status_code < 500, r.status_code
            error = r.json()["error"]
            assert len(error["message"]) <= BOUND, len(error["message"])
        r = http.post("/v1/responses", json={"model": "assistant", "input": "hi", "previous_response_id": BIG})
        assert 400 <= r.status_code < 500, r.status_code
        assert len(r.json()["error"]["message"]) <= BOUND


def test_an_approval_answer_for_unknown_huge_call_ids_is_answered_without_quoting_them_twice(home: Path) -> None:
    """Each refused decision of an `approval_response` says why in its result: the message quoted
    the (up to 1.9 MB) call id whole beside the `call_id` field, an ack twice the request's size."""
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=cli_env(home)).code == 0

    async def go(url: str) -> None:
        ws = await WS.open(url)
        try:
            ack = await ws.request(
                {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
            )
            conv = str(ack["conversation_id"])
            await ws.expect(lambda f: f.get("type") == "approval_request", 20)
            ids = ["a" * 1_000_000, "b" * 1_000_000]
            decisions = [{"call_id": ids[0], "decision": "approve"}, {"call_id": ids[1], "decision": "deny"}]
            reply = await ws.request({"type": "approval_response", "conversation": conv, "decisions": decisions}, 30)
            assert reply["type"] == "ack", str(reply)[:300]
            assert [r["call_id"] for r in reply["results"]] == ids  # the client's own ids, to match them
            for result in reply["results"]:
                assert result["accepted"] is False
                assert len(result["message"]) <= BOUND, len(result["message"])
        finally:
            await ws.close()

    with serving(home) as sp:
        asyncio.run(go(sp.url))
