"""Idempotency-Key findings of the s36 attack on the OpenAI surface (A):

F1. A keyed request whose turn a server stop (SIGTERM: 503 `server_shutting_down`, "retry once the
    server is back") or crash (SIGKILL) cut off, repeated after the restart into the same
    conversation, ran a new turn that added the user's input a second time: the model (and
    `conversations history`) saw the question twice, with the cut-off answer between. The repeat
    now re-runs the interrupted turn's input (`Kernel._rerun`): the conversation holds it once, the
    cut-off reply stays in the history (as what was shown) but out of the model's view
    (`history.model_view`), and a repeat after that replays; two repeats racing run it once.
F5. Two `Idempotency-Key` (or `X-Conversation-Id`) headers in one request: the first silently won.
    Now a 400 naming the header on both routes, nothing run; two `Content-Encoding` headers are one
    list of codings (a gzip named in the second is not passed over).

Real parts: `appserver serve` on SQLite (stopped with SIGTERM or SIGKILL), httpx, the echo model
and a fake OpenAI upstream on loopback (tests/fakes/openai_upstream.py) recording what the model
was sent.
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


def _rows(home: Path, sql: str, *args: Any) -> list[Any]:
    with sqlite3.connect(home / "appserver.db", timeout=10) as db:
        return db.execute(sql, args).fetchall()


def _messages(home: Path, conversation: str) -> list[tuple[str, str, str]]:
    """(role, text, completion_status) of the conversation's stored messages, in order."""
    rows = _rows(
        home,
        "SELECT m.role, m.content, m.completion_status FROM messages m JOIN conversations c"
        " ON c.id = m.conversation_id WHERE c.id = ? OR c.id LIKE ? ORDER BY m.id",
        conversation,
        f"{conversation}~%",
    )
    return [
        (role, json.loads(content) if content.startswith('"') else content, status) for role, content, status in rows
    ]


