"""Findings of the s38 attack on the OpenAI surface (A), fixed by I:

F1. `max_tool_calls` sent as an integral float (`1.0`, `0.0`, `1e0`: JavaScript clients, serializers
    that write floats) was accepted and echoed as the integer, but not enforced: every call ran.
F2. A keyed repeat of a request that ANSWERS calls (function_call_output with previous_response_id,
    a chat transcript ending in `tool` messages, an approval) naming no conversation, whose stream
    was cut (or whose server was killed), landed in a NEW conversation: the answers were stored
    twice and the conversation forked. It now re-runs in place, the answers held once.
F4. Past `max_tool_calls`, a `tool_choice` that named only the server's tools (an allowed_tools
    choice, an `mcp` one, a function one) became plain `auto` over the client's functions the
    client had left out of it: the model was offered a tool it was not allowed.

Real parts: `appserver serve` on SQLite on loopback, the real `openai` SDK, a loopback fake
OpenAI-compatible upstream (tests/fakes/openai_upstream.py) recording every model call.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

T = 30.0
SLOW_WORDS = 40  # the reply after an answer: one word every SLOW_GAP_S, long enough to be cut
SLOW_GAP_S = 0.05
MYFN = {"type": "function", "name": "myfn", "parameters": {"type": "object", "properties": {}}}
CHAT_MYFN = {"type": "function", "function": {"name": "myfn", "parameters": {"type": "object", "properties": {}}}}


def _call(name: str, n: int = 1) -> Reply:
    calls = [tool_delta(i, id=f"call_{uuid.uuid4().hex[:10]}", name=name, arguments="{}") for i in range(n)]
    return Reply(pieces=[openai_sse([chunk(role="assistant", tool_calls=calls), chunk(finish_reason="tool_calls")])])


def _text(text: str) -> Reply:
    return Reply(pieces=[openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop")])])


def _slow() -> Reply:
    """A reply of SLOW_WORDS words, each in its own HTTP chunk SLOW_GAP_S apart."""
    words = [openai_sse([chunk(role="assistant", content=f"w{i} ")], done=False) for i in range(SLOW_WORDS)]
    return Reply(pieces=[*words, openai_sse([chunk(finish_reason="stop")])], delay_s=SLOW_GAP_S)


def model(req: RecordedRequest) -> Reply:
    """By the last user message: `CLOCK` calls clock (twice per step for `CLOCK2`) until three
    results are in; `MYFN` / `ASK` call myfn / clock once, then reply slowly; else `done`."""
    messages = (req.json or {}).get("messages", [])
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    said = str(messages[last].get("content") if messages else "")
    results = sum(1 for m in messages[last:] if m.get("role") == "tool")
    if said.startswith("CLOCK"):
        return _call("clock", 2 if said.startswith("CLOCK2") else 1) if results < 3 else _text("done")
    if said.startswith(("MYFN", "ASK")):
        return _call("myfn" if said.startswith("MYFN") else "clock") if not results else _slow()
    return _text("done")


@dataclass
class Served:
    home: Path
    fake: FakeOpenAI
    sp: ServeProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.sp.url + "/v1", api_key="unused", max_retries=0, timeout=T)

    def rows(self, sql: str, *args: Any) -> list[Any]:
        with sqlite3.connect(self.home / "appserver.db", timeout=10) as db:
            return db.execute(sql, args).fetchall()

    def results(self, conversation: str) -> list[str]:
        """The tool results `conversation` holds, by call id."""
        return [
            c
            for (c,) in self.rows(
                "SELECT tool_call_id FROM messages WHERE conversation_id=? AND role='tool'", conversation
            )
        ]

    def conversations(self) -> int:
        return int(self.rows("SELECT count(*) FROM conversations")[0][0])

    def until_cancelled(self, conversation: str) -> None:
        wait_for(
            lambda: self.rows(
                "SELECT 1 FROM turns WHERE conversation_id=? AND status IN ('cancelled','interrupted')", conversation
            ),
            20,
            "the end of the turn its client left",
        )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with FakeOpenAI() as fake:
        fake.responder = model
        home = tmp_path / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, policy in (("a", "allow"), ("b", "ask")):
            made = run_cli(
                home, "agents", "create", "--name", name, "--model", "fake:m", "--tool", f"clock={policy}", env=cli
            )
            assert made.code == 0, made.err
        sp = start_serve(home, env=cli)
        box = Served(home, fake, sp)
        try:
            yield box
        finally:
            box.sp.kill()


def ran(response: Any) -> list[str]:
    """The server-tool calls a Response shows as run."""
    return [i.name for i in response.output if i.type == "mcp_call" and i.error is None]


# ---------------------------------------------------------------- F1


@pytest.mark.parametrize("cap", [0.0, 1.0, 2.0])
def test_an_integral_float_max_tool_calls_is_enforced(served: Served, cap: float) -> None:
    with served.client() as client:
        response = client.responses.create(model="a", input="CLOCK2", max_tool_calls=cap)  # type: ignore[arg-type]
    assert response.status == "completed", response
    assert response.max_tool_calls == int(cap)
    assert len(ran(response)) == int(cap), response.output


def test_max_tool_calls_written_1e0_is_enforced(served: Served) -> None:
    raw = '{"model": "a", "input": "CLOCK2", "max_tool_calls": 1e0}'
    r = httpx.post(
        served.sp.url + "/v1/responses", content=raw, headers={"content-type": "application/json"}, timeout=T
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["max_tool_calls"] == 1
    assert [i["name"] for i in body["output"] if i["type"] == "mcp_call" and not i.get("error")] == ["clock"]


# ---------------------------------------------------------------- F4


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "clock"}]},
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "clock"}]},
        {"type": "mcp", "server_label": "a"},
        {"type": "mcp", "server_label": "a", "name": "clock"},
        {"type": "function", "name": "clock"},
    ],
)
def test_past_the_cap_a_choice_of_the_servers_tools_offers_no_other_tool(
    served: Served, choice: dict[str, Any]
) -> None:
    with served.client() as client:
        response = client.responses.create(
            model="a",
            input="hello",
            tools=[MYFN],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tool_calls=0,
        )
    assert response.status == "completed" and response.output_text == "done", response
    sent = served.fake.requests[-1].json or {}
    assert not sent.get("tools"), sent  # never the client's myfn, which the choice left out
    assert sent.get("tool_choice") in (None, "none"), sent


def test_past_the_cap_an_allowed_tools_choice_keeps_the_clients_tools_it_lists(served: Served) -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "clock"}, {"type": "function", "name": "myfn"}],
    }
    with served.client() as client:
        client.responses.create(model="a", input="hello", tools=[MYFN], tool_choice=choice, max_tool_calls=0)  # type: ignore[list-item,arg-type]
    sent = served.fake.requests[-1].json or {}
    assert [t["function"]["name"] for t in sent.get("tools") or []] == ["myfn"], sent


# ---------------------------------------------------------------- F2


def _cut(events: Any) -> None:
    """Read a stream until some reply text was shown, then leave (the client gone)."""
    for event in events:
        kind = getattr(event, "type", None)
        if kind == "response.output_text.delta" or (kind is None and event.choices and event.choices[0].delta.content):
            break
    events.close()


def _responses_answer_retry(served: Served, first: Any, answer: dict[str, Any], agent: str) -> tuple[str, str, Any]:
    """Send `answer` to `first` keyed and streamed, leave mid-reply, send it again: (the first
    attempt's conversation, the repeat's, the repeat's final Response)."""
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    kw: dict[str, Any] = dict(
        model=agent, previous_response_id=first.id, input=[answer], stream=True, extra_headers=key
    )
    if agent == "a":
        kw["tools"] = [MYFN]
    with served.client() as client:
        raw = client.responses.with_raw_response.create(**kw)
        conversation = raw.headers["x-conversation-id"]
        _cut(raw.parse())
        served.until_cancelled(conversation)
        again = client.responses.with_raw_response.create(**kw)
        final = [e for e in again.parse() if e.type == "response.completed"]
    assert len(final) == 1
    return conversation, again.headers["x-conversation-id"], final[0].response


def test_a_keyed_repeat_of_function_call_output_re_runs_in_its_conversation(served: Served) -> None:
    with served.client() as client:
        first = client.responses.create(model="a", input="MYFN", tools=[MYFN])  # type: ignore[list-item]
    [call] = [i for i in first.output if i.type == "function_call"]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "found"}
    conversation, again, response = _responses_answer_retry(served, first, answer, "a")
    assert again == conversation  # not a fork holding the result a second time
    assert response.output_text.strip() == " ".join(f"w{i}" for i in range(SLOW_WORDS))
    assert served.results(conversation) == [call.call_id]
    assert served.conversations() == 1


