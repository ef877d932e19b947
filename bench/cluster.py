"""Turns per second through `appserver serve`: SQLite, PostgreSQL, and three servers on one
PostgreSQL database, side by side in one run (prints; asserts nothing).

    .venv/bin/python bench/cluster.py [--seconds 5] [--concurrency 32]

Each target gets the same load: `--concurrency` clients posting non-stream chat completions (the
offline `echo` model, so what is measured is the server's own cost per turn: HTTP, the kernel,
the store) for `--seconds`, in two shapes:

- `new`: every request starts a conversation (no cross-server work; each server runs its own).
- `shared`: 16 conversations, the clients spread over them and, with three servers, over the
  servers round-robin, so most inputs arrive at a server that does not hold their conversation
  (queued in the database, pulled by the holder, followed through its published snapshots).

A 2-core machine shows the per-turn cost of each setup, not scaling: three servers share the same
two cores (and the database's).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import http_request, one_request, read_response  # noqa: E402

from tests.support.cli import cli_env  # noqa: E402
from tests.support.pg import temp_database  # noqa: E402
from tests.support.serve import ServeProcess, start_serve  # noqa: E402

SHARED_CONVERSATIONS = 16


async def _drive(urls: list[str], seconds: float, concurrency: int, shared: bool) -> tuple[float, int]:
    """`concurrency` clients, each on one keep-alive connection to one server (spread over the
    servers), posting non-stream chat completions for `seconds`; a raw HTTP/1.1 client (from
    bench/compare.py), so the client's own cost stays small next to the servers'."""
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    convs: list[str] = []
    if shared:
        for i in range(SHARED_CONVERSATIONS):
            port = ports[i % len(ports)]
            resp = await one_request(port, http_request("/v1/chat/completions", port, _body("start")))
            convs.append(resp.headers["x-conversation-id"])
    done, errors = 0, 0
    deadline = time.perf_counter() + seconds

    async def client_loop(w: int) -> None:
        nonlocal done, errors
        port = ports[w % len(ports)]
        headers = {"X-Conversation-Id": convs[(w * 7) % len(convs)]} if shared else {}
        data = http_request("/v1/chat/completions", port, _body("hi"), headers)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                writer.write(data)
                resp = await asyncio.wait_for(read_response(reader), 30)
                if resp.status == 200:
                    done += 1
                else:
                    errors += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(w) for w in range(concurrency)))
    return done / (time.perf_counter() - t0), errors


def _body(text: str) -> dict[str, object]:
    return {"model": "assistant", "messages": [{"role": "user", "content": text}]}


def _start(tmp: Path, n: int, url: str | None) -> list[ServeProcess]:
    nodes = []
    for i in range(n):
        home = tmp / f"node{i}"
        env = cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="1000")
        if url:
            env["APPSERVER_STORE__URL"] = url
        nodes.append(start_serve(home, env=env))
    return nodes


def _measure(label: str, tmp: Path, n: int, url: str | None, args: argparse.Namespace) -> dict[str, float]:
    nodes = _start(tmp, n, url)
    try:
        urls = [sp.url for sp in nodes]
        out = {}
        for shape in ("new", "shared"):
            rate, errors = asyncio.run(_drive(urls, args.seconds, args.concurrency, shape == "shared"))
            out[shape] = rate
            note = f"  ({errors} errors)" if errors else ""
            print(f"  {label:<28} {shape:<7} {rate:9.0f} turns/s{note}", flush=True)
        return out
    finally:
        for sp in nodes:
            sp.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    print(f"turns/s through appserver serve, {args.concurrency} clients, {args.seconds:g} s per shape")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results["SQLite, 1 server"] = _measure("SQLite, 1 server", tmp / "sqlite", 1, None, args)
        with temp_database("bench_cluster1") as url:
            results["PostgreSQL, 1 server"] = _measure("PostgreSQL, 1 server", tmp / "pg1", 1, url, args)
        with temp_database("bench_cluster3") as url:
            results["PostgreSQL, 3 servers"] = _measure("PostgreSQL, 3 servers", tmp / "pg3", 3, url, args)
    base = results["SQLite, 1 server"]
    print()
    print(f"{'target':<24} {'new':>10} {'shared':>10}   (ratio to SQLite, 1 server)")
    for label, r in results.items():
        print(
            f"{label:<24} {r['new']:>10.0f} {r['shared']:>10.0f}   "
            f"{r['new'] / base['new']:.2f}× / {r['shared'] / base['shared']:.2f}×"
        )


if __name__ == "__main__":
    main()
