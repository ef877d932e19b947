"""The `anthropic` kind against a loopback fake Messages API (issue 7 checks 1, 4, 5)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider, parse_sse_bytes
from appserver.providers.base import (
    ChatMessage,
    Done,
    ProviderChunk,
    ProviderError,
    ProviderRequest,
    ProviderState,
    Reasoning,
    Text,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.fakes.anthropic_upstream import (
    MESSAGE_STOP,
    PING,
    FakeAnthropic,
    anthropic_error,
    anthropic_sse,
    block_delta,
    block_start,
    block_stop,
    message_delta,
    message_start,
    redacted_block,
    text_answer,
    text_block,
    thinking_block,
    tool_use_block,
)
from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_sse
from tests.test_providers_openai import coalesce, tool_args

SIGNATURE = "EqoBCkgIARABGAIiQL2+/sig==" * 4
CLOCK = ToolSpec("clock", "Current time", {"type": "object", "properties": {"tz": {"type": "string"}}})


def claude_cfg(fake: FakeAnthropic, name: str = "claude", **kw: Any) -> ProviderConfig:
    return ProviderConfig(name=name, kind="anthropic", base_url=fake.base_url, api_key_env=None, **kw)


def req(*messages: ChatMessage, **kw: Any) -> ProviderRequest:
    return ProviderRequest(model="claude-fake", messages=list(messages) or [ChatMessage("user", "hi")], **kw)


async def collect(provider: Any, request: ProviderRequest) -> list[ProviderChunk]:
    out = [c async for c in provider.stream(request)]
    assert sum(isinstance(c, Done) for c in out) == 1 and isinstance(out[-1], Done)
    return out


async def run(fake: FakeAnthropic, request: ProviderRequest | None = None, **kw: Any) -> list[ProviderChunk]:
    provider = AnthropicProvider(claude_cfg(fake, **kw))
    try:
        return await collect(provider, request or req())
    finally:
        await provider.aclose()


def assistant_from(chunks: list[ProviderChunk]) -> ChatMessage:
    """Build the stored assistant message from a stream, as the agent loop does."""
    text = "".join(c.text for c in chunks if isinstance(c, Text))
    reasoning = "".join(c.text for c in chunks if isinstance(c, Reasoning))
    calls: dict[int, ToolCall] = {}
    state = None
    for c in chunks:
        if isinstance(c, ToolCallStart):
            calls[c.index] = ToolCall(c.id, c.name, "")
        elif isinstance(c, ToolCallArgs):
            calls[c.index].arguments += c.delta
        elif isinstance(c, ProviderState):
            state = c.data
    # Round-trip through JSON like the store does.
    state = json.loads(json.dumps(state)) if state is not None else None
    return ChatMessage(
        "assistant",
        text,
        tool_calls=list(calls.values()),
        reasoning=reasoning or None,
        provider_state=state,
    )


@pytest.fixture
def fake() -> Any:
    with FakeAnthropic() as f:
        yield f


# ---------------------------------------------------------------- basics


async def test_text_answer_usage_and_request_shape(fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", "sk-ant-test")
    fake.script(
        anthropic_sse(
            [
                message_start(30, cache_read=70),
                PING,
                *text_block(0, ["Hel", "lo ", "✓"]),
                PING,
                message_delta("end_turn", 9),
                MESSAGE_STOP,
            ]
        )
    )
    provider = AnthropicProvider(
        ProviderConfig(
            name="claude",
            kind="anthropic",
            base_url=fake.base_url,
            api_key_env="FAKE_ANTHROPIC_KEY",
        )
    )
    got = await collect(
        provider,
        req(
            ChatMessage("system", "be brief"),
            ChatMessage("user", "hi"),
            ChatMessage("system", "really"),
        ),
    )
    await provider.aclose()
    assert provider.kind == "anthropic" and provider.name == "claude"
    assert coalesce(got) == [
        Text("Hello ✓"),
        Usage(input_tokens=100, output_tokens=9, cached_tokens=70),
        Done("stop"),
    ]
    sent = fake.requests[0]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "sk-ant-test"
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.json == {
        "model": "claude-fake",
        "max_tokens": 8192,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": True,
        "system": "be brief\n\nreally",
    }


def test_request_mapping_tools_images_results_and_params() -> None:
    provider = AnthropicProvider(ProviderConfig(name="claude", kind="anthropic", base_url="http://x/v1"))
    assert provider.url == "http://x/v1/messages"
    body = provider.build_body(
        req(
            ChatMessage(
                "user",
                [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                    {"type": "image_url", "image_url": "https://example.com/a.png"},
                ],
            ),
            ChatMessage(
                "assistant",
                "",
                tool_calls=[
                    ToolCall("tu_1", "clock", '{"tz":"UTC"}'),
                    ToolCall("tu_2", "clock", "{broken"),
                ],
            ),
            ChatMessage("tool", "12:00", tool_call_id="tu_1"),
            ChatMessage("tool", "", tool_call_id="tu_2"),
            ChatMessage("user", "and now?"),
            tools=[CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.3,
            top_p=0.5,
            stop=["END"],
            max_tokens=512,
            response_format={"type": "json_object"},
        )
    )
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "tu_1", "name": "clock", "input": {"tz": "UTC"}},
                {"type": "tool_use", "id": "tu_2", "name": "clock", "input": {}},
            ],
        },
        {
            "role": "user",  # consecutive tool results (and the next user text) in one message
            "content": [
                {"type": "tool_result", "tool_use_id": "tu_1", "content": "12:00"},
                {"type": "tool_result", "tool_use_id": "tu_2"},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]
    assert body["tools"] == [{"name": "clock", "input_schema": CLOCK.parameters, "description": "Current time"}]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert (body["temperature"], body["top_p"], body["stop_sequences"], body["max_tokens"]) == (
        0.3,
        0.5,
        ["END"],
        512,
    )
    assert "response_format" not in body and "thinking" not in body


def test_reasoning_effort_enables_thinking_and_drops_incompatible_params() -> None:
    provider = AnthropicProvider(ProviderConfig(name="claude", kind="anthropic", base_url="http://x"))
    body = provider.build_body(
        req(
            tools=[CLOCK],
            tool_choice={"type": "function", "function": {"name": "clock"}},
            reasoning_effort="medium",
            temperature=0.2,
            top_p=0.5,
        )
    )
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 8192}
    assert body["max_tokens"] > 8192
    assert "temperature" not in body and "top_p" not in body
    assert body["tool_choice"] == {"type": "auto"}  # forced tool use is refused with thinking
    small = provider.build_body(req(reasoning_effort="high", max_tokens=1500))
    assert "thinking" not in small and small["max_tokens"] == 1500
    assert "thinking" not in provider.build_body(req(reasoning_effort="none"))


# ---------------------------------------------------------------- check 4: thinking replay

TURN1 = [
    message_start(50),
    *thinking_block(0, ["The user wants ", "the time ✓."], SIGNATURE),
    *redacted_block(1, "ENCRYPTED=="),
    *text_block(2, ["Checking ", "the clock."]),
    *tool_use_block(3, "toolu_01", "clock", ['{"tz"', ': "Eu', 'rope/Paris"}']),
    message_delta("tool_use", 40),
    MESSAGE_STOP,
]
THINKING = {"type": "thinking", "thinking": "The user wants the time ✓.", "signature": SIGNATURE}
REDACTED = {"type": "redacted_thinking", "data": "ENCRYPTED=="}


async def test_thinking_and_tool_use_replayed_unchanged_then_switch_to_openai(
    fake: FakeAnthropic,
) -> None:
    provider = AnthropicProvider(claude_cfg(fake))
    user = ChatMessage("user", "what time is it in Paris?")
    fake.script(anthropic_sse(TURN1), chunk_size=11)
    first = await collect(provider, req(user, tools=[CLOCK]))
    assert coalesce(first) == [
        Reasoning("The user wants the time ✓."),
        Text("Checking the clock."),
        ToolCallStart(0, "toolu_01", "clock"),
        ToolCallArgs(0, '{"tz": "Europe/Paris"}'),
        ProviderState({"provider": "claude", "blocks": [THINKING, REDACTED]}),
        Usage(input_tokens=50, output_tokens=40),
        Done("tool_calls"),
    ]

    # Second request of the turn (tool result) and a second turn both replay the blocks.
    assistant = assistant_from(first)
    result = ChatMessage("tool", "13:05", tool_call_id="toolu_01", name="clock")
    fake.script(anthropic_sse(text_answer("It is 13:05.")))
    second = await collect(provider, req(user, assistant, result, tools=[CLOCK]))
    assert coalesce(second)[0] == Text("It is 13:05.")
    sent = fake.requests[1].json
    assert sent["messages"][1] == {
        "role": "assistant",
        "content": [
            THINKING,  # thinking text and signature byte-for-byte, in their original order
            REDACTED,
            {"type": "text", "text": "Checking the clock."},
            {
                "type": "tool_use",
                "id": "toolu_01",
                "name": "clock",
                "input": {"tz": "Europe/Paris"},
            },
        ],
    }
    assert sent["messages"][2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "13:05"}],
    }
    assert SIGNATURE in fake.requests[1].body.decode()
    await provider.aclose()

    # Another Anthropic provider config (different account/key) must not get this state.
    other = AnthropicProvider(claude_cfg(fake, name="claude-work"))
    fake.script(anthropic_sse(text_answer("ok")))
    await collect(other, req(user, assistant, result))
    assert SIGNATURE not in fake.requests[2].body.decode()
    assert "thinking" not in fake.requests[2].body.decode()
    await other.aclose()

    # The agent switches to an `openai` kind model: the next turn works and sends no state.
    with FakeOpenAI() as oai:
        oai.script(openai_sse([chunk(content="Still 13:05."), chunk(finish_reason="stop")]))
        switched = OpenAICompatProvider(ProviderConfig(name="ollama", base_url=oai.base_url, api_key_env=None))
        later = ChatMessage("user", "and now?")
        got = await collect(switched, ProviderRequest("llama", [user, assistant, result, later], tools=[CLOCK]))
        await switched.aclose()
        assert coalesce(got) == [Text("Still 13:05."), Done("stop")]
        raw = oai.requests[0].body.decode()
        assert SIGNATURE not in raw and "ENCRYPTED" not in raw
        assert "thinking" not in raw and "provider_state" not in raw and "The user wants" not in raw
        assert oai.requests[0].json["messages"][1] == {
            "role": "assistant",
            "content": "Checking the clock.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "clock", "arguments": '{"tz": "Europe/Paris"}'},
                }
            ],
        }


def test_foreign_or_malformed_state_is_ignored() -> None:
    provider = AnthropicProvider(ProviderConfig(name="claude", kind="anthropic", base_url="http://x"))
    for state in (
        {"provider": "openai", "blocks": [THINKING]},
        {"blocks": [THINKING]},
        {"provider": "claude", "blocks": "nope"},
        {"provider": "claude", "blocks": [{"type": "text", "text": "not replayable"}, 3]},
    ):
        msg = ChatMessage("assistant", "hi", provider_state=state)
        assert provider.build_messages([ChatMessage("user", "q"), msg])[1][1] == {
            "role": "assistant",
            "content": [{"type": "text", "text": "hi"}],
        }


def test_thinking_only_message_is_not_replayed_alone() -> None:
    provider = AnthropicProvider(ProviderConfig(name="claude", kind="anthropic", base_url="http://x"))
    msg = ChatMessage("assistant", "", reasoning="r", provider_state={"provider": "claude", "blocks": [THINKING]})
    _, messages = provider.build_messages([ChatMessage("user", "a"), msg, ChatMessage("user", "b")])
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


# ---------------------------------------------------------------- check 1: split anywhere

RICH = anthropic_sse(
    [
        message_start(12),
        PING,
        *thinking_block(0, ["Hmm ", "🤔 ", "let me see"], SIGNATURE),
        *text_block(1, ["Voilà ", "日本 ", "✓"]),
        block_start(2, {"type": "tool_use", "id": "tu_a", "name": "clock", "input": {}}),
        block_start(3, {"type": "tool_use", "id": "tu_b", "name": "search", "input": {}}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '{"tz": '}),
        block_delta(3, {"type": "input_json_delta", "partial_json": '{"q": "ü'}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '"UTC"}'}),
        block_delta(3, {"type": "input_json_delta", "partial_json": 'ber"}'}),
        block_stop(2),
        block_stop(3),
        *tool_use_block(4, "tu_c", "noargs", []),
        message_delta("tool_use", 77),
        MESSAGE_STOP,
    ]
)
RICH_EXPECTED: list[ProviderChunk] = [
    Reasoning("Hmm 🤔 let me see"),
    Text("Voilà 日本 ✓"),
    ToolCallStart(0, "tu_a", "clock"),
    ToolCallStart(1, "tu_b", "search"),
    ToolCallArgs(0, '{"tz": '),
    ToolCallArgs(1, '{"q": "ü'),
    ToolCallArgs(0, '"UTC"}'),
    ToolCallArgs(1, 'ber"}'),
    ToolCallStart(2, "tu_c", "noargs"),
    ToolCallArgs(2, "{}"),
    ProviderState(
        {
            "provider": "anthropic",
            "blocks": [{"type": "thinking", "thinking": "Hmm 🤔 let me see", "signature": SIGNATURE}],
        }
    ),
    Usage(input_tokens=12, output_tokens=77),
    Done("tool_calls"),
]


def test_every_byte_offset_in_process() -> None:
    assert coalesce(parse_sse_bytes([RICH])) == RICH_EXPECTED
    assert tool_args(parse_sse_bytes([RICH])) == {
        "clock": {"tz": "UTC"},
        "search": {"q": "über"},
        "noargs": {},
    }
    for i in range(len(RICH) + 1):
        assert coalesce(parse_sse_bytes([RICH[:i], RICH[i:]])) == RICH_EXPECTED, f"cut at {i}"


async def test_every_byte_offset_over_http(fake: FakeAnthropic) -> None:
    provider = AnthropicProvider(claude_cfg(fake, name="anthropic"))
    try:
        for i in range(1, len(RICH), 3):  # every third offset over the socket; all offsets above
            fake.script(RICH, splits=[i, i + 1, i + 2])
            assert coalesce(await collect(provider, req())) == RICH_EXPECTED, f"cut at {i}"
    finally:
        await provider.aclose()


# ---------------------------------------------------------------- stop reasons and endings


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("tool_use", "tool_calls"),
        ("max_tokens", "length"),
        ("refusal", "content_filter"),
        ("pause_turn", "unknown"),
    ],
)
async def test_stop_reasons(fake: FakeAnthropic, stop_reason: str, finish: str) -> None:
    fake.script(anthropic_sse(text_answer("x", stop_reason)))
    assert (await run(fake))[-1] == Done(finish)  # type: ignore[arg-type]


async def test_max_tokens_during_tool_use_reports_length(fake: FakeAnthropic) -> None:
    fake.script(
        anthropic_sse(
            [
                message_start(),
                *tool_use_block(0, "tu_1", "clock", ['{"tz": "Eu']),
                message_delta("max_tokens"),
                MESSAGE_STOP,
            ]
        )
    )
    got = await run(fake)
    assert got[0] == ToolCallStart(0, "tu_1", "clock") and got[-1] == Done("length")


async def test_thinking_only_answer_has_no_text(fake: FakeAnthropic) -> None:
    fake.script(
        anthropic_sse(
            [
                message_start(),
                *thinking_block(0, ["just ", "thinking"], "sig"),
                message_delta("end_turn"),
                MESSAGE_STOP,
            ]
        )
    )
    got = await run(fake)
    assert not any(isinstance(c, Text) for c in got)
    assert coalesce(got)[0] == Reasoning("just thinking") and got[-1] == Done("stop")


async def test_stream_cut_before_message_stop(fake: FakeAnthropic) -> None:
    fake.script(
        anthropic_sse(
            [
                message_start(),
                block_start(0, {"type": "text", "text": "Hi"}),
                block_delta(0, {"type": "text_delta", "text": "!"}),
            ]
        )
    )
    provider = AnthropicProvider(claude_cfg(fake))
    got: list[ProviderChunk] = []
    with pytest.raises(ProviderError) as info:
        async for c in provider.stream(req()):
            got.append(c)
    await provider.aclose()
    # cut off between two events: a network failure, never a finished answer
    assert info.value.kind == "network" and "no stop_reason" in info.value.message
    assert coalesce(got) == [Text("Hi!")]


async def test_stop_reason_without_message_stop_is_lenient(fake: FakeAnthropic) -> None:
    fake.script(anthropic_sse([message_start(), *text_block(0, ["Hi"]), message_delta("end_turn")]))
    got = await run(fake)
    assert coalesce(got)[0] == Text("Hi") and got[-1] == Done("stop")


# ---------------------------------------------------------------- errors


async def test_error_event_mid_stream(fake: FakeAnthropic) -> None:
    fake.script(
        anthropic_sse(
            [
                message_start(),
                *text_block(0, ["par"]),
                anthropic_error("overloaded_error", "Overloaded"),
            ]
        )
    )
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert (info.value.kind, info.value.status, info.value.message) == ("server", 529, "Overloaded")


@pytest.mark.parametrize(
    ("status", "etype", "message", "headers", "kind", "retry_after"),
    [
        (401, "authentication_error", "invalid x-api-key", {}, "auth", None),
        (403, "permission_error", "no access", {}, "auth", None),
        (404, "not_found_error", "model: claude-nope", {}, "not_found", None),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 210000 tokens > 200000 maximum",
            {},
            "context_overflow",
            None,
        ),
        (
            400,
            "invalid_request_error",
            "messages: roles must alternate",
            {},
            "invalid_request",
            None,
        ),
        (
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit",
            {"retry-after": "2"},
            "rate_limit",
            2.0,
        ),
        (500, "api_error", "Internal server error", {}, "server", None),
        (529, "overloaded_error", "Overloaded", {}, "server", None),
    ],
)
async def test_http_errors(
    fake: FakeAnthropic,
    status: int,
    etype: str,
    message: str,
    headers: dict[str, str],
    kind: str,
    retry_after: float | None,
) -> None:
    fake.fail(status, anthropic_error(etype, message), headers=headers)
    with pytest.raises(ProviderError) as info:
        await run(fake)
    err = info.value
    assert (err.kind, err.status, err.message, err.retry_after_s) == (
        kind,
        status,
        message,
        retry_after,
    )


async def test_malformed_json_is_protocol_error(fake: FakeAnthropic) -> None:
    fake.script(b'event: message_start\ndata: {"type": "message_start", "message": \n\n')
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert info.value.kind == "protocol"


async def test_args_for_unknown_block_is_protocol_error(fake: FakeAnthropic) -> None:
    fake.script(anthropic_sse([message_start(), block_delta(5, {"type": "input_json_delta", "partial_json": "{}"})]))
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert info.value.kind == "protocol"
