"""The Slack channel end to end (issue 18): a real `appserver serve --channels slack`, its gateway
child running plugins/slack with the real slack_sdk clients, against the loopback fake of the Slack
Web API and Socket Mode (tests/fakes/slack_api.py). One server for the module; the kill -9 test
runs last (it restarts the gateway child)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Iterator

import pytest

from plugins.slack import MAX_LENGTH
from tests.fakes.slack_api import FakeSlack, SlackMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", "slack:main:C-appr", "careful")
    assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def test_a_dm_grows_by_updates_and_ends_exact_in_mrkdwn(srv: ChannelServer, slack: FakeSlack) -> None:
    ts = slack.inject_dm("U1", "/slow 30", channel="D-e2e")
    words = " ".join(f"w{i}" for i in range(1, 31))
    message = slack.wait_for_text("D-e2e", words, timeout=30)
    assert len(slack.messages("D-e2e")) == 1
    assert message.edits >= 1, "a 1.5 s reply should have grown by chat.update"
    assert message.history[-1] == words
    assert [c.method for c in slack.calls(channel="D-e2e")].count("chat.postMessage") == 1
    assert slack.acked(slack.event_id_of(ts))
    assert store_turns(srv.home, f'message_id="D-e2e:{ts}"') == 1
    ts2 = slack.inject_dm("U1", "**bold** &amp; &lt;tag&gt; [docs](https://x.test/?a=1&amp;b=2)", channel="D-e2e")
    final = slack.wait_for_text("D-e2e", lambda t: t.startswith("echo: *bold*"), timeout=20)
    assert final.text == "echo: *bold* &amp; &lt;tag&gt; <https://x.test/?a=1&amp;b=2|docs>"
    assert store_turns(srv.home, f'message_id="D-e2e:{ts2}"') == 1
    assert "slack:main running" in srv.channels_check()["detail"]


def test_a_short_reply_with_a_fence_in_mid_line_keeps_one_code_block(srv: ChannelServer, slack: FakeSlack) -> None:
    """A fence opening mid-line in a short reply ended in a stray extra fence (outside finding, s21)."""
    slack.inject_dm("U1", "Here it is: ```python\nprint(1)\n```", channel="D-fence")
    reply = slack.wait_for_text("D-fence", lambda t: "print(1)" in t, timeout=20)
    assert reply.text.count("```") == 2 and reply.text.rstrip().endswith("```"), reply.text
    assert re.search(r"```\n?(python\n)?print\(1\)\n```$", reply.text.rstrip()), reply.text


def test_a_mention_is_answered_in_its_thread(srv: ChannelServer, slack: FakeSlack) -> None:
    ts = slack.inject_mention("U2", "<@UBOT> hello channel", channel="C-e2e")
    reply = slack.wait_for_text("C-e2e", "echo: hello channel", timeout=20)
    assert reply.thread_ts == ts
    follow = slack.inject_mention("U2", "<@UBOT> and again", channel="C-e2e", thread_ts=ts)
    second = slack.wait_for_text("C-e2e", "echo: and again", timeout=20)
    assert second.thread_ts == ts and follow != ts


def test_a_long_reply_is_split_at_the_limit(srv: ChannelServer, slack: FakeSlack) -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "word & more " * 60 for i in range(12))
    assert len(text) > 2 * MAX_LENGTH
    slack.inject_dm("U1", text.replace("&", "&amp;"), channel="D-long")

    def whole() -> list[str] | None:
        parts = [m.text for m in slack.messages("D-long")]
        return parts if "".join(parts).count("word &amp; more") == 12 * 60 else None

    parts = slack.wait_for(whole, timeout=30, what="the whole reply, split")
    assert len(parts) >= 3 and all(len(p) <= MAX_LENGTH for p in parts), [len(p) for p in parts]
    assert parts[0].startswith("echo: Paragraph 0:") and parts[-1].rstrip().endswith("word &amp; more")


def test_429_retry_after_is_honoured(srv: ChannelServer, slack: FakeSlack) -> None:
    slack.fail_next("chat.postMessage", "ratelimited", retry_after=2)
    slack.inject_dm("U1", "slowly please", channel="D-429")
    slack.wait_for_text("D-429", "echo: slowly please", timeout=20)
    calls = [c for c in slack.calls(channel="D-429") if c.method in ("chat.postMessage", "chat.update")]
    assert [c.status for c in calls][:2] == [429, 200], [c.status for c in calls]
    assert calls[1].t - calls[0].t >= 2.0, calls[1].t - calls[0].t
    assert len(slack.messages("D-429")) == 1


def test_an_approval_is_answered_by_a_button(srv: ChannelServer, slack: FakeSlack) -> None:
    ts = slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C-appr")

    def prompt() -> SlackMessage | None:
        return next((m for m in slack.messages("C-appr") if any(b["type"] == "actions" for b in m.blocks)), None)

    shown = slack.wait_for(prompt, timeout=20, what="the approval prompt with buttons")
    assert shown.thread_ts == ts and shown.text.startswith("🔐")
    short = re.search(r"/approve (\w+)", shown.text)
    assert short, shown
    slack.click("U2", "C-appr", shown.ts, f"approve:{short.group(1)}", user_name="ann")
    decided = slack.wait_for_text("C-appr", lambda t: t.startswith("🔐") and "Approved by `ann`" in t, timeout=20)
    assert [b["type"] for b in decided.blocks] == ["section"]  # the buttons are gone
    answer = slack.wait_for_text(
        "C-appr", lambda t: t.startswith("clock -&gt; ") or t.startswith("clock -> "), timeout=20
    )
    assert answer.thread_ts == ts


def test_a_disconnect_mid_burst_loses_nothing_and_doubles_nothing(srv: ChannelServer, slack: FakeSlack) -> None:
    before = slack.connections
    sent = []
    for i in range(6):
        sent.append((f"D-burst{i}", slack.inject_dm("U1", f"burst {i}", channel=f"D-burst{i}")))
        if i == 2:
            assert slack.disconnect()  # Slack asks the client to reconnect, mid-burst
    for i, (channel, ts) in enumerate(sent):
        slack.wait_for_text(channel, f"echo: burst {i}", timeout=20)
        assert store_turns(srv.home, f'message_id="{channel}:{ts}"') == 1
    for channel, _ in sent:
        assert len(slack.messages(channel)) == 1
    assert slack.connections == before + 1 and slack.open_sockets == 1
    assert not slack.pending()


def test_kill_9_before_the_ack_gives_one_turn_and_one_reply(srv: ChannelServer, slack: FakeSlack) -> None:
    pid = srv.gateway_pid()
    armed = threading.Event()
    armed.set()

    def kill_on_delivery(event_id: str, retry_attempt: int) -> None:
        if armed.is_set() and retry_attempt == 0:
            armed.clear()
            with contextlib.suppress(ProcessLookupError):  # (a hook that raised would stop the fake's pump)
                os.kill(pid, signal.SIGKILL)  # delivered, the ack not yet sent
            slack.lose_ack(event_id)  # (on a loaded machine the ack may have left just before the kill)

    slack.on_delivered(kill_on_delivery)
    try:
        ts = slack.inject_dm("U1", "survive the crash", channel="D-kill")
        slack.wait_for_text("D-kill", "echo: survive the crash", timeout=40)
    finally:
        slack.on_delivered(None)
    event_id = slack.event_id_of(ts)
    # Slack redelivers it (its ack died with the process). On a loaded machine the first gateway
    # may have replied before the kill landed: then the redelivery comes after the reply.
    slack.wait_for(
        lambda: (max(d.retry_attempt for d in slack.deliveries(event_id)) >= 1 and slack.acked(event_id)) or None,
        timeout=30,
    )
    assert store_turns(srv.home, f'message_id="D-kill:{ts}"') == 1
    slack.wait_for(lambda: srv.gateway_pid() != pid or None, timeout=5)
    assert len(slack.messages("D-kill")) == 1
    assert slack.open_sockets == 1
