"""An environment proxy entry httpx cannot build breaks only the calls it covers, and those clearly.

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

import importlib.util
from collections.abc import AsyncIterator, Iterator

import pytest

from appserver.providers.base import ProviderError
from appserver.providers.fasttransport import LeanClient
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.fakes.openai_upstream import FakeOpenAI
from tests.test_providers_s33g import ANSWER, PROXY_VARS, CountingProxy, call, provider_for

HAS_SOCKSIO = importlib.util.find_spec("socksio") is not None
DEAD = "127.0.0.1:9"  # nothing is reached there: every call below either goes elsewhere or fails first


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
        ("HTTP_PROXY", "ftp://alice:s3cret@127.0.0.1:9", "Unknown scheme"),
        ("http_proxy", "http://alice:s3cret@h:notaport", "Invalid port"),
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
