"""HTTP overhead of the OpenAI surface: an agent on the `openai` provider kind pointed at a loopback
fake upstream; the same chat completion through `appserver serve` vs straight to the upstream.

Prints median / p99 latency at concurrency 1 and 64 and their ratios, plus the streamed
time-to-first-token added. Target: <= 1.5 ms added median at concurrency 1. Prints, never asserts.

    .venv/bin/python bench/http_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.cli import cli_env, run_cli  # noqa: E402
from tests.support.serve import start_serve  # noqa: E402

WORDS = ["Hello", " from", " the", " fake", " upstream", "."]


async def completions(request: Request):  # type: ignore[no-untyped-def]
    body = await request.json()
    base = {"id": "chatcmpl-fake", "created": int(time.time()), "model": body.get("model", "m")}
    if not body.get("stream"):
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(WORDS)},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
            }
        )

    async def gen():  # type: ignore[no-untyped-def]
        for w in WORDS:
            chunk = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        last = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
        }
        yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def upstream_app() -> Starlette:
    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def start_upstream() -> tuple[str, subprocess.Popen]:
    """The fake upstream in its own process: sharing the client's process (and GIL) would make the
    bench measure the client's CPU at concurrency 64 more than the server's."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, __file__, "--upstream-port", str(port)])
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("the fake upstream did not start")
            time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1", proc


async def measure(url: str, body: dict, total: int, concurrency: int) -> list[float]:
    """Latencies of `total` requests from `concurrency` clients, each with its own connection: one
    shared httpx pool of 64 connections spends more CPU on its own bookkeeping than the server does."""
    latencies: list[float] = []
    queue = list(range(total))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            queue.pop()
            t0 = time.perf_counter()
            r = await client.post(url, json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(timeout=60, limits=limits) for _ in range(concurrency)]
    try:
        for _ in range(min(20, total)):  # warm-up
            await clients[0].post(url, json=body)
        await asyncio.gather(*(worker(c) for c in clients))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return latencies


async def ttft(url: str, body: dict, n: int) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", url, json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    compact = line.replace(" ", "")
                    if (
                        first is None
                        and line.startswith("data: ")
                        and '"content":"' in compact
                        and '"content":""' not in compact
                    ):
                        first = time.perf_counter() - t0
            if first is not None:
                out.append(first)
    return out


def stats(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values) * 1000, values[min(len(values) - 1, int(len(values) * 0.99))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)  # internal: be the fake upstream
    args = ap.parse_args()
    if args.upstream_port:
        uvicorn.run(upstream_app(), host="127.0.0.1", port=args.upstream_port, log_level="error", lifespan="off")
        return
    upstream, up_proc = start_upstream()
    home = Path(tempfile.mkdtemp(prefix="appserver-bench-")) / "home"
    env = cli_env(
        home,
        APPSERVER_PROVIDERS__FAKE__KIND="openai",
        APPSERVER_PROVIDERS__FAKE__BASE_URL=upstream,
        APPSERVER_DISABLE_CRON="1",
        APPSERVER_LIMITS__QUEUE_MAX="10000",
    )
    os.environ.update({k: v for k, v in env.items() if k.startswith("APPSERVER_")})
    r = run_cli(home, "agents", "create", "--name", "bench", "--model", "fake:m", env=env)
    if r.code != 0:
        sys.exit(f"could not create the agent: {r.err}")
    sp = start_serve(home, env=env)
    for pipe in (sp.proc.stdout, sp.proc.stderr):  # drain them: a full pipe would stall the server
        threading.Thread(target=pipe.read, daemon=True).start()
    try:
        direct_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        served_body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
        print(f"{'':24}{'median ms':>12}{'p99 ms':>10}")
        for conc in (1, 64):
            total = args.requests if conc == 1 else max(args.requests, 64 * 5)
            d = stats(asyncio.run(measure(f"{upstream}/chat/completions", direct_body, total, conc)))
            s = stats(asyncio.run(measure(f"{sp.url}/v1/chat/completions", served_body, total, conc)))
            print(f"upstream  c={conc:<3}         {d[0]:>12.2f}{d[1]:>10.2f}")
            print(f"server    c={conc:<3}         {s[0]:>12.2f}{s[1]:>10.2f}")
            print(
                f"  ratio (server/upstream): median {s[0] / d[0]:.2f}x, p99 {s[1] / d[1]:.2f}x; "
                f"added median {s[0] - d[0]:.2f} ms"
            )
        n = min(100, args.requests)
        td = stats(asyncio.run(ttft(f"{upstream}/chat/completions", direct_body, n)))
        ts = stats(asyncio.run(ttft(f"{sp.url}/v1/chat/completions", served_body, n)))
        print(
            f"streamed time to first token: upstream {td[0]:.2f} ms, server {ts[0]:.2f} ms, "
            f"added {ts[0] - td[0]:.2f} ms (median)"
        )
    finally:
        sp.stop()
        up_proc.terminate()
        up_proc.wait(10)


if __name__ == "__main__":
    main()
