"""A cron run's outcome is in the run log exactly once, whatever instant its server is killed at.

Before the fix `watch_outcome` (cron/runner.py) moved the run's claim to `settled` and only then
wrote the run log's `outcome`: a server killed between the two left the claim `settled` with no
outcome, and the server that took over (`Scheduler._resume_orphan` → `_outcome_then_delivery` →
`watch_outcome`) found the step taken and never wrote it: `cron logs` said `fired → submitted →
delivered`, forever. Now the record is written before the claim's step is saved, under the store
lock (`take_recorded_step`), and on one home a claim already `settled` whose outcome the run log
lacks (left by an older server) gets it from the server that takes over.

The crash is a real SIGKILL of a scheduler process, at each of its durable writes in turn (a
`crons.json` save, a run-log append; found by a Python audit hook, nothing of the scheduler is
replaced; each such process is a fork of a helper that imported the scheduler once, `Forks`, not
a new interpreter paying the imports again at each kill point); the server that takes over is a
real `Scheduler` with a fake kernel and gateway, as in the other cron tests. On a PostgreSQL store
(the same runner, the tasks in the database, a run log per server) the kill comes before each
run-log append.

Also: `cron.runlog.delivery_record` (the take-over's question "was this run's reply recorded?"),
read backward to the run's `fired` record instead of reading the whole log.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cron import runlog as runlog_module
from cron.runlog import read_runs
from cron.runner import TurnOutcome
from cron.schedule import ScheduleSpec
from cron.scheduler import Scheduler
from cron.store import CronStore, CronTask, Occurrence, make_task
from cron.stores import cron_store_for

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
FIRED_AT = T0 + timedelta(hours=1, seconds=1)
TAKEN_OVER_AT = T0 + timedelta(hours=1, seconds=30)
TARGET = "webhook:home:kitchen"
MAX_WRITES = 30  # a run writes about ten times: more means the kill never came

# The scheduler that is killed: one tick (claim, fire run #1), its outcome and its reply, then a
# clean close. Killed with SIGKILL just before its KILL_AT-th durable write: a save of the tasks
# (crons.json replaced; not on a database) or an append to its run log. The fake kernel notes the
# turn it accepted (`kernel`), the fake gateway every reply it sent (`sent`): both outside the
# scheduler's files, and what the server that takes over sees of them.
SCHEDULER_SCRIPT = r"""
import asyncio, os, signal, sys
from datetime import datetime
from pathlib import Path

from cron.runner import TurnOutcome
from cron.scheduler import Scheduler
from cron.stores import cron_store_for

home, url, now = sys.argv[1], sys.argv[2], datetime.fromisoformat(sys.argv[3])
kill_at, outside = int(sys.argv[4]), Path(sys.argv[5])
crons, runs = os.path.join(home, "crons.json"), os.path.join(home, "cron-runs") + os.sep
writes = 0


def hook(event, args):
    global writes
    if event == "os.rename":
        durable = os.fspath(args[1]) == crons
    elif event == "open":
        path, flags = args[0], args[2]
        durable = (
            isinstance(path, (str, bytes, os.PathLike))
            and os.fsdecode(path).startswith(runs)
            and isinstance(flags, int)
            and bool(flags & os.O_APPEND)
        )
    else:
        return
    if durable:
        writes += 1
        if writes == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


async def fire(task, occ):
    (outside / "kernel").write_text(f"turn_{occ.number}")
    return f"turn_{occ.number}"


async def outcome(turn_id):
    return TurnOutcome("completed", reply=f"reply of {turn_id}")


async def deliver(target, text):
    with open(outside / "sent", "a") as f:
        f.write(f"{target} {text}\n")
    return ["m1"]


async def main():
    s = Scheduler(cron_store_for(Path(home), url), fire=fire, clock=lambda: now, await_outcome=outcome, deliver=deliver)
    await s.tick()
    await s.wait_outcomes(30)
    await s.close()


