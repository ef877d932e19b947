"""Turns paused over HTTP count in the open-turn cap (`[limits] open_turns_per_client`,
docs/configuration.md, docs/security.md). A reply with client tool calls (or an approval request)
returns while its turn stays open, paused for `client_tool_timeout_s`, holding no
`connections_per_client` slot; only the WebSocket counted open turns, so one token sent a big
/v1/responses input, then 100 tiny requests forking it (`previous_response_id` and a `/call`) and
held 100 paused turns (and a gigabyte) against a cap of 10. Now an HTTP turn takes a place in the
same per-credential count as a WebSocket's, from its accept until it ends; past the cap a request
is refused 429 `too_many_open_turns` before anything is written; a request answering a paused turn
needs no second place, and its end frees the place.

A real `appserver serve --auth token` with the cap at 3, real tokens, the real openai SDK and
`websockets` client, the echo model (`/call f {}`: a client call to `f`; `/slow N`: N words).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0
CAP = 3
NAMES = ("fill", "answer", "mixed", "chat")
F = {"type": "function", "name": "f", "description": "A client function.", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path_factory.mktemp("httpcap") / "home"
    home.mkdir(parents=True)
    store = TokenStore(home)
    tokens = {name: store.create(name=name)[1] for name in NAMES}
    env = cli_env(home, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, tokens


def _client(sp: ServeProcess, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key=token, max_retries=0, timeout=T)


def _paused(client: openai.OpenAI, **extra: Any) -> Any:
    """A response whose turn pauses at a client call of `f` (open until answered)."""
    resp = client.responses.create(model="assistant", input="/call f {}", tools=[F], **extra)  # type: ignore[list-item]
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "f", resp.output
    return resp


def _refused(err: pytest.ExceptionInfo[openai.RateLimitError]) -> None:
    assert err.value.status_code == 429, err.value
    assert err.value.code == "too_many_open_turns", err.value.body
    assert f"{CAP} open turns" in err.value.message and "[limits] open_turns_per_client" in err.value.message
    assert err.value.response.headers.get("x-should-retry") == "false"


def _counts(home: Path) -> tuple[int, int, list[tuple[str, int]]]:
    """Conversations, turns, and turns by status."""
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        convs = int(c.execute("SELECT count(*) FROM conversations").fetchone()[0])
        turns = int(c.execute("SELECT count(*) FROM turns").fetchone()[0])
        by = [(str(s), int(n)) for s, n in c.execute("SELECT status, count(*) FROM turns GROUP BY status")]
        return convs, turns, sorted(by)


def _answer(client: openai.OpenAI, resp: Any) -> Any:
    call = next(o for o in resp.output if o.type == "function_call")
    return client.responses.create(
        model="assistant",
        previous_response_id=resp.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
        tools=[F],  # type: ignore[list-item]
    )


def test_paused_http_turns_fill_the_cap_and_a_refused_request_writes_nothing(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    client = _client(sp, tokens["fill"])
    first = client.responses.create(model="assistant", input="a long history")
    for _ in range(CAP):  # the repro's shape: forks of the first response, each paused at a call
        _paused(client, previous_response_id=first.id)
    before = _counts(sp.home)
    with pytest.raises(openai.RateLimitError) as err:
        _paused(client, previous_response_id=first.id)  # would fork into a new conversation
    _refused(err)
    with pytest.raises(openai.RateLimitError) as err:
        _paused(client)  # a new conversation
    _refused(err)
    assert _counts(sp.home) == before  # no conversation, no turn written for them
    # another credential is not held back by it
    other = _client(sp, tokens["chat"])
    done = other.responses.create(model="assistant", input="hi")
    assert done.status == "completed"


def test_answering_a_paused_turn_needs_no_place_and_its_end_frees_one(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    client = _client(sp, tokens["answer"])
    held = [_paused(client) for _ in range(CAP)]
    with pytest.raises(openai.RateLimitError) as err:
        client.responses.create(model="assistant", input="hi")
    _refused(err)
    answered = _answer(client, held[0])  # all places taken: the turn it resumes holds one
    assert answered.status == "completed", answered
    assert "f -> 42" in answered.output_text
    # its turn ended: its place is free again, for one turn only
    assert client.responses.create(model="assistant", input="hi again").status == "completed"
    _paused(client)
    with pytest.raises(openai.RateLimitError) as err:
        _paused(client)
    _refused(err)


async def test_websocket_and_http_turns_share_the_count(srv: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, tokens = srv
    token = tokens["mixed"]
    client = _client(sp, token)
    await asyncio.to_thread(_paused, client)
    await asyncio.to_thread(_paused, client)
    ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)
    try:
        frame = {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 1000"}
        ack = await ws.request(frame, T)
        assert ack["type"] == "ack", ack  # the third place
        err = await ws.request(frame, T)
        assert err["type"] == "error" and err["code"] == "too_many_open_turns", err  # HTTP's two count
        with pytest.raises(openai.RateLimitError) as http_err:
            await asyncio.to_thread(client.responses.create, model="assistant", input="hi")
        _refused(http_err)  # the WebSocket's turn counts for HTTP too
        cancel = {"type": "cancel", "conversation": ack["conversation_id"], "turn_id": ack["turn_id"]}
        assert (await ws.request(cancel, T))["type"] == "ack"
        assert (await ws.terminal(ack["turn_id"], T))["status"] == "cancelled"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + T
        while True:  # the cancelled turn's place comes back once its end is seen
            try:
                done = await asyncio.to_thread(client.responses.create, model="assistant", input="hi")
                break
            except openai.RateLimitError:
                assert loop.time() < deadline, "the cancelled WebSocket turn's place never came back"
                await asyncio.sleep(0.05)
        assert done.status == "completed"
    finally:
        await ws.close()


def test_chat_completions_tool_calls_hold_a_place(srv: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, tokens = srv
    client = _client(sp, tokens["chat"])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for i in range(CAP):
        reply = client.chat.completions.create(
            model="assistant",
            messages=[{"role": "user", "content": f'/call f {{}}\n/call f {{"n": {i}}}'}],
            tools=[tool],  # type: ignore[list-item]
        )
        assert reply.choices[0].finish_reason == "tool_calls", reply
    before = _counts(sp.home)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "hi"}])
    _refused(err)
    assert _counts(sp.home) == before
