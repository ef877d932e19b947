"""Anthropic-kind agents and audio output, from an outside tester's findings (session 27), through a
real `appserver serve` on loopback, the real `openai` SDK and the project's fake Messages API
(tests/fakes/anthropic_upstream.py), which refuses what the real API refuses (`messages_problem`):
whitespace-only text blocks, a context opening with the assistant, a thinking budget not below
max_tokens.

1. A structured-output format (chat `response_format`, Responses `text.format`: json_schema,
   json_object) on an anthropic agent is refused, never dropped (it was, and the client got free
   text with a 200): chat answers 400 `unsupported_parameter` (`param` `response_format`) before
   the turn; every other path fails the turn before any upstream call. `text` still answers.
2. `reasoning_effort` `xhigh` and `max` give larger thinking budgets (they turned thinking off),
   and every effort's listed budget is what is sent when no max_tokens is set (high's 24576 was
   cut to 16384); a max_tokens that is set holds thinking and answer, the budget half of it at most.
3. A reply of only whitespace ("\\n\\n") no longer wedges its conversation: blank text blocks are
   left out of every request (history, a client's transcript, tool results, the new input), a
   message left empty is dropped, and the context still opens with the user.
4. Chat `modalities` with "audio", or an `audio` setting, is a 400: answers are text only.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from tests.fakes.anthropic_upstream import (
    MESSAGE_STOP,
    FakeAnthropic,
    anthropic_error,
    anthropic_sse,
    message_delta,
    message_start,
    messages_problem,
    text_answer,
    tool_use_block,
)
from tests.fakes.openai_upstream import RecordedRequest, Reply
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "Person",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
PIXEL = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16).decode()


def _last_user_text(body: dict[str, Any]) -> str:
    """The last text block of the last user message."""
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    content = users[-1]["content"] if users else ""
    if isinstance(content, str):
        return content
    texts = [str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text"]
    return texts[-1] if texts else ""  # the newest input's, of user messages merged into one


def model(req: RecordedRequest) -> Reply:
    """The fake model: refuses as the real API would, else answers by a word of the last user text."""
    body = req.json
    problem = messages_problem(body)
    if problem is not None:
        error = json.dumps(anthropic_error("invalid_request_error", problem)).encode()
        return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
    last = body["messages"][-1]["content"]
    answering_call = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
    text = _last_user_text(body)
    if answering_call:
        events = text_answer("looked it up")
    elif "WSONLY" in text:
        events = text_answer("\n\n")
    elif "CALL" in text:
        call = tool_use_block(0, f"toolu_{uuid.uuid4().hex[:8]}", "lookup", ['{"q": ', '"x"}'])
        events = [message_start(), *call, message_delta("tool_use"), MESSAGE_STOP]
    else:
        events = text_answer("anth: ok")
    return Reply(pieces=[anthropic_sse(events)])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeAnthropic) -> None:
        self.sp, self.fake = sp, fake

    def sent(self, tag: str) -> list[dict[str, Any]]:
        """The bodies of the upstream calls that carried `tag`."""
        return [r.json for r in list(self.fake.requests) if tag.encode() in r.body]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeAnthropic() as fake:
        fake.responder = model
        home: Path = tmp_path_factory.mktemp("s27c") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.anth]\nkind = "anthropic"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, agent_model in (("claude", "anth:claude-fake"), ("plain", "echo")):
            made = run_cli(home, "agents", "create", "--name", name, "--model", agent_model, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    """`chat.completions.create` with the fields as sent (some outside the SDK's types on purpose)."""
    return client.chat.completions.create(**fields)


def tag() -> str:
    return uuid.uuid4().hex


def refused(exc: pytest.ExceptionInfo[openai.BadRequestError], code: str, param: str) -> str:
    body = exc.value.body
    assert isinstance(body, dict), body
    assert (exc.value.status_code, body.get("code"), body.get("param")) == (400, code, param), body
    return str(body.get("message"))


# ---------------------------------------------------------------- 1. structured output


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", [SCHEMA_FORMAT, {"type": "json_object"}], ids=["json_schema", "json_object"])
def test_chat_structured_output_on_an_anthropic_agent_is_refused_before_any_call(
    env: Env, client: openai.OpenAI, fmt: dict[str, Any], stream: bool
) -> None:
    t = tag()
    with pytest.raises(openai.BadRequestError) as exc:
        chat(
            client,
            model="claude",
            messages=[{"role": "user", "content": f"give me a person {t}"}],
            response_format=fmt,
            stream=stream,
        )
    message = refused(exc, "unsupported_parameter", "response_format")
    assert "anthropic" in message and "claude" in message and fmt["type"] in message, message
    assert env.sent(t) == []  # no upstream call, and no turn: the same request without it goes through


def test_chat_parse_with_a_pydantic_model_is_refused_not_answered_with_free_text(
    env: Env, client: openai.OpenAI
) -> None:
    class Person(pydantic.BaseModel):
        name: str

    t = tag()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.parse(
            model="claude", messages=[{"role": "user", "content": f"a person {t}"}], response_format=Person
        )
    refused(exc, "unsupported_parameter", "response_format")
    assert env.sent(t) == []


def test_a_text_response_format_still_answers(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    reply = chat(
        client, model="claude", messages=[{"role": "user", "content": f"hello {t}"}], response_format={"type": "text"}
    )
    assert reply.choices[0].message.content == "anth: ok"
    (body,) = env.sent(t)
    assert "response_format" not in body


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_on_an_anthropic_agent_is_refused_before_the_turn(
    env: Env, client: openai.OpenAI, stream: bool
) -> None:
    """/v1/responses: a 400 naming `text.format` before the turn starts, as on chat, instead of
    echoing the format as applied over free text."""
    t = tag()
    fmt = {"type": "json_schema", "name": "Person", "schema": SCHEMA_FORMAT["json_schema"]["schema"], "strict": True}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="claude", input=f"a person {t}", text={"format": fmt}, stream=stream)
    err = caught.value.body
    assert isinstance(err, dict) and err.get("param") == "text.format", err
    assert err.get("code") == "unsupported_parameter" and "anthropic" in str(err.get("message")), err
    assert env.sent(t) == []


# ---------------------------------------------------------------- 2. reasoning effort


@pytest.mark.parametrize(
    ("effort", "budget"),
    [("low", 2048), ("medium", 8192), ("high", 24576), ("xhigh", 32768), ("max", 49152), ("none", 0), ("minimal", 0)],
)
def test_each_effort_sends_its_listed_thinking_budget(
    env: Env, client: openai.OpenAI, effort: str, budget: int
) -> None:
    t = tag()
    reply = chat(
        client,
        model="claude",
        messages=[{"role": "user", "content": f"think {t}"}],
        reasoning_effort=effort,
    )
    assert reply.choices[0].message.content == "anth: ok"  # the fake refuses a budget not below max_tokens
    (body,) = env.sent(t)
    if budget:
        assert body["thinking"] == {"type": "enabled", "budget_tokens": budget}, body
        assert body["max_tokens"] == budget + 8192, body
    else:
        assert "thinking" not in body and body["max_tokens"] == 8192, body


@pytest.mark.parametrize(("effort", "max_tokens", "budget"), [("high", 4000, 2000), ("max", 200000, 49152)])
def test_a_set_max_tokens_holds_thinking_and_answer(
    env: Env, client: openai.OpenAI, effort: str, max_tokens: int, budget: int
) -> None:
    t = tag()
    chat(
        client,
        model="claude",
        messages=[{"role": "user", "content": f"think {t}"}],
        reasoning_effort=effort,
        max_completion_tokens=max_tokens,
    )
    (body,) = env.sent(t)
    assert (body["thinking"]["budget_tokens"], body["max_tokens"]) == (budget, max_tokens), body


# ---------------------------------------------------------------- 3. whitespace-only text


def test_a_whitespace_only_reply_does_not_wedge_its_conversation(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    first = client.chat.completions.with_raw_response.create(
        model="claude", messages=[{"role": "user", "content": f"WSONLY {t}"}]
    )
    conversation = first.headers["x-conversation-id"]
    assert first.parse().choices[0].message.content == "\n\n"
    for i in range(2):
        reply = chat(
            client,
            model="claude",
            messages=[{"role": "user", "content": f"follow-up {i} {t}"}],
            extra_headers={"X-Conversation-Id": conversation},
        )
        assert reply.choices[0].message.content == "anth: ok"
    body = env.sent(f"follow-up 0 {t}")[0]
    # the blank reply left out, the two user messages around it merged into one
    assert body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": f"WSONLY {t}"}, {"type": "text", "text": f"follow-up 0 {t}"}],
        }
    ]


