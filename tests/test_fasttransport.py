"""The providers' lean HTTP transport against a raw loopback server: framing, keep-alive, stale
connections, flow control, cancellation. (The provider suites run it against the fake upstream.)"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest

from appserver.providers.fasttransport import LeanTransport
from tests.support.certs import self_signed
from tests.support.net import Reply, ScriptedServer, read_request, serving


def framed(text: bytes, *extra: bytes) -> Reply:
    return lambda _body: [
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n" % (len(text), b"".join(e + b"\r\n" for e in extra)),
        text,
    ]


def chunked(pieces: list[bytes]) -> Reply:
    return lambda _body: [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n",
        *(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces),
        b"0\r\n\r\n",
    ]


async def test_keep_alive_reuses_one_connection_and_frames_bodies() -> None:
    raw = ScriptedServer([framed(b"one"), chunked([b"t", b"wo"]), lambda body: framed(b"echo " + body)(body)])
    async with (
        serving(raw) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client,
    ):
        assert (await client.post(url + "/a", content=b"x")).text == "one"
        async with client.stream("POST", url + "/b", json={"k": 1}) as r:
            assert [p async for p in r.aiter_bytes()] and r.headers["content-type"] == "text/event-stream"
        r3 = await client.post(url + "/c", content=b"payload")
        assert r3.text == "echo payload"
    assert raw.connections == 1
    assert raw.bodies == [b"x", b'{"k":1}', b"payload"]


async def test_closed_connections_are_never_reused() -> None:
    # "Connection: close" in the reply, then a server that hangs up after each reply anyway.
    raw = ScriptedServer([framed(b"a", b"connection: close"), framed(b"b"), framed(b"c")], close_after=True)
    async with (
        serving(raw) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client,
    ):
        assert (await client.post(url, content=b"1")).text == "a"
        assert (await client.post(url, content=b"2")).text == "b"
        await asyncio.sleep(0.05)  # the server's FIN arrives while the connection is idle
        assert (await client.post(url, content=b"3")).text == "c"
    assert raw.connections == 3


async def test_idle_connections_past_their_expiry_are_closed_while_traffic_goes_on() -> None:
    # A burst opens eight connections; then one request at a time keeps reusing the top of the
    # pool. The seven below it must still be closed once they expired, not kept open for good.
    raw = ScriptedServer([framed(b"ok") for _ in range(8 + 12 + 1)])  # one spare: no handler runs out
    transport = LeanTransport(keepalive_expiry=0.3)
    async with serving(raw) as url, httpx.AsyncClient(transport=transport, timeout=5) as client:
        burst = await asyncio.gather(*(client.post(url, content=b"b") for _ in range(8)))
        assert [r.text for r in burst] == ["ok"] * 8 and raw.connections == 8
        for _ in range(12):
            assert (await client.post(url, content=b"s")).text == "ok"
            await asyncio.sleep(0.1)
        assert raw.connections == 8  # the steady requests reused a pooled connection
        assert raw.closed == 7  # the rest were swept after 0.3 s idle
        await asyncio.sleep(0.6)
        assert raw.closed == 8  # and the last one once traffic stopped
    assert transport._sweeper is None  # aclose cancelled the timer


async def test_body_until_close_and_large_chunked_body_with_flow_control() -> None:
    big = [bytes([65 + i % 26]) * 65536 for i in range(20)]  # 1.3 MB: reading pauses and resumes

    def until_close(_body: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n", b"no length ", b"given"]

    raw = ScriptedServer([chunked(big)])
    async with (
        serving(raw) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client,
    ):
        got = await client.post(url, content=b"")
        assert got.content == b"".join(big)
    raw2 = ScriptedServer([until_close], close_after=True)
    async with (
        serving(raw2) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client,
    ):
        assert (await client.post(url, content=b"")).text == "no length given"


async def test_cancel_mid_body_drops_the_connection_and_timeouts_are_httpx_errors() -> None:
    gate = asyncio.Event()

    def slow(_body: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"5\r\nfirst\r\n"]

    raw = ScriptedServer([slow, framed(b"fresh")])
    async with (
        serving(raw) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=httpx.Timeout(5, read=0.2)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", url, content=b"") as r:
                async for part in r.aiter_bytes():
                    assert part == b"first"
                    gate.set()
        assert gate.is_set()
        assert (await client.post(url, content=b"")).text == "fresh"
    assert raw.connections == 2, "a half-read connection must not be reused"


async def test_connect_errors_are_httpx_errors() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    async with httpx.AsyncClient(transport=LeanTransport(), timeout=2) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/", content=b"")


async def test_https_verifies_the_upstream_certificate(tmp_path: Path) -> None:
    pem, key = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pem, key)
    raw = ScriptedServer([framed(b"secret"), framed(b"again")])
    srv = await asyncio.start_server(raw.handle, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}/"
    try:
        trusting = ssl.create_default_context(cafile=str(pem))
        async with httpx.AsyncClient(transport=LeanTransport(ssl_context=trusting), timeout=5) as client:
            assert (await client.post(url, content=b"")).text == "secret"
            assert (await client.post(url, content=b"")).text == "again"
        assert raw.connections == 1
        async with httpx.AsyncClient(transport=LeanTransport(), timeout=5) as client:  # system trust store
            with pytest.raises(httpx.ConnectError):
                await client.post(url, content=b"")
    finally:
        srv.close()


async def test_provider_reads_each_kind_of_answer_through_the_lean_response() -> None:
    """The provider's lean path (`LeanClient.post_stream` → `LeanResponse`): a plain stream is read
    off the connection, a gzip-encoded one, a JSON answer and an error status through
    `decoded_body`; the one connection is reused after each."""
    import gzip
    import json

    from appserver.config import ProviderConfig
    from appserver.providers.base import ChatMessage, Done, ProviderError, ProviderRequest, Text
    from appserver.providers.fasttransport import LeanClient, LeanResponse
    from appserver.providers.openai_compat import OpenAICompatProvider

    def sse(text: str) -> bytes:
        chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        return b"data: %s\n\ndata: %s\n\ndata: [DONE]\n\n" % (json.dumps(chunk).encode(), json.dumps(end).encode())

    completion = json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}, "finish_reason": "stop"}]}
    ).encode()
    error = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
    zipped = gzip.compress(sse("zipped"))
    raw = ScriptedServer(
        [
            framed(sse("plain"), b"content-type: text/event-stream"),
            framed(zipped, b"content-type: text/event-stream", b"content-encoding: gzip"),
            framed(completion, b"content-type: application/json"),
            lambda _b: [
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % len(error),
                error,
            ],
            framed(sse("again"), b"content-type: text/event-stream"),
            framed(b"raw", b"content-type: text/plain"),
        ]
    )
    async with serving(raw) as url:
        provider = OpenAICompatProvider(
            ProviderConfig("up", kind="openai", base_url=url + "/v1", api_key_env=None, max_attempts=1)
        )
        assert isinstance(provider._client(), LeanClient)
        request = ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])

        async def chunks() -> list[object]:
            return [c async for c in provider.stream(request)]

        assert await chunks() == [Text("plain"), Done("stop")]
        assert await chunks() == [Text("zipped"), Done("stop")]
        assert await chunks() == [Text("whole"), Done("stop")]
        with pytest.raises(ProviderError) as failed:
            await chunks()
        assert failed.value.status == 429 and "slow down" in str(failed.value)
        assert await chunks() == [Text("again"), Done("stop")]
        async with provider._client().post_stream(url + "/v1/chat/completions", b"{}", {}, httpx.Timeout(5)) as r:
            assert isinstance(r, LeanResponse) and r.status_code == 200
            assert (b"content-type", b"text/plain") in r.raw_headers and r.headers["content-type"] == "text/plain"
            assert b"".join([p async for p in r.stream]) == b"raw"
        await provider.aclose()
    assert raw.connections == 1


@pytest.mark.parametrize("stray", [b"HTTP/1.1 200 OK\r\ncontent-le", b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx"])
@pytest.mark.parametrize("same_read", [False, True])
async def test_a_connection_that_got_bytes_nobody_asked_for_is_not_reused(stray: bytes, same_read: bool) -> None:
    """An upstream that writes after its answer (late, or in the same packet): a partial stray would
    make the next request on that connection wait for its rest; a whole one would be read as the
    next request's answer. Either way the connection is dropped and the next request gets a new one."""
    connections = 0
    second = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        n = connections
        try:
            while True:
                await read_request(reader)
                answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\nfrom %d" % (len(b"from %d" % n), n)
                writer.write(answer + stray if same_read else answer)
                await writer.drain()
                if not same_read:
                    await asyncio.sleep(0.05)
                    writer.write(stray)
                    await writer.drain()
                second.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/x"
    try:
        async with httpx.AsyncClient(transport=LeanTransport(), timeout=3) as client:
            assert (await client.post(url, content=b"1")).text == "from 1"
            await asyncio.wait_for(second.wait(), 3)
            await asyncio.sleep(0.1)  # the stray bytes have arrived
            t0 = asyncio.get_running_loop().time()
            assert (await client.post(url, content=b"2")).text == "from 2"  # a new connection, at once
            assert asyncio.get_running_loop().time() - t0 < 1.0
    finally:
        srv.close()
    assert connections == 2


