"""/v1/responses fidelity fixes from an outside tester's findings (session 37, attacker C), through a
real `appserver serve` on loopback (agents on a loopback fake OpenAI upstream), httpx and the real
`openai` SDK, checked against OpenAI's API description (../shared/conformance).

1. The input items taken without being read for the model (`reasoning`, `mcp_call`,
   `mcp_approval_request`, `mcp_list_tools`) were accepted whatever they held: their fields are
   now checked as OpenAI's description types them, down to their entries (400 naming the path),
   and this server's own output items, resent as the SDK dumps them, still pass.
2. An item with `"type": ""` (or a number) was read as a message: only a type left out (or null,
   an optional field not given) means one; those are refused naming `input[i].type`.
3. An unknown content part on /v1/responses was refused listing Chat's part names, with `param`
   `input[i].content`: it now lists the Responses part types and names `…content[j].type` (chat
   lists its own); a function_call_output's parts are named `input[i].output[j]`.
4. `input_items` listed a resent assistant `refusal` part as `output_text` and dropped an
   `output_text`'s annotations: each part is listed as sent.
5. An `output_text`'s `annotations` and `logprobs` entries were not checked: now as OpenAI types
   them (an annotation by its `type`, a log probability's fields).
6. The Response object dropped accepted fields: `reasoning.generate_summary` (and `context`,
   `mode`), a function tool's `output_schema` / `defer_loading` / `allowed_callers`,
   `prompt_cache_retention`: now echoed (non-stream, stream, GET).
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)


def upstream_model(req: RecordedRequest) -> Reply:
    """`CALL <tag>`: some reasoning, then a call of `clock`; anything else: `done` with reasoning."""
    last = (req.json or {}).get("messages", [{}])[-1]
    text = last.get("content") if isinstance(last.get("content"), str) else ""
    if last.get("role") == "user" and str(text).startswith("CALL "):
        call = tool_delta(0, id=f"call_{uuid.uuid4().hex[:12]}", name="clock", arguments="{}")
        chunks = [chunk(role="assistant", reasoning_content="thinking"), chunk(tool_calls=[call])]
        chunks.append(chunk(finish_reason="tool_calls"))
    else:
        chunks = [chunk(role="assistant", reasoning_content="so"), chunk(content="done"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse(chunks)])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s37c") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, policy in (("open", "clock=allow"), ("asker", "clock=ask")):
            made = run_cli(home, "agents", "create", "--name", name, "--model", "fake:m", "--tool", policy, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield sp


@pytest.fixture
def http(srv: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


@pytest.fixture
def client(srv: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def respond(http: httpx.Client, input_: Any, **fields: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": "open", "input": input_, **fields})


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    validate("Response", body)
    return body


def refused(r: httpx.Response, code: str, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return err


def around(item: Any) -> list[Any]:
    """A transcript with `item` at input[1]."""
    return [{"role": "user", "content": "q"}, item, {"role": "user", "content": f"b {uuid.uuid4().hex}"}]


# ---------------------------------------------------------------- 1. items taken unread


RS = {"type": "reasoning", "id": "rs_1", "summary": []}
MCP = {"type": "mcp_call", "id": "mcp_1", "server_label": "open", "name": "clock", "arguments": "{}"}
ASK = {**MCP, "type": "mcp_approval_request", "id": "mcpr_1"}
LIST = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "open", "tools": []}
TOOL = {"name": "clock", "input_schema": {"type": "object"}}

MALFORMED = [
    ({"type": "reasoning", "id": "rs_1"}, "missing_required_parameter", "input[1].summary"),
    ({"type": "reasoning", "summary": []}, "missing_required_parameter", "input[1].id"),
    ({**RS, "summary": "x"}, "invalid_type", "input[1].summary"),
    ({**RS, "summary": [5]}, "invalid_type", "input[1].summary[0]"),
    ({**RS, "summary": [{"type": "summary_text", "text": 5}]}, "invalid_type", "input[1].summary[0].text"),
    ({**RS, "summary": [{"type": "summary_text"}]}, "missing_required_parameter", "input[1].summary[0].text"),
    ({**RS, "summary": [{"type": "text", "text": "a"}]}, "invalid_value", "input[1].summary[0].type"),
    ({**RS, "content": [{"type": "reasoning_text"}]}, "missing_required_parameter", "input[1].content[0].text"),
    ({**RS, "content": "x"}, "invalid_type", "input[1].content"),
    ({**RS, "encrypted_content": 5}, "invalid_type", "input[1].encrypted_content"),
    ({"type": "mcp_call"}, "missing_required_parameter", "input[1].id"),
    ({**MCP, "arguments": 5}, "invalid_type", "input[1].arguments"),
    ({k: v for k, v in MCP.items() if k != "server_label"}, "missing_required_parameter", "input[1].server_label"),
    ({**MCP, "name": None}, "invalid_type", "input[1].name"),
    ({**MCP, "output": 5}, "invalid_type", "input[1].output"),
    ({**MCP, "approval_request_id": 5}, "invalid_type", "input[1].approval_request_id"),
    ({**MCP, "error": "boom"}, "invalid_type", "input[1].error"),
    ({**MCP, "error": {"type": "bogus"}}, "invalid_value", "input[1].error.type"),
    ({**MCP, "error": {"type": "http_error", "code": 500}}, "missing_required_parameter", "input[1].error.message"),
    ({**ASK, "server_label": 7, "arguments": {}}, "invalid_type", "input[1].server_label"),
    ({**ASK, "arguments": {}}, "invalid_type", "input[1].arguments"),
    ({k: v for k, v in ASK.items() if k != "name"}, "missing_required_parameter", "input[1].name"),
    ({**LIST, "tools": "x"}, "invalid_type", "input[1].tools"),
    ({k: v for k, v in LIST.items() if k != "tools"}, "missing_required_parameter", "input[1].tools"),
    ({**LIST, "tools": [{"name": "clock"}]}, "missing_required_parameter", "input[1].tools[0].input_schema"),
    ({**LIST, "tools": [{**TOOL, "description": 5}]}, "invalid_type", "input[1].tools[0].description"),
    ({**LIST, "error": 5}, "invalid_type", "input[1].error"),
]


@pytest.mark.parametrize(("item", "code", "param"), MALFORMED)
def test_an_item_taken_unread_is_checked_as_openai_types_it(
    http: httpx.Client, item: dict[str, Any], code: str, param: str
) -> None:
    refused(respond(http, around(item)), code, param)


def test_well_formed_items_taken_unread_pass(http: httpx.Client) -> None:
    """Optional fields null (as the SDK dumps an item) or filled, every entry type: accepted."""
    items = [
        {**RS, "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": None, "status": None},
        {**RS, "content": [{"type": "reasoning_text", "text": "t"}], "encrypted_content": "e"},
        {**MCP, "output": None, "error": None, "approval_request_id": None, "status": "completed"},
        {**MCP, "error": {"type": "mcp_protocol_error", "code": -32600, "message": "m"}, "status": "failed"},
        {**MCP, "error": {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": "x"}]}},
        ASK,
        {**LIST, "tools": [TOOL, {**TOOL, "description": None, "annotations": {"readOnlyHint": True}}], "error": None},
    ]
    for item in items:
        ok(respond(http, around(item)))
    # a malformed one among them is refused at its place
    refused(
        respond(http, around({"type": "reasoning", "id": "rs_1"})), "missing_required_parameter", "input[1].summary"
    )


def test_this_servers_own_output_items_resent_pass_and_their_required_fields_are_required(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """Resent as the SDK dumps them (`input += response.output`): 200; each with a required field
    taken out: 400 naming it."""
    ran = client.responses.create(model="open", input=f"CALL {uuid.uuid4().hex}")
    asked = client.responses.create(model="asker", input=f"CALL {uuid.uuid4().hex}")
    types = [o.type for o in ran.output] + [o.type for o in asked.output]
    assert {"reasoning", "mcp_call", "mcp_approval_request", "message"} <= set(types), types
    history: list[Any] = [{"role": "user", "content": "CALL x"}]
    history += [o.model_dump(mode="json") for o in ran.output]
    history += [{"role": "user", "content": "CALL y"}]
    history += [o.model_dump(mode="json") for o in asked.output if o.type == "mcp_approval_request"]
    again = client.responses.create(model="open", input=[*history, {"role": "user", "content": "next"}])
    assert again.status == "completed", again
    required = {
        "reasoning": ("id", "summary"),
        "mcp_call": ("id", "server_label", "name", "arguments"),
        "mcp_approval_request": ("id", "server_label", "name", "arguments"),
    }
    checked = 0
    for i, item in enumerate(history):
        for name in required.get(item.get("type"), ()):
            broken = copy.deepcopy(history)
            del broken[i][name]
            refused(
                respond(http, [*broken, {"role": "user", "content": "n"}]),
                "missing_required_parameter",
                f"input[{i}].{name}",
            )
            checked += 1
    assert checked >= 10


# ---------------------------------------------------------------- 2. an empty or null type


@pytest.mark.parametrize(("kind", "code"), [("", "invalid_value"), (5, "invalid_type")])
def test_a_given_type_must_name_one(http: httpx.Client, kind: Any, code: str) -> None:
    refused(respond(http, [{"type": kind, "role": "user", "content": "hi"}]), code, "input[0].type")
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    resent = [{"role": "user", "content": "a"}, call, {"type": kind, "call_id": "c1", "output": "r"}]
    refused(respond(http, resent), code, "input[2].type")
    # left out, or null (an optional field not given, as SDKs dump one), it is a message
    assert ok(respond(http, [{"role": "user", "content": "typeless"}]))["status"] == "completed"
    assert ok(respond(http, [{"type": None, "role": "user", "content": "typeless"}]))["status"] == "completed"


# ---------------------------------------------------------------- 3. an unknown part, named in the route's terms


def test_an_unknown_part_on_responses_lists_the_responses_part_types(http: httpx.Client) -> None:
    err = refused(
        respond(http, [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_video"}]}]),
        "unsupported_content_part",
        "input[0].content[1].type",
    )
    for name in ("input_text", "input_image", "input_file", "output_text", "refusal"):
        assert name in err["message"], err
    assert "image_url" not in err["message"] and "'text'" not in err["message"], err
    # in a function_call_output the parts are its `output`
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_video"}]}
    err = refused(
        respond(http, [{"role": "user", "content": "a"}, call, result]),
        "unsupported_content_part",
        "input[2].output[0].type",
    )
    assert "input_text" in err["message"], err
    refused(
        respond(http, [{"role": "user", "content": "a"}, call, {**result, "output": [{"type": "input_text"}]}]),
        "missing_required_parameter",
        "input[2].output[0].text",
    )
    # instructions given as messages name the Responses types too
    instructions = [{"type": "message", "role": "system", "content": [{"type": "input_video"}]}]
    err = refused(
        respond(http, "hi", instructions=instructions), "unsupported_content_part", "instructions[0].content[0].type"
    )
    assert "input_text" in err["message"] and "image_url" not in err["message"], err
    # Chat's part types stay accepted here (a leniency)
    chat_parts = [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    assert ok(respond(http, [{"role": "user", "content": chat_parts}]))["status"] == "completed"


def test_an_unknown_part_on_chat_lists_chats_part_types(http: httpx.Client) -> None:
    body = {"model": "open", "messages": [{"role": "user", "content": [{"type": "input_video"}]}]}
    r = http.post("/v1/chat/completions", json=body)
    err = refused(r, "unsupported_content_part", "messages[0].content[0].type")
    assert "image_url" in err["message"] and "input_text" not in err["message"], err


# ---------------------------------------------------------------- 4. assistant parts listed as sent


def test_input_items_list_a_resent_assistant_messages_parts_as_sent(client: openai.OpenAI, http: httpx.Client) -> None:
    note = {"type": "url_citation", "url": "https://example.com", "title": "t", "start_index": 0, "end_index": 2}
    lp = {
        "token": "ok",
        "logprob": -0.5,
        "bytes": [111, 107],
        "top_logprobs": [{"token": "ok", "logprob": -0.5, "bytes": []}],
    }
    refusal = {"type": "refusal", "refusal": "I can't"}
    answer = {"type": "output_text", "text": "ok", "annotations": [note], "logprobs": [lp]}
    inp = [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [refusal]},
        {"type": "message", "role": "assistant", "content": [answer, {"type": "input_text", "text": "more"}]},
        {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "b"},
    ]
    body = ok(respond(http, inp))
    listed = [i.model_dump(mode="json") for i in client.responses.input_items.list(body["id"], order="asc")]
    assert listed[1]["content"] == [refusal]
    assert listed[2]["content"] == [answer, {"type": "output_text", "text": "more", "annotations": [], "logprobs": []}]
    assert listed[3]["content"] == [{"type": "output_text", "text": "plain", "annotations": [], "logprobs": []}]
    # a stored item referred to again is read as it was sent
    ref = [
        {"role": "user", "content": "a"},
        {"type": "item_reference", "id": listed[2]["id"]},
        {"role": "user", "content": "c"},
    ]
    again = ok(respond(http, ref))
    relisted = http.get(f"/v1/responses/{again['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert relisted[1]["content"] == listed[2]["content"]


# ---------------------------------------------------------------- 5. annotations and logprobs entries


LOGPROB = {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}
BAD_ENTRIES = [
    ({"annotations": [5]}, "invalid_type", "annotations[0]"),
    ({"annotations": [{"type": "bogus"}]}, "invalid_value", "annotations[0].type"),
    ({"annotations": [{"url": "https://example.com"}]}, "missing_required_parameter", "annotations[0].type"),
    (
        {"annotations": [{"type": "url_citation", "url": "https://e.com", "title": "t", "start_index": 0}]},
        "missing_required_parameter",
        "annotations[0].end_index",
    ),
    (
        {"annotations": [{"type": "file_citation", "file_id": "f", "index": "0", "filename": "a"}]},
        "invalid_type",
        "annotations[0].index",
    ),
    ({"annotations": [{"type": "file_path", "file_id": 5, "index": 0}]}, "invalid_type", "annotations[0].file_id"),
    (
        {"annotations": [{"type": "container_file_citation", "file_id": "f"}]},
        "missing_required_parameter",
        "annotations[0].container_id",
    ),
    ({"logprobs": ["x"]}, "invalid_type", "logprobs[0]"),
    ({"logprobs": [{**LOGPROB, "logprob": "x"}]}, "invalid_type", "logprobs[0].logprob"),
    (
        {"logprobs": [{k: v for k, v in LOGPROB.items() if k != "bytes"}]},
        "missing_required_parameter",
        "logprobs[0].bytes",
    ),
    ({"logprobs": [{**LOGPROB, "bytes": ["a"]}]}, "invalid_type", "logprobs[0].bytes[0]"),
    (
        {"logprobs": [{**LOGPROB, "top_logprobs": [{"token": "a", "logprob": 0}]}]},
        "missing_required_parameter",
        "logprobs[0].top_logprobs[0].bytes",
    ),
    (
        {"logprobs": [{**LOGPROB, "top_logprobs": [{"token": 1, "logprob": 0, "bytes": []}]}]},
        "invalid_type",
        "logprobs[0].top_logprobs[0].token",
    ),
]


@pytest.mark.parametrize(("extra", "code", "path"), BAD_ENTRIES)
def test_an_output_text_entry_is_checked_as_openai_types_it(
    http: httpx.Client, extra: dict[str, Any], code: str, path: str
) -> None:
    part = {"type": "output_text", "text": "ok", **extra}
    refused(
        respond(http, around({"type": "message", "role": "assistant", "content": [part]})),
        code,
        f"input[1].content[0].{path}",
    )


def test_well_formed_annotations_and_logprobs_pass(http: httpx.Client) -> None:
    notes = [
        {"type": "file_citation", "file_id": "f", "index": 0, "filename": "a.txt"},
        {"type": "url_citation", "url": "https://e.com", "title": "t", "start_index": 0, "end_index": 2},
        {
            "type": "container_file_citation",
            "container_id": "c",
            "file_id": "f",
            "start_index": 0,
            "end_index": 1,
            "filename": "a",
        },
        {"type": "file_path", "file_id": "f", "index": 1},
    ]
    part = {"type": "output_text", "text": "ok", "annotations": notes, "logprobs": [LOGPROB]}
    ok(respond(http, around({"type": "message", "role": "assistant", "content": [part]})))
    bad = {**part, "annotations": [*notes, {"type": "bogus"}]}
    refused(
        respond(http, around({"type": "message", "role": "assistant", "content": [bad]})),
        "invalid_value",
        "input[1].content[0].annotations[4].type",
    )


# ---------------------------------------------------------------- 6. the Response object echoes what it accepted


def test_the_response_echoes_the_fields_it_accepted(http: httpx.Client) -> None:
    fn = {
        "type": "function",
        "name": "f",
        "parameters": {"type": "object", "properties": {}},
        "strict": False,
        "output_schema": {"type": "object"},
        "defer_loading": True,
        "allowed_callers": ["direct"],
    }
    sent = {
        "reasoning": {"generate_summary": "detailed", "context": "all_turns", "mode": "standard"},
        "tools": [fn],
        "prompt_cache_retention": "24h",
    }
    body = ok(respond(http, "hi", **sent))
    stream = http.post("/v1/responses", json={"model": "open", "input": "hi", "stream": True, **sent})
    events = [json.loads(p) for p in sse_payloads(sse_lines(stream.content))]
    got = http.get(f"/v1/responses/{body['id']}").json()
    shown = [body, got, *(e["response"] for e in events if e["type"] in ("response.created", "response.completed"))]
    assert len(shown) == 4
    for b in shown:
        validate("Response", b)
        assert b["reasoning"] == {"effort": None, "summary": None, **sent["reasoning"]}, b["reasoning"]
        assert {k: b["tools"][0][k] for k in ("output_schema", "defer_loading", "allowed_callers")} == {
            "output_schema": {"type": "object"},
            "defer_loading": True,
            "allowed_callers": ["direct"],
        }, b["tools"]
        assert b["prompt_cache_retention"] == "24h"
    # not sent: not shown (or null, for prompt_cache_retention as for prompt_cache_key)
    plain = ok(
        respond(http, "hi", tools=[{k: v for k, v in fn.items() if k in ("type", "name", "parameters", "strict")}])
    )
    assert plain["reasoning"] == {"effort": None, "summary": None}
    assert not {"output_schema", "defer_loading", "allowed_callers"} & set(plain["tools"][0])
    assert plain["prompt_cache_retention"] is None
