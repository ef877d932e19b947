"""OpenAI surface fixes from an outside tester's findings with real clients (round 23).

Through a real `appserver serve` with the real `openai` SDK: the offline `echo` agent `assistant`
(`/slow N`, `/call TOOL {json}`), and `remote` / `solo` on a loopback fake OpenAI upstream.

1. Input queued behind a turn that then pauses for a client tool call has not run: the paused turn
   is still its conversation's head, so the usual OpenAI answer (`function_call_output` with
   `previous_response_id`; a stateless chat transcript with the tool message) continues it in
   that conversation instead of a fork, and the queued input runs after it.
2. Legacy `functions`: a reply with two calls shows the first; its `function` answer continues the
   same conversation and the next call comes back, until all are answered.
3. `tool_choice {"type": "mcp", "server_label": <agent>}` with no name requires one of the
   agent's own tools, never the client's functions.
4. `instructions` given as messages is checked as `input` messages are (content required).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

F_RESP = {"type": "function", "name": "f", "parameters": {"type": "object"}}
F_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FUNCS = [{"name": "f", "parameters": {"type": "object"}}, {"name": "g", "parameters": {"type": "object"}}]


def upstream_model(req: RecordedRequest) -> Reply:
    return Reply(pieces=[openai_sse([chunk(role="assistant", content="ok"), chunk(finish_reason="stop")])])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home: Path = tmp_path_factory.mktemp("s23") / "home"
        home.mkdir()
        # a queued input the fix leaves waiting would otherwise wait 300 s before the old code's failure shows
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
            "[limits]\nclient_tool_timeout_s = 20\n"
        )
        env = cli_env(home)
        for args in (("--name", "remote"), ("--name", "solo", "--tool", "schedule=deny")):
            r = run_cli(home, "agents", "create", *args, "--model", "fake:m", "--json", env=env)
            assert r.code == 0, r.err
        r = run_cli(home, "agents", "create", "--name", "asker", "--tool", "clock=ask", "--json", env=env)
        assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def fake(srv: tuple[ServeProcess, FakeOpenAI]) -> FakeOpenAI:
    srv[1].requests.clear()
    return srv[1]


class Streamed(threading.Thread):
    """A streamed request read in the background: `accepted` once its input is queued (the first
    event), `events` every event, `error` what the stream raised."""

    def __init__(self, open_stream: Any) -> None:
        super().__init__(daemon=True)
        self.open_stream = open_stream
        self.accepted = threading.Event()
        self.events: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for event in self.open_stream():
                self.events.append(event)
                self.accepted.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.accepted.set()

    def final_response(self) -> Any:
        done = [e.response for e in self.events if e.type in ("response.completed", "response.incomplete")]
        assert done, (self.error, [e.type for e in self.events])
        return done[-1]


def _pause_behind_a_running_turn(
    client: openai.OpenAI, conv: str, pauser: Streamed, model: str = "assistant"
) -> Streamed:
    """Turn A runs in `conv`; `pauser` (B, which will pause for client tool f) and D ("after") are
    queued behind it, in that order; then A's client leaves, cancelling A, so B runs and pauses
    with D still queued behind it. D's stream."""
    pinned = {"X-Conversation-Id": conv}
    running = client.responses.create(model=model, input="/slow 100000", stream=True, extra_headers=pinned)
    for event in running:
        if event.type == "response.output_text.delta":
            break  # A runs
    pauser.start()
    assert pauser.accepted.wait(30) and pauser.error is None, pauser.error
    queued = Streamed(lambda: client.responses.create(model=model, input="after", stream=True, extra_headers=pinned))
    queued.start()
    assert queued.accepted.wait(30) and queued.error is None, queued.error
    running.close()  # A's client leaves: A is cancelled, B runs and pauses, D stays queued
    pauser.join(30)
    assert not pauser.is_alive()
    return queued


