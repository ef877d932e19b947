"""Session 20: an HTTP request whose credential is revoked while it runs.

A WebSocket closed with 4401 within half a second of `appserver token revoke`; an SSE stream on the
OpenAI routes (or a non-stream request waiting for its turn) went on delivering the turn's output
to the revoked holder until the turn ended, which a paused turn may take `approval_timeout_s` to
do. Now it ends like a WebSocket: within about a second the turn is cancelled (its text so far
kept) and the request answers 401 `credential_revoked` (a chat stream's error chunk, a Responses
stream's `error` event). Real server, token mode, the real CLI revoking.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.state import token_home
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(120)

SLOW = "/slow 400"  # the echo model streams 400 words, many seconds: the revoke lands mid-turn


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[tuple[ServeProcess, Path, dict[str, str]]]:
    home = tmp_path / "home"
    token_home(home)
    env = cli_env(home)
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, home, env


def _token(home: Path, env: dict[str, str], name: str) -> str:
    made = run_cli(home, "token", "create", "--name", name, "--json", env=env)
    assert made.code == 0, made.err
    return str(made.json()["token"])


def _revoke_when(home: Path, env: dict[str, str], name: str, ready: Callable[[], bool]) -> threading.Thread:
    """Revoke `name` once `ready()` (the turn is under way: a fixed delay revoked it before a loaded
    machine had even sent the request, which then got a plain 401)."""

    def revoke() -> None:
        assert eventually(ready, 30), "the turn never got under way"
        r = run_cli(home, "token", "revoke", name, env=env)
        assert r.code == 0, r.err

    t = threading.Thread(target=revoke)
    t.start()
    return t


def _conversations(home: Path, env: dict[str, str]) -> int:
    listed = run_cli(home, "conversations", "list", "--json", env=env)
    return len(json.loads(listed.out)) if listed.code == 0 else 0


def _turn_status(home: Path, env: dict[str, str], conversation: str) -> list[str]:
    r = run_cli(home, "conversations", "history", conversation, "--json", env=env)
    assert r.code == 0, r.err
    return [str(m.get("completion_status")) for m in json.loads(r.out) if m["role"] == "assistant"]


def test_a_chat_stream_ends_with_an_error_once_its_token_is_revoked(
    srv: tuple[ServeProcess, Path, dict[str, str]],
) -> None:
    sp, home, env = srv
    token = _token(home, env, "victim")
    streaming = threading.Event()
    revoker = _revoke_when(home, env, "victim", streaming.is_set)
    lines: list[str] = []
    started = time.monotonic()
    with httpx.stream(
        "POST",
        sp.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "assistant", "stream": True, "messages": [{"role": "user", "content": SLOW}]},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        conversation = r.headers["x-conversation-id"]
        streaming.set()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    revoker.join()
    took = time.monotonic() - started
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == "credential_revoked", error
    assert took < 10, took  # long before the 400 words' end
    # the turn was cancelled, what it streamed kept
    assert _turn_status(home, env, conversation) == ["cancelled"]
    # and the token is refused from now on
    again = httpx.get(sp.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert again.status_code == 401


def test_a_responses_stream_ends_with_an_error_event_once_its_token_is_revoked(
    srv: tuple[ServeProcess, Path, dict[str, str]],
) -> None:
    sp, home, env = srv
    token = _token(home, env, "victim2")
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key=token, max_retries=0)
    events: list[Any] = []
    revoker = _revoke_when(home, env, "victim2", lambda: any(e.type == "response.output_text.delta" for e in events))
    for event in client.responses.create(model="assistant", input=SLOW, stream=True):
        events.append(event)
    revoker.join()
    kinds = [e.type for e in events]
    assert kinds[-1] == "error" and events[-1].code == "credential_revoked", events[-1]
    assert "response.output_text.delta" in kinds and "response.completed" not in kinds, kinds[-5:]
    response_id = events[0].response.id
    assert response_id.startswith("resp_")
    # the turn was cancelled, what it streamed kept (the CLI reads the store: every conversation)
    listed = run_cli(home, "conversations", "list", "--json", env=env)
    assert listed.code == 0, listed.err
    (conversation,) = [c["id"] for c in json.loads(listed.out)]
    assert _turn_status(home, env, conversation) == ["cancelled"]


def test_a_non_stream_request_answers_401_once_its_token_is_revoked(
    srv: tuple[ServeProcess, Path, dict[str, str]],
) -> None:
    sp, home, env = srv
    token = _token(home, env, "victim3")
    before = _conversations(home, env)
    revoker = _revoke_when(home, env, "victim3", lambda: _conversations(home, env) > before)
    started = time.monotonic()
    r = httpx.post(
        sp.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "assistant", "messages": [{"role": "user", "content": SLOW}]},
        timeout=30,
    )
    revoker.join()
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "credential_revoked", r.text
    assert time.monotonic() - started < 10
    assert _turn_status(home, env, r.headers["x-conversation-id"]) == ["cancelled"]
