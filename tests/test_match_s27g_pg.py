"""Session 27 (g), on PostgreSQL: a history-prefix lookup reads the newest few points of the
caller's own conversations, however many conversations (its own or another credential's) reached
the same history (tests/test_match_s27g.py has the finding and the SQLite cases).

What the database reads is counted by the database itself: `EXPLAIN (ANALYZE)` of the store's own
query gives the rows each scan of `history_points` produced. The continuation and fork rules are
checked through a real `appserver serve` on PostgreSQL with the real `openai` SDK.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest

from appserver.http.conversation_match import PREFIX_CANDIDATES
from appserver.store import AgentRecord, ConversationRecord, MessageRecord
from appserver.store.base import history_points_read
from appserver.store.pgschema import MIGRATIONS
from appserver.store.postgres import PostgresStore
from appserver.store.records import HistoryPoint
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, serving
from tests.test_match_s27g import OPENING
from tests.test_pg_migrate_s21 import _at_version

pytestmark = pytest.mark.timeout(180)

BOBS, ALICES = 1200, 40  # points of one history: bob's conversations, alice's


def scanned(plan: dict[str, Any], table: str) -> int:
    """Rows the scans of `table` produced in an `EXPLAIN (ANALYZE, FORMAT JSON)` plan (a node of
    a loop produces its rows once per loop)."""
    own = plan.get("Actual Rows", 0) * plan.get("Actual Loops", 1) if plan.get("Relation Name") == table else 0
    return int(own) + sum(scanned(p, table) for p in plan.get("Plans", []))


def rows_read(url: str, agent_id: str, namespace: str | None, limit: int) -> tuple[int, list[str]]:
    """(rows of `history_points` the lookup's query read, the conversations it returned)."""
    query, params = history_points_read("%s", agent_id, "h", namespace, limit)
    with psycopg.connect(url) as conn:
        (plan,) = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params).fetchone()  # type: ignore[misc]
        got = [r[2] for r in conn.execute(query, params).fetchall()]
    return scanned(plan[0]["Plan"], "history_points"), got


