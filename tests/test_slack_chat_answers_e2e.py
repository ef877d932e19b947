"""Chat answers in Slack end to end: a real `appserver serve --channels slack` against the loopback
fake. `/approve X` needs the ID the prompt shows (or the whole call id), not any piece of it; a
second click on an answered prompt posts nothing; a stranger's commands are not kept for the first
turn after the pairing is approved."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.fakes.slack_api import FakeSlack, SlackMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config

pytestmark = pytest.mark.timeout(150)

CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack-answers") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "pairing", "allow": ["U2"], "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for channel in ("C-suffix", "C-double"):
        routed = run_cli(home, "channels", "route", "add", f"slack:main:{channel}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def _prompt(slack: FakeSlack, channel: str) -> tuple[SlackMessage, str]:
    shown = slack.wait_for(
        lambda: next((m for m in slack.messages(channel) if m.text.startswith("🔐")), None),
        timeout=30,
        what="the approval prompt",
    )
    short = re.search(r"/approve (\w+)", shown.text)
    assert short, shown.text
    return shown, short.group(1)


def _with_buttons(message: SlackMessage) -> bool:
    return any(b.get("type") == "actions" for b in message.blocks)


def test_approve_needs_the_id_as_shown_not_a_piece_of_it(srv: ChannelServer, slack: FakeSlack) -> None:
    parent = slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C-suffix")
    shown, short = _prompt(slack, "C-suffix")
    for piece in (short[-1], short[-3:]):
        slack.inject_mention("U2", f"<@UBOT> /approve {piece}", channel="C-suffix", thread_ts=parent)
        slack.wait_for_text("C-suffix", f"No request waiting for an answer here with ID `{piece}`.", timeout=20)
    assert not any("Approved" in m.text for m in slack.messages("C-suffix")) and _with_buttons(shown)
    slack.inject_mention("U2", f"<@UBOT> /approve {short.upper()}", channel="C-suffix", thread_ts=parent)
    decided = slack.wait_for_text("C-suffix", lambda t: t.startswith("🔐") and "Approved by" in t, timeout=20)
    assert decided.ts == shown.ts and not _with_buttons(decided)


def test_a_second_click_on_an_answered_prompt_posts_nothing(srv: ChannelServer, slack: FakeSlack) -> None:
    slack.inject_mention("U2", "<@UBOT> /call clock {}", channel="C-double")
    shown, short = _prompt(slack, "C-double")
    slack.click("U2", "C-double", shown.ts, f"approve:{short}", user_name="ann")
    slack.click("U2", "C-double", shown.ts, f"deny:{short}", user_name="ann")
    decided = slack.wait_for_text("C-double", lambda t: t.startswith("🔐") and "Approved by `ann`" in t, timeout=20)
    assert decided.ts == shown.ts and not _with_buttons(decided)
    slack.wait_for_text("C-double", lambda t: t.startswith(("clock -&gt; ", "clock -> ")), timeout=20)
    time.sleep(2.0)  # the second click has long been handled
    texts = [m.text for m in slack.messages("C-double")]
    assert not any("No request waiting" in t or "already answered" in t for t in texts), texts
    assert "Denied" not in decided.text


def test_a_strangers_commands_are_not_kept_for_the_first_turn(srv: ChannelServer, slack: FakeSlack) -> None:
    slack.inject_dm("U9", "/pair", channel="D-stranger")
    prompt = slack.wait_for_text("D-stranger", lambda t: "pairing code" in t, timeout=20)
    slack.inject_dm("U9", "/approve ABCDEFGH", channel="D-stranger")
    slack.inject_dm("U9", "/new", channel="D-stranger")
    slack.inject_dm("U9", "hello there", channel="D-stranger")
    time.sleep(1.5)  # all four are decided before the approval
    code = re.search(CODE, prompt.text)
    assert code, prompt.text
    ok = run_cli(srv.home, "pairing", "approve", code.group(0).replace("-", ""))
    assert ok.code == 0, ok.err
    reply = slack.wait_for_text("D-stranger", lambda t: t.startswith("echo:"), timeout=30)
    assert reply.text == "echo: hello there", reply.text
    assert store_turns(srv.home, "hello there") == 1
    for command in ("/pair", "/approve ABCDEFGH", "/new"):
        assert store_turns(srv.home, command) == 0, command
