"""/v1/responses request keys and echoed sampling, from an outside tester's findings (session 27),
through a real `appserver serve` on loopback, httpx and the real `openai` SDK, agents on a loopback
fake OpenAI upstream that records what each model call got.

3. An unknown or misspelt key inside `tools[i]` (a function tool's `paramters`, Chat's nested
   `function`), inside an input item of any type (`input[0].foo`) or a content part
   (`input[0].content[0].foo`), and a value outside an item's enum (`input[0].status: "bogus"`)
   are a 400 naming the path (they were dropped or taken). Items the SDKs send back (`input +=
   response.output`, with their `id`, `status`, `annotations`, `logprobs`, `summary`, …) still pass.
4. The Response object echoes the sampling the model calls got: an agent's own `temperature`,
   `top_p`, `max_tokens` when the request gives none or the agent does not let it
   (`allow_overrides=false`), not 1.0 / 1.0 / null or the request's ignored values; in the body,
   each stream event's response and `GET`, and for a request that resumed a paused turn.
"""

from __future__ import annotations

import json
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.openai_schema import document, require_conformance, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}


def upstream_model(req: RecordedRequest) -> Reply:
    """`CALL <name> <json> …`: a call of that tool; `THINK …`: reasoning, then text; else text."""
    last = (req.json or {}).get("messages", [{}])[-1]
    content = last.get("content")
    text = " ".join(p.get("text", "") for p in content) if isinstance(content, list) else str(content or "")
    if last.get("role") == "user" and text.startswith("CALL "):
        _, name, args, _ = text.split(" ", 3)
        call = tool_delta(0, id=f"call_{uuid.uuid4().hex[:12]}", name=name, arguments=args)
        chunks = [chunk(role="assistant", tool_calls=[call]), chunk(finish_reason="tool_calls")]
    elif text.startswith("THINK"):
        chunks = [
            chunk(role="assistant", reasoning_content="hmm"),
            chunk(content="thought"),
            chunk(finish_reason="stop"),
        ]
    else:
        chunks = [chunk(role="assistant", content=f"done: {text[:40]}"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse(chunks)])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI) -> None:
        self.sp, self.fake = sp, fake

    def sent(self, tag: str) -> list[dict[str, Any]]:
        """The model calls of the request whose input carried `tag`."""
        return [r.json for r in self.fake.requests if r.json and tag in json.dumps(r.json)]


