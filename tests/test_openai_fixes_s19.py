"""OpenAI surface fixes from an outside tester's findings (round 19).

Through a real `appserver serve` with the real `openai` SDK (httpx where the raw answer matters):
`remote` and `remoteask` (clock under approval) run on a loopback fake OpenAI upstream that picks
its reply from `MODE:x` in the last user message, reports 15 tokens (10 in, 5 out, 3 cached, 2
reasoning) per model call, and records what it was sent.

1. New input continuing from a point where calls wait for answers is refused (Responses 409
   `calls_pending` naming them, chat 400 `tool_calls_unanswered`), in a fork too, even when the
   calls were answered later in the conversation forked from: the model never gets an assistant
   message with tool calls and no results.
2. A response's (or chat completion's) `usage` covers the model calls of that request only, not
   the whole turn a client-tool round trip resumes: 15 then 15, streamed and replayed alike.
3. A streamed chat refusal accumulates `content` None (as non-stream), a text its text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

WEATHER_R = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
WEATHER_C = {"type": "function", "function": {k: v for k, v in WEATHER_R.items() if k != "type"}}
USAGE = usage_chunk(10, 5, reasoning=2, cached=3)  # 15 tokens per model call


def _last_text(req: RecordedRequest) -> str:
    """The last user text, or TOOLRESULT when the request ends with tool results."""
    for m in reversed(req.json.get("messages", [])):
        if m.get("role") == "tool":
            return "TOOLRESULT"
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            return str(c or "")
    return ""


def upstream_model(req: RecordedRequest) -> Reply:
    text = _last_text(req)
    mode = text.split("MODE:")[1].split()[0] if "MODE:" in text else "text"
    if text == "TOOLRESULT":
        chunks = [chunk(role="assistant", content="got tool results"), chunk(finish_reason="stop")]
    elif mode == "parallel":
        chunks = [
            chunk(role="assistant", tool_calls=[tool_delta(0, id="call_A", name="get_weather", arguments="{}")]),
            chunk(tool_calls=[tool_delta(1, id="call_B", name="get_weather", arguments='{"city":"Rome"}')]),
            chunk(finish_reason="tool_calls"),
        ]
    elif mode == "tool":
        chunks = [
            chunk(role="assistant", tool_calls=[tool_delta(0, id="call_A", name="get_weather", arguments="{}")]),
            chunk(finish_reason="tool_calls"),
        ]
    elif mode == "clock":
        chunks = [
            chunk(role="assistant", tool_calls=[tool_delta(0, id="call_C", name="clock", arguments="{}")]),
            chunk(finish_reason="tool_calls"),
        ]
    elif mode == "refusal":
        first, rest = chunk(role="assistant"), chunk()
        first["choices"][0]["delta"].update({"content": None, "refusal": "I can't "})
        rest["choices"][0]["delta"]["refusal"] = "help with that."
        chunks = [first, rest, chunk(finish_reason="stop")]
    else:
        chunks = [chunk(role="assistant", content="hello "), chunk(content="world"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse([*chunks, USAGE])])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home = tmp_path_factory.mktemp("fixes19") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        for args in (("--name", "remote"), ("--name", "remoteask", "--tool", "clock=ask")):
            r = run_cli(home, "agents", "create", *args, "--model", "fake:m", "--json", env=env)
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
    return srv[1]


def dangling_calls(messages: list[dict[str, Any]]) -> list[str]:
    """Ids of assistant tool calls not followed (before the next non-tool message) by their result."""
    out: list[str] = []
    for n, m in enumerate(messages):
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            continue
        answered = set()
        for later in messages[n + 1 :]:
            if later.get("role") != "tool":
                break
            answered.add(later.get("tool_call_id"))
        out += [c["id"] for c in m["tool_calls"] if c["id"] not in answered]
    return out


def assert_upstream_got_no_dangling_call(fake: FakeOpenAI) -> None:
    for req in fake.requests:
        messages = req.json["messages"]
        assert dangling_calls(messages) == [], [(m["role"], m.get("tool_calls")) for m in messages]


def answers(*call_ids: str) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": c, "output": f"result {c}"} for c in call_ids]


def assert_calls_pending(exc: openai.APIStatusError, *names: str) -> None:
    assert exc.status_code == 409, exc
    body = exc.response.json()
    err = body["error"]
    assert err["code"] == "calls_pending" and err["type"] == "invalid_request_error" and err["param"] == "input"
    for name in names:
        assert name in err["message"], err
    validate("ErrorResponse", body)


# ---------------------------------------------------------------- 1. no new input past open calls


def test_a_fork_from_a_response_with_client_calls_answered_later_needs_their_answers(
    client: openai.OpenAI, fake: FakeOpenAI
) -> None:
    r = client.responses.create(model="remote", input="MODE:parallel a", tools=[WEATHER_R])  # type: ignore[list-item]
    assert [(o.type, getattr(o, "call_id", None)) for o in r.output] == [
        ("function_call", "call_A"),
        ("function_call", "call_B"),
    ]
    with pytest.raises(openai.ConflictError) as exc:  # while the conversation waits: 409 (as before)
        client.responses.create(model="remote", input="MODE:text hi", previous_response_id=r.id)
    assert_calls_pending(exc.value, "call_A", "call_B")
    answered = client.responses.create(
        model="remote",
        input=answers("call_A", "call_B"),  # type: ignore[arg-type]
        previous_response_id=r.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
    )
    assert answered.status == "completed" and answered.output_text == "got tool results"

    calls = len(fake.requests)
    # R is no longer its conversation's head: new input on it would fork after two calls without
    # results. Refused the same way, streamed or not, nothing sent to the model, nothing written.
    for stream in (False, True):
        with pytest.raises(openai.ConflictError) as exc:
            client.responses.create(model="remote", input="MODE:text again", previous_response_id=r.id, stream=stream)
        assert_calls_pending(exc.value, "call_A", "call_B", r.id)
    # messages added before the new input (a fork seeded with them): the same
    with pytest.raises(openai.ConflictError) as exc:
        client.responses.create(
            model="remote",
            input=[
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "U2"},
            ],
            previous_response_id=r.id,
        )
    assert_calls_pending(exc.value, "call_A", "call_B")
    assert len(fake.requests) == calls

    # the way on: answer the calls on R (a fork, answered as sent), then continue from there
    fork = client.responses.create(
        model="remote",
        input=answers("call_A", "call_B"),  # type: ignore[arg-type]
        previous_response_id=r.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
    )
    assert fork.status == "completed"
    more = client.responses.create(model="remote", input="MODE:text more", previous_response_id=fork.id)
    again = client.responses.create(model="remote", input="MODE:text and more", previous_response_id=more.id)
    assert more.status == again.status == "completed"
    assert_upstream_got_no_dangling_call(fake)
    roles = [m["role"] for m in fake.requests[-1].json["messages"] if m["role"] != "system"]
    assert roles == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant", "user"], roles


def test_a_fork_from_a_response_with_an_approval_decided_later_needs_its_answer(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    r = client.responses.create(model="remoteask", input="MODE:clock a")
    asks = [o for o in r.output if o.type == "mcp_approval_request"]
    assert [a.id for a in asks] == ["mcpr_call_C"]
    approve = [{"type": "mcp_approval_response", "approval_request_id": "mcpr_call_C", "approve": True}]
    done = client.responses.create(model="remoteask", input=approve, previous_response_id=r.id)  # type: ignore[arg-type]
    assert done.status == "completed" and [o.type for o in done.output] == ["mcp_call", "message"]

    calls = len(fake.requests)
    with pytest.raises(openai.ConflictError) as exc:
        client.responses.create(model="remoteask", input="MODE:text hi again", previous_response_id=r.id)
    assert_calls_pending(exc.value, "mcpr_call_C")
    assert len(fake.requests) == calls

    # answering it on R again forks with the call's result reused, and that fork goes on
    fork = client.responses.create(model="remoteask", input=approve, previous_response_id=r.id)  # type: ignore[arg-type]
    assert fork.status == "completed"
    nxt = client.responses.create(model="remoteask", input="MODE:text next", previous_response_id=fork.id)
    assert nxt.status == "completed"
    assert_upstream_got_no_dangling_call(fake)


def test_a_stateless_resend_of_a_point_with_an_open_approval_and_new_input_is_refused(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    """A stateless client resending a point where an approval was asked (its request item), with
    new input after it, once the conversation moved on: the fork it would make is refused as the
    conversation itself refused it while it waited (Responses 409, chat its 400)."""
    r = client.responses.create(model="remoteask", input="MODE:clock s")
    asks = [o for o in r.output if o.type == "mcp_approval_request"]
    approve = [{"type": "mcp_approval_response", "approval_request_id": asks[0].id, "approve": True}]
    done = client.responses.create(model="remoteask", input=approve, previous_response_id=r.id)  # type: ignore[arg-type]
    assert done.status == "completed"
    calls = len(fake.requests)
    history = [{"role": "user", "content": "MODE:clock s"}, asks[0].model_dump()]
    stateless = http.post(
        "/v1/responses", json={"model": "remoteask", "input": [*history, {"role": "user", "content": "x"}]}
    )
    assert stateless.status_code == 409, stateless.text
    validate("ErrorResponse", stateless.json())
    err = stateless.json()["error"]
    assert err["code"] == "calls_pending" and err["param"] == "input" and "mcpr_call_C" in err["message"], err
    # chat, whose view of that point is an empty assistant reply: its own refusal of the same
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": "remoteask",
            "messages": [
                {"role": "user", "content": "MODE:clock s"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "x"},
            ],
        },
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "tool_calls_unanswered" and "call_C" in chat.text
    assert len(fake.requests) == calls
    # resending the approval it got there instead forks with the call's result, and goes on
    again = http.post("/v1/responses", json={"model": "remoteask", "input": [*history, *approve]})
    assert again.status_code == 200, again.text
    nxt = client.responses.create(model="remoteask", input="MODE:text on", previous_response_id=again.json()["id"])
    assert nxt.status == "completed"
    assert_upstream_got_no_dangling_call(fake)


def test_chat_history_reaching_a_point_with_open_calls_is_refused(http: httpx.Client, fake: FakeOpenAI) -> None:
    """A stateless chat client whose history stops at the calls (no tool messages) before new input:
    OpenAI's own 400, whether or not the conversation has moved on (the transcript check, kept)."""
    first = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [{"role": "user", "content": "MODE:tool c"}], "tools": [WEATHER_C]},
    ).json()
    reply = first["choices"][0]["message"]
    assert reply["tool_calls"][0]["id"] == "call_A"
    history = [{"role": "user", "content": "MODE:tool c"}, reply]
    ok = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [*history, {"role": "tool", "tool_call_id": "call_A", "content": "sunny"}],
            "tools": [WEATHER_C],
        },
    )
    assert ok.status_code == 200, ok.text
    bad = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [*history, {"role": "user", "content": "MODE:text x"}]},
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "tool_calls_unanswered", bad.text
    assert_upstream_got_no_dangling_call(fake)


