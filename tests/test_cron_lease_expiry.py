"""A scheduler lease held by a process on another host (a home on shared storage, a container that
came back under a new hostname) cannot be judged by pid: it expires when its heartbeat stops.
A real `serve` waits while the foreign lease is renewed, says so in /readyz, and takes over and
fires once the lease has gone unrenewed for its TTL; the holder renews its own lease on time."""

from __future__ import annotations

import json
import logging
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron.lease import MAX_CLOCK_SKEW_S, MAX_LEASE_TTL_S, LeaseHolder, Sightings, owner_alive
from cron.store import CronStore, OwnerRecord
from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import check, wait_ready
from tests.support.wait import eventually, wait_for

pytestmark = pytest.mark.timeout(60)


def foreign(renewed_at: datetime, ttl_s: float) -> OwnerRecord:
    return OwnerRecord(4242, "e" * 32, renewed_at, 1, "a-host-that-is-not-this-one", None, renewed_at, ttl_s)


def add_soon_task(home: Path, env: dict[str, str]) -> str:
    """A task due in a second; its id."""
    add = run_cli(home, "cron", "add", "--name", "soon", "--agent", "assistant",
                  "--in", "1s", "--exact", "--prompt", "wake up", "--json", env=env)  # fmt: skip
    assert add.code == 0, add.err
    return str(json.loads(add.out)["id"])


def serve_until_fired(home: Path, env: dict[str, str], task_id: str, event: str = "submitted") -> str:
    """A server on `home` until the task's run log shows `event`; it must hold the lease by then.
    Returns what it logged."""
    sp = start_serve(home, env=env)
    try:
        wait_for(lambda: any(r["event"] == event for r in run_log(home, task_id)), 15, "the take-over and fire")
        owner = CronStore(home).read().scheduler_owner
        assert owner is not None and owner.pid == sp.proc.pid
    finally:
        sp.stop()
    return sp.proc.stderr.read() if sp.proc.stderr else ""


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_foreign_lease_is_respected_while_renewed_and_taken_once_it_expires(home: Path) -> None:
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id = add_soon_task(home, env)
    ttl = 4.5  # the task is due within its first second: over two seconds of ticks with the lease live
    renewed = datetime.now(UTC)
    with CronStore(home).transaction() as state:  # the other host's server, alive a moment ago
        state.scheduler_owner = foreign(renewed, ttl)
    sp = start_serve(home, env=env)
    try:
        body = wait_ready(sp.url, 200)
        cron = check(body, "cron")
        assert cron["status"] == "ok" and "a-host-that-is-not-this-one" in cron.get("detail", ""), cron
        while (datetime.now(UTC) - renewed).total_seconds() < ttl - 1.0:
            assert run_log(home, task_id) == []  # the lease is live: this server does not fire
            time.sleep(0.2)
        wait_for(lambda: any(r["event"] == "outcome" for r in run_log(home, task_id)), 15, "the take-over and fire")
        assert [r["event"] for r in run_log(home, task_id)] == ["fired", "submitted", "outcome"]
        owner = CronStore(home).read().scheduler_owner
        assert owner is not None and owner.pid == sp.proc.pid and owner.renewed_at is not None
        # readiness results are cached for 1.5 s: polled until a fresh one no longer names the other host
        held = {"name": "cron", "status": "ok"}
        eventually(lambda: check(wait_ready(sp.url, 200), "cron") == held, 10, interval=0.1)
        assert check(wait_ready(sp.url, 200), "cron") == held
    finally:
        sp.kill()


def test_the_holder_renews_its_heartbeat_and_a_stale_one_elsewhere_is_dead(tmp_path: Path) -> None:
    store = CronStore(tmp_path)
    me = LeaseHolder(store, started_at=datetime.now(UTC), ttl_s=3.0)
    assert me.claim()
    first = store.read().scheduler_owner
    assert first is not None and first.ttl_s == 3.0 and first.renewed_at is not None
    assert me.claim() and store.read().scheduler_owner.renewed_at == first.renewed_at  # type: ignore[union-attr]
    time.sleep(1.1)  # a third of the TTL: renewal is due
    assert me.claim()
    renewed = store.read().scheduler_owner
    assert renewed is not None and renewed.renewed_at is not None and renewed.renewed_at > first.renewed_at
    now = datetime.now(UTC)
    assert owner_alive(foreign(now - timedelta(seconds=2), 3.0), now)
    assert not owner_alive(foreign(now - timedelta(seconds=4), 3.0), now)


