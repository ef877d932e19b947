"""Tool fixes found in session 19: the shell tool's timeout that never ended for a command
flooding its output (and held the agent's workspace lock, so every later shell call of the agent
hung), its output cap applied only after everything was read into memory, the clock tool's
OSError for an overlong timezone, and `appserver run` silent about a turn stopped at max_steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appserver.agent.tools import CLOCK, SHELL, TZ_NAME_MAX, ToolContext, zone_named
from appserver.config import Config, load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.records import AgentRecord
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import start_serve

# How long a flooding command runs before its timeout kills it. The hang came from the kill landing
# while the pipe reader was paused past its buffer limit, which a flood reaches within milliseconds;
# each second of flood costs ~1 CPU-s (the command writing, the tool reading and dropping).
FLOOD_S = 0.5


def _ctx(home: Path, **limits: float) -> ToolContext:
    cfg = Config(home=home)
    for name, value in limits.items():
        setattr(cfg.limits, name, value)
    agent = AgentRecord(id="a", name="a", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0)
    return ToolContext(agent, "c", "t", cfg)


# ---------------------------------------------------------------- shell: timeout of a flooding command


@pytest.mark.parametrize("command", ["cat /dev/zero", "yes"])
async def test_a_flooding_command_times_out_every_time(tmp_path: Path, command: str) -> None:
    # Before the fix ~60 % of these never returned: killed while the pipe reader was paused past
    # its buffer limit, the command's pipe never showed EOF and the wait for it never ended.
    ctx = _ctx(tmp_path)
    for _ in range(5):
        started = time.monotonic()
        out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": FLOOD_S}, ctx), 20)
        killed = f"command timed out after {FLOOD_S} s and was killed"
        assert out.is_error and out.text.startswith(killed), out.text[:200]
        assert time.monotonic() - started < 15
        # what it printed until then, cut at the cap, with the count of what was dropped
        assert len(out.text) < ctx.config.limits.shell_output_max_bytes + 500
        assert "[output truncated:" in out.text
    ok = await asyncio.wait_for(SHELL.run({"command": "echo still here", "timeout_s": 5}, ctx), 20)
    assert not ok.is_error and ok.text == "still here\n"


async def test_after_a_flooding_timeout_the_agent_s_next_shell_call_runs(tmp_path: Path) -> None:
    # Through the real loop: the agent's workspace lock was held by the hung call, so every later
    # shell call of the agent (in any conversation) hung until a restart.
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    try:
        await server.agents.create("actor", "echo", tools={"shell": "allow"})
        for _ in range(3):
            flood = "/call shell " + json.dumps({"command": "yes", "timeout_s": FLOOD_S})
            sub = await server.kernel.submit(SubmitRequest(agent="actor", input=flood, conversation="new"))
            snap = await sub.wait(20)
            [call] = [b for b in snap.blocks if b["type"] == "tool_call"]
            assert call["is_error"] and f"timed out after {FLOOD_S} s" in call["output"], call
        hello = "/call shell " + json.dumps({"command": "echo next", "timeout_s": 5})
        sub = await server.kernel.submit(SubmitRequest(agent="actor", input=hello, conversation="new"))
        snap = await sub.wait(20)
        [call] = [b for b in snap.blocks if b["type"] == "tool_call"]
        assert not call["is_error"] and call["output"] == "next\n", call
    finally:
        await server.close()


async def test_a_command_whose_output_pipe_outlives_the_kill_does_not_hang(tmp_path: Path) -> None:
    # A process that left the group (setsid) keeps the pipe open after the kill: the tool closes
    # its end after a grace instead of waiting for an EOF that never comes.
    ctx = _ctx(tmp_path)
    marker = tmp_path / "escaped.pid"
    command = f"setsid sh -c 'echo $$ > {marker}; exec sleep 30' & echo started; sleep 60"
    try:
        out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": 0.5}, ctx), 30)
        assert out.is_error and out.text.startswith("command timed out after 0.5 s and was killed")
        assert "started" in out.text
    finally:
        if marker.exists():
            try:
                os.kill(int(marker.read_text().strip()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass


async def test_a_cancelled_shell_call_kills_its_command_and_returns(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    marker = tmp_path / "flood.pid"
    task = asyncio.ensure_future(SHELL.run({"command": f"echo $$ > {marker}; exec yes", "timeout_s": 30}, ctx))
    # cancelled while it floods: once its pid is written it execs `yes`, and the tool's reader is
    # past its buffer within milliseconds (a fixed 1 s wait cost ~1 CPU-s of flood)
    deadline = asyncio.get_running_loop().time() + 15
    while not (marker.exists() and marker.read_text().strip()):
        assert asyncio.get_running_loop().time() < deadline and not task.done(), "the command never started"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 15)
    pid = int(marker.read_text().strip())
    # SIGKILL was sent and the pipe is closed; the kernel finishes the exit on its own schedule
    # (on a loaded machine the process reads 'R' for a moment after closing its files)
    assert await _gone_or_zombie(pid, within_s=5), f"pid {pid} still runs after the cancel"


async def _gone_or_zombie(pid: int, within_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- shell: output cap bounds memory

_PEAK = """
import asyncio, json, sys
from pathlib import Path
from appserver.agent.tools import SHELL, ToolContext
from appserver.config import Config
from appserver.store.records import AgentRecord

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

