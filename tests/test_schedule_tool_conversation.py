"""The `schedule` tool for a caller whose conversation is unowned (local CLI, admin): an omitted
`conversation` is the one the tool was called from, as its description tells the model, and a
conversation that does not exist or is another agent's is refused when the task is made (as
`cron add --conversation` refuses it), not accepted to fail at every run. Real CLI turns (`/call`
on the echo model) against a real home."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.cli import CLIResult, run_cli


def ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args)
    assert r.code == 0, (args, r.out, r.err)
    return r


def schedule(home: Path, agent: str, called_in: str, **args: Any) -> tuple[str, str]:
    """(conversation id of the turn, the tool's answer) of one `/call schedule` turn."""
    call = json.dumps({"action": "create", "prompt": "stand up", "every": "1h", **args})
    out = ok(home, "run", "--agent", agent, "--conversation", called_in, "--json", f"/call schedule {call}").json()
    return str(out["conversation_id"]), str(out["text"])


def tasks(home: Path) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in ok(home, "cron", "list", "--json").json()}


def test_an_omitted_conversation_is_the_one_the_tool_was_called_from(tmp_path: Path) -> None:
    home = tmp_path / "home"
    conv, text = schedule(home, "assistant", "new", name="here")
    assert "created task here" in text, text
    assert tasks(home)["here"]["conversation"] == conv  # not "new": a fresh conversation each run


def test_a_missing_or_another_agents_conversation_is_refused_at_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    ok(home, "agents", "create", "--name", "ops")
    mine, _ = schedule(home, "ops", "new", name="first")
    other = str(ok(home, "run", "--json", "assistant private").json()["conversation_id"])

    _, text = schedule(home, "ops", "new", name="ghost", conversation="conv_doesnotexist")
    assert "schedule create failed: unknown conversation 'conv_doesnotexist'" in text, text
    _, text = schedule(home, "ops", "new", name="theirs", conversation=other)
    assert f"schedule create failed: conversation {other!r} belongs to another agent" in text, text
    # what an unowned caller may still name: its agent's own conversations, new and default
    for name, target in (("mine", mine), ("fresh", "new"), ("home", "default")):
        _, text = schedule(home, "ops", "new", name=name, conversation=target)
        assert f"created task {name}" in text, text
    made = tasks(home)
    assert sorted(made) == ["first", "fresh", "home", "mine"], made
    assert made["mine"]["conversation"] == mine and made["fresh"]["conversation"] == "new"
