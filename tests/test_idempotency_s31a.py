"""Idempotency-Key gaps an outside tester found (s31a):

1. A keyed request ANSWERING tool calls whose server was killed before its answer was stored ran
   the model again on its repeat, in a fork, instead of following the turn its answers resumed:
   only a request with new user input looked for its earlier turn, and the answering one filed no
   kernel key (`keep_answers_key`, `Idempotency.earlier(answered)`).
2. A stream's response DELETEd after such a crash came back under a new id on the key's repeat:
   only keys already `done` forgot it; now the pending key notes the id its stream announced
   (`Idempotency.note_start`), and the DELETE forgets that too.
3. With auth `none`, an HTTP key matched a WebSocket turn filed under the same text in a
   conversation named like the HTTP key scope (`http_turn`).
4. The same key and body sent to another conversation (X-Conversation-Id) replayed the other
   conversation's answer: the header is part of the request now (409 like another body).
5. A WebSocket `idempotency_key: ""` was no key (two copies ran); now `bad_frame`, as HTTP's 400.

Real parts: `appserver serve` on SQLite (killed with SIGKILL), httpx, raw sockets, `websockets`. A
crash that lost a stored answer is written into the database as that kill leaves it (the turn
completed, the key pending under a dead process), as tests/test_idempotency_rerun_s30v.py does;
the DELETE case stalls a real stream's reader instead, since what the stream kept matters there."""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 20.0


def _rows(home: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql, args).fetchall()


def _lose_answer(home: Path, key: str) -> None:
    """The state a SIGKILL leaves when it hits after the key's turn completed, before its answer
    was stored: the key pending under a process that is gone."""
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute(
            "UPDATE http_idempotency SET state='pending', status_code=NULL, content_type=NULL, body=NULL,"
            " conversation_id=NULL, owner='999999999:1' WHERE key=?",
            (key,),
        )


def _sse_output_text(text: str) -> str:
    """The text of a Responses stream's `response.completed` output."""
    for line in text.splitlines():
        if line.startswith("data:"):
            event = json.loads(line.removeprefix("data:"))
            if event.get("type") == "response.completed":
                return _output_text(event["response"])
    raise AssertionError(f"no response.completed in {text[:500]}")


def _output_text(resp: dict[str, Any]) -> str:
    assert not [i for i in resp["output"] if i["type"] == "function_call"], resp["output"]  # after the answered call
    return "".join(
        c.get("text", "") for i in resp["output"] if i["type"] == "message" for c in i["content"] if isinstance(c, dict)
    )


def _chat_answering(url: str, key2: str, stream: bool) -> tuple[dict[str, Any], str]:
    """(the answering request's body, its reply text) after a first keyed request got a tool call."""
    tools = [{"type": "function", "function": {"name": "mytool", "parameters": {"type": "object", "properties": {}}}}]
    first = {"model": "assistant", "messages": [{"role": "user", "content": "/call mytool {}"}], "tools": tools}
    r1 = httpx.post(f"{url}/v1/chat/completions", json=first, headers={"Idempotency-Key": "k1-" + key2}, timeout=T)
    assert r1.status_code == 200, r1.text
    msg = r1.json()["choices"][0]["message"]
    call = msg["tool_calls"][0]
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "the tool says 42"}
    body = {**first, "messages": [*first["messages"], msg, answer], "stream": stream}
    return body, _chat_text(_post(url, "/v1/chat/completions", body, key2), stream)


def _responses_answering(url: str, key2: str, stream: bool) -> tuple[dict[str, Any], str]:
    tools = [{"type": "function", "name": "mytool", "parameters": {"type": "object", "properties": {}}}]
    first = {"model": "assistant", "input": "/call mytool {}", "tools": tools}
    r1 = httpx.post(f"{url}/v1/responses", json=first, headers={"Idempotency-Key": "k1-" + key2}, timeout=T)
    assert r1.status_code == 200, r1.text
    call = next(o for o in r1.json()["output"] if o["type"] == "function_call")
    body = {
        "model": "assistant",
        "previous_response_id": r1.json()["id"],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "the tool says 42"}],
        "tools": tools,
        "stream": stream,
    }
    return body, _responses_text(_post(url, "/v1/responses", body, key2), stream)


def _post(url: str, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json=body, headers={"Idempotency-Key": key}, timeout=T)
    assert r.status_code == 200, r.text
    return r


def _chat_text(r: httpx.Response, stream: bool) -> str:
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    out = []
    for line in r.text.splitlines():
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            for choice in json.loads(line.removeprefix("data:"))["choices"]:
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


def _responses_text(r: httpx.Response, stream: bool) -> str:
    return _sse_output_text(r.text) if stream else _output_text(r.json())


@pytest.mark.parametrize(
    ("route", "stream"),
    [("chat", False), ("chat", True), ("responses", False), ("responses", True)],
)
def test_a_repeat_of_answers_after_a_crash_follows_the_turn_they_resumed(
    tmp_path: Path, route: str, stream: bool
) -> None:
    home = tmp_path / "home"
    key2 = "k2-" + uuid.uuid4().hex
    sp = start_serve(home)
    try:
        answering = _chat_answering if route == "chat" else _responses_answering
        body, text = answering(sp.url, key2, stream)
        assert "42" in text, text
    finally:
        sp.stop(signal.SIGKILL)
    _lose_answer(home, key2)
    sp = start_serve(home)
    try:
        path = "/v1/chat/completions" if route == "chat" else "/v1/responses"
        again = _post(sp.url, path, body, key2)
        # the turn the answers resumed, followed: no second run in a fork of the conversation
        assert _rows(home, "SELECT count(*) FROM turns") == [(1,)]
        assert _rows(home, "SELECT count(*) FROM conversations") == [(1,)]
        got = _chat_text(again, stream) if route == "chat" else _responses_text(again, stream)
        assert got == text
    finally:
        sp.stop()


