"""The open-turn cap (`[limits] open_turns_per_client`) across a restart on a PostgreSQL store, and
when a cluster server takes up turns of one that died (session 26, an outside tester's report).

A restarted server counted again only what `Kernel.settle_crashed` took up, which runs without a
cluster link; a PostgreSQL server always has one, and takes up a stopped server's turns through
the cluster sweep (`Kernel.catch_up`) or, after a kill -9 (the dead server's leases outlive it for a
few seconds), not at its start at all: so each restart let a credential open another cap's worth
(queued turns after a stop or a kill, paused turns after a kill). Now every turn holding a place
(`COUNTED_FOR`) that a server takes up, or finds open and counted by no live server, is counted
until it ends; one that a live server accepted (and counts) is not counted twice.

Real `appserver serve` processes on a database of their own, real tokens, `websockets` clients
(and `OpenTurns` itself for a turn taken up twice or moved away), the echo model (`/call clock {}`
on the agent `careful` pauses for an approval; `/slow N`: N words, 50 ms apart). Queued turns wait
behind a turn of another (admin) credential, which is not counted.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from appserver.auth import token_store_for
from appserver.security.limits import OpenTurns
from tests.support.cli import cli_env, run_cli
from tests.support.pg import ADMIN_URL, require_postgres, temp_database, url_for
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

T = 30.0  # a request to a conversation a killed server held waits until it is judged gone (~2 s)
# A server that starts, or survives, takes a killed one's work over once it has been up for 3.5
# heartbeats and the killed one's heartbeat is 2.5 heartbeats old: 7 s at the default 2 s heartbeat,
# under 2 s at 0.5 s (the instance timeout, for a server that stops answering, stays 30 s).
FAST_BEAT = {"APPSERVER_STORE__HEARTBEAT_S": "0.5"}
CAP = 3
ASK = "/call clock {}"
SLOW = "/slow 1000"  # 50 s: open until cancelled


def _env(home: Path, url: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP), **FAST_BEAT)


@pytest.fixture(scope="module")
def pg_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A database migrated once, with the agent `careful` (made by the CLI, as a test's home would
    be), and that home's config.toml: each test's database is a copy of it (CREATE DATABASE …
    TEMPLATE), which spares every test the schema's migrations. Nothing stays connected to it."""
    require_postgres()
    with temp_database("opencapt") as url:
        home = tmp_path_factory.mktemp("opencap-template") / "home"
        r = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(home, url))
        assert r.code == 0, r.err
        yield urlsplit(url).path.lstrip("/"), (home / "config.toml").read_text()


@pytest.fixture
def pg(tmp_path: Path, pg_template: tuple[str, str]) -> Iterator[tuple[Path, dict[str, str], str]]:
    """A home on a database of its own with the agent `careful`, its env, and the database URL."""
    template, config = pg_template
    name = f"appserver_test_opencapf_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    try:
        home = tmp_path / "home"
        home.mkdir()
        (home / "config.toml").write_text(config)
        url = url_for(name)
        yield home, _env(home, url), url
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _tokens(home: Path, url: str) -> tuple[str, str]:
    """(the credential under test, a bystander whose turns run ahead of its queued ones), kept in
    the database as every server of it reads them."""
    store = token_store_for(home, url)
    return store.create(name="me", scopes="ws,admin")[1], store.create(name="other", scopes="ws,admin")[1]


async def _open(sp: ServeProcess, token: str) -> WS:
    return await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


def _submit(text: str, agent: str = "assistant", conversation: str = "new") -> dict[str, Any]:
    return {"type": "submit_input", "agent": agent, "conversation": conversation, "input": text}


async def _ack(ws: WS, frame: dict[str, Any]) -> dict[str, Any]:
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    return ack


async def _refused(ws: WS) -> None:
    err = await ws.request(_submit(SLOW), T)
    assert err["type"] == "error" and err["code"] == "too_many_open_turns", err


