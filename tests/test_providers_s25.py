"""A hostile upstream's response head and `Retry-After` fail a call clearly and boundedly.

- The lean transport kept every header field an upstream sent: `HTTP/1.1 200` and then thousands
  of 64 KiB fields grew the server by hundreds of MB per call (each retry holding a whole head), and
  the client was told "Server disconnected without sending a response". Now a head past 100 KiB (as
  httpx's own transport allows) or 100 header fields is refused as a protocol error (502
  `upstream_protocol_error`, not retried) naming the limit, and its connection closed unread. The
  read timeout bounds the head as a whole: a head trickled a byte at a time ends with it.
- A `Retry-After` date with a year no datetime holds (`01 Jan 10000000000 00:00:00 GMT`) raised
  OverflowError: a 500 internal_error with a traceback, not retried. Now any value that is no
  number or date a clock can hold is ignored, as other bad values were: the default backoff retries.

A real raw loopback upstream and the real providers; one case through `appserver serve` and the
openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, ProviderChunk, ProviderError, ProviderRequest, Text
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.providers.retry import RetryPolicy, retry_delay_ms
from tests.support.cli import cli_env, run_cli
from tests.support.net import read_request
from tests.support.serve import start_serve

pytestmark = pytest.mark.timeout(60)

KINDS = ("openai", "anthropic")
FIELD = b"v" * 65536
OFFERED = 1024  # fields of 64 KiB: 64 MiB of head offered, far beyond what kernel buffers hold


@dataclass
class Upstream:
    """What a raw upstream wrote: per request, the bytes sent and whether the client cut it off."""

    requests: list[bytes] = field(default_factory=list)
    written: int = 0
    cut: bool = False


Answer = Callable[[asyncio.StreamWriter, bytes, Upstream], Awaitable[None]]


@asynccontextmanager
async def upstream(answer: Answer) -> AsyncIterator[tuple[str, Upstream]]:
    """A raw HTTP/1.1 server on loopback answering every request with `answer`: (its URL, its record)."""
    seen = Upstream()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                _, body = await read_request(reader)
                seen.requests.append(body)
                await answer(writer, body, seen)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up (`send` notes it if that cut a reply), or the reply ended it
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()


async def send(writer: asyncio.StreamWriter, data: bytes, seen: Upstream) -> None:
    writer.write(data)
    try:
        await writer.drain()
    except ConnectionError:
        seen.cut = True
        raise
    seen.written += len(data)


async def endless_head(writer: asyncio.StreamWriter, _body: bytes, seen: Upstream) -> None:
    """`HTTP/1.1 200` and then 64 MiB of header fields; the connection closes after them."""
    await send(writer, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n", seen)
    for i in range(OFFERED):
        await send(writer, b"X-H%d: %s\r\n" % (i, FIELD), seen)
    writer.close()
    raise ConnectionError("done")


def sse_answer(kind: str, text: str) -> bytes:
    if kind == "openai":
        events = [
            {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        return b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"
    events = [
        {"type": "message_start", "message": {"id": "m", "role": "assistant", "content": [], "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]
    return b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events)


def make(
    kind: str, url: str, timeout_s: float = 30, transport: str = "lean"
) -> OpenAICompatProvider | AnthropicProvider:
    base = f"{url}/v1" if kind == "openai" else url
    cfg = ProviderConfig(
        "up", kind=kind, base_url=base, api_key_env=None, max_attempts=1, timeout_s=timeout_s, transport=transport
    )
    return OpenAICompatProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)


async def call(kind: str, url: str, timeout_s: float = 30) -> list[ProviderChunk]:
    """One model call, bounded (a head that never ends must fail the test, not hang it)."""
    provider = make(kind, url, timeout_s)
    try:
        request = ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])

        async def run() -> list[ProviderChunk]:
            return [c async for c in provider.stream(request)]

        return await asyncio.wait_for(run(), 15)
    finally:
        await provider.aclose()


async def failure(kind: str, url: str, timeout_s: float = 30) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await call(kind, url, timeout_s)
    return caught.value


# ---------------------------------------------------------------- 1. the response head


@pytest.mark.parametrize("kind", KINDS)
async def test_a_head_past_100_kib_is_a_protocol_error_and_is_not_read_further(kind: str) -> None:
    async with upstream(endless_head) as (url, seen):
        tracemalloc.start()
        try:
            err = await failure(kind, url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        for _ in range(100):  # the upstream learns of the close at its next write
            if seen.cut:
                break
            await asyncio.sleep(0.05)
    assert err.kind == "protocol", err
    assert "response head (status line and headers) is larger than 102400 bytes" in err.message, err.message
    assert retry_delay_ms(err, 1) is None  # the same upstream would send it again
    assert len(seen.requests) == 1
    # The connection was dropped: the upstream could not write its 64 MiB, and none of it was held.
    assert seen.cut and seen.written < OFFERED * len(FIELD) // 2, (seen.cut, seen.written)
    assert peak < 16 << 20, peak


async def many_fields(count: int, writer: asyncio.StreamWriter, seen: Upstream, kind: str) -> None:
    body = sse_answer(kind, "fine")
    fields = b"".join(b"X-F%d: x\r\n" % i for i in range(count - 2))
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n%s\r\n" % (len(body), fields)
    await send(writer, head + body, seen)


@pytest.mark.parametrize("kind", KINDS)
async def test_more_than_100_header_fields_is_a_protocol_error_and_100_are_fine(kind: str) -> None:
    async def hundred(writer: asyncio.StreamWriter, _body: bytes, seen: Upstream) -> None:
        await many_fields(100, writer, seen, kind)

    async def too_many(writer: asyncio.StreamWriter, _body: bytes, seen: Upstream) -> None:
        await many_fields(5000, writer, seen, kind)

    async with upstream(hundred) as (url, _):
        chunks = await call(kind, url)
    assert "".join(c.text for c in chunks if isinstance(c, Text)) == "fine"
    async with upstream(too_many) as (url, _):
        err = await failure(kind, url)
    assert err.kind == "protocol", err
    assert "response head has more than 100 headers" in err.message, err.message


async def trickled_head(writer: asyncio.StreamWriter, _body: bytes, seen: Upstream) -> None:
    """A status line, then a header byte every 50 ms for as long as the client reads."""
    await send(writer, b"HTTP/1.1 200 OK\r\nX-Slow: ", seen)
    for _ in range(1200):
        await asyncio.sleep(0.05)
        await send(writer, b"a", seen)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_trickled_head_ends_with_the_read_timeout_as_a_whole(kind: str) -> None:
    async with upstream(trickled_head) as (url, seen):
        err = await failure(kind, url, timeout_s=1)
    assert err.kind == "timeout", err
    assert len(seen.requests) == 1


# ---------------------------------------------------------------- 2. Retry-After

BAD_RETRY_AFTER = [
    "01 Jan 10000000000 00:00:00 GMT",
    "Mon, 01 Jan 99999999999 00:00:00 GMT",
    "Mon, 01 Jan 2000 00:00:00 +9999999999999",
    "1" + "0" * 400,
    "1e309",
    "NaN",
]


@pytest.mark.parametrize("transport", ("lean", "httpx"))
@pytest.mark.parametrize("kind", KINDS)
async def test_a_retry_after_no_clock_holds_is_ignored_and_the_429_is_retried(kind: str, transport: str) -> None:
    values = list(BAD_RETRY_AFTER)

    async def limited(writer: asyncio.StreamWriter, _body: bytes, seen: Upstream) -> None:
        body = b'{"error": {"message": "slow down", "type": "rate_limit_error"}}'
        await send(
            writer,
            b"HTTP/1.1 429 Too Many\r\nContent-Type: application/json\r\nRetry-After: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (values[len(seen.requests) - 1].encode(), len(body), body),
            seen,
        )

    errors = []
    async with upstream(limited) as (url, _):
        for _value in values:
            provider = make(kind, url, transport=transport)
            try:
                with pytest.raises(ProviderError) as caught:
                    request = ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])
                    await asyncio.wait_for(_drain(provider, request), 15)
                errors.append(caught.value)
            finally:
                await provider.aclose()
    for value, err in zip(values, errors, strict=True):
        assert err.kind == "rate_limit" and err.status == 429 and err.retry_after_s is None, (value, err)
        assert retry_delay_ms(err, 1, RetryPolicy(base_ms=7)) == 7, value  # the default backoff


async def _drain(provider: OpenAICompatProvider | AnthropicProvider, request: ProviderRequest) -> None:
    async for _ in provider.stream(request):
        pass


# ---------------------------------------------------------------- through `appserver serve`


async def test_through_serve_the_client_gets_clear_errors_and_the_429_is_retried(tmp_path: Path) -> None:
    async def answer(writer: asyncio.StreamWriter, body: bytes, seen: Upstream) -> None:
        if b"HUGEHEADERS" in body:
            await endless_head(writer, body, seen)
            return
        err = b'{"error": {"message": "slow down", "type": "requests"}}'
        await send(
            writer,
            b"HTTP/1.1 429 X\r\nContent-Type: application/json\r\nRetry-After: 01 Jan 10000000000 00:00:00 GMT\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(err), err),
            seen,
        )

    home = tmp_path / "home"
    home.mkdir()
    async with upstream(answer) as (url, seen):
        (home / "config.toml").write_text(
            "[limits]\nretry_base_ms = 1\n"
            f'[providers.oa]\nkind = "openai"\nbase_url = "{url}/v1"\napi_key_env = ""\nmax_attempts = 3\n'
        )
        env = cli_env(home)
        made = await asyncio.to_thread(run_cli, home, "agents", "create", "--name", "gpt", "--model", "oa:g", env=env)
        assert made.code == 0, made.err
        sp = await asyncio.to_thread(start_serve, home, env=env)
        try:
            client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0, timeout=30)
            answers = []
            for said in ("RETRY", "HUGEHEADERS"):
                with pytest.raises(openai.APIStatusError) as caught:
                    await client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": said}])
                answers.append((caught.value.status_code, caught.value.body))
                if said == "RETRY":
                    rate_limited = len(seen.requests)
            await client.close()
        finally:
            await asyncio.to_thread(sp.stop)
    log = sp.proc.stderr.read() if sp.proc.stderr else ""
    (limited_status, limited), (head_status, head) = answers
    assert limited_status == 429 and isinstance(limited, dict) and limited.get("code") == "upstream_rate_limited"
    assert rate_limited == 3  # retried up to max_attempts: the bad Retry-After was ignored
    assert head_status == 502 and isinstance(head, dict) and head.get("code") == "upstream_protocol_error", head
    assert "larger than 102400 bytes" in str(head.get("message")), head
    assert len(seen.requests) == 4  # the refused head was not retried
    assert seen.cut and seen.written < OFFERED * len(FIELD) // 2, (seen.cut, seen.written)
    assert "Traceback" not in log and "OverflowError" not in log, log[-3000:]
