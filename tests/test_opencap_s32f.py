"""A request refused 429 `too_many_open_turns` writes nothing, also one that answers tool calls
(session 32, an outside tester's report). A request answering calls takes no place when all are
taken (the paused turn it resumes holds one); when its answers go to a conversation written
paused for them (a fork of a round answered before, a transcript whose calls this server never
issued), that turn would be open past the cap: it was refused, but only after the fork or seeded
conversation was written, leaving it and a cancelled turn behind, one per refused request, so a
client held at the cap could grow the store without bound. Now it is refused before anything is
written, its Idempotency-Key is free again (a repeat runs once a place is free), and no place leaks.

A real `appserver serve --auth token` (SQLite) with `open_turns_per_client = 3`, real tokens, real
HTTP over loopback, the echo model (`/call f {}`: a client call to `f`; a result `R` is echoed as
`f -> R`), chat completions and Responses, stream and non-stream.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0
CAP = 3
TABLES = ("conversations", "turns", "messages", "pending_calls", "responses", "history_points", "http_idempotency")
F_RESP = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
F_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("cap32f") / "home"
    home.mkdir(parents=True)
    env = cli_env(home, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp


class Caller:
    """One credential of its own (the cap counts per credential) on the server."""

    def __init__(self, sp: ServeProcess) -> None:
        self.sp = sp
        token = TokenStore(sp.home).create(name=f"c-{uuid.uuid4().hex[:8]}")[1]
        self.http = httpx.Client(base_url=sp.url, timeout=T, headers={"Authorization": f"Bearer {token}"})

    def post(self, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        return self.http.post(path, json=body, headers=headers)

    def paused(self) -> dict[str, Any]:
        """A response whose turn pauses at a client call of `f` (open, holding a place, until answered)."""
        r = self.post("/v1/responses", {"model": "assistant", "input": "/call f {}", "tools": [F_RESP]})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def answer(self, resp: dict[str, Any], output: str, **extra: Any) -> httpx.Response:
        call = next(o for o in resp["output"] if o["type"] == "function_call")
        body = {
            "model": "assistant",
            "previous_response_id": resp["id"],
            "tools": [F_RESP],
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": output}],
            **extra,
        }
        return self.post("/v1/responses", body)


def _counts(home: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as c:
        return {t: int(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in TABLES}  # noqa: S608


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_open_turns", r.text
    assert r.headers.get("x-should-retry") == "false"
    assert "x-conversation-id" not in r.headers  # no conversation to name


def _chat_answer(call_id: str, user: str = "/call f {}") -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "R"},
    ]


def _chat_fork(c: Caller) -> tuple[str, dict[str, Any], dict[str, str]]:
    """A chat tool round answered once already: sending its answer again forks."""
    user = f"/call f {{}}\n{uuid.uuid4().hex}"
    first = c.post(
        "/v1/chat/completions",
        {"model": "assistant", "messages": [{"role": "user", "content": user}], "tools": [F_CHAT]},
    )
    assert first.status_code == 200, first.text
    call_id = first.json()["choices"][0]["message"]["tool_calls"][0]["id"]
    body = {"model": "assistant", "messages": _chat_answer(call_id, user), "tools": [F_CHAT]}
    done = c.post("/v1/chat/completions", body)
    assert done.status_code == 200 and "f -> R" in done.text, done.text
    return "/v1/chat/completions", body, {}


def _chat_imported(c: Caller) -> tuple[str, dict[str, Any], dict[str, str]]:
    """A transcript answering a call this server never issued: seeded as a new conversation."""
    body = {"model": "assistant", "messages": _chat_answer(f"call_imp{uuid.uuid4().hex[:8]}"), "tools": [F_CHAT]}
    return "/v1/chat/completions", body, {}


def _chat_header_new(c: Caller) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The same, into a conversation of its own (`X-Conversation-Id: new`)."""
    path, body, _ = _chat_imported(c)
    return path, body, {"X-Conversation-Id": "new"}


def _responses_fork(c: Caller) -> tuple[str, dict[str, Any], dict[str, str]]:
    """An answer to a response whose call was answered already: a fork of it."""
    first = c.paused()
    done = c.answer(first, "R")
    assert done.status_code == 200 and done.json()["status"] == "completed", done.text
    call = next(o for o in first["output"] if o["type"] == "function_call")
    body = {
        "model": "assistant",
        "previous_response_id": first["id"],
        "tools": [F_RESP],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "R"}],
    }
    return "/v1/responses", body, {}