async def _fill(store: PostgresStore) -> None:
    """Agent agt_1; bob's and alice's conversations, each at point `h`, recorded in order."""
    await store.create_agent(AgentRecord(id="agt_1", name="a"))
    owners = [("ns:alice" if n % (BOBS // ALICES) == 0 else "ns:bob") for n in range(BOBS + ALICES)]
    for at in range(0, len(owners), 100):
        part = range(at, min(len(owners), at + 100))
        await asyncio.gather(
            *(
                store.create_conversation(ConversationRecord(id=f"c{n:05}", agent_id="agt_1", namespace=owners[n]))
                for n in part
            )
        )
        await asyncio.gather(
            *(store.add_history_point(HistoryPoint("agt_1", "h", f"c{n:05}", n, created_at=1000.0 + n)) for n in part)
        )


def test_a_lookup_reads_as_many_points_as_it_returns_on_postgresql() -> None:
    require_postgres()
    with temp_database("match27g") as url:

        async def go() -> None:
            store = PostgresStore(url)
            await store.open()
            try:
                await _fill(store)
                bob = await store.find_history_points("agt_1", "h", namespace="ns:bob", limit=5)
                assert [p.conversation_id for p in bob] == [f"c{n:05}" for n in (1239, 1238, 1237, 1236, 1235)]
                await store.append_messages("c01235", [MessageRecord(role="user", content="later")])
                bob = await store.find_history_points("agt_1", "h", namespace="ns:bob", limit=5)
                assert bob[0].conversation_id == "c01235"  # most recently active first, of the same five
                alice = await store.find_history_points("agt_1", "h", namespace="ns:alice", limit=3)
                assert [p.conversation_id for p in alice] == ["c01230", "c01200", "c01170"]
                assert await store.find_history_points("agt_1", "h", namespace="ns:carol") == []
                heads = await store.last_message_ids(["c01235", "c00001", "nope"])
                assert heads == {"c01235": await store.last_message_id("c01235"), "c00001": 0, "nope": 0}
            finally:
                await store.close()

        asyncio.run(go())
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ANALYZE history_points")
            conn.execute("ANALYZE conversations")
        for namespace in ("ns:bob", "ns:alice", None):  # None: admin, every namespace's
            read, got = rows_read(url, "agt_1", namespace, PREFIX_CANDIDATES)
            assert len(got) == PREFIX_CANDIDATES
            assert read <= PREFIX_CANDIDATES, (namespace, read)  # not the 1,240 points of that history


def test_points_recorded_before_the_upgrade_are_found_by_their_owner_only_on_postgresql() -> None:
    require_postgres()
    with temp_database("match27g_up") as url:
        _at_version(url, max(v for v, _ in MIGRATIONS) - 1)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO agents(id, name, model, created_at, updated_at) VALUES ('agt_1', 'a', 'echo', 1, 1)"
            )
            for n, (conv, ns) in enumerate([("c_bob", "ns:bob"), ("c_alice", "ns:alice"), ("c_ops", None)]):
                conn.execute(
                    "INSERT INTO conversations(id, agent_id, namespace, created_at, updated_at) "
                    "VALUES (%s, 'agt_1', %s, %s, %s)",
                    (conv, ns, n, n),
                )
                conn.execute(
                    "INSERT INTO history_points(agent_id, prefix_hash, conversation_id, last_message_id, created_at) "
                    "VALUES ('agt_1', 'h', %s, 0, %s)",
                    (conv, n),
                )

        async def go() -> None:
            store = PostgresStore(url)
            await store.open()
            try:
                found = await store.find_history_points("agt_1", "h", namespace="ns:bob")
                assert [p.conversation_id for p in found] == ["c_bob"]
                found = await store.find_history_points("agt_1", "h", namespace="ns:alice")
                assert [p.conversation_id for p in found] == ["c_alice"]
                everyone = await store.find_history_points("agt_1", "h")
                assert [p.conversation_id for p in everyone] == ["c_ops", "c_alice", "c_bob"]
            finally:
                await store.close()

        asyncio.run(go())


# ------------------------------------------------------------------ through a real server


def _token(home: Path, env: dict[str, str], name: str, scopes: str) -> str:
    made = run_cli(home, "token", "create", "--name", name, "--scopes", scopes, "--json", env=env)
    assert made.code == 0, made.err
    return str(json.loads(made.out)["token"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str, dict[str, str]]]:
    """A server on PostgreSQL in token mode; tokens bob, alice (a namespace each) and ops (admin)."""
    require_postgres()
    home = tmp_path_factory.mktemp("match27g") / "home"
    with temp_database("match27g_serve") as url:
        env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_AUTH__MODE="token")
        tokens = {
            "bob": _token(home, env, "bob", "openai"),
            "alice": _token(home, env, "alice", "openai"),
            "ops": _token(home, env, "ops", "openai,admin"),
        }
        with serving(home, env=env) as sp:
            yield sp, url, tokens


def _chat(sp: ServeProcess, token: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key=token, max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(model="assistant", messages=messages)  # type: ignore[arg-type]
    conv = raw.headers.get("x-conversation-id")
    assert conv, raw.headers
    return conv, raw.parse().choices[0].message.content or ""


def _forked_from(url: str, conv: str) -> tuple[str | None, str | None]:
    """(the conversation `conv` was forked from, its namespace)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT forked_from, namespace FROM conversations WHERE id = %s", (conv,)).fetchone()
    assert row is not None
    return row[0], row[1]


def test_continuation_and_forks_are_as_before_on_postgresql(served: tuple[ServeProcess, str, dict[str, str]]) -> None:
    sp, url, tokens = served
    bob, alice, ops = tokens["bob"], tokens["alice"], tokens["ops"]
    for i in range(PREFIX_CANDIDATES + 8):
        _chat(sp, bob, [*OPENING, {"role": "user", "content": f"q{i}"}])
    mine, reply = _chat(sp, bob, [*OPENING, {"role": "user", "content": "mine"}])
    assert reply == "echo: mine"
    turn2 = [*OPENING, {"role": "user", "content": "mine"}, {"role": "assistant", "content": reply}]
    again, reply2 = _chat(sp, bob, [*turn2, {"role": "user", "content": "more"}])
    assert (again, reply2) == (mine, "echo: more")  # continued
    regen, _ = _chat(sp, bob, [*turn2, {"role": "user", "content": "more"}])
    assert regen != mine and _forked_from(url, regen)[0] == mine  # moved past that point: forked
    # alice: none of bob's is hers; her own with the opening forks from one of hers
    first, _ = _chat(sp, alice, [*OPENING, {"role": "user", "content": "a0"}])
    assert _forked_from(url, first)[0] is None
    second, _ = _chat(sp, alice, [*OPENING, {"role": "user", "content": "a1"}])
    source, owner = _forked_from(url, second)
    assert source == first and owner == _forked_from(url, first)[1]
    # admin sees every conversation: it forks from the most recently active there
    theirs, _ = _chat(sp, ops, [*OPENING, {"role": "user", "content": "o0"}])
    assert _forked_from(url, theirs)[0] == second
