"""A cluster server judged gone (fenced) runs no cron: its scheduler takes no lease and claims no
run, even with the lease in its name, and a run it claimed before it was found fenced is not fired
(its kernel refuses it, and it would be lost as `fire_failed`). The due runs are left to the next
healthy server, which catches them up under the task's misfire policy.

Found by an outside tester: server A stopped (SIGSTOP) long enough to be judged gone, then B killed:
A took the lease "from dead owner" B and burned every occurrence as `fire_failed`, so C, started
later, caught up nothing. Here the cluster is real PostgreSQL rows: an instance is judged gone the
way a survivor does it (its `instances` row deleted, or its heartbeat left to go stale).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cron.runlog import read_runs
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronTask, Occurrence, make_task
from cron.stores import cron_store_for

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
TIMEOUT_S, HEARTBEAT_S = 6.0, 1.0  # [store] instance_timeout_s and heartbeat_s of every server here
NOW = "extract(epoch from clock_timestamp())"


@pytest.fixture
def url() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    from appserver.store.pgschema import MIGRATIONS
    from tests.support.pg import temp_database

    with temp_database("cron_cluster_s24") as database:
        with psycopg.connect(database, autocommit=True) as conn:
            for _, script in MIGRATIONS:
                conn.execute(script)
        yield database


def _sql(url: str, query: str, *args: object) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description else []


def beat(url: str, *instances: str, age_s: float = 0.0) -> None:
    """Register or renew the instances' heartbeats, `age_s` old (what each server's session does)."""
    for i, instance in enumerate(instances):
        _sql(
            url,
            "INSERT INTO instances(id, host, pid, address, lock_key, started_at, heartbeat_at) "
            f"VALUES (%s, 'h', 1, '', %s, {NOW}, {NOW} - %s) ON CONFLICT (id) DO UPDATE "
            "SET heartbeat_at = EXCLUDED.heartbeat_at",
            instance,
            1000 + i,
            age_s,
        )


def judge_gone(url: str, instance: str) -> None:
    """What a survivor does to an instance it judged gone (`Cluster.forget_gone`): delete its row."""
    _sql(url, "DELETE FROM instances WHERE id = %s", instance)


class Kernel:
    """The kernels of the cluster, as cron sees them: a fenced server's refuses every submission
    (as `Kernel._check_not_fenced` does); each accepted run is kept by its idempotency key."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.turns: dict[tuple[str, int], str] = {}
        self.submitted_by: list[tuple[str, int, str]] = []  # task id, run, instance

    def fenced(self, instance: str) -> bool:
        rows = _sql(self.url, f"SELECT {NOW} - heartbeat_at FROM instances WHERE id = %s", instance)
        return not rows or float(rows[0][0]) > TIMEOUT_S - HEARTBEAT_S  # (as `Cluster.fenced` judges itself)

    def fire_of(
        self, instance: str, after_fire: Callable[[], None] | None = None
    ) -> Callable[[CronTask, Occurrence], Awaitable[str]]:
        async def fire(task: CronTask, occ: Occurrence) -> str:
            if self.fenced(instance):
                raise RuntimeError(f"Unavailable: this server ({instance}) was judged gone by the others")
            turn = self.turns.setdefault((task.id, occ.number), f"turn_{task.id}_{occ.number}")
            self.submitted_by.append((task.id, occ.number, instance))
            if after_fire is not None:
                after_fire()
            return turn

        return fire

    async def claimed_turn(self, task: CronTask, occ: Occurrence) -> str | None:
        return self.turns.get((task.id, occ.number))


def server(
    home: Path,
    url: str,
    instance: str,
    kernel: Kernel,
    clock: list[datetime],
    after_fire: Callable[[], None] | None = None,
) -> Scheduler:
    """One server's scheduler on the cluster's database (what `CronService.start` sets up)."""
    store = cron_store_for(home, url)
    store.join_cluster(instance, TIMEOUT_S, HEARTBEAT_S)
    return Scheduler(
        store,
        fire=kernel.fire_of(instance, after_fire),
        clock=lambda: clock[0],
        claimed_turn=kernel.claimed_turn,
    )


def add_task(home: Path, url: str) -> CronTask:
    store = cron_store_for(home, url)
    try:
        spec = ScheduleSpec("every", "2s", "UTC")
        return store.add(
            make_task(name="t", agent="assistant", schedule=spec, prompt="tick", now=T0, misfire="run_all", exact=True)
        )
    finally:
        store.close()


def cron_doc(url: str) -> dict[str, object]:
    import json

    rows = _sql(url, "SELECT doc FROM cron_state WHERE id = 1")
    return dict(json.loads(str(rows[0][0])))


def owner_instance(url: str) -> object:
    owner = cron_doc(url).get("scheduler_owner")
    return owner.get("instance") if isinstance(owner, dict) else None


def events(home: Path, task_id: str) -> list[str]:
    return [str(r["event"]) for r in read_runs(home / "cron-runs", task_id)]


