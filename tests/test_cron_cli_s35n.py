"""Attacker d's cron CLI findings (session 35, helper n), through the real CLI and a real `serve`.

1. `cron run` through a server that gave no outcome (its --timeout passed, or the server was killed
   after it acked the run) printed only `error: the turn did not settle …` / `the server closed the
   connection`, stdout empty even with --json, never saying that run #N (turn …) had started; now it
   is reported as in-process (`unknown`, with the run and its turn), and a lost server is waited for
   as `appserver run` waits (the client's reconnect), so a server started again gives the outcome.
2. A POSIX `TZ` (`CET-1CEST,M3.5.0,M10.5.0/3`) made `cron add` use /etc/localtime's zone without a
   word; now it refuses, asking for --tz, and writes nothing.
3. `cron add` under a held crons.json.lock waited for it twice (20 s) while saying "timed out after
   10 s"; now once.
4. `cron logs` printed `turn None` for queued runs `cron disable` cancelled with no server running.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

SLOW = '<channel-message a="1">/slow 200</channel-message>'  # the echo model: 200 words, 10 s


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def add_task(home: Path, *args: str) -> str:
    """`cron add` (agent `assistant`); the new task's id."""
    made = run_cli(home, "cron", "add", "--agent", "assistant", "--json", *args)
    assert made.code == 0, made.err
    return str(json.loads(made.out)["id"])


@pytest.fixture
def slow_task(home: Path) -> str:
    return add_task(home, "--name", "s", "--every", "1h", "--prompt", SLOW)


def test_cron_run_through_a_server_without_an_outcome_says_the_run_and_its_turn(home: Path, slow_task: str) -> None:
    with serving(home, graceful=False):
        as_json = run_cli(home, "cron", "run", "s", "--timeout", "1", "--json")
        plain = run_cli(home, "cron", "run", "s", "--timeout", "1")
    assert as_json.code == 1, (as_json.code, as_json.out, as_json.err)
    assert as_json.out.strip(), f"--json printed nothing (stderr: {as_json.err!r})"
    out = as_json.json()
    submitted = {r["occurrence"]: r["turn_id"] for r in run_log(home, slow_task) if r["event"] == "submitted"}
    assert out["outcome"] == "unknown" and out["occurrence"]["occurrence"] == 1, out
    assert out["turn_id"] == submitted[1], (out["turn_id"], submitted)
    assert out["error"].startswith("no outcome within 1 s"), out["error"]
    assert plain.code == 1, (plain.code, plain.out, plain.err)
    assert plain.out.startswith("run #2 of s: unknown: no outcome within 1 s"), (plain.out, plain.err)
    assert f"(turn {submitted[2]})" in plain.out, plain.out
    assert "did not settle" not in plain.err + as_json.err


def conversation_of(home: Path, turn_id: str) -> str:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        return str(c.execute("SELECT conversation_id FROM turns WHERE id=?", (turn_id,)).fetchone()[0])


def wait_streaming(sp: ServeProcess, conversation: str, turn_id: str) -> None:
    """Until the turn has streamed a few words: the `cron run` client had its ack well before."""

    def has_words(frame: dict[str, Any]) -> bool:
        snap = frame.get("snapshot") or frame.get("active_turn") or {}
        text = "".join(b.get("text") or "" for b in snap.get("blocks") or [] if b.get("type") == "text")
        return snap.get("turn_id") == turn_id and "w3" in text

    async def go() -> None:
        ws = await WS.open(sp.url)
        try:
            state = await ws.request({"type": "subscribe", "conversation": conversation})
            if not has_words(state):
                await ws.expect(has_words, timeout=20)
        finally:
            await ws.close()

    asyncio.run(go())


