"""A cron run with `--deliver` whose server is killed while the turn waits: the next server records
its outcome (cron.service.CronService.recover_outcomes) and must also deliver its reply, or say in
the run log why not (the task was removed meanwhile). Real `serve` processes, the real webhook
channel and a local receiver of its replies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ROOT, CLIResult, cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for
from tests.support.zygote_client import appserver_popen

SECRET = "s3cr3t-for-the-webhook"


class Receiver:
    """The app that receives the webhook channel's replies (the body of every POST)."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/replies"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def records(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events(home: Path, task_id: str) -> list[str]:
    return [str(r["event"]) for r in records(home, task_id)]


def running_turns(home: Path) -> int:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM turns WHERE status = 'running'").fetchone()[0])
    finally:
        conn.close()


def ok(home: Path, *args: str, env: dict[str, str]) -> CLIResult:
    r = run_cli(home, *args, env=env)
    assert r.code == 0, (args, r.out, r.err)
    return r


def test_a_reply_recovered_after_a_kill_is_delivered_or_the_log_says_why_not(
    tmp_path: Path, receiver: Receiver
) -> None:
    home = tmp_path / "home"
    settings = {
        "listen": f"127.0.0.1:{free_port()}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    env = cli_env(home, WH_SECRET=SECRET)
    ids = {}
    for name, chat in (("kept", "kitchen"), ("dropped", "garage")):
        ids[name] = ok(home, "cron", "add", "--name", name, "--agent", "assistant", "--every", "1h", "--exact",
                       "--conversation", "default", "--prompt", f"say {name}",
                       "--deliver", f"webhook:main:{chat}", "--json", env=env).json()["id"]  # fmt: skip

    with channel_server(home, env=env) as srv:
        gateway = srv.gateway_pid()
        # A slow turn holds the default conversation, so both cron turns queue behind it.
        with open(tmp_path / "slow.out", "wb") as out:
            slow = appserver_popen(["run", "--conversation", "default", "/slow 400"], env=env, cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            wait_for(lambda: running_turns(home) == 1, 10, "the slow turn to run")
            for name in ids:
                run_cli(home, "cron", "run", name, "--timeout", "0.2", env=env)  # queued: no outcome yet
            for name, task_id in ids.items():
                wait_for(lambda task_id=task_id: "submitted" in events(home, task_id), 10, f"{name} submitted")
            assert all("outcome" not in events(home, t) for t in ids.values()), "the cron turns did not queue"
            srv.proc.send_signal(signal.SIGKILL)  # the server dies with both turns queued
            srv.proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.kill(gateway, signal.SIGKILL)  # and its gateway child (no longer its child once orphaned)
        finally:
            slow.kill()
            slow.wait(10)

    ok(home, "cron", "remove", "dropped", env=env)
    with channel_server(home, env=env, ready=False):
        wait_for(lambda: "delivered" in events(home, ids["kept"]), 60, "the recovered reply to be delivered")
        wait_for(lambda: "delivery_failed" in events(home, ids["dropped"]), 60, "the removed task's verdict")

    kept = records(home, ids["kept"])
    assert [r["event"] for r in kept] == ["fired", "submitted", "outcome", "delivered"], kept
    assert kept[2]["status"] == "completed" and kept[3]["target"] == "webhook:main:kitchen", kept
    assert [p["chat"] for p in receiver.posts] == ["kitchen"], receiver.posts  # the removed task's: never sent
    assert "say kept" in receiver.posts[0]["text"], receiver.posts

    dropped = records(home, ids["dropped"])
    assert [r["event"] for r in dropped] == ["fired", "submitted", "removed", "outcome", "delivery_failed"], dropped
    assert dropped[-1]["target"] == "webhook:main:garage" and "removed" in dropped[-1]["error"], dropped


def test_a_run_lost_with_its_server_records_that_its_reply_was_not_delivered(tmp_path: Path) -> None:
    """A turn the dead server accepted but never stored is recorded `lost`; a task that delivers
    its replies also gets the `delivery_failed` saying nothing was sent (no silent gap)."""
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__MAIN__REPLY_URL="http://127.0.0.1:9/replies")
    task_id = ok(home, "cron", "add", "--name", "t", "--agent", "assistant", "--every", "1h", "--prompt", "p",
                 "--deliver", "webhook:main:kitchen", "--json", env=env).json()["id"]  # fmt: skip
    at = "2020-01-01T00:00:00+00:00"  # long before the next server starts
    runs = home / "cron-runs"
    runs.mkdir(exist_ok=True)
    (runs / f"{task_id}.jsonl").write_text(
        json.dumps({"event": "fired", "at": at, "task_id": task_id, "occurrence": 1}) + "\n"
        + json.dumps({"event": "submitted", "at": at, "task_id": task_id, "occurrence": 1, "turn_id": "turn_gone"})
        + "\n"
    )  # fmt: skip
    with channel_server(home, env=env, ready=False):
        wait_for(lambda: "delivery_failed" in events(home, task_id), 20, "the delivery verdict")
    recs = records(home, task_id)
    assert [r["event"] for r in recs] == ["fired", "submitted", "outcome", "delivery_failed"], recs
    assert recs[2]["status"] == "lost" and recs[3]["target"] == "webhook:main:kitchen", recs
