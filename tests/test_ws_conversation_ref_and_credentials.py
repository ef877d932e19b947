"""The WebSocket protocol's reading of conversation ids and of a second credential (fix 17, items 7-8).

* `submit_input` stripped whitespace around `conversation`; `subscribe`, `get_history`,
  `unsubscribe`, `approval_response` and `cancel` did not (`" default "` → conversation_not_found).
  Every frame now reads it the same way (one helper in appserver/ws/routes.py).
* A `hello.token` different from the upgrade's `Authorization` token was silently ignored (the
  connection acted as the header's credential). Now it is refused: `error`
  `conflicting_credentials` and close 4401. The same token in both is fine.

Real `appserver serve` processes on loopback, real `websockets` clients.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from appserver.auth import TokenStore
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("wsref") / "home"
    with serving(home, env=cli_env(home)) as sp:
        yield sp


async def test_every_frame_reads_a_conversation_id_with_spaces_around_it_the_same_way(
    open_server: ServeProcess,
) -> None:
    ws = await WS.open(open_server.url)
    try:
        sub = await ws.request({"type": "subscribe", "conversation": " default ", "agent": "assistant"})
        assert sub["type"] == "conversation_state", sub
        conv = sub["conversation"]["id"]
        padded = f"  {conv}\t"
        ack = await ws.request({"type": "submit_input", "conversation": padded, "agent": "assistant", "input": "hi"})
        assert ack["type"] == "ack" and ack["conversation_id"] == conv, ack
        await ws.terminal(ack["turn_id"])
        for frame in (
            {"type": "subscribe", "conversation": padded},
            {"type": "get_history", "conversation": padded},
            {"type": "get_history", "conversation": " default ", "agent": "assistant"},
            {"type": "cancel", "conversation": padded},
            {
                "type": "approval_response",
                "conversation": padded,
                "decisions": [{"call_id": "call_x", "decision": "deny"}],
            },
        ):
            reply = await ws.request(frame)
            assert reply["type"] != "error" or reply["code"] not in ("conversation_not_found", "bad_frame"), (
                frame,
                reply,
            )
            if reply["type"] == "history":
                assert reply["conversation_id"] == conv and any(m["content"] == "hi" for m in reply["messages"]), reply
            elif reply["type"] == "conversation_state":
                assert reply["conversation"]["id"] == conv, reply
            elif reply["type"] == "ack":
                assert reply["conversation_id"] == conv, reply
            else:  # approval_response of an idle conversation: the conversation was found
                assert reply["code"] == "not_awaiting", (frame, reply)
        unsub = await ws.request({"type": "unsubscribe", "conversation": padded})
        assert unsub["conversation_id"] == conv and unsub["results"] == [{"subscribed": False, "was_subscribed": True}]
        for kind in ("subscribe", "get_history", "unsubscribe", "cancel"):
            blank = await ws.request({"type": kind, "conversation": "   "})
            assert blank["type"] == "error" and blank["code"] == "bad_frame", (kind, blank)
            assert blank["param"] == "conversation", blank
    finally:
        await ws.close()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str, str]]:
    home = tmp_path_factory.mktemp("ws_auth") / "home"
    tokens = TokenStore(home)
    alice = tokens.create(name="alice")[1]
    bob = tokens.create(name="bob")[1]
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp, alice, bob


async def _closed(ws: WS, timeout: float = 10) -> tuple[int, str]:
    """The server's close frame (frames before it are kept in `ws.seen`)."""
    deadline = time.monotonic() + timeout
    with pytest.raises(websockets.ConnectionClosed) as info:
        while True:
            await ws.recv(max(0.01, deadline - time.monotonic()))
    assert info.value.rcvd is not None, "the server did not send a close frame"
    return info.value.rcvd.code, info.value.rcvd.reason


async def test_a_hello_token_that_differs_from_the_upgrade_token_is_refused(
    token_server: tuple[ServeProcess, str, str],
) -> None:
    sp, alice, bob = token_server
    ws = await WS.open(sp.url, hello=False, headers={"Authorization": f"Bearer {alice}"})
    try:
        await ws.send({"type": "hello", "protocol": 1, "client": "t", "token": bob, "request_id": "h"})
        error = await ws.recv()
        assert error["type"] == "error" and error["code"] == "conflicting_credentials", error
        assert error["request_id"] == "h" and "two different credentials" in error["message"], error
        code, _ = await _closed(ws)
        assert code == 4401
    finally:
        await ws.close()

    for hello_token in (alice, f"Bearer {alice}", None):  # the same credential, or none in hello: fine
        ws = await WS.open(sp.url, hello=False, headers={"Authorization": f"Bearer {alice}"})
        try:
            hello = {"type": "hello", "protocol": 1, "client": "t", **({"token": hello_token} if hello_token else {})}
            welcome = await ws.request(hello)
            assert welcome["type"] == "welcome" and welcome["subject"] == "token:alice", welcome
        finally:
            await ws.close()

    ws = await WS.open(sp.url, hello=False)  # no header: the hello token is the credential
    try:
        welcome = await ws.request({"type": "hello", "protocol": 1, "client": "t", "token": bob})
        assert welcome["type"] == "welcome" and welcome["subject"] == "token:bob", welcome
    finally:
        await ws.close()


def test_protocol_doc_names_the_new_auth_code() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text("utf-8")
    assert "| `conflicting_credentials` |" in doc
