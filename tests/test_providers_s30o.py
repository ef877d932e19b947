"""Session 30, fix helper O: three ways an upstream's finished answer (or ordinary refusal) was lost.

1. An answer whose upstream kept the body open after `data: [DONE]` (OpenAI kind) or after
   `message_stop` (Anthropic kind) was held until the read timeout, then failed as
   `upstream_timeout`, the stored reply marked incomplete; with `: keep-alive` comments after
   `[DONE]` it was held until the upstream closed. Now the answer ends there (as the OpenAI SDK
   reads it), and the connection whose body never ended is closed, never pooled.
2. A 429 that is an ordinary rate limit but names a quota or billing (Azure's per-minute limit,
   OpenAI's free tier, Gemini's RESOURCE_EXHAUSTED as a list body) was taken for an exhausted quota
   and failed at once as `insufficient_quota`. Now it is retried; a real `insufficient_quota` is not.
3. A legacy `function_call` answer (stream deltas or `message.function_call`) was dropped: an
   empty `stop` answer. Now it is a tool call; a `function_call`/`tool_calls` finish with nothing
   parsed is a protocol error, never an empty answer.

Real `appserver serve`, the real `openai` SDK, the loopback fake upstreams."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.anthropic_upstream import (
    MESSAGE_STOP,
    FakeAnthropic,
    anthropic_sse,
    message_delta,
    message_start,
    text_block,
)
from tests.fakes.openai_upstream import FakeOpenAI, FakeUpstream, chunk, openai_error, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HOLD_S = 60.0  # longer than any test waits: the answer must never wait for it


class Upstreams:
    def __init__(self, oa: FakeOpenAI, an: FakeAnthropic, home: Path, srv: ServeProcess) -> None:
        self.oa, self.an, self.home, self.srv = oa, an, home, srv


@pytest.fixture(scope="module")
def ups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstreams]:
    with FakeOpenAI() as oa, FakeAnthropic() as an:
        home = tmp_path_factory.mktemp("s30o") / "home"
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[providers.oa]\nkind = "openai"\nbase_url = "{oa.base_url}"\napi_key_env = ""\n'
            "max_attempts = 2\ntimeout_s = 2\n"
            f'[providers.an]\nkind = "anthropic"\nbase_url = "{an.base_url}"\napi_key_env = ""\n'
            "max_attempts = 1\ntimeout_s = 2\n"
        )
        env = cli_env(home)
        for name, model in (("oa", "oa:m"), ("an", "an:m")):
            made = run_cli(home, "agents", "create", "--name", name, "--model", model, env=env)
            assert made.code == 0, made.err
        with serving(home, env=env) as srv:
            yield Upstreams(oa, an, home, srv)


@pytest.fixture
def client(ups: Upstreams) -> Iterator[openai.OpenAI]:
    for fake in (ups.oa, ups.an):
        fake.clear()
    with openai.OpenAI(base_url=f"{ups.srv.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def stream_text(client: openai.OpenAI, model: str) -> tuple[str, str | None, str | None]:
    """(text, finish_reason, conversation id) of a streamed chat answer."""
    text, finish = "", None
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True
    ) as raw:
        conv = raw.headers.get("x-conversation-id")
        for part in raw.parse():
            for choice in part.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    return text, finish, conv


def stored_assistant(ups: Upstreams, conv: str | None) -> list[tuple[str, str]]:
    assert conv
    shown = run_cli(ups.home, "conversations", "history", conv, "--json", env=cli_env(ups.home))
    assert shown.code == 0, shown.err
    return [(m["content"], m["completion_status"]) for m in json.loads(shown.out) if m["role"] == "assistant"]


def wait_hold_end(fake: FakeUpstream, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while not fake.holds and time.monotonic() < deadline:
        time.sleep(0.02)
    return list(fake.holds)


# ---------------------------------------------------------------- 1. the answer ends at its end


def test_an_openai_answer_ends_at_done_though_the_upstream_keeps_the_body_open(
    ups: Upstreams, client: openai.OpenAI
) -> None:
    body = openai_sse([chunk(role="assistant", content="The complete answer."), chunk(finish_reason="stop")])
    ups.oa.script(body, hold_s=HOLD_S)  # [DONE], then nothing for longer than timeout_s
    text, finish, conv = stream_text(client, "oa")
    assert (text, finish) == ("The complete answer.", "stop")
    assert stored_assistant(ups, conv) == [("The complete answer.", "completed")]
    # the connection whose body never ended was closed, not pooled for the next call
    assert wait_hold_end(ups.oa) == ["client_closed"]
    ups.oa.script(openai_sse([chunk(content="next"), chunk(finish_reason="stop")]))
    assert stream_text(client, "oa")[:2] == ("next", "stop")
    assert len(ups.oa.requests) == 2  # answered, never retried


def test_keep_alive_comments_after_done_do_not_hold_the_answer(ups: Upstreams, client: openai.OpenAI) -> None:
    body = openai_sse([chunk(role="assistant", content="Done already."), chunk(finish_reason="stop")])
    ups.oa.script(body, hold_s=HOLD_S, hold_beat=b": keep-alive\n\n")
    text, finish, conv = stream_text(client, "oa")  # the SDK gives up after 30 s: the hold is 60
    assert (text, finish) == ("Done already.", "stop")
    assert stored_assistant(ups, conv) == [("Done already.", "completed")]
    assert wait_hold_end(ups.oa) == ["client_closed"]


def test_an_anthropic_answer_ends_at_message_stop_though_the_body_stays_open(
    ups: Upstreams, client: openai.OpenAI
) -> None:
    events = [message_start(), *text_block(0, ["Claude's ", "answer."]), message_delta("end_turn"), MESSAGE_STOP]
    ups.an.script(anthropic_sse(events), hold_s=HOLD_S)
    text, finish, conv = stream_text(client, "an")
    assert (text, finish) == ("Claude's answer.", "stop")
    assert stored_assistant(ups, conv) == [("Claude's answer.", "completed")]
    assert wait_hold_end(ups.an) == ["client_closed"]


# ---------------------------------------------------------------- 2. a rate limit is retried

AZURE_429 = {
    "error": {
        "code": "429",
        "message": "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-02-01 "
        "have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 1 second. "
        "Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default "
        "rate limit.",
    }
}
OPENAI_FREE_TIER_429 = openai_error(
    "Rate limit reached for default-gpt-3.5-turbo in organization org-abc on requests per min. Limit: 3 / min. "
    "Please try again in 20s. Please add a payment method to your account to increase your rate limit. "
    "Visit https://platform.openai.com/account/billing to add a payment method.",
    type="requests",
    code="rate_limit_exceeded",
)
GEMINI_429 = [  # a list, as Gemini's OpenAI-compatible endpoint sends it
    {
        "error": {
            "code": 429,
            "message": "Resource has been exhausted (e.g. check quota).",
            "status": "RESOURCE_EXHAUSTED",
        }
    }
]


@pytest.mark.parametrize(
    ("body", "headers"),
    [(AZURE_429, {"Retry-After": "0"}), (OPENAI_FREE_TIER_429, {}), (GEMINI_429, {})],
    ids=["azure", "openai-free-tier", "gemini"],
)
def test_a_rate_limit_that_names_a_quota_is_retried(
    ups: Upstreams, client: openai.OpenAI, body: Any, headers: dict[str, str]
) -> None:
    ups.oa.fail(429, body, headers=headers)
    ups.oa.script(openai_sse([chunk(content="Answer after the rate limit."), chunk(finish_reason="stop")]))
    text, finish, _ = stream_text(client, "oa")
    assert (text, finish) == ("Answer after the rate limit.", "stop")
    assert len(ups.oa.requests) == 2


def test_gemini_rate_limit_says_its_message_and_an_exhausted_quota_is_not_retried(
    ups: Upstreams, client: openai.OpenAI
) -> None:
    for _ in range(2):
        ups.oa.fail(429, GEMINI_429)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "hi"}])
    assert "Resource has been exhausted" in str(limited.value.body), limited.value.body
    assert len(ups.oa.requests) == 2  # retried once (max_attempts = 2)
    ups.oa.requests.clear()
    ups.oa.fail(
        429,
        openai_error(
            "You exceeded your current quota, please check your plan and billing details.",
            type="insufficient_quota",
            code="insufficient_quota",
        ),
    )
    with pytest.raises(openai.RateLimitError) as quota:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(quota.value.body, dict) and quota.value.body.get("code") == "insufficient_quota"
    assert len(ups.oa.requests) == 1  # never retried


# ---------------------------------------------------------------- 3. the legacy function_call


def _legacy_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _legacy_call_stream() -> bytes:
    return openai_sse(
        [
            _legacy_chunk({"role": "assistant", "content": None, "function_call": {"name": "get_weather"}}),
            _legacy_chunk({"function_call": {"arguments": '{"city": '}}),
            _legacy_chunk({"function_call": {"arguments": '"Oslo"}'}}),
            _legacy_chunk({}, "function_call"),
        ]
    )


def _legacy_call_completion() -> bytes:
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    message = {"role": "assistant", "content": None, "function_call": call}
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "function_call"}],
        }
    ).encode()


@pytest.mark.parametrize("shape", ["stream", "completion"])
def test_a_legacy_function_call_answer_is_a_tool_call(ups: Upstreams, client: openai.OpenAI, shape: str) -> None:
    if shape == "stream":
        ups.oa.script(_legacy_call_stream())
    else:
        ups.oa.script(_legacy_call_completion(), content_type="application/json")
    answer = client.chat.completions.create(
        model="oa", messages=[{"role": "user", "content": "weather in Oslo?"}], tools=[WEATHER]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id


def test_a_tool_call_finish_without_any_call_is_an_error_not_an_empty_answer(
    ups: Upstreams, client: openai.OpenAI
) -> None:
    ups.oa.script(openai_sse([chunk(role="assistant"), chunk(finish_reason="function_call")]))
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    assert failed.value.status_code == 502, failed.value
    assert "function_call" in str(failed.value.body), failed.value.body
    assert len(ups.oa.requests) == 1  # a protocol error: not retried


# ---------------------------------------------------------------- re-attack: what the narrowing missed


def test_an_account_without_active_billing_is_a_quota_error_not_retried(ups: Upstreams, client: openai.OpenAI) -> None:
    """OpenAI's `billing_not_active` (a 429) was retried as a rate limit and told the user to wait."""
    ups.oa.fail(
        429,
        openai_error(
            "Your account is not active, please check your billing details on our website.",
            type="billing_not_active",
            code="billing_not_active",
        ),
    )
    with pytest.raises(openai.RateLimitError) as quota:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(quota.value.body, dict) and quota.value.body.get("code") == "insufficient_quota"
    assert len(ups.oa.requests) == 1  # never retried