def _stalled_stream(sp: ServeProcess, key: str) -> tuple[socket.socket, str]:
    """A keyed Responses stream whose reader reads nothing after `response.created`: its long echo
    fills the socket, and the stream cannot end (nor store its answer) before the kill."""
    body = {"model": "assistant", "input": " ".join(f"w{i}" for i in range(150000)), "stream": True}
    raw = json.dumps(body).encode()
    host, port = sp.url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(T)
    s.connect((host, int(port)))
    s.sendall(
        f"POST /v1/responses HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    head = b""
    while (m := re.search(rb'"id":"(resp_[0-9a-f]+)"', head)) is None:
        got = s.recv(2048)
        assert got, head
        head += got
    return s, m.group(1).decode()


def test_a_stream_response_deleted_after_a_crash_answers_its_key_with_the_404(tmp_path: Path) -> None:
    home = tmp_path / "home"
    key = "dr-" + uuid.uuid4().hex
    sp = start_serve(home)
    try:
        sock, rid = _stalled_stream(sp, key)
        wait_for(lambda: _rows(home, "SELECT 1 FROM turns WHERE status='completed'"), 60, "the turn completed")
        assert _rows(home, "SELECT state FROM http_idempotency") == [("pending",)]
    finally:
        sp.stop(signal.SIGKILL)
    sock.close()
    sp = start_serve(home)
    try:
        assert httpx.delete(f"{sp.url}/v1/responses/{rid}", timeout=T).status_code == 200
        body = {"model": "assistant", "input": " ".join(f"w{i}" for i in range(150000)), "stream": True}
        again = httpx.post(f"{sp.url}/v1/responses", json=body, headers={"Idempotency-Key": key}, timeout=60)
        assert again.status_code == 404, again.text[:300]
        assert again.json()["error"]["code"] == "response_not_found"
        assert _rows(home, "SELECT count(*) FROM turns") == [(1,)]
    finally:
        sp.stop()


async def test_an_http_key_never_follows_a_websocket_turn(tmp_path: Path) -> None:
    """Auth `none`: the local owner's WebSocket keys are unprefixed and filed under the conversation
    id; one named like the HTTP key scope (`http:none:local`) once handed its turn to HTTP."""
    sp = start_serve(tmp_path / "home")
    try:
        made = httpx.post(
            f"{sp.url}/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "make it"}]},
            headers={"X-Conversation-Id": "http:none:local"},
            timeout=T,
        )
        assert made.headers["x-conversation-id"] == "http:none:local"
        key = "kk-" + uuid.uuid4().hex
        submit = {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "http:none:local",
            "input": "WS ONLY TEXT",
            "idempotency_key": key,
        }
        ws = await WS.open(sp.url, open_timeout=T)
        ack = await ws.request(submit, T)
        assert ack["type"] == "ack", ack
        await ws.terminal(ack["turn_id"], T)
        r = httpx.post(
            f"{sp.url}/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "a fresh http question"}]},
            headers={"Idempotency-Key": key},
            timeout=T,
        )
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert "a fresh http question" in content and "WS ONLY" not in content, content
        again = await ws.request(submit, T)  # the WebSocket key still names its turn
        assert (again["type"], again.get("turn_id"), again.get("duplicate")) == ("ack", ack["turn_id"], True)
        await ws.close()
    finally:
        sp.stop()


def test_the_same_key_and_body_for_another_conversation_is_another_request(tmp_path: Path) -> None:
    sp = start_serve(tmp_path / "home")
    try:
        url = f"{sp.url}/v1/chat/completions"
        for conv, text in (("convA", "alpha secret"), ("convB", "beta")):
            msgs = [{"role": "user", "content": text}]
            made = httpx.post(url, json={"model": "assistant", "messages": msgs}, headers={"X-Conversation-Id": conv})
            assert made.status_code == 200, made.text
        key = uuid.uuid4().hex
        body = {"model": "assistant", "messages": [{"role": "user", "content": "/recall"}]}
        a = httpx.post(url, json=body, headers={"X-Conversation-Id": "convA", "Idempotency-Key": key}, timeout=T)
        assert a.status_code == 200, a.text
        b = httpx.post(url, json=body, headers={"X-Conversation-Id": "convB", "Idempotency-Key": key}, timeout=T)
        assert b.status_code == 409, b.text
        assert b.json()["error"]["code"] == "idempotency_key_reused"
        none = httpx.post(url, json=body, headers={"Idempotency-Key": key}, timeout=T)
        assert none.status_code == 409, none.text
        same = httpx.post(url, json=body, headers={"X-Conversation-Id": "convA", "Idempotency-Key": key}, timeout=T)
        assert same.headers.get("idempotent-replayed") == "true"
        assert same.json() == a.json()
    finally:
        sp.stop()


async def test_an_empty_websocket_key_is_a_bad_frame(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    try:
        ws = await WS.open(sp.url, open_timeout=T)
        submit = {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "hi"}
        refused = await ws.request({**submit, "idempotency_key": ""}, T)
        assert (refused["type"], refused.get("code"), refused.get("param")) == ("error", "bad_frame", "idempotency_key")
        assert _rows(home, "SELECT count(*) FROM turns") == [(0,)]
        await ws.close()
    finally:
        sp.stop()
