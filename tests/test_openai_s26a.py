"""OpenAI surface fixes from an outside tester's findings (session 26), through a real `appserver
serve` on loopback (echo agents) with httpx and the real `openai` SDK, checked against OpenAI's API
description (../shared/conformance).

1. Chat: `logit_bias` maps token ids (strings of digits) to integers from -100 to 100: a bias of
   another type is 400 `invalid_type`, one out of range `integer_above_max_value` /
   `integer_below_min_value`, both naming `logit_bias.<id>`; a key that is no token id is 400
   `invalid_value` naming `logit_bias`. A message's `name` (system, developer, user, assistant)
   is a string: another type is 400 `invalid_type` naming `messages[i].name`.
2. Responses: an unknown key inside a nested request object (`reasoning`, `text`, `text.format`,
   `stream_options`, `tool_choice`, `conversation`, `prompt_cache_options`, `moderation`,
   `context_management[i]`) is 400 `unknown_parameter` naming its path, as a top-level one is;
   their values are type-checked. `tool_choice` objects are type-checked on both routes.
3. Responses: an input item with neither `type` nor `role` is a message without its role (400
   `missing_required_parameter`, `input[0].role`); no error message shows Python's None.
4. An agent tool call that went through an approval request names it in its `mcp_call`
   (`approval_request_id` `mcpr_<call id>`): non-stream, streamed, `GET`; null otherwise.
"""

from __future__ import annotations

import json
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
    home = tmp_path_factory.mktemp("s26a") / "home"
    env = cli_env(home)
    for args in (("--name", "runs", "--tool", "clock=allow"), ("--name", "asks", "--tool", "clock=ask")):
        made = run_cli(home, "agents", "create", *args, env=env)
        assert made.code == 0, made.err
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


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": "runs", "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], **fields}
    return http.post("/v1/chat/completions", json=body)


