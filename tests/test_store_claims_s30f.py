"""Session 30 (f): what a store keeps for a request that never ended, and for an older server.

1. An Idempotency-Key whose request never ended (its server killed mid-request, or killed after
   its turn completed but before the reply was stored) stays that request's. A request with a
   different body under the key is 409 `idempotency_key_reused` (docs/openai.md); a repeat of the
   original takes the key over and gets its answer. Before, the dead claim was taken over (or, at
   a start, deleted) whatever the body: the other body was answered 200 with the original
   request's reply (its turn, which `Idempotency.earlier` follows), kept under the new body's
   hash, and the original client's retry got 409: it never got its answer.
2. A history point an older server writes during a rolling upgrade, after the new server's
   migration filled `history_points.namespace` in, has none (NULL). Its owner's next request with
   the whole transcript continues its conversation, as before the upgrade; nobody else's does.
   Before, the lookup read `namespace = owner` only: the owner's transcript forked a new
   conversation.

Real servers (SQLite on disk; PostgreSQL clusters of two), the real store, real sockets.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from appserver.store import AgentRecord, ConversationRecord, SQLiteStore, StoreError
from appserver.store.postgres import PostgresStore
from appserver.store.records import HistoryPoint, HttpIdempotency
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database, url_for
from tests.support.serve import ServeProcess, serving, start_serve_at, stop_all
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

DEAD_OWNER = "999999999:1"  # a pid above any pid_max: a process that is gone
WAIT_S = 30.0  # every wait's bound; none is reached when the server works
PORTS = (52500, 52999)  # this test's ports (a cluster member is reached at its listen address)
ORIGINAL = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 40"}]}
OTHER = {"model": "assistant", "messages": [{"role": "user", "content": "please delete everything"}]}
SLOW_REPLY = " ".join(f"w{i}" for i in range(1, 41))


def _chat(url: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=WAIT_S)


def _reply(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _reused(r: httpx.Response) -> bool:
    return r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"


# ------------------------------------------------------------------ 1. a key whose request never ended


def test_a_key_left_pending_at_a_crash_is_kept_for_its_request_on_sqlite(tmp_path: Path) -> None:
    """A server killed after its turn completed but before the reply was stored leaves the key
    pending under a dead process: the state is written as that kill leaves it. The restart
    releases the key; another body under it is refused, the original gets its turn's reply."""
    home = tmp_path / "home"
    env = cli_env(home)
    key = {"Idempotency-Key": "K-sqlite"}
    original = {"model": "assistant", "messages": [{"role": "user", "content": "hello"}]}
    with serving(home, env=env) as sp:
        answered = _reply(_chat(sp.url, original, key))
    with sqlite3.connect(home / "appserver.db") as db:
        changed = db.execute(
            "UPDATE http_idempotency SET state='pending', status_code=NULL, content_type=NULL, body=NULL, "
            "conversation_id=NULL, owner=? WHERE key=?",
            (DEAD_OWNER, key["Idempotency-Key"]),
        ).rowcount
    assert changed == 1
    with serving(home, env=env) as sp:
        assert _reused(_chat(sp.url, OTHER, key))
        again = _chat(sp.url, original, key)
        assert _reply(again) == answered == "echo: hello"
        assert _reused(_chat(sp.url, OTHER, key))  # the key is the original's still
    with sqlite3.connect(home / "appserver.db") as db:
        turns = db.execute("SELECT input FROM turns ORDER BY rowid").fetchall()
    assert [json.loads(t[0])["content"] for t in turns] == ["hello"]  # the other body never ran


def _cluster_env(home: Path, url: str) -> dict[str, str]:
    return cli_env(
        home,
        APPSERVER_STORE__URL=url,
        APPSERVER_STORE__HEARTBEAT_S="0.2",
        APPSERVER_STORE__INSTANCE_TIMEOUT_S="3",
    )


@pytest.fixture
def pg_pair(tmp_path: Path) -> Iterator[tuple[str, ServeProcess, ServeProcess]]:
    """Two servers of a cluster on a fresh PostgreSQL database: (its URL, B, C)."""
    require_postgres()
    with temp_database("s30f_keys") as url:
        started: list[ServeProcess] = []
        try:
            for i, port in enumerate((PORTS[0], PORTS[0] + 1)):
                home = tmp_path / f"node{i}"
                started.append(start_serve_at(home, port, _cluster_env(home, url), last=PORTS[0] + 240, step=2))
            yield url, started[0], started[1]
        finally:
            stop_all(*started)


