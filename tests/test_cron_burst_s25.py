"""Many cron runs ending in the same moment on one server: every outcome is recorded, none times out.

Before the fix each outcome (`cron/runner.py` `take_recorded_step`, `take_step`) was a locked
load-and-save of the whole crons.json in a worker thread of its own, and the worker threads of the
one server polled the file lock against each other: with a thousand tasks due in one minute some
waited longer than `lock_timeout_s`, logged "could not record that task … is settled: timed out …;
another appserver process is holding it" (no other process ran) and left their claims `submitted`.
Now this process's threads take the lock one at a time before the file lock (so the timeout only
ever measures another process's hold, and says who that is when the system tells), and the steps
handed in together are saved at once (`CronStore.combined`).

Real parts throughout: a real `Scheduler` and `CronStore` on a temporary home, the real runner,
a fake kernel (as in the other cron tests), a real second process holding the lock.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import filelock
import pytest

from cron.runlog import read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronFile, CronLockTimeout, CronStore, CronStoreError, CronTask, Occurrence, make_task

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DUE = T0 + timedelta(minutes=30)
WAIT_S = 10.0


def a_task(name: str) -> CronTask:
    return make_task(
        name=name,
        agent="assistant",
        schedule=ScheduleSpec("at", "2026-01-01 00:30", "UTC"),
        prompt=f"prompt of {name}",
        now=T0,
        exact=True,
    )


def add_tasks(store: CronStore, count: int) -> list[str]:
    with store.transaction() as state:
        state.tasks.extend(a_task(f"t{i}") for i in range(count))
        return [t.id for t in state.tasks]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_hundreds_of_runs_ending_together_are_all_recorded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """400 tasks due at one instant, their turns ending at once, settled from 32 worker threads
    with a lock timeout of 0.3 s: before the fix many timed out on each other and stayed
    `claimed`/`submitted`; now every claim ends `done`, with one outcome each in the run log."""
    store = CronStore(tmp_path / "home", lock_timeout_s=0.3)
    ids = add_tasks(store, 400)

    async def fire(task: CronTask, occurrence: Occurrence) -> str:
        return f"turn_{task.id}"

    async def outcome(turn_id: str) -> TurnOutcome:
        return TurnOutcome("completed", reply="ok")

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))  # a server with many CPUs
        scheduler = Scheduler(store, fire=fire, clock=lambda: DUE + timedelta(seconds=1), await_outcome=outcome)
        await scheduler.tick()
        await scheduler.wait_outcomes(30)
        await scheduler.close()

    with caplog.at_level(logging.WARNING, logger="appserver.cron"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()] == []
    progress = {t.id: (t.last_claimed or {}).get("progress") for t in CronStore(tmp_path / "home").read().tasks}
    assert progress == dict.fromkeys(ids, "done")
    for task_id in ids:
        outcomes = [r for r in read_runs(store.runs_dir, task_id) if r.get("event") == "outcome"]
        assert [r.get("status") for r in outcomes] == ["completed"], task_id


def test_threads_of_one_process_never_time_out_on_each_other(tmp_path: Path) -> None:
    """Two stores of one home in one process (the scheduler's, a `schedule` tool call's): a thread
    holding the lock for five times the timeout delays the other, never fails it."""
    home = tmp_path / "home"
    first, second = CronStore(home, lock_timeout_s=0.2), CronStore(home, lock_timeout_s=0.2)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with first.lock():
            held.set()
            time.sleep(1.0)
        done.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(WAIT_S)
    second.add(a_task("waited"))  # before the fix: CronLockTimeout after 0.2 s
    assert done.is_set()
    holder.join(WAIT_S)
    assert [t.name for t in first.read().tasks] == ["waited"]


def test_lock_taken_again_by_its_holder_thread_is_held_already(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home", lock_timeout_s=0.2)
    with store.lock(), CronStore(tmp_path / "home", lock_timeout_s=0.2).lock():
        pass


HOLDER = """
import sys, time, filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_timeout_names_the_process_holding_the_lock(tmp_path: Path) -> None:
    """Another process holds crons.json.lock: the timeout names it (pid and command line), and the
    threads queued behind the one that timed out give up with it instead of 0.5 s more each."""
    store = CronStore(tmp_path / "home", lock_timeout_s=0.5)
    store.add(a_task("kept"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        errors: list[str] = []

        def read() -> None:
            try:
                store.read()
            except CronLockTimeout as exc:
                errors.append(str(exc))

        started = time.monotonic()
        readers = [threading.Thread(target=read) for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(WAIT_S)
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait(WAIT_S)
    assert len(errors) == 4
    for message in errors:
        assert "timed out after 0.5 s waiting for" in message
        assert f"held by process {proc.pid} (" in message and "filelock" in message
        assert "appserver process" not in message
    assert elapsed < 1.5  # one wait of 0.5 s, not four in a row
    assert [t.name for t in store.read().tasks] == ["kept"]


def test_timeout_says_when_this_process_holds_it_outside_the_store(tmp_path: Path) -> None:
    store = CronStore(tmp_path / "home", lock_timeout_s=0.2)
    store.add(a_task("kept"))
    with filelock.FileLock(str(store.lock_path)), pytest.raises(CronLockTimeout) as caught:
        store.read()
    assert "outside its cron store" in str(caught.value)


def hand_in(store: CronStore, job: Callable[[CronFile], tuple[Any, bool]], results: dict[int, Any], key: int) -> None:
    """`store.combined(job)` in a thread of its own, once the jobs handed in before it wait."""
    waiting = len(store._jobs)

    def run() -> None:
        try:
            results[key] = store.combined(job)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[key] = exc

    threading.Thread(target=run, daemon=True).start()
    wait_until(lambda: len(store._jobs) == waiting + 1, f"job {key} to be handed in")


def test_steps_handed_in_together_are_saved_at_once(tmp_path: Path) -> None:
    """Thirty steps handed in while the lock is held run on one load and are saved once, every
    one of them kept."""
    store = CronStore(tmp_path / "home", lock_timeout_s=0.2)
    add_tasks(store, 30)
    loads: list[int] = []
    results: dict[int, Any] = {}

    def step(i: int) -> Callable[[CronFile], tuple[Any, bool]]:
        def job(state: CronFile) -> tuple[Any, bool]:
            loads.append(id(state))
            next(t for t in state.tasks if t.name == f"t{i}").set_error(f"noted {i}", T0)
            return i, True

        return job

    with store.lock():
        before = store.signature()
        for i in range(30):
            hand_in(store, step(i), results, i)
    wait_until(lambda: len(results) == 30, "every step")
    assert results == {i: i for i in range(30)}
    assert len(set(loads)) == 1 and len(loads) == 30  # one load, one batch
    assert store.signature() != before
    assert {t.name: t.last_error for t in store.read().tasks} == {f"t{i}": f"noted {i}" for i in range(30)}


def test_a_step_that_fails_saves_nothing_of_its_batch(tmp_path: Path) -> None:
    """Record first, then the claim's move: a step that raises is never saved half-done, nor are
    the steps run with it (they are told so); the steps after it are run and saved on their own."""
    store = CronStore(tmp_path / "home", lock_timeout_s=0.2)
    add_tasks(store, 3)
    results: dict[int, Any] = {}

    def note(name: str) -> Callable[[CronFile], tuple[Any, bool]]:
        def job(state: CronFile) -> tuple[Any, bool]:
            next(t for t in state.tasks if t.name == name).set_error(f"noted {name}", T0)
            return name, True

        return job

    def broken(state: CronFile) -> tuple[Any, bool]:
        state.tasks[1].set_error("half done", T0)
        raise ValueError("the record could not be written")

    with store.lock():
        hand_in(store, note("t0"), results, 0)
        hand_in(store, broken, results, 1)
        hand_in(store, note("t2"), results, 2)
    wait_until(lambda: len(results) == 3, "every step")
    assert isinstance(results[0], CronStoreError) and "not saved" in str(results[0])
    assert isinstance(results[1], ValueError)
    assert results[2] == "t2"
    assert {t.name: t.last_error for t in store.read().tasks} == {"t0": None, "t1": None, "t2": "noted t2"}
