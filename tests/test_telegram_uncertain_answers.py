"""A Telegram send answered with a page that is no Bot API answer (a maintenance page served with
200, a proxy's 502) may have been performed behind it: it is uncertain, so it is not sent again
(Telegram can neither dedupe nor be asked). The real python-telegram-bot against the loopback fake."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.delivery import Outbox, SendUncertain
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Account, AdapterContext, InboundMessage, Target
from plugins.telegram import create_adapter
from tests.fakes.telegram_api import FakeTelegram

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.mark.parametrize("status", [200, 502])
async def test_a_send_answered_with_a_page_is_not_sent_again(tg: FakeTelegram, tmp_path: Path, status: int) -> None:
    async def on_message(msg: InboundMessage) -> None:
        pass

    ctx = AdapterContext(on_message, lambda state, reason: None, tmp_path, logging.getLogger("test.telegram"))
    adapter = create_adapter(Account("telegram", "main", tg.settings(), {"token": tg.token}), ctx)
    await adapter.start()
    try:
        chat = tg.chat(4242)
        tg.perform_then_page("sendMessage", status)
        with pytest.raises(SendUncertain, match="may have reached the chat"):
            await Outbox(adapter, ChatRateLimiter(100.0, 100), asyncio.sleep).send(Target(str(chat)), "hello")
        assert [m.text for m in tg.messages(chat)] == ["hello"]
        assert len(tg.calls("sendMessage")) == 1
    finally:
        await adapter.stop()