# ---------------------------------------------------------------- 2. usage per request


def _usage_is_one_call(u: Any) -> None:
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (10, 5, 15), u
    assert u.input_tokens_details.cached_tokens == 3 and u.output_tokens_details.reasoning_tokens == 2, u


def test_responses_usage_is_this_requests_model_calls(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    r1 = client.responses.create(model="remote", input="MODE:tool u", tools=[WEATHER_R])  # type: ignore[list-item]
    _usage_is_one_call(r1.usage)
    r2 = client.responses.create(
        model="remote",
        input=answers("call_A"),  # type: ignore[arg-type]
        previous_response_id=r1.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
    )
    assert r2.output_text == "got tool results"
    _usage_is_one_call(r2.usage)  # the turn's total is 30: this request made one call
    _usage_is_one_call(client.responses.retrieve(r2.id).usage)

    # streamed: response.completed carries the same
    s1 = client.responses.create(model="remote", input="MODE:tool us", tools=[WEATHER_R], stream=True)  # type: ignore[list-item]
    done1 = [e for e in s1 if e.type == "response.completed"][0].response
    _usage_is_one_call(done1.usage)
    s2 = client.responses.create(
        model="remote",
        input=answers("call_A"),  # type: ignore[arg-type]
        previous_response_id=done1.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
        stream=True,
    )
    done2 = [e for e in s2 if e.type == "response.completed"][0].response
    _usage_is_one_call(done2.usage)

    # an idempotent replay of the answering request replays its own usage
    r3 = client.responses.create(model="remote", input="MODE:tool ui", tools=[WEATHER_R])  # type: ignore[list-item]
    body = {"model": "remote", "input": answers("call_A"), "previous_response_id": r3.id, "tools": [WEATHER_R]}
    first = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "s19-usage"})
    replay = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "s19-usage"})
    assert first.status_code == replay.status_code == 200, first.text
    assert replay.headers.get("idempotent-replayed") == "true"
    assert first.json()["usage"]["total_tokens"] == replay.json()["usage"]["total_tokens"] == 15

    # a round answered in parts: the request that only answers one of two calls made no model call
    p1 = client.responses.create(model="remote", input="MODE:parallel up", tools=[WEATHER_R])  # type: ignore[list-item]
    part = client.responses.create(
        model="remote",
        input=answers("call_A"),  # type: ignore[arg-type]
        previous_response_id=p1.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
    )
    assert [o.call_id for o in part.output if o.type == "function_call"] == ["call_B"]
    assert part.usage is not None and part.usage.total_tokens == 0
    rest = client.responses.create(
        model="remote",
        input=answers("call_B"),  # type: ignore[arg-type]
        previous_response_id=part.id,
        tools=[WEATHER_R],  # type: ignore[list-item]
    )
    _usage_is_one_call(rest.usage)