def test_anthropics_credit_balance_400_is_a_quota_error(ups: Upstreams, client: openai.OpenAI) -> None:
    """Anthropic says "credit balance is too low" with a 400: it was `upstream_invalid_request`
    ("the request's own fault")."""
    ups.an.fail(
        400,
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing.",
            },
        },
    )
    with pytest.raises(openai.APIStatusError) as quota:
        client.chat.completions.create(model="an", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(quota.value.body, dict) and quota.value.body.get("code") == "insufficient_quota", quota.value.body
    assert "credit balance is too low" in str(quota.value.body)
    assert len(ups.an.requests) == 1


def test_a_tool_finish_with_only_an_inline_think_block_is_an_error(ups: Upstreams, client: openai.OpenAI) -> None:
    """`<think>…</think>` content (Ollama, llama.cpp with R1/Qwen3) is reasoning, not an answer: a
    `tool_calls` finish with it and no call was an empty `stop` answer."""
    body = [chunk(role="assistant", content="<think>I should call the clock"), chunk(content=" tool</think>")]
    ups.oa.script(openai_sse([*body, chunk(finish_reason="tool_calls")]))
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER])
    assert failed.value.status_code == 502, failed.value
    ups.oa.script(
        openai_sse([chunk(role="assistant", content="<think>x</think>It is noon."), chunk(finish_reason="tool_calls")])
    )
    answer = client.chat.completions.create(
        model="oa", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER]
    )
    assert answer.choices[0].message.content == "It is noon."  # answer text with a tool finish stays an answer
