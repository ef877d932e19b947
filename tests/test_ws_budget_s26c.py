"""Found by an outside test of the WebSocket outbound byte budget (session 26):

1. Clients that never read blocked every new local client: once an address's connections (every
   local client in auth mode `none`) held over half their share, no frame of any of them was read,
   a new connection's `hello` included, which was then closed 4401 "hello timeout" for a stall of
   the server's making, until the non-readers were closed as slow (30 s). A connection that holds
   (next to) nothing now always has its next frame read: only the ones holding bytes wait, and
   the budget stays bounded by evicting the ones that take nothing.
2. The budget evicted the connection holding the most: a client that read everything (and got
   big replies) was closed 4408 while eight subscribers that read nothing stayed. It now evicts
   the connection whose client took the fewest bytes of late (tests/test_ws_budget_s26g.py).

Real sockets against the app served by uvicorn with the edge's protocols, in this test's loop (as
tests/test_ws_s24.py does), with budgets of a few MiB; the clients offer no compression, as `serve`
runs without it (`[limits] ws_compression`): a compressed page would hold a few KB.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from appserver.auth import Authenticator
from appserver.ws.codes import CLOSE_SLOW_CONSUMER
from appserver.ws.connection import Connection, OutboundBudget
from tests.test_ws_s24 import Served, hello, really_held, rpc, serving, until

pytestmark = pytest.mark.timeout(60)
T = 10.0
BUDGET = 1024 * 1024  # a connection's outbound buffer
TOTAL = 4 * 1024 * 1024  # all connections together: a quarter (1 MiB) per address
GROUP = "address:127.0.0.1"
TURN_INPUT = "cd" * 75_000  # 150 KB in, 150 KB echoed: two turns make a ~600 KB history page


async def turn(ws: ClientConnection, conversation: str, text: str, rid: str) -> None:
    ack = await rpc(ws, {"type": "submit_input", "agent": "careful", "conversation": conversation, "input": text}, rid)
    assert ack["type"] == "ack", ack
    while True:
        snap = (await until(ws, "turn_updated"))["snapshot"]
        if snap["turn_id"] == ack["turn_id"] and snap["status"] in ("completed", "failed", "cancelled"):
            assert snap["status"] == "completed", snap
            return


async def sleeper_client(url: str, client: str) -> tuple[ClientConnection, str]:
    """A client with a small receive window from the start (the kernel then holds little of what
    it is sent), greeted; it reads nothing more once `never_reads`."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.setblocking(False)
    port = int(url.split(":")[2].split("/")[0])
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), T)
    return await hello(url, client, sock=sock, compression=None)


def never_reads(ws: ClientConnection) -> None:
    ws.transport.pause_reading()


async def eventually(check: Any, what: str, timeout: float = T) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


# ── 1. a connection holding nothing is read while others' bytes fill the budget ──────────────────


async def test_a_new_client_is_answered_while_non_readers_fill_its_address_share(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Authenticator, "hello_timeout_s", 1.0)  # a stall shows within a second
    async with serving(
        tmp_path,
        APPSERVER_LIMITS__WS_OUTBOUND_MAX_BYTES=str(BUDGET),
        APPSERVER_LIMITS__WS_OUTBOUND_TOTAL_MAX_BYTES=str(TOTAL),
    ) as served:
        await _new_client_answered(served)


async def _new_client_answered(served: Served) -> None:
    hub = served.services.hub
    budget = hub.outbound_budget
    ws, _ = await hello(served.url, "writer", compression=None)
    conv = (await rpc(ws, {"type": "create_conversation", "agent": "careful"}, "c"))["conversation"]["id"]
    for i in range(2):
        await turn(ws, conv, TURN_INPUT, f"t{i}")
    await ws.close()
    history = {"type": "get_history", "conversation": conv, "limit": 1000}

    sleepers: list[ClientConnection] = []
    conns: list[tuple[str, Connection]] = []
    most_group = page = 0

    def sample() -> None:
        nonlocal most_group
        most_group = max(most_group, sum(really_held(served, conns).values()))

    for n in range(4):
        sleeper, conn_id = await sleeper_client(served.url, f"sleeper{n}")
        never_reads(sleeper)
        conns.append(("127.0.0.1", hub.connections[conn_id]))
        for i in range(12):  # more than the kernel takes in (a few MB on loopback): the rest waits
            await sleeper.send(json.dumps({**history, "request_id": f"h{i}"}))
        sleepers.append(sleeper)
    await eventually(lambda: (budget.sweep(), budget.tight(GROUP))[1], "the non-readers fill half the share")

    # a new local client: its hello is read and answered, not held back until 4401
    probe, probe_id = await hello(served.url, "probe", compression=None)
    conns.append(("127.0.0.1", hub.connections[probe_id]))
    sample()
    assert budget.tight(GROUP), budget.groups  # (still: the others hold their bytes)
    # …and so are its requests, a big page each, as long as it takes what it is sent
    for i in range(4):
        reply = await rpc(probe, {**history}, f"p{i}")
        assert reply["type"] == "history" and reply["messages"], reply
        page = max(page, len(json.dumps(reply)) + 1024)  # (a page's frame, give or take its escapes)
        sample()
    assert hub.connections[probe_id].alive
    for _ in range(50):  # a while longer: what all of them hold stays bounded
        sample()
        await asyncio.sleep(0.01)
    evicted = [c.close_request for _, c in conns if c.close_request is not None]
    assert evicted and all(code == CLOSE_SLOW_CONSUMER and "slow consumer" in why for code, why in evicted)
    assert page > TOTAL // 8, page  # half an address's share: a few of them fill it
    assert most_group <= TOTAL // 4 + page, (most_group, page)
    assert budget.peak <= TOTAL + page, budget.peak
    for sleeper in sleepers:
        sleeper.transport.abort()
    await probe.close()


