"""A `--deliver` target is taken only when the gateway can deliver to it: `channel:account:chat`
or `channel:account:chat:thread`, no part empty (gateway/app.py `deliver_text`). Through the real
CLI (`cron add`) and a crons.json edited by hand (the task is kept as invalid and reported, like a
task with any other unusable field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cron.schedule import ScheduleError
from cron.store import validate_deliver
from tests.support.cli import CLIResult, cli_env, run_cli

ACCOUNT = {"APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__HOME__REPLY_URL": "http://127.0.0.1:9/replies"}
REFUSED = [
    "webhook:home:kit:chen:x",  # 5 parts
    "webhook:home:kitchen:",  # an empty thread
    "webhook:home::thread",  # an empty chat
    "webhook:home:",
    "webhook:home",
    ":home:kitchen",
    "webhook::kitchen",
    "webhook:home:a:b:c:d",
    "webhook:home:c\x1b[2J",  # a control character: no chat is named so
    "webhook:home:kitchen:t\x00",
    "webhook:home:k\ud800",  # a lone surrogate
]
TAKEN = ["webhook:home:kitchen", "webhook:home:kitchen:thread-1", "telegram:bot1:-100123:42"]


@pytest.mark.parametrize("target", REFUSED)
def test_validate_deliver_refuses_what_the_gateway_cannot_deliver_to(target: str) -> None:
    with pytest.raises(ScheduleError, match="invalid deliver target"):
        validate_deliver(target)


@pytest.mark.parametrize("target", TAKEN)
def test_validate_deliver_takes_three_or_four_parts(target: str) -> None:
    assert validate_deliver(target) == target


def add(home: Path, name: str, target: str) -> CLIResult:
    return run_cli(home, "cron", "add", "--name", name, "--agent", "assistant", "--every", "1h", "--prompt", "p",
                   "--deliver", target, env=cli_env(home, **ACCOUNT))  # fmt: skip


def test_cron_add_refuses_an_undeliverable_target_and_writes_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for target in ("webhook:home:kit:chen:x", "webhook:home:kitchen:"):
        r = add(home, "t", target)
        lines = r.err.strip().splitlines()
        assert r.code == 1 and len(lines) == 1, (target, r.code, r.err)
        assert lines[0].startswith("error: invalid deliver target") and "channel:account:chat:thread" in lines[0]
    assert not (home / "crons.json").exists() or json.loads((home / "crons.json").read_text())["tasks"] == []
    assert add(home, "ok", "webhook:home:kitchen:thread").code == 0


def test_a_hand_edited_undeliverable_target_makes_the_task_invalid_and_said(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert add(home, "kept", "webhook:home:kitchen").code == 0
    assert add(home, "edited", "webhook:home:hall").code == 0
    path = home / "crons.json"
    path.write_text(path.read_text().replace('"webhook:home:hall"', '"webhook:home:kit:chen:x"'))
    r = run_cli(home, "cron", "list", "--json")
    assert r.code == 0, r.err
    assert [t["name"] for t in json.loads(r.out) if t["state"] != "invalid"] == ["kept"]  # the other is not scheduled
    assert [t["name"] for t in json.loads(r.out) if t["state"] == "invalid"] == ["edited"]
    assert "is invalid and not scheduled" in r.err and "invalid deliver target" in r.err, r.err
    r = run_cli(home, "cron", "show", "edited")  # shown as invalid, with its reason
    assert r.code == 0 and "invalid deliver target 'webhook:home:kit:chen:x'" in r.out, (r.code, r.out, r.err)
    assert "webhook:home:kit:chen:x" in path.read_text()  # kept as it was for the user to fix
