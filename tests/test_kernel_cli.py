"""Issue 2 acceptance through the real CLI and a real `serve` process."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.zygote_client import appserver_popen


def test_run_hello_json(cli) -> None:
    r = cli("run", "--agent", "assistant", "--json", "hello")
    assert r.code == 0, r.err
    data = r.json()
    assert data["status"] == "completed"
    assert data["stop_reason"] == "end_turn"
    assert data["text"] == "echo: hello"
    assert data["conversation_id"].startswith("conv_")


def test_history_is_server_state_across_processes(cli) -> None:
    first = cli("run", "--conversation", "new", "--json", "one").json()
    conv = first["conversation_id"]
    assert cli("run", "--conversation", conv, "two").code == 0
    third = cli("run", "--conversation", conv, "--json", "/recall").json()
    assert third["text"] == "one | two"
    hist = cli("conversations", "history", conv, "--json").json()
    assert [m["role"] for m in hist] == ["user", "assistant"] * 3


def test_approval_answered_by_another_process(cli) -> None:
    assert cli("agents", "create", "--name", "careful", "--tool", "clock=ask").code == 0
    paused = cli("run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}")
    assert paused.code == 0, paused.err
    data = paused.json()
    assert data["status"] == "awaiting" and data["stop_reason"] == "requires_approval"
    assert len(data["pending"]) == 1
    call_id = data["pending"][0]["call_id"]
    resumed = cli(
        "run", "--agent", "careful", "--conversation", data["conversation_id"], "--approve", call_id, "--json"
    )
    assert resumed.code == 0, resumed.err
    out = resumed.json()
    assert out["status"] == "completed" and out["stop_reason"] == "end_turn"
    assert out["text"].startswith("clock -> 20")
    # a second answer to the same call is refused with a clear message
    again = cli("run", "--agent", "careful", "--conversation", data["conversation_id"], "--approve", call_id)
    assert again.code != 0 and "error:" in again.err


def test_denial_is_readable_by_the_model(cli) -> None:
    cli("agents", "create", "--name", "careful", "--tool", "clock=ask")
    data = cli("run", "--agent", "careful", "--conversation", "new", "--json", "/call clock {}").json()
    call_id = data["pending"][0]["call_id"]
    out = cli(
        "run",
        "--agent",
        "careful",
        "--conversation",
        data["conversation_id"],
        "--deny",
        call_id,
        "--reason",
        "not now",
        "--json",
    ).json()
    assert out["status"] == "completed"
    assert "denied" in out["text"] and "not now" in out["text"]


def test_kill9_mid_turn_is_settled_as_interrupted(home: Path, cli) -> None:
    conv = cli("run", "--conversation", "new", "--json", "first").json()["conversation_id"]
    proc = appserver_popen(
        ["run", "--conversation", conv, "/slow 300"],
        env=cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    db = home / "appserver.db"
    deadline = time.monotonic() + 20
    draft = None
    while time.monotonic() < deadline and draft is None:
        time.sleep(0.1)
        with sqlite3.connect(db) as c:
            row = c.execute("SELECT draft FROM turns WHERE status='running'").fetchone()
        if row and row[0] and len(json.loads(row[0])["text"].split()) >= 5:
            draft = json.loads(row[0])["text"]
    assert draft, "the running turn never checkpointed its text"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    after = cli("run", "--conversation", conv, "--json", "/recall")
    assert after.code == 0, after.err
    assert after.json()["text"] == "first | /slow 300"
    hist = cli("conversations", "history", conv, "--json").json()
    interrupted = [m for m in hist if m.get("completion_status") == "interrupted"]
    assert len(interrupted) == 1
    assert interrupted[0]["content"].startswith("w1 w2 w3 w4 w5")
    with sqlite3.connect(db) as c:
        statuses = [r[0] for r in c.execute("SELECT status FROM turns ORDER BY rowid")]
    assert statuses == ["completed", "interrupted", "completed"]


def _db_dump(home: Path) -> list:
    with sqlite3.connect(home / "appserver.db") as c:
        return [
            list(c.execute(f"SELECT * FROM {t}"))
            for t in ("agents", "conversations", "turns", "messages", "pending_calls")
        ]


def test_bad_input_is_one_line_error_and_writes_nothing(home: Path, cli) -> None:
    assert cli("agents", "list").code == 0
    before = _db_dump(home)
    for args in (
        ("run", "--agent", "nobody", "hi"),
        ("run", "--conversation", "conv_doesnotexist", "hi"),
        ("agents", "create", "--name", "x", "--tool", "clock=sometimes"),
        ("agents", "create", "--name", "x", "--tool", "justaname"),
        ("agents", "create", "--name", "x", "--tool", "shel=ask"),  # a typo: it would govern nothing
        ("agents", "update", "assistant", "--tool", "nosuch=allow"),
        ("agents", "create", "--name", "x", "--model", "gpt-4o"),
        ("agents", "create", "--name", "x", "--model", "nosuchprovider:model"),
        ("agents", "update", "assistant", "--model", "bad model"),
        ("run", "--approve", "call_nope"),
        ("run", "--reason", "because", "hi"),  # a reason with no --deny was ignored, silently
    ):
        r = cli(*args)
        assert r.code != 0, args
        lines = [line for line in r.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.err)
    assert _db_dump(home) == before


def test_agents_crud_json(cli) -> None:
    created = cli(
        "agents",
        "create",
        "--name",
        "helper",
        "--model",
        "openai:gpt-4o-mini",
        "--system",
        "be brief",
        "--tool",
        "shell=ask",
        "--json",
    ).json()
    assert created["tools"] == {"shell": "ask"} and created["model"] == "openai:gpt-4o-mini"
    shown = cli("agents", "show", "helper", "--json").json()
    assert shown["id"] == created["id"]
    updated = cli("agents", "update", created["id"], "--system", "be kind", "--tool", "clock=deny", "--json").json()
    assert updated["system"] == "be kind" and updated["tools"] == {"shell": "ask", "clock": "deny"}
    names = {a["name"] for a in cli("agents", "list", "--json").json()}
    assert names == {"assistant", "helper"}
    assert cli("agents", "delete", "helper").code == 0
    assert cli("agents", "show", "helper").code != 0


def test_serve_health_server_json_and_sigterm(home: Path) -> None:
    sp = start_serve(home)
    try:
        assert httpx.get(sp.url + "/healthz", timeout=5).json() == {"status": "ok"}
        ready = httpx.get(sp.url + "/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        info = json.loads((home / "server.json").read_text())
        assert info["pid"] == sp.proc.pid and info["url"] == sp.url
        # `run` never races a live server on the same home: it runs the turn through the server
        r = run_cli(home, "run", "--json", "hello")
        assert r.code == 0, r.err
        data = r.json()
        assert data["status"] == "completed" and data["text"] == "echo: hello"
        assert data["conversation_id"].startswith("conv_")
    finally:
        code = sp.stop(signal.SIGTERM)
    assert code == 0
    assert not (home / "server.json").exists()
    # and with the server gone, run works again
    assert run_cli(home, "run", "hello").code == 0
