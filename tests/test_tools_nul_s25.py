"""A NUL in what an upstream model streams (a tool call's id or name, its reasoning, a client call's
arguments) on the PostgreSQL store (found by an outside test, round 25).

PostgreSQL text cannot hold a NUL. A `clock` call whose id held one ran, then the turn failed with
a 500 "the turn could not be saved": the assistant message with the call was already stored (the
checkpoint before a tool runs), its result never was, so every later request sent an unanswered
call upstream. A NUL in the call's name, in the reasoning, or in a client call's arguments (the
pending call's raw column) failed the turn too. Now the agent loop gives such a call a fresh id
and writes the name's NUL as U+FFFD; the store writes NUL as U+FFFD in the raw text columns of
messages and pending_calls (as `store copy` does).

A real `appserver serve` on a database of its own, a loopback fake OpenAI upstream, real HTTP.
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
from tests.support.pg import temp_database
from tests.support.serve import serving

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.timeout(60)

F_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _sse(*chunks: dict[str, Any]) -> Reply:
    return Reply(pieces=[openai_sse([chunk(role="assistant"), *chunks])])


def _call(call_id: str, name: str, arguments: str = "{}") -> Reply:
    return _sse(
        chunk(tool_calls=[tool_delta(0, id=call_id, name=name, arguments=arguments)]),
        chunk(finish_reason="tool_calls"),
    )


def upstream_model(req: RecordedRequest) -> Reply:
    """A tool result is answered "done"; the user's word picks the reply with a NUL in it."""
    last = req.json["messages"][-1]
    if last["role"] == "tool":
        return _sse(chunk(content="done"), chunk(finish_reason="stop"))
    word = last["content"] if isinstance(last["content"], str) else ""
    if word == "nul-id":
        return _call("call_\x00nul", "clock")
    if word == "nul-name":
        return _call("call_name1", "clo\x00ck")
    if word == "nul-reasoning":  # reasoning, then a call: the checkpoint before the call stores it
        return _sse(
            chunk(reasoning_content="think\x00ing"),
            chunk(tool_calls=[tool_delta(0, id="call_\x00why", name="clock", arguments="{}")]),
            chunk(finish_reason="tool_calls"),
        )
    if word == "nul-args":  # a client call whose (not JSON) arguments hold a NUL: a pending call
        return _call("call_args1", "f", '{"a": "x\x00"}')
    return _sse(chunk(content="again: " + word), chunk(finish_reason="stop"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, FakeOpenAI]]:
    with temp_database("nul_s25") as url, FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("nul_s25") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[store]\nurl = "{url}"\n\n'
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        made = run_cli(home, "agents", "create", "--name", "fa", "--model", "fake:m", "--tool", "clock=allow", env=env)
        assert made.code == 0, made.err
        with serving(home, env=env) as sp:
            yield sp.url + "/v1", url, fake


def _chat(base: str, conv: str, text: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        base + "/chat/completions",
        json={"model": "fa", "messages": [{"role": "user", "content": text}], **extra},
        headers={"X-Conversation-Id": conv},
        timeout=30,
    )


def _rows(url: str, conv: str) -> list[dict[str, Any]]:
    with psycopg.connect(url, row_factory=psycopg.rows.dict_row) as c:
        return c.execute(
            "SELECT role, tool_calls, tool_call_id, name, reasoning, content FROM messages "
            "WHERE conversation_id=%s ORDER BY id",
            (conv,),
        ).fetchall()


def _answered_calls(messages: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The ids of the calls a request sent upstream, and of the tool results it sent."""
    calls = [c["id"] for m in messages if m.get("tool_calls") for c in m["tool_calls"]]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    return calls, results


def _next_turn_sends_every_call_answered(base: str, conv: str, fake: FakeOpenAI) -> list[dict[str, Any]]:
    then = _chat(base, conv, "later")
    assert then.status_code == 200, then.text
    assert then.json()["choices"][0]["message"]["content"] == "again: later"
    sent = fake.requests[-1].json["messages"]
    calls, results = _answered_calls(sent)
    assert calls and calls == results, sent
    assert all("\x00" not in i for i in calls)
    return list(sent)


@pytest.mark.parametrize("word", ["nul-id", "nul-reasoning"])
def test_a_call_whose_id_holds_a_nul_runs_once_and_is_stored_with_its_result(
    srv: tuple[str, str, FakeOpenAI], word: str
) -> None:
    base, url, fake = srv
    conv = f"conv-{word}"
    r = _chat(base, conv, word)
    assert r.status_code == 200, r.text  # before: 500 "the turn could not be saved"
    assert r.json()["choices"][0]["message"]["content"] == "done"
    rows = _rows(url, conv)
    assert [m["role"] for m in rows] == ["user", "assistant", "tool", "assistant"]
    (call,) = json.loads(rows[1]["tool_calls"])
    assert call["id"].startswith("call_") and "\x00" not in call["id"]  # a fresh id
    assert rows[2]["tool_call_id"] == call["id"] and rows[2]["name"] == "clock"
    assert "UTC" in json.loads(rows[2]["content"])  # the clock ran
    if word == "nul-reasoning":
        assert rows[1]["reasoning"] == "think\ufffding"
    _next_turn_sends_every_call_answered(base, conv, fake)


def test_a_call_whose_name_holds_a_nul_is_answered_as_an_unknown_tool(srv: tuple[str, str, FakeOpenAI]) -> None:
    base, url, fake = srv
    conv = "conv-nul-name"
    r = _chat(base, conv, "nul-name")
    assert r.status_code == 200, r.text  # before: 500
    rows = _rows(url, conv)
    assert [m["role"] for m in rows] == ["user", "assistant", "tool", "assistant"]
    (call,) = json.loads(rows[1]["tool_calls"])
    assert call == {**call, "id": "call_name1", "name": "clo\ufffdck"}
    assert rows[2]["tool_call_id"] == "call_name1" and rows[2]["name"] == "clo\ufffdck"
    assert "clo\ufffdck" in json.loads(rows[2]["content"])  # the error names the call's tool
    _next_turn_sends_every_call_answered(base, conv, fake)


def test_a_client_call_whose_arguments_hold_a_nul_waits_for_the_client(srv: tuple[str, str, FakeOpenAI]) -> None:
    base, url, _ = srv
    conv = "conv-nul-args"
    r = _chat(base, conv, "nul-args", tools=[F_CHAT])
    assert r.status_code == 200, r.text  # before: 500 (the pending call's arguments)
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "call_args1" and call["function"]["name"] == "f"
    with psycopg.connect(url) as c:
        row = c.execute("SELECT arguments, status FROM pending_calls WHERE call_id='call_args1'").fetchone()
    assert row == ('{"a": "x\ufffd"}', "pending")
