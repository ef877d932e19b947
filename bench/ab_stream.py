"""Two or more versions of the server side by side on one core: CPU time per streamed token, alternating.

The streaming counterpart of bench/ab.py: each target is served from its own source tree (a path,
or a git revision exported with `git archive`), all pinned to the first CPU; bench/compare.py's
upstream streams `--tokens` tokens `--gap-ms` apart (its `/slow/` path) on the other CPU, where this
script's SSE client runs too. Round after round (the order reversed each round), `--streams`
concurrent Chat Completions streams (stream=true) go to each target in turn; the server's user and
system CPU time is read from /proc before and after, so what is compared is CPU per streamed token
(the turn's start and end spread over its tokens), which depends far less on the host's speed at
that moment than the gaps. Each round prints the inter-token gap p50 and p99 seen by the client
beside it (the upstream's own gap is `--gap-ms`: the added gap is what is above it), and the end
the median of the rounds per target. Keep `--streams` below the one core's saturation (about
200-400) for a CPU figure; at saturation the latest-value stream joins tokens.

    .venv/bin/python bench/ab_stream.py HEAD .                    # the last commit against the working tree
    .venv/bin/python bench/ab_stream.py HEAD . --streams 300 --rounds 6

A target is `PATH_OR_REV[|NAME=VALUE,...]`; `.` is the working tree. Needs Linux /proc.
Prints, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from ab import cpu_times, pinned, source_tree  # noqa: E402
from compare import (  # noqa: E402
    BODY,
    end,
    free_port,
    http_request,
    percentile,
    run_async,
    serve_tree,
    sse_stream,
    stream_gaps,
    track,
    wait_port,
)


@dataclass
class Target:
    spec: str
    tree: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    per_token_us: list[float] = field(default_factory=list)
    sys_us: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)


def start(t: Target, upstream: str, work: Path, index: int, streams: int) -> None:
    env = {
        **os.environ,
        "APPSERVER_HOME": str(work / f"home{index}"),
        "PYTHONPATH": str(t.tree),
        "APPSERVER_PROVIDERS__FAKE__KIND": "openai",
        "APPSERVER_PROVIDERS__FAKE__BASE_URL": f"{upstream}/slow/v1",  # agent `m` on the gapped stream
        "APPSERVER_DISABLE_CRON": "1",
        "APPSERVER_LIMITS__QUEUE_MAX": "10000",
        "APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT": str(streams + 256),
        **t.env,
    }
    t.proc, t.port = serve_tree(t.tree, env, t.spec, tuple(pinned(0, [])))


async def streams_round(port: int, n: int, timeout: float) -> tuple[list[float], int, dict[str, int], str]:
    data = http_request("/v1/chat/completions", port, {**BODY, "stream": True}, {"Connection": "close"})
    runs = await asyncio.gather(*(sse_stream(port, data, timeout) for _ in range(n)))
    gaps: list[float] = []
    errors: dict[str, int] = {}
    chunks = 0
    text = ""
    for r in runs:
        kind = r.error or ("incomplete" if not r.done else "")
        if kind:
            errors[kind] = errors.get(kind, 0) + 1
        gaps.extend(stream_gaps(r.arrivals))
        chunks += len(r.arrivals)
        text = text or r.text
    return gaps, chunks, errors, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="PATH_OR_REV[|NAME=VALUE,...]; '.' is the working tree")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=300, help="concurrent streams per round")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="the upstream's gap between tokens")
    a = ap.parse_args()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the client (and the upstream) off the targets' CPU
    work = Path(tempfile.mkdtemp(prefix="appserver-abs-"))
    up_port = free_port()
    cmd = [sys.executable, str(ROOT / "bench" / "compare.py"), "--upstream-port", str(up_port)]
    cmd += ["--gap-ms", str(a.gap_ms), "--tokens", str(a.tokens)]
    upstream = track(subprocess.Popen(pinned(1, cmd)))
    expected = "".join(f"t{i} " for i in range(a.tokens))
    timeout = a.tokens * a.gap_ms / 1000 + 120
    targets: list[Target] = []
    try:
        wait_port(up_port, upstream)
        for i, spec in enumerate(a.targets):
            ref, _, extra = spec.partition("|")
            env = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
            targets.append(Target(spec, source_tree(ref, work), env))
            start(targets[-1], f"http://127.0.0.1:{up_port}", work, i, a.streams)
        time.sleep(1)
        for t in targets:  # warm-up: caches, pools, the first imports
            run_async(streams_round(t.port, min(a.streams, 20), timeout))
        for r in range(a.rounds):
            for t in targets if r % 2 == 0 else list(reversed(targets)):
                assert t.proc is not None
                u0, s0 = cpu_times(t.proc.pid)
                gaps, chunks, errors, text = run_async(streams_round(t.port, a.streams, timeout))
                u1, s1 = cpu_times(t.proc.pid)
                tokens = a.streams * a.tokens
                per = 1e6 * (u1 - u0 + s1 - s0) / tokens
                ms = sorted(g * 1000 for g in gaps)
                p50, p99 = (percentile(ms, 50), percentile(ms, 99)) if ms else (0.0, 0.0)
                t.per_token_us.append(per)
                t.sys_us.append(1e6 * (s1 - s0) / tokens)
                t.p50_ms.append(p50)
                t.p99_ms.append(p99)
                bad = f"  errors {errors}" if errors else ""
                if text and text != expected:
                    bad += "  WRONG TEXT"
                print(
                    f"round {r}  {t.spec:<40} {per:6.1f} µs CPU/token (sys {t.sys_us[-1]:5.1f})  "
                    f"gap p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({chunks} content chunks){bad}",
                    flush=True,
                )
        print(f"\n{a.streams} streams x {a.tokens} tokens, {a.gap_ms:g} ms apart, {a.rounds} rounds; medians:")
        base: float | None = None
        for t in targets:
            per = statistics.median(t.per_token_us)
            base = base or per
            print(
                f"  {t.spec:<40} {per:6.1f} µs CPU/token ({per / base:.3f}x), sys {statistics.median(t.sys_us):5.1f}; "
                f"gap p50 {statistics.median(t.p50_ms):.2f} ms (added {statistics.median(t.p50_ms) - a.gap_ms:+.2f}), "
                f"p99 {statistics.median(t.p99_ms):.2f} ms (added {statistics.median(t.p99_ms) - a.gap_ms:+.2f})"
            )
    finally:
        for t in targets:
            if t.proc is not None:
                end(t.proc)
        end(upstream)


if __name__ == "__main__":
    main()
