"""What an upstream's answer may cost to decode: content-coding chains, encodings we did not offer,
the SSE decoder's per-event limit and the memory one event may hold. Real sockets on loopback
against a raw scripted server; memory is measured with tracemalloc where it is the point."""

from __future__ import annotations

import functools
import json
import tracemalloc
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, Done, ProviderError, ProviderRequest, Text
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.providers.sse import SSEDecoder
from tests.support.net import Reply, ScriptedServer, serving

MiB = 1024 * 1024


def head(status: int, *fields: bytes, length: int | None = None) -> bytes:
    framing = b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n"
    return b"HTTP/1.1 %d X\r\n%s%s\r\n" % (status, framing, b"".join(f + b"\r\n" for f in fields))


def whole(body: bytes, *fields: bytes, status: int = 200) -> Reply:
    """One write: head and body (Content-Length)."""
    return lambda _body: [head(status, *fields, length=len(body)) + body]


def pieces(parts: Iterable[bytes], *fields: bytes, pause: float = 0.0, status: int = 200) -> Reply:
    """A chunked body, one write per part (with `pause` between them)."""

    def reply(_body: bytes) -> Iterator[bytes | float]:
        yield head(status, *fields)
        for part in parts:
            yield b"%x\r\n%s\r\n" % (len(part), part)
            if pause:
                yield pause
        yield b"0\r\n\r\n"

    return reply


SSE = b"content-type: text/event-stream"
JSON = b"content-type: application/json"


def event(text: str) -> bytes:
    return b"data: %s\n\n" % json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()


FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def completion(text: str) -> bytes:
    return json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    ).encode()


def pack(data: bytes, coding: str) -> bytes:
    wbits = {"gzip": 31, "x-gzip": 31, "deflate": 15, "rawdeflate": -15}[coding]
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(data) + packer.flush()


