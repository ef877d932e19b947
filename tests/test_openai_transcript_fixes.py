"""Fixes found by an outside tester of the OpenAI surface, through a real `appserver serve` with
httpx and the real `openai` SDK: approvals answered in parts, upstream streams cut off between two
events, idempotency replays of deleted responses, malformed earlier messages, error codes.

Agents: `ops` (echo, clock=ask and shell=ask) and `remote` (a loopback fake OpenAI upstream).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_sse, usage_chunk
from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

TWO_ASKS = '/call clock {}\n/call shell {"command":"echo hi"}'


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    require_conformance()
    with FakeOpenAI() as fake:
        home = tmp_path_factory.mktemp("fixes") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant`
        for args in (
            ("--name", "ops", "--tool", "clock=ask", "--tool", "shell=ask"),
            ("--name", "remote", "--model", "fake:m"),
        ):
            r = run_cli(home, "agents", "create", *args, "--json", env=env)
            assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def http(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv[0].url, timeout=30) as c:
        yield c


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def fake(srv: tuple[ServeProcess, FakeOpenAI]) -> FakeOpenAI:
    srv[1].requests.clear()
    srv[1]._replies.clear()
    return srv[1]


def kinds(response: dict[str, Any]) -> list[tuple[str, str]]:
    return [(o["type"], o.get("name", "")) for o in response["output"]]


def stream_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        body = r.read()
    events = [json.loads(p) for p in sse_payloads(sse_lines(body))]
    for e in events:
        validate("ResponseStreamEvent", e)
    return events


def error_of(r: httpx.Response) -> dict[str, Any]:
    validate("ErrorResponse", r.json())
    return dict(r.json()["error"])


# ---------------------------------------------------------------- 1. approvals answered in parts


def test_approvals_answered_one_at_a_time(http: httpx.Client) -> None:
    r1 = http.post("/v1/responses", json={"model": "ops", "input": TWO_ASKS}).json()
    clock, shell = (o for o in r1["output"] if o["type"] == "mcp_approval_request")
    assert (clock["name"], shell["name"]) == ("clock", "shell")
    r2 = http.post(
        "/v1/responses",
        json={
            "model": "ops",
            "previous_response_id": r1["id"],
            "input": [{"type": "mcp_approval_response", "approval_request_id": clock["id"], "approve": True}],
        },
    ).json()
    validate("Response", r2)
    # only the call still open is asked for; the approved one has not run yet (the turn waits)
    assert [(o["type"], o["id"]) for o in r2["output"]] == [("mcp_approval_request", shell["id"])]
    r3 = http.post(
        "/v1/responses",
        json={
            "model": "ops",
            "previous_response_id": r2["id"],
            "input": [{"type": "mcp_approval_response", "approval_request_id": shell["id"], "approve": True}],
        },
    ).json()
    validate("Response", r3)
    assert kinds(r3) == [("mcp_call", "clock"), ("mcp_call", "shell"), ("message", "")]
    calls = {o["name"]: o for o in r3["output"] if o["type"] == "mcp_call"}
    assert calls["clock"]["status"] == "completed" and calls["clock"]["output"]
    assert calls["shell"]["output"].strip() == "hi"


def test_approvals_answered_in_parts_streamed_and_stateless(http: httpx.Client) -> None:
    r1 = http.post("/v1/responses", json={"model": "ops", "input": TWO_ASKS}).json()
    clock, shell = (o for o in r1["output"] if o["type"] == "mcp_approval_request")
    deny_clock = {"type": "mcp_approval_response", "approval_request_id": clock["id"], "approve": False}
    events = stream_events(http, {"model": "ops", "previous_response_id": r1["id"], "input": [deny_clock]})
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["id"]) for i in added] == [("mcp_approval_request", shell["id"])]
    assert events[-1]["type"] == "response.completed"
    # a stateless client resends everything: the answer given before is history, not new
    history = [{"role": "user", "content": TWO_ASKS}, *r1["output"], deny_clock]
    approve_shell = {"type": "mcp_approval_response", "approval_request_id": shell["id"], "approve": True}
    events = stream_events(http, {"model": "ops", "input": [*history, approve_shell]})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("name")) for i in done] == [
        ("mcp_call", "clock"),
        ("mcp_call", "shell"),
        ("message", None),
    ]
    assert done[0]["status"] == "failed" and done[0]["error"]  # the denied call
    assert events[-1]["type"] == "response.completed"


# ---------------------------------------------------------------- 2. an upstream stream cut off between events


def test_upstream_stream_cut_off_between_events_fails_the_turn(http: httpx.Client, fake: FakeOpenAI) -> None:
    cut_off = openai_sse([chunk(role="assistant", content="The answer is: first half of")], done=False)
    fake.script(cut_off)
    r = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "q"}]})
    assert r.status_code == 502 and error_of(r)["code"] == "upstream_unreachable"
    assert r.headers["x-should-retry"] == "false"
    fake.script(cut_off)
    r = http.post("/v1/responses", json={"model": "remote", "input": "q"})
    body = r.json()
    validate("Response", body)
    assert body["status"] == "failed" and body["error"]["code"] == "server_error"
    # a stream that sent [DONE] (no finish_reason) ended as it meant to
    fake.script(openai_sse([chunk(role="assistant", content="whole"), usage_chunk(3, 1)]))
    r = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "q2"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- 3. Idempotency-Key replays after DELETE


@pytest.mark.parametrize("stream", [False, True])
def test_a_deleted_response_is_not_replayed(http: httpx.Client, stream: bool) -> None:
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    body = {"model": "assistant", "input": f"my secret text {uuid.uuid4().hex}", "stream": stream}
    first = http.post("/v1/responses", json=body, headers=key)
    assert first.status_code == 200
    rid = first.json()["id"] if not stream else json.loads(sse_payloads(sse_lines(first.content))[0])["response"]["id"]
    again = http.post("/v1/responses", json=body, headers=key)
    assert again.headers["idempotent-replayed"] == "true" and rid in again.text  # replayed before the delete
    assert http.delete(f"/v1/responses/{rid}").status_code == 200
    for _ in range(2):
        replay = http.post("/v1/responses", json=body, headers=key)
        assert replay.status_code == 404 and "secret" not in replay.text
        err = error_of(replay)
        assert (err["code"], err["param"]) == ("response_not_found", "Idempotency-Key") and rid in err["message"]
        assert replay.headers["x-conversation-id"] == first.headers["x-conversation-id"]


def test_a_store_false_response_replays_under_its_key(http: httpx.Client) -> None:
    """The documented exception: the key keeps its answer, the response store does not."""
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    body = {"model": "assistant", "input": "not stored", "store": False}
    first = http.post("/v1/responses", json=body, headers=key)
    assert http.get(f"/v1/responses/{first.json()['id']}").status_code == 404
    again = http.post("/v1/responses", json=body, headers=key)
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"


def test_a_response_deleted_while_it_streams_is_not_replayed(http: httpx.Client) -> None:
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    body = {"model": "assistant", "input": "/slow 8", "stream": True}
    with http.stream("POST", "/v1/responses", json=body, headers=key) as r:
        lines = r.iter_lines()
        rid = next(json.loads(line[len("data: ") :])["response"]["id"] for line in lines if line.startswith("data: "))
        assert http.delete(f"/v1/responses/{rid}").status_code == 200
        assert any("response.completed" in line for line in lines)  # the stream ran to its end
    replay = http.post("/v1/responses", json=body, headers=key)
    assert replay.status_code == 404 and error_of(replay)["code"] == "response_not_found"


# ---------------------------------------------------------------- 4. malformed earlier messages


RECALL = {"role": "user", "content": "/recall"}
CHAT_HISTORY_REFUSED = [
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "system", "content": None}], "messages[0].content", "invalid_type"),
    (
        [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{}]}],
        "messages[1].tool_calls[0].id",
        "missing_required_parameter",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": 1}}],
            },
            {"role": "tool", "tool_call_id": "a", "content": "r"},
        ],
        "messages[1].tool_calls[0].function.arguments",
        "invalid_type",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "7", "content": "r"},
        ],
        "messages[1].tool_calls[0].id",
        "invalid_type",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "u", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        ],
        "messages",
        "tool_calls_unanswered",
    ),
]


@pytest.mark.parametrize(("history", "param", "code"), CHAT_HISTORY_REFUSED)
def test_chat_refuses_malformed_earlier_messages(http: httpx.Client, history: list[Any], param: str, code: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": [*history, RECALL]})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, code), err


def test_chat_keeps_what_real_clients_send(client: openai.OpenAI) -> None:
    """content null (or absent) with tool_calls, and empty-string content: as openai-agents,
    langchain, litellm and pydantic-ai send them."""
    call = {"id": "call_k1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    for assistant in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ):
        c = client.chat.completions.create(
            model="assistant",
            messages=[
                {"role": "system", "content": ""},
                {"role": "user", "content": f"weather {uuid.uuid4().hex}"},
                assistant,  # type: ignore[list-item]
                {"role": "tool", "tool_call_id": "call_k1", "content": "sunny"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "thanks"},
            ],
        )
        assert c.choices[0].message.content == "echo: thanks"


RESPONSES_HISTORY_REFUSED = [
    ([{"type": "message", "role": "user"}], "input[0].content", "missing_required_parameter"),
    ([{"role": "assistant", "content": None}], "input[0].content", "invalid_type"),
    (
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}],
        "input[0].arguments",
        "invalid_type",
    ),
    (
        [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
        "input",
        "tool_calls_unanswered",
    ),
]


@pytest.mark.parametrize(("history", "param", "code"), RESPONSES_HISTORY_REFUSED)
def test_responses_refuses_malformed_earlier_items(
    http: httpx.Client, history: list[Any], param: str, code: str
) -> None:
    r = http.post("/v1/responses", json={"model": "assistant", "input": [*history, RECALL]})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, code), err


# ---------------------------------------------------------------- 5. error codes and params


def test_answers_refused_name_the_answers_field(http: httpx.Client) -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    r = http.post("/v1/responses", json={"model": "assistant", "input": '/call f {"a":1}', "tools": tools}).json()
    cid = r["output"][0]["call_id"]

    def follow(items: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": "assistant", "previous_response_id": r["id"], "tools": tools, "input": items}
        answer = http.post("/v1/responses", json=body)
        assert answer.status_code == 400, answer.text
        return error_of(answer)

    twice = [{"type": "function_call_output", "call_id": cid, "output": out} for out in ("A", "B")]
    assert (follow(twice)["code"], follow(twice)["param"]) == ("invalid_input", "input")
    unknown = follow([{"type": "function_call_output", "call_id": "call_nope", "output": "A"}])
    assert (unknown["code"], unknown["param"]) == ("unknown_tool_call", "input")
    done = http.post(
        "/v1/responses",
        json={"model": "assistant", "previous_response_id": r["id"], "tools": tools, "input": twice[:1]},
    )
    assert done.status_code == 200  # nothing was written by the refused ones: the call still waited


def test_chat_error_codes(http: httpx.Client) -> None:
    def refused(body: dict[str, Any]) -> dict[str, Any]:
        r = http.post("/v1/chat/completions", json={"model": "assistant", **body})
        assert r.status_code == 400, r.text
        return error_of(r)

    stray = refused(
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "t1", "content": "r"}]}
    )
    assert (stray["code"], stray["param"]) == ("unknown_tool_call", "messages") and "t1" in stray["message"]
    q = [{"role": "user", "content": "q"}]
    assert refused({"messages": q, "function_call": 12345})["param"] == "function_call"
    bad_name = {"type": "json_schema", "json_schema": {"name": "not a valid name!", "schema": {"type": "object"}}}
    err = refused({"messages": q, "response_format": bad_name})
    assert (err["param"], err["code"]) == ("response_format.json_schema.name", "invalid_value")
    r = http.post(
        "/v1/responses",
        json={
            "model": "assistant",
            "input": "q",
            "text": {"format": {**bad_name["json_schema"], "type": "json_schema"}},
        },
    )
    assert r.status_code == 400 and error_of(r)["param"] == "text.format.name"
    ok = http.post("/v1/chat/completions", json={"model": "assistant", "messages": q, "function_call": "auto"})
    assert ok.status_code == 200
