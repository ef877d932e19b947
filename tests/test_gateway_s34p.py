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
from collections.abc import Iterator

import pytest

from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import ChannelServer, discord_server, end_pending_turn

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


def test_a_turn_cancelled_while_the_gateway_was_down_reads_cancelled(srv: ChannelServer, fake: FakeDiscord) -> None:
    pid = srv.gateway_pid()
    fake.inject_guild_message("821", "/call clock {}", channel=APPROVALS, mention=True)
    waiting = fake.wait_for_text(APPROVALS, lambda t: "waiting for approval of clock" in t, timeout=30)
    fake.hold()  # the restarted gateway connects only once released: the turn ends before it looks
    try:
        os.kill(pid, signal.SIGKILL)
        asyncio.run(end_pending_turn(srv, "careful", "cancel"))
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
