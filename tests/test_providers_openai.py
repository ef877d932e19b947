"""The `openai` kind against a loopback fake Chat Completions server (issue 7 checks 1-3, 7;
issue 2 check 8 at provider level)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.config import ProviderConfig
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
from appserver.providers.openai_compat import OpenAICompatProvider, parse_sse_bytes
from tests.fakes.openai_upstream import (
    FakeOpenAI,
    chunk,
    openai_error,
    openai_sse,
    tool_delta,
    usage_chunk,
)

CLOCK = ToolSpec(
    "clock",
    "Current time",
    {"type": "object", "properties": {"tz": {"type": "string"}}},
)


def coalesce(chunks: list[ProviderChunk]) -> list[ProviderChunk]:
    """Merge adjacent Text/Reasoning and adjacent args of the same call: where a stream was cut
    must not matter, only what it says."""
    out: list[ProviderChunk] = []
    for c in chunks:
        prev = out[-1] if out else None
        if isinstance(c, Text) and isinstance(prev, Text):
            out[-1] = Text(prev.text + c.text)
        elif isinstance(c, Reasoning) and isinstance(prev, Reasoning):
            out[-1] = Reasoning(prev.text + c.text)
        elif isinstance(c, ToolCallArgs) and isinstance(prev, ToolCallArgs) and prev.index == c.index:
            out[-1] = ToolCallArgs(c.index, prev.delta + c.delta)
        else:
            out.append(c)
    return out


def tool_args(chunks: list[ProviderChunk]) -> dict[str, Any]:
    """name → parsed arguments, reassembled per call index as the agent loop does."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for c in chunks:
        if isinstance(c, ToolCallStart):
            assert c.index not in names, "ToolCallStart emitted twice"
            names[c.index] = c.name
            args[c.index] = ""
        elif isinstance(c, ToolCallArgs):
            assert c.index in names, "args before ToolCallStart"
            args[c.index] += c.delta
    return {names[i]: json.loads(a) for i, a in args.items()}


def cfg(fake: FakeOpenAI, **kw: Any) -> ProviderConfig:
    return ProviderConfig(name="fake", kind="openai", base_url=fake.base_url, api_key_env=None, **kw)


def req(text: str = "hi", **kw: Any) -> ProviderRequest:
    return ProviderRequest(model="fake-model", messages=[ChatMessage("user", text)], **kw)


async def collect(provider: OpenAICompatProvider, request: ProviderRequest) -> list[ProviderChunk]:
    out = [c async for c in provider.stream(request)]
    assert sum(isinstance(c, Done) for c in out) == 1 and isinstance(out[-1], Done)
    return out


async def run(fake: FakeOpenAI, request: ProviderRequest | None = None, **kw: Any) -> list[ProviderChunk]:
    provider = OpenAICompatProvider(cfg(fake, **kw))
    try:
        return await collect(provider, request or req())
    finally:
        await provider.aclose()


@pytest.fixture
def fake() -> Any:
    with FakeOpenAI() as f:
        yield f


# ---------------------------------------------------------------- issue 2 check 8


async def test_text_tool_call_in_several_chunks_and_usage(fake: FakeOpenAI) -> None:
    body = openai_sse(
        [
            chunk(role="assistant", content=""),
            chunk(content="Let me "),
            chunk(content="check."),
            chunk(tool_calls=[tool_delta(0, id="call_1", name="clock", arguments="")]),
            chunk(tool_calls=[tool_delta(0, arguments='{"tz"')]),
            chunk(tool_calls=[tool_delta(0, arguments=': "Europe/')]),
            chunk(tool_calls=[tool_delta(0, arguments='Paris"}')]),
            chunk(finish_reason="tool_calls"),
            usage_chunk(42, 17),
        ]
    )
    fake.script(body, chunk_size=13)
    got = await run(fake, req("what time is it?", tools=[CLOCK]))
    assert coalesce(got) == [
        Text("Let me check."),
        ToolCallStart(0, "call_1", "clock"),
        ToolCallArgs(0, '{"tz": "Europe/Paris"}'),
        Usage(input_tokens=42, output_tokens=17),
        Done("tool_calls"),
    ]
    sent = fake.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.json["stream"] is True
    assert sent.json["stream_options"] == {"include_usage": True}
    assert sent.json["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "clock",
                "description": "Current time",
                "parameters": CLOCK.parameters,
            },
        }
    ]
    assert sent.json["messages"] == [{"role": "user", "content": "what time is it?"}]