TUNED = ("--param", "temperature=0.2", "--param", "top_p=0.3", "--param", "max_tokens=77")
AGENTS = {
    "plain": ("--tool", "clock=allow"),
    "asker": ("--tool", "clock=ask", *TUNED),
    "tuned": TUNED,
    "fixed": (*TUNED, "--param", "reasoning_effort=low", "--param", "allow_overrides=false"),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s27b_fields") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, args in AGENTS.items():
            made = run_cli(home, "agents", "create", "--name", name, "--model", "fake:m", *args, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake)


@pytest.fixture
def http(env: Env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.sp.url, timeout=30) as c:
        yield c


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=env.sp.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def body_of(response: Any) -> dict[str, Any]:
    """An SDK Response as the server sent it (the SDK's own defaults left out)."""
    dumped: dict[str, Any] = response.model_dump(mode="json", exclude_unset=True)
    return dumped


# ---------------------------------------------------------------- 3. unknown keys, enums


def spec_keys(*names: str) -> set[str]:
    """The properties (and required keys) of schemas of OpenAI's API description."""
    schemas = document("openai-openapi.json")["components"]["schemas"]
    return {k for n in names for k in (*schemas[n].get("properties", {}), *schemas[n].get("required", []))}


def sdk_keys(param: Any) -> set[str]:
    """The keys the openai SDK's TypedDict `param` may send."""
    return set(typing.get_type_hints(param))


def test_the_key_tables_are_openais_description_and_the_sdks() -> None:
    """Every key OpenAI's description (or the openai SDK) gives a tool, an input item or a content
    part is known, and no other: the server's literals are checked against both."""
    require_conformance()
    from openai.types import responses as sdk
    from openai.types.responses import response_input_param as sdk_items
    from openai.types.responses import tool_param as sdk_tools

    from appserver.http.responses import FUNCTION_TOOL_KEYS, ITEM_KEYS, MCP_FILTER_KEYS, MCP_TOOL_KEYS, PART_KEYS

    assert set(FUNCTION_TOOL_KEYS) == spec_keys("FunctionTool") | sdk_keys(sdk.FunctionToolParam)
    assert set(MCP_TOOL_KEYS) == spec_keys("MCPTool") == sdk_keys(sdk_tools.Mcp)
    assert set(MCP_FILTER_KEYS) == spec_keys("MCPToolFilter") == sdk_keys(sdk_tools.McpAllowedToolsMcpToolFilter)
    expected = {
        "message": spec_keys("EasyInputMessage", "InputMessage", "OutputMessage"),
        "function_call": spec_keys("FunctionToolCall") | sdk_keys(sdk.ResponseFunctionToolCallParam),
        "function_call_output": spec_keys("FunctionCallOutputItemParam"),
        "mcp_approval_response": spec_keys("MCPApprovalResponse"),
        "mcp_approval_request": spec_keys("MCPApprovalRequest"),
        "mcp_call": spec_keys("MCPToolCall"),
        "reasoning": spec_keys("ReasoningItem"),
        "mcp_list_tools": spec_keys("MCPListTools"),
        "item_reference": spec_keys("ItemReferenceParam"),
    }
    assert {k: set(v) for k, v in ITEM_KEYS.items()} == expected
    for param in (sdk.EasyInputMessageParam, sdk.ResponseOutputMessageParam, sdk_items.Message):
        assert sdk_keys(param) <= set(ITEM_KEYS["message"])
    for kind, param in (
        ("function_call_output", sdk_items.FunctionCallOutput),
        ("mcp_approval_response", sdk_items.McpApprovalResponse),
        ("mcp_call", sdk_items.McpCall),
        ("reasoning", sdk.ResponseReasoningItemParam),
    ):
        assert sdk_keys(param) <= set(ITEM_KEYS[kind]), kind
    parts = {
        "input_text": spec_keys("InputTextContent", "InputTextContentParam") | sdk_keys(sdk.ResponseInputTextParam),
        "input_image": spec_keys("InputImageContent", "InputImageContentParamAutoParam"),
        "input_file": spec_keys("InputFileContent", "InputFileContentParam"),
        "output_text": spec_keys("OutputTextContent") | sdk_keys(sdk.ResponseOutputTextParam),
        "refusal": spec_keys("RefusalContent"),
    }
    assert {k: set(PART_KEYS[k]) for k in parts} == parts
    assert sdk_keys(sdk.ResponseInputImageParam) <= parts["input_image"]
    assert sdk_keys(sdk.ResponseInputFileParam) <= parts["input_file"]


USER = {"role": "user", "content": "hi"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [{**FN, "paramters": {"type": "object"}}]}, "unknown_parameter", "tools[0].paramters"),
    ({"tools": [{**FN, "function": {"name": "f", "parameters": {}}}]}, "unknown_parameter", "tools[0].function"),
    ({"tools": [FN, {**FN, "name": "g", "bogus": 1}]}, "unknown_parameter", "tools[1].bogus"),
    ({"tools": [{**FN, "defer_loading": "no"}]}, "invalid_type", "tools[0].defer_loading"),
    ({"tools": [{**FN, "output_schema": 5}]}, "invalid_type", "tools[0].output_schema"),
    ({"input": [{**USER, "foo": 1}]}, "unknown_parameter", "input[0].foo"),
    ({"input": [{**USER, "type": "message", "status": "bogus"}]}, "invalid_value", "input[0].status"),
    ({"input": [{**USER, "phase": "bogus"}]}, "invalid_value", "input[0].phase"),
    ({"input": [{**USER, "id": 5}]}, "invalid_type", "input[0].id"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "foo": 1}]}]},
        "unknown_parameter",
        "input[0].content[0].foo",
    ),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b", "x": 1}],
                }
            ]
        },
        "unknown_parameter",
        "input[0].content[1].x",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png", "foo": 1}]}]},
        "unknown_parameter",
        "input[0].content[0].foo",
    ),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_file", "file_data": "QQ==", "filename": "a.txt", "detail": "huge"}],
                }
            ]
        },
        "invalid_value",
        "input[0].content[0].detail",
    ),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi", "prompt_cache_breakpoint": {"mode": "x"}}],
                }
            ]
        },
        "invalid_value",
        "input[0].content[0].prompt_cache_breakpoint.mode",
    ),
    (
        {
            "input": [
                {"role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": [], "foo": 1}]},
                USER,
            ]
        },
        "unknown_parameter",
        "input[0].content[0].foo",
    ),
    (
        {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x", "logprobs": 5}]}, USER]},
        "invalid_type",
        "input[0].content[0].logprobs",
    ),
    ({"input": [USER, {**CALL, "foo": 1}, OUTPUT]}, "unknown_parameter", "input[1].foo"),
    ({"input": [USER, {**CALL, "status": "done"}, OUTPUT]}, "invalid_value", "input[1].status"),
    ({"input": [USER, CALL, {**OUTPUT, "foo": 1}]}, "unknown_parameter", "input[2].foo"),
    (
        {"input": [USER, CALL, {**OUTPUT, "output": [{"type": "input_text", "text": "42", "foo": 1}]}]},
        "unknown_parameter",
        "input[2].output[0].foo",
    ),
    (
        {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "foo": 1}, USER]},
        "unknown_parameter",
        "input[0].foo",
    ),
    (
        {
            "input": [
                USER,
                {
                    "type": "mcp_call",
                    "id": "mcp_1",
                    "server_label": "s",
                    "name": "clock",
                    "arguments": "{}",
                    "status": "bogus",
                },
            ]
        },
        "invalid_value",
        "input[1].status",
    ),
    (
        {
            "input": [
                USER,
                {
                    "type": "mcp_approval_request",
                    "id": "mcpr_1",
                    "server_label": "s",
                    "name": "c",
                    "arguments": "{}",
                    "foo": 1,
                },
            ]
        },
        "unknown_parameter",
        "input[1].foo",
    ),
    (
        {"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True, "foo": 1}]},
        "unknown_parameter",
        "input[0].foo",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1", "foo": 1}]}, "unknown_parameter", "input[0].foo"),
    (
        {"input": [{"type": "mcp_list_tools", "id": "x", "server_label": "s", "tools": [], "foo": 1}, USER]},
        "unknown_parameter",
        "input[0].foo",
    ),
]


@pytest.mark.parametrize(("fields", "code", "param"), REFUSED, ids=[f"{p}:{c}" for _, c, p in REFUSED])
def test_unknown_keys_and_values_inside_tools_items_and_parts_are_refused(
    env: Env, http: httpx.Client, fields: dict[str, Any], code: str, param: str
) -> None:
    tag = uuid.uuid4().hex
    r = http.post("/v1/responses", json={"model": "plain", "input": f"hi {tag}", "user": tag, **fields})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert "None" not in err["message"], err
    assert env.sent(tag) == []  # refused before any model call


def test_the_sdk_round_trip_of_every_output_item_passes(env: Env, client: openai.OpenAI) -> None:
    """`input += response.output`: messages (output_text with annotations and logprobs), reasoning
    (summary, content), mcp_call (error, approval_request_id) and function_call items, with ids and
    statuses, go back as they came."""
    mcp: Any = [{"type": "mcp", "server_label": "plain", "server_url": "http://unused.invalid"}, FN]
    history: list[Any] = []
    for text in ("THINK first", "CALL clock {} x", "plain text"):
        history.append({"role": "user", "content": f"{text} {uuid.uuid4().hex}"})
        done = client.responses.create(model="plain", input=history, tools=mcp)
        validate("Response", body_of(done))
        history += done.output
    types = [getattr(i, "type", None) for i in history if not isinstance(i, dict)]
    assert types == ["reasoning", "message", "mcp_call", "message", "message"], types
    history.append({"role": "user", "content": f"CALL f {{}} {uuid.uuid4().hex}"})
    asked = client.responses.create(model="plain", input=history, tools=mcp)
    assert [o.type for o in asked.output] == ["function_call"]
    call = asked.output[0]
    assert call.type == "function_call"
    history += asked.output
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
    answered = client.responses.create(model="plain", input=history, tools=mcp)
    assert answered.output_text.startswith("done: ")
    # the items input_items lists go back too (their ids, statuses and content parts), with the reply
    listed = [
        i.model_dump(mode="json", exclude_unset=True)
        for i in client.responses.input_items.list(answered.id, order="asc")
    ]
    again = client.responses.create(
        model="plain",
        input=[*listed, *answered.output, {"role": "user", "content": f"more {uuid.uuid4().hex}"}],
        tools=mcp,
    )
    assert again.status == "completed"


def test_a_stateless_approval_sent_back_from_the_sdk_passes(client: openai.OpenAI) -> None:
    user: Any = {"role": "user", "content": f"CALL clock {{}} {uuid.uuid4().hex}"}
    first = client.responses.create(model="asker", input=[user])
    request = first.output[0]
    assert request.type == "mcp_approval_request"
    answer: Any = {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}
    done = client.responses.create(model="asker", input=[user, request, answer])
    assert done.output[0].type == "mcp_call" and done.output[0].status == "completed"


# ---------------------------------------------------------------- 4. the sampling echoed


def sampling(body: dict[str, Any]) -> tuple[Any, Any, Any]:
    return body["temperature"], body["top_p"], body["max_output_tokens"]


def upstream_sampling(sent: dict[str, Any]) -> tuple[Any, Any, Any]:
    return sent.get("temperature"), sent.get("top_p"), sent.get("max_tokens", sent.get("max_completion_tokens"))


ECHOED = [
    ("tuned", {}, (0.2, 0.3, 77)),
    ("tuned", {"temperature": 0.9, "max_output_tokens": 500}, (0.9, 0.3, 500)),
    ("fixed", {"temperature": 0.9, "top_p": 0.5, "max_output_tokens": 500}, (0.2, 0.3, 77)),
    ("plain", {}, (1.0, 1.0, None)),  # nothing sent: OpenAI's defaults, as before
    ("plain", {"temperature": 0.5, "top_p": 0.25, "max_output_tokens": 9}, (0.5, 0.25, 9)),
]


@pytest.mark.parametrize(("model", "fields", "used"), ECHOED, ids=[f"{m}-{json.dumps(f)}" for m, f, _ in ECHOED])
def test_the_response_echoes_the_sampling_the_model_got(
    env: Env, http: httpx.Client, model: str, fields: dict[str, Any], used: tuple[Any, Any, Any]
) -> None:
    tag = uuid.uuid4().hex
    body = http.post("/v1/responses", json={"model": model, "input": f"hi {tag}", **fields}).json()
    validate("Response", body)
    sent = env.sent(tag)
    assert len(sent) == 1
    nothing = model == "plain" and not fields  # nothing sent upstream: OpenAI's defaults echoed
    assert sampling(body) == used
    assert upstream_sampling(sent[0]) == ((None, None, None) if nothing else used)
    assert sampling(http.get(f"/v1/responses/{body['id']}").json()) == used

    tag = uuid.uuid4().hex
    with http.stream(
        "POST", "/v1/responses", json={"model": model, "input": f"hi {tag}", "stream": True, **fields}
    ) as r:
        events = [json.loads(p) for p in sse_payloads(list(r.iter_lines()))]
    shown = [sampling(e["response"]) for e in events if "response" in e]
    assert len(shown) >= 3 and set(shown) == {used}, shown  # created, in_progress, completed


def test_an_agent_that_keeps_its_sampling_echoes_its_reasoning_effort(env: Env, http: httpx.Client) -> None:
    tag = uuid.uuid4().hex
    fields = {"temperature": 0.9, "reasoning": {"effort": "high"}}
    body = http.post("/v1/responses", json={"model": "fixed", "input": f"hi {tag}", **fields}).json()
    validate("Response", body)
    assert env.sent(tag)[0]["reasoning_effort"] == "low"
    assert body["reasoning"]["effort"] == "low" and body["temperature"] == 0.2


def test_a_request_resuming_a_turn_echoes_the_sampling_its_own_calls_get(env: Env, client: openai.OpenAI) -> None:
    """Answers resume a paused turn, whose model calls after them get the sampling of the
    answering request (session 28: every request is its own model call, as on OpenAI; they kept
    the first request's): the agent's own where it gives none, and its Response says so."""
    tag = uuid.uuid4().hex
    first = client.responses.create(
        model="asker", input=f"CALL clock {{}} {tag}", temperature=0.6, max_output_tokens=55
    )
    assert (first.temperature, first.top_p, first.max_output_tokens) == (0.6, 0.3, 55)
    answer: Any = {"type": "mcp_approval_response", "approval_request_id": first.output[0].id, "approve": True}
    done = client.responses.create(model="asker", previous_response_id=first.id, input=[answer])
    assert done.output_text.startswith("done: ")
    sent = env.sent(tag)
    assert [upstream_sampling(s) for s in sent] == [(0.6, 0.3, 55), (0.2, 0.3, 77)]
    assert (done.temperature, done.top_p, done.max_output_tokens) == (0.2, 0.3, 77)
    assert sampling(client.responses.retrieve(done.id).model_dump(mode="json")) == (0.2, 0.3, 77)
