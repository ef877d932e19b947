"""Answering an approval prompt in a group that counts only mentions (gateway/chatops.py, app.py),
through the real gateway and the fakechat plugin: a member who did not start the turn is refused
once a minute however often they try (each try was a refusal in the chat), and the starter typing
`/approve ID` without a mention, as the prompt asks, approves (it was told "Only the person who
started this … can answer it", which was not the reason)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home

pytestmark = pytest.mark.timeout(120)

NOT_YOURS = "Only the person who started this"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(
        tmp_path_factory.mktemp("answers") / "home", chat, group_policy="mention", dm_policy="allowlist",
        allow=["ann", "bob"],
    )  # fmt: skip
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", "fakechat:main:team", "careful")
    assert routed.code == 0, routed.err
    with channel_server(home) as server:
        yield server


def test_a_member_is_refused_once_and_the_starter_answers_without_a_mention(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("team", "/call clock {}", sender="ann", chat_type="group", mentions_bot=True)
    prompt = chat.wait_for_text("team", lambda t: t.startswith("🔐") and "clock" in t, timeout=15)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    for _ in range(5):
        chat.inject("team", f"/approve {short.group(1)}", sender="bob", chat_type="group", mentions_bot=True)
    chat.wait_for_text("team", lambda t: NOT_YOURS in t, timeout=15)
    chat.inject("team", "/status", sender="bob", chat_type="group", mentions_bot=True)
    chat.wait_for_text("team", lambda t: t.startswith("Agent: careful"), timeout=15)  # bob's tries are all handled
    assert sum(NOT_YOURS in m.text for m in chat.messages("team")) == 1
    chat.inject("team", f"/approve {short.group(1)}", sender="ann", sender_name="Ann", chat_type="group")
    chat.wait_for_text("team", lambda t: t.startswith("🔐") and "✅ Approved by `Ann`" in t, timeout=15)
    chat.wait_for_text("team", lambda t: t.startswith("clock -> "), timeout=15)
    time.sleep(0.3)
    assert sum(NOT_YOURS in m.text for m in chat.messages("team")) == 1


def test_a_bare_approve_answers_only_the_prompt_of_its_own_thread(srv: ChannelServer, chat: FakeChat) -> None:
    """A bare `/approve` typed in another thread (a Slack thread, a Telegram forum topic) approved
    the chat's only open prompt, which its sender could not see from there, and said nothing where
    it was typed (found by an outside test). It answers its own thread's prompt; elsewhere it names
    the IDs that wait in the chat's other threads (`/approve ID` answers them from anywhere)."""
    chat.inject("team", "/call clock {}", sender="ann", chat_type="group", mentions_bot=True, thread="t1")
    prompt = chat.wait_for_text("team", lambda t: t.startswith("🔐") and "clock" in t, timeout=15, thread="t1")
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    chat.inject("team", "/approve", sender="ann", chat_type="group", mentions_bot=True, thread="t2")
    told = chat.wait_for_text("team", lambda t: "No request waiting" in t, timeout=15, thread="t2")
    assert "in this thread" in told.text and short.group(1) in told.text, told.text
    assert not any("Approved" in m.text for m in chat.messages("team", "t1"))
    chat.inject("team", "/approve", sender="ann", sender_name="Ann", chat_type="group", mentions_bot=True, thread="t1")
    chat.wait_for_text("team", lambda t: t.startswith("🔐") and "✅ Approved by `Ann`" in t, timeout=15, thread="t1")
