"""An `admin` credential cannot say its turn came from a chat (s39 re-attacker RC): it sees the
gateway's conversations, and a `submit_input` into one with `source` {kind: channel, chat: victim,
sender: bob} made the schedule tool store a task delivering to another chat, blaming bob. The
WebSocket now keeps a `channel` or `cron_prompt` kind only from the gateway's credential (or the
local owner): anyone else's is stored as `claimed_kind`, which nothing believes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.support.gateway import ChannelServer, WebhookReplies
from tests.support.wait import wait_for
from tests.support.ws import WS
from tests.test_cron_s39c import T, _tasks, _token, _webhook, replies, webhook_srv

__all__ = ["replies", "webhook_srv"]  # the fixtures, shared with the module they come from

pytestmark = pytest.mark.timeout(120)


def test_an_admin_cannot_submit_as_a_chat_into_the_gateways_conversation(
    webhook_srv: tuple[ChannelServer, int], replies: WebhookReplies
) -> None:
    srv, port = webhook_srv
    _webhook(port, "m-f1", "alice", "hello")
    wait_for(lambda: replies.texts_for("m-f1") or None, T, "the gateway's answer")
    ops = _token(srv.home, "ops", "ws,admin")

    async def framed() -> list[dict[str, Any]]:
        ws = await WS.open(srv.url, hello=False)
        try:
            hello = await ws.request({"type": "hello", "protocol": 1, "client": "test", "token": ops})
            assert hello["type"] == "welcome", hello
            listed = await ws.request({"type": "list_conversations", "agent": "assistant", "limit": 50})
            chats = [
                c
                for c in listed["conversations"]
                if str(c.get("metadata", {}).get("channel_route", "")).startswith("webhook:home:c1")
            ]
            assert chats, listed
            conv = str(chats[0]["id"])
            call = {"action": "create", "name": "framed-admin", "every": "1h", "prompt": "p"}
            source = {"kind": "channel", "channel": "webhook", "account": "home", "chat": "victim", "sender": "bob"}
            ack = await ws.request(
                {
                    "type": "submit_input",
                    "agent": "assistant",
                    "conversation": conv,
                    "input": f"/call schedule {json.dumps(call)}",
                    "source": source,
                }
            )
            assert ack["type"] == "ack", ack
            await ws.expect(
                lambda f: (
                    f.get("type") == "turn_updated"
                    and f["snapshot"]["turn_id"] == ack["turn_id"]
                    and f["snapshot"]["status"] in ("completed", "failed")
                ),
                T,
            )
            history = await ws.request({"type": "get_history", "conversation": conv, "limit": 200})
            return [m for m in history["messages"] if m.get("turn_id") == ack["turn_id"] and m["role"] == "user"]
        finally:
            await ws.close()

    mine = asyncio.run(framed())
    task = wait_for(lambda: _tasks(srv.home).get("framed-admin"), T, "the admin's task")
    # before: deliver webhook:home:victim, origin {chat: victim, sender: bob}
    assert "victim" not in str(task.get("deliver")), task
    assert (task.get("origin") or {}).get("sender") != "bob", task
    assert (task.get("origin") or {}).get("chat") in (None, "c1"), task
    assert [m["source"].get("kind") for m in mine] == [None], mine
    assert [m["source"].get("claimed_kind") for m in mine] == ["channel"], mine
    assert not [b for b in replies.bodies if b.get("chat") == "victim"]