async def test_request_mapping(fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_OPENAI_KEY", "sk-test")
    fake.script(openai_sse([chunk(content="ok", finish_reason="stop")]))
    request = ProviderRequest(
        model="m1",
        messages=[
            ChatMessage("system", "be brief"),
            ChatMessage(
                "user",
                [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                ],
            ),
            ChatMessage(
                "assistant",
                "",
                tool_calls=[ToolCall("call_9", "clock", '{"tz":"UTC"}')],
                reasoning="secret thoughts",
                provider_state={"provider": "claude", "blocks": [{"type": "thinking"}]},
            ),
            ChatMessage("tool", "12:00", tool_call_id="call_9", name="clock"),
            ChatMessage("assistant", "It is noon.", reasoning="more thoughts"),
            ChatMessage("user", "thanks"),
        ],
        tools=[CLOCK],
        tool_choice="auto",
        parallel_tool_calls=False,
        temperature=0.2,
        top_p=0.9,
        max_tokens=100,
        stop=["END"],
        response_format={"type": "json_object"},
        reasoning_effort="low",
    )
    provider = OpenAICompatProvider(
        ProviderConfig(
            name="fake",
            base_url=fake.base_url,
            api_key_env="FAKE_OPENAI_KEY",
            headers={"X-Extra": "1"},
        )
    )
    await collect(provider, request)
    await provider.aclose()
    sent = fake.requests[0]
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert sent.headers["x-extra"] == "1"
    body = sent.json
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "clock", "arguments": '{"tz":"UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "12:00"},
        {"role": "assistant", "content": "It is noon."},
        {"role": "user", "content": "thanks"},
    ]
    for key, value in {
        "model": "m1",
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 100,
        "stop": ["END"],
        "response_format": {"type": "json_object"},
        "reasoning_effort": "low",
    }.items():
        assert body[key] == value, key
    raw = sent.body.decode()
    assert "secret thoughts" not in raw and "thinking" not in raw and "claude" not in raw


def test_unset_parameters_are_not_sent_and_openai_gets_max_completion_tokens() -> None:
    local = OpenAICompatProvider(ProviderConfig(name="ollama", base_url="http://127.0.0.1:1/v1"))
    body = local.build_body(req(parallel_tool_calls=True, tool_choice="auto"))
    assert set(body) == {"model", "messages", "stream", "stream_options"}
    official = OpenAICompatProvider(ProviderConfig(name="openai"))
    assert official.build_body(req(max_tokens=5))["max_completion_tokens"] == 5
    assert local.build_body(req(max_tokens=5))["max_tokens"] == 5


# ---------------------------------------------------------------- check 1: split anywhere

