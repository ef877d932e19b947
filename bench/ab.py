"""Two or more versions of the server side by side on one core: CPU time per request, alternating.

On a host whose speed drifts by 2-5x within minutes (docs/benchmarks.md "The machine"), a change of
a few percent shows only when the versions run interleaved: each target is served from its own
source tree (a path, or a git revision exported with `git archive`), all pinned to the first CPU,
and wrk (one thread, the same non-stream chat body as bench/compare.py) loads them in turn,
round after round, reversing the order each round. Each round reads the server's user and system
CPU time from /proc before and after its load, so what is compared is CPU per request, which
depends far less on the host's speed at that moment than requests per second. Each round's
latency (p50, p99) is printed too, and the median of the rounds' per target at the end.

    .venv/bin/python bench/ab.py HEAD~3 HEAD                 # two revisions
    .venv/bin/python bench/ab.py a00da74 . --rounds 6 --c 1  # a revision against the working tree
    .venv/bin/python bench/ab.py . '.|APPSERVER_SERVER__EVENT_LOOP=uvloop'   # env per target

A target is `PATH_OR_REV[|NAME=VALUE,...]`; `.` is the working tree. Needs wrk and Linux /proc.
Prints, never asserts.
"""

from __future__ import annotations

import argparse
import os
import shutil
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

from compare import BODY, LoadRun, end, export_rev, free_port, parse_wrk, serve_tree, track, wait_port, wrk_lua  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    spec: str
    tree: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    requests: int = 0
    user_s: float = 0.0
    sys_s: float = 0.0
    rps_sum: float = 0.0
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def source_tree(ref: str, work: Path) -> Path:
    """The working tree for `.` or an existing directory, else `ref` exported from git."""
    if ref == "." or Path(ref).is_dir():
        return (ROOT if ref == "." else Path(ref)).resolve()
    tree = work / f"rev-{ref.replace('/', '_')}"
    return tree if tree.exists() else export_rev(ref, tree)


def pinned(cpu: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else cmd


def start(t: Target, upstream: str, work: Path, index: int) -> None:
    home = work / f"home{index}"
    env = {
        **os.environ,
        "APPSERVER_HOME": str(home),
        "PYTHONPATH": str(t.tree),
        "APPSERVER_PROVIDERS__FAKE__KIND": "openai",
        "APPSERVER_PROVIDERS__FAKE__BASE_URL": f"{upstream}/v1",
        "APPSERVER_DISABLE_CRON": "1",
        "APPSERVER_LIMITS__QUEUE_MAX": "10000",
        "APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT": "2000",
        **t.env,
    }
    t.proc, t.port = serve_tree(t.tree, env, t.spec, tuple(pinned(0, [])))


def load(wrk: str, script: Path, port: int, c: int, secs: int) -> LoadRun:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    cmd = pinned(1, [wrk, "-t1", f"-c{c}", f"-d{secs}s", "--timeout", "10s", "-s", str(script), url])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + 60).stdout
    run = parse_wrk(out)
    errors = run.error_count
    if errors:
        print(f"    ({errors} errors in this round)", flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="PATH_OR_REV[|NAME=VALUE,...]; '.' is the working tree")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--secs", type=int, default=4, help="seconds of load per target per round")
    ap.add_argument("--c", type=int, default=64, help="connections")
    a = ap.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench/ab.py needs wrk (apt install wrk)")
    work = Path(tempfile.mkdtemp(prefix="appserver-ab-"))
    script = work / "chat.lua"
    script.write_text(wrk_lua(BODY))
    up_port = free_port()
    upstream = track(
        subprocess.Popen(
            pinned(1, [sys.executable, str(ROOT / "bench" / "compare.py"), "--upstream-port", str(up_port)])
        )
    )
    targets: list[Target] = []
    try:
        wait_port(up_port, upstream)
        for i, spec in enumerate(a.targets):
            ref, _, extra = spec.partition("|")
            env = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
            targets.append(Target(spec, source_tree(ref, work), env))
            start(targets[-1], f"http://127.0.0.1:{up_port}", work, i)
        time.sleep(1)
        for t in targets:  # warm-up: caches, pools, the first imports
            load(wrk, script, t.port, min(a.c, 8), 2)
        for r in range(a.rounds):
            for t in targets if r % 2 == 0 else list(reversed(targets)):
                assert t.proc is not None
                u0, s0 = cpu_times(t.proc.pid)
                run = load(wrk, script, t.port, a.c, a.secs)
                n, rps = run.requests, run.rps
                u1, s1 = cpu_times(t.proc.pid)
                t.requests += n
                t.user_s += u1 - u0
                t.sys_s += s1 - s0
                t.rps_sum += rps
                t.p50_ms.append(run.p(50))
                t.p99_ms.append(run.p(99))
                per = 1e6 * (u1 - u0 + s1 - s0) / max(n, 1)
                print(
                    f"round {r}  {t.spec:<40} {rps:8.0f} req/s  {per:7.0f} µs CPU/request  "
                    f"p50 {run.p(50):6.2f} ms  p99 {run.p(99):6.2f} ms",
                    flush=True,
                )
        print(f"\nc={a.c}, {a.rounds} rounds of {a.secs} s, the first target is 1.000×:")
        base: float | None = None
        for t in targets:
            per = 1e6 * (t.user_s + t.sys_s) / max(t.requests, 1)
            base = base or per
            sys_per = 1e6 * t.sys_s / max(t.requests, 1)
            print(
                f"  {t.spec:<40} {t.rps_sum / a.rounds:8.0f} req/s  {per:7.1f} µs CPU/request ({per / base:.3f}×), "
                f"of it system {sys_per:5.1f} µs; median of the rounds' p50 {statistics.median(t.p50_ms):.2f} ms, "
                f"p99 {statistics.median(t.p99_ms):.2f} ms"
            )
    finally:
        for t in targets:
            if t.proc is not None:
                end(t.proc)
        end(upstream)


if __name__ == "__main__":
    main()
