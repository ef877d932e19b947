"""Slack approval prompts end to end against the loopback fake (tests/fakes/slack_api.py), with a
real `appserver serve --channels slack`, a fast watchdog and a short approval timeout:

* the clicker's display name is shown literally in the decided prompt, not as a masked link;
* a prompt whose call timed out while the gateway child was hung (SIGSTOP, then killed by the
  watchdog and restarted) is edited by the restarted gateway: its buttons go, and it no longer
  asks for an answer. The SIGSTOP test runs last."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
from collections.abc import Iterator

import pytest

from gateway.db import default_path
from tests.fakes.slack_api import FakeSlack, SlackMessage
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import READY_LINE, ChannelServer, channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

FAST_WATCHDOG = {
    "APPSERVER_GATEWAY_PING_INTERVAL_S": "1",
    "APPSERVER_GATEWAY_PING_TIMEOUT_S": "1",
    "APPSERVER_GATEWAY_HUNG_KILL_S": "7",
    "APPSERVER_LIMITS__APPROVAL_TIMEOUT_S": "6",  # the call times out before the watchdog kills
    # gateway/supervisor.py reads the watchdog's variables at import, which the test zygote did long
    # ago: a variable of the PYTHON family makes `serve` a fresh interpreter.
    "PYTHON_FRESH_INTERPRETER": "1",
}


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=1.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("slack-reconcile") / "home"
    settings = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                "dm_policy": "open", "default_agent": "assistant"}  # fmt: skip
    write_config(home, {"slack": {"main": settings}}, ["slack"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for channel in ("D-name", "D-hung"):
        routed = run_cli(home, "channels", "route", "add", f"slack:main:{channel}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token, **FAST_WATCHDOG)
    with channel_server(home, "--channels", "slack", env=env) as server:
        yield server


def _with_buttons(message: SlackMessage) -> bool:
    return any(b.get("type") == "actions" for b in message.blocks)


def _prompt(slack: FakeSlack, channel: str) -> tuple[SlackMessage, str]:
    prompt = slack.wait_for(
        lambda: next((m for m in slack.messages(channel) if m.text.startswith("🔐") and _with_buttons(m)), None),
        timeout=25,
        what="the approval prompt with buttons",
    )
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    return prompt, short.group(1)


def _noted(srv: ChannelServer, ts: str) -> bool:
    """Whether gateway.db holds `ts` among an approval prompt's message ids."""
    try:
        conn = sqlite3.connect(f"file:{default_path(srv.home)}?mode=ro", uri=True)  # reads the -wal too
        try:
            rows = conn.execute("SELECT message_ids FROM approval_prompts").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError:  # busy for a moment
        return False
    return any(ts in json.loads(ids or "[]") for (ids,) in rows)


def _now(slack: FakeSlack, channel: str, ts: str) -> SlackMessage:
    return next(m for m in slack.messages(channel) if m.ts == ts)


def test_the_clickers_name_is_shown_literally(srv: ChannelServer, slack: FakeSlack) -> None:
    name = "[Verify your account](http://evil.example/login)"
    slack.inject_dm("U7", "/call clock {}", channel="D-name")
    prompt, short = _prompt(slack, "D-name")
    slack.click("U7", "D-name", prompt.ts, f"approve:{short}", user_name=name)
    decided = slack.wait_for_text("D-name", lambda t: t.startswith("🔐") and "Approved by" in t, timeout=20)
    assert decided.ts == prompt.ts and not _with_buttons(decided)
    assert decided.text.endswith(f"Approved by `{name}`"), decided.text  # a code span: no masked link
    assert "<http://evil.example/login|" not in decided.text


def test_a_prompt_that_timed_out_while_the_gateway_hung_loses_its_buttons(srv: ChannelServer, slack: FakeSlack) -> None:
    slack.inject_dm("U8", "/call clock {}", channel="D-hung")
    prompt, _short = _prompt(slack, "D-hung")
    # the prompt's ts is noted in gateway.db after its post returned: hang the gateway once it is
    wait_for(lambda: _noted(srv, prompt.ts), 20, "the prompt's ts noted in gateway.db")
    pid = srv.gateway_pid()
    readies = srv.log().count(READY_LINE)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: srv.gateway_pid() != pid or None, 40, "the watchdog's restart")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the watchdog, as it should be
    srv.wait_channels_ready(restarts=readies)  # the restarted gateway's

    def settled() -> SlackMessage | None:
        m = _now(slack, "D-hung", prompt.ts)
        return m if "No longer waiting for an answer" in m.text and not _with_buttons(m) else None

    decided = wait_for(settled, 40, "the prompt edited without buttons")
    assert "Reply /approve" not in decided.text
    assert [m.ts for m in slack.messages("D-hung") if m.text.startswith("🔐")] == [prompt.ts]
