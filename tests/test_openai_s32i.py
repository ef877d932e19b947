"""OpenAI surface fixes from an outside tester's findings (session 32, helper i), through a real
`appserver serve` on loopback (token auth) with the real `openai` SDK and the OpenAI Agents SDK,
its agents `bot` and `asker` on a loopback fake OpenAI upstream scripted by the user text.

1. A handoff to another served agent keeps server-side state: previous_response_id of another
   agent's response (Agents SDK `auto_previous_response_id` / `previous_response_id`) forks that
   history into a new conversation of the requested agent, and the chain goes on from there; it
   was a 404 `previous_response_not_found` for a response the same credential could GET.
   `conversation` naming another agent's conversation is a 400 naming that agent's model (it
   was a 404 "not found"); another credential's response or conversation stays a 404.
2. Chat `prediction`, `moderation` and `web_search_options` are type-checked (any value was a
   200); `web_search_options` is refused, as this server does no web search.
3. Responses `context_management: []` is a 400 `empty_array` (minItems 1).
4. POST /v1/responses/compact and /v1/responses/input_tokens (SDK `responses.compact()`,
   `responses.input_tokens.count()`) are a 404 `unknown_url` saying they are not implemented (a
   405 pointing at GET, as if `compact` were a response id).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.openai_schema import require_conformance, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)


def _texts(messages: list[dict[str, Any]], role: str) -> list[str]:
    out: list[str] = []
    for m in messages:
        if m.get("role") != role:
            continue
        c = m.get("content")
        out.append(c if isinstance(c, str) else " ".join(p.get("text", "") for p in c or []))
    return out


def upstream_model(req: RecordedRequest) -> Reply:
    """`HANDOFF` in the last user text calls the first `transfer_to_…` tool offered, `CLOCK` the
    agent's own `clock`; else the agent (named in its system prompt) says which user texts it saw."""
    body = req.json
    messages = body.get("messages") or []
    tools = [t["function"]["name"] for t in body.get("tools") or []]
    who = "asker" if any("AGENT:asker" in t for t in _texts(messages, "system")) else "bot"
    last = messages[-1] if messages else {}
    text = _texts([last], "user")[0] if last.get("role") == "user" else ""
    call = None
    if "HANDOFF" in text:
        call = next((t for t in tools if t.startswith("transfer_to_")), None)
    elif "CLOCK" in text and "clock" in tools:
        call = "clock"
    if call is not None:
        tc = {"index": 0, "id": f"call_{len(messages)}", "type": "function"}
        tc["function"] = {"name": call, "arguments": "{}"}
        chunks = [chunk(role="assistant", tool_calls=[tc]), chunk(finish_reason="tool_calls")]
    else:
        seen = " | ".join(_texts(messages, "user"))
        chunks = [chunk(role="assistant", content=f"{who} saw: {seen}"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse(chunks)])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, tokens: dict[str, str]) -> None:
        self.sp, self.fake, self.tokens = sp, fake, tokens
        self.base = f"{sp.url}/v1"

    def client(self, who: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=self.tokens[who], max_retries=0, timeout=30)

    def http(self, who: str = "alice") -> httpx.Client:
        return httpx.Client(base_url=self.sp.url, headers={"Authorization": f"Bearer {self.tokens[who]}"}, timeout=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_conformance()
    set_tracing_disabled(True)
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s32i") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[auth]\nmode = "token"\n\n[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\n'
            'api_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, tool in (("bot", "clock=ask"), ("asker", "clock=allow")):
            args = ("--name", name, "--model", "fake:m", "--system", f"AGENT:{name}", "--tool", tool)
            made = run_cli(home, "agents", "create", *args, env=cli)
            assert made.code == 0, made.err
        tokens: dict[str, str] = {}
        for who in ("alice", "bob"):
            minted = run_cli(home, "token", "create", "--name", who, "--json", env=cli)
            assert minted.code == 0, minted.err
            tokens[who] = str(minted.json()["token"])
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, tokens)


