"""Per-account liveness and counters in gateway.db, read by `appserver channels status` and /readyz.

The gateway child writes here (one row per account); the CLI reads it whether or not a server runs,
so `channels status` shows the last known state even after a crash. The row also keeps the account's
last failed send that has no ledger row (a cron delivery): the ledger's `failed` rows say the rest.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import astuple, dataclass, replace
from typing import Literal

from gateway.db import transaction
from gateway.sqlstore import scope_of

Counter = Literal["messages_in", "turns", "replies", "failures"]
FAILURE_REASON_MAX = 2000  # a receiver's answer is part of the reason: keep the row small

_UPSERT = (
    "INSERT INTO account_status (channel, account, state, reason, last_inbound, last_outbound,"
    " messages_in, turns, replies, failures, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
    " ON CONFLICT(channel, account) DO UPDATE SET state=excluded.state, reason=excluded.reason,"
    " last_inbound=excluded.last_inbound, last_outbound=excluded.last_outbound,"
    " messages_in=excluded.messages_in, turns=excluded.turns, replies=excluded.replies,"
    " failures=excluded.failures, updated_at=excluded.updated_at"
)


@dataclass(frozen=True, slots=True)
class AccountStatus:
    channel: str
    account: str
    state: str
    reason: str | None
    last_inbound: float | None
    last_outbound: float | None
    messages_in: int
    turns: int
    replies: int
    failures: int
    updated_at: float

    def to_json(self) -> dict[str, object]:
        return {
            "channel": self.channel,
            "account": self.account,
            "state": self.state,
            "reason": self.reason,
            "last_inbound": self.last_inbound,
            "last_outbound": self.last_outbound,
            "messages_in": self.messages_in,
            "turns": self.turns,
            "replies": self.replies,
            "failures": self.failures,
            "updated_at": self.updated_at,
        }


class StatusBoard:
    """Owner of the `account_status` table. The gateway keeps live counters in memory
    (`AccountStatus` values) and saves them here in one transaction per second or per state change,
    so a busy account costs no write per message."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def save(self, statuses: list[AccountStatus]) -> None:
        """Write the rows from memory; the last failure (`note_failure`) is left as it is."""
        with transaction(self._conn, durable=False) as c:
            c.executemany(_UPSERT, [astuple(s) for s in statuses])

    def note_failure(self, status: AccountStatus, reason: str, at: float) -> None:
        """Save the account's row with `reason` as its last failure, at once and durably: a failed
        send that no ledger row records (a cron delivery) is known only here, and failures are rare."""
        with transaction(self._conn) as c:
            c.execute(_UPSERT, astuple(status))
            c.execute(
                "UPDATE account_status SET last_failure_at=?, last_failure_reason=? WHERE channel=? AND account=?",
                (at, reason[:FAILURE_REASON_MAX], status.channel, status.account),
            )

    def last_failures(self) -> dict[tuple[str, str], tuple[str, float]]:
        """Per (channel, account), the last failure noted here: (reason, when)."""
        rows = self._conn.execute(
            "SELECT channel, account, last_failure_reason, last_failure_at FROM account_status"
            " WHERE last_failure_at IS NOT NULL"
        ).fetchall()
        return {(channel, account): (reason or "", at) for channel, account, reason, at in rows}

    def all(self) -> list[AccountStatus]:
        rows = self._conn.execute(
            "SELECT channel, account, state, reason, last_inbound, last_outbound, messages_in, turns, replies,"
            " failures, updated_at FROM account_status ORDER BY channel, account"
        ).fetchall()
        return [AccountStatus(*row) for row in rows]

    def get(self, channel: str, account: str) -> AccountStatus | None:
        return next((s for s in self.all() if (s.channel, s.account) == (channel, account)), None)

    def mark_unconfigured(self, keep: set[tuple[str, str]]) -> None:
        """Accounts no longer configured show as stopped (their counters stay for the record)."""
        if scope_of(self._conn) is not None:
            return  # a database other servers' gateways share: the rows of accounts not run here are theirs
        stale = [s for s in self.all() if (s.channel, s.account) not in keep and s.state != "stopped"]
        self.save([replace(s, state="stopped", reason="not configured", updated_at=time.time()) for s in stale])
