"""A reply part whose post a kill -9 cut short is edited to the final text after the restart (session
34, K). The gateway notes a part as attempted before posting it; a restart repeats it with the same
Discord nonce, and Discord answers the repeat with the message the first attempt created, which
shows that attempt's text. When the turn ended meanwhile (approved from the CLI while the gateway
was down), the repeat carried the final reply and the outbox took it as posted with that text: the
message stayed "⚙ clock…  ⏸ waiting for approval of clock" for good, the reply never shown
(seen under load in tests/test_discord_s28r.py, where the kill lands at a press's callback).

End to end: `appserver serve --channels discord` against the loopback fake of Discord, the gateway
child killed -9 the moment the fake recorded the reply's first post, before answering it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.requests import Request

from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import ChannelServer, discord_server, end_pending_turn

pytestmark = pytest.mark.timeout(150)

APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask)


class Fake(FakeDiscord):
    """The fake, calling `on_reply_post` with the message id as a post without buttons in APPROVALS
    (a reply part, not the approval prompt) is recorded, before it is answered."""

    def __init__(self) -> None:
        super().__init__()
        self.on_reply_post: Callable[[str], None] | None = None

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        answer = super()._handle(request, method, parts, body, kind)
        hook = self.on_reply_post
        is_reply = kind == "POST messages" and parts[1] == APPROVALS and not (body or {}).get("components")
        if hook is not None and is_reply and answer[0] == 200:
            self.on_reply_post = None
            hook(str(answer[1]["id"]))
        return answer


@pytest.fixture(scope="module")
def fake() -> Iterator[Fake]:
    with Fake() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: Fake) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("discord_s34k") / "home"
    with discord_server(home, fake, {APPROVALS: "approvals"}, careful_in=APPROVALS) as server:
        yield server


def test_a_reply_part_cut_short_by_a_kill_shows_the_final_reply_after_the_restart(
    srv: ChannelServer, fake: Fake
) -> None:
    pid = srv.gateway_pid()
    first: list[str] = []

    def kill(message_id: str) -> None:
        fake.hold()  # the restarted gateway connects only once released: the turn ends before it looks
        os.kill(pid, signal.SIGKILL)
        first.append(message_id)

    fake.on_reply_post = kill
    try:
        fake.inject_guild_message("821", "/call clock {}", channel=APPROVALS, mention=True)
        fake.wait_for(lambda: first, 30, "the reply's first post")
        shown = next(m for m in fake.messages(APPROVALS) if m.id == first[0])
        assert "clock" in shown.content, shown.content
        asyncio.run(end_pending_turn(srv, "careful", "approve"))
    finally:
        fake.on_reply_post = None
        fake.release()
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, 20, "the restarted gateway child")
    reply = fake.wait_for_text(APPROVALS, lambda t: t.startswith("clock -> "), timeout=30)
    assert reply.id == first[0]  # the reply goes on in its message, never a second one
    assert [m.id for m in fake.messages(APPROVALS) if "clock -> " in m.content] == [first[0]]
