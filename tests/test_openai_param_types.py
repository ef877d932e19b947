"""Request fields checked against the types and enums of OpenAI's API description (a wrong type is a
400 naming the field, null stays accepted where OpenAI allows it), the Response object echoing what
was sent, and the status of a response's message items when it did not complete. Through a real
`appserver serve` (echo agent) with httpx and the real `openai` SDK.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
RFN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("param_types") / "home"
    home.mkdir()
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant` (echo)
    with serving(home, env=env) as sp:
        yield sp


@pytest.fixture
def http(srv: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": "assistant", "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], **fields}
    return http.post("/v1/chat/completions", json=body)


def respond(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": "assistant", "input": f"hi {uuid.uuid4().hex}", **fields})


def refused(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param, err
    return err


# ---------------------------------------------------------------- 1. loose types


CHAT_REFUSED = [
    ({"stream": 0}, "stream"),
    ({"stream": ""}, "stream"),
    ({"stream": {}}, "stream"),
    ({"stream": []}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"n": True}, "n"),
    ({"n": "1"}, "n"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}}, "tool_choice"),
    (
        {"tools": [FN], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
        "tool_choice",
    ),
    (
        {"tools": [FN], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "x", "tools": [FN]}}},
        "tool_choice.allowed_tools.mode",
    ),
    ({"reasoning_effort": 5}, "reasoning_effort"),
    ({"reasoning_effort": "bogus"}, "reasoning_effort"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"logprobs": "x"}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": "x"}, "seed"),
    ({"service_tier": "bogus"}, "service_tier"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": "x"}, "metadata"),
    ({"safety_identifier": 1}, "safety_identifier"),
    ({"safety_identifier": "x" * 65}, "safety_identifier"),
    ({"prompt_cache_key": []}, "prompt_cache_key"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_REFUSED, ids=[p + ":" + json.dumps(f) for f, p in CHAT_REFUSED])
def test_chat_fields_of_the_wrong_type_are_a_400_naming_them(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    refused(chat(http, **fields), param)


RESPONSES_REFUSED = [
    ({"stream": 0}, "stream"),
    ({"stream": "yes"}, "stream"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"text": "x"}, "text"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"text": {"format": {"type": "bogus"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"reasoning": "x"}, "reasoning"),
    ({"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ({"reasoning": {"summary": 1}}, "reasoning.summary"),
    ({"truncation": "bogus"}, "truncation"),
    ({"include": "x"}, "include"),
    ({"include": ["bogus"]}, "include[0]"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"max_tool_calls": "3"}, "max_tool_calls"),
    ({"background": "x"}, "background"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"instructions": ["x"]}, "instructions[0]"),
    ({"instructions": [{"role": "user", "content": "x"}]}, "instructions[0].role"),
    ({"instructions": 5}, "instructions"),
    ({"tools": [{**RFN, "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{**RFN, "parameters": "x"}]}, "tools[0].parameters"),
    ({"tools": [RFN], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tools": [RFN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [RFN], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"service_tier": "bogus"}, "service_tier"),
    ({"metadata": {"k": ["v"]}}, "metadata.k"),
    ({"input": ""}, "input"),
]


@pytest.mark.parametrize(
    ("fields", "param"), RESPONSES_REFUSED, ids=[p + ":" + json.dumps(f) for f, p in RESPONSES_REFUSED]
)
def test_responses_fields_of_the_wrong_type_are_a_400_naming_them(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    refused(respond(http, **fields), param)


def test_background_true_stays_unsupported_and_a_function_choice_without_a_name_says_so(http: httpx.Client) -> None:
    err = refused(respond(http, background=True), "background")
    assert err["code"] == "unsupported_parameter"
    err = refused(chat(http, tools=[FN], tool_choice={"type": "function"}), "tool_choice.function")
    assert "name" in err["message"] and "None" not in err["message"], err
    err = refused(respond(http, input=""), "input")
    assert err["code"] == "missing_input"


def test_null_stays_accepted_where_openai_allows_it(http: httpx.Client) -> None:
    nulls = ("stream", "n", "stream_options", "reasoning_effort", "response_format", "parallel_tool_calls", "seed")
    r = chat(http, **dict.fromkeys(nulls), logprobs=None, top_logprobs=None, service_tier=None, metadata=None)
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    nulls = ("stream", "background", "parallel_tool_calls", "text", "reasoning", "truncation", "include")
    r = respond(http, **dict.fromkeys(nulls), max_tool_calls=None, instructions=None, safety_identifier=None)
    assert r.status_code == 200, r.text
    validate("Response", r.json())
    assert r.json()["text"] == {"format": {"type": "text"}} and r.json()["truncation"] == "disabled"


def test_stream_options_include_usage_false_gives_no_usage_chunk(http: httpx.Client) -> None:
    r = chat(http, stream=True, stream_options={"include_usage": False})
    assert r.status_code == 200, r.text
    chunks = [json.loads(p) for p in sse_payloads(sse_lines(r.content)) if p != "[DONE]"]
    assert chunks and all(ch["choices"] for ch in chunks), chunks[-1]


# ---------------------------------------------------------------- 2. the Response object echoes the request

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
ECHOED: dict[str, Any] = {
    "text": {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}},
    "reasoning": {"effort": "high"},
    "tools": [RFN],
    "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
    "user": "u-1",
    "safety_identifier": "sid-1",
    "prompt_cache_key": "pck-1",
    "instructions": [{"role": "developer", "content": "be brief"}],
    "truncation": "auto",
    "max_tool_calls": 3,
    "top_logprobs": 2,
}


def assert_echoes(response: dict[str, Any]) -> None:
    validate("Response", response)
    assert response["text"] == ECHOED["text"]
    assert response["reasoning"] == {"effort": "high", "summary": None}
    assert response["tool_choice"] == ECHOED["tool_choice"]
    assert (response["user"], response["safety_identifier"], response["prompt_cache_key"]) == ("u-1", "sid-1", "pck-1")
    assert response["instructions"] == [{"type": "message", "role": "developer", "content": "be brief"}]
    assert (response["truncation"], response["max_tool_calls"], response["top_logprobs"]) == ("auto", 3, 2)


def test_the_response_object_echoes_what_was_sent(http: httpx.Client) -> None:
    r = respond(http, **ECHOED)
    assert r.status_code == 200, r.text
    assert_echoes(r.json())
    stored = http.get(f"/v1/responses/{r.json()['id']}")
    assert stored.status_code == 200
    assert_echoes(stored.json())


def test_a_streamed_response_echoes_what_was_sent_in_created_and_completed(
    srv: ServeProcess, http: httpx.Client
) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    events = list(client.responses.create(model="assistant", input=f"s {uuid.uuid4().hex}", stream=True, **ECHOED))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    for e in (events[0], events[-1]):
        assert_echoes(e.response.model_dump(mode="json", exclude_unset=True, by_alias=True))
    stored = http.get(f"/v1/responses/{events[0].response.id}")
    assert_echoes(stored.json())


def test_a_string_instruction_is_echoed_as_sent(http: httpx.Client) -> None:
    r = respond(http, instructions="be brief")
    assert r.status_code == 200 and r.json()["instructions"] == "be brief", r.text
    assert "user" not in r.json()  # Response.user is a string: absent when not sent
    validate("Response", r.json())


# ---------------------------------------------------------------- 3. a cancelled response's message


def test_a_response_cancelled_by_its_client_keeps_its_partial_message_incomplete(
    srv: ServeProcess, http: httpx.Client
) -> None:
    rid = None
    texts = 0
    with http.stream("POST", "/v1/responses", json={"model": "assistant", "input": "/slow 40", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.created":
                rid = event["response"]["id"]
            if event["type"] == "response.output_text.delta":
                texts += 1
                if texts >= 3:
                    break  # hang up mid-message
    assert rid is not None
    deadline = time.monotonic() + 15
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = http.get(f"/v1/responses/{rid}").json()
        if body.get("status") not in ("in_progress", None):
            break
        time.sleep(0.2)
    assert body["status"] == "cancelled", body
    validate("Response", body)
    messages = [o for o in body["output"] if o["type"] == "message"]
    assert messages and all(m["status"] == "incomplete" for m in messages), messages
    assert messages[0]["content"][0]["text"], messages  # the text shown so far is kept


def test_a_completed_response_keeps_its_messages_completed(http: httpx.Client) -> None:
    r = respond(http)
    assert r.status_code == 200 and r.json()["output"][0]["status"] == "completed", r.text


# ---------------------------------------------------------------- 4. the legacy function_call round


def test_a_legacy_function_call_and_function_message_are_a_tool_round(http: httpx.Client) -> None:
    u = uuid.uuid4().hex
    msgs = [
        {"role": "user", "content": f"legacy {u}"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "r1"},
    ]
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": msgs})
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    assert "r1" in r.json()["choices"][0]["message"]["content"]
    bad = [*msgs[:1], {"role": "assistant", "content": None, "function_call": {"name": "f"}}, msgs[2]]
    refused(
        http.post("/v1/chat/completions", json={"model": "assistant", "messages": bad}),
        "messages[1].function_call.arguments",
    )
    bad = [*msgs[:2], {"role": "function", "content": "r1"}]
    refused(http.post("/v1/chat/completions", json={"model": "assistant", "messages": bad}), "messages[2].name")
