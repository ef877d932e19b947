"""Cron runs queued behind a held turn when their server stops, a crons.json set aside at start,
and the reason of a reply not delivered.

1. A task's runs queue in `--conversation default` behind a turn waiting for an approval: its
   scheduled run (a one-shot's, claimed under the scheduler's lease token), then runs started by
   `cron run` (run now, which a run of the task still queued does not hold back; a scheduled
   occurrence would be skipped). The server is stopped (SIGTERM, then a restart; or kill -9 with a
   `serve --standby` taking over), and the runs queued on the server that took over push the first
   ones out of the claims (more than three open at once). Before the fix two recovery paths of the
   server that took over followed the same queued turns: `CronService.recover_outcomes` (turns a
   previous server did not see end) and the scheduler's take-over of the runs the stopped scheduler
   claimed (`Scheduler._submit_orphan` / `_resume_orphan`). Their only guard, the claim's progress
   in the tasks (`CronTask.advance_claim`), answered "not followed" for a run dropped from the
   claims once done (or pushed out of them, more than three open at once), and on that answer both
   wrote the run's `outcome` and both POSTed its `--deliver` reply. Now one watcher per run and
   process (`Scheduler._watch`), a run dropped from the claims once done is known done
   (`last_claimed.followed_from`), and a run the tasks do not follow is recorded only when the run
   log lacks its record, and delivered only by the process that recorded its outcome.
2. A crons.json that cannot be parsed at start is set aside by the scheduler's first tick, which
   then held no lease and slept until the next tick boundary (here `[cron] tick_s = 3600`): a task
   added meanwhile did not fire. Now a change of crons.json wakes it (and a failed tick is retried
   soon), so the lease is taken and the task fires.
3. The server log said "reply to … not delivered: not delivered: the run cancelled".

Real `appserver serve` processes (the echo model; a call waiting for approval holds the
conversation), the real webhook channel and a loopback receiver of its replies, real crons.json
and run logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cron.runner import TurnOutcome, deliver_reply
from cron.schedule import ScheduleSpec
from cron.store import OPEN_CLAIMS_KEPT, CronStore, make_task
from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.gateway import gateway_children, start_channel_server, write_config
from tests.support.serve import start_serve
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(150)

SECRET = "s3cr3t-for-the-webhook-s22"
TARGET = "webhook:home:kitchen"
QUEUED = 4  # runs submitted behind the held turn after a restart (more than the 3 claims kept open)


def _port(*taken: int) -> int:
    """A free loopback port of the range these tests may use (22140-22199), other than `taken`
    (ports chosen for a listener not bound yet)."""
    for port in (p for p in range(22140, 22200) if p not in taken):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 22140-22199")


class Receiver:
    """The app receiving the webhook channel's replies: the body of every POST."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.posts.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", _port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        # polled every 0.05 s for the shutdown (the default 0.5 s is what each test's end would wait)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def received(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.posts)


