"""Idempotency-Key gaps a re-attack of s31a found (s31q):

1. A repeat after a crash followed its turn from where its reply started, but not up to where it
   ended: once the turn had moved on (a later request answered the calls the reply asked for), the
   repeat showed that later request's reply too (chat: tool_calls and the later text in one
   message, `finish_reason: stop`). It now ends at the first pause after its start that its route's
   reply ends at (`Idempotency.earlier(ends=...)`, `past_pause`), as the first reply did.
2. A non-stream keyed /v1/responses request killed after its response was stored, before the
   key's answer was: a DELETE of the response did not forget the pending key, and the repeat
   served the deleted text under a new id. The key now names the response before it is stored
   (`_Run.keep` notes it first), so the DELETE makes the repeat answer the 404.

Real parts: `appserver serve` on SQLite (killed with SIGKILL), httpx and the openai SDK, a fake
OpenAI upstream on loopback. A lost answer is written into the database as a kill leaves it, as
tests/test_idempotency_s31a.py does; for 2, where what the request wrote before the kill matters,
SQLite triggers refuse the key's last writes instead (the kill's effect), and the server is then
killed.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(90)

T = 20.0
CHAT_TOOLS = [{"type": "function", "function": {"name": "mytool", "parameters": {"type": "object", "properties": {}}}}]
RESP_TOOLS = [{"type": "function", "name": "mytool", "parameters": {"type": "object", "properties": {}}}]


def _rows(home: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql, args).fetchall()


def _lose_answer(home: Path, key: str) -> None:
    """As tests/test_idempotency_s31a.py: the key pending under a process that is gone."""
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute(
            "UPDATE http_idempotency SET state='pending', status_code=NULL, content_type=NULL, body=NULL,"
            " conversation_id=NULL, owner='999999999:1' WHERE key=?",
            (key,),
        )


def two_calls(req: RecordedRequest) -> Reply:
    """A call of mytool; after its result, text and a second call; after that one's, text."""
    results = sum(m["role"] == "tool" for m in req.json["messages"])
    if results == 0:
        chunks = [chunk(role="assistant", tool_calls=[tool_delta(0, id="call_A1", name="mytool", arguments="{}")])]
    elif results == 1:
        chunks = [
            chunk(role="assistant", content="between"),
            chunk(tool_calls=[tool_delta(0, id="call_B2", name="mytool", arguments="{}")]),
        ]
    else:
        chunks = [chunk(role="assistant", content="all done")]
    finish = "tool_calls" if results < 2 else "stop"
    return Reply(pieces=[openai_sse([*chunks, chunk(finish_reason=finish)])])


