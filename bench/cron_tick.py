"""Cron scheduler cost (prints; asserts nothing).

one scheduler tick over 10,000 tasks (target <= 50 ms): the first (parses crons.json), a quiet one
(nothing due, the parsed state is cached) and a busy one (100 tasks due and fired)
the time to add 1,000 tasks through the store API (each add is lock + load + atomic save)
and, for comparison, one `appserver cron add` through the CLI (process start, agent check, add)

  .venv/bin/python bench/cron_tick.py [TASKS]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cron.schedule import ScheduleSpec  # noqa: E402
from cron.scheduler import Scheduler  # noqa: E402
from cron.store import CronStore, CronTask, Occurrence, make_task, utcnow  # noqa: E402

ZONES = ("UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo", "Australia/Sydney")
EVERY_MINUTE = 100  # tasks due at every minute boundary: the busy tick fires these


def spec(i: int) -> ScheduleSpec:
    """A realistic mix: daily/weekly cron in several zones, intervals, one-shots."""
    tz = ZONES[i % len(ZONES)]
    kind = i % 3
    if i < EVERY_MINUTE:
        return ScheduleSpec("every", "1m", tz)
    if kind == 0:
        return ScheduleSpec("cron", f"{i % 60} {i % 24} * * {'1-5' if i % 2 else '*'}", tz)
    if kind == 1:
        return ScheduleSpec("every", f"{30 + i % 600}m", tz)
    return ScheduleSpec("in", f"{2 + i % 200}h", tz)


def task(i: int, now: datetime) -> CronTask:
    return make_task(
        name=f"task-{i}",
        agent="assistant",
        schedule=spec(i),
        prompt=f"prompt {i}",
        now=now,
        exact=True,
    )


def cli_add_s(home: Path, n: int) -> float:
    env = {**os.environ, "APPSERVER_HOME": str(home)}
    cmd = [
        sys.executable,
        "-m",
        "appserver",
        "cron",
        "add",
        "--agent",
        "assistant",
        "--every",
        "1h",
    ]
    subprocess.run([*cmd, "--name", "warm-up", "--prompt", "p"], env=env, check=True, capture_output=True)
    t0 = time.perf_counter()
    for i in range(n):
        subprocess.run([*cmd, "--name", f"cli-{i}", "--prompt", "p"], env=env, check=True, capture_output=True)
    return (time.perf_counter() - t0) / n


async def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        store = CronStore(home)
        now = utcnow().replace(second=0, microsecond=0) + timedelta(seconds=1)

        t0 = time.perf_counter()
        for i in range(1000):
            store.add(task(i, now))
        add_s = time.perf_counter() - t0
        print(
            f"add 1,000 tasks via CronStore.add: {add_s:.2f} s "
            f"({add_s / 1000 * 1e3:.2f} ms per add: lock, parse, atomic save; grows with the file)"
        )

        with store.transaction() as state:
            state.tasks.extend(task(i, now) for i in range(1000, total))
        size = (home / "crons.json").stat().st_size
        print(f"crons.json with {total:,} tasks: {size / 1e6:.1f} MB")

        fired: list[Occurrence] = []

        async def fire(t: CronTask, occ: Occurrence) -> str | None:
            fired.append(occ)
            return None

        clock = [now + timedelta(seconds=5)]
        scheduler = Scheduler(CronStore(home), fire=fire, clock=lambda: clock[0], tick_s=60)

        async def timed_tick() -> float:
            t = time.perf_counter()
            await scheduler.tick()
            return time.perf_counter() - t

        first = await timed_tick()
        quiet = []
        for _ in range(20):
            clock[0] += timedelta(seconds=1)
            quiet.append(await timed_tick())
        busy = []
        for _ in range(5):
            clock[0] += timedelta(minutes=1)
            before = len(fired)
            busy.append(await timed_tick())
            assert len(fired) - before == EVERY_MINUTE  # sanity of the bench itself, not a target
        print(f"tick over {total:,} tasks: first {first * 1e3:.1f} ms (parses the file, takes the lease)")
        print(
            f"tick over {total:,} tasks, nothing due: median {statistics.median(quiet) * 1e3:.1f} ms (target <= 50 ms)"
        )
        print(
            f"tick over {total:,} tasks, {EVERY_MINUTE} due: median {statistics.median(busy) * 1e3:.1f} ms "
            f"(claim saved, then {EVERY_MINUTE} fires + run-log lines)"
        )
        await scheduler.close()

    with tempfile.TemporaryDirectory() as tmp:
        per = cli_add_s(Path(tmp), 5)
        print(f"`appserver cron add` through the CLI: {per * 1e3:.0f} ms per add (interpreter start, agent check, add)")


if __name__ == "__main__":
    asyncio.run(main())