class Procs:
    """What a test starts (servers, their gateway children, clients): all ended at its end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.gateways: list[int] = []

    def add(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        self.procs.append(proc)
        return proc

    def kill9(self, proc: subprocess.Popen[Any]) -> None:
        """SIGKILL a server and its gateway child (orphaned, it would go on sending)."""
        children = gateway_children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def end(self) -> None:
        """SIGKILL what is still running (its checks are done: a graceful stop would only cost the
        teardown its gateway's shutdown), then every gateway child seen."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                self.gateways += gateway_children(proc.pid)
                proc.kill()
                proc.wait(10)
        for pid in self.gateways:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.end()


def _ok(home: Path, env: dict[str, str], *args: str) -> CLIResult:
    r = run_cli(home, *args, env=env)
    assert r.code == 0, (args, r.out, r.err)
    return r


def _records(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_run(home: Path, task_id: str) -> dict[int, list[str]]:
    runs: dict[int, list[str]] = {}
    for r in _records(home, task_id):
        if isinstance(r.get("occurrence"), int):
            runs.setdefault(r["occurrence"], []).append(str(r["event"]))
    return runs


def _submitted(home: Path, task_id: str) -> int:
    return sum("submitted" in events for events in _by_run(home, task_id).values())


def _all_ended(home: Path, task_id: str, end: tuple[str, ...]) -> bool:
    runs = _by_run(home, task_id)
    return bool(runs) and all(any(e in events for e in end) for events in runs.values())


def _add_task(home: Path, env: dict[str, str], agent: str, *deliver: str) -> str:
    """A one-shot task due in a second: its scheduled run (claimed by the scheduler, under its lease
    token) queues behind the held conversation; its other runs are run-now's."""
    return str(
        _ok(home, env, "cron", "add", "--name", "q", "--agent", agent, "--in", "1s", "--conversation", "default",
            "--prompt", "queued", *deliver, "--json").json()["id"]
    )  # fmt: skip


def _run_now(home: Path, env: dict[str, str], procs: Procs, task_id: str, count: int) -> None:
    """`count` runs of the task submitted at once by `appserver cron run q` through the running
    server (run now is not held back by a run of the task still queued): they queue behind the
    turn that holds the default conversation. Each client waits for its turn in the background."""
    target = _submitted(home, task_id) + count
    for _ in range(count):
        procs.add(
            appserver_popen(
                ["cron", "run", "q"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )  # fmt: skip
        )
    wait_for(lambda: _submitted(home, task_id) >= target, 30, f"{count} more runs queued behind the held turn")


def _hold_for_approval(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """A turn of `careful` in the default conversation waiting for the approval of a call, which
    outlives its server: (its conversation, the call). The cron turns submitted there queue."""
    _ok(home, env, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    held = _ok(home, env, "run", "--agent", "careful", "--conversation", "default", "--json", "/call clock {}").json()
    (call,) = [c["call_id"] for c in held["pending"]]
    return str(held["conversation_id"]), str(call)


def _approve(home: Path, env: dict[str, str], held: tuple[str, str]) -> None:
    approved = run_cli(home, "run", "--agent", "careful", "--conversation", held[0], "--approve", held[1], env=env)
    assert approved.code == 0, (approved.out, approved.err)


def _serves(home: Path, pid: int) -> bool:
    """Does the server.json of the home name process `pid` (written once it serves)?"""
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((home / "server.json").read_text()).get("pid") == pid)
    return False


def _once_each(home: Path, task_id: str, event: str | tuple[str, ...]) -> None:
    events = (event,) if isinstance(event, str) else event
    runs = _by_run(home, task_id)
    twice = {n: e for n, e in runs.items() if sum(e.count(x) for x in events) != 1}
    assert not twice, f"runs whose {'/'.join(events)} is not recorded exactly once: {twice}"


def test_queued_runs_are_recorded_once_after_a_sigterm_and_restart(tmp_path: Path, procs: Procs) -> None:
    """The task's scheduled run queues behind a turn waiting for an approval; the server is
    stopped, and the restarted one follows that run by both recovery paths while the runs queued
    there push it out of the claims. Then the call is approved and they all run."""
    home = tmp_path / "home"
    env = cli_env(home)
    first = start_serve(home, env=env)
    procs.add(first.proc)
    held = _hold_for_approval(home, env)
    task_id = _add_task(home, env, "careful")
    wait_for(lambda: _submitted(home, task_id) == 1, 30, "the scheduled run queued behind the held turn")
    first.stop(signal.SIGTERM, timeout=30)
    second = start_serve(home, env=env)
    procs.add(second.proc)
    _run_now(home, env, procs, task_id, QUEUED)
    _approve(home, env, held)
    wait_for(lambda: _all_ended(home, task_id, ("outcome", "missed")), 40, "every run's outcome")
    time.sleep(2)  # a second record of the same run would come with the first
    _once_each(home, task_id, ("outcome", "missed"))
    assert _submitted(home, task_id) == 1 + QUEUED


def test_queued_runs_are_recorded_and_delivered_once_when_a_standby_takes_over_after_kill9(
    tmp_path: Path, procs: Procs
) -> None:
    """The default conversation is held by a turn waiting for an approval, which outlives its
    server: the runs queue behind it, before and after the standby takes over, and go on being
    claimed there, so the first ones are pushed out of the claims the tasks follow while both
    recovery paths of the standby wait for them. Then the call is approved and they all run."""
    receiver = Receiver()
    try:
        home = tmp_path / "home"
        webhook_port = _port()
        settings = {
            "listen": f"127.0.0.1:{webhook_port}",
            "secret_env": "WH_SECRET",
            "reply_url": receiver.url,
            "default_agent": "careful",
            "chat_rate": 50,  # the seven replies go out at once, not one a second (a second send too)
        }
        write_config(home, {"webhook": {"home": settings}}, ["webhook"])
        env = cli_env(home, WH_SECRET=SECRET)
        active = start_channel_server(home, env=env)
        procs.add(active.proc)
        # The standby starts once the active server holds the home, and comes up while the active
        # one's channels start and the runs queue; it is waiting before the active one is killed.
        standby_log = tmp_path / "standby.log"
        with open(standby_log, "wb") as out:
            standby = procs.add(
                appserver_popen(
                    ["serve", "--standby", "--listen", f"127.0.0.1:{_port(webhook_port)}"],
                    env=env,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        active.wait_channels_ready()
        held = _hold_for_approval(home, env)
        task_id = _add_task(home, env, "careful", "--deliver", TARGET)
        wait_for(lambda: _submitted(home, task_id) == 1, 30, "the scheduled run queued behind the held turn")
        _run_now(home, env, procs, task_id, 1)
        wait_for(lambda: "appserver standby:" in standby_log.read_text(errors="replace"), 20, "the standby to wait")
        procs.kill9(active.proc)
        # the standby takes over; the runs queued there push the first ones out of the claims
        wait_for(lambda: _serves(home, standby.pid), 40, "the standby to serve")
        _run_now(home, env, procs, task_id, 5)
        _approve(home, env, held)
        wait_for(
            lambda: _all_ended(home, task_id, ("delivered", "delivery_failed", "missed")),
            40,
            "every run's reply to be sent (or said not sent)",
        )
        time.sleep(2)  # a second send of the same reply would come with the first
        log = standby_log.read_text(errors="replace")
        runs = _by_run(home, task_id)
        _once_each(home, task_id, ("outcome", "missed"))
        _once_each(home, task_id, ("delivered", "delivery_failed", "missed"))
        delivered = [r for r in _records(home, task_id) if r["event"] == "delivered"]
        assert len(delivered) >= 7, (runs, log[-3000:])
        texts = Counter(str(p.get("text")) for p in receiver.received())
        assert all(n == 1 for n in texts.values()), texts  # no reply POSTed twice
        assert sum(texts.values()) == len(delivered), (texts, delivered)
        assert "not delivered: not delivered" not in log
        assert standby.poll() is None
    finally:
        receiver.server.shutdown()


@pytest.mark.parametrize(
    "content",
    [b"{garbage", b'{"version": 1, "tasks": [', b"", b"\0" * 4096],
    ids=["garbage", "truncated", "empty", "nul"],
)
def test_a_task_added_after_a_corrupt_crons_json_was_set_aside_fires(tmp_path: Path, content: bytes) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("[cron]\ntick_s = 3600\n")  # the backstop tick never comes
    (home / "crons.json").write_bytes(content)
    env = cli_env(home)
    srv = start_serve(home, env=env)
    try:
        wait_for(lambda: list(home.glob("crons.json.corrupt-*")), 20, "crons.json to be set aside")
        task_id = str(
            _ok(home, env, "cron", "add", "--name", "after", "--agent", "assistant", "--every", "1s", "--exact",
                "--prompt", "hi", "--json").json()["id"]
        )  # fmt: skip
        wait_for(
            lambda: "outcome" in [r["event"] for r in _records(home, task_id)],
            25,
            "the task added after the set-aside to fire",
        )
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.stop()
        srv.kill()


def test_a_run_followed_to_done_is_not_taken_again(tmp_path: Path) -> None:
    """The store's answer itself: a run dropped from the claims once done is known done (taken),
    not "not followed" (which let a second process record and deliver it again); a run pushed out
    of the claims undone stays "not followed"."""
    store = CronStore(tmp_path)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    task = store.add(make_task(name="t", agent="a", schedule=ScheduleSpec("every", "1m", "UTC"), prompt="p", now=t0))
    with store.lock():
        state = store.load()
        t = state.get(task.id)
        assert t is not None
        for i in range(OPEN_CLAIMS_KEPT + 3):  # runs 1 and 2 (and 3) pushed out of those kept
            t.claim(t0 + timedelta(minutes=i), t0 + timedelta(minutes=i), t0 + timedelta(minutes=i))
        store.save(state)
    assert store.advance(task.id, 2, "settled") is None  # pushed out: not followed
    assert store.advance(task.id, 4, "settled", final=True) is True  # done: dropped from the claims
    assert store.advance(task.id, 4, "settled") is False  # a second follower does not take it
    assert store.advance(task.id, 4, "delivering") is False
    assert store.claim_progress(task.id, 4) == (True, "done")
    assert store.advance(task.id, 5, "settled") is True  # still open: followed as before
    assert store.advance(task.id, OPEN_CLAIMS_KEPT + 4, "settled") is None  # never claimed here


def test_a_reply_not_delivered_is_said_once_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CronStore(tmp_path)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    task = store.add(
        make_task(name="t", agent="a", schedule=ScheduleSpec("every", "1m", "UTC"), prompt="p", now=t0, deliver=TARGET)
    )
    sent: list[str] = []

    async def deliver(target: str, text: str) -> list[str]:  # the gateway: never reached here
        sent.append(text)
        return ["m1"]

    with caplog.at_level(logging.WARNING, logger="appserver.cron"):
        asyncio.run(deliver_reply(store, task.id, 1, "turn_1", TurnOutcome("cancelled", "stopped"), TARGET, deliver))
    assert sent == []
    record = [r for r in _records(tmp_path, task.id) if r["event"] == "delivery_failed"]
    assert [r["error"] for r in record] == ["not delivered: the run cancelled"]
    assert "not delivered: the run cancelled" in caplog.text
    assert "not delivered: not delivered" not in caplog.text, caplog.text