def _chat_usage_is_one_call(u: Any) -> None:
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (10, 5, 15), u
    assert u.prompt_tokens_details.cached_tokens == 3 and u.completion_tokens_details.reasoning_tokens == 2, u


def test_chat_usage_is_this_requests_model_calls(client: openai.OpenAI, fake: FakeOpenAI) -> None:
    msgs: list[Any] = [{"role": "user", "content": "MODE:tool cu"}]
    c1 = client.chat.completions.create(model="remote", messages=msgs, tools=[WEATHER_C])  # type: ignore[list-item]
    _chat_usage_is_one_call(c1.usage)
    msgs += [
        c1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "call_A", "content": "s"},
    ]
    c2 = client.chat.completions.create(model="remote", messages=msgs, tools=[WEATHER_C])  # type: ignore[list-item]
    assert c2.choices[0].message.content == "got tool results"
    _chat_usage_is_one_call(c2.usage)

    # streamed with include_usage: the usage chunk
    smsgs: list[Any] = [{"role": "user", "content": "MODE:tool cs"}]
    for n in range(2):
        with client.chat.completions.stream(
            model="remote",
            messages=smsgs,
            tools=[WEATHER_C],  # type: ignore[list-item]
            stream_options={"include_usage": True},
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        _chat_usage_is_one_call(final.usage)
        if n == 0:
            smsgs += [
                final.choices[0].message.model_dump(exclude_none=True, exclude={"parsed"}),
                {"role": "tool", "tool_call_id": "call_A", "content": "s"},
            ]

    # the deprecated `functions`: answered by a `function` message, the same
    fn = WEATHER_C["function"]
    lmsgs: list[Any] = [{"role": "user", "content": "MODE:tool cl"}]
    l1 = client.chat.completions.create(model="remote", messages=lmsgs, functions=[fn])  # type: ignore[list-item]
    assert l1.choices[0].finish_reason == "function_call"
    _chat_usage_is_one_call(l1.usage)
    call = l1.choices[0].message.function_call
    assert call is not None
    lmsgs += [
        {"role": "assistant", "content": None, "function_call": {"name": call.name, "arguments": call.arguments}},
        {"role": "function", "name": "get_weather", "content": "s"},
    ]
    l2 = client.chat.completions.create(model="remote", messages=lmsgs, functions=[fn])  # type: ignore[list-item]
    assert l2.choices[0].message.content == "got tool results"
    _chat_usage_is_one_call(l2.usage)


# ---------------------------------------------------------------- 3. streamed refusal: content None


def test_a_streamed_refusal_accumulates_content_none(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    def streamed(text: str, **kw: Any) -> Any:
        with client.chat.completions.stream(model="remote", messages=[{"role": "user", "content": text}], **kw) as s:
            for _ in s:
                pass
            return s.get_final_completion().choices[0].message

    refused = streamed("MODE:refusal r")
    assert refused.content is None and refused.refusal == "I can't help with that."
    text = streamed("MODE:text t")
    assert text.content == "hello world" and text.refusal is None
    called = streamed("MODE:tool t", tools=[WEATHER_C])
    assert called.content is None and [c.id for c in called.tool_calls or []] == ["call_A"]
    # the same as the non-stream answers
    plain = client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "MODE:refusal p"}])
    assert plain.choices[0].message.content is None and plain.choices[0].message.refusal == "I can't help with that."

    # the raw chunks: OpenAI's schema, the role chunk first, no content in it
    r = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [{"role": "user", "content": "MODE:refusal raw"}], "stream": True},
    )
    payloads = [json.loads(p) for p in sse_payloads(sse_lines(r.content)) if p != "[DONE]"]
    for p in payloads:
        validate("CreateChatCompletionStreamResponse", p)
    deltas = [p["choices"][0]["delta"] for p in payloads if p["choices"]]
    assert deltas[0] == {"role": "assistant"}, deltas
    assert all("content" not in d or d["content"] is None for d in deltas), deltas
    assert "".join(d.get("refusal") or "" for d in deltas) == "I can't help with that."
