"""Three holes in what a credential may hold or be shown (session 26, an outside tester's report):

- a restart forgot the open-turn count (`[limits] open_turns_per_client`): three turns paused for
  an approval, the fourth refused; after a restart three more were accepted (six open against a
  cap of three), and each restart added three. The turns the restarted server takes up open count
  again, until they end (answered, cancelled, ...);
- a keyed submit to `new` whose copy won the key elsewhere left an empty conversation of its own
  (`Kernel.submit` made it before the accept found the duplicate): it is removed again;
- an HTTP `Idempotency-Key` replay handed a token rotated under an `admin` token's name (same keys,
  no `admin`) the stored answer and `X-Conversation-Id` of the admin's conversation, which it gets
  404 for when it names it: refused 409, as the WebSocket refuses it, for chat completions and
  responses, also when the repeat waited for the request still running.

A real `appserver serve --auth token` (SQLite), real tokens, `websockets` clients, the openai SDK
and the echo model (`/call clock {}` asks for an approval on the agent `careful`; `/slow N`: N
words, 50 ms apart). The PostgreSQL cluster case of the second is in test_opencap_s26b_pg.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appserver.auth import Principal, TokenStore, namespace_of
from appserver.http.common import Idempotency
from appserver.http.errors import ApiError
from appserver.runtime import SubmitRequest
from tests.support.cli import careful_home, cli_env
from tests.support.kernel import open_server
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0
CAP = 3
ASK = "/call clock {}"
SLOW = "/slow 1000"  # 50 s: open until cancelled


def _env(home: Path) -> dict[str, str]:
    return cli_env(home, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP))


async def _open(sp: ServeProcess, token: str) -> WS:
    return await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


def _submit(text: str, agent: str = "careful", conversation: str = "new", **extra: Any) -> dict[str, Any]:
    return {"type": "submit_input", "agent": agent, "conversation": conversation, "input": text, **extra}


async def _paused(ws: WS) -> tuple[dict[str, Any], str]:
    """A turn paused for the approval of its clock call: (its ack, the call's id)."""
    ack = await ws.request(_submit(ASK), T)
    assert ack["type"] == "ack", ack
    req = await ws.expect(lambda f: f["type"] == "approval_request" and f["turn_id"] == ack["turn_id"], T)
    return ack, req["call_id"]


async def _refused(ws: WS, text: str = SLOW) -> None:
    err = await ws.request(_submit(text, "assistant"), T)
    assert err["type"] == "error" and err["code"] == "too_many_open_turns", err


async def _accepted_once_free(ws: WS) -> dict[str, Any]:
    """The next submit accepted (a place is given back as its turn's end is seen: soon after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + T
    while True:
        reply = await ws.request(_submit(SLOW, "assistant"), T)
        if reply["type"] == "ack":
            return reply
        assert reply["code"] == "too_many_open_turns" and loop.time() < deadline, reply
        await asyncio.sleep(0.05)


async def _cancel(ws: WS, ack: dict[str, Any]) -> None:
    frame = {"type": "cancel", "conversation": ack["conversation_id"], "turn_id": ack["turn_id"]}
    reply = await ws.request(frame, T)
    assert reply["type"] == "ack" and reply["cancelled"] is True, reply


async def test_a_restart_counts_the_turns_still_open_until_they_end(tmp_path: Path) -> None:
    home = careful_home(tmp_path)
    token = TokenStore(home).create(name="paused")[1]
    other = TokenStore(home).create(name="other")[1]
    sp = start_serve(home, "--auth", "token", env=_env(home))
    try:
        ws = await _open(sp, token)
        held = [await _paused(ws) for _ in range(CAP)]
        await _refused(ws)
        await ws.close()
    finally:
        assert sp.stop() == 0
        sp.kill()

    with serving(home, "--auth", "token", env=_env(home)) as sp:
        ws = await _open(sp, token)
        try:
            await _refused(ws)  # the three paused turns still hold the three places
            await _refused(ws)
            bystander = await _open(sp, other)  # another credential's count is its own
            ack = await bystander.request(_submit("hi", "assistant"), T)
            assert ack["type"] == "ack", ack
            await bystander.close()

            # answered: the approval runs the call, the turn completes and gives its place back
            (first, call_id), second, third = held[0], held[1][0], held[2][0]
            for ack in (first, second):  # a new socket: it hears of their ends once subscribed
                sub = await ws.request({"type": "subscribe", "conversation": ack["conversation_id"]}, T)
                assert sub["type"] == "conversation_state" and sub["state"] == "awaiting", sub
            decision = {"call_id": call_id, "decision": "approve"}
            reply = await ws.request(
                {"type": "approval_response", "conversation": first["conversation_id"], "decisions": [decision]}, T
            )
            assert reply["type"] == "ack", reply
            assert (await ws.terminal(first["turn_id"], T))["status"] == "completed"
            fresh = await _accepted_once_free(ws)
            await _refused(ws)  # exactly one place came back

            await _cancel(ws, second)  # cancelled while paused: its place comes back too
            assert (await ws.terminal(second["turn_id"], T))["status"] == "cancelled"
            fresh2 = await _accepted_once_free(ws)
            await _refused(ws)
            for ack in (third, fresh, fresh2):
                await _cancel(ws, ack)
        finally:
            await ws.close()


async def test_copies_of_a_keyed_submit_to_new_leave_no_empty_conversation(tmp_path: Path) -> None:
    """Submitted at once through the kernel (as two front ends would): the one the duplicate
    reached made a conversation of its own before its accept found the key taken."""
    server = await open_server(tmp_path / "home")
    try:
        for round_ in range(3):
            key = f"k-{uuid.uuid4().hex}"
            request = SubmitRequest(agent="assistant", input=f"hello {round_}", conversation="new", idempotency_key=key)
            subs = await asyncio.gather(*(server.kernel.submit(request) for _ in range(4)))
            assert len({(s.turn_id, s.conversation_id) for s in subs}) == 1, subs
            assert sorted(s.duplicate for s in subs) == [False, True, True, True], subs
            convs = await server.store.list_conversations(None, limit=100)
            assert len(convs) == round_ + 1, [c.id for c in convs]
            assert convs[0].id == subs[0].conversation_id
            assert server.kernel.runtime_count <= round_ + 1  # the removed ones are not held either
            await subs[0].wait(T)
    finally:
        await server.close()


@pytest.fixture(scope="module")
def rot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("rot") / "home"
    home.mkdir(parents=True)
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp


def _rotate(home: Path, name: str, scopes: str) -> str:
    """(Re)create the token `name` with `scopes`: its keys stay the name's."""
    store = TokenStore(home)
    with contextlib.suppress(KeyError):  # none yet
        store.revoke(name)
    return store.create(name=name, scopes=scopes)[1]


def _client(sp: ServeProcess, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key=token, max_retries=0, timeout=T)


CHAT = {"model": "assistant", "messages": [{"role": "user", "content": "SECRET board minutes"}]}


def _ask_chat(sp: ServeProcess, token: str, key: str, text: str = "SECRET board minutes") -> Any:
    body = {**CHAT, "messages": [{"role": "user", "content": text}]}
    return _client(sp, token).chat.completions.with_raw_response.create(**body, extra_headers={"Idempotency-Key": key})


def _ask_responses(sp: ServeProcess, token: str, key: str, text: str = "SECRET board minutes") -> Any:
    return _client(sp, token).responses.with_raw_response.create(
        model="assistant", input=text, extra_headers={"Idempotency-Key": key}
    )


def _admin_conversation_hidden(sp: ServeProcess, token: str, conv: str) -> None:
    """The rotated token cannot name the admin's conversation directly either (the bar to meet)."""
    r = httpx.post(
        sp.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}", "X-Conversation-Id": conv},
        json={**CHAT, "messages": [{"role": "user", "content": "peek"}]},
        timeout=T,
    )
    assert r.status_code == 404, r.text


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_replay_never_shows_a_rotated_token_a_conversation_it_may_not_see(rot: ServeProcess, route: str) -> None:
    ask = _ask_chat if route == "chat" else _ask_responses
    name, key = f"rot-{route}", f"key-{uuid.uuid4().hex}"
    admin = _rotate(rot.home, name, "openai,ws,admin")
    first = ask(rot, admin, key)
    conv = first.headers["x-conversation-id"]
    assert first.status_code == 200 and "SECRET" in first.text
    again = ask(rot, admin, key)  # its own repeat is still replayed
    assert again.headers.get("idempotent-replayed") == "true" and again.text == first.text

    rotated = _rotate(rot.home, name, "openai,ws")
    _admin_conversation_hidden(rot, rotated, conv)
    with pytest.raises(openai.ConflictError) as refused:
        ask(rot, rotated, key)
    resp = refused.value.response
    assert refused.value.code == "idempotency_key_reused" and refused.value.param == "Idempotency-Key"
    assert "may not see" in refused.value.message
    assert resp.headers.get("x-conversation-id") is None and "SECRET" not in resp.text
    assert resp.headers.get("x-should-retry") == "false"
    fresh = ask(rot, rotated, f"key-{uuid.uuid4().hex}", "mine")  # another key runs, in its own conversation
    assert fresh.status_code == 200 and fresh.headers["x-conversation-id"] != conv