def submitted_turn(home: Path, task_id: str, run: subprocess.Popen[str]) -> str:
    """The turn of run #1 once the server submitted it (a `cron run` that ended first is the failure)."""

    def submitted() -> list[dict[str, Any]] | None:
        if run.poll() is not None:
            out, err = run.communicate()
            raise AssertionError(f"cron run ended ({run.returncode}) before its run was submitted: {out!r} {err!r}")
        return [r for r in run_log(home, task_id) if r["event"] == "submitted"]

    return str(wait_for(submitted, 20, "run #1 submitted")[0]["turn_id"])


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_cron_run_rides_out_a_killed_server_as_appserver_run_does(
    home: Path, slow_task: str, spawned: list[subprocess.Popen[str]]
) -> None:
    """kill -9 of the server after its ack: `cron run` reconnects to the server started again on the
    home (found through server.json) and reports that server's outcome of run #1, by its turn."""
    first = start_serve(home)
    second: ServeProcess | None = None
    try:
        run = appserver_popen(["cron", "run", "s", "--timeout", "60", "--json"], env=cli_env(home), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        spawned.append(run)
        turn_id = submitted_turn(home, slow_task, run)
        wait_streaming(first, conversation_of(home, turn_id), turn_id)
        first.proc.kill()
        first.proc.wait(10)
        second = start_serve(home)
        out, err = run.communicate(timeout=60)
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert out.strip(), f"--json printed nothing; stderr: {err!r}"
    said = json.loads(out)
    assert said["turn_id"] == turn_id and said["occurrence"]["occurrence"] == 1, said
    assert said["outcome"] == "cancelled" and said["snapshot"]["error"]["kind"] == "interrupted", said
    assert run.returncode == 1, (run.returncode, err)
    assert "[connection lost" in err and "[reconnected to" in err, err


def test_cron_run_with_no_server_back_reports_the_run_unknown(
    home: Path, slow_task: str, spawned: list[subprocess.Popen[str]]
) -> None:
    """kill -9 and no server within --reconnect-wait: `unknown`, naming run #1 and its turn."""
    sp = start_serve(home)
    try:
        run = appserver_popen(["cron", "run", "s", "--reconnect-wait", "0.5"], env=cli_env(home), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        spawned.append(run)
        turn_id = submitted_turn(home, slow_task, run)
        wait_streaming(sp, conversation_of(home, turn_id), turn_id)
        sp.proc.kill()
        sp.proc.wait(10)
        out, err = run.communicate(timeout=30)
    finally:
        sp.kill()
    assert run.returncode == 1, (run.returncode, out, err)
    assert out.startswith("run #1 of s: unknown: lost the server"), (out, err)
    assert f"(turn {turn_id})" in out and "cron logs s" in out, out


POSIX_ZONES = ("CET-1CEST,M3.5.0,M10.5.0/3", "<+03>-3")


@pytest.mark.parametrize("tz", POSIX_ZONES)
def test_cron_add_refuses_a_posix_tz_it_cannot_name(home: Path, tz: str) -> None:
    env = cli_env(home, TZ=tz)
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "r", "--at", "2030-01-01 12:00",
                "--prompt", "hi", env=env)  # fmt: skip
    assert r.code != 0, f"TZ={tz!r} was taken as another zone: {r.out!r}"
    assert f"TZ={tz!r}" in r.err and "--tz" in r.err, r.err
    listed = run_cli(home, "cron", "list", "--json", env=env)
    assert listed.code == 0 and listed.json() == [], listed.out
    # an IANA zone given with --tz is what the task uses, whatever TZ says
    r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "r", "--at", "2030-01-01 12:00",
                "--tz", "Europe/Paris", "--prompt", "hi", "--json", env=env)  # fmt: skip
    assert r.code == 0 and r.json()["schedule"]["tz"] == "Europe/Paris", r.err


def test_cron_add_takes_a_tz_that_names_a_zone(home: Path) -> None:
    for tz, zone in ((":Asia/Tokyo", "Asia/Tokyo"), ("/usr/share/zoneinfo/America/Santiago", "America/Santiago")):
        name = zone.replace("/", "-")
        r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", name, "--every", "1h", "--prompt", "hi",
                    "--json", env=cli_env(home, TZ=tz))  # fmt: skip
        assert r.code == 0 and r.json()["schedule"]["tz"] == zone, (tz, r.err)


def test_cron_add_waits_for_a_held_lock_once(home: Path) -> None:
    add_task(home, "--name", "t0", "--every", "1h", "--prompt", "hi")
    fd = os.open(home / "crons.json.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        try:
            r = run_cli(home, "cron", "add", "--agent", "assistant", "--name", "t1", "--every", "1h",
                        "--prompt", "hi", timeout=17)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("cron add still waited after 17 s: it waits for the lock twice (10 s each)")
        took = time.monotonic() - started
    finally:
        os.close(fd)
    assert r.code == 1 and "timed out after 10 s" in r.err, (r.code, r.err)
    assert r.err.count("\n") == 1, r.err
    assert took < 15, f"cron add took {took:.1f} s for one 10 s wait"


def test_cron_logs_of_runs_cancelled_before_their_turn_say_no_turn(home: Path) -> None:
    """A `run_all` catch-up stopped by a clean stop leaves runs queued; `cron disable` with no
    server records them cancelled (no turn); `cron logs` shows them without a `turn None`."""
    prompt = '<channel-message a="1">/slow 100</channel-message>'
    task_id = add_task(home, "--name", "ra", "--every", "1s", "--exact", "--misfire", "run_all", "--prompt", prompt)
    time.sleep(2.5)  # downtime: the clock has to pass a few of its occurrences while no server runs

    def queued() -> bool:
        """A run submitted and one claimed behind it, not submitted yet."""
        records = run_log(home, task_id)
        fired = {r["occurrence"] for r in records if r["event"] == "fired"}
        submitted = {r["occurrence"] for r in records if r["event"] == "submitted"}
        return bool(submitted) and bool(fired - submitted)

    with serving(home) as sp:
        wait_for(queued, 20, "a run submitted and another queued behind it")
        assert sp.stop() == 0
    off = run_cli(home, "cron", "disable", "ra")
    assert off.code == 0, off.err
    logs = run_cli(home, "cron", "logs", "ra")
    assert logs.code == 0, logs.err
    cancelled = [line for line in logs.out.splitlines() if "cancelled: not started" in line]
    assert cancelled, logs.out
    assert "None" not in logs.out, logs.out
    for line in cancelled:
        assert " turn " not in line, line
