"""OpenAI-compatible HTTP surface (issue 3), driven by the official `openai` SDK against `appserver serve`.

Every body, chunk and event is validated against ../shared/conformance/openai-openapi.json.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("openai") / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0  # creates the home and `assistant`
    for args in (("--name", "twin"), ("--name", "twin"), ("--name", "asker", "--tool", "clock=ask")):
        r = run_cli(home, "agents", "create", *args, "--json", env=env)
        assert r.code == 0, r.err
    with serving(home, env=env) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(srv: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(srv: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def agents_json(srv: ServeProcess) -> list[dict]:
    r = run_cli(srv.home, "agents", "list", "--json", env=cli_env(srv.home))
    return json.loads(r.out)


def sse(http: httpx.Client, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, list[str]]:
    lines: list[str] = []
    with http.stream("POST", path, json=body, headers=headers or {}) as r:
        for line in r.iter_lines():
            lines.append(line)
    return r, lines


# ---------------------------------------------------------------- 1. models


def test_models_list_and_retrieve(client: openai.OpenAI, http: httpx.Client, srv: ServeProcess) -> None:
    ids = [m.id for m in client.models.list()]
    assert "assistant" in ids
    twins = [a["id"] for a in agents_json(srv) if a["name"] == "twin"]
    assert len(twins) == 2 and all(t in ids for t in twins) and "twin" not in ids
    for t in twins:
        assert client.models.retrieve(t).id == t
    assert client.models.retrieve("assistant").owned_by == "appserver"
    body = http.get("/v1/models").json()
    validate("ListModelsResponse", body)
    validate("Model", http.get("/v1/models/assistant").json())
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("twin")


# ---------------------------------------------------------------- 2 + 3. basic calls, schemas


def test_chat_non_stream_and_stream(client: openai.OpenAI, http: httpx.Client) -> None:
    c = client.chat.completions.create(
        model="assistant",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
    )
    assert c.choices[0].message.content == "echo: hello world"
    assert c.choices[0].finish_reason == "stop" and c.usage and c.usage.completion_tokens == 3
    r = http.post(
        "/v1/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": "raw body"}]}
    )
    assert r.status_code == 200 and r.headers["x-conversation-id"]
    validate("CreateChatCompletionResponse", r.json())

    chunks = list(
        client.chat.completions.create(
            model="assistant",
            messages=[{"role": "user", "content": "streamed words here"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "echo: streamed words here"
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage and chunks[-1].usage.total_tokens > 0

    resp, lines = sse(
        http,
        "/v1/chat/completions",
        {
            "model": "assistant",
            "messages": [{"role": "user", "content": "/slow 5"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    payloads = sse_payloads(lines)
    assert payloads[-1] == "[DONE]"
    for p in payloads[:-1]:
        validate("CreateChatCompletionStreamResponse", json.loads(p))
    assert (
        "".join((json.loads(p)["choices"] or [{"delta": {}}])[0]["delta"].get("content") or "" for p in payloads[:-1])
        == "w1 w2 w3 w4 w5"
    )


def test_chat_reasoning_content_and_params(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "assistant",
            "messages": [{"role": "user", "content": "/think deeply"}],
            "max_completion_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.9,
            "stop": ["zzz"],
        },
    )
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "done thinking" and msg["reasoning_content"] == "deeply"
    validate("CreateChatCompletionResponse", r.json())
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "assistant",
            "messages": [{"role": "user", "content": "one two three four five"}],
            "max_tokens": 2,
        },
    )
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post(
        "/v1/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": "x"}], "n": 2}
    )
    assert r.status_code == 400
    validate("ErrorResponse", r.json())
    img = {
        "role": "user",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    }
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": [img]})
    assert r.json()["choices"][0]["message"]["content"] == "echo: look"


def test_responses_create_stream_and_store(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(model="assistant", input="hi there", instructions="be nice")
    assert r.output_text == "echo: hi there" and r.status == "completed"
    with client.responses.stream(model="assistant", input="/slow 4") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == "w1 w2 w3 w4"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"

    resp, lines = sse(http, "/v1/responses", {"model": "assistant", "input": "/think hard", "stream": True})
    events = [json.loads(p) for p in sse_payloads(lines)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        validate("ResponseStreamEvent", e)
    assert events[-1]["type"] == "response.completed"

    raw = http.post("/v1/responses", json={"model": "assistant", "input": "stored one"})
    validate("Response", raw.json())
    rid = raw.json()["id"]
    got = http.get(f"/v1/responses/{rid}")
    assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == "echo: stored one"
    validate("Response", got.json())
    validate("ResponseResource", got.json(), doc="openresponses-openapi.json")
    items = http.get(f"/v1/responses/{rid}/input_items")
    validate("ResponseItemList", items.json())
    assert items.json()["data"][0]["content"][0]["text"] == "stored one"
    assert client.responses.retrieve(rid).output_text == "echo: stored one"
    client.responses.delete(rid)
    gone = http.get(f"/v1/responses/{rid}")
    assert gone.status_code == 404
    validate("ErrorResponse", gone.json())
    unstored = http.post("/v1/responses", json={"model": "assistant", "input": "no store", "store": False}).json()
    assert http.get(f"/v1/responses/{unstored['id']}").status_code == 404


# ---------------------------------------------------------------- 4 + 5. conversation identity


def test_history_prefix_match(http: httpx.Client) -> None:
    u1 = {"role": "user", "content": f"first {time.time()}"}
    r1 = http.post("/v1/chat/completions", json={"model": "assistant", "messages": [u1]})
    a1 = r1.json()["choices"][0]["message"]
    r2 = http.post(
        "/v1/chat/completions",
        json={
            "model": "assistant",
            "messages": [u1, {"role": "assistant", "content": a1["content"]}, {"role": "user", "content": "/recall"}],
        },
    )
    assert r2.json()["choices"][0]["message"]["content"] == u1["content"]
    assert r1.headers["x-conversation-id"] == r2.headers["x-conversation-id"]
    changed = {"role": "user", "content": u1["content"] + " (edited)"}
    r3 = http.post(
        "/v1/chat/completions",
        json={
            "model": "assistant",
            "messages": [
                changed,
                {"role": "assistant", "content": a1["content"]},
                {"role": "user", "content": "/recall"},
            ],
        },
    )
    assert r3.headers["x-conversation-id"] != r1.headers["x-conversation-id"]
    assert r3.json()["choices"][0]["message"]["content"] == changed["content"]
    # a regenerate (resending the older point) forks, leaving the original untouched
    r4 = http.post(
        "/v1/chat/completions",
        json={
            "model": "assistant",
            "messages": [
                u1,
                {"role": "assistant", "content": a1["content"]},
                {"role": "user", "content": "/recall again"},
            ],
        },
    )
    assert r4.headers["x-conversation-id"] not in (r1.headers["x-conversation-id"], r3.headers["x-conversation-id"])


def test_header_and_previous_response(client: openai.OpenAI, http: httpx.Client) -> None:
    cid = f"pinned-{int(time.time() * 1000)}"
    h = {"X-Conversation-Id": cid}
    http.post(
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": "remember me"}]},
        headers=h,
    )
    r = http.post(
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": "/recall"}]},
        headers=h,
    )
    assert r.headers["x-conversation-id"] == cid and r.json()["choices"][0]["message"]["content"] == "remember me"

    r1 = client.responses.with_raw_response.create(model="assistant", input="alpha")
    p1 = r1.parse()
    p2 = client.responses.create(model="assistant", input="beta", previous_response_id=p1.id)
    p3 = client.responses.with_raw_response.create(model="assistant", input="/recall", previous_response_id=p2.id)
    assert p3.parse().output_text == "alpha | beta"
    assert p3.headers["x-conversation-id"] == r1.headers["x-conversation-id"]
    fork = client.responses.with_raw_response.create(model="assistant", input="/recall", previous_response_id=p1.id)
    assert fork.parse().output_text == "alpha"
    assert fork.headers["x-conversation-id"] != r1.headers["x-conversation-id"]
    again = client.responses.create(model="assistant", input="/recall", previous_response_id=p3.parse().id)
    assert again.output_text == "alpha | beta | /recall"  # the original conversation was not changed by the fork
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="assistant", input="x", previous_response_id="resp_nope")


# ---------------------------------------------------------------- 6. client tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_client_tool_chat(client: openai.OpenAI, http: httpx.Client) -> None:
    msgs: list[dict] = [{"role": "user", "content": '/call get_weather {"city":"Paris"}'}]
    raw = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs, "tools": [WEATHER]})
    validate("CreateChatCompletionResponse", raw.json())
    c = client.chat.completions.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    done = client.chat.completions.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    assert done.choices[0].message.content == "get_weather -> sunny, 21C"
    assert done.choices[0].finish_reason == "stop"

    # streamed: the call arrives as tool_calls deltas and ends the stream
    resp, lines = sse(
        http,
        "/v1/chat/completions",
        {
            "model": "assistant",
            "messages": [{"role": "user", "content": '/call get_weather {"city":"Rome"}'}],
            "tools": [WEATHER],
            "stream": True,
        },
    )
    chunks = [json.loads(p) for p in sse_payloads(lines)[:-1]]
    for ch in chunks:
        validate("CreateChatCompletionStreamResponse", ch)
    args = "".join(
        tc["function"].get("arguments", "") for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls") or []
    )
    assert json.loads(args) == {"city": "Rome"} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_client_tool_responses(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "weather",
        "parameters": WEATHER["function"]["parameters"],
    }
    r = client.responses.create(model="assistant", input='/call get_weather {"city":"Paris"}', tools=[tool])  # type: ignore[list-item]
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Paris"}
    r2 = client.responses.create(
        model="assistant",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "rainy"}],
        tools=[tool],
    )  # type: ignore[list-item]
    assert r2.output_text == "get_weather -> rainy"


# ---------------------------------------------------------------- 7. approvals on /v1/responses


def test_mcp_approval(client: openai.OpenAI, http: httpx.Client) -> None:
    raw = http.post("/v1/responses", json={"model": "asker", "input": "/call clock {}"})
    validate("Response", raw.json())
    req = [o for o in raw.json()["output"] if o["type"] == "mcp_approval_request"]
    assert req and req[0]["name"] == "clock" and not [o for o in raw.json()["output"] if o["type"] == "function_call"]
    ok = http.post(
        "/v1/responses",
        json={
            "model": "asker",
            "previous_response_id": raw.json()["id"],
            "input": [{"type": "mcp_approval_response", "approval_request_id": req[0]["id"], "approve": True}],
        },
    )
    validate("Response", ok.json())
    kinds = [o["type"] for o in ok.json()["output"]]
    assert "mcp_call" in kinds and "function_call" not in kinds
    text = "".join(c["text"] for o in ok.json()["output"] if o["type"] == "message" for c in o["content"])
    assert text.startswith("clock -> ")

    r = client.responses.create(model="asker", input="/call clock {}")
    rid = next(o.id for o in r.output if o.type == "mcp_approval_request")
    denied = client.responses.create(
        model="asker",
        previous_response_id=r.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": rid, "approve": False, "reason": "not now"}],
    )
    assert "denied" in denied.output_text and "not now" in denied.output_text

    # streamed: events validate and the SDK accepts their order
    with client.responses.stream(model="asker", input="/call clock {}") as s:
        list(s)
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["mcp_approval_request"]


# ---------------------------------------------------------------- 8. errors and idempotency


def test_idempotency_and_errors(http: httpx.Client) -> None:
    body = {"model": "assistant", "messages": [{"role": "user", "content": "once only"}]}
    h = {"Idempotency-Key": f"k-{time.time()}"}
    a = http.post("/v1/chat/completions", json=body, headers=h)
    b = http.post("/v1/chat/completions", json=body, headers=h)
    assert a.status_code == b.status_code == 200 and a.json()["id"] == b.json()["id"]
    assert a.headers["x-conversation-id"] == b.headers["x-conversation-id"]
    c = http.post("/v1/chat/completions", json={**body, "temperature": 0.5}, headers=h)
    assert c.status_code == 409
    validate("ErrorResponse", c.json())
    rh = {"Idempotency-Key": f"r-{time.time()}"}
    r1 = http.post("/v1/responses", json={"model": "assistant", "input": "idem"}, headers=rh)
    r2 = http.post("/v1/responses", json={"model": "assistant", "input": "idem"}, headers=rh)
    assert r1.json()["id"] == r2.json()["id"]
    assert http.post("/v1/responses", json={"model": "assistant", "input": "other"}, headers=rh).status_code == 409

    cases = [
        (
            http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (
            http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
            400,
            None,
        ),
        (http.get("/v1/chat/completions"), 405, None),
        (http.put("/v1/responses", json={}), 405, None),
        (http.post("/v1/responses", json={"input": "no model"}), 400, None),
        (
            http.post(
                "/v1/chat/completions", content=b"x" * (21 * 1024 * 1024), headers={"content-type": "application/json"}
            ),
            413,
            None,
        ),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, (resp.status_code, resp.text[:200])
        validate("ErrorResponse", resp.json())
        if code:
            assert resp.json()["error"]["code"] == code


def test_metrics(http: httpx.Client) -> None:
    http.post(
        "/v1/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": "count me"}]}
    )
    text = http.get("/metrics").text
    assert 'appserver_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert 'appserver_turns_total{outcome="completed"}' in text
    for name in ("appserver_turn_latency_seconds_bucket", "appserver_queue_depth", "appserver_active_streams"):
        assert name in text


# ---------------------------------------------------------------- 9. disconnect cancels


def test_disconnect_cancels_turn(srv: ServeProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "/slow 300"}], "stream": True},
        ) as r:
            conv = r.headers["x-conversation-id"]
            seen = ""
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if "w4" in seen:
                    break
    db = sqlite3.connect(f"file:{Path(srv.home) / 'appserver.db'}?mode=ro", uri=True)
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline:
        row = db.execute("SELECT status FROM turns WHERE conversation_id=?", (conv,)).fetchone()
        status = row[0] if row else None
        if status == "cancelled":
            break
        time.sleep(0.05)
    assert status == "cancelled"
    text, completion = db.execute(
        "SELECT content, completion_status FROM messages WHERE conversation_id=? AND role='assistant'", (conv,)
    ).fetchone()
    assert json.loads(text).startswith("w1 w2 w3 w4") and completion == "cancelled"
    assert "w300" not in json.loads(text)


# ---------------------------------------------------------------- keepalives while chat waits for an approval


def test_chat_waits_for_approval_with_keepalives(tmp_path: Path) -> None:
    require_conformance()
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__SSE_KEEPALIVE_S="0.2", APPSERVER_LIMITS__APPROVAL_TIMEOUT_S="1.2")
    assert run_cli(home, "agents", "create", "--name", "asker", "--tool", "clock=ask", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        with httpx.Client(base_url=sp.url, timeout=30) as c:
            resp, lines = sse(
                c,
                "/v1/chat/completions",
                {"model": "asker", "messages": [{"role": "user", "content": "/call clock {}"}], "stream": True},
            )
        assert any(line.startswith(": keepalive") for line in lines)
        payloads = sse_payloads(lines)
        text = "".join(
            (json.loads(p)["choices"] or [{"delta": {}}])[0]["delta"].get("content") or "" for p in payloads[:-1]
        )
        assert "timed out" in text and "not denied by a person" in text
        assert payloads[-1] == "[DONE]"
    finally:
        sp.stop()


def test_sse_survives_line_readers_that_split_at_unicode_line_breaks(http: httpx.Client) -> None:
    """U+0085/U+2028/U+2029 are legal raw in JSON but httpx `iter_lines` splits at them."""
    text = "one\u2028two\u2029three\x85four"
    for path, body in (
        (
            "/v1/chat/completions",
            {"model": "assistant", "messages": [{"role": "user", "content": text}], "stream": True},
        ),
        ("/v1/responses", {"model": "assistant", "input": text, "stream": True}),
    ):
        resp, lines = sse(http, path, body)
        payloads = [p for p in sse_payloads(lines) if p != "[DONE]"]
        events = [json.loads(p) for p in payloads]  # a cut line would not parse
        if path == "/v1/chat/completions":
            got = "".join((e["choices"] or [{"delta": {}}])[0]["delta"].get("content") or "" for e in events)
        else:
            got = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
        assert got == f"echo: {text}", path


def test_a_streamed_reply_is_replayed_whole_for_the_same_idempotency_key(http: httpx.Client) -> None:
    for path, body in (
        (
            "/v1/chat/completions",
            {"model": "assistant", "messages": [{"role": "user", "content": "stream once"}], "stream": True},
        ),
        ("/v1/responses", {"model": "assistant", "input": "stream once", "stream": True}),
    ):
        h = {"Idempotency-Key": f"s-{path}-{time.time()}"}
        first, lines = sse(http, path, body, h)
        again, replayed = sse(http, path, body, h)
        assert again.headers.get("idempotent-replayed") == "true", path
        assert [x for x in replayed if x] == [x for x in lines if x], path
