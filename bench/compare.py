"""The server beside the upstream it fronts (and LiteLLM proxy, when installed): one table of ratios.

An instant OpenAI-compatible upstream runs in its own process; `appserver serve` (agent `m` on a
provider of kind `openai` pointed at it) and, when found, LiteLLM proxy (one worker, model `m`)
run in front of it. One load generator (wrk when installed, else a built-in asyncio client) sends
the same body to all three: `{"model": "m", "messages": [{"role": "user", "content": "hi"}]}`.

Parts (`--only`, repeatable): http (c=1 latency, c=64 req/s, RSS), stream (1,000 concurrent SSE
streams with fixed gaps; time to first token at c=1), soak (memory over 100,000 turns, 3 times),
ws (one turn fanned out to 1,000 WebSocket subscribers), startup (`appserver --help`, spawn to
first 200). Prints the issue's targets beside the measured values; never asserts. Writes
bench/results/compare.json and compare.png (matplotlib, the `bench` extra).

    .venv/bin/python bench/compare.py [--quick] [--only http] [--litellm PATH] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.cli import cli_env, run_cli  # noqa: E402
from tests.support.serve import ServeProcess, start_serve  # noqa: E402

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM_AGENT = "mstream"  # the server's agent on the upstream's slow (gapped) streaming path
WORDS = ["Hello", " from", " the", " fake", " upstream", "."]
LITELLM_HINT = "not installed (pip install 'litellm[proxy]')"
# The commit issue 20 measured (638 req/s at c=64): `--baseline` serves it beside the current code,
# so "4x today" is a ratio measured in one run instead of against a number from another day's host.
ISSUE_REV = "a00da74"
PCTS: list[float] = [float(p) for p in range(1, 100)] + [99.9, 99.99]

# The issue's targets (issue 20), printed beside the measured values.
TARGETS = {
    "c64_rps": 2500.0,  # c=64 through the server, one process: at least
    "c1_added_p50_ms": 1.0,  # c=1 added median: at most
    "c1_p99_ms": 5.0,  # c=1 p99 through the server: at most
    "stream_added_p99_gap_ms": 20.0,
    "ttft_added_ms": 2.0,
    "rss_idle_mb": 70.0,
    "rss_after_evict_factor": 1.3,
    "start_to_200_s": 0.5,
    "help_s": 0.15,
    "ws_p99_ms": 50.0,
}

T = TypeVar("T")


# ---------------------------------------------------------------- pure parts (tests/test_bench_compare.py)


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0..100) of ascending values, linear between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def percentiles(values: list[float], ps: list[float] | None = None) -> dict[float, float]:
    s = sorted(values)
    return {p: percentile(s, p) for p in (PCTS if ps is None else ps)}


WRK_LUA = """\
wrk.method = "POST"
wrk.body = [==[__BODY__]==]
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH requests %d\\n", summary.requests))
  io.write(string.format("BENCH duration_us %d\\n", summary.duration))
  io.write(string.format("BENCH errors connect=%d read=%d write=%d status=%d timeout=%d\\n",
    e.connect, e.read, e.write, e.status, e.timeout))
  io.write(string.format("BENCH latency_us min=%d mean=%.1f max=%d\\n", latency.min, latency.mean, latency.max))
  for _, p in ipairs({__PCTS__}) do
    io.write(string.format("BENCH pct %g %d\\n", p, latency:percentile(p)))
  end
end
"""


def wrk_lua(body: dict[str, Any]) -> str:
    return WRK_LUA.replace("__BODY__", json.dumps(body)).replace("__PCTS__", ", ".join(f"{p:g}" for p in PCTS))


@dataclass
class LoadRun:
    """One load run: request count, wall time, errors by kind, latency percentiles in ms."""

    requests: int
    duration_s: float
    errors: dict[str, int] = field(default_factory=dict)
    pct_ms: dict[float, float] = field(default_factory=dict)
    mean_ms: float = float("nan")
    max_ms: float = float("nan")

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def p(self, q: float) -> float:
        return self.pct_ms.get(q, float("nan"))

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "rps": round(self.rps, 1),
            "errors": self.errors,
            "mean_ms": self.mean_ms,
            "max_ms": self.max_ms,
            "pct_ms": {f"{k:g}": round(v, 4) for k, v in self.pct_ms.items()},
        }


def parse_wrk(text: str) -> LoadRun:
    """wrk's stdout with the `BENCH …` lines that WRK_LUA's done() prints (microseconds → ms)."""
    run = LoadRun(0, 0.0)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "BENCH":
            continue
        key = parts[1]
        if key == "requests":
            run.requests = int(parts[2])
        elif key == "duration_us":
            run.duration_s = int(parts[2]) / 1e6
        elif key == "errors":
            for kv in parts[2:]:
                k, _, v = kv.partition("=")
                if int(v):
                    run.errors[k] = int(v)
        elif key == "latency_us":
            vals = dict(kv.partition("=")[::2] for kv in parts[2:])
            run.mean_ms = float(vals.get("mean", "nan")) / 1000
            run.max_ms = float(vals.get("max", "nan")) / 1000
        elif key == "pct" and len(parts) == 4:
            run.pct_ms[float(parts[2])] = int(parts[3]) / 1000
    return run


def load_from_latencies(latencies_s: list[float], duration_s: float, errors: dict[str, int]) -> LoadRun:
    pct = {p: v * 1000 for p, v in percentiles(latencies_s).items()} if latencies_s else {}
    return LoadRun(
        len(latencies_s),
        duration_s,
        dict(errors),
        pct,
        statistics.fmean(latencies_s) * 1000 if latencies_s else float("nan"),
        max(latencies_s) * 1000 if latencies_s else float("nan"),
    )


@dataclass
class Row:
    """One target's line of the comparison table (ms, req/s, MB, s; None = not measured)."""

    name: str
    c1_p50: float | None = None
    c1_p99: float | None = None
    c64_rps: float | None = None
    rss_idle_mb: float | None = None
    rss_after_mb: float | None = None
    start_s: float | None = None
    note: str = ""


def ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base <= 0 or value != value or base != base:
        return ""
    r = value / base
    shown = f"{r:.0f}" if r >= 100 else f"{r:.1f}" if r >= 10 else f"{r:.2f}" if r >= 0.1 else f"{r:.2g}"
    return f" ({shown}×)"


def fmt_ms(v: float | None) -> str:
    if v is None or v != v:
        return "—"
    return f"{v:.2f} ms" if v < 10 else f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