@functools.cache
def zeros_gzip(size: int) -> bytes:
    """`size` zero bytes gzipped (about a thousandth of that). Made once per size (~0.2 CPU-s for
    64 MiB) and shared by the bomb tests: the bytes are the same each time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    piece = bytes(MiB)
    return b"".join(packer.compress(piece) for _ in range(size // MiB)) + packer.flush()


def request() -> ProviderRequest:
    return ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])


async def call(url: str, kind: str = "openai", **cfg: Any) -> list[object]:
    provider: OpenAICompatProvider | AnthropicProvider
    if kind == "openai":
        provider = OpenAICompatProvider(
            ProviderConfig("up", kind="openai", base_url=url + "/v1", api_key_env=None, max_attempts=1, **cfg)
        )
    else:
        provider = AnthropicProvider(
            ProviderConfig("up", kind="anthropic", base_url=url, api_key_env=None, max_attempts=1, **cfg)
        )
    try:
        return [c async for c in provider.stream(request())]
    finally:
        await provider.aclose()


def text_of(chunks: list[object]) -> str:
    return "".join(c.text for c in chunks if isinstance(c, Text))


async def failing_call(url: str, **cfg: Any) -> tuple[ProviderError, int]:
    """The call's ProviderError and the peak of traced memory while it ran."""
    tracemalloc.start()
    try:
        with pytest.raises(ProviderError) as failed:
            await call(url, **cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return failed.value, peak


# ---------------------------------------------------------------- content-coding chains


@pytest.mark.parametrize(
    ("fields", "codings"),
    [
        ((b"content-encoding: gzip, gzip",), ["gzip", "gzip"]),
        ((b"content-encoding: gzip", b"content-encoding: gzip"), ["gzip", "gzip"]),
        ((b"content-encoding: gzip, identity",), ["gzip"]),
        ((b"content-encoding: identity, identity",), []),
        ((b"Content-Encoding: X-GZIP ,deflate",), ["x-gzip", "deflate"]),
        ((b"content-encoding: deflate, gzip",), ["rawdeflate", "gzip"]),
    ],
)
async def test_a_chain_of_codings_decodes_in_reverse_order(fields: tuple[bytes, ...], codings: list[str]) -> None:
    """Codings are listed in the order they were applied; each one is undone, last first."""
    text = "chained " * 200_000  # 1.6 MB: more than one decoded piece per stage
    stream = event(text) + FINISH
    answer = completion(text)
    for coding in codings:
        stream, answer = pack(stream, coding), pack(answer, coding)
    raw = ScriptedServer([whole(stream, SSE, *fields), whole(answer, JSON, *fields)])
    async with serving(raw) as url:
        for _ in range(2):
            chunks = await call(url)
            assert text_of(chunks) == text and chunks[-1] == Done("stop")


@pytest.mark.parametrize(
    "fields",
    [
        (b"content-encoding: gzip, gzip",),
        (b"content-encoding: gzip", b"content-encoding: gzip"),
        (b"content-encoding: x-gzip, deflate",),
    ],
)
@pytest.mark.parametrize("ctype", [SSE, JSON])
async def test_a_twice_compressed_bomb_is_decoded_in_bounded_steps(fields: tuple[bytes, ...], ctype: bytes) -> None:
    """64 MB of zeros compressed twice is a few hundred bytes: every stage of the chain is bounded,
    so the call fails at `answer_max_bytes` without ever holding the bomb expanded (httpx, which
    took every chain but a lone gzip/deflate, expanded each read of each stage whole)."""
    inner = zeros_gzip(64 * MiB)
    outer = pack(inner, "deflate") if fields[0].endswith(b"deflate") else pack(inner, "gzip")
    raw = ScriptedServer([whole(outer, ctype, *fields)])
    async with serving(raw) as url:
        failed, peak = await failing_call(url, answer_max_bytes=4 * MiB)
    assert failed.kind == "protocol" and "larger than 4194304 bytes" in str(failed), failed
    assert peak < 24 * MiB, f"peak {peak} bytes while reading the bomb"


async def test_a_bomb_labelled_gzip_then_identity_is_bounded() -> None:
    """`gzip, identity` is gzip: decoded by the bounded decoder, not handed to httpx."""
    raw = ScriptedServer([whole(zeros_gzip(64 * MiB), SSE, b"content-encoding: gzip, identity")])
    async with serving(raw) as url:
        failed, peak = await failing_call(url, answer_max_bytes=4 * MiB)
    assert failed.kind == "protocol" and "larger than 4194304 bytes" in str(failed), failed
    assert peak < 24 * MiB, f"peak {peak} bytes while reading the bomb"


@pytest.mark.parametrize("fields", [(b"content-encoding: gzip, gzip",), (b"content-encoding: gzip",) * 2])
async def test_an_error_body_compressed_twice_is_read_in_bounded_steps(fields: tuple[bytes, ...]) -> None:
    """A 400 whose body is a double-gzip bomb keeps its status; at most 64 KiB of it is read."""
    raw = ScriptedServer([whole(pack(zeros_gzip(64 * MiB), "gzip"), JSON, *fields, status=400)])
    async with serving(raw) as url:
        failed, peak = await failing_call(url)
    assert failed.status == 400 and failed.kind == "invalid_request", failed
    assert peak < 16 * MiB, f"peak {peak} bytes while reading the error body"


async def test_an_error_body_compressed_twice_keeps_its_message() -> None:
    body = json.dumps({"error": {"message": "bad thing, twice packed"}}).encode()
    raw = ScriptedServer([whole(pack(pack(body, "gzip"), "gzip"), JSON, b"content-encoding: gzip, gzip", status=503)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url)
    assert failed.value.kind == "server" and failed.value.status == 503
    assert "bad thing, twice packed" in str(failed.value)


async def test_more_codings_than_any_server_applies_are_refused() -> None:
    body = event("deep") + FINISH
    for _ in range(5):
        body = pack(body, "gzip")
    raw = ScriptedServer([whole(body, SSE, b"content-encoding: gzip, gzip, gzip, gzip, gzip")])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url)
    assert failed.value.kind == "protocol" and "content codings" in str(failed.value)


# ---------------------------------------------------------------- encodings we did not offer


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_both_providers_offer_only_the_encodings_they_decode_in_bounded_steps(kind: str) -> None:
    """httpx offers `br` and `zstd` when brotli or zstandard happen to be installed; their decoders
    expand a read whole. The providers say what they take, whatever is installed."""
    raw = ScriptedServer([whole(b"", SSE)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError):
            await call(url, kind)
    fields = [line.split(b":", 1) for line in raw.heads[0].split(b"\r\n")[1:] if b":" in line]
    offered = [value.strip() for name, value in fields if name.strip().lower() == b"accept-encoding"]
    assert offered == [b"gzip, deflate"]


@pytest.mark.parametrize("coding", [b"br", b"zstd", b"compress", b"foo", b"gzip, br", b"br, gzip"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_encoding_we_did_not_offer_is_a_protocol_error(coding: bytes, kind: str) -> None:
    """Not guessed at, nor passed on as if it were plain text (httpx skips codings it has no decoder
    for): the call fails and says which coding it was."""
    body = event("looks plain") + FINISH  # labelled, not really encoded: still refused
    raw = ScriptedServer([whole(body, SSE, b"content-encoding: " + coding)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url, kind)
    assert failed.value.kind == "protocol", failed.value
    assert "content-encoding" in str(failed.value) and "not offered" in str(failed.value), failed.value


async def test_an_error_body_in_an_encoding_we_did_not_offer_keeps_its_status() -> None:
    raw = ScriptedServer([whole(b"\x28\xb5\x2f\xfd" + b"junk" * 50, JSON, b"content-encoding: zstd", status=429)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url)
    assert failed.value.kind == "rate_limit" and failed.value.status == 429


async def test_a_json_answer_in_an_encoding_we_did_not_offer_is_a_protocol_error() -> None:
    raw = ScriptedServer([whole(completion("x"), JSON, b"content-encoding: br")])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url)
    assert failed.value.kind == "protocol" and "not offered" in str(failed.value)


# ---------------------------------------------------------------- what follows the compressed data


async def test_bytes_after_the_compressed_data_are_dropped_not_kept() -> None:
    """Garbage after the gzip member is tolerated (as before) but not accumulated: 32 MB of it cost
    zlib's `unused_data` 32 MB."""
    body = pack(event("member") + FINISH, "gzip")

    def reply(_body: bytes) -> Iterator[bytes | float]:
        junk = b"JUNK" * (MiB // 4)
        yield head(200, SSE, b"content-encoding: gzip", length=len(body) + 32 * len(junk)) + body
        for _ in range(32):
            yield junk

    raw = ScriptedServer([reply])
    async with serving(raw) as url:
        tracemalloc.start()
        try:
            chunks = await call(url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert text_of(chunks) == "member" and chunks[-1] == Done("stop")
    assert peak < 8 * MiB, f"peak {peak} bytes"


# ---------------------------------------------------------------- raw deflate, split early


@pytest.mark.parametrize("coding", ["deflate", "rawdeflate"])
@pytest.mark.parametrize("first", [1, 2, 3])
async def test_deflate_with_or_without_its_header_is_recognised_however_it_is_split(coding: str, first: int) -> None:
    """`deflate` comes with a zlib header or raw; the choice is made once enough bytes are there,
    not on a first piece of one byte."""
    body = pack(event("split deflate") + FINISH, coding)
    raw = ScriptedServer([pieces([body[:first], body[first:]], SSE, b"content-encoding: deflate", pause=0.05)])
    async with serving(raw) as url:
        chunks = await call(url)
    assert text_of(chunks) == "split deflate" and chunks[-1] == Done("stop")


@pytest.mark.parametrize("coding", ["gzip", "deflate", "rawdeflate"])
async def test_a_compressed_stream_byte_by_byte_decodes(coding: str) -> None:
    body = pack(event("one byte at a time") + FINISH, coding)
    header = b"content-encoding: " + (b"deflate" if coding == "rawdeflate" else coding.encode())
    raw = ScriptedServer([pieces([body[i : i + 1] for i in range(len(body))], SSE, header, pause=0.001)])
    async with serving(raw) as url:
        chunks = await call(url)
    assert text_of(chunks) == "one byte at a time" and chunks[-1] == Done("stop")


# ---------------------------------------------------------------- the per-event limit


def big_event(size: int) -> bytes:
    """A valid chunk event whose `data:` line is `size` bytes long (the field name included)."""
    shell = event("")
    pad = size - (len(shell) - 2)
    return event("A" * pad)


@pytest.mark.parametrize("split", ["one write", "two writes", "byte pieces"])
async def test_the_event_limit_holds_however_the_event_arrives(split: str) -> None:
    """A 100 KB event against a 4096-byte limit fails whether it came in one read or several (it
    passed when one read held it whole: the fast path handed it out before the size check)."""
    body = big_event(100_000) + FINISH
    parts = {
        "one write": [body],
        "two writes": [body[:50_000], body[50_000:]],
        "byte pieces": [body[i : i + 4096] for i in range(0, len(body), 4096)],
    }[split]
    raw = ScriptedServer([pieces(parts, SSE, pause=0.02)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url, answer_max_bytes=4096)
    assert failed.value.kind == "protocol" and "larger than 4096 bytes" in str(failed.value)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
async def test_an_event_of_many_lines_in_one_read_is_held_to_the_limit(newline: bytes) -> None:
    lines = (b"data: " + b"z" * 200 + newline) * 40 + newline  # 8 KB of data lines, one event
    raw = ScriptedServer([whole(lines + FINISH.replace(b"\n", newline), SSE)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url, answer_max_bytes=4096)
    assert failed.value.kind == "protocol" and "larger than 4096 bytes" in str(failed.value)


async def test_an_anthropic_event_over_the_limit_fails_in_one_read() -> None:
    big = json.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "B" * 9000}})
    body = b"event: content_block_delta\ndata: %s\n\n" % big.encode()
    raw = ScriptedServer([whole(body, SSE)])
    async with serving(raw) as url:
        with pytest.raises(ProviderError) as failed:
            await call(url, "anthropic", answer_max_bytes=4096)
    assert failed.value.kind == "protocol" and "larger than 4096 bytes" in str(failed.value)


def padded_event(size: int, text: str) -> bytes:
    """A chunk event whose `data:` line is `size` bytes long, most of it a field that is not the
    answer (an `id`), with `text` as its content."""
    shell = b"data: %s\n\n" % json.dumps({"id": "", "choices": [{"index": 0, "delta": {"content": text}}]}).encode()
    pad = "A" * (size - (len(shell) - 2))
    return b"data: %s\n\n" % json.dumps({"id": pad, "choices": [{"index": 0, "delta": {"content": text}}]}).encode()


async def test_events_up_to_the_limit_pass_however_they_arrive() -> None:
    """The event limit is per event: many events each just under it pass, in any segmentation (the
    answer they carry together stays under the limit of a whole answer)."""
    body = padded_event(4096, "word ") * 30 + FINISH
    for parts in ([body], [body[i : i + 1000] for i in range(0, len(body), 1000)]):
        raw = ScriptedServer([pieces(parts, SSE)])
        async with serving(raw) as url:
            chunks = await call(url, answer_max_bytes=4096)
        assert text_of(chunks) == "word " * 30


def test_the_decoder_decides_an_events_size_the_same_for_every_split() -> None:
    """SSEDecoder alone: an event's data lines together, and any one line, may reach the limit and
    not pass it. In LF, CRLF and CR, as one or several lines, every split point (into two or three
    pieces) gives the same outcome."""
    limit = 1024

    def lines(newline: bytes, *specs: tuple[bytes, int]) -> bytes:
        """`specs`: (field, length of the whole line) pairs, then the blank line."""
        out = b"".join(field + b": " + b"x" * (n - len(field) - 2) + newline for field, n in specs)
        return out + newline

    cases = [
        ([(b"data", limit)], True),
        ([(b"data", limit + 1)], False),
        ([(b"data", 256)] * 4, True),
        ([(b"data", 256)] * 3 + [(b"data", 257)], False),
        ([(b"event", limit), (b"data", limit)], True),  # only the data lines make the event's size
        ([(b"event", limit + 1), (b"data", 10)], False),  # but no line may pass the limit
        ([(b"", limit + 1), (b"data", 10)], False),  # a comment neither
        ([(b"data", 600), (b"id", 600), (b"data", 424)], True),
        ([(b"data", 600), (b"id", 600), (b"data", 425)], False),
    ]
    for newline in (b"\n", b"\r\n", b"\r"):
        for specs, fits in cases:
            ev = lines(newline, *specs)
            outcomes = set()
            cuts = [(a, b) for a in range(0, len(ev) + 1, 7) for b in range(a, len(ev) + 1, 97)]
            cuts += [(a, a) for a in range(len(ev) + 1)]
            for a, b in cuts:
                dec = SSEDecoder(limit)
                try:
                    got = dec.feed(ev[:a]) + dec.feed(ev[a:b]) + dec.feed(ev[b:]) + dec.close()
                    outcomes.add(("ok", len(got)))
                except ProviderError:
                    outcomes.add(("too large", 0))
            assert outcomes == {("ok", 1) if fits else ("too large", 0)}, (newline, specs, outcomes)


# ---------------------------------------------------------------- memory within one event


def many_short_lines(total: int) -> Iterator[bytes]:
    piece = b"data: xy\n" * 8192
    for _ in range(total // len(piece) + 1):
        yield piece


@pytest.mark.parametrize("compressed", [False, True])
async def test_an_event_of_many_short_lines_costs_about_its_size(compressed: bool) -> None:
    """One event of 9-byte `data: xy` lines: each line was held as a str and a list slot (~60
    bytes), so memory grew ~7x past the limit before it fired. The event's data is now held as
    bytes; what is left is the limit plus the cost of splitting one read or decoded piece (at most
    1 MiB) into its lines, which `feed` drops before it returns."""
    limit = 4 * MiB
    if compressed:
        body = pack(b"".join(many_short_lines(4 * limit)), "gzip")
        reply = whole(body, SSE, b"content-encoding: gzip")
    else:
        reply = pieces(many_short_lines(4 * limit), SSE)
    raw = ScriptedServer([reply])
    async with serving(raw) as url:
        failed, peak = await failing_call(url, answer_max_bytes=limit)
    assert failed.kind == "protocol" and f"larger than {limit} bytes" in str(failed)
    assert peak < limit + 10 * MiB, f"peak {peak} bytes for a {limit}-byte limit"


def test_multi_line_data_decodes_as_before() -> None:
    """Lines joined with LF, each line's broken UTF-8 replaced on its own, `data:` with and
    without its space, a bare `data`."""
    dec = SSEDecoder(4096)
    stream = "data: é\ndata:x\ndata\ndata:  two spaces\n".encode() + b"data: \xe2\x82\ndata: end\xc3\n\n"
    for i in range(len(stream)):
        dec = SSEDecoder(4096)
        got = dec.feed(stream[:i]) + dec.feed(stream[i:]) + dec.close()
        assert [e.data for e in got] == ["é\nx\n\n two spaces\n\ufffd\nend\ufffd"]
