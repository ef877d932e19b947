"""Session 37 outside attack I, F2: a Slack final edit that lands late is not posted again.

A reply's final `chat.update` failed (`internal_error`, not performed) until the outbox's last
attempt, which Slack queued and performed after the client's timeout. The lookup that tells
whether the edit landed (`Outbox.edit_landed`) ran at once, still read the old text, and the final
text was posted anew; the queued edit then landed and the chat showed the reply twice. A lookup
that reads the old text now looks again LOOKUP_SETTLE_S after the uncertain attempt began, as a
send's lookup does, before it posts anything.

The real slack_sdk adapter against the loopback fake (tests/fakes/slack_api.py), the real
`Outbox` / `ReplySink` / `ChatRateLimiter`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.delivery import LOOKUP_SETTLE_S, Outbox, ReplySink
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Account, AdapterContext, InboundMessage, Target
from plugins.slack import SlackAdapter
from plugins.slack import create_adapter as create_slack
from tests.fakes.slack_api import FakeSlack

pytestmark = pytest.mark.timeout(120)

LATE_S = 1.5  # the queued edit is performed this long after it arrived (past the client's 1 s)


class StandIn:
    """The gateway's side of the contract: `on_message` commits at once."""

    async def on_message(self, msg: InboundMessage) -> None:
        pass

    def report(self, state: Any, reason: str | None) -> None:
        pass


class Clock:
    """The outbox's clock: the retry minute's long backoffs pass at once, while a wait as short as
    the lookup's settle is real (the late edit lands on the fake's own clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.now += seconds
        await asyncio.sleep(seconds if seconds <= LOOKUP_SETTLE_S else 0)


@pytest.fixture
def slack(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlack]:
    monkeypatch.setenv("APPSERVER_SLACK_API_TIMEOUT_S", "1")
    with FakeSlack(ack_timeout=0.6) as fake:
        yield fake


@pytest.fixture
async def slack_adapter(slack: FakeSlack, tmp_path: Path) -> AsyncIterator[SlackAdapter]:
    gw = StandIn()
    ctx = AdapterContext(gw.on_message, gw.report, tmp_path, logging.getLogger("test.s37i.slack"))
    tokens = {"bot_token": slack.bot_token, "app_token": slack.app_token}
    adapter = create_slack(Account("slack", "main", {"api_url": slack.url}, tokens), ctx)
    assert isinstance(adapter, SlackAdapter)
    await adapter.start()
    try:
        yield adapter
    finally:
        await adapter.stop()


def _sink(adapter: SlackAdapter, chat: str) -> ReplySink:
    clock = Clock()
    limiter = ChatRateLimiter(rate=20.0, burst=20, clock=clock, sleep=clock.sleep)
    sink = ReplySink(Outbox(adapter, limiter, clock.sleep, clock=clock), Target(chat), interval=0.0)
    sink.key = f"slack:main:{chat}:1"
    return sink


async def test_slack_a_final_edit_that_lands_late_is_not_posted_again(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    chat = "D-s37i-late"
    slack.add_channel(chat)
    reply = _sink(slack_adapter, chat)
    await reply.show("w1 w2")
    updates = 0

    def on_request(method: str, params: Any) -> None:
        nonlocal updates
        if method == "chat.update":
            updates += 1
            if updates == 8:  # the outbox's last attempt: queued, performed after the client gave up
                slack.hold_answers("chat.update", 4.0, perform_after=LATE_S)

    slack.on_request = on_request
    slack.fail_next("chat.update", "internal_error", count=7)  # attempts 1-7: not performed
    try:
        ids = await asyncio.wait_for(reply.finish("w1 w2 w3 w4"), 60)
    finally:
        slack.on_request = None
        slack.clear_failures()
    assert updates == 8
    await asyncio.sleep(LATE_S + 0.5)  # anything still queued has landed by now
    messages = slack.messages(chat)
    assert [m.text for m in messages] == ["w1 w2 w3 w4"]
    assert ids == [messages[0].ts]


async def test_slack_a_final_edit_that_never_lands_is_posted_anew_once(
    slack: FakeSlack, slack_adapter: SlackAdapter
) -> None:
    """The settle changes nothing for an edit that never lands: looked at again, it still reads
    the old text, and the final text is posted anew, once."""
    chat = "D-s37i-never"
    slack.add_channel(chat)
    reply = _sink(slack_adapter, chat)
    await reply.show("w1 w2")
    slack.fail_next("chat.update", "internal_error", count=1000)  # not performed, for minutes
    try:
        ids = await asyncio.wait_for(reply.finish("w1 w2 w3"), 60)
    finally:
        slack.clear_failures()
    texts = [m.text for m in slack.messages(chat)]
    assert texts == ["w1 w2", "w1 w2 w3"], texts
    assert ids == [slack.messages(chat)[-1].ts]
