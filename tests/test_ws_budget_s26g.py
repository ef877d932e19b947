"""Found by an outside test of the WebSocket outbound byte budget (session 26, after b2b7314):

The budget evicted the connection "stalled longest": the one whose client had taken nothing for
the longest, as measured. A reader's socket drains in window-sized steps (about a second apart
for a ~100 KB/s reader on loopback), so between two steps a client that reads without stopping
looked stalled since its last step, and every connection opened after that looked "younger":
with all local clients one group (auth mode `none`), fresh connections that each asked one big
history page and never read got a reader that never stops evicted (4408) within seconds. The
budget now evicts by how much each client took of late (a decaying rate of the bytes it took):
those that took nothing first, then the slowest.

Real sockets against the app served by uvicorn with the edge's protocols, in this test's loop (as
tests/test_ws_budget_s26c.py does), with budgets of a few MiB; the reader is a raw WebSocket
client that takes a few KB at a time, as a slow link does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from appserver.ws.codes import CLOSE_SLOW_CONSUMER
from appserver.ws.connection import Connection, OutboundBudget
from tests.test_ws_budget_s26c import BUDGET, TOTAL, TURN_INPUT, never_reads, sleeper_client, turn
from tests.test_ws_s24 import Served, hello, really_held, rpc, serving

pytestmark = pytest.mark.timeout(60)
T = 10.0


class SlowReader:
    """A raw WebSocket client that takes `chunk` bytes every `pause` seconds and asks for the next
    history page once it has all of the ones it asked for, as a client on a slow link does."""

    def __init__(self, sock: socket.socket, request: dict[str, Any], chunk: int, pause: float) -> None:
        self.sock = sock
        self.request = request
        self.chunk = chunk
        self.pause = pause
        self.buffer = b""
        self.asked = 0
        self.pages = 0  # history replies received whole
        self.closed: tuple[int, str] | None = None  # a close frame's code and reason
        self.running = True

    @classmethod
    async def open(cls, url: str, request: dict[str, Any], chunk: int, pause: float) -> SlowReader:
        loop = asyncio.get_running_loop()
        port = int(url.split(":")[2].split("/")[0])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), T)
        key = base64.b64encode(os.urandom(16)).decode()
        head = (
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        await loop.sock_sendall(sock, head.encode())
        reader = cls(sock, request, chunk, pause)
        while b"\r\n\r\n" not in reader.buffer:
            data = await asyncio.wait_for(loop.sock_recv(sock, 4096), T)
            assert data, "closed during the handshake"
            reader.buffer += data
        status, reader.buffer = reader.buffer.split(b"\r\n\r\n", 1)
        assert b" 101 " in status.split(b"\r\n")[0], status
        await reader.send({"type": "hello", "protocol": 1, "client": "slow", "request_id": "hello"})
        return reader

    async def send(self, frame: dict[str, Any]) -> None:
        data = json.dumps(frame).encode()
        mask = os.urandom(4)
        n = len(data)
        if n < 126:
            head = struct.pack("!BB", 0x81, 0x80 | n)
        elif n < 65536:
            head = struct.pack("!BBH", 0x81, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        await asyncio.get_running_loop().sock_sendall(self.sock, head + mask + masked)

    def _frames(self) -> None:
        """Consume the whole frames in the buffer: count history pages, note a close."""
        while len(self.buffer) >= 2:
            opcode, n = self.buffer[0] & 0x0F, self.buffer[1] & 0x7F
            at = 2
            if n == 126:
                if len(self.buffer) < 4:
                    return
                n, at = struct.unpack("!H", self.buffer[2:4])[0], 4
            elif n == 127:
                if len(self.buffer) < 10:
                    return
                n, at = struct.unpack("!Q", self.buffer[2:10])[0], 10
            if len(self.buffer) < at + n:
                return
            payload, self.buffer = self.buffer[at : at + n], self.buffer[at + n :]
            if opcode == 8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                self.closed = (code, payload[2:].decode(errors="replace"))
            elif opcode == 1 and payload.startswith(b'{"type":"history"'):
                self.pages += 1

    async def run(self) -> None:
        """Read at its pace until stopped or closed; ask the next page once the last is in."""
        loop = asyncio.get_running_loop()
        while self.running and self.closed is None:
            if self.pages >= self.asked:
                await self.send({**self.request, "request_id": f"page{self.asked}"})
                self.asked += 1
            data = await asyncio.wait_for(loop.sock_recv(self.sock, self.chunk), T)
            if not data:
                self.closed = self.closed or (1006, "reset")
                return
            self.buffer += data
            self._frames()
            await asyncio.sleep(self.pause)


async def test_fresh_non_readers_do_not_get_a_reader_that_never_stops_evicted(tmp_path: Any) -> None:
    async with serving(
        tmp_path,
        APPSERVER_LIMITS__WS_OUTBOUND_MAX_BYTES=str(BUDGET),
        APPSERVER_LIMITS__WS_OUTBOUND_TOTAL_MAX_BYTES=str(TOTAL),
    ) as served:
        await _churn(served)


async def _churn(served: Served) -> None:
    hub = served.services.hub
    budget = hub.outbound_budget
    writer, _ = await hello(served.url, "writer", compression=None)
    conv = (await rpc(writer, {"type": "create_conversation", "agent": "careful"}, "c"))["conversation"]["id"]
    for i in range(2):
        await turn(writer, conv, TURN_INPUT, f"t{i}")
    await writer.close()
    history = {"type": "get_history", "conversation": conv, "limit": 1000}

    # a client on a slow link (~200 KB/s: 8 KB each 40 ms) that reads without ever stopping
    reader = await SlowReader.open(served.url, history, 8192, 0.04)
    reading = asyncio.ensure_future(reader.run())
    await asyncio.sleep(1.0)  # it takes part of its first page (~600 KB: about 3 s of reading)
    assert reader.closed is None and not reading.done(), reader.closed

    # meanwhile fresh local connections arrive, 20 a second, each asking for the page once and
    # never reading: the address's share (1 MiB) holds two of their pages at most
    sleepers: list[ClientConnection] = []
    conns: list[tuple[str, Connection]] = []
    most_group = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 4.0
    while loop.time() < end and reader.closed is None:
        sleeper, conn_id = await sleeper_client(served.url, f"sleeper{len(sleepers)}")
        never_reads(sleeper)
        conns.append(("127.0.0.1", hub.connections[conn_id]))
        await sleeper.send(json.dumps({**history, "request_id": "h"}))
        sleepers.append(sleeper)
        for _ in range(5):
            most_group = max(most_group, sum(really_held(served, conns).values()))
            await asyncio.sleep(0.01)
    reader.running = False
    await asyncio.wait_for(reading, T)

    assert reader.closed is None, f"the reader was closed after {reader.pages} pages: {reader.closed}"
    assert reader.pages >= 1, reader.pages  # it kept reading all along (~800 KB in 4 s)
    evicted = [c.close_request for _, c in conns if c.close_request is not None]
    assert len(evicted) >= len(conns) // 2, (len(evicted), len(conns))
    assert all(code == CLOSE_SLOW_CONSUMER and "slow consumer" in why for code, why in evicted), evicted
    page = max(c.outbound.peak_bytes for _, c in conns) + 64 * 1024  # (a page's frame, give or take)
    assert most_group <= TOTAL // 4 + page, (most_group, page)  # an address's share held
    assert budget.peak <= TOTAL + page, budget.peak
    for sleeper in sleepers:
        sleeper.transport.abort()
    reader.sock.close()


# ── unit: the order in which the budget lets connections go ──────────────────────────────────────


class Socket:
    """What the edge offers a connection of its socket (`write_frame`, `unsent`, `abort`): bytes
    written wait until the client takes them (`take`); `keeps_up`: the client takes all at once."""

    def __init__(self, *, keeps_up: bool = False) -> None:
        self.waiting = 0
        self.keeps_up = keeps_up

    def write_frame(self, frame: bytes) -> bool:
        if not self.keeps_up:
            self.waiting += len(frame)
        return True

    def unsent(self) -> int:
        return self.waiting

    def take(self, n: int) -> None:
        self.waiting = max(0, self.waiting - n)

    def abort(self) -> None:
        self.waiting = 0


async def test_those_that_took_nothing_go_first_then_the_one_that_stopped_taking() -> None:
    budget = OutboundBudget(8 * BUDGET, group_max_bytes=8 * BUDGET)
    stuck = asyncio.Event()

    async def never_sends(text: str) -> None:
        await stuck.wait()

    def conn(sock: Socket | None = None) -> Connection:
        return Connection(
            never_sends,
            outbound_max=256,
            send_timeout_s=30,
            outbound_max_bytes=8 * BUDGET,
            budget=budget,
            write_frame=sock.write_frame if sock else None,
            unsent=sock.unsent if sock else None,
            abort=sock.abort if sock else None,
        )

    fast_sock, slow_sock, quits_sock = Socket(), Socket(), Socket()
    fast, slow, quits = conn(fast_sock), conn(slow_sock), conn(quits_sock)
    small, big = conn(), conn()  # no socket: they never take a byte
    for c in (fast, slow, quits):
        c.send({"type": "history", "pad": "r" * (3 * BUDGET // 2)})  # readers holding the most
    small.send({"type": "history", "pad": "s" * (BUDGET // 2)})
    big.send({"type": "history", "pad": "b" * BUDGET})
    assert fast.held > big.held > small.held
    loop = asyncio.get_running_loop()
    swept = loop.time()
    for i in range(20):  # they take their bytes; one of them, as slow as another, stops half-way
        fast_sock.take(40_000)
        slow_sock.take(10_000)
        if i < 10:
            quits_sock.take(10_000)
        swept += 1  # (a sweep measures at most every 10 ms: told it is later)
        budget.sweep(now=swept)
        await asyncio.sleep(0.01)
    assert quits.held > slow.held > big.held > small.held  # the slower readers still hold the most

    def ask() -> None:
        """A frame for a client that keeps up, one byte past the bound: one connection has to go."""
        nonlocal swept
        swept += 1
        budget.sweep(now=swept)
        room = budget.max_bytes - budget.held
        conn(Socket(keeps_up=True)).send({"type": "history", "pad": "a" * (room + 1)})

    ask()  # of the two that took nothing, the one holding more
    assert big.close_request is not None and big.close_request[0] == CLOSE_SLOW_CONSUMER
    assert small.alive and fast.alive and slow.alive and quits.alive
    ask()
    assert small.close_request is not None and small.close_request[0] == CLOSE_SLOW_CONSUMER
    ask()  # then the client that took least of late: the one that stopped, not the slow one
    assert quits.close_request is not None and quits.close_request[0] == CLOSE_SLOW_CONSUMER
    assert fast.alive and slow.alive
    ask()  # then the slowest taker
    assert slow.close_request is not None and fast.alive
    assert budget.evictions == 4
    assert budget.peak <= budget.max_bytes + 2 * BUDGET, budget.peak  # over by one frame at most
