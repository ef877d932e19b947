"""The `mcp` tool naming this agent on /v1/responses, from an outside tester's findings (session 27),
through a real `appserver serve` on loopback, httpx and the real `openai` SDK, agents on a loopback
fake OpenAI upstream that records what each model call was offered.

1. `allowed_tools` (an array of names, or `{tool_names, read_only}`) narrows the agent's own tools
   for the turn: only those are offered upstream, a call to another is not run, and no tool_choice
   names one left out. `require_approval` `always` (or a tool its `always` filter takes) makes each
   such call an `mcp_approval_request` even where the agent's policy is `allow`; `never` does not
   loosen an agent's `ask` (the owner's policy is the boundary). Both were ignored.
2. Every field of an `mcp` tool is checked against OpenAI's `MCPTool`: `require_approval:
   "sometimes"`, `server_url: 5`, `allowed_tools: "clock"` were accepted and echoed (the Response
   then failed OpenAI's schema); a missing `server_label` is `missing_required_parameter`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.openai_schema import require_conformance, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)


def last_text(req: RecordedRequest) -> tuple[str, str]:
    """(role, text) of the last message a model call got."""
    last = (req.json or {}).get("messages", [{}])[-1]
    content = last.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(last.get("role")), str(content or "")


def upstream_model(req: RecordedRequest) -> Reply:
    """`CALL <name> <json> <tag>`: a call of that tool; after a tool result: `done: <result>`."""
    role, text = last_text(req)
    if role == "user" and text.startswith("CALL "):
        _, name, args, _ = text.split(" ", 3)
        call = tool_delta(0, id=f"call_{uuid.uuid4().hex[:12]}", name=name, arguments=args)
        chunks = [chunk(role="assistant", tool_calls=[call]), chunk(finish_reason="tool_calls")]
    else:
        chunks = [chunk(role="assistant", content=f"done: {text[:60]}"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse(chunks)])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, ids: dict[str, str]) -> None:
        self.sp, self.fake, self.ids = sp, fake, ids

    def sent(self, tag: str) -> list[dict[str, Any]]:
        """The model calls of the request whose input carried `tag`."""
        return [r.json for r in self.fake.requests if r.json and tag in json.dumps(r.json)]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s27b") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        ids: dict[str, str] = {}
        for name, policies in (("open", ("clock=allow", "schedule=allow")), ("asker", ("clock=ask", "schedule=allow"))):
            tools = [a for p in policies for a in ("--tool", p)]
            made = run_cli(home, "agents", "create", "--name", name, "--model", "fake:m", *tools, "--json", env=cli)
            assert made.code == 0, made.err
            ids[name] = str(made.json()["id"])
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, ids)


@pytest.fixture
def http(env: Env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.sp.url, timeout=30) as c:
        yield c


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=env.sp.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def mcp(label: str = "open", **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": "http://unused.invalid", **fields}


def call(name: str, args: str = "{}") -> tuple[str, str]:
    """(input asking the fake model to call `name`, its tag)."""
    tag = uuid.uuid4().hex
    return f"CALL {name} {args} {tag}", tag


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    validate("Response", body)
    return body


def offered(sent: dict[str, Any]) -> list[str]:
    return sorted(t["function"]["name"] for t in sent.get("tools") or [])


def kinds(body: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(o["type"], o.get("name")) for o in body["output"]]


# ---------------------------------------------------------------- 1. allowed_tools


ALLOWED = [
    (["clock"], ["clock"]),
    ({"tool_names": ["schedule"]}, ["schedule"]),
    ({"read_only": True}, ["clock"]),  # clock declares itself read-only; schedule writes
    ({"read_only": False}, ["schedule"]),
    ({"tool_names": ["clock", "schedule"], "read_only": True}, ["clock"]),
    ({}, ["clock", "schedule"]),
    ([], []),
    (None, ["clock", "schedule"]),
]


@pytest.mark.parametrize(("allowed", "names"), ALLOWED, ids=[json.dumps(a) for a, _ in ALLOWED])
def test_allowed_tools_are_the_only_agent_tools_offered(
    env: Env, http: httpx.Client, allowed: Any, names: list[str]
) -> None:
    text, tag = call("nothing")
    tool = mcp(allowed_tools=allowed)
    body = ok(http.post("/v1/responses", json={"model": "open", "input": text.replace("CALL", "SAY"), "tools": [tool]}))
    assert offered(env.sent(tag)[0]) == names
    assert body["tools"] == [tool]  # echoed as sent


def test_a_call_to_a_tool_not_allowed_is_not_run(env: Env, http: httpx.Client) -> None:
    text, tag = call("schedule", '{"action":"list"}')
    body = ok(
        http.post("/v1/responses", json={"model": "open", "input": text, "tools": [mcp(allowed_tools=["clock"])]})
    )
    first = body["output"][0]
    assert (first["type"], first["name"], first["status"]) == ("mcp_call", "schedule", "failed"), body["output"]
    said = first["error"]["content"][0]["text"]
    assert "not among the tools this request allows" in said and "not executed" in said
    # the model was told so, and the schedule tool never ran (its listing never reached the model)
    result = [m for m in env.sent(tag)[-1]["messages"] if m["role"] == "tool"]
    assert len(result) == 1 and "not among the tools" in result[0]["content"]

    # the same call with the tool allowed runs
    text, tag = call("schedule", '{"action":"list"}')
    body = ok(
        http.post("/v1/responses", json={"model": "open", "input": text, "tools": [mcp(allowed_tools=["schedule"])]})
    )
    assert (body["output"][0]["status"], body["output"][0]["error"]) == ("completed", None)


def test_no_tool_choice_names_a_tool_not_allowed(env: Env, http: httpx.Client) -> None:
    tools = [mcp(allowed_tools=["clock"])]
    for choice in (
        {"type": "mcp", "server_label": "open", "name": "schedule"},
        {"type": "function", "name": "schedule"},
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "schedule"}]},
    ):
        r = http.post("/v1/responses", json={"model": "open", "input": "hi", "tools": tools, "tool_choice": choice})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_tool_choice", r.json()
    # an mcp choice without a name picks among the allowed tools only
    text, tag = call("nothing")
    choice = {"type": "mcp", "server_label": "open"}
    ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": tools, "tool_choice": choice}))
    assert env.sent(tag)[0]["tool_choice"] == {"type": "function", "function": {"name": "clock"}}
    r = http.post(
        "/v1/responses",
        json={"model": "open", "input": "hi", "tools": [mcp(allowed_tools=[])], "tool_choice": "required"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tool_choice", r.text


def test_a_client_function_is_not_narrowed_by_the_agents_allowed_tools(env: Env, http: httpx.Client) -> None:
    text, tag = call("nothing")
    fn = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}
    ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": [mcp(allowed_tools=["clock"]), fn]}))
    assert offered(env.sent(tag)[0]) == ["clock", "f"]


# ---------------------------------------------------------------- 1. require_approval


def test_require_approval_always_asks_even_where_the_agent_allows(env: Env, client: openai.OpenAI) -> None:
    text, tag = call("clock")
    tools: Any = [mcp(require_approval="always")]
    first = client.responses.create(model="open", input=text, tools=tools)
    validate("Response", first.model_dump(mode="json", exclude_unset=True))
    assert [o.type for o in first.output] == ["mcp_approval_request"]
    request = first.output[0]
    assert request.type == "mcp_approval_request" and request.name == "clock" and request.server_label == "open"
    assert len(env.sent(tag)) == 1  # nothing ran: the turn waits for the answer
    # answered as input_items lists an answer (its `id` and `request_id` too): the call runs
    answer: Any = {
        "type": "mcp_approval_response",
        "id": f"mcpa_{uuid.uuid4().hex}",
        "request_id": request.id,
        "approval_request_id": request.id,
        "approve": True,
        "reason": None,
    }
    done = client.responses.create(model="open", previous_response_id=first.id, input=[answer], tools=tools)
    validate("Response", done.model_dump(mode="json", exclude_unset=True))
    ran = done.output[0]
    assert ran.type == "mcp_call" and ran.status == "completed" and ran.approval_request_id == request.id
    assert done.output_text.startswith("done: ")


def test_require_approval_always_asks_on_a_stream_too(env: Env, http: httpx.Client) -> None:
    text, _ = call("clock")
    body = {"model": "open", "input": text, "tools": [mcp(require_approval="always")], "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        events = [json.loads(p) for p in sse_payloads(list(r.iter_lines()))]
    assert r.status_code == 200
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["mcp_approval_request"], done
    assert events[-1]["type"] == "response.completed"


def test_require_approval_filters_ask_for_the_tools_they_take(env: Env, http: httpx.Client) -> None:
    approval = {"always": {"tool_names": ["schedule"]}, "never": {"tool_names": ["clock"]}}
    tools = [mcp(require_approval=approval)]
    text, _ = call("clock")
    body = ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": tools}))
    assert kinds(body) == [("mcp_call", "clock"), ("message", None)]
    assert body["output"][0]["approval_request_id"] is None
    text, _ = call("schedule", '{"action":"list"}')
    body = ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": tools}))
    assert kinds(body) == [("mcp_approval_request", "schedule")]
    # read_only: the tools that write are asked about
    tools = [mcp(require_approval={"always": {"read_only": False}})]
    text, _ = call("clock")
    assert kinds(ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": tools})))[0] == (
        "mcp_call",
        "clock",
    )


@pytest.mark.parametrize("never", ["never", {"never": {"tool_names": ["clock"]}}])
def test_require_approval_never_does_not_loosen_an_agent_that_asks(env: Env, http: httpx.Client, never: Any) -> None:
    text, tag = call("clock")
    tools = [mcp("asker", require_approval=never)]
    body = ok(http.post("/v1/responses", json={"model": "asker", "input": text, "tools": tools}))
    assert kinds(body) == [("mcp_approval_request", "clock")]
    assert len(env.sent(tag)) == 1
    # and without the mcp tool, the agent's `allow` needs no approval (the default is unchanged)
    text, _ = call("clock")
    body = ok(http.post("/v1/responses", json={"model": "open", "input": text, "tools": [mcp()]}))
    assert kinds(body) == [("mcp_call", "clock"), ("message", None)]


# ---------------------------------------------------------------- 2. the mcp tool's fields

REFUSED = [
    ({"require_approval": "sometimes"}, "invalid_value", "tools[0].require_approval"),
    ({"require_approval": 5}, "invalid_type", "tools[0].require_approval"),
    ({"require_approval": {"always": ["clock"]}}, "invalid_type", "tools[0].require_approval.always"),
    ({"require_approval": {"sometimes": {}}}, "unknown_parameter", "tools[0].require_approval.sometimes"),
    ({"require_approval": {"always": {"names": ["x"]}}}, "unknown_parameter", "tools[0].require_approval.always.names"),
    (
        {"require_approval": {"never": {"read_only": "yes"}}},
        "invalid_type",
        "tools[0].require_approval.never.read_only",
    ),
    ({"server_url": 5}, "invalid_type", "tools[0].server_url"),
    ({"server_url": None}, "invalid_type", "tools[0].server_url"),
    ({"allowed_tools": "clock"}, "invalid_type", "tools[0].allowed_tools"),
    ({"allowed_tools": [5]}, "invalid_type", "tools[0].allowed_tools[0]"),
    ({"allowed_tools": {"tool_names": "clock"}}, "invalid_type", "tools[0].allowed_tools.tool_names"),
    ({"allowed_tools": {"tool_names": None}}, "invalid_type", "tools[0].allowed_tools.tool_names"),
    ({"allowed_tools": {"bogus": 1}}, "unknown_parameter", "tools[0].allowed_tools.bogus"),
    ({"headers": {"X-A": 5}}, "invalid_type", "tools[0].headers.X-A"),
    ({"headers": "x"}, "invalid_type", "tools[0].headers"),
    ({"server_description": 5}, "invalid_type", "tools[0].server_description"),
    ({"authorization": 5}, "invalid_type", "tools[0].authorization"),
    ({"connector_id": "connector_myspace"}, "invalid_value", "tools[0].connector_id"),
    ({"tunnel_id": "tunnel_x"}, "invalid_value", "tools[0].tunnel_id"),
    ({"defer_loading": "no"}, "invalid_type", "tools[0].defer_loading"),
    ({"allowed_callers": []}, "empty_array", "tools[0].allowed_callers"),
    ({"allowed_callers": ["anyone"]}, "invalid_value", "tools[0].allowed_callers[0]"),
    ({"bogus": 1}, "unknown_parameter", "tools[0].bogus"),
    ({"server_label": 5}, "invalid_type", "tools[0].server_label"),
    ({"server_label": None}, "invalid_type", "tools[0].server_label"),
]


@pytest.mark.parametrize(("fields", "code", "param"), REFUSED, ids=[json.dumps(f) for f, _, _ in REFUSED])
def test_every_field_of_an_mcp_tool_is_checked(
    http: httpx.Client, fields: dict[str, Any], code: str, param: str
) -> None:
    r = http.post("/v1/responses", json={"model": "open", "input": "hi", "tools": [mcp(**fields)]})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert "None" not in err["message"], err


def test_an_mcp_tool_without_a_server_label_is_missing_it(http: httpx.Client) -> None:
    tool = {"type": "mcp", "server_url": "http://x"}
    r = http.post(
        "/v1/responses", json={"model": "open", "input": "hi", "tools": [{"type": "function", "name": "f"}, tool]}
    )
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "missing_required_parameter",
        "tools[1].server_label",
    )


def test_a_valid_mcp_tool_is_echoed_as_openais_schema_has_it(env: Env, http: httpx.Client) -> None:
    tool = mcp(
        env.ids["open"],
        server_description="this agent",
        headers={"X-A": "b"},
        allowed_tools={"tool_names": ["clock"], "read_only": True},
        require_approval={"always": {"tool_names": ["clock"]}, "never": {"read_only": True}},
        allowed_callers=["direct"],
        defer_loading=False,
        authorization="secret-token",
    )
    body = ok(http.post("/v1/responses", json={"model": "open", "input": "hi", "tools": [tool]}))
    shown = {k: v for k, v in tool.items() if k != "authorization"}  # a token is never echoed
    assert body["tools"] == [shown]
    assert http.get(f"/v1/responses/{body['id']}").json()["tools"] == [shown]
    for approval in ("always", "never", None):
        ok(http.post("/v1/responses", json={"model": "open", "input": "hi", "tools": [mcp(require_approval=approval)]}))
