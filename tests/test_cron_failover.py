"""Issue 6 check 3 end to end: two `serve` processes on one home (the second `--standby`); exactly one
holds the home and the cron lease; `kill -9` of the holder → the standby takes over and fires the
next due task within two ticks, exactly once. Plus the identity rules the standby relies on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from appserver.procid import identity, process_start_ticks
from appserver.serverinfo import HomeLock, claim_home, read_live_server, write_server_json
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.net import free_port, listening
from tests.support.wait import wait_for
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

TICK_S = 1.0


class Serve:
    """`appserver serve` as a subprocess whose stdout lines are collected by a reader thread."""

    def __init__(self, home: Path, port: int, *extra: str, env: dict[str, str]) -> None:
        self.proc = appserver_popen(
            ["serve", "--listen", f"127.0.0.1:{port}", *extra],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, needle: str) -> bool:
        return any(needle in line for line in self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def crons(home: Path) -> dict[str, Any]:
    return json.loads((home / "crons.json").read_text())


def owner_pid(home: Path) -> int | None:
    try:
        owner = crons(home).get("scheduler_owner")
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return None if owner is None else int(owner["pid"])


def live_server_of(home: Path, pid: int) -> dict[str, Any] | None:
    info = read_live_server(home / "server.json")
    return info if info is not None and info["pid"] == pid else None


def run_log(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_standby_takes_over_after_kill9_and_fires_within_two_ticks(home: Path) -> None:
    env = cli_env(home, APPSERVER_CRON_TICK_S=str(TICK_S))
    home.mkdir(parents=True)
    p1, p2 = free_port(), free_port()
    holder = Serve(home, p1, env=env)
    standby: Serve | None = None
    try:
        wait_for(lambda: holder.said("listening on"), 20, "the holder to listen")
        wait_for(lambda: owner_pid(home) == holder.proc.pid, 10, "the holder to take the cron lease")

        # a plain second `serve` is refused and points at --standby
        r = run_cli(home, "serve", "--listen", f"127.0.0.1:{free_port()}", env=env)
        assert r.code == 3 and "--standby" in r.err, (r.code, r.err)

        standby = Serve(home, p2, "--standby", env=env)
        wait_for(lambda: standby.said("appserver standby:"), 20, "the standby to start waiting")  # type: ignore[union-attr]
        add = run_cli(home, "cron", "add", "--name", "soon", "--agent", "assistant",
                      "--in", "3s", "--exact", "--prompt", "wake up", "--json", env=env)  # fmt: skip
        assert add.code == 0, add.err
        task = json.loads(add.out)
        due = datetime.fromisoformat(task["next_due_at"]).timestamp()

        # while the holder lives the standby waits: no socket, no lease, no server.json of its own
        while time.time() < due - 0.3:
            assert owner_pid(home) == holder.proc.pid
            assert json.loads((home / "server.json").read_text())["pid"] == holder.proc.pid
            assert standby.proc.poll() is None and not listening(p2)
            time.sleep(0.1)
        assert run_log(home, task["id"]) == []  # not due yet: nobody fired it

        holder.proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        holder.proc.wait(10)

        fired = wait_for(
            lambda: [x for x in run_log(home, task["id"]) if x["event"] == "fired"],
            15,
            "the standby to fire the task",
        )
        fired_at = datetime.fromisoformat(fired[0]["fired_at"]).timestamp()
        assert fired_at - max(due, killed_at) <= 2 * TICK_S, (fired_at, due, killed_at)
        assert owner_pid(home) == standby.proc.pid
        # server.json follows once the socket is bound (the lifespan, and so the first tick, runs first)
        info = wait_for(lambda: live_server_of(home, standby.proc.pid), 10, "the standby's server.json")  # type: ignore[union-attr]
        assert info["url"] == f"http://127.0.0.1:{p2}" and listening(p2)

        # exactly once: one fire, one turn, one cron_prompt message, and nothing more a tick later
        wait_for(lambda: any(x["event"] == "outcome" for x in run_log(home, task["id"])), 10, "the outcome")
        time.sleep(TICK_S + 0.2)
        events = [x["event"] for x in run_log(home, task["id"])]
        assert events == ["fired", "submitted", "outcome"], events
        outcome = run_log(home, task["id"])[-1]
        assert outcome["status"] == "completed", outcome

        async def history() -> list[dict[str, Any]]:
            ws = await WS.open(info["url"])
            try:
                conv = outcome["detail"]["conversation_id"]
                return (await ws.request({"type": "get_history", "conversation": conv}))["messages"]
            finally:
                await ws.close()

        user = [m for m in asyncio.run(history()) if m["role"] == "user"]
        assert len(user) == 1 and user[0]["source"]["kind"] == "cron_prompt"
        assert user[0]["turn_id"] == outcome["turn_id"]

        standby.proc.send_signal(signal.SIGTERM)
        assert standby.proc.wait(15) == 0
        assert crons(home)["scheduler_owner"] is None  # released on a clean stop
        assert not (home / "server.json").exists()
    finally:
        holder.kill()
        if standby is not None:
            standby.kill()


def test_server_json_of_a_reused_pid_is_dead_and_the_home_lock_is_exclusive(tmp_path: Path) -> None:
    """A live pid whose start time differs (the pid was reused) does not hold the home; serve.lock
    admits one holder at a time."""
    server_json = tmp_path / "server.json"
    with socket.create_server(("127.0.0.1", 0)) as answering:  # a server that predates serve.lock answers
        write_server_json(server_json, f"http://127.0.0.1:{answering.getsockname()[1]}", "none")
        me = read_live_server(server_json)
        assert me is not None and me["identity"] == identity()
        lock, live = claim_home(server_json)  # lock free, but a live server.json still owns the home
        assert lock is None and live is not None and live["pid"] == os.getpid()

    start = process_start_ticks(os.getpid())
    assert start is not None
    server_json.write_text(json.dumps({**me, "identity": f"{os.getpid()}:{start + 1}"}))
    assert read_live_server(server_json) is None  # pid alive, start time differs → dead
    lock, live = claim_home(server_json)
    assert lock is not None and live is None
    try:
        other = HomeLock(lock.path)
        assert not other.try_acquire()  # a second open file description is refused
        lock.release()
        assert other.try_acquire()
        other.release()
    finally:
        lock.release()


def test_cli_waits_for_a_server_that_is_still_starting(home: Path, tmp_path: Path) -> None:
    """`serve.lock` held but no server.json yet: a CLI command waits instead of running beside it."""
    from appserver.serverinfo import HomeStarting, find_live_server, home_lock_path

    home.mkdir(parents=True, exist_ok=True)
    server_json = home / "server.json"
    lock = HomeLock(home_lock_path(server_json))
    assert lock.try_acquire()
    try:
        started = time.monotonic()
        try:
            find_live_server(server_json, wait_s=0.3)
            raise AssertionError("a held lock without server.json must not read as 'no server'")
        except HomeStarting:
            assert time.monotonic() - started >= 0.3
        proc = appserver_popen(
            ["run", "--agent", "assistant", "--json", "hello"],
            env=cli_env(home),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.5)
        assert proc.poll() is None, "the CLI ran while a server was starting on its home"
    finally:
        lock.release()  # the starting server went away: the CLI may now run in-process
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out)["text"] == "echo: hello"
    assert find_live_server(server_json, wait_s=0.1) is None


def test_a_momentary_probe_never_turns_a_server_away(tmp_path: Path) -> None:
    path = tmp_path / "serve.lock"
    path.touch()
    probe = os.open(path, os.O_RDONLY)
    import fcntl

    fcntl.flock(probe, fcntl.LOCK_SH)  # a CLI's probe, released 0.1 s later
    threading.Timer(0.1, lambda: os.close(probe)).start()
    lock = HomeLock(path)
    assert lock.try_acquire()  # waits out the probe instead of refusing
    assert HomeLock(path).held_elsewhere()
    lock.release()
    assert not HomeLock(path).held_elsewhere()


def test_outcome_of_a_cron_turn_queued_at_kill9_is_recorded_by_the_next_server(home: Path) -> None:
    """Issue 14.4: the primary fires a cron turn that queues behind a long turn, then dies by
    kill -9; the next server runs the queued turn, and the run log gets its outcome."""
    from tests.support.serve import start_serve

    env = cli_env(home)
    first = start_serve(home, env=env)
    second = None
    try:

        async def block() -> None:
            ws = await WS.open(first.url)
            try:
                ack = await ws.request(
                    {"type": "submit_input", "agent": "assistant", "conversation": "default", "input": "/slow 600"}
                )
                assert ack["type"] == "ack", ack
            finally:
                await ws.close()  # a disconnect never cancels a turn

        asyncio.run(block())
        add = run_cli(home, "cron", "add", "--name", "q", "--agent", "assistant", "--in", "1s", "--exact",
                      "--conversation", "default", "--prompt", "after the long one", "--json", env=env)  # fmt: skip
        assert add.code == 0, add.err
        task_id = json.loads(add.out)["id"]
        submitted = wait_for(
            lambda: [x for x in run_log(home, task_id) if x["event"] == "submitted"],
            15,
            "the cron turn to be submitted",
        )[0]
        with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as db:
            (status,) = db.execute("SELECT status FROM turns WHERE id=?", (submitted["turn_id"],)).fetchone()
        assert status == "queued"
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        assert [x["event"] for x in run_log(home, task_id)] == ["fired", "submitted"]

        second = start_serve(home, env=env)
        outcome = wait_for(
            lambda: [x for x in run_log(home, task_id) if x["event"] == "outcome"],
            15,
            "the next server to record the outcome",
        )
        assert len(outcome) == 1 and outcome[0]["turn_id"] == submitted["turn_id"]
        assert outcome[0]["occurrence"] == 1 and outcome[0]["status"] == "completed", outcome
        logs = run_cli(home, "cron", "logs", "q", env=env)
        assert logs.code == 0 and f"turn {submitted['turn_id']} completed" in logs.out, logs.out
        assert [x["event"] for x in run_log(home, task_id)] == ["fired", "submitted", "outcome"]
    finally:
        for sp in (first, second):
            if sp is not None and sp.proc.poll() is None:
                sp.proc.kill()
                sp.proc.wait(10)


def test_an_occurrence_claimed_by_a_scheduler_that_died_before_submitting_it_still_runs_once(home: Path) -> None:
    """The window the claim-before-fire rule leaves: a scheduler committed the claim of an
    occurrence and was killed before submitting its turn. The scheduler that takes the lease over
    from it submits that occurrence (the kernel's idempotency key keeps it to one turn) and logs it
    as recovered, instead of the occurrence being silently lost; a later takeover does not repeat it."""
    import socket

    from cron.store import CronStore, OwnerRecord, utcnow

    env = cli_env(home, APPSERVER_CRON_TICK_S="0.3")
    add = run_cli(home, "cron", "add", "--name", "once", "--agent", "assistant",
                  "--in", "1h", "--exact", "--prompt", "wake up", "--json", env=env)  # fmt: skip
    assert add.code == 0, add.err
    task_id = json.loads(add.out)["id"]
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the dead scheduler
    store = CronStore(home)
    now = utcnow()
    with store.transaction() as state:  # what the killed scheduler committed: the claim, nothing more
        state.scheduler_owner = OwnerRecord(gone.pid, "deadbeef", now, None, socket.gethostname())
        task = state.find("once")
        task.claim(now, now, now, by="deadbeef")
        task.next_fire_at = task.next_due_at = None

    def cron_turns() -> list[str]:
        db = home / "appserver.db"
        if not db.exists():
            return []
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT id, idempotency_key FROM turns").fetchall()
        finally:
            conn.close()
        return [key for _, key in rows if (key or "").split("@")[0] == f"cron\x1f{task_id}:1"]

    port = free_port()
    srv = Serve(home, port, env=env)
    try:
        wait_for(lambda: cron_turns() or None, 20, "the recovered occurrence's turn")
        wait_for(lambda: any(x["event"] == "outcome" for x in run_log(home, task_id)), 10, "its outcome")
        events = [(x["event"], x.get("recovered")) for x in run_log(home, task_id)]
        assert events[:2] == [("fired", True), ("submitted", True)], events
        srv.kill()  # killed again after submitting: the next takeover finds the turn, runs nothing more
        srv = Serve(home, port, env=env)
        wait_for(lambda: srv.said("listening on"), 20, "the second server to listen")
        wait_for(lambda: owner_pid(home) == srv.proc.pid, 10, "the second server to take the lease")
        time.sleep(1.0)
        assert len(cron_turns()) == 1
    finally:
        srv.kill()
