"""Issue 11.2: credential namespaces hold on every front end (DESIGN §13, docs/security.md).

One real `appserver serve --auth token`; tokens A and B (same scopes, same agents: only the
namespace tells them apart) and an admin token; real `websockets` and `httpx` clients. A's
conversations, made over WebSocket or HTTP, are invisible and unusable for B on both front ends,
refusals look exactly like unknown ids, each credential has its own default conversation, and the
`schedule` tool (cron targets) stays inside the namespace of the conversation it runs in.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS, db_messages

pytestmark = pytest.mark.timeout(60)

T = 10.0
LOOKUP = {"name": "lookup", "description": "a client tool", "parameters": {"type": "object", "properties": {}}}


@dataclass
class Srv:
    sp: ServeProcess
    a: str
    b: str
    admin: str

    @property
    def url(self) -> str:
        return self.sp.url


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("ns") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    store = TokenStore(home)
    a = store.create(name="tok-a")[1]  # default scopes openai,ws; every agent
    b = store.create(name="tok-b")[1]
    admin = store.create(name="tok-admin", scopes="openai,ws,admin")[1]
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, a, b, admin)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def ws_for(srv: Srv, token: str) -> WS:
    return await WS.open(srv.url, headers=bearer(token), open_timeout=T)


def submit(conversation: str | None, text: str, agent: str = "assistant", **extra: Any) -> dict[str, Any]:
    frame = {"type": "submit_input", "agent": agent, "input": text, **extra}
    if conversation is not None:
        frame["conversation"] = conversation
    return frame


async def run_turn(ws: WS, frame: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(ack, the final text of the turn)."""
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], T)
    assert snap["status"] == "completed", snap
    return ack, snap["blocks"][-1]["text"]


def same_refusal(mine: dict[str, Any], unknown: dict[str, Any], ref: str) -> None:
    """A refusal for someone else's conversation says exactly what an unknown id gets."""
    assert mine["type"] == unknown["type"] == "error"
    assert mine["code"] == unknown["code"] == "conversation_not_found"
    assert mine["param"] == unknown["param"]
    assert mine["message"].replace(ref, "ID") == unknown["message"].replace("conv_doesnotexist", "ID")


async def test_websocket_isolates_conversations_of_two_tokens(srv: Srv) -> None:
    a, b = await ws_for(srv, srv.a), await ws_for(srv, srv.b)
    ack, _ = await run_turn(a, submit("new", "alpha secret"))
    conv_a = ack["conversation_id"]

    listed = await b.request({"type": "list_conversations"}, T)
    assert conv_a not in {c["id"] for c in listed["conversations"]}
    assert conv_a in {c["id"] for c in (await a.request({"type": "list_conversations"}, T))["conversations"]}

    frames = [
        {"type": "get_history", "conversation": "CONV"},
        {"type": "subscribe", "conversation": "CONV"},
        submit("CONV", "beta was here"),
        {"type": "cancel", "conversation": "CONV"},
        {
            "type": "approval_response",
            "conversation": "CONV",
            "decisions": [{"call_id": "call_x", "decision": "approve"}],
        },
    ]
    for frame in frames:
        mine = await b.request({**frame, "conversation": conv_a}, T)
        unknown = await b.request({**frame, "conversation": "conv_doesnotexist"}, T)
        same_refusal(mine, unknown, conv_a)
    # nothing of B reached A's conversation, nothing of A reached B
    assert [r[0] for r in db_messages(srv.sp.home, conv_a)] == ["user", "assistant"]
    assert not [f for f in b.seen if "alpha secret" in json.dumps(f)]
    await a.close()
    await b.close()


