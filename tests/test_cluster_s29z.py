"""A server judged gone by its cluster tells its WebSocket clients (docs/scale-out.md, "How it works").

Found by an outside tester: A held a conversation a client on A subscribed to; A was stopped long
enough to be judged gone, B took over and ran new turns. A's subscriber heard nothing of them, no
error either, its socket open; a subscribe on A (the same connection or a fresh one) answered idle
from A's stale view while B ran a turn. Now: each subscription with no turn still followed there
gets `server_unavailable` at once; a turn still followed there delivers its end (read from the
database); then the socket is closed with 1012. A new connection to A is closed at once (1012),
never answered from A's stale view. Real PostgreSQL,
two real `appserver serve` processes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import websockets

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}


def _start(tmp: Path, url: str) -> list[ServeProcess]:
    return [
        start_serve(tmp / f"node{i}", env=cli_env(tmp / f"node{i}", APPSERVER_STORE__URL=url, **FAST)) for i in range(2)
    ]


def _stop_all(nodes: list[ServeProcess]) -> None:
    for sp in nodes:
        if sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGCONT)
    for sp in nodes:
        try:
            sp.stop(timeout=10)
        except Exception:
            pass
        sp.kill()


def _statuses(url: str, conversation_id: str) -> list[str]:
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT status FROM turns WHERE conversation_id = %s ORDER BY seq", (conversation_id,))
        return [str(r[0]) for r in rows.fetchall()]


async def _create(ws: WS) -> str:
    reply = await ws.request({"type": "create_conversation", "agent": "assistant"})
    assert "conversation" in reply, reply
    return str(reply["conversation"]["id"])


async def _submit(ws: WS, conversation: str, text: str) -> dict[str, Any]:
    ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": text})
    assert ack["type"] == "ack", ack
    return ack


async def _until_closed(ws: WS, timeout: float) -> int | None:
    """Read every frame until the server closes the socket; its close code."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the socket was not closed; frames: {ws.seen[-10:]}"
        try:
            await ws.recv(left)
        except websockets.ConnectionClosed:
            return ws.conn.close_code


def _gone(frame: dict[str, Any], conversation_id: str) -> bool:
    return (
        frame["type"] == "error"
        and frame.get("code") == "server_unavailable"
        and frame.get("conversation_id") == conversation_id
    )


def test_a_server_judged_gone_tells_its_subscribers_and_refuses_subscribes(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("s29z") as url:
        nodes = _start(tmp_path, url)
        try:

            async def go() -> None:
                a = await WS.open(nodes[0].url)
                b = await WS.open(nodes[1].url)
                idle = await _create(a)
                await a.request({"type": "subscribe", "conversation": idle})
                first = await _submit(a, idle, "hi")
                assert (await a.terminal(first["turn_id"]))["status"] == "completed"  # A holds it
                busy = await _create(a)
                running = await _submit(a, busy, "/slow 200")  # followed by `a` (it submitted it)
                await a.expect(
                    lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"],
                    timeout=15,
                )
                nodes[0].proc.send_signal(signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 30
                    while _statuses(url, busy) != ["interrupted"]:  # B judged A gone and took it over
                        assert time.monotonic() < deadline, _statuses(url, busy)
                        await asyncio.sleep(0.1)
                finally:
                    nodes[0].proc.send_signal(signal.SIGCONT)
                async with httpx.AsyncClient() as http:
                    deadline = time.monotonic() + 15
                    while (await http.get(nodes[0].url + "/readyz")).status_code != 503:
                        assert time.monotonic() < deadline, "A never learned it was judged gone"
                        await asyncio.sleep(0.1)

                # B runs a turn of the conversation A held
                on_b = await _submit(b, idle, "/slow 30")

                # the subscription with nothing followed on A is told at once
                told = await a.expect(lambda f: _gone(f, idle), timeout=10)
                assert "another server" in told["message"], told

                # a fresh connection to A: closed at once with 1012 (it stayed open for good, answered
                # nothing: a client kept waiting there instead of reconnecting elsewhere)
                fresh = await WS.open(nodes[0].url, hello=False)
                assert await _until_closed(fresh, timeout=10) == 1012

                # the turn `a` followed on A delivers its end (as the database has it), then the
                # socket closes with 1012 after a server_unavailable for that subscription too
                code = await _until_closed(a, timeout=30)
                ended = a.snapshots(running["turn_id"])[-1]
                assert ended["status"] == "cancelled" and (ended["error"] or {}).get("kind") == "interrupted", ended
                assert code == 1012, (code, a.seen[-5:])
                assert any(_gone(f, busy) for f in a.seen), a.seen[-5:]
                assert not a.snapshots(on_b["turn_id"])  # nothing of B's turn from A's stale view

                assert (await b.terminal(on_b["turn_id"], timeout=30))["status"] == "completed"
                await b.close()

            asyncio.run(go())
        finally:
            _stop_all(nodes)
