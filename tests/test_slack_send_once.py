"""A Slack reply part is posted once: the real slack_sdk client against the loopback fake
(tests/fakes/slack_api.py), with the gateway's `Outbox` and `ReplySink`. Each post carries its key
in message metadata; a post whose answer comes after the client's timeout is found again by that
key (`conversations.history`, or `conversations.replies` in a thread) and the reply continues in it.
The kill -9 of the gateway while a post is in flight is in tests/test_slack_send_once_e2e.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from slack_sdk.http_retry.request import HttpRequest as RetryRequest
from slack_sdk.http_retry.state import RetryState

from gateway.delivery import ReplySink, SendUncertain
from plugins.contract import DeliveryError, Target
from plugins.slack import SlackAdapter
from plugins.slack.adapter import API_TIMEOUT_ENV, REPLY_EVENT, _RetryDroppedConnections
from tests.fakes.slack_api import FakeSlack
from tests.support.slack import outbox, started_adapter

pytestmark = pytest.mark.timeout(60)

# the client's timeout for Web API calls in these tests (a loaded CI host took over 0.5 s for a plain one)
TIMEOUT_S = 1.0
LATE_S = 2.5  # a held answer comes this long after the post was performed


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=0.6) as fake:
        yield fake


@pytest.fixture
async def adapter(slack: FakeSlack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SlackAdapter]:
    monkeypatch.setenv(API_TIMEOUT_ENV, str(TIMEOUT_S))
    async with started_adapter(slack, tmp_path) as made:
        yield made


def tagged(key: str) -> dict[str, Any]:
    return {"event_type": REPLY_EVENT, "event_payload": {"key": key}}


async def test_a_post_carries_its_key_and_is_found_by_it(slack: FakeSlack, adapter: SlackAdapter) -> None:
    slack.add_channel("D-key")
    since = time.time()
    [other] = await adapter.send(Target("D-key", key="slack:main:D-key:1:0"), "first")
    [ts] = await adapter.send(Target("D-key", key="slack:main:D-key:2:0"), "second")
    await adapter.send(Target("D-key"), "a notice without a key")
    [first, second, notice] = slack.messages("D-key")
    assert first.metadata == tagged("slack:main:D-key:1:0") and second.metadata == tagged("slack:main:D-key:2:0")
    assert notice.metadata is None
    slack.inject_dm("U1", "a person writes meanwhile", channel="D-key")
    assert await adapter.find_sent(Target("D-key", key="slack:main:D-key:2:0"), since) == [ts]
    assert await adapter.find_sent(Target("D-key", key="slack:main:D-key:1:0"), since) == [other]
    assert await adapter.find_sent(Target("D-key", key="slack:main:D-key:3:0"), since) is None
    assert await adapter.find_sent(Target("D-key", key="slack:main:D-key:2:0"), since + 3600) is None  # too old
    [call] = slack.calls("conversations.history", channel="D-key")[:1]
    assert call.params.get("include_all_metadata") in ("1", "true", True)


async def test_a_post_in_a_thread_is_found_among_the_threads_replies(slack: FakeSlack, adapter: SlackAdapter) -> None:
    parent = slack.inject_mention("U2", "<@UBOT> start a thread", channel="C-thread")
    [ts] = await adapter.send(Target("C-thread", thread=parent, key="slack:main:k:0"), "in the thread")
    await adapter.send(Target("C-thread", key="slack:main:k:0:elsewhere"), "top level")
    assert await adapter.find_sent(Target("C-thread", thread=parent, key="slack:main:k:0"), 0.0) == [ts]
    assert slack.calls("conversations.replies", channel="C-thread")
    assert await adapter.find_sent(Target("C-thread", key="slack:main:k:0"), 0.0) is None  # not at the top level


async def test_the_lookup_pages_through_history_and_gives_up_when_it_cannot_tell(
    slack: FakeSlack, adapter: SlackAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plugins.slack.adapter as slack_adapter

    monkeypatch.setattr(slack_adapter, "LOOKUP_PAGE", 2)
    monkeypatch.setattr(slack_adapter, "LOOKUP_PAGES", 3)
    slack.add_channel("D-pages")
    [ts] = await adapter.send(Target("D-pages", key="wanted"), "the one")
    for i in range(5):
        await adapter.send(Target("D-pages", key=f"other:{i}"), f"later {i}")
    assert await adapter.find_sent(Target("D-pages", key="wanted"), 0.0) == [ts]  # the last of the third page
    await adapter.send(Target("D-pages", key="other:5"), "one more")  # now on a fourth page: too far
    with pytest.raises(DeliveryError, match="cannot tell") as refused:
        await adapter.find_sent(Target("D-pages", key="wanted"), 0.0)
    assert refused.value.permanent


async def test_a_post_answered_after_the_timeout_is_one_message_and_the_reply_continues_in_it(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    slack.add_channel("D-late")
    slack.hold_answers("chat.postMessage", LATE_S, channel="D-late")
    noted: list[tuple[str, float]] = []
    sink = ReplySink(outbox(adapter), Target("D-late"), key="slack:main:D-late:1.1", interval=0.0)
    sink.on_attempt = lambda part, at: noted.append((part, at))
    assert await sink.show("The answer") == [slack.messages("D-late")[0].ts]
    await sink.show("The answer is")
    ids = await sink.finish("The answer is **42**.")
    [message] = slack.messages("D-late")
    assert ids == [message.ts] and message.text == "The answer is *42*." and message.edits >= 1
    posts = slack.calls("chat.postMessage", channel="D-late")
    assert len(posts) == 1  # performed once; its late answer was never needed
    assert slack.calls("conversations.history", channel="D-late")
    assert [part for part, _ in noted] == ["slack:main:D-late:1.1:0"]


async def test_a_late_post_in_a_thread_is_found_in_the_thread(slack: FakeSlack, adapter: SlackAdapter) -> None:
    parent = slack.inject_mention("U2", "<@UBOT> a question", channel="C-late")
    slack.hold_answers("chat.postMessage", LATE_S, channel="C-late")
    sink = ReplySink(outbox(adapter), Target("C-late", thread=parent), key="slack:main:C-late:q", stream=False)
    ids = await sink.finish("one answer, in the thread")
    [message] = slack.messages("C-late")
    assert ids == [message.ts] and message.thread_ts == parent
    assert len(slack.calls("chat.postMessage", channel="C-late")) == 1
    assert slack.calls("conversations.replies", channel="C-late")


async def test_a_late_notice_outside_a_reply_is_found_by_the_key_the_outbox_gave_it(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    slack.add_channel("D-notice")
    slack.hold_answers("chat.postMessage", LATE_S, channel="D-notice")
    ids = await outbox(adapter).send(Target("D-notice"), "a notice")
    [message] = slack.messages("D-notice")
    assert ids == [message.ts] and message.metadata is not None
    assert len(slack.calls("chat.postMessage", channel="D-notice")) == 1


async def test_a_post_that_never_arrived_is_posted_again_after_the_lookup(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    slack.add_channel("D-lost")
    slack.hold_answers("chat.postMessage", LATE_S, channel="D-lost", perform=False)
    ids = await outbox(adapter).send(Target("D-lost", key="k:lost"), "hello")
    [message] = slack.messages("D-lost")
    assert ids == [message.ts] and message.text == "hello"
    assert len(slack.calls("chat.postMessage", channel="D-lost")) == 2
    # looked up at once, and once more when LOOKUP_SETTLE_S had passed since the lost post began
    assert len(slack.calls("conversations.history", channel="D-lost")) == 2


async def test_a_post_slack_performs_after_the_first_lookup_is_found_by_the_second(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    """The post was still queued at Slack when the client gave up and looked: not there yet. A
    second look, LOOKUP_SETTLE_S after the post began, finds it (was: posted again, shown twice)."""
    slack.add_channel("D-queued")
    slack.hold_answers("chat.postMessage", 2 * LATE_S, channel="D-queued", perform_after=LATE_S)
    ids = await outbox(adapter).send(Target("D-queued", key="k:queued"), "hello")
    # whatever Slack still had queued is performed by now: the held post was performed LATE_S after it
    # arrived and is answered 2 * LATE_S after it; send() returned at the second look, LOOKUP_SETTLE_S
    # (3 s) after the post began, so LATE_S more is past both (a post again would be performed at once)
    await asyncio.sleep(LATE_S)
    [message] = slack.messages("D-queued")
    assert ids == [message.ts] and message.text == "hello"
    [post] = slack.calls("chat.postMessage", channel="D-queued")
    looks = slack.calls("conversations.history", channel="D-queued")
    assert len(looks) == 2 and looks[0].t < post.t < looks[1].t  # performed between the two looks


async def test_without_the_history_scope_a_late_post_is_not_posted_twice(
    slack: FakeSlack, adapter: SlackAdapter
) -> None:
    slack.add_channel("D-scope")
    slack.hold_answers("chat.postMessage", LATE_S, channel="D-scope")
    slack.fail_next("conversations.history", "missing_scope")
    with pytest.raises(SendUncertain, match="missing_scope"):
        await outbox(adapter).send(Target("D-scope", key="k:scope"), "hello")
    assert len(slack.messages("D-scope")) == 1 and len(slack.calls("chat.postMessage", channel="D-scope")) == 1


async def test_a_timeout_is_uncertain_and_a_slack_error_is_not(slack: FakeSlack, adapter: SlackAdapter) -> None:
    slack.add_channel("D-kinds")
    slack.hold_answers("chat.postMessage", LATE_S, channel="D-kinds")
    with pytest.raises(DeliveryError) as late:
        await adapter.send(Target("D-kinds"), "x")
    assert late.value.uncertain and not late.value.permanent
    slack.fail_next("chat.postMessage", "channel_not_found")
    with pytest.raises(DeliveryError) as refused:
        await adapter.send(Target("D-kinds"), "x")
    assert not refused.value.uncertain


async def test_slack_sdk_never_retries_a_post_by_itself() -> None:
    handler = _RetryDroppedConnections()
    dropped = aiohttp.ServerDisconnectedError()

    async def retries(method: str) -> bool:
        request = RetryRequest(method="POST", url=f"https://slack.com/api/{method}", headers={}, body_params={})
        return await handler.can_retry_async(state=RetryState(), request=request, response=None, error=dropped)

    assert not await retries("chat.postMessage")
    assert await retries("chat.update") and await retries("conversations.history")
