"""Session 27, a re-attacker's two findings on the inbound budget of the WebSocket edge (4f05b2a).

1. A fragmented message's first frame reserved the whole frame limit, and nothing bounded how long
   it could take to arrive: 64 sockets each sending a 10-byte text frame with FIN=0, then a byte a
   second (answering pings), held the whole 256 MiB budget for good. A victim's big frame was never
   read, and since its pongs sat in TCP behind it, the keepalive closed the victim (1011).
2. With compression, a frame counted by what it might inflate to (1032x its wire size): any
   compressed chat message over ~63 bytes on the wire waited while the budget was full.

Real sockets against the app behind uvicorn and the edge (test_edge_s27a.py's `serving`), with a
small budget (one reservation fills it); states and bytes are checked, every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import zlib
from pathlib import Path

import pytest

from appserver.security.ws_inbound import INBOUND_FREE, InboundBudget
from tests.test_edge_s27a import MiB, Reader, T, close_code, connect, hello, masked, serving, upgrade

pytestmark = pytest.mark.timeout(90)


class Client(Reader):
    """A raw client that answers the server's pings (a keepalive would close it otherwise)."""

    def next_frame(self) -> tuple[int, bytes]:
        while True:
            opcode, payload = self.frame()
            if opcode == 0x9:
                self.sock.sendall(masked(payload, opcode=0xA))
                continue
            return opcode, payload

    def answer(self, request_id: str) -> dict[str, object]:
        """The message answering `request_id`, or the close the server sent instead."""
        while True:
            opcode, payload = self.next_frame()
            if opcode == 0x8:
                return {"type": "closed", "code": close_code(payload), "reason": payload[2:].decode()}
            frame: dict[str, object] = json.loads(payload)
            if frame.get("request_id") == request_id:
                return frame


def _greeted(port: int, token: str, ext: str = "") -> tuple[socket.socket, Client]:
    s = connect(port)
    head = upgrade(port, token)
    if ext:
        head = head[:-2] + f"Sec-WebSocket-Extensions: {ext}\r\n\r\n".encode()
    s.sendall(head + hello())
    client = Client(s)
    assert client.head().startswith(b"HTTP/1.1 101 ")
    assert client.answer("h")["type"] == "welcome"
    return s, client


def _trickler(s: socket.socket, client: Client) -> dict[str, object]:
    """A fragmented message begun (10 bytes, FIN=0), then one byte of continuation for each ping
    the server sends, pings answered: what the server ends it with."""
    s.sendall(masked(b'{"type":"x', first=0x01))
    while True:
        opcode, payload = client.frame()
        if opcode == 0x9:
            s.sendall(masked(payload, opcode=0xA) + masked(b"x", first=0x00))
        elif opcode == 0x8:
            return {"code": close_code(payload), "reason": payload[2:].decode()}


def _victim(s: socket.socket, client: Client) -> dict[str, object]:
    """A 1 MiB ping (it waits for the budget while the trickler holds it), pings answered."""
    s.sendall(masked(json.dumps({"type": "ping", "request_id": "big", "pad": "v" * MiB}).encode()))
    return client.answer("big")


