"""OpenAI surface fixes from an outside tester's findings with real clients (round 23, second part).

Through a real `appserver serve` (SQLite) with real HTTP clients: the offline `echo` agent
`assistant` (`/call TOOL {json}`), `asker` (its own tool `clock`), and `fa` on a loopback fake
OpenAI upstream.

1. A model reply with text after its client tool call ("before ", call f, "after"): the answer
   to the call shows the model's next reply (before: `output: []`, chat content "").
2. Legacy `functions`, two calls answered one at a time: the final request resent unchanged forks
   with the results the transcript holds (before: the fork asked for the second call again, and a
   further resend gave both calls the second call's result).
3. A tool message placed before the assistant message that made its call, and a legacy `function`
   answer naming another function than the one shown: 400 `unknown_tool_call` (before: dropped,
   or matched to a call the client was never shown).
4. `tool_choice {"type": "mcp", "server_label": <agent>, "name": <client function>}`: 400.
5. An answer to a call another request answered first says so (not "its turn ended").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)

F_RESP = {"type": "function", "name": "f", "parameters": {"type": "object"}}
F_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def upstream_model(req: RecordedRequest) -> Reply:
    """A tool result is answered "got <result>"; anything else with text, call f, then more text."""
    last = req.json["messages"][-1]
    if last["role"] == "tool":
        return Reply(
            pieces=[
                openai_sse([chunk(role="assistant", content=f"got {last['content']}"), chunk(finish_reason="stop")])
            ]
        )
    return Reply(
        pieces=[
            openai_sse(
                [
                    chunk(role="assistant", content="before "),
                    chunk(tool_calls=[tool_delta(0, id="call_T", name="f", arguments="{}")]),
                    chunk(content="after"),
                    chunk(finish_reason="tool_calls"),
                ]
            )
        ]
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeOpenAI]]:
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s23b") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        r = run_cli(home, "agents", "create", "--name", "fa", "--model", "fake:m", "--json", env=env)
        assert r.code == 0, r.err
        r = run_cli(home, "agents", "create", "--name", "asker", "--tool", "clock=ask", "--json", env=env)
        assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp.url + "/v1", fake


@pytest.fixture
def base(srv: tuple[str, FakeOpenAI]) -> str:
    return srv[0]


@pytest.fixture
def c() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def _texts(body: dict[str, Any]) -> list[str]:
    return [p["text"] for o in body["output"] if o["type"] == "message" for p in o["content"]]


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize("how", ["previous_response_id", "conversation"])
def test_an_answer_to_a_call_made_between_texts_shows_the_models_next_reply(
    base: str, c: httpx.Client, how: str
) -> None:
    asked = c.post(base + "/responses", json={"model": "fa", "input": "go", "tools": [F_RESP]})
    paused = _ok(asked)
    assert _texts(paused) == ["before ", "after"]
    answer: dict[str, Any] = {
        "model": "fa",
        "tools": [F_RESP],
        "input": [{"type": "function_call_output", "call_id": "call_T", "output": "hi"}],
    }
    answer[how] = paused["id"] if how == "previous_response_id" else asked.headers["x-conversation-id"]
    answered = _ok(c.post(base + "/responses", json=answer))
    assert answered["status"] == "completed"
    assert _texts(answered) == ["got hi"]  # before: output []


def test_an_answer_streamed_to_a_call_made_between_texts_shows_the_models_next_reply(
    base: str, c: httpx.Client
) -> None:
    paused = _ok(c.post(base + "/responses", json={"model": "fa", "input": "go", "tools": [F_RESP]}))
    answer = {
        "model": "fa",
        "tools": [F_RESP],
        "previous_response_id": paused["id"],
        "input": [{"type": "function_call_output", "call_id": "call_T", "output": "hi"}],
        "stream": True,
    }
    with c.stream("POST", base + "/responses", json=answer) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "got hi"  # before: no delta at all
    done = next(e["response"] for e in events if e["type"] == "response.completed")
    assert _texts(done) == ["got hi"]


def test_a_chat_answer_to_a_call_made_between_texts_shows_the_models_next_reply(base: str, c: httpx.Client) -> None:
    user = {"role": "user", "content": "go"}
    asked = _ok(c.post(base + "/chat/completions", json={"model": "fa", "messages": [user], "tools": [F_CHAT]}))
    m = asked["choices"][0]["message"]
    msgs = [
        user,
        {"role": "assistant", "content": m["content"], "tool_calls": m["tool_calls"]},
        {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "hi"},
    ]
    answered = _ok(c.post(base + "/chat/completions", json={"model": "fa", "messages": msgs, "tools": [F_CHAT]}))
    assert answered["choices"][0]["message"]["content"] == "got hi"  # before: ""


def test_a_resent_legacy_transcript_keeps_each_calls_own_result(base: str, c: httpx.Client) -> None:
    fns = [{"name": "f", "parameters": {"type": "object"}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": '/call f {"x":1,"t":"s23b"}\n/call f {"x":2}'}]

    def post() -> dict[str, Any]:
        r = c.post(base + "/chat/completions", json={"model": "assistant", "messages": msgs, "functions": fns})
        return _ok(r)["choices"][0]

    for result in ("R1", "R2"):
        shown = post()
        assert shown["finish_reason"] == "function_call"
        msgs += [
            {"role": "assistant", "content": None, "function_call": shown["message"]["function_call"]},
            {"role": "function", "name": "f", "content": result},
        ]
    final = post()
    assert final["message"]["content"] == "f -> R1\nf -> R2"
    for _ in range(2):  # an SDK retry, then another
        again = post()
        # before: the first resend asked for f {"x":2} again, the second answered "f -> R2\nf -> R2"
        assert again["finish_reason"] == "stop", again
        assert again["message"]["content"] == "f -> R1\nf -> R2"


def test_a_tool_message_before_the_assistant_message_that_made_its_call_is_refused(base: str, c: httpx.Client) -> None:
    user = {"role": "user", "content": '/call f {"a":"s23b"}\n/call f {"b":1}'}
    asked = _ok(c.post(base + "/chat/completions", json={"model": "assistant", "messages": [user], "tools": [F_CHAT]}))
    calls = asked["choices"][0]["message"]["tool_calls"]
    msgs = [
        user,
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "A"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "B"},
    ]
    r = c.post(base + "/chat/completions", json={"model": "assistant", "messages": msgs, "tools": [F_CHAT]})
    assert r.status_code == 400, r.text  # before: 200, the misplaced result dropped, its call asked again
    assert r.json()["error"]["code"] == "unknown_tool_call"
    assert calls[0]["id"] in r.json()["error"]["message"]


def test_a_legacy_answer_naming_a_function_not_shown_is_refused(base: str, c: httpx.Client) -> None:
    fns = [{"name": "f", "parameters": {"type": "object"}}, {"name": "g", "parameters": {"type": "object"}}]
    user = {"role": "user", "content": "/call f {}\n/call g {}"}
    shown = _ok(c.post(base + "/chat/completions", json={"model": "assistant", "messages": [user], "functions": fns}))
    call = shown["choices"][0]["message"]["function_call"]
    assert call["name"] == "f"
    msgs = [
        user,
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "g", "content": "G"},
    ]
    r = c.post(base + "/chat/completions", json={"model": "assistant", "messages": msgs, "functions": fns})
    assert r.status_code == 400, r.text  # before: 200, answering the hidden call of g
    assert r.json()["error"]["code"] == "unknown_tool_call"


def test_an_mcp_tool_choice_naming_a_client_function_is_refused(base: str, c: httpx.Client) -> None:
    g = {"type": "function", "name": "g", "parameters": {"type": "object"}}
    body: dict[str, Any] = {"model": "asker", "input": "hi", "tools": [g]}
    r = c.post(base + "/responses", json={**body, "tool_choice": {"type": "mcp", "server_label": "asker", "name": "g"}})
    assert r.status_code == 400, r.text  # before: 200, the model made to call the client's g
    assert r.json()["error"]["code"] == "invalid_tool_choice"
    own = c.post(
        base + "/responses", json={**body, "tool_choice": {"type": "mcp", "server_label": "asker", "name": "clock"}}
    )
    assert own.status_code == 200, own.text  # the agent's own tool: still taken


def test_an_answer_that_lost_to_another_requests_answer_says_so(base: str, c: httpx.Client) -> None:
    asked = c.post(base + "/responses", json={"model": "assistant", "input": "/call f {}", "tools": [F_RESP]})
    call = next(o for o in _ok(asked)["output"] if o["type"] == "function_call")["call_id"]
    conv = asked.headers["x-conversation-id"]
    answer = {
        "model": "assistant",
        "tools": [F_RESP],
        "conversation": conv,
        "input": [{"type": "function_call_output", "call_id": call, "output": "R"}],
    }
    _ok(c.post(base + "/responses", json=answer))
    late = c.post(base + "/responses", json={**answer, "input": [{**answer["input"][0], "output": "other"}]})
    assert late.status_code == 400, late.text
    error = late.json()["error"]
    assert error["code"] == "already_resolved"
    assert "another request answered it first" in error["message"]  # before: "its turn ended (cancelled, …)"
