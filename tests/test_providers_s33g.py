"""The default `lean` provider transport honours the environment's proxies as httpx does.

httpx reads HTTP_PROXY / HTTPS_PROXY / ALL_PROXY only for a client given no transport of its own,
so the lean client called the model directly, API key included, around a proxy the deployment set
(docs/configuration.md promises "env proxies still go through httpx"). Here a real provider call
(in-process, real sockets) goes to tests/fakes/openai_upstream.py with HTTP_PROXY pointing at a
small loopback forwarding proxy that counts what it is asked to forward: a call goes through it,
a NO_PROXY naming the upstream bypasses it (on the lean path), and an `https` upstream reached
through it (a CONNECT tunnel) has its certificate verified as httpx verifies one.

An environment proxy entry httpx cannot build breaks only the calls it covers, and those clearly.

The lean transport built httpx's proxy transport for every environment proxy, and a pattern for
every NO_PROXY entry, when a provider's client was made: one entry httpx cannot build (a SOCKS
proxy without socksio, `NO_PROXY=[::1]`, `HTTP_PROXY=ftp://…`) made every model call of every
provider fail with an ImportError or InvalidURL (a 500 internal_error and a traceback), even for
an upstream that entry does not cover or NO_PROXY exempts. Here real provider calls (in-process,
real sockets) go to tests/fakes/openai_upstream.py: a call the bad entry does not cover succeeds
(through the proxy that does apply, or direct on the lean path), and a call an unusable proxy
covers fails as a provider error naming the variable, its password masked.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from appserver.config import ProviderConfig
from appserver.providers.base import ChatMessage, Done, ProviderError, ProviderRequest, Text
from appserver.providers.fasttransport import LeanClient
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_sse
from tests.support.certs import self_signed

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD")
WAIT_S = 10.0
HAS_SOCKSIO = importlib.util.find_spec("socksio") is not None
DEAD = "127.0.0.1:9"  # nothing is reached there: every call below either goes elsewhere or fails first
ANSWER = openai_sse([chunk(role="assistant", content="pong"), chunk(finish_reason="stop")])


class CountingProxy:
    """An HTTP forward proxy on loopback: an absolute-form request is sent on in origin form, a
    CONNECT is tunnelled; `seen` holds each request line it was asked to forward."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await asyncio.wait_for(self.server.wait_closed(), WAIT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                line, rest = head.split(b"\r\n", 1)
                method, target, version = line.decode("ascii").split(" ")
                self.seen.append(f"{method} {target}")
                if method == "CONNECT":
                    host, port = target.rsplit(":", 1)
                    up_reader, up_writer = await asyncio.open_connection(host, int(port))
                    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                else:
                    scheme_host, _, path = target.partition("://")[2].partition("/")
                    host, port = scheme_host.rsplit(":", 1)
                    up_reader, up_writer = await asyncio.open_connection(host, int(port))
                    up_writer.write(f"{method} /{path} {version}\r\n".encode("ascii") + rest)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()


@pytest.fixture(autouse=True)
def no_env_proxies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Only the proxy variables a test sets (either case: urllib reads both)."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    yield


@pytest.fixture
async def proxy() -> AsyncIterator[CountingProxy]:
    p = CountingProxy()
    await p.start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as f:
        yield f


def provider_for(base_url: str, transport: str = "lean") -> OpenAICompatProvider:
    return OpenAICompatProvider(
        ProviderConfig(name="fake", kind="openai", base_url=base_url, api_key_env=None, transport=transport)
    )


async def call(provider: OpenAICompatProvider) -> str:
    """One real model call; its text."""
    request = ProviderRequest(model="fake-model", messages=[ChatMessage("user", "ping")])
    try:
        async with asyncio.timeout(WAIT_S):
            got = [c async for c in provider.stream(request)]
    finally:
        await provider.aclose()
    assert isinstance(got[-1], Done)
    return "".join(c.text for c in got if isinstance(c, Text))


