"""Session 28, helper W: on an `anthropic`-kind agent the Response object echoes what the Messages
API was sent (anthropic.sent_params, the rule build_body follows), through a real `appserver serve`,
the real `openai` SDK and the fake Anthropic upstream, which records each call's body.

1. With thinking on, a tool_choice that forces tool use (`required`, a function) is sent as `auto`
   (the API refuses forced tool use with thinking): the Response echoed the requested choice.
2. A request (and agent) without a token limit: the call is sent a default `max_tokens` (8192, plus
   the thinking budget with thinking on); `max_output_tokens` echoed null.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.fakes.anthropic_upstream import (
    FakeAnthropic,
    anthropic_error,
    anthropic_sse,
    messages_problem,
    text_answer,
)
from tests.fakes.openai_upstream import RecordedRequest, Reply
from tests.support.serve import ServeProcess, serving_provider

pytestmark = pytest.mark.timeout(120)

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}


def anthropic_model(req: RecordedRequest) -> Reply:
    """The fake Messages API, refusing forced tool use with thinking on as the real one does."""
    body = req.json
    problem = messages_problem(body)
    forced = (body.get("tool_choice") or {}).get("type") in ("any", "tool")
    if problem is None and forced and (body.get("thinking") or {}).get("type") == "enabled":
        problem = "Thinking may not be enabled when tool_choice forces tool use."
    if problem is not None:
        error = json.dumps(anthropic_error("invalid_request_error", problem)).encode()
        return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
    return Reply(pieces=[anthropic_sse(text_answer("anth: ok"))])


class Env:
    def __init__(self, sp: ServeProcess, anth: FakeAnthropic) -> None:
        self.sp, self.anth = sp, anth

    def sent(self, t: str) -> dict[str, Any]:
        """The body of the one upstream call that carried `t`."""
        (body,) = [r.json for r in list(self.anth.requests) if t.encode() in r.body]
        return body


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeAnthropic() as anth:
        anth.responder = anthropic_model
        home = tmp_path_factory.mktemp("s28w") / "home"
        with serving_provider(home, "anthropic", anth.base_url, {"claude": "claude-fake"}) as sp:
            yield Env(sp, anth)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:12]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "lookup"}], ids=["required", "function"])
def test_with_thinking_on_a_forced_tool_choice_is_sent_and_echoed_as_auto(
    env: Env, client: openai.OpenAI, choice: Any
) -> None:
    t = tag()
    r = client.responses.create(
        model="claude", input=f"hi {t}", tools=[LOOKUP], tool_choice=choice, reasoning={"effort": "low"}
    )
    sent = env.sent(t)
    assert r.status == "completed", r.error
    assert sent["thinking"]["type"] == "enabled" and sent["tool_choice"] == {"type": "auto"}
    assert r.tool_choice == "auto"
    assert client.responses.retrieve(r.id).tool_choice == "auto"


@pytest.mark.parametrize(
    ("choice", "upstream"),
    [("required", {"type": "any"}), ({"type": "function", "name": "lookup"}, {"type": "tool", "name": "lookup"})],
    ids=["required", "function"],
)
def test_without_thinking_a_forced_tool_choice_is_sent_and_echoed_as_asked(
    env: Env, client: openai.OpenAI, choice: Any, upstream: dict[str, Any]
) -> None:
    t = tag()
    r = client.responses.create(model="claude", input=f"hi {t}", tools=[LOOKUP], tool_choice=choice)
    assert env.sent(t)["tool_choice"] == upstream
    shown = r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump(exclude_none=True)
    assert shown == choice


@pytest.mark.parametrize(("effort", "expected"), [(None, 8192), ("high", 24576 + 8192)], ids=["plain", "thinking"])
def test_without_a_limit_max_output_tokens_echoes_the_default_sent(
    env: Env, client: openai.OpenAI, effort: str | None, expected: int
) -> None:
    t = tag()
    extra: dict[str, Any] = {"reasoning": {"effort": effort}} if effort else {}
    r = client.responses.create(model="claude", input=f"hi {t}", **extra)
    assert env.sent(t)["max_tokens"] == expected
    assert r.max_output_tokens == expected
    assert client.responses.retrieve(r.id).max_output_tokens == expected


def test_a_streamed_response_echoes_the_same(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    with client.responses.stream(
        model="claude", input=f"hi {t}", tools=[LOOKUP], tool_choice="required", reasoning={"effort": "low"}
    ) as stream:
        created = next(e for e in stream if e.type == "response.created").response
        final = stream.get_final_response()
    sent = env.sent(t)
    assert sent["tool_choice"] == {"type": "auto"} and sent["max_tokens"] == 2048 + 8192
    for r in (created, final):
        assert (r.tool_choice, r.max_output_tokens) == ("auto", 2048 + 8192)


def test_a_set_limit_is_sent_and_echoed_unchanged(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r = client.responses.create(model="claude", input=f"hi {t}", max_output_tokens=3000)
    assert env.sent(t)["max_tokens"] == 3000 and r.max_output_tokens == 3000