def respond(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": "runs", "input": f"hi {uuid.uuid4().hex}", **fields})


def refused(r: httpx.Response, code: str, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    for python in ("None", "True", "False"):  # JSON is meant: null, true, false
        assert python not in err["message"], err
    return err


# ---------------------------------------------------------------- 1. chat: logit_bias, message names

LOGIT_BIAS_REFUSED = [
    ({"50256": "x"}, "invalid_type", "logit_bias.50256"),
    ({"50256": 0.5}, "invalid_type", "logit_bias.50256"),
    ({"50256": None}, "invalid_type", "logit_bias.50256"),
    ({"50256": True}, "invalid_type", "logit_bias.50256"),
    ({"50256": [1]}, "invalid_type", "logit_bias.50256"),
    ({"50256": 1000000}, "integer_above_max_value", "logit_bias.50256"),
    ({"50256": 101}, "integer_above_max_value", "logit_bias.50256"),
    ({"7": -101}, "integer_below_min_value", "logit_bias.7"),
    ({"abc": 1}, "invalid_value", "logit_bias"),
    ({"-1": 1}, "invalid_value", "logit_bias"),
    ({"1.5": 1}, "invalid_value", "logit_bias"),
    ({"": 1}, "invalid_value", "logit_bias"),
    ({"١٢": 1}, "invalid_value", "logit_bias"),  # digits, but not ASCII ones
    ([1], "invalid_type", "logit_bias"),
]


@pytest.mark.parametrize(
    ("bias", "code", "param"), LOGIT_BIAS_REFUSED, ids=[json.dumps(b) for b, _, _ in LOGIT_BIAS_REFUSED]
)
def test_chat_logit_bias_is_token_ids_to_integers_from_minus_100_to_100(
    http: httpx.Client, bias: Any, code: str, param: str
) -> None:
    refused(chat(http, logit_bias=bias), code, param)


def test_chat_logit_bias_within_openais_range_is_accepted(http: httpx.Client, client: openai.OpenAI) -> None:
    r = chat(http, logit_bias={"50256": -100, "1": 100, "0": 0, "2": 5.0})  # 5.0 is an integer in JSON Schema
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    done = client.chat.completions.create(
        model="runs", messages=[{"role": "user", "content": "biased"}], logit_bias={"50256": -100}
    )
    assert done.choices[0].message.content == "echo: biased"
    assert chat(http, logit_bias=None).status_code == 200


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
@pytest.mark.parametrize("name", [5, True, {"a": 1}, ["x"]])
def test_chat_message_names_are_strings(http: httpx.Client, role: str, name: Any) -> None:
    messages = [{"role": role, "content": "x", "name": name}, {"role": "user", "content": f"go {uuid.uuid4().hex}"}]
    refused(
        http.post("/v1/chat/completions", json={"model": "runs", "messages": messages}),
        "invalid_type",
        "messages[0].name",
    )


def test_chat_message_names_of_the_right_type_are_accepted(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="runs",
        messages=[
            {"role": "system", "content": "be brief", "name": "sys"},
            {"role": "developer", "content": "be kind", "name": "dev"},
            {"role": "user", "content": "hello", "name": "alice"},
            {"role": "assistant", "content": "echo: hello", "name": "bot", "refusal": None},
            {"role": "user", "content": f"named {uuid.uuid4().hex}", "name": "bob"},
        ],
    )
    assert done.choices[0].message.content is not None and done.choices[0].message.content.startswith("echo: named")


def test_chat_assistant_refusal_and_content_part_type_are_checked(http: httpx.Client) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": "x", "refusal": 5},
        {"role": "user", "content": "go"},
    ]
    refused(
        http.post("/v1/chat/completions", json={"model": "runs", "messages": messages}),
        "invalid_type",
        "messages[0].refusal",
    )
    messages = [{"role": "user", "content": [{"text": "no type"}]}]
    refused(
        http.post("/v1/chat/completions", json={"model": "runs", "messages": messages}),
        "missing_required_parameter",
        "messages[0].content[0].type",
    )
    messages = [{"role": "user", "content": [{"type": 5, "text": "x"}]}]
    refused(
        http.post("/v1/chat/completions", json={"model": "runs", "messages": messages}),
        "invalid_type",
        "messages[0].content[0].type",
    )


# ---------------------------------------------------------------- 2. nested objects: unknown keys, types

RESPONSES_NESTED_REFUSED = [
    ({"reasoning": {"bogus": 1}}, "unknown_parameter", "reasoning.bogus"),
    ({"reasoning": {"effort": "low", "bogus": 1}}, "unknown_parameter", "reasoning.bogus"),
    ({"text": {"bogus": 1}}, "unknown_parameter", "text.bogus"),
    ({"text": {"format": {"type": "text", "bogus": 1}}}, "unknown_parameter", "text.format.bogus"),
    ({"text": {"format": {"type": "json_object", "name": "x"}}}, "unknown_parameter", "text.format.name"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "bogus": 1}}},
        "unknown_parameter",
        "text.format.bogus",
    ),
    ({"stream": True, "stream_options": {"bogus": 1}}, "unknown_parameter", "stream_options.bogus"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "unknown_parameter", "stream_options.include_usage"),
    (
        {"tools": [RFN], "tool_choice": {"type": "function", "name": "f", "bogus": 1}},
        "unknown_parameter",
        "tool_choice.bogus",
    ),
    (
        {"tools": [RFN], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "unknown_parameter",
        "tool_choice.function",
    ),
    (
        {"tools": [RFN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [], "x": 1}},
        "unknown_parameter",
        "tool_choice.x",
    ),
    ({"tool_choice": {"type": "mcp", "server_label": "runs", "bogus": 1}}, "unknown_parameter", "tool_choice.bogus"),
    ({"conversation": {"id": "c", "bogus": 1}}, "unknown_parameter", "conversation.bogus"),
    ({"prompt_cache_options": {"bogus": 1}}, "unknown_parameter", "prompt_cache_options.bogus"),
    ({"prompt_cache_options": {"ttl": "1h"}}, "invalid_value", "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": 5}}, "invalid_type", "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"prewarm": "yes"}}, "invalid_type", "prompt_cache_options.prewarm"),
    ({"moderation": {"model": "m", "bogus": 1}}, "unknown_parameter", "moderation.bogus"),
    ({"moderation": {}}, "missing_required_parameter", "moderation.model"),
    ({"moderation": {"model": 5}}, "invalid_type", "moderation.model"),
    ({"moderation": {"model": "m", "policy": "x"}}, "invalid_type", "moderation.policy"),
    ({"context_management": [{"type": "compaction", "bogus": 1}]}, "unknown_parameter", "context_management[0].bogus"),
    ({"context_management": [5]}, "invalid_type", "context_management[0]"),
    ({"context_management": [{}]}, "missing_required_parameter", "context_management[0].type"),
    (
        {"context_management": [{"type": "compaction", "compact_threshold": 5}]},
        "integer_below_min_value",
        "context_management[0].compact_threshold",
    ),
    ({"tools": [RFN], "tool_choice": {"name": "f"}}, "missing_required_parameter", "tool_choice.type"),
    ({"tools": [RFN], "tool_choice": {"type": 5}}, "invalid_type", "tool_choice.type"),
    ({"tools": [RFN], "tool_choice": {"type": "function", "name": 5}}, "invalid_type", "tool_choice.name"),
    ({"tool_choice": {"type": "mcp", "server_label": 5}}, "invalid_type", "tool_choice.server_label"),
    ({"tool_choice": {"type": "mcp", "name": "clock"}}, "missing_required_parameter", "tool_choice.server_label"),
    ({"tool_choice": {"type": "mcp", "server_label": "runs", "name": 5}}, "invalid_type", "tool_choice.name"),
]


