"""An error never carries a client's megabyte back whole. A `get_turn` for a 1 MB turn id, a
`get_history` of a 1 MB conversation reference and a `submit_input` to a 1 MB agent name were
answered with an `error` frame quoting each whole (a 3 MB id gave a 3 MB message); the OpenAI
surface builds its error objects in one place too. Real `appserver serve`, a raw WebSocket, httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.serve import ServeProcess
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
