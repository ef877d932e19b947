"""A turn cancelled from another client while the gateway child was down ends in the chat as
cancelled, not as a server stop (session 34, P). After the restart, `Replies._first_snapshot` took
the outcome `ServerLink.recover` rebuilt from the history: the turn's last message is a tool result,
so "failed, kind unknown", which the chat shows as "⚠ The reply was interrupted (the server stopped
while it was being written)." although the server never stopped. The server's `get_turn` knows the
turn was cancelled; the restarted gateway now asks it first.

End to end: `appserver serve --channels discord` against the loopback fake of Discord; the gateway
child is killed -9 while the turn waits for an approval, the turn is cancelled over the protocol
while the child is down, then the child restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from appserver.client import ProtocolClient
from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import ChannelServer, discord_server

pytestmark = pytest.mark.timeout(120)

APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("gateway_s34p") / "home"
    with discord_server(home, fake, {APPROVALS: "approvals"}, careful_in=APPROVALS) as server:
        yield server


async def _cancel_and_wait_for_the_end(srv: ChannelServer, agent: str) -> None:
    """Cancel the turn of `agent` that waits for an approval over the protocol, as a desktop app
    does, and wait until its conversation is idle again (the turn ended)."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        deadline = time.monotonic() + 30
        conversation: str | None = None
        while conversation is None:
            assert time.monotonic() < deadline, "no pending approval found"
            convs = await client.request({"type": "list_conversations", "agent": agent})
            for conv in convs["conversations"]:
                state = await client.request({"type": "subscribe", "conversation": conv["id"]})
                if state.get("pending_approvals"):
                    conversation = conv["id"]
            if conversation is None:
                await asyncio.sleep(0.05)
        ack: dict[str, Any] = await client.request({"type": "cancel", "conversation": conversation})
        assert ack.get("type") != "error", ack
        while True:
            state = await client.request({"type": "subscribe", "conversation": conversation})
            if state.get("state") == "idle" and not state.get("active_turn"):
                return
            assert time.monotonic() < deadline, f"the turn did not end: {state}"
            await asyncio.sleep(0.05)
    finally:
        await client.close()


def test_a_turn_cancelled_while_the_gateway_was_down_reads_cancelled(srv: ChannelServer, fake: FakeDiscord) -> None:
    pid = srv.gateway_pid()
    fake.inject_guild_message("821", "/call clock {}", channel=APPROVALS, mention=True)
    waiting = fake.wait_for_text(APPROVALS, lambda t: "waiting for approval of clock" in t, timeout=30)
    fake.hold()  # the restarted gateway connects only once released: the turn ends before it looks
    try:
        os.kill(pid, signal.SIGKILL)
        asyncio.run(_cancel_and_wait_for_the_end(srv, "careful"))
    finally:
        fake.release()
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    fake.wait_for(
        lambda: next(
            (m for m in fake.messages(APPROVALS) if m.id == waiting.id and "waiting for approval" not in m.content),
            None,
        ),
        30,
        "the reply edited to the turn's outcome",
    )
    reply = next(m for m in fake.messages(APPROVALS) if m.id == waiting.id)
    assert "server stopped" not in reply.content, reply.content
    assert "⏹ Cancelled." in reply.content, reply.content
