"""The OpenAI routes and the other surfaces driving the same conversation: what a WebSocket client
decided, cancelled or dropped, and what a kill -9 left, as the HTTP clients then see it. A real
`appserver serve` on loopback, the real `openai` SDK and httpx, the WebSocket helpers.

1. An approval a call already has (a WebSocket client denied it) is never changed through a fork:
   answering it otherwise with `previous_response_id`, or by resending the transcript, is a 400
   `already_resolved` that writes nothing (was: 200, and the fork ran the shell command the person
   had denied). Repeating the same answer still forks and answers, and an approval repeated (a
   retry, three at once) never runs its call twice: the fork reuses the result (was: the shell
   command ran once per resend). A client tool's result may be given otherwise: nothing of the
   server runs for it, so the fork answers it, as a stateless OpenAI request would be answered
   (was: 400).
2. A Responses stream queued behind another turn, told its response id (`response.created`), then
   the server killed (-9): after the restart `GET` answers how its turn ended, and
   `previous_response_id` naming it continues (was: `in_progress` and 409 forever).
3. A turn cancelled by a WebSocket client: a chat request whose turn showed nothing is an error
   (409 `turn_cancelled`), never an empty `stop` (was: 200 with empty content); a Responses stream
   ends with the status the non-stream answer and `GET` give, `cancelled` (was: `response.failed`
   with status `failed`).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("cross") / "home"
    env = cli_env(home)
    made = run_cli(home, "agents", "create", "--name", "ops", "--tool", "shell=ask", env=env)
    assert made.code == 0, made.err
    with serving(home, env=env) as sp:
        yield sp


def conversations(sp: ServeProcess) -> int:
    with sqlite3.connect(f"file:{sp.home / 'appserver.db'}?mode=ro", uri=True) as c:
        return int(c.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])


def user_texts(sp: ServeProcess, conversation_id: str) -> list[str]:
    with sqlite3.connect(f"file:{sp.home / 'appserver.db'}?mode=ro", uri=True) as c:
        rows = c.execute(
            "SELECT content FROM messages WHERE conversation_id = ? AND role = 'user' ORDER BY id", (conversation_id,)
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


async def _ended(ws: WS, conversation_id: str) -> None:
    """Wait until the socket saw a turn of `conversation_id` end (denied: it went on and finished)."""

    def ended(f: dict[str, Any]) -> bool:
        return (
            f["type"] == "turn_updated"
            and f["snapshot"]["conversation_id"] == conversation_id
            and f["snapshot"]["status"] in ("completed", "cancelled", "failed")
        )

    if not any(ended(f) for f in ws.seen):
        await ws.expect(ended)


def refused_as_resolved(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "already_resolved", r.text
    assert r.json()["error"]["param"] in ("input", "messages")


# ---------------------------------------------------------------- 1. decided elsewhere


def test_an_approval_denied_on_the_websocket_is_never_run_through_a_fork(srv: ServeProcess, tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    command = f'/call shell {{"command": "echo ran >> {mark}"}}'

    async def go() -> None:
        ws = await WS.open(srv.url)
        http = httpx.AsyncClient(base_url=srv.url, timeout=30)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "ops"}))["conversation"]["id"]
            await ws.request({"type": "subscribe", "conversation": conv})
            first = await http.post("/v1/responses", json={"model": "ops", "conversation": conv, "input": command})
            assert first.status_code == 200, first.text
            (req,) = [o for o in first.json()["output"] if o["type"] == "mcp_approval_request"]
            asked = await ws.expect(lambda f: f["type"] == "approval_request")
            assert f"mcpr_{asked['call_id']}" == req["id"]
            ack = await ws.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [{"call_id": asked["call_id"], "decision": "deny", "reason": "no"}],
                }
            )
            assert ack["results"][0]["accepted"] is True, ack
            await ws.terminal(asked["turn_id"])
            before = conversations(srv)

            approve = {"type": "mcp_approval_response", "approval_request_id": req["id"], "approve": True}
            # the client that started the turn approves it after all: with previous_response_id …
            again = await http.post(
                "/v1/responses", json={"model": "ops", "previous_response_id": first.json()["id"], "input": [approve]}
            )
            refused_as_resolved(again)
            assert "denied" in again.json()["error"]["message"]
            # … or statelessly, resending the round, on a turn started without any conversation id
            said = command.replace("ran", "ran-stateless")
            started = await http.post("/v1/responses", json={"model": "ops", "input": said})
            (req2,) = [o for o in started.json()["output"] if o["type"] == "mcp_approval_request"]
            conv2 = started.headers["x-conversation-id"]
            await ws.request({"type": "subscribe", "conversation": conv2})
            ack = await ws.request(
                {
                    "type": "approval_response",
                    "conversation": conv2,
                    "decisions": [{"call_id": req2["id"].removeprefix("mcpr_"), "decision": "deny"}],
                }
            )
            assert ack["results"][0]["accepted"] is True, ack
            await _ended(ws, conv2)
            before = conversations(srv)
            approve2 = dict(approve, approval_request_id=req2["id"])
            stateless = await http.post(
                "/v1/responses", json={"model": "ops", "input": [{"role": "user", "content": said}, req2, approve2]}
            )
            refused_as_resolved(stateless)
            await asyncio.sleep(0.5)  # a fork that ran the command would have written the mark by now
            assert not mark.exists(), "the command a person denied ran"
            assert conversations(srv) == before  # refused whole: no fork written

            # the same answer again (a retry) is history: it forks and is answered, never refused
            deny = dict(approve, approve=False)
            repeat = await http.post(
                "/v1/responses", json={"model": "ops", "previous_response_id": first.json()["id"], "input": [deny]}
            )
            assert repeat.status_code == 200, repeat.text
            validate("Response", repeat.json())
            assert repeat.headers["x-conversation-id"] != conv
            assert [o["status"] for o in repeat.json()["output"] if o["type"] == "mcp_call"] == ["failed"]
            assert not mark.exists()
        finally:
            await http.aclose()
            await ws.close()

    asyncio.run(go())


def test_an_approval_resent_runs_its_call_once_and_the_forks_reuse_its_result(
    srv: ServeProcess, tmp_path: Path
) -> None:
    mark = tmp_path / "ran"
    command = f'/call shell {{"command": "echo ran >> {mark} && echo done-once"}}'

    async def go() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            first = await http.post("/v1/responses", json={"model": "ops", "input": command})
            assert first.status_code == 200, first.text
            (req,) = [o for o in first.json()["output"] if o["type"] == "mcp_approval_request"]
            approve = {"type": "mcp_approval_response", "approval_request_id": req["id"], "approve": True}
            body = {"model": "ops", "previous_response_id": first.json()["id"], "input": [approve]}
            at_once = await asyncio.gather(*(http.post("/v1/responses", json=body) for _ in range(3)))
            codes = sorted(r.status_code for r in at_once)
            assert 200 in codes and set(codes) <= {200, 409}, [r.text for r in at_once]
            for r in at_once:
                if r.status_code == 409:  # still being answered by the first: retry once it is done
                    validate("ErrorResponse", r.json())
                    assert r.json()["error"]["code"] == "already_resolving", r.text
            # the OpenAI SDK sends them (it retries a 409 on its own): every one is answered
            sdk = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=4)
            by_sdk = await asyncio.gather(
                *(
                    sdk.responses.create(model="ops", previous_response_id=first.json()["id"], input=[approve])  # type: ignore[arg-type,list-item]
                    for _ in range(3)
                )
            )
            await sdk.close()
            for resp in by_sdk:
                (call,) = [o for o in resp.output if o.type == "mcp_call"]
                assert call.status == "completed" and "done-once" in (call.output or ""), resp.output
            later = await http.post("/v1/responses", json=body)
            stateless = await http.post(
                "/v1/responses", json={"model": "ops", "input": [{"role": "user", "content": command}, req, approve]}
            )
            for r in [*(r for r in at_once if r.status_code == 200), later, stateless]:
                assert r.status_code == 200, r.text
                validate("Response", r.json())
                calls = [o for o in r.json()["output"] if o["type"] == "mcp_call"]
                assert [c["status"] for c in calls] == ["completed"], r.json()["output"]
                assert "done-once" in calls[0]["output"], calls
            assert mark.read_text().count("ran") == 1, "an approval given once ran its call more than once"
            assert later.headers["x-conversation-id"] != first.headers["x-conversation-id"]  # a fork

    asyncio.run(go())


def test_a_fork_keeps_every_call_closed_where_it_came_from(srv: ServeProcess, tmp_path: Path) -> None:
    """A round of two calls, A approved and B denied (by a person, with a reason) in the source:
    a resend answering only one of them forks with the other closed as it was there, never open
    again (was: the fork asked for it anew, and approving it there ran the denied call and A a
    second time). A call approved there that waits for the rest of its round is a 400 naming
    the conversation to answer in (was: a 409 to retry that no retry cleared)."""
    marks = {k: tmp_path / k for k in "ABCD"}

    def shell(k: str) -> str:
        return f'/call shell {{"command": "echo ran >> {marks[k]}"}}'

    def ran(k: str) -> int:
        return marks[k].read_text().count("ran") if marks[k].exists() else 0

    def approve(req: dict[str, Any], ok: bool = True) -> dict[str, Any]:
        return {"type": "mcp_approval_response", "approval_request_id": req["id"], "approve": ok}

    def calls(r: httpx.Response) -> list[tuple[str, str | None]]:
        assert r.status_code == 200, r.text
        validate("Response", r.json())
        return [
            (o["output"] or "", (o.get("error") or {}).get("content", [{}])[0].get("text"))
            for o in r.json()["output"]
            if o["type"] == "mcp_call"
        ]

    async def go() -> None:
        ws = await WS.open(srv.url)
        http = httpx.AsyncClient(base_url=srv.url, timeout=30)
        try:
            first = await http.post("/v1/responses", json={"model": "ops", "input": f"{shell('A')}\n{shell('B')}"})
            a, b = [o for o in first.json()["output"] if o["type"] == "mcp_approval_request"]
            conv = first.headers["x-conversation-id"]
            await ws.request({"type": "subscribe", "conversation": conv})
            decided = await ws.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [
                        {"call_id": a["id"].removeprefix("mcpr_"), "decision": "approve"},
                        {"call_id": b["id"].removeprefix("mcpr_"), "decision": "deny", "reason": "never on prod"},
                    ],
                }
            )
            assert all(r["accepted"] for r in decided["results"]), decided
            await _ended(ws, conv)
            assert (ran("A"), ran("B")) == (1, 0)
            prev = first.json()["id"]
            for only in ([approve(a)], [approve(b, False)]):
                fork = await http.post(
                    "/v1/responses", json={"model": "ops", "previous_response_id": prev, "input": only}
                )
                (done_a, _), (_, denied_b) = calls(fork)
                assert denied_b is not None and "never on prod" in denied_b, denied_b
                assert fork.headers["x-conversation-id"] != conv
            stateless = await http.post(
                "/v1/responses",
                json={
                    "model": "ops",
                    "input": [{"role": "user", "content": f"{shell('A')}\n{shell('B')}"}, a, b, approve(a)],
                },
            )
            assert len(calls(stateless)) == 2
            assert (ran("A"), ran("B")) == (1, 0), "a fork ran a call again, or ran the one a person denied"

            # a round answered in parts: C approved, D still open in the source
            second = await http.post("/v1/responses", json={"model": "ops", "input": f"{shell('C')}\n{shell('D')}"})
            c, d = [o for o in second.json()["output"] if o["type"] == "mcp_approval_request"]
            part = await http.post(
                "/v1/responses",
                json={"model": "ops", "previous_response_id": second.json()["id"], "input": [approve(c)]},
            )
            assert part.status_code == 200 and ran("C") == 0, part.text  # waits for D's answer
            await ws.request(
                {
                    "type": "submit_input",
                    "agent": "ops",
                    "conversation": part.headers["x-conversation-id"],
                    "input": "later",
                }
            )  # queued behind the pause: it has not run, the paused turn is still the head
            again = await http.post(
                "/v1/responses",
                json={"model": "ops", "previous_response_id": second.json()["id"], "input": [approve(d)]},
            )
            assert again.status_code == 200, again.text  # answers the round there: no fork
            assert again.headers["x-conversation-id"] == part.headers["x-conversation-id"]
            assert ran("C") == ran("D") == 1
        finally:
            await http.aclose()
            await ws.close()

    asyncio.run(go())


def test_a_client_tool_result_given_otherwise_forks(srv: ServeProcess) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": f'/call f {{"n": "{uuid.uuid4().hex}"}}'}]
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json={"model": "ops", "messages": ask, "tools": [tool]})
        assert first.status_code == 200, first.text
        (made,) = first.json()["choices"][0]["message"]["tool_calls"]
        asked = [*ask, {"role": "assistant", "content": None, "tool_calls": [made]}]

        def answer(output: str) -> httpx.Response:
            msgs = [*asked, {"role": "tool", "tool_call_id": made["id"], "content": output}]
            return http.post("/v1/chat/completions", json={"model": "ops", "messages": msgs, "tools": [tool]})

        done = answer("A")
        assert done.status_code == 200 and done.json()["choices"][0]["message"]["content"] == "f -> A"
        assert done.headers["x-conversation-id"] == first.headers["x-conversation-id"]
        other = answer("B")  # another result: a fork answers it (nothing of the server ran for it)
        assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] == "f -> B", other.text
        assert other.headers["x-conversation-id"] != first.headers["x-conversation-id"]
        retried = answer("A")  # the same body again: a fork answers it again, as before
        assert retried.status_code == 200 and retried.json()["choices"][0]["message"]["content"] == "f -> A"

        # Responses, with previous_response_id
        rtool = {"type": "function", "name": "g", "parameters": {"type": "object"}}
        r1 = http.post(
            "/v1/responses",
            json={"model": "ops", "input": f'/call g {{"n": "{uuid.uuid4().hex}"}}', "tools": [rtool]},
        )
        (fc,) = [o for o in r1.json()["output"] if o["type"] == "function_call"]

        def output(text: str) -> httpx.Response:
            item = {"type": "function_call_output", "call_id": fc["call_id"], "output": text}
            body = {"model": "ops", "previous_response_id": r1.json()["id"], "input": [item], "tools": [rtool]}
            return http.post("/v1/responses", json=body)

        assert output("A").status_code == 200
        b = output("B")
        assert b.status_code == 200, b.text
        texts = [c["text"] for o in b.json()["output"] if o["type"] == "message" for c in o["content"]]
        assert texts == ["g -> B"], b.json()["output"]
        assert output("A").status_code == 200


# ---------------------------------------------------------------- 2. kill -9 with a queued stream


def test_a_queued_stream_killed_with_the_server_is_answered_as_its_turn_ended(tmp_path: Path) -> None:
    require_conformance()
    home = tmp_path / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    rid = ""
    try:

        async def queue_and_kill() -> tuple[str, str]:
            ws = await WS.open(sp.url)
            conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await ws.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 400"})
            client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0)
            stream = await client.responses.create(model="assistant", input="queued", conversation=conv, stream=True)
            async for e in stream:
                if e.type == "response.created":
                    break
            held = await client.responses.retrieve(e.response.id)
            assert held.status == "in_progress"  # stored so from response.created on
            sp.proc.kill()  # kill -9, the turn still queued behind the WebSocket's
            sp.proc.wait(10)
            await client.close()
            return e.response.id, conv

        rid, conv = asyncio.run(queue_and_kill())
    finally:
        sp.kill()

    sp = start_serve(home, env=env)
    try:
        with httpx.Client(base_url=sp.url, timeout=30) as http:
            deadline = time.monotonic() + 20
            while (got := http.get(f"/v1/responses/{rid}")).json().get("status") == "in_progress":
                assert time.monotonic() < deadline, "the response stays in_progress after its turn ended"
                time.sleep(0.1)
            assert got.status_code == 200, got.text
            validate("Response", got.json())
            body = got.json()
            # how its turn ended: dropped at the restart (nothing of it in the history), or run then
            if body["status"] == "cancelled":
                assert body["output"] == [] and "queued" not in user_texts(sp, conv)
            else:
                assert body["status"] == "completed", body
                assert body["output"][-1]["content"][0]["text"] == "echo: queued"
            assert http.get(f"/v1/responses/{rid}").json() == body  # kept so
            nxt = http.post("/v1/responses", json={"model": "assistant", "input": "next", "previous_response_id": rid})
            if body["status"] == "cancelled":  # dropped: it says so, and nothing continues from it
                assert body["error"]["message"].endswith("[input_withdrawn]"), body
                assert nxt.status_code == 400 and nxt.json()["error"]["code"] == "previous_response_withdrawn"
                return
            assert nxt.status_code == 200, nxt.text
            assert nxt.json()["status"] == "completed"
    finally:
        sp.stop()


def test_a_stream_killed_mid_turn_keeps_its_text_and_a_continuation_follows_it(tmp_path: Path) -> None:
    """The running turn of a Responses stream is interrupted by kill -9: after the restart `GET`
    answers `failed` with the text the turn kept as an incomplete message, and previous_response_id
    naming it continues after that turn (was: no output, and the continuation forked from before the
    turn, its input and kept text missing)."""
    require_conformance()
    home = tmp_path / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    try:

        async def stream_and_kill() -> tuple[str, str]:
            client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0)
            first = await client.responses.create(model="assistant", input="first")
            stream = await client.responses.create(
                model="assistant", input="/slow 300", previous_response_id=first.id, stream=True
            )
            rid, words = "", 0
            async for e in stream:
                if e.type == "response.created":
                    rid = e.response.id
                elif e.type == "response.output_text.delta":
                    words += 1
                    if words == 5:
                        break
            await asyncio.sleep(0.7)  # the turn's draft (twice a second) holds some of its text now
            sp.proc.kill()
            sp.proc.wait(10)
            await client.close()
            return first.id, rid

        first_id, rid = asyncio.run(stream_and_kill())
    finally:
        sp.kill()

    sp = start_serve(home, env=env)
    try:
        with httpx.Client(base_url=sp.url, timeout=30) as http:
            got = http.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            validate("Response", got.json())
            body = got.json()
            assert body["status"] == "failed", body
            (message,) = [o for o in body["output"] if o["type"] == "message"]
            kept = message["content"][0]["text"]
            assert message["status"] == "incomplete" and kept.startswith("w1 w2 w3"), body["output"]
            assert http.get(f"/v1/responses/{rid}").json() == body  # kept so
            nxt = http.post(
                "/v1/responses", json={"model": "assistant", "input": "/recall", "previous_response_id": rid}
            )
            assert nxt.status_code == 200, nxt.text
            assert nxt.json()["output"][-1]["content"][0]["text"] == "first | /slow 300", nxt.json()
            got_first = http.get(f"/v1/responses/{first_id}").json()
            assert got_first["status"] == "completed"
    finally:
        sp.stop()


def test_a_stream_answering_an_approval_killed_while_the_call_runs_shows_the_call(tmp_path: Path) -> None:
    """kill -9 while the call an approval resumed runs inside a Responses stream: after the restart
    `GET` shows that `mcp_call` with the interrupted outcome (was: `failed` with no output)."""
    require_conformance()
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "ops", "--tool", "shell=ask", env=env).code == 0
    sp = start_serve(home, env=env)
    try:

        async def approve_and_kill() -> str:
            client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0)
            first = await client.responses.create(model="ops", input='/call shell {"command": "sleep 30"}')
            (req,) = [o for o in first.output if o.type == "mcp_approval_request"]
            answer = {"type": "mcp_approval_response", "approval_request_id": req.id, "approve": True}
            stream = await client.responses.create(
                model="ops",
                previous_response_id=first.id,
                input=[answer],  # type: ignore[list-item]
                stream=True,
            )
            rid = ""
            async for e in stream:
                if e.type == "response.created":
                    rid = e.response.id
                elif e.type == "response.output_item.added" and e.item.type == "mcp_call":
                    break
            await asyncio.sleep(0.3)
            sp.proc.kill()
            sp.proc.wait(10)
            await client.close()
            return rid

        rid = asyncio.run(approve_and_kill())
    finally:
        sp.kill()

    sp = start_serve(home, env=env)
    try:
        with httpx.Client(base_url=sp.url, timeout=30) as http:
            got = http.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            validate("Response", got.json())
            assert got.json()["status"] == "failed"
            (call,) = [o for o in got.json()["output"] if o["type"] == "mcp_call"]
            assert call["name"] == "shell" and call["error"] is not None, call
    finally:
        sp.stop()


# ---------------------------------------------------------------- 3. cancelled from the WebSocket


async def _new_turn(ws: WS, known: set[str]) -> str:
    """The id of the next turn the subscribed socket sees that is not in `known` (added to it)."""

    def fresh(f: dict[str, Any]) -> bool:
        return f["type"] == "turn_updated" and f["snapshot"]["turn_id"] not in known

    seen = next((f for f in ws.seen if fresh(f)), None) or await ws.expect(fresh)
    known.add(seen["snapshot"]["turn_id"])
    return str(seen["snapshot"]["turn_id"])


def test_queued_http_inputs_cancelled_from_the_websocket_are_no_answers(srv: ServeProcess) -> None:
    async def go() -> None:
        ws = await WS.open(srv.url)
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=2)
        http = httpx.AsyncClient(base_url=srv.url, timeout=30)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await ws.request({"type": "subscribe", "conversation": conv})
            ack = await ws.request(
                {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 200"}
            )
            known = {ack["turn_id"]}
            pinned = {"X-Conversation-Id": conv}

            chat = asyncio.create_task(
                client.chat.completions.create(
                    model="assistant", messages=[{"role": "user", "content": "chat-q"}], extra_headers=pinned
                )
            )
            chat_turn = await _new_turn(ws, known)

            async def chat_stream() -> list[str]:
                body = {"model": "assistant", "stream": True, "messages": [{"role": "user", "content": "chat-s"}]}
                async with http.stream("POST", "/v1/chat/completions", json=body, headers=pinned) as r:
                    assert r.status_code == 200
                    return sse_payloads([line async for line in r.aiter_lines()])

            streamed = asyncio.create_task(chat_stream())
            stream_turn = await _new_turn(ws, known)

            async def responses_stream() -> list[Any]:
                events = []
                stream = await client.responses.create(
                    model="assistant", input="resp-s", conversation=conv, stream=True
                )
                async for e in stream:
                    events.append(e)
                return events

            resp = asyncio.create_task(responses_stream())
            resp_turn = await _new_turn(ws, known)

            for turn in (chat_turn, stream_turn, resp_turn):
                cancelled = await ws.request({"type": "cancel", "conversation": conv, "turn_id": turn})
                assert cancelled["cancelled"] is True, cancelled

            with pytest.raises(openai.ConflictError) as info:
                await asyncio.wait_for(chat, 10)
            validate("ErrorResponse", info.value.response.json())
            assert info.value.body["code"] == "turn_cancelled"  # type: ignore[index]
            assert info.value.response.headers["x-should-retry"] == "false"
            assert info.value.response.headers["x-conversation-id"] == conv

            payloads = await asyncio.wait_for(streamed, 10)
            assert payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])
            assert error["error"]["code"] == "turn_cancelled", payloads
            assert not any('"finish_reason":"stop"' in p.replace(" ", "") for p in payloads)

            events = await asyncio.wait_for(resp, 10)
            last = events[-1]
            validate("ResponseStreamEvent", last.model_dump(mode="json", exclude_unset=True))
            assert last.type == "response.incomplete" and last.response.status == "cancelled", last
            kept = await client.responses.retrieve(last.response.id)
            assert kept.status == "cancelled"

            await ws.request({"type": "cancel", "conversation": conv})
            await ws.terminal(ack["turn_id"], timeout=15)  # the cancel is acked before the turn's commit
            assert user_texts(srv, conv) == ["/slow 200"]  # the dropped inputs wrote nothing
        finally:
            await client.close()
            await http.aclose()
            await ws.close()

    asyncio.run(go())


def test_a_running_turn_cancelled_from_the_websocket_keeps_its_text_and_says_cancelled(srv: ServeProcess) -> None:
    async def go() -> None:
        ws = await WS.open(srv.url)
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await ws.request({"type": "subscribe", "conversation": conv})

            # Responses stream: ends with the status its stored response and a non-stream answer have
            stream = await client.responses.create(model="assistant", input="/slow 200", conversation=conv, stream=True)
            events: list[Any] = []
            async for e in stream:
                events.append(e)
                if e.type == "response.output_text.delta":
                    break
            await ws.request({"type": "cancel", "conversation": conv})
            async for e in stream:
                events.append(e)
            last = events[-1]
            validate("ResponseStreamEvent", last.model_dump(mode="json", exclude_unset=True))
            assert last.type == "response.incomplete" and last.response.status == "cancelled", last
            assert last.response.error is None
            (msg,) = last.response.output
            assert msg.status == "incomplete" and msg.content[0].text.startswith("w1")  # type: ignore[union-attr]
            assert (await client.responses.retrieve(last.response.id)).status == "cancelled"

            # chat, non-stream, cancelled after it showed text: that text, as a 200
            known = {f["snapshot"]["turn_id"] for f in ws.seen if f["type"] == "turn_updated"}
            chat = asyncio.create_task(
                client.chat.completions.create(
                    model="assistant",
                    messages=[{"role": "user", "content": "/slow 200"}],
                    extra_headers={"X-Conversation-Id": conv},
                )
            )
            turn = await _new_turn(ws, known)
            await ws.expect(
                lambda f: (
                    f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn and bool(f["snapshot"]["blocks"])
                )
            )
            await asyncio.sleep(0.2)
            await ws.request({"type": "cancel", "conversation": conv})
            done = await asyncio.wait_for(chat, 10)
            validate("CreateChatCompletionResponse", done.model_dump(mode="json", exclude_unset=True))
            assert (done.choices[0].message.content or "").startswith("w1")
        finally:
            await client.close()
            await ws.close()

    asyncio.run(go())


def test_a_cancelled_turns_reply_frees_its_idempotency_key(srv: ServeProcess) -> None:
    """docs/openai.md: only an answer is kept under a key; after a cancelled turn the key is free
    and a repeat runs anew. A turn cancelled from the WebSocket after it showed text was answered
    200 with that text, and kept: the repeat replayed the cancelled reply (Responses, chat, streams)."""

    async def cancelled_once(ws: WS, known: set[str], conv: str, send: Any) -> None:
        task = asyncio.create_task(send)
        turn = await _new_turn(ws, known)
        await ws.expect(
            lambda f: f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn and bool(f["snapshot"]["blocks"])
        )
        await ws.request({"type": "cancel", "conversation": conv, "turn_id": turn})
        await asyncio.wait_for(task, 10)

    async def go() -> None:
        ws = await WS.open(srv.url)
        http = httpx.AsyncClient(base_url=srv.url, timeout=20)
        try:
            conv = (await ws.request({"type": "create_conversation", "agent": "assistant"}))["conversation"]["id"]
            await ws.request({"type": "subscribe", "conversation": conv})
            known: set[str] = set()
            cases = [
                ("/v1/responses", {"model": "assistant", "input": "/slow 200", "conversation": conv}),
                ("/v1/responses", {"model": "assistant", "input": "/slow 200", "conversation": conv, "stream": True}),
                (
                    "/v1/chat/completions",
                    {"model": "assistant", "messages": [{"role": "user", "content": "/slow 200"}]},
                ),
                (
                    "/v1/chat/completions",
                    {"model": "assistant", "messages": [{"role": "user", "content": "/slow 200"}], "stream": True},
                ),
            ]
            for n, (path, body) in enumerate(cases):
                headers = {"Idempotency-Key": f"cancelled-{n}", "X-Conversation-Id": conv}
                await cancelled_once(ws, known, conv, http.post(path, json=body, headers=headers))
                repeat = asyncio.create_task(http.post(path, json=body, headers=headers))
                turn = await _new_turn(ws, known)  # it runs anew: a turn of its own
                await ws.request({"type": "cancel", "conversation": conv, "turn_id": turn})
                again = await asyncio.wait_for(repeat, 10)
                assert again.headers.get("Idempotent-Replayed") is None, (path, body.get("stream"), again.text[:200])
        finally:
            await http.aclose()
            await ws.close()

    asyncio.run(go())
