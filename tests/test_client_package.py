"""DESIGN §13: the protocol client is its own package, `appserver/client/`, importing nothing of the
server; its frame types match the server's; its buffer is bounded; its token goes in a header."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any, get_args, get_type_hints

import pytest
import websockets

from appserver.client import Closed, FrameBuffer, ProtocolClient, frames, ws_url
from appserver.ws import frames as server_frames
from tests.support.cli import ROOT


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    probe = (
        "import sys, appserver.client; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('appserver.'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "appserver.client" in loaded
    assert [m for m in loaded if not m.startswith("appserver.client")] == []


def _types(union: Any) -> set[str]:
    return {get_args(get_type_hints(td)["type"])[0] for td in get_args(union)}


def test_the_client_knows_exactly_the_frame_types_of_the_server() -> None:
    assert _types(frames.ClientFrame) == set(server_frames.CLIENT_TYPES)
    assert _types(frames.ServerFrame) == set(server_frames.SERVER_TYPES)
    assert frames.PROTOCOL_VERSION == server_frames.PROTOCOL_VERSION
    assert frames.CLOSE_SLOW_CONSUMER == server_frames.CLOSE_SLOW_CONSUMER


def test_ws_url() -> None:
    assert ws_url("http://h:1/") == "ws://h:1/ws"
    assert ws_url("https://h") == "wss://h/ws"
    assert ws_url("ws://h/ws") == "ws://h/ws"


def _snap(turn: str, rev: int) -> dict[str, Any]:
    return {"type": "turn_updated", "snapshot": {"turn_id": turn, "revision": rev}}


async def test_a_full_buffer_drops_older_snapshots_of_a_turn_first() -> None:
    buf = FrameBuffer(3)
    assert buf.put(_snap("t1", 1)) and buf.put({"type": "event", "name": "x"}) and buf.put(_snap("t2", 1))
    assert buf.put(_snap("t1", 2))  # replaces t1 rev 1
    assert [(f.get("snapshot") or {}).get("revision") for f in [await buf.get() for _ in range(3)]] == [None, 1, 2]
    for i in range(3):
        assert buf.put({"type": "event", "name": str(i)})
    assert not buf.put({"type": "event", "name": "overflow"})  # nothing to coalesce: refused
    buf.end()
    assert [(await buf.get() or {}).get("name") for _ in range(3)] == ["0", "1", "2"]
    assert await buf.get() is None and await buf.get() is None


async def _fake_server(flood: int, seen: list[str | None]) -> Any:
    async def handler(ws: Any) -> None:
        seen.append(ws.request.headers.get("Authorization"))
        hello = json.loads(await ws.recv())
        await ws.send(
            json.dumps(
                {
                    "type": "welcome",
                    "protocol": 1,
                    "server": "fake",
                    "connection_id": "c1",
                    "request_id": hello["request_id"],
                }
            )
        )
        for i in range(flood):
            await ws.send(json.dumps({"type": "event", "name": f"e{i}", "data": {}}))
        await ws.wait_closed()

    return await websockets.serve(handler, "127.0.0.1", 0)


async def test_a_consumer_that_falls_behind_ends_the_connection_not_the_memory() -> None:
    seen: list[str | None] = []
    server = await _fake_server(50, seen)
    port = server.sockets[0].getsockname()[1]
    try:
        client = await ProtocolClient.connect(f"http://127.0.0.1:{port}", token="t0k", max_buffered=5)

        async def gave_up() -> None:  # nobody reads meanwhile, so the buffer fills
            while client.close_reason is None:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(gave_up(), 5)
        got = [f["name"] async for f in client.frames()]  # what was buffered, then the end
        assert got == ["e0", "e1", "e2", "e3", "e4"]
        with pytest.raises(Closed, match="fell behind"):
            await client.request({"type": "ping"})
        await client.close()
    finally:
        server.close()
        await server.wait_closed()
    assert seen == ["Bearer t0k"]


async def test_a_token_source_is_asked_at_connect_and_the_environment_is_the_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str | None] = []
    server = await _fake_server(0, seen)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("APPSERVER_TOKEN", "from-env")
    try:
        async with await ProtocolClient.connect(f"http://127.0.0.1:{port}", token=lambda: "rotated"):
            pass
        async with await ProtocolClient.connect(f"http://127.0.0.1:{port}"):
            pass
        monkeypatch.delenv("APPSERVER_TOKEN")
        async with await ProtocolClient.connect(f"http://127.0.0.1:{port}"):
            pass
    finally:
        server.close()
        await server.wait_closed()
    assert seen == ["Bearer rotated", "Bearer from-env", None]
