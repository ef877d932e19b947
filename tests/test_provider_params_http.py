"""Per-agent provider parameters (CLI, request overrides) and provider errors over HTTP (issue 7)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_error, openai_sse, usage_chunk
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(60)


def ok_reply(text: str = "fine") -> bytes:
    return openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop"), usage_chunk(5, 1)])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeOpenAI, ServeProcess, openai.OpenAI]]:
    with FakeOpenAI() as fake:
        home = tmp_path_factory.mktemp("params") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 2\n'
        )
        env = cli_env(home, APPSERVER_LIMITS__RETRY_BASE_MS="5")
        r = run_cli(
            home,
            "agents",
            "create",
            "--name",
            "remote",
            "--model",
            "fake:m",
            "--param",
            "temperature=0.3",
            "--param",
            "max_tokens=50",
            "--json",
            env=env,
        )
        assert r.code == 0, r.err
        assert r.json()["params"] == {"temperature": 0.3, "max_tokens": 50}
        sp = start_serve(home, env=env)
        try:
            # The SDK's default retries stay on: the server must tell it not to repeat a failed turn.
            yield fake, sp, openai.OpenAI(base_url=sp.url + "/v1", api_key="unused")
        finally:
            sp.stop()


@pytest.fixture
def setup(served: tuple[FakeOpenAI, ServeProcess, openai.OpenAI]) -> tuple[FakeOpenAI, ServeProcess, openai.OpenAI]:
    fake = served[0]
    fake.requests.clear()
    fake._replies.clear()
    return served


def test_agent_params_reach_the_provider_and_requests_override_only_when_allowed(setup) -> None:  # type: ignore[no-untyped-def]
    fake, sp, client = setup
    fake.script(ok_reply())
    client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}])
    body = fake.requests[-1].json
    assert body["temperature"] == 0.3 and body["max_tokens"] == 50
    fake.script(ok_reply())
    client.chat.completions.create(
        model="remote", messages=[{"role": "user", "content": "hi"}], temperature=0.9, max_tokens=20
    )
    body = fake.requests[-1].json
    assert body["temperature"] == 0.9 and body["max_tokens"] == 20
    r = run_cli(
        sp.home, "agents", "update", "remote", "--param", "allow_overrides=false", "--json", env=cli_env(sp.home)
    )
    assert r.code == 0, r.err
    fake.script(ok_reply())
    client.chat.completions.create(
        model="remote", messages=[{"role": "user", "content": "hi"}], temperature=0.9, max_tokens=20
    )
    body = fake.requests[-1].json
    assert body["temperature"] == 0.3 and body["max_tokens"] == 50


@pytest.mark.parametrize(
    ("upstream_status", "upstream_body", "status", "code", "upstream_requests"),
    [
        (
            401,
            openai_error("Incorrect API key provided", type="invalid_request_error", code="invalid_api_key"),
            502,
            "upstream_auth_failed",
            1,
        ),
        (
            429,
            openai_error("Rate limit reached", type="requests", code="rate_limit_exceeded"),
            429,
            "upstream_rate_limited",
            2,
        ),
        (
            429,
            openai_error("You exceeded your current quota", type="insufficient_quota", code="insufficient_quota"),
            429,
            "insufficient_quota",
            1,
        ),
        (
            400,
            openai_error("This model's maximum context length is 10 tokens", code="context_length_exceeded"),
            400,
            "context_length_exceeded",
            1,  # a retry with a smaller budget would send the same single message: not sent (s21)
        ),
        (503, openai_error("overloaded", type="server_error"), 502, "upstream_server_error", 2),
    ],
)
def test_provider_errors_reach_the_client_as_openai_errors_and_are_not_retried_by_it(
    setup, upstream_status, upstream_body, status, code, upstream_requests
) -> None:  # type: ignore[no-untyped-def]
    fake, sp, client = setup
    for _ in range(4):
        fake.fail(upstream_status, upstream_body, headers={"Retry-After": "0"})
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}])
    err = info.value
    assert err.status_code == status
    assert err.body["code"] == code, err.body  # type: ignore[index]
    assert err.response.headers["x-should-retry"] == "false"
    assert len(fake.requests) == upstream_requests  # our own retry policy ran; the SDK did not add more
    # The non-stream Responses route answers with the same HTTP error (issue 13.5).
    fake._replies.clear()
    fake.fail(upstream_status, upstream_body, headers={"Retry-After": "0"})
    fake.fail(upstream_status, upstream_body, headers={"Retry-After": "0"})
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(model="remote", input="hi")
    assert info.value.status_code == status and info.value.body["code"] == code  # type: ignore[index]


def test_bad_params_are_refused_and_nothing_is_written(cli) -> None:  # type: ignore[no-untyped-def]
    for bad, words in (
        ("temperature=9", "between 0 and 2"),
        ("temperature=hot", "a number"),
        ("bogus=1", "KEY one of"),
        ("reasoning_effort=max", "use minimal"),
        ("context_window=100", "between 512"),
    ):
        r = cli("agents", "create", "--name", "p", "--param", bad)
        assert r.code != 0 and words in r.err, (bad, r.err)
    assert "p " not in cli("agents", "list").out
    r = cli("agents", "create", "--name", "p", "--param", "temperature=0.5", "--param", "reasoning=hidden", "--json")
    assert r.code == 0 and r.json()["params"] == {"temperature": 0.5, "reasoning": "hidden"}
    r = cli("agents", "update", "p", "--param", "temperature=", "--json")
    assert r.code == 0 and r.json()["params"] == {"reasoning": "hidden"}
    assert "params: reasoning=hidden" in cli("agents", "show", "p").out