def _bomb(size: int, *, wbits: int) -> bytes:
    """`size` zero bytes compressed (about a thousandth of that on the wire)."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    piece = bytes(1024 * 1024)
    return b"".join(packer.compress(piece) for _ in range(size // len(piece))) + packer.flush()


async def _stream_all(url: str, **cfg: object) -> list[object]:
    from appserver.config import ProviderConfig
    from appserver.providers.base import ChatMessage, ProviderRequest
    from appserver.providers.openai_compat import OpenAICompatProvider

    provider = OpenAICompatProvider(
        ProviderConfig("up", kind="openai", base_url=url + "/v1", api_key_env=None, max_attempts=1, **cfg)  # type: ignore[arg-type]
    )
    try:
        return [c async for c in provider.stream(ProviderRequest(model="m", messages=[ChatMessage("user", "hi")]))]
    finally:
        await provider.aclose()


@pytest.mark.parametrize("ctype", [b"application/json", b"text/event-stream"])
async def test_a_compressed_bomb_fails_the_call_without_filling_memory(ctype: bytes) -> None:
    """64 MB of zeros in 64 KB of gzip, as a JSON answer or an SSE line that never ends: the call
    fails as a protocol error once the decoded answer passes `answer_max_bytes`, and the server
    never held the bomb expanded (httpx's decoder expanded each network read whole)."""
    import tracemalloc

    from appserver.providers.base import ProviderError

    bomb = _bomb(64 * 1024 * 1024, wbits=31)
    raw = ScriptedServer([framed(bomb, b"content-type: " + ctype, b"content-encoding: gzip")])
    async with serving(raw) as url:
        tracemalloc.start()
        try:
            with pytest.raises(ProviderError) as failed:
                await _stream_all(url, answer_max_bytes=4 * 1024 * 1024)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert failed.value.kind == "protocol" and "larger than 4194304 bytes" in str(failed.value)
    assert peak < 24 * 1024 * 1024, f"peak {peak} bytes while reading the bomb"


async def test_an_sse_line_that_never_ends_fails_at_the_limit() -> None:
    """An uncompressed stream whose `data:` line keeps growing is cut at `answer_max_bytes` (the
    line so far counts; so do the data lines of an event that never gets its blank line)."""
    from appserver.providers.base import ProviderError

    endless = b"data: " + b"x" * (3 * 1024 * 1024)
    many_lines = b"data: " + b"y" * 1000 + b"\n"
    raw = ScriptedServer(
        [
            framed(endless, b"content-type: text/event-stream"),
            framed(many_lines * 3000, b"content-type: text/event-stream"),
        ]
    )
    async with serving(raw) as url:
        for _ in range(2):
            with pytest.raises(ProviderError) as failed:
                await _stream_all(url, answer_max_bytes=1024 * 1024)
            assert failed.value.kind == "protocol" and "larger than 1048576 bytes" in str(failed.value)


@pytest.mark.parametrize(("encoding", "wbits"), [(b"gzip", 31), (b"deflate", 15), (b"deflate", -15)])
async def test_compressed_answers_decode_in_bounded_pieces(encoding: bytes, wbits: int) -> None:
    """gzip, deflate with its zlib header and raw deflate (both are sent as `deflate`), as a stream
    and as one JSON answer, decode to what was compressed."""
    import json
    import zlib

    from appserver.providers.base import Done, Text

    def pack(data: bytes) -> bytes:
        packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
        return packer.compress(data) + packer.flush()

    text = "word " * 500_000  # 2.5 MB: more than one decoded piece
    event = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
    stream = b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(event).encode()
    whole = json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    ).encode()
    raw = ScriptedServer(
        [
            framed(pack(stream), b"content-type: text/event-stream", b"content-encoding: " + encoding),
            framed(pack(whole), b"content-type: application/json", b"content-encoding: " + encoding),
        ]
    )
    async with serving(raw) as url:
        for _ in range(2):
            chunks = await _stream_all(url)
            assert "".join(c.text for c in chunks if isinstance(c, Text)) == text
            assert chunks[-1] == Done("stop")