async def test_others_bytes_hold_back_only_a_connection_that_holds_bytes_itself() -> None:
    """Backpressure still holds a connection holding bytes while its group is over half its share;
    one holding nothing is read."""

    stuck = asyncio.Event()

    async def never_sends(text: str) -> None:
        await stuck.wait()

    budget = OutboundBudget(8 * BUDGET, group_max_bytes=2 * BUDGET)
    hog = Connection(never_sends, outbound_max=256, send_timeout_s=30, outbound_max_bytes=4 * BUDGET, budget=budget)
    idle = Connection(never_sends, outbound_max=256, send_timeout_s=30, outbound_max_bytes=4 * BUDGET, budget=budget)
    hog.send({"type": "history", "pad": "h" * (BUDGET + BUDGET // 2)})  # over half the address's share
    assert budget.tight(hog.charge.group if hog.charge else "")
    await asyncio.wait_for(idle.wait_for_room(), 2.0)  # holds nothing: read
    waiting = asyncio.ensure_future(hog.wait_for_room())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # holds the bytes: waits
    hog.kill(CLOSE_SLOW_CONSUMER, "done")
    await asyncio.wait_for(waiting, T)


# ── 2. the connection evicted is one whose client takes nothing ─────────────────────────────────


async def test_non_reading_subscribers_are_evicted_not_the_client_that_reads(tmp_path: Any) -> None:
    async with serving(
        tmp_path,
        APPSERVER_LIMITS__WS_OUTBOUND_MAX_BYTES=str(BUDGET),
        APPSERVER_LIMITS__WS_OUTBOUND_TOTAL_MAX_BYTES=str(TOTAL),
    ) as served:
        hub = served.services.hub
        writer, writer_id = await hello(served.url, "writer", compression=None)
        conv = (await rpc(writer, {"type": "create_conversation", "agent": "careful"}, "c"))["conversation"]["id"]
        sleepers: list[tuple[ClientConnection, Connection]] = []
        for n in range(8):
            sleeper, conn_id = await sleeper_client(served.url, f"sleeper{n}")
            ack = await rpc(sleeper, {"type": "subscribe", "conversation": conv}, "s")
            assert ack["type"] == "conversation_state", ack
            never_reads(sleeper)
            sleepers.append((sleeper, hub.connections[conn_id]))
        # ~110 KB, echoed back to all nine: a client that keeps up holds about three snapshots of
        # its turn at once (one unsent in the socket, one taken by the writer task, the newest queued)
        big = " ".join(f"word{i}" for i in range(12_000))
        try:
            for r in range(4):
                await turn(writer, conv, big, f"r{r}")
        except ConnectionClosed as exc:
            pytest.fail(f"the client that reads everything was closed in round {r}: {exc.rcvd}")
        assert hub.connections[writer_id].alive
        evicted = [c.close_request for _, c in sleepers if c.close_request is not None]
        assert evicted, "no non-reader was evicted: the test did not fill the budget"
        assert all(code == CLOSE_SLOW_CONSUMER and "slow consumer" in why for code, why in evicted), evicted
        for sleeper, _ in sleepers:
            sleeper.transport.abort()
        await writer.close()


async def test_the_budget_evicts_the_connection_that_took_nothing_not_the_biggest() -> None:
    """(Session 26g: the order is by what each client took of late, tests/test_ws_budget_s26g.py;
    this one's `big` was a client that never took a byte either, evicted then as stalled less long.)"""
    stuck = asyncio.Event()

    async def never_sends(text: str) -> None:
        await stuck.wait()

    budget = OutboundBudget(4 * BUDGET, group_max_bytes=4 * BUDGET)
    waiting = [0]  # what `big`'s socket holds unsent: its client takes it slowly

    def write_frame(frame: bytes) -> bool:
        waiting[0] += len(frame)
        return True

    def conn(*, reads: bool = False) -> Connection:
        return Connection(
            never_sends,
            outbound_max=256,
            send_timeout_s=30,
            outbound_max_bytes=4 * BUDGET,
            budget=budget,
            write_frame=write_frame if reads else None,
            unsent=(lambda: waiting[0]) if reads else None,
        )

    stalled, big = conn(), conn(reads=True)
    stalled.send({"type": "history", "pad": "s" * BUDGET})  # first, and never taken
    await asyncio.sleep(0.02)
    for i in range(3):
        big.send({"type": "history", "n": i, "pad": "b" * (BUDGET * 4 // 5)})  # more, but later
        waiting[0] -= BUDGET // 8  # …and taken, bit by bit
        budget.sweep(now=asyncio.get_running_loop().time() + i)
    assert big.held > stalled.held
    asker = conn()
    asker.send({"type": "history", "pad": "a" * BUDGET})  # past the total: one has to go
    assert stalled.close_request is not None and stalled.close_request[0] == CLOSE_SLOW_CONSUMER
    assert big.alive and asker.alive, (big.close_request, asker.close_request)
    assert budget.evictions == 1
