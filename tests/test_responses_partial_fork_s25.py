"""A fork at a response that answered only part of a tool round keeps that response's answers.

Through a real `appserver serve` whose agents run on a loopback fake OpenAI upstream that records
what the model receives, driven by the real `openai` SDK with `previous_response_id`:

r1 asks for two calls, r2 answers one of them (a partial answer: the rest stays open), r3 answers
the rest. The same request as r3 sent again (an SDK retry after a dropped connection, a
regenerate; or several at once) forks at r2, and r2's context holds the answer it gave: the fork
answers the rest and the model sees both answers, as r3's did. Before, the fork asked again for
the call r2 had answered (under the same call id), and answering it again lost the earlier result.
A fork at r1 (both calls open there) still asks for whatever the request does not answer.

GET /v1/responses/{id} and /input_items refuse an `include` value the API does not know, as POST
does (before: any value was accepted).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

TOOLS: list[Any] = [
    {"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}} for n in ("f", "g")
]


class Model:
    """The fake upstream's model: `TOOLS a b` calls a and b (fresh call ids); anything else answers
    `SAW ` and the tool results of the last round it was sent, sorted, joined by `|`."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def __call__(self, req: RecordedRequest) -> Reply:
        messages = req.json["messages"]
        last = messages[-1]
        if last["role"] == "user" and str(last["content"]).startswith("TOOLS "):
            names = str(last["content"]).split()[1:]
            with self.lock:
                ids = [f"call_s25_{next(self.ids)}" for _ in names]
            deltas = [tool_delta(i, id=ids[i], name=n, arguments="{}") for i, n in enumerate(names)]
            body = [chunk(role="assistant", tool_calls=deltas), chunk(finish_reason="tool_calls")]
        else:
            body = [
                chunk(role="assistant", content=f"SAW {'|'.join(round_results(messages))}"),
                chunk(finish_reason="stop"),
            ]
        return Reply(pieces=[openai_sse(body)])