def test_a_streamed_whitespace_only_reply_does_not_wedge_it_either(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    with client.chat.completions.with_streaming_response.create(
        model="claude", messages=[{"role": "user", "content": f"WSONLY {t}"}], stream=True
    ) as streamed:
        conversation = streamed.headers["x-conversation-id"]
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    assert text == "\n\n"
    reply = chat(
        client,
        model="claude",
        messages=[{"role": "user", "content": f"next {t}"}],
        extra_headers={"X-Conversation-Id": conversation},
    )
    assert reply.choices[0].message.content == "anth: ok"


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        (  # a blank assistant reply in the client's own transcript
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n\t "}],
            [{"role": "user", "content": [{"type": "text", "text": "hi"}, "NEW"]}],
        ),
        (  # a transcript that opens with a greeting: a placeholder user message goes first
            [{"role": "assistant", "content": "Ahoy, I am a pirate."}],
            [
                {"role": "user", "content": [{"type": "text", "text": "(start of the conversation)"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Ahoy, I am a pirate."}]},
                {"role": "user", "content": ["NEW"]},
            ],
        ),
        (  # a blank first user message dropped: the same
            [
                {"role": "user", "content": [{"type": "text", "text": "\n"}]},
                {"role": "assistant", "content": "Hello."},
            ],
            [
                {"role": "user", "content": [{"type": "text", "text": "(start of the conversation)"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                {"role": "user", "content": ["NEW"]},
            ],
        ),
    ],
    ids=["blank-reply", "greeting-first", "blank-first-user"],
)
def test_a_clients_transcript_with_blank_texts_is_sent_as_the_api_takes_it(
    env: Env, client: openai.OpenAI, history: list[dict[str, Any]], expected: list[dict[str, Any]]
) -> None:
    t = tag()
    new = {"type": "text", "text": f"question {t}"}
    reply = chat(
        client,
        model="claude",
        messages=[*history, {"role": "user", "content": f"question {t}"}],
        extra_headers={"X-Conversation-Id": "new"},
    )
    assert reply.choices[0].message.content == "anth: ok"
    (body,) = env.sent(t)
    for message in expected:
        message["content"] = [new if block == "NEW" else block for block in message["content"]]
    assert body["messages"] == expected


def test_blank_new_input_text_beside_an_image_is_left_out(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    reply = chat(
        client,
        model="claude",
        messages=[
            {"role": "user", "content": f"look {t}"},
            {"role": "assistant", "content": "At what?"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "  \n"}, {"type": "image_url", "image_url": {"url": PIXEL}}],
            },
        ],
        extra_headers={"X-Conversation-Id": "new"},
    )
    assert reply.choices[0].message.content == "anth: ok"
    (body,) = env.sent(t)
    assert [b["type"] for b in body["messages"][-1]["content"]] == ["image"]


def test_a_blank_tool_result_is_sent_without_content(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    asked = [{"role": "user", "content": f"CALL {t}"}]
    first = chat(client, model="claude", messages=asked, tools=[LOOKUP])
    calls = first.choices[0].message.tool_calls
    assert calls, first
    call = calls[0]
    reply = chat(
        client,
        model="claude",
        tools=[LOOKUP],
        messages=[
            *asked,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": " \n "},
        ],
    )
    assert reply.choices[0].message.content == "looked it up"
    body = env.sent(t)[-1]
    results = [b for b in body["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert len(results) == 1 and "content" not in results[0], body["messages"]


# ---------------------------------------------------------------- 4. audio output


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
            "unsupported_value",
            "modalities",
        ),
        ({"modalities": ["audio"]}, "unsupported_value", "modalities"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "unsupported_parameter", "audio"),
        ({"modalities": ["text"], "audio": {"voice": "alloy", "format": "mp3"}}, "unsupported_parameter", "audio"),
    ],
)
@pytest.mark.parametrize("agent", ["plain", "claude"])
def test_audio_output_is_refused_text_only_answers(
    env: Env, client: openai.OpenAI, agent: str, fields: dict[str, Any], code: str, param: str
) -> None:
    t = tag()
    with pytest.raises(openai.BadRequestError) as exc:
        chat(
            client,
            model=agent,
            messages=[{"role": "user", "content": f"say it {t}"}],
            **fields,
        )
    assert "text only" in refused(exc, code, param)
    assert env.sent(t) == []


def test_text_modalities_still_answer(env: Env, client: openai.OpenAI) -> None:
    reply = chat(client, model="plain", messages=[{"role": "user", "content": "hi"}], modalities=["text"], audio=None)
    assert reply.choices[0].message.content


def test_audio_refused_over_plain_http_too(env: Env) -> None:
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
    r = httpx.post(f"{env.sp.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", r.text
