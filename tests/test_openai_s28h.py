"""An outside tester's findings (session 28, helper H), through a real `appserver serve` on loopback,
the real `openai` SDK (and the OpenAI Agents SDK) and the project's fake upstreams, which record
what each model call got (tests/fakes/openai_upstream.py, tests/fakes/anthropic_upstream.py).

1. A request answering a paused turn's client tool calls is its own model call, as on OpenAI: its
   `text.format` / `response_format`, `tool_choice`, `parallel_tool_calls`, sampling, token limit,
   `instructions` and client tools are what the turn's model calls after its answers get (they got
   those of the request that started the turn, while the Response echoed the answering request's:
   `responses.parse` failed, and a format the answer left out was still applied). Stored with the
   answers (the turn's row holds them); Responses with previous_response_id and with a resent
   transcript, a fork of an answered point, chat completions, and the Agents SDK's
   `tool_choice="required"` (reset after its tool call) all alike.
2. An anthropic-kind agent with thinking on: the Response echoes what the Messages API was sent —
   no temperature, no top_p below 0.95 (they were echoed as used); an effort whose thinking budget
   falls under 1024 tokens leaves thinking off and `reasoning.effort` echoes null (it said "high").
3. A Responses `input_image` by `file_id` (image_url left out or null) is a clear 400
   `unsupported_value` naming `file_id` (no Files API here), not `missing_required_parameter`
   'image_url'.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from tests.fakes.anthropic_upstream import (
    FakeAnthropic,
    anthropic_error,
    anthropic_sse,
    messages_problem,
    text_answer,
)
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, one_call_sse, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}
FETCH = {"type": "function", "name": "fetch", "parameters": {"type": "object", "properties": {"u": {"type": "string"}}}}
CHAT_LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "strict": True,  # chat.completions.parse takes strict tools only
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string"}},
            "required": ["q"],
            "additionalProperties": False,
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "Person", "schema": PERSON_SCHEMA, "strict": True}}
PERSON_CHAT: Any = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON_SCHEMA, "strict": True}}


class Person(pydantic.BaseModel):
    name: str


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def model(req: RecordedRequest) -> Reply:
    """The fake OpenAI-compatible model. After a tool result: JSON under a json_schema format, another
    call when a tool call is forced, else plain text. A new input with CALL (or a forced choice):
    a call to `lookup`."""
    body = req.json
    last = body["messages"][-1]
    forced = body.get("tool_choice") == "required"
    if last["role"] == "tool" and not forced:
        fmt = body.get("response_format") or {}
        text = '{"name": "bob"}' if fmt.get("type") == "json_schema" else "got result"
        return Reply(pieces=[openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop")])])
    if forced or "CALL" in _text(last.get("content")):
        return Reply(pieces=[one_call_sse(f"call_{uuid.uuid4().hex[:12]}", "lookup", '{"q": "x"}')])
    return Reply(pieces=[openai_sse([chunk(role="assistant", content="ok"), chunk(finish_reason="stop")])])


def anthropic_model(req: RecordedRequest) -> Reply:
    problem = messages_problem(req.json)
    if problem is not None:
        error = json.dumps(anthropic_error("invalid_request_error", problem)).encode()
        return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
    return Reply(pieces=[anthropic_sse(text_answer("anth: ok"))])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, anth: FakeAnthropic, home: Path) -> None:
        self.sp, self.fake, self.anth, self.home = sp, fake, anth, home

    def calls(self, t: str, fake: FakeOpenAI | FakeAnthropic | None = None) -> list[dict[str, Any]]:
        """The bodies of the upstream calls that carried `t`, in order."""
        return [r.json for r in list((fake or self.fake).requests) if t.encode() in r.body]

    def after_answer(self, t: str) -> list[dict[str, Any]]:
        """The calls of `t`'s conversation made after a tool result (the answering request's)."""
        return [b for b in self.calls(t) if b["messages"][-1]["role"] == "tool"]

    def stored_options(self, conversation_id: str) -> list[dict[str, Any]]:
        """Each turn's options as the store holds them (read from appserver.db), oldest first."""
        uri = f"file:{self.home / 'appserver.db'}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True)) as db:
            rows = db.execute(
                "SELECT options FROM turns WHERE conversation_id=? ORDER BY created_at", (conversation_id,)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeOpenAI() as fake, FakeAnthropic() as anth:
        fake.responder = model
        anth.responder = anthropic_model
        home: Path = tmp_path_factory.mktemp("s28h") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
            f'[providers.anth]\nkind = "anthropic"\nbase_url = "{anth.base_url}"\napi_key_env = ""\n'
            "max_attempts = 1\n"
        )
        cli = cli_env(home)
        made_agents = (
            ("gpt", "fake:m", ()),
            ("claude", "anth:claude-fake", ("--param", "temperature=0.3", "--param", "top_p=0.5")),
            ("claude_small", "anth:claude-fake", ("--param", "temperature=0.3", "--param", "max_tokens=1500")),
        )
        for name, agent_model, params in made_agents:
            made = run_cli(home, "agents", "create", "--name", name, "--model", agent_model, *params, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, anth, home)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:12]


