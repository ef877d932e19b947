"""`max_tool_calls` on /v1/responses is enforced, not only echoed: a turn processes at most that
many calls of the server's own tools (OpenAI's built-in tools); calls past it are not run (their
result says so) and the model is no longer offered the server's tools. The client's function
tools are not counted. Through a real `appserver serve` on loopback, the real `openai` SDK, and a
loopback fake upstream that keeps calling `clock` (two calls at once when asked) whatever it is
offered, recording what each model call offered."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)


def calling_model(req: RecordedRequest) -> Reply:
    """Calls `clock` (twice in one step for `TWICE`) until it has seen three clock results; a
    `lookup` client function call for `CLIENT` first; then answers `done`."""
    messages = (req.json or {}).get("messages", [])
    first = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    results = sum(1 for m in messages if m.get("role") == "tool")
    if str(first).startswith("CLIENT") and not any(m.get("role") == "tool" for m in messages):
        calls = [tool_delta(0, id=f"call_{uuid.uuid4().hex[:8]}", name="lookup", arguments="{}")]
    elif str(first).startswith("MIXED") and results == 1:  # a clock call, then the client's
        calls = [tool_delta(0, id=f"call_{uuid.uuid4().hex[:8]}", name="lookup", arguments="{}")]
    elif results < 3:
        n = 2 if str(first).startswith("TWICE") else 1
        calls = [tool_delta(i, id=f"call_{uuid.uuid4().hex[:8]}", name="clock", arguments="{}") for i in range(n)]
    else:
        calls = []
    if calls:
        chunks = [chunk(role="assistant", tool_calls=calls), chunk(finish_reason="tool_calls")]
    else:
        chunks = [chunk(role="assistant", content="done"), chunk(finish_reason="stop")]
    return Reply(pieces=[openai_sse(chunks)])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, FakeOpenAI]]:
    with FakeOpenAI() as fake:
        fake.responder = calling_model
        home: Path = tmp_path_factory.mktemp("maxcalls") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        made = run_cli(home, "agents", "create", "--name", "a", "--model", "fake:m", "--tool", "clock=allow", env=cli)
        assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            with openai.OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
                yield client, fake


def offered(req: RecordedRequest) -> list[str]:
    return [t["function"]["name"] for t in (req.json or {}).get("tools") or []]


def clock_calls(response: Any) -> list[tuple[str, bool]]:
    """(output, ran) of each clock call the response shows."""
    out = []
    for item in response.output:
        if item.type == "mcp_call" and item.name == "clock":
            out.append((item.output or "" if item.error is None else str(item.error), item.error is None))
    return out


@pytest.mark.parametrize(("prompt", "cap"), [("ONE", 0), ("ONE", 1), ("ONE", 2), ("TWICE", 1), ("TWICE", 3)])
def test_a_turn_runs_at_most_max_tool_calls_of_the_servers_tools(
    served: tuple[openai.OpenAI, FakeOpenAI], prompt: str, cap: int
) -> None:
    client, fake = served
    fake.clear()
    response = client.responses.create(model="a", input=prompt, max_tool_calls=cap)
    assert response.status == "completed" and response.output_text == "done", response
    assert response.max_tool_calls == cap
    calls = clock_calls(response)
    ran = [c for c in calls if c[1]]
    assert len(ran) == min(cap, 3), calls
    for output, did_run in calls:
        if not did_run:
            assert "max_tool_calls" in output, output
    # once the cap is reached the model is no longer offered the server's tools
    seen = [offered(r) for r in fake.requests]
    assert ("clock" in seen[0]) == (cap > 0) and seen[-1] == [], seen
    for r, tools in zip(fake.requests, seen, strict=True):
        sent = (r.json or {}).get("messages", [])
        made = sum(len(m.get("tool_calls") or []) for m in sent if m.get("role") == "assistant")
        assert ("clock" in tools) == (made < cap), (seen, made)


def test_without_max_tool_calls_nothing_is_capped(served: tuple[openai.OpenAI, FakeOpenAI]) -> None:
    client, fake = served
    fake.clear()
    response = client.responses.create(model="a", input="TWICE")
    assert response.status == "completed" and response.max_tool_calls is None
    calls = clock_calls(response)
    assert len(calls) == 4 and all(ran for _, ran in calls), calls  # two steps of two calls
    assert all("clock" in offered(r) for r in fake.requests)


def test_the_clients_function_tools_are_not_counted(served: tuple[openai.OpenAI, FakeOpenAI]) -> None:
    client, fake = served
    fake.clear()
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    first = client.responses.create(model="a", input="CLIENT", tools=[lookup], max_tool_calls=1)  # type: ignore[list-item]
    [call] = [i for i in first.output if i.type == "function_call"]
    assert call.name == "lookup"
    # the client's call took nothing of the cap: the resumed turn still runs one clock call
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "found"}
    second = client.responses.create(
        model="a",
        previous_response_id=first.id,
        input=[answer],  # type: ignore[list-item]
        tools=[lookup],  # type: ignore[list-item]
        max_tool_calls=1,
    )
    assert second.status == "completed" and second.output_text == "done", second
    ran = [c for c in clock_calls(second) if c[1]]
    assert len(ran) == 1, clock_calls(second)
    assert {"clock", "lookup"} <= set(offered(fake.requests[0]))
    assert offered(fake.requests[-1]) == ["lookup"]  # the server's tools withheld, the client's kept


def test_a_request_resuming_the_turn_has_its_own_cap(served: tuple[openai.OpenAI, FakeOpenAI]) -> None:
    # OpenAI counts max_tool_calls per response: the calls the turn ran before the request's answers
    # were the earlier response's
    client, fake = served
    fake.clear()
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    first = client.responses.create(model="a", input="MIXED", tools=[lookup], max_tool_calls=1)  # type: ignore[list-item]
    assert len([c for c in clock_calls(first) if c[1]]) == 1, clock_calls(first)
    [call] = [i for i in first.output if i.type == "function_call"]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "found"}
    second = client.responses.create(
        model="a",
        previous_response_id=first.id,
        input=[answer],  # type: ignore[list-item]
        tools=[lookup],  # type: ignore[list-item]
        max_tool_calls=1,
    )
    assert second.status == "completed" and second.output_text == "done", second
    assert len([c for c in clock_calls(second) if c[1]]) == 1, clock_calls(second)
