"""Each Slack reply part is posted once, end to end: a real `appserver serve --channels slack`, its
gateway child running plugins/slack with the real slack_sdk clients, against the loopback fake
(tests/fakes/slack_api.py). A post whose answer comes after the client's timeout, and a post in
flight when the gateway is killed -9, are both found again by the key in their message metadata:
one message per part, and the reply continues in it. One server for the module (its Web API
timeout shortened through the environment); the kill -9 tests run last (they restart the child)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Entry, Ledger, UpdateKey
from plugins.slack import MAX_LENGTH
from plugins.slack.adapter import API_TIMEOUT_ENV
from tests.fakes.slack_api import Call, FakeSlack, SlackMessage
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, gateway_children, store_turns, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

API_TIMEOUT_S = 2.0  # the gateway child's Slack Web API timeout
HELD_S = 5.0  # a held post is answered this long after it was performed: after the timeout


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack-once") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token, **{API_TIMEOUT_ENV: str(API_TIMEOUT_S)})
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(1, n + 1))


def _entry(home: Path, channel: str, ts: str) -> Entry | None:
    ledger = Ledger.open(default_path(home))
    try:
        return ledger.get(UpdateKey("slack", "main", f"{channel}:{ts}"))
    finally:
        ledger.close()


def _delivered(srv: ChannelServer, channel: str, ts: str) -> Entry:
    entry: Entry = wait_for(
        lambda: (e := _entry(srv.home, channel, ts)) is not None and e.state == "delivered" and e,
        timeout=40,
        what="the reply recorded as delivered",
    )
    return entry


def _keys(messages: list[SlackMessage]) -> list[str]:
    return [str((m.metadata or {}).get("event_payload", {}).get("key")) for m in messages]


def test_a_post_answered_after_the_timeout_is_one_message_and_the_reply_continues_in_it(
    srv: ChannelServer, slack: FakeSlack
) -> None:
    slack.hold_answers("chat.postMessage", HELD_S, channel="D-late")
    ts = slack.inject_dm("U1", "/slow 120", channel="D-late")  # 6 s of words: it goes on after the lookup
    message = slack.wait_for_text("D-late", _words(120), timeout=40)
    entry = _delivered(srv, "D-late", ts)
    assert len(slack.messages("D-late")) == 1, [m.text for m in slack.messages("D-late")]
    assert len(slack.calls("chat.postMessage", channel="D-late")) == 1  # the late one, never repeated
    assert slack.calls("conversations.history", channel="D-late")  # found by its key
    assert message.edits >= 2 and message.history[0] != message.history[-1]  # grew in that one message
    assert _keys([message]) == [f"slack:main:D-late:{ts}:0"]
    assert entry.remote_ids == (message.ts,)
    assert store_turns(srv.home, f'message_id="D-late:{ts}"') == 1


class _KillOnce:
    """SIGKILLs the gateway child the first time it is called (from the fake's hook, on its loop)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.done = threading.Event()

    def __call__(self) -> None:
        if not self.done.is_set():
            self.done.set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _kill_at_post(slack: FakeSlack, kill: _KillOnce, channel: str, nth: int) -> None:
    """Kill the child when the `nth` post to `channel` has been performed, before its answer goes out
    (and hold that answer, so nothing of it reaches anyone in time)."""
    seen: list[Call] = []

    def on_answer(call: Call) -> None:
        if call.method == "chat.postMessage" and call.channel == channel and call.status == 200:
            seen.append(call)
            if len(seen) == nth:
                kill()

    slack.on_answer = on_answer


def _restarted(srv: ChannelServer, first: int, kill: _KillOnce) -> None:
    wait_for(kill.done.is_set, timeout=30, what="the post the child is killed at")
    wait_for(lambda: first not in gateway_children(srv.proc.pid), timeout=20, what="the child to die")
    wait_for(lambda: srv.gateway_pid() != first or None, timeout=30, what="the restarted child")


def test_kill_9_while_a_post_is_in_flight_gives_one_message(srv: ChannelServer, slack: FakeSlack) -> None:
    first = srv.gateway_pid()
    kill = _KillOnce(first)
    _kill_at_post(slack, kill, "D-kill", 1)
    slack.hold_answers("chat.postMessage", HELD_S, channel="D-kill")
    try:
        ts = slack.inject_dm("U1", "/slow 60", channel="D-kill")
        _restarted(srv, first, kill)
        message = slack.wait_for_text("D-kill", _words(60), timeout=40)
        entry = _delivered(srv, "D-kill", ts)
    finally:
        slack.on_answer = None
    time.sleep(1.0)  # a duplicate would show up by now
    assert [m.ts for m in slack.messages("D-kill")] == [message.ts], [m.text for m in slack.messages("D-kill")]
    assert len(slack.calls("chat.postMessage", channel="D-kill")) == 1  # the killed child's, reused
    assert slack.calls("conversations.history", channel="D-kill")
    assert entry.remote_ids == (message.ts,)
    assert store_turns(srv.home, f'message_id="D-kill:{ts}"') == 1
    assert "the child exited with code -9" in srv.log()


def test_kill_9_while_a_later_part_is_in_flight_gives_one_message_per_part(
    srv: ChannelServer, slack: FakeSlack
) -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "word & more " * 60 for i in range(12))
    assert len(text) > 2 * MAX_LENGTH
    first = srv.gateway_pid()
    kill = _KillOnce(first)
    _kill_at_post(slack, kill, "D-kill2", 2)  # the first part noted, the second performed, unanswered
    try:
        ts = slack.inject_dm("U1", text.replace("&", "&amp;"), channel="D-kill2")
        _restarted(srv, first, kill)

        def whole() -> list[SlackMessage] | None:
            parts = slack.messages("D-kill2")
            return parts if "".join(m.text for m in parts).count("word &amp; more") >= 12 * 60 else None

        slack.wait_for(whole, timeout=40, what="the whole reply, split")
        entry = _delivered(srv, "D-kill2", ts)
    finally:
        slack.on_answer = None
    time.sleep(1.0)  # a duplicate would show up by now
    parts = slack.messages("D-kill2")
    assert "".join(m.text for m in parts).count("word &amp; more") == 12 * 60, [len(m.text) for m in parts]
    assert len(parts) >= 3 and all(len(m.text) <= MAX_LENGTH for m in parts)
    assert _keys(parts) == [f"slack:main:D-kill2:{ts}:{i}" for i in range(len(parts))]  # each part once
    assert len(slack.calls("chat.postMessage", channel="D-kill2")) == len(parts)
    assert entry.remote_ids == tuple(m.ts for m in parts)
    assert store_turns(srv.home, f'message_id="D-kill2:{ts}"') == 1
