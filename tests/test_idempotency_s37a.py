"""Idempotency-Key findings of the s37 attack on the OpenAI surface (A):

F1. A keyed repeat of a request that names no conversation (no `X-Conversation-Id`, or `new`; no
    `conversation`: the OpenAI SDK's usual flow, chat resending its transcript, Responses chaining
    `previous_response_id`) whose turn its client left (a timeout) or a crash cut off, landed in a
    NEW conversation: the earlier one now ends with the input and the cut-off reply, so the
    transcript no longer matched its head. The input was stored twice and a dead branch left. The
    repeat now re-runs that turn in its own conversation (`ConversationMatcher.by_rerun`), and is
    placed as ever (a fork) when that conversation moved on since (another input landed there).
F2. The same keyed request on several connections, the first client leaving: a waiting repeat
    could decide on a re-run while the cancelled turn was still finishing in its runtime (its end
    stored, its cut-off reply being written), was refused it and added the input again (the model
    sent [user X, its cut-off reply, user X]). The decision now waits (bounded) for that turn to
    leave its runtime (`ConversationRuntime.until_left`).

Real parts: `appserver serve` on SQLite, httpx streams left mid-reply, the echo model; F2 an
in-process `Server` on SQLite whose store holds the state the race leaves for an instant.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth.tokens import TokenStore
from appserver.runtime import SubmitRequest
from tests.support.kernel import open_server
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

T = 30.0
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
SLOW = "/slow 20"
FULL = " ".join(f"w{i}" for i in range(1, 21))


def _rows(home: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql, args).fetchall()


def _users(home: Path, text: str) -> list[str]:
    """The conversations holding a user message `text`, one entry per message."""
    rows = _rows(home, "SELECT conversation_id, content FROM messages WHERE role='user' ORDER BY id")
    return [c for c, content in rows if (json.loads(content) if content.startswith('"') else content) == text]


def _assistant_statuses(home: Path, conversation: str) -> list[str]:
    rows = _rows(
        home,
        "SELECT completion_status FROM messages WHERE conversation_id=? AND role='assistant' ORDER BY id",
        conversation,
    )
    return [s for (s,) in rows]


def _shown(route: str, line: str) -> bool:
    """A stream line carrying reply text."""
    if route == CHAT:
        return line.startswith("data: {") and bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
    return line.startswith("data: {") and json.loads(line[6:]).get("type") == "response.output_text.delta"


def _leave_mid_reply(sp: ServeProcess, route: str, body: dict[str, Any], headers: dict[str, str]) -> str:
    """Send the keyed streamed request and leave once some of its reply was shown (the client
    gone: its turn cancelled, that text kept). Its conversation once the cancel is stored."""
    with httpx.Client(timeout=T) as http, http.stream("POST", f"{sp.url}{route}", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        conversation = r.headers["x-conversation-id"]
        for line in r.iter_lines():
            if _shown(route, line):
                break
    wait_for(
        lambda: _rows(sp.home, "SELECT 1 FROM turns WHERE conversation_id=? AND status='cancelled'", conversation),
        20,
        "the cancel of the turn its client left",
    )
    return conversation


def _repeat(sp: ServeProcess, route: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, str]:
    """The same keyed streamed request again, read whole: (its conversation, its reply text)."""
    text = []
    with httpx.Client(timeout=T) as http, http.stream("POST", f"{sp.url}{route}", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers.get("idempotent-replayed") is None
        conversation = r.headers["x-conversation-id"]
        for line in r.iter_lines():
            if _shown(route, line):
                event = json.loads(line[6:])
                text.append(event["choices"][0]["delta"]["content"] if route == CHAT else event["delta"])
    return conversation, "".join(text)


def _recall(sp: ServeProcess, conversation: str) -> str:
    """What the echo model is given as the conversation's earlier user messages."""
    r = httpx.post(
        f"{sp.url}{CHAT}",
        json={"model": "assistant", "messages": [{"role": "user", "content": "/recall"}]},
        headers={"X-Conversation-Id": conversation},
        timeout=T,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


# ---------------------------------------------------------------- F1


def test_an_unpinned_chat_repeat_re_runs_in_its_conversation_and_forks_once_it_moved_on(tmp_path: Path) -> None:
    sp = start_serve(tmp_path / "home")
    try:
        first = httpx.post(
            f"{sp.url}{CHAT}",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hello"}]},
            timeout=T,
        )
        assert first.status_code == 200, first.text
        conv1 = first.headers["x-conversation-id"]
        said = first.json()["choices"][0]["message"]["content"]
        history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": said}]
        body = {"model": "assistant", "stream": True, "messages": [*history, {"role": "user", "content": SLOW}]}
        key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        assert _leave_mid_reply(sp, CHAT, body, key) == conv1  # matched by its transcript
        conversation, text = _repeat(sp, CHAT, body, key)
        assert conversation == conv1  # not a new conversation holding the input again
        assert text == FULL
        assert _users(sp.home, SLOW) == [conv1]
        assert _rows(sp.home, "SELECT count(*) FROM conversations") == [(1,)]
        assert _assistant_statuses(sp.home, conv1) == ["completed", "cancelled", "completed"]
        # the next request of the transcript continues it
        history += [{"role": "user", "content": SLOW}, {"role": "assistant", "content": FULL}]
        nxt = httpx.post(
            f"{sp.url}{CHAT}",
            json={"model": "assistant", "messages": [*history, {"role": "user", "content": "/recall"}]},
            timeout=T,
        )
        assert nxt.status_code == 200 and nxt.headers["x-conversation-id"] == conv1, nxt.text
        assert nxt.json()["choices"][0]["message"]["content"] == f"hello | {SLOW}"  # the input once

        # Moved on since (another input landed there): placed as ever, a fork; conv1 holds it once.
        history += [{"role": "user", "content": "/recall"}, {"role": "assistant", "content": f"hello | {SLOW}"}]
        body = {"model": "assistant", "stream": True, "messages": [*history, {"role": "user", "content": "/slow 21"}]}
        key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        assert _leave_mid_reply(sp, CHAT, body, key) == conv1
        assert _recall(sp, conv1).endswith("| /slow 21")
        conversation, text = _repeat(sp, CHAT, body, key)
        assert conversation != conv1 and text.startswith("w1 w2")
        assert sorted(_users(sp.home, "/slow 21")) == sorted([conv1, conversation])
    finally:
        sp.stop()


def test_a_repeat_chained_by_previous_response_id_re_runs_in_its_conversation(tmp_path: Path) -> None:
    sp = start_serve(tmp_path / "home")
    try:
        first = httpx.post(f"{sp.url}{RESPONSES}", json={"model": "assistant", "input": "hello"}, timeout=T)
        assert first.status_code == 200, first.text
        conv1 = first.headers["x-conversation-id"]
        body = {"model": "assistant", "stream": True, "input": SLOW, "previous_response_id": first.json()["id"]}
        key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        assert _leave_mid_reply(sp, RESPONSES, body, key) == conv1
        conversation, text = _repeat(sp, RESPONSES, body, key)
        assert conversation == conv1 and text == FULL
        assert _users(sp.home, SLOW) == [conv1]
        assert _rows(sp.home, "SELECT count(*) FROM conversations") == [(1,)]
        assert _recall(sp, conv1) == f"hello | {SLOW}"
    finally:
        sp.stop()


@pytest.mark.parametrize("named", [None, "new"])
def test_a_first_turn_repeat_re_runs_in_the_conversation_its_request_made(tmp_path: Path, named: str | None) -> None:
    sp = start_serve(tmp_path / "home")
    try:
        body = {"model": "assistant", "stream": True, "messages": [{"role": "user", "content": SLOW}]}
        key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        if named is not None:
            key["X-Conversation-Id"] = named
        conv1 = _leave_mid_reply(sp, CHAT, body, key)
        conversation, text = _repeat(sp, CHAT, body, key)
        assert conversation == conv1 and text == FULL
        assert _users(sp.home, SLOW) == [conv1]
        assert _rows(sp.home, "SELECT count(*) FROM conversations") == [(1,)]
    finally:
        sp.stop()


# ---------------------------------------------------------------- F2


async def test_a_re_run_waits_for_the_cancelled_turn_to_leave_its_runtime(tmp_path: Path) -> None:
    """The race's state, held: the earlier turn's end is stored (cancelled) while its runtime still
    finishes it. The repeat's turn waits for it to leave, then re-runs its input (held once)."""
    home = tmp_path / "home"
    server = await open_server(home)
    try:
        kernel = server.kernel
        scope = "http:s37a"
        source = {"kind": "openai_chat"}
        first = await kernel.submit(
            SubmitRequest(
                agent="assistant",
                input="/slow 200",
                conversation="new",
                source=source,
                idempotency_key="k1",
                idempotency_scope=scope,
            )
        )
        async with asyncio.timeout(20):
            while not any(b.get("text") for b in first.handle.controller.snapshot().blocks):
                await asyncio.sleep(0.02)
        with sqlite3.connect(home / "appserver.db", timeout=10) as db:
            db.execute("UPDATE turns SET status='cancelled' WHERE id=?", (first.turn_id,))
        repeat = asyncio.create_task(
            kernel.submit(
                SubmitRequest(
                    agent="assistant",
                    input="/slow 200",
                    conversation=first.conversation_id,
                    source=source,
                    idempotency_key="k2",
                    idempotency_scope=scope,
                    rerun_of=first.turn_id,
                )
            )
        )
        await asyncio.sleep(0.3)
        assert not repeat.done()  # waits for the earlier turn, instead of adding the input behind it
        await kernel.cancel(first.conversation_id, first.turn_id)  # its client left: the turn ends
        sub = await asyncio.wait_for(repeat, 10)
        turn = await server.store.get_turn(sub.turn_id)
        assert turn is not None and turn.input.get("rerun_of") == first.turn_id
        users = [m for m in await server.store.list_messages(first.conversation_id) if m.role == "user"]
        assert [m.turn_id for m in users] == [first.turn_id]
        await kernel.cancel(first.conversation_id, sub.turn_id)
        await asyncio.wait_for(sub.wait(), 10)
        users = [m for m in await server.store.list_messages(first.conversation_id) if m.role == "user"]
        assert len(users) == 1
    finally:
        await server.close()


def test_a_repeat_goes_back_only_to_a_conversation_its_credential_sees(tmp_path: Path) -> None:
    """The key's scope is the credential's name: a token re-created under it without `admin` does
    not see the conversation the admin one's request went into, so its repeat is placed as any
    request of its own is (a conversation of its namespace), never re-run in that one."""
    home = tmp_path / "home"
    home.mkdir(parents=True)
    _, admin = TokenStore(home).create(name="alice", scopes="admin,openai")
    sp = start_serve(home, "--auth", "token")
    try:
        body = {"model": "assistant", "stream": True, "messages": [{"role": "user", "content": SLOW}]}
        seen = {"Authorization": f"Bearer {admin}", "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        conv1 = _leave_mid_reply(sp, CHAT, body, seen)
        assert _repeat(sp, CHAT, body, seen) == (conv1, FULL)  # its own: re-run there
        other = {"model": "assistant", "stream": True, "messages": [{"role": "user", "content": "/slow 22"}]}
        key = f"k-{uuid.uuid4().hex}"
        conv2 = _leave_mid_reply(sp, CHAT, other, {"Authorization": f"Bearer {admin}", "Idempotency-Key": key})
        TokenStore(home).revoke("alice")
        _, plain = TokenStore(home).create(name="alice", scopes="openai")
        conversation, text = _repeat(sp, CHAT, other, {"Authorization": f"Bearer {plain}", "Idempotency-Key": key})
        assert conversation not in (conv1, conv2) and text.startswith("w1 w2")
        assert _users(sp.home, "/slow 22") == [conv2, conversation]
        assert _assistant_statuses(sp.home, conv2) == ["cancelled"]
    finally:
        sp.stop()
