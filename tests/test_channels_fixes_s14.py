"""Channel fixes (session 14): hostile webhook bodies are 400, never 500 or a half-recorded message;
every JSON reader in the channels takes a too-long integer or too-deep nesting as bad JSON; `/new`
on a pinned route says so instead of claiming a new conversation; the gateway's answers to a
message carry `reply_to`; a cron delivery's verdict is its outcome (the timeouts are ordered, a
delivery given up says why and sends nothing more)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import cron.runner
import gateway.supervisor
from gateway.delivery import BACKOFF_S, DeliveryFailed, Outbox
from gateway.ratelimit import ChatRateLimiter
from gateway.replies import DELIVER_GIVE_UP_S
from gateway.tool import ToolRefusal, parse_call
from plugins.contract import Target
from plugins.loader import PluginError, read_manifest
from plugins.webhook import WebhookAdapter, create_adapter
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.test_plugins_webhook import Gateway, Receiver, make_account, message, post
from tests.test_plugins_webhook import receiver as receiver  # noqa: F401 - the loopback reply_url fixture

pytestmark = pytest.mark.timeout(120)

# ----------------------------------------------------------------------------- webhook: hostile bodies


@pytest.fixture
async def hook(tmp_path: Path) -> AsyncIterator[tuple[WebhookAdapter, Gateway]]:
    gw = Gateway(tmp_path)
    adapter = create_adapter(make_account(), gw.context())
    await adapter.start()
    try:
        yield adapter, gw
    finally:
        await adapter.stop()


def _raw(body: dict[str, Any]) -> bytes:
    """JSON with `\\uXXXX` escapes, as any sender may write them (ASCII only, so it can be sent)."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.mark.parametrize("name", ["id", "chat", "thread", "sender", "sender_name", "text", "reply_to", "extra"])
async def test_a_lone_surrogate_in_any_field_is_400_and_records_nothing(
    hook: tuple[WebhookAdapter, Gateway], name: str
) -> None:
    adapter, gw = hook
    response = await post(adapter, _raw(message(**{name: "evt\ud800"})))
    assert response.status_code == 400, response.text
    assert f"{name} holds a lone surrogate" in response.json()["error"]
    assert gw.messages == []


async def test_a_lone_surrogate_nested_or_in_a_key_is_400(hook: tuple[WebhookAdapter, Gateway]) -> None:
    adapter, gw = hook
    nested = await post(adapter, _raw(message(meta={"deep": ["ok", "x\udc00"]})))
    keyed = await post(adapter, _raw(message(**{"k\ud800": 1})))
    assert (nested.status_code, keyed.status_code) == (400, 400)
    assert "a field name holds a lone surrogate" in keyed.json()["error"]
    assert gw.messages == []
    # A replacement character or a proper pair (an emoji) is text like any other.
    fine = await post(adapter, _raw(message(id="evt\ufffd", text="hi \U0001f600")))
    assert fine.status_code == 202 and [m.message_id for m in gw.messages] == ["evt\ufffd"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "d-1", "chat": "k", "sender": "ha", "text": "t", "n": ' + b"9" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["5000 digits", "deep array", "deep in an object"],
)
async def test_too_many_digits_or_too_deep_is_400_not_valid_json(
    hook: tuple[WebhookAdapter, Gateway], body: bytes
) -> None:
    adapter, gw = hook
    response = await post(adapter, body)
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.json()["error"]
    assert gw.messages == []