def test_a_dead_foreign_lease_without_a_heartbeat_does_not_block_cron_forever(home: Path) -> None:
    """The record an older server on another host left (no heartbeat fields), an hour old."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id = add_soon_task(home, env)
    data = json.loads((home / "crons.json").read_text())
    started = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    data["scheduler_owner"] = {"pid": 4242, "token": "d" * 32, "started_at": started, "proc_start": 1, "host": "gone"}
    (home / "crons.json").write_text(json.dumps(data))
    serve_until_fired(home, env, task_id)


@pytest.mark.parametrize(
    "owner",
    [
        {"pid": "abc", "token": "d" * 32, "started_at": "2026-01-01T00:00:00+00:00"},
        {"pid": 2**40, "token": "d" * 32, "started_at": "2026-01-01T00:00:00+00:00"},
        {"pid": 4242, "token": "d" * 32, "started_at": "not a time"},
        "a string",
        [1, 2],
    ],
)
def test_an_unusable_lease_record_keeps_the_tasks_and_is_taken_over(home: Path, owner: Any) -> None:
    """The lease record is the scheduler's, not the user's: a damaged one (a hand edit, another
    tool) is read as no owner, loudly, and the tasks stay; before, the whole crons.json was set
    aside and every task stopped firing."""
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id = add_soon_task(home, env)
    data = json.loads((home / "crons.json").read_text())
    data["scheduler_owner"] = owner
    (home / "crons.json").write_text(json.dumps(data))
    listed = run_cli(home, "cron", "list", "--json", env=env)
    assert listed.code == 0, listed.err
    assert [t["id"] for t in json.loads(listed.out)] == [task_id]
    assert "scheduler lease record is unusable" in listed.err
    serve_until_fired(home, env, task_id)
    assert not list(home.glob("crons.json.corrupt-*"))


# ── records that passed validation but blocked every scheduler forever, silently ───────────────


def test_a_heartbeat_in_the_future_counts_from_when_this_process_first_saw_it() -> None:
    now = datetime.now(UTC)
    seen = Sightings()  # a scheduler's memory (its LeaseHolder's)
    stuck = foreign(datetime(9999, 12, 31, tzinfo=UTC), 3.0)
    assert owner_alive(stuck, now, seen)  # first seen now: a live holder with a fast clock keeps its lease
    assert owner_alive(stuck, now + timedelta(seconds=2), seen)
    assert not owner_alive(stuck, now + timedelta(seconds=4), seen)  # not renewed for its TTL since: expired
    assert owner_alive(stuck, now + timedelta(seconds=4), Sightings())  # another process first sees it now
    skewed = foreign(now + timedelta(seconds=MAX_CLOCK_SKEW_S / 2), 3.0)  # a little ahead is believed
    assert owner_alive(skewed, now + timedelta(seconds=MAX_CLOCK_SKEW_S / 2 + 2), seen)
    assert not owner_alive(skewed, now + timedelta(seconds=MAX_CLOCK_SKEW_S / 2 + 4), seen)


def test_a_lease_ttl_beyond_the_maximum_is_judged_by_the_maximum() -> None:
    now = datetime.now(UTC)
    century = 36500 * 86400.0
    assert OwnerRecord.from_dict(foreign(now, century).to_dict()).ttl_s == century  # still a usable record
    assert owner_alive(foreign(now - timedelta(seconds=MAX_LEASE_TTL_S - 60), century), now)
    assert not owner_alive(foreign(now - timedelta(seconds=MAX_LEASE_TTL_S + 60), century), now)
    assert LeaseHolder(CronStore(Path("/nonexistent")), started_at=now, ttl_s=century).ttl_s == MAX_LEASE_TTL_S


def test_waiting_for_a_live_holder_is_logged_once_and_taking_the_lease_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pid 1 on this host without a start time, renewing its lease: legitimate (the server may be
    pid 1 in a container), so the wait is not cut short while its heartbeat is fresh (without a
    start time the pid proves nothing, tests/test_cron_lease_unverified.py), but it is said, once."""
    store = CronStore(tmp_path)
    started = datetime(2026, 1, 1, tzinfo=UTC)
    with store.transaction() as state:
        state.scheduler_owner = OwnerRecord(
            1, "f" * 32, started, None, socket.gethostname(), renewed_at=datetime.now(UTC), ttl_s=90.0
        )
    me = LeaseHolder(store, started_at=datetime.now(UTC), ttl_s=3.0)
    caplog.set_level(logging.INFO, logger="appserver.cron")
    for _ in range(5):
        assert not me.claim()
    waits = [r for r in caplog.records if "waiting for the scheduler lease" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.WARNING
    assert f"pid 1 on {socket.gethostname()} since {started.isoformat()}" in waits[0].getMessage()
    with store.transaction() as state:
        state.scheduler_owner = None  # the holder stopped and released it
    assert me.claim() and me.claim()
    takes = [r for r in caplog.records if "this process takes it" in r.getMessage()]
    assert len(takes) == 1 and takes[0].levelno == logging.WARNING


def test_a_real_server_takes_over_a_foreign_lease_renewed_in_the_far_future(home: Path) -> None:
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    task_id = add_soon_task(home, env)
    with CronStore(home).transaction() as state:  # a hand edit, or a host whose clock ran away
        state.scheduler_owner = foreign(datetime(9999, 12, 31, tzinfo=UTC), 1.0)
    log_text = serve_until_fired(home, env, task_id, "outcome")
    assert log_text.count("waiting for the scheduler lease held by pid 4242") == 1, log_text[-3000:]
    assert log_text.count("in the future; it is counted from now") == 1, log_text[-3000:]
    assert log_text.count("taking over the scheduler lease from expired owner pid 4242") == 1, log_text[-3000:]