sys.addaudithook(hook)
asyncio.run(main())
"""


class Outside:
    """The fake kernel and gateway of the server that takes over, sharing what the killed one
    left in `outside`: the turn its kernel accepted, the replies its gateway sent."""

    def __init__(self, outside: Path) -> None:
        self.outside = outside

    async def fire(self, task: CronTask, occ: Occurrence) -> str:
        (self.outside / "kernel").write_text(f"turn_{occ.number}")
        return f"turn_{occ.number}"

    async def claimed_turn(self, task: CronTask, occ: Occurrence) -> str | None:
        kernel = self.outside / "kernel"
        return kernel.read_text() if kernel.exists() else None

    async def outcome(self, turn_id: str) -> TurnOutcome:
        return TurnOutcome("completed", reply=f"reply of {turn_id}")

    async def deliver(self, target: str, text: str) -> list[str]:
        with open(self.outside / "sent", "a") as f:
            f.write(f"{target} {text}\n")
        return ["m2"]

    def sent(self) -> list[str]:
        path = self.outside / "sent"
        return path.read_text().splitlines() if path.exists() else []


def _add_task(store: CronStore, deliver: str | None) -> CronTask:
    return store.add(
        make_task(
            name="t",
            agent="echo",
            schedule=ScheduleSpec("every", "1h", "UTC"),
            prompt="p",
            now=T0,
            exact=True,
            deliver=deliver,
        )  # fmt: skip
    )


# `python -c SCHEDULER_SCRIPT ARGS` without a new interpreter's start and imports (~0.25 CPU-s, each
# of ~30 kill points): a helper imports what the script imports once, then per request (a JSON line:
# the arguments, the file for the child's output) forks a child that runs the script as `-c` does
# (its `__main__`, its `sys.argv`, its end through the interpreter's own exit: an uncaught exception
# prints a traceback and exits 1) and replies with the child's pid, then its exit code (negative: the
# signal that killed it, as in `subprocess`). The helper holds no scheduler, store or connection.
FORK_SERVER = r"""
import json, os, sys

import cron.runner, cron.scheduler, cron.stores  # what SCHEDULER_SCRIPT imports

try:
    import cron.pgstore  # the PostgreSQL store and its driver
except ImportError:
    pass

script = compile(sys.argv[1], "<string>", "exec")
while True:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    args, output = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)

null = os.open(os.devnull, os.O_RDONLY)
out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(null, 0)
os.dup2(out, 1)
os.dup2(out, 2)
os.close(null)
os.close(out)
sys.argv = ["-c", *args]
del json, line, args, output, pid, null, out
exec(script, {"__name__": "__main__", "__builtins__": __builtins__})
"""


class Forks:
    """The scheduler processes to kill, forked by one FORK_SERVER of this module."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER, SCHEDULER_SCRIPT],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.buffer = b""

    def _line(self, deadline: float) -> int:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("the forked scheduler did not end in time")
            data = os.read(fd, 4096)
            assert data, f"the fork server ended (exit code {self.proc.wait()})"
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return int(line)

    def run(self, args: list[str], output: Path, timeout: float) -> tuple[int, str]:
        """(exit code, output) of SCHEDULER_SCRIPT run with `args` in a forked child."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([args, str(output)]).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._line(deadline)
        try:
            code = self._line(deadline)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise
        return code, output.read_text(errors="replace")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    server = Forks()
    try:
        yield server
    finally:
        server.close()


def _run_killed(forks: Forks, home: Path, url: str, kill_at: int, outside: Path) -> int:
    args = [str(home), url, FIRED_AT.isoformat(), str(kill_at), str(outside)]
    code, output = forks.run(args, outside.parent / "scheduler.out", timeout=60)
    assert code in (0, -9), output
    return code


async def _take_over(store: CronStore, fakes: Outside) -> None:
    """A server that takes over (restarted, a standby; on a cluster a survivor), its scheduler's
    first tick: the killed one's lease is taken, its run resolved."""

    async def channels_up() -> None:
        return None

    s = Scheduler(
        store,
        fire=fakes.fire,
        clock=lambda: TAKEN_OVER_AT,
        await_outcome=fakes.outcome,
        deliver=fakes.deliver,
        claimed_turn=fakes.claimed_turn,
        before_recovered_delivery=channels_up,
    )
    assert (await s.tick()).has_lease
    await s.wait_outcomes(10)
    await s.close()


def _of_run(records: list[dict[str, Any]]) -> list[str]:
    return [str(r["event"]) for r in records if r.get("occurrence") == 1]


