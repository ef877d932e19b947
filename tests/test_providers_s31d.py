"""Session 31, fix helper D: two ways an upstream stream's end was misread.

1. A 200 stream whose error came in a flat shape (vLLM's `{"object": "error", "message", "type",
   "code": 400}`, FastChat's `{"text", "error_code": 50002}`), then `[DONE]`, was a finished
   answer: empty, or the text before the error, finish_reason stop. A body that was only
   `data: [DONE]` was an empty completed answer too. Now the flat error is classified from its
   code as the `{"error": {...}}` shape is, and `[DONE]` after no choice at all is a protocol
   error; an empty answer that has its finish reason, usage-only and empty-choices metadata
   chunks, and comments are read as before.
2. An answer whose finish reason (`finish_reason`; Anthropic `stop_reason`) came but not its end
   (`[DONE]`; `message_stop`), on a body the upstream then held open, failed at `timeout_s` as
   `upstream_timeout`, though the same answer followed by a close was accepted. Now a body quiet
   for a short grace after the finish reason ends as a closed one would.

The provider classes (both transports) against the loopback fake upstreams; one check of each
through a real `appserver serve` and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider
from appserver.providers.base import ChatMessage, Done, ProviderChunk, ProviderError, ProviderRequest, Text, Usage
from appserver.providers.openai_compat import OpenAICompatProvider
from tests.fakes.anthropic_upstream import FakeAnthropic, anthropic_sse, message_delta, message_start, text_block
from tests.fakes.openai_upstream import FakeOpenAI, FakeUpstream, chunk, openai_sse, usage_chunk
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)

HOLD_S = 60.0  # how long the fake holds a body open: longer than any test waits
TRANSPORTS = ("lean", "httpx")

VLLM_OVERFLOW = {
    "object": "error",
    "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
VLLM_OOM = {
    "object": "error",
    "message": "CUDA out of memory",
    "type": "InternalServerError",
    "param": None,
    "code": 500,
}


def openai_cfg(fake: FakeUpstream, transport: str = "lean", timeout_s: float = 2.0) -> ProviderConfig:
    return ProviderConfig(
        name="oa", kind="openai", base_url=fake.base_url, api_key_env=None, transport=transport, timeout_s=timeout_s
    )


def req() -> ProviderRequest:
    return ProviderRequest(model="m", messages=[ChatMessage("user", "hi")])


async def openai_run(fake: FakeOpenAI, transport: str = "lean", timeout_s: float = 2.0) -> list[ProviderChunk]:
    """What the provider yields; a ProviderError is returned as the last item, not raised."""
    provider = OpenAICompatProvider(openai_cfg(fake, transport, timeout_s))
    got: list[Any] = []
    try:
        async for c in provider.stream(req()):
            got.append(c)
    except ProviderError as exc:
        got.append(exc)
    finally:
        await provider.aclose()
    return got


def text_of(got: list[Any]) -> str:
    return "".join(c.text for c in got if isinstance(c, Text))


async def wait_hold_end(fake: FakeUpstream, timeout: float = 10) -> list[str]:
    """How the fake's hold ended (the loop keeps running meanwhile: a socket closes on it)."""
    deadline = time.monotonic() + timeout
    while not fake.holds and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return list(fake.holds)


@pytest.fixture
def oa() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def an() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


# ---------------------------------------------------------------- 1. flat errors, [DONE] alone


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_flat_vllm_error_then_done_is_the_error_it_says(oa: FakeOpenAI, transport: str) -> None:
    oa.script(openai_sse([VLLM_OVERFLOW]))
    got = await openai_run(oa, transport)
    err = got[-1]
    assert isinstance(err, ProviderError), got
    assert (err.kind, err.status) == ("context_overflow", 400)
    assert "maximum context length is 4096" in err.message
    assert not any(isinstance(c, Done) for c in got)