@pytest.fixture(scope="module")
def upstream_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home with agent `two` on the fake upstream, made once (the upstream answers each request
    from its own messages alone); each test runs on a copy of it."""
    with FakeOpenAI() as fake:
        fake.responder = two_calls
        home = tmp_path_factory.mktemp("s31q") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.up]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        made = run_cli(home, "agents", "create", "--name", "two", "--model", "up:m", env=cli_env(home))
        assert made.code == 0, made.err
        yield home


@pytest.fixture
def upstream_home(upstream_template: Path, tmp_path: Path) -> Path:
    """A fresh home of this test's own: the template as `agents create` left it (no process has
    it open), so its database holds the agent and no turn yet."""
    home = tmp_path / "home"
    shutil.copytree(upstream_template, home)
    return home


def _chat_reply(r: httpx.Response, stream: bool) -> tuple[str, list[str], str]:
    """(content, tool call ids, finish_reason) of a chat reply, stream or not."""
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        calls = [c["id"] for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"] or "", calls, choice["finish_reason"]
    text, calls, finish = "", [], ""
    for line in r.text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        for choice in json.loads(line.removeprefix("data:"))["choices"]:
            text += choice["delta"].get("content") or ""
            calls += [c["id"] for c in choice["delta"].get("tool_calls") or [] if c.get("id")]
            finish = choice["finish_reason"] or finish
    return text, calls, finish


def _resp_reply(r: httpx.Response, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    """(status, [(item type, text or call id)]) of a Responses reply, stream or not."""
    assert r.status_code == 200, r.text
    resp: dict[str, Any] | None = r.json() if not stream else None
    if stream:
        for line in r.text.splitlines():
            event = json.loads(line.removeprefix("data:")) if line.startswith("data:") else {}
            if event.get("type") in ("response.completed", "response.incomplete", "response.failed"):
                resp = event["response"]
    assert resp is not None, r.text[:500]
    items = [
        (
            o["type"],
            o.get("call_id") or "".join(c.get("text", "") for c in o.get("content") or [] if isinstance(c, dict)),
        )
        for o in resp["output"]
    ]
    return resp["status"], items


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("lost", ["user", "answers"])
def test_a_chat_repeat_after_the_turn_moved_on_ends_where_its_reply_did(
    upstream_home: Path, lost: str, stream: bool
) -> None:
    home = upstream_home
    url = "/v1/chat/completions"
    keys = [f"k{n}-{uuid.uuid4().hex}" for n in (1, 2, 3)]
    sp = start_serve(home)
    try:
        with httpx.Client(base_url=sp.url, timeout=T) as http:
            b1 = {"model": "two", "messages": [{"role": "user", "content": "go"}], "tools": CHAT_TOOLS}
            r1 = http.post(url, json={**b1, "stream": stream}, headers={"Idempotency-Key": keys[0]})
            first = _chat_reply(r1, stream)
            assert first == ("", ["call_A1"], "tool_calls")
            m1 = {"role": "assistant", "tool_calls": [_call("call_A1")]}
            b2 = {**b1, "messages": [*b1["messages"], m1, {"role": "tool", "tool_call_id": "call_A1", "content": "ra"}]}
            r2 = http.post(url, json={**b2, "stream": stream}, headers={"Idempotency-Key": keys[1]})
            second = _chat_reply(r2, stream)
            assert second == ("between", ["call_B2"], "tool_calls")
            m2 = {"role": "assistant", "content": "between", "tool_calls": [_call("call_B2")]}
            b3 = {**b2, "messages": [*b2["messages"], m2, {"role": "tool", "tool_call_id": "call_B2", "content": "rb"}]}
            r3 = http.post(url, json={**b3, "stream": stream}, headers={"Idempotency-Key": keys[2]})
            assert _chat_reply(r3, stream) == ("all done", [], "stop")
    finally:
        sp.stop(signal.SIGKILL)
    key, body, expected = (keys[0], b1, first) if lost == "user" else (keys[1], b2, second)
    _lose_answer(home, key)
    sp = start_serve(home)
    try:
        again = httpx.post(
            f"{sp.url}{url}", json={**body, "stream": stream}, headers={"Idempotency-Key": key}, timeout=T
        )
        # the same reply as the first time: up to the pause it ended at, not on to the later text
        assert _chat_reply(again, stream) == expected
        assert _rows(home, "SELECT count(*) FROM turns") == [(1,)]
    finally:
        sp.stop()


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "mytool", "arguments": "{}"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("lost", ["user", "answers"])
def test_a_responses_repeat_after_the_turn_moved_on_ends_where_its_reply_did(
    upstream_home: Path, lost: str, stream: bool
) -> None:
    home = upstream_home
    key1, key2 = f"k1-{uuid.uuid4().hex}", f"k2-{uuid.uuid4().hex}"
    sp = start_serve(home)
    try:
        with openai.OpenAI(base_url=f"{sp.url}/v1", api_key="unused", max_retries=0, timeout=T) as client:
            body1 = {"model": "two", "input": "go", "tools": RESP_TOOLS, "stream": stream}
            r1 = httpx.post(f"{sp.url}/v1/responses", json=body1, headers={"Idempotency-Key": key1}, timeout=T)
            first = _resp_reply(r1, stream)
            assert first == ("completed", [("function_call", "call_A1")])
            body2 = {
                "model": "two",
                "previous_response_id": _rid(r1, stream),
                "input": [{"type": "function_call_output", "call_id": "call_A1", "output": "ra"}],
                "tools": RESP_TOOLS,
                "stream": stream,
            }
            r2 = httpx.post(f"{sp.url}/v1/responses", json=body2, headers={"Idempotency-Key": key2}, timeout=T)
            second = _resp_reply(r2, stream)
            assert second == ("completed", [("message", "between"), ("function_call", "call_B2")])
            r3 = client.responses.create(
                model="two",
                previous_response_id=_rid(r2, stream),
                input=[{"type": "function_call_output", "call_id": "call_B2", "output": "rb"}],
                tools=RESP_TOOLS,  # type: ignore[arg-type]
            )
            assert r3.output_text == "all done"
    finally:
        sp.stop(signal.SIGKILL)
    key, body, expected = (key1, body1, first) if lost == "user" else (key2, body2, second)
    _lose_answer(home, key)
    sp = start_serve(home)
    try:
        again = httpx.post(f"{sp.url}/v1/responses", json=body, headers={"Idempotency-Key": key}, timeout=T)
        assert _resp_reply(again, stream) == expected
        assert _rows(home, "SELECT count(*) FROM turns") == [(1,)]
    finally:
        sp.stop()


def _rid(r: httpx.Response, stream: bool) -> str:
    if not stream:
        return str(r.json()["id"])
    first = next(line for line in r.text.splitlines() if line.startswith("data:"))
    return str(json.loads(first.removeprefix("data:"))["response"]["id"])


def _kill_after_response_stored(sp: ServeProcess, body: dict[str, Any], key: str) -> str:
    """A keyed non-stream request killed after its response was stored, before its key's answer
    was: triggers refuse every write of the key but its notes (as the kill would have), the
    server is killed, and the id of the response it stored is returned (its client may have
    learned it: the conversation's items, a GET of a later response)."""
    home = sp.home
    with sqlite3.connect(home / "appserver.db") as db:
        db.executescript(
            "CREATE TRIGGER killed_finish BEFORE UPDATE ON http_idempotency WHEN NEW.state='done'"
            " BEGIN SELECT RAISE(ABORT, 'killed'); END;"
            "CREATE TRIGGER killed_drop BEFORE DELETE ON http_idempotency BEGIN SELECT RAISE(ABORT, 'killed'); END;"
        )
    before = {r[0] for r in _rows(home, "SELECT id FROM responses")}
    try:  # its reply, if any, is no concern: the kill came before it
        httpx.post(f"{sp.url}/v1/responses", json=body, headers={"Idempotency-Key": key}, timeout=T)
    except httpx.HTTPError:
        pass
    sp.stop(signal.SIGKILL)
    with sqlite3.connect(home / "appserver.db") as db:
        db.executescript("DROP TRIGGER killed_finish; DROP TRIGGER killed_drop;")
    assert _rows(home, "SELECT state FROM http_idempotency WHERE key=?", key) == [("pending",)]
    (rid,) = {r[0] for r in _rows(home, "SELECT id FROM responses")} - before
    return str(rid)


@pytest.mark.parametrize("kind", ["user", "answer"])
def test_a_non_stream_response_deleted_after_a_crash_answers_its_key_with_the_404(tmp_path: Path, kind: str) -> None:
    home = tmp_path / "home"
    key = f"dl-{uuid.uuid4().hex}"
    sp = start_serve(home)
    try:
        if kind == "user":
            body: dict[str, Any] = {"model": "assistant", "input": "secret words"}
        else:
            r1 = httpx.post(
                f"{sp.url}/v1/responses",
                json={"model": "assistant", "input": "/call mytool {}", "tools": RESP_TOOLS},
                timeout=T,
            ).json()
            call = next(o for o in r1["output"] if o["type"] == "function_call")
            body = {
                "model": "assistant",
                "previous_response_id": r1["id"],
                "tools": RESP_TOOLS,
                "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "secret 42"}],
            }
        rid = _kill_after_response_stored(sp, body, key)
    finally:
        sp.stop(signal.SIGKILL)
    turns = _rows(home, "SELECT count(*) FROM turns")
    sp = start_serve(home)
    try:
        assert httpx.delete(f"{sp.url}/v1/responses/{rid}", timeout=T).status_code == 200
        again = httpx.post(f"{sp.url}/v1/responses", json=body, headers={"Idempotency-Key": key}, timeout=T)
        assert again.status_code == 404, again.text[:300]
        assert again.json()["error"]["code"] == "response_not_found"
        assert _rows(home, "SELECT count(*) FROM turns") == turns  # no new turn, no new response
        assert rid not in {r[0] for r in _rows(home, "SELECT id FROM responses")}
    finally:
        sp.stop()