def _check_once(events: list[str], sent: list[str], deliver: str | None, where: str) -> None:
    """Run #1 was claimed, submitted once, its outcome recorded once, and with `deliver` its reply
    sent at most once and its verdict recorded once, after the outcome."""
    assert events.count("fired") == 1 and events.count("submitted") == 1, where
    assert events.count("outcome") == 1, where
    verdicts = [e for e in events if e in ("delivered", "delivery_failed")]
    if deliver is None:
        assert verdicts == [] and sent == [], where
        return
    assert len(verdicts) == 1 and len(sent) <= 1, where
    assert events.index("outcome") < events.index(verdicts[0]), where
    if verdicts == ["delivered"]:
        assert len(sent) == 1, where


@pytest.mark.parametrize("deliver", [TARGET, None], ids=["deliver", "no-deliver"])
async def test_a_kill_at_any_write_of_a_run_leaves_its_outcome_recorded_once(
    tmp_path: Path, deliver: str | None, forks: Forks
) -> None:
    """One home: the run log of the killed scheduler is the run log of the one that takes over."""
    for kill_at in range(1, MAX_WRITES + 1):
        base = tmp_path / f"k{kill_at}"
        home, outside = base / "home", base / "outside"
        outside.mkdir(parents=True)
        task = _add_task(CronStore(home), deliver)
        code = _run_killed(forks, home, "", kill_at, outside)
        store = CronStore(home)
        fakes = Outside(outside)
        if code == -9:
            await _take_over(store, fakes)
        events = _of_run(read_runs(store.runs_dir, task.id))
        where = f"killed before write {kill_at}: {events} {fakes.sent()}"
        if events.count("fired") == 0:  # killed before the claim was saved: the run was never claimed
            continue
        _check_once(events, fakes.sent(), deliver, where)
        assert store.claim_progress(task.id, 1) == (True, "done"), where
        if code == 0:
            assert kill_at > 5, "the run ended without being killed: the kill points were not found"
            return
    pytest.fail(f"the scheduler was still killed at its write {MAX_WRITES}")


@pytest.mark.parametrize("deliver", [TARGET, None], ids=["deliver", "no-deliver"])
async def test_on_a_postgresql_store_a_kill_before_any_run_log_write_leaves_the_outcome_recorded_once(
    tmp_path: Path, deliver: str | None, forks: Forks
) -> None:
    """A cluster's database holds the tasks, each server has a run log of its own: the killed
    server's and the survivor's logs together hold the run's outcome once."""
    psycopg = pytest.importorskip("psycopg")
    from appserver.store.pgschema import MIGRATIONS
    from tests.support.pg import temp_database

    with temp_database("cron_outcome_s21") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            for _, script in MIGRATIONS:
                conn.execute(script)
        for kill_at in range(1, MAX_WRITES + 1):
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("DELETE FROM cron_state")
            base = tmp_path / f"k{kill_at}"
            dead, survivor, outside = base / "dead", base / "survivor", base / "outside"
            outside.mkdir(parents=True)
            first = cron_store_for(dead, url)
            task = _add_task(first, deliver)
            first.close()
            code = _run_killed(forks, dead, url, kill_at, outside)
            fakes = Outside(outside)
            if code == -9:
                await _take_over(cron_store_for(survivor, url), fakes)
            events = _of_run(read_runs(dead / "cron-runs", task.id)) + _of_run(
                read_runs(survivor / "cron-runs", task.id)
            )
            where = f"killed before run-log write {kill_at}: {events} {fakes.sent()}"
            if events.count("fired") == 0:
                continue
            assert events.count("outcome") == 1, where
            verdicts = [e for e in events if e in ("delivered", "delivery_failed")]
            assert len(verdicts) == (1 if deliver else 0) and len(fakes.sent()) <= 1, where
            check = cron_store_for(survivor, url)
            try:
                assert check.claim_progress(task.id, 1) == (True, "done"), where
            finally:
                check.close()
            if code == 0:
                assert kill_at > 3, "the run ended without being killed: the kill points were not found"
                return
        pytest.fail(f"the scheduler was still killed at its write {MAX_WRITES}")


# ---------------------------------------------------------------- what an older server left


