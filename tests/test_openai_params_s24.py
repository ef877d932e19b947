"""Request parameters of `/v1/responses` and `/v1/chat/completions`, as OpenAI takes them.

1. `/v1/responses` refuses a field OpenAI's Responses API does not know (400 `unknown_parameter`)
   and the Chat Completions spellings it renamed or dropped (400 `unsupported_parameter`, saying
   where it moved), instead of accepting and dropping them (a client sending `response_format`
   got no structured output). The set of known fields is a literal in the code, checked here
   against OpenAI's API description; the real openai SDK (create, stream, parse, every field its
   `responses.create` can send) and the OpenAI Agents SDK still work.
2. The same mistake gets the same (status, code, param) on both routes: a wrong JSON type is
   `invalid_type`, a missing required field `missing_required_parameter`, each with its path.

Through a real `appserver serve` (echo agent) with httpx and the real `openai` SDK.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest

from tests.openai_schema import document, require_conformance, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FN_TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}, "strict": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("params_s24") / "home"
    home.mkdir()
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant` (echo)
    with serving(home, env=env) as sp:
        yield sp


@pytest.fixture
def http(srv: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


@pytest.fixture
def client(srv: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def refusal(r: httpx.Response) -> dict[str, Any]:
    """The error object of a 400 that matches OpenAI's ErrorResponse schema."""
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    return err


# ---------------------------------------------------------------- 1. the fields /v1/responses knows


def spec_fields(schema_name: str) -> set[str]:
    """The top-level properties of a request schema of OpenAI's description, allOf followed."""
    schemas = document("openai-openapi.json")["components"]["schemas"]
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "$ref" in node:
            walk(schemas[node["$ref"].rsplit("/", 1)[-1]])
            return
        found.update(node.get("properties", {}))
        for part in node.get("allOf", []):
            walk(part)

    walk(schemas[schema_name])
    return found


def sdk_create_fields() -> set[str]:
    """Every body field the openai SDK's `responses.create` can send (its keyword parameters)."""
    from openai.resources.responses import Responses

    params = inspect.signature(Responses.create).parameters
    return set(params) - {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def test_the_known_fields_literal_is_openais_create_response() -> None:
    require_conformance()
    from appserver.http.responses import CHAT_ONLY_FIELDS, MOVED_FIELDS, RESPONSES_FIELDS, SDK_ONLY_FIELDS

    responses = spec_fields("CreateResponse")
    assert set(RESPONSES_FIELDS) == responses
    chat_only = spec_fields("CreateChatCompletionRequest") - responses
    # `verbosity`: a Chat field the openai SDK's `responses.parse` sends at the top, so accepted
    assert set(MOVED_FIELDS) | CHAT_ONLY_FIELDS | {"verbosity"} == chat_only
    assert not set(MOVED_FIELDS) & CHAT_ONLY_FIELDS
    # fields of the SDK the description predates: none of OpenAI's own, all the SDK sends
    assert not SDK_ONLY_FIELDS & (responses | chat_only - {"verbosity"})
    assert sdk_create_fields() <= RESPONSES_FIELDS | SDK_ONLY_FIELDS, sdk_create_fields() - RESPONSES_FIELDS


JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
REFUSED_FIELDS = [
    ({"response_format": JSON_SCHEMA_FORMAT}, "unsupported_parameter", "moved to 'text.format'"),
    ({"max_tokens": 5}, "unsupported_parameter", "moved to 'max_output_tokens'"),
    ({"max_completion_tokens": 5}, "unsupported_parameter", "moved to 'max_output_tokens'"),
    ({"reasoning_effort": "huge"}, "unsupported_parameter", "moved to 'reasoning.effort'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "unsupported_parameter", "moved to 'input'"),
    ({"stop": ["x"]}, "unsupported_parameter", "no such parameter"),
    ({"n": 2}, "unsupported_parameter", "no such parameter"),
    ({"seed": "not-even-an-int"}, "unsupported_parameter", "no such parameter"),
    ({"functions": [{"name": "f"}]}, "unsupported_parameter", "no such parameter"),
    ({"logprobs": True}, "unsupported_parameter", "no such parameter"),
    ({"foo": 1}, "unknown_parameter", "Unknown parameter: 'foo'."),
    ({"extra_body": {"top_k": 3}}, "unknown_parameter", "Unknown parameter: 'extra_body'."),
]


@pytest.mark.parametrize(("extra", "code", "said"), REFUSED_FIELDS, ids=[next(iter(e)) for e, _, _ in REFUSED_FIELDS])
def test_responses_refuses_fields_it_does_not_know(
    http: httpx.Client, extra: dict[str, Any], code: str, said: str
) -> None:
    r = http.post("/v1/responses", json={"model": "assistant", "input": "hi", **extra})
    err = refusal(r)
    name = next(iter(extra))
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, name), err
    assert said in err["message"] and f"'{name}'" in err["message"], err


def test_the_openai_sdk_gets_vendor_fields_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="assistant", input="hi", extra_body={"top_k": 3})
    assert (info.value.code, info.value.param) == ("unknown_parameter", "top_k")