def table(rows: list[Row], direct: Row | None = None) -> str:
    """A markdown table; every row but `direct` shows its ratio to `direct` after each number."""
    head = ["target", "c=1 p50", "c=1 p99", "c=64 req/s", "RSS idle → after load", "start to first 200"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = None if r is direct else direct
        if r.note and r.c1_p50 is None and r.c64_rps is None:
            cells = [r.name, r.note, "—", "—", "—", "—"]
        else:
            rps = "—" if r.c64_rps is None else f"{r.c64_rps:,.0f}" + ratio(r.c64_rps, base and base.c64_rps)
            rss = (
                "—"
                if r.rss_idle_mb is None
                else f"{r.rss_idle_mb:.0f} → {r.rss_after_mb:.0f} MB"
                if r.rss_after_mb is not None
                else f"{r.rss_idle_mb:.0f} MB"
            )
            cells = [
                r.name + (f" ({r.note})" if r.note else ""),
                fmt_ms(r.c1_p50) + ratio(r.c1_p50, base and base.c1_p50),
                fmt_ms(r.c1_p99) + ratio(r.c1_p99, base and base.c1_p99),
                rps,
                rss,
                "—" if r.start_s is None else f"{r.start_s:.2f} s",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(value: float | None, target: float, at_least: bool = False) -> str:
    if value is None or value != value:
        return "not measured"
    ok = value >= target if at_least else value <= target
    return "meets" if ok else "misses"


def fmt_num(v: float | None) -> str:
    if v is None or v != v:
        return "—"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}" if v else "0"


def target_line(what: str, value: float | None, unit: str, target: float, at_least: bool = False) -> str:
    sign = "≥" if at_least else "≤"
    want = f"{sign} {target:,g} {unit}".rstrip()
    return f"  {what:<44} {fmt_num(value):>9} {unit:<6} target {want:<14} {verdict(value, target, at_least)}"


def stream_gaps(arrivals: list[float]) -> list[float]:
    """Gaps between successive content-chunk arrivals of one stream."""
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def max_in_flight(intervals: list[tuple[float, float]]) -> int:
    """The most intervals (first to last token of a stream) open at one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


# ---------------------------------------------------------------- the instant upstream (its own process)


def upstream_app(gap_s: float, tokens: int) -> Callable[..., Awaitable[None]]:
    """A bare ASGI app: /v1/chat/completions answers at once (JSON, or the 6-word stream when
    `stream` is set); /slow/v1/chat/completions streams `tokens` tokens `gap_s` apart."""
    now = int(time.time())
    base = {"id": "chatcmpl-fake", "created": now, "model": "m"}
    usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj: dict[str, Any] = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if finish:
            obj["usage"] = usage
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def completion(text: str) -> bytes:
        return json.dumps(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": usage,
            },
            separators=(",", ":"),
        ).encode()

    fast_json = completion("".join(WORDS))
    fast_stream = b"".join([chunk({"role": "assistant", "content": ""})] + [chunk({"content": w}) for w in WORDS])
    fast_stream += chunk({}, "stop") + b"data: [DONE]\n\n"
    slow_tokens = [f"t{i} " for i in range(tokens)]
    slow_json = completion("".join(slow_tokens))
    slow_chunks = [chunk({"content": t}) for t in slow_tokens]
    slow_tail = chunk({}, "stop") + b"data: [DONE]\n\n"
    json_head = [(b"content-type", b"application/json")]
    sse_head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if not path.endswith("/chat/completions"):
            await send({"type": "http.response.start", "status": 404, "headers": json_head})
            await send({"type": "http.response.body", "body": b'{"error":{"message":"not found"}}'})
            return
        try:
            stream = bool(json.loads(body).get("stream"))
        except ValueError:
            await send({"type": "http.response.start", "status": 400, "headers": json_head})
            await send({"type": "http.response.body", "body": b'{"error":{"message":"bad json"}}'})
            return
        slow = path.startswith("/slow/")
        if not stream:
            await send({"type": "http.response.start", "status": 200, "headers": json_head})
            await send({"type": "http.response.body", "body": slow_json if slow else fast_json})
            return
        await send({"type": "http.response.start", "status": 200, "headers": sse_head})
        if not slow:
            await send({"type": "http.response.body", "body": fast_stream})
            return
        for i, c in enumerate(slow_chunks):
            if i:
                await asyncio.sleep(gap_s)
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": slow_tail})

    return app


def serve_upstream(port: int, gap_ms: float, tokens: int) -> None:
    import uvicorn

    uvicorn.run(
        upstream_app(gap_ms / 1000, tokens),
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="off",
        access_log=False,
        backlog=4096,
    )


# ---------------------------------------------------------------- processes, CPUs, memory

_children: list[subprocess.Popen[Any]] = []


def track(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    _children.append(proc)
    return proc


def end(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def end_all() -> None:
    for p in reversed(_children):
        with contextlib.suppress(Exception):
            end(p, 5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"process {proc.args} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port} after {timeout} s") from None
            time.sleep(0.02)


class Cpus:
    """On ≥ 2 CPUs: the target under test on the first, this process (load generator) and the
    upstream on the rest. Children inherit the affinity of the thread that spawns them."""

    def __init__(self, enabled: bool) -> None:
        allowed = sorted(os.sched_getaffinity(0))
        self.pinned = enabled and len(allowed) >= 2
        self.target = {allowed[0]} if self.pinned else set(allowed)
        self.rest = set(allowed[1:]) if self.pinned else set(allowed)
        if self.pinned:
            os.sched_setaffinity(0, self.rest)

    def describe(self) -> str:
        if not self.pinned:
            return f"CPU placement: unpinned ({len(self.rest)} CPU)"
        return (
            f"CPU placement: target under test on CPU {sorted(self.target)}, "
            f"load generator + upstream on CPU {sorted(self.rest)}"
        )

    @contextlib.contextmanager
    def for_target(self) -> Iterator[None]:
        """Spawn inside this block to start a process on the target CPU."""
        if not self.pinned:
            yield
            return
        os.sched_setaffinity(0, self.target)
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.rest)

    def move(self, pid: int, cpus: set[int]) -> None:
        """Every thread of `pid` to `cpus` (the direct row: the upstream is then the target)."""
        if not self.pinned:
            return
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def tree_pids(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in task.read_text().split())
    return out


def rss_mb(pid: int) -> float:
    """VmRSS of `pid` and its descendants, in MB."""
    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


class Drain:
    """Reads a child's pipe so it never blocks; keeps the last lines and counts tracebacks/errors."""

    def __init__(self, *pipes: Any) -> None:
        self.tail: deque[str] = deque(maxlen=200)
        self.tracebacks = 0
        self.errors = 0
        for pipe in pipes:
            if pipe is not None:
                threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        with contextlib.suppress(Exception):
            for line in pipe:
                text = line if isinstance(line, str) else line.decode(errors="replace")
                self.tail.append(text.rstrip())
                if text.startswith("Traceback"):
                    self.tracebacks += 1
                if " ERROR " in text or text.startswith("ERROR"):
                    self.errors += 1


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---------------------------------------------------------------- the built-in HTTP/1.1 client


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes


def http_request(path: str, port: int, body: dict[str, Any] | None, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    method = "POST" if body is not None else "GET"
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The data of a chunked body, chunk by chunk (trailers ignored)."""
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed inside a chunked body")
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def body_parts(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "content-length" in headers:
        n = int(headers["content-length"])
        if n:
            yield await reader.readexactly(n)
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        async for c in chunks(reader):
            yield c
    else:
        while data := await reader.read(65536):
            yield data


async def read_response(reader: asyncio.StreamReader) -> Resp:
    status, headers = await read_head(reader)
    body = b"".join([part async for part in body_parts(reader, headers)])
    return Resp(status, headers, body)


async def one_request(port: int, data: bytes, timeout: float = 10) -> Resp:
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            return await read_response(reader)
        finally:
            writer.close()


async def drive(
    port: int,
    make: Callable[[int], bytes],
    concurrency: int,
    *,
    total: int | None = None,
    duration: float | None = None,
    on_response: Callable[[int, Resp], None] | None = None,
    timeout: float = 30,
) -> tuple[list[float], float, dict[str, int]]:
    """`concurrency` workers, one keep-alive connection each, until `total` requests or `duration`
    seconds. Returns every latency (s), the wall time and the errors by kind."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counter = 0
    t_start = time.perf_counter()
    end_at = t_start + duration if duration else float("inf")

    def err(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    async def worker() -> None:
        nonlocal counter
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while (total is None or counter < total) and time.perf_counter() < end_at:
                i = counter
                counter += 1
                try:
                    async with asyncio.timeout(timeout):
                        if conn is None:
                            conn = await asyncio.open_connection("127.0.0.1", port)
                        reader, writer = conn
                        t0 = time.perf_counter()
                        writer.write(make(i))
                        resp = await read_response(reader)
                        latencies.append(time.perf_counter() - t0)
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                    err(type(exc).__name__)
                    if conn is not None:
                        conn[1].close()
                    conn = None
                    await asyncio.sleep(0.01)
                    continue
                except TimeoutError:
                    err("timeout")
                    if conn is not None:
                        conn[1].close()
                    conn = None
                    continue
                if resp.status != 200:
                    err(f"status {resp.status}")
                if on_response is not None:
                    on_response(i, resp)
                if resp.headers.get("connection", "").lower() == "close":
                    conn[1].close()
                    conn = None
        finally:
            if conn is not None:
                conn[1].close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t_start, errors


def builtin_load(port: int, path: str, body: dict[str, Any], concurrency: int, duration: float) -> LoadRun:
    data = http_request(path, port, body)
    lat, wall, errors = run_async(drive(port, lambda _i: data, concurrency, duration=duration))
    return load_from_latencies(lat, wall, errors)


def wrk_load(wrk: str, url: str, body: dict[str, Any], concurrency: int, duration: float, workdir: Path) -> LoadRun:
    script = workdir / "bench.lua"
    script.write_text(wrk_lua(body))
    cmd = [wrk, "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s", "--timeout", "10s", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    run = parse_wrk(out.stdout)
    if run.requests == 0 and out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr.strip()}")
    return run


# ---------------------------------------------------------------- the built-in SSE client


@dataclass
class StreamRun:
    status: int = 0
    error: str = ""
    ttft_s: float | None = None
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    text: str = ""
    done: bool = False


async def sse_stream(port: int, data: bytes, timeout: float, stop_after_first: bool = False) -> StreamRun:
    run = StreamRun()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            t0 = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            run.status, headers = await read_head(reader)
            if run.status != 200:
                run.error = f"status {run.status}"
                return run
            buf = b""
            async for part in body_parts(reader, headers):
                now = time.perf_counter()
                buf += part.replace(b"\r\n", b"\n")
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    for line in ev.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            run.done = True
                            continue
                        obj = json.loads(payload)
                        choices = obj.get("choices") or [{}]
                        content = (choices[0].get("delta") or {}).get("content")
                        if content:
                            if run.ttft_s is None:
                                run.ttft_s = now - t0
                            run.arrivals.append(now)
                            run.text += content
                if stop_after_first and run.ttft_s is not None:
                    return run
    except TimeoutError:
        run.error = "timeout"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        run.error = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    return run


# ---------------------------------------------------------------- targets under test


@dataclass
class Bench:
    args: argparse.Namespace
    cpus: Cpus
    work: Path
    results: dict[str, Any] = field(default_factory=dict)
    upstream_port: int = 0
    upstream_proc: subprocess.Popen[Any] | None = None
    server: ServeProcess | None = None
    server_log: Drain | None = None
    server_rss_idle: float = 0.0
    server_home: Path | None = None

    @property
    def upstream(self) -> str:
        return f"http://127.0.0.1:{self.upstream_port}"

    def ensure_upstream(self) -> None:
        if self.upstream_proc is not None:
            return
        port = free_port()
        cmd = [sys.executable, __file__, "--upstream-port", str(port), "--gap-ms", str(self.args.gap_ms)]
        cmd += ["--tokens", str(self.args.tokens)]
        self.upstream_proc = track(subprocess.Popen(cmd))
        wait_port(port, self.upstream_proc)
        self.upstream_port = port

    def server_env(self, home: Path, **extra: str) -> dict[str, str]:
        return cli_env(
            home,
            APPSERVER_PROVIDERS__FAKE__KIND="openai",
            APPSERVER_PROVIDERS__FAKE__BASE_URL=f"{self.upstream}/v1",
            APPSERVER_PROVIDERS__SLOW__KIND="openai",
            APPSERVER_PROVIDERS__SLOW__BASE_URL=f"{self.upstream}/slow/v1",
            APPSERVER_DISABLE_CRON="1",
            APPSERVER_LIMITS__QUEUE_MAX="10000",
            APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT=str(self.args.streams + 256),
            **extra,
        )

    def make_home(self, name: str, env_extra: dict[str, str] | None = None) -> tuple[Path, dict[str, str]]:
        home = self.work / name
        env = self.server_env(home, **(env_extra or {}))
        for agent, model in (("m", "fake:m"), (STREAM_AGENT, "slow:m")):
            r = run_cli(home, "agents", "create", "--name", agent, "--model", model, env=env)
            if r.code != 0:
                raise RuntimeError(f"could not create the agent {agent}: {r.err}")
        return home, env

    def start_server(self, home: Path, env: dict[str, str]) -> tuple[ServeProcess, Drain]:
        with self.cpus.for_target():
            sp = start_serve(home, env=env)
        track(sp.proc)
        return sp, Drain(sp.proc.stdout, sp.proc.stderr)

    def ensure_server(self) -> ServeProcess:
        self.ensure_upstream()
        if self.server is None:
            self.server_home, env = self.make_home("main")
            self.server, self.server_log = self.start_server(self.server_home, env)
            time.sleep(0.5)
            self.server_rss_idle = rss_mb(self.server.proc.pid)
        return self.server


def server_port(sp: ServeProcess) -> int:
    return int(sp.url.rsplit(":", 1)[1].split("/")[0])


def find_litellm(arg: str | None) -> str | None:
    for cand in (arg, os.environ.get("LITELLM_BIN"), shutil.which("litellm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def litellm_version(exe: str) -> str:
    pip = Path(exe).with_name("pip")
    try:
        if pip.exists():
            out = subprocess.run([str(pip), "show", "litellm"], capture_output=True, text=True, timeout=60).stdout
            for line in out.splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        return out.rsplit("=", 1)[-1].strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


async def first_200(port: int, data: bytes, proc: subprocess.Popen[Any], t0: float, timeout: float) -> float | None:
    """Seconds from `t0` (just before the spawn) to the first 200 on `data`; None if it never came."""
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            r = await one_request(port, data, timeout=5)
            if r.status == 200:
                return time.perf_counter() - t0
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass
        await asyncio.sleep(0.005)
    return None


def start_litellm(b: Bench, exe: str) -> tuple[subprocess.Popen[Any], int, float | None, Drain]:
    cfg = b.work / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        "  - model_name: m\n"
        "    litellm_params:\n"
        "      model: openai/m\n"
        f"      api_base: {b.upstream}/v1\n"
        "      api_key: dummy\n"
    )
    port = free_port()
    # no master key, as the server runs here (loopback, no auth); the local cost map: no fetch at start
    env = dict(
        os.environ,
        LITELLM_LOG="ERROR",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY="true",
    )
    cmd = [exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    t0 = time.perf_counter()
    with b.cpus.for_target():
        proc = track(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=b.work, text=True)
        )
    log = Drain(proc.stdout, proc.stderr)
    started = run_async(first_200(port, http_request("/v1/chat/completions", port, BODY), proc, t0, 180))
    if started is None:
        end(proc)
        tail = "\n".join(list(log.tail)[-15:])
        raise RuntimeError(f"LiteLLM did not answer 200 within 180 s:\n{tail}")
    return proc, port, started, log


# ---------------------------------------------------------------- parts


def load(b: Bench, port: int, path: str, body: dict[str, Any], concurrency: int, duration: float) -> LoadRun:
    wrk = None if b.args.builtin_client else shutil.which("wrk")
    if wrk:
        return wrk_load(wrk, f"http://127.0.0.1:{port}{path}", body, concurrency, duration, b.work)
    return builtin_load(port, path, body, concurrency, duration)


def measure_target(b: Bench, name: str, port: int, path: str, body: dict[str, Any]) -> dict[str, LoadRun]:
    d = b.args.duration
    warm = load(b, port, path, body, 8, min(2.0, d))  # warm-up: caches, connection pools, JIT-less but real
    if warm.requests == 0:
        raise RuntimeError(f"{name}: no request succeeded during the warm-up ({warm.errors})")
    c1 = load(b, port, path, body, 1, d)
    c64 = load(b, port, path, body, 64, d)
    for label, run in (("c=1", c1), ("c=64", c64)):
        errs = f", errors {run.errors}" if run.errors else ""
        print(
            f"  {name:<10} {label:<5} {run.requests:>8,} requests in {run.duration_s:5.1f} s = {run.rps:>8,.0f} req/s, "
            f"p50 {fmt_ms(run.p(50))}, p99 {fmt_ms(run.p(99))}, p99.9 {fmt_ms(run.p(99.9))}{errs}",
            flush=True,
        )
    return {"c1": c1, "c64": c64}


def export_rev(rev: str, tree: Path) -> Path:
    """Git revision `rev` of this repository as files in `tree` (made here), by `git archive`."""
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def serve_tree(
    tree: Path, env: dict[str, str], label: str, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """`appserver serve` run from the source tree `tree` (PYTHONPATH in `env` names it), with agent
    `m` on provider `fake` created first; `prefix` goes before the command (e.g. taskset)."""
    made = subprocess.run(
        [sys.executable, "-m", "appserver", "agents", "create", "--name", "m", "--model", "fake:m"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if made.returncode != 0:
        raise RuntimeError(f"{label}: could not create the agent: {made.stderr.strip()}")
    port = free_port()
    cmd = [*prefix, sys.executable, "-m", "appserver", "serve", "--listen", f"127.0.0.1:{port}"]
    proc = track(subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_port(port, proc, timeout=60)
    return proc, port


def measure_baseline(b: Bench, rev: str) -> dict[str, Any]:
    """The server of git revision `rev` (exported with `git archive`, run from its own tree with the
    same interpreter, packages, upstream and agent) under the same load as the current code."""
    tree = export_rev(rev, b.work / f"baseline-{rev}")
    home = b.work / "baseline-home"
    env = {**b.server_env(home), "PYTHONPATH": str(tree)}
    env.pop("PYTHONSAFEPATH", None)
    with b.cpus.for_target():
        proc, port = serve_tree(tree, env, f"baseline {rev}")
    try:
        time.sleep(0.5)
        idle = rss_mb(proc.pid)
        runs: dict[str, Any] = measure_target(b, f"@{rev}", port, "/v1/chat/completions", BODY)
        runs.update(rss_idle_mb=idle, rss_after_mb=rss_mb(proc.pid))
        return runs
    finally:
        end(proc)


def measure_relay(b: Bench) -> dict[str, Any]:
    """bench/bare_relay.py (uvicorn + the server's upstream client, nothing else) on the target
    CPU, under the same load: the floor the server's own work stands on."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "bench" / "bare_relay.py"), "--port", str(port), "--upstream", f"{b.upstream}/v1"]
    with b.cpus.for_target():
        proc = track(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        wait_port(port, proc, timeout=60)
        time.sleep(0.5)
        idle = rss_mb(proc.pid)
        runs: dict[str, Any] = measure_target(b, "relay", port, "/v1/chat/completions", BODY)
        runs.update(rss_idle_mb=idle, rss_after_mb=rss_mb(proc.pid))
        return runs
    finally:
        end(proc)


def part_http(b: Bench) -> None:
    print("\n== HTTP: non-stream chat completion, same body to every target ==", flush=True)
    print(
        f"  load generator: {'built-in asyncio client' if b.args.builtin_client or not shutil.which('wrk') else 'wrk'}"
    )
    b.ensure_upstream()
    assert b.upstream_proc is not None
    rows: list[Row] = []
    res: dict[str, Any] = {}
    # the upstream alone: while it is the target, it gets the target CPU
    b.cpus.move(b.upstream_proc.pid, b.cpus.target)
    try:
        direct = measure_target(b, "upstream", b.upstream_port, "/v1/chat/completions", BODY)
    finally:
        b.cpus.move(b.upstream_proc.pid, b.cpus.rest)
    rows.append(Row("upstream directly", direct["c1"].p(50), direct["c1"].p(99), direct["c64"].rps))
    res["upstream"] = {k: v.to_json() for k, v in direct.items()}

    relay = measure_relay(b)
    rows.append(
        Row(
            "bare relay (uvicorn + the server's upstream client; no kernel, no store)",
            relay["c1"].p(50),
            relay["c1"].p(99),
            relay["c64"].rps,
            relay["rss_idle_mb"],
            relay["rss_after_mb"],
        )
    )
    res["relay"] = {k: v.to_json() for k, v in relay.items() if isinstance(v, LoadRun)}

    sp = b.ensure_server()
    port = server_port(sp)
    start = b.results.get("startup", {}).get("server_first_200_s")
    served = measure_target(b, "appserver", port, "/v1/chat/completions", BODY)
    after = rss_mb(sp.proc.pid)
    rows.append(
        Row(
            "appserver (agent on the `openai` kind → upstream)",
            served["c1"].p(50),
            served["c1"].p(99),
            served["c64"].rps,
            b.server_rss_idle,
            after,
            start,
        )
    )
    res["appserver"] = {k: v.to_json() for k, v in served.items()}
    res["appserver"].update(rss_idle_mb=b.server_rss_idle, rss_after_mb=after)
    if b.args.baseline:
        base = measure_baseline(b, b.args.baseline)
        rows.append(
            Row(
                f"appserver at {b.args.baseline} (the same, older code)",
                base["c1"].p(50),
                base["c1"].p(99),
                base["c64"].rps,
                base["rss_idle_mb"],  # type: ignore[arg-type]
                base["rss_after_mb"],  # type: ignore[arg-type]
            )
        )
        res["baseline"] = {k: v.to_json() for k, v in base.items() if isinstance(v, LoadRun)}
        res["baseline"].update(rev=b.args.baseline, rss_idle_mb=base["rss_idle_mb"], rss_after_mb=base["rss_after_mb"])

    exe = find_litellm(b.args.litellm)
    if exe is None or b.args.no_litellm:
        rows.append(Row("LiteLLM proxy", note=LITELLM_HINT if exe is None else "skipped (--no-litellm)"))
        res["litellm"] = None
    else:
        version = litellm_version(exe)
        print(f"  LiteLLM {version}: {exe}", flush=True)
        try:
            proc, lport, started, _log = start_litellm(b, exe)
        except RuntimeError as exc:
            print(f"  !! {exc}", flush=True)
            rows.append(Row(f"LiteLLM proxy {version}", note="did not start (see the output above)"))
            res["litellm"] = None
            b.results["http"] = res
            b.results["table_rows"] = [asdict(r) for r in rows]
            b.results["_rows"] = rows
            return
        try:
            time.sleep(1.0)
            idle = rss_mb(proc.pid)
            ll = measure_target(b, "litellm", lport, "/v1/chat/completions", BODY)
            after_ll = rss_mb(proc.pid)
        finally:
            end(proc)
        rows.append(
            Row(f"LiteLLM proxy {version}, one worker", ll["c1"].p(50), ll["c1"].p(99), ll["c64"].rps, idle, after_ll)
        )
        rows[-1].start_s = started
        res["litellm"] = {k: v.to_json() for k, v in ll.items()}
        res["litellm"].update(version=version, rss_idle_mb=idle, rss_after_mb=after_ll, first_200_s=started)
    b.results["http"] = res
    b.results["table_rows"] = [asdict(r) for r in rows]
    b.results["_rows"] = rows


def stream_round(b: Bench, name: str, port: int, path: str, model: str, n: int) -> dict[str, Any]:
    """`n` concurrent streams: errors, inter-token gaps, streams in flight, first token under load."""
    a = b.args
    timeout = a.tokens * a.gap_ms / 1000 + 120
    expected = "".join(f"t{i} " for i in range(a.tokens))
    data = http_request(path, port, {**BODY, "model": model, "stream": True}, {"Connection": "close"})

    async def many() -> tuple[list[StreamRun], float]:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(sse_stream(port, data, timeout) for _ in range(n)))
        return list(runs), time.perf_counter() - t0

    runs, wall = run_async(many())
    errors: dict[str, int] = {}
    gaps: list[float] = []
    for r in runs:
        kind = r.error or ("incomplete" if not r.done else "wrong text" if r.text != expected else "")
        if kind:
            errors[kind] = errors.get(kind, 0) + 1
        gaps.extend(stream_gaps(r.arrivals))
    g = percentiles([x * 1000 for x in gaps], [50, 90, 99, 99.9, 100])
    ttfts = sorted(r.ttft_s * 1000 for r in runs if r.ttft_s is not None)
    in_flight = max_in_flight([(r.arrivals[0], r.arrivals[-1]) for r in runs if r.arrivals])
    res = {
        "streams": n,
        "errors": errors,
        "wall_s": round(wall, 2),
        "chunks": len(gaps) + sum(1 for r in runs if r.arrivals),
        "gap_ms": {f"{k:g}": round(v, 3) for k, v in g.items()},
        "first_token_ms_p50": percentile(ttfts, 50) if ttfts else None,
        "first_token_ms_p99": percentile(ttfts, 99) if ttfts else None,
        "max_streams_in_flight": in_flight,
    }
    print(
        f"  {name:<10} {n} streams in {wall:5.1f} s, errors {sum(errors.values())}"
        f"{' ' + str(errors) if errors else ''}; at most {in_flight} streaming at once;"
        f" gap p50 {fmt_ms(g[50])}, p99 {fmt_ms(g[99])}, max {fmt_ms(g[100])};"
        f" first token under load p50 {fmt_ms(res['first_token_ms_p50'])}, p99 {fmt_ms(res['first_token_ms_p99'])}",
        flush=True,
    )
    return res


def part_stream(b: Bench) -> None:
    a = b.args
    print(
        f"\n== Streaming: {a.streams} concurrent SSE streams of {a.tokens} tokens, {a.gap_ms:g} ms apart ==",
        flush=True,
    )
    sp = b.ensure_server()
    sport = server_port(sp)
    res: dict[str, Any] = {}
    res["upstream"] = up = stream_round(b, "upstream", b.upstream_port, "/slow/v1/chat/completions", "m", a.streams)
    res["appserver"] = sv = stream_round(b, "appserver", sport, "/v1/chat/completions", STREAM_AGENT, a.streams)
    res["added_p99_gap_ms"] = sv["gap_ms"]["99"] - up["gap_ms"]["99"]
    print(
        f"  inter-token gap p99: upstream {fmt_ms(up['gap_ms']['99'])}, appserver {fmt_ms(sv['gap_ms']['99'])}"
        f"{ratio(sv['gap_ms']['99'], up['gap_ms']['99'])}, added {res['added_p99_gap_ms']:.1f} ms",
        flush=True,
    )
    capped = sv["max_streams_in_flight"]
    if capped < a.streams * 0.9:
        print(
            f"  !! through the server at most {capped} of {a.streams} streams ran at once "
            f"(the others waited for their first token; wall {sv['wall_s']:.0f} s vs {up['wall_s']:.0f} s direct); "
            f"like for like, the upstream directly with {capped} streams:",
            flush=True,
        )
        res["upstream_same_in_flight"] = same = stream_round(
            b, "upstream", b.upstream_port, "/slow/v1/chat/completions", "m", max(1, capped)
        )
        res["added_p99_gap_ms_same_in_flight"] = sv["gap_ms"]["99"] - same["gap_ms"]["99"]
        print(
            f"  inter-token gap p99 at {capped} in flight: upstream {fmt_ms(same['gap_ms']['99'])}, appserver "
            f"{fmt_ms(sv['gap_ms']['99'])}{ratio(sv['gap_ms']['99'], same['gap_ms']['99'])}, "
            f"added {res['added_p99_gap_ms_same_in_flight']:.1f} ms",
            flush=True,
        )

    # time to first token at c=1, on the instant path (the 6-word stream)
    n = a.ttft_n
    ttft: dict[str, list[float]] = {}
    for name, port, in_model in (("upstream", b.upstream_port, "m"), ("appserver", sport, "m")):
        data = http_request("/v1/chat/completions", port, {**BODY, "model": in_model, "stream": True})

        async def seq(data: bytes = data, port: int = port) -> list[float]:
            out = []
            for i in range(n + 5):
                r = await sse_stream(port, data, 30)
                if r.ttft_s is not None and i >= 5:  # the first 5 warm up
                    out.append(r.ttft_s * 1000)
            return out

        ttft[name] = run_async(seq())
    t_up = percentiles(ttft["upstream"], [50, 99])
    t_sv = percentiles(ttft["appserver"], [50, 99])
    res["ttft_c1"] = {
        "n": n,
        "upstream_ms": {f"{k:g}": v for k, v in t_up.items()},
        "appserver_ms": {f"{k:g}": v for k, v in t_sv.items()},
        "added_p50_ms": t_sv[50] - t_up[50],
    }
    print(
        f"  time to first token at c=1 ({n} sequential streams, instant upstream): upstream {fmt_ms(t_up[50])}, "
        f"appserver {fmt_ms(t_sv[50])}{ratio(t_sv[50], t_up[50])}, added {t_sv[50] - t_up[50]:.2f} ms (median)",
        flush=True,
    )
    b.results["stream"] = res


def part_soak(b: Bench) -> None:
    a = b.args
    turns, convs = a.soak_turns, min(a.soak_conversations, a.soak_turns)
    print(
        f"\n== Memory soak: {turns:,} turns over {convs:,} conversations, {a.soak_rounds} times "
        f"(idle runtimes evicted after {a.evict_s:g} s) ==",
        flush=True,
    )
    b.ensure_upstream()
    home, env = b.make_home("soak", {"APPSERVER_LIMITS__IDLE_EVICT_S": f"{a.evict_s:g}"})
    sp, log = b.start_server(home, env)
    port = server_port(sp)
    res: dict[str, Any] = {"turns": turns, "conversations": convs, "rounds": []}
    try:
        time.sleep(1.0)
        idle = rss_mb(sp.proc.pid)
        res["rss_idle_mb"] = idle
        print(f"  idle RSS {idle:.1f} MB", flush=True)
        new_req = http_request("/v1/chat/completions", port, BODY)
        metrics_req = http_request("/metrics", port, None)
        for rnd in range(1, a.soak_rounds + 1):
            ids: list[str] = [""] * convs

            def keep_id(i: int, r: Resp, ids: list[str] = ids) -> None:
                ids[i] = r.headers.get("x-conversation-id", "")

            t0 = time.perf_counter()
            lat1, _, err1 = run_async(drive(port, lambda _i: new_req, 64, total=convs, on_response=keep_id))
            known = [i for i in ids if i]
            rest = turns - convs
            lat2: list[float] = []
            err2: dict[str, int] = {}
            if rest > 0 and known:
                reqs = [http_request("/v1/chat/completions", port, BODY, {"X-Conversation-Id": c}) for c in known]
                lat2, _, err2 = run_async(drive(port, lambda i, reqs=reqs: reqs[i % len(reqs)], 64, total=rest))
            wall = time.perf_counter() - t0
            after = rss_mb(sp.proc.pid)
            errors = {k: err1.get(k, 0) + err2.get(k, 0) for k in {*err1, *err2}}
            # wait for the runtimes to be evicted (the sweeper runs every idle_evict_s / 2)
            deadline = time.monotonic() + a.evict_s * 5 + 30
            left = -1.0
            while time.monotonic() < deadline:
                try:
                    text = run_async(one_request(port, metrics_req)).body.decode()
                    left = next(
                        float(line.split()[-1])
                        for line in text.splitlines()
                        if line.startswith("appserver_conversation_runtimes ")
                    )
                except (OSError, TimeoutError, StopIteration, ValueError):
                    left = -1.0
                if left == 0:
                    break
                time.sleep(0.5)
            time.sleep(1.0)
            evicted = rss_mb(sp.proc.pid)
            done = len(lat1) + len(lat2)
            res["rounds"].append(
                {
                    "round": rnd,
                    "turns_done": done,
                    "wall_s": round(wall, 2),
                    "turns_per_s": round(done / wall, 1),
                    "errors": errors,
                    "conversations_created": len(known),
                    "rss_after_soak_mb": after,
                    "rss_after_evict_mb": evicted,
                    "runtimes_left": left,
                }
            )
            print(
                f"  round {rnd}: {done:,} turns in {wall:.1f} s ({done / wall:,.0f}/s), errors {sum(errors.values())}"
                f"{' ' + str(errors) if errors else ''}; RSS right after {after:.1f} MB, after eviction "
                f"{evicted:.1f} MB ({evicted / idle:.2f}× idle; runtimes left {left:g})",
                flush=True,
            )
        ev = [r["rss_after_evict_mb"] for r in res["rounds"]]
        res["growth_first_to_last_mb"] = ev[-1] - ev[0] if ev else None
        if len(ev) > 1:
            print(f"  leak check: RSS after eviction round 1 → {len(ev)}: {ev[0]:.1f} → {ev[-1]:.1f} MB", flush=True)
        res["server_log_tracebacks"] = log.tracebacks
        res["server_log_errors"] = log.errors
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            sp.stop()
        sp.kill()
    b.results["soak"] = res


def part_ws(b: Bench) -> None:
    n = b.args.ws_connections
    print(f"\n== WebSocket: one turn fanned out to {n} subscribers ==", flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ws_fanout

    cpus = b.cpus.target if b.cpus.pinned else None
    out = asyncio.run(asyncio.wait_for(ws_fanout.run(n, quiet=True, serve_cpus=cpus), timeout=300))
    deliveries = out.get("delivery_ms") or []
    p = percentiles(deliveries, [50, 99, 100]) if deliveries else {}
    res = {
        "connections": n,
        "delivered": len(deliveries),
        "delivery_ms": {f"{k:g}": v for k, v in p.items()},
        "submit_to_last_ms": out.get("submit_to_last_ms"),
        "rss_per_connection_kib": out.get("rss_per_connection_kib"),
    }
    b.results["ws"] = res
    if p:
        print(
            f"  commit → terminal snapshot across {len(deliveries)} subscribers: p50 {fmt_ms(p[50])}, "
            f"p99 {fmt_ms(p[99])}, max {fmt_ms(p[100])}; submit → last {fmt_ms(out.get('submit_to_last_ms'))}; "
            f"{out.get('rss_per_connection_kib', 0):.1f} KiB RSS per idle connection",
            flush=True,
        )


def part_startup(b: Bench) -> None:
    print("\n== Startup ==", flush=True)
    exe = Path(sys.executable).with_name("appserver")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "appserver"]
    b.ensure_upstream()
    home, env = b.make_home("startup")
    helps = []
    for _ in range(b.args.help_runs):
        t0 = time.perf_counter()
        subprocess.run([*cli, "--help"], capture_output=True, env=env, timeout=30, check=True)
        helps.append(time.perf_counter() - t0)
    firsts: list[float] = []
    for _ in range(b.args.start_runs):
        port = free_port()
        data = http_request("/v1/chat/completions", port, BODY)
        t0 = time.perf_counter()
        with b.cpus.for_target():
            proc = track(
                subprocess.Popen(
                    [*cli, "serve", "--listen", f"127.0.0.1:{port}"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            t = run_async(first_200(port, data, proc, t0, 30))
            if t is not None:
                firsts.append(t)
        finally:
            end(proc)
    res = {
        "help_s_median": statistics.median(helps),
        "help_runs": len(helps),
        "server_first_200_s": statistics.median(firsts) if firsts else None,
        "server_first_200_runs": [round(x, 3) for x in firsts],
    }
    b.results["startup"] = res
    print(
        f"  `appserver --help`: {res['help_s_median']:.3f} s (median of {len(helps)}); "
        f"spawn `appserver serve` → first 200 on the chat request: "
        f"{'—' if not firsts else f'{statistics.median(firsts):.3f} s'} (median of {len(firsts)}: "
        f"{', '.join(f'{x:.3f}' for x in firsts)})",
        flush=True,
    )


# ---------------------------------------------------------------- report


def summary(b: Bench) -> None:
    r = b.results
    print("\n== Summary ==")
    rows: list[Row] | None = r.pop("_rows", None)
    if rows:
        mine = next((i for i, row in enumerate(rows) if row.name.startswith("appserver (")), None)
        if mine is not None and rows[mine].start_s is None and r.get("startup", {}).get("server_first_200_s"):
            rows[mine].start_s = r["startup"]["server_first_200_s"]
            r["table_rows"][mine]["start_s"] = rows[mine].start_s
        print(table(rows, rows[0]))
        http = r["http"]
        errs = {
            name: {k: v["errors"] for k, v in http[name].items() if isinstance(v, dict) and v.get("errors")}
            for name in ("upstream", "relay", "appserver", "baseline", "litellm")
            if http.get(name)
        }
        errs = {k: v for k, v in errs.items() if v}
        if errs:
            print(f"errors during the HTTP runs: {errs}")
    print("\ntargets (issue 20; printed, not asserted):")
    lines = []
    if "http" in r:
        up, sv = r["http"]["upstream"], r["http"]["appserver"]
        lines.append(target_line("c=64 req/s through the server", sv["c64"]["rps"], "req/s", TARGETS["c64_rps"], True))
        base = r["http"].get("baseline")
        if base:  # the issue's "≥ 4x today": the code it measured, served in this same run
            rel = sv["c64"]["rps"] / base["c64"]["rps"]
            lines.append(target_line(f"  c=64 against the code at {base['rev']}", rel, "×", 4.0, True))
        lines.append(
            target_line("  c=64 as a share of the upstream direct", sv["c64"]["rps"] / up["c64"]["rps"], "", 0.2, True)
        )
        relay = r["http"].get("relay")
        if relay:  # no target: how much of what a do-nothing relay serves on this host the server keeps
            share = sv["c64"]["rps"] / relay["c64"]["rps"]
            lines.append(f"    c=64 as a share of the bare relay (the floor; no target) {share:.3f}")
        ll = r["http"].get("litellm")
        if ll:
            lines.append(target_line("  c=64 against LiteLLM", sv["c64"]["rps"] / ll["c64"]["rps"], "×", 30.0, True))
        added = sv["c1"]["pct_ms"]["50"] - up["c1"]["pct_ms"]["50"]
        lines.append(target_line("c=1 added median", added, "ms", TARGETS["c1_added_p50_ms"]))
        lines.append(target_line("c=1 p99 through the server", sv["c1"]["pct_ms"]["99"], "ms", TARGETS["c1_p99_ms"]))
        lines.append(target_line("idle RSS", sv["rss_idle_mb"], "MB", TARGETS["rss_idle_mb"]))
    if "stream" in r:
        s = r["stream"]
        n_err = sum(s["appserver"]["errors"].values())
        lines.append(target_line(f"stream errors ({s['appserver']['streams']} streams)", n_err, "", 0))
        n = s["appserver"]["streams"]
        lines.append(
            target_line(
                "streams running at once through the server", s["appserver"]["max_streams_in_flight"], "", n, True
            )
        )
        lines.append(target_line("stream added p99 inter-token gap", s["added_p99_gap_ms"], "ms", 20.0))
        if "added_p99_gap_ms_same_in_flight" in s:
            lines.append(
                target_line(
                    "  the same, direct at the server's in-flight", s["added_p99_gap_ms_same_in_flight"], "ms", 20
                )
            )
        lines.append(target_line("time to first token added (c=1)", s["ttft_c1"]["added_p50_ms"], "ms", 2.0))
    if "soak" in r and r["soak"]["rounds"]:
        s = r["soak"]
        last = s["rounds"][-1]["rss_after_evict_mb"]
        lines.append(target_line("soak: RSS after eviction / idle", last / s["rss_idle_mb"], "×", 1.3))
        tolerance = round(0.05 * s["rss_idle_mb"], 1)  # "no growth", within 5 % of idle RSS of noise
        lines.append(
            target_line("soak: growth round 1 → last (leak check)", s["growth_first_to_last_mb"], "MB", tolerance)
        )
    if "startup" in r:
        s = r["startup"]
        lines.append(target_line("spawn → first 200", s["server_first_200_s"], "s", TARGETS["start_to_200_s"]))
        lines.append(target_line("`appserver --help`", s["help_s_median"], "s", TARGETS["help_s"]))
    if "ws" in r and r["ws"]["delivery_ms"]:
        lines.append(target_line("WS fan-out p99 delivery", r["ws"]["delivery_ms"]["99"], "ms", TARGETS["ws_p99_ms"]))
    print("\n".join(lines))
    if b.server_log is not None and (b.server_log.tracebacks or b.server_log.errors):
        print(
            f"\nthe server logged {b.server_log.tracebacks} tracebacks, {b.server_log.errors} ERROR lines; last ones:"
        )
        print("\n".join(list(b.server_log.tail)[-20:]))
    r["server_log"] = None if b.server_log is None else {"tracebacks": b.server_log.tracebacks}


def plot(b: Bench, out: Path) -> None:
    http = b.results.get("http")
    if not http:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install -e '.[bench]')")
        return
    names = [
        ("upstream", "upstream directly"),
        ("relay", "bare relay"),
        ("appserver", "appserver"),
        ("baseline", f"appserver at {http['baseline']['rev']}" if http.get("baseline") else ""),
        ("litellm", "LiteLLM proxy"),
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    bars: list[tuple[str, float, str]] = []
    for key, label in names:
        d = http.get(key)
        if not d:
            continue
        pct = {float(k): v for k, v in d["c1"]["pct_ms"].items()}
        xs = sorted(pct)
        (line,) = left.plot(xs, [pct[x] for x in xs], label=label, marker=".", markersize=3)
        bars.append((label.replace(" ", "\n", 1), d["c64"]["rps"], line.get_color()))  # one color per target
    left.set_yscale("log")
    left.set_xlabel("percentile")
    left.set_ylabel("latency (ms, log)")
    left.set_title("c=1 latency distribution")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    labels = [x[0] for x in bars]
    values = [x[1] for x in bars]
    right.bar(labels, values, color=[x[2] for x in bars])
    for i, v in enumerate(values):
        right.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    right.axhline(TARGETS["c64_rps"], color="grey", linestyle="--", linewidth=1)
    right.text(len(bars) - 0.5, TARGETS["c64_rps"], "target ≥ 2,500", ha="right", va="bottom", color="grey")
    right.set_yscale("log")
    right.set_ylabel("requests/s (log)")
    right.set_title("c=64 throughput")
    fig.suptitle("non-stream chat completion: upstream directly vs through a gateway")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["http", "stream", "soak", "ws", "startup"]
    ap.add_argument("--only", action="append", choices=parts, help="run only this part (repeatable)")
    ap.add_argument("--quick", action="store_true", help="short runs for development (~1 minute)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per load run (default 10; quick 2)")
    ap.add_argument("--litellm", help="the litellm executable (else $LITELLM_BIN, else `litellm` on PATH)")
    ap.add_argument("--no-litellm", action="store_true", help="skip LiteLLM even when installed")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help=f"also serve this git revision of the project beside the current code (issue 20's own: {ISSUE_REV})",
    )
    ap.add_argument("--builtin-client", action="store_true", help="the asyncio load generator even if wrk is here")
    ap.add_argument("--no-pin", action="store_true", help="no CPU pinning")
    ap.add_argument("--streams", type=int, default=None, help="concurrent SSE streams (default 1000; quick 100)")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="upstream gap between streamed tokens")
    ap.add_argument("--ttft-n", type=int, default=50, help="sequential streams for time to first token")
    ap.add_argument("--soak-turns", type=int, default=None, help="turns per soak round (default 100000)")
    ap.add_argument("--soak-conversations", type=int, default=None, help="conversations per round (default 10000)")
    ap.add_argument("--soak-rounds", type=int, default=3)
    ap.add_argument("--evict-s", type=float, default=2.0, help="APPSERVER_LIMITS__IDLE_EVICT_S of the soak server")
    ap.add_argument("--ws-connections", type=int, default=None, help="WebSocket subscribers (default 1000)")
    ap.add_argument("--help-runs", type=int, default=10)
    ap.add_argument("--start-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)  # internal: be the upstream
    a = ap.parse_args()
    if a.upstream_port:
        serve_upstream(a.upstream_port, a.gap_ms, a.tokens)
        return
    q = a.quick
    a.duration = a.duration if a.duration is not None else 2.0 if q else 10.0
    a.streams = a.streams if a.streams is not None else 100 if q else 1000
    a.soak_turns = a.soak_turns if a.soak_turns is not None else 2000 if q else 100_000
    a.soak_conversations = a.soak_conversations if a.soak_conversations is not None else 200 if q else 10_000
    a.ws_connections = a.ws_connections if a.ws_connections is not None else 200 if q else 1000
    if q:
        a.ttft_n = min(a.ttft_n, 20)
        a.help_runs = min(a.help_runs, 3)
    selected = a.only or parts

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * max(a.streams, a.ws_connections) + 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, need)), hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cpus = Cpus(not a.no_pin)
    work = Path(tempfile.mkdtemp(prefix="appserver-compare-"))
    b = Bench(a, cpus, work)
    print(f"machine: {os.cpu_count()} CPU, Python {sys.version.split()[0]}; {cpus.describe()}")
    print(f"parts: {', '.join(p for p in parts if p in selected)}{' (quick)' if q else ''}", flush=True)
    b.results["config"] = {
        k: v for k, v in vars(a).items() if k not in ("upstream_port", "out") and not isinstance(v, Path)
    }
    b.results["config"]["pinned"] = cpus.pinned
    t_all = time.perf_counter()
    try:
        # startup first: it runs before anything has loaded the machine
        for part, fn in (
            ("startup", part_startup),
            ("http", part_http),
            ("stream", part_stream),
            ("ws", part_ws),
            ("soak", part_soak),
        ):
            if part in selected:
                fn(b)
        if b.server is not None and b.server.proc.poll() is not None:
            print(f"!! the server exited with {b.server.proc.returncode} during the run")
        summary(b)
        a.out.mkdir(parents=True, exist_ok=True)
        b.results["total_s"] = round(time.perf_counter() - t_all, 1)
        (a.out / "compare.json").write_text(json.dumps(b.results, indent=1, default=str) + "\n")
        print(f"\nnumbers: {a.out / 'compare.json'}")
        plot(b, a.out / "compare.png")
        print(f"total {time.perf_counter() - t_all:.0f} s")
    finally:
        if b.server is not None:
            with contextlib.suppress(Exception):
                b.server.stop()
        end_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the children were ended by main's finally
        sys.exit("interrupted")
