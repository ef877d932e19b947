"""`appserver cron logs` through the real CLI: a run log nothing can be read from is an error, never
"no runs yet"; one with some unreadable lines says so once and shows the rest; delivery records
show their run, target and message ids; and every cron command exits 2 for a task that does not
exist, as `agents show` and `conversations show` do for an id they do not know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cron.runlog import append_run
from tests.support.cli import CLIResult, run_cli


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args)
    assert r.code == 0, (args, r.out, r.err)
    return r


def add(home: Path, name: str) -> str:
    r = ok(home, "cron", "add", "--name", name, "--agent", "assistant", "--every", "1h", "--prompt", "p", "--json")
    return str(r.json()["id"])


def log_path(home: Path, task_id: str) -> Path:
    return home / "cron-runs" / f"{task_id}.jsonl"


def test_a_run_log_nothing_can_be_read_from_fails_in_one_line(home: Path) -> None:
    task_id = add(home, "g")
    ok(home, "cron", "run", "g")
    assert ok(home, "cron", "show", "g", "--json").json()["occurrence"] == 1
    log_path(home, task_id).write_bytes(b"\x8f\x00garbage{\r\x01[not json\n\n42\n")
    for extra in ((), ("--json",)):
        r = run_cli(home, "cron", "logs", "g", *extra)
        assert r.code == 1 and r.out == "", (extra, r.code, r.out, r.err)  # never "no runs yet", never []
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the run log "), r.err
        assert "cannot be read" in lines[0] and str(log_path(home, task_id)) in lines[0], r.err


def test_unreadable_lines_are_said_once_and_the_readable_records_shown(home: Path) -> None:
    task_id = add(home, "g")
    ok(home, "cron", "run", "g")
    path = log_path(home, task_id)
    path.write_bytes(b"torn{\n" + path.read_bytes() + b"[1]\n\xff\xfe\n")
    r = ok(home, "cron", "logs", "g")
    assert [x.split()[3] for x in r.out.splitlines()] == ["fired", "submitted", "outcome"], r.out
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "3 unreadable line(s)" in lines[0], r.err
    r = ok(home, "cron", "logs", "g", "--json")
    assert [rec["event"] for rec in json.loads(r.out)] == ["fired", "submitted", "outcome"]
    assert len(r.err.strip().splitlines()) == 1, r.err


def test_delivery_records_show_the_run_target_and_message_ids(home: Path) -> None:
    task_id = add(home, "g")
    runs = home / "cron-runs"
    append_run(runs, task_id, "delivered", occurrence=3, turn_id="turn_a", target="webhook:main:kitchen",
               remote_ids=["m1", "m2"])  # fmt: skip
    append_run(runs, task_id, "delivery_failed", occurrence=4, turn_id="turn_b", target="webhook:main:hall",
               error="RuntimeError: the gateway is not running")  # fmt: skip
    delivered, failed = ok(home, "cron", "logs", "g").out.splitlines()
    assert delivered.split()[3] == "delivered", delivered
    assert "#3 turn turn_a to webhook:main:kitchen (message ids: m1, m2)" in delivered, delivered
    assert failed.split()[3] == "delivery_failed", failed
    assert "#4 to webhook:main:hall: RuntimeError: the gateway is not running" in failed, failed


@pytest.mark.parametrize(
    "args",
    [
        ("show", "nosuch"),
        ("logs", "nosuch"),
        ("preview", "nosuch"),
        ("enable", "nosuch"),
        ("disable", "nosuch"),
        ("remove", "nosuch"),
        ("run", "nosuch"),
        ("show", "g", "--agent", "someone-else"),
    ],
)
def test_a_task_that_does_not_exist_is_exit_code_2_in_every_command(home: Path, args: tuple[str, ...]) -> None:
    add(home, "g")
    r = run_cli(home, "cron", *args)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1, (args, r.code, r.err)
    assert lines[0].startswith("error: no cron task "), r.err


def test_cron_add_for_an_unknown_agent_is_exit_code_2(home: Path) -> None:
    r = run_cli(home, "cron", "add", "--name", "g", "--agent", "nosuch", "--every", "1h", "--prompt", "p")
    assert r.code == 2 and r.err.strip() == "error: unknown agent 'nosuch'", (r.code, r.err)
    assert run_cli(home, "agents", "show", "nosuch").code == 2  # what the agents commands answer
