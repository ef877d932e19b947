"""gateway/ledger.py: settled ledger rows are deleted once past their retention period.

gateway.db kept every message's text and reply for ever: a gateway running for months grew its
file without bound. Rows that settled (delivered, failed, denied) more than `RETENTION_S` ago now
go, a short transaction at a time, at the gateway's start and hourly; a row not settled, the newest
row of each chat and a batch with a message still open stay, and a recent id is still recognised.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from gateway.ledger import RETENTION_DAYS_ENV, RETENTION_S, Ledger, UpdateKey, prune_settled, retention_s
from tests.fakes.fakechat import FakeChat
from tests.support.cli import cli_env
from tests.support.gateway import channel_server, fakechat_home
from tests.support.wait import wait_for

DAY = 86400.0
NOW = 1_700_000_000.0
OLD = NOW - 40 * DAY
RECENT = NOW - 1 * DAY


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(n: str, channel: str = "telegram", account: str = "main") -> UpdateKey:
    return UpdateKey(channel, account, n)


def put(ledger: Ledger, clock: Clock, k: UpdateKey, chat: str, state: str, at: float) -> None:
    """A row moved to `state` through the ledger's own transitions, all at time `at`."""
    clock.now = at
    ledger.record(k, chat=chat, sender="ann", payload={"text": f"message {k.message_id}"})
    if state == "received":
        return
    if state in ("denied", "held"):
        ledger.decide(k, "deny" if state == "denied" else "pair", "test")
        return
    ledger.decide(k, "allow", "test")
    if state == "failed":
        ledger.mark_failed(k, "test")
    elif state in ("submitted", "finished", "delivered"):
        ledger.mark_submitted(k, f"turn-{k.message_id}")
        if state in ("finished", "delivered"):
            ledger.mark_finished(k, "the reply")
        if state == "delivered":
            ledger.mark_delivered(k, ["r1"])


def names(ledger: Ledger) -> set[str]:
    return {row[0] for row in ledger.connection.execute("SELECT message_id FROM ledger")}


@pytest.fixture
def ledger(tmp_path: Path) -> tuple[Ledger, Clock]:
    clock = Clock(NOW)
    return Ledger.open(tmp_path / "channels" / "gateway.db", clock), clock


def test_old_settled_rows_go_and_the_rest_stay(ledger: tuple[Ledger, Clock]) -> None:
    led, clock = ledger
    for n, state in enumerate(("delivered", "failed", "denied"), 1):
        put(led, clock, key(f"old-{state}"), "c1", state, OLD + n)
    for n, state in enumerate(("received", "allowed", "held", "submitted", "finished"), 10):
        put(led, clock, key(f"open-{state}"), "c1", state, OLD + n)
    # another account's rows of the same chat id are another chat
    put(led, clock, key("other-old", account="second"), "c1", "delivered", OLD + 15)
    put(led, clock, key("other-new", account="second"), "c1", "delivered", OLD + 16)
    put(led, clock, key("alone"), "c2", "delivered", OLD + 17)  # old, but the newest (only) row of c2
    put(led, clock, key("late"), "c1", "held", OLD + 20)  # kept behind a pairing for 40 days...
    # a debounced batch whose first message is still open: its settled member stays with it
    put(led, clock, key("head"), "c3", "allowed", OLD + 30)
    put(led, clock, key("member"), "c3", "allowed", OLD + 31)
    led.assign_batch([key("head"), key("member")])
    led.mark_submitted(key("head"), "turn-b")
    led.mark_submitted(key("member"), "turn-b")
    led.mark_finished(key("member"), "")
    led.mark_delivered(key("member"), [])
    put(led, clock, key("recent"), "c1", "delivered", RECENT)  # the newest of c1
    put(led, clock, key("c3-new"), "c3", "delivered", RECENT)
    clock.now = RECENT
    led.refuse(key("late"), "pairing denied")  # ...and denied yesterday: settled recently

    before = NOW - RETENTION_S
    after: int | None = 0
    pruned = 0
    while after is not None:  # three rows at a time: the cursor goes on where the last batch stopped
        deleted, after = led.prune(before, after=after, scan=3)
        pruned += deleted

    gone = {"old-delivered", "old-failed", "old-denied", "other-old"}
    assert pruned == len(gone)
    assert names(led) == {
        "open-received",
        "open-allowed",
        "open-held",
        "open-submitted",
        "open-finished",
        "recent",
        "alone",
        "late",
        "head",
        "member",
        "c3-new",
        "other-new",
    }
    # the resume queries still see every open row
    assert {e.key.message_id for e in led.to_decide() + led.to_submit() + led.in_flight() + led.to_deliver()} == {
        "open-received",
        "open-allowed",
        "open-submitted",
        "open-finished",
        "head",
    }
    assert [e.key.message_id for e in led.batch_of(led.get(key("head")))] == ["head", "member"]  # type: ignore[arg-type]


async def test_a_recent_id_is_still_recognised_after_a_prune(ledger: tuple[Ledger, Clock]) -> None:
    led, clock = ledger
    put(led, clock, key("old"), "c1", "delivered", OLD)
    put(led, clock, key("recent"), "c1", "delivered", RECENT)
    assert await prune_settled(led, NOW - RETENTION_S) == 1
    clock.now = NOW
    entry, created = led.record(key("recent"), chat="c1", sender="ann", payload={"text": "again"})
    assert not created and entry.state == "delivered"  # the redelivery makes no second turn
    assert names(led) == {"recent"}
    assert await prune_settled(led, NOW - RETENTION_S) == 0  # nothing more to do


async def test_a_pass_over_many_rows_goes_in_small_transactions(ledger: tuple[Ledger, Clock]) -> None:
    led, clock = ledger
    for n in range(1200):
        put(led, clock, key(f"m{n}"), f"chat{n % 7}", "delivered", OLD + n)
    put(led, clock, key("newer"), "chat0", "delivered", RECENT)
    commits: list[str] = []
    led.connection.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    assert await prune_settled(led, NOW - RETENTION_S) == 1200 - 6  # chat1..chat6 keep their newest
    led.connection.set_trace_callback(None)
    assert len(commits) >= 3  # 500 rows looked at per transaction


def test_the_retention_period_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RETENTION_DAYS_ENV, raising=False)
    assert retention_s() == RETENTION_S == 30 * DAY
    monkeypatch.setenv(RETENTION_DAYS_ENV, "7")
    assert retention_s() == 7 * DAY
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(RETENTION_DAYS_ENV, bad)
        assert retention_s() == RETENTION_S


def test_the_gateway_prunes_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    real = time.time()
    clock = Clock(real - 40 * DAY)
    led = Ledger.open(home / "channels" / "gateway.db", clock)
    put(led, clock, key("ancient", "fakechat"), "dm1", "delivered", real - 40 * DAY)
    put(led, clock, key("yesterday", "fakechat"), "dm1", "delivered", real - DAY)
    led.close()
    with FakeChat() as chat:
        fakechat_home(home, chat)
        with channel_server(home, env=cli_env(home)) as srv:

            def pruned() -> bool:
                conn = sqlite3.connect(f"file:{srv.home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
                try:
                    rows = conn.execute("SELECT message_id FROM ledger ORDER BY id").fetchall()
                finally:
                    conn.close()
                return rows == [("yesterday",)]

            wait_for(pruned, timeout=20, what="the gateway's prune at start")