def test_a_keyed_repeat_of_an_approval_re_runs_in_its_conversation_without_running_the_call_again(
    served: Served,
) -> None:
    with served.client() as client:
        first = client.responses.create(model="b", input="ASK")
    [asked] = [i for i in first.output if i.type == "mcp_approval_request"]
    answer = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}
    conversation, again, response = _responses_answer_retry(served, first, answer, "b")
    assert again == conversation
    assert response.status == "completed"
    assert len(served.results(conversation)) == 1  # the approved clock call ran once
    assert served.conversations() == 1


def test_a_keyed_repeat_of_a_chat_transcript_ending_in_tool_results_re_runs_in_place(served: Served) -> None:
    with served.client() as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "MYFN"}]
        first = client.chat.completions.create(model="a", messages=messages, tools=[CHAT_MYFN])  # type: ignore[arg-type,list-item]
        [call] = first.choices[0].message.tool_calls or []
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "found"},
        ]
        kw: dict[str, Any] = dict(
            model="a",
            messages=messages,
            tools=[CHAT_MYFN],
            stream=True,
            extra_headers={"Idempotency-Key": f"k-{uuid.uuid4().hex}"},
        )
        raw = client.chat.completions.with_raw_response.create(**kw)
        conversation = raw.headers["x-conversation-id"]
        _cut(raw.parse())
        served.until_cancelled(conversation)
        again = client.chat.completions.with_raw_response.create(**kw)
        text = "".join(c.choices[0].delta.content or "" for c in again.parse() if c.choices)
    assert again.headers["x-conversation-id"] == conversation
    assert text.strip() == " ".join(f"w{i}" for i in range(SLOW_WORDS))
    assert served.results(conversation) == [call.id]
    assert served.conversations() == 1


def test_a_keyed_repeat_of_function_call_output_after_a_crash_re_runs_in_its_conversation(served: Served) -> None:
    with served.client() as client:
        first = client.responses.create(model="a", input="MYFN", tools=[MYFN])  # type: ignore[list-item]
    [call] = [i for i in first.output if i.type == "function_call"]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "found"}
    body = {"model": "a", "previous_response_id": first.id, "input": [answer], "tools": [MYFN], "stream": True}
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    with (
        httpx.Client(timeout=T) as http,
        http.stream("POST", served.sp.url + "/v1/responses", json=body, headers=key) as r,
    ):
        assert r.status_code == 200
        conversation = r.headers["x-conversation-id"]
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("type") == "response.output_text.delta":
                served.sp.kill()  # kill -9 mid-reply
                break
    served.sp = start_serve(served.home, env=cli_env(served.home))
    with served.client() as client:
        again = client.responses.with_raw_response.create(**body, extra_headers=key)
        final = [e for e in again.parse() if e.type == "response.completed"]
    assert again.headers["x-conversation-id"] == conversation
    assert len(final) == 1
    assert served.results(conversation) == [call.call_id]
    assert served.conversations() == 1
