"""Frames written straight to the socket (appserver/ws/connection.py `_write_now`): the same bytes
as the `websockets` library frames, never ahead of a frame queued or held by the writer task, and
the queue's way for a connection that compresses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.frames import Frame, Opcode

from appserver.auth import Authenticator, Principal
from appserver.config import Config
from appserver.security.ws_session import run_ws
from appserver.ws.connection import WRITE_FRAME, Connection, text_frame
from tests.support.cli import cli_env
from tests.support.serve import start_serve
from tests.support.ws import WS


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_a_text_frame_is_what_the_websockets_library_writes(size: int) -> None:
    payload = ("é" * size).encode()[:size]
    assert text_frame(payload) == Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])


class Socket:
    """Stands in for the socket under the connection: `paused` as flow control pauses it."""

    def __init__(self) -> None:
        self.paused = True
        self.wire: list[str] = []
        self.resumed = asyncio.Event()

    def write_frame(self, frame: bytes) -> bool:
        if self.paused:
            return False
        self.wire.append(frame[2:].decode())  # small frames: a two-byte header
        return True

    async def send_text(self, text: str) -> None:
        await self.resumed.wait()  # as uvicorn's send waits for the paused socket
        self.wire.append(text)

    def resume(self) -> None:
        self.paused = False
        self.resumed.set()


async def test_a_frame_never_overtakes_one_the_writer_task_holds() -> None:
    sock = Socket()
    conn = Connection(sock.send_text, outbound_max=16, send_timeout_s=5, write_frame=sock.write_frame)
    sender = asyncio.get_running_loop().create_task(conn.run_sender())
    try:
        conn.send_encoded('"a"')  # paused: queued, and the writer task takes it and waits
        await asyncio.sleep(0.01)
        assert len(conn.outbound) == 0 and sock.wire == []
        sock.paused = False  # the socket takes frames again before the task has run
        conn.send_encoded('"b"')
        conn.send_snapshot("turn_1", '"c"')
        sock.resumed.set()
        for _ in range(100):
            if len(sock.wire) == 3:
                break
            await asyncio.sleep(0.01)
        assert sock.wire == ['"a"', '"b"', '"c"']
        conn.send_encoded('"d"')  # nothing queued or held: straight to the socket
        assert sock.wire[-1] == '"d"' and len(conn.outbound) == 0
        assert conn.sent == 4
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)


async def test_a_frame_queued_behind_a_paused_socket_keeps_its_place() -> None:
    sock = Socket()
    conn = Connection(sock.send_text, outbound_max=16, send_timeout_s=5, write_frame=sock.write_frame)
    conn.send_encoded('"a"')
    conn.send_encoded('"b"')
    sock.paused = False
    conn.send_encoded('"c"')  # two queued ahead of it: it queues too
    assert sock.wire == [] and len(conn.outbound) == 3
    sock.resume()
    sender = asyncio.get_running_loop().create_task(conn.run_sender())
    try:
        for _ in range(100):
            if len(sock.wire) == 3:
                break
            await asyncio.sleep(0.01)
        assert sock.wire == ['"a"', '"b"', '"c"']
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)


@pytest.mark.parametrize("compression", [None, "deflate"])
async def test_replies_and_fanned_out_snapshots_arrive_whole_and_in_order(
    tmp_path: Path, compression: str | None
) -> None:
    """Against a real server: pipelined requests are answered in order (big replies among them, so
    some frames go straight out and some queue behind the full socket), and a subscriber sees the
    turn's terminal snapshot; with permessage-deflate on, every frame takes the queue's way."""
    home = tmp_path / "home"
    extra = {"APPSERVER_SERVER__WS_COMPRESSION": "true"} if compression else {}
    sp = start_serve(home, env=cli_env(home, **extra))
    try:
        boss = await WS.open(sp.url, compression=compression)
        big = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": " ".join(["x" * 99] * 2000)}
        )
        await boss.terminal(big["turn_id"])
        watcher = await WS.open(sp.url, compression=compression)
        conv = (await watcher.request({"type": "subscribe", "conversation": big["conversation_id"]}))["conversation"]
        for i in range(8):
            kind = {"type": "get_history", "conversation": conv["id"]} if i % 2 else {"type": "ping"}
            await boss.send({**kind, "request_id": f"r{i}"})
        answered = [(await boss.expect(lambda f: "request_id" in f, timeout=20))["request_id"] for _ in range(8)]
        assert answered == [f"r{i}" for i in range(8)]
        ack = await boss.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conv["id"], "input": "to the watcher"}
        )
        snap = await watcher.terminal(ack["turn_id"])
        assert snap["status"] == "completed" and snap["blocks"][-1]["text"] == "echo: to the watcher"
        assert json.loads(json.dumps(snap)) == snap
        await watcher.close()
        await boss.close()
    finally:
        sp.stop()


async def test_direct_writes_pass_the_guard_session(tmp_path: Path) -> None:
    """The guard's session stands between the app and the socket for direct writes too: none
    while one of its sends holds the lock (that frame keeps its place), none once it closed the
    socket (here: an oversized frame; likewise a revoked or expired credential)."""
    wire: list[bytes] = []
    sent: list[dict[str, Any]] = []
    gate = asyncio.Event()
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    seen: dict[str, bool] = {}

    def raw_write(frame: bytes) -> bool:
        wire.append(frame)
        return True

    async def send(message: dict[str, Any]) -> None:  # the server's side: one send waits
        sent.append(message)
        if message.get("text") == "slow":
            await gate.wait()

    async def app(scope: dict[str, Any], receive: Any, send_: Any) -> None:
        write = scope["extensions"][WRITE_FRAME]
        await send_({"type": "websocket.accept"})
        seen["open"] = write(b"open")
        slow = asyncio.create_task(send_({"type": "websocket.send", "text": "slow"}))
        await asyncio.sleep(0)
        seen["while_a_send_waits"] = write(b"mid")
        gate.set()
        await slow
        incoming.put_nowait({"type": "websocket.receive", "text": "x" * 2000})
        await receive()  # the guard closes (1009) and reports a disconnect
        seen["after_the_guard_closed"] = write(b"late")

    scope = {"type": "websocket", "path": "/ws", "extensions": {WRITE_FRAME: raw_write}}
    auth = Authenticator(Config(home=tmp_path / "home"))
    await run_ws(app, scope, incoming.get, send, {"principal": Principal.local()}, auth, 10, 1024)
    assert seen == {"open": True, "while_a_send_waits": False, "after_the_guard_closed": False}
    assert wire == [b"open"]
    assert sent[-1]["type"] == "websocket.close" and sent[-1]["code"] == 1009
