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
import select
import sqlite3
import sys
import tempfile
import threading
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


class RawSubscriber(asyncio.Protocol):
    """A lean WebSocket client for the N subscribers: the handshake, masked text frames out, frames
    in scanned as bytes (JSON decoded only when one looks terminal). While a turn fans out, the
    subscribers' sockets are read by `watch_terminals` (a thread with its own epoll, no asyncio),
    which stamps each one's terminal snapshot as it reads it. The `websockets` client with
    `json.loads` on every frame costs the load generator ~100 µs per frame, and asyncio streams
    with a task per subscriber ~30 µs: with 1,000 subscribers on the same small machine the
    clients, not the server, then set the delivery time."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: asyncio.Future[bytes] = loop.create_future()
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()

    @classmethod
    async def connect(cls, host: str, port: int) -> RawSubscriber:
        _, sub = await asyncio.get_running_loop().create_connection(cls, host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        assert sub.transport is not None
        sub.transport.write(
            f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(sub.head, 30)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"WebSocket handshake refused: {head[:200]!r}")
        return sub

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.head.done():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head.set_result(bytes(self.buf[:end]))
            del self.buf[: end + 4]
        for payload in self.payloads(b""):
            self.frames.put_nowait(payload)

    def payloads(self, data: bytes) -> Iterator[bytes]:
        """The data frames' payloads complete in the buffer once `data` is added (control frames
        skipped); an incomplete frame stays for the next read."""
        buf = self.buf
        buf += data
        while len(buf) >= 2:
            b0, n = buf[0], buf[1] & 0x7F
            at = 2
            if n == 126:
                if len(buf) < 4:
                    return
                n, at = int.from_bytes(buf[2:4], "big"), 4
            elif n == 127:
                if len(buf) < 10:
                    return
                n, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < at + n:
                return
            payload = bytes(buf[at : at + n])
            del buf[: at + n]
            if b0 & 0x0F in (0x1, 0x2, 0x0):
                yield payload

    def terminal_in(self, data: bytes) -> bool:
        """Whether `data` completes a terminal snapshot of a turn."""
        for payload in self.payloads(data):
            if TERMINAL_HINT.search(payload):
                f = json.loads(payload)
                if f.get("type") == "turn_updated" and f["snapshot"]["status"] in ("completed", "failed", "cancelled"):
                    return True
        return False

    def send(self, frame: dict[str, Any]) -> None:
        payload = json.dumps(frame).encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
        key = (mask * (n // 4 + 1))[:n]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")
        assert self.transport is not None
        self.transport.write(head + mask + masked)

    async def frame(self) -> bytes:
        """The next data frame's payload (control frames skipped), while the loop reads."""
        return await asyncio.wait_for(self.frames.get(), 30)

    def fileno(self) -> int:
        assert self.transport is not None
        return int(self.transport.get_extra_info("socket").fileno())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def watch_terminals(subs: list[RawSubscriber], ready: threading.Event, timeout: float = 60) -> list[float]:
    """Read the (paused) subscribers' sockets with epoll until each has its terminal snapshot; the
    time each one's arrived, in no order. Raises if a connection closes or the time runs out."""
    poll = select.epoll()
    by_fd = {sub.fileno(): sub for sub in subs}
    for fd in by_fd:
        poll.register(fd, select.EPOLLIN)
    ready.set()
    arrived: list[float] = []
    deadline = time.monotonic() + timeout
    try:
        while len(arrived) < len(subs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(subs) - len(arrived)} subscribers saw no terminal snapshot in {timeout} s")
            for fd, _ in poll.poll(0.5):
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                now = time.time()
                if not data:
                    raise ConnectionError("the server closed a subscriber's connection")
                if by_fd[fd].terminal_in(data):
                    arrived.append(now)
                    poll.unregister(fd)
    finally:
        poll.close()
    return arrived


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
            await c.frame()
            await c.frame()
        await asyncio.sleep(0.5)
        idle = rss_kib(sp.proc.pid)
        out["rss_per_connection_kib"] = (idle - base) / n
        say(f"connections: {n}")
        say(
            f"server RSS: {base} KiB before, {idle} KiB with {n} idle subscribed connections -> "
            f"{(idle - base) / n:.1f} KiB per connection"
        )

        for c in conns:
            assert c.transport is not None
            c.transport.pause_reading()  # from now on watch_terminals reads them
        ready = threading.Event()
        watching = asyncio.ensure_future(asyncio.to_thread(watch_terminals, conns, ready))
        await asyncio.to_thread(ready.wait, 30)
        t0 = time.time()
        await boss.send(
            json.dumps({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "benchmark " * 20})
        )
        done_at = await watching
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