async def test_approvals_and_client_tools_of_another_token_are_out_of_reach(srv: Srv) -> None:
    a, b = await ws_for(srv, srv.a), await ws_for(srv, srv.b)
    # A's turn waits for an approval: B can neither see it nor answer it
    ack = await a.request(submit("new", "/call clock {}", agent="careful"), T)
    req = await a.expect(lambda f: f["type"] == "approval_request", T)
    conv = ack["conversation_id"]
    refused = await b.request(
        {
            "type": "approval_response",
            "conversation": conv,
            "decisions": [{"call_id": req["call_id"], "decision": "deny"}],
        },
        T,
    )
    assert refused["code"] == "conversation_not_found"
    assert (await b.request({"type": "subscribe", "conversation": conv}, T))["code"] == "conversation_not_found"
    won = await a.request(
        {
            "type": "approval_response",
            "conversation": conv,
            "decisions": [{"call_id": req["call_id"], "decision": "approve"}],
        },
        T,
    )
    assert won["results"][0]["accepted"] is True  # still A's to answer
    assert (await a.terminal(ack["turn_id"], T))["blocks"][-1]["text"].startswith("clock -> 20")
    # A's client tool call: B's tool_result is refused, A's is taken
    ack = await a.request(submit("new", "/call lookup {}", client_tools=[LOOKUP]), T)
    call = await a.expect(lambda f: f["type"] == "tool_call_request", T)
    stolen = await b.request({"type": "tool_result", "call_id": call["call_id"], "output": "from B"}, T)
    assert stolen["type"] == "error" and stolen["code"] == "unknown_call"
    assert (await a.request({"type": "tool_result", "call_id": call["call_id"], "output": "from A"}, T))[
        "type"
    ] == "ack"
    assert (await a.terminal(ack["turn_id"], T))["blocks"][-1]["text"] == "lookup -> from A"
    assert not [f for f in b.seen if f["type"] in ("approval_request", "tool_call_request", "turn_updated")]
    await a.close()
    await b.close()


async def test_each_credential_has_its_own_default_conversation(srv: Srv) -> None:
    a, b, admin = await ws_for(srv, srv.a), await ws_for(srv, srv.b), await ws_for(srv, srv.admin)
    ack_a, _ = await run_turn(a, submit(None, "said to my default"))  # no conversation: default
    ack_b, recall_b = await run_turn(b, submit("default", "/recall"))
    ack_admin, _ = await run_turn(admin, submit(None, "admin default"))
    ids = {ack_a["conversation_id"], ack_b["conversation_id"], ack_admin["conversation_id"]}
    assert len(ids) == 3, ids  # nobody shares a default
    assert recall_b == "echo: (nothing)" or "said to my default" not in recall_b
    assert ack_a["conversation_id"].startswith("conv_default~")
    # "default" in other frames is the same per-credential conversation, shown as a default
    state = await a.request({"type": "subscribe", "conversation": "default", "agent": "assistant"}, T)
    assert state["conversation"]["id"] == ack_a["conversation_id"] and state["conversation"]["default"] is True
    _, again = await run_turn(a, submit(None, "/recall"))
    assert "said to my default" in again
    # the agent's shared default belongs to admin and local callers only
    same_refusal(
        await b.request({"type": "get_history", "conversation": ack_admin["conversation_id"]}, T),
        await b.request({"type": "get_history", "conversation": "conv_doesnotexist"}, T),
        ack_admin["conversation_id"],
    )
    # admin sees everyone's
    for cid in ids:
        assert (await admin.request({"type": "get_history", "conversation": cid}, T))["type"] == "history"
    for w in (a, b, admin):
        await w.close()


