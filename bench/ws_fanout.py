"""Fan-out benchmark: N subscribed connections on one conversation; time from a turn's commit to
the last terminal snapshot delivered, and the server's RSS per idle connection. Prints, no asserts.

    .venv/bin/python bench/ws_fanout.py [--connections 1000]

`run(n)` also returns the numbers (bench/compare.py calls it with `quiet=True`), among them each
subscriber's delivery time: its terminal snapshot's arrival minus the turn's commit (`ended_at`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import resource
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import websockets  # noqa: E402

from tests.support.cli import cli_env  # noqa: E402
from tests.support.serve import start_serve  # noqa: E402

TERMINAL_HINT = re.compile(rb'"status":\s*"(completed|failed|cancelled)"')


class RawSubscriber:
    """A lean WebSocket client for the N subscribers: the handshake, masked text frames out, frames
    in scanned as bytes (JSON decoded only when one looks terminal). The `websockets` client with
    `json.loads` on every frame costs the load generator ~100 µs per frame: with 1,000 subscribers
    on the same small machine the clients, not the server, set the delivery time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, host: str, port: int) -> RawSubscriber:
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"WebSocket handshake refused: {head[:200]!r}")
        return cls(reader, writer)

    def send(self, frame: dict[str, Any]) -> None:
        payload = json.dumps(frame).encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
        key = (mask * (n // 4 + 1))[:n]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")
        self.writer.write(head + mask + masked)

    async def frame(self) -> bytes:
        """The next data frame's payload (control frames skipped)."""
        while True:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(await self.reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await self.reader.readexactly(8), "big")
            payload = await self.reader.readexactly(n)
            if b0 & 0x0F in (0x1, 0x2, 0x0):
                return payload

    async def wait_terminal(self) -> float:
        while True:
            payload = await self.frame()
            if TERMINAL_HINT.search(payload):
                f = json.loads(payload)
                if f.get("type") == "turn_updated" and f["snapshot"]["status"] in ("completed", "failed", "cancelled"):
                    return time.time()

    def close(self) -> None:
        self.writer.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """Processes spawned inside run on `cpus` (they inherit the spawning thread's affinity)."""
    if not cpus:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


async def run(n: int, *, quiet: bool = False, serve_cpus: set[int] | None = None) -> dict[str, Any]:
    """Fan one turn out to `n` subscribers; prints unless `quiet`; returns the numbers (ms, KiB)."""
    say = (lambda *_a: None) if quiet else print
    out: dict[str, Any] = {"connections": n}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * n + 256)), hard))
    home = Path(tempfile.mkdtemp()) / "home"
    with affinity(serve_cpus):
        sp = start_serve(home, env=cli_env(home, APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT=str(n + 64)))
    url = sp.url.replace("http://", "ws://") + "/ws"
    try:
        boss = await websockets.connect(url, max_size=None)
        await boss.send(json.dumps({"type": "hello", "protocol": 1}))
        await boss.recv()
        await boss.send(json.dumps({"type": "create_conversation", "agent": "assistant", "request_id": "c"}))
        conv = json.loads(await boss.recv())["conversation"]["id"]
        base = rss_kib(sp.proc.pid)
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        conns: list[RawSubscriber] = []
        for i in range(0, n, 100):
            batch = await asyncio.gather(*(RawSubscriber.connect(host, int(port)) for _ in range(min(100, n - i))))
            conns.extend(batch)
        for c in conns:
            c.send({"type": "hello", "protocol": 1})
            c.send({"type": "subscribe", "conversation": conv})
        for c in conns:
            await asyncio.wait_for(c.frame(), 30)
            await asyncio.wait_for(c.frame(), 30)
        await asyncio.sleep(0.5)
        idle = rss_kib(sp.proc.pid)
        out["rss_per_connection_kib"] = (idle - base) / n
        say(f"connections: {n}")
        say(
            f"server RSS: {base} KiB before, {idle} KiB with {n} idle subscribed connections -> "
            f"{(idle - base) / n:.1f} KiB per connection"
        )

        done_at: list[float] = []

        async def wait_terminal(c: RawSubscriber) -> None:
            done_at.append(await asyncio.wait_for(c.wait_terminal(), 60))

        waiters = [asyncio.create_task(wait_terminal(c)) for c in conns]
        t0 = time.time()
        await boss.send(
            json.dumps({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "benchmark " * 20})
        )
        await asyncio.gather(*waiters)
        with sqlite3.connect(home / "appserver.db") as db:
            ended = db.execute(
                "SELECT ended_at FROM turns WHERE conversation_id=? ORDER BY rowid DESC LIMIT 1", (conv,)
            ).fetchone()[0]
        out["submit_to_last_ms"] = (max(done_at) - t0) * 1000
        say(f"submit -> last terminal snapshot: {(max(done_at) - t0) * 1000:.1f} ms")
        if ended:
            out["delivery_ms"] = sorted((t - ended) * 1000 for t in done_at)
            say(f"commit -> first terminal snapshot: {(min(done_at) - ended) * 1000:.1f} ms")
            say(
                f"commit -> last terminal snapshot:  {(max(done_at) - ended) * 1000:.1f} ms  "
                "(same clock, client and server on one host)"
            )
            d = out["delivery_ms"]
            say(f"commit -> terminal snapshot p99 across subscribers: {d[min(len(d) - 1, int(len(d) * 0.99))]:.1f} ms")
        for c in conns:
            c.close()
        await boss.close()
    finally:
        sp.stop()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--connections", type=int, default=1000)
    asyncio.run(run(p.parse_args().connections))
