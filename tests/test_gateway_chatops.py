"""Chat commands and approvals in the chat, through the real gateway (issue 16)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from appserver.client import ProtocolClient
from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import (
    ChannelServer,
    channel_server,
    fakechat_home,
    store_turns,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("chatops") / "home", chat, group_policy="open", admins=["boss"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    for chat_name in ("approvals", "approvals-cli"):
        routed = run_cli(home, "channels", "route", "add", f"fakechat:main:{chat_name}", "careful")
        assert routed.code == 0, routed.err
    with channel_server(home) as server:
        yield server


def _turns(srv: ChannelServer) -> int:
    return store_turns(srv.home, "<channel-message")


def test_help_and_status_answer_without_a_turn(srv: ChannelServer, chat: FakeChat) -> None:
    before = _turns(srv)
    chat.inject("cmd", "/help")
    chat.wait_for_text("cmd", lambda t: t.startswith("Commands:"), timeout=15)
    chat.inject("cmd", "/status@bot")
    chat.wait_for_text("cmd", lambda t: "No conversation yet" in t, timeout=15)
    assert _turns(srv) == before


def test_new_starts_a_new_conversation(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("newer", "first")
    chat.wait_for_text("newer", "echo: first", timeout=15)
    chat.inject("newer", "/status")
    one = re.search(r"conv_\w+", chat.wait_for_text("newer", lambda t: "Conversation conv_" in t, timeout=15).text)
    chat.inject("newer", "/new")
    chat.wait_for_text("newer", lambda t: "new conversation" in t, timeout=15)
    chat.inject("newer", "second")
    chat.wait_for_text("newer", "echo: second", timeout=15)
    chat.inject("newer", "/recall")  # the new conversation remembers nothing of the first
    recall = chat.wait_for_text("newer", lambda t: "second</channel-message>" in t, timeout=15)
    assert ">first<" not in recall.text
    chat.inject("newer", "/status")
    statuses = chat.wait_for(
        lambda: [m.text for m in chat.messages("newer") if "Conversation conv_" in m.text][1:] or None, timeout=15
    )
    two = re.search(r"conv_\w+", statuses[0])
    assert one and two and one.group(0) != two.group(0)


def test_cancel_stops_the_running_turn(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("cancelling", "/slow 400")
    chat.wait_for(lambda: chat.messages("cancelling") or None, timeout=15, what="the reply to start")
    chat.inject("cancelling", "/cancel")
    chat.wait_for_text("cancelling", "⏹ Cancelled.", timeout=15)
    reply = chat.wait_for_text("cancelling", lambda t: t.startswith("w1") and "⏹ Cancelled." in t, timeout=15)
    assert "w400" not in reply.text


def test_only_the_starter_or_an_admin_may_cancel_in_a_group(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("team", "/slow 400", sender="alice", chat_type="group")
    chat.wait_for(lambda: chat.messages("team") or None, timeout=15, what="the reply to start")
    chat.inject("team", "/cancel", sender="mallory", chat_type="group")
    chat.wait_for_text("team", lambda t: "Only the person who started" in t, timeout=15)
    chat.inject("team", "/cancel", sender="boss", chat_type="group")  # an admin
    chat.wait_for_text("team", "⏹ Cancelled.", timeout=15)


def test_a_queued_message_gives_no_right_to_cancel_the_running_turn(srv: ChannelServer, chat: FakeChat) -> None:
    """Bob's message waits behind Alice's running turn: his /cancel is refused (it would stop hers)
    and withdraws only his own waiting message; hers stops her turn, and then his next one runs."""
    chat.inject("team-queue", "/slow 400", sender="alice", chat_type="group")
    chat.wait_for(lambda: chat.messages("team-queue") or None, timeout=15, what="Alice's reply to start")
    queued = chat.inject("team-queue", "me too", sender="bob", chat_type="group")
    wait_for(lambda: _ledger_state(srv, queued) == "submitted", 15, "Bob's turn to be queued")
    chat.inject("team-queue", "/cancel", sender="bob", chat_type="group")
    refused = chat.wait_for_text("team-queue", lambda t: "Only the person who started" in t, timeout=15)
    assert "Dropped 1 waiting message" in refused.text, refused.text  # his own, withdrawn before it ran
    assert not any("⏹ Cancelled." in m.text for m in chat.messages("team-queue"))
    again = chat.inject("team-queue", "me too", sender="bob", chat_type="group")
    wait_for(lambda: _ledger_state(srv, again) == "submitted", 15, "Bob's next turn to be queued")
    chat.inject("team-queue", "/cancel", sender="alice", chat_type="group")
    chat.wait_for_text("team-queue", "⏹ Cancelled.", timeout=15)
    chat.wait_for_text("team-queue", "echo: me too", timeout=15)  # Bob's turn was not the one cancelled


def _ledger_state(srv: ChannelServer, message_id: str) -> str | None:
    ledger = Ledger.open(default_path(srv.home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return entry.state if entry is not None else None
    finally:
        ledger.close()


def test_approval_by_the_starter_runs_the_tool_and_a_stranger_is_refused(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("approvals", "/call clock {}", sender="ann", chat_type="group")
    prompt = chat.wait_for_text("approvals", lambda t: t.startswith("🔐") and "clock" in t, timeout=15)
    short = re.search(r"/approve (\w+)", prompt.text)
    assert short, prompt.text
    chat.inject("approvals", f"/approve {short.group(1)}", sender="mallory", chat_type="group")
    chat.wait_for_text("approvals", lambda t: "Only the person who started this" in t, timeout=15)
    chat.inject("approvals", f"/approve {short.group(1)}", sender="ann", sender_name="Ann", chat_type="group")
    chat.wait_for_text("approvals", lambda t: t.startswith("🔐") and "✅ Approved by `Ann`" in t, timeout=15)
    chat.wait_for_text("approvals", lambda t: t.startswith("clock -> "), timeout=15)


def test_an_approval_answered_elsewhere_updates_the_chat_prompt(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("approvals", "/call clock {}", sender="ann", chat_type="group")
    chat.wait_for(
        lambda: (
            [m for m in chat.messages("approvals") if m.text.startswith("🔐") and "Reply /approve" in m.text] or None
        ),
        timeout=15,
        what="an open prompt",
    )

    async def answer_from_a_desktop() -> None:
        client = await ProtocolClient.connect(srv.url, token="", client="desktop")
        try:
            convs = await client.request({"type": "list_conversations", "agent": "careful"})
            for conv in convs["conversations"]:
                state = await client.request({"type": "subscribe", "conversation": conv["id"]})
                for pending in state.get("pending_approvals") or []:
                    await client.request(
                        {
                            "type": "approval_response",
                            "conversation": conv["id"],
                            "decisions": [{"call_id": pending["call_id"], "decision": "deny"}],
                        }  # fmt: skip
                    )
                    return
            raise AssertionError("no pending approval found")
        finally:
            await client.close()

    asyncio.run(answer_from_a_desktop())
    chat.wait_for_text("approvals", lambda t: t.startswith("🔐") and "❌ Denied" in t, timeout=15)


def test_an_approval_answered_from_the_cli_updates_the_chat_prompt(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("approvals-cli", "/call clock {}", sender="ann", chat_type="group")
    chat.wait_for_text("approvals-cli", lambda t: t.startswith("🔐") and "Reply /approve" in t, timeout=15)

    async def pending_call() -> tuple[str, str]:
        client = await ProtocolClient.connect(srv.url, token="", client="probe")
        try:
            convs = await client.request({"type": "list_conversations", "agent": "careful"})
            for conv in convs["conversations"]:
                state = await client.request({"type": "subscribe", "conversation": conv["id"]})
                for pending in state.get("pending_approvals") or []:
                    return conv["id"], pending["call_id"]
            raise AssertionError("no pending approval found")
        finally:
            await client.close()

    conv, call_id = asyncio.run(pending_call())
    answered = run_cli(srv.home, "run", "--agent", "careful", "--conversation", conv, "--approve", call_id)
    assert answered.code == 0, answered.err
    chat.wait_for_text("approvals-cli", lambda t: t.startswith("🔐") and "✅ Approved" in t, timeout=15)
    chat.wait_for_text("approvals-cli", lambda t: t.startswith("clock -> "), timeout=15)
