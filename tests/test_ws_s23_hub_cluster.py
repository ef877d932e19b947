"""A client tool call belongs to whoever supplied the tool, also across the servers of a cluster
(docs/scale-out.md): a WebSocket client subscribing through another server leaves open an HTTP
client's call and another server's WebSocket connection's call. Before, that server's watch found no
connection of its own running the tool and closed the call as if its client had disconnected.

Real PostgreSQL, two real `appserver serve` processes, the real openai SDK, real WebSocket clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

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


def _env(home: Path, url: str) -> dict[str, str]:
    # nothing here kills a server: a long instance timeout keeps a loaded machine from fencing one
    return cli_env(
        home, APPSERVER_STORE__URL=url, APPSERVER_STORE__HEARTBEAT_S="0.2", APPSERVER_STORE__INSTANCE_TIMEOUT_S="20"
    )


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("s23hub")
    with temp_database("s23_hub") as url:
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                started.append(start_serve(home, env=_env(home, url)))
            yield started
        finally:
            for sp in started:
                try:
                    sp.stop(timeout=10)
                except Exception:
                    pass
                sp.kill()


async def _behind_node1(viewer: WS, conv: str) -> None:
    """An answer through node 1 reaches node 0 behind whatever node 1 sent it on showing the pause
    (before, the closing of the call "as gone"); it names no open call, so it changes nothing."""
    nothing = {"call_id": "mcpr_none", "decision": "deny"}
    await viewer.request({"type": "approval_response", "conversation": conv, "decisions": [nothing]})


def _turn_in(status: str) -> Any:
    return lambda f: f["type"] == "turn_updated" and f["snapshot"]["status"] == status


async def test_a_subscriber_on_another_server_leaves_an_http_clients_call_open(nodes: list[ServeProcess]) -> None:
    sdk = openai.AsyncOpenAI(base_url=nodes[0].url + "/v1", api_key="x", max_retries=0, timeout=30)
    raw = await sdk.responses.with_raw_response.create(model="assistant", input="hello")
    conv = raw.headers["x-conversation-id"]  # held by node 0, which ran its turn
    viewer = await WS.open(nodes[1].url)
    await viewer.request({"type": "subscribe", "conversation": conv})
    # node 1 follows the conversation from here on: it is shown the next turn, then the paused one
    await sdk.responses.create(model="assistant", conversation=conv, input="again")
    await viewer.expect(_turn_in("completed"), timeout=30)
    paused = await sdk.responses.create(model="assistant", conversation=conv, input="/call f {}", tools=[F])  # type: ignore[list-item]
    call_id = [o for o in paused.output if o.type == "function_call"][0].call_id
    turn_id = (await viewer.expect(_turn_in("awaiting"), timeout=30))["snapshot"]["turn_id"]
    await _behind_node1(viewer, conv)
    out: list[Any] = [{"type": "function_call_output", "call_id": call_id, "output": "REAL RESULT"}]
    resp = await sdk.responses.create(model="assistant", conversation=conv, input=out, tools=[F])  # type: ignore[list-item]
    assert resp.output_text == "f -> REAL RESULT"
    snap = await viewer.terminal(turn_id, timeout=30)
    assert snap["blocks"][-1]["text"] == "f -> REAL RESULT"
    assert not [f for f in viewer.seen if GONE in str(f)]
    await viewer.close()
    await sdk.close()


async def test_a_subscriber_on_another_server_leaves_a_websocket_clients_call_open(
    nodes: list[ServeProcess],
) -> None:
    owner = await WS.open(nodes[0].url)
    conv = (await owner.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hi"}))[
        "conversation_id"
    ]
    await owner.expect(_turn_in("completed"))  # held by node 0, which ran its turn
    viewer = await WS.open(nodes[1].url)
    await viewer.request({"type": "subscribe", "conversation": conv})
    warm = await owner.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "again"})
    await viewer.terminal(warm["turn_id"], timeout=30)  # node 1 follows it from here on
    ack = await owner.request(_submit_f(conv))
    req = await owner.expect(lambda f: f["type"] == "tool_call_request")
    await viewer.expect(_turn_in("awaiting"), timeout=30)
    await _behind_node1(viewer, conv)
    reply = await owner.request({"type": "tool_result", "call_id": req["call_id"], "output": "ws result"})
    assert reply["type"] == "ack" and reply["results"][0]["accepted"] is True, reply
    snap = await viewer.terminal(ack["turn_id"], timeout=30)
    assert snap["blocks"][-1]["text"] == "f -> ws result"
    await owner.close()
    await viewer.close()