RICH = openai_sse(
    [
        chunk(role="assistant", content=""),
        chunk(reasoning_content="Considering ✓ the "),
        chunk(reasoning_content="question…"),
        chunk(content="<think>inline 🤔 thought</think>\n\nHéllo, "),
        chunk(content="wörld! 日本"),
        chunk(tool_calls=[tool_delta(0, name="clock", arguments='{"tz": "Asia/')]),
        chunk(tool_calls=[tool_delta(1, id="call_b", name="search", arguments='{"q": ')]),
        chunk(tool_calls=[tool_delta(0, id="call_a", arguments='Tokyo"}')]),
        chunk(tool_calls=[tool_delta(1, arguments='"ünïcode ✓"}')]),
        chunk(finish_reason="tool_calls"),
        usage_chunk(120, 60, reasoning=20, cached=100),
    ]
)
RICH_EXPECTED: list[ProviderChunk] = [
    Reasoning("Considering ✓ the question…inline 🤔 thought"),
    Text("Héllo, wörld! 日本"),
    ToolCallStart(1, "call_b", "search"),  # call 0 waits for its id
    ToolCallArgs(1, '{"q": '),
    ToolCallStart(0, "call_a", "clock"),
    ToolCallArgs(0, '{"tz": "Asia/Tokyo"}'),
    ToolCallArgs(1, '"ünïcode ✓"}'),
    Usage(input_tokens=120, output_tokens=60, reasoning_tokens=20, cached_tokens=100),
    Done("tool_calls"),
]


def test_rich_answer_parses_as_expected() -> None:
    got = parse_sse_bytes([RICH])
    assert coalesce(got) == RICH_EXPECTED
    assert tool_args(got) == {"clock": {"tz": "Asia/Tokyo"}, "search": {"q": "ünïcode ✓"}}


def test_every_byte_offset_in_process() -> None:
    """Exhaustive and deterministic: every two-way cut, plus byte-by-byte."""
    for i in range(len(RICH) + 1):
        assert coalesce(parse_sse_bytes([RICH[:i], RICH[i:]])) == RICH_EXPECTED, f"cut at {i}"
    assert coalesce(parse_sse_bytes([RICH[i : i + 1] for i in range(len(RICH))])) == RICH_EXPECTED


async def test_every_byte_offset_over_http(fake: FakeOpenAI) -> None:
    """The same answer through a real socket, cut at every offset (one HTTP chunk per piece)."""
    provider = OpenAICompatProvider(cfg(fake))
    try:
        for i in range(1, len(RICH)):
            fake.script(RICH, splits=[i])
            got = coalesce(await collect(provider, req()))
            assert got == RICH_EXPECTED, f"cut at {i}"
        fake.script(RICH, chunk_size=1)
        assert coalesce(await collect(provider, req())) == RICH_EXPECTED
    finally:
        await provider.aclose()
    assert len(fake.requests) == len(RICH)


# ---------------------------------------------------------------- check 2: think tags


async def test_think_tags_split_across_sse_chunks(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(content="<th"),
                chunk(content="ink>weighing options"),
                chunk(content="</thi"),
                chunk(content="nk>Final answer."),
                chunk(finish_reason="stop"),
            ]
        )
    )
    got = await run(fake)
    assert coalesce(got) == [Reasoning("weighing options"), Text("Final answer."), Done("stop")]
    visible = "".join(c.text for c in got if isinstance(c, Text))
    assert "<" not in visible and "think" not in visible


# ---------------------------------------------------------------- check 3: tool calls


