"""A reply's final edit that gets no answer in time (a slow Bot API applies it, then answers late) is
not replaced by a new message: an edit is idempotent and most likely landed, so posting the text anew
showed the reply twice. Only a definite refusal to edit that message ("message to edit not found")
posts the final text as a new message. The real python-telegram-bot against the loopback fake."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from gateway.delivery import Outbox, ReplySink
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Account, Adapter, AdapterContext, InboundMessage, Target
from plugins.telegram import create_adapter
from tests.fakes.telegram_api import FakeTelegram

pytestmark = pytest.mark.timeout(60)

# The adapter's Bot API call timeout (15 s in plugins/telegram/adapter.py), shortened for the adapter
# under test through its environment knob: the fake still answers only 2 s after the client gave up.
CLIENT_READ_TIMEOUT_S = 3.0


class SlowEdits(FakeTelegram):
    """Performs editMessageText at once but answers it only after the client gave up waiting, while
    `slow` is set (a slow Bot API)."""

    slow = False
    slow_then_gone = False  # once: this edit answers late, and the message is then deleted

    async def _handle(self, request: Request) -> Response:
        response = await super()._handle(request)
        gone = request.path_params["method"] == "editMessageText" and self.slow_then_gone
        if gone:
            self.slow_then_gone = False
            self.fail_next("editMessageText", 400, description="Bad Request: message to edit not found")
        if request.path_params["method"] == "editMessageText" and (self.slow or gone):
            deadline = time.monotonic() + CLIENT_READ_TIMEOUT_S + 2
            while time.monotonic() < deadline and not self._closing:
                await asyncio.sleep(0.05)
        return response


@pytest.fixture
def tg() -> Iterator[SlowEdits]:
    with SlowEdits() as fake:
        yield fake


@pytest.fixture
async def adapter(tg: SlowEdits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Adapter]:
    monkeypatch.setenv("APPSERVER_TELEGRAM_API_TIMEOUT_S", str(CLIENT_READ_TIMEOUT_S))

    async def on_message(msg: InboundMessage) -> None:
        pass

    ctx = AdapterContext(on_message, lambda state, reason: None, tmp_path, logging.getLogger("test.telegram"))
    made = create_adapter(Account("telegram", "main", tg.settings(), {"token": tg.token}), ctx)
    await made.start()
    try:
        yield made
    finally:
        await made.stop()


class Jumps:
    """The outbox's budget clock: each reading is a minute later, so a failed call is given up after
    its first attempt (the test does not wait out the minute of retries)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 61.0
        return self.now


async def no_wait(seconds: float) -> None:
    await asyncio.sleep(0)


def sink(adapter: Adapter, chat: int, clock: Any = time.monotonic) -> ReplySink:
    outbox = Outbox(adapter, ChatRateLimiter(100.0, 100), no_wait, clock=clock)
    return ReplySink(outbox, Target(str(chat)), key="turn-1")


async def test_a_final_edit_answered_too_late_is_not_posted_again(tg: SlowEdits, adapter: Adapter) -> None:
    chat = tg.chat(800)
    reply = sink(adapter, chat, Jumps())
    await reply.show("Working on it")
    tg.slow = True
    ids = await reply.finish("Working on it. Done: the full answer.")
    tg.slow = False
    assert [m.text for m in tg.messages(chat)] == ["Working on it. Done: the full answer."]
    assert len(tg.calls("sendMessage")) == 1
    assert ids == [str(tg.messages(chat)[0].message_id)]


async def test_a_final_edit_answered_with_a_page_is_retried_not_posted_again(tg: SlowEdits, adapter: Adapter) -> None:
    chat = tg.chat(801)
    reply = sink(adapter, chat)
    await reply.show("Working on it")
    for _ in range(10):  # every attempt is performed, then answered with a proxy's page
        tg.perform_then_page("editMessageText", 502)
    await reply.finish("Working on it. Done.")
    assert [m.text for m in tg.messages(chat)] == ["Working on it. Done."]
    assert len(tg.calls("sendMessage")) == 1
    assert len(tg.calls("editMessageText")) > 1  # retried (bounded) before it was left as it is


async def test_a_final_edit_refused_for_that_message_posts_the_text_anew(tg: SlowEdits, adapter: Adapter) -> None:
    chat = tg.chat(802)
    reply = sink(adapter, chat)
    await reply.show("Working on it")
    tg.fail_next("editMessageText", 400, description="Bad Request: message to edit not found")
    ids = await reply.finish("Working on it. Done.")
    assert [m.text for m in tg.messages(chat)] == ["Working on it", "Working on it. Done."]
    assert len(tg.calls("editMessageText")) == 1  # a refusal is not retried
    assert ids == [str(tg.messages(chat)[1].message_id)]


async def test_a_final_edit_not_modified_is_success(tg: SlowEdits, adapter: Adapter) -> None:
    chat = tg.chat(803)
    reply = sink(adapter, chat)
    await reply.show("Working on it")
    tg.fail_next("editMessageText", 400, description="Bad Request: message is not modified: same text")
    await reply.finish("Working on it. Done.")
    assert [m.text for m in tg.messages(chat)] == ["Working on it"]  # the fake was told it is unchanged
    assert len(tg.calls("sendMessage")) == 1


async def test_a_final_edit_answered_late_then_refused_posts_the_text_anew(tg: SlowEdits, adapter: Adapter) -> None:
    """Session 29 re-attack: the earlier doubtful attempt made a later refusal (the user deleted the
    message meanwhile) read as "may have landed": the chat was left with no answer at all."""
    chat = tg.chat(804)
    reply = sink(adapter, chat)
    await reply.show("Working on it")
    tg.slow_then_gone = True
    ids = await reply.finish("Working on it. Done.")
    assert len(tg.calls("editMessageText")) == 2  # the late one, then the refusal
    assert [m.text for m in tg.messages(chat)][-1] == "Working on it. Done."
    assert len(tg.calls("sendMessage")) == 2
    assert ids == [str(tg.messages(chat)[-1].message_id)]
