"""Slack pairing helpers of the revoke tests: a sender paired, a turn of theirs paused on an approval
with one message queued behind it, and the ledger's and the revoke count's view of it."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from gateway.db import default_path
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer
from tests.support.wait import wait_for


def ledger_row(home: Path, ts: str) -> tuple[str, str | None] | None:
    """(state, reason) of the ledger row of the Slack message `ts` (keyed `channel:ts`)."""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, reason FROM ledger WHERE message_id LIKE ?", (f"%:{ts}",)).fetchone()
    finally:
        conn.close()
    return (str(row[0]), row[1]) if row else None


def settled_row(home: Path, ts: str, timeout: float, what: str) -> tuple[str, str | None]:
    """The row of `ts` once it is failed or delivered."""
    found = wait_for(lambda: (r := ledger_row(home, ts)) and r[0] in ("failed", "delivered") and r, timeout, what)
    return tuple(found)  # type: ignore[return-value]


def revoke_counts(home: Path) -> tuple[int, int]:
    """(made, applied) of gateway.db's `pairing_revokes`: what `pairing revoke` waits on."""
    conn = sqlite3.connect(f"file:{default_path(home)}?mode=ro", uri=True)
    try:
        made, applied = conn.execute("SELECT made, applied FROM pairing_revokes").fetchone()
    finally:
        conn.close()
    return int(made), int(applied)


def pairing_code(slack: FakeSlack, user: str, dm: str) -> str:
    """The code the gateway gives `user`, a stranger writing in the DM `dm`."""
    slack.inject_dm(user, f"hi from {user}", channel=dm)
    found = re.search(r"approve (\w{8})", slack.wait_for_text(dm, lambda t: "pairing code" in t, 30).text)
    assert found, slack.messages(dm)
    return found.group(1)


def paused_with_one_queued(srv: ChannelServer, slack: FakeSlack, user: str, dm: str, queued: str) -> str:
    """Pair `user`, pause a turn of theirs on an approval (the agent's clock asks) and queue `queued`
    behind it on the server; returns the queued message's ts."""
    assert run_cli(srv.home, "pairing", "approve", pairing_code(slack, user, dm)).code == 0
    slack.wait_for_text(dm, f"echo: hi from {user}", 30)
    slack.inject_dm(user, "/call clock {}", channel=dm)
    slack.wait_for_text(dm, lambda t: "/approve" in t, 30)
    ts = slack.inject_dm(user, queued, channel=dm)
    wait_for(lambda: ledger_row(srv.home, ts) == ("submitted", "dm: approved sender"), 30, "the message queued")
    return ts
