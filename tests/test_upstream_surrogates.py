"""An upstream that sends a lone UTF-16 surrogate (JSON `"\\ud800"`) no longer fails the turn.

orjson refuses such an escape; the standard parser, which the providers fell back to, takes it and
yields text that UTF-8 cannot carry: the turn failed at the store's insert (UnicodeEncodeError),
after the streaming client had seen the text. Now the providers' decoding
(appserver/providers/jsontext.py) turns each lone surrogate into U+FFFD where upstream text enters
the server, so a stream, the answer and the store hold the same text. orjson takes everything
else, so normal text pays nothing for the check.

A scripted upstream on loopback (tests/support/net.py), a real `appserver serve`, the `openai` SDK.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import openai
import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, Done, ProviderError, ProviderRequest, Text, ToolCallArgs, Usage
from appserver.providers.jsontext import loads, loads_event
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.support.cli import cli_env, run_cli
from tests.support.net import Reply, ScriptedServer, serving
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(60)

LONE = "a\ud800b\udfffc"  # a lone high and a lone low surrogate
SHOWN = "a\ufffdb\ufffdc"
SSE = b"content-type: text/event-stream"
JSON = b"content-type: application/json"


def reply(body: bytes, ctype: bytes = SSE, status: int = 200) -> Reply:
    head = b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n\r\n" % (status, len(body), ctype)
    return lambda _request: [head + body]


def sse(*chunks: dict[str, Any]) -> bytes:
    # json.dumps escapes the surrogates as `\udXXX`, as an upstream's JSON encoder does
    return b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks) + b"data: [DONE]\n\n"


def delta(**d: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": d}]}


STOP = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def text_stream(text: str) -> Reply:
    return reply(sse(delta(role="assistant", content=text), STOP))


# ---------------------------------------------------------------- the decoding itself


def test_a_lone_surrogate_becomes_u_fffd_and_a_pair_stays_its_character() -> None:
    assert loads(json.dumps({"t": LONE})) == {"t": SHOWN}
    assert loads(json.dumps({LONE: [LONE, {"k": LONE}]}).encode()) == {SHOWN: [SHOWN, {"k": SHOWN}]}
    assert loads('"\\ud83d\\ude00"') == "\U0001f600"  # a pair is one character, orjson takes it
    # the exact path (a usage chunk with a count orjson would round) is made safe too
    big = 10**25
    assert loads_event(json.dumps({"usage": {"prompt_tokens": big}, "x": LONE})) == {
        "usage": {"prompt_tokens": big},
        "x": SHOWN,
    }
    with pytest.raises(ValueError):
        loads("{not json")


# ---------------------------------------------------------------- each way upstream text comes in


def request() -> ProviderRequest:
    return ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])


async def collect(url: str, kind: str = "openai") -> list[object]:
    base = url + "/v1" if kind == "openai" else url
    cfg = ProviderConfig("up", kind=kind, base_url=base, api_key_env=None, max_attempts=1)
    provider = OpenAICompatProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)
    try:
        return [c async for c in provider.stream(request())]
    finally:
        await provider.aclose()


def text_of(chunks: list[object]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, Text))


async def test_provider_paths_replace_lone_surrogates() -> None:
    whole = json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": LONE}, "finish_reason": "stop"}]}
    ).encode()
    call = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": {"tz": LONE}}}
    replies = [
        text_stream(LONE),
        reply(whole, JSON),  # a server that ignores `stream: true`
        reply(sse(delta(tool_calls=[{"index": 0, **call}]), STOP)),
        reply(sse(delta(content="x"), {"choices": [], "usage": {"prompt_tokens": 10**21, "note": LONE}})),
        reply(json.dumps({"error": {"message": f"bad {LONE}"}}).encode(), JSON, status=400),
    ]
    async with serving(ScriptedServer(replies)) as url:
        streamed = await collect(url)
        assert text_of(streamed) == SHOWN and streamed[-1] == Done("stop")
        assert text_of(await collect(url)) == SHOWN
        args = [c for c in await collect(url) if isinstance(c, ToolCallArgs)]
        assert json.loads("".join(a.delta for a in args)) == {"tz": SHOWN}
        usage = [c for c in await collect(url) if isinstance(c, Usage)]
        assert usage and usage[0].input_tokens == 10**21
        with pytest.raises(ProviderError) as failed:
            await collect(url)
    assert SHOWN in str(failed.value)
    str(failed.value).encode("utf-8")  # the message can be stored and shown


def anthropic_sse(text: str) -> bytes:
    events = [
        {"type": "message_start", "message": {"id": "m", "role": "assistant", "usage": {"input_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    ]
    return b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events)


async def test_the_anthropic_stream_replaces_lone_surrogates() -> None:
    async with serving(ScriptedServer([reply(anthropic_sse(LONE))])) as url:
        chunks = await collect(url, "anthropic")
    assert text_of(chunks) == SHOWN and chunks[-1] == Done("stop")


# ---------------------------------------------------------------- through the server


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "home"


def stored_texts(home: Path) -> list[tuple[str, str, str]]:
    with closing(sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT role, content, completion_status FROM messages ORDER BY id").fetchall()
        turns = db.execute("SELECT status FROM turns ORDER BY rowid").fetchall()
    assert {t[0] for t in turns} == {"completed"}, turns
    return [(r, json.loads(c), s) for r, c, s in rows]


async def test_the_turn_completes_and_clients_and_store_see_the_same_text(home: Path) -> None:
    upstream = ScriptedServer([text_stream(LONE), text_stream(LONE), text_stream("z" + LONE)])
    async with serving(upstream) as url:
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[providers.up]\nkind = "openai"\nbase_url = "{url}/v1"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        made = await asyncio.to_thread(
            run_cli, home, "agents", "create", "--name", "remote", "--model", "up:m", env=env
        )
        assert made.code == 0, made.err
        sp = await asyncio.to_thread(start_serve, home, env=env)
        try:
            client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=20)
            pieces: list[str] = []
            finish = None
            stream = await client.chat.completions.create(
                model="remote", messages=[{"role": "user", "content": "one"}], stream=True
            )
            async for c in stream:
                if c.choices:
                    pieces.append(c.choices[0].delta.content or "")
                    finish = c.choices[0].finish_reason or finish
            assert "".join(pieces) == SHOWN and finish == "stop"
            answer = await client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "two"}])
            assert answer.choices[0].message.content == SHOWN
            events = [e async for e in await client.responses.create(model="remote", input="three", stream=True)]
            assert events[-1].type == "response.completed", events[-1]
            assert events[-1].response.output_text == "z" + SHOWN
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "z" + SHOWN
            await client.close()
        finally:
            await asyncio.to_thread(sp.stop)
    replies = [content for role, content, _ in stored_texts(home) if role == "assistant"]
    assert [r if isinstance(r, str) else "".join(p.get("text", "") for p in r) for r in replies] == [
        SHOWN,
        SHOWN,
        "z" + SHOWN,
    ], replies
