"""Answers to one paused turn's client tool call, sent at the same moment to two servers of a cluster
with the same `previous_response_id`: each is answered, as the two would be on one server (the first
continues the conversation, the other forks from the response it named; docs/openai.md "Racing
requests").

Before, each server decided on its own to continue the conversation, and the one whose answer came
second got a 200 with no output (the same answer: "nothing new"), a 409 `not_awaiting`, or a 400
`already_resolved` (another answer). Real PostgreSQL, two real `appserver serve` processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(90)

F = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ROUNDS = 6


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("s23c")
    with temp_database("s23c_race") as url:
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                env = cli_env(
                    home,
                    APPSERVER_STORE__URL=url,
                    APPSERVER_STORE__HEARTBEAT_S="0.2",
                    APPSERVER_STORE__INSTANCE_TIMEOUT_S="20",
                )
                started.append(start_serve(home, env=env))
            yield [sp.url + "/v1" for sp in started]
        finally:
            for sp in started:
                try:
                    sp.stop(timeout=10)
                except Exception:
                    pass
                sp.kill()


async def _paused(c: httpx.AsyncClient, base: str) -> tuple[str, str]:
    """A response of `base` paused at a call of the client's tool f: its id and the call's."""
    r = await c.post(base + "/responses", json={"model": "assistant", "input": "/call f {}", "tools": [F]})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["id"], next(o for o in body["output"] if o["type"] == "function_call")["call_id"]


def _answer(prev: str, call: str, output: str) -> dict[str, Any]:
    return {
        "model": "assistant",
        "tools": [F],
        "previous_response_id": prev,
        "input": [{"type": "function_call_output", "call_id": call, "output": output}],
    }


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    body = r.json()
    return "".join(
        p.get("text", "") for o in body["output"] if o["type"] == "message" for p in o["content"] if isinstance(p, dict)
    )


async def _race(nodes: list[str], outputs: tuple[str, str]) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(ROUNDS):
            prev, call = await _paused(c, nodes[0])
            sends = [
                c.post(base + "/responses", json=_answer(prev, call, out))
                for base, out in zip(nodes, outputs, strict=True)
            ]
            replies = await asyncio.gather(*sends)
            assert [_text(r) for r in replies] == [f"f -> {out}" for out in outputs]
            convs = {r.headers["x-conversation-id"] for r in replies}
            assert len(convs) == 2  # one continued the conversation, the other forked from the response


async def test_the_same_answer_sent_to_two_servers_at_once_is_answered_by_both(nodes: list[str]) -> None:
    await _race(nodes, ("RA", "RA"))


async def test_different_answers_sent_to_two_servers_at_once_are_each_answered(nodes: list[str]) -> None:
    await _race(nodes, ("RA", "RB"))
