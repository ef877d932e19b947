"""A hostile upstream's answers fail a turn clearly, never as an internal error or an empty reply.

- An Anthropic block event whose `index` is not an integer (a list, an object, a string, `true`)
  failed with `TypeError: unhashable type` (a 500 internal error and a traceback) or was taken:
  now a protocol error (502 `upstream_protocol_error`), as a `content_block_start` without one was.
- A redirect (3xx) is never followed, and was read as an answer: a 307 with no body said "upstream
  answered 200 without any event", a 302 with JSON became an empty reply. Now a protocol error
  naming the status and where it points, for both kinds and both transports; a 2xx without any
  event names its real status and content type.
- A 200 JSON answer that is no completion (`{"object": "list", "data": []}`) was an empty reply that
  finished with `stop`; an Anthropic JSON answer to a streamed request said only "without any
  event". Now they say what came back (an error object in it is classified as its error).
- An Anthropic content block of a type the parser skips (`server_tool_use`) took its
  `input_json_delta` for a tool call's and failed the turn: its deltas are skipped with it.
- The same class of hostile values: a usage count `Infinity`/`NaN`/`1e400` (OverflowError) and JSON
  nested deeper than Python recurses (RecursionError), in a stream event or an error answer.

A real loopback upstream (tests/fakes) and the real providers; one case through `appserver serve`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, Done, ProviderChunk, ProviderError, ProviderRequest, Text, Usage
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.fakes.anthropic_upstream import (
    FakeAnthropic,
    anthropic_sse,
    block_delta,
    block_start,
    block_stop,
    message_delta,
    message_start,
)
from tests.fakes.openai_upstream import FakeOpenAI, FakeUpstream, chunk, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.net import ScriptedServer, serving
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(60)

KINDS = ("openai", "anthropic")
TRANSPORTS = ("lean", "httpx")


def make(kind: str, base_url: str, transport: str = "lean") -> OpenAICompatProvider | AnthropicProvider:
    cfg = ProviderConfig("up", kind=kind, base_url=base_url, api_key_env=None, max_attempts=1, transport=transport)
    return OpenAICompatProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)


async def collect(kind: str, base_url: str, transport: str = "lean") -> list[ProviderChunk]:
    provider = make(kind, base_url, transport)
    try:
        request = ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])
        return [c async for c in provider.stream(request)]
    finally:
        await provider.aclose()


async def failure(kind: str, base_url: str, transport: str = "lean") -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await collect(kind, base_url, transport)
    return caught.value


def fake_for(kind: str) -> FakeUpstream:
    return FakeOpenAI() if kind == "openai" else FakeAnthropic()


def text_of(chunks: list[ProviderChunk]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, Text))


# ---------------------------------------------------------------- 1. Anthropic block indexes


def _with_index(event: dict[str, Any], index: Any) -> dict[str, Any]:
    return {**event, "index": index}


BAD_INDEXES = {
    "stop-list": [block_start(0, {"type": "text", "text": ""}), _with_index(block_stop(0), [0])],
    "delta-object": [_with_index(block_delta(0, {"type": "thinking_delta", "thinking": "x"}), {"a": 1})],
    "delta-text-list": [
        block_start(0, {"type": "text", "text": ""}),
        _with_index(block_delta(0, {"type": "text_delta", "text": "x"}), [0]),
    ],
    "start-true": [_with_index(block_start(0, {"type": "text", "text": ""}), True)],
    "stop-string": [block_start(0, {"type": "text", "text": ""}), _with_index(block_stop(0), "0")],
    "delta-true": [
        block_start(1, {"type": "thinking", "thinking": ""}),
        _with_index(block_delta(1, {"type": "thinking_delta", "thinking": "x"}), True),
    ],
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
async def test_an_anthropic_block_index_that_is_not_an_integer_is_a_protocol_error(case: str) -> None:
    events = [message_start(), *BAD_INDEXES[case], message_delta("end_turn"), {"type": "message_stop"}]
    with FakeAnthropic() as fake:
        fake.script(anthropic_sse(events))
        err = await failure("anthropic", fake.base_url)
    assert err.kind == "protocol", err
    assert "index that is not an integer" in err.message, err.message


# ---------------------------------------------------------------- 2. redirects and other statuses


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", KINDS)
async def test_a_redirect_is_not_followed_and_names_its_status_and_location(kind: str, transport: str) -> None:
    with fake_for(kind) as fake, FakeOpenAI() as elsewhere:
        target = f"{elsewhere.base_url}/chat/completions"
        fake.fail(307, None, headers={"Location": target})  # no body at all
        fake.fail(302, {"ok": True}, headers={"Location": "/elsewhere?x=1"})  # JSON, relative Location
        fake.fail(303, None)  # no Location
        first = await failure(kind, fake.base_url, transport)
        second = await failure(kind, fake.base_url, transport)
        third = await failure(kind, fake.base_url, transport)
        origin = f"http://127.0.0.1:{fake.port}"
        assert len(fake.requests) == 3 and elsewhere.requests == []  # nothing followed anywhere
    for err, status in ((first, 307), (second, 302), (third, 303)):
        assert err.kind == "protocol" and err.status == status, err
        assert "redirects are not followed" in err.message and "[providers.up] base_url" in err.message, err
    assert f"the upstream redirected (307 to {target})" in first.message, first.message
    assert f"(302 to {origin}/elsewhere?x=1)" in second.message, second.message
    assert "HTTP 303, a redirect without a Location" in third.message, third.message


@pytest.mark.parametrize("kind", KINDS)
async def test_a_2xx_without_any_event_names_its_real_status_and_content_type(kind: str) -> None:
    with fake_for(kind) as fake:
        fake.script(b"", status=201)
        fake.script(b"<html>Login required</html>", content_type="text/html")
        created = await failure(kind, fake.base_url)
        html = await failure(kind, fake.base_url)
    assert created.kind == "protocol" and "upstream answered HTTP 201 (text/event-stream) without any event" in str(
        created
    ), created
    assert "HTTP 200 (text/html) without any event" in str(html), html


# ---------------------------------------------------------------- 3. JSON answers that are no answer


NOT_COMPLETIONS = {
    "model-list": ({"object": "list", "data": []}, "a JSON object with object 'list' (keys: object, data)"),
    "no-choice": ({"id": "x", "choices": []}, "(keys: id, choices)"),
    "legacy-text": ({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}, "(keys: choices)"),
}


@pytest.mark.parametrize("case", sorted(NOT_COMPLETIONS))
async def test_a_json_answer_that_is_no_completion_is_a_protocol_error(case: str) -> None:
    body, said = NOT_COMPLETIONS[case]
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}, "finish_reason": "stop"}]}
    with FakeOpenAI() as fake:
        fake.script(json.dumps(body), content_type="application/json")
        fake.script(json.dumps(whole), content_type="application/json")
        err = await failure("openai", fake.base_url)
        fine = await collect("openai", fake.base_url)  # a server ignoring `stream: true` still works
    assert err.kind == "protocol", err
    assert (
        "upstream answered HTTP 200 with a JSON object" in err.message
        and said in err.message
        and "not a chat completion" in err.message
    ), err
    assert text_of(fine) == "whole" and fine[-1] == Done("stop")


async def test_an_anthropic_json_answer_says_what_came_and_an_error_in_it_is_classified() -> None:
    message = {"id": "m", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "x"}]}
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with FakeAnthropic() as fake:
        fake.script(json.dumps(message), content_type="application/json")
        fake.script(json.dumps(overloaded), content_type="application/json")
        err = await failure("anthropic", fake.base_url)
        busy = await failure("anthropic", fake.base_url)
    assert err.kind == "protocol", err
    assert "HTTP 200 with a JSON object with type 'message'" in err.message, err.message
    assert "not the event stream asked for" in err.message, err.message
    assert busy.kind == "server" and busy.message == "Overloaded", busy  # retried as the stream's error event is


# ---------------------------------------------------------------- 4. blocks the Anthropic parser skips


async def test_deltas_of_a_skipped_anthropic_block_are_skipped_too() -> None:
    events = [
        message_start(),
        block_start(0, {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {}}),
        block_delta(0, {"type": "input_json_delta", "partial_json": '{"query": "x"}'}),
        block_delta(0, {"type": "some_later_delta", "data": 1}),
        block_stop(0),
        block_start(1, {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []}),
        block_stop(1),
        block_start(2, {"type": "text", "text": ""}),
        block_delta(2, {"type": "text_delta", "text": "after search"}),
        block_stop(2),
        message_delta("end_turn"),
        {"type": "message_stop"},
    ]
    in_text = [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        block_delta(0, {"type": "input_json_delta", "partial_json": "{}"}),
    ]
    with FakeAnthropic() as fake:
        fake.script(anthropic_sse(events), chunk_size=9)
        fake.script(anthropic_sse(in_text))
        chunks = await collect("anthropic", fake.base_url)
        strict = await failure("anthropic", fake.base_url)  # a block the parser reads still checks its deltas
    assert strict.kind == "protocol" and "input_json_delta outside a tool_use block" in strict.message, strict
    assert text_of(chunks) == "after search" and chunks[-1] == Done("stop"), chunks


# ---------------------------------------------------------------- hostile numbers and nesting


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "1e400"])
async def test_a_usage_count_that_is_no_finite_number_counts_nothing(number: str) -> None:
    body = openai_sse([chunk(content="hi"), chunk(finish_reason="stop")], done=False)
    body += b'data: {"choices": [], "usage": {"prompt_tokens": %s, "completion_tokens": 3}}\n\ndata: [DONE]\n\n' % (
        number.encode()
    )
    with FakeOpenAI() as fake:
        fake.script(body)
        chunks = await collect("openai", fake.base_url)
    assert text_of(chunks) == "hi" and chunks[-1] == Done("stop")
    assert [c for c in chunks if isinstance(c, Usage)] == [Usage(input_tokens=0, output_tokens=3)]


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("kind", KINDS)
async def test_json_nested_too_deeply_is_malformed_not_a_crash(kind: str) -> None:
    event = '{"type": "ping", "choices": [], "x": ' + DEEP + "}"
    with fake_for(kind) as fake:
        fake.script(f"data: {event}\n\n".encode())
        fake.script('{"error": {"message": ' + DEEP + "}}", status=400, content_type="application/json")
        streamed = await failure(kind, fake.base_url)
        refused = await failure(kind, fake.base_url)
    assert streamed.kind == "protocol" and "malformed JSON" in streamed.message, streamed
    assert refused.kind == "invalid_request" and refused.status == 400, refused


# ---------------------------------------------------------------- through `appserver serve`


def _raw(status: int, body: bytes, ctype: bytes = b"text/event-stream", extra: bytes = b"") -> Any:
    head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (status, ctype, len(body), extra)
    return lambda _request: [head + body]


async def test_through_serve_clients_get_a_502_upstream_protocol_error_naming_what_came(tmp_path: Path) -> None:
    bad_index = anthropic_sse(
        [
            message_start(),
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, {"type": "text_delta", "text": "hi"}),
            _with_index(block_stop(0), [0]),
            message_delta("end_turn"),
            {"type": "message_stop"},
        ]
    )
    upstream = ScriptedServer(
        [
            _raw(200, bad_index),
            _raw(307, b"", extra=b"location: https://llm.example/v2/chat/completions\r\n"),
            _raw(302, b'{"ok": true}', b"application/json", b"location: /elsewhere\r\n"),
            _raw(200, b'{"object": "list", "data": []}', b"application/json"),
        ]
    )
    home = tmp_path / "home"
    async with serving(upstream) as url:
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[providers.oa]\nkind = "openai"\nbase_url = "{url}/v1"\napi_key_env = ""\nmax_attempts = 1\n'
            f'[providers.an]\nkind = "anthropic"\nbase_url = "{url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        for name, model in (("claude", "an:c"), ("gpt", "oa:g")):
            made = await asyncio.to_thread(run_cli, home, "agents", "create", "--name", name, "--model", model, env=env)
            assert made.code == 0, made.err
        sp = await asyncio.to_thread(start_serve, home, env=env)
        try:
            async with httpx.AsyncClient(base_url=sp.url, timeout=20) as client:
                answers = []
                for agent in ("claude", "gpt", "gpt", "gpt"):
                    r = await client.post(
                        "/v1/chat/completions",
                        headers={"X-Conversation-Id": "new"},
                        json={"model": agent, "messages": [{"role": "user", "content": "go"}]},
                    )
                    answers.append((r.status_code, r.json().get("error") or r.json()))
        finally:
            await asyncio.to_thread(sp.stop)
    log = sp.proc.stderr.read() if sp.proc.stderr else ""
    for status, error in answers:
        assert status == 502 and error.get("code") == "upstream_protocol_error", answers
    messages = [e["message"] for _, e in answers]
    assert "content_block_stop with an index that is not an integer" in messages[0], messages
    assert "the upstream redirected (307 to https://llm.example/v2/chat/completions)" in messages[1], messages
    assert "set [providers.oa] base_url to where it points" in messages[1], messages
    assert f"(302 to {url}/elsewhere)" in messages[2], messages
    assert "with a JSON object with object 'list'" in messages[3], messages
    assert "Traceback" not in log and "TypeError" not in log, log[-3000:]
