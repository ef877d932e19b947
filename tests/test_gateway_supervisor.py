"""gateway/supervisor.py against a fake child: a small executable script standing in for
`python -m gateway` that speaks the stdio control protocol, or misbehaves on purpose."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.supervisor import Credential, GatewaySupervisor

# The fake child. `FAKE_MODES` (comma separated) gives the behaviour of the 1st, 2nd, ... start (the
# last one repeats): `ok` speaks the protocol; `exit3` exits with code 3 before READY; `never_ready`
# never says READY and ignores the end of stdin; `stubborn` is ready but ignores `stop` and the end
# of stdin; `eof_only` ignores `stop` but exits at the end of stdin. Every start appends what it got to
# $APPSERVER_HOME/starts.jsonl.
CHILD = r"""
import json, os, sys, time

home = os.environ["APPSERVER_HOME"]
os.makedirs(home, exist_ok=True)
counter = os.path.join(home, "count")
n = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(n + 1))
modes = os.environ.get("FAKE_MODES", "ok").split(",")
mode = modes[min(n, len(modes) - 1)]
start = json.loads(sys.stdin.readline())
with open(os.path.join(home, "starts.jsonl"), "a") as f:
    seen = {"argv": sys.argv[1:], "start": start, "mode": mode, "token_env": os.environ.get("APPSERVER_TOKEN")}
    f.write(json.dumps(seen) + "\n")


def err(line):
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def respond(rid, **payload):
    out("GATEWAY_RESPONSE " + json.dumps({"id": rid, **payload}))


err(f"INFO gateway: child {n} starting ({mode})")
err("GATEWAY_READY")  # a control line on stderr is only log text
err('GATEWAY_RESPONSE {"id": "r1", "forged": true}')
if mode == "exit3":
    err("ERROR gateway: cannot reach the server")
    sys.exit(3)
if mode == "never_ready":
    time.sleep(60)
    sys.exit(0)
out("this is not a control line")
state = {"type": "account_state", "channel": "toy", "account": "main", "state": "running", "reason": None}
out("GATEWAY_EVENT " + json.dumps(state))
out("GATEWAY_READY")
for line in sys.stdin:
    cmd = json.loads(line)
    op, rid = cmd["op"], cmd["id"]
    if op == "echo":
        respond(rid, ok=True, got=cmd)
    elif op == "ping":
        respond(rid, ok=True)
    elif op == "slow":
        time.sleep(cmd["delay"])
        respond(rid, ok=True, late=True)
    elif op == "silent":
        pass
    elif op == "event":
        out("GATEWAY_EVENT " + json.dumps(cmd["payload"]))
        respond(rid, ok=True)
    elif op == "log":
        for text in cmd["lines"]:
            err(text)
        respond(rid, ok=True)
    elif op == "crash":
        os._exit(5)
    elif op == "stop":
        if mode in ("stubborn", "eof_only"):
            continue
        respond(rid, ok=True)
        sys.exit(0)
if mode == "stubborn":
    time.sleep(60)
