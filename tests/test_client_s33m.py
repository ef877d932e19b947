"""A reconnect that finds many followed turns ended costs a few round trips, not one per turn: a
client following 150 turns of a conversation that all completed while it was away, against a server
that takes 20 ms per request, got none of their outcomes within its 2 s reconnect window (it asked
for each turn by id, one after another); it reads the completed ones from the history at once."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from appserver.client import TERMINAL, ProtocolClient

pytestmark = pytest.mark.timeout(60)

TURNS = 150
LATENCY_S = 0.02  # each request after the submits, as a slow link or store would answer it


class SlowServer:
    """Acks submits; closes with 1012 after the last; afterwards every turn has completed, and each
    request is answered LATENCY_S after the one before (one connection's requests in order)."""

    def __init__(self) -> None:
        self.turns: list[str] = []
        self.asked: dict[str, int] = {}

    async def handler(self, ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            kind, rid = frame["type"], frame.get("request_id")
            if kind == "hello":
                welcome = {"protocol": 1, "server": "x", "connection_id": "wsc_1", "subject": "local"}
                await ws.send(json.dumps({"type": "welcome", "request_id": rid, **welcome}))
                continue
            if kind == "submit_input":
                turn = f"turn_{len(self.turns)}"
                self.turns.append(turn)
                ack = {"type": "ack", "request_id": rid, "conversation_id": "conv_1", "turn_id": turn}
                await ws.send(json.dumps({**ack, "status": "queued", "position": len(self.turns)}))
                if len(self.turns) == TURNS:
                    await ws.close(1012, "restart")
                continue
            self.asked[kind] = self.asked.get(kind, 0) + 1
            await asyncio.sleep(LATENCY_S)
            await ws.send(json.dumps({**self._answer(kind, frame), "request_id": rid}))

    def _answer(self, kind: str, frame: dict[str, Any]) -> dict[str, Any]:
        if kind == "subscribe":
            conversation = {"id": "conv_1", "agent_id": "a"}
            return {"type": "conversation_state", "conversation": conversation, "active_turn": None, "queued": 0}
        if kind == "get_history":
            messages: list[dict[str, Any]] = []
            for i, turn in enumerate(self.turns):
                messages.append({"id": 2 * i, "role": "user", "content": "hi", "turn_id": turn})
                reply = {"id": 2 * i + 1, "role": "assistant", "content": "ok", "turn_id": turn}
                messages.append({**reply, "completion_status": "completed"})
            return {"type": "history", "messages": messages, "has_more": False}
        if kind == "get_turn":
            snapshot = {
                "turn_id": frame["turn_id"], "conversation_id": "conv_1", "agent_id": "a", "revision": 5,
                "status": "completed", "stop_reason": "end_turn", "blocks": [{"type": "text", "text": "ok"}],
                "pending": [], "error": None,
            }  # fmt: skip
            return {"type": "turn", "snapshot": snapshot}
        return {"type": "error", "code": "unknown_type", "message": kind}


async def test_a_reconnect_settles_many_completed_turns_in_a_few_round_trips() -> None:
    fake = SlowServer()
    async with serve(fake.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = await ProtocolClient.connect(f"http://127.0.0.1:{port}", reconnect=True, reconnect_s=2)
        try:
            followed = set()
            for i in range(TURNS):
                ack = await client.submit("a", "hi", conversation="conv_1", idempotency_key=f"k{i}")
                followed.add(ack["turn_id"])
            started, settled = time.monotonic(), set()
            while settled != followed:
                frame = await client.next_frame(10)
                snapshot = frame.get("snapshot") or {}
                if frame.get("type") == "turn_updated" and snapshot.get("status") in TERMINAL:
                    assert snapshot["status"] == "completed", snapshot
                    settled.add(snapshot["turn_id"])
            assert client.reconnects == 1
            assert fake.asked.get("get_turn", 0) < TURNS // 10, fake.asked
            assert time.monotonic() - started < 2, "the reconnect took as long as its window"
        finally:
            await client.close()
