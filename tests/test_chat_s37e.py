"""Attacker E's `appserver chat` findings (session 37, fixer e), against loopback servers.

F1. SIGTERM/SIGHUP while `subscribe` (or `create_conversation`) waits for its answer exited
    143/129 without a word; now `error: interrupted by SIGTERM: no turn was started`, as while
    connecting and as `appserver run` says it.
F2. A `subscribe` reply without a usable `conversation` (missing, or a string) crashed chat with a
    traceback; now one `error:` line and exit 1.
F3. `--agent ''` got "give a conversation id (or 'default' with an agent)", and over the protocol
    the `bad_frame` named `param: conversation`; now the empty agent is named.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from appserver.serverinfo import write_server_json
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import serving
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(60)

WELCOME = {"protocol": 1, "server": "x", "connection_id": "wsc_1", "subject": "local", "max_frame_bytes": 4194304}

Handler = Callable[[ServerConnection, dict[str, Any]], Awaitable[None]]


def fake_server(on_frame: Handler) -> Callable[[ServerConnection], Awaitable[None]]:
    """A /ws that welcomes, then hands every other frame to `on_frame`."""

    async def handle(ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            if frame["type"] == "hello":
                await ws.send(json.dumps({"type": "welcome", "request_id": frame.get("request_id"), **WELCOME}))
            else:
                await on_frame(ws, frame)

    return handle


def chat_popen(home: Path, *args: str) -> subprocess.Popen[str]:
    return appserver_popen(
        ["chat", "--reconnect-wait", "0", *args],
        env=cli_env(home),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("conversation", ["default", "new"])
async def test_a_stop_signal_while_subscribing_says_no_turn_was_started(
    tmp_path: Path, signum: int, conversation: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    asked: asyncio.Queue[str] = asyncio.Queue()

    async def stall(ws: ServerConnection, frame: dict[str, Any]) -> None:
        asked.put_nowait(frame["type"])  # and never answered: a stalled server

    async with serve(fake_server(stall), "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        write_server_json(home / "server.json", url, "none", home=str(home))
        proc = chat_popen(home, "--conversation", conversation)
        try:
            first = await asyncio.wait_for(asked.get(), 20)
            assert first == ("create_conversation" if conversation == "new" else "subscribe")
            await asyncio.sleep(0.2)  # the request is awaited now
            proc.send_signal(signum)
            out, err = await asyncio.to_thread(proc.communicate, None, 20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, (proc.returncode, out, err)
    assert err.strip() == f"error: interrupted by {name}: no turn was started", (out, err)


@pytest.mark.parametrize("conversation", [{"id": "conv_x"}, "conv_x", None, {"agent_id": "agt_x", "id": 5}])
async def test_a_subscribe_reply_without_a_conversation_is_one_error_line(tmp_path: Path, conversation: Any) -> None:
    home = tmp_path / "home"
    home.mkdir()

    async def broken(ws: ServerConnection, frame: dict[str, Any]) -> None:
        state: dict[str, Any] = {"state": "idle", "subscribed": True, "active_turn": None}
        if conversation is not None:
            state["conversation"] = conversation
        await ws.send(json.dumps({"type": "conversation_state", "request_id": frame.get("request_id"), **state}))

    async with serve(fake_server(broken), "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        write_server_json(home / "server.json", url, "none", home=str(home))
        proc = chat_popen(home)
        out, err = await asyncio.to_thread(proc.communicate, "hi\n", 30)
    assert "Traceback" not in out + err, err
    assert proc.returncode == 1, (proc.returncode, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "conversation_state" in lines[0] and "conversation" in lines[0], err


def test_an_empty_agent_is_named_as_the_agent(home: Path) -> None:
    with serving(home) as sp:
        started = time.monotonic()
        got = run_cli(home, "chat", "--agent", "", stdin="hi\n")
        assert time.monotonic() - started < 30

        async def over_ws() -> list[dict[str, Any]]:
            ws = await WS.open(sp.url)
            try:
                return [
                    await ws.request({"type": kind, "conversation": "default", "agent": ""})
                    for kind in ("subscribe", "get_history")
                ]
            finally:
                await ws.close()

        replies = asyncio.run(over_ws())
    assert got.code == 2, (got.code, got.out, got.err)
    assert "agent" in got.err and "give a conversation id" not in got.err, got.err
    for reply in replies:
        assert reply["type"] == "error" and reply["code"] == "bad_frame", reply
        assert reply["param"] == "agent", reply
        assert "conversation" not in reply["message"], reply