async def test_a_key_whose_claim_was_lost_never_follows_a_turn_the_caller_may_not_see(tmp_path: Path) -> None:
    """A request whose server stopped before it stored its answer left no claim (released at the
    next start), only its turn under the key (`Idempotency.earlier`): a repeat follows that turn,
    unless the repeating credential may not see its conversation (the rotated token)."""
    server = await open_server(tmp_path / "home")
    try:
        admin = Principal(subject="rot", kind="token", scopes=frozenset({"openai", "ws", "admin"}))
        rotated = Principal(subject="rot", kind="token", scopes=frozenset({"openai", "ws"}))
        key, scope = f"key-{uuid.uuid4().hex}", namespace_of(admin)
        assert scope == namespace_of(rotated)  # one name, one key scope
        request = SubmitRequest(
            agent="assistant",
            input="SECRET board minutes",
            conversation="new",
            idempotency_key=key,
            idempotency_scope=f"http:{scope}",  # as the OpenAI routes file it
            source={"kind": "openai_chat"},  # an HTTP request's turn (a key never follows a WebSocket one)
        )
        sub = await server.kernel.submit(request)
        assert (await sub.wait(T)).status == "completed"

        followed, _ = await Idempotency(server, scope, key, "hash", admin).earlier()
        assert followed is not None and followed.conversation_id == sub.conversation_id
        with pytest.raises(ApiError) as refused:
            await Idempotency(server, scope, key, "hash", rotated).earlier()
        assert refused.value.status == 409 and refused.value.code == "idempotency_key_reused"
    finally:
        await server.close()
