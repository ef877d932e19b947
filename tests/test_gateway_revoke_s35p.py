"""A revoke made while the gateway child is down, and one that refuses a turn in the middle of a
conversation, keep what docs/channels.md promises ("Pairing", "Delivery").

* K1: `pairing revoke` asked only whether a gateway held gateway.lock; a gateway child killed and
  waiting out its restart holds nothing, so the command returned at once, silently, while the
  server kept running its queue: the revoked sender's queued turn started the moment the turn ahead
  ended. It now waits (within its 5 s) for the restarted child, which refuses the resumed turns
  before it says it acted on the revoke; when none comes back in time it warns on stderr. A resumed
  turn the server ran meanwhile no longer claims it never started.
* K2: a turn given up without a reply (refused after a revoke, withdrawn by `/cancel`) let the next
  reply of its conversation stop waiting for the earlier ones (`ChatOrder` waited only for the
  reply right before): another member's replies went out of order. A place given up hands its wait
  on now.

Real parts: `appserver serve --channels slack` with slack-bolt against the loopback fake Slack
(tests/fakes/slack_api.py), the gateway child killed with SIGKILL, the CLI, gateway.db and the store
read with sqlite3; `ChatOrder` and the refusal reason directly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from appserver.cli.pairing import APPLIED_WAIT_S
from appserver.client import ProtocolClient
from gateway.db import default_path, gateway_running
from gateway.delivery import ChatOrder
from gateway.replies import TurnContext, _refused_reason
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config
from tests.support.pairing import paused_conversation, paused_with_one_queued, revoke_counts, settled_row, until_idle
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

BEFORE_START = "the sender's access was taken away before the turn started"
AS_IT_STARTED = "the sender's access was taken away as the turn started"
ONCE_STARTED = "the sender's access was taken away; the turn had started when the gateway saw it"
DOWN_WARNING = "its gateway is down"


# ---------------------------------------------------------------- K2: ChatOrder


async def _reply(order: ChatOrder, name: str, done: list[str], go: asyncio.Event, *, given_up: bool = False) -> None:
    """What `Replies._deliver` does with its place: a reply waits for the one before it before going
    out; a turn given up (not let in, withdrawn) releases its place without waiting for anything."""
    before, mine = order.ticket("chat:conv")
    try:
        await go.wait()
        if given_up:
            return
        if before is not None:
            await before.wait()
        done.append(name)
    finally:
        order.release("chat:conv", mine)


async def _order_with_given_up(given_up: set[str], ready_order: list[str]) -> list[str]:
    """Replies a1 v1 a2 v2 a3 of one conversation (the v's given up), let go in `ready_order`:
    the order in which the kept ones went out."""
    order = ChatOrder()
    done: list[str] = []
    names = ["a1", "v1", "a2", "v2", "a3"]
    gos = {name: asyncio.Event() for name in names}
    tasks = []
    for name in names:
        tasks.append(asyncio.ensure_future(_reply(order, name, done, gos[name], given_up=name in given_up)))
        await asyncio.sleep(0)  # each takes its ticket before the next is made
    for name in ready_order:
        gos[name].set()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order.ticket("chat:conv")[0] is None, "the conversation's order was left with a place not done"
    return done


async def test_a_turn_refused_after_a_revoke_does_not_let_a_later_reply_overtake_an_earlier_one() -> None:
    # a1 waits for a turn ahead (its reply is slow); v1 (revoked) is refused (`NotLetIn`) at once, a2 is ready
    done = await _order_with_given_up({"v1", "v2"}, ["v1", "v2", "a2", "a3", "a1"])
    assert done == ["a1", "a2", "a3"], done


async def test_a_turn_withdrawn_by_cancel_hands_its_wait_on() -> None:
    # v1 `/cancel`led out of the queue (`Withdrawn`) before a1 is out; a2 was ready long before a1
    done = await _order_with_given_up({"v1"}, ["a2", "v1", "a3", "v2", "a1"])
    assert done == ["a1", "a2", "v2", "a3"], done


async def test_places_given_up_in_a_row_and_last_hand_their_wait_on() -> None:
    order = ChatOrder()
    first_before, first = order.ticket("k")
    _, refused = order.ticket("k")
    _, withdrawn = order.ticket("k")
    order.release("k", refused)  # given up before the first reply is out
    order.release("k", withdrawn)
    later_before, later = order.ticket("k")  # a message that came after them still waits for the first
    assert first_before is None
    assert later_before is withdrawn, "a later message's place no longer waits for the first reply"
    assert not later_before.is_set(), "a later reply could go out before the first"
    order.release("k", first)
    assert refused.is_set() and withdrawn.is_set() and later_before.is_set()
    order.release("k", later)
    assert order.ticket("k")[0] is None


# ---------------------------------------------------------------- K1: the refusal's reason


def _context(resumed: bool) -> TurnContext:
    """A turn's context as `Replies.follow` makes it; the account runner is not asked for the reason."""
    return TurnContext(None, None, None, "m1", "UV", "conv", waited=True, resumed=resumed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("snapshot", "resumed", "reason"),
    [
        ({"status": "cancelled", "error": {"kind": "withdrawn"}}, True, BEFORE_START),
        ({"status": "running", "phase": "queued"}, True, BEFORE_START),
        ({"status": "completed"}, True, ONCE_STARTED),  # the server ran it while no gateway ran
        ({"status": "running", "phase": "tool"}, True, ONCE_STARTED),
        ({"status": "running", "phase": "tool"}, False, AS_IT_STARTED),
        ({"status": "cancelled", "error": {"kind": "withdrawn"}}, False, BEFORE_START),
    ],
)
def test_a_resumed_turn_the_server_shows_started_never_says_it_did_not_start(
    snapshot: dict[str, Any], resumed: bool, reason: str
) -> None:
    assert _refused_reason(_context(resumed), snapshot) == reason


# ---------------------------------------------------------------- K1: end to end


@contextmanager
def _server(tmp_path: Path, slack: FakeSlack, backoff_s: float) -> Iterator[ChannelServer]:
    """A Slack account under `dm_policy = "pairing"` whose agent asks before its clock tool runs; a
    killed gateway child is started again after `backoff_s`."""
    home = tmp_path / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "pairing", "admins": ["UADM"], "default_agent": "careful"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    env = cli_env(
        home,
        SLACK_BOT=slack.bot_token,
        SLACK_APP=slack.app_token,
        APPSERVER_GATEWAY_RESTART_BACKOFF_S=str(backoff_s),
    )
    with channel_server(home, "--channels", "slack", env=env) as srv:
        yield srv


def _kill_gateway(srv: ChannelServer) -> None:
    """SIGKILL the gateway child; returns once gateway.lock is free (the server still runs)."""
    os.kill(srv.gateway_pid(), signal.SIGKILL)
    wait_for(lambda: not gateway_running(default_path(srv.home)), 10, "the killed gateway to let go of its lock")


async def _cancel_turn_ahead(client: ProtocolClient, conversation: str) -> None:
    """A desktop client's cancel of the paused turn, waiting until the conversation is idle."""
    ack = await client.request({"type": "cancel", "conversation": conversation})
    assert ack.get("type") != "error", ack
    await until_idle(client, conversation)


async def _revoke_then_end_turn_ahead(srv: ChannelServer, sender: str) -> tuple[CLIResult, float]:
    """`pairing revoke` and, the moment it returns, the end of the paused turn ahead of the sender's
    queued one; returns the command's result and how long it took."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        conversation = await paused_conversation(client)
        _kill_gateway(srv)
        began = time.monotonic()
        revoked = await asyncio.to_thread(run_cli, srv.home, "pairing", "revoke", sender)
        took = time.monotonic() - began
        await _cancel_turn_ahead(client, conversation)
        return revoked, took
    finally:
        await client.close()


def test_a_revoke_while_the_gateway_child_restarts_returns_once_the_queued_turn_is_withdrawn(tmp_path: Path) -> None:
    with FakeSlack() as slack, _server(tmp_path, slack, backoff_s=1.5) as srv:
        queued = paused_with_one_queued(srv, slack, "UV", "D-v", "QUEUED-K1 for the agent")
        revoked, took = asyncio.run(_revoke_then_end_turn_ahead(srv, "UV"))
        assert revoked.code == 0, revoked.err
        assert store_turns(srv.home, "QUEUED-K1") == 0, (
            f"the revoked sender's queued message reached the agent after `pairing revoke` returned"
            f" in {took:.2f} s (stderr {revoked.err!r})"
        )
        assert "warning" not in revoked.err and took < APPLIED_WAIT_S, (took, revoked.err)
        assert "note: the gateway was down" in revoked.err, revoked.err  # a turn started meanwhile would have run
        assert settled_row(srv.home, queued, 15, "the queued message to settle") == ("failed", BEFORE_START)
        made, applied = revoke_counts(srv.home)
        assert applied >= made
        assert not any("QUEUED-K1" in m.text for m in slack.messages("D-v"))


def test_a_revoke_no_gateway_comes_back_for_in_time_says_so_and_the_started_turn_says_it_started(
    tmp_path: Path,
) -> None:
    with FakeSlack() as slack, _server(tmp_path, slack, backoff_s=APPLIED_WAIT_S + 4) as srv:
        queued = paused_with_one_queued(srv, slack, "UV", "D-v", "QUEUED-K1B for the agent")

        async def revoke_while_down() -> tuple[CLIResult, float]:
            client = await ProtocolClient.connect(srv.url, token="", client="desktop")
            try:
                conversation = await paused_conversation(client)
                _kill_gateway(srv)
                began = time.monotonic()
                revoked = await asyncio.to_thread(run_cli, srv.home, "pairing", "revoke", "UV")
                took = time.monotonic() - began
                assert not gateway_running(default_path(srv.home)), "the gateway came back before the command ended"
                # as the warning says: the turn ahead ends, and the server starts the queued one
                await _cancel_turn_ahead(client, conversation)
                return revoked, took
            finally:
                await client.close()

        revoked, took = asyncio.run(revoke_while_down())
        assert revoked.code == 0 and "Revoked UV (1 account)." in revoked.out, (revoked.out, revoked.err)
        assert DOWN_WARNING in revoked.err and "may still be answered" in revoked.err, (took, revoked.err)
        assert APPLIED_WAIT_S - 0.5 <= took < APPLIED_WAIT_S + 4, took  # the bounded wait, not the restart's
        assert store_turns(srv.home, "QUEUED-K1B") == 1  # it did start: the warning was true
        srv.wait_channels_ready(timeout=30, restarts=1)
        # the restarted gateway acts on the revoke, refusing the turn the server ran, and says it started
        assert settled_row(srv.home, queued, 15, "the started turn to settle") == ("failed", ONCE_STARTED)
        wait_for(
            lambda: (c := revoke_counts(srv.home))[1] >= c[0], 10, "the restarted gateway to mark the revoke applied"
        )
        time.sleep(0.5)  # its reply would be on its way by now
        assert not any("QUEUED-K1B" in m.text for m in slack.messages("D-v"))