def answered(call: Any) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": call.call_id, "output": "42"}]


def first_call(client: openai.OpenAI, t: str, **fields: Any) -> tuple[Any, str]:
    """A request whose turn pauses at a call to `lookup`: (the response, its conversation id)."""
    raw = client.responses.with_raw_response.create(model="gpt", input=f"CALL {t}", tools=[LOOKUP], **fields)
    r1 = raw.parse()
    assert r1.output[-1].type == "function_call", r1.output
    return r1, raw.headers["x-conversation-id"]


# ---------------------------------------------------------------- 1. an answer's own options


@pytest.mark.parametrize("how", ["previous_response_id", "resent_transcript"])
def test_an_answer_with_a_json_schema_gets_it_and_responses_parse_works(
    env: Env, client: openai.OpenAI, how: str
) -> None:
    t = tag()
    r1, conv = first_call(client, t)
    if how == "previous_response_id":
        where: dict[str, Any] = {"previous_response_id": r1.id, "input": answered(r1.output[-1])}
    else:  # a stateless client: the whole transcript, its own call and the output
        call = r1.output[-1]
        transcript = [
            {"role": "user", "content": f"CALL {t}"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        ]
        where = {"input": transcript + answered(call)}
    r2 = client.responses.parse(
        model="gpt",
        tools=[LOOKUP, FETCH],
        text_format=Person,
        temperature=0.2,
        top_p=0.7,
        max_output_tokens=999,
        parallel_tool_calls=False,
        tool_choice="none",
        instructions=f"answer as JSON {t}",
        **where,
    )
    assert r2.output_parsed == Person(name="bob")
    (sent,) = env.after_answer(t)
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["name"] == "Person"
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.2, 0.7, 999)
    assert (sent["tool_choice"], sent["parallel_tool_calls"]) == ("none", False)
    assert {"lookup", "fetch"} <= {t["function"]["name"] for t in sent["tools"]}  # its client tools
    assert ("system", f"answer as JSON {t}") in [(m["role"], _text(m["content"])) for m in sent["messages"]]
    # the echo is what that call got
    assert (r2.temperature, r2.top_p, r2.max_output_tokens) == (0.2, 0.7, 999)
    assert (r2.tool_choice, r2.parallel_tool_calls, r2.text.format.type) == ("none", False, "json_schema")
    # stored with the answer: a server resuming the turn (after a restart, in a cluster) runs with them
    stored = env.stored_options(conv)[-1]
    assert (stored["response_format"]["type"], stored["temperature"], stored["tool_choice"]) == (
        "json_schema",
        0.2,
        "none",
    )


