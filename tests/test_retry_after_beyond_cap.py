"""An upstream 429 with a Retry-After far beyond what the server waits (fix 17, item 9).

Was: `Retry-After: 3600` was capped at `max_retry_after_ms` (60 s) and retried: a non-stream request
hung four attempts × 60 s, about three minutes, then got the same error. Retrying sooner than the
upstream asked only meets the same refusal, so the server now gives up at once with the upstream's
rate-limit error, its message naming the Retry-After. A real `serve` against the fake upstream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.openai_upstream import (
    FakeOpenAI,
    RecordedRequest,
    Reply,
    chunk,
    openai_error,
    openai_sse,
    usage_chunk,
)
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FAST_S = 10.0  # far below one capped wait (60 s), far above a normal answer


def fine(req: RecordedRequest) -> Reply:
    """The fake's answer when no failure is queued."""
    return Reply(
        pieces=[openai_sse([chunk(role="assistant", content="fine"), chunk(finish_reason="stop"), usage_chunk(5, 1)])]
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    with FakeOpenAI() as fake:
        fake.responder = fine
        home = tmp_path_factory.mktemp("retry_after") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 4\n'
        )
        env = cli_env(home)
        made = run_cli(home, "agents", "create", "--name", "remote", "--model", "fake:m", "--json", env=env)
        assert made.code == 0, made.err
        with serving(home, env=env) as sp:
            yield sp, fake


def test_a_retry_after_beyond_the_cap_fails_at_once_naming_it(srv: tuple[ServeProcess, FakeOpenAI]) -> None:
    sp, fake = srv
    before = len(fake.requests)
    # one refusal: a retry (after a capped wait) would get the fake's default answer, a 200
    fake.fail(429, openai_error("Rate limit reached", type="rate_limit_error"), headers={"Retry-After": "3600"})
    started = time.monotonic()
    with httpx.Client(base_url=sp.url, timeout=FAST_S + 5) as http:
        r = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "x"}]})
    took = time.monotonic() - started
    assert took < FAST_S, f"the request waited {took:.1f} s for an upstream that asked for an hour"
    assert r.status_code == 429, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert "Rate limit reached" in message and "3600 s" in message and "Retry-After" in message, message
    assert len(fake.requests) - before == 1  # not retried


def test_a_retry_after_within_the_cap_is_still_waited_and_retried(srv: tuple[ServeProcess, FakeOpenAI]) -> None:
    sp, fake = srv
    before = len(fake.requests)
    fake.fail(429, openai_error("Rate limit reached", type="rate_limit_error"), headers={"Retry-After": "1"})
    started = time.monotonic()
    with httpx.Client(base_url=sp.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "y"}]})
    took = time.monotonic() - started
    assert r.status_code == 200, (r.status_code, r.text)
    assert len(fake.requests) - before == 2 and took >= 0.9, took  # waited as asked, then answered
