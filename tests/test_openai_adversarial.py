"""Breaks an outside tester found on /v1, through a real `appserver serve` with the real `openai`
SDK (and httpx for bodies the SDK would not send). Every body is validated against OpenAI's
OpenAPI document.

Agents: `assistant` on echo; `remote` on a loopback fake OpenAI upstream that answers `fine`.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import (
    FakeOpenAI,
    RecordedRequest,
    Reply,
    chunk,
    openai_sse,
    tool_delta,
    usage_chunk,
)
from tests.openai_schema import require_conformance, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)


def fine(req: RecordedRequest) -> Reply:
    return Reply(
        pieces=[openai_sse([chunk(role="assistant", content="fine"), chunk(finish_reason="stop"), usage_chunk(5, 1)])]
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = fine
        home = tmp_path_factory.mktemp("adversarial") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant`
        assert run_cli(home, "agents", "create", "--name", "remote", "--model", "fake:m", "--json", env=env).code == 0
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def http(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv[0].url, timeout=30) as c:
        yield c


def conversations(srv: tuple[ServeProcess, FakeOpenAI]) -> int:
    with sqlite3.connect(f"file:{Path(srv[0].home) / 'appserver.db'}?mode=ro", uri=True) as c:
        return int(c.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])


def call(cid: str, name: str = "f") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


# ---------------------------------------------------------------- a round of calls answered in parts


def test_a_stateless_client_answering_a_round_in_parts_resends_the_earlier_answers(http: httpx.Client) -> None:
    """The client answers one of two calls, is told the other is still open, then resends the whole
    history with both results (as stateless clients do): the repeated answer is history, not a
    second answer (was: 400 already_resolved)."""
    u = uuid.uuid4().hex
    msgs: list[Any] = [
        {"role": "user", "content": f"two calls {u}"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
    ]
    part = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs})
    assert part.status_code == 200, part.text
    validate("CreateChatCompletionResponse", part.json())
    choice = part.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and [c["id"] for c in choice["message"]["tool_calls"]] == ["c2"]
    full = http.post(
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [*msgs, {"role": "tool", "tool_call_id": "c2", "content": "r2"}]},
    )
    assert full.status_code == 200, full.text
    assert full.json()["choices"][0]["message"]["content"] == "f -> r1\nf -> r2"
    assert full.headers["x-conversation-id"] == part.headers["x-conversation-id"]
    # the first request again (a retry): nothing new, still waiting for c2 — now answered, so it forks
    again = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs})
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["tool_calls"][0]["id"] == "c2"

    # Responses: the partial answer must show what is still open (was: `completed` with no output)
    items: list[Any] = [
        {"role": "user", "content": f"two calls {u} r"},
        {"type": "function_call", "call_id": "k1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "k2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "k1", "output": "r1"},
    ]
    part = http.post("/v1/responses", json={"model": "assistant", "input": items})
    assert part.status_code == 200, part.text
    validate("Response", part.json())
    assert [(o["type"], o.get("call_id")) for o in part.json()["output"]] == [("function_call", "k2")]
    full = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [*items, {"type": "function_call_output", "call_id": "k2", "output": "r2"}],
        },
    )
    assert full.status_code == 200, full.text
    validate("Response", full.json())
    assert full.json()["output"][-1]["content"][0]["text"] == "f -> r1\nf -> r2"


def test_a_repeated_answer_through_previous_response_id_is_not_an_error(client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": f"prev {uuid.uuid4().hex}"},
        {"type": "function_call", "call_id": "p1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "p2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "p1", "output": "r1"},
    ]
    first = client.responses.create(model="assistant", input=items)
    assert [o.type for o in first.output] == ["function_call"]
    done = client.responses.create(
        model="assistant",
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": "p1", "output": "r1"},
            {"type": "function_call_output", "call_id": "p2", "output": "r2"},
        ],
    )
    assert done.output_text == "f -> r1\nf -> r2"


# ---------------------------------------------------------------- histories the server cannot keep


def test_duplicate_tool_call_ids_are_a_400_and_write_nothing(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    before = conversations(srv)
    msgs = [
        {"role": "user", "content": f"dup {uuid.uuid4().hex}"},
        {"role": "assistant", "content": None, "tool_calls": [call("d1", "f"), call("d1", "g")]},
        {"role": "tool", "tool_call_id": "d1", "content": "r"},
    ]
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs})
    assert r.status_code == 400, r.text  # was: 500 and a conversation left behind
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "duplicate_tool_call_id" and r.json()["error"]["param"] == "messages"
    items = [
        {"role": "user", "content": "dup"},
        {"type": "function_call", "call_id": "d1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "d1", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "d1", "output": "r"},
    ]
    r = http.post("/v1/responses", json={"model": "assistant", "input": items})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert conversations(srv) == before


def _messages(srv: tuple[ServeProcess, FakeOpenAI], conversation_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(f"file:{Path(srv[0].home) / 'appserver.db'}?mode=ro", uri=True) as c:
        rows = c.execute(
            "SELECT role, COALESCE(content, '') FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
    return [(str(role), str(content)) for role, content in rows]


def test_one_input_answering_a_call_twice_differently_is_refused_whole_and_writes_nothing(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    """Two different results (or approve and deny) for one call in one request: a 400 that applies
    none of them (was: the 400, yet the first answer was taken and the turn ran on with it)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": f'/call f {{"n": "{uuid.uuid4().hex}"}}'}]
    first = http.post("/v1/chat/completions", json={"model": "assistant", "messages": ask, "tools": [tool]})
    assert first.status_code == 200, first.text
    conv = first.headers["x-conversation-id"]
    (made,) = first.json()["choices"][0]["message"]["tool_calls"]
    asked = [*ask, {"role": "assistant", "content": None, "tool_calls": [made]}]
    twice = [
        *asked,
        {"role": "tool", "tool_call_id": made["id"], "content": "A"},
        {"role": "tool", "tool_call_id": made["id"], "content": "B"},
    ]
    before = _messages(srv, conv)
    assert [role for role, _ in before] == ["user", "assistant"]
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": twice, "tools": [tool]})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert _messages(srv, conv) == before
    once = http.post(
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [*twice[:-1]], "tools": [tool]},
        headers={"X-Conversation-Id": conv},
    )
    assert once.status_code == 200, once.text
    assert once.json()["choices"][0]["message"]["content"] == "f -> A"

    # approvals through the Responses API: approve and deny for one request
    env = cli_env(Path(srv[0].home))
    made_agent = run_cli(Path(srv[0].home), "agents", "create", "--name", f"asker-{uuid.uuid4().hex[:6]}",
                         "--tool", "clock=ask", "--json", env=env)  # fmt: skip
    assert made_agent.code == 0, made_agent.err
    asker = json.loads(made_agent.out)["name"]
    started = http.post("/v1/responses", json={"model": asker, "input": "/call clock {}"})
    assert started.status_code == 200, started.text
    (request,) = [o for o in started.json()["output"] if o["type"] == "mcp_approval_request"]
    conv = started.headers["x-conversation-id"]
    before = _messages(srv, conv)
    assert [role for role, _ in before] == ["user", "assistant"]
    both = [
        {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True},
        {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": False},
    ]
    r = http.post("/v1/responses", json={"model": asker, "previous_response_id": started.json()["id"], "input": both})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    time.sleep(0.3)  # a wrongly resumed turn would have run the clock by now
    assert _messages(srv, conv) == before
    denied = http.post(
        "/v1/responses", json={"model": asker, "previous_response_id": started.json()["id"], "input": both[1:]}
    )
    assert denied.status_code == 200, denied.text
    assert not any(role == "tool" and "UTC" in text and "denied" not in text for role, text in _messages(srv, conv))


def test_a_resent_answer_finds_its_own_conversation_when_another_made_the_same_call(http: httpx.Client) -> None:
    """Two clients send the same opening and get the same call (other ids). The second answers its
    call, then resends that body (a retry): it is answered again, in a fork of its own conversation,
    never refused in the other client's (was: 400 "no pending call" from the other one)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": f'/call f {{"w": "{uuid.uuid4().hex}"}}'}]
    other = http.post("/v1/chat/completions", json={"model": "assistant", "messages": ask, "tools": [tool]})
    assert other.status_code == 200, other.text  # left waiting for its result
    mine = http.post("/v1/chat/completions", json={"model": "assistant", "messages": ask, "tools": [tool]})
    (made,) = mine.json()["choices"][0]["message"]["tool_calls"]
    body = {
        "model": "assistant",
        "messages": [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [made]},
            {"role": "tool", "tool_call_id": made["id"], "content": "OUT"},
        ],
        "tools": [tool],
    }
    for _ in range(3):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "f -> OUT"
        assert r.headers["x-conversation-id"] != other.headers["x-conversation-id"]

    rtool = {"type": "function", "name": "g", "parameters": {"type": "object"}}
    said = f'/call g {{"w": "{uuid.uuid4().hex}"}}'
    other = http.post("/v1/responses", json={"model": "assistant", "input": said, "tools": [rtool]})
    assert other.status_code == 200, other.text
    mine = http.post("/v1/responses", json={"model": "assistant", "input": said, "tools": [rtool]})
    (fc,) = [o for o in mine.json()["output"] if o["type"] == "function_call"]
    items = [
        {"role": "user", "content": said},
        {"type": "function_call", "call_id": fc["call_id"], "name": "g", "arguments": fc["arguments"]},
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "OUT"},
    ]
    for _ in range(3):
        r = http.post("/v1/responses", json={"model": "assistant", "input": items, "tools": [rtool]})
        assert r.status_code == 200, r.text
        assert r.json()["output"][-1]["content"][0]["text"] == "g -> OUT"
        assert r.headers["x-conversation-id"] != other.headers["x-conversation-id"]


def test_a_name_two_agents_share_is_an_ambiguous_model_not_a_missing_one(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    home = Path(srv[0].home)
    name = f"twin-{uuid.uuid4().hex[:8]}"
    first = run_cli(home, "agents", "create", "--name", name, "--json", env=cli_env(home))
    assert first.code == 0 and "also named" not in first.err
    second = run_cli(home, "agents", "create", "--name", name, "--json", env=cli_env(home))
    assert second.code == 0, second.err
    ids = [json.loads(first.out)["id"], json.loads(second.out)["id"]]
    assert f"{ids[0]} is also named {name!r}" in second.err  # the CLI says what it did to clients of the name
    r = http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "model_ambiguous" and all(i in r.json()["error"]["message"] for i in ids)
    ok = http.post("/v1/chat/completions", json={"model": ids[1], "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} >= set(ids)


def test_images_where_only_users_may_send_them_are_refused_not_dropped(http: httpx.Client) -> None:
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for msgs in (
        [{"role": "system", "content": [{"type": "text", "text": "s"}, img]}, {"role": "user", "content": "x"}],
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call("i1")]},
            {"role": "tool", "tool_call_id": "i1", "content": [img]},
        ],
    ):
        r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_part", r.text
        validate("ErrorResponse", r.json())
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    for body in (
        {"input": [{"role": "developer", "content": [image]}, {"role": "user", "content": "x"}]},
        {"input": "x", "instructions": [{"role": "system", "content": [image]}]},
    ):
        r = http.post("/v1/responses", json={"model": "assistant", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_part", r.text


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,AA!A", "base64 is not valid"),
        ("data:image/png;base64,AAA", "base64 is not valid"),  # cut short: no whole group
        ("data:image/png;base64,", "holds no data"),
        ("data:image/png,AAAA", "must be base64"),
        ("file:///etc/passwd", "must start with https:, http: or data:image/"),
        (" https://example.com/a.png", "without the space before it"),
    ],
)
def test_an_image_url_no_model_could_take_is_refused_where_it_arrives(http: httpx.Client, url: str, says: str) -> None:
    """Broken base64 or a scheme a provider must not fetch (a local file): a 400 naming the part on
    both routes (and the WebSocket protocol uses the same check), not a turn that fails upstream."""
    chat = {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}],
    }
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": [chat]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image_url", r.text
    assert says in r.json()["error"]["message"] and "messages[0].content[1]" in r.json()["error"]["message"]
    validate("ErrorResponse", r.json())
    item = {"role": "user", "content": [{"type": "input_image", "image_url": url}]}
    r = http.post("/v1/responses", json={"model": "assistant", "input": [item]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image_url", r.text
    ok = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    good = http.post(
        "/v1/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": [ok]}]}
    )
    assert good.status_code == 200, good.text


def test_a_conversation_object_without_an_id_is_refused_not_ignored(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": "assistant", "input": "x", "conversation": {"idd": "conv_x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation.id", r.text  # was: a new conversation
    validate("ErrorResponse", r.json())


# ---------------------------------------------------------------- idempotency: the same JSON


def test_an_idempotency_key_replays_the_same_json_whatever_its_number_spelling(http: httpx.Client) -> None:
    key = uuid.uuid4().hex
    h = {"Idempotency-Key": key, "content-type": "application/json"}
    first = http.post(
        "/v1/chat/completions",
        content='{"model":"assistant","temperature":1.0,"max_tokens":100,"messages":[{"role":"user","content":"n"}]}',
        headers=h,
    )
    assert first.status_code == 200
    # the same JSON from a serialiser that writes integers without ".0" (JavaScript, a proxy)
    again = http.post(
        "/v1/chat/completions",
        content='{"messages":[{"content":"n","role":"user"}],"max_tokens":1e2,"temperature":1,"model":"assistant"}',
        headers=h,
    )
    assert again.status_code == 200, again.text  # was: 409 idempotency_key_reused
    assert again.headers.get("idempotent-replayed") == "true" and again.text == first.text
    other = http.post(
        "/v1/chat/completions",
        content='{"model":"assistant","temperature":1.5,"max_tokens":100,"messages":[{"role":"user","content":"n"}]}',
        headers=h,
    )
    assert other.status_code == 409


def test_a_failed_turn_names_its_conversation_and_frees_its_idempotency_key(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    """The client's message went into a conversation even when its turn failed: the error says
    which (was: no X-Conversation-Id, so the client could not find it). Only answers are kept for a
    key, so a repeat after the failure runs again; an empty key is a mistake, not "no key"."""
    key = uuid.uuid4().hex
    text = f"/error 502 {key}"
    for route, body in (
        ("/v1/chat/completions", {"model": "assistant", "messages": [{"role": "user", "content": text}]}),
        ("/v1/responses", {"model": "assistant", "input": text}),
    ):
        pinned = f"conv_pin_{uuid.uuid4().hex[:12]}"
        failed = http.post(route, json=body, headers={"X-Conversation-Id": pinned})
        assert failed.status_code == 502, failed.text
        validate("ErrorResponse", failed.json())
        assert failed.headers["x-conversation-id"] == pinned
        assert [role for role, _ in _messages(srv, pinned)][:1] == ["user"]
        unpinned = http.post(route, json=body, headers={"Idempotency-Key": f"{route}{key}"})
        assert unpinned.status_code == 502 and unpinned.headers["x-conversation-id"].startswith("conv_")
        again = http.post(route, json=body, headers={"Idempotency-Key": f"{route}{key}"})
        assert again.status_code == 502 and "idempotent-replayed" not in again.headers
        # it ran anew, in the conversation the failed turn left its input in: held there once
        assert again.headers["x-conversation-id"] == unpinned.headers["x-conversation-id"]
        assert [role for role, _ in _messages(srv, unpinned.headers["x-conversation-id"])].count("user") == 1
        empty = http.post(route, json=body, headers={"Idempotency-Key": ""})
        assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_idempotency_key", empty.text


# ---------------------------------------------------------------- client tools and the agent's own


def test_client_tool_names_are_unique_and_shadow_the_agents_own(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    fake = srv[1]
    fake.requests.clear()
    mine = {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "the client's clock",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    r = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [{"role": "user", "content": "time?"}], "tools": [mine]},
    )
    assert r.status_code == 200, r.text
    sent = [t["function"] for t in fake.requests[-1].json["tools"]]
    assert [t["name"] for t in sent].count("clock") == 1, sent  # was: two tools named clock upstream
    assert next(t for t in sent if t["name"] == "clock")["description"] == "the client's clock"
    for path, tools in (
        ("/v1/chat/completions", [mine, mine]),
        ("/v1/responses", [{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]),
    ):
        body: dict[str, Any] = {"model": "remote", "tools": tools}
        body["messages" if "chat" in path else "input"] = [{"role": "user", "content": "x"}]
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_function_name", r.text
        validate("ErrorResponse", json.loads(r.text))


# ---------------------------------------------------------------- upstream call ids


def test_an_upstream_that_numbers_its_calls_per_reply_keeps_working(
    http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    """llama.cpp-style upstreams name every first call `call_0`: the second client-tool turn of a
    conversation was a 500 (UNIQUE constraint failed: pending_calls…) and left the turn stuck."""
    fake = srv[1]

    def numbered(req: RecordedRequest) -> Reply:
        if req.json["messages"][-1]["role"] == "tool":
            return fine(req)
        return Reply(
            pieces=[
                openai_sse(
                    [
                        chunk(
                            role="assistant",
                            tool_calls=[tool_delta(0, id="call_0", name="get_weather", arguments="{}")],
                        ),
                        chunk(finish_reason="tool_calls"),
                        usage_chunk(1, 1),
                    ]
                )
            ]
        )

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    h = {"X-Conversation-Id": f"numbered-{uuid.uuid4().hex}"}
    fake.responder = numbered
    try:
        ids = []
        for i in range(2):
            msgs: list[Any] = [{"role": "user", "content": f"q{i}"}]
            r = http.post(
                "/v1/chat/completions", json={"model": "remote", "messages": msgs, "tools": [tool]}, headers=h
            )
            assert r.status_code == 200, r.text
            validate("CreateChatCompletionResponse", r.json())
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            ids.append(calls[0]["id"])
            msgs += [
                r.json()["choices"][0]["message"],
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sun"},
            ]
            r = http.post(
                "/v1/chat/completions", json={"model": "remote", "messages": msgs, "tools": [tool]}, headers=h
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine", r.text
        assert ids[0] == "call_0" and ids[1] != "call_0"
    finally:
        fake.responder = fine


# ---------------------------------------------------------------- a reply cut short upstream


def test_a_reply_the_upstream_cut_short_is_an_error_not_a_finished_answer(
    srv: tuple[ServeProcess, FakeOpenAI], client: openai.OpenAI, http: httpx.Client
) -> None:
    """Text, then the upstream's connection drops mid-body: chat completions must not present the
    part as a whole answer (`finish_reason: stop`). Non-stream: the turn's error; stream: the text
    that was shown, then an error event (the SDK raises), never a `stop` chunk."""
    _, fake = srv
    body = openai_sse([chunk(role="assistant", content="the first half "), chunk(content="and the rest")])
    cut_at = body.index(b"and the rest")

    fake.script(body, chunk_size=cut_at, drop_after=cut_at)
    r = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "q1"}]})
    assert r.status_code >= 500, r.text
    assert r.json()["error"]["code"] and "turn failed" in r.json()["error"]["message"]

    fake.script(body, chunk_size=cut_at, drop_after=cut_at)
    shown: list[str] = []
    finishes: list[str | None] = []
    with pytest.raises(openai.APIError):
        for c in client.chat.completions.create(
            model="remote", messages=[{"role": "user", "content": "q2"}], stream=True
        ):
            if c.choices:
                shown.append(c.choices[0].delta.content or "")
                finishes.append(c.choices[0].finish_reason)
    assert "".join(shown) == "the first half " and "stop" not in finishes


# ---------------------------------------------------------------- the agent deleted mid-request


def test_a_responses_stream_whose_agent_is_deleted_says_so(
    srv: tuple[ServeProcess, FakeOpenAI], http: httpx.Client
) -> None:
    """`/v1/responses` with `stream: true`, the agent deleted mid-stream: it ends with
    `response.failed` whose message says the agent was deleted (model_not_found), as the other
    paths answer, not a generic "could not be saved" server error."""
    import threading

    sp, _ = srv
    env = cli_env(sp.home)
    assert run_cli(sp.home, "agents", "create", "--name", "fleeting", "--model", "echo:m", "--json", env=env).code == 0
    events: list[dict[str, Any]] = []
    started = threading.Event()

    def read() -> None:
        with http.stream("POST", "/v1/responses", json={"model": "fleeting", "input": "/slow 60", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1].get("type") == "response.output_text.delta":
                        started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(10), events
    assert run_cli(sp.home, "agents", "delete", "fleeting", env=env).code == 0
    t.join(30)
    last = events[-1]
    assert last["type"] == "response.failed", last
    error = last["response"]["error"]
    assert "deleted" in error["message"] and "model_not_found" in error["message"], error


def test_a_conversation_id_reused_after_its_agent_was_deleted_starts_empty(
    srv: tuple[ServeProcess, FakeOpenAI], http: httpx.Client
) -> None:
    """Agent A's conversation (by `X-Conversation-Id`) holds a secret; A is deleted from the CLI (the
    server hears nothing of it); agent B then uses the same conversation id. B gets a new, empty
    conversation: nothing of A's history, kept in A's runtime in the server's memory, carries over."""
    sp, _ = srv
    env = cli_env(sp.home)
    for name in ("keeper", "stranger"):
        made = run_cli(sp.home, "agents", "create", "--name", name, "--model", "echo:m", "--json", env=env)
        assert made.code == 0, made.err
    conv = {"X-Conversation-Id": f"shared-{uuid.uuid4().hex[:8]}"}
    said = http.post(
        "/v1/chat/completions",
        json={"model": "keeper", "messages": [{"role": "user", "content": "my password is hunter2"}]},
        headers=conv,
    )
    assert said.status_code == 200, said.text
    assert run_cli(sp.home, "agents", "delete", "keeper", env=env).code == 0
    recalled = http.post(
        "/v1/chat/completions",
        json={"model": "stranger", "messages": [{"role": "user", "content": "/recall"}]},
        headers=conv,
    )
    assert recalled.status_code == 200, recalled.text
    text = recalled.json()["choices"][0]["message"]["content"]
    assert "hunter2" not in text, text
    again = http.post(
        "/v1/chat/completions",
        json={"model": "stranger", "messages": [{"role": "user", "content": "/recall"}]},
        headers=conv,
    )
    assert "hunter2" not in again.json()["choices"][0]["message"]["content"]


