"""A client tool call belongs to whoever supplied the tool (docs/protocol.md "Reconnect",
docs/openai.md "New input while calls are pending"): an HTTP client's call stays open for that
client when a WebSocket client subscribes to its conversation or submits input to it. Before, the
arrival of the WebSocket watch closed the call at once as if "the client that runs the tool f
disconnected", the turn finished on that made-up error and the HTTP client's real answer was
refused (or forked). A WebSocket connection's own call is still closed as gone when the server it
was submitted to restarted.

A real `appserver serve`, the real openai SDK, real WebSocket clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

F = {"type": "function", "name": "f", "parameters": {"type": "object"}}
WS_F = {"name": "f", "description": "f on the WebSocket client", "parameters": {"type": "object"}}
GONE = "disconnected before returning a result"


def _submit_f(conversation: str) -> dict[str, Any]:
    """A WebSocket input whose turn calls the connection's own tool f."""
    return {
        "type": "submit_input",
        "agent": "assistant",
        "conversation": conversation,
        "input": "/call f {}",
        "client_tools": [WS_F],
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("wss23hub") / "home"
    env = cli_env(home)
    made = run_cli(home, "agents", "create", "--name", "asker", "--tool", "clock=ask", env=env)
    assert made.code == 0, made.err
    with serving(home, env=env) as sp:
        yield sp


def _sdk(sp: ServeProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0, timeout=20)


async def _paused_on_f(sdk: openai.AsyncOpenAI) -> tuple[str, str]:
    """An HTTP turn paused for the client's tool f: its conversation and the call id."""
    raw = await sdk.responses.with_raw_response.create(model="assistant", input="/call f {}", tools=[F])  # type: ignore[list-item]
    resp = raw.parse()
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1, resp.output
    return raw.headers["x-conversation-id"], calls[0].call_id


async def _answer_f(sdk: openai.AsyncOpenAI, conv: str, call_id: str) -> str:
    out: list[Any] = [{"type": "function_call_output", "call_id": call_id, "output": "REAL RESULT"}]
    resp = await sdk.responses.create(model="assistant", conversation=conv, input=out, tools=[F])  # type: ignore[list-item]
    return resp.output_text


def _awaiting(f: dict[str, Any]) -> bool:
    return f["type"] == "turn_updated" and f["snapshot"]["status"] == "awaiting"


async def test_a_subscriber_leaves_an_http_clients_call_open(server: ServeProcess) -> None:
    sdk = _sdk(server)
    conv, call_id = await _paused_on_f(sdk)
    viewer = await WS.open(server.url)
    state = await viewer.request({"type": "subscribe", "conversation": conv})
    assert state["active_turn"]["status"] == "awaiting", state
    turn_id = state["active_turn"]["turn_id"]
    # the watch's follower publishes the paused turn (and, before, closed its call right after)
    await viewer.expect(_awaiting)
    assert await _answer_f(sdk, conv, call_id) == "f -> REAL RESULT"
    snap = await viewer.terminal(turn_id)
    assert snap["status"] == "completed" and snap["blocks"][-1]["text"] == "f -> REAL RESULT"
    assert not [f for f in viewer.seen if GONE in str(f)]
    await viewer.close()
    await sdk.close()


async def test_a_websocket_submit_queues_behind_an_http_clients_call(server: ServeProcess) -> None:
    sdk = _sdk(server)
    conv, call_id = await _paused_on_f(sdk)
    ws = await WS.open(server.url)
    ack = await ws.request(_submit_f(conv))
    assert ack["type"] == "ack" and ack["queue_position"] == 1, ack
    await ws.expect(_awaiting)  # the HTTP client's turn, shown to the new subscriber
    assert await _answer_f(sdk, conv, call_id) == "f -> REAL RESULT"
    # then the queued WebSocket turn runs, and its own call goes to its own connection
    req = await ws.expect(lambda f: f["type"] == "tool_call_request")
    assert req["turn_id"] == ack["turn_id"] and req["call_id"] != call_id
    reply = await ws.request({"type": "tool_result", "call_id": req["call_id"], "output": "ws result"})
    assert reply["results"][0]["accepted"] is True, reply
    snap = await ws.terminal(ack["turn_id"])
    assert snap["status"] == "completed" and snap["blocks"][-1]["text"] == "f -> ws result"
    assert not [f for f in ws.seen if GONE in str(f)]
    await ws.close()
    await sdk.close()


async def test_a_subscriber_leaves_an_http_clients_approval_open(server: ServeProcess) -> None:
    sdk = _sdk(server)
    raw = await sdk.responses.with_raw_response.create(model="asker", input="/call clock {}")
    asked = [o for o in raw.parse().output if o.type == "mcp_approval_request"]
    assert len(asked) == 1
    conv = raw.headers["x-conversation-id"]
    viewer = await WS.open(server.url)
    await viewer.request({"type": "subscribe", "conversation": conv})
    await viewer.expect(lambda f: f["type"] == "approval_request")
    await viewer.expect(_awaiting)
    answer: list[Any] = [{"type": "mcp_approval_response", "approval_request_id": asked[0].id, "approve": True}]
    resp = await sdk.responses.create(model="asker", conversation=conv, input=answer)
    assert [o.type for o in resp.output if o.type == "mcp_call"] == ["mcp_call"], resp.output
    await viewer.close()
    await sdk.close()


async def test_a_websocket_call_is_closed_as_gone_after_a_restart(tmp_path: Path) -> None:
    """Its connection did not survive the restart: the next watch closes the call, as before."""
    home = tmp_path / "home"
    with serving(home, env=cli_env(home), graceful=False) as sp:  # killed: nothing closes the call
        owner = await WS.open(sp.url)
        ack = await owner.request(_submit_f("new"))
        await owner.expect(lambda f: f["type"] == "tool_call_request")
    await owner.close()
    with serving(home, env=cli_env(home)) as sp:
        viewer = await WS.open(sp.url)
        await viewer.request({"type": "subscribe", "conversation": ack["conversation_id"]})
        snap = await viewer.terminal(ack["turn_id"])
        assert GONE in snap["blocks"][-1]["text"]
        await viewer.close()