def _recall(sp: ServeProcess, conversation: str) -> str:
    """What the echo model was given as the conversation's earlier user messages."""
    r = httpx.post(
        f"{sp.url}{CHAT}",
        json={"model": "assistant", "messages": [{"role": "user", "content": "/recall"}]},
        headers={"X-Conversation-Id": conversation},
        timeout=T,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _post_in_background(url: str, body: dict[str, Any], headers: dict[str, str]) -> threading.Thread:
    """The first attempt: its answer (if any) is no concern, its server is stopped under it."""

    def send() -> None:
        try:
            httpx.post(url, json=body, headers=headers, timeout=T)
        except httpx.HTTPError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


# ---------------------------------------------------------------- F5


def test_repeated_idempotency_key_conversation_and_encoding_headers_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home)
    try:
        with httpx.Client(base_url=sp.url, timeout=T) as http:
            bodies = {
                CHAT: {"model": "assistant", "messages": [{"role": "user", "content": "dup"}]},
                RESPONSES: {"model": "assistant", "input": "dup"},
            }
            for path, body in bodies.items():
                for name, code in (
                    ("Idempotency-Key", "invalid_idempotency_key"),
                    ("X-Conversation-Id", "invalid_conversation_id"),
                ):
                    r = http.post(path, json=body, headers=[(name, "a-1"), (name, "b-2")])
                    assert r.status_code == 400, (path, name, r.status_code, r.text)
                    err = r.json()["error"]
                    assert (err["code"], err["param"]) == (code, name), err
                    assert name in err["message"]
                # a gzip named in a second Content-Encoding header is a coding like the first's
                r = http.post(
                    path,
                    content=json.dumps(body).encode(),
                    headers=[
                        ("Content-Type", "application/json"),
                        ("Content-Encoding", "identity"),
                        ("Content-Encoding", "gzip"),
                    ],
                )
                assert r.status_code == 415, (path, r.status_code, r.text)
                assert r.json()["error"]["code"] == "unsupported_content_encoding"
            assert _rows(home, "SELECT count(*) FROM turns") == [(0,)]  # nothing ran
            # one of each is as ever
            r = http.post(
                CHAT,
                json=bodies[CHAT],
                headers={"Idempotency-Key": "one", "X-Conversation-Id": "c-one", "Content-Encoding": "identity"},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-conversation-id"] == "c-one"
    finally:
        sp.stop()


# ---------------------------------------------------------------- F1


def _kill_while_replying(home: Path, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """The keyed request sent to a new server of `home`, killed (SIGKILL) once its turn runs with
    some of its reply saved (a draft: the kill leaves that text in the history)."""
    sp = start_serve(home)
    sender = _post_in_background(f"{sp.url}{url}", body, headers)
    try:
        wait_for(
            lambda: _rows(home, "SELECT 1 FROM turns WHERE status='running' AND draft IS NOT NULL"),
            20,
            "a draft of the reply",
        )
    finally:
        sp.stop(signal.SIGKILL)
    sender.join(10)


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_a_keyed_retry_after_a_kill_keeps_the_input_once(tmp_path: Path, route: str) -> None:
    """SIGKILL mid-turn (the echo model, its reply partly shown), restart, the same request with
    the same key into the same conversation, killed again mid-turn, restart, once more: one user
    message, the model given it once; the answer replayed after that."""
    home = tmp_path / "home"
    conversation = f"s36a-{uuid.uuid4().hex[:8]}"
    headers = {"Idempotency-Key": f"k-{uuid.uuid4().hex}", "X-Conversation-Id": conversation}
    if route == CHAT:
        body: dict[str, Any] = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 30"}]}
    else:
        body = {"model": "assistant", "input": "/slow 30"}
    _kill_while_replying(home, route, body, headers)
    _kill_while_replying(home, route, body, headers)  # the retry's own turn: a crash again
    sp = start_serve(home)
    try:
        again = httpx.post(f"{sp.url}{route}", json=body, headers=headers, timeout=T)
        assert again.status_code == 200, again.text
        assert again.headers.get("idempotent-replayed") is None
        reply = again.json()
        text = reply["choices"][0]["message"]["content"] if route == CHAT else reply["output"][0]["content"][0]["text"]
        assert text == " ".join(f"w{i}" for i in range(1, 31))
        stored = _messages(home, conversation)
        assert [m for m in stored if m[0] == "user"] == [("user", "/slow 30", "completed")], stored
        assert [m[2] for m in stored if m[0] == "assistant"] == ["interrupted", "interrupted", "completed"], stored
        assert stored[0][0] == "user" and stored[-1] == ("assistant", text, "completed"), stored
        statuses = [s for (s,) in _rows(home, "SELECT status FROM turns ORDER BY rowid")]
        assert statuses == ["interrupted", "interrupted", "completed"]
        assert _recall(sp, conversation) == "/slow 30"  # the model: the question once
        replay = httpx.post(f"{sp.url}{route}", json=body, headers=headers, timeout=T)
        assert replay.headers.get("idempotent-replayed") == "true"
        assert replay.content == again.content
    finally:
        sp.stop()


def _slow_then_quick(calls: list[int]) -> Any:
    """The upstream's replies: the first a slow stream of words (the server is stopped under it),
    each later one a short answer."""

    def reply(req: RecordedRequest) -> Reply:
        calls.append(1)
        if len(calls) == 1:
            words = [chunk(role="assistant", content="partial")] + [chunk(content=f" p{i}") for i in range(200)]
            pieces = [openai_sse([c], done=False) for c in words]
            return Reply(pieces=pieces, delay_s=0.05)
        return Reply(pieces=[openai_sse([chunk(role="assistant", content="full answer"), chunk(finish_reason="stop")])])

    return reply


def test_a_keyed_stream_retry_after_a_stop_runs_the_input_once_without_the_cut_off_reply(tmp_path: Path) -> None:
    """SIGTERM mid-stream (/v1/responses, stream; the server's 503 asks for the retry), restart,
    two identical keyed retries at once: one new turn; the model is sent the user's input once and
    not its own cut-off reply; the conversation keeps the input once."""
    calls: list[int] = []
    with FakeOpenAI() as fake:
        fake.responder = _slow_then_quick(calls)
        home = tmp_path / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.up]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        made = run_cli(home, "agents", "create", "--name", "fk", "--model", "up:m", env=cli_env(home))
        assert made.code == 0, made.err
        conversation = f"s36a-{uuid.uuid4().hex[:8]}"
        headers = {"Idempotency-Key": f"k-{uuid.uuid4().hex}", "X-Conversation-Id": conversation}
        body = {"model": "fk", "input": "write the report", "stream": True}
        sp = start_serve(home)
        sender = _post_in_background(f"{sp.url}{RESPONSES}", body, headers)
        try:
            wait_for(lambda: _rows(home, "SELECT 1 FROM turns WHERE draft IS NOT NULL"), 20, "a draft of the reply")
        finally:
            sp.stop(signal.SIGTERM)
        sender.join(10)
        stopped = _messages(home, conversation)
        assert stopped[0] == ("user", "write the report", "completed")
        assert stopped[-1][0] == "assistant" and stopped[-1][2] == "interrupted", stopped

        sp = start_serve(home)
        try:
            answers: list[httpx.Response] = []

            def retry() -> None:
                answers.append(httpx.post(f"{sp.url}{RESPONSES}", json=body, headers=headers, timeout=T))

            racing = [threading.Thread(target=retry, daemon=True) for _ in range(2)]
            for t in racing:
                t.start()
            for t in racing:
                t.join(T)
            assert len(answers) == 2 and all(a.status_code == 200 for a in answers), [a.text for a in answers]
            assert all("response.completed" in a.text and "full answer" in a.text for a in answers)
            assert answers[0].content == answers[1].content  # the later one: the first's stream, replayed
            assert len(calls) == 2  # the cut-off call, and the re-run's: one for both retries
            sent = fake.requests[-1].json["messages"]
            assert [m["content"] for m in sent if m["role"] == "user"] == ["write the report"], sent
            assert not [m for m in sent if m["role"] == "assistant"], sent  # not its own cut-off answer
            stored = _messages(home, conversation)
            assert [m for m in stored if m[0] == "user"] == [("user", "write the report", "completed")], stored
            assert stored[-1] == ("assistant", "full answer", "completed"), stored
            assert [s for (s,) in _rows(home, "SELECT status FROM turns ORDER BY rowid")] == [
                "interrupted",
                "completed",
            ]
        finally:
            sp.stop()
