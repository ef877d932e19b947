"""Text from elsewhere never controls the user's terminal: the cron, channels and agents commands.

`cron run` prints the model's reply and the run's reason; `cron show|list|logs` print what crons.json
and the run log hold (written by the agent's `schedule` tool, by channels and by the model too);
`channels list|status|route list` print a plugin's, a platform's and gateway.db's words; `agents`
prints names and ids from the store, which any client of the server may have written. Each shows
their controls as escapes (appserver/cli/safetext.py), and `--json` keeps the values exact.
See tests/test_cli_terminal_safety.py for the chat, history and run commands.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path, open_db
from gateway.routing import RouteKey, Router
from gateway.status import AccountStatus, StatusBoard
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.gateway import write_config
from tests.test_cli_terminal_safety import EVIL, assert_no_foreign_controls, assert_shown

pytestmark = pytest.mark.timeout(120)

# EVIL without a CR or backspace: what a JSON string in crons.json or config.toml can hold as well.
SHORT = "\x1b]0;T\x07\x9b2J\x1b[31mred"
SHORT_SHOWN = r"\x1b]0;T\x07\x9b2J\x1b[31mred"


def cli(home: Path, *args: str) -> CLIResult:
    """The real CLI in a pipe (what a log or `| less -R` gets): every byte checked."""
    result = run_cli(home, *args, env=cli_env(home))
    assert_no_foreign_controls((result.out + result.err).encode())
    return result


def ok(home: Path, *args: str) -> CLIResult:
    result = cli(home, *args)
    assert result.code == 0, (args, result.out, result.err)
    return result


def edit_crons(home: Path, task_id: str, **values: Any) -> None:
    """A hand edit (or the schedule tool's write) of one task in crons.json."""
    path = home / "crons.json"
    data = json.loads(path.read_text())
    for task in data["tasks"]:
        if task["id"] == task_id:
            task.update(values)
    path.write_text(json.dumps(data))


def write_run_log(home: Path, task_id: str, *records: dict[str, Any]) -> None:
    runs = home / "cron-runs"
    runs.mkdir(exist_ok=True)
    at = "2026-01-02T03:04:05+00:00"
    lines = [json.dumps({"at": at, "task_id": task_id, **r}) for r in records]
    (runs / f"{task_id}.jsonl").write_text("\n".join(lines) + "\n")


def test_cron_run_shows_the_models_text_with_its_controls_escaped(tmp_path: Path) -> None:
    """The echo model repeats the task's prompt: the reply `cron run` prints is the model's text."""
    home = tmp_path / "home"
    ok(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h", "--prompt", EVIL)
    shown = ok(home, "cron", "run", "t")
    assert_shown(shown.out)
    as_json = ok(home, "cron", "run", "t", "--json")
    blocks = as_json.json()["snapshot"]["blocks"]
    assert any(EVIL in str(b.get("text")) for b in blocks), blocks  # the exact value
    assert "\x9b" not in as_json.out and "\x1b" not in as_json.out


def test_cron_show_list_and_logs_show_stored_text_with_its_controls_escaped(tmp_path: Path) -> None:
    home = tmp_path / "home"
    task_id = ok(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h", "--prompt", "p",
                 "--json").json()["id"]  # fmt: skip
    bad_id = ok(home, "cron", "add", "--name", "u", "--agent", "assistant", "--every", "1h", "--prompt", "p",
                "--json").json()["id"]  # fmt: skip
    # As the schedule tool may write them: a prompt and a last error from the model's words.
    edit_crons(home, task_id, prompt=EVIL, last_error=SHORT, last_error_at="2026-01-02T03:04:05+00:00")
    edit_crons(home, bad_id, id=SHORT, misfire="sometimes")  # invalid: said (by its id), not scheduled

    shown = ok(home, "cron", "show", "t")
    assert_shown(shown.out)
    assert SHORT_SHOWN in shown.out
    listed = ok(home, "cron", "list")
    assert r"\x1b]0;T\x07" in listed.out  # the last error's start, in its column
    assert SHORT_SHOWN in listed.err, listed.err  # the invalid task's warning names it
    assert json.loads(ok(home, "cron", "show", "t", "--json").out)["prompt"] == EVIL

    write_run_log(
        home,
        task_id,
        {"event": "fired", "occurrence": 1, "scheduled_for": SHORT},
        {"event": "submitted", "occurrence": 1, "turn_id": SHORT},
        {"event": "outcome", "occurrence": 1, "turn_id": "turn_1", "status": "failed", "error": EVIL},
        {"event": "delivery_failed", "occurrence": 1, "target": "webhook:main:hall", "error": SHORT},
        {"event": "delivered", "occurrence": 1, "turn_id": "turn_1", "target": "x:y:z", "remote_ids": [SHORT]},
        {"event": "missed", "scheduled_for": "2026-01-02T03:04:05+00:00", "reason": SHORT},
        {"event": "fire_failed", "occurrence": 2, "error": SHORT},
        {"event": SHORT, "error": SHORT},
    )
    logs = ok(home, "cron", "logs", "t")
    assert_shown(logs.out)
    assert logs.out.count(SHORT_SHOWN) >= 8, logs.out
    records = ok(home, "cron", "logs", "t", "--json").json()
    assert records[2]["error"] == EVIL and records[3]["error"] == SHORT


def test_channels_list_status_and_routes_show_outside_text_with_its_controls_escaped(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # An account whose settings the gateway refuses (written by hand): the reason quotes the value.
    write_config(home, {"webhook": {"main": {"listen": "127.0.0.1:1", "dm_policy": SHORT}}}, ["webhook"])
    # A user plugin whose manifest names an entry outside its folder: its error quotes the manifest.
    plugin = home / "channels" / "evil"
    plugin.mkdir(parents=True)
    (plugin / "channel.json").write_text(json.dumps({"id": "evil", "entry": "../" + SHORT + ":Plugin"}))
    # What the gateway recorded: a platform's refusal as the account's reason, a route to an agent
    # written into gateway.db by another tool.
    conn = open_db(default_path(home))
    try:
        StatusBoard(conn).save(
            [
                AccountStatus(
                    "webhook", "main", "error", f"the platform said: {EVIL}", None, None, 0, 0, 0, 0, time.time()
                )
            ]
        )
        Router(conn).add(RouteKey.of("webhook", "main", "hall", None), SHORT, SHORT)
    finally:
        conn.close()

    listed = ok(home, "channels", "list")
    assert listed.out.count(SHORT_SHOWN) >= 2, listed.out  # the plugin's error and the account's, below the table
    assert json.loads(ok(home, "channels", "list", "--json").out)["channels"]
    status = ok(home, "channels", "status")
    assert r"\x1b]0;PWNED-TITLE\x07" in status.out and r"x\x0dOVERWRITE\x08!" in status.out, status.out
    as_json = ok(home, "channels", "status", "--json").json()
    assert as_json["accounts"][0]["reason"] == f"the platform said: {EVIL}"
    routes = ok(home, "channels", "route", "list")
    assert routes.out.count(SHORT_SHOWN) == 2, routes.out
    assert ok(home, "channels", "route", "list", "--json").json()[0]["agent"] == SHORT


def test_agents_show_names_from_the_store_exactly_but_the_system_prompt_as_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made = ok(home, "agents", "create", "--name", "helper", "--system", "line one\n\tline two", "--json").json()
    conn = sqlite3.connect(home / "appserver.db")  # another client of a shared store, an older version
    try:
        conn.execute("UPDATE agents SET name = ? WHERE id = ?", (EVIL, made["id"]))
        conn.commit()
    finally:
        conn.close()
    listed = ok(home, "agents", "list")
    assert_shown(listed.out)
    shown = ok(home, "agents", "show", made["id"])
    assert_shown(shown.out)
    assert "system: line one\n\tline two" in shown.out  # newline and tab kept; only controls escaped
    assert ok(home, "agents", "show", made["id"], "--json").json()["name"] == EVIL
    deleted = ok(home, "agents", "delete", made["id"])
    assert_shown(deleted.out)