async def test_text_before_a_flat_error_is_no_finished_answer(oa: FakeOpenAI) -> None:
    oa.script(openai_sse([chunk(role="assistant", content="partial v"), VLLM_OOM]))
    got = await openai_run(oa)
    assert text_of(got) == "partial v"  # shown so far, then the failure
    err = got[-1]
    assert isinstance(err, ProviderError), got
    assert (err.kind, err.status, err.message) == ("server", 500, "CUDA out of memory")


@pytest.mark.parametrize(
    ("error_code", "kind", "status"),
    [(50002, "server", 500), (42901, "rate_limit", 429), (40301, "auth", 403)],
)
async def test_a_fastchat_error_chunk_is_classified_from_its_code(
    oa: FakeOpenAI, error_code: int, kind: str, status: int
) -> None:
    oa.script(openai_sse([{"text": "NETWORK ERROR DUE TO HIGH TRAFFIC.", "error_code": error_code}]))
    got = await openai_run(oa)
    err = got[-1]
    assert isinstance(err, ProviderError), got
    assert (err.kind, err.status, err.message) == (kind, status, "NETWORK ERROR DUE TO HIGH TRAFFIC.")


async def test_a_flat_error_answered_as_one_json_object_is_the_error(oa: FakeOpenAI) -> None:
    oa.script(json.dumps(VLLM_OOM), content_type="application/json")
    got = await openai_run(oa)
    err = got[-1]
    assert isinstance(err, ProviderError), got
    assert (err.kind, err.status) == ("server", 500)


@pytest.mark.parametrize(
    "body",
    [b"data: [DONE]\n\n", openai_sse([usage_chunk(3, 0)]), openai_sse([{"choices": [], "prompt_filter_results": []}])],
    ids=["done-only", "usage-only", "metadata-only"],
)
async def test_done_after_no_choice_is_a_protocol_error(oa: FakeOpenAI, body: bytes) -> None:
    oa.script(body)
    got = await openai_run(oa)
    err = got[-1]
    assert isinstance(err, ProviderError), got
    assert err.kind == "protocol"
    assert "no choice" in err.message


async def test_legitimate_streams_without_error_still_answer(oa: FakeOpenAI) -> None:
    # an empty answer that says it finished
    oa.script(openai_sse([chunk(role="assistant", content=""), chunk(finish_reason="stop")]))
    got = await openai_run(oa)
    assert got[-1] == Done("stop") and text_of(got) == ""
    # Azure's empty-choices first chunk, OpenRouter's comments, usage in a trailing chunk
    azure_first = {"id": "", "object": "", "choices": [], "prompt_filter_results": [{"prompt_index": 0}]}
    body = b": OPENROUTER PROCESSING\n\n" + openai_sse(
        [azure_first, chunk(content="Hello."), chunk(finish_reason="stop"), usage_chunk(5, 2)]
    )
    oa.script(body)
    got = await openai_run(oa)
    assert text_of(got) == "Hello." and got[-1] == Done("stop")
    assert Usage(input_tokens=5, output_tokens=2) in got
    # a server that ends with [DONE] and no finish reason, after a choice: as before, no error
    oa.script(openai_sse([chunk(content="No finish reason.")]))
    got = await openai_run(oa)
    assert text_of(got) == "No finish reason." and isinstance(got[-1], Done)


# ---------------------------------------------------------------- 2. a finished answer on a body held open


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_finished_openai_answer_ends_though_the_body_stays_open_without_done(
    oa: FakeOpenAI, transport: str
) -> None:
    body = openai_sse([chunk(role="assistant", content="The whole answer."), chunk(finish_reason="stop")], done=False)
    oa.script(body, hold_s=HOLD_S)
    got = await openai_run(oa, transport)  # timeout_s 2: before, ReadTimeout at 2 s
    assert not any(isinstance(c, ProviderError) for c in got), got
    assert text_of(got) == "The whole answer." and got[-1] == Done("stop")
    assert await wait_hold_end(oa) == ["client_closed"]  # the unfinished body's connection is not pooled


