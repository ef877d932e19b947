"""Retry policy as a pure function, table-driven (issue 7 check 5)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from appserver.config import ProviderConfig
from appserver.providers.base import (
    ChatMessage,
    Done,
    ProviderChunk,
    ProviderError,
    ProviderRequest,
    Text,
    error_from_status,
)
from appserver.providers.openai_compat import OpenAICompatProvider
from appserver.providers.retry import RetryPolicy, parse_retry_after, retry_delay_ms
from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_error, openai_sse

POLICY = RetryPolicy(max_attempts=4, base_ms=500, cap_ms=20_000, max_retry_after_ms=60_000)


# (status, error body, kind, retries?)
STATUS_TABLE: list[tuple[int, Any, str, bool]] = [
    (400, openai_error("Invalid 'messages'"), "invalid_request", False),
    (
        400,
        openai_error("maximum context length is 8192 tokens", code="context_length_exceeded"),
        "context_overflow",
        False,
    ),
    (401, openai_error("Incorrect API key", code="invalid_api_key"), "auth", False),
    (403, openai_error("Project does not have access"), "auth", False),
    (403, openai_error("quota", code="insufficient_quota"), "quota", False),
    (404, openai_error("model not found"), "not_found", False),
    (408, "request timeout", "server", True),
    (409, openai_error("conflict"), "server", True),
    (413, "payload too large", "invalid_request", False),
    (422, {"detail": "unprocessable"}, "invalid_request", False),
    (429, openai_error("Rate limit reached for requests"), "rate_limit", True),
    (
        429,
        openai_error("You exceeded your current quota", code="insufficient_quota"),
        "quota",
        False,
    ),
    (500, openai_error("server error"), "server", True),
    (502, "bad gateway", "server", True),
    (503, "unavailable", "server", True),
    (504, "gateway timeout", "server", True),
    (
        529,
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        "server",
        True,
    ),
]


@pytest.mark.parametrize(("status", "body", "kind", "retries"), STATUS_TABLE)
def test_status_classes(status: int, body: Any, kind: str, retries: bool) -> None:
    err = error_from_status(status, str(body), body=body)
    assert err.kind == kind
    delay = retry_delay_ms(err, 1, POLICY)
    assert (delay is not None) == retries
    assert err.to_dict() == {
        "kind": kind,
        "status": status,
        "retryable": retries,
        "message": str(body),
    }


@pytest.mark.parametrize(
    ("kind", "retries"),
    [
        ("network", True),
        ("timeout", True),
        ("rate_limit", True),
        ("server", True),
        ("quota", False),
        ("auth", False),
        ("not_found", False),
        ("invalid_request", False),
        ("context_overflow", False),
        ("protocol", False),
    ],
)
def test_error_kinds(kind: str, retries: bool) -> None:
    err = ProviderError(kind, "x")  # type: ignore[arg-type]
    assert (retry_delay_ms(err, 1, POLICY) is not None) == retries


def test_capped_exponential_backoff_and_attempt_limit() -> None:
    err = ProviderError("server", "boom", status=500)
    assert [retry_delay_ms(err, a, POLICY) for a in (1, 2, 3, 4)] == [500, 1000, 2000, None]
    long = RetryPolicy(max_attempts=20, base_ms=500, cap_ms=5_000)
    assert [retry_delay_ms(err, a, long) for a in range(1, 8)] == [
        500,
        1000,
        2000,
        4000,
        5000,
        5000,
        5000,
    ]


def test_retry_after_is_honoured_and_capped() -> None:
    assert retry_delay_ms(ProviderError("rate_limit", "x", status=429, retry_after_s=1), 1, POLICY) == 1000
    assert retry_delay_ms(ProviderError("rate_limit", "x", retry_after_s=0.25), 3, POLICY) == 250
    assert retry_delay_ms(ProviderError("rate_limit", "x", retry_after_s=60), 1, POLICY) == 60_000
    # Longer than the policy waits: given up at once (see tests/test_retry_after_beyond_cap.py).
    far = ProviderError("rate_limit", "x", retry_after_s=3600)
    assert retry_delay_ms(far, 1, POLICY) is None and "3600 s" in far.message
    # Retry-After never makes a non-retryable error retryable.
    assert retry_delay_ms(ProviderError("auth", "x", status=401, retry_after_s=1), 1, POLICY) is None


def test_nothing_retries_after_output_reached_a_client() -> None:
    for kind in ("network", "timeout", "rate_limit", "server"):
        err = ProviderError(kind, "x", retry_after_s=1)  # type: ignore[arg-type]
        assert retry_delay_ms(err, 1, POLICY, output_shown=True) is None


def test_retry_delay_is_pure() -> None:
    err = ProviderError("server", "x", status=503)
    assert {retry_delay_ms(err, 2, POLICY) for _ in range(50)} == {1000}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "1"}, 1.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": "-3"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "bogus", "retry-after": "9"}, 9.0),
        ({"retry-after": "nan"}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers) == expected


def test_parse_retry_after_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after({"retry-after": later}, now=now.timestamp()) == pytest.approx(30)
    earlier = format_datetime(now - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after({"retry-after": earlier}, now=now.timestamp()) == 0.0


# ---------------------------------------------------------------- against the fake upstream


async def stream_with_retries(
    provider: OpenAICompatProvider, request: ProviderRequest, policy: RetryPolicy
) -> AsyncIterator[tuple[int, ProviderChunk]]:
    """What the agent loop does: retry per policy until output was shown."""
    import asyncio

    attempt = 1
    while True:
        shown = False
        try:
            async for c in provider.stream(request):
                shown = shown or isinstance(c, Text)
                yield attempt, c
            return
        except ProviderError as err:
            delay = retry_delay_ms(err, attempt, policy, output_shown=shown)
            if delay is None:
                raise
            await asyncio.sleep(delay / 1000)
            attempt += 1


def _req() -> ProviderRequest:
    return ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])


async def test_429_with_retry_after_one_second_waits_about_a_second() -> None:
    with FakeOpenAI() as fake:
        fake.fail(429, openai_error("Rate limit reached", type="requests"), headers={"Retry-After": "1"})
        fake.script(openai_sse([chunk(content="ok"), chunk(finish_reason="stop")]))
        provider = OpenAICompatProvider(ProviderConfig(name="f", base_url=fake.base_url, api_key_env=None))
        start = time.monotonic()
        got = [x async for x in stream_with_retries(provider, _req(), POLICY)]
        elapsed = time.monotonic() - start
        await provider.aclose()
    assert [c for _, c in got] == [Text("ok"), Done("stop")]
    assert {a for a, _ in got} == {2}
    assert 0.9 <= elapsed < 2.5
    assert len(fake.requests) == 2


async def test_401_fails_at_once_with_a_readable_auth_error() -> None:
    with FakeOpenAI() as fake:
        fake.fail(401, openai_error("Incorrect API key provided: sk-xx", code="invalid_api_key"))
        fake.script(openai_sse([chunk(content="never")]))
        provider = OpenAICompatProvider(ProviderConfig(name="f", base_url=fake.base_url, api_key_env=None))
        start = time.monotonic()
        with pytest.raises(ProviderError) as info:
            [x async for x in stream_with_retries(provider, _req(), POLICY)]
        await provider.aclose()
        assert time.monotonic() - start < 0.5
        assert len(fake.requests) == 1
    assert info.value.to_dict() == {
        "kind": "auth",
        "status": 401,
        "retryable": False,
        "message": "Incorrect API key provided: sk-xx",
    }


async def test_no_retry_after_text_was_shown() -> None:
    with FakeOpenAI() as fake:
        body = openai_sse([chunk(content="partial answer "), chunk(content="more")])
        fake.script(body, chunk_size=len(body) // 2 + 1, drop_after=len(body) // 2 + 1)
        provider = OpenAICompatProvider(ProviderConfig(name="f", base_url=fake.base_url, api_key_env=None))
        with pytest.raises(ProviderError) as info:
            [x async for x in stream_with_retries(provider, _req(), POLICY)]
        await provider.aclose()
        assert info.value.kind == "network" and len(fake.requests) == 1