async def test_the_read_timeout_counts_from_each_wait_not_from_the_first() -> None:
    """One timer per connection, moved lazily: a body that trickles in, each piece well within the
    read timeout, is read whole however long it takes in all; a gap longer than it fails."""
    pieces = [b"%d\r\npart%d\r\n" % (5, i) for i in range(6)]
    trickle: Reply = lambda _body: [  # noqa: E731
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        *[x for p in pieces for x in (0.1, p)],
        b"0\r\n\r\n",
    ]
    stall: Reply = lambda _body: [  # noqa: E731
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        pieces[0],
        0.1,
        pieces[1],
        0.6,
        pieces[2],
        b"0\r\n\r\n",
    ]
    raw = ScriptedServer([trickle, stall])
    async with (
        serving(raw) as url,
        httpx.AsyncClient(transport=LeanTransport(), timeout=httpx.Timeout(5, read=0.3)) as client,
    ):
        async with client.stream("POST", url, content=b"") as r:
            body = b"".join([part async for part in r.aiter_bytes()])
        assert body == b"".join(b"part%d" % i for i in range(6))  # 0.6 s in all, twice the timeout
        got: list[bytes] = []
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", url, content=b"") as r:
                async for part in r.aiter_bytes():
                    got.append(part)
        assert b"".join(got) == b"part0part1"