@pytest.mark.parametrize("text", ['{"id": "x", "n": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_a_plugin_manifest_with_too_many_digits_or_too_deep_is_a_plugin_error(tmp_path: Path, text: str) -> None:
    folder = tmp_path / "hostile"
    folder.mkdir()
    (folder / "channel.json").write_text(text)
    with pytest.raises(PluginError, match="not valid JSON"):
        read_manifest(folder)


@pytest.mark.parametrize("arguments", ['{"action": "send", "n": ' + "9" * 5000 + "}", "[" * 100_000])
def test_tool_arguments_with_too_many_digits_or_too_deep_are_refused(arguments: str) -> None:
    with pytest.raises(ToolRefusal, match="not valid JSON"):
        parse_call(arguments, channel="fakechat", account="main", here=Target("c"), reply_to=None)


# ----------------------------------------------------------------------------- commands: /new, reply_to


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("s14") / "home", chat)
    with channel_server(home) as server:
        yield server


def test_new_on_a_pinned_route_says_it_is_pinned_and_changes_nothing(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("pin-src", "remember this")
    chat.wait_for_text("pin-src", "echo: remember this", timeout=15)
    chat.inject("pin-src", "/status")
    status = chat.wait_for_text("pin-src", lambda t: "Conversation conv_" in t, timeout=15).text
    found = re.search(r"conv_\w+", status)
    assert found
    conversation = found.group(0)
    routed = run_cli(
        srv.home, "channels", "route", "add", "fakechat:main:pinned", "assistant", "--conversation", conversation
    )
    assert routed.code == 0, routed.err
    chat.inject("pinned", "/new")
    answer = chat.wait_for_text("pinned", lambda t: "pinned" in t or "new conversation" in t, timeout=15)
    assert answer.text.startswith("📌") and conversation in answer.text, answer.text
    assert "new conversation" not in answer.text
    chat.inject("pinned", "/recall")  # still the pinned conversation: it remembers the first message
    recall = chat.wait_for_text("pinned", lambda t: "channel-message" in t, timeout=15)
    assert "remember this" in recall.text


def test_answers_to_commands_and_notices_carry_reply_to(srv: ChannelServer, chat: FakeChat) -> None:
    new = chat.inject("replyto", "/new")
    answer = chat.wait_for_text("replyto", lambda t: "new conversation" in t, timeout=15)
    assert answer.reply_to == new
    status = chat.inject("replyto", "/help")
    helped = chat.wait_for(
        lambda: next((m for m in chat.messages("replyto") if m.reply_to == status), None), timeout=15
    )
    assert helped.text


# ----------------------------------------------------------------------------- cron delivery: the verdict


def test_the_delivery_timeouts_are_ordered_so_the_verdict_is_the_outcome() -> None:
    """outbox retries < the gateway's give-up < the supervisor's `deliver` wait < cron's wait."""
    assert sum(BACKOFF_S) < DELIVER_GIVE_UP_S
    assert DELIVER_GIVE_UP_S < gateway.supervisor.DELIVER_COMMAND_TIMEOUT_S < cron.runner.DELIVER_TIMEOUT_S


async def _no_wait(_seconds: float) -> None:
    await asyncio.sleep(0)


async def test_a_reply_that_keeps_failing_says_how_long_and_how_often(tmp_path: Path, receiver: Receiver) -> None:
    receiver.status, receiver.body = 503, "busy"
    adapter = create_adapter(
        make_account(reply_url=f"http://127.0.0.1:{receiver.port}/reply"), Gateway(tmp_path).context()
    )
    outbox = Outbox(adapter, ChatRateLimiter(rate=1000.0, burst=1000), _no_wait)
    try:
        with pytest.raises(DeliveryFailed) as failed:
            await outbox.send(Target("kitchen"), "hello")
    finally:
        await adapter.stop()
    assert "reply_url answered 503: busy" in str(failed.value)
    assert "(after 8 attempts over" in str(failed.value)
    assert len(receiver.requests) == 8


async def test_a_delivery_given_up_says_why_and_sends_nothing_more(tmp_path: Path, receiver: Receiver) -> None:
    receiver.status, receiver.body = 503, "busy"
    adapter = create_adapter(
        make_account(reply_url=f"http://127.0.0.1:{receiver.port}/reply"), Gateway(tmp_path).context()
    )
    outbox = Outbox(adapter, ChatRateLimiter(rate=1000.0, burst=1000), asyncio.sleep)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(outbox.send(Target("kitchen"), "hello"), 1.2)
        reason = outbox.gave_up(1.2)
        posts = len(receiver.requests)
        await asyncio.sleep(2.5)  # the backoff would have posted again by now
    finally:
        await adapter.stop()
    assert reason.startswith("gave up after 1.2 s; the channel kept failing: reply_url answered 503: busy"), reason
    assert len(receiver.requests) == posts >= 2