@pytest.mark.parametrize(
    ("fields", "code", "param"), RESPONSES_NESTED_REFUSED, ids=[p for _, _, p in RESPONSES_NESTED_REFUSED]
)
def test_responses_nested_objects_refuse_unknown_keys_and_wrong_types(
    http: httpx.Client, fields: dict[str, Any], code: str, param: str
) -> None:
    err = refused(respond(http, **fields), code, param)
    if code == "unknown_parameter":
        assert err["message"] == f"Unknown parameter: '{param}'.", err


CHAT_CHOICE_REFUSED = [
    ({"tools": [FN], "tool_choice": {"function": {"name": "f"}}}, "missing_required_parameter", "tool_choice.type"),
    ({"tools": [FN], "tool_choice": {"type": None}}, "invalid_type", "tool_choice.type"),
    (
        {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": 5}}},
        "invalid_type",
        "tool_choice.function.name",
    ),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": "f"}}, "invalid_type", "tool_choice.function"),
]


@pytest.mark.parametrize(("fields", "code", "param"), CHAT_CHOICE_REFUSED, ids=[p for _, _, p in CHAT_CHOICE_REFUSED])
def test_chat_tool_choice_objects_are_type_checked(
    http: httpx.Client, fields: dict[str, Any], code: str, param: str
) -> None:
    refused(chat(http, **fields), code, param)


def test_values_in_messages_are_shown_as_json(http: httpx.Client) -> None:
    err = refused(
        chat(
            http,
            tools=[FN],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function"}]}},
        ),
        "missing_required_parameter",
        "tool_choice.allowed_tools.tools[0].function",
    )
    assert "'tool_choice.allowed_tools.tools[0].function'" in err["message"], err
    err = refused(respond(http, input=[{"type": "web_search_call"}]), "unsupported_item_type", "input")
    assert "type 'web_search_call'" in err["message"], err


def test_valid_nested_objects_from_the_sdk_still_pass(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    done = client.responses.create(
        model="runs",
        input="nested",
        reasoning={"effort": "low", "summary": "auto", "generate_summary": None, "context": "auto", "mode": "standard"},
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}, "verbosity": "low"},
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}],
        tool_choice={"type": "function", "name": "f"},
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        context_management=[{"type": "compaction", "compact_threshold": 200000}],
        moderation={"model": "omni-moderation-latest", "policy": None},
    )
    validate("Response", done.model_dump(mode="json", exclude_unset=True, by_alias=True))
    stream = client.responses.create(
        model="runs", input="streamed", stream=True, stream_options={"include_obfuscation": False}
    )
    kinds = [e.type for e in stream]
    assert kinds[-1] == "response.completed", kinds
    chat_done = client.chat.completions.create(
        model="runs",
        messages=[{"role": "user", "content": "chat nested"}],
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
    )
    assert [c for c in chat_done][-1].usage is not None