async def test_two_interleaved_tool_calls_ten_pieces_each(fake: FakeOpenAI) -> None:
    a = json.dumps({"city": "Paris", "units": "metric", "days": [1, 2, 3]})
    b = json.dumps({"query": "weather in Tōkyō", "limit": 10})
    pa = [a[i * len(a) // 10 : (i + 1) * len(a) // 10] for i in range(10)]
    pb = [b[i * len(b) // 10 : (i + 1) * len(b) // 10] for i in range(10)]
    chunks = [
        chunk(
            tool_calls=[
                tool_delta(0, id="call_a", name="forecast", arguments=""),
                tool_delta(1, id="call_b", name="search", arguments=""),
            ]
        )
    ]
    for x, y in zip(pa, pb, strict=True):
        chunks.append(chunk(tool_calls=[tool_delta(0, arguments=x)]))
        chunks.append(chunk(tool_calls=[tool_delta(1, arguments=y)]))
    chunks += [chunk(finish_reason="tool_calls"), usage_chunk(5, 5)]
    fake.script(openai_sse(chunks), chunk_size=17)
    got = await run(fake, req(tools=[CLOCK]))
    starts = [c for c in got if isinstance(c, ToolCallStart)]
    assert starts == [ToolCallStart(0, "call_a", "forecast"), ToolCallStart(1, "call_b", "search")]
    assert tool_args(got) == {"forecast": json.loads(a), "search": json.loads(b)}
    assert sum(isinstance(c, ToolCallArgs) for c in got) == 20
    assert got[-1] == Done("tool_calls")


async def test_tool_call_id_arriving_late_buffers_arguments(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(tool_calls=[tool_delta(0, name="clock", arguments='{"tz":')]),
                chunk(tool_calls=[tool_delta(0, arguments=' "UTC"')]),
                chunk(tool_calls=[tool_delta(0, id="call_late", arguments="}")]),
                chunk(finish_reason="tool_calls"),
            ]
        )
    )
    got = await run(fake)
    assert got == [
        ToolCallStart(0, "call_late", "clock"),
        ToolCallArgs(0, '{"tz": "UTC"}'),  # held until the id came, none lost
        Done("tool_calls"),
    ]


async def test_tool_call_that_never_gets_an_id_is_given_one(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(tool_calls=[tool_delta(0, name="clock", arguments="{}")]),
                chunk(finish_reason="tool_calls"),
            ]
        )
    )
    got = await run(fake)
    start = got[0]
    assert isinstance(start, ToolCallStart) and start.name == "clock" and start.id.startswith("call_")
    assert got[1:] == [ToolCallArgs(0, "{}"), Done("tool_calls")]


async def test_tool_calls_without_index_and_repeated_zero_index(fake: FakeOpenAI) -> None:
    """Servers that omit `index`, or number every call 0, still give distinct calls."""
    fake.script(
        openai_sse(
            [
                chunk(
                    tool_calls=[
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "a", "arguments": '{"x":1}'},
                        }
                    ]
                ),
                chunk(tool_calls=[tool_delta(0, id="c2", name="b", arguments='{"y":2}')]),
                chunk(tool_calls=[tool_delta(0, id="c3", name="c", arguments="")]),
                chunk(finish_reason="stop"),  # Ollama says "stop" for tool-call answers
            ]
        )
    )
    got = await run(fake)
    assert [c for c in got if isinstance(c, ToolCallStart)] == [
        ToolCallStart(0, "c1", "a"),
        ToolCallStart(1, "c2", "b"),
        ToolCallStart(2, "c3", "c"),
    ]
    assert tool_args(got) == {"a": {"x": 1}, "b": {"y": 2}, "c": {}}
    assert got[-1] == Done("tool_calls")


# ---------------------------------------------------------------- reasoning fields


async def test_reasoning_fields_and_content_in_one_delta(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(reasoning_content="from vllm "),
                chunk(reasoning="from openrouter "),
                chunk(reasoning_content="both ", reasoning="both "),  # sent twice, shown once
                chunk(reasoning="last", content="Visible"),
                chunk(content=" text", finish_reason="stop"),
            ]
        )
    )
    got = await run(fake)
    assert coalesce(got) == [
        Reasoning("from vllm from openrouter both last"),
        Text("Visible text"),
        Done("stop"),
    ]


# ---------------------------------------------------------------- check 7


async def test_reasoning_only_answer_has_no_text(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(role="assistant", content=""),
                chunk(reasoning_content="I think the "),
                chunk(reasoning_content="answer is 4", content=""),
                chunk(finish_reason="stop"),
                usage_chunk(10, 8, reasoning=8),
            ]
        )
    )
    got = await run(fake)
    assert not any(isinstance(c, Text) for c in got)
    assert coalesce(got) == [
        Reasoning("I think the answer is 4"),
        Usage(input_tokens=10, output_tokens=8, reasoning_tokens=8),
        Done("stop"),
    ]


