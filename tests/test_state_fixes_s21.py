"""State-file fixes (session 21): concurrent edits of config.toml take turns under `config.toml.lock`
(none is lost while its command says it was saved); a run-log record with a run number above 2**53
never makes `cron run` write a task crons.json cannot load back; temporaries left by atomic writes
killed mid-way are removed by a later write (or start) once their writer is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from appserver.cli import channels as channels_cli
from appserver.fsutil import STALE_TEMP_S, atomic_write_text, remove_stale_temporaries
from appserver.procid import process_start_ticks
from cron.runlog import MAX_RUN_NUMBER, used_runs
from cron.store import MAX_OCCURRENCE, CronStore, CronStoreError
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.zygote_client import appserver_popen

BASE = """\
# my appserver config
[server]
listen = "127.0.0.1:8770"   # keep this port
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir(mode=0o700)
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    monkeypatch.delenv("APPSERVER_CHANNELS__ENABLED", raising=False)
    (h / "config.toml").write_text(BASE)
    return h


def _run_all(home: Path, commands: list[list[str]]) -> list[CLIResult]:
    """Start every command at once (real processes on one home), then wait for them all."""
    env = cli_env(home, WHS="s3cret")
    procs = [
        appserver_popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in commands
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(CLIResult(proc.returncode, out, err))
    return results


def _add(name: str, port: int) -> list[str]:
    return [
        "channels",
        "add",
        "webhook",
        name,
        "--set",
        f"listen=127.0.0.1:{port}",
        "--set",
        "default_agent=assistant",
        "--secret",
        "secret=env:WHS",
    ]


def _accounts(home: Path) -> set[str]:
    data = tomllib.loads((home / "config.toml").read_text())
    return set(data.get("channels", {}).get("webhook", {}).get("accounts", {}))


# ── Bug 1: concurrent edits of config.toml ─────────────────────────────────────────────────────────


def test_concurrent_channel_edits_all_land(home: Path) -> None:
    """8 `channels add` and 2 `channels remove` at once, three rounds: each one says it saved its
    change, and each change is in the file (before the fix, one in 8 was lost while saying "Added")."""
    for rnd in range(3):
        kept = {f"k{rnd}a", f"k{rnd}b"}
        gone = {f"g{rnd}a", f"g{rnd}b"}
        for i, name in enumerate(sorted(kept | gone)):
            r = run_cli(home, *_add(name, 35000 + rnd * 100 + i), env=cli_env(home, WHS="s3cret"))
            assert r.code == 0, r.err
        before = _accounts(home)
        added = {f"r{rnd}n{i}" for i in range(8)}
        commands = [_add(f"r{rnd}n{i}", 35010 + rnd * 100 + i) for i in range(8)]
        commands += [["channels", "remove", "webhook", name] for name in sorted(gone)]
        results = _run_all(home, commands)
        now = _accounts(home)
        said_added = {args[3] for args, r in zip(commands, results, strict=True) if r.code == 0 and args[1] == "add"}
        said_removed = {
            args[3] for args, r in zip(commands, results, strict=True) if r.code == 0 and args[1] == "remove"
        }
        assert said_added <= now and not (said_removed & now), ("a change said saved is lost", now)
        for args, r in zip(commands, results, strict=True):
            assert r.code == 0, (args, r.out, r.err)  # concurrent edits take turns: none is refused
        assert now == (before | added) - gone, (home / "config.toml").read_text()
    text = (home / "config.toml").read_text()
    assert text.startswith(BASE)  # the owner's comments and layout stay


def test_concurrent_first_edits_of_a_new_home_all_land(tmp_path: Path) -> None:
    """On a home with no config.toml yet, a command that found none wrote the default over a
    `channels add` that had just saved (the default is now created only where there is none)."""
    for rnd in range(8):
        home = tmp_path / f"new{rnd}"
        home.mkdir(mode=0o700)
        commands = [_add(f"n{i}", 36000 + rnd * 100 + i) for i in range(6)] + [["agents", "list"]] * 2
        results = _run_all(home, commands)
        for args, r in zip(commands, results, strict=True):
            assert r.code == 0, (args, r.out, r.err)
        assert _accounts(home) == {f"n{i}" for i in range(6)}, (home / "config.toml").read_text()


def test_an_exclusive_write_never_replaces_a_file(tmp_path: Path) -> None:
    target = tmp_path / "config.toml"
    assert atomic_write_text(target, "first", exclusive=True)
    assert not atomic_write_text(target, "second", exclusive=True)
    assert target.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no temporary left behind


def test_config_lock_waits_times_out_and_a_dead_holder_never_blocks(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live holder of config.toml.lock: the edit is refused after the timeout (exit 1, one line,
    nothing written). Killed (-9), it blocks nothing: the next command saves its change."""
    lock = home / "config.toml.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import filelock, sys, time\n"
            f"held = filelock.FileLock({str(lock)!r})\n"
            "held.acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(channels_cli, "CONFIG_LOCK_TIMEOUT_S", 0.2)
        monkeypatch.setenv("WHS", "s3cret")
        res = CliRunner().invoke(channels_cli.channels_group, _add("waits", 35200)[1:], catch_exceptions=False)
        assert res.exit_code == 1, res.output
        assert "timed out" in res.stderr and "config.toml.lock" in res.stderr and "nothing written" in res.stderr
        assert (home / "config.toml").read_text() == BASE
        for args in (["enable", "webhook"], ["remove", "webhook", "waits"]):
            res = CliRunner().invoke(channels_cli.channels_group, args, catch_exceptions=False)
            assert res.exit_code == 1 and "timed out" in res.stderr, (args, res.output)
        assert (home / "config.toml").read_text() == BASE
    finally:
        holder.kill()
        holder.wait()
    r = run_cli(home, *_add("after", 35201), env=cli_env(home, WHS="s3cret"))
    assert r.code == 0, r.err
    r = run_cli(home, "channels", "enable", "webhook")
    assert r.code == 0, r.err
    assert _accounts(home) == {"after"}
    assert "webhook" in tomllib.loads((home / "config.toml").read_text())["channels"]["enabled"]


# ── Bug 2: a run number above 2**53 in the run log ─────────────────────────────────────────────────


def _task_id(home: Path, name: str) -> str:
    data = json.loads((home / "crons.json").read_text())
    return next(t["id"] for t in data["tasks"] if t["name"] == name)


def _append(home: Path, task_id: str, occurrence: str) -> None:
    log = home / "cron-runs" / f"{task_id}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(
            f'{{"event": "fired", "at": "2026-01-01T00:00:00+00:00", "task_id": "{task_id}", '
            f'"occurrence": {occurrence}, "manual": true}}\n'
        )


def test_run_number_above_2_53_in_the_run_log_is_skipped(home: Path) -> None:
    r = run_cli(home, "cron", "add", "--name", "t1", "--agent", "assistant", "--every", "1h", "--prompt", "hi")
    assert r.code == 0, r.err
    tid = _task_id(home, "t1")
    _append(home, tid, str(2**53 + 1))
    _append(home, tid, str(2**64))
    r = run_cli(home, "cron", "run", "t1")
    assert r.code == 0, (r.out, r.err)
    assert "skipped 2 record(s)" in r.err and str(2**53 + 1) in r.err, r.err
    task = next(t for t in json.loads((home / "crons.json").read_text())["tasks"] if t["id"] == tid)
    assert task["occurrence"] == 1
    r = run_cli(home, "cron", "list")
    assert r.code == 0 and "t1" in r.out and "invalid" not in r.err, (r.out, r.err)
    for args in (("cron", "show", "t1"), ("cron", "logs", "t1"), ("cron", "run", "t1")):
        r = run_cli(home, *args)
        assert r.code == 0, (args, r.out, r.err)
    task = next(t for t in json.loads((home / "crons.json").read_text())["tasks"] if t["id"] == tid)
    assert task["occurrence"] == 2
    assert used_runs(home / "cron-runs", tid)[0] == 2


def test_run_number_at_the_limit_refuses_the_run_and_keeps_the_task_loadable(home: Path) -> None:
    """2**53 itself is a run number a task may have; the next one is not: the run is refused with
    one line, and crons.json is not written with a counter its loader rejects."""
    r = run_cli(home, "cron", "add", "--name", "t1", "--agent", "assistant", "--every", "1h", "--prompt", "hi")
    assert r.code == 0, r.err
    tid = _task_id(home, "t1")
    _append(home, tid, str(MAX_RUN_NUMBER))
    before = (home / "crons.json").read_bytes()
    r = run_cli(home, "cron", "run", "t1")
    assert r.code == 1, (r.out, r.err)
    assert "highest run number" in r.err and "nothing was run" in r.err, r.err
    assert (home / "crons.json").read_bytes() == before
    r = run_cli(home, "cron", "list")
    assert r.code == 0 and "t1" in r.out, (r.out, r.err)
    assert run_cli(home, "cron", "show", "t1").code == 0


def test_a_task_its_loader_would_reject_is_never_written(tmp_path: Path) -> None:
    store = CronStore(tmp_path)
    r = run_cli(tmp_path, "cron", "add", "--name", "t1", "--agent", "assistant", "--every", "1h", "--prompt", "hi")
    assert r.code == 0, r.err
    before = (tmp_path / "crons.json").read_bytes()
    with store.lock():
        state = store.load()
        state.tasks[0].occurrence = MAX_OCCURRENCE + 1
        with pytest.raises(CronStoreError, match="cannot load back"):
            store.save(state)
    assert (tmp_path / "crons.json").read_bytes() == before
    with store.lock():
        state = store.load()
        task = state.tasks[0]
        task.occurrence = 5
        with pytest.raises(CronStoreError, match="highest run number"):
            task.claim(task.created_at, task.created_at, task.created_at, floor=MAX_OCCURRENCE)
        assert task.occurrence == 5 and task.last_claimed is None


# ── Bug 3: temporaries of writes killed mid-way ────────────────────────────────────────────────────

_KILLED_WRITE = textwrap.dedent(
    """\
    import os, signal, sys
    from pathlib import Path
    from appserver import fsutil
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed between write and rename
    fsutil.atomic_write_text(Path(sys.argv[1]), "half written\\n")
    """
)


def _killed_write(target: Path) -> Path:
    """A real atomic write of `target` killed (-9) before its rename; returns the temporary it left."""
    before = set(target.parent.iterdir())
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(target)], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p for p in set(target.parent.iterdir()) - before if p.name.endswith(".tmp")]
    assert len(left) == 1, left
    return left[0]


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_write_killed_mid_way_leaves_no_temporary_for_good(home: Path) -> None:
    stale = _killed_write(home / "config.toml")
    assert stale.name.startswith(".config.toml.")
    fresh = _killed_write(home / "config.toml")  # just killed: left until it is old enough
    old_format = home / ".config.toml.ab12cd_9.tmp"  # an older version's name (no writer named)
    old_format.write_text("x")
    mine = home / f".config.toml.{os.getpid()}-{process_start_ticks(os.getpid()) or 0}.zz99yy88.tmp"
    mine.write_text("being written by a live process")
    not_ours = home / ".config.toml.notours.tmp"
    not_ours.write_text("x")
    other_target = home / ".config.toml.lock.ab12cd_9.tmp"
    other_target.write_text("x")
    for p in (stale, old_format, mine, not_ours, other_target):
        _age(p, STALE_TEMP_S * 10)
    assert (home / "config.toml").read_text() == BASE  # the killed writes changed nothing
    r = run_cli(home, *_add("w1", 35300), env=cli_env(home, WHS="s3cret"))
    assert r.code == 0, r.err
    assert not stale.exists() and not old_format.exists()
    assert fresh.exists() and mine.exists() and not_ours.exists() and other_target.exists()
    assert _accounts(home) == {"w1"}
    _age(fresh, STALE_TEMP_S * 10)
    assert remove_stale_temporaries(home / "config.toml") == [fresh]


def test_a_start_removes_temporaries_of_the_home_state_files(home: Path) -> None:
    assert run_cli(home, "agents", "list").code == 0
    left = [_killed_write(home / name) for name in ("appserver.db.position", "crons.json", "server.json")]
    (home / "auth").mkdir(mode=0o700, exist_ok=True)
    left.append(_killed_write(home / "auth" / "tokens.json"))
    for p in left:
        _age(p, STALE_TEMP_S * 10)
    r = run_cli(home, "agents", "list")  # opens the home as a server start does
    assert r.code == 0, r.err
    assert [p for p in left if p.exists()] == []


def test_commands_opening_a_new_store_at_once_all_open_it(tmp_path: Path) -> None:
    """Two commands on a new home: one read the other's fresh write-ahead log, half way through
    being made, as a lost one, and refused the store ("the write-ahead log … is shorter than it
    was"). Opening and closing the store now take turns (`appserver.db.open-lock`)."""
    for rnd in range(12):
        home = tmp_path / f"fresh{rnd}"
        home.mkdir(mode=0o700)
        (home / "config.toml").write_text(BASE)
        commands = [["agents", "list"], ["conversations", "list", "--agent", "assistant"]] * 4
        for args, r in zip(commands, _run_all(home, commands), strict=True):
            assert r.code == 0, (args, r.out, r.err)
