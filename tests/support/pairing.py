"""Slack pairing helpers of the revoke tests: a sender paired, a turn of theirs paused on an approval
with one message queued behind it, and the ledger's and the revoke count's view of it."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path

from appserver.client import ProtocolClient
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


async def paused_conversation(client: ProtocolClient, agent: str = "careful") -> str:
    """The conversation of the one turn of `agent` waiting for an approval."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for conv in (await client.request({"type": "list_conversations", "agent": agent}))["conversations"]:
            state = await client.request({"type": "subscribe", "conversation": conv["id"]})
            if state.get("pending_approvals"):
                return str(conv["id"])
        await asyncio.sleep(0.05)
    raise AssertionError("no turn waits for an approval")


async def until_idle(client: ProtocolClient, conversation: str) -> None:
    """Until the conversation has no turn running or queued (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        state = await client.request({"type": "subscribe", "conversation": conversation})
        if state.get("state") == "idle" and not state.get("active_turn") and not state.get("queued"):
            return
        assert time.monotonic() < deadline, f"the conversation did not go idle: {state}"
        await asyncio.sleep(0.05)