async def _cancel(ws: WS, ack: dict[str, Any]) -> None:
    frame = {"type": "cancel", "conversation": ack["conversation_id"], "turn_id": ack["turn_id"]}
    reply = await ws.request(frame, T)
    assert reply["type"] == "ack" and reply["cancelled"] is True, reply


async def _accepted_once_free(ws: WS) -> dict[str, Any]:
    """The next submit accepted (a place is given back as its turn's end is seen: soon after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + T
    while True:
        reply = await ws.request(_submit(SLOW), T)
        if reply["type"] == "ack":
            return reply
        assert reply["code"] == "too_many_open_turns" and loop.time() < deadline, reply
        await asyncio.sleep(0.05)


async def _hold_queued(sp: ServeProcess, me: str, other: str) -> list[dict[str, Any]]:
    """Three turns of `me` queued behind a turn of `other` that runs (one conversation)."""
    by_other = await _open(sp, other)
    head = await _ack(by_other, _submit(SLOW))
    await by_other.close()
    ws = await _open(sp, me)
    held = [await _ack(ws, _submit(SLOW, conversation=head["conversation_id"])) for _ in range(CAP)]
    assert [a["queue_position"] for a in held] == [1, 2, 3], held
    await _refused(ws)
    await ws.close()
    return held


def _asks_approval(turn_id: str, frame: dict[str, Any]) -> bool:
    return bool(frame["type"] == "approval_request" and frame["turn_id"] == turn_id)


async def _hold_paused(sp: ServeProcess, me: str) -> list[dict[str, Any]]:
    """Three turns of `me`, each paused for the approval of its clock call."""
    ws = await _open(sp, me)
    held = []
    for _ in range(CAP):
        ack = await _ack(ws, _submit(ASK, "careful"))
        await ws.expect(partial(_asks_approval, ack["turn_id"]), T)
        held.append(ack)
    await _refused(ws)
    await ws.close()
    return held


@pytest.mark.parametrize("paused", [False, True], ids=["queued", "paused"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "kill9"])
async def test_a_restart_counts_the_turns_still_open(
    pg: tuple[Path, dict[str, str], str], paused: bool, sig: signal.Signals
) -> None:
    home, env, url = pg
    me, other = _tokens(home, url)
    sp = start_serve(home, "--auth", "token", env=env)
    try:
        held = await _hold_paused(sp, me) if paused else await _hold_queued(sp, me, other)
    finally:
        code = sp.stop(sig)
        sp.kill()
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)

    with serving(home, "--auth", "token", env=env, graceful=False) as sp:  # SIGKILLed at the end
        ws = await _open(sp, me)
        try:
            await _refused(ws)  # the three turns still open hold the three places
            await _refused(ws)
            await _cancel(ws, held[0])  # (after a kill, once the dead server is judged gone)
            fresh = await _accepted_once_free(ws)  # its place came back: exactly one
            await _refused(ws)
            for ack in (*held[1:], fresh):
                await _cancel(ws, ack)
        finally:
            await ws.close()


async def _gone(url: str) -> None:
    """Wait until the survivor deleted the row of the instance that is no longer live."""
    deadline = time.monotonic() + T
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            row = await (await conn.execute("SELECT count(*) FROM instances")).fetchone()
            if row is not None and row[0] == 1:
                return
            assert time.monotonic() < deadline, "the killed server was never judged gone"
            await asyncio.sleep(0.1)


async def _refused_eventually(ws: WS) -> None:
    """Refused once the survivor counts the turns it took over (the sweep after the dead server
    was judged gone); a probe accepted before is cancelled, and its end waited for, first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + T
    while True:
        reply = await ws.request(_submit(SLOW), T)
        if reply["type"] == "error":
            assert reply["code"] == "too_many_open_turns", reply
            return
        assert loop.time() < deadline, "the turns of the killed server were never counted"
        await _cancel(ws, reply)
        await ws.terminal(reply["turn_id"], T)
        await asyncio.sleep(0.2)


