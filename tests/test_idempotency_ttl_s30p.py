"""Session 30 (p): an idempotency key older than its 48 h names nothing, on a server that ran all along.

docs/openai.md keeps an `Idempotency-Key` 48 h; docs/protocol.md keeps a `submit_input` key at
least 24 h. Before, only the HTTP claim expired on a running server (it was purged at each keyed
request): the kernel's key for the request's turn was purged at the server's start only. A new
request with a 49 h old key then found the old turn under it and followed it: a different question
got the old question's answer (chat: `echo: first question`; responses: the old text under a new
response id), and the new input never ran. A WebSocket resend of a 49 h old key was acked as a
duplicate of the old turn. Now every lookup, accept and claim ignores an expired key, which a new
use takes over (in the commit that accepts its turn), whether or not a purge removed it.

Real servers (SQLite on disk; PostgreSQL), the real openai SDK and real WebSocket clients; the
rows are aged by UPDATE through a connection of the test's own while the server keeps running.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest

from tests.support.cli import cli_env
from tests.support.pg import temp_database
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

T = 30.0  # every wait's bound; none is reached when the server works
PORTS = {"sqlite": 60500, "postgresql": 60700}  # this test's range: 60500-60999
AGE_S = 49 * 3600  # past the keys' 48 h
TABLES = ("http_idempotency", "idempotency_keys")  # HTTP requests' keys; turns' keys (HTTP, WebSocket)


@contextmanager
def server(backend: str, tmp_path: Path) -> Iterator[tuple[ServeProcess, Callable[..., None]]]:
    """A running server and how to age the idempotency rows of its store by 49 h (of both
    tables unless told which)."""
    home = tmp_path / "home"
    port = PORTS[backend]
    if backend == "sqlite":
        sp = start_serve_at(home, port, cli_env(home), last=port + 190, step=1)

        def age_sqlite(tables: tuple[str, ...] = TABLES) -> None:
            with sqlite3.connect(home / "appserver.db", timeout=T) as db:
                for table in tables:
                    db.execute(f"UPDATE {table} SET created_at = created_at - ?", (AGE_S,))

        try:
            yield sp, age_sqlite
        finally:
            stop_all(sp)
        return
    with temp_database("s30p_ttl") as url:
        sp = start_serve_at(home, port, cli_env(home, APPSERVER_STORE__URL=url), last=port + 190, step=1)

        def age_pg(tables: tuple[str, ...] = TABLES) -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                for table in tables:
                    conn.execute(f"UPDATE {table} SET created_at = created_at - %s", (AGE_S,))

        try:
            yield sp, age_pg
        finally:
            stop_all(sp)


def _client(sp: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=T)


def _chat(client: openai.OpenAI, key: str, text: str) -> tuple[str, bool, str]:
    """(reply, replayed, conversation id)."""
    raw = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": text}], extra_headers={"Idempotency-Key": key}
    )
    reply = raw.parse().choices[0].message.content or ""
    return reply, raw.headers.get("idempotent-replayed") == "true", raw.headers["x-conversation-id"]


def _respond(client: openai.OpenAI, key: str, text: str) -> tuple[str, str, bool]:
    """(response id, its text, replayed)."""
    raw = client.responses.with_raw_response.create(
        model="assistant", input=text, extra_headers={"Idempotency-Key": key}
    )
    resp = raw.parse()
    return resp.id, resp.output_text, raw.headers.get("idempotent-replayed") == "true"


def _submit(conversation: str, key: str, text: str) -> dict[str, Any]:
    return {"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": text,
            "idempotency_key": key}  # fmt: skip


async def _run(ws: WS, frame: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(its ack, the text its turn ended with)."""
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], T)
    assert snap["status"] == "completed", snap
    return ack, snap["blocks"][-1]["text"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_http_key_older_than_48_h_runs_the_new_request(backend: str, tmp_path: Path) -> None:
    with server(backend, tmp_path) as (sp, age):
        client = _client(sp)
        first = _chat(client, "k-chat", "first question")
        assert first[:2] == ("echo: first question", False)
        assert _chat(client, "k-chat", "first question")[:2] == ("echo: first question", True)  # within 48 h
        age()
        # a different request under the 49 h old key runs: before, it got "echo: first question"
        new = _chat(client, "k-chat", "a different, new question")
        assert new[:2] == ("echo: a different, new question", False)
        assert _chat(client, "k-chat", "a different, new question")[:2] == (new[0], True)  # the key is its now
        age()
        # the very request of 49 h ago runs again too: its key is a new one
        again = _chat(client, "k-chat", "a different, new question")
        assert again[:2] == ("echo: a different, new question", False)

        # only the request's claim gone (expired) while its turn's key is not yet: another body
        # under the key still never gets that turn's reply (the turn's key names the request)
        _chat(client, "k-claim", "the claim's question")
        age(("http_idempotency",))
        assert _chat(client, "k-claim", "another question")[:2] == ("echo: another question", False)

        rid, text, replayed = _respond(client, "k-resp", "a responses question")
        assert (text, replayed) == ("echo: a responses question", False)
        age()
        rid2, text2, replayed2 = _respond(client, "k-resp", "another responses question")
        assert (text2, replayed2) == ("echo: another responses question", False) and rid2 != rid
        assert _respond(client, "k-resp", "another responses question") == (rid2, text2, True)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_a_submit_input_key_older_than_48_h_runs_the_new_input(backend: str, tmp_path: Path) -> None:
    with server(backend, tmp_path) as (sp, age):
        ws = await WS.open(sp.url, open_timeout=T)
        try:
            # sent to "new" (keyed by agent), then re-sent to the conversation its ack named
            first, text = await _run(ws, _submit("new", "w-new", "first input"))
            conv = first["conversation_id"]
            assert (first["duplicate"], text) == (False, "echo: first input")
            keyed, text = await _run(ws, _submit(conv, "w-conv", "second input"))  # keyed by conversation
            assert (keyed["duplicate"], text) == (False, "echo: second input")
            resent = await ws.request(_submit(conv, "w-conv", "second input"), T)  # within 48 h: one turn
            assert (resent["turn_id"], resent["duplicate"]) == (keyed["turn_id"], True)
            age()

            for conversation, key, old in ((conv, "w-new", first), (conv, "w-conv", keyed), ("new", "w-new", first)):
                ack, text = await _run(ws, _submit(conversation, key, f"newer input for {key}"))
                assert ack["duplicate"] is False and ack["turn_id"] != old["turn_id"], (conversation, key, ack)
                assert text == f"echo: newer input for {key}"
            # and the key now names the new turn
            last = await ws.request(_submit("new", "w-new", "anything"), T)
            assert last["duplicate"] is True and last["turn_id"] == ack["turn_id"]
        finally:
            await ws.close()