# ---------------------------------------------------------------- 3. an input item without a type


@pytest.mark.parametrize("item", [{"content": "a"}, {"type": None, "content": "a"}])
def test_an_input_item_without_type_or_role_is_a_message_missing_its_role(http: httpx.Client, item: Any) -> None:
    refused(respond(http, input=[item]), "missing_required_parameter", "input[0].role")
    as_message = respond(http, input=[{"type": "message", "content": "a"}])
    refused(as_message, "missing_required_parameter", "input[0].role")


def test_an_input_item_with_a_role_and_no_type_is_still_a_message(http: httpx.Client) -> None:
    r = respond(http, input=[{"role": "user", "content": "typeless"}])
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == "echo: typeless"


# ---------------------------------------------------------------- 4. approval_request_id of an mcp_call


def _post(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    validate("Response", out)
    return out


def _one(output: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in output if o["type"] == kind]
    assert len(found) == 1, output
    return found[0]


@pytest.mark.parametrize("approve", [True, False])
def test_an_approved_or_denied_call_names_its_approval_request(http: httpx.Client, approve: bool) -> None:
    asked = _post(http, {"model": "asks", "input": "/call clock {}"})
    request = _one(asked["output"], "mcp_approval_request")
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": approve}
    done = _post(http, {"model": "asks", "previous_response_id": asked["id"], "input": [answer]})
    call = _one(done["output"], "mcp_call")
    assert call["id"] == "mcp_" + request["id"].removeprefix("mcpr_")
    assert call["status"] == ("completed" if approve else "failed"), call
    assert call["approval_request_id"] == request["id"], call
    kept = http.get(f"/v1/responses/{done['id']}")
    assert kept.status_code == 200, kept.text
    assert _one(kept.json()["output"], "mcp_call") == call
    items = http.get(f"/v1/responses/{done['id']}/input_items")
    assert items.status_code == 200, items.text
    assert [i["approval_request_id"] for i in items.json()["data"]] == [request["id"]]


def test_a_stateless_approval_names_its_request(http: httpx.Client) -> None:
    asked = _post(http, {"model": "asks", "input": "/call clock {}"})
    request = _one(asked["output"], "mcp_approval_request")
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    done = _post(http, {"model": "asks", "input": [{"role": "user", "content": "/call clock {}"}, request, answer]})
    assert _one(done["output"], "mcp_call")["approval_request_id"] == request["id"]


def test_a_streamed_approved_call_names_its_request_in_every_event(http: httpx.Client) -> None:
    asked = _post(http, {"model": "asks", "input": "/call clock {}"})
    request = _one(asked["output"], "mcp_approval_request")
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    r = http.post(
        "/v1/responses",
        json={"model": "asks", "previous_response_id": asked["id"], "input": [answer], "stream": True},
    )
    assert r.status_code == 200, r.text
    events = [json.loads(p) for p in sse_payloads(sse_lines(r.content))]
    for e in events:
        validate("ResponseStreamEvent", e)
    items = [e["item"] for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
    calls = [i for i in items if i["type"] == "mcp_call"]
    assert len(calls) == 2, items
    assert all(c["approval_request_id"] == request["id"] for c in calls), calls
    final = events[-1]
    assert final["type"] == "response.completed", final
    assert _one(final["response"]["output"], "mcp_call")["approval_request_id"] == request["id"]
    kept = http.get(f"/v1/responses/{final['response']['id']}")
    assert _one(kept.json()["output"], "mcp_call")["approval_request_id"] == request["id"]


def test_a_call_without_an_approval_names_none(http: httpx.Client, client: openai.OpenAI) -> None:
    ran = _post(http, {"model": "runs", "input": "/call clock {}"})
    call = _one(ran["output"], "mcp_call")
    assert call["status"] == "completed" and call["approval_request_id"] is None, call
    again = client.responses.create(model="runs", input="/call clock {}")
    assert [o.approval_request_id for o in again.output if o.type == "mcp_call"] == [None]