def test_an_answer_by_previous_response_id_continues_a_turn_paused_with_input_queued_behind_it(
    client: openai.OpenAI,
) -> None:
    conv = "s23-queued-behind-pause"
    b = Streamed(
        lambda: client.responses.create(
            model="assistant",
            input="/call f {}",
            tools=[F_RESP],  # type: ignore[list-item]
            stream=True,
            extra_headers={"X-Conversation-Id": conv},
        )
    )
    d = _pause_behind_a_running_turn(client, conv, b)
    paused = b.final_response()
    call = next(o for o in paused.output if o.type == "function_call")
    raw = client.responses.with_raw_response.create(
        model="assistant",
        previous_response_id=paused.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "R"}],
        tools=[F_RESP],  # type: ignore[list-item]
    )
    # Before: a fork answered it, and the conversation kept waiting for the call (D with it).
    assert raw.headers["x-conversation-id"] == conv
    answered = raw.parse()
    assert answered.status == "completed" and answered.output_text == "f -> R"
    d.join(30)
    assert not d.is_alive() and d.error is None, d.error
    after = d.final_response()
    assert after.status == "completed" and after.output_text == "echo: after"
    # nothing waits in the conversation any more: new input runs there
    nxt = client.responses.create(model="assistant", input="next", conversation=conv)
    assert nxt.output_text == "echo: next"


def test_an_approval_by_previous_response_id_continues_a_turn_paused_with_input_queued_behind_it(
    client: openai.OpenAI,
) -> None:
    conv = "s23-approval-behind-pause"
    b = Streamed(
        lambda: client.responses.create(
            model="asker", input="/call clock {}", stream=True, extra_headers={"X-Conversation-Id": conv}
        )
    )
    d = _pause_behind_a_running_turn(client, conv, b, "asker")
    paused = b.final_response()
    ask = next(o for o in paused.output if o.type == "mcp_approval_request")
    raw = client.responses.with_raw_response.create(
        model="asker",
        previous_response_id=paused.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": ask.id, "approve": True}],
    )
    assert raw.headers["x-conversation-id"] == conv  # before: a fork
    answered = raw.parse()
    assert [o.type for o in answered.output][:1] == ["mcp_call"] and answered.status == "completed"
    d.join(30)
    assert not d.is_alive() and d.error is None, d.error
    assert d.final_response().output_text == "echo: after"


def test_a_stateless_chat_answer_continues_a_turn_paused_with_input_queued_behind_it(client: openai.OpenAI) -> None:
    conv = "s23-chat-queued-behind-pause"
    asked = [{"role": "user", "content": "/call f {}"}]

    def chat_stream() -> Any:
        return client.chat.completions.create(
            model="assistant",
            messages=asked,  # type: ignore[arg-type]
            tools=[F_CHAT],  # type: ignore[list-item]
            stream=True,
            extra_headers={"X-Conversation-Id": conv},
        )

    b = Streamed(chat_stream)
    d = _pause_behind_a_running_turn(client, conv, b)
    calls = [tc for e in b.events for tc in (e.choices[0].delta.tool_calls or []) if e.choices]
    assert calls and calls[0].id and calls[0].function and calls[0].function.name == "f", b.events
    transcript = [
        *asked,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": calls[0].id, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "R"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="assistant",
        messages=transcript,  # type: ignore[arg-type]
        tools=[F_CHAT],  # type: ignore[list-item]
    )
    assert raw.headers["x-conversation-id"] == conv  # before: a fork
    assert raw.parse().choices[0].message.content == "f -> R"
    d.join(30)
    assert not d.is_alive() and d.error is None, d.error
    assert d.final_response().output_text == "echo: after"


def test_new_input_by_previous_response_id_while_paused_with_input_queued_is_still_refused(
    client: openai.OpenAI,
) -> None:
    conv = "s23-new-input-while-paused"
    b = Streamed(
        lambda: client.responses.create(
            model="assistant",
            input="/call f {}",
            tools=[F_RESP],  # type: ignore[list-item]
            stream=True,
            extra_headers={"X-Conversation-Id": conv},
        )
    )
    d = _pause_behind_a_running_turn(client, conv, b)
    paused = b.final_response()
    with pytest.raises(openai.ConflictError) as exc:
        client.responses.create(model="assistant", input="more", previous_response_id=paused.id)
    assert exc.value.response.json()["error"]["code"] == "calls_pending"
    call = next(o for o in paused.output if o.type == "function_call")
    client.responses.create(
        model="assistant",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "R"}],
        conversation=conv,
        tools=[F_RESP],  # type: ignore[list-item]
    )
    d.join(30)
    assert d.final_response().output_text == "echo: after"


