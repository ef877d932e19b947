"""crons.json under its lock (checks 1, 2, 8) and the `appserver cron` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import filelock
import pytest
from click.testing import CliRunner

from appserver.cli.cron import ANY_AGENT, AgentDirectory, cron_group
from appserver.fsutil import CorruptStateFile
from cron.runlog import append_run, read_runs
from cron.schedule import ScheduleSpec
from cron.store import CronFileUnreadable, CronLockTimeout, CronStore, CronStoreError, make_task
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
# the `cron` commands alone, any agent name accepted (no store needed)
CRON_ALONE = "from appserver.cli.cron import ANY_AGENT, cron_group; cron_group(obj=ANY_AGENT)"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    return h


def cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cron_group, list(args), obj=ANY_AGENT, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def task(name: str = "t", **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("schedule", ScheduleSpec("every", "1h", "UTC"))
    kw.setdefault("now", datetime(2026, 1, 1, tzinfo=UTC))
    return make_task(name=name, agent=str(kw.pop("agent", "echo")), prompt="p", **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ check 1


def test_ten_concurrent_add_processes(home: Path) -> None:
    env = {**os.environ, "APPSERVER_HOME": str(home), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CRON_ALONE, "add", "--name", f"job{i}", "--agent", "echo",
             "--every", f"{i + 1}m", "--prompt", f"prompt {i}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for i in range(10)
    ]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    data = json.loads((home / "crons.json").read_text())
    assert data["version"] == 1
    assert sorted(t["name"] for t in data["tasks"]) == sorted(f"job{i}" for i in range(10))
    assert len({t["id"] for t in data["tasks"]}) == 10
    assert not list(home.glob("crons.json.corrupt-*"))
    assert not list(home.glob(".crons.json.*.tmp"))


# ------------------------------------------------------------------ check 2


def test_corrupt_file_is_moved_aside_and_next_add_keeps_it(home: Path) -> None:
    home.mkdir(parents=True)
    garbage = b'{"version": 1, "tasks": [ {"name": "precious"'  # truncated write
    (home / "crons.json").write_bytes(garbage)

    code, out, err = cli("add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 1
    assert "moved aside" in err and "crons.json.corrupt-" in err
    assert len(err.strip().splitlines()) == 1
    aside = list(home.glob("crons.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert not (home / "crons.json").exists()  # the refused add wrote nothing

    code, out, err = cli("add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x")
    assert code == 0, err
    assert "warning" in err and aside[0].name in err  # the user keeps being told
    assert aside[0].read_bytes() == garbage  # never overwritten
    assert [t["name"] for t in json.loads((home / "crons.json").read_text())["tasks"]] == ["a"]


def test_valid_json_with_wrong_shape_is_corrupt_too(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "crons.json").write_text(json.dumps({"version": 1, "tasks": [{"id": 3}]}))
    with pytest.raises(CronFileUnreadable):  # a reader reports it and moves nothing
        CronStore(home).read()
    assert CronStore(home).corrupt_files() == [] and (home / "crons.json").exists()
    with pytest.raises(CorruptStateFile), CronStore(home).transaction():  # a writer sets it aside
        pass
    assert len(CronStore(home).corrupt_files()) == 1
    assert CronStore(home).read().tasks == []


def test_newer_format_is_refused_not_moved(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "crons.json").write_text(json.dumps({"version": 99, "tasks": []}))
    with pytest.raises(CronStoreError, match="newer"):
        CronStore(home).read()
    assert (home / "crons.json").exists()


def test_lock_timeout_is_a_clear_error(home: Path) -> None:
    store = CronStore(home, lock_timeout_s=0.2)
    home.mkdir(parents=True)
    holder = filelock.FileLock(str(store.lock_path))
    with holder:
        with pytest.raises(CronLockTimeout, match="timed out after 0.2 s waiting for .*crons.json.lock"):
            store.add(task())
    store.add(task())


def test_names_unique_per_agent(home: Path) -> None:
    store = CronStore(home)
    store.add(task("brief", agent="a"))
    store.add(task("brief", agent="b"))
    with pytest.raises(CronStoreError, match="already has"):
        store.add(task("brief", agent="a"))
    with pytest.raises(CronStoreError, match="several agents"):
        store.read().find("brief")
    assert store.read().find("brief", "b").agent == "b"


def test_round_trip(home: Path) -> None:
    store = CronStore(home)
    t = task("x", deliver="telegram:bot1:-100123:thread", exact=True, misfire="run_all")
    store.add(t)
    back = store.read().find("x")
    assert back.to_dict() == t.to_dict()


def test_save_reencodes_every_changed_task(home: Path) -> None:
    """save() reuses the last JSON line of unchanged tasks; any change, even an in-place edit of
    `last_claimed`, must still reach the file."""
    store = CronStore(home)
    for name in ("a", "b", "c"):
        store.add(task(name))
    later = datetime(2026, 3, 1, tzinfo=UTC)
    with store.lock():
        state = store.load()
        a, b, _ = state.tasks
        a.next_fire_at, a.occurrence = later, 7
        b.last_claimed = {"occurrence": 1}
        store.save(state, cache=True)
    with store.lock():
        state = store.load()  # the cached object: edit it in place
        assert state.tasks[1].last_claimed is not None
        state.tasks[1].last_claimed["occurrence"] = 2
        store.save(state, cache=True)
    fresh = CronStore(home).read()  # another process's view: parsed from the file
    assert [t.to_dict() for t in fresh.tasks] == [t.to_dict() for t in state.tasks]
    assert fresh.find("a").next_fire_at == later and fresh.find("a").occurrence == 7
    assert fresh.find("b").last_claimed == {"occurrence": 2}


# ------------------------------------------------------------------ check 8 (CLI refusals)


@pytest.mark.parametrize(
    "args",
    [
        ["--cron", "61 * * * *"],
        ["--cron", "0 8 * *"],
        ["--cron", "0 0 30 2 *"],
        ["--cron", "0 8 * * *", "--tz", "Mars/Olympus"],
        ["--every", "0m"],
        ["--every", "soon"],
        ["--at", "2020-01-01 08:00"],
        ["--at", "2020-01-01 08:00", "--tz", "Europe/Paris"],
        ["--at", "not a time"],
        ["--in", "0h"],
        ["--every", "1h", "--deliver", "slack"],
        ["--every", "1h", "--conversation", "has space"],
        ["--every", "1h", "--max-lateness", "forever"],
    ],
)
def test_invalid_add_is_refused_and_writes_nothing(home: Path, args: list[str]) -> None:
    assert cli("add", "--name", "ok", "--agent", "echo", "--every", "1h", "--prompt", "x")[0] == 0
    before = (home / "crons.json").read_bytes()
    code, out, err = cli("add", "--name", "new", "--agent", "echo", "--prompt", "x", *args)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")  # spelled like every command
    assert (home / "crons.json").read_bytes() == before


def test_add_needs_exactly_one_schedule(home: Path) -> None:
    code, _, err = cli("add", "--name", "n", "--agent", "echo", "--prompt", "x")
    assert code == 2 and "exactly one" in err
    code, _, err = cli("add", "--name", "n", "--agent", "echo", "--prompt", "x", "--every", "1h", "--in", "1h")
    assert code == 2
    assert not (home / "crons.json").exists()


def test_bad_name_and_duplicate_refused(home: Path) -> None:
    assert cli("add", "--name", "a b", "--agent", "e", "--every", "1h", "--prompt", "x")[0] == 1
    assert cli("add", "--name", "ab", "--agent", "e", "--every", "1h", "--prompt", "x")[0] == 0
    code, _, err = cli("add", "--name", "ab", "--agent", "e", "--every", "2h", "--prompt", "y")
    assert code == 1 and "already has" in err


def test_validate_agent_hook(home: Path) -> None:
    def validate(cfg: object, agent: str) -> str:
        if agent != "echo":
            raise LookupError(f"no agent named {agent!r}")
        return "agent_echo_id"

    agents = AgentDirectory(resolve=validate, names=ANY_AGENT.names)
    res = CliRunner().invoke(
        cron_group, ["add", "--name", "a", "--agent", "nope", "--every", "1h", "--prompt", "x"], obj=agents
    )
    assert res.exit_code == 2 and "no agent named 'nope'" in res.stderr  # as `agents show` exits
    res = CliRunner().invoke(
        cron_group, ["add", "--name", "a", "--agent", "echo", "--every", "1h", "--prompt", "x"], obj=agents
    )
    assert res.exit_code == 0
    assert CronStore(home).read().tasks[0].agent == "agent_echo_id"


# ------------------------------------------------------------------ the other commands


def test_list_show_enable_disable_remove_preview_logs(home: Path) -> None:
    code, out, _ = cli(
        "add", "--name", "brief", "--agent", "echo", "--cron", "0 8 * * *", "--tz", "Europe/Paris",
        "--prompt", "morning", "--json",
    )  # fmt: skip
    assert code == 0
    added = json.loads(out)
    assert added["schedule"] == {"kind": "cron", "expr": "0 8 * * *", "tz": "Europe/Paris"}
    assert added["next_fire_at"] and added["state"] == "scheduled"

    code, out, _ = cli("list", "--json")
    assert [t["name"] for t in json.loads(out)] == ["brief"]
    code, out, _ = cli("list")
    assert "brief" in out and "cron 0 8 * * * [Europe/Paris]" in out

    code, out, _ = cli("show", "brief")
    assert code == 0 and "morning" in out and added["id"] in out
    assert json.loads(cli("show", added["id"], "--json")[1])["name"] == "brief"

    code, out, _ = cli("preview", "brief", "--count", "3", "--json")
    times = [datetime.fromisoformat(p["scheduled_for"]) for p in json.loads(out)]
    assert len(times) == 3
    assert all(t.astimezone(__import__("zoneinfo").ZoneInfo("Europe/Paris")).hour == 8 for t in times)
    assert times[1] - times[0] == timedelta(days=1)
    code, out, _ = cli("preview", "brief", "--count", "2")
    lines = out.strip().splitlines()  # a line names the scheduled time too when the task has jitter
    assert code == 0 and len(lines) == 2 and all("08:00:00" in line for line in lines)

    assert cli("disable", "brief")[0] == 0
    assert json.loads(cli("show", "brief", "--json")[1])["state"] == "disabled"
    assert cli("enable", "brief")[0] == 0
    assert json.loads(cli("show", "brief", "--json")[1])["enabled"] is True

    store = CronStore(home)
    append_run(
        store.runs_dir,
        added["id"],
        "missed",
        scheduled_for="2026-01-01T07:00:00+00:00",
        reason="down",
    )
    code, out, _ = cli("logs", "brief")
    assert code == 0 and "missed" in out and "down" in out
    assert json.loads(cli("logs", "brief", "--json")[1])[0]["event"] == "missed"

    assert cli("remove", "brief")[0] == 0
    code, _, err = cli("show", "brief")
    assert code == 2 and "no cron task 'brief'" in err
    assert cli("list")[1].strip() == "no cron tasks"


def test_run_log_reader_skips_torn_lines_and_marks_lost(tmp_path: Path) -> None:
    runs = tmp_path / "cron-runs"
    append_run(runs, "cron_x", "fired", occurrence=1)
    append_run(runs, "cron_x", "fired", occurrence=2)
    append_run(runs, "cron_x", "submitted", occurrence=2, turn_id="turn_2")
    append_run(runs, "cron_x", "fired", occurrence=3)
    with open(runs / "cron_x.jsonl", "ab") as f:
        f.write(b'{"event": "subm')  # a write cut short by a crash
    recs = read_runs(runs, "cron_x")
    assert [r["event"] for r in recs] == ["fired", "fired", "submitted", "fired"]
    assert recs[0].get("lost") is True  # claimed, never submitted
    assert "lost" not in recs[1] and "lost" not in recs[3]  # the newest may still be in flight
    assert len(read_runs(runs, "cron_x", limit=2)) == 2


# ------------------------------------------------------------------ issue 14.16: a corrupt crons.json


@pytest.mark.parametrize("args", [["list"], ["list", "--json"], ["show", "t"], ["logs", "t"], ["preview", "t"]])
def test_readers_report_a_corrupt_file_and_move_nothing(home: Path, args: list[str]) -> None:
    home.mkdir(parents=True)
    garbage = b'{"version": 1, "tasks": [ {"name": "precious"'
    (home / "crons.json").write_bytes(garbage)
    code, out, err = cli(*args)
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "cannot be read" in err and "left in place" in err
    assert len(err.strip().splitlines()) == 1
    assert (home / "crons.json").read_bytes() == garbage  # not moved, not rewritten
    assert CronStore(home).corrupt_files() == []


async def test_a_running_scheduler_keeps_reporting_a_corrupt_file(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler (a writer) sets the file aside, then says so at every tick, rate-limited, and
    `CronService.problem()` (for /readyz) tells until the user deals with the set-aside file."""
    import asyncio
    import logging

    from appserver.config import load_config
    from appserver.server import Server
    from cron.scheduler import Scheduler
    from cron.service import CronService

    async def fire(task: object, occ: object) -> str:
        return "turn"

    store = CronStore(home)
    store.add(task("precious"))
    s = Scheduler(store, fire=fire, tick_s=0.1, problem_log_every_s=0.3)
    stop = asyncio.Event()
    caplog.set_level(logging.ERROR, logger="appserver.cron")
    loop = asyncio.create_task(s.run(stop))

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]

    try:
        await asyncio.sleep(0.3)
        assert s.problem() is None
        corrupted_at = time.monotonic()
        (home / "crons.json").write_text("{ not json")  # corrupted under the running server
        # Waited for, not slept on: a loaded machine may tick late, never early.
        problem = await wait_until(s.problem, 10, "the scheduler to report the corrupt file")
        assert "set aside" in problem and "not scheduled" in problem
        await wait_until(lambda: len(said()) >= 3, 10, "the problem logged at later ticks too")
        # every tick, at most once per 0.3 s (plus once at once when the text changes): not just once
        assert len(said()) <= (time.monotonic() - corrupted_at) / 0.3 + 2, said()
        for aside in store.corrupt_files():
            aside.unlink()  # the user dealt with it
        await wait_until(lambda: s.problem() is None, 10, "the problem to clear")
    finally:
        stop.set()
        await asyncio.wait_for(loop, 5)

    service = CronService(Server(load_config(home)))
    assert service.problem() is None
    (home / "crons.json").write_text("[]")
    with pytest.raises(CorruptStateFile), service.scheduler.store.transaction():
        pass
    assert "set aside" in (service.problem() or "")


def test_unrecorded_turns_are_submitted_before_the_cutoff_without_an_outcome(tmp_path: Path) -> None:
    """What a new server recovers (issue 14.4): turns an earlier process submitted and never saw
    end; never those this process submitted itself (after its start) and watches already."""
    from cron.runlog import unrecorded_turns

    runs = tmp_path / "cron-runs"
    append_run(runs, "cron_a", "submitted", occurrence=1, turn_id="t1")
    append_run(runs, "cron_a", "outcome", occurrence=1, turn_id="t1", status="completed")
    append_run(runs, "cron_a", "submitted", occurrence=2, turn_id="t2")
    append_run(runs, "cron_c", "fired", occurrence=1)  # claimed, never submitted: nothing to wait for
    cutoff = datetime.now(UTC)
    append_run(runs, "cron_b", "submitted", occurrence=1, turn_id="t3")
    assert unrecorded_turns(runs, cutoff) == [("cron_a", 2, "t2")]
    assert unrecorded_turns(tmp_path / "nowhere", cutoff) == []
