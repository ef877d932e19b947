"""A client tool whose client disconnects mid-call (the gateway killed by its watchdog while
`message_channel` was sending) may have acted already: the model is told the outcome is unknown and
to check before retrying, not that the call "has no result" (a model that retried posted twice).
A real `appserver serve`, spoken to over the WebSocket protocol."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

MESSAGE_CHANNEL = {
    "name": "message_channel",
    "description": "Send a message to the chat.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("gw-client-gone") / "home"
    with serving(home, env=cli_env(home)) as sp:
        yield sp


async def test_a_disconnect_mid_call_says_the_tool_may_have_acted(server: ServeProcess) -> None:
    owner, watcher = await WS.open(server.url), await WS.open(server.url)
    conv = (await watcher.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
    await watcher.request({"type": "subscribe", "conversation": conv})
    ack = await owner.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": conv,
            "input": '/call message_channel {"text":"the report is ready"}',
            "client_tools": [MESSAGE_CHANNEL],
        }
    )
    await owner.expect(lambda f: f["type"] == "tool_call_request")
    await owner.close()  # as if killed while its send was in flight
    snap = await watcher.terminal(ack["turn_id"], timeout=10)
    told = snap["blocks"][-1]["text"]
    assert told.startswith("message_channel -> "), told
    assert "outcome is unknown" in told and "may have acted" in told and "before retrying" in told, told
    assert "has no result" not in told
    await watcher.close()