def error_of(r: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert r.status_code == status, r.text
    validate("ErrorResponse", r.json())
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    return str(err["message"])


# ---------------------------------------------------------------- 1. handoffs keep server state


def _run_handoff(env: Env, **run: Any) -> Any:
    """Triage (model `bot`) hands off to Other (model `asker`); then Other is run again from there."""

    async def go() -> Any:
        async with openai.AsyncOpenAI(base_url=env.base, api_key=env.tokens["alice"], max_retries=0) as client:
            other = Agent(name="Other", model=OpenAIResponsesModel("asker", client), instructions="the other one")
            triage = Agent(name="Triage", model=OpenAIResponsesModel("bot", client), handoffs=[other])
            first = await Runner.run(triage, "HANDOFF to the other please", **run)
            again = await Runner.run(other, "and a follow-up", previous_response_id=first.last_response_id)
            return first, again

    return asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("mode", ["auto_previous_response_id", "previous_response_id"])
def test_agents_sdk_handoff_to_another_served_agent_keeps_server_state(env: Env, mode: str) -> None:
    run: dict[str, Any] = {"auto_previous_response_id": True}
    if mode == "previous_response_id":
        start = env.client().responses.create(model="bot", input="an earlier hello")
        run = {"previous_response_id": start.id}
    first, again = _run_handoff(env, **run)
    assert first.last_agent.name == "Other"
    # the other agent answered in its own conversation, with the history before the handoff
    assert first.final_output.startswith("asker saw: "), first.final_output
    assert "HANDOFF to the other please" in first.final_output
    if mode == "previous_response_id":
        assert "an earlier hello" in first.final_output
    assert again.final_output.startswith("asker saw: ") and "and a follow-up" in again.final_output
    assert "HANDOFF to the other please" in again.final_output
    with env.http() as http:
        handed = http.get(f"/v1/responses/{first.last_response_id}")
        after = http.get(f"/v1/responses/{again.last_response_id}")
    assert handed.status_code == after.status_code == 200, (handed.text, after.text)
    validate("Response", handed.json())
    assert handed.json()["model"] == after.json()["model"] == "asker"
    # the follow-up continued the fork at its head: the same conversation
    assert handed.headers["x-conversation-id"] == after.headers["x-conversation-id"]
    assert after.json()["previous_response_id"] == first.last_response_id


def test_previous_response_of_another_model_forks_and_leaves_its_conversation(env: Env) -> None:
    c = env.client()
    r1 = c.responses.with_raw_response.create(model="bot", input="bot's first")
    bot_conv, r1_id = r1.headers["x-conversation-id"], r1.parse().id
    r2 = c.responses.with_raw_response.create(model="asker", input="asker continues", previous_response_id=r1_id)
    body = r2.parse()
    assert body.model == "asker" and body.previous_response_id == r1_id
    assert body.output_text == "asker saw: bot's first | asker continues"
    assert r2.headers["x-conversation-id"] != bot_conv
    # the bot's conversation is as it was: bot continues it at its head
    r3 = c.responses.with_raw_response.create(model="bot", input="bot again", previous_response_id=r1_id)
    assert r3.headers["x-conversation-id"] == bot_conv
    assert r3.parse().output_text == "bot saw: bot's first | bot again"


def test_conversation_of_another_model_is_a_clear_400_and_other_credentials_still_404(env: Env) -> None:
    with env.http() as http:
        made = http.post("/v1/responses", json={"model": "bot", "input": "keep this"})
        assert made.status_code == 200, made.text
        conv, rid = made.headers["x-conversation-id"], made.json()["id"]
        said = error_of(
            http.post("/v1/responses", json={"model": "asker", "input": "x", "conversation": conv}),
            400,
            "conversation_model_mismatch",
            "conversation",
        )
        assert f"'{conv}' belongs to model 'bot'" in said and "previous_response_id" in said, said
        assert made.json()["model"] == "bot"
    # another credential learns nothing: as an unknown id
    with env.http("bob") as http:
        error_of(
            http.post("/v1/responses", json={"model": "asker", "input": "x", "conversation": conv}),
            404,
            "conversation_not_found",
            "conversation",
        )
        error_of(
            http.post("/v1/responses", json={"model": "asker", "input": "x", "previous_response_id": rid}),
            404,
            "previous_response_not_found",
            "previous_response_id",
        )


def test_agents_sdk_handoff_with_conversation_id_says_why(env: Env) -> None:
    with env.http() as http:
        conv = http.post("/v1/responses", json={"model": "bot", "input": "start"}).headers["x-conversation-id"]
    with pytest.raises(openai.BadRequestError) as caught:
        _run_handoff(env, conversation_id=conv)
    assert "belongs to model 'bot'" in str(caught.value)


def test_approvals_of_another_models_response_are_refused(env: Env) -> None:
    with env.http() as http:
        asked = http.post("/v1/responses", json={"model": "bot", "input": "CLOCK please"})
        assert asked.status_code == 200, asked.text
        request = next(i for i in asked.json()["output"] if i["type"] == "mcp_approval_request")
        answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
        body = {"model": "asker", "input": [answer], "previous_response_id": asked.json()["id"]}
        said = error_of(http.post("/v1/responses", json=body), 400, "unsupported_input", "input")
        assert "of model 'bot'" in said, said
        # new input after the open approval: 409 calls_pending, as for bot's own fork
        body = {"model": "asker", "input": "hi", "previous_response_id": asked.json()["id"]}
        error_of(http.post("/v1/responses", json=body), 409, "calls_pending", "input")


# ---------------------------------------------------------------- 2, 3. ignored fields type-checked

CHAT_REFUSED = [
    ({"prediction": 5}, "invalid_type", "prediction"),
    ({"prediction": {"type": "bogus", "content": "x"}}, "invalid_value", "prediction.type"),
    ({"prediction": {"type": "content"}}, "missing_required_parameter", "prediction.content"),
    ({"prediction": {"type": "content", "content": []}}, "empty_array", "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "text", "text": 5}]}}, "invalid_type", None),
    ({"moderation": "str"}, "invalid_type", "moderation"),
    ({"moderation": {}}, "missing_required_parameter", "moderation.model"),
    ({"web_search_options": 5}, "invalid_type", "web_search_options"),
    ({"web_search_options": {"search_context_size": "huge"}}, "invalid_value", None),
    ({"web_search_options": {"user_location": {"type": "bogus", "approximate": {}}}}, "invalid_value", None),
    (
        {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"city": 5}}}},
        "invalid_type",
        None,
    ),
    ({"web_search_options": {}}, "unsupported_parameter", "web_search_options"),
    ({"web_search_options": {"search_context_size": "low"}}, "unsupported_parameter", "web_search_options"),
]


