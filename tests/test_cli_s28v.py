"""SIGTERM or SIGHUP while `appserver chat` was connecting cancelled its task once, and Python
3.11's `asyncio.wait_for` (under `ProtocolClient.request`) drops a cancel that lands as its inner
awaitable completes: with the server's reply to `subscribe` arriving with the signal, chat went on
into an interactive session on a terminal that was gone, every later signal only asking that
session to end. The same flaw as `appserver run`'s Ctrl-C (tests/test_cli_s28u.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.cli import ROOT

# A fake server on real sockets (in chat's process): it replies to `subscribe`, lets the loop turn
# `hops` times, then raises SIGTERM, for each of several `hops`: some of them put the stop and the
# reply's completion in the same loop iteration (the race, made certain); later ones stop the session.
# Each chat must end by the signal (143) within a few seconds; one that goes on is cancelled at 8 s.
SCRIPT = r"""
import asyncio, json, os, signal, sys, time
from websockets.asyncio.server import serve
from appserver.cli.chat import chat

CONV = {"id": "conv_x", "agent_id": "agt_x", "default": True, "title": "t", "user": None,
        "forked_from": None, "metadata": {}, "created_at": 1.0, "updated_at": 1.0}

async def trial(hops: int) -> str:
    async def server(ws) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            rid = frame.get("request_id")
            if frame["type"] == "hello":
                welcome = {"protocol": 1, "server": "x", "connection_id": "wsc_1", "subject": "local"}
                await ws.send(json.dumps({"type": "welcome", "request_id": rid, **welcome}))
            elif frame["type"] == "subscribe":
                state = {"conversation": CONV, "state": "idle", "subscribed": True, "active_turn": None}
                await ws.send(json.dumps({"type": "conversation_state", "request_id": rid, **state}))
                for _ in range(hops):
                    await asyncio.sleep(0)
                signal.raise_signal(signal.SIGTERM)

    async with serve(server, "127.0.0.1", 0) as listening:
        port = listening.sockets[0].getsockname()[1]
        began = time.monotonic()
        task = asyncio.create_task(
            chat(f"ws://127.0.0.1:{port}", "assistant", "default", None, False, 0, None)
        )
        await asyncio.wait((task,), timeout=8)
        took = time.monotonic() - began
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
            return f"hops {hops}: still running after {took:.1f} s"
        return f"hops {hops}: exit {task.result()} after {took:.1f} s"

async def main() -> None:
    for hops in range(HOPS):
        print("RESULT", await trial(hops), file=sys.stderr, flush=True)

HOPS = int(sys.argv[1])
keys, kept_open = os.pipe()  # chat's stdin: no key ever, no end either
os.dup2(keys, 0)
asyncio.run(main())
"""
HOPS = 6  # 0, 1 and 2 made chat go on (Python 3.11, websockets 16); a few more for a margin


def test_a_stop_signal_as_the_subscribe_reply_lands_still_ends_chat() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(HOPS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    results = [line.removeprefix("RESULT ") for line in done.stderr.splitlines() if line.startswith("RESULT ")]
    assert len(results) == HOPS, done.stderr
    for result in results:
        said, took = result.split(" after ")
        assert said.endswith(": exit 143"), results
        assert float(took.split()[0]) < 6, results
