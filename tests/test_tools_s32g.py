"""Agent tool fixes found by an outside test, round 32 (g).

1. An agent's workspace (`workspaces/<agent id>`) that was a symbolic link to nothing (a disk not
   mounted) or a regular file made every shell call fail with `FileExistsError: [Errno 17] File
   exists`, naming neither the link nor its target. Now the result (and a log line) says what is
   wrong, for the workspace and for `workspaces/` itself, and nothing is made where a link points.
2. The schedule tool quoted a refused `name`, `misfire`, `conversation` (and a `name` to cancel)
   whole: a 100,000-character value gave a ~100 KB tool result, stored, sent to every subscriber and
   replayed to the model. Now such a value is quoted cut short, as `tz`, `cron`, `in` and `at` were.

Through a real `appserver serve` (the echo model's `/call`) and the real `websockets` client.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)


async def _tool_result(ws: WS, agent: str, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """The one tool_call block of a `/call TOOL ARGS` turn, once the turn ended."""
    ack = await ws.request(
        {"type": "submit_input", "agent": agent, "conversation": "new", "input": f"/call {tool} {json.dumps(args)}"}
    )
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], timeout=30)
    [call] = [b for b in snap["blocks"] if b["type"] == "tool_call"]
    return dict(call)


def _serve(home: Path, *agent_args: str) -> Any:
    made = run_cli(home, "agents", "create", *agent_args)
    assert made.code == 0, made.err
    return serving(home)


async def test_a_workspace_or_workspaces_that_is_no_directory_is_named_and_nothing_made(tmp_path: Path) -> None:
    home = tmp_path / "home"
    unmounted = tmp_path / "unmounted"  # where the links point: it must stay missing
    with _serve(home, "--name", "sh", "--tool", "shell=allow") as sp:
        sp: ServeProcess
        ws = await WS.open(sp.url)
        try:
            first = await _tool_result(ws, "sh", "shell", {"command": "pwd"})
            workspace = Path(first["output"].strip())
            assert not first["is_error"] and workspace.parent == home / "workspaces", first

            async def shell_says() -> str:
                call = await _tool_result(ws, "sh", "shell", {"command": "echo ran > /dev/null; echo hi"})
                assert call["is_error"], call
                text = str(call["output"])
                assert "File exists" not in text and "FileExistsError" not in text, text
                assert "nothing was run" in text, text
                return text

            # the workspace: a link to nothing (its disk not mounted), then a regular file in its place
            workspace.rmdir()
            workspace.symlink_to(unmounted / "ws")
            text = await shell_says()
            assert f"{workspace}: a symbolic link to {unmounted / 'ws'}, which does not exist" in text, text
            assert "is its disk mounted?" in text, text
            workspace.unlink()
            workspace.write_text("")
            text = await shell_says()
            assert f"{workspace}: a regular file, not a directory" in text, text
            workspace.unlink()
            workspace.symlink_to("/etc/hostname")  # a link to a file: both said
            text = await shell_says()
            assert f"{workspace}: a symbolic link to /etc/hostname, which is a regular file, not a directory" in text
            workspace.unlink()

            # `workspaces/` itself, gone to a disk not mounted while the server runs, then a file
            moved = home / "workspaces.real"
            (home / "workspaces").rename(moved)
            (home / "workspaces").symlink_to(unmounted / "all")
            text = await shell_says()
            assert f"{home / 'workspaces'}: a symbolic link to {unmounted / 'all'}, which does not exist" in text, text
            assert f"so {workspace} cannot be reached" in text, text
            (home / "workspaces").unlink()
            (home / "workspaces").write_text("")
            text = await shell_says()
            assert f"{home / 'workspaces'}: a regular file, not a directory, so {workspace} cannot be made" in text
            (home / "workspaces").unlink()
            assert not unmounted.exists() and not os.path.lexists(unmounted)  # nothing made where links pointed

            # put right, the next call makes the workspace again and runs
            moved.rename(home / "workspaces")
            again = await _tool_result(ws, "sh", "shell", {"command": "pwd"})
            assert not again["is_error"] and again["output"].strip() == str(workspace), again
        finally:
            await ws.close()
        sp.stop()
        log = sp.proc.stderr.read() if sp.proc.stderr else ""
    assert "its workspace cannot be used" in log and f"a symbolic link to {unmounted / 'ws'}" in log, log[-3000:]


async def test_the_schedule_tool_quotes_a_refused_huge_value_cut_short(tmp_path: Path) -> None:
    home = tmp_path / "home"
    big = "x" * 100_000
    refused = {
        "name": {"action": "create", "name": big, "prompt": "p", "in": "1h"},
        "misfire": {"action": "create", "name": "a", "prompt": "p", "in": "1h", "misfire": big},
        "conversation": {"action": "create", "name": "a", "prompt": "p", "in": "1h", "conversation": big},
        "cancel": {"action": "cancel", "name": big},
        "tz": {"action": "create", "name": "a", "prompt": "p", "in": "1h", "tz": big},  # was already cut
    }
    with _serve(home, "--name", "sch") as sp:
        ws = await WS.open(sp.url)
        try:
            for label, args in refused.items():
                call = await _tool_result(ws, "sch", "schedule", args)
                text = str(call["output"])
                assert call["is_error"] and text.startswith("schedule "), (label, text[:300])
                assert len(text) < 600, (label, len(text), text[:300])
                assert "xxxx" in text and "characters)" in text, (label, text)
            listed = await _tool_result(ws, "sch", "schedule", {"action": "list"})
            assert listed["output"] == "no scheduled tasks", listed  # nothing was made
        finally:
            await ws.close()
