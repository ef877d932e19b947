"""Shell tool fixes found by an outside test, round 31 (m).

1. Provider secrets given by `APPSERVER_PROVIDERS__<NAME>__BASE_URL` / `__HEADERS` (a password or key
   in the URL, an Authorization header) reached every shell command: the tool's environment now
   carries no `APPSERVER_*` variable at all (nor a provider's `api_key_env`).
2. A command that stopped its guard (`kill -STOP $PPID`) was reported timed out though it had ended,
   and a `setsid` daemon it started outlived the call (the stopped guard never ran its kill).
3. A command over 128 KiB failed with a raw `OSError: Argument list too long`, a huge integer
   `timeout_s` with an `OverflowError`; with `ask` a person was asked to approve such a call. An
   over-long command (and a NUL in it, a `timeout_s` that is no positive number) is now refused
   with a clear message before anyone is asked; a huge positive `timeout_s` is capped as any other.
4. Shell calls of different conversations of one agent run one at a time: a call that waited for
   another says so in its result (its own timeout counts from its start).

Through the real agent loop (an in-process `Server`, the echo model's `/call`), real processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from appserver.config import load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server


def _alive_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `marker` (a sleep of a unique duration)."""
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
        if marker in cmdline and state not in (b"Z", b"X"):
            found.append(int(entry.name))
    return found


