"""Session 29: an `allowed_tools` tool_choice is enforced on every provider. It used to reach the
upstream as is: an OpenAI-compatible server passed it on (most of them, and Anthropic's API, know
no such choice), and the anthropic provider sent no tool_choice and every tool — the model could
call a tool the request ruled out, while the Response echoed the choice as honoured. Now the call
offers only the listed tools, with `auto` or `required` (one tool: that function); with thinking on
(Anthropic refuses forced tool use) a `required` one goes as `auto` over the listed tools, and the
Response echoes that mode. Real `appserver serve`, the real `openai` SDK, the fake Anthropic
upstream recording each call's body."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.fakes.anthropic_upstream import FakeAnthropic, anthropic_sse, text_answer
from tests.fakes.openai_upstream import RecordedRequest, Reply
from tests.support.serve import ServeProcess, serving_provider

pytestmark = pytest.mark.timeout(120)


def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


def chat_fn(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


class Env:
    def __init__(self, sp: ServeProcess, anth: FakeAnthropic) -> None:
        self.sp, self.anth = sp, anth

    def sent(self, t: str) -> dict[str, Any]:
        (body,) = [r.json for r in list(self.anth.requests) if t.encode() in r.body]
        return body


def answer(req: RecordedRequest) -> Reply:
    return Reply(pieces=[anthropic_sse(text_answer("anth: ok"))])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeAnthropic() as anth:
        anth.responder = answer
        home = tmp_path_factory.mktemp("s29a") / "home"
        with serving_provider(home, "anthropic", anth.base_url, {"claude": "claude-fake"}) as sp:
            yield Env(sp, anth)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:12]


def offered(body: dict[str, Any]) -> list[str]:
    return sorted(t["name"] for t in body.get("tools", []))


@pytest.mark.parametrize(
    ("mode", "listed", "upstream"),
    [
        ("auto", ["a", "b"], {"type": "auto"}),
        ("required", ["a", "b"], {"type": "any"}),
        ("required", ["b"], {"type": "tool", "name": "b"}),
    ],
    ids=["auto", "required", "required-one"],
)
def test_responses_allowed_tools_offers_only_the_listed_tools(
    env: Env, client: openai.OpenAI, mode: str, listed: list[str], upstream: dict[str, Any]
) -> None:
    t = tag()
    choice = {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": n} for n in listed]}
    r = client.responses.create(
        model="claude",
        input=f"hi {t}",
        tools=[fn("a"), fn("b"), fn("c")],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
    )
    assert r.status == "completed", r.error
    sent = env.sent(t)
    assert offered(sent) == listed  # before: a, b, c and no tool_choice at all
    assert sent["tool_choice"] == upstream
    assert r.tool_choice.model_dump(exclude_none=True) == choice  # type: ignore[union-attr]


def test_with_thinking_a_required_allowed_tools_goes_and_is_echoed_as_auto(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]}
    r = client.responses.create(
        model="claude",
        input=f"hi {t}",
        tools=[fn("a"), fn("b")],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        reasoning={"effort": "low"},
    )
    assert r.status == "completed", r.error
    sent = env.sent(t)
    assert sent["thinking"]["type"] == "enabled"
    assert offered(sent) == ["a"] and sent["tool_choice"] == {"type": "auto"}
    for shown in (r.tool_choice, client.responses.retrieve(r.id).tool_choice):
        assert shown.model_dump(exclude_none=True) == {**choice, "mode": "auto"}  # type: ignore[union-attr]


def test_an_mcp_choice_without_a_name_offers_only_the_agents_own_tools(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r = client.responses.create(
        model="claude",
        input=f"hi {t}",
        tools=[fn("a")],  # type: ignore[list-item]
        tool_choice={"type": "mcp", "server_label": "claude"},  # type: ignore[typeddict-item]
    )
    assert r.status == "completed", r.error
    sent = env.sent(t)
    assert "a" not in offered(sent) and offered(sent), sent.get("tools")  # before: a offered, nothing forced
    assert sent["tool_choice"]["type"] in ("any", "tool")


def test_chat_completions_allowed_tools_offers_only_the_listed_tools(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": f"hi {t}"}],
        tools=[chat_fn("a"), chat_fn("b")],  # type: ignore[list-item]
        tool_choice={  # type: ignore[arg-type]
            "type": "allowed_tools",
            "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "b"}}]},
        },
    )
    assert r.choices[0].message.content == "anth: ok"
    sent = env.sent(t)
    assert offered(sent) == ["b"] and sent["tool_choice"] == {"type": "auto"}


def test_with_thinking_an_mcp_choice_without_a_name_is_echoed_as_allowed_tools_auto(
    env: Env, client: openai.OpenAI
) -> None:
    """Not a bare `auto`, which would tell the client its own tool `a` had been on offer."""
    t = tag()
    asked = {"type": "mcp", "server_label": "claude"}
    r = client.responses.create(
        model="claude",
        input=f"hi {t}",
        tools=[fn("a")],  # type: ignore[list-item]
        tool_choice=asked,  # type: ignore[typeddict-item]
        reasoning={"effort": "low"},
    )
    assert r.status == "completed", r.error
    sent = env.sent(t)
    assert "a" not in offered(sent) and sent["tool_choice"] == {"type": "auto"}
    want = {"type": "allowed_tools", "mode": "auto", "tools": [asked]}
    for shown in (r.tool_choice, client.responses.retrieve(r.id).tool_choice):
        assert shown.model_dump(exclude_none=True) == want  # type: ignore[union-attr]


def test_a_responses_allowed_tools_entry_is_named_by_its_name(env: Env, client: openai.OpenAI) -> None:
    """An entry is a tool definition (other keys allowed, OpenAI's spec): a Chat-shaped `function`
    beside its `name` used to pick that other tool (`b`) instead of the one named (`a`)."""
    t = tag()
    entry = {"type": "function", "name": "a", "function": {"name": "b"}}
    r = client.responses.create(
        model="claude",
        input=f"hi {t}",
        tools=[fn("a"), fn("b")],  # type: ignore[list-item]
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [entry]},  # type: ignore[arg-type]
    )
    assert r.status == "completed", r.error
    sent = env.sent(t)
    assert offered(sent) == ["a"] and sent["tool_choice"] == {"type": "tool", "name": "a"}
    shown = r.tool_choice.model_dump(exclude_none=True)  # type: ignore[union-attr]
    assert [x["name"] for x in shown["tools"]] == ["a"]