async def test_usage_after_the_finish_reason_is_kept_when_the_body_then_stalls(oa: FakeOpenAI) -> None:
    pieces = [
        openai_sse([chunk(content="Counted."), chunk(finish_reason="stop")], done=False),
        openai_sse([usage_chunk(7, 3)], done=False),
    ]
    oa.script(pieces, delay_s=0.3, hold_s=HOLD_S, hold_beat=b": keep-alive\n\n")
    got = await openai_run(oa)
    assert not any(isinstance(c, ProviderError) for c in got), got
    assert text_of(got) == "Counted." and got[-1] == Done("stop")
    assert Usage(input_tokens=7, output_tokens=3) in got  # comments do not extend the grace either


async def test_a_finish_reason_on_every_chunk_does_not_cut_the_answer(oa: FakeOpenAI) -> None:
    words = ["one ", "two ", "three ", "four"]
    pieces = [openai_sse([chunk(content=w, finish_reason="stop")], done=False) for w in words]
    oa.script([*pieces, b"data: [DONE]\n\n"], delay_s=0.6)  # 2.4 s in all, more than the 1 s grace
    got = await openai_run(oa)
    assert text_of(got) == "one two three four" and got[-1] == Done("stop")


async def test_the_grace_is_seconds_not_the_read_timeout(oa: FakeOpenAI) -> None:
    body = openai_sse([chunk(content="Long timeout."), chunk(finish_reason="stop")], done=False)
    oa.script(body, hold_s=HOLD_S)
    # timeout_s 60: before, the answer waited 60 s and then failed; now it ends after the grace
    got = await asyncio.wait_for(openai_run(oa, timeout_s=60.0), 30)
    assert text_of(got) == "Long timeout." and got[-1] == Done("stop")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stopped_anthropic_answer_ends_without_message_stop(an: FakeAnthropic, transport: str) -> None:
    events = [message_start(), *text_block(0, ["Claude's ", "answer."]), message_delta("end_turn")]
    an.script(anthropic_sse(events), hold_s=HOLD_S)
    cfg = ProviderConfig(
        name="an", kind="anthropic", base_url=an.base_url, api_key_env=None, transport=transport, timeout_s=2.0
    )
    provider = AnthropicProvider(cfg)
    try:
        got = [c async for c in provider.stream(req())]
    finally:
        await provider.aclose()
    assert text_of(got) == "Claude's answer." and got[-1] == Done("stop")
    assert await wait_hold_end(an) == ["client_closed"]


# ---------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeOpenAI, openai.OpenAI]]:
    with FakeOpenAI() as fake:
        home: Path = tmp_path_factory.mktemp("s31d") / "home"
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[providers.oa]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\n'
            "max_attempts = 1\ntimeout_s = 2\n"
        )
        env = cli_env(home)
        made = run_cli(home, "agents", "create", "--name", "oa", "--model", "oa:m", env=env)
        assert made.code == 0, made.err
        with serving(home, env=env) as srv:
            with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
                yield fake, client


def test_the_server_answers_a_flat_error_as_an_error_and_a_stalled_finish_as_the_answer(
    served: tuple[FakeOpenAI, openai.OpenAI],
) -> None:
    fake, client = served
    fake.script(openai_sse([VLLM_OVERFLOW]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "hi"}])
    assert "maximum context length is 4096" in str(refused.value)
    fake.script(b"data: [DONE]\n\n")
    with pytest.raises(openai.APIStatusError) as empty:
        client.responses.create(model="oa", input="hi")
    assert empty.value.status_code == 502
    body = openai_sse([chunk(content="Finished."), chunk(finish_reason="stop")], done=False)
    fake.script(body, hold_s=HOLD_S)
    answer = client.chat.completions.create(model="oa", messages=[{"role": "user", "content": "hi"}])
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Finished.", "stop")
