"""Issue 5 acceptance 1, 2, 6, 7 (+ list/history/unsubscribe/auth) with `websockets` against a real `serve`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS, db_messages


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("wsproto") / "home"
    with serving(home, env=cli_env(home, APPSERVER_LIMITS__WS_FRAME_MAX_BYTES=str(256 * 1024))) as sp:
        yield sp


async def test_hello_submit_revisions_and_terminal_after_commit(server: ServeProcess) -> None:
    ws = await WS.open(server.url, hello=False)
    welcome = await ws.request({"type": "hello", "protocol": 1, "client": "test"})
    assert welcome["type"] == "welcome" and welcome["protocol"] == 1 and welcome["connection_id"]
    ack = await ws.request(
        {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hello world"}
    )
    assert ack["type"] == "ack" and ack["turn_id"].startswith("turn_") and ack["queue_position"] == 0
    turn_id, conv = ack["turn_id"], ack["conversation_id"]
    # the terminal snapshot: checked against the store the moment it arrives
    frame = await ws.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["status"] != "running")
    snap = frame["snapshot"]
    rows = db_messages(server.home, conv)
    assert snap["status"] == "completed" and snap["stop_reason"] == "end_turn"
    assert [r[0] for r in rows] == ["user", "assistant"] and "echo: hello world" in rows[1][1]
    revisions = [s["revision"] for s in ws.snapshots(turn_id)]
    assert revisions == sorted(set(revisions)) and len(revisions) >= 1
    hist = await ws.request({"type": "get_history", "conversation": conv})
    assert hist["type"] == "history" and [m["role"] for m in hist["messages"]] == ["user", "assistant"]
    assert hist["messages"][1]["content"] == "echo: hello world"
    assert hist["messages"][0]["source"]["connection"] == welcome["connection_id"]
    await ws.close()


async def test_cancel_keeps_partial_text(server: ServeProcess) -> None:
    ws = await WS.open(server.url)
    ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 300"})
    await ws.expect(
        lambda f: (
            f["type"] == "turn_updated"
            and len(f["snapshot"]["blocks"]) > 0
            and len(f["snapshot"]["blocks"][0]["text"].split()) >= 5
        )
    )
    reply = await ws.request({"type": "cancel", "conversation": ack["conversation_id"]})
    assert reply["type"] == "ack" and reply["cancelled"] is True
    snap = await ws.terminal(ack["turn_id"])
    assert snap["status"] == "cancelled"
    hist = (await ws.request({"type": "get_history", "conversation": ack["conversation_id"]}))["messages"]
    assert hist[-1]["role"] == "assistant" and hist[-1]["completion_status"] == "cancelled"
    assert hist[-1]["content"].startswith("w1 w2 w3 w4 w5")
    await ws.close()


async def test_a_cancel_naming_a_turn_stops_that_turn_only(server: ServeProcess) -> None:
    """A cancel meant for a turn that has ended (a re-send after a reconnect, a /cancel racing the
    next turn) must not stop the one after it; naming a queued turn takes it out of the queue."""
    ws = await WS.open(server.url)
    first = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hi"})
    conv = first["conversation_id"]
    assert (await ws.terminal(first["turn_id"]))["status"] == "completed"
    running = await ws.request(
        {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 200"}
    )
    queued = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "later"})
    assert queued["queue_position"] == 1
    late = await ws.request({"type": "cancel", "conversation": conv, "turn_id": first["turn_id"]})
    assert late["type"] == "ack" and late["cancelled"] is False
    unknown = await ws.request({"type": "cancel", "conversation": conv, "turn_id": "turn_nosuch"})
    assert unknown["cancelled"] is False
    dropped = await ws.request({"type": "cancel", "conversation": conv, "turn_id": queued["turn_id"]})
    assert dropped["cancelled"] is True
    stopped = await ws.request({"type": "cancel", "conversation": conv, "turn_id": running["turn_id"]})
    assert stopped["cancelled"] is True
    assert (await ws.terminal(running["turn_id"]))["status"] == "cancelled"
    hist = (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
    assert "later" not in [m["content"] for m in hist if m["role"] == "user"]  # withdrawn before it ran
    await ws.close()


async def test_two_inputs_at_once_run_in_the_order_their_acks_gave(server: ServeProcess) -> None:
    """Two clients submit to an idle conversation at the same moment: the input acknowledged at
    queue position 0 runs first. One group commit settled both accepts, and the submitter whose
    write closed the group went on first, so the input acked 1 ran first in about one try in five."""
    a, b = await WS.open(server.url), await WS.open(server.url)
    raced = 0
    for i in range(25):
        conv = (await a.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
        acks = await asyncio.gather(
            *(
                ws.request(
                    {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": f"/recall {n}{i}"}
                )
                for ws, n in ((a, "A"), (b, "B"))
            )
        )
        for ack, ws in zip(acks, (a, b), strict=True):
            await ws.terminal(ack["turn_id"])
        history = (await a.request({"type": "get_history", "conversation": conv}))["messages"]
        ran = [m["content"].removeprefix("/recall ") for m in history if m["role"] == "user"]
        positions = {n: ack["queue_position"] for ack, n in zip(acks, (f"A{i}", f"B{i}"), strict=True)}
        if sorted(positions.values()) == [0, 0]:
            continue  # (a loaded machine: the first had ended before the second came)
        raced += 1
        assert ran == sorted(positions, key=positions.__getitem__), (i, positions, ran)
    assert raced, "the two inputs never met: the race was not run"
    await a.close()
    await b.close()


async def test_idempotent_submit_is_one_turn(server: ServeProcess) -> None:
    ws = await WS.open(server.url)
    conv = (await ws.request({"type": "create_conversation", "agent": "assistant", "title": "idem"}))["conversation"][
        "id"
    ]
    frame = {
        "type": "submit_input",
        "agent": "assistant",
        "conversation": conv,
        "input": "once",
        "idempotency_key": "k-1",
        "source": {"channel": "telegram", "chat": "42", "sender": "ann"},
    }
    first = await ws.request(frame)
    second = await ws.request(frame)
    assert first["turn_id"] == second["turn_id"]
    assert first["duplicate"] is False and second["duplicate"] is True
    await ws.terminal(first["turn_id"])
    hist = (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
    assert [m["role"] for m in hist] == ["user", "assistant"]
    assert hist[0]["source"]["channel"] == "telegram" and hist[0]["source"]["sender"] == "ann"
    await ws.close()


async def test_bad_frames_get_error_frames_and_connection_survives(server: ServeProcess) -> None:
    ws = await WS.open(server.url)
    await ws.send("this is not json {")
    err = await ws.recv()
    assert err["type"] == "error" and err["code"] == "bad_json"
    await ws.send({"type": "teleport", "request_id": "x1"})
    err = await ws.recv()
    assert err == {
        "type": "error",
        "request_id": "x1",
        "code": "unknown_type",
        "message": "unknown frame type 'teleport'",
        "param": "type",
    }
    await ws.send({"type": "submit_input", "input": "hi", "request_id": "x2"})
    err = await ws.recv()
    assert (
        err["type"] == "error" and err["code"] == "bad_frame" and err["param"] == "agent" and err["request_id"] == "x2"
    )
    await ws.send({"type": "subscribe", "conversation": "conv_nope", "request_id": "x3"})
    err = await ws.recv()
    assert err["code"] == "conversation_not_found"
    await ws.send({"type": "submit_input", "agent": "nobody", "input": "hi", "request_id": "x4"})
    assert (await ws.recv())["code"] == "agent_not_found"
    await ws.send({"type": "approval_response", "conversation": "conv_nope", "decisions": [], "request_id": "x5"})
    assert (await ws.recv())["code"] == "bad_frame"
    await ws.send(json.dumps([1, 2]))
    assert (await ws.recv())["code"] == "bad_frame"
    # still works afterwards
    assert (await ws.request({"type": "ping"}))["type"] == "pong"
    ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "still here"})
    assert (await ws.terminal(ack["turn_id"]))["status"] == "completed"
    await ws.close()


async def test_hello_required_and_protocol_version(server: ServeProcess) -> None:
    ws = await WS.open(server.url, hello=False)
    err = await ws.request({"type": "list_agents"})
    assert err["type"] == "error" and err["code"] == "hello_required"
    err = await ws.request({"type": "no_such_frame"})  # any frame but hello, known or not (protocol.md)
    assert err["type"] == "error" and err["code"] == "hello_required"
    err = await ws.request({"type": "hello", "protocol": 99})
    assert err["code"] == "unsupported_protocol"
    with pytest.raises(websockets.ConnectionClosed) as info:
        await ws.recv(5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 4406


async def test_conversation_references_each_frame_can_follow(server: ServeProcess) -> None:
    """An empty `conversation` is no reference (was: the agent's default, on submit_input only); a
    frame with no `agent` field is not told to add one to use `default`."""
    ws = await WS.open(server.url)
    err = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "", "input": "x"})
    assert (err["type"], err["code"], err["param"]) == ("error", "bad_frame", "conversation")
    err = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "  ", "input": "x"})
    assert (err["code"], err["param"]) == ("bad_frame", "conversation")
    for frame in (
        {"type": "cancel", "conversation": "default", "agent": "assistant"},
        {"type": "approval_response", "conversation": "default", "decisions": [{"call_id": "c", "decision": "deny"}]},
    ):
        err = await ws.request(frame)
        assert err["code"] == "bad_frame" and err["message"] == "give a conversation id", err
    err = await ws.request({"type": "subscribe", "conversation": "default"})
    assert err["code"] == "bad_frame" and "'default' with an agent" in err["message"]
    await ws.close()


async def test_oversized_frame_closes_with_reason(server: ServeProcess) -> None:
    ws = await WS.open(server.url)
    await ws.send(json.dumps({"type": "submit_input", "agent": "assistant", "input": "x" * (300 * 1024)}))
    with pytest.raises(websockets.ConnectionClosed) as info:
        await ws.recv(5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


async def test_lists_unsubscribe_and_default_conversation(server: ServeProcess) -> None:
    ws = await WS.open(server.url)
    agents = await ws.request({"type": "list_agents"})
    assert "assistant" in {a["name"] for a in agents["agents"]}
    state = await ws.request({"type": "subscribe", "conversation": "default", "agent": "assistant"})
    assert (
        state["type"] == "conversation_state"
        and state["subscribed"] is True
        and state["conversation"]["default"] is True
    )
    convs = await ws.request({"type": "list_conversations", "agent": "assistant"})
    assert state["conversation"]["id"] in {c["id"] for c in convs["conversations"]}
    ack = await ws.request({"type": "unsubscribe", "conversation": state["conversation"]["id"]})
    assert ack["type"] == "ack"
    # a turn started elsewhere on that conversation no longer reaches this connection
    other = await WS.open(server.url)
    sub = await other.request(
        {"type": "submit_input", "agent": "assistant", "conversation": state["conversation"]["id"], "input": "quiet"}
    )
    await other.terminal(sub["turn_id"])
    assert not [f for f in await ws.drain(0.3) if f["type"] == "turn_updated"]
    await ws.close()
    await other.close()


def test_token_auth_in_hello_and_agent_scope(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "other", env=env).code == 0
    tok = run_cli(home, "token", "create", "--name", "t1", "--agents", "assistant", "--json", env=env).json()
    token = tok.get("token") or tok.get("secret")
    sp = start_serve(home, "--auth", "token", env=env)

    async def go() -> None:
        bad = await WS.open(sp.url, hello=False)
        err = await bad.request({"type": "hello", "protocol": 1, "token": "nope"})
        assert err["type"] == "error"
        with pytest.raises(websockets.ConnectionClosed) as info:
            await bad.recv(5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 4401
        ws = await WS.open(sp.url, hello=False)
        welcome = await ws.request({"type": "hello", "protocol": 1, "token": token})
        assert welcome["type"] == "welcome"
        names = {a["name"] for a in (await ws.request({"type": "list_agents"}))["agents"]}
        assert names == {"assistant"}
        err = await ws.request({"type": "submit_input", "agent": "other", "input": "hi"})
        assert err["type"] == "error" and err["code"] == "forbidden"
        ack = await ws.request({"type": "submit_input", "agent": "assistant", "input": "hi"})
        assert (await ws.terminal(ack["turn_id"]))["status"] == "completed"
        await ws.close()
        # the same token at the upgrade works too
        hdr = await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"})
        await hdr.close()

    try:
        asyncio.run(go())
    finally:
        sp.stop()
