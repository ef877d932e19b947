"""Idempotency-Key findings of the s36 re-test on the OpenAI surface (I):

F1. A keyed request answering client tool calls (chat: `tool` messages; Responses:
    `function_call_output` items) into a conversation pinned with `X-Conversation-Id`, whose
    resumed turn a stop (SIGTERM), a crash (SIGKILL) or the client leaving cut off, was refused
    when repeated with the same key and body: 400 `already_resolved` ("another request answered
    it first"), so the tool round could never be answered; after a SIGKILL the stored result was
    the server's "outcome unknown" text instead of the client's. The repeat now re-runs that
    resumption once (the results held once, the cut-off reply out of the model's view), a crash
    keeps the client's delivered result, and other answers or another key are refused as before.
F2. A chat history `tool_calls` entry of type `custom` was accepted and silently dropped (a `tool`
    message answering it: 400 `unknown_tool_call`). Custom tools are not supported: now a 400
    naming `messages[i].tool_calls[k].type`, code `unsupported_tool` as for `tools`.

Real parts: `appserver serve` on SQLite (stopped with SIGTERM or SIGKILL), httpx, and a fake OpenAI
upstream on loopback (tests/fakes/openai_upstream.py) that makes the tool call and records what
the model was sent.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

T = 30.0
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
RESULT = "RESULT-42"


def _rows(home: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql, args).fetchall()


def _messages(home: Path) -> list[tuple[str, str, str]]:
    """(role, text, completion_status) of every stored message, in order."""
    rows = _rows(home, "SELECT role, content, completion_status FROM messages ORDER BY id")
    return [(r, json.loads(c) if c.startswith('"') else c, s) for r, c, s in rows]


def _upstream(calls: list[RecordedRequest], slow: int = 1) -> Any:
    """The model: first the client call `lookup`, then `slow` slow streams of words (cut off under
    them), then a short answer to each later call."""

    def reply(req: RecordedRequest) -> Reply:
        calls.append(req)
        if len(calls) == 1:
            call = {"index": 0, "id": "call_abc", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            return Reply(
                pieces=[openai_sse([chunk(role="assistant", tool_calls=[call]), chunk(finish_reason="tool_calls")])]
            )
        if len(calls) <= 1 + slow:
            words = [chunk(role="assistant", content="partial")] + [chunk(content=f" p{i}") for i in range(300)]
            return Reply(pieces=[openai_sse([c], done=False) for c in words], delay_s=0.05)
        text = f"full answer {len(calls)}"
        return Reply(pieces=[openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop")])])

    return reply


def _agent_home(tmp_path: Path, fake: FakeOpenAI) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[providers.up]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
    )
    made = run_cli(home, "agents", "create", "--name", "fk", "--model", "up:m", env=cli_env(home))
    assert made.code == 0, made.err
    return home


def _first_round(sp: ServeProcess, route: str, conversation: str) -> dict[str, Any]:
    """The pinned conversation's first request (the model calls `lookup`), and the body answering it."""
    headers = {"X-Conversation-Id": conversation}
    if route == CHAT:
        tools = [
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
        ]
        asked = [{"role": "user", "content": "look it up"}]
        r = httpx.post(
            f"{sp.url}{CHAT}", json={"model": "fk", "messages": asked, "tools": tools}, headers=headers, timeout=T
        )
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        answered = [
            *asked,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": RESULT},
        ]
        return {"model": "fk", "messages": answered, "tools": tools, "stream": True}
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    r = httpx.post(
        f"{sp.url}{RESPONSES}", json={"model": "fk", "input": "look it up", "tools": tools}, headers=headers, timeout=T
    )
    assert r.status_code == 200, r.text
    call = next(o for o in r.json()["output"] if o["type"] == "function_call")
    output = [{"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}]
    return {"model": "fk", "input": output, "tools": tools, "stream": True}


def _cut_off(
    home: Path, sp: ServeProcess, route: str, body: dict[str, Any], headers: dict[str, str], mode: str
) -> ServeProcess:
    """The keyed answers sent; their resumed turn's reply cut off once it has some text: by the
    client leaving (`cut`), or by a SIGTERM / SIGKILL (the server started again). The server to
    retry on."""
    if mode == "cut":
        with httpx.stream("POST", f"{sp.url}{route}", json=body, headers=headers, timeout=T) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += ("p1" in line) or ("p2" in line)
                if seen:
                    break
        wait_for(lambda: _rows(home, "SELECT 1 FROM turns WHERE status = 'cancelled'"), 20, "the turn cancelled")
        return sp

    def send() -> None:
        try:
            httpx.post(f"{sp.url}{route}", json=body, headers=headers, timeout=T)
        except httpx.HTTPError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        wait_for(
            lambda: _rows(home, "SELECT 1 FROM turns WHERE status = 'running' AND draft IS NOT NULL"),
            20,
            "a draft of the reply",
        )
    finally:
        sp.stop(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
    sender.join(10)
    return start_serve(home)


def _answer_text(route: str, r: httpx.Response) -> str:
    """The text of a stream's answer (chat chunks or Responses events)."""
    out = []
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if route == CHAT:
            out += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        elif event.get("type") == "response.output_text.delta":
            out.append(event["delta"])
    return "".join(out)


@pytest.mark.parametrize(
    ("route", "mode"),
    [(CHAT, "term"), (CHAT, "kill"), (CHAT, "cut"), (RESPONSES, "term"), (RESPONSES, "kill"), (RESPONSES, "cut")],
)
def test_a_keyed_retry_of_tool_results_reruns_the_cut_off_resumption(tmp_path: Path, route: str, mode: str) -> None:
    calls: list[RecordedRequest] = []
    with FakeOpenAI() as fake:
        fake.responder = _upstream(calls)
        home = _agent_home(tmp_path, fake)
        conversation = f"s36i-{uuid.uuid4().hex[:8]}"
        headers = {"X-Conversation-Id": conversation, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        sp = start_serve(home)
        try:
            body = _first_round(sp, route, conversation)
            sp = _cut_off(home, sp, route, body, headers, mode)
            # the client's delivered result is the stored one, whatever cut the turn off
            tools = [m for m in _messages(home) if m[0] == "tool"]
            assert tools == [("tool", RESULT, "completed")], tools

            # another key with the same answers, or the same key with other answers: refused as before
            other = {**headers, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
            for h, b in ((other, body), (headers, _with_result(route, body, "OTHER"))):
                r = httpx.post(f"{sp.url}{route}", json=b, headers=h, timeout=T)
                assert r.status_code in (400, 409), r.text
                assert r.json()["error"]["code"] in ("already_resolved", "idempotency_key_reused"), r.text

            again = httpx.post(f"{sp.url}{route}", json=body, headers=headers, timeout=T)
            assert again.status_code == 200, again.text
            assert again.headers.get("idempotent-replayed") is None
            assert _answer_text(route, again) == "full answer 3", again.text
            assert len(calls) == 3  # the tool call, the cut-off reply, the re-run
            sent = calls[-1].json["messages"]
            assert [m["role"] for m in sent if m["role"] != "system"] == ["user", "assistant", "tool"], sent
            assert [m["content"] for m in sent if m["role"] == "tool"] == [RESULT], sent
            assert "partial" not in json.dumps(sent)  # not its own cut-off answer
            stored = _messages(home)
            assert [m[0] for m in stored if m[0] in ("user", "tool")] == ["user", "tool"], stored
            assert stored[-1] == ("assistant", "full answer 3", "completed"), stored

            replay = httpx.post(f"{sp.url}{route}", json=body, headers=headers, timeout=T)
            assert replay.headers.get("idempotent-replayed") == "true", replay.text
            assert len(calls) == 3

            # the next turn: the model sees the answer, not the cut-off reply
            nxt = {"model": "fk", "messages": [{"role": "user", "content": "next"}]}
            r = httpx.post(f"{sp.url}{CHAT}", json=nxt, headers={"X-Conversation-Id": conversation}, timeout=T)
            assert r.status_code == 200, r.text
            sent = calls[-1].json["messages"]
            assert "partial" not in json.dumps(sent), sent
            assert [m["content"] for m in sent if m["role"] == "user"] == ["look it up", "next"], sent
        finally:
            sp.stop()


def test_a_second_crash_of_the_rerun_is_rerun_again(tmp_path: Path) -> None:
    """SIGKILL under the resumed turn, and again under the keyed retry's re-run: a third attempt
    with the key re-runs once more, the results and input held once."""
    calls: list[RecordedRequest] = []
    with FakeOpenAI() as fake:
        fake.responder = _upstream(calls, slow=2)
        home = _agent_home(tmp_path, fake)
        conversation = f"s36i-{uuid.uuid4().hex[:8]}"
        headers = {"X-Conversation-Id": conversation, "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        sp = start_serve(home)
        try:
            body = _first_round(sp, CHAT, conversation)
            sp = _cut_off(home, sp, CHAT, body, headers, "kill")
            sp = _cut_off(home, sp, CHAT, body, headers, "kill")
            assert len(calls) == 3
            again = httpx.post(f"{sp.url}{CHAT}", json=body, headers=headers, timeout=T)
            assert again.status_code == 200, again.text
            assert _answer_text(CHAT, again) == "full answer 4", again.text
            sent = calls[-1].json["messages"]
            assert [m["role"] for m in sent if m["role"] != "system"] == ["user", "assistant", "tool"], sent
            assert "partial" not in json.dumps(sent)
            stored = _messages(home)
            assert [m for m in stored if m[0] in ("user", "tool")] == [
                ("user", "look it up", "completed"),
                ("tool", RESULT, "completed"),
            ], stored
            statuses = [s for (s,) in _rows(home, "SELECT status FROM turns ORDER BY rowid")]
            assert statuses == ["interrupted", "interrupted", "completed"], statuses
        finally:
            sp.stop()


def _with_result(route: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    """`body` answering its call with `text` instead."""
    if route == CHAT:
        return {**body, "messages": [*body["messages"][:-1], {**body["messages"][-1], "content": text}]}
    return {**body, "input": [{**body["input"][0], "output": text}]}


def test_a_custom_tool_call_in_chat_history_is_refused_by_name(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    try:
        fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        custom = {"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}
        for answered in (True, False):
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [custom]},
            ]
            if answered:
                messages.append({"role": "tool", "tool_call_id": "c1", "content": "r"})
            messages.append({"role": "user", "content": "/recall"})
            r = httpx.post(
                f"{sp.url}{CHAT}", json={"model": "assistant", "messages": messages, "tools": [fn]}, timeout=T
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == ("messages[1].tool_calls[0].type", "unsupported_tool"), err
        assert _rows(home, "SELECT count(*) FROM turns") == [(0,)]
    finally:
        sp.stop()