def round_results(messages: list[dict[str, Any]]) -> list[str]:
    """The contents of the tool messages after the last assistant message, sorted."""
    i = len(messages) - 1
    while i >= 0 and messages[i]["role"] == "tool":
        i -= 1
    return sorted(str(m["content"]) for m in messages[i + 1 :])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    with FakeOpenAI() as fake:
        fake.responder = Model()
        home: Path = tmp_path_factory.mktemp("partial_fork") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        for args in (("--name", "remote"), ("--name", "careful", "--tool", "clock=ask")):
            r = run_cli(home, "agents", "create", *args, "--model", "fake:m", "--json", env=env)
            assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def output(client: openai.OpenAI, model: str, **kw: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A response, and its output as (type, call name or call id)."""
    r = client.responses.create(model=model, tools=TOOLS, **kw)
    shown = [(o.type, getattr(o, "name", None) or getattr(o, "call_id", None) or "") for o in r.output]
    return r, shown


def result(call_id: str, value: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": value}


def partly_answered(client: openai.OpenAI) -> tuple[Any, Any, dict[str, str]]:
    """r1 (calls f and g), r2 (f answered with RES_F, g still asked for), the call ids by name."""
    r1, _ = output(client, "remote", input="TOOLS f g")
    calls = {o.name: o.call_id for o in r1.output if o.type == "function_call"}
    assert set(calls) == {"f", "g"}, r1.output
    r2, shown = output(client, "remote", previous_response_id=r1.id, input=[result(calls["f"], "RES_F")])
    assert shown == [("function_call", "g")], shown
    return r1, r2, calls


def test_the_same_answer_to_the_rest_of_a_round_again_keeps_the_answer_given_before(
    client: openai.OpenAI, srv: tuple[ServeProcess, FakeOpenAI]
) -> None:
    fake = srv[1]
    r1, r2, calls = partly_answered(client)
    rest = {"previous_response_id": r2.id, "input": [result(calls["g"], "RES_G")]}
    r3, _ = output(client, "remote", **rest)
    assert (r3.status, r3.output_text) == ("completed", "SAW RES_F|RES_G")
    asked = len(fake.requests)
    again, shown = output(client, "remote", **rest)  # a retry after a dropped connection
    # Before: 200 completed with no model call, asking for f again ([function_call f]).
    assert shown == [("message", "")], shown
    assert (again.status, again.output_text) == ("completed", "SAW RES_F|RES_G")
    assert len(fake.requests) == asked + 1
    assert round_results(fake.requests[-1].json["messages"]) == ["RES_F", "RES_G"]
    # r2 asked for g only: new input after it names g, as it did while r2 was the head
    with pytest.raises(openai.ConflictError) as refused:
        client.responses.create(model="remote", tools=TOOLS, previous_response_id=r2.id, input="new")
    assert refused.value.code == "calls_pending" and calls["f"] not in refused.value.message, refused.value.message
    assert calls["g"] in refused.value.message
    # f had its answer at r2: another one is refused there, as at the head; the same one is history
    with pytest.raises(openai.BadRequestError) as changed:
        changed_f = [result(calls["f"], "OTHER"), result(calls["g"], "RES_G")]
        client.responses.create(model="remote", tools=TOOLS, previous_response_id=r2.id, input=changed_f)
    assert changed.value.code == "already_resolved", changed.value.message
    same, _ = output(
        client, "remote", previous_response_id=r2.id, input=[result(calls["f"], "RES_F"), result(calls["g"], "G9")]
    )
    assert same.output_text == "SAW G9|RES_F"
    # and the fork goes on like any conversation
    nxt, _ = output(client, "remote", previous_response_id=again.id, input="more")
    assert nxt.status == "completed"


def test_a_fork_at_the_response_that_asked_for_both_calls_still_asks_for_both(client: openai.OpenAI) -> None:
    r1, r2, calls = partly_answered(client)
    done, _ = output(client, "remote", previous_response_id=r2.id, input=[result(calls["g"], "RES_G")])
    assert done.output_text == "SAW RES_F|RES_G"
    # at r1 nothing was answered: a request answering only g is asked for f
    fork, shown = output(client, "remote", previous_response_id=r1.id, input=[result(calls["g"], "G2")])
    assert shown == [("function_call", "f")], shown
    end, _ = output(client, "remote", previous_response_id=fork.id, input=[result(calls["f"], "F2")])
    assert end.output_text == "SAW F2|G2"
    both, _ = output(
        client, "remote", previous_response_id=r1.id, input=[result(calls["f"], "F3"), result(calls["g"], "G3")]
    )
    assert both.output_text == "SAW F3|G3"


def test_answers_to_the_rest_of_a_round_sent_at_once_each_keep_the_answer_given_before(
    client: openai.OpenAI,
) -> None:
    _, r2, calls = partly_answered(client)

    def answer(i: int) -> tuple[str, str, list[str]]:
        with openai.OpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0, timeout=30) as c:
            r = c.responses.create(
                model="remote", tools=TOOLS, previous_response_id=r2.id, input=[result(calls["g"], f"G{i}")]
            )
        return r.status, r.output_text, [o.type for o in r.output]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(answer, range(4)))
    # Before: one got its answer, the others `function_call f` again.
    assert answers == [("completed", f"SAW G{i}|RES_F", ["message"]) for i in range(4)], answers


@pytest.mark.parametrize("client_first", [True, False], ids=["client-then-approval", "approval-then-client"])
def test_a_round_of_a_client_call_and_an_approval_answered_in_parts_and_resent(
    client: openai.OpenAI, srv: tuple[ServeProcess, FakeOpenAI], client_first: bool
) -> None:
    fake = srv[1]
    r1, _ = output(client, "careful", input="TOOLS clock f")
    ask = next(o for o in r1.output if o.type == "mcp_approval_request")
    call = next(o for o in r1.output if o.type == "function_call")
    approve = {"type": "mcp_approval_response", "approval_request_id": ask.id, "approve": True}
    first, second = ([result(call.call_id, "RES_F")], [approve])
    if not client_first:
        first, second = second, first
    r2, shown = output(client, "careful", previous_response_id=r1.id, input=first)
    assert [t for t, _ in shown] == (["mcp_approval_request"] if client_first else ["function_call"]), shown
    r3, _ = output(client, "careful", previous_response_id=r2.id, input=second)
    assert r3.status == "completed" and "RES_F" in r3.output_text.split("|"), r3.output_text
    asked = len(fake.requests)
    again, shown = output(client, "careful", previous_response_id=r2.id, input=second)
    # Before (client call first): [function_call f], the call r2's request had answered.
    assert "function_call" not in [t for t, _ in shown], shown
    assert again.status == "completed" and again.output_text == r3.output_text  # the clock's result reused
    assert len(fake.requests) == asked + 1
    assert "RES_F" in round_results(fake.requests[-1].json["messages"])


@pytest.mark.parametrize(
    "query", ["include=bogus", "include[]=bogus", "include[]=file_search_call.results&include[]=x"]
)
def test_get_refuses_an_include_value_the_api_does_not_know(srv: tuple[ServeProcess, FakeOpenAI], query: str) -> None:
    with httpx.Client(base_url=srv[0].url, timeout=30) as http:
        r = http.post("/v1/responses", json={"model": "remote", "input": "hi"})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        posted = http.post("/v1/responses", json={"model": "remote", "input": "hi", "include": ["bogus"]})
        assert posted.status_code == 400
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            got = http.get(f"{path}?{query}")
            assert got.status_code == 400, (path, got.text)
            err = got.json()["error"]
            assert (err["code"], err["param"]) == (posted.json()["error"]["code"], "include"), err
        ok = http.get(f"/v1/responses/{rid}/input_items?include[]=message.output_text.logprobs")
        assert ok.status_code == 200, ok.text
        assert json.loads(http.get(f"/v1/responses/{rid}?include=reasoning.encrypted_content").text)["id"] == rid
