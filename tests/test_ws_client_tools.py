"""Issue 5 acceptance 5: client tools go to the declaring connection; result, timeout and disconnect."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

LOOKUP = {
    "name": "lookup",
    "description": "Look something up on the client.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("wstools") / "home"
    with serving(home, env=cli_env(home, APPSERVER_LIMITS__CLIENT_TOOL_TIMEOUT_S="2")) as sp:
        yield sp


async def test_client_tool_result_resumes_the_turn(server: ServeProcess) -> None:
    owner, watcher = await WS.open(server.url), await WS.open(server.url)
    conv = (await owner.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
    await watcher.request({"type": "subscribe", "conversation": conv})
    ack = await owner.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": conv,
            "input": '/call lookup {"q":"x"}',
            "client_tools": [LOOKUP],
        }
    )
    req = await owner.expect(lambda f: f["type"] == "tool_call_request")
    assert req["name"] == "lookup" and req["arguments"] == '{"q":"x"}' and req["turn_id"] == ack["turn_id"]
    assert 0 < req["timeout_s"] <= 2
    reply = await owner.request({"type": "tool_result", "call_id": req["call_id"], "output": "x is 42"})
    assert reply["type"] == "ack" and reply["results"][0]["accepted"] is True
    snap = await owner.terminal(ack["turn_id"])
    assert snap["status"] == "completed" and snap["blocks"][-1]["text"] == "lookup -> x is 42"
    # the watcher saw the turn, but the tool call request went to the declaring connection only
    await watcher.terminal(ack["turn_id"])
    assert not [f for f in watcher.seen if f["type"] == "tool_call_request"]
    # a second result for the same call is refused
    err = await owner.request({"type": "tool_result", "call_id": req["call_id"], "output": "again"})
    assert err["type"] == "error" and err["code"] == "unknown_call"
    await owner.close()
    await watcher.close()


async def test_client_tool_timeout_gives_the_model_an_error(server: ServeProcess) -> None:
    owner = await WS.open(server.url)
    ack = await owner.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "new",
            "input": '/call lookup {"q":"y"}',
            "client_tools": [LOOKUP],
        }
    )
    await owner.expect(lambda f: f["type"] == "tool_call_request")
    snap = await owner.terminal(ack["turn_id"], timeout=15)  # nobody answers within 2 s
    assert snap["status"] == "completed"
    assert snap["blocks"][-1]["text"].startswith("lookup -> The client did not return a result for lookup")
    await owner.close()


async def test_declaring_client_disconnect_gives_the_model_an_error(server: ServeProcess) -> None:
    owner, watcher = await WS.open(server.url), await WS.open(server.url)
    conv = (await watcher.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
    await watcher.request({"type": "subscribe", "conversation": conv})
    ack = await owner.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": conv,
            "input": '/call lookup {"q":"z"}',
            "client_tools": [LOOKUP],
        }
    )
    await owner.expect(lambda f: f["type"] == "tool_call_request")
    await owner.close()  # the client that runs the tool is gone; the turn is not cancelled
    snap = await watcher.terminal(ack["turn_id"], timeout=5)
    assert snap["status"] == "completed"
    assert "disconnected before returning a result" in snap["blocks"][-1]["text"]
    await watcher.close()