@pytest.mark.parametrize(("extra", "code", "param"), CHAT_REFUSED)
def test_chat_prediction_moderation_and_web_search_options_are_checked(
    env: Env, extra: dict[str, Any], code: str, param: str | None
) -> None:
    with env.http() as http:
        body = {"model": "bot", "messages": [{"role": "user", "content": "hi"}], **extra}
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err = r.json()["error"]
    assert err["code"] == code, err
    key = next(iter(extra))
    assert (err["param"] == param) if param else err["param"].startswith(f"{key}."), err
    if code == "unsupported_parameter":
        assert "no web search" in err["message"], err


def test_chat_well_typed_prediction_and_moderation_are_accepted(env: Env) -> None:
    done = env.client().chat.completions.create(
        model="bot",
        messages=[{"role": "user", "content": "hi"}],
        prediction={"type": "content", "content": [{"type": "text", "text": "hello"}]},
        extra_body={"moderation": {"model": "omni-moderation-latest", "policy": None}},
    )
    assert done.choices[0].message.content == "bot saw: hi"


def test_responses_context_management_needs_an_entry(env: Env) -> None:
    with env.http() as http:
        body: dict[str, Any] = {"model": "bot", "input": "hi", "context_management": []}
        said = error_of(http.post("/v1/responses", json=body), 400, "empty_array", "context_management")
        assert "minimum length 1" in said
        body["context_management"] = [{"type": "compaction", "compact_threshold": 2000}]
        assert http.post("/v1/responses", json=body).status_code == 200


# ---------------------------------------------------------------- 4. unimplemented OpenAI routes


def test_compact_and_input_tokens_are_not_implemented_404s(env: Env) -> None:
    c = env.client()
    with pytest.raises(openai.NotFoundError) as compact:
        c.responses.compact(model="bot", input="hi")
    assert compact.value.code == "unknown_url" and "does not implement response compaction" in str(compact.value)
    with pytest.raises(openai.NotFoundError) as count:
        c.responses.input_tokens.count(model="bot", input="hi")
    assert count.value.code == "unknown_url" and "input token counting" in str(count.value)
    with env.http() as http:
        for method in ("GET", "DELETE", "POST"):
            for path in ("/v1/responses/compact", "/v1/responses/input_tokens"):
                said = error_of(
                    http.request(method, path, json={} if method == "POST" else None), 404, "unknown_url", None
                )
                assert said.startswith(f"Invalid URL ({method} {path}): this server does not implement"), said
        made = http.post("/v1/responses", json={"model": "bot", "input": "still fine"}).json()
        assert http.get(f"/v1/responses/{made['id']}").status_code == 200
        assert json.loads(http.get(f"/v1/responses/{made['id']}/input_items").text)["object"] == "list"
