"""A new conversation written paused at tool calls on a PostgreSQL store (a cluster of one real
`appserver serve`): the server takes the conversation's lease before writing its paused turn.

Before, the write was refused (no lease: another server's, as far as the store could tell), the
request answered 500, and the server judged itself gone: every later request 503
`server_unavailable` until a restart. The triggers: a stateless chat history holding tool calls the
server never issued (seeded, paused at them, answered), and the same `function_call_output` sent
again with the same `previous_response_id` (the documented retry, which forks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)

F_RESP = {"type": "function", "name": "f", "parameters": {"type": "object"}}
F_CHAT = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture
def base(tmp_path: Path) -> Iterator[str]:
    require_postgres()
    home = tmp_path / "home"
    with temp_database("s23b_paused") as url:
        env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_STORE__INSTANCE_TIMEOUT_S="20")
        with serving(home, env=env) as sp:
            yield sp.url + "/v1"


def _still_serving(c: httpx.Client, base: str) -> None:
    r = c.post(base + "/chat/completions", json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo: hi"


def test_a_seeded_history_with_calls_the_server_never_issued_is_answered_and_the_server_keeps_serving(
    base: str,
) -> None:
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_imported1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_imported1", "content": "sunny"},
    ]
    with httpx.Client(timeout=30) as c:
        r = c.post(base + "/chat/completions", json={"model": "assistant", "messages": msgs, "tools": [F_CHAT]})
        assert r.status_code == 200, r.text  # before: 500, and the server fenced itself
        assert r.json()["choices"][0]["message"]["content"] == "f -> sunny"
        _still_serving(c, base)


def test_the_same_answer_sent_again_by_previous_response_id_forks_and_the_server_keeps_serving(base: str) -> None:
    with httpx.Client(timeout=30) as c:
        paused = c.post(base + "/responses", json={"model": "assistant", "input": "/call f {}", "tools": [F_RESP]})
        assert paused.status_code == 200, paused.text
        body = paused.json()
        call = next(o for o in body["output"] if o["type"] == "function_call")["call_id"]
        answer = {
            "model": "assistant",
            "tools": [F_RESP],
            "previous_response_id": body["id"],
            "input": [{"type": "function_call_output", "call_id": call, "output": "R"}],
        }
        first = c.post(base + "/responses", json=answer)
        assert first.status_code == 200, first.text
        again = c.post(base + "/responses", json=answer)
        assert again.status_code == 200, again.text  # before: 500, and the server fenced itself
        assert again.headers["x-conversation-id"] != first.headers["x-conversation-id"]  # a fork
        texts = [p["text"] for o in again.json()["output"] if o["type"] == "message" for p in o["content"]]
        assert texts == ["f -> R"]
        _still_serving(c, base)
