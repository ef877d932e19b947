"""A post Slack performed but answered with an error is not posted twice: `internal_error` and
`fatal_error` (Slack: "some aspect of the operation may have succeeded"), `service_unavailable` as a
500, a proxy's HTML 502/503/504 and an HTML page served with 200 are uncertain, so the part is looked
up by its key before anything is posted again. Errors that say Slack refused the call stay certain.
The real slack_sdk client against the loopback fake (`perform_then_fail`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.delivery import ReplySink
from plugins.contract import DeliveryError, Target
from plugins.slack import SlackAdapter
from plugins.slack.adapter import API_TIMEOUT_ENV
from tests.fakes.slack_api import FakeSlack
from tests.support.slack import outbox, started_adapter

pytestmark = pytest.mark.timeout(60)

ANSWERS = [  # (error, HTTP status, as an HTML page)
    ("internal_error", 200, False),
    ("fatal_error", 200, False),
    ("service_unavailable", 500, False),
    ("bad_gateway", 502, True),
    ("service_unavailable", 503, True),
    ("gateway_timeout", 504, True),
    ("maintenance", 200, True),
]


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=0.6) as fake:
        yield fake


@pytest.fixture
async def adapter(slack: FakeSlack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SlackAdapter]:
    monkeypatch.setenv(API_TIMEOUT_ENV, "2")
    async with started_adapter(slack, tmp_path) as made:
        yield made


@pytest.mark.parametrize(("error", "status", "html"), ANSWERS)
async def test_a_post_performed_but_answered_with_an_error_is_one_message(
    slack: FakeSlack, adapter: SlackAdapter, error: str, status: int, html: bool
) -> None:
    chat = f"D-err-{error}-{status}-{int(html)}"
    slack.add_channel(chat)
    slack.perform_then_fail("chat.postMessage", error, status=status, html=html)
    with pytest.raises(DeliveryError) as raised:
        await adapter.send(Target(chat, key="probe"), "probe")
    assert raised.value.uncertain and not raised.value.permanent
    slack.perform_then_fail("chat.postMessage", error, status=status, html=html)
    ids = await outbox(adapter).send(Target(chat, key=f"k:{chat}"), "hello")
    probe, message = slack.messages(chat)
    assert ids == [message.ts] and message.text == "hello"
    assert len(slack.calls("chat.postMessage", channel=chat)) == 2  # the probe and the one post
    assert slack.calls("conversations.history", channel=chat)  # looked up, found, not posted again


async def test_a_streamed_reply_whose_first_post_errs_continues_in_that_message(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    slack.add_channel("D-stream")
    slack.perform_then_fail("chat.postMessage", "internal_error")
    sink = ReplySink(outbox(adapter), Target("D-stream"), key="slack:main:D-stream:1.1", interval=0.0)
    await sink.show("The answer")
    ids = await sink.finish("The answer is 42.")
    [message] = slack.messages("D-stream")  # no frozen copy of "The answer"
    assert ids == [message.ts] and message.text == "The answer is 42."


async def test_an_approval_prompt_whose_post_errs_is_posted_once(slack: FakeSlack, adapter: SlackAdapter) -> None:
    slack.add_channel("D-prompt")
    slack.perform_then_fail("chat.postMessage", "fatal_error")
    sent = await outbox(adapter).prompt(Target("D-prompt", key="k:prompt"), "Run `ls`?", "ab12")
    [message] = slack.messages("D-prompt")
    assert sent.ids == [message.ts] and any(b.get("type") == "actions" for b in message.blocks)


@pytest.mark.parametrize("error", ["channel_not_found", "invalid_auth", "msg_too_long", "ratelimited"])
async def test_a_refusal_stays_certain(slack: FakeSlack, adapter: SlackAdapter, error: str) -> None:
    slack.add_channel("D-refused")
    slack.fail_next("chat.postMessage", error)
    with pytest.raises(DeliveryError) as refused:
        await adapter.send(Target("D-refused"), "x")
    assert not refused.value.uncertain
    assert refused.value.permanent or refused.value.retry_after is not None
