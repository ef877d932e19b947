"""OpenAI surface fidelity (issue 13): what real clients hit, through a real `appserver serve`
with the real `openai` SDK (and the OpenAI Agents SDK for server approvals).

Agents: `assistant` and `asker` (clock=ask) run on echo; `remote` and `looper` on a loopback fake
OpenAI upstream whose model `m` honours `tool_choice` (a forced call calls `clock`, else it answers
in text) and whose model `loop` calls `clock` whenever tools are offered; `nosys` opts into
`match_ignores_system`. Every body and event is validated against OpenAI's OpenAPI document.
"""

from __future__ import annotations

import json
import sqlite3
import time
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
    one_call_sse,
    openai_error,
    openai_sse,
    tool_delta,
    usage_chunk,
)
from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_R = {
    "type": "function",
    "name": "get_weather",
    "description": "weather",
    "parameters": WEATHER["function"]["parameters"],
}
PDF = "data:application/pdf;base64,JVBERi0xLjQK"


def upstream_model(req: RecordedRequest) -> Reply:
    """`m`: a forced tool_choice calls clock; a trailing tool result is summarised; else text.
    `loop`: calls clock on every step while tools are offered."""
    body = req.json
    last = body["messages"][-1]
    forced = body.get("tool_choice") not in (None, "auto", "none")
    calls = body["model"] == "loop" and body.get("tools")
    if (forced or calls) and not (body["model"] == "m" and last["role"] == "tool"):
        sse = openai_sse(
            [
                chunk(
                    role="assistant",
                    tool_calls=[tool_delta(0, id=f"call_{time.monotonic_ns()}", name="clock", arguments="{}")],
                ),
                chunk(finish_reason="tool_calls"),
                usage_chunk(5, 1),
            ]
        )
    else:
        text = f"after tool: {last['content'][:20]}" if last["role"] == "tool" else "fine"
        sse = openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop"), usage_chunk(5, 1)])
    return Reply(pieces=[sse])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home = tmp_path_factory.mktemp("fidelity") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home, APPSERVER_LIMITS__SSE_KEEPALIVE_S="0.2")
        assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant`
        for args in (
            ("--name", "asker", "--tool", "clock=ask"),
            ("--name", "remote", "--model", "fake:m"),
            ("--name", "looper", "--model", "fake:loop", "--param", "max_steps=3"),
            ("--name", "nosys", "--param", "match_ignores_system=true"),
        ):
            r = run_cli(home, "agents", "create", *args, "--json", env=env)
            assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def http(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv[0].url, timeout=30) as c:
        yield c


@pytest.fixture
def fake(srv: tuple[ServeProcess, FakeOpenAI]) -> FakeOpenAI:
    srv[1].requests.clear()
    srv[1]._replies.clear()
    return srv[1]


def db(srv: tuple[ServeProcess, FakeOpenAI]) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{Path(srv[0].home) / 'appserver.db'}?mode=ro", uri=True)


def count_conversations(srv: tuple[ServeProcess, FakeOpenAI]) -> int:
    with db(srv) as c:
        return int(c.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])


def agent_id(srv: tuple[ServeProcess, FakeOpenAI], name: str) -> str:
    r = run_cli(srv[0].home, "agents", "show", name, "--json", env=cli_env(srv[0].home))
    return str(r.json()["id"])


def text_of(response: Any) -> str:
    return "".join(c["text"] for o in response["output"] if o["type"] == "message" for c in o["content"])


# ---------------------------------------------------------------- 13.1 resending a finished tool round


def test_resending_a_finished_tool_round_forks_and_answers(client: openai.OpenAI, http: httpx.Client) -> None:
    msgs: list[dict] = [{"role": "user", "content": f'/call get_weather {{"city":"Oslo {time.time()}"}}'}]
    first = client.chat.completions.with_raw_response.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    call = first.parse().choices[0].message.tool_calls[0]  # type: ignore[index]
    msgs += [
        first.parse().choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    done = client.chat.completions.with_raw_response.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    assert done.parse().choices[0].message.content == "get_weather -> sunny"
    # the same body again (an SDK retry, a "regenerate"): that point was passed, so it forks
    again = client.chat.completions.with_raw_response.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    assert again.parse().choices[0].message.content == "get_weather -> sunny"
    assert again.headers["x-conversation-id"] not in (done.headers["x-conversation-id"],)
    assert done.headers["x-conversation-id"] == first.headers["x-conversation-id"]
    validate("CreateChatCompletionResponse", again.http_response.json())

    # Responses, stateless: an approval round resent whole after it was answered
    prompt = f'/call clock {{"timezone":"UTC","nonce":"{time.time()}"}}'
    ask = http.post("/v1/responses", json={"model": "asker", "input": prompt})
    req = next(o for o in ask.json()["output"] if o["type"] == "mcp_approval_request")
    body = {
        "model": "asker",
        "input": [
            {"role": "user", "content": prompt},
            req,
            {"type": "mcp_approval_response", "approval_request_id": req["id"], "approve": True},
        ],
    }
    ok = http.post("/v1/responses", json=body)
    assert ok.status_code == 200 and text_of(ok.json()).startswith("clock -> "), ok.text
    assert ok.headers["x-conversation-id"] == ask.headers["x-conversation-id"]  # the stateless resend continued it
    twice = http.post("/v1/responses", json=body)
    assert twice.status_code == 200, twice.text
    validate("Response", twice.json())
    assert text_of(twice.json()).startswith("clock -> ")
    assert twice.headers["x-conversation-id"] != ok.headers["x-conversation-id"]


# ---------------------------------------------------------------- 13.2 tool calls this server never issued


def test_a_history_with_foreign_tool_calls_is_seeded_and_answered(
    client: openai.OpenAI, http: httpx.Client, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    stamp = time.time()
    msgs = [
        {"role": "user", "content": f"weather in Rome? {stamp}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_imported1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_imported1", "content": "hot"},
    ]
    c = client.chat.completions.with_raw_response.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[arg-type]
    assert c.parse().choices[0].message.content == "get_weather -> hot"
    assert c.parse().choices[0].finish_reason == "stop"
    conv = c.headers["x-conversation-id"]
    with db(srv) as d:
        roles = [r[0] for r in d.execute("SELECT role FROM messages WHERE conversation_id=? ORDER BY id", (conv,))]
    assert roles == ["user", "assistant", "tool", "assistant"]
    # the identical request again is answered too (a fork of that point), not refused
    again = client.chat.completions.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[arg-type]
    assert again.choices[0].message.content == "get_weather -> hot"

    # a refused request writes nothing: results for a call the history does not make
    before = count_conversations(srv)
    bad = [*msgs[:2], {"role": "tool", "tool_call_id": "call_other", "content": "x"}]
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": bad})
    assert (
        r.status_code == 400
        and r.json()["error"]["code"] == "unknown_tool_call"
        and "call_other" in r.json()["error"]["message"]
    )
    validate("ErrorResponse", r.json())
    r = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert count_conversations(srv) == before

    # Responses with a function_call item from elsewhere
    resp = client.responses.create(
        model="assistant",
        tools=[WEATHER_R],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": f"imported {stamp}"},
            {"type": "function_call", "call_id": "fc_imported", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "fc_imported", "output": "cold"},
        ],
    )
    assert resp.output_text == "get_weather -> cold"


# ---------------------------------------------------------------- 13.3 tool_choice, max_steps


def test_tool_choice_applies_to_the_first_model_call_only(client: openai.OpenAI, fake: FakeOpenAI) -> None:
    c = client.chat.completions.create(
        model="remote", messages=[{"role": "user", "content": "what time is it?"}], tool_choice="required"
    )
    assert c.choices[0].finish_reason == "stop" and c.choices[0].message.content.startswith("after tool:")  # type: ignore[union-attr]
    sent = [r.json for r in fake.requests]
    assert len(sent) == 2, sent
    assert sent[0]["tool_choice"] == "required" and "tool_choice" not in sent[1]
    fake.requests.clear()
    r = client.responses.create(
        model="remote", input="what time is it?", tool_choice={"type": "function", "name": "clock"}
    )
    assert r.status == "completed" and r.output_text.startswith("after tool:")
    sent = [r.json for r in fake.requests]
    assert (
        sent[0]["tool_choice"] == {"type": "function", "function": {"name": "clock"}} and "tool_choice" not in sent[1]
    )


def test_a_turn_stopped_by_max_steps_says_so(client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI) -> None:
    c = client.chat.completions.create(model="looper", messages=[{"role": "user", "content": "loop"}])
    assert c.choices[0].finish_reason == "length"
    assert "max_steps" in (c.choices[0].message.content or "") and "3 steps" in (c.choices[0].message.content or "")
    assert len(fake.requests) == 3
    chunks = list(
        client.chat.completions.create(
            model="looper", messages=[{"role": "user", "content": "loop again"}], stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "max_steps" in "".join(ch.choices[0].delta.content or "" for ch in chunks)
    raw = http.post("/v1/responses", json={"model": "looper", "input": "loop"})
    body = raw.json()
    validate("Response", body)
    assert body["status"] == "incomplete" and body["incomplete_details"]["reason"] == "max_output_tokens"
    assert "max_steps" in text_of(body) and [o["type"] for o in body["output"]].count("mcp_call") == 3
    with client.responses.stream(model="looper", input="loop") as s:
        kinds = [e.type for e in s]
    assert kinds[-1] == "response.incomplete"


# ---------------------------------------------------------------- 13.4 new input while calls are pending


def test_new_input_while_a_call_is_pending_is_answered_at_once(client: openai.OpenAI, http: httpx.Client) -> None:
    msgs: list[dict] = [{"role": "user", "content": f'/call get_weather {{"city":"Lima {time.time()}"}}'}]
    first = client.chat.completions.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "never mind"}]
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="assistant", messages=msgs, tools=[WEATHER])  # type: ignore[list-item]
    assert time.monotonic() - t0 < 5 and call.id in info.value.message and "tool_call_id" in info.value.message

    r = client.responses.create(model="asker", input="/call clock {}")
    rid = next(o.id for o in r.output if o.type == "mcp_approval_request")
    t0 = time.monotonic()
    with pytest.raises(openai.ConflictError) as conflict:
        client.responses.create(model="asker", previous_response_id=r.id, input="something else")
    assert time.monotonic() - t0 < 5 and rid in conflict.value.message
    validate("ErrorResponse", conflict.value.response.json())
    # the pending call is still answerable
    ok = client.responses.create(
        model="asker",
        previous_response_id=r.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": rid, "approve": False}],
    )
    assert "denied" in ok.output_text


def test_a_queued_http_input_whose_client_left_is_dropped(
    srv: tuple[ServeProcess, FakeOpenAI], http: httpx.Client
) -> None:
    conv = f"queue-{time.time_ns()}"
    h = {"X-Conversation-Id": conv}
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": "/slow 30"}], "stream": True},
        headers=h,
    ) as running:
        lines = running.iter_lines()
        next(lines)  # the turn runs
        with httpx.Client(base_url=srv[0].url, timeout=0.4) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post(
                "/v1/chat/completions",
                json={"model": "assistant", "messages": [{"role": "user", "content": "queued and abandoned"}]},
                headers=h,
            )
        rest = list(lines)
    assert "data: [DONE]" in rest
    deadline = time.monotonic() + 5
    statuses: list[str] = []
    while time.monotonic() < deadline:
        with db(srv) as d:
            statuses = [
                r[0] for r in d.execute("SELECT status FROM turns WHERE conversation_id=? ORDER BY rowid", (conv,))
            ]
        if statuses == ["completed", "cancelled"]:
            break
        time.sleep(0.05)
    assert statuses == ["completed", "cancelled"]
    time.sleep(0.3)  # had it been queued still, it would run right after the first turn
    with db(srv) as d:
        texts = [
            r[0] for r in d.execute("SELECT content FROM messages WHERE conversation_id=? AND role='user'", (conv,))
        ]
    assert texts == [json.dumps("/slow 30")]


# ---------------------------------------------------------------- 13.5 upstream failure, 13.8 upstream 400


def test_upstream_failure_on_non_stream_responses_is_an_http_error(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    fake.fail(503, openai_error("overloaded", type="server_error"))
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(model="remote", input="hi")
    assert info.value.status_code == 502 and info.value.body["code"] == "upstream_server_error"  # type: ignore[index]
    validate("ErrorResponse", info.value.response.json())
    fake.fail(503, openai_error("overloaded", type="server_error"))
    with http.stream("POST", "/v1/responses", json={"model": "remote", "input": "hi", "stream": True}) as r:
        events = [json.loads(p) for p in sse_payloads(list(r.iter_lines()))]
    assert r.status_code == 200 and events[-1]["type"] == "response.failed"
    # an upstream 400 is the request's fault: relayed as a 400 on both routes
    fake.fail(400, openai_error("Invalid value for 'logit_bias'", code="invalid_value"))
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["code"] == "upstream_invalid_request"  # type: ignore[index]
    fake.fail(400, openai_error("Invalid value", code="invalid_value"))
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="remote", input="hi")


# ---------------------------------------------------------------- 13.6 the Agents SDK answers a server approval


def test_the_agents_sdk_completes_a_server_approval(srv: tuple[ServeProcess, FakeOpenAI]) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    label = agent_id(srv, "asker")
    seen: list[str] = []

    def on_approval(request: Any) -> dict[str, Any]:
        seen.append(request.data.name)
        return {"approve": True}

    model = agents.OpenAIResponsesModel(
        model="asker", openai_client=openai.AsyncOpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0)
    )
    tool = agents.HostedMCPTool(
        tool_config={
            "type": "mcp",
            "server_label": label,
            "server_url": "http://unused.invalid",
            "require_approval": "always",
        },
        on_approval_request=on_approval,
    )
    agent = agents.Agent(name="tester", model=model, tools=[tool])
    result = agents.Runner.run_sync(agent, "/call clock {}", max_turns=4)
    assert seen == ["clock"]
    assert str(result.final_output).startswith("clock -> ")
    kinds = [item.type for item in result.new_items]
    assert "mcp_approval_request_item" in kinds and "mcp_approval_response_item" in kinds
    # a tool naming another MCP server is still refused, by name
    other = agents.HostedMCPTool(
        tool_config={
            "type": "mcp",
            "server_label": "elsewhere",
            "server_url": "http://unused.invalid",
            "require_approval": "always",
        }
    )
    with pytest.raises(openai.BadRequestError) as info:
        agents.Runner.run_sync(agents.Agent(name="t2", model=model, tools=[other]), "hi", max_turns=2)
    assert "elsewhere" in info.value.message


# ---------------------------------------------------------------- 13.7 event lines


def test_responses_streams_carry_event_lines_and_chat_streams_do_not(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/responses", json={"model": "assistant", "input": "two words", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    assert pairs and all(e.startswith("event: ") and d.startswith("data: ") for e, d in pairs), lines[:6]
    for e, d in pairs:
        event = json.loads(d[len("data: ") :])
        assert e == f"event: {event['type']}"
        validate("ResponseStreamEvent", event)
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": "x"}], "stream": True},
    ) as r:
        assert not [line for line in r.iter_lines() if line.startswith("event:")]


# ---------------------------------------------------------------- 13.8 parameters are range-checked


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"temperature": 5}, "temperature"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"max_tokens": 10**12}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/responses", {"temperature": -1}, "temperature"),
        ("/v1/responses", {"max_output_tokens": 10**12}, "max_output_tokens"),
        ("/v1/responses", {"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        # OpenAI's metadata limits: 16 pairs, keys of 64 characters, values of 512
        ("/v1/chat/completions", {"store": True, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ("/v1/responses", {"metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/responses", {"metadata": {"k": "v" * 513}}, "metadata.k"),
    ],
)
def test_parameters_are_range_checked(http: httpx.Client, fake: FakeOpenAI, path: str, extra: dict, param: str) -> None:
    body = {
        "model": "remote",
        **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"input": "hi"}),
        **extra,
    }
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    assert fake.requests == []  # refused before any upstream call


def test_input_items_limit_is_range_checked(client: openai.OpenAI, http: httpx.Client) -> None:
    rid = client.responses.create(model="assistant", input="list me").id
    for limit in (0, 1000):
        r = http.get(f"/v1/responses/{rid}/input_items", params={"limit": limit})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    assert len(client.responses.input_items.list(rid, limit=1).data) == 1


# ---------------------------------------------------------------- 13.9 file and audio parts


def test_file_and_audio_parts_are_forwarded_or_refused_by_name(
    client: openai.OpenAI, fake: FakeOpenAI, http: httpx.Client
) -> None:
    file_part = {"type": "file", "file": {"filename": "a.pdf", "file_data": PDF}}
    audio_part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    c = client.chat.completions.create(
        model="remote",
        messages=[{"role": "user", "content": [{"type": "text", "text": "read"}, file_part, audio_part]}],
    )  # type: ignore[list-item]
    assert c.choices[0].message.content == "fine"
    content = fake.requests[-1].json["messages"][-1]["content"]
    assert file_part in content and audio_part in content
    r = client.responses.create(
        model="remote",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "read"},
                    {"type": "input_file", "filename": "b.pdf", "file_data": PDF},
                ],
            }
        ],
    )
    assert r.output_text == "fine"
    assert {"type": "file", "file": {"filename": "b.pdf", "file_data": PDF}} in fake.requests[-1].json["messages"][-1][
        "content"
    ]
    # echo takes text and images only: refused, naming the part, never dropped
    for part in (file_part, audio_part):
        resp = http.post(
            "/v1/chat/completions",
            json={
                "model": "assistant",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}],
            },
        )
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_content_part"
        assert f"'{part['type']}'" in resp.json()["error"]["message"]
    resp = http.post(
        "/v1/responses",
        json={"model": "assistant", "input": [{"role": "user", "content": [{"type": "input_file", "file_data": PDF}]}]},
    )
    assert resp.status_code == 400 and "'file'" in resp.json()["error"]["message"]


# ---------------------------------------------------------------- 13.10 item_reference


def test_item_references_resolve_to_stored_items_or_are_refused(client: openai.OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(model="assistant", input=f"alpha {time.time()}")
    items = client.responses.input_items.list(first.id).data
    refs = [{"type": "item_reference", "id": items[0].id}, {"type": "item_reference", "id": first.output[0].id}]
    again = client.responses.with_raw_response.create(
        model="assistant", input=[*refs, {"role": "user", "content": "/recall"}]
    )  # type: ignore[list-item]
    assert again.parse().output_text.startswith("alpha ")  # the referenced history was read: same conversation
    r = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [{"type": "item_reference", "id": "msg_nothing"}, {"role": "user", "content": "x"}],
        },
    )
    assert r.status_code == 400 and "msg_nothing" in r.json()["error"]["message"]
    validate("ErrorResponse", r.json())
    r = http.post("/v1/responses", json={"model": "asker", "input": [refs[1], {"role": "user", "content": "x"}]})
    assert r.status_code == 400  # another agent's items are not found


# ---------------------------------------------------------------- 13.12 idempotency keys


def test_idempotency_keys_hash_canonical_json_and_span_both_routes(http: httpx.Client) -> None:
    key = {"Idempotency-Key": f"canon-{time.time_ns()}", "content-type": "application/json"}
    a = http.post(
        "/v1/chat/completions",
        content=b'{"model": "assistant", "messages": [{"role": "user", "content": "canon"}]}',
        headers=key,
    )
    b = http.post(
        "/v1/chat/completions",
        content=b'{"messages":[{"content":"canon","role":"user"}],"model":"assistant"}',
        headers=key,
    )
    assert a.status_code == b.status_code == 200 and b.headers.get("idempotent-replayed") == "true"
    assert a.json()["id"] == b.json()["id"]
    c = http.post("/v1/responses", json={"model": "assistant", "input": "canon"}, headers=key)
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_key_reused"


# ---------------------------------------------------------------- 13.13 messages


def test_error_messages_say_what_is_wrong(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": 5, "messages": [{"role": "user", "content": "x"}]})
    assert (
        r.status_code == 400
        and "must be a string" in r.json()["error"]["message"]
        and "required" not in r.json()["error"]["message"]
    )
    r = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": [
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
                {"role": "user", "content": "x"},
            ],
        },
    )
    assert r.status_code == 400 and "'web_search_call'" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "unsupported_item_type"
    r = http.get("/v1/models/")
    assert r.status_code == 404 and "required" not in r.json()["error"]["message"]
    for resp in (r,):
        validate("ErrorResponse", resp.json())


# ---------------------------------------------------------------- 13.15 match_ignores_system


def test_match_ignores_system_keeps_one_conversation_when_the_system_prompt_changes(http: httpx.Client) -> None:
    def chat(model: str, stamp: int, history: list[dict]) -> httpx.Response:
        return http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "system", "content": f"now is {stamp}"}, *history]},
        )

    for model, same in (("nosys", True), ("assistant", False)):
        u1 = {"role": "user", "content": f"hello {model} {time.time()}"}
        r1 = chat(model, 1, [u1])
        a1 = {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]}
        r2 = chat(model, 2, [u1, a1, {"role": "user", "content": "/recall"}])
        assert (r1.headers["x-conversation-id"] == r2.headers["x-conversation-id"]) is same, model
        assert r2.json()["choices"][0]["message"]["content"] == u1["content"]


# ---------------------------------------------------------------- 13.14 docs/openai.md


def test_openai_doc_lists_routes_items_parts_and_store_false(
    client: openai.OpenAI, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    from appserver.http.chat import MEDIA_PARTS
    from appserver.http.responses import SUPPORTED_ITEMS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "openai.md").read_text()
    for route in (
        "GET /v1/models",
        "GET /v1/models/{id}",
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "GET /v1/responses/{id}",
        "DELETE /v1/responses/{id}",
        "GET /v1/responses/{id}/input_items",
    ):
        assert f"`{route}`" in doc, route
    for name in (
        *SUPPORTED_ITEMS,
        *MEDIA_PARTS,
        "match_ignores_system",
        "Idempotency-Key",
        "X-Conversation-Id",
        "tool_choice",
        "max_steps",
    ):
        assert name in doc, name
    assert "## `store: false`" in doc and "## Conversation identity" in doc
    # what the doc says store:false means: no stored response, the conversation still kept
    raw = client.responses.with_raw_response.create(model="assistant", input=f"unstored {time.time()}", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(raw.parse().id)
    with db(srv) as d:
        assert (
            d.execute(
                "SELECT COUNT(*) FROM messages WHERE conversation_id=?", (raw.headers["x-conversation-id"],)
            ).fetchone()[0]
            == 2
        )


# ---------------------------------------------------------------- every input item reaches the model


def test_system_and_developer_input_messages_instruct_the_model(http: httpx.Client, fake: FakeOpenAI) -> None:
    """A Responses `input` with developer/system messages (LangChain sends a system prompt so):
    their text reaches the model as system text after `instructions`, as chat's system messages do."""
    body = {
        "model": "remote",
        "instructions": "BE BRIEF",
        "input": [{"role": "developer", "content": "RULE ONE"}, {"role": "user", "content": "hi"}],
    }
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    validate("Response", r.json())
    sent = fake.requests[-1].json["messages"]
    assert [m["content"] for m in sent if m["role"] == "system"] == ["BE BRIEF", "RULE ONE"], sent
    assert sent[-1] == {"role": "user", "content": "hi"}


def test_messages_before_the_new_input_follow_a_previous_response(http: httpx.Client, fake: FakeOpenAI) -> None:
    """previous_response_id with [user, assistant, user]: all three are new items (OpenAI's rule),
    placed after the previous response's context, listed by input_items, and kept for the next
    response of the chain. With `conversation` the same input is refused, never half-used."""
    first = http.post("/v1/responses", json={"model": "remote", "input": "base"}).json()
    added = [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    r = http.post("/v1/responses", json={"model": "remote", "previous_response_id": first["id"], "input": added})
    assert r.status_code == 200, r.text
    seen = [(m["role"], m["content"]) for m in fake.requests[-1].json["messages"]]
    assert seen == [("user", "base"), ("assistant", "fine"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")]
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()
    validate("ResponseItemList", items)
    assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [
        ("user", "U1"),
        ("assistant", "A1"),
        ("user", "U2"),
    ]
    nxt = http.post("/v1/responses", json={"model": "remote", "previous_response_id": r.json()["id"], "input": "U3"})
    assert nxt.status_code == 200, nxt.text
    seen = [m["content"] for m in fake.requests[-1].json["messages"]]
    assert seen == ["base", "fine", "U1", "A1", "U2", "fine", "U3"], seen

    conv = nxt.headers["x-conversation-id"]
    calls = len(fake.requests)
    refused = http.post("/v1/responses", json={"model": "remote", "conversation": conv, "input": added})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_input", refused.text
    validate("ErrorResponse", refused.json())
    assert len(fake.requests) == calls  # nothing ran
    again = http.post(
        "/v1/responses", json={"model": "remote", "previous_response_id": nxt.json()["id"], "input": "U4"}
    )
    assert again.status_code == 200, again.text  # the refused request left the chain as it was
    assert [m["content"] for m in fake.requests[-1].json["messages"]][-3:] == ["U3", "fine", "U4"]


def test_a_function_call_cut_off_by_the_token_limit_is_incomplete(http: httpx.Client, fake: FakeOpenAI) -> None:
    """The model ran out of tokens in the middle of a call's arguments: the response is incomplete,
    and so is its function_call item (it cannot be answered), never `completed`."""
    fake.script(one_call_sse("call_cut", "get_weather", '{"a":', finish="length"))
    r = http.post("/v1/responses", json={"model": "remote", "input": "weather?", "tools": [WEATHER_R]})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("Response", body)
    assert body["status"] == "incomplete", body
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert calls and all(c["status"] == "incomplete" for c in calls), body["output"]


def test_retrieving_a_response_as_a_stream_is_refused_in_words(client: openai.OpenAI, http: httpx.Client) -> None:
    """`responses.retrieve(id, stream=True)` follows a background response; there are none here, so
    it is a 400 saying so, never an empty event stream that looks like success."""
    rid = client.responses.create(model="assistant", input="kept").id
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(rid, stream=True)
    assert refused.value.body["code"] == "unsupported_parameter" and refused.value.body["param"] == "stream"  # type: ignore[index]
    validate("ErrorResponse", refused.value.response.json())
    assert http.get(f"/v1/responses/{rid}", params={"stream": "maybe"}).status_code == 400
    assert client.responses.retrieve(rid).output_text == "echo: kept"


def test_a_reply_stopped_by_the_content_filter_says_so(client: openai.OpenAI, fake: FakeOpenAI) -> None:
    """An upstream `finish_reason: content_filter` is not a normal stop: chat says content_filter
    (stream and not), Responses is incomplete with reason content_filter."""

    def filtered() -> None:
        fake.script(openai_sse([chunk(role="assistant", content="partial"), chunk(finish_reason="content_filter")]))

    filtered()
    raw = client.chat.completions.with_raw_response.create(model="remote", messages=[{"role": "user", "content": "x"}])
    validate("CreateChatCompletionResponse", raw.http_response.json())
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "content_filter" and reply.choices[0].message.content == "partial"
    filtered()
    chunks = list(
        client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "y"}], stream=True)
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "content_filter"
    ]
    filtered()
    raw_r = client.responses.with_raw_response.create(model="remote", input="z")
    validate("Response", raw_r.http_response.json())
    response = raw_r.parse()
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "content_filter" and response.output_text == "partial"


def test_calls_cut_off_by_the_content_filter_are_not_run(http: httpx.Client, fake: FakeOpenAI) -> None:
    """The filter stopped the reply while it streamed a call: its arguments may be cut, so the call
    is not run (as with the token limit), and the response says content_filter."""
    fake.script(one_call_sse("call_cf", "clock", "{", finish="content_filter"))
    r = http.post("/v1/responses", json={"model": "remote", "input": "time?"})
    assert r.status_code == 200, r.text
    validate("Response", r.json())
    assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": "content_filter"}
    assert len(fake.requests) == 1  # no second model call: the clock never ran
    calls = [o for o in r.json()["output"] if o["type"] == "mcp_call"]
    assert calls and all(c["status"] == "failed" for c in calls), r.json()
    assert "content filter" in calls[0]["error"]["content"][0]["text"], calls


def _refuses(fake: FakeOpenAI) -> None:
    """The upstream declines as OpenAI's models do: `refusal` deltas, `content` null."""
    first = chunk(role="assistant")
    first["choices"][0]["delta"].update({"content": None, "refusal": ""})
    parts = [chunk(), chunk()]
    parts[0]["choices"][0]["delta"] = {"refusal": "I can't "}
    parts[1]["choices"][0]["delta"] = {"refusal": "help with that."}
    fake.script(openai_sse([first, *parts, chunk(finish_reason="stop"), usage_chunk(5, 4)]))


def test_a_refusal_reaches_the_client_as_a_refusal(client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI) -> None:
    """The model's refusal is neither dropped (an empty answer) nor passed off as an answer: chat
    has it in `refusal` (and `.parse()` gives no parsed value), streams send `refusal` deltas, and
    Responses has a `refusal` content part with refusal events, all as OpenAI's schema has them."""
    _refuses(fake)
    raw = client.chat.completions.with_raw_response.create(model="remote", messages=[{"role": "user", "content": "x"}])
    validate("CreateChatCompletionResponse", raw.http_response.json())
    message = raw.parse().choices[0].message
    assert message.refusal == "I can't help with that." and message.content is None

    _refuses(fake)
    chunks = list(
        client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "y"}], stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.refusal or "" for d in deltas) == "I can't help with that."
    assert "".join(d.content or "" for d in deltas) == ""

    _refuses(fake)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    parsed = client.chat.completions.parse(
        model="remote",
        messages=[{"role": "user", "content": "z"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
    )
    assert parsed.choices[0].message.refusal == "I can't help with that."

    _refuses(fake)
    body = http.post("/v1/responses", json={"model": "remote", "input": "w"}).json()
    validate("Response", body)
    assert body["output"][0]["content"] == [{"type": "refusal", "refusal": "I can't help with that."}], body

    _refuses(fake)
    r = http.post("/v1/responses", json={"model": "remote", "input": "v", "stream": True})
    events = [json.loads(p) for p in sse_payloads(sse_lines(r.content)) if p != "[DONE]"]
    for e in events:
        validate("ResponseStreamEvent", e)
    kinds = [e["type"] for e in events]
    assert "response.refusal.delta" in kinds and "response.output_text.delta" not in kinds, kinds
    done = next(e for e in events if e["type"] == "response.refusal.done")
    assert done["refusal"] == "I can't help with that."


def test_added_messages_keep_the_rules_of_new_input(http: httpx.Client, fake: FakeOpenAI) -> None:
    """Messages added with previous_response_id: not while the response waits for a call's answer
    (409 calls_pending, as for any new input; the model got an unanswered call), a function_call
    among them is listed by input_items, and a file part the model cannot take is refused even
    in history (it was dropped)."""
    fake.script(one_call_sse("call_w1", "get_weather", "{}"))
    waiting = http.post("/v1/responses", json={"model": "remote", "input": "weather?", "tools": [WEATHER_R]}).json()
    assert [o["type"] for o in waiting["output"]] == ["function_call"], waiting
    added = [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    calls = len(fake.requests)
    r = http.post("/v1/responses", json={"model": "remote", "previous_response_id": waiting["id"], "input": added})
    assert r.status_code == 409 and r.json()["error"]["code"] == "calls_pending", r.text
    assert "call_w1" in r.json()["error"]["message"] and len(fake.requests) == calls

    first = http.post("/v1/responses", json={"model": "remote", "input": "base"}).json()
    history = [
        {"role": "user", "content": "U1"},
        {"type": "function_call", "call_id": "call_h1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_h1", "output": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "U2"},
    ]
    r = http.post(
        "/v1/responses",
        json={"model": "remote", "previous_response_id": first["id"], "input": history, "tools": [WEATHER_R]},
    )
    assert r.status_code == 200, r.text
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()
    validate("ResponseItemList", items)
    assert [i["type"] for i in items["data"]] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ], items

    pdf = {"role": "user", "content": [{"type": "input_file", "filename": "a.pdf", "file_data": PDF}]}
    echo_first = http.post("/v1/responses", json={"model": "assistant", "input": "base"}).json()
    with_file = [pdf, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    r = http.post(
        "/v1/responses", json={"model": "assistant", "previous_response_id": echo_first["id"], "input": with_file}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_part", r.text
    chat_file = [{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF}}]}, *with_file[1:]]
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": chat_file})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_part", r.text


def test_a_previous_response_chain_leaves_no_point_a_shorter_history_could_match(
    http: httpx.Client, fake: FakeOpenAI
) -> None:
    """A conversation continued with previous_response_id holds context its requests did not send:
    a stateless request carrying only the last exchange must not continue it (and see that context)."""
    secret = http.post("/v1/responses", json={"model": "remote", "input": "SECRET-CONTEXT"}).json()
    later = http.post("/v1/responses", json={"model": "remote", "previous_response_id": secret["id"], "input": "hello"})
    assert later.status_code == 200, later.text
    stranger = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "next"},
            ],
        },
    )
    assert stranger.status_code == 200, stranger.text
    assert stranger.headers["x-conversation-id"] != later.headers["x-conversation-id"]
    assert "SECRET-CONTEXT" not in json.dumps(fake.requests[-1].json["messages"])


def test_an_answer_then_a_refusal_stay_apart_once_stored(
    srv: tuple[ServeProcess, FakeOpenAI], client: openai.OpenAI, fake: FakeOpenAI
) -> None:
    """Text, then a refusal, in one reply: the chat message has both fields, and the stored message
    says which part is the refusal, so its history (and a snapshot rebuilt from it) keeps them apart."""
    import asyncio

    from tests.support.ws import WS

    first = chunk(role="assistant", content="Sure. ")
    tail = chunk()
    tail["choices"][0]["delta"] = {"refusal": "I can't do the rest."}
    fake.script(openai_sse([first, tail, chunk(finish_reason="stop")]))
    raw = client.chat.completions.with_raw_response.create(model="remote", messages=[{"role": "user", "content": "x"}])
    message = raw.parse().choices[0].message
    assert (message.content, message.refusal) == ("Sure. ", "I can't do the rest."), message
    conv = raw.headers["x-conversation-id"]

    async def history() -> list[dict[str, Any]]:
        ws = await WS.open(srv[0].url)
        try:
            reply = await ws.request({"type": "get_history", "conversation": conv}, 10)
            return list(reply["messages"])
        finally:
            await ws.close()

    stored = asyncio.run(history())[-1]
    assert stored["content"] == "Sure. I can't do the rest." and stored["refusal"] == "I can't do the rest.", stored


def test_the_deprecated_functions_shape_is_served_not_ignored(client: openai.OpenAI, fake: FakeOpenAI) -> None:
    """`functions` / `function_call` (deprecated, still OpenAI's): the functions reach the model as
    tools, a call comes back as `message.function_call` with finish_reason `function_call`, and a
    `function` message answers it by name (the legacy shape has no call id). They were ignored."""
    fn = {"name": "get_weather", "description": "weather", "parameters": WEATHER["function"]["parameters"]}

    def calls_weather(call_id: str) -> None:
        fake.script(one_call_sse(call_id, "get_weather", '{"city": "Paris"}'))

    calls_weather("call_up1")
    ask = [{"role": "user", "content": "weather in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(
        model="remote", messages=ask, functions=[fn], function_call="auto"
    )  # type: ignore[call-overload]
    validate("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls, choice
    assert choice.message.function_call is not None and choice.message.function_call.name == "get_weather"
    sent = fake.requests[-1].json
    assert "get_weather" in [t["function"]["name"] for t in sent["tools"]] and sent["parallel_tool_calls"] is False
    answered = ask + [
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    reply = client.chat.completions.create(model="remote", messages=answered, functions=[fn])  # type: ignore[call-overload]
    assert reply.choices[0].message.content == "after tool: sunny", reply
    assert fake.requests[-1].json["messages"][-1] == {"role": "tool", "tool_call_id": "call_up1", "content": "sunny"}

    calls_weather("call_up2")
    chunks = list(
        client.chat.completions.create(
            model="remote", messages=[{"role": "user", "content": "and Rome?"}], functions=[fn], stream=True
        )  # type: ignore[call-overload]
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.tool_calls for d in deltas)
    assert [d.function_call.name for d in deltas if d.function_call and d.function_call.name] == ["get_weather"]
    assert "".join(d.function_call.arguments or "" for d in deltas if d.function_call) == '{"city": "Paris"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["function_call"]


def test_functions_and_tools_together_are_refused(http: httpx.Client) -> None:
    fn = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    for extra, param in (
        ({"functions": [fn], "tools": [WEATHER]}, "functions"),
        ({"functions": [fn], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
        ({"functions": [fn], "function_call": {"nom": "f"}}, "function_call.name"),
        ({"functions": "f"}, "functions"),
    ):
        r = http.post(
            "/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "x"}], **extra}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        validate("ErrorResponse", r.json())


# ---------------------------------------------------------------- session 21


def weather_sent(fake: FakeOpenAI) -> dict[str, Any]:
    """The client tool `get_weather` as the last model call was offered it."""
    [tool] = [t["function"] for t in fake.requests[-1].json["tools"] if t["function"]["name"] == "get_weather"]
    return dict(tool)


def test_a_function_tools_strict_reaches_the_model(http: httpx.Client, fake: FakeOpenAI) -> None:
    """`strict` on a client function tool goes to the model as sent (the OpenAI Agents SDK marks
    every tool strict); it was checked, echoed and dropped."""
    strict_chat = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    r = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [{"role": "user", "content": "s"}], "tools": [strict_chat]},
    )
    assert r.status_code == 200, r.text
    assert weather_sent(fake)["strict"] is True, fake.requests[-1].json["tools"]
    r = http.post("/v1/responses", json={"model": "remote", "input": "s", "tools": [{**WEATHER_R, "strict": False}]})
    assert r.status_code == 200 and r.json()["tools"][0]["strict"] is False, r.text
    assert weather_sent(fake)["strict"] is False
    r = http.post("/v1/responses", json={"model": "remote", "input": "s", "tools": [WEATHER_R]})
    assert r.status_code == 200, r.text
    assert "strict" not in weather_sent(fake)  # not sent: the upstream's default

    # the step after an answer offers the tools of the answering request (its own model call, as on
    # OpenAI: session 28), strict as it sends them
    fake.script(one_call_sse("call_st1", "get_weather", "{}"))
    waiting = http.post("/v1/responses", json={"model": "remote", "input": "weather?", "tools": [WEATHER_R]}).json()
    assert [o["type"] for o in waiting["output"]] == ["function_call"], waiting
    answer = {"type": "function_call_output", "call_id": "call_st1", "output": "sunny"}
    r = http.post(
        "/v1/responses",
        json={
            "model": "remote",
            "previous_response_id": waiting["id"],
            "input": [answer],
            "tools": [{**WEATHER_R, "strict": True}],
        },
    )
    assert r.status_code == 200, r.text
    assert weather_sent(fake)["strict"] is True


def test_a_function_output_in_parts_is_listed_as_sent(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    """A function_call_output sent as parts reaches the model as one text and is listed by
    input_items part by part, as a message's parts are (it was listed joined)."""
    fake.script(one_call_sse("call_parts1", "get_weather", "{}"))
    waiting = http.post("/v1/responses", json={"model": "remote", "input": "weather?", "tools": [WEATHER_R]}).json()
    parts = [{"type": "input_text", "text": "part1"}, {"type": "input_text", "text": "part2"}]
    answer = {"type": "function_call_output", "call_id": "call_parts1", "output": parts}
    r = http.post("/v1/responses", json={"model": "remote", "previous_response_id": waiting["id"], "input": [answer]})
    assert r.status_code == 200, r.text
    tool_message = fake.requests[-1].json["messages"][-1]
    assert tool_message["role"] == "tool" and "part1" in tool_message["content"] and "part2" in tool_message["content"]
    listed = http.get(f"/v1/responses/{r.json()['id']}/input_items").json()
    validate("ResponseItemList", listed)
    [fco] = [i for i in listed["data"] if i["type"] == "function_call_output"]
    assert fco["output"] == parts, fco
    assert client.responses.input_items.list(r.json()["id"]).data[0].type == "function_call_output"


def test_a_conflict_a_retry_would_meet_again_tells_the_sdk_not_to_retry(
    srv: tuple[ServeProcess, FakeOpenAI], fake: FakeOpenAI
) -> None:
    """The OpenAI SDK retries every 409 unless told `x-should-retry: false`: a 409 calls_pending
    or idempotency_key_reused was sent three times by one create() call."""
    sent: list[str] = []
    hooks = {"request": [lambda request: sent.append(request.url.path)]}
    with httpx.Client(event_hooks=hooks) as transport:
        client = openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=2, http_client=transport)
        fake.script(one_call_sse("call_409", "get_weather", "{}"))
        waiting = client.responses.create(model="remote", input="weather?", tools=[WEATHER_R])  # type: ignore[list-item]
        sent.clear()
        with pytest.raises(openai.ConflictError) as exc:
            client.responses.create(model="remote", previous_response_id=waiting.id, input="and now?")
        assert exc.value.code == "calls_pending" and exc.value.response.headers["x-should-retry"] == "false"
        assert len(sent) == 1, sent

        key = {"Idempotency-Key": f"k409-{time.monotonic_ns()}"}
        client.responses.create(model="assistant", input="one", extra_headers=key)
        sent.clear()
        with pytest.raises(openai.ConflictError) as exc:
            client.responses.create(model="assistant", input="two", extra_headers=key)
        assert exc.value.code == "idempotency_key_reused" and len(sent) == 1, sent
