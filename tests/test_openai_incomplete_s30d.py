"""Session 30, helper A: what a reply that did not complete shows, the same on every path.

1. A Responses stream closed each finished item (`response.output_item.done`) as `completed`,
   while its terminal `response.incomplete` and `GET` called the same items `incomplete`: a turn
   stopped by `max_steps` after its reasoning and text, a client call cut off by the token limit.
   Now an item finished before the end stays `completed` everywhere; the last one of a response
   that did not complete, and every client call of it (it can never be answered), is `incomplete`
   everywhere, its `output_item.done` held until the outcome is known.
2. A client call the token limit cut off showed in the chat stream (tool_calls deltas, finish
   `length`) but not in the non-stream answer (content "", no tool_calls); answering it was a 409
   `not_awaiting` where Responses says 400 `already_resolved`. Now both answers show the call, as
   OpenAI does, and an answer to it is a 400 `already_resolved` on both routes.

Real `appserver serve`, the real `openai` SDK, the fake OpenAI upstream answering by the last user
message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.openai_schema import validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

FA = {"type": "function", "name": "fa", "parameters": {"type": "object", "properties": {}}}
CHAT_FA = {"type": "function", "function": {"name": "fa", "parameters": {"type": "object", "properties": {}}}}


def last_user_text(req: RecordedRequest) -> str:
    for m in reversed(req.json["messages"]):
        if m["role"] == "user":
            c = m["content"]
            return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)
    return ""


def upstream_model(req: RecordedRequest) -> Reply:
    """MIX: reasoning, text, then a call of the first tool offered. CALLLEN: a call of `fa` whose
    arguments the token limit cut off (finish_reason length). Each event its own piece, a pause
    between them, so that the stream sees every item close before the turn ends."""
    said = last_user_text(req)
    if said.startswith("MIX"):
        name = req.json["tools"][0]["function"]["name"]
        chunks = [
            chunk(role="assistant", reasoning_content="hmm"),
            chunk(content="text then call"),
            chunk(tool_calls=[tool_delta(0, id="call_mix1", name=name, arguments="{}")]),
            chunk(finish_reason="tool_calls"),
        ]
    elif said.startswith("CALLLEN"):
        chunks = [
            chunk(role="assistant", tool_calls=[tool_delta(0, id="call_len", name="fa", arguments='{"a":')]),
            chunk(finish_reason="length"),
        ]
    else:
        chunks = [chunk(role="assistant", content=f"ok: {said}"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse([c], done=False) for c in chunks] + [b"data: [DONE]\n\n"], delay_s=0.05)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s30d") / "home"
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[providers.up]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        for args in (
            ("--name", "remote", "--model", "up:m"),
            ("--name", "steps1", "--model", "up:m", "--tool", "clock=allow", "--param", "max_steps=1"),
        ):
            made = run_cli(home, "agents", "create", *args, env=env)
            assert made.code == 0, made.err
        with serving(home, env=env) as sp:
            yield sp


@pytest.fixture
def client(srv: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(srv: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def statuses(output: list[Any]) -> dict[str, str | None]:
    return {o["id"]: o.get("status") for o in output}


def streamed(client: openai.OpenAI, **body: Any) -> tuple[dict[str, str | None], dict[str, Any]]:
    """(item id → status each `response.output_item.done` gave, the terminal event's response)."""
    done: dict[str, str | None] = {}
    final: dict[str, Any] | None = None
    with client.responses.create(stream=True, **body) as events:
        for e in events:
            dumped = e.model_dump(mode="json", exclude_unset=True)
            validate("ResponseStreamEvent", dumped)
            if e.type == "response.output_item.done":
                done[dumped["item"]["id"]] = dumped["item"].get("status")
            if e.type in ("response.completed", "response.incomplete", "response.failed"):
                final = dumped["response"]
    assert final is not None
    return done, final


def test_max_steps_stop_streams_the_item_statuses_the_response_keeps(client: openai.OpenAI, http: httpx.Client) -> None:
    done, final = streamed(client, model="steps1", input="MIX")
    assert final["status"] == "incomplete", final
    kept = http.get(f"/v1/responses/{final['id']}").json()
    assert done == statuses(final["output"]) == statuses(kept["output"]), (done, final["output"])
    # finished before the stop: completed; the note saying the agent stopped is the incomplete end
    assert [(o["type"], o["status"]) for o in final["output"]] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("mcp_call", "completed"),
        ("message", "incomplete"),
    ], final["output"]
    assert "max_steps" in final["output"][-1]["content"][0]["text"]
    # a non-stream request tells the same
    body = http.post("/v1/responses", json={"model": "steps1", "input": "MIX"}).json()
    assert [(o["type"], o["status"]) for o in body["output"]] == [(o["type"], o["status"]) for o in final["output"]]


def test_a_client_call_cut_by_the_token_limit_streams_as_incomplete(client: openai.OpenAI, http: httpx.Client) -> None:
    done, final = streamed(client, model="remote", input="CALLLEN", tools=[FA])
    assert final["status"] == "incomplete", final
    kept = http.get(f"/v1/responses/{final['id']}").json()
    assert done == statuses(final["output"]) == statuses(kept["output"]), (done, final["output"])
    ((call),) = final["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete" and call["arguments"] == '{"a":'


def chat_stream(client: openai.OpenAI, messages: list[Any]) -> tuple[dict[str, Any], str | None]:
    """The message a chat stream adds up to, and its finish_reason."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with client.chat.completions.create(
        model="remote",
        messages=messages,
        tools=[CHAT_FA],  # type: ignore[list-item]
        stream=True,
    ) as chunks:
        for c in chunks:
            choice = c.choices[0]
            if choice.delta.content is not None:
                content = (content or "") + choice.delta.content
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"type": "function", "function": {"arguments": ""}})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["function"]["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["function"]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def test_a_chat_call_cut_by_the_token_limit_is_in_both_answers_and_closed(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    cut_call = {"id": "call_len", "type": "function", "function": {"name": "fa", "arguments": '{"a":'}}
    asked = [{"role": "user", "content": "CALLLEN stream"}]
    message, finish = chat_stream(client, asked)
    assert finish == "length" and message == {"role": "assistant", "content": None, "tool_calls": [cut_call]}

    plain = [{"role": "user", "content": "CALLLEN plain"}]
    r = http.post("/v1/chat/completions", json={"model": "remote", "messages": plain, "tools": [CHAT_FA]})
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] == [cut_call], choice

    # answering the call either answer showed: the turn ended and closed it, as on Responses
    for transcript, shown in ((asked, message), (plain, choice["message"])):
        answer = [*transcript, shown, {"role": "tool", "tool_call_id": "call_len", "content": "r"}]
        a = http.post("/v1/chat/completions", json={"model": "remote", "messages": answer, "tools": [CHAT_FA]})
        assert a.status_code == 400, a.text
        err = a.json()["error"]
        assert err["code"] == "already_resolved" and err["param"] == "messages", err
        assert "call_len" in err["message"] and "token limit" in err["message"], err

    first = http.post("/v1/responses", json={"model": "remote", "input": "CALLLEN responses", "tools": [FA]}).json()
    answered = http.post(
        "/v1/responses",
        json={
            "model": "remote",
            "previous_response_id": first["id"],
            "input": [{"type": "function_call_output", "call_id": "call_len", "output": "r"}],
            "tools": [FA],
        },
    )
    assert answered.status_code == 400, answered.text
    assert answered.json()["error"]["code"] == "already_resolved", answered.text
    assert answered.json()["error"]["message"] == err["message"]  # the same words on both routes
