"""A cron delivery that failed counts in `appserver channels status` (session 23).

docs/channels.md says a reply that could not be delivered is counted in `channels status`, and a
cron delivery that went out did count (REPLIES), but one that failed counted nowhere: the run log
said `delivery_failed`, while FAILURES stayed 0 and LAST FAILURE `-` (a cron delivery has no ledger
row, and status read the last failure from the ledger only). Now the failed send counts in the
account's failures and is its last failure, kept in its status row, which a restart keeps.

Real `serve`, the real webhook channel and a loopback receiver of its replies that answers 404 (a
permanent failure: refused at the first attempt, no minute of retries), real CLI.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.db import default_path, open_db
from gateway.ledger import Ledger, UpdateKey
from gateway.status import AccountStatus, StatusBoard
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-for-the-webhook"
TARGET = "webhook:home:kitchen"
REASON = "cron delivery to kitchen failed: reply_url answered 404: no such hook"


class Receiver:
    """The app receiving the webhook channel's replies: answers 404 while `refusing`, else 200."""

    def __init__(self) -> None:
        self.refused = 0
        self.accepted = 0
        self.refusing = True
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's API
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    refuse = outer.refusing
                    outer.refused += refuse
                    outer.accepted += not refuse
                body = b"no such hook" if refuse else b""
                self.send_response(404 if refuse else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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


@pytest.fixture()
def home(tmp_path: Path, receiver: Receiver) -> Path:
    home = tmp_path / "home"
    settings = {
        "listen": f"127.0.0.1:{free_port()}",
        "secret_env": "WH_SECRET",
        "reply_url": receiver.url,
        "default_agent": "assistant",
    }
    write_config(home, {"webhook": {"home": settings}}, ["webhook"])
    return home


def _ok(home: Path, *args: str) -> CLIResult:
    r = run_cli(home, *args, env=cli_env(home, WH_SECRET=SECRET))
    assert r.code == 0, (args, r.out, r.err)
    return r


def _events(home: Path, task_id: str) -> list[dict[str, Any]]:
    path = home / "cron-runs" / f"{task_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _deliver_once(home: Path, name: str) -> dict[str, Any]:
    """Add a one-shot task delivering to TARGET and wait for its delivery's verdict in the run log."""
    task = _ok(home, "cron", "add", "--name", name, "--agent", "assistant", "--in", "1s", "--exact",
               "--prompt", f"say {name}", "--deliver", TARGET, "--json").json()  # fmt: skip

    def verdict() -> dict[str, Any] | None:
        return next((e for e in _events(home, str(task["id"])) if e["event"] in ("delivered", "delivery_failed")), None)

    found: dict[str, Any] = wait_for(verdict, 60, f"the delivery of {name}")
    return found


def _account(home: Path) -> dict[str, Any]:
    accounts = _ok(home, "channels", "status", "--json").json()["accounts"]
    found: dict[str, Any] = next(a for a in accounts if (a["channel"], a["account"]) == ("webhook", "home"))
    return found


def _assert_failure_shown(home: Path, failures: int) -> None:
    account = _account(home)
    assert account["failures"] == failures, account
    last = account["last_failure"]
    assert last is not None and last["reason"] == REASON and last["message_id"] is None, last
    table = _ok(home, "channels", "status").out
    header = next(line for line in table.splitlines() if line.startswith("CHANNEL"))
    row = next(line for line in table.splitlines() if line.startswith("webhook"))
    assert row[header.index("FAILURES") :].split()[0] == str(failures), table
    assert row[header.index("LAST FAILURE") :].split(": ", 1)[1].strip() == REASON, table


def test_a_failed_cron_delivery_counts_in_status_is_its_last_failure_and_survives_a_restart(
    home: Path, receiver: Receiver
) -> None:
    """One home and server for two checks that used to start their own: (1) a failed cron delivery
    counts in status and is its last failure, a later success leaving it shown; (2) that last failure
    survives a restart of the server and its gateway."""
    env = cli_env(home, WH_SECRET=SECRET)
    # (1) counted, and the last failure
    with channel_server(home, env=env):
        failed = _deliver_once(home, "refused")
        assert failed["event"] == "delivery_failed" and "reply_url answered 404" in failed["error"], failed
        assert receiver.refused == 1
        _assert_failure_shown(home, failures=1)
        receiver.refusing = False
        delivered = _deliver_once(home, "accepted")
        assert delivered["event"] == "delivered", delivered
        # a later success counts (saved within a second), and leaves the last failure shown
        wait_for(lambda: _account(home)["replies"] == 1, 10, "the delivered reply to be counted")
    _assert_failure_shown(home, failures=1)
    # (2) the last failure of a cron delivery survives a restart
    restarted = time.time()
    with channel_server(home, env=env):
        # the restarted gateway has written its row from memory (state running, after the restart)
        wait_for(lambda: (a := _account(home))["state"] == "running" and a["updated_at"] > restarted, 30, "a save")
        _assert_failure_shown(home, failures=1)


@pytest.mark.parametrize("newest", ["ledger", "status row"])
def test_status_shows_the_newer_of_the_ledgers_failure_and_the_status_rows(tmp_path: Path, newest: str) -> None:
    """A failed reply (a ledger row) and a failed cron delivery (the status row): the later one shows."""
    home = tmp_path / "home"
    _ok(home, "channels", "add", "webhook", "home", "--set", f"listen=127.0.0.1:{free_port()}", "--enable")
    now = time.time()
    reply_at, cron_at = (now - 10, now - 100) if newest == "ledger" else (now - 100, now - 10)
    conn = open_db(default_path(home))
    try:
        ledger = Ledger(conn, clock=lambda: reply_at)
        key = UpdateKey("webhook", "home", "m1")
        ledger.record(key, chat="c", sender="s")
        ledger.decide(key, "allow", "open")
        ledger.mark_failed(key, "delivery failed: reply_url answered 410: gone")
        status = AccountStatus("webhook", "home", "running", None, None, None, 1, 1, 0, 2, now)
        StatusBoard(conn).note_failure(status, REASON, cron_at)
    finally:
        conn.close()
    last = _account(home)["last_failure"]
    if newest == "ledger":
        assert last == {"at": reply_at, "message_id": "m1", "reason": "delivery failed: reply_url answered 410: gone"}
    else:
        assert last == {"at": cron_at, "message_id": None, "reason": REASON}