async def test_a_server_judged_gone_takes_no_lease_from_a_dead_holder_and_the_next_healthy_one_catches_up(
    tmp_path: Path, url: str
) -> None:
    kernel, clock = Kernel(url), [T0]
    task = add_task(tmp_path / "admin", url)
    beat(url, "inst_a", "inst_b")
    a = server(tmp_path / "a", url, "inst_a", kernel, clock)
    b = server(tmp_path / "b", url, "inst_b", kernel, clock)
    try:
        assert (await b.tick()).has_lease
        assert not (await a.tick()).has_lease  # A stands by behind the live B
        assert owner_instance(url) == "inst_b"
        judge_gone(url, "inst_a")  # B judged A gone (A was stopped) …
        beat(url, "inst_b", age_s=100)  # … then B was killed: its heartbeat stops
        clock[0] = T0 + timedelta(seconds=10)  # runs #1..#5 came due meanwhile
        report = await a.tick()
        assert not report.has_lease and report.fired == []
        assert owner_instance(url) == "inst_b", "a server judged gone took the scheduler lease"
        assert kernel.submitted_by == [] and events(tmp_path / "a", task.id) == []
        assert cron_doc(url)["tasks"][0]["occurrence"] == 0  # type: ignore[index]  # nothing claimed

        beat(url, "inst_c")
        c = server(tmp_path / "c", url, "inst_c", kernel, clock)
        try:
            report = await c.tick()
            assert report.has_lease and owner_instance(url) == "inst_c"
            assert sorted(n for _, n, _ in report.fired) == [1, 2, 3, 4, 5]  # run_all: every run caught up
            assert events(tmp_path / "c", task.id).count("submitted") == 5
        finally:
            await c.close()
    finally:
        await a.close()
        await b.close()


async def test_a_holder_judged_gone_claims_nothing_more_and_a_healthy_server_takes_the_runs_over(
    tmp_path: Path, url: str
) -> None:
    kernel, clock = Kernel(url), [T0]
    task = add_task(tmp_path / "admin", url)
    beat(url, "inst_a")
    a = server(tmp_path / "a", url, "inst_a", kernel, clock)
    try:
        assert (await a.tick()).has_lease and owner_instance(url) == "inst_a"
        judge_gone(url, "inst_a")
        clock[0] = T0 + timedelta(seconds=6)
        report = await a.tick()
        assert not report.has_lease and report.fired == [], "a server judged gone still ran its scheduler"
        assert not a.has_lease and "judged gone" in (a.lease_state or "")
        assert "fire_failed" not in events(tmp_path / "a", task.id)
        assert cron_doc(url)["tasks"][0]["occurrence"] == 0  # type: ignore[index]

        beat(url, "inst_c")
        c = server(tmp_path / "c", url, "inst_c", kernel, clock)
        try:
            report = await c.tick()
            assert report.has_lease and sorted(n for _, n, _ in report.fired) == [1, 2, 3]
        finally:
            await c.close()
        assert owner_instance(url) is None or owner_instance(url) == "inst_c"  # (C released it on close)
    finally:
        await a.close()
    assert owner_instance(url) != "inst_a"  # A's close released nothing it did not hold


async def test_a_run_claimed_before_its_server_was_judged_gone_is_left_to_the_server_that_takes_over(
    tmp_path: Path, url: str
) -> None:
    kernel, clock = Kernel(url), [T0]
    task = add_task(tmp_path / "admin", url)
    beat(url, "inst_a")
    # A is judged gone while it fires the first of its claimed runs (as if stopped right then)
    a = server(tmp_path / "a", url, "inst_a", kernel, clock, after_fire=lambda: judge_gone(url, "inst_a"))
    try:
        assert (await a.tick()).has_lease
        clock[0] = T0 + timedelta(seconds=6)
        report = await a.tick()  # claims #1..#3 (run_all), fires #1, then finds itself fenced
        assert [n for _, n, _ in report.fired] == [1]
        assert "fire_failed" not in events(tmp_path / "a", task.id)

        beat(url, "inst_c")
        c = server(tmp_path / "c", url, "inst_c", kernel, clock)
        try:
            report = await c.tick()
            assert report.has_lease
            assert sorted(n for _, n, _ in report.fired) == [2, 3]  # adopted from A, submitted once
        finally:
            await c.close()
        assert sorted(n for _, n, _ in kernel.submitted_by) == [1, 2, 3]
    finally:
        await a.close()


async def test_runs_held_back_while_a_server_was_fenced_fire_once_it_is_live_again_with_its_lease(
    tmp_path: Path, url: str
) -> None:
    kernel, clock = Kernel(url), [T0]
    task = add_task(tmp_path / "admin", url)
    beat(url, "inst_a")
    # A's session stalls while it fires (its heartbeat goes stale past the point it fences itself)
    a = server(tmp_path / "a", url, "inst_a", kernel, clock, after_fire=lambda: beat(url, "inst_a", age_s=5.5))
    try:
        assert (await a.tick()).has_lease
        clock[0] = T0 + timedelta(seconds=4)
        report = await a.tick()  # claims #1, #2; fires #1; #2 is held back
        assert [n for _, n, _ in report.fired] == [1]
        a.fire = kernel.fire_of("inst_a")
        beat(url, "inst_a")  # its session renewed the heartbeat: nobody took the lease meanwhile
        report = await a.tick()
        assert report.has_lease and [n for _, n, _ in report.fired] == [2]
        assert sorted(n for _, n, _ in kernel.submitted_by) == [1, 2]
        assert "fire_failed" not in events(tmp_path / "a", task.id)
    finally:
        await a.close()