async def test_length_with_tool_call_is_reported_as_length(fake: FakeOpenAI) -> None:
    fake.script(
        openai_sse(
            [
                chunk(tool_calls=[tool_delta(0, id="call_1", name="clock", arguments='{"tz": "Eur')]),
                chunk(finish_reason="length"),
                usage_chunk(10, 4),
            ]
        )
    )
    got = await run(fake)
    assert got[0] == ToolCallStart(0, "call_1", "clock")
    assert got[-1] == Done("length")


# ---------------------------------------------------------------- stream endings


async def test_usage_only_final_chunk(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="hi"), chunk(finish_reason="stop"), usage_chunk(3, 1, cached=2)]))
    assert await run(fake) == [
        Text("hi"),
        Usage(input_tokens=3, output_tokens=1, cached_tokens=2),
        Done("stop"),
    ]


async def test_stream_ending_without_finish_reason_or_done_is_cut_off(fake: FakeOpenAI) -> None:
    """A stream closed cleanly between two events, with neither a finish reason nor `[DONE]`, was
    cut off: a network failure (as a stream dropped mid-event), never a finished answer."""
    fake.script(openai_sse([chunk(content="partial"), chunk(content=" answer")], done=False))
    provider = OpenAICompatProvider(cfg(fake))
    got: list[ProviderChunk] = []
    with pytest.raises(ProviderError) as info:
        async for c in provider.stream(req()):
            got.append(c)
    await provider.aclose()
    assert info.value.kind == "network" and "no finish_reason" in info.value.message
    assert coalesce(got) == [Text("partial answer")]  # what was shown, and no Done


async def test_done_marker_without_finish_reason_is_lenient(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="partial"), chunk(content=" answer")]))
    assert coalesce(await run(fake)) == [Text("partial answer"), Done("unknown")]


async def test_finish_reason_without_done_marker_and_crlf(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="ok"), chunk(finish_reason="content_filter")], done=False, crlf=True))
    assert await run(fake) == [Text("ok"), Done("content_filter")]


async def test_dangling_partial_think_tag_is_flushed_as_text(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="a <thi"), chunk(finish_reason="stop")]))
    assert coalesce(await run(fake)) == [Text("a <thi"), Done("stop")]


async def test_server_that_ignores_stream_true(fake: FakeOpenAI) -> None:
    completion = {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "<think>hm</think>Hi",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "clock", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    fake.script(json.dumps(completion), content_type="application/json")
    assert await run(fake) == [
        Reasoning("hm"),
        Text("Hi"),
        ToolCallStart(0, "c1", "clock"),
        ToolCallArgs(0, "{}"),
        Usage(input_tokens=1, output_tokens=2),
        Done("tool_calls"),
    ]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "body", "headers", "kind", "retry_after"),
    [
        (401, openai_error("Incorrect API key provided", code="invalid_api_key"), {}, "auth", None),
        (403, openai_error("Forbidden"), {}, "auth", None),
        (
            404,
            openai_error("The model `nope` does not exist", code="model_not_found"),
            {},
            "not_found",
            None,
        ),
        (400, openai_error("bad 'temperature'"), {}, "invalid_request", None),
        (
            400,
            openai_error("This model's maximum context length is 8192 tokens", code="context_length_exceeded"),
            {},
            "context_overflow",
            None,
        ),
        (
            429,
            openai_error("Rate limit reached", type="requests"),
            {"Retry-After": "1"},
            "rate_limit",
            1.0,
        ),
        (429, openai_error("Slow down"), {"retry-after-ms": "250"}, "rate_limit", 0.25),
        (
            429,
            openai_error(
                "You exceeded your current quota",
                type="insufficient_quota",
                code="insufficient_quota",
            ),
            {},
            "quota",
            None,
        ),
        (500, openai_error("The server had an error", type="server_error"), {}, "server", None),
        (503, "upstream unavailable", {}, "server", None),
        (502, {"error": "ollama: model runner crashed"}, {}, "server", None),
    ],
)
async def test_http_errors(
    fake: FakeOpenAI,
    status: int,
    body: Any,
    headers: dict[str, str],
    kind: str,
    retry_after: float | None,
) -> None:
    fake.fail(status, body, headers=headers)
    provider = OpenAICompatProvider(cfg(fake))
    with pytest.raises(ProviderError) as info:
        await collect(provider, req())
    await provider.aclose()
    err = info.value
    assert (err.kind, err.status, err.retry_after_s) == (kind, status, retry_after)
    expected_msg = body["error"] if isinstance(body, dict) and isinstance(body["error"], str) else None
    if isinstance(body, dict) and isinstance(body["error"], dict):
        expected_msg = body["error"]["message"]
    elif isinstance(body, str):
        expected_msg = body
    assert err.message == expected_msg
    assert err.to_dict()["kind"] == kind