async def test_default_and_new_over_http_are_the_credentials_own_never_ids_anyone_can_take(srv: Srv) -> None:
    """`X-Conversation-Id: default` (or Responses `conversation: "default"`) is the credential's
    own default, the one its WebSocket `default` names; `new` is a conversation of its own. Was: a
    token landed in the agent's shared default (reading admin's text) and created a conversation
    named `default` (and `new`) that locked every other credential out of the word."""
    a, admin = await ws_for(srv, srv.a), await ws_for(srv, srv.admin)
    ack_admin, _ = await run_turn(admin, submit(None, "ADMIN-ONLY text"))
    ack_a, _ = await run_turn(a, submit(None, "a's own default"))
    chat = {"model": "assistant", "messages": [{"role": "user", "content": "/recall"}]}
    with httpx.Client(base_url=srv.url, timeout=T) as http:
        for token, own in ((srv.a, ack_a["conversation_id"]), (srv.admin, ack_admin["conversation_id"])):
            for word in ("default", "DEFAULT"):
                r = http.post("/v1/chat/completions", json=chat, headers={**bearer(token), "X-Conversation-Id": word})
                assert r.status_code == 200 and r.headers["x-conversation-id"] == own, r.text
            r = http.post(
                "/v1/responses",
                json={"model": "assistant", "input": "/recall", "conversation": "default"},
                headers=bearer(token),
            )
            assert r.status_code == 200 and r.headers["x-conversation-id"] == own, r.text
        recall = http.post("/v1/chat/completions", json=chat, headers={**bearer(srv.a), "X-Conversation-Id": "default"})
        assert "ADMIN-ONLY" not in recall.text and "a's own default" in recall.text
        b_default = http.post(
            "/v1/chat/completions", json=chat, headers={**bearer(srv.b), "X-Conversation-Id": "default"}
        )
        assert b_default.status_code == 200 and b_default.headers["x-conversation-id"] not in (
            ack_a["conversation_id"],
            ack_admin["conversation_id"],
        )
        made = set()
        for token in (srv.a, srv.b, srv.a):
            r = http.post("/v1/chat/completions", json=chat, headers={**bearer(token), "X-Conversation-Id": "new"})
            assert r.status_code == 200, r.text
            made.add(r.headers["x-conversation-id"])
        assert len(made) == 3 and not made & {"new", "default"}
    with sqlite3.connect(f"file:{Path(srv.sp.home) / 'appserver.db'}?mode=ro", uri=True) as db:
        named = db.execute("SELECT id FROM conversations WHERE lower(id) IN ('default', 'new')").fetchall()
    assert named == []  # no conversation is named by the word
    for w in (a, admin):
        await w.close()


