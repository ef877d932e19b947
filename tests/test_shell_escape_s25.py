"""Shell tool fix found in session 25: a process that keeps changing its pid (fork, the child calls
setsid, the parent exits) outlived the call. The guard's one scan of /proc at the call's end saw no
child while the process was between pids (the old pid gone before its entry was read, the new one
born after the list was taken), so the guard exited and the process was handed to init."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from appserver.agent.tools import SHELL, ToolContext
from appserver.config import Config
from appserver.store.records import AgentRecord

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux: a subreaper and /proc")

# fork; the child leaves the session and the group; the parent exits: for HOP_S seconds, then it rests
JUMPER = """import os, sys, time
end = time.time() + float(sys.argv[2])
while time.time() < end:
    if os.fork():
        os._exit(0)
    os.setsid()
time.sleep(60)
"""
HOP_S = 2.0


def _ctx(home: Path) -> ToolContext:
    agent = AgentRecord(id="a", name="a", model="echo", system="", tools={}, params={}, created_at=0, updated_at=0)
    return ToolContext(agent, "c", "t", Config(home=home))


def _alive_with(marker: str) -> list[int]:
    """The live (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != b"Z":
            found.append(int(entry.name))
    return found


def _kill_all_with(marker: str) -> None:
    """Teardown: kill what the code under test left running (by pid, scanning until none is seen)."""
    deadline = time.monotonic() + HOP_S + 3
    quiet = 0
    while quiet < 5 and time.monotonic() < deadline:
        pids = _alive_with(marker)
        quiet = 0 if pids else quiet + 1
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


@pytest.mark.timeout(20)
async def test_a_pid_hopping_setsid_process_does_not_outlive_the_call(tmp_path: Path) -> None:
    script = tmp_path / "jumper.py"
    script.write_text(JUMPER)
    marker = f"hop-s25-{os.getpid()}-{time.monotonic_ns()}"
    command = f"{sys.executable} {script} {marker} {HOP_S} & sleep 0.3; echo started"
    started = time.monotonic()
    try:
        out = await asyncio.wait_for(SHELL.run({"command": command, "timeout_s": 8}, _ctx(tmp_path)), 15)
        assert (out.is_error, out.text) == (False, "started\n"), out
        assert time.monotonic() - started < 3, "the call waited for what its command left"
        # once the hopping time is over a survivor rests under one pid, where a scan cannot miss it
        await asyncio.sleep(max(0.0, started + HOP_S + 0.5 - time.monotonic()))
        seen: list[int] = []
        for _ in range(5):
            seen += _alive_with(marker)
            await asyncio.sleep(0.05)
        assert not seen, f"the pid-hopping process outlived its call: {sorted(set(seen))}"
    finally:
        _kill_all_with(marker)