async def test_connection_refused_is_network_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    provider = OpenAICompatProvider(
        ProviderConfig(name="dead", base_url=f"http://127.0.0.1:{port}/v1", api_key_env=None)
    )
    with pytest.raises(ProviderError) as info:
        await collect(provider, req())
    await provider.aclose()
    assert info.value.kind == "network"
    assert isinstance(info.value.__cause__, httpx.ConnectError)


async def test_connection_dropped_mid_stream_is_network_error(fake: FakeOpenAI) -> None:
    body = openai_sse([chunk(content="hello "), chunk(content="world"), chunk(finish_reason="stop")])
    fake.script(body, chunk_size=10, drop_after=40)
    provider = OpenAICompatProvider(cfg(fake))
    got: list[ProviderChunk] = []
    with pytest.raises(ProviderError) as info:
        async for c in provider.stream(req()):
            got.append(c)
    await provider.aclose()
    assert info.value.kind == "network"
    assert not any(isinstance(c, Done) for c in got)


async def test_slow_upstream_is_timeout(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="late")]), initial_delay_s=1.5)
    with pytest.raises(ProviderError) as info:
        await run(fake, timeout_s=0.2)
    assert info.value.kind == "timeout"


async def test_stall_between_chunks_is_timeout(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="a"), chunk(content="b")]), chunk_size=20, delay_s=1.0)
    with pytest.raises(ProviderError) as info:
        await run(fake, timeout_s=0.2)
    assert info.value.kind == "timeout"


async def test_malformed_json_is_protocol_error(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="ok"), '{"choices": [{"delta": {"content": "x"'], done=True))
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert info.value.kind == "protocol"


async def test_empty_200_is_protocol_error(fake: FakeOpenAI) -> None:
    fake.script(b"")
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert info.value.kind == "protocol"


async def test_error_inside_a_200_stream(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="par"), {"error": {"code": 502, "message": "provider went away"}}]))
    with pytest.raises(ProviderError) as info:
        await run(fake)
    assert (info.value.kind, info.value.message) == ("server", "provider went away")


async def test_shared_client_is_not_closed_by_provider(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="x", finish_reason="stop")]))
    async with httpx.AsyncClient() as client:
        provider = OpenAICompatProvider(cfg(fake), http=client)
        assert provider.kind == "openai" and provider.name == "fake"
        assert await collect(provider, req()) == [Text("x"), Done("stop")]
        await provider.aclose()
        assert not client.is_closed


async def test_no_provider_state_is_emitted_or_sent(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="x", finish_reason="stop")]))
    got = await run(fake)
    assert not any(isinstance(c, ProviderState) for c in got)


