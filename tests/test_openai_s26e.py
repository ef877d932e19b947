"""OpenAI tool_choice and server_label fixes from an outside tester's findings (session 26), through
a real `appserver serve` on loopback with httpx, the real `openai` SDK and the OpenAI Agents SDK:
the offline echo agent `ops` (`clock=ask`, `schedule=allow`) and `remote` on a loopback fake
OpenAI upstream (which records the tool_choice the model call got).

1. Each tool of an `allowed_tools` choice is checked as a `tool_choice` of its type: an `mcp` one
   naming another server, or a hosted type, is 400 `unsupported_tool` (they were taken by `name`
   alone, running the agent's own tool); an `mcp` one naming this agent without `name` allows every
   tool of its own, with a name that tool (it was refused as "allowed tool null"). Both shapes:
   Responses (`mode`, `tools` beside `type`) and Chat (nested under `allowed_tools`).
2. An `mcp` tool naming this agent by its name: the server tool items of that response (body,
   stream, GET, a continuation naming it again) carry that label, not the id, so the Agents SDK's
   `HostedMCPTool(server_label=<name>)` finds them.
3. A tool_choice's name: errors say which choice (mcp or function) and name the field
   (`tool_choice.name`, `tool_choice.function.name`; `tool_choice.function` left out on Chat); a
   null or another type is `invalid_type`, `""` `invalid_value`, on both routes.
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

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
RFN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}


def upstream_model(req: RecordedRequest) -> Reply:
    return Reply(pieces=[openai_sse([chunk(role="assistant", content="ok"), chunk(finish_reason="stop")])])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, ids: dict[str, str]) -> None:
        self.sp, self.fake, self.ids = sp, fake, ids


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s26e") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        ids: dict[str, str] = {}
        for name, args in (
            ("ops", ("--tool", "clock=ask", "--tool", "schedule=allow")),
            ("remote", ("--model", "fake:m", "--tool", "clock=allow", "--tool", "schedule=allow")),
        ):
            made = run_cli(home, "agents", "create", "--name", name, *args, "--json", env=cli)
            assert made.code == 0, made.err
            ids[name] = str(made.json()["id"])
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, ids)


@pytest.fixture
def http(env: Env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.sp.url, timeout=30) as c:
        yield c


def respond(http: httpx.Client, model: str = "ops", **fields: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": model, "input": f"hi {uuid.uuid4().hex}", **fields})


def chat(http: httpx.Client, model: str = "ops", **fields: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], **fields}
    return http.post("/v1/chat/completions", json=body)


def refused(r: httpx.Response, code: str, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err: dict[str, Any] = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert "None" not in err["message"], err
    return err


def ok(r: httpx.Response, schema: str = "Response") -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    validate(schema, body)
    return body


def allowed(*tools: Any, mode: str = "required") -> dict[str, Any]:
    return {"type": "allowed_tools", "mode": mode, "tools": list(tools)}


def chat_allowed(*tools: Any, mode: str = "required") -> dict[str, Any]:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": list(tools)}}


# ---------------------------------------------------------------- 1. allowed_tools entries

OPS = "<ops id>"  # replaced by the agent's id
RESPONSES_ENTRIES_REFUSED = [
    ([{"type": "mcp", "server_label": "deepwiki", "name": "clock"}], "unsupported_tool", "tool_choice", "'deepwiki'"),
    ([{"type": "mcp", "server_label": "deepwiki"}], "unsupported_tool", "tool_choice", "'deepwiki'"),
    (
        [{"type": "image_generation", "name": "clock"}],
        "unsupported_tool",
        "tool_choice",
        "'tool_choice.tools[0]' type 'image_generation'",
    ),
    ([{"type": "image_generation"}], "unsupported_tool", "tool_choice", "type 'image_generation'"),
    ([RFN, {"type": "web_search_preview"}], "unsupported_tool", "tool_choice", "'tool_choice.tools[1]'"),
    ([{"type": "allowed_tools", "mode": "auto", "tools": [RFN]}], "unsupported_tool", "tool_choice", "allowed_tools"),
    ([{"type": "function", "name": "nope"}], "invalid_tool_choice", "tool_choice", "'nope'"),
    ([{"type": "mcp", "server_label": OPS, "name": "f"}], "invalid_tool_choice", "tool_choice", "has no tool 'f'"),
    ([{"type": "function"}], "missing_required_parameter", "tool_choice.tools[0].name", "tools[0].name"),
    ([{"name": "f"}], "missing_required_parameter", "tool_choice.tools[0].type", "tools[0].type"),
    ([RFN, {"type": "function", "name": ""}], "invalid_value", "tool_choice.tools[1].name", "function choice"),
    ([{"type": "mcp", "server_label": OPS, "name": ""}], "invalid_value", "tool_choice.tools[0].name", "an mcp"),
    ([{"type": "mcp", "server_label": 5}], "invalid_type", "tool_choice.tools[0].server_label", "a string"),
]


@pytest.mark.parametrize(
    ("tools", "code", "param", "said"),
    RESPONSES_ENTRIES_REFUSED,
    ids=[json.dumps(t) for t, _, _, _ in RESPONSES_ENTRIES_REFUSED],
)
def test_responses_allowed_tools_entries_are_checked_by_their_type(
    env: Env, http: httpx.Client, tools: list[Any], code: str, param: str, said: str
) -> None:
    tools = [{**t, "server_label": env.ids["ops"]} if t.get("server_label") == OPS else t for t in tools]
    for mode in ("required", "auto"):
        r = respond(http, input="/call clock {}", tools=[RFN], tool_choice=allowed(*tools, mode=mode))
        err = refused(r, code, param)
        assert said in err["message"], err
        assert "null" not in err["message"], err  # the client sent none


CHAT_ENTRIES_REFUSED = [
    ([{"type": "mcp", "server_label": "deepwiki", "name": "clock"}], "unsupported_tool", "tool_choice"),
    ([{"type": "image_generation"}], "unsupported_tool", "tool_choice"),
    ([{"type": "function", "function": {"name": "nope"}}], "invalid_tool_choice", "tool_choice"),
    ([{"type": "function"}], "missing_required_parameter", "tool_choice.allowed_tools.tools[0].function"),
    (
        [{"type": "function", "function": {}}],
        "missing_required_parameter",
        "tool_choice.allowed_tools.tools[0].function.name",
    ),
    (
        [FN, {"type": "function", "function": {"name": ""}}],
        "invalid_value",
        "tool_choice.allowed_tools.tools[1].function.name",
    ),
]


@pytest.mark.parametrize(
    ("tools", "code", "param"), CHAT_ENTRIES_REFUSED, ids=[json.dumps(t) for t, _, _ in CHAT_ENTRIES_REFUSED]
)
def test_chat_allowed_tools_entries_are_checked_by_their_type(
    http: httpx.Client, tools: list[Any], code: str, param: str
) -> None:
    err = refused(chat(http, tools=[FN], tool_choice=chat_allowed(*tools)), code, param)
    assert "null" not in err["message"], err


def test_a_top_level_mcp_choice_of_another_server_stays_refused(http: httpx.Client) -> None:
    choice = {"type": "mcp", "server_label": "deepwiki", "name": "clock"}
    refused(respond(http, tools=[RFN], tool_choice=choice), "unsupported_tool", "tool_choice")
    refused(chat(http, tools=[FN], tool_choice=choice), "unsupported_tool", "tool_choice")


def _sent_choice(env: Env) -> tuple[Any, list[str]]:
    """The first model call's tool_choice and the (sorted) names of the tools it offers: an
    allowed_tools choice is sent as the listed tools only, with `auto` or `required` (session 29)."""
    sent = [r.json for r in env.fake.requests if r.json and "messages" in r.json]
    assert sent, env.fake.requests
    return sent[0].get("tool_choice"), sorted(t["function"]["name"] for t in sent[0].get("tools", []))


@pytest.mark.parametrize("label", ["id", "name"])
def test_an_mcp_entry_naming_this_agent_allows_its_own_tools(env: Env, http: httpx.Client, label: str) -> None:
    server = env.ids["remote"] if label == "id" else "remote"
    env.fake.requests.clear()
    body = ok(respond(http, "remote", tools=[RFN], tool_choice=allowed({"type": "mcp", "server_label": server})))
    assert _sent_choice(env) == ("required", ["clock", "schedule"])
    assert body["tool_choice"] == allowed({"type": "mcp", "server_label": server})  # echoed as sent

    env.fake.requests.clear()
    mixed = allowed({"type": "mcp", "server_label": server, "name": "clock"}, {"type": "function", "name": "f"})
    ok(respond(http, "remote", tools=[RFN], tool_choice={**mixed, "mode": "auto"}))
    assert _sent_choice(env) == ("auto", ["clock", "f"])

    env.fake.requests.clear()  # Chat's shape, both kinds of entry, a tool listed twice once
    nested = chat_allowed(
        {"type": "function", "function": {"name": "f"}},
        {"type": "mcp", "server_label": server},
        {"type": "function", "function": {"name": "clock"}},
    )
    ok(chat(http, "remote", tools=[FN], tool_choice=nested), "CreateChatCompletionResponse")
    assert _sent_choice(env) == ("required", ["clock", "f", "schedule"])


def test_the_testers_spec_example_entry_runs_on_the_echo_agent(env: Env, http: httpx.Client) -> None:
    ops = env.ids["ops"]
    body = ok(
        http.post(
            "/v1/responses",
            json={
                "model": "ops",
                "input": "/call clock {}",
                "tools": [{"type": "mcp", "server_label": ops}],
                "tool_choice": allowed({"type": "mcp", "server_label": ops}),
            },
        )
    )
    asked = [o for o in body["output"] if o["type"] == "mcp_approval_request"]
    assert [(o["name"], o["server_label"]) for o in asked] == [("clock", ops)], body["output"]


# ---------------------------------------------------------------- 2. the label a client named this agent by


def _one(output: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in output if o["type"] == kind]
    assert len(found) == 1, output
    return found[0]


@pytest.mark.parametrize("by", ["name", "id"])
def test_server_tool_items_carry_the_label_the_request_used(env: Env, http: httpx.Client, by: str) -> None:
    label = "ops" if by == "name" else env.ids["ops"]
    tools = [{"type": "mcp", "server_label": label, "server_url": "http://unused.invalid"}]
    asked = ok(http.post("/v1/responses", json={"model": "ops", "input": "/call clock {}", "tools": tools}))
    request = _one(asked["output"], "mcp_approval_request")
    assert request["server_label"] == label, request
    assert asked["tools"][0]["server_label"] == label, asked["tools"]
    kept = ok(http.get(f"/v1/responses/{asked['id']}"))
    assert _one(kept["output"], "mcp_approval_request") == request

    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    r = http.post(
        "/v1/responses",
        json={"model": "ops", "previous_response_id": asked["id"], "input": [answer], "tools": tools, "stream": True},
    )
    assert r.status_code == 200, r.text
    events = [json.loads(p) for p in sse_payloads(sse_lines(r.content))]
    items = [e["item"] for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
    calls = [i for i in items if i["type"] == "mcp_call"]
    assert len(calls) == 2 and all(c["server_label"] == label for c in calls), calls
    final = events[-1]
    assert final["type"] == "response.completed", final
    assert _one(final["response"]["output"], "mcp_call")["server_label"] == label
    kept = ok(http.get(f"/v1/responses/{final['response']['id']}"))
    assert _one(kept["output"], "mcp_call")["server_label"] == label
    listed = http.get(f"/v1/responses/{final['response']['id']}/input_items")
    assert listed.status_code == 200 and [i["type"] for i in listed.json()["data"]] == ["mcp_approval_response"]


def test_without_an_mcp_tool_items_carry_the_agent_id(env: Env, http: httpx.Client) -> None:
    ran = ok(http.post("/v1/responses", json={"model": "ops", "input": "/call schedule {}"}))
    assert _one(ran["output"], "mcp_call")["server_label"] == env.ids["ops"]
    by_choice = ok(
        http.post(
            "/v1/responses",
            json={"model": "ops", "input": "/call clock {}", "tool_choice": {"type": "mcp", "server_label": "ops"}},
        )
    )
    assert _one(by_choice["output"], "mcp_approval_request")["server_label"] == "ops"


def test_the_agents_sdk_finds_its_hosted_mcp_tool_by_the_agents_name(env: Env) -> None:
    agents = pytest.importorskip("agents")
    from agents.model_settings import MCPToolChoice

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    def on_approval(request: Any) -> dict[str, Any]:
        seen.append(request.data.name)
        return {"approve": True}

    model = agents.OpenAIResponsesModel(
        model="ops", openai_client=openai.AsyncOpenAI(base_url=env.sp.url + "/v1", api_key="unused", max_retries=0)
    )
    tool = agents.HostedMCPTool(
        tool_config={"type": "mcp", "server_label": "ops", "require_approval": "always"},
        on_approval_request=on_approval,
    )
    agent = agents.Agent(
        name="a",
        model=model,
        tools=[tool],
        model_settings=agents.ModelSettings(tool_choice=MCPToolChoice(server_label="ops", name="clock")),
    )
    result = agents.Runner.run_sync(agent, "/call clock {}", max_turns=4)
    assert seen == ["clock"]
    assert str(result.final_output).startswith("clock -> "), result.final_output


# ---------------------------------------------------------------- 3. a tool_choice's name

RESPONSES_NAMES_REFUSED = [
    ({"type": "mcp", "server_label": "ops", "name": ""}, "invalid_value", "tool_choice.name", "an mcp choice"),
    ({"type": "function", "name": ""}, "invalid_value", "tool_choice.name", "a function choice"),
    ({"type": "function", "name": None}, "invalid_type", "tool_choice.name", "got null"),
    ({"type": "function", "name": 5}, "invalid_type", "tool_choice.name", "got a number"),
    ({"type": "function"}, "missing_required_parameter", "tool_choice.name", "'tool_choice.name'"),
]


@pytest.mark.parametrize(
    ("choice", "code", "param", "said"),
    RESPONSES_NAMES_REFUSED,
    ids=[json.dumps(c) for c, *_ in RESPONSES_NAMES_REFUSED],
)
def test_responses_choice_names_are_checked_down_to_the_field(
    http: httpx.Client, choice: Any, code: str, param: str, said: str
) -> None:
    err = refused(respond(http, tools=[RFN], tool_choice=choice), code, param)
    assert said in err["message"], err


CHAT_NAMES_REFUSED = [
    ({"type": "mcp", "server_label": "ops", "name": ""}, "invalid_value", "tool_choice.name"),
    ({"type": "function", "function": {"name": ""}}, "invalid_value", "tool_choice.function.name"),
    ({"type": "function", "function": {"name": None}}, "invalid_type", "tool_choice.function.name"),
    ({"type": "function", "function": {}}, "missing_required_parameter", "tool_choice.function.name"),
    ({"type": "function"}, "missing_required_parameter", "tool_choice.function"),
    ({"type": "function", "function": None}, "invalid_type", "tool_choice.function"),
    ({"type": "function", "name": None}, "invalid_type", "tool_choice.name"),
    ({"type": "function", "name": 5}, "invalid_type", "tool_choice.name"),
]


@pytest.mark.parametrize(
    ("choice", "code", "param"), CHAT_NAMES_REFUSED, ids=[json.dumps(c) for c, *_ in CHAT_NAMES_REFUSED]
)
def test_chat_choice_names_are_checked_down_to_the_field(
    http: httpx.Client, choice: Any, code: str, param: str
) -> None:
    refused(chat(http, tools=[FN], tool_choice=choice), code, param)


def test_an_empty_legacy_function_call_name_is_an_invalid_value(http: httpx.Client) -> None:
    fn = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    refused(chat(http, functions=[fn], function_call={"name": ""}), "invalid_value", "function_call.name")


def test_valid_choices_still_pass(env: Env, http: httpx.Client) -> None:
    ok(respond(http, tools=[RFN], tool_choice={"type": "function", "name": "f"}))
    ok(respond(http, tools=[RFN], tool_choice={"type": "mcp", "server_label": "ops", "name": None}))
    ok(respond(http, tools=[RFN], tool_choice={"type": "mcp", "server_label": env.ids["ops"], "name": "clock"}))
    ok(
        chat(http, tools=[FN], tool_choice={"type": "function", "function": {"name": "f"}}),
        "CreateChatCompletionResponse",
    )
    ok(chat(http, tools=[FN], tool_choice={"type": "function", "name": "f"}), "CreateChatCompletionResponse")
