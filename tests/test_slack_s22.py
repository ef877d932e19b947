"""Slack channel fixes (session 22), end to end: a real `appserver serve --channels slack` and its
gateway child, the real slack_sdk clients against the loopback fake (tests/fakes/slack_api.py).

* An Approve click that Slack holds while the server restarts (kill -9) and redelivers the moment
  the new gateway connects is applied, not dropped as a click on an answered prompt: the server
  has not re-sent its pending requests yet at that moment (gateway/chatops.py `_announced`).
* A bot token Slack refuses while running (`token_revoked` on every post) puts the account in
  `error` naming the bot token, in /readyz and `appserver channels status`.
  The Telegram (401) and Discord (401) adapters had the same gap on a send: fixed the same way.
* A Deny click is recorded for the model as the clicker's (`by boss (via appserver-gateway)`),
  not as the gateway's client name (`approval_response.on_behalf_of`).
* A message Slack sends on the old socket right after asking for a refresh (`disconnect`) is
  handled from that socket, not dropped and redelivered seconds later behind the person's next
  messages: the chat and the conversation keep the order they were written in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugins.contract import Account, AdapterContext, DeliveryError, InboundMessage, Target
from plugins.discord import create_adapter as create_discord
from plugins.telegram import create_adapter as create_telegram
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack, SlackMessage
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, _text, channel_server, gateway_children, write_config
from tests.support.wait import wait_for, wait_until

pytestmark = pytest.mark.timeout(180)

DISCORD_CHANNEL = "300000000000000001"  # the fake's guild text channel


def _home(root: Path, slack: FakeSlack, routes: dict[str, str], **settings: object) -> Path:
    home = root / "home"
    account = {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
               "dm_policy": "open", "default_agent": "assistant", **settings}  # fmt: skip
    write_config(home, {"slack": {"main": account}}, ["slack"])
    if routes:
        created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
        assert created.code == 0, created.err
    for key, agent in routes.items():
        routed = run_cli(home, "channels", "route", "add", key, agent)
        assert routed.code == 0, routed.err
    return home


def _env(home: Path, slack: FakeSlack) -> dict[str, str]:
    return cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token)


def _with_buttons(message: SlackMessage) -> bool:
    return any(b.get("type") == "actions" for b in message.blocks)


def _prompt(slack: FakeSlack, channel: str) -> tuple[SlackMessage, str]:
    prompt = slack.wait_for(
        lambda: next((m for m in slack.messages(channel) if m.text.startswith("🔐") and _with_buttons(m)), None),
        timeout=30,
        what="the approval prompt with buttons",
    )
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    return prompt, short.group(1)


def _now(slack: FakeSlack, channel: str, ts: str) -> SlackMessage:
    return next(m for m in slack.messages(channel) if m.ts == ts)


def _user_turns(home: Path, chat: str) -> list[str]:
    """The text of each user message of `chat` in the store, in the order the conversation has them."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT content FROM messages WHERE role='user' ORDER BY rowid").fetchall()
    finally:
        conn.close()
    found = []
    for (content,) in rows:
        text = _text(content)
        if f'chat="{chat}"' in text:
            body = re.search(r">([^<]*)</channel-message>", text)
            found.append(body.group(1).strip() if body else text)
    return found


def _prompt_ts_noted(home: Path, ts: str) -> bool:
    """The approval prompt posted as `ts` is noted in gateway.db (`approval_prompts.message_ids`)."""
    conn = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT message_ids FROM approval_prompts").fetchall()
    finally:
        conn.close()
    return any(ts in json.loads(ids) for (ids,) in rows)


def _kill9(srv: ChannelServer) -> None:
    children = gateway_children(srv.proc.pid)
    srv.kill()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- 1: a click held over a restart