def every_sdk_field() -> dict[str, Any]:
    """A valid value for every field `responses.create` can send (null where OpenAI allows it)."""
    return {
        "access_programs": {"cyber": "standard"},
        "background": False,
        "background_options": {"completion_window": "soonest"},
        "context_management": [{"type": "compaction", "compact_threshold": 100000}],
        "conversation": None,
        "image": {"context_compression": "auto"},
        "include": ["message.output_text.logprobs"],
        "input": f"hi {uuid.uuid4().hex}",
        "instructions": "be brief",
        "max_output_tokens": 200,
        "max_tool_calls": 3,
        "metadata": {"k": "v"},
        "model": "assistant",
        "moderation": None,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_key": "pck",
        "prompt_cache_options": {"mode": "implicit"},
        "prompt_cache_retention": "in_memory",
        "reasoning": {"effort": "low", "summary": "auto"},
        "safety_identifier": "sid",
        "service_tier": "auto",
        "store": True,
        "stream": False,
        "stream_options": None,
        "temperature": 0.5,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "tool_choice": "auto",
        "tools": [FN_TOOL],
        "top_logprobs": 0,
        "top_p": 0.9,
        "truncation": "disabled",
        "user": "u-1",
    }


def test_every_field_the_openai_sdk_can_send_is_accepted(client: openai.OpenAI) -> None:
    sent = every_sdk_field()
    assert set(sent) == sdk_create_fields(), "the openai SDK's responses.create changed: add its new fields here"
    response = client.responses.create(**sent)
    assert response.status == "completed" and response.output_text.startswith("echo: hi"), response
    validate("Response", response.model_dump(mode="json", exclude_unset=True))


class Answer(pydantic.BaseModel):
    text: str


def test_the_openai_sdk_streams_and_parses(client: openai.OpenAI) -> None:
    with client.responses.stream(model="assistant", input="streamed", max_output_tokens=50) as stream:
        final = stream.get_final_response()
    assert final.output_text == "echo: streamed"
    # parse sends the schema as text.format; parse_as=None reads the echo's plain text back
    parsed = client.responses.parse(model="assistant", input="parsed", text_format=Answer, parse_as=None)
    assert parsed.output_text == "echo: parsed"
    # parse takes `verbosity` and sends it at the top of the body: accepted, as OpenAI does
    terse = client.responses.parse(model="assistant", input="terse", verbosity="low", parse_as=None)
    assert terse.output_text == "echo: terse"
    assert parsed.text is not None and parsed.text.format is not None and parsed.text.format.type == "json_schema"


def test_the_agents_sdk_runs_with_its_model_settings(srv: ServeProcess) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        model="assistant",
        openai_client=openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30),
    )
    settings = agents.ModelSettings(
        temperature=0.5,
        top_p=0.9,
        max_tokens=100,
        parallel_tool_calls=True,
        truncation="auto",
        reasoning=openai.types.shared.Reasoning(effort="low"),
        verbosity="low",
        metadata={"k": "v"},
        store=True,
        include_usage=True,
        top_logprobs=1,
        prompt_cache_retention="in_memory",
        tool_choice="auto",
    )

    @agents.function_tool
    def lookup(word: str) -> str:
        """Look a word up."""
        return word

    agent = agents.Agent(name="tester", model=model, model_settings=settings, tools=[lookup])
    result = agents.Runner.run_sync(agent, "hello agents", max_turns=2)
    assert str(result.final_output) == "echo: hello agents"


# ---------------------------------------------------------------- 2. one mistake, one answer on both routes


def chat_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "assistant", "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], **extra}


def responses_body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "assistant", "input": f"hi {uuid.uuid4().hex}", **extra}


def messages(*items: Any) -> dict[str, Any]:
    return {"messages": list(items)}


def inputs(*items: Any) -> dict[str, Any]:
    return {"input": list(items)}


