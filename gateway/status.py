"""Per-account liveness and counters in gateway.db, read by `appserver channels status` and /readyz.

The gateway child writes here (one row per account); the CLI reads it whether or not a server runs,
so `channels status` shows the last known state even after a crash.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import astuple, dataclass, replace
from typing import Literal

from gateway.db import transaction

Counter = Literal["messages_in", "turns", "replies", "failures"]


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
        with transaction(self._conn, durable=False) as c:
            c.executemany(
                "INSERT INTO account_status (channel, account, state, reason, last_inbound, last_outbound,"
                " messages_in, turns, replies, failures, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT(channel, account) DO UPDATE SET state=excluded.state, reason=excluded.reason,"
                " last_inbound=excluded.last_inbound, last_outbound=excluded.last_outbound,"
                " messages_in=excluded.messages_in, turns=excluded.turns, replies=excluded.replies,"
                " failures=excluded.failures, updated_at=excluded.updated_at",
                [astuple(s) for s in statuses],
            )

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
        stale = [s for s in self.all() if (s.channel, s.account) not in keep and s.state != "stopped"]
        self.save([replace(s, state="stopped", reason="not configured", updated_at=time.time()) for s in stale])
