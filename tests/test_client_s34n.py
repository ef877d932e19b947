"""The client library matches replies to requests by request_id (session 34, N): two requests in
flight under one id got each other's reply (a `ping` answered with the `agents` list) and the other
waited out its timeout, forever without one. A caller's id already waiting is refused at once; the
client's own ids (`r1`, `r2`, ...) skip those a caller has in flight. Against a real `serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appserver.client import ProtocolClient
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)


def test_request_ids_in_flight_never_share_a_reply(tmp_path: Path) -> None:
    async def go(url: str) -> None:
        client = await ProtocolClient.connect(url, client="s34n")
        try:
            agents, refused = await asyncio.gather(
                client.request({"type": "list_agents", "request_id": "x"}, timeout=10),
                client.request({"type": "ping", "request_id": "x"}, timeout=10),
                return_exceptions=True,
            )
            assert isinstance(agents, dict) and agents["type"] == "agents", agents
            assert isinstance(refused, ValueError) and "'x'" in str(refused), refused
            # once answered, the id is free again
            assert (await client.request({"type": "ping", "request_id": "x"}, timeout=10))["type"] == "pong"

            # callers' ids r1..r64 in flight beside requests with ids of the client's own making
            mine = [client.request({"type": "ping", "request_id": f"r{i}"}, timeout=10) for i in range(1, 65)]
            generated = [client.request({"type": "list_agents"}, timeout=10) for _ in range(8)]
            replies = await asyncio.gather(*mine, *generated)
            assert [r["type"] for r in replies] == ["pong"] * 64 + ["agents"] * 8, replies
            assert [r["request_id"] for r in replies[:64]] == [f"r{i}" for i in range(1, 65)]
            assert not {r["request_id"] for r in replies[64:]} & {f"r{i}" for i in range(1, 65)}
        finally:
            await client.close()

    with serving(tmp_path / "home") as sp:
        asyncio.run(go(sp.url))