cfg = Config(home=Path(sys.argv[1]))
agent = AgentRecord(id="a", name="a", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0)
ctx = ToolContext(agent, "c", "t", cfg)
before = hwm()
out = asyncio.run(SHELL.run({"command": sys.argv[2], "timeout_s": 30}, ctx))
print(json.dumps({"grew": hwm() - before, "is_error": out.is_error, "len": len(out.text), "tail": out.text[-120:]}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_output_past_the_cap_is_dropped_as_it_comes_not_kept(tmp_path: Path) -> None:
    # Before the fix all of it was read into memory and cut afterwards: 300 MB of output took the
    # server's peak memory up by 600 MB, while the result showed only the first 64 KiB. 100 MB
    # (then: 200 MB of growth) is still far past the 64 MiB bound the fixed tool stays under.
    size = 100_000_000
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path), f"head -c {size} /dev/zero; echo done >&2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert not got["is_error"]  # the command ran to its end
    assert f"[output truncated: {size + 5} bytes, showing the first 65536]" in got["tail"]
    assert got["len"] < 65536 + 200
    assert got["grew"] < 64 * 1024 * 1024, got  # far below the 100 MB the command wrote


async def test_stderr_counts_towards_the_same_cap(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, shell_output_max_bytes=1000)
    out = await SHELL.run({"command": "head -c 5000 /dev/zero >&2; echo tail", "timeout_s": 10}, ctx)
    assert not out.is_error
    assert out.text.endswith("[output truncated: 5005 bytes, showing the first 1000]")


# ---------------------------------------------------------------- clock: a timezone no file system takes


@pytest.mark.parametrize(
    "tz", ["a" * 5000, "a/" * 200, "../../etc/passwd", "/etc/localtime", "UTC\x00", "Europe/../UTC", "x" * 300]
)
async def test_clock_refuses_a_bad_timezone_with_its_own_message(tmp_path: Path, tz: str) -> None:
    out = await CLOCK.run({"timezone": tz}, _ctx(tmp_path))
    assert out.is_error and out.text.startswith("unknown timezone ") and "use an IANA name" in out.text
    assert "Errno" not in out.text and "site-packages" not in out.text and "zoneinfo" not in out.text
    assert len(out.text) < 200  # the name is shortened, not echoed whole


async def test_clock_still_takes_iana_names(tmp_path: Path) -> None:
    for tz in ("UTC", "Europe/Paris", "America/Argentina/Buenos_Aires", "Etc/GMT+5", "America/Port-au-Prince"):
        out = await CLOCK.run({"timezone": tz}, _ctx(tmp_path))
        assert not out.is_error and out.text.endswith(f"({tz})"), out.text
    assert zone_named("Z" * (TZ_NAME_MAX + 1)) is None and zone_named(None) is None


async def test_schedule_refuses_an_overlong_timezone_in_its_words(tmp_path: Path) -> None:
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    try:
        await server.agents.create("planner", "echo", tools={"schedule": "allow"})
        args = {"action": "create", "name": "t", "prompt": "p", "every": "1h", "tz": "a" * 5000}
        sub = await server.kernel.submit(
            SubmitRequest(agent="planner", input="/call schedule " + json.dumps(args), conversation="new")
        )
        snap = await sub.wait(20)
        [call] = [b for b in snap.blocks if b["type"] == "tool_call"]
        assert call["is_error"] and "unknown timezone" in call["output"], call
        assert "Errno" not in call["output"] and len(call["output"]) < 300, call
    finally:
        await server.close()


# ---------------------------------------------------------------- run: a turn stopped at max_steps


def test_run_says_a_turn_stopped_at_max_steps(home: Path) -> None:
    env = cli_env(home, APPSERVER_LIMITS__MAX_STEPS="1")
    res = run_cli(home, "run", "--conversation", "new", "/call clock {}", env=env)
    assert res.code == 0, res.err  # the turn completed; what it did stands
    assert "[stopped: the agent reached its limit of 1 steps (max_steps)" in res.err, res.err
    assert "max_steps" not in res.out  # stdout stays the reply alone
    as_json = run_cli(home, "run", "--conversation", "new", "--json", "/call clock {}", env=env)
    assert as_json.code == 0 and as_json.json()["stop_reason"] == "max_steps"
    assert "[stopped:" not in as_json.out and "[stopped:" not in as_json.err  # --json is exact


def test_run_through_a_server_says_max_steps_and_retries(home: Path) -> None:
    env = cli_env(home, APPSERVER_LIMITS__MAX_STEPS="1")
    sp = start_serve(home, env=env)
    try:
        res = run_cli(home, "run", "--conversation", "new", "/call clock {}", env=env)
        assert res.code == 0, res.err
        assert "[stopped: the agent reached its step limit (max_steps)" in res.err, res.err
        retried = run_cli(home, "run", "--conversation", "new", "/error 429", env=env)
        assert retried.code == 1
        assert "retrying: attempt 2]" in retried.err and "429" in retried.err, retried.err
    finally:
        assert sp.stop() == 0
