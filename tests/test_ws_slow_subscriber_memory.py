"""A subscriber that does not read while a long reply streams (issue: a 400 KB echo reply took the
server from 54 MB to about 850 MB). Each `turn_updated` is the whole snapshot, text so far included;
the connection's buffer keeps only the newest snapshot of a turn (latest wins), but a replaced entry
kept its text until the writer reached its place, so a client that reads nothing held every
revision: the sum of every prefix of the reply. The replaced text is now let go of at once."""

from __future__ import annotations

import asyncio
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.ws.connection import Outbound
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)


def test_a_replaced_snapshot_is_let_go_of_before_the_writer_reaches_it() -> None:
    out = Outbound(limit=100)
    out.put("welcome")  # a frame ahead of the snapshots that is never taken: nothing drains
    size = 100_000
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for revision in range(2_000):
            out.put_snapshot("turn_1", f"{revision:08d}" + "x" * size)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(out) == 2  # the welcome and the newest snapshot
    assert held < 4 * size, f"{held / 1e6:.1f} MB held for one {size / 1e6:.1f} MB snapshot"

    async def drain() -> list[str]:
        return [await out.get(), await out.get()]

    first, newest = asyncio.run(drain())
    assert first == "welcome" and newest.startswith("00001999"), (first, newest[:8])


def test_order_with_other_frames_between_snapshots_is_kept() -> None:
    """Latest wins, but a frame queued after an older snapshot still comes after it: the newest
    snapshot takes the newest place (never ahead of an approval request queued before it)."""
    out = Outbound(limit=100)
    for revision in range(200):
        out.put_snapshot("turn_1", f"snap {revision}")
        if revision == 150:
            out.put("approval_request")
    out.put_snapshot("turn_2", "other turn")

    async def drain() -> list[str]:
        return [await out.get() for _ in range(len(out))]

    assert asyncio.run(drain()) == ["approval_request", "snap 199", "other turn"]


@pytest.fixture
def sp(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home)) as server:
        yield server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_subscriber_that_never_reads_does_not_hold_every_revision_of_a_long_reply(sp: ServeProcess) -> None:
    async def go() -> float:
        reader = await WS.open(sp.url)
        made = await reader.request({"type": "create_conversation", "agent": "assistant"})
        conversation = made["conversation"]["id"]
        stuck = await WS.open(sp.url)
        await stuck.request({"type": "subscribe", "conversation": conversation})
        raw = stuck.conn.transport.get_extra_info("socket")
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.conn.transport.pause_reading()  # from here on it takes nothing
        before = rss_mb(sp.proc.pid)
        ack = await reader.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": "a " * 200_000}
        )
        peak = before
        waiting = asyncio.ensure_future(reader.terminal(ack["turn_id"], timeout=60))
        while not waiting.done():
            peak = max(peak, rss_mb(sp.proc.pid))
            await asyncio.sleep(0.05)
        final = waiting.result()
        assert final["status"] == "completed", final["status"]
        await reader.close()
        stuck.conn.transport.abort()
        return peak - before

    grown = asyncio.run(go())
    # every revision held: hundreds of MB (about 800 here); the newest one and the encoding: tens
    assert grown < 200, f"the server grew by {grown:.0f} MB while one subscriber did not read"
