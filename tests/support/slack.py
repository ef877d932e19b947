"""A started Slack adapter (the real slack_sdk client) against the loopback fake, and an Outbox
over it: the set-up the Slack delivery tests share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from gateway.delivery import Outbox
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Account, AdapterContext, InboundMessage
from plugins.slack import SlackAdapter, create_adapter
from tests.fakes.slack_api import FakeSlack


@asynccontextmanager
async def started_adapter(slack: FakeSlack, home: Path) -> AsyncIterator[SlackAdapter]:
    """Account `main` on the fake, every inbound message acked; stopped on the way out."""

    async def on_message(msg: InboundMessage) -> None:
        if msg.ack is not None:
            await msg.ack()

    ctx = AdapterContext(on_message, lambda state, reason: None, home, logging.getLogger("test.slack"))
    account = Account(
        "slack", "main", {"api_url": slack.url}, {"bot_token": slack.bot_token, "app_token": slack.app_token}
    )
    made = create_adapter(account, ctx)
    assert isinstance(made, SlackAdapter)
    await made.start()
    try:
        yield made
    finally:
        await made.stop()


def outbox(adapter: SlackAdapter) -> Outbox:
    return Outbox(adapter, ChatRateLimiter(rate=50.0, burst=50), asyncio.sleep)
