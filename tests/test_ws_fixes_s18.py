"""Fixes of the WebSocket review (s18), each against real `appserver serve` processes and real
sockets (a hostile server of our own for the client's fixes):

* F1: a token given in `hello` counts against that credential's connection cap, not its address's;
* F2: `unsubscribe` reads `conversation` as `subscribe` does (`default` with `agent`);
* F3: after kill -9 and a restart, a turn's revision still goes up;
* F4: the client ignores frames nested too deep and snapshots older than one it delivered.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from appserver.auth import TokenStore
from appserver.client import ProtocolClient
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS, ws_url

pytestmark = pytest.mark.timeout(90)

T = 10.0
CAP = 3


# ───────────────────────────────────────────────────────────── F1: the cap of a hello credential


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str, str]]:
    home = tmp_path_factory.mktemp("s18_cap") / "home"
    tokens = TokenStore(home)
    bob = tokens.create(name="bob")[1]
    alice = tokens.create(name="alice")[1]
    env = cli_env(home, APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT=str(CAP))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, bob, alice


async def _raw(url: str, source: str = "127.0.0.1", **kw: Any) -> Any:
    return await websockets.connect(ws_url(url), max_size=None, open_timeout=T, local_addr=(source, 0), **kw)


async def _hello(conn: Any, token: str) -> dict[str, Any]:
    await conn.send(json.dumps({"type": "hello", "protocol": 1, "token": token, "request_id": "h"}))
    return json.loads(await asyncio.wait_for(conn.recv(), T))


async def _close_code(conn: Any) -> int | None:
    with pytest.raises(websockets.ConnectionClosed) as info:
        while True:
            await asyncio.wait_for(conn.recv(), T)
    return info.value.rcvd.code if info.value.rcvd is not None else None


async def _welcomed(url: str, token: str, source: str) -> Any:
    conn = await _raw(url, source)
    reply = await _hello(conn, token)
    assert reply["type"] == "welcome", reply
    return conn


async def test_hello_tokens_count_against_the_credentials_cap(capped: tuple[ServeProcess, str, str]) -> None:
    """One token authenticating by `hello` from several addresses held CAP sockets per address
    (the cap never applied to it); now it holds CAP in all, like sockets authenticated by header."""
    sp, bob, alice = capped
    held = [await _welcomed(sp.url, bob, f"127.0.0.{i + 1}") for i in range(CAP)]  # three addresses
    try:
        # a fourth, from a fresh address (whose own slots are free): refused at hello, 4429
        extra = await _raw(sp.url, "127.0.0.9")
        err = await _hello(extra, bob)
        assert (err["type"], err["code"], err["request_id"]) == ("error", "too_many_connections", "h"), err
        assert await _close_code(extra) == 4429
        # the same credential in the Authorization header: the 429 the doc names (counted together)
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(
                ws_url(sp.url), additional_headers={"Authorization": f"Bearer {bob}"}, open_timeout=T
            )
        assert refused.value.response.status_code == 429
        # another credential from the same addresses is not affected
        other = await _welcomed(sp.url, alice, "127.0.0.1")
        await other.close()
        # the refused socket gave its address slot back: CAP sockets awaiting hello from there fit
        waiting = [await _raw(sp.url, "127.0.0.9") for _ in range(CAP)]
        for w in waiting:
            await w.close()
    finally:
        for c in held:
            await c.close()
    # no slot leaked: once closed, the credential has its CAP sockets again (header and hello)
    await asyncio.sleep(0.3)
    again = [await _welcomed(sp.url, bob, "127.0.0.5") for _ in range(CAP - 1)]
    header = await WS.open(sp.url, headers={"Authorization": f"Bearer {bob}"}, open_timeout=T)
    assert (await header.request({"type": "ping"}, T))["type"] == "pong"
    extra = await _raw(sp.url, "127.0.0.6")
    assert (await _hello(extra, bob))["code"] == "too_many_connections"
    assert await _close_code(extra) == 4429
    for c in again:
        await c.close()
    await header.close()


async def test_header_and_hello_sockets_share_one_budget(capped: tuple[ServeProcess, str, str]) -> None:
    """From one address: CAP sockets by header, then hello-authenticated ones (was: CAP more)."""
    sp, bob, _ = capped
    await asyncio.sleep(0.3)  # (the slots of the test before are given back as its sockets close)
    by_header = [await WS.open(sp.url, headers={"Authorization": f"Bearer {bob}"}, open_timeout=T) for _ in range(CAP)]
    try:
        extra = await _raw(sp.url)  # awaiting hello: its address's slot (nobody's credential yet)
        err = await _hello(extra, bob)
        assert err["code"] == "too_many_connections", err
        assert await _close_code(extra) == 4429
    finally:
        for ws in by_header:
            await ws.close()
    await asyncio.sleep(0.3)
    ok = await _welcomed(sp.url, bob, "127.0.0.1")
    await ok.close()


# ───────────────────────────────────────────────────────────── F2: unsubscribe names as subscribe


async def test_unsubscribe_default_with_agent_ends_the_subscription(
    capped: tuple[ServeProcess, str, str],
) -> None:
    sp, bob, alice = capped
    a = await WS.open(sp.url, headers={"Authorization": f"Bearer {bob}"}, open_timeout=T)
    b = await WS.open(sp.url, headers={"Authorization": f"Bearer {bob}"}, open_timeout=T)
    eve = await WS.open(sp.url, headers={"Authorization": f"Bearer {alice}"}, open_timeout=T)
    try:
        state = await a.request({"type": "subscribe", "conversation": "default", "agent": "assistant"}, T)
        conv = state["conversation"]["id"]
        ack = await a.request({"type": "unsubscribe", "conversation": " default ", "agent": "assistant"}, T)
        assert ack["type"] == "ack" and ack["conversation_id"] == conv, ack
        assert ack["results"] == [{"subscribed": False, "was_subscribed": True}], ack
        # a turn on that conversation no longer reaches `a`
        sub = await b.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "hi"}, T)
        await b.terminal(sub["turn_id"], T)
        assert (await a.request({"type": "ping"}, T))["type"] == "pong"
        assert not [f for f in a.seen if f["type"] == "turn_updated"], a.seen
        # the same errors as subscribe: no agent with default, unknown, another agent, another namespace
        err = await a.request({"type": "unsubscribe", "conversation": "default"}, T)
        assert (err["code"], err["param"]) == ("bad_frame", "conversation"), err
        err = await a.request({"type": "unsubscribe", "conversation": "conv_0000000000000000"}, T)
        assert err["code"] == "conversation_not_found", err
        err = await a.request({"type": "unsubscribe", "conversation": "default", "agent": "nobody"}, T)
        assert err["code"] == "agent_not_found", err
        for frame in ({"type": "subscribe", "conversation": conv}, {"type": "unsubscribe", "conversation": conv}):
            err = await eve.request(frame, T)
            assert err["code"] == "conversation_not_found", (frame, err)
        # by id, as before
        await a.request({"type": "subscribe", "conversation": conv}, T)
        ack = await a.request({"type": "unsubscribe", "conversation": conv}, T)
        assert ack["results"] == [{"subscribed": False, "was_subscribed": True}], ack
    finally:
        for ws in (a, b, eve):
            await ws.close()


# ───────────────────────────────────────────────────────────── F3: revisions across kill -9


def _running_with_draft(home: Path, turn_id: str) -> bool:
    with sqlite3.connect(home / "appserver.db") as c:
        row = c.execute("SELECT status, draft FROM turns WHERE id=?", (turn_id,)).fetchone()
    return row is not None and row[0] == "running" and row[1] is not None


async def test_revision_rises_across_kill9_and_restart(tmp_path: Path) -> None:
    """The client saw revision R before kill -9; after the restart the turn (settled interrupted)
    is shown above R (was: revision 1), both to a resent input and to `wait_turn`."""
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.2")
    sp = start_serve(home, env=env)
    try:
        ws = await WS.open(sp.url, open_timeout=T)
        conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}, T))["conversation"]["id"]
        submit = {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 400"}
        ack = await ws.request({**submit, "idempotency_key": "k1"}, T)
        turn = ack["turn_id"]
        seen = 0
        deadline = time.monotonic() + T
        while time.monotonic() < deadline and (seen < 10 or not _running_with_draft(home, turn)):
            f = await ws.recv(T)
            if f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn:
                seen = max(seen, f["snapshot"]["revision"])
        # revisions published after the last checkpoint were never stored
        for _ in range(5):
            f = await ws.recv(T)
            if f["type"] == "turn_updated":
                seen = max(seen, f["snapshot"]["revision"])
        assert seen >= 10
        sp.stop(signal.SIGKILL)
        await ws.conn.close()
    finally:
        sp.kill()
    sp = start_serve(home, env=env)
    try:
        ws = await WS.open(sp.url, open_timeout=T)
        again = await ws.request({**submit, "idempotency_key": "k1"}, T)
        assert again["turn_id"] == turn and again["duplicate"] is True, again
        snap = await ws.terminal(turn, T)
        assert snap["status"] == "cancelled" and snap["error"]["kind"] == "interrupted", snap
        assert snap["revision"] > seen, (snap["revision"], seen)
        assert snap["revision"] < 2**53  # exact in every client's JSON numbers
        # shown again: the same revision (a snapshot may repeat), never a lower one
        ws2 = await WS.open(sp.url, open_timeout=T)
        await ws2.request({**submit, "idempotency_key": "k1"}, T)
        assert (await ws2.terminal(turn, T))["revision"] == snap["revision"]
        await ws.close()
        await ws2.close()
        # the built-in client takes it: newer than anything it delivered for the turn
        client = await ProtocolClient.connect(sp.url, open_timeout=T)
        try:
            dup = await client.submit("assistant", "/slow 400", conv, idempotency_key="k1")
            got = await client.wait_turn(dup["turn_id"], timeout=T)
            assert got["revision"] == snap["revision"] and got["status"] == "cancelled", got
        finally:
            await client.close()
    finally:
        sp.stop()
        sp.kill()


# ───────────────────────────────────────────────────────────── F4: a hostile server


def _snap(rev: Any, status: str, text: str) -> str:
    return json.dumps(
        {
            "type": "turn_updated",
            "snapshot": {
                "turn_id": "turn_fake",
                "conversation_id": "conv_fake",
                "agent_id": "agt_x",
                "revision": rev,
                "status": status,
                "phase": "responding",
                "stop_reason": None,
                "blocks": [{"type": "text", "text": text}],
                "pending": [],
                "usage": {},
                "error": None,
                "queue_position": 0,
                "attempt": 1,
                "updated_at": 0,
            },
        }
    )


def _hostile(mode: str) -> Any:
    async def handler(ws: Any) -> None:
        async for raw in ws:
            f = json.loads(raw)
            rid = f.get("request_id")
            if f["type"] == "hello":
                welcome = {"type": "welcome", "request_id": rid, "protocol": 1, "server": "fake"}
                await ws.send(json.dumps({**welcome, "connection_id": "wsc_x", "subject": "local"}))
            elif f["type"] == "submit_input":
                ack = {"type": "ack", "request_id": rid, "turn_id": "turn_fake", "conversation_id": "conv_fake"}
                await ws.send(json.dumps({**ack, "queue_position": 0, "duplicate": False}))
                if mode == "deep":
                    for depth in (100_000, 65):  # past the parser's recursion limit; just past 64
                        await ws.send('{"type":"event","name":"x","data":' + "[" * depth + "]" * depth + "}")
                    await ws.send('{"type":"event","name":"ok","data":' + "[" * 62 + "]" * 62 + "}")  # 64 deep
                    await ws.send(_snap(6, "completed", "after deep"))
                else:
                    await ws.send(_snap(5, "running", "hello world"))
                    await ws.send(_snap(3, "completed", "hel"))  # older than what was shown
                    await ws.send(_snap(5, "completed", "same revision"))
                    await ws.send(_snap(6, "completed", "x"))
                    await ws.send(_snap(4, "completed", "late and old"))
                    await ws.send(json.dumps({"type": "event", "name": "end", "data": {}}))

    return handler


async def test_client_ignores_frames_nested_too_deep() -> None:
    async with websockets.serve(_hostile("deep"), "127.0.0.1", 0, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        client = await ProtocolClient.connect(f"http://127.0.0.1:{port}", open_timeout=T)
        try:
            ack = await client.submit("assistant", "hi")
            seen: list[dict[str, Any]] = []

            async def note(frame: dict[str, Any]) -> None:
                seen.append(frame)

            snap = await client.wait_turn(ack["turn_id"], timeout=T, on_frame=note)
            assert snap["blocks"][0]["text"] == "after deep" and not client.gone
            # the frames past 64 levels were ignored, the one at 64 delivered
            assert [f.get("name") for f in seen if f["type"] == "event"] == ["ok"], seen
        finally:
            await client.close()


async def test_client_delivers_only_newer_revisions_of_a_turn() -> None:
    async with websockets.serve(_hostile("regress"), "127.0.0.1", 0, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        client = await ProtocolClient.connect(f"http://127.0.0.1:{port}", open_timeout=T)
        try:
            ack = await client.submit("assistant", "hi")
            snap = await client.wait_turn(ack["turn_id"], timeout=T)  # what `appserver run` waits with
            assert (snap["revision"], snap["blocks"][0]["text"]) == (6, "x"), snap
            # and to a reader of frames() (`appserver chat`): nothing older or repeated followed
            rest = []
            while True:
                frame = await client.next_frame(T)
                if frame["type"] == "event":
                    break
                rest.append(frame)
            assert rest == [], rest
        finally:
            await client.close()