def _responses_imported(c: Caller) -> tuple[str, dict[str, Any], dict[str, str]]:
    """A whole transcript answering a call this server never issued: seeded as a new conversation."""
    call_id = f"call_imp{uuid.uuid4().hex[:8]}"
    body = {
        "model": "assistant",
        "tools": [F_RESP],
        "input": [
            {"role": "user", "content": "/call f {}"},
            {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "R"},
        ],
    }
    return "/v1/responses", body, {}


CASES = {
    "chat-fork": _chat_fork,
    "chat-imported": _chat_imported,
    "chat-header-new": _chat_header_new,
    "responses-fork": _responses_fork,
    "responses-imported": _responses_imported,
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_answer_refused_at_the_cap_writes_nothing_and_frees_its_key(
    srv: ServeProcess, case: str, stream: bool
) -> None:
    c = Caller(srv)
    path, body, headers = CASES[case](c)
    body = {**body, "stream": stream}
    held = [c.paused() for _ in range(CAP)]
    key = f"k-{uuid.uuid4().hex}"

    before = _counts(srv.home)
    for _ in range(3):  # again and again: each refused, none leaves anything behind
        _refused(c.post(path, body, **headers, **{"Idempotency-Key": key}))
    assert _counts(srv.home) == before

    # a place comes back (a held turn answered and ended): the same keyed request now runs
    assert c.answer(held[0], "done").json()["status"] == "completed"
    ran = c.post(path, body, **headers, **{"Idempotency-Key": key})
    assert ran.status_code == 200, ran.text
    assert ran.headers.get("idempotent-replayed") is None  # the refusal kept no answer under the key
    assert "f -> R" in ran.text, ran.text
    again = c.post(path, body, **headers, **{"Idempotency-Key": key})
    assert again.headers.get("idempotent-replayed") == "true" and again.text == ran.text

    # no place leaked: two held, one free (the answered turn ended), then full again
    third = c.paused()
    _refused(c.post("/v1/responses", {"model": "assistant", "input": "/call f {}", "tools": [F_RESP]}))
    for resp in (*held[1:], third):  # end them: the module's server is shared
        assert c.answer(resp, "x").status_code == 200


def test_the_refused_fork_of_the_report_leaves_the_source_as_it_was(srv: ServeProcess) -> None:
    """The report's first repro, read back through the API: no forked conversation appears, and
    the source's history is unchanged (its answer kept once)."""
    c = Caller(srv)
    path, body, _ = _responses_fork(c)
    src = c.http.get(f"/v1/responses/{body['previous_response_id']}").json()
    held = [c.paused() for _ in range(CAP)]
    before = _counts(srv.home)
    _refused(c.post(path, body))
    assert _counts(srv.home) == before
    assert c.http.get(f"/v1/responses/{src['id']}").json() == src
    for resp in held:
        assert c.answer(resp, "x").status_code == 200
    # with a place free, the same answer forks as before: its own conversation, answered
    forked = c.post(path, body)
    assert forked.status_code == 200 and forked.json()["status"] == "completed", forked.text
    assert "f -> R" in json.dumps(forked.json()["output"])


def test_a_keyed_repeat_after_delete_gets_the_404_the_docs_describe(srv: ServeProcess) -> None:
    """docs/openai.md (`Idempotency-Key`): the key's stored answer becomes a 404 `response_not_found`
    naming the key and the deleted response, replayed; a GET's 404 names `response_id`."""
    c = Caller(srv)
    key = f"k-{uuid.uuid4().hex}"
    body = {"model": "assistant", "input": "hello"}
    first = c.post("/v1/responses", body, **{"Idempotency-Key": key})
    rid = first.json()["id"]
    assert c.http.delete(f"/v1/responses/{rid}").status_code == 200
    got = c.http.get(f"/v1/responses/{rid}")
    assert got.status_code == 404 and got.json()["error"]["param"] == "response_id", got.text
    again = c.post("/v1/responses", body, **{"Idempotency-Key": key})
    err = again.json()["error"]
    assert again.status_code == 404 and again.headers.get("idempotent-replayed") == "true", again.text
    assert err["code"] == "response_not_found" and err["param"] == "Idempotency-Key" and rid in err["message"]