def test_a_click_slack_held_while_the_server_restarted_is_applied(tmp_path: Path) -> None:
    with FakeSlack(ack_timeout=1.0, max_retries=5) as slack:
        home = _home(tmp_path, slack, {"slack:main:D-click": "careful"})
        env = _env(home, slack)
        with channel_server(home, "--channels", "slack", env=env) as srv:
            slack.inject_dm("U2", '/call clock {"n": 1}', channel="D-click")
            prompt, short = _prompt(slack, "D-click")
            wait_for(lambda: "D-click" in (home / "channels" / "gateway.db").read_bytes().decode("latin-1")
                     or None, 10, "the prompt remembered")  # fmt: skip
            # its ts is noted in gateway.db right after the post returned
            wait_for(lambda: _prompt_ts_noted(home, prompt.ts), 10, "the prompt's ts noted")
            _kill9(srv)
        # The click waits at Slack while nothing is connected; Slack delivers it as soon as the new
        # gateway's socket is up, before the server has re-sent the pending approval request.
        action_ts = slack.click("U2", "D-click", prompt.ts, f"approve:{short}", user_name="ann")
        with channel_server(home, "--channels", "slack", env=env) as srv:

            def approved() -> SlackMessage | None:
                m = _now(slack, "D-click", prompt.ts)
                return m if "Approved by `ann`" in m.text and not _with_buttons(m) else None

            wait_for(approved, 40, "the held click applied to the prompt")
            slack.wait_for_text("D-click", lambda t: t.startswith("clock -") and "denied" not in t, timeout=30)
            assert any(d.event_id == f"act-{action_ts}" for d in slack.deliveries()), "the click was delivered"
            assert "a click on an answered approval prompt" not in srv.log()
            assert [m.ts for m in slack.messages("D-click") if m.text.startswith("🔐")] == [prompt.ts]


# ---------------------------------------------------------------- 2: a revoked bot token


def test_a_bot_token_refused_while_running_puts_the_account_in_error(tmp_path: Path) -> None:
    with FakeSlack(ack_timeout=1.0) as slack:
        home = _home(tmp_path, slack, {})
        with channel_server(home, "--channels", "slack", env=_env(home, slack)) as srv:
            slack.inject_dm("U1", "warm", channel="D-warm")
            slack.wait_for_text("D-warm", "echo: warm", timeout=30)
            slack.fail_next("chat.postMessage", "token_revoked", count=1000)  # revoked: every post refused
            slack.inject_dm("U1", "revoked", channel="D-revoked")

            def refused() -> dict[str, object] | None:
                check = srv.channels_check()
                return check if "slack:main error" in str(check.get("detail")) else None

            check = wait_for(refused, 40, "the account in error in /readyz")
            assert check["status"] == "fail"
            assert "Slack refused the bot token (bot_token_env / bot_token_file): token_revoked" in str(check["detail"])
            status = run_cli(home, "channels", "status")
            assert status.code == 0, status.err
            line = next(x for x in status.out.splitlines() if x.startswith("slack"))
            assert " error " in line and "bot token" in line and "token_revoked" in line, status.out
            time.sleep(2.5)  # the socket's watchdog (0.2 s) must not put it back to running
            assert "slack:main error" in str(srv.channels_check().get("detail"))


# ---------------------------------------------------------------- one server for 3 and 4


@pytest.fixture(scope="module")
def shared_slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=3.0) as fake:  # Slack's own ack timeout
        yield fake


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, shared_slack: FakeSlack) -> Iterator[ChannelServer]:
    root = tmp_path_factory.mktemp("slack-s22")
    home = _home(root, shared_slack, {"slack:main:D-deny": "careful"}, admins=["UADM"])
    with channel_server(home, "--channels", "slack", env=_env(home, shared_slack)) as srv:
        yield srv


# ---------------------------------------------------------------- 3: who denied, for the model


def test_a_deny_click_is_recorded_as_the_clickers(shared: ChannelServer, shared_slack: FakeSlack) -> None:
    slack = shared_slack
    slack.inject_dm("U2", "/call clock {}", channel="D-deny")
    prompt, short = _prompt(slack, "D-deny")
    slack.click("UADM", "D-deny", prompt.ts, f"deny:{short}", user_name="boss")
    wait_for(lambda: "Denied by `boss`" in _now(slack, "D-deny", prompt.ts).text or None, 30, "the decided prompt")
    result = slack.wait_for_text("D-deny", lambda t: "denied this call to clock" in t, timeout=30)
    assert "denied this call to clock by boss (via appserver-gateway)" in result.text, result.text
    conn = sqlite3.connect(f"file:{shared.home / 'appserver.db'}?mode=ro", uri=True)
    try:
        tool = [_text(c) for (c,) in conn.execute("SELECT content FROM messages WHERE role='tool'").fetchall()]
    finally:
        conn.close()
    assert any("The user denied this call to clock by boss (via appserver-gateway)" in t for t in tool), tool