# ---------------------------------------------------------------- 2. legacy functions, one at a time


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_functions_come_back_one_at_a_time_in_one_conversation(client: openai.OpenAI, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": '/call f {"a":1}\n/call g {"b":2}\n/call f {"a":3}'}]
    shown: list[tuple[str, str]] = []
    convs: list[str] = []
    for _ in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="assistant",
            messages=messages,
            functions=FUNCS,  # type: ignore[arg-type]
            stream=stream,
        )
        convs.append(raw.headers["x-conversation-id"])
        if stream:
            deltas = [e.choices[0] for e in raw.parse() if e.choices]
            finish = next(c.finish_reason for c in deltas if c.finish_reason)
            content = "".join(c.delta.content or "" for c in deltas)
            fcs = [c.delta.function_call for c in deltas if c.delta.function_call]
            call = (fcs[0].name, "".join(fc.arguments or "" for fc in fcs)) if fcs else None
        else:
            choice = raw.parse().choices[0]
            finish, content = choice.finish_reason, choice.message.content or ""
            fc = choice.message.function_call
            call = (fc.name, fc.arguments) if fc else None
        if finish != "function_call":
            break
        assert call is not None
        shown.append(call)
        messages += [
            {"role": "assistant", "content": None, "function_call": {"name": call[0], "arguments": call[1]}},
            {"role": "function", "name": call[0], "content": f"R{len(shown)}"},
        ]
    # before: f only, then its answer went to a new conversation and g never came back
    assert shown == [("f", '{"a":1}'), ("g", '{"b":2}'), ("f", '{"a":3}')]
    assert len(set(convs)) == 1, convs
    assert content == "f -> R1\ng -> R2\nf -> R3"


# ---------------------------------------------------------------- 3. mcp tool_choice without a name


def test_an_mcp_choice_without_a_name_requires_the_agents_own_tools_only(
    client: openai.OpenAI, fake: FakeOpenAI
) -> None:
    for model, want in (
        ("remote", ("required", ["clock", "schedule"])),
        ("solo", ({"type": "function", "function": {"name": "clock"}}, ["clock", "f"])),  # forced by name
    ):
        fake.requests.clear()
        r = client.responses.create(
            model=model,
            input="hello",
            tools=[F_RESP],  # type: ignore[list-item]
            tool_choice={"type": "mcp", "server_label": model},  # type: ignore[typeddict-item]
        )
        assert r.status == "completed"
        sent = fake.requests[0].json
        # before: "required" over every tool, which the client's own f satisfies; then (session 28)
        # an allowed_tools choice, which most OpenAI-compatible servers and Anthropic do not take:
        # now the call offers only the agent's own tools, required (one: that function, forced)
        assert sorted(t["function"]["name"] for t in sent["tools"]) == want[1]
        assert sent["tool_choice"] == want[0]
        assert r.tool_choice.type == "mcp"  # the echo is the request's
    # the agent's only tool shadowed by a client tool of its name: nothing of its own to require
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="solo",
            input="hello",
            tools=[{**F_RESP, "name": "clock"}],  # type: ignore[list-item]
            tool_choice={"type": "mcp", "server_label": "solo"},  # type: ignore[typeddict-item]
        )
    err = exc.value.response.json()["error"]
    assert err["code"] == "invalid_tool_choice" and err["param"] == "tool_choice", err


# ---------------------------------------------------------------- 4. instructions messages


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"role": "system"}, "missing_required_parameter"),
        ({"role": "system", "content": None}, "invalid_type"),
        ({"role": "developer", "content": 5}, "invalid_type"),
    ],
)
def test_instructions_messages_need_content_as_input_messages_do(
    srv: tuple[ServeProcess, FakeOpenAI], message: dict[str, Any], code: str
) -> None:
    url = srv[0].url + "/v1/responses"
    as_input = httpx.post(
        url, json={"model": "assistant", "input": [message, {"role": "user", "content": "hi"}]}, timeout=30
    )
    as_instructions = httpx.post(url, json={"model": "assistant", "input": "hi", "instructions": [message]}, timeout=30)
    assert as_input.status_code == as_instructions.status_code == 400, as_instructions.text
    got, same = as_instructions.json()["error"], as_input.json()["error"]
    assert got["code"] == same["code"] == code and got["type"] == same["type"] == "invalid_request_error"
    assert got["param"] == "instructions[0].content" and same["param"] == "input[0].content"
    fine = httpx.post(
        url,
        json={"model": "assistant", "input": "hi", "instructions": [{"role": "system", "content": "be brief"}]},
        timeout=30,
    )
    assert fine.status_code == 200 and fine.json()["instructions"][0]["content"] == "be brief"