def test_an_agent_deleted_while_its_request_runs_is_a_404_not_a_500(
    srv: tuple[ServeProcess, FakeOpenAI], http: httpx.Client
) -> None:
    """`appserver agents delete` while a request for that agent waits on its model: the request
    ends as the model not existing (404 model_not_found), as the next one does, not as a server
    error; the server keeps serving."""
    import threading

    sp, fake = srv
    env = cli_env(sp.home)
    made = run_cli(sp.home, "agents", "create", "--name", "doomed", "--model", "fake:m", "--json", env=env)
    assert made.code == 0, made.err
    fake.script(
        openai_sse([chunk(role="assistant", content="too late"), chunk(finish_reason="stop")]), initial_delay_s=1.5
    )
    got: dict[str, httpx.Response] = {}

    def ask() -> None:
        got["r"] = http.post(
            "/v1/chat/completions", json={"model": "doomed", "messages": [{"role": "user", "content": "q"}]}
        )

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 10
    while not any(
        json.loads(r.body or b"{}").get("messages") == [{"role": "user", "content": "q"}] for r in fake.requests
    ):
        assert time.monotonic() < deadline, "the model call never came"
        time.sleep(0.02)
    assert run_cli(sp.home, "agents", "delete", "doomed", env=env).code == 0
    t.join(20)
    r = got["r"]
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    after = http.post("/v1/chat/completions", json={"model": "doomed", "messages": [{"role": "user", "content": "q"}]})
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert (
        http.post(
            "/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "ok"}]}
        ).status_code
        == 200
    )


def test_refusals_name_parts_and_fields_as_the_clients_api_does(http: httpx.Client) -> None:
    """A Responses `input_image` is refused as `input_image` / `image_url` (a string there), not in
    Chat's words; a conversation id taken by another model reads as not found, nothing more."""
    no_url = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}],
        },
    )
    assert no_url.status_code == 400, no_url.text
    assert no_url.json()["error"]["param"] == "input[0].content[0].image_url", no_url.text
    assert "image_url.url" not in no_url.json()["error"]["message"], no_url.text
    assistant_image = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}],
                },
                {"role": "user", "content": "again"},
            ],
        },
    )
    assert assistant_image.status_code == 400, assistant_image.text
    assert "'input_image'" in assistant_image.json()["error"]["message"], assistant_image.text
    made = http.post(
        "/v1/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": "x"}]}
    )
    conv = made.headers["x-conversation-id"]
    other = http.post(
        "/v1/chat/completions",
        headers={"X-Conversation-Id": conv},
        json={"model": "remote", "messages": [{"role": "user", "content": "x"}]},
    )
    assert other.status_code == 404, other.text
    assert other.json()["error"]["message"] == f"Conversation with id {conv!r} not found for this model and credential."