"""

FAST = {"ready_timeout": 5.0, "stop_grace": 2.0, "backoff_min": 0.05, "backoff_max": 0.1}
ACCOUNTS = [{"channel": "toy", "name": "main", "settings": {}, "secrets": {}}]


class Credentials:
    """Mints a token per child start and counts revocations."""

    def __init__(self) -> None:
        self.minted: list[str] = []
        self.revoked: list[str] = []

    def __call__(self) -> Credential:
        token = f"tok{len(self.minted)}"
        self.minted.append(token)
        return Credential(token, lambda: self.revoked.append(token))


class Fixture:
    def __init__(self, tmp_path: Path) -> None:
        self.home = tmp_path / "home"
        self.script = tmp_path / "fake-python"
        self.script.write_text(f"#!{sys.executable}\n{CHILD}")
        self.script.chmod(0o755)
        self.credentials = Credentials()
        self.supervisors: list[GatewaySupervisor] = []

    def supervisor(self, modes: str = "ok", **kw: Any) -> GatewaySupervisor:
        env = {"PATH": "/usr/bin:/bin", "FAKE_MODES": modes, "APPSERVER_TOKEN": "the server's own"}
        sup = GatewaySupervisor(
            home=self.home,
            url=lambda: "ws://127.0.0.1:9/ws",
            accounts=ACCOUNTS,
            credential=self.credentials,
            env=env,
            **{"python": str(self.script), **FAST, **kw},
        )
        self.supervisors.append(sup)
        return sup

    def starts(self) -> list[dict[str, Any]]:
        path = self.home / "starts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
async def fx(tmp_path: Path) -> AsyncIterator[Fixture]:
    f = Fixture(tmp_path)
    yield f
    for sup in f.supervisors:
        await sup.stop()


async def until(predicate: Any, timeout: float = 15.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


async def test_ready_means_running_and_commands_round_trip(fx: Fixture) -> None:
    sup = fx.supervisor()
    await sup.start()
    assert sup.view.state == "running" and sup.view.pid is not None
    ok, detail = sup.readiness()
    assert ok, detail
    assert detail["accounts"]["toy:main"]["state"] == "running"
    reply = await sup.command("echo", text="hi")
    assert reply["ok"] is True
    assert reply["got"] == {"id": reply["id"], "op": "echo", "text": "hi"}
    again = await sup.command("echo")
    assert again["id"] != reply["id"]

    (start,) = fx.starts()
    assert start["argv"] == ["-P", "-m", "gateway"]  # nothing from the working directory
    assert start["start"] == {
        "op": "start",
        "url": "ws://127.0.0.1:9/ws",
        "token": "tok0",
        "home": str(fx.home),
        "accounts": ACCOUNTS,
    }
    assert start["token_env"] is None  # the child's credential travels on stdin only
    assert fx.credentials.revoked == []  # revoked when that child ends, not before


async def test_stop_is_graceful_and_revokes_the_credential(fx: Fixture) -> None:
    sup = fx.supervisor()
    await sup.start()
    proc = sup._proc
    assert proc is not None
    t0 = time.monotonic()
    await sup.stop()
    assert time.monotonic() - t0 < 1.5
    assert proc.returncode == 0
    assert sup.view.state == "stopped"
    assert fx.credentials.minted == ["tok0"] and fx.credentials.revoked == ["tok0"]
    assert not sup.readiness()[0]
    with pytest.raises(RuntimeError, match="not running"):
        await sup.command("echo")


async def test_stop_closes_stdin_and_the_child_exits_on_its_own(fx: Fixture) -> None:
    sup = fx.supervisor("eof_only", stop_grace=0.3)
    await sup.start()
    proc = sup._proc
    assert proc is not None
    t0 = time.monotonic()
    await sup.stop()  # the stop command times out; closing stdin ends the child
    assert proc.returncode == 0
    assert time.monotonic() - t0 < 2.0  # the command times out after the grace; no kill (code 0)
    assert fx.credentials.revoked == ["tok0"]


async def test_a_child_that_ignores_stop_is_killed_after_the_grace(fx: Fixture) -> None:
    sup = fx.supervisor("stubborn", stop_grace=0.3)
    await sup.start()
    proc = sup._proc
    assert proc is not None
    t0 = time.monotonic()
    await sup.stop()
    elapsed = time.monotonic() - t0
    assert proc.returncode is not None and proc.returncode < 0  # killed by a signal
    assert 0.3 <= elapsed < 2.0
    assert fx.credentials.revoked == ["tok0"]


async def test_command_timeout_and_a_late_answer_is_ignored(fx: Fixture) -> None:
    sup = fx.supervisor()
    await sup.start()
    with pytest.raises(TimeoutError):
        await sup.command("silent", timeout=0.2)
    with pytest.raises(TimeoutError):
        await sup.command("slow", delay=0.3, timeout=0.1)
    # The late answer to the slow command arrives first and matches nothing; the next is answered.
    reply = await sup.command("echo", text="after")
    assert reply["got"]["text"] == "after"
    assert sup._pending == {}


async def test_a_crash_is_restarted_with_backoff(fx: Fixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor()
    await sup.start()
    first_pid = sup.view.pid
    pending = asyncio.ensure_future(sup.command("silent", timeout=5.0))
    await asyncio.sleep(0.05)
    with pytest.raises(RuntimeError, match="the gateway exited"):
        await asyncio.gather(sup.command("crash", timeout=5.0), pending)
    await until(lambda: sup.view.restarts == 1 and sup.view.state == "running")
    assert sup.view.pid != first_pid
    assert "exited with code 5; restarting in 0.05 s" in caplog.text
    assert fx.credentials.minted == ["tok0", "tok1"]
    assert fx.credentials.revoked == ["tok0"]  # once per child, at its end
    assert [s["start"]["token"] for s in fx.starts()] == ["tok0", "tok1"]
    assert (await sup.command("echo"))["ok"]


async def test_a_failed_start_is_known_at_once_and_retried(fx: Fixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor("exit3,exit3,ok", ready_timeout=5.0)
    t0 = time.monotonic()
    await sup.start()  # returns with the first outcome: the failure, not the READY timeout
    assert time.monotonic() - t0 < 2.0
    assert sup.view.state == "backoff"
    assert sup.view.reason is not None and "exited with code 3" in sup.view.reason
    assert sup.readiness()[1]["accounts"]["toy:main"]["state"] == "stopped"
    await until(lambda: sup.view.state == "running")
    assert sup.view.restarts == 2
    assert "restarting in 0.05 s" in caplog.text and "restarting in 0.1 s" in caplog.text  # doubling
    assert [s["mode"] for s in fx.starts()] == ["exit3", "exit3", "ok"]
    assert fx.credentials.revoked == ["tok0", "tok1"]


async def test_backoff_is_capped(fx: Fixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor("exit3,exit3,exit3,exit3,ok", backoff_min=0.02, backoff_max=0.05)
    await sup.start()
    await until(lambda: sup.view.state == "running")
    waits = [r.getMessage().rsplit("restarting in ", 1)[1] for r in caplog.records if "restarting in" in r.getMessage()]
    assert waits == ["0.02 s", "0.04 s", "0.05 s", "0.05 s"]


async def test_never_ready_is_killed_after_the_ready_timeout_and_retried(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor("exit3,never_ready,ok", ready_timeout=1.0, stop_grace=0.2)
    await sup.start()
    await until(lambda: sup.view.state == "running")
    assert [s["mode"] for s in fx.starts()][:3] == ["exit3", "never_ready", "ok"]
    lines = [r.getMessage() for r in caplog.records if "not ready within" in r.getMessage()]
    assert any("not ready within 1 s" in line and "(never_ready)" in line for line in lines), lines
    for line in lines:  # the last log lines of the child stopped, never of the one before
        assert len(re.findall(r"child \d+ starting", line)) <= 1, line
    assert sup.view.restarts == len(fx.starts()) - 1 >= 2
    assert len(fx.credentials.revoked) == sup.view.restarts


async def test_stderr_is_relayed_to_the_gateway_logger(fx: Fixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway")
    sup = fx.supervisor()
    await sup.start()
    lines = ["ERROR gateway.toy: platform said no", "WARNING gateway: slow", "Traceback (most recent call last):"]
    await sup.command("log", lines=lines)
    await until(lambda: any("Traceback" in r.getMessage() for r in caplog.records))
    relayed = {r.getMessage(): r.levelno for r in caplog.records if r.name == "gateway"}
    assert relayed["gateway| INFO gateway: child 0 starting (ok)"] == logging.INFO
    assert relayed["gateway| ERROR gateway.toy: platform said no"] == logging.ERROR
    assert relayed["gateway| WARNING gateway: slow"] == logging.WARNING
    assert relayed["gateway| Traceback (most recent call last):"] == logging.ERROR
    # Control lines on stderr are log text, never acted on.
    assert "gateway| GATEWAY_READY" in relayed
    assert 'gateway| GATEWAY_RESPONSE {"id": "r1", "forged": true}' in relayed


async def test_account_state_events_update_readiness(fx: Fixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor()
    await sup.start()
    assert sup.readiness()[0]
    event = {"type": "account_state", "channel": "toy", "account": "main", "state": "backoff", "reason": "429"}
    await sup.command("event", payload=event)
    ok, detail = sup.readiness()
    assert not ok
    assert detail["accounts"]["toy:main"] == {"channel": "toy", "account": "main", "state": "backoff", "reason": "429"}
    # An account the server did not configure is not added; a gateway_error is logged.
    await sup.command("event", payload={**event, "account": "ghost"})
    await sup.command("event", payload={"type": "gateway_error", "message": "gateway.db was corrupt"})
    assert set(sup.readiness()[1]["accounts"]) == {"toy:main"}
    assert "gateway: gateway.db was corrupt" in caplog.text
    await sup.command("event", payload={**event, "state": "running", "reason": None})
    assert sup.readiness()[0]


async def test_a_child_that_cannot_be_run_says_why(fx: Fixture, tmp_path: Path) -> None:
    sup = fx.supervisor(python=str(tmp_path / "no-such-python"))
    await sup.start()
    assert sup.view.state == "backoff"
    assert sup.view.reason is not None
    assert sup.view.reason.startswith("could not be run (FileNotFoundError")
    assert "restarting in 0.05 s" in sup.view.reason
    await sup.stop()
    assert fx.credentials.revoked == fx.credentials.minted  # every minted credential is revoked


async def test_stop_during_backoff_starts_nothing_more(fx: Fixture) -> None:
    sup = fx.supervisor("exit3", backoff_min=0.3, backoff_max=0.3)
    await sup.start()
    assert sup.view.state == "backoff"
    await sup.stop()
    await asyncio.sleep(0.4)
    assert sup.view.state == "stopped"
    assert [s["mode"] for s in fx.starts()] == ["exit3"]
    assert fx.credentials.revoked == ["tok0"]


PINGS = {"ping_interval": 0.1, "ping_timeout": 0.3, "hung_kill": 1.5}


async def test_a_stopped_child_is_unready_then_killed_and_restarted(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that stops answering (SIGSTOP, a wedged loop) kept /readyz saying channels ok forever:
    the supervisor never sent the child's `ping`. Now it is `unresponsive` at once and killed later."""
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor(**PINGS)
    await sup.start()
    pid = sup.view.pid
    assert pid is not None and sup.readiness()[0]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    await until(lambda: sup.view.state == "unresponsive", timeout=5)
    ok, detail = sup.readiness()
    assert not ok and detail["gateway"] == "unresponsive" and detail["reason"].startswith("no answer to a ping for")
    assert f"the child (pid {pid}) does not answer pings" in caplog.text
    await until(lambda: sup.view.pid != pid and sup.view.state == "running", timeout=10)
    assert time.monotonic() - stopped_at >= PINGS["hung_kill"]
    assert sup.view.restarts == 1 and sup.readiness()[0]
    assert re.search(rf"the child \(pid {pid}\) answered no ping for \d+ s and was killed", caplog.text)
    assert "the child answered no ping for" in caplog.text and "restarting in" in caplog.text


async def test_a_child_that_answers_again_is_ready_again_without_a_restart(
    fx: Fixture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appserver.gateway")
    sup = fx.supervisor(**{**PINGS, "hung_kill": 30.0})
    await sup.start()
    pid = sup.view.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await until(lambda: sup.view.state == "unresponsive", timeout=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    await until(lambda: sup.view.state == "running", timeout=5)
    assert sup.readiness()[0] and sup.view.pid == pid and sup.view.restarts == 0
    assert "answers pings again" in caplog.text