# (what chat gets, what responses gets: the same mistake in each route's spelling), the code, and
# the param each route names (its own path to the field)
SAME_MISTAKES: list[tuple[str, dict[str, Any], dict[str, Any], str, str, str]] = [
    ("parallel_tool_calls", {"parallel_tool_calls": "x"}, {"parallel_tool_calls": "x"}, "invalid_type", "", ""),
    ("store", {"store": "x"}, {"store": "x"}, "invalid_type", "", ""),
    ("user", {"user": 5}, {"user": 5}, "invalid_type", "", ""),
    ("temperature", {"temperature": "1"}, {"temperature": "1"}, "invalid_type", "", ""),
    ("top_p", {"top_p": "1"}, {"top_p": "1"}, "invalid_type", "", ""),
    ("token limit", {"max_tokens": "5"}, {"max_output_tokens": "5"}, "invalid_type", "max_tokens", "max_output_tokens"),
    ("tools object", {"tools": {}}, {"tools": {}}, "invalid_type", "tools", "tools"),
    ("tool not an object", {"tools": ["f"]}, {"tools": ["f"]}, "invalid_type", "tools[0]", "tools[0]"),
    ("tool type", {"tools": [{"type": 5}]}, {"tools": [{"type": 5}]}, "invalid_type", "tools[0].type", ""),
    (
        "function tool without its function",
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function"}]},
        "missing_required_parameter",
        "tools[0].function",
        "tools[0].name",
    ),
    (
        "function name of another type",
        {"tools": [{"type": "function", "function": {"name": 5}}]},
        {"tools": [{"type": "function", "name": 5}]},
        "invalid_type",
        "tools[0].function.name",
        "tools[0].name",
    ),
    (
        "function without a name",
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        {"tools": [{"type": "function", "parameters": {}}]},
        "missing_required_parameter",
        "tools[0].function.name",
        "tools[0].name",
    ),
    ("transcript type", {"messages": 5}, {"input": 5}, "invalid_type", "messages", "input"),
    ("item not an object", messages("x"), inputs("x"), "invalid_type", "messages[0]", "input[0]"),
    (
        "message without role",
        messages({"content": "hi"}),
        inputs({"type": "message", "content": "hi"}),
        "missing_required_parameter",
        "messages[0].role",
        "input[0].role",
    ),
    (
        "role of another type",
        messages({"role": 5, "content": "hi"}),
        inputs({"role": 5, "content": "hi"}),
        "invalid_type",
        "messages[0].role",
        "input[0].role",
    ),
    (
        "role unknown",
        messages({"role": "boss", "content": "hi"}),
        inputs({"role": "boss", "content": "hi"}),
        "invalid_value",
        "messages[0].role",
        "input[0].role",
    ),
    (
        "content of another type",
        messages({"role": "user", "content": 5}),
        inputs({"role": "user", "content": 5}),
        "invalid_type",
        "messages[0].content",
        "input[0].content",
    ),
    (
        "content part not an object",
        messages({"role": "user", "content": ["x"]}),
        inputs({"role": "user", "content": ["x"]}),
        "invalid_type",
        "messages[0].content[0]",
        "input[0].content[0]",
    ),
    (
        "text part without text",
        messages({"role": "user", "content": [{"type": "text"}]}),
        inputs({"role": "user", "content": [{"type": "input_text"}]}),
        "missing_required_parameter",
        "messages[0].content[0].text",
        "input[0].content[0].text",
    ),
    (
        "text part's text of another type",
        messages({"role": "user", "content": [{"type": "text", "text": 5}]}),
        inputs({"role": "user", "content": [{"type": "input_text", "text": 5}]}),
        "invalid_type",
        "messages[0].content[0].text",
        "input[0].content[0].text",
    ),
    (
        "image part without its url",
        messages({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
        inputs({"role": "user", "content": [{"type": "input_image"}]}),
        "missing_required_parameter",
        "messages[0].content[0].image_url.url",
        "input[0].content[0].image_url",
    ),
    (
        "tool result without output",
        messages({"role": "tool", "tool_call_id": "c1"}),
        inputs({"type": "function_call_output", "call_id": "c1"}),
        "missing_required_parameter",
        "messages[0].content",
        "input[0].output",
    ),
    (
        "tool result of another type",
        messages({"role": "tool", "tool_call_id": "c1", "content": 5}),
        inputs({"type": "function_call_output", "call_id": "c1", "output": 5}),
        "invalid_type",
        "messages[0].content",
        "input[0].output",
    ),
]


@pytest.mark.parametrize(
    ("chat_extra", "responses_extra", "code", "chat_param", "responses_param"),
    [row[1:] for row in SAME_MISTAKES],
    ids=[row[0] for row in SAME_MISTAKES],
)
def test_one_mistake_gets_one_answer_on_both_routes(
    http: httpx.Client,
    chat_extra: dict[str, Any],
    responses_extra: dict[str, Any],
    code: str,
    chat_param: str,
    responses_param: str,
) -> None:
    on_chat = refusal(http.post("/v1/chat/completions", json=chat_body(chat_extra)))
    on_responses = refusal(http.post("/v1/responses", json=responses_body(responses_extra)))
    named = next(iter(chat_extra))
    assert on_chat["param"] == (chat_param or named), on_chat
    assert on_responses["param"] == (responses_param or chat_param or named), on_responses
    assert (on_chat["code"], on_responses["code"]) == (code, code), (on_chat, on_responses)


def test_a_tool_result_without_its_call_is_named_on_both_routes(http: httpx.Client) -> None:
    on_chat = refusal(http.post("/v1/chat/completions", json=chat_body(messages({"role": "tool", "content": "r"}))))
    assert on_chat["code"] == "missing_required_parameter", on_chat
    body = responses_body(inputs({"type": "function_call_output", "output": "r"}))
    on_responses = refusal(http.post("/v1/responses", json=body))
    assert on_responses["code"] == "missing_call_id", on_responses  # call_id is optional in OpenAI's schema
    typed = responses_body(inputs({"type": "function_call_output", "call_id": 5, "output": "r"}))
    assert refusal(http.post("/v1/responses", json=typed))["code"] == "invalid_type"


RESPONSES_ONLY = [
    ({"previous_response_id": 5}, "invalid_type", "previous_response_id"),
    ({"conversation": 5}, "invalid_type", "conversation"),
    ({"conversation": {}}, "missing_required_parameter", "conversation.id"),
    ({"conversation": {"id": 5}}, "invalid_type", "conversation.id"),
    ({"instructions": ["x"]}, "invalid_type", "instructions[0]"),
    ({"instructions": [{"content": "x"}]}, "missing_required_parameter", "instructions[0].role"),
    (inputs({"type": 5, "role": "user", "content": "hi"}), "invalid_type", "input[0].type"),
    (
        inputs({"type": "mcp_approval_response", "approval_request_id": "x"}),
        "missing_required_parameter",
        "input[0].approve",
    ),
    (
        inputs({"type": "mcp_approval_response", "approve": True}),
        "missing_required_parameter",
        "input[0].approval_request_id",
    ),
    (
        inputs({"type": "mcp_approval_response", "approval_request_id": "x", "approve": "y"}),
        "invalid_type",
        "input[0].approve",
    ),
    ({"context_management": "x"}, "invalid_type", "context_management"),
    ({"image": "x"}, "invalid_type", "image"),
    ({"verbosity": "huge"}, "invalid_value", "verbosity"),
    ({"text": {"format": {}}}, "missing_required_parameter", "text.format.type"),
    ({"text": {"format": {"type": None}}}, "invalid_type", "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "missing_required_parameter", "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": None}}}, "invalid_type", "text.format.name"),
]
CHAT_ONLY = [
    ({"stop": 5}, "invalid_type", "stop"),
    ({"stop": ["x", 5]}, "invalid_type", "stop[1]"),
    ({"messages": []}, "empty_array", "messages"),
    ({"function_call": 5}, "invalid_type", "function_call"),
    ({"function_call": {}}, "missing_required_parameter", "function_call.name"),
    ({"function_call": "sometimes"}, "invalid_value", "function_call"),
    ({"functions": {}}, "invalid_type", "functions"),
    ({"tools": [{"type": "function", "function": "f"}]}, "invalid_type", "tools[0].function"),
    (
        messages({"role": "assistant", "content": "x", "tool_calls": {}}, {"role": "user", "content": "y"}),
        "invalid_type",
        "messages[0].tool_calls",
    ),
    (messages({"role": "function", "content": "x"}), "missing_required_parameter", "messages[0].name"),
    ({"response_format": {}}, "missing_required_parameter", "response_format.type"),
    ({"response_format": {"type": None}}, "invalid_type", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "missing_required_parameter", "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "missing_required_parameter",
        "response_format.json_schema.name",
    ),
    (
        messages({"role": "assistant", "function_call": {"arguments": "{}"}}, {"role": "user", "content": "y"}),
        "missing_required_parameter",
        "messages[0].function_call.name",
    ),
    (
        messages({"role": "assistant", "function_call": {"name": "f"}}, {"role": "user", "content": "y"}),
        "missing_required_parameter",
        "messages[0].function_call.arguments",
    ),
]


@pytest.mark.parametrize(("extra", "code", "param"), RESPONSES_ONLY, ids=[p for _, _, p in RESPONSES_ONLY])
def test_responses_names_each_mistake_by_its_path(
    http: httpx.Client, extra: dict[str, Any], code: str, param: str
) -> None:
    err = refusal(http.post("/v1/responses", json=responses_body(extra)))
    assert (err["code"], err["param"]) == (code, param), err


@pytest.mark.parametrize(("extra", "code", "param"), CHAT_ONLY, ids=[p + ":" + json.dumps(e) for e, _, p in CHAT_ONLY])
def test_chat_names_each_mistake_by_its_path(http: httpx.Client, extra: dict[str, Any], code: str, param: str) -> None:
    err = refusal(http.post("/v1/chat/completions", json=chat_body(extra)))
    assert (err["code"], err["param"]) == (code, param), err
