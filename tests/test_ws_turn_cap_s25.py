"""One credential cannot hold any number of turns open over the WebSocket (`[limits]
open_turns_per_client`, docs/security.md): a disconnect never cancels a turn, so one socket sent
2,000 `submit_input` to `new` (where `queue_max` never bites), closed, and the 2,000 slow turns ran
on, slowing every other credential. Past the cap a submit is refused (`too_many_open_turns`) and
nothing is accepted; another credential is unaffected; a turn gives its place back when it ends,
however it ends (completed, failed, cancelled, withdrawn from its queue, answered after a pause),
also after its socket closed; thousands of turns leave nothing counted; the channel gateway's own
credential is not counted.

A real `appserver serve --auth token` with the cap at 3, real tokens, real `websockets` clients and
the echo model's slow replies (`/slow N`: N words, 50 ms apart).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appserver.auth import TokenStore
from appserver.config import ConfigError, load_config
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0
CAP = 3
SLOW = "/slow 1000"  # 50 s: open until cancelled
NAMES = ("cap1", "cap2", "ends", "gone", "burst")
LOOKUP = {
    "name": "lookup",
    "description": "Look something up on the client.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path_factory.mktemp("turncap") / "home"
    home.mkdir(parents=True)
    store = TokenStore(home)
    tokens = {name: store.create(name=name)[1] for name in NAMES}
    tokens["gateway"] = store.mint_gateway("gateway")[1]
    env = cli_env(home, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, tokens


async def _open(sp: ServeProcess, token: str) -> WS:
    return await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


def _submit(text: str, conversation: str = "new", **extra: Any) -> dict[str, Any]:
    return {"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": text, **extra}


async def _accepted(ws: WS, text: str, conversation: str = "new", **extra: Any) -> dict[str, Any]:
    ack = await ws.request(_submit(text, conversation, **extra), T)
    assert ack["type"] == "ack" and not ack["duplicate"], ack
    return ack


async def _refused(ws: WS, text: str = SLOW) -> dict[str, Any]:
    err = await ws.request(_submit(text), T)
    assert err["type"] == "error" and err["code"] == "too_many_open_turns", err
    return err


async def _cancel(ws: WS, ack: dict[str, Any], status: str = "cancelled") -> None:
    frame = {"type": "cancel", "conversation": ack["conversation_id"], "turn_id": ack["turn_id"]}
    reply = await ws.request(frame, T)
    assert reply["type"] == "ack" and reply["cancelled"] is True, reply
    assert (await ws.terminal(ack["turn_id"], T))["status"] == status


def _turn_count(home: Path) -> int:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        return int(c.execute("SELECT count(*) FROM turns").fetchone()[0])


async def test_past_the_cap_nothing_is_accepted_and_another_credential_is_unaffected(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    one, other = await _open(sp, tokens["cap1"]), await _open(sp, tokens["cap2"])
    try:
        held = [await _accepted(one, SLOW, idempotency_key=f"k{i}") for i in range(CAP)]
        before = _turn_count(sp.home)
        err = await _refused(one)
        assert f"{CAP} open turns" in err["message"] and "[limits] open_turns_per_client" in err["message"], err
        assert _turn_count(sp.home) == before  # nothing accepted, no conversation made for it either
        # a resend of an accepted input (its key) is still answered with its turn, not refused
        dup = await one.request(_submit(SLOW, idempotency_key="k0"), T)
        assert dup["type"] == "ack" and dup["duplicate"] is True and dup["turn_id"] == held[0]["turn_id"], dup

        # another credential is not held back by it: its turns are accepted and answered at once
        started = time.monotonic()
        for _ in range(CAP):
            ack = await _accepted(other, "hi")
            assert (await other.terminal(ack["turn_id"], T))["status"] == "completed"
        assert time.monotonic() - started < 5

        # a turn that ends gives its place back: the credential may submit again
        await _cancel(one, held[0])
        held[0] = await _accepted(one, SLOW)
        await _refused(one)
        for ack in held:
            await _cancel(one, ack)
    finally:
        await one.close()
        await other.close()


async def test_every_way_a_turn_ends_gives_its_place_back_and_a_paused_turn_holds_one(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    ws = await _open(sp, tokens["ends"])
    try:
        running = await _accepted(ws, SLOW)
        queued = await _accepted(ws, "behind it", running["conversation_id"])
        assert queued["queue_position"] == 1, queued
        paused = await _accepted(ws, '/call lookup {"q":"x"}', client_tools=[LOOKUP])
        call = await ws.expect(lambda f: f["type"] == "tool_call_request", T)
        await _refused(ws)  # running, queued and paused for a client tool: three open

        await _cancel(ws, queued)  # withdrawn from the queue before it started
        failed = await _accepted(ws, "/error 400")
        assert (await ws.terminal(failed["turn_id"], T))["status"] == "failed"
        second = await _accepted(ws, SLOW)  # the withdrawn and the failed one hold no place
        await _refused(ws)

        reply = await ws.request({"type": "tool_result", "call_id": call["call_id"], "output": "42"}, T)
        assert reply["type"] == "ack", reply
        assert (await ws.terminal(paused["turn_id"], T))["status"] == "completed"
        third = await _accepted(ws, SLOW)  # the answered one ended
        await _refused(ws)

        await _cancel(ws, running)  # cancelled while it ran
        fourth = await _accepted(ws, SLOW)
        await _refused(ws)
        for ack in (second, third, fourth):
            await _cancel(ws, ack)
    finally:
        await ws.close()


async def test_turns_left_running_by_a_closed_socket_hold_their_places_until_they_end(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    first = await _open(sp, tokens["gone"])
    for _ in range(CAP):
        await _accepted(first, "/slow 30")  # 1.5 s each, all at once
    await first.close()
    ws = await _open(sp, tokens["gone"])
    try:
        await _refused(ws)  # the socket went, its turns run on and still count
        deadline = time.monotonic() + T
        while True:  # they end by themselves, nobody watching: their places come back
            reply = await ws.request(_submit("hi"), T)
            if reply["type"] == "ack":
                break
            assert reply["code"] == "too_many_open_turns" and time.monotonic() < deadline, reply
            await asyncio.sleep(0.1)
        await ws.terminal(reply["turn_id"], T)
        # all three places come back as the left turns end (they need not end together: a loaded
        # machine runs them apart)
        held: list[dict[str, Any]] = []
        while len(held) < CAP:
            reply = await ws.request(_submit(SLOW), T)
            if reply["type"] == "ack":
                held.append(reply)
                continue
            assert reply["code"] == "too_many_open_turns" and time.monotonic() < deadline, reply
            await asyncio.sleep(0.1)
        await _refused(ws)
        for ack in held:
            await _cancel(ws, ack)
    finally:
        await ws.close()


async def test_a_thousand_turns_leave_nothing_counted(srv: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, tokens = srv
    lanes = [await _open(sp, tokens["burst"]) for _ in range(CAP)]
    per_lane = 340

    async def lane(ws: WS) -> None:
        conv = "new"
        for i in range(per_lane):
            ack = await _accepted(ws, f"short {i}", conv)
            conv = ack["conversation_id"]
            assert (await ws.terminal(ack["turn_id"], T))["status"] == "completed"
            ws.seen.clear()

    try:
        await asyncio.gather(*(lane(ws) for ws in lanes))
        # a pipelined burst past the cap: exactly CAP accepted, the rest refused
        ws = lanes[0]
        for i in range(CAP + 5):
            await ws.send({**_submit(SLOW), "request_id": f"b{i}"})
        replies = [await ws.expect(lambda f, i=i: f.get("request_id") == f"b{i}", T) for i in range(CAP + 5)]
        acks = [r for r in replies if r["type"] == "ack"]
        assert len(acks) == CAP, replies
        assert {r["code"] for r in replies if r["type"] == "error"} == {"too_many_open_turns"}, replies
        for ack in acks:
            await _cancel(ws, ack)
        # after all of them, the count is back at 0 (neither leaked nor given back twice)
        held = [await _accepted(ws, SLOW) for _ in range(CAP)]
        await _refused(ws)
        for ack in held:
            await _cancel(ws, ack)
    finally:
        for ws in lanes:
            await ws.close()


async def test_the_channel_gateways_own_credential_is_not_counted(srv: tuple[ServeProcess, dict[str, str]]) -> None:
    """It submits for every chat sender under one credential, which only the server mints."""
    sp, tokens = srv
    ws = await _open(sp, tokens["gateway"])
    try:
        held = [await _accepted(ws, SLOW) for _ in range(CAP + 2)]
        for ack in held:
            await _cancel(ws, ack)
    finally:
        await ws.close()


def test_the_setting_is_checked_like_connections_per_client(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(ConfigError, match="open_turns_per_client"):
        load_config(home, {"APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT": "-1"})
    assert load_config(home, {"APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT": "0"}).limits.open_turns_per_client == 0
    assert load_config(home, {}).limits.open_turns_per_client == 256
