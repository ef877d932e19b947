"""Slack approval prompts end to end: a real `appserver serve --channels slack` against the loopback
fake (tests/fakes/slack_api.py). The prompt goes out like every send (a 429 is waited out, not the
prompt lost), and a gateway killed while a prompt waits reuses that prompt after its restart: one
prompt in the chat, and the one a person clicks is the one updated. The kill test runs last."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.slack_api import FakeSlack, SlackMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack-approvals") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for channel in ("C-a429", "C-akill"):
        routed = run_cli(home, "channels", "route", "add", f"slack:main:{channel}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def _prompts(slack: FakeSlack, channel: str) -> list[SlackMessage]:
    return [m for m in slack.messages(channel) if m.text.startswith("🔐")]


def _with_buttons(message: SlackMessage) -> bool:
    return any(b.get("type") == "actions" for b in message.blocks)


def test_a_429_on_the_prompt_is_waited_out_and_the_prompt_shown(srv: ChannelServer, slack: FakeSlack) -> None:
    armed = [True]

    def rate_limit_the_prompt(method: str, params: dict[str, Any]) -> None:
        if armed[0] and method == "chat.postMessage" and params.get("channel") == "C-a429" and "blocks" in params:
            armed[0] = False
            slack.fail_next("chat.postMessage", "ratelimited", retry_after=1)

    slack.on_request = rate_limit_the_prompt
    try:
        slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C-a429")
        shown = slack.wait_for(
            lambda: next((m for m in _prompts(slack, "C-a429") if _with_buttons(m)), None),
            timeout=30,
            what="the approval prompt with buttons, after the 429",
        )
    finally:
        slack.on_request = None
    posts = [c for c in slack.calls("chat.postMessage", channel="C-a429") if "blocks" in c.params]
    assert [c.status for c in posts] == [429, 200], [c.status for c in posts]
    assert posts[1].t - posts[0].t >= 1.0  # Retry-After honoured
    short = re.search(r"/approve (\w+)", shown.text)
    assert short, shown.text
    slack.click("U2", "C-a429", shown.ts, f"approve:{short.group(1)}", user_name="ann")
    decided = slack.wait_for_text("C-a429", lambda t: t.startswith("🔐") and "Approved by `ann`" in t, timeout=20)
    assert decided.ts == shown.ts and not _with_buttons(decided)
    assert len(_prompts(slack, "C-a429")) == 1


def test_a_prompt_pending_across_a_kill_9_is_reused_not_posted_again(srv: ChannelServer, slack: FakeSlack) -> None:
    slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C-akill")
    first = slack.wait_for(lambda: next(iter(_prompts(slack, "C-akill")), None), timeout=30, what="the approval prompt")
    short = re.search(r"/approve (\w+)", first.text)
    assert short and _with_buttons(first), first
    time.sleep(1.0)  # the prompt's id is noted in gateway.db right after its post returned
    pid = srv.gateway_pid()
    os.kill(pid, signal.SIGKILL)
    slack.wait_for(lambda: (srv.gateway_pid() != pid) or None, timeout=30, what="a new gateway child")
    srv.wait_channels_ready(30)
    time.sleep(4.0)  # the server sends the pending request again to the restarted gateway
    assert [m.ts for m in _prompts(slack, "C-akill")] == [first.ts], [m.text for m in slack.messages("C-akill")]
    slack.click("U2", "C-akill", first.ts, f"approve:{short.group(1)}", user_name="ann")
    decided = slack.wait_for_text("C-akill", lambda t: t.startswith("🔐") and "Approved by `ann`" in t, timeout=20)
    assert decided.ts == first.ts and not _with_buttons(decided)  # the prompt posted is the one updated
    slack.wait_for_text("C-akill", lambda t: t.startswith(("clock -&gt; ", "clock -> ")), timeout=20)
    assert len(_prompts(slack, "C-akill")) == 1
    assert not any(_with_buttons(m) for m in slack.messages("C-akill"))
