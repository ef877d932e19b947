"""Session 29, helper X: a whole transcript whose tool round comes before a new user message is
history, not answers. A client that ran a tool itself and stopped there (the Agents SDK's
`stop_on_first_tool`, LangGraph's return_direct, a few-shot transcript) sends
`[user, function_call, function_call_output, user]` with no server state named; the server refused
it 400 `mixed_input`, on both routes, though OpenAI takes it (the order says which input is new).
Now the round is the history the new user message follows: the model sees the whole transcript
once, in order; a stateful request mixing results and user input is still refused. Real
`appserver serve`, the real `openai` SDK (and the Agents SDK), the fake OpenAI upstream recording
each model call."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, one_call_sse, openai_sse
from tests.support.serve import ServeProcess, serving_provider

pytestmark = pytest.mark.timeout(120)

LOOKUP = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
CHAT_LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def upstream_model(req: RecordedRequest) -> Reply:
    """Calls `lookup` when the last user message asks for it ("call ..."), else echoes it."""
    last = req.json["messages"][-1]
    said = text_of(last)
    if last["role"] == "user" and said.startswith("call"):
        return Reply(pieces=[one_call_sse(f"call_{uuid.uuid4().hex[:8]}", "lookup", "{}")])
    return Reply(pieces=[openai_sse([chunk(role="assistant", content=f"ok: {said}"), chunk(finish_reason="stop")])])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI) -> None:
        self.sp, self.fake = sp, fake

    def calls_with(self, t: str) -> list[list[tuple[str, str]]]:
        """The conversation (role, text / call names / result) of each model call whose last message carried `t`."""
        out = []
        for r in list(self.fake.requests):
            msgs = r.json["messages"]
            if t in text_of(msgs[-1]):
                out.append([shape(m) for m in msgs if m["role"] != "system"])
        return out


def shape(m: dict[str, Any]) -> tuple[str, str]:
    if m["role"] == "assistant" and m.get("tool_calls"):
        return ("assistant", ",".join(c["function"]["name"] for c in m["tool_calls"]))
    return (m["role"], text_of(m))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home = tmp_path_factory.mktemp("s29x") / "home"
        with serving_provider(home, "openai", fake.base_url, {"remote": "m"}) as sp:
            yield Env(sp, fake)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def expected(t: str, result: str) -> list[tuple[str, str]]:
    return [("user", f"call {t}"), ("assistant", "lookup"), ("tool", result), ("user", f"thanks {t}")]


def test_responses_stateless_tool_round_then_user(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    first = client.responses.create(model="remote", input=f"call {t}", tools=[LOOKUP])  # type: ignore[list-item]
    (fc,) = [o for o in first.output if o.type == "function_call"]
    transcript: list[Any] = [
        {"role": "user", "content": f"call {t}"},
        {"type": "function_call", "call_id": fc.call_id, "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": fc.call_id, "output": f"result {t}"},
        {"role": "user", "content": f"thanks {t}"},
    ]
    r = client.responses.create(model="remote", input=transcript, tools=[LOOKUP])  # type: ignore[list-item]
    assert r.output_text == f"ok: thanks {t}"
    assert env.calls_with(f"thanks {t}") == [expected(t, f"result {t}")]
    # the same stateless request again: the history is not doubled
    again = client.responses.create(model="remote", input=transcript, tools=[LOOKUP])  # type: ignore[list-item]
    assert again.output_text == f"ok: thanks {t}"
    assert env.calls_with(f"thanks {t}") == [expected(t, f"result {t}")] * 2
    # and the next turn of that transcript goes on from the reply
    reply = {"role": "assistant", "content": f"ok: thanks {t}"}
    follow = [*transcript, reply, {"role": "user", "content": f"more {t}"}]
    nxt = client.responses.create(model="remote", input=follow, tools=[LOOKUP])  # type: ignore[list-item]
    assert nxt.output_text == f"ok: more {t}"
    assert env.calls_with(f"more {t}") == [
        [*expected(t, f"result {t}"), ("assistant", f"ok: thanks {t}"), ("user", f"more {t}")]
    ]


def test_responses_new_transcript_with_unissued_call(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    transcript: list[Any] = [
        {"role": "user", "content": f"call {t}"},
        {"type": "function_call", "call_id": f"call_never_{t}", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"call_never_{t}", "output": f"fewshot {t}"},
        {"role": "user", "content": f"thanks {t}"},
    ]
    r = client.responses.create(model="remote", input=transcript, tools=[LOOKUP])  # type: ignore[list-item]
    assert r.output_text == f"ok: thanks {t}"
    assert env.calls_with(f"thanks {t}") == [expected(t, f"fewshot {t}")]


def test_chat_stateless_tool_round_then_user(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    first = client.chat.completions.create(
        model="remote",
        messages=[{"role": "user", "content": f"call {t}"}],
        tools=[CHAT_LOOKUP],  # type: ignore[list-item]
    )
    (tc,) = first.choices[0].message.tool_calls or []
    messages: list[Any] = [
        {"role": "user", "content": f"call {t}"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": f"result {t}"},
        {"role": "user", "content": f"thanks {t}"},
    ]
    for n in (1, 2):  # the same request twice: each call sees the transcript once
        r = client.chat.completions.create(model="remote", messages=messages, tools=[CHAT_LOOKUP])  # type: ignore[list-item]
        assert r.choices[0].message.content == f"ok: thanks {t}"
        assert env.calls_with(f"thanks {t}") == [expected(t, f"result {t}")] * n


def test_still_refused_when_ambiguous(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    first = client.responses.create(model="remote", input=f"call {t}", tools=[LOOKUP])  # type: ignore[list-item]
    (fc,) = [o for o in first.output if o.type == "function_call"]
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "r"}
    # stateful: the results would answer the paused turn, the user input start another
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="remote",
            previous_response_id=first.id,
            input=[output, {"role": "user", "content": f"thanks {t}"}],  # type: ignore[list-item]
            tools=[LOOKUP],  # type: ignore[list-item]
        )
    assert exc.value.code == "mixed_input"
    # user input before the results in the new part: no order to read
    call = {"type": "function_call", "call_id": fc.call_id, "name": "lookup", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="remote",
            input=[{"role": "user", "content": f"call {t}"}, call, {"role": "user", "content": "x"}, output],  # type: ignore[list-item]
            tools=[LOOKUP],  # type: ignore[list-item]
        )
    assert exc.value.code == "mixed_input"
    # a call left without its output is still OpenAI's refusal
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="remote",
            messages=[
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "user", "content": "b"},
            ],
            tools=[CHAT_LOOKUP],  # type: ignore[list-item]
        )
    assert exc.value.code == "tool_calls_unanswered"


def test_a_call_answered_twice_differently_in_the_history_round_is_refused(env: Env, client: openai.OpenAI) -> None:
    """Re-attack: the model saw only the first of two different results for one call (200); the same
    results as answers are refused invalid_input, and so are they now as history."""
    t = tag()
    call = {"type": "function_call", "call_id": "c_dup", "name": "lookup", "arguments": "{}"}
    outputs = [{"type": "function_call_output", "call_id": "c_dup", "output": o} for o in ("one", "two")]
    before = len(env.fake.requests)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="remote",
            input=[{"role": "user", "content": f"call {t}"}, call, *outputs, {"role": "user", "content": "next"}],  # type: ignore[list-item]
            tools=[LOOKUP],  # type: ignore[list-item]
        )
    assert (exc.value.code, exc.value.param) == ("invalid_input", "input")
    assigned = {"id": "c_dup", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="remote",
            messages=[
                {"role": "user", "content": f"call {t}"},
                {"role": "assistant", "tool_calls": [assigned]},  # type: ignore[list-item]
                {"role": "tool", "tool_call_id": "c_dup", "content": "one"},
                {"role": "tool", "tool_call_id": "c_dup", "content": "two"},
                {"role": "user", "content": "next"},
            ],
            tools=[CHAT_LOOKUP],  # type: ignore[list-item]
        )
    assert (exc.value.code, exc.value.param) == ("invalid_input", "messages")
    assert len(env.fake.requests) == before  # nothing reached the model


def test_agents_sdk_stop_on_first_tool_then_user(env: Env) -> None:
    agents = pytest.importorskip("agents")
    t = tag()

    @agents.function_tool
    def lookup() -> str:
        """Look it up."""
        return f"looked {t}"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = agents.OpenAIResponsesModel(model="remote", openai_client=client)
        agent = agents.Agent(name="a", model=model, tools=[lookup], tool_use_behavior="stop_on_first_tool")
        config = agents.RunConfig(tracing_disabled=True)
        first = await agents.Runner.run(agent, f"call {t}", run_config=config)
        assert first.final_output == f"looked {t}"
        nxt = first.to_input_list() + [{"role": "user", "content": f"thanks {t}"}]
        second = await agents.Runner.run(agent, nxt, run_config=config)
        await client.close()
        return second

    second = asyncio.run(run())
    assert second.final_output == f"ok: thanks {t}"
    assert env.calls_with(f"thanks {t}") == [expected(t, json.dumps(f"looked {t}")[1:-1])]
