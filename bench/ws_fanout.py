"""Fan-out benchmark: N subscribed connections on one conversation; time from a turn's commit to
the last terminal snapshot delivered, and the server's RSS per idle connection. Prints, no asserts.

    .venv/bin/python bench/ws_fanout.py [--connections 1000]

`run(n)` also returns the numbers (bench/compare.py calls it with `quiet=True`), among them each
subscriber's delivery time: its terminal snapshot's arrival minus the turn's commit (`ended_at`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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
        conns = []
        for i in range(0, n, 100):
            batch = await asyncio.gather(*(websockets.connect(url, max_size=None) for _ in range(min(100, n - i))))
            conns.extend(batch)
        for c in conns:
            await c.send(json.dumps({"type": "hello", "protocol": 1}))
            await c.send(json.dumps({"type": "subscribe", "conversation": conv}))
        for c in conns:
            await c.recv()
            await c.recv()
        await asyncio.sleep(0.5)
        idle = rss_kib(sp.proc.pid)
        out["rss_per_connection_kib"] = (idle - base) / n
        say(f"connections: {n}")
        say(
            f"server RSS: {base} KiB before, {idle} KiB with {n} idle subscribed connections -> "
            f"{(idle - base) / n:.1f} KiB per connection"
        )

        done_at: list[float] = []

        async def wait_terminal(c: websockets.ClientConnection) -> None:
            while True:
                f = json.loads(await c.recv())
                if f["type"] == "turn_updated" and f["snapshot"]["status"] in ("completed", "failed", "cancelled"):
                    done_at.append(time.time())
                    return

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
        await asyncio.gather(*(c.close() for c in conns))
        await boss.close()
    finally:
        sp.stop()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--connections", type=int, default=1000)
    asyncio.run(run(p.parse_args().connections))