def test_an_answer_without_a_format_gets_plain_text_after_a_first_request_with_one(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    r1, _ = first_call(client, t, text=PERSON_FORMAT, temperature=0.9, instructions=f"first {t}")
    (first,) = env.calls(t)
    assert first["response_format"]["type"] == "json_schema" and first["temperature"] == 0.9
    r2 = client.responses.create(model="gpt", previous_response_id=r1.id, input=answered(r1.output[-1]), tools=[LOOKUP])
    (sent,) = env.after_answer(t)
    assert "response_format" not in sent and "temperature" not in sent
    assert f"first {t}" not in json.dumps(sent["messages"])  # the first request's instructions were its own
    assert r2.output_text == "got result"
    assert (r2.text.format.type, r2.temperature) == ("text", 1.0)


def test_tool_choice_required_is_not_kept_for_an_answer_without_one(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r1 = client.responses.create(model="gpt", input=f"look it up {t}", tools=[LOOKUP], tool_choice="required")
    (first,) = env.calls(t)
    assert first["tool_choice"] == "required"
    r2 = client.responses.create(model="gpt", previous_response_id=r1.id, input=answered(r1.output[-1]), tools=[LOOKUP])
    (sent,) = env.after_answer(t)
    assert sent.get("tool_choice") in (None, "auto")
    assert (r2.output_text, r2.tool_choice) == ("got result", "auto")


def test_an_answer_that_forces_a_call_gets_it_for_its_first_model_call(env: Env, client: openai.OpenAI) -> None:
    """The answering request's tool_choice governs its own first model call (the one after its
    answers), as a new request's governs its first: later steps use `auto`."""
    t = tag()
    r1, _ = first_call(client, t)
    r2 = client.responses.create(
        model="gpt", previous_response_id=r1.id, input=answered(r1.output[-1]), tools=[LOOKUP], tool_choice="required"
    )
    (sent,) = env.after_answer(t)
    assert sent["tool_choice"] == "required"
    assert r2.output[-1].type == "function_call"  # the model was made to call a tool again
    r3 = client.responses.create(model="gpt", previous_response_id=r2.id, input=answered(r2.output[-1]), tools=[LOOKUP])
    assert env.after_answer(t)[-1].get("tool_choice") in (None, "auto")
    assert r3.output_text == "got result"


def test_a_fork_of_an_answered_point_runs_with_the_options_of_the_request_answering_in_it(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    r1, conv = first_call(client, t)
    plain = client.responses.create(
        model="gpt", previous_response_id=r1.id, input=answered(r1.output[-1]), tools=[LOOKUP]
    )
    assert plain.output_text == "got result"
    raw = client.responses.with_raw_response.create(  # the same call answered again: a fork of r1
        model="gpt",
        previous_response_id=r1.id,
        input=answered(r1.output[-1]),
        tools=[LOOKUP],
        text=PERSON_FORMAT,
        tool_choice="none",
        temperature=0.4,
    )
    forked = raw.parse()
    assert raw.headers["x-conversation-id"] != conv
    sent = env.after_answer(t)[-1]
    assert (sent["response_format"]["type"], sent["tool_choice"], sent["temperature"]) == ("json_schema", "none", 0.4)
    assert forked.output_text == '{"name": "bob"}'
    assert (forked.text.format.type, forked.tool_choice, forked.temperature) == ("json_schema", "none", 0.4)


def test_chat_tool_results_with_their_own_response_format_and_sampling(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    messages: list[Any] = [{"role": "user", "content": f"CALL {t}"}]
    first = client.chat.completions.create(model="gpt", messages=messages, tools=[CHAT_LOOKUP], temperature=0.5)
    msg = first.choices[0].message
    assert msg.tool_calls
    messages += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"},
    ]
    parsed = client.chat.completions.parse(
        model="gpt", messages=messages, tools=[CHAT_LOOKUP], response_format=Person, temperature=1.9, tool_choice="none"
    )
    assert parsed.choices[0].message.parsed == Person(name="bob")
    (sent,) = env.after_answer(t)
    assert sent["response_format"]["type"] == "json_schema"
    assert (sent["temperature"], sent["tool_choice"]) == (1.9, "none")


def test_chat_tool_choice_required_is_not_kept_for_tool_results_without_one(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    messages: list[Any] = [{"role": "user", "content": f"look it up {t}"}]
    first = client.chat.completions.create(
        model="gpt", messages=messages, tools=[CHAT_LOOKUP], tool_choice="required", response_format=PERSON_CHAT
    )
    msg = first.choices[0].message
    messages += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"},  # type: ignore[index]
    ]
    reply = client.chat.completions.create(model="gpt", messages=messages, tools=[CHAT_LOOKUP])
    (sent,) = env.after_answer(t)
    assert sent.get("tool_choice") in (None, "auto") and "response_format" not in sent
    assert reply.choices[0].message.content == "got result"


def test_the_agents_sdk_with_tool_choice_required_ends_after_its_tool_call(env: Env) -> None:
    """The Agents SDK sends tool_choice "required", then none once its tool ran
    (`reset_tool_choice`): the model call after the tool's output is not forced again."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    t = tag()
    ran: list[str] = []

    @agents.function_tool
    def lookup(q: str) -> str:
        """Look something up."""
        ran.append(q)
        return "42"

    model_ = agents.OpenAIResponsesModel(
        model="gpt", openai_client=openai.AsyncOpenAI(base_url=env.sp.url + "/v1", api_key="unused", max_retries=0)
    )
    agent = agents.Agent(
        name="a", model=model_, tools=[lookup], model_settings=agents.ModelSettings(tool_choice="required")
    )
    result = agents.Runner.run_sync(agent, f"look it up {t}", max_turns=4)
    assert result.final_output == "got result"
    assert ran == ["x"]
    choices = [b.get("tool_choice") for b in env.calls(t)]
    assert choices[0] == "required" and choices[-1] in (None, "auto"), choices


# ---------------------------------------------------------------- 2. anthropic: the echo is what was sent


def _anth_sent(env: Env, t: str) -> dict[str, Any]:
    (sent,) = env.calls(t, env.anth)
    return sent


@pytest.mark.parametrize("asked", [{}, {"temperature": 0.7, "top_p": 0.8}], ids=["agent_params", "request_params"])
def test_with_thinking_on_temperature_and_a_low_top_p_are_neither_sent_nor_echoed(
    env: Env, client: openai.OpenAI, asked: dict[str, Any]
) -> None:
    t = tag()
    r = client.responses.create(model="claude", input=f"hi {t}", reasoning={"effort": "high"}, **asked)
    sent = _anth_sent(env, t)
    assert sent["thinking"]["type"] == "enabled"
    assert "temperature" not in sent and "top_p" not in sent
    assert (r.temperature, r.top_p, r.reasoning.effort) == (1.0, 1.0, "high")


def test_with_thinking_on_a_top_p_of_at_least_095_is_sent_and_echoed(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r = client.responses.create(model="claude", input=f"hi {t}", reasoning={"effort": "low"}, top_p=0.97)
    sent = _anth_sent(env, t)
    assert sent["thinking"]["budget_tokens"] == 2048 and sent["top_p"] == 0.97
    assert (r.temperature, r.top_p) == (1.0, 0.97)


def test_without_thinking_the_agents_sampling_is_sent_and_echoed(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r = client.responses.create(model="claude", input=f"hi {t}")
    sent = _anth_sent(env, t)
    assert "thinking" not in sent and (sent["temperature"], sent["top_p"]) == (0.3, 0.5)
    assert (r.temperature, r.top_p, r.reasoning.effort) == (0.3, 0.5, None)


@pytest.mark.parametrize("where", ["agent_max_tokens", "request_max_output_tokens"])
def test_an_effort_with_too_small_a_budget_leaves_thinking_off_and_echoes_no_effort(
    env: Env, client: openai.OpenAI, where: str
) -> None:
    t = tag()
    if where == "agent_max_tokens":  # claude_small: max_tokens=1500, so at most 750 for thinking
        r = client.responses.create(model="claude_small", input=f"hi {t}", reasoning={"effort": "high"})
    else:
        r = client.responses.create(
            model="claude", input=f"hi {t}", reasoning={"effort": "high"}, max_output_tokens=1500
        )
    sent = _anth_sent(env, t)
    assert "thinking" not in sent and sent["max_tokens"] == 1500 and sent["temperature"] == 0.3
    assert (r.reasoning.effort, r.temperature, r.max_output_tokens) == (None, 0.3, 1500)


# ---------------------------------------------------------------- 3. an image by file_id


@pytest.mark.parametrize(
    "image",
    [
        {"type": "input_image", "file_id": "file-abc", "detail": "auto"},
        {"type": "input_image", "image_url": None, "file_id": "file-abc", "detail": "auto"},
        {"type": "input_image", "image_url": "https://example.com/a.png", "file_id": "file-abc"},
    ],
    ids=["file_id_only", "image_url_null", "both"],
)
def test_an_input_image_by_file_id_is_refused_by_name(env: Env, client: openai.OpenAI, image: dict[str, Any]) -> None:
    t = tag()
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="gpt", input=[{"role": "user", "content": [{"type": "input_text", "text": f"look {t}"}, image]}]
        )
    body = exc.value.body
    assert isinstance(body, dict), body
    assert (body["code"], body["param"]) == ("unsupported_value", "input[0].content[1].file_id"), body
    assert "file_id" in body["message"] and "Files API" in body["message"], body
    assert env.calls(t) == []


def test_an_input_image_with_a_null_image_url_and_no_file_id_is_still_a_type_error(env: Env) -> None:
    part = {"type": "input_image", "image_url": None}
    got = httpx.post(
        f"{env.sp.url}/v1/responses",
        json={"model": "gpt", "input": [{"role": "user", "content": [part]}]},
        timeout=30,
    )
    assert got.status_code == 400
    assert (got.json()["error"]["code"], got.json()["error"]["param"]) == (
        "invalid_type",
        "input[0].content[0].image_url",
    )
