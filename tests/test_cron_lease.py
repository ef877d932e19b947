"""The scheduler lease (issue 6 check 3): fake owner records, then two real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cron.lease import LeaseHolder, owner_alive, process_start
from cron.store import CronStore, OwnerRecord
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def owner(pid: int, proc_start: int | None, host: str | None = None) -> OwnerRecord:
    return OwnerRecord(pid, "f" * 32, NOW, proc_start, socket.gethostname() if host is None else host)


def put_owner(store: CronStore, rec: OwnerRecord | None) -> None:
    with store.transaction() as state:
        state.scheduler_owner = rec


@pytest.fixture
def sleeper() -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


def test_claim_from_nobody_verify_release(tmp_path: Path) -> None:
    store = CronStore(tmp_path)
    me = LeaseHolder(store, started_at=NOW)
    assert me.claim()
    rec = store.read().scheduler_owner
    assert rec is not None and rec.pid == os.getpid() and rec.token == me.token
    assert rec.proc_start == process_start(os.getpid()) and rec.proc_start is not None
    assert me.verify() and me.claim()
    other = LeaseHolder(store, started_at=NOW)  # same pid, other token: a second scheduler in-process
    assert not other.claim()
    me.release()
    assert store.read().scheduler_owner is None
    assert other.claim()


def test_dead_owner_is_taken_over(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(p.pid)
    p.wait(timeout=30)
    store = CronStore(tmp_path)
    put_owner(store, owner(p.pid, start))
    assert not owner_alive(owner(p.pid, start))
    assert LeaseHolder(store, started_at=NOW).claim()


def test_live_owner_is_respected(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    store = CronStore(tmp_path)
    put_owner(store, owner(sleeper.pid, process_start(sleeper.pid)))
    me = LeaseHolder(store, started_at=NOW)
    assert not me.claim()
    assert store.read().scheduler_owner.pid == sleeper.pid  # type: ignore[union-attr]


def test_reused_pid_with_other_start_time_is_dead(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    store = CronStore(tmp_path)
    real = process_start(sleeper.pid)
    assert real is not None
    put_owner(store, owner(sleeper.pid, real + 12345))  # the pid is alive, but it is not our owner
    assert not owner_alive(owner(sleeper.pid, real + 12345))
    assert LeaseHolder(store, started_at=NOW).claim()


def test_zombie_owner_is_dead(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    start = process_start(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    wait_for(
        lambda: open(f"/proc/{sleeper.pid}/stat").read().split(")")[-1].split()[0] == "Z",
        10,
        "zombie",
    )
    store = CronStore(tmp_path)
    put_owner(store, owner(sleeper.pid, start))
    assert LeaseHolder(store, started_at=NOW).claim()


def test_owner_on_another_host_is_judged_by_its_heartbeat(tmp_path: Path) -> None:
    """Another host's pid cannot be checked: a lease renewed within its TTL is respected, one
    that was not (the holder died, or its container came back under a new hostname) is taken."""
    store = CronStore(tmp_path)
    fresh = owner(999_999_999, 1, host="some-other-host")
    fresh.renewed_at, fresh.ttl_s = datetime.now(UTC), 60.0
    put_owner(store, fresh)
    assert not LeaseHolder(store, started_at=NOW).claim()
    stale = owner(999_999_999, 1, host="some-other-host")
    stale.renewed_at, stale.ttl_s = datetime.now(UTC) - timedelta(seconds=61), 60.0
    put_owner(store, stale)
    me = LeaseHolder(store, started_at=NOW)
    assert me.claim()
    rec = store.read().scheduler_owner
    assert rec is not None and rec.token == me.token and rec.renewed_at is not None


# ------------------------------------------------------------------ two real processes

SCHEDULER_SCRIPT = r"""
import asyncio, json, os, sys
from pathlib import Path
from cron.scheduler import Scheduler

home, out = Path(sys.argv[1]), Path(sys.argv[2])

async def fire(task, occ):
    with open(out, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "task": task.name, "n": occ.number}) + "\n")
    return f"turn-{os.getpid()}-{occ.number}"

async def main():
    s = Scheduler(home, fire=fire, tick_s=0.25)
    await s.run(asyncio.Event())

asyncio.run(main())
"""


def test_two_processes_one_lease_and_takeover_after_kill9(tmp_path: Path) -> None:
    home, out = tmp_path / "home", tmp_path / "fires.jsonl"
    home.mkdir()
    store = CronStore(home)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", SCHEDULER_SCRIPT, str(home), str(out)], cwd=REPO, env=env)

    def holder() -> int | None:
        o = store.read().scheduler_owner
        return None if o is None else o.pid

    a = start()
    b: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: holder() == a.pid, 20, "the first process to take the lease")
        b = start()
        time.sleep(1.5)  # several ticks of contention
        assert holder() == a.pid

        from cron.schedule import ScheduleSpec
        from cron.store import make_task

        store.add(make_task(name="tick", agent="echo", schedule=ScheduleSpec("every", "1s", "UTC"),
                            prompt="p", now=datetime.now(UTC), exact=True))  # fmt: skip
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 2, 20, "fires from the holder")
        fires = [json.loads(line) for line in out.read_text().splitlines()]
        assert {f["pid"] for f in fires} == {a.pid}  # only the lease holder fires

        os.kill(a.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        a.wait(timeout=10)
        wait_for(
            lambda: any(json.loads(line)["pid"] == b.pid for line in out.read_text().splitlines()),  # type: ignore[union-attr]
            20,
            "the survivor to fire",
        )
        # the next due task (every 1 s) fires within two ticks (0.25 s) plus the 1 s period
        assert time.monotonic() - killed_at < 1.0 + 2 * 0.25 + 1.5  # + slack for a loaded machine
        assert holder() == b.pid
        fires = [json.loads(line) for line in out.read_text().splitlines()]
        numbers = [f["n"] for f in fires]
        assert len(numbers) == len(set(numbers)), "an occurrence was fired twice across the handover"
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_clean_stop_releases_the_lease(tmp_path: Path) -> None:
    home = tmp_path / "home"
    script = r"""
import asyncio, sys
from pathlib import Path
from cron.scheduler import Scheduler

async def fire(task, occ):
    return None

async def main():
    stop = asyncio.Event()
    s = Scheduler(Path(sys.argv[1]), fire=fire, tick_s=0.1)
    asyncio.get_running_loop().call_later(0.5, stop.set)
    await asyncio.wait_for(s.run(stop), timeout=20)

asyncio.run(main())
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script, str(home)], cwd=REPO, env=env, check=True, timeout=60)
    data = json.loads((home / "crons.json").read_text())
    assert data["scheduler_owner"] is None