async def _wait_for(check: object, what: str) -> None:
    for _ in range(int(T / 0.01)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_a_trickled_fragmented_message_cannot_hold_the_budget_nor_get_a_waiting_victim_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    budget = InboundBudget(2 * MiB, group_max_bytes=2 * MiB)
    caplog.set_level(logging.INFO, logger="appserver")
    # pings every 0.1 s, 0.3 s for each pong: many times over while the victim waits for the budget
    async with serving(tmp_path, inbound=budget, message_read_s=2.0, ping=(0.1, 0.3)) as sv:
        a_sock, a_client = await asyncio.to_thread(_greeted, sv.port, sv.token)
        v_sock, v_client = await asyncio.to_thread(_greeted, sv.port, sv.token)
        with a_sock, v_sock:
            trickled = asyncio.create_task(asyncio.to_thread(_trickler, a_sock, a_client))
            await _wait_for(lambda: budget.held == 2 * MiB, "the fragment's start reserved nothing")
            victim = asyncio.create_task(asyncio.to_thread(_victim, v_sock, v_client))
            await _wait_for(lambda: budget.waits >= 1, "the victim's frame did not wait for the budget")
            closed = await asyncio.wait_for(trickled, 3 * T)
            answered = await asyncio.wait_for(victim, 3 * T)
    assert closed["code"] == 1009, closed  # its message never arrived whole within the bound
    assert answered["type"] == "pong", answered  # not closed 1011 while the server did not read it
    assert any("held 2097152 bytes of the inbound budget: closing (1009)" in r.getMessage() for r in caplog.records)


# ── 2. small compressed messages ────────────────────────────────────────────────────────────


def _chat(request_id: str) -> bytes:
    """An ordinary message of ~1.2 KB that compresses to ~600 B: 600 x 1032 is far over 64 KiB."""
    return json.dumps({"type": "ping", "request_id": request_id, "note": os.urandom(300).hex()}).encode()


def _deflated(squeeze: zlib._Compress, message: bytes) -> bytes:
    return masked((squeeze.compress(message) + squeeze.flush(zlib.Z_SYNC_FLUSH))[:-4], first=0x80 | 0x40 | 0x1)


def _compressed_session(port: int, token: str, takeover: bool, started: list[object]) -> list[dict[str, object]]:
    """While the budget is full: three small compressed messages (answered at once), then one of
    ~1 KB on the wire that inflates to 1 MiB (`started` gets its client: it waits), then one more
    small one behind it."""
    ext = "permessage-deflate" + ("" if takeover else "; client_no_context_takeover")
    s, client = _greeted(port, token, ext)
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)

    def frame(message: bytes) -> bytes:
        if takeover:
            return _deflated(squeeze, message)
        return _deflated(zlib.compressobj(9, zlib.DEFLATED, -15), message)

    with s:
        got = []
        for i in range(3):
            message = _chat(f"c{i}")
            wire = frame(message)
            assert 200 < len(wire) < 2000 and len(wire) * 1032 > INBOUND_FREE, len(wire)
            s.sendall(wire)
            got.append(client.answer(f"c{i}"))
        bomb = json.dumps({"type": "ping", "request_id": "bomb", "pad": "b" * MiB}).encode()
        s.sendall(frame(bomb) + frame(_chat("after")))
        started.append(client)
        got.append(client.answer("bomb"))
        got.append(client.answer("after"))
        return got


@pytest.mark.parametrize("takeover", [False, True], ids=["no_context_takeover", "context_takeover"])
async def test_small_compressed_messages_never_wait_for_the_budget_and_a_bomb_still_does(
    tmp_path: Path, takeover: bool
) -> None:
    budget = InboundBudget(2 * MiB, group_max_bytes=2 * MiB)
    async with serving(tmp_path, inbound=budget, deflate=True) as sv:
        a_sock, a_client = await asyncio.to_thread(_greeted, sv.port, sv.token)
        with a_sock:
            a_sock.sendall(masked(b'{"type":"x', first=0x01))  # holds the whole budget
            await _wait_for(lambda: budget.held == 2 * MiB, "the fragment's start reserved nothing")
            started: list[object] = []
            session = asyncio.create_task(asyncio.to_thread(_compressed_session, sv.port, sv.token, takeover, started))
            await _wait_for(lambda: started and budget.waits >= 1, "the bomb did not wait for the budget")
            assert not session.done()  # the bomb is unread while the budget is full
            waits = budget.waits
        # the holder is gone: its reservation given back, the bomb is read
        got = await asyncio.wait_for(session, 3 * T)
    assert [g["type"] for g in got] == ["pong"] * 5, got
    assert waits == 1  # only the bomb waited; the three small compressed messages did not
