"""Numbers users and peers type are ASCII digits: `str.isdigit` and regex `\\d` also take `٥` (Arabic-
Indic five) and `²` (superscript two), which `int` reads as 5 or refuses with a ValueError nobody
catches. Each parser here refuses them with its own clear error (or ignores them, where a peer's
field is advisory), instead of reading another number than the user wrote or failing late."""

from __future__ import annotations

import asyncio

import pytest

from appserver.auth.tokens import parse_duration as token_duration
from appserver.netaddr import parse_listen, split_host_header
from appserver.providers.base import ChatMessage, ProviderError, ProviderRequest, Text
from appserver.providers.echo import EchoProvider
from appserver.providers.sse import SSEDecoder
from cron.schedule import ScheduleError, normalize_cron, parse_duration
from plugins.webhook.adapter import AccountError, _parse_listen

NOT_ASCII = ["٥", "²", "١٢", "５"]  # Arabic-Indic, superscript, Arabic-Indic, full-width


@pytest.mark.parametrize("digits", NOT_ASCII)
def test_cron_durations_and_fields_take_ascii_digits_only(digits: str) -> None:
    assert parse_duration("5m").total_seconds() == 300
    with pytest.raises(ScheduleError, match="invalid duration"):
        parse_duration(f"{digits}m")
    with pytest.raises(ScheduleError, match="invalid cron expression"):
        normalize_cron(f"{digits} * * * *")
    with pytest.raises(ScheduleError, match="invalid cron expression"):
        normalize_cron(f"1-{digits} * * * *")


@pytest.mark.parametrize("digits", NOT_ASCII)
def test_token_lifetimes_take_ascii_digits_only(digits: str) -> None:
    assert token_duration("5d") == 5 * 86400
    with pytest.raises(ValueError, match="invalid duration"):
        token_duration(f"{digits}d")


@pytest.mark.parametrize("digits", NOT_ASCII)
def test_listen_addresses_and_host_headers_take_ascii_ports_only(digits: str) -> None:
    assert parse_listen("8080").port == 8080
    for text in (digits, f":{digits}", f"127.0.0.1:{digits}"):
        with pytest.raises(ValueError):
            parse_listen(text)
    assert split_host_header("example.com:8080") == ("example.com", 8080)
    with pytest.raises(ValueError, match="malformed Host header"):
        split_host_header(f"example.com:{digits}")
    with pytest.raises(ValueError, match="malformed Host header"):
        split_host_header(f"[::1]:{digits}")
    with pytest.raises(AccountError, match="listen must be host:port"):
        _parse_listen(f"127.0.0.1:{digits}", "webhook")


def test_an_upstream_sse_retry_field_of_other_digits_is_ignored_not_a_crash() -> None:
    dec = SSEDecoder()
    events = dec.feed("retry: ²\ndata: a\n\nretry: 7\ndata: b\n\n".encode())
    assert [(e.data, e.retry) for e in events] == [("a", None), ("b", 7)]


@pytest.mark.parametrize("digits", ["²", "٥"])
def test_echo_commands_with_other_digits_use_their_defaults(digits: str) -> None:
    async def run(text: str) -> list[object]:
        request = ProviderRequest(model="echo", messages=[ChatMessage("user", text)])
        return [c async for c in EchoProvider().stream(request)]

    slow = asyncio.run(run(f"/slow {digits}"))
    assert sum(1 for c in slow if isinstance(c, Text)) == 10  # the default, not 5 words or a crash
    with pytest.raises(ProviderError) as err:
        asyncio.run(run(f"/error {digits}"))
    assert err.value.status == 500
