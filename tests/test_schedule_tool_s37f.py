"""Chats do not share the `schedule` tool's tasks through the gateway's one credential (session 37).

Every chat's conversation, of every channel and account, is in the namespace of the gateway's
credential (`token:token:gateway`), and the tool scoped list, cancel, names and the 100-task cap to
that namespace: a sender in one chat read another chat's scheduled prompts in full, cancelled them
and, with 100 tasks of its own, refused every other chat any. Now, in a gateway conversation, the
tool's owner is the conversation: it lists, cancels, names and counts only that conversation's
tasks and schedules into no other conversation. A token's turns keep seeing their namespace's tasks
from any of its conversations, and `appserver cron list` shows the operator every task.
Real `appserver serve --auth token` with the fakechat channel (echo model's `/call`), the token's
turns over HTTP, crons.json and the CLI read from disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.support.net import SSL

pytestmark = pytest.mark.timeout(180)

GATEWAY_NS = "token:token:gateway"
T = 30.0


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[tuple[ChannelServer, str]]:
    home = fakechat_home(tmp_path_factory.mktemp("s37f") / "home", chat, stream=False)  # whole replies
    with open(home / "config.toml", "a") as config:
        config.write('\n[auth]\nmode = "token"\n')
    token = TokenStore(home).create(name="alice")[1]
    with channel_server(home) as server:
        yield server, token


def _call(chat: FakeChat, chat_id: str, sender: str, *calls: dict[str, Any]) -> str:
    """Send `/call schedule …` lines from `sender` in `chat_id`; the bot's answer to them (a long
    one comes in several messages: all of them, one `schedule ->` line per call)."""
    before = len(chat.messages(chat_id))
    chat.inject(chat_id, "\n".join(f"/call schedule {json.dumps(c)}" for c in calls), sender=sender)

    def answer() -> str | None:
        text = "\n".join(m.text for m in chat.messages(chat_id)[before:])
        return text if text.startswith("schedule ->") and text.count("schedule ->") >= len(calls) else None

    return str(chat.wait_for(answer, timeout=T, what=f"the schedule answer in {chat_id}"))


def _create(name: str, prompt: str = "remind me", **extra: str) -> dict[str, Any]:
    return {"action": "create", "name": name, "prompt": prompt, "cron": "0 9 * * *", "tz": "UTC", **extra}


def _tasks(home: Path) -> list[dict[str, Any]]:
    return list(json.loads((home / "crons.json").read_text())["tasks"])


def _token_turn(srv: ChannelServer, token: str, conversation: str, call: dict[str, Any]) -> tuple[str, str]:
    """A turn of the token over HTTP: (its conversation id, the reply)."""
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": f"/call schedule {json.dumps(call)}"}]},
        headers={"Authorization": f"Bearer {token}", "X-Conversation-Id": conversation},
        timeout=T,
        verify=SSL,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-conversation-id"], str(r.json()["choices"][0]["message"]["content"])


def test_a_chat_neither_reads_nor_cancels_nor_targets_another_chats_tasks(
    srv: tuple[ChannelServer, str], chat: FakeChat
) -> None:
    server, token = srv
    made = _call(chat, "chatB", "bob", _create("bobpriv", "BOB PRIVATE: pay rent to IBAN 12345"))
    assert made.startswith("schedule -> created task bobpriv"), made
    (bobs,) = [t for t in _tasks(server.home) if t["name"] == "bobpriv"]
    assert bobs["namespace"] == GATEWAY_NS  # the gateway's credential, as before

    listed = _call(chat, "chatA", "alice", {"action": "list"})
    assert listed == "schedule -> no scheduled tasks", listed
    cancel = _call(chat, "chatA", "alice", {"action": "cancel", "name": "bobpriv"})
    assert "no cron task 'bobpriv'" in cancel, cancel
    cancel = _call(chat, "chatA", "alice", {"action": "cancel", "id": bobs["id"]})
    assert "no cron task" in cancel, cancel
    assert [t["id"] for t in _tasks(server.home) if t["name"] == "bobpriv"] == [bobs["id"]]

    # another chat's conversation is no target, even by its id
    aimed = _call(chat, "chatA", "alice", _create("aimed", conversation=bobs["conversation"]))
    assert "schedule create failed" in aimed, aimed
    assert "aimed" not in {t["name"] for t in _tasks(server.home)}
    # names are the chat's own: chat A may use the name chat B did, and learns nothing from it
    mine = _call(chat, "chatA", "alice", _create("bobpriv", "alice's own"))
    assert mine.startswith("schedule -> created task bobpriv"), mine
    alices = next(t for t in _tasks(server.home) if t["name"] == "bobpriv" and t["id"] != bobs["id"])
    assert alices["conversation"] != bobs["conversation"] and alices["namespace"] == GATEWAY_NS

    listed = _call(chat, "chatB", "bob", {"action": "list"})
    assert "BOB PRIVATE" in listed and "alice's own" not in listed and listed.count("bobpriv (") == 1, listed
    listed = _call(chat, "chatA", "alice", {"action": "list"})
    assert "alice's own" in listed and "BOB PRIVATE" not in listed, listed

    # the operator sees both
    shown = run_cli(server.home, "cron", "list")
    assert shown.code == 0, shown.err
    assert shown.out.count("bobpriv") == 2 and bobs["id"] in shown.out and alices["id"] in shown.out, shown.out

    # a token's turns see its namespace's tasks from any of its conversations, and no chat's
    first, made = _token_turn(server, token, "new", _create("tok-task"))
    assert made.startswith("schedule -> created task tok-task"), made
    second, listed = _token_turn(server, token, "new", {"action": "list"})
    assert second != first and "tok-task" in listed and "bobpriv" not in listed, listed
    _, cancelled = _token_turn(server, token, second, {"action": "cancel", "name": "tok-task"})
    assert "cancelled task tok-task" in cancelled, cancelled
    # and chat B cancels its own
    cancel = _call(chat, "chatB", "bob", {"action": "cancel", "name": "bobpriv"})
    assert f"cancelled task bobpriv ({bobs['id']})" in cancel, cancel
    assert [t["id"] for t in _tasks(server.home) if t["name"] == "bobpriv"] == [alices["id"]]


def test_one_chat_cannot_use_up_another_chats_quota(srv: tuple[ChannelServer, str], chat: FakeChat) -> None:
    server, _ = srv
    _call(chat, "quotaA", "mallory", *[_create(f"q{i}", "x") for i in range(100)])
    mallorys = [t for t in _tasks(server.home) if t["name"].startswith("q") and t["name"][1:].isdigit()]
    assert len(mallorys) == 100 and len({t["conversation"] for t in mallorys}) == 1
    over = _call(chat, "quotaA", "mallory", _create("q100", "x"))
    assert "schedule create failed" in over and "already 100" in over, over  # the chat's own cap holds

    made = _call(chat, "quotaB", "carol", _create("carols", "remind carol"))
    assert made.startswith("schedule -> created task carols"), made


def test_without_credentials_chats_are_kept_apart_too(tmp_path: Path) -> None:
    # auth mode `none` (the default): the gateway is unowned like every caller, so its chats'
    # conversations are told by the route the gateway opened them for (their metadata); a local
    # turn still sees every task the tool made
    with FakeChat() as chat, channel_server(fakechat_home(tmp_path / "home", chat, stream=False)) as server:
        made = _call(chat, "noneB", "bob", _create("bobs", "BOB PRIVATE"))
        assert made.startswith("schedule -> created task bobs"), made
        (bobs,) = [t for t in _tasks(server.home) if t["name"] == "bobs"]
        listed = _call(chat, "noneA", "alice", {"action": "list"})
        assert listed == "schedule -> no scheduled tasks", listed
        cancel = _call(chat, "noneA", "alice", {"action": "cancel", "id": bobs["id"]})
        assert "no cron task" in cancel, cancel
        aimed = _call(chat, "noneA", "alice", _create("aimed", conversation=bobs["conversation"]))
        assert "schedule create failed" in aimed, aimed
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": '/call schedule {"action": "list"}'}]},
            timeout=T,
            verify=SSL,
        )
        assert r.status_code == 200 and "BOB PRIVATE" in r.json()["choices"][0]["message"]["content"], r.text