def _pg(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, args)
        return cur.fetchall() if cur.description else []


def test_a_key_taken_over_from_a_killed_server_keeps_its_body_on_postgresql(
    pg_pair: tuple[str, ServeProcess, ServeProcess],
) -> None:
    url, b, c = pg_pair
    key = {"Idempotency-Key": "K1"}
    errors: list[BaseException] = []

    def on_b() -> None:
        try:
            _chat(b.url, ORIGINAL, key)
        except httpx.HTTPError as exc:  # the server is killed under it
            errors.append(exc)

    first = threading.Thread(target=on_b, daemon=True)
    first.start()
    running = wait_for(
        lambda: (
            _pg(url, "SELECT 1 FROM http_idempotency WHERE key='K1' AND state='pending'")
            and _pg(url, "SELECT owner FROM turns WHERE status='running'")
        ),
        WAIT_S,
        "B's keyed turn to run",
    )
    b.kill()
    first.join(WAIT_S)
    assert not first.is_alive() and errors
    # C judged B gone: it took over what B left (the turn no longer runs under B)
    wait_for(
        lambda: not _pg(url, "SELECT 1 FROM turns WHERE status='running' AND owner=%s", running[0][0]),
        WAIT_S,
        "C to take over what B left",
    )
    other = _chat(c.url, OTHER, key)
    assert _reused(other), other.text
    again = _chat(c.url, ORIGINAL, key)  # waits until B is judged gone, then takes the key over
    assert _reply(again) == SLOW_REPLY
    replay = _chat(c.url, ORIGINAL, key)
    assert replay.headers.get("idempotent-replayed") == "true" and _reply(replay) == SLOW_REPLY
    assert _reused(_chat(c.url, OTHER, key))
    inputs = [json.loads(r[0])["content"] for r in _pg(url, "SELECT input FROM turns ORDER BY seq")]
    assert "please delete everything" not in inputs


def test_an_answer_lost_to_an_outage_keeps_its_key_for_its_request_on_postgresql() -> None:
    """The database goes away as two requests end: one with an answer (its turn completed), one
    with an error. Once it is back, `repair` releases the first for a repeat of its request only
    (another body would be given its turn) and deletes the second (free again, as after any error)."""
    require_postgres()
    with temp_database("s30f_outage") as url:
        db = url.rsplit("/", 1)[1]

        def connections(allowed: bool) -> None:
            with psycopg.connect(url_for("postgres"), autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS {str(allowed).lower()}')
                if not allowed:
                    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))

        async def go() -> None:
            store = PostgresStore(url, connect_timeout_s=1.0)
            await store.open()
            try:
                for key in ("answered", "errored"):
                    assert await store.claim_http_idempotency(HttpIdempotency("s", key, f"h-{key}")) is None
                connections(False)
                try:
                    with pytest.raises(StoreError):
                        await store.finish_http_idempotency("s", "answered", 200, "application/json", "{}", None)
                    with pytest.raises(StoreError):
                        await store.drop_http_idempotency("s", "errored")
                finally:
                    connections(True)
                deadline = time.monotonic() + WAIT_S
                while True:  # as the cluster's heartbeat does: once the store's pool is back
                    try:
                        await store.repair()
                        break
                    except StoreError:
                        assert time.monotonic() < deadline, "the database did not come back"
                        await asyncio.sleep(0.1)
            finally:
                await store.close()
            store = PostgresStore(url)  # a fresh pool: no reconnect backoff left from the outage
            await store.open()
            try:
                kept = await store.get_http_idempotency("s", "answered")
                assert kept is not None and (kept.state, kept.owner, kept.body_hash) == ("pending", None, "h-answered")
                assert await store.get_http_idempotency("s", "errored") is None
                other = await store.claim_http_idempotency(HttpIdempotency("s", "answered", "h-other"))
                assert other is not None and other.body_hash == "h-answered"
                assert await store.claim_http_idempotency(HttpIdempotency("s", "answered", "h-answered")) is None
                assert await store.claim_http_idempotency(HttpIdempotency("s", "errored", "h-other")) is None
            finally:
                await store.close()

        asyncio.run(go())


# ------------------------------------------------------------------ 2. points an older server wrote


