"""Telegram: at most once for a send whose outcome is unknown. sendMessage takes no idempotency key
and a bot cannot read a chat back, so a failure after the request may have reached Telegram is
`uncertain` (plugins/telegram `may_have_arrived`) and the gateway does not repeat that send (its
reply fails, logged as an error); a failure before the connection was made is retried as before."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from telegram.error import NetworkError, TelegramError, TimedOut

from gateway.delivery import Outbox, SendUncertain
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import DeliveryError, Target
from plugins.telegram.adapter import TelegramAdapter, _delivery, may_have_arrived


def _raised(exc: Exception, cause: BaseException) -> Exception:
    try:
        raise exc from cause
    except Exception as caught:  # noqa: BLE001 - the exception as python-telegram-bot raises it
        return caught


REQUEST = httpx.Request("POST", "https://api.telegram.org/botX/sendMessage")


@pytest.mark.parametrize(
    ("error", "uncertain"),
    [
        (_raised(TimedOut(), httpx.ReadTimeout("read", request=REQUEST)), True),
        (_raised(TimedOut(), httpx.WriteTimeout("write", request=REQUEST)), True),
        (_raised(NetworkError("httpx.RemoteProtocolError"), httpx.RemoteProtocolError("gone", request=REQUEST)), True),
        (_raised(NetworkError("httpx.ReadError"), httpx.ReadError("reset", request=REQUEST)), True),
        (_raised(TimedOut(), httpx.ConnectTimeout("connect", request=REQUEST)), False),
        (_raised(TimedOut("Pool timeout"), httpx.PoolTimeout("pool", request=REQUEST)), False),
        (_raised(NetworkError("httpx.ConnectError"), httpx.ConnectError("refused", request=REQUEST)), False),
        # a gateway's 502 page the library could not parse: its backend may have done the call
        (_raised(NetworkError("Bad Gateway (502). Parsing failed"), TelegramError("Invalid server response")), True),
    ],
)
async def test_a_failure_after_the_request_left_is_uncertain(error: NetworkError, uncertain: bool) -> None:
    assert may_have_arrived(error) is uncertain

    async def call() -> Any:
        raise error

    with pytest.raises(DeliveryError) as raised:
        await _delivery(call())
    assert raised.value.uncertain is uncertain and not raised.value.permanent


async def test_an_error_the_bot_api_answers_is_a_plain_retry() -> None:
    """A 5xx in the Bot API's own JSON (raised without a cause): Telegram refused the call, so it
    can be made again: neither uncertain nor permanent."""

    async def call() -> Any:
        raise NetworkError("Internal Server Error")

    with pytest.raises(DeliveryError) as raised:
        await _delivery(call())
    assert not raised.value.uncertain and not raised.value.permanent
    assert raised.value.reason == "Telegram answered with an error: NetworkError: Internal Server Error"


def test_telegram_can_neither_dedupe_nor_be_asked() -> None:
    assert not getattr(TelegramAdapter, "dedupes_sends", False)
    assert not callable(getattr(TelegramAdapter, "find_sent", None))


class _Telegram:
    """The Telegram adapter's send as the outbox sees it: a read timeout after Telegram took it."""

    limits = TelegramAdapter.limits

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.sends = 0

    @property
    def is_running(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, target: Target, text: str) -> list[str]:
        self.sends += 1
        if self.sends == 1:

            async def fail() -> Any:
                raise self.failure

            await _delivery(fail())
        return [str(self.sends)]


async def test_a_timed_out_send_is_not_repeated_and_a_refused_connection_is() -> None:
    async def no_wait(seconds: float) -> None:
        await asyncio.sleep(0)

    late = _Telegram(_raised(TimedOut(), httpx.ReadTimeout("read", request=REQUEST)))
    with pytest.raises(SendUncertain, match="may have reached the chat"):
        await Outbox(late, ChatRateLimiter(100.0, 100), no_wait).send(Target("42"), "hello")  # type: ignore[arg-type]
    assert late.sends == 1
    refused = _Telegram(_raised(NetworkError("httpx.ConnectError"), httpx.ConnectError("refused", request=REQUEST)))
    assert await Outbox(refused, ChatRateLimiter(100.0, 100), no_wait).send(Target("42"), "hello") == ["2"]  # type: ignore[arg-type]
    assert refused.sends == 2