@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_a_model_call_goes_through_the_env_proxy(
    transport: str, fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    fake.script(ANSWER)
    assert await call(provider_for(fake.base_url, transport)) == "pong"
    assert proxy.seen == [f"POST {fake.base_url}/chat/completions"]


async def test_all_proxy_covers_the_call_too(
    fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALL_PROXY", proxy.url)
    fake.script(ANSWER)
    assert await call(provider_for(fake.base_url)) == "pong"
    assert proxy.seen == [f"POST {fake.base_url}/chat/completions"]


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "localhost,127.0.0.1", "*"])
async def test_no_proxy_naming_the_upstream_keeps_the_lean_path(
    no_proxy: str, fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", no_proxy)
    fake.script(ANSWER)
    provider = provider_for(fake.base_url)
    client = provider._client()
    assert isinstance(client, LeanClient) and client._route(provider.url, provider.build_headers()) is not None
    assert await call(provider) == "pong"
    assert proxy.seen == []


async def test_an_other_host_in_no_proxy_does_not_bypass_it(
    fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "example.com,127.0.0.2")
    fake.script(ANSWER)
    assert await call(provider_for(fake.base_url)) == "pong"
    assert len(proxy.seen) == 1


async def _tls_upstream(tmp_path: Path) -> tuple[asyncio.Server, Path]:
    """A minimal https upstream with a self-signed certificate: one SSE answer per request."""
    cert, key = self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                fields = (line.partition(b":") for line in head.split(b"\r\n"))
                length = next(int(v) for n, _, v in fields if n.lower() == b"content-length")
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client refused the certificate
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    return server, cert


async def test_an_https_upstream_through_the_proxy_is_verified(
    tmp_path: Path, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert = await _tls_upstream(tmp_path)
    base_url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        with pytest.raises(ProviderError) as refused:
            await call(provider_for(base_url))
        assert refused.value.kind == "network" and "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
        assert proxy.seen == [f"CONNECT {base_url[8:-3]}"]

        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted as httpx trusts one
        assert await call(provider_for(base_url)) == "pong"
        assert proxy.seen == [f"CONNECT {base_url[8:-3]}"] * 2
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT_S)


def lean_route_of(provider: OpenAICompatProvider) -> object:
    client = provider._client()
    assert isinstance(client, LeanClient)
    return client._route(provider.url, provider.build_headers())


@pytest.mark.parametrize(
    "env",
    [
        {"ALL_PROXY": f"socks5://{DEAD}", "NO_PROXY": "127.0.0.1"},
        {"HTTPS_PROXY": f"socks5h://{DEAD}"},  # covers https only: the upstream is http
        {"HTTPS_PROXY": f"ftp://{DEAD}"},
        {"HTTP_PROXY": f"ftp://{DEAD}", "NO_PROXY": "127.0.0.1"},
        {"HTTP_PROXY": "http://h:notaport", "NO_PROXY": "localhost,127.0.0.1"},
    ],
)
async def test_an_unusable_proxy_that_does_not_cover_the_upstream_is_no_error(
    env: dict[str, str], fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fake.script(ANSWER)
    provider = provider_for(fake.base_url)
    assert lean_route_of(provider) is not None  # direct, on the lean path
    assert await call(provider) == "pong"


@pytest.mark.parametrize("no_proxy", ["[::1]", "[::1]:8080", "é.com", "example.com,[::1],é.com"])
async def test_a_no_proxy_entry_httpx_cannot_read_leaves_the_proxy_that_applies(
    no_proxy: str, fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", no_proxy)
    fake.script(ANSWER)
    assert await call(provider_for(fake.base_url)) == "pong"
    assert proxy.seen == [f"POST {fake.base_url}/chat/completions"]


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        pytest.param(
            "ALL_PROXY",
            "socks5://alice:s3cret@127.0.0.1:9",
            "socksio",
            marks=pytest.mark.skipif(HAS_SOCKSIO, reason="socksio is installed: the SOCKS proxy can be built"),
        ),
        ("HTTP_PROXY", "ftp://alice:s3cret@127.0.0.1:9", "its scheme must be http, https, socks5 or socks5h"),
        ("http_proxy", "http://alice:s3cret@h:notaport", "its host or port"),
    ],
)
async def test_an_unusable_proxy_that_covers_the_upstream_is_a_provider_error_naming_it(
    name: str, value: str, why: str, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    monkeypatch.setenv("NO_PROXY", "example.com")  # another host: the upstream stays covered
    with pytest.raises(ProviderError) as failed:
        await call(provider_for(fake.base_url))
    said = str(failed.value)
    assert failed.value.kind == "network"
    assert f"the proxy {name} names" in said and why in said
    assert "alice" in said and "s3cret" not in said


@pytest.mark.parametrize(
    "value",
    [
        f"ftp://TOKENX@{DEAD}",  # httpx's message quoted the URL, a one-word user part whole
        "http://alice:SECRET/PW@127.0.0.1:9",  # httpx took the password's head for the port and quoted it
        f"socks4://TOKENX@{DEAD}",
    ],
)
@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_an_unusable_proxy_is_refused_without_quoting_its_secret(
    value: str, transport: str, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", value)
    with pytest.raises(ProviderError) as failed:  # (httpx's own transport: a ValueError, a 500)
        await call(provider_for(fake.base_url, transport))
    assert failed.value.kind == "network"
    assert "TOKENX" not in str(failed.value) and "SECRET" not in str(failed.value), str(failed.value)


async def test_a_base_url_with_a_long_fragment_is_routed_as_the_url_called(
    fake: FakeOpenAI, proxy: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fragment is never sent, and the route is the called URL's (httpx could not read the
    whole base_url, over 64 KiB, and the lean client then called the upstream direct)."""
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    fake.script(ANSWER)
    assert await call(provider_for(fake.base_url + "#" + "a" * 70_000)) == "pong"
    assert proxy.seen == [f"POST {fake.base_url}/chat/completions"]