async def _pulled(ws: WS, conversation_id: str) -> None:
    """Wait until the server holding the conversation queued the three turns another accepted."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + T
    while True:
        state = await ws.request({"type": "subscribe", "conversation": conversation_id}, T)
        assert state["type"] == "conversation_state", state
        if state["queued"] == CAP:
            return
        assert loop.time() < deadline, state
        await asyncio.sleep(0.05)


async def test_a_survivor_counts_what_it_takes_over_not_what_a_live_server_counts(
    pg: tuple[Path, dict[str, str], str], tmp_path: Path
) -> None:
    """Two servers. `me` queues three turns through A into a conversation B runs (B pulls them):
    A counts them, B not (`me` may still open three through B). Once A is killed and judged gone,
    B counts them too, until they end."""
    home, env, url = pg
    me, other = _tokens(home, url)
    home_b = tmp_path / "home_b"
    env_b = {**env, "APPSERVER_HOME": str(home_b)}
    a = start_serve(home, "--auth", "token", env=env)
    try:
        with serving(home_b, "--auth", "token", env=env_b, graceful=False) as b:
            by_other = await _open(b, other)
            head = await _ack(by_other, _submit(SLOW))  # B holds its conversation
            await by_other.close()
            on_a = await _open(a, me)
            held = [await _ack(on_a, _submit(SLOW, conversation=head["conversation_id"])) for _ in range(CAP)]
            await _refused(on_a)
            await on_a.close()

            on_b = await _open(b, me)
            try:
                await _pulled(on_b, head["conversation_id"])
                mine = [await _ack(on_b, _submit(SLOW)) for _ in range(CAP)]  # A's three not counted twice
                await _refused(on_b)
                own = mine[0]
                for ack in mine[1:]:
                    await _cancel(on_b, ack)
                    await on_b.terminal(ack["turn_id"], T)
                assert a.stop(signal.SIGKILL) == -signal.SIGKILL
                await _gone(url)
                await _refused_eventually(on_b)  # 1 + the 3 taken over, against 3
                await _cancel(on_b, held[0])
                await _cancel(on_b, held[1])
                assert (await on_b.terminal(held[1]["turn_id"], T))["status"] == "cancelled"
                fresh = await _accepted_once_free(on_b)  # 1 + 1 + 1: exactly one more
                await _refused(on_b)
                for ack in (held[2], own, fresh):
                    await _cancel(on_b, ack)
            finally:
                await on_b.close()
    finally:
        a.kill()


async def test_a_turn_taken_up_twice_counts_once_and_a_moved_one_gives_its_place_back() -> None:
    """`OpenTurns.restore` per turn: told again (taken up anew, a newer handle), the count stays and
    the newer end is watched; `let_go` (the turn moved to another server) gives the place back at
    once, and the end of a watch it replaced gives nothing back a second time."""
    turns = OpenTurns(2)
    first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def until(event: asyncio.Event) -> None:
        await event.wait()

    turns.restore("k", "t1", partial(until, first), "t1")
    turns.restore("k", "t1", partial(until, second), "t1")  # the same turn, taken up again
    assert turns.count("k") == 1
    first.set()  # the replaced watch ends: nothing given back
    await asyncio.sleep(0.05)
    assert turns.count("k") == 1
    second.set()  # the turn ended
    for _ in range(100):
        if turns.count("k") == 0:
            break
        await asyncio.sleep(0.01)
    assert turns.count("k") == 0

    turns.restore("k", "t2", partial(until, third), "t2")
    assert turns.take("k") and not turns.take("k")  # t2 and a submit hold both places
    turns.let_go("t2")  # moved: its place is back now
    assert turns.count("k") == 1 and turns.take("k")
    third.set()
    await asyncio.sleep(0.05)
    assert turns.count("k") == 2  # its watch ended after the let-go: nothing given back twice
