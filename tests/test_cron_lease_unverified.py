"""A lease record that names a live pid but carries no process start time (a hand edit) cannot be
verified as an appserver of this home: it holds the lease only while its heartbeat is fresh, and
is taken over once its TTL has passed, instead of blocking cron forever. The real scheduler and a
real crons.json; the pid is a real, unrelated live process."""

from __future__ import annotations

import json
import socket
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence


async def nothing(task: CronTask, occ: Occurrence) -> str:
    return "turn"


def write_owner(store: CronStore, pid: int, renewed_ago_s: float) -> None:
    now = datetime.now(UTC)
    store.home.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "token": "f" * 32, "started_at": (now - timedelta(hours=1)).isoformat(),
             "host": socket.gethostname(), "renewed_at": (now - timedelta(seconds=renewed_ago_s)).isoformat(),
             "ttl_s": 90}  # fmt: skip
    store.path.write_text(json.dumps({"version": 1, "scheduler_owner": owner, "tasks": []}))


@pytest.mark.parametrize(("renewed_ago_s", "taken"), [(10, False), (200, True)])
async def test_an_unverifiable_live_pid_holds_the_lease_only_until_it_expires(
    tmp_path: Path, renewed_ago_s: float, taken: bool
) -> None:
    other = subprocess.Popen(["sleep", "60"])  # alive, and no appserver
    try:
        store = CronStore(tmp_path / "home")
        write_owner(store, other.pid, renewed_ago_s)
        s = Scheduler(store, fire=nothing)
        report = await s.tick()
        assert report.has_lease is taken, s.lease_state
        await s.close()
    finally:
        other.kill()
        other.wait()