async def test_http_and_websocket_apply_one_rule(srv: Srv) -> None:
    a = await ws_for(srv, srv.a)
    ack, _ = await run_turn(a, submit("new", "alpha over ws"))
    conv_ws = ack["conversation_id"]
    with httpx.Client(base_url=srv.url + "/v1", timeout=T) as c:

        def chat(token: str, conversation: str, text: str) -> httpx.Response:
            return c.post(
                "/chat/completions",
                headers={**bearer(token), "X-Conversation-Id": conversation},
                json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
            )

        # a conversation A made over WS: B gets 404 over HTTP, A continues it over HTTP
        r = chat(srv.b, conv_ws, "/recall")
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
        r = chat(srv.a, conv_ws, "/recall")
        assert r.status_code == 200 and "alpha over ws" in r.json()["choices"][0]["message"]["content"]
        # a conversation A made over HTTP: B cannot reach it over WS, A can
        assert chat(srv.a, "hdr-conv-of-a", "alpha over http").status_code == 200
        b = await ws_for(srv, srv.b)
        same_refusal(
            await b.request({"type": "get_history", "conversation": "hdr-conv-of-a"}, T),
            await b.request({"type": "get_history", "conversation": "conv_doesnotexist"}, T),
            "hdr-conv-of-a",
        )
        hist = await a.request({"type": "get_history", "conversation": "hdr-conv-of-a"}, T)
        assert [m["content"] for m in hist["messages"]][0] == "alpha over http"
        # stored responses belong to their conversation's namespace
        r = c.post("/responses", headers=bearer(srv.a), json={"model": "assistant", "input": "alpha response"})
        assert r.status_code == 200
        resp_id = r.json()["id"]
        assert c.get(f"/responses/{resp_id}", headers=bearer(srv.a)).status_code == 200
        assert c.get(f"/responses/{resp_id}", headers=bearer(srv.admin)).status_code == 200
        r = c.get(f"/responses/{resp_id}", headers=bearer(srv.b))
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        assert c.get(f"/responses/{resp_id}/input_items", headers=bearer(srv.b)).status_code == 404
        r = c.post(
            "/responses",
            headers=bearer(srv.b),
            json={"model": "assistant", "input": "x", "previous_response_id": resp_id},
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
        assert c.delete(f"/responses/{resp_id}", headers=bearer(srv.b)).status_code == 404
        assert c.get(f"/responses/{resp_id}", headers=bearer(srv.a)).status_code == 200  # not deleted
        # an unowned conversation (made by an admin) is not A's either, on either front end
        admin = await ws_for(srv, srv.admin)
        unowned = (await admin.request({"type": "create_conversation", "agent": "assistant"}, T))["conversation"]["id"]
        assert chat(srv.a, unowned, "hi").status_code == 404
        assert (await a.request({"type": "subscribe", "conversation": unowned}, T))["code"] == "conversation_not_found"
        assert chat(srv.admin, conv_ws, "/recall").status_code == 200  # admin sees all
    for w in (a, b, admin):
        await w.close()


async def test_idempotency_keys_belong_to_the_credential(srv: Srv) -> None:
    a, b = await ws_for(srv, srv.a), await ws_for(srv, srv.b)
    first, _ = await run_turn(a, submit("new", "alpha keyed", idempotency_key="shared-key"))
    other = await b.request(submit("new", "beta keyed", idempotency_key="shared-key"), T)
    assert other["duplicate"] is False and other["turn_id"] != first["turn_id"]
    assert other["conversation_id"] != first["conversation_id"]
    await b.terminal(other["turn_id"], T)
    assert not [f for f in b.seen if "alpha keyed" in json.dumps(f)]
    await a.close()
    await b.close()


def _tasks(home: Path) -> list[dict[str, Any]]:
    return list(json.loads((home / "crons.json").read_text())["tasks"])


async def test_schedule_tool_targets_stay_in_the_namespace(srv: Srv) -> None:
    a, b, admin = await ws_for(srv, srv.a), await ws_for(srv, srv.b), await ws_for(srv, srv.admin)
    ack_b, _ = await run_turn(b, submit("new", "beta's conversation"))
    conv_b = ack_b["conversation_id"]
    ack, text = await run_turn(
        a, submit("new", '/call schedule {"action": "create", "name": "a-task", "prompt": "hello", "in": "2h"}')
    )
    conv_a = ack["conversation_id"]
    assert text.startswith("schedule -> created task a-task"), text
    task = next(t for t in _tasks(srv.sp.home) if t["name"] == "a-task")
    assert task["conversation"] == conv_a  # into the caller's own conversation, not an unowned "new"
    for target in (conv_b, "new", "default"):
        call = {"action": "create", "name": "x-task", "prompt": "p", "in": "2h", "conversation": target}
        _, text = await run_turn(a, submit(conv_a, f"/call schedule {json.dumps(call)}"))
        assert "schedule create failed" in text, (target, text)
    assert "x-task" not in {t["name"] for t in _tasks(srv.sp.home)}
    # B neither lists nor cancels A's task
    _, text = await run_turn(b, submit(conv_b, '/call schedule {"action": "list"}'))
    assert "a-task" not in text
    _, text = await run_turn(b, submit(conv_b, '/call schedule {"action": "cancel", "name": "a-task"}'))
    assert "failed" in text and "a-task" in {t["name"] for t in _tasks(srv.sp.home)}
    # A lists it; an admin (unowned conversation) sees all tasks of the agent
    _, text = await run_turn(a, submit(conv_a, '/call schedule {"action": "list"}'))
    assert "a-task" in text
    _, text = await run_turn(admin, submit("new", '/call schedule {"action": "list"}'))
    assert "a-task" in text
    _, text = await run_turn(a, submit(conv_a, '/call schedule {"action": "cancel", "name": "a-task"}'))
    assert re.search(r"cancelled task a-task", text)
    for w in (a, b, admin):
        await w.close()
