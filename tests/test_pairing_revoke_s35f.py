"""A revoke ends the revoked sender's queued turns at once, and says true things when it cannot
(docs/channels.md, "Pairing" and "Approvals in the chat").

* F2: the gateway saw a revoke only in the loop that also sent the approval and denial notices, each
  awaited inline: one notice waiting out Slack's 429 (Retry-After) held up every revoke that long,
  and the revoked sender's queued turn started when the turn ahead of it ended. Queued turns are now
  refused first; notices go out on their own, in order per chat, once each.
* F1: the gateway looked at gateway.db once a second, so a `pairing revoke` followed at once by the
  end of the turn ahead (cancelled from a desktop client) let the queued turn start: the agent read
  the revoked sender's text. The gateway now notices a change within a tenth of a second (`PRAGMA
  data_version`), and `pairing revoke` waits until the running gateway says it acted on it.
* When the turn still starts first (here: the gateway stopped while it happens), it is cancelled as
  the gateway first sees it, never answered, and its row no longer claims it never started.

Real parts: `appserver serve --channels slack` with slack-bolt against the loopback fake Slack
(tests/fakes/slack_api.py, which answers a 429), the CLI, gateway.db and the store read with sqlite3.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from appserver.cli.pairing import APPLIED_WAIT_S
from appserver.client import ProtocolClient
from gateway.db import default_path, open_db
from gateway.pairing import Pairing
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, end_pending_turn, store_turns, write_config
from tests.support.pairing import pairing_code, paused_conversation, paused_with_one_queued, settled_row, until_idle
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

BEFORE_START = "the sender's access was taken away before the turn started"
AS_IT_STARTED = "the sender's access was taken away as the turn started"
APPROVED = "✅ You're approved. Your messages are on their way to the assistant."


@contextmanager
def _server(tmp_path: Path, slack: FakeSlack) -> Iterator[ChannelServer]:
    """A Slack account under `dm_policy = "pairing"` whose agent asks before its clock tool runs."""
    home = tmp_path / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "pairing", "admins": ["UADM"], "default_agent": "careful"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    with channel_server(
        home, "--channels", "slack", env=cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    ) as srv:
        yield srv


def _revoke_in_place(home: Path, sender: str) -> None:
    """What `pairing revoke` writes, without waiting for the gateway (another process's write)."""
    conn = open_db(default_path(home))
    try:
        assert Pairing(conn).revoke(sender) == 1
    finally:
        conn.close()


def test_a_notice_stuck_behind_a_rate_limit_does_not_hold_up_a_revoke(tmp_path: Path) -> None:
    with FakeSlack() as slack, _server(tmp_path, slack) as srv:
        queued = paused_with_one_queued(srv, slack, "UV", "D-v", "QUEUED-F2 for the agent")
        newcomer = pairing_code(slack, "UN", "D-n")
        slack.fail_next("chat.postMessage", "ratelimited", retry_after=8)  # the newcomer's "You're approved"
        assert run_cli(srv.home, "pairing", "approve", newcomer).code == 0
        wait_for(
            lambda: any(c.status == 429 for c in slack.calls("chat.postMessage", channel="D-n")),
            10,
            "the approval notice to be answered 429",
        )
        revoked = run_cli(srv.home, "pairing", "revoke", "UV")
        assert revoked.code == 0 and "warning" not in revoked.err, revoked.err
        # the notice waits out its Retry-After (8 s): the queued turn is refused meanwhile, still queued
        assert settled_row(srv.home, queued, 2, "the queued message refused while the notice waits") == (
            "failed",
            BEFORE_START,
        )
        asyncio.run(end_pending_turn(srv, "careful", "cancel"))  # the turn ahead ends: nothing may start
        assert store_turns(srv.home, "QUEUED-F2") == 0
        # the notice still goes out, once, after its wait
        slack.wait_for_text("D-n", APPROVED, 30)
        slack.wait_for_text("D-n", "echo: hi from UN", 30)
        time.sleep(1.0)  # a second copy would follow at the gateway's next look
        assert [m.text for m in slack.messages("D-n")].count(APPROVED) == 1
        assert not any("QUEUED-F2" in m.text for m in slack.messages("D-v"))


async def _revoke_then_cancel(srv: ChannelServer, sender: str) -> tuple[CLIResult, float]:
    """`pairing revoke` and, the moment it returns, a desktop client's cancel of the paused turn ahead
    of the sender's queued one; returns the command's result and how long it took."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        conversation = await paused_conversation(client)
        began = time.monotonic()
        revoked = await asyncio.to_thread(run_cli, srv.home, "pairing", "revoke", sender)
        took = time.monotonic() - began
        ack = await client.request({"type": "cancel", "conversation": conversation})
        assert ack.get("type") != "error", ack
        await until_idle(client, conversation)
        return revoked, took
    finally:
        await client.close()


def test_a_revoke_followed_at_once_by_the_end_of_the_turn_ahead_never_starts_the_queued_turn(tmp_path: Path) -> None:
    with FakeSlack() as slack, _server(tmp_path, slack) as srv:
        queued = paused_with_one_queued(srv, slack, "UV", "D-v", "QUEUED-F1 for the agent")
        revoked, took = asyncio.run(_revoke_then_cancel(srv, "UV"))
        assert revoked.code == 0, revoked.err
        assert store_turns(srv.home, "QUEUED-F1") == 0, "the revoked sender's queued message reached the agent"
        assert settled_row(srv.home, queued, 10, "the queued message to settle") == ("failed", BEFORE_START)
        # the command returned once the gateway had acted on it, well within its bounded wait
        assert "warning" not in revoked.err and took < APPLIED_WAIT_S, (took, revoked.err)
        conn = sqlite3.connect(f"file:{default_path(srv.home)}?mode=ro", uri=True)
        try:
            made, applied = conn.execute("SELECT made, applied FROM pairing_revokes").fetchone()
        finally:
            conn.close()
        assert applied >= made
        assert not any("QUEUED-F1" in m.text for m in slack.messages("D-v"))


async def _race_lost(srv: ChannelServer, gateway: int, sender: str) -> None:
    """The revoke and the end of the turn ahead while the gateway is stopped: the queued turn starts
    (and, with the echo model, ends) before the gateway can know of the revoke."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        conversation = await paused_conversation(client)
        os.kill(gateway, signal.SIGSTOP)
        try:
            _revoke_in_place(srv.home, sender)
            ack = await client.request({"type": "cancel", "conversation": conversation})
            assert ack.get("type") != "error", ack
            await until_idle(client, conversation)
        finally:
            os.kill(gateway, signal.SIGCONT)
    finally:
        await client.close()


def test_a_queued_turn_that_started_before_the_gateway_saw_the_revoke_says_so(tmp_path: Path) -> None:
    with FakeSlack() as slack, _server(tmp_path, slack) as srv:
        queued = paused_with_one_queued(srv, slack, "UV", "D-v", "QUEUED-RACE for the agent")
        asyncio.run(_race_lost(srv, srv.gateway_pid(), "UV"))
        assert store_turns(srv.home, "QUEUED-RACE") == 1  # it did start: the agent read it
        assert settled_row(srv.home, queued, 15, "the started turn to settle") == ("failed", AS_IT_STARTED)
        time.sleep(0.5)  # its reply would be on its way by now
        assert not any("QUEUED-RACE" in m.text for m in slack.messages("D-v"))