async def _points_without_owner(store: SQLiteStore | PostgresStore, null_owner: Any) -> None:
    """Bob's and alice's conversations at point `h`: some points written with their owner, the
    others (`null_owner(conversation)`) as an older server writes them, without."""
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    convs = {"c_bob_new": "ns:bob", "c_bob_old": "ns:bob", "c_alice_old": "ns:alice", "c_ops": None}
    for n, (conv, ns) in enumerate(convs.items()):
        await store.create_conversation(ConversationRecord(id=conv, agent_id="agt_1", namespace=ns))
        await store.add_history_point(HistoryPoint("agt_1", "h", conv, n, created_at=100.0 + n))
    for conv in ("c_bob_old", "c_alice_old", "c_ops"):
        null_owner(conv)
    bob = await store.find_history_points("agt_1", "h", namespace="ns:bob")
    assert sorted(p.conversation_id for p in bob) == ["c_bob_new", "c_bob_old"]
    assert [p.conversation_id for p in await store.find_history_points("agt_1", "h", namespace="ns:bob", limit=1)] == [
        "c_bob_old"  # the newest of both kinds: recorded last
    ]
    alice = await store.find_history_points("agt_1", "h", namespace="ns:alice")
    assert [p.conversation_id for p in alice] == ["c_alice_old"]
    assert await store.find_history_points("agt_1", "h", namespace="ns:carol") == []
    everyone = await store.find_history_points("agt_1", "h")
    assert sorted(p.conversation_id for p in everyone) == ["c_alice_old", "c_bob_new", "c_bob_old", "c_ops"]
    # the same point written again by this version carries its owner again
    await store.add_history_point(HistoryPoint("agt_1", "h", "c_alice_old", 9, created_at=200.0))


def test_points_without_an_owner_are_found_by_their_conversations_owner_only_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "store.db"

    def null_owner(conv: str) -> None:
        with sqlite3.connect(path) as db:
            db.execute("UPDATE history_points SET namespace=NULL WHERE conversation_id=?", (conv,))

    async def go() -> None:
        store = SQLiteStore(path)
        await store.open()
        try:
            await _points_without_owner(store, null_owner)
        finally:
            await store.close()

    asyncio.run(go())
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT namespace FROM history_points WHERE conversation_id='c_alice_old'").fetchone() == (
            "ns:alice",
        )


def test_points_without_an_owner_are_found_by_their_conversations_owner_only_on_postgresql() -> None:
    require_postgres()
    with temp_database("s30f_points") as url:

        def null_owner(conv: str) -> None:
            _pg(url, "UPDATE history_points SET namespace=NULL WHERE conversation_id=%s", conv)

        async def go() -> None:
            store = PostgresStore(url)
            await store.open()
            try:
                await _points_without_owner(store, null_owner)
            finally:
                await store.close()

        asyncio.run(go())
        assert _pg(url, "SELECT namespace FROM history_points WHERE conversation_id='c_alice_old'") == [("ns:alice",)]


def _token(home: Path, env: dict[str, str], name: str) -> dict[str, str]:
    made = run_cli(home, "token", "create", "--name", name, "--scopes", "openai", "--json", env=env)
    assert made.code == 0, made.err
    return {"Authorization": "Bearer " + str(json.loads(made.out)["token"])}


def test_a_transcript_continues_at_a_point_an_older_server_wrote_on_postgresql(tmp_path: Path) -> None:
    """The point of alice's first reply is made as an older server writes it after the upgrade's
    migration (namespace NULL, through a real connection): her next request continues that
    conversation; bob's with the same transcript does not reach it."""
    require_postgres()
    home = tmp_path / "home"
    with temp_database("s30f_roll") as url:
        env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token")
        alice, bob = _token(home, env, "alice"), _token(home, env, "bob")
        sp = start_serve_at(home, PORTS[0] + 300, env, last=PORTS[1], step=3)
        try:
            opening = [{"role": "user", "content": "hello from before the upgrade"}]
            first = _chat(sp.url, {"model": "assistant", "messages": opening}, alice)
            conv = first.headers["x-conversation-id"]
            made = _pg(url, "UPDATE history_points SET namespace=NULL WHERE conversation_id=%s RETURNING 1", conv)
            assert made, "no point was written"
            reply = {"role": "assistant", "content": _reply(first)}
            transcript = [*opening, reply, {"role": "user", "content": "more"}]
            theirs = _chat(sp.url, {"model": "assistant", "messages": transcript}, bob)
            assert _reply(theirs) == "echo: more" and theirs.headers["x-conversation-id"] != conv
            again = _chat(sp.url, {"model": "assistant", "messages": transcript}, alice)
            assert _reply(again) == "echo: more"
            assert again.headers["x-conversation-id"] == conv  # continued, not forked
        finally:
            stop_all(sp)