# ---------------------------------------------------------------- 4: order over a socket refresh


def test_a_message_sent_as_slack_refreshes_the_socket_keeps_its_place(
    shared: ChannelServer, shared_slack: FakeSlack
) -> None:
    slack = shared_slack
    slack.inject_dm("U1", "warm", channel="D-order-warm")
    slack.wait_for_text("D-order-warm", "echo: warm", timeout=30)
    first = slack.inject_dm("U1", "one", channel="D-order")
    assert slack.disconnect()  # Slack asks for a new socket as `one` goes out on the old one
    time.sleep(0.4)
    slack.inject_dm("U1", "two", channel="D-order")
    time.sleep(0.3)
    slack.inject_dm("U1", "three", channel="D-order")
    slack.wait_for(lambda: len(slack.messages("D-order")) >= 3 or None, 40, "three replies")
    assert [m.text for m in slack.messages("D-order")] == ["echo: one", "echo: two", "echo: three"]
    assert _user_turns(shared.home, "D-order") == ["one", "two", "three"]
    attempts = [d.retry_attempt for d in slack.deliveries(slack.event_id_of(first))]
    assert attempts == [0], f"`one` was redelivered: {attempts}"


# ---------------------------------------------------------------- 2, the same gap on Telegram and Discord


class _States:
    """The adapter's reports, as the gateway's AccountRunner would get them."""

    def __init__(self) -> None:
        self.states: list[tuple[str, str | None]] = []

    async def on_message(self, msg: InboundMessage) -> None:
        if msg.ack is not None:
            await msg.ack()

    def report(self, state: str, reason: str | None) -> None:
        self.states.append((state, reason))

    def context(self, data_dir: Path, name: str) -> AdapterContext:
        return AdapterContext(self.on_message, self.report, data_dir, logging.getLogger(f"test.{name}"))  # type: ignore[arg-type]


async def test_a_telegram_token_refused_on_a_send_puts_the_account_in_error(tmp_path: Path) -> None:
    with FakeTelegram() as tg:
        seen = _States()
        account = Account("telegram", "main", tg.settings(poll_timeout=1), {"token": tg.token},
                          {"token": "environment variable TG_TOKEN"})  # fmt: skip
        adapter = create_telegram(account, seen.context(tmp_path, "telegram"))
        await adapter.start()
        try:
            await wait_until(lambda: seen.states and seen.states[-1][0] == "running", 20, "running")
            tg.fail_next("sendMessage", 401, count=1000)  # revoked in BotFather, as sendMessage says
            with pytest.raises(DeliveryError):
                await adapter.send(Target("1001"), "hello")
            state, reason = seen.states[-1]
            assert state == "error" and "refused the bot token" in (reason or ""), seen.states
            assert "TG_TOKEN" in (reason or "")
            # A poll is a call with the same token, and Telegram's 401 is the token's, never one
            # method's: polls that succeed again end the `error` (one transient 401 left it there
            # for as long as the bot was idle, a re-attack found)
            await wait_until(lambda: seen.states[-1][0] == "running", 20, "running again after a poll")
        finally:
            await adapter.stop()


async def test_a_discord_token_refused_on_a_send_puts_the_account_in_error(tmp_path: Path) -> None:
    with FakeDiscord() as fake:
        seen = _States()
        settings = {"api_url": fake.api_url, "gateway_url": fake.gateway_url}
        account = Account("discord", "main", settings, {"token": fake.token},
                          {"token": "environment variable DISCORD_TOKEN"})  # fmt: skip
        adapter = create_discord(account, seen.context(tmp_path, "discord"))
        await adapter.start()
        try:
            assert seen.states[-1][0] == "running", seen.states
            fake.fail_next("POST messages", status=401, count=1000)  # the token was reset in the portal
            with pytest.raises(DeliveryError):
                await adapter.send(Target(DISCORD_CHANNEL), "hello")
            state, reason = seen.states[-1]
            assert state == "error" and "refused the token" in (reason or ""), seen.states
            assert "DISCORD_TOKEN" in (reason or "")
        finally:
            await adapter.stop()
