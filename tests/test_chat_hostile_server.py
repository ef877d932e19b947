"""`appserver chat` against a server that sends frames of the wrong shape.

A `turn_updated` without a snapshot, a text block whose text is a number, a block that is a
string, an `approval_request` without a name, frames that are JSON but no object: each made `chat`
die with a traceback (or close the connection and blame the server). A server could also send its
own `connection_lost` event and have it shown as the client's. Now a malformed frame is one
`error:` line and the session goes on; only the client library's own events are shown as such.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from appserver.client import ProtocolClient
from appserver.serverinfo import write_server_json
from tests.support.cli import ROOT, cli_env
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(60)

CONV = {
    "id": "conv_x",
    "agent_id": "agt_x",
    "default": True,
    "title": "t",
    "user": None,
    "forked_from": None,
    "metadata": {},
    "created_at": 1.0,
    "updated_at": 1.0,
}


def _snapshot(status: str, blocks: Any, revision: int) -> dict[str, Any]:
    return {
        "turn_id": "turn_1",
        "conversation_id": "conv_x",
        "revision": revision,
        "status": status,
        "blocks": blocks,
    }


MALFORMED: list[Any] = [
    [1, 2],
    None,
    5,
    {"type": "turn_updated"},
    {"type": "turn_updated", "snapshot": _snapshot("running", [{"type": "text", "text": 5}], 1)},
    {"type": "turn_updated", "snapshot": _snapshot("running", ["x"], 2)},
    {"type": "turn_updated", "snapshot": {"turn_id": "turn_1", "revision": "three"}},
    {"type": "approval_request", "conversation_id": "conv_x", "turn_id": "turn_1", "call_id": "c1"},
    {"type": "event", "name": "connection_lost", "local": True, "data": {"code": 1006, "reconnect_s": "soon"}},
    {"type": "event", "name": "reconnected", "local": True, "data": {"url": "http://evil.example"}},
    {"type": "ack", "request_id": ["not", "hashable"]},
]


async def _hostile(ws: ServerConnection) -> None:
    async for raw in ws:
        frame = json.loads(raw)
        rid, kind = frame.get("request_id"), frame["type"]
        if kind == "hello":
            welcome = {"protocol": 1, "server": "x", "connection_id": "wsc_1", "subject": "local"}
            await ws.send(json.dumps({"type": "welcome", "request_id": rid, **welcome}))
        elif kind in ("subscribe", "create_conversation"):
            state = {"conversation": CONV, "state": "idle", "subscribed": True, "active_turn": None}
            await ws.send(json.dumps({"type": "conversation_state", "request_id": rid, **state}))
        elif kind == "submit_input":
            ack = {"turn_id": "turn_1", "conversation_id": "conv_x", "queue_position": 0, "duplicate": False}
            await ws.send(json.dumps({"type": "ack", "request_id": rid, **ack}))
            for bad in MALFORMED:
                await ws.send(json.dumps(bad))
            done = _snapshot("completed", [{"type": "text", "text": "the real reply"}], 9)
            await ws.send(json.dumps({"type": "turn_updated", "snapshot": done}))
        else:
            await ws.send(json.dumps({"type": "ack", "request_id": rid}))


async def test_chat_says_one_line_per_malformed_frame_and_goes_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    async with serve(_hostile, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        write_server_json(home / "server.json", url, "none", home=str(home))
        proc = appserver_popen(
            ["chat", "--reconnect-wait", "0"],
            env=cli_env(home),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = await asyncio.to_thread(proc.communicate, "hello\n", 30)
    both = out + err
    assert "Traceback" not in both, both
    assert "the real reply" in both, both  # the connection lived through every bad frame
    assert both.count("ignored a malformed") >= 4, both
    # a server's "local" events are not shown as the client's own
    assert "connection lost" not in both and "evil.example" not in both, both
    assert "the server closed the connection" not in both, both


async def test_the_client_library_drops_non_objects_and_a_servers_local_flag() -> None:
    async with serve(_hostile, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        client = await ProtocolClient.connect(url, open_timeout=5, reconnect=False)
        try:
            ack = await client.submit("a", "hi", "default")
            snap = await client.wait_turn(ack["turn_id"], timeout=10)
            assert snap["status"] == "completed"
        finally:
            await client.close()
    # (had a frame that is not an object reached the dispatcher, the connection would have died
    # with an AttributeError and wait_turn raised instead)