def _kill_all_with(marker: str) -> None:
    """Teardown: kill what the code under test left running (by pid)."""
    for pid in _alive_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _gone(marker: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive_with(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not _alive_with(marker)


async def _open(home: Path, environ: dict[str, str] | None = None) -> Server:
    server = Server(load_config(home, environ=environ if environ is not None else {}))
    await server.open()
    await server.agents.create("sh", "echo", tools={"shell": "allow"})
    await server.agents.create("ask", "echo", tools={"shell": "ask"})
    return server


async def _call(server: Server, agent: str, args: dict[str, Any] | str, conversation: str = "new") -> Any:
    """One `/call shell` turn; its snapshot once it ended or paused for an answer."""
    text = args if isinstance(args, str) else json.dumps(args)
    sub = await server.kernel.submit(SubmitRequest(agent=agent, input="/call shell " + text, conversation=conversation))
    return await sub.wait(30)


def _only_call(snap: Any) -> dict[str, Any]:
    [call] = [b for b in snap.blocks if b["type"] == "tool_call"]
    return dict(call)


# ---------------------------------------------------------------- 1. no APPSERVER_* variable reaches a command


async def test_a_command_gets_no_appserver_variable_nor_a_provider_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    given = {
        "APPSERVER_HOME": str(home),
        "APPSERVER_PROVIDERS__MYP__KIND": "openai",
        "APPSERVER_PROVIDERS__MYP__BASE_URL": "http://user:s31mPassw0rd@127.0.0.1:9/v1?api-key=S31MQUERYSECRET",
        "APPSERVER_PROVIDERS__MYP__HEADERS": '{"Authorization": "Bearer S31MHEADERSECRET"}',
        "APPSERVER_PROVIDERS__MYP__API_KEY_ENV": "MYP_S31M_KEY",
        "MYP_S31M_KEY": "sk-s31m-provider-key-0123456789",
        "S31M_PLAIN": "plain-s31m-visible",
    }
    for name, text in given.items():
        monkeypatch.setenv(name, text)
    server = await _open(home, dict(os.environ))
    try:
        assert "myp" in server.config.providers  # the variables configured the server
        call = _only_call(await _call(server, "sh", {"command": "env"}))
    finally:
        await server.close()
    shown = call["output"]
    assert not call["is_error"] and "plain-s31m-visible" in shown, call  # the rest is passed on
    for secret in ("s31mPassw0rd", "S31MQUERYSECRET", "S31MHEADERSECRET", "sk-s31m-provider-key"):
        assert secret not in shown, f"{secret} reached the command"
    names = {line.split("=", 1)[0] for line in shown.splitlines() if "=" in line}
    # only the two the server sets for itself (`reap_orphaned_tools`)
    assert {n for n in names if n.startswith("APPSERVER_")} == {"APPSERVER_TOOL_OWNER", "APPSERVER_TOOL_HOME"}, names


# ---------------------------------------------------------------- 2. a command that stops its guard


async def test_a_command_that_stopped_its_guard_is_reported_as_it_ended_and_leaves_nothing(tmp_path: Path) -> None:
    server = await _open(tmp_path / "home")
    marker = "31.4521"
    try:
        command = f'setsid sh -c "exec sleep {marker}" >/dev/null 2>&1 & kill -STOP $PPID; echo done'
        call = _only_call(await _call(server, "sh", {"command": command, "timeout_s": 2}))
        # it ended (the server saw that only at the timeout): not "timed out ... and was killed"
        assert not call["is_error"] and call["output"].startswith("done\n"), call
        assert "stopped the tool's guard process" in call["output"], call
        assert await _gone(marker, 5), "the setsid daemon outlived the call"
    finally:
        _kill_all_with(marker)
        await server.close()


async def test_a_command_that_keeps_stopping_its_guard_times_out_and_leaves_nothing(tmp_path: Path) -> None:
    server = await _open(tmp_path / "home")
    marker = "31.4522"
    try:
        command = f'setsid sh -c "exec sleep {marker}" >/dev/null 2>&1 & while :; do kill -STOP $PPID; sleep 0.05; done'
        call = _only_call(await _call(server, "sh", {"command": command, "timeout_s": 1}))
        assert call["is_error"] and call["output"].startswith("command timed out after 1 s"), call
        assert await _gone(marker, 5), "the setsid daemon outlived the call"
    finally:
        _kill_all_with(marker)
        await server.close()


# ---------------------------------------------------------------- 3. arguments that can only fail


async def test_arguments_that_cannot_run_are_refused_before_anyone_is_asked(tmp_path: Path) -> None:
    server = await _open(tmp_path / "home")
    try:
        cases = [
            ('{"command": "cat > f.txt <<EOF\\n' + "a" * 140_000 + '\\nEOF\\nwc -c f.txt"}', "'command' is 140"),
            ('{"command": "echo hi", "timeout_s": -1' + "0" * 400 + "}", "'timeout_s' must be a positive number"),
            ('{"command": "echo hi", "timeout_s": "5"}', "'timeout_s' must be a positive number"),
            ('{"command": "echo hi", "timeout_s": true}', "'timeout_s' must be a positive number"),
            ('{"command": "echo hi\\u0000there"}', "NUL"),
        ]
        for arguments, expected in cases:
            for agent in ("ask", "sh"):
                snap = await _call(server, agent, arguments)
                call = _only_call(snap)
                assert snap.status == "completed" and not snap.pending, (agent, expected, snap.status, call)
                assert call["is_error"], (agent, call)
                assert call["output"].startswith("Invalid arguments for shell: "), (agent, call["output"][:300])
                assert expected in call["output"], (agent, call["output"][:300])
        agent = await server.agents.get("sh")
        assert not (server.config.workspace(agent.id) / "f.txt").exists()
        # a huge integer timeout is a long one: capped at the limit, as 1e300 is (it failed converting to float)
        call = _only_call(await _call(server, "sh", '{"command": "echo hi", "timeout_s": 1' + "0" * 400 + "}"))
        assert not call["is_error"] and call["output"] == "hi\n", call["output"][:300]
        # a command at the limit still runs (the limit is the kernel's, not a stricter one)
        command = "echo ok #"
        command += "a" * (128 * 1024 - 1 - len(command))
        call = _only_call(await _call(server, "sh", {"command": command, "timeout_s": 30}))
        assert not call["is_error"] and call["output"] == "ok\n", call["output"][:300]
    finally:
        await server.close()


# ---------------------------------------------------------------- 4. one agent's shell calls, one at a time


async def test_a_call_that_waited_for_the_agents_workspace_says_so(tmp_path: Path) -> None:
    server = await _open(tmp_path / "home")
    try:
        agent = await server.agents.get("sh")
        started = server.config.workspace(agent.id) / "a-started"
        first = asyncio.create_task(
            _call(server, "sh", {"command": "touch a-started; sleep 3; echo A", "timeout_s": 8})
        )
        deadline = time.monotonic() + 10
        while not started.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert started.exists(), "the first call never started"
        second = _only_call(await _call(server, "sh", {"command": "echo B", "timeout_s": 2}))
        assert not second["is_error"] and second["output"].startswith("B\n"), second
        assert "waited" in second["output"] and "before running" in second["output"], second
        one = _only_call(await asyncio.wait_for(first, 20))
        assert one["output"] == "A\n", one  # the first one did not wait: no note
    finally:
        await server.close()