async def _settled_without_outcome(tmp_path: Path) -> tuple[CronStore, CronTask, Outside]:
    """A home as an older server killed between the claim's `settled` and the run log's `outcome`
    left it (what the testers' mkstate.py builds): claim `settled`, the log `fired`, `submitted`."""
    home, outside = tmp_path / "home", tmp_path / "outside"
    outside.mkdir(parents=True)
    store = CronStore(home)
    task = _add_task(store, TARGET)
    fakes = Outside(outside)

    s = Scheduler(store, fire=fakes.fire, clock=lambda: FIRED_AT)  # fires run #1, then stops
    assert [n for _, n, _ in (await s.tick()).fired] == [1]
    await s.close()
    assert _of_run(read_runs(store.runs_dir, task.id)) == ["fired", "submitted"]
    state = json.loads((home / "crons.json").read_text())
    state["tasks"][0]["last_claimed"]["progress"] = "settled"
    (home / "crons.json").write_text(json.dumps(state, indent=1))
    return store, task, fakes


async def test_a_settled_claim_whose_outcome_the_log_lacks_gets_it_once_from_the_server_that_takes_over(
    tmp_path: Path,
) -> None:
    store, task, fakes = await _settled_without_outcome(tmp_path)
    await _take_over(store, fakes)
    records = [r for r in read_runs(store.runs_dir, task.id) if r.get("occurrence") == 1]
    assert [r["event"] for r in records] == ["fired", "submitted", "outcome", "delivered"], records
    assert records[2]["status"] == "completed" and records[2]["turn_id"] == "turn_1", records
    assert fakes.sent() == [f"{TARGET} reply of turn_1"]
    assert store.claim_progress(task.id, 1) == (True, "done")


async def test_two_watchers_of_that_run_record_its_outcome_once(tmp_path: Path) -> None:
    """A restarted server follows the run twice: its scheduler takes the claim over, and its cron
    service follows the turns whose outcome the log lacks (`CronService.recover_outcomes`, through
    `Scheduler.watch`). One records the outcome, one sends the reply."""
    store, task, fakes = await _settled_without_outcome(tmp_path)

    async def channels_up() -> None:
        await asyncio.sleep(0)

    s = Scheduler(
        store,
        fire=fakes.fire,
        clock=lambda: TAKEN_OVER_AT,
        await_outcome=fakes.outcome,
        deliver=fakes.deliver,
        claimed_turn=fakes.claimed_turn,
        before_recovered_delivery=channels_up,
    )
    pending = s.unrecorded_turns()
    assert pending == [(task.id, 1, "turn_1")]
    for task_id, number, turn_id in pending:
        s.watch(task_id, number, turn_id, TARGET, before_delivery=channels_up)
    assert (await s.tick()).has_lease
    await s.wait_outcomes(10)
    await s.close()
    assert _of_run(read_runs(store.runs_dir, task.id)) == ["fired", "submitted", "outcome", "delivered"]
    assert fakes.sent() == [f"{TARGET} reply of turn_1"]
    assert store.claim_progress(task.id, 1) == (True, "done")


# ---------------------------------------------------------------- delivery_record


def test_delivery_record_finds_the_reply_of_a_run(tmp_path: Path) -> None:
    from cron.runlog import delivery_record  # (imported here: the other tests run without it)

    runs = tmp_path / "cron-runs"
    for n in range(1, 4):
        runlog_module.append_run(runs, "cron_abc", "fired", occurrence=n)
        runlog_module.append_run(runs, "cron_abc", "outcome", occurrence=n, status="completed")
    runlog_module.append_run(runs, "cron_abc", "delivered", occurrence=2, target=TARGET, remote_ids=["m"])
    runlog_module.append_run(runs, "cron_abc", "delivery_failed", occurrence=3, target=TARGET, error="no")
    found = delivery_record(runs, "cron_abc", 2)
    assert found is not None and found["event"] == "delivered" and found["remote_ids"] == ["m"]
    failed = delivery_record(runs, "cron_abc", 3)
    assert failed is not None and failed["event"] == "delivery_failed"
    assert delivery_record(runs, "cron_abc", 1) is None
    assert delivery_record(runs, "cron_nothing", 1) is None
