"""Numbers users and peers type are ASCII digits: `str.isdigit` and regex `\\d` also take `٥` (Arabic-
Indic five) and `²` (superscript two), which `int` reads as 5 or refuses with a ValueError nobody
catches. Each parser here refuses them with its own clear error (or ignores them, where a peer's
field is advisory), instead of reading another number than the user wrote or failing late."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from starlette.requests import Request

from appserver.auth.tokens import parse_duration as token_duration
from appserver.configcheck import Invalid, convert
from appserver.netaddr import parse_listen, split_host_header
from appserver.providers.base import ChatMessage, ProviderError, ProviderRequest, Text
from appserver.providers.echo import EchoProvider
from appserver.providers.sse import SSEDecoder
from cron.schedule import ScheduleError, normalize_cron, parse_duration
from plugins.contract import Account, AdapterContext, DeliveryError, InboundMessage
from plugins.discord.adapter import DiscordAdapter, _snowflake
from plugins.discord.adapter import create_adapter as create_discord
from plugins.telegram.adapter import _chat_id as tg_chat_id
from plugins.telegram.adapter import _int_or_none as tg_thread_id
from plugins.telegram.adapter import _message_id as tg_message_id
from plugins.webhook.adapter import WebhookAdapter, _BadRequest
from plugins.webhook.adapter import create_adapter as create_webhook
from plugins.webhook.settings import parse_listen as webhook_listen
from tests.support.cli import cli_env, run_cli

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
    with pytest.raises(ValueError, match="listen must be host:port"):
        webhook_listen(f"127.0.0.1:{digits}")


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


# ── digit strings too long for int() ───────────────────────────────────────────────────────────
# int() refuses more than 4300 digits with a ValueError in Python's words ("Exceeds the limit"); a
# check that passed them on to int() answered with that message, a 500 or a traceback. Each parser
# bounds the digits first and answers in its own words.

LONG = "9" * 5000
PYTHONS_WORDS = "Exceeds the limit"


def test_long_cron_durations_and_fields_are_refused_in_words() -> None:
    for text in (f"{LONG}m", f"1h{LONG}s"):
        with pytest.raises(ScheduleError, match="invalid duration .*: at most 36500d") as err:
            parse_duration(text)
        assert len(str(err.value)) < 200  # the input is cut short, not repeated whole
    assert parse_duration(f"{'0' * 5000}1m").total_seconds() == 60  # leading zeros: still a small number
    for expr in (f"{LONG} * * * *", f"1-{LONG} * * * *", f"0-{'0' * 5000}1 * * * *"):
        with pytest.raises(ScheduleError, match="invalid cron expression") as err:
            normalize_cron(expr)
        assert len(str(err.value)) < 300


def test_long_token_lifetimes_are_refused_in_words() -> None:
    for text in (f"{'9' * 400}s", f"{LONG}d", "99999999999999w"):
        with pytest.raises(ValueError, match="at most 36500d") as err:
            token_duration(text)
        assert PYTHONS_WORDS not in str(err.value) and len(str(err.value)) < 200


def test_long_ports_are_refused_in_words() -> None:
    for text in (LONG, f":{LONG}", f"127.0.0.1:{LONG}", f"[::1]:{LONG}"):
        with pytest.raises(ValueError, match="invalid port in listen address") as err:
            parse_listen(text)
        assert len(str(err.value)) < 200
    with pytest.raises(ValueError, match="malformed Host header"):
        split_host_header(f"example.com:{LONG}")
    with pytest.raises(ValueError, match="listen must be host:port"):
        webhook_listen(f"127.0.0.1:{LONG}")


def test_an_upstream_sse_retry_of_many_digits_is_ignored_not_a_crash() -> None:
    dec = SSEDecoder()
    events = dec.feed(f"retry: {LONG}\ndata: a\n\nretry: {'9' * 11}\ndata: b\n\nretry: 1500\ndata: c\n\n".encode())
    assert [(e.data, e.retry) for e in events] == [("a", None), ("b", None), ("c", 1500)]


async def _echo(text: str) -> list[object]:
    request = ProviderRequest(model="echo", messages=[ChatMessage("user", text)])
    return [c async for c in EchoProvider().stream(request)]


async def test_echo_commands_with_many_digits_use_their_defaults() -> None:
    slow = await _echo(f"/slow {LONG}")
    assert sum(1 for c in slow if isinstance(c, Text)) == 10
    assert sum(1 for c in await _echo("/slow 3") if isinstance(c, Text)) == 3
    assert sum(1 for c in await _echo("/slow 0") if isinstance(c, Text)) == 0


@pytest.mark.parametrize(("arg", "status"), [(LONG, 500), ("200", 500), ("99999", 500), ("399", 500), ("600", 500),
                                             ("400", 400), ("404", 404), ("599", 599), ("503", 503)])  # fmt: skip
async def test_echo_error_answers_only_error_statuses(arg: str, status: int) -> None:
    with pytest.raises(ProviderError) as err:
        await _echo(f"/error {arg}")
    assert err.value.status == status


# ── environment settings ──────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("text", ["٥", "1_0", "+5", "５", "²", LONG, "0x10", "5.0", ""])
def test_an_integer_setting_from_the_environment_is_ascii_digits_only(text: str) -> None:
    assert convert("-5", int, None, from_env=True) == -5
    assert convert(" 42 ", int, None, from_env=True) == 42
    with pytest.raises(Invalid, match="an integer"):
        convert(text, int, None, from_env=True)


@pytest.mark.parametrize("text", ["٥", "1_0.5", "+5", "٥.٥", LONG, "nan", "inf", "1e400", "1.5.2", "-"])
def test_a_number_setting_from_the_environment_is_ascii_only(text: str) -> None:
    for good, value in (("1.5", 1.5), ("-0.25", -0.25), (".5", 0.5), ("3", 3.0), ("1e3", 1000.0)):
        assert convert(good, float, None, from_env=True) == value
    with pytest.raises(Invalid, match="a number"):
        convert(text, float, None, from_env=True)


@pytest.mark.parametrize("text", ["٥", "1_0", "+5", LONG])
def test_the_cli_names_the_setting_when_its_environment_value_is_not_ascii_digits(tmp_path: Path, text: str) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "token", "list", env=cli_env(home, APPSERVER_LIMITS__RETRY_BASE_MS=text))
    assert r.code == 2, (r.code, r.out, r.err[:300])
    assert r.err.count("\n") == 1 and "retry_base_ms" in r.err and "Traceback" not in r.err, r.err[:300]
    assert len(r.err) < 300, r.err[:300]  # a long value is cut short in the line, not repeated whole


# ── chat platforms' ids ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("text", ["٥", "-٥", "1_0", "+5", " 5", "5\n", "--5", "", LONG, "9" * 20])
def test_telegram_ids_are_ascii_digits(text: str) -> None:
    assert tg_chat_id("-1001234567890") == -1001234567890 and tg_chat_id("42") == 42
    with pytest.raises(DeliveryError, match="not a Telegram chat id") as err:
        tg_chat_id(text)
    assert err.value.permanent and len(str(err.value)) < 100
    assert tg_thread_id("7") == 7
    if text:
        with pytest.raises(DeliveryError, match="not a Telegram thread id"):
            tg_thread_id(text)
    assert tg_message_id("-100123:42:e5") == 42 and tg_message_id("42") == 42
    assert tg_message_id(text) is None and tg_message_id(f"-100123:{text}") is None


def test_discord_ids_are_ascii_digits_of_a_snowflakes_length() -> None:
    assert _snowflake("1234567890123456789") and _snowflake("9" * 20)
    for text in ("٥", "²", "1_0", "+5", "", "9" * 21, LONG):
        assert not _snowflake(text), text[:30]


def test_discord_catch_up_state_with_ids_that_are_no_ids_is_read_without_them(tmp_path: Path) -> None:
    """`failed` ids of other digits or of 5000 digits, a `last` of 5000 digits (a JSON number) and a
    channel key of other digits: each is dropped (with a warning), the usable rest kept; noting the
    next message works instead of raising from an unguarded int()."""
    state = {
        "111": {"last": "500", "chat": "111", "thread": None, "chat_type": "group", "failed": ["٥", LONG, "450"]},
        "٥": {"last": "7", "chat": "٥", "thread": None, "chat_type": "group"},
        "222": {"last": "600", "chat": "222", "thread": None, "chat_type": "group", "failed": "450"},
    }
    text = json.dumps(state)[:-1] + f', "333": {{"last": {LONG}, "chat": "333"}}}}'
    (tmp_path / "last_seen.json").write_text(text)
    ctx = AdapterContext(_no_message, lambda state, reason: None, tmp_path, logging.getLogger("test.discord"))
    adapter = create_discord(Account("discord", "main", {}, {"token": "x"}), ctx)
    assert isinstance(adapter, DiscordAdapter)
    assert adapter._seen == {
        "111": {"last": "500", "chat": "111", "thread": None, "chat_type": "group", "failed": ["450"]},
        "222": {"last": "600", "chat": "222", "thread": None, "chat_type": "group"},
    }
    msg = InboundMessage("discord", "main", "111", "group", "u", "501", "hi")
    adapter._note_seen(111, 450, msg)  # the held message is recorded now
    adapter._note_seen(111, 501, msg)
    saved = json.loads((tmp_path / "last_seen.json").read_text())
    assert saved["111"]["last"] == "501" and "failed" not in saved["111"]


async def _no_message(msg: InboundMessage) -> None:
    raise AssertionError("no message is expected")


@pytest.mark.parametrize("declared", [LONG, "9" * 19])
async def test_a_webhook_content_length_of_many_digits_is_413_not_a_crash(tmp_path: Path, declared: str) -> None:
    """uvicorn's parser refuses such a header today; the adapter's own check must not depend on it."""
    ctx = AdapterContext(_no_message, lambda state, reason: None, tmp_path, logging.getLogger("test.webhook"))
    adapter = create_webhook(Account("webhook", "hooks", {"listen": "127.0.0.1:0"}, {"secret": "s" * 16}), ctx)
    assert isinstance(adapter, WebhookAdapter)

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", declared.encode())]}
    with pytest.raises(_BadRequest) as err:
        await adapter._read_body(Request(scope, receive))
    assert err.value.status == 413
    small = {**scope, "headers": [(b"content-length", b"2")]}
    assert await adapter._read_body(Request(small, receive)) == b"{}"
