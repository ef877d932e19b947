"""`appserver channels status` says why a reply failed (session 23).

docs/channels.md ("Replies") promises that a reply the receiver refused is recorded "with the status
and the start of your answer (visible in `appserver channels status`)", but status showed only the
counters. It now shows each account's most recent failed ledger row: its reason (trimmed, controls
escaped) and when, in the table and in --json. Real CLI, gateway.db on disk written by the ledger.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.db import default_path, open_db
from gateway.ledger import Ledger, UpdateKey
from gateway.status import AccountStatus, StatusBoard
from tests.support.cli import run_cli

pytestmark = pytest.mark.timeout(60)

OLD_REASON = "delivery failed: reply_url answered 500: an older failure"
# a receiver's answer may hold anything: a terminal title sequence, a newline, and a lot of it
NEW_REASON = "delivery failed: reply_url answered 404: \x1b]0;pwned\x07not\nhere " + "x" * 2000


def _fail(ledger: Ledger, message_id: str, reason: str) -> None:
    key = UpdateKey("webhook", "main", message_id)
    ledger.record(key, chat="c", sender="s")
    ledger.decide(key, "allow", "open")
    ledger.mark_submitted(key, f"turn-{message_id}")
    ledger.mark_finished(key, "the answer")
    ledger.mark_failed(key, reason)


def _seed(home: Path, now: float) -> None:
    at = [now - 600]
    conn = open_db(default_path(home))
    try:
        ledger = Ledger(conn, clock=lambda: at[0])
        _fail(ledger, "older", OLD_REASON)
        at[0] = now - 125
        _fail(ledger, "dl-404", NEW_REASON)
        at[0] = now - 10  # a later success does not hide the last failure
        key = UpdateKey("webhook", "main", "ok")
        ledger.record(key, chat="c", sender="s")
        ledger.decide(key, "allow", "open")
        StatusBoard(conn).save([AccountStatus("webhook", "main", "running", None, now - 10, now - 10, 3, 3, 0, 2, now)])
    finally:
        conn.close()


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Path, float]:
    """A home with two webhook accounts, and the time its failures were written relative to."""
    home = tmp_path / "home"
    for name, port in (("main", "18791"), ("spare", "18792")):
        added = run_cli(home, "channels", "add", "webhook", name, "--set", f"listen=127.0.0.1:{port}", "--enable")
        assert added.code == 0, added.err
    now = time.time()
    _seed(home, now)
    return home, now


def test_status_shows_each_accounts_last_failure_and_why(seeded: tuple[Path, float]) -> None:
    home, _ = seeded
    got = run_cli(home, "channels", "status")
    assert got.code == 0, got.err
    header = next(line for line in got.out.splitlines() if line.startswith("CHANNEL"))
    assert header.rstrip().endswith("LAST FAILURE")
    rows = {line.split()[1]: line for line in got.out.splitlines() if line.startswith("webhook")}
    cell = rows["main"][header.index("LAST FAILURE") :]
    assert cell.startswith("2m ago: delivery failed: reply_url answered 404: \\x1b]0;pwned\\x07not\\x0ahere xxx"), cell
    assert cell.endswith("…") and len(cell) < 200, cell  # trimmed, not 2,000 characters
    assert "\x1b" not in got.out and "\x07" not in got.out  # escaped, never acted on by the terminal
    assert rows["spare"].rstrip().endswith("-")


def test_status_json_has_the_last_failure(seeded: tuple[Path, float]) -> None:
    home, now = seeded
    got = run_cli(home, "channels", "status", "--json")
    assert got.code == 0, got.err
    accounts = {a["account"]: a for a in got.json()["accounts"]}
    last = accounts["main"]["last_failure"]
    assert last["message_id"] == "dl-404" and last["at"] == pytest.approx(now - 125)
    assert last["reason"].startswith(NEW_REASON[:60]) and last["reason"].endswith("…")
    assert len(last["reason"]) <= 1000
    assert accounts["main"]["failures"] == 2
    assert accounts["spare"]["last_failure"] is None
