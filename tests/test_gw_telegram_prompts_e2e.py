"""Approval prompts and commands on Telegram end to end, against the loopback fake Bot API: a real
`appserver serve --channels telegram` with a fast watchdog and a short approval timeout.

* A prompt whose call ended while the gateway was hung (SIGSTOP, then killed by the watchdog and
  restarted) lost its `approval_resolved` frame with the dead child: the restarted gateway must
  still settle it (buttons gone), whether the call timed out or was answered from the protocol.
* Names and IDs people type are shown literally in the bot's own messages, never as HTML links.
* `@bot /approve ID` is a command; `/cancel@otherbot` is another bot's and must not stop our turn.

The SIGSTOP tests run last: they kill the gateway child."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from appserver.client import ProtocolClient
from tests.fakes.telegram_api import BotMessage, FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, store_turns, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

# In the first SIGSTOP test the call must time out while the child is stopped, before the watchdog
# kills it: the SIGSTOP comes at least 1 s after the call started (the prompt posted, then a pause),
# the kill at least HUNG_KILL_S after the last answered ping, which came at most a ping interval
# before the SIGSTOP, so the timeout comes at least 1 + HUNG_KILL_S - PING_INTERVAL_S -
# APPROVAL_TIMEOUT_S = 1 s before the kill. A desktop's answer (the second SIGSTOP test) comes well
# within APPROVAL_TIMEOUT_S.
APPROVAL_TIMEOUT_S = 4
FAST_WATCHDOG = {
    "APPSERVER_GATEWAY_PING_INTERVAL_S": "0.5",
    "APPSERVER_GATEWAY_PING_TIMEOUT_S": "1",
    "APPSERVER_GATEWAY_HUNG_KILL_S": "4.5",
    "APPSERVER_LIMITS__APPROVAL_TIMEOUT_S": str(APPROVAL_TIMEOUT_S),
    # gateway/supervisor.py reads the three above from the environment as the supervisor is made (no
    # longer at import), so `serve` forked from the test zygote honours them: no fresh interpreter.
    # Were they ignored (60 s to a kill), the SIGSTOP tests' 40 s wait for the restart would fail.
}
GROUP = -100777
ADMIN = 9001


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("tg-prompts") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "open",
                "default_agent": "assistant", "admins": [str(ADMIN)]}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for chat in ("5100", "5150", "5200", "5300", "5350", str(GROUP)):
        routed = run_cli(home, "channels", "route", "add", f"telegram:main:{chat}", "careful")
        assert routed.code == 0, routed.err
    env = cli_env(home, TG_TOKEN=tg.token, **FAST_WATCHDOG)
    with channel_server(home, "--channels", "telegram", env=env) as server:
        yield server


def _prompt(tg: FakeTelegram, chat: int, after: int = 0) -> tuple[BotMessage, str]:
    """The approval prompt posted in `chat` after its first `after` messages, and its short id."""
    prompt = tg.wait_for(
        lambda: next((m for m in tg.messages(chat)[after:] if m.text.startswith("🔐") and m.reply_markup), None),
        timeout=25,
        what="the approval prompt with buttons",
    )
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    return prompt, short.group(1)


def _settled(tg: FakeTelegram, chat: int, message_id: int, line: str, timeout: float = 40) -> BotMessage:
    def edited() -> BotMessage | None:
        m = tg.message(chat, message_id)
        return m if line in m.text and m.reply_markup is None else None

    return tg.wait_for(edited, timeout, f"the prompt edited to {line!r} without buttons")


def test_a_typed_id_is_shown_literally(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("/approve [x](https://evil.example/id)", user_id=5350)
    refused = tg.wait_for_text(5350, lambda t: t.startswith("No request waiting"), timeout=20)
    assert "[x](https://evil.example/id)" in refused.text and "<a " not in refused.source, refused.source


def test_an_approvers_name_is_shown_literally(srv: ChannelServer, tg: FakeTelegram) -> None:
    name = "[Verify your account](https://evil.example/login) **URGENT**"
    tg.dm("/call clock {}", user_id=5300, first_name=name)
    prompt, short = _prompt(tg, 5300)
    tg.inject(5300, f"/approve {short}", sender=tg.user(5300, name))
    decided = _settled(tg, 5300, prompt.message_id, "✅ Approved by")
    assert f"Approved by {name}" in decided.text, decided.text  # as typed, not a link and bold
    assert "<a " not in decided.source and "<b>" not in decided.source, decided.source


def test_a_mention_before_a_command_is_a_command(srv: ChannelServer, tg: FakeTelegram) -> None:
    bob = tg.user(4201, "Bob", "bob")
    tg.inject(GROUP, f"@{tg.username} hi", kind="supergroup", sender=bob)
    echo = tg.wait_for_text(GROUP, f"echo: @{tg.username} hi", timeout=20)
    seen = len(tg.messages(GROUP))
    tg.inject(GROUP, "/call clock {}", kind="supergroup", sender=bob, reply_to=echo.message_id)
    prompt, short = _prompt(tg, GROUP, seen)
    tg.inject(GROUP, f"@{tg.username} /approve {short}", kind="supergroup", sender=bob)
    _settled(tg, GROUP, prompt.message_id, "✅ Approved by")
    tg.wait_for_text(GROUP, lambda t: t.startswith("clock -> "), timeout=20)
    assert store_turns(srv.home, "/approve") == 0  # the gateway's command, never text for the agent


def test_a_command_for_another_bot_does_not_stop_our_reply(srv: ChannelServer, tg: FakeTelegram) -> None:
    """In a chat where every message counts (a DM here, an open group alike), `/cancel@otherbot` is
    addressed to another bot: it neither cancels our turn nor reaches our agent."""
    tg.dm("/slow 100", user_id=5200)  # 5 s of words: the /cancel@other below comes well inside them
    tg.wait_for(lambda: tg.messages(5200) or None, timeout=20, what="the slow reply starting")
    tg.dm("/cancel@some_other_bot", user_id=5200)
    words = " ".join(f"w{i}" for i in range(1, 101))
    tg.wait_for_text(5200, words, timeout=40)  # the reply ran to its end
    assert not any("Cancelled" in m.text for m in tg.messages(5200)), [m.text for m in tg.messages(5200)]
    assert store_turns(srv.home, "/cancel@some_other_bot") == 0


def test_a_prompt_that_timed_out_while_the_gateway_hung_loses_its_buttons(srv: ChannelServer, tg: FakeTelegram) -> None:
    tg.dm("/call clock {}", user_id=5100)
    prompt, short = _prompt(tg, 5100)
    time.sleep(1.0)  # the prompt's message id is noted in gateway.db after its post returned
    pid = srv.gateway_pid()
    os.kill(pid, signal.SIGSTOP)  # hung: the call times out; the watchdog kills the child later
    try:
        wait_for(lambda: srv.gateway_pid() != pid or None, 40, "the watchdog's restart")
    finally:
        with_suppressed_lookup(lambda: os.kill(pid, signal.SIGCONT))
    srv.wait_channels_ready(30)
    decided = _settled(tg, 5100, prompt.message_id, "No longer waiting for an answer")
    assert "Reply /approve" not in decided.text
    tg.inject(5100, f"/approve {short}", sender=tg.user(5100, "Ann"))
    tg.wait_for_text(5100, lambda t: t.startswith("No request waiting"), timeout=20)


def test_a_prompt_answered_elsewhere_while_the_gateway_hung_shows_the_answer(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    tg.dm("/call clock {}", user_id=5150)
    prompt, _short = _prompt(tg, 5150)
    time.sleep(0.5)
    pid = srv.gateway_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        asyncio.run(_approve_from_a_desktop(srv, "careful"))  # well before the call would time out
        wait_for(lambda: srv.gateway_pid() != pid or None, 40, "the watchdog's restart")
    finally:
        with_suppressed_lookup(lambda: os.kill(pid, signal.SIGCONT))
    srv.wait_channels_ready(30)
    _settled(tg, 5150, prompt.message_id, "✅ Approved")
    tg.wait_for_text(5150, lambda t: t.startswith("clock -> "), timeout=30)


async def _approve_from_a_desktop(srv: ChannelServer, agent: str) -> None:
    """Approve the one pending call of `agent` over the protocol, as a desktop app (or the CLI) does."""
    client = await ProtocolClient.connect(srv.url, token="", client="desktop")
    try:
        convs = await client.request({"type": "list_conversations", "agent": agent})
        for conv in convs["conversations"]:
            state = await client.request({"type": "subscribe", "conversation": conv["id"]})
            for pending in state.get("pending_approvals") or []:
                ack: dict[str, Any] = await client.request(
                    {
                        "type": "approval_response",
                        "conversation": conv["id"],
                        "decisions": [{"call_id": pending["call_id"], "decision": "approve"}],
                    }  # fmt: skip
                )
                assert (ack.get("results") or [{}])[0].get("accepted") is True, ack
                return
        raise AssertionError("no pending approval found")
    finally:
        await client.close()


def with_suppressed_lookup(action: Any) -> None:
    """Run `action`, a signal to a process that may be gone already (killed by the watchdog)."""
    try:
        action()
    except ProcessLookupError:
        pass