async def test_both_transports_read_the_same_stream(fake: FakeOpenAI) -> None:
    from appserver.providers.fasttransport import LeanClient
    from appserver.providers.upstream import default_client

    body = openai_sse(
        [
            chunk(role="assistant", content="héllo "),
            chunk(reasoning_content="thinking"),
            chunk(tool_calls=[tool_delta(0, id="call_1", name="clock", arguments='{"tz": "UTC"}')]),
            chunk(finish_reason="tool_calls"),
            usage_chunk(9, 4),
        ]
    )
    results = []
    for transport in ("lean", "httpx"):
        client = default_client(cfg(fake, transport=transport))
        assert isinstance(client, LeanClient) == (transport == "lean")
        await client.aclose()
        fake.script(body, chunk_size=7)
        results.append(coalesce(await run(fake, req(tools=[CLOCK]), transport=transport)))
    assert results[0] == results[1]
    assert tool_args(results[0]) == {"clock": {"tz": "UTC"}}


def test_unknown_transport_is_a_config_error(tmp_path: Path) -> None:
    from appserver.config import ConfigError, load_config

    (tmp_path / "config.toml").write_text('[providers.x]\nbase_url = "http://127.0.0.1:1/v1"\ntransport = "curl"\n')
    with pytest.raises(ConfigError, match="transport must be one of 'lean', 'httpx'"):
        load_config(tmp_path, environ={})


def test_joined_merges_adjacent_deltas_of_one_read_only() -> None:
    from appserver.providers.base import Reasoning, Text, ToolCallArgs, ToolCallStart
    from appserver.providers.openai_compat import joined

    got = joined(
        [
            Reasoning("a"),
            Reasoning("b"),
            Text("he"),
            Text("llo"),
            ToolCallStart(0, "c0", "f"),
            ToolCallArgs(0, '{"x"'),
            ToolCallArgs(0, ":1}"),
            ToolCallArgs(1, "{}"),
            Text("!"),
        ]
    )
    assert got == [
        Reasoning("ab"),
        Text("hello"),
        ToolCallStart(0, "c0", "f"),
        ToolCallArgs(0, '{"x":1}'),
        ToolCallArgs(1, "{}"),
        Text("!"),
    ]
    assert joined([Text("x")]) == [Text("x")]


async def test_text_before_an_error_event_in_the_same_read_is_kept(fake: FakeOpenAI) -> None:
    """Events of one network read are parsed together and their deltas joined; an error event
    among them must not swallow the text before it (the turn keeps what was shown)."""
    fake.script(
        openai_sse([chunk(content="partial "), chunk(content="text"), {"error": {"code": 502, "message": "boom"}}])
    )  # one write, one read
    provider = OpenAICompatProvider(cfg(fake))
    got: list[ProviderChunk] = []
    try:
        with pytest.raises(ProviderError) as info:
            async for c in provider.stream(req()):
                got.append(c)
    finally:
        await provider.aclose()
    assert info.value.message == "boom"
    assert got == [Text("partial text")]


async def test_usage_counts_beyond_64_bits_keep_every_digit(fake: FakeOpenAI) -> None:
    fake.script(openai_sse([chunk(content="x", finish_reason="stop"), usage_chunk(10**30, 10**21)]))
    got = await run(fake)
    assert Usage(input_tokens=10**30, output_tokens=10**21) in got


def test_parts_with_a_refusal_and_whitespace_before_a_call_keep_their_order() -> None:
    """Content parts beside a refusal are kept; text held back at the start precedes a tool call
    or a refusal that follows it."""
    from appserver.providers.base import Refusal
    from appserver.providers.openai_compat import OpenAIStreamParser

    p = OpenAIStreamParser()
    out = p.feed_chunk(
        {"choices": [{"index": 0, "delta": {"content": [{"type": "text", "text": "PART "}], "refusal": "NO"}}]}
    )
    assert out == [Text("PART "), Refusal("NO")]
    q = OpenAIStreamParser()
    assert q.feed_chunk({"choices": [{"index": 0, "delta": {"content": "\n\n"}}]}) == []
    out = q.feed_chunk(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ]
                    },
                }
            ]
        }
    )
    assert out[0] == Text("\n\n") and type(out[1]).__name__ == "ToolCallStart", out
