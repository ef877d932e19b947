"""First uses of one conversation at the same time (session 20 fixes), on real servers and PostgreSQL.

A conversation that is "created when unknown" (an unseen `X-Conversation-Id`, an agent's shared
`default`, a credential's own default `conv_default~…`) was looked up, then created: requests (or
servers) that raced each found nothing and each inserted, and on PostgreSQL every loser got the
raw unique violation as a 500 `internal_error` (`conversations_pkey`, `conversations_default`).
Creation is now idempotent across processes (`Store.ensure_conversation`: the row is inserted
unless one is there, and the one there is read back), so every racer lands in one conversation;
an id that exists for another agent or another credential is still refused as unknown, never
adopted, however the race goes. (A credential without `admin` that sends a header name gets its
own conversation `NAME~<tag>`, tests/test_conversation_names_s20.py: two credentials racing with
one name get one conversation each.)
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from appserver.store import AgentRecord, ConversationRecord, MessageRecord, SQLiteStore
from appserver.store.postgres import PostgresStore
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

N = 6  # simultaneous first requests per check (the tester saw ~half of 6 fail)
AUTH = {"APPSERVER_AUTH__MODE": "token"}


@dataclass
class Cluster:
    url: str
    nodes: list[ServeProcess]
    admin: str  # sees every conversation (namespace None)
    a: str  # a plain credential: a namespace of its own
    b: str  # another one

    def logs(self) -> str:
        return "".join(
            f"--- node{i}\n{sp.proc.stderr.so_far()}"  # type: ignore[attr-defined]
            for i, sp in enumerate(self.nodes)
            if sp.proc.stderr is not None
        )


def _env(home: Path, url: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, **AUTH)


def _token(home: Path, url: str, name: str, scopes: str) -> str:
    made = run_cli(home, "token", "create", "--name", name, "--scopes", scopes, "--json", env=_env(home, url))
    assert made.code == 0, made.err
    return str(json.loads(made.out)["token"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two servers on one PostgreSQL database, token auth; agents `assistant` and `careful`."""
    require_postgres()
    tmp = tmp_path_factory.mktemp("races")
    with temp_database("races_s20") as url:
        admin_home = tmp / "admin"
        made = run_cli(admin_home, "agents", "create", "--name", "careful", env=_env(admin_home, url))
        assert made.code == 0, made.err
        admin = _token(admin_home, url, "ops", "openai,ws,admin")
        a = _token(admin_home, url, "app-a", "openai,ws")
        b = _token(admin_home, url, "app-b", "openai,ws")
        nodes: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                nodes.append(start_serve(home, env=_env(home, url)))
            yield Cluster(url, nodes, admin, a, b)
        finally:
            for sp in nodes:
                sp.stop()
            for sp in nodes:
                sp.kill()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _request(i: int, text: str, model: str = "assistant") -> tuple[str, dict[str, Any]]:
    """Every other request on each OpenAI route."""
    if i % 2:
        return "/v1/responses", {"model": model, "input": text}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}


async def _burst(
    nodes: list[ServeProcess], token: str, conversation: str, text: str, n: int = N, model: str = "assistant"
) -> list[httpx.Response]:
    """`n` first requests at once, spread over `nodes`, all naming `conversation` in the header."""
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            path, body = _request(i, f"{text} {i}", model)
            headers = {**_bearer(token), "X-Conversation-Id": conversation}
            return await client.post(nodes[i % len(nodes)].url + path, json=body, headers=headers)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _rows(url: str, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        return c.execute(query, params).fetchall()


def _agent_id(url: str, name: str) -> str:
    return str(_rows(url, "SELECT id FROM agents WHERE name = %s", (name,))[0][0])


def _turn_conversations(url: str, text: str) -> list[str]:
    """The conversation of every turn whose input starts with `text`."""
    rows = _rows(url, "SELECT conversation_id, input FROM turns ORDER BY seq", ())
    out = []
    for conv, given in rows:
        content = (given if isinstance(given, dict) else json.loads(given)).get("content")
        if isinstance(content, str) and content.startswith(text + " "):
            out.append(conv)
    return out


def _conversation_of(reply: httpx.Response) -> str:
    return reply.headers["X-Conversation-Id"]


def _all_ok(replies: list[httpx.Response], cluster: Cluster) -> None:
    bad = [(r.status_code, r.text[:300]) for r in replies if r.status_code != 200]
    assert not bad, f"{bad}\n{cluster.logs()[-6000:]}"


# ---------------------------------------------------------------- unseen X-Conversation-Id


def test_an_unseen_header_id_used_by_simultaneous_requests_on_one_server_is_one_conversation(
    cluster: Cluster,
) -> None:
    conv = "race-one-" + uuid.uuid4().hex[:12]
    replies = asyncio.run(_burst(cluster.nodes[:1], cluster.admin, conv, "one-server"))
    _all_ok(replies, cluster)
    assert {_conversation_of(r) for r in replies} == {conv}
    assert _rows(cluster.url, "SELECT count(*) FROM conversations WHERE id = %s", (conv,)) == [(1,)]
    assert _turn_conversations(cluster.url, "one-server") == [conv] * N


def test_an_unseen_header_id_used_on_two_servers_at_once_is_one_conversation(cluster: Cluster) -> None:
    name = "race-two-" + uuid.uuid4().hex[:12]
    replies = asyncio.run(_burst(cluster.nodes, cluster.a, name, "two-servers"))
    _all_ok(replies, cluster)
    convs = {_conversation_of(r) for r in replies}
    assert len(convs) == 1
    (conv,) = convs
    assert conv.startswith(name + "~")  # credential a's own conversation of that name
    rows = _rows(cluster.url, "SELECT namespace FROM conversations WHERE id = %s", (conv,))
    assert len(rows) == 1 and rows[0][0] is not None  # owned by credential a
    assert _turn_conversations(cluster.url, "two-servers") == [conv] * N


def test_an_unseen_header_name_raced_by_two_credentials_is_one_conversation_each(cluster: Cluster) -> None:
    """Never shared across namespaces: each credential's name is its own (`NAME~<tag>`,
    tests/test_conversation_names_s20.py), so both bursts succeed, each in one conversation of its
    own namespace, with no 500 and nothing of one in the other."""
    name = "race-ns-" + uuid.uuid4().hex[:12]

    async def go() -> list[tuple[str, httpx.Response]]:
        a, b = await asyncio.gather(
            _burst(cluster.nodes, cluster.a, name, "ns-a"), _burst(cluster.nodes, cluster.b, name, "ns-b")
        )
        return [("a", r) for r in a] + [("b", r) for r in b]

    replies = asyncio.run(go())
    _all_ok([r for _, r in replies], cluster)
    convs = {who: {_conversation_of(r) for w, r in replies if w == who} for who in ("a", "b")}
    assert all(len(c) == 1 for c in convs.values()), convs
    (conv_a,), (conv_b,) = convs["a"], convs["b"]
    assert conv_a != conv_b and conv_a.startswith(name + "~") and conv_b.startswith(name + "~")
    assert _turn_conversations(cluster.url, "ns-a") == [conv_a] * N
    assert _turn_conversations(cluster.url, "ns-b") == [conv_b] * N
    assert _rows(cluster.url, "SELECT count(*) FROM conversations WHERE id = %s", (name,)) == [(0,)]


def test_an_unseen_header_id_raced_by_two_agents_goes_to_one_the_other_is_refused(cluster: Cluster) -> None:
    conv = "race-agent-" + uuid.uuid4().hex[:12]

    async def go() -> list[tuple[str, httpx.Response]]:
        a, b = await asyncio.gather(
            _burst(cluster.nodes, cluster.admin, conv, "agent-assistant"),
            _burst(cluster.nodes, cluster.admin, conv, "agent-careful", model="careful"),
        )
        return [("assistant", r) for r in a] + [("careful", r) for r in b]

    replies = asyncio.run(go())
    odd = [(w, r.status_code, r.text[:300]) for w, r in replies if r.status_code not in (200, 404)]
    assert not odd, f"{odd}\n{cluster.logs()[-6000:]}"
    winners = {who for who, r in replies if r.status_code == 200}
    assert len(winners) == 1, [(w, r.status_code) for w, r in replies]
    winner = winners.pop()
    owner = _rows(cluster.url, "SELECT agent_id FROM conversations WHERE id = %s", (conv,))
    assert owner == [(_agent_id(cluster.url, winner),)]
    loser = "careful" if winner == "assistant" else "assistant"
    assert _turn_conversations(cluster.url, f"agent-{loser}") == []


def test_an_existing_header_id_of_another_credential_is_still_refused(cluster: Cluster) -> None:
    """Another credential's conversation id (as its answers echo it) is not found, on every server."""
    name = "race-taken-" + uuid.uuid4().hex[:12]
    first = asyncio.run(_burst(cluster.nodes[:1], cluster.a, name, "taken-a", n=1))
    _all_ok(first, cluster)
    conv = _conversation_of(first[0])
    again = asyncio.run(_burst(cluster.nodes, cluster.b, conv, "taken-b", n=4))
    assert [r.status_code for r in again] == [404] * 4, [r.text for r in again]
    assert {r.json()["error"]["code"] for r in again} == {"conversation_not_found"}


# ---------------------------------------------------------------- default conversations


def test_the_shared_default_raced_over_http_and_websocket_on_two_servers_is_one_conversation(
    cluster: Cluster,
) -> None:
    """The admin credential's `default` is the agent's shared default (unique per agent)."""

    async def ws_submit(sp: ServeProcess, text: str) -> dict[str, Any]:
        ws = await WS.open(sp.url, headers=_bearer(cluster.admin))
        try:
            return await ws.request(
                {"type": "submit_input", "agent": "careful", "conversation": "default", "input": text}, 20
            )
        finally:
            await ws.close()

    async def go() -> tuple[list[httpx.Response], list[dict[str, Any]]]:
        http = _burst(cluster.nodes, cluster.admin, "default", "shared-default", model="careful")
        acks = asyncio.gather(*(ws_submit(cluster.nodes[i % 2], f"shared-default {100 + i}") for i in range(4)))
        return await asyncio.gather(http, acks)

    replies, acks = asyncio.run(go())
    _all_ok(replies, cluster)
    assert all(a["type"] == "ack" for a in acks), acks
    careful = _agent_id(cluster.url, "careful")
    defaults = _rows(cluster.url, "SELECT id FROM conversations WHERE agent_id = %s AND is_default", (careful,))
    assert len(defaults) == 1
    (default,) = defaults[0]
    assert {_conversation_of(r) for r in replies} == {default}
    assert {a["conversation_id"] for a in acks} == {default}
    assert _turn_conversations(cluster.url, "shared-default") == [default] * (N + 4)


def test_a_credentials_own_default_raced_on_two_servers_is_one_conversation(cluster: Cluster) -> None:
    """A plain credential's `default` is its own (`conv_default~…`, a derived id: the primary key)."""

    async def ws_submit(sp: ServeProcess, text: str) -> dict[str, Any]:
        ws = await WS.open(sp.url, headers=_bearer(cluster.b))
        try:
            return await ws.request(
                {"type": "submit_input", "agent": "assistant", "conversation": "default", "input": text}, 20
            )
        finally:
            await ws.close()

    async def go() -> tuple[list[httpx.Response], list[dict[str, Any]]]:
        http = _burst(cluster.nodes, cluster.b, "default", "own-default")
        acks = asyncio.gather(*(ws_submit(cluster.nodes[i % 2], f"own-default {100 + i}") for i in range(4)))
        return await asyncio.gather(http, acks)

    replies, acks = asyncio.run(go())
    _all_ok(replies, cluster)
    assert all(a["type"] == "ack" for a in acks), acks
    convs = {_conversation_of(r) for r in replies} | {a["conversation_id"] for a in acks}
    assert len(convs) == 1
    (default,) = convs
    assert default.startswith("conv_default~")
    rows = _rows(cluster.url, "SELECT namespace, is_default FROM conversations WHERE id = %s", (default,))
    assert len(rows) == 1 and rows[0][0] is not None and rows[0][1] is False
    assert _turn_conversations(cluster.url, "own-default") == [default] * (N + 4)


# ---------------------------------------------------------------- the store contract


@pytest.fixture(params=["sqlite", "postgresql"])
def two_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """Two store objects on the same data: two servers' (PostgreSQL), or one home's (SQLite, whose
    file one server owns: the same object twice)."""
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "store.db")
        yield s, s
        return
    with temp_database("races_store") as url:
        yield PostgresStore(url), PostgresStore(url)


async def test_ensure_conversation_creates_once_and_reads_back_the_rest(two_stores: tuple[Any, Any]) -> None:
    first, second = two_stores
    await first.open()
    if second is not first:
        await second.open()
    try:
        await first.create_agent(AgentRecord(id="agt_1", name="a1"))
        await first.create_agent(AgentRecord(id="agt_2", name="a2"))
        stores = [first, second] * 4

        # the same id at once: one creates it, the others get the row there
        made = await asyncio.gather(
            *(
                s.ensure_conversation(ConversationRecord(id="conv_x", agent_id="agt_1", title=f"t{i}", namespace="ns"))
                for i, s in enumerate(stores)
            )
        )
        assert sorted(created for _, created in made) == [False] * 7 + [True]
        winner = next(conv for conv, created in made if created)
        assert {(c.id, c.agent_id, c.namespace, c.title) for c, _ in made} == {("conv_x", "agt_1", "ns", winner.title)}

        # an agent's default at once, each under an id of its own: one default, all get it
        made = await asyncio.gather(
            *(
                s.ensure_conversation(ConversationRecord(id=f"conv_d{i}", agent_id="agt_1", is_default=True))
                for i, s in enumerate(stores)
            )
        )
        assert sorted(created for _, created in made) == [False] * 7 + [True]
        assert len({c.id for c, _ in made}) == 1
        default = await first.get_default_conversation("agt_1")
        assert default is not None and default.id == made[0][0].id and default.is_default

        # an id another agent holds: the row there comes back as it is (the caller refuses it)
        other, created = await second.ensure_conversation(ConversationRecord(id="conv_x", agent_id="agt_2"))
        assert not created and other.agent_id == "agt_1" and other.namespace == "ns"

        # copies only into a conversation it creates
        await first.append_messages("conv_x", [MessageRecord(role="user", content="hi")])
        ids = [m.id for m in await first.list_messages("conv_x")]
        again, created = await second.ensure_conversation(
            ConversationRecord(id="conv_x", agent_id="agt_1"), copy_messages=ids
        )
        assert not created and again.agent_id == "agt_1"
        assert [m.content for m in await first.list_messages("conv_x")] == ["hi"]
        copy, created = await second.ensure_conversation(
            ConversationRecord(id="conv_y", agent_id="agt_1"), copy_messages=ids
        )
        assert created and [m.content for m in await first.list_messages("conv_y")] == ["hi"]
    finally:
        await first.close()
        if second is not first:
            await second.close()


def test_an_unseen_header_id_with_a_resent_history_is_seeded_once(cluster: Cluster) -> None:
    """The first requests carry an earlier exchange: the one that creates the conversation writes
    it with its seed in one step, so the others (on the other server too, which may load the
    conversation first) find the history whole, and it is there once."""
    conv = "race-seed-" + uuid.uuid4().hex[:12]
    earlier = [{"role": "user", "content": "seed question"}, {"role": "assistant", "content": "seed answer"}]

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(i: int) -> httpx.Response:
                body = {"model": "assistant", "messages": [*earlier, {"role": "user", "content": f"seeded {i}"}]}
                headers = {**_bearer(cluster.admin), "X-Conversation-Id": conv}
                return await client.post(cluster.nodes[i % 2].url + "/v1/chat/completions", json=body, headers=headers)

            return list(await asyncio.gather(*(one(i) for i in range(N))))

    replies = asyncio.run(go())
    _all_ok(replies, cluster)
    assert {_conversation_of(r) for r in replies} == {conv}
    rows = _rows(cluster.url, "SELECT role, content FROM messages WHERE conversation_id = %s ORDER BY id", (conv,))
    contents = [(role, json.loads(content)) for role, content in rows]
    assert contents[:2] == [("user", "seed question"), ("assistant", "seed answer")]
    assert [c for _, c in contents].count("seed question") == 1
    assert sorted(c for r, c in contents if r == "user")[1:] == sorted(f"seeded {i}" for i in range(N))
    assert _turn_conversations(cluster.url, "seeded") == [conv] * N


def test_sqlite_keeps_answering_simultaneous_first_uses_in_one_conversation(tmp_path: Path) -> None:
    """The same races on the SQLite store (one server owns its file): unchanged, all in one."""
    with serving(tmp_path / "h") as sp:

        async def go() -> tuple[list[httpx.Response], list[httpx.Response]]:
            header = _burst([sp], "unused", "race-sqlite-1", "sqlite-header")
            default = _burst([sp], "unused", "default", "sqlite-default")
            return await asyncio.gather(header, default)

        header, default = asyncio.run(go())
        for r in header + default:
            assert r.status_code == 200, r.text
        assert {_conversation_of(r) for r in header} == {"race-sqlite-1"}
        assert len({_conversation_of(r) for r in default}) == 1


async def test_a_conversation_of_a_deleted_agent_is_agent_missing_never_a_raw_error(tmp_path: Path) -> None:
    """On PostgreSQL the insert of a conversation whose agent was deleted meanwhile (another request
    or server) failed on the foreign key, answered as a 500; it is AgentMissing, which the kernel
    words as the agent gone and HTTP as the model gone (404 model_not_found)."""
    from appserver.errors import AgentGone
    from appserver.http.errors import from_kernel
    from appserver.runtime.kernel import agent_missing_is_gone
    from appserver.store.base import AgentMissing

    with temp_database("races_gone") as url:
        store = PostgresStore(url)
        await store.open()
        try:
            ghost = AgentRecord(id="agt_gone", name="ghost")  # never stored: as if deleted meanwhile
            for make in (
                lambda: store.create_conversation(ConversationRecord(id="conv_g1", agent_id=ghost.id)),
                lambda: store.ensure_conversation(ConversationRecord(id="conv_g2", agent_id=ghost.id, namespace="n")),
                lambda: store.ensure_conversation(
                    ConversationRecord(id="conv_g3", agent_id=ghost.id, is_default=True, title="default")
                ),
            ):
                with pytest.raises(AgentMissing):
                    await make()
                with pytest.raises(AgentGone) as gone:
                    with agent_missing_is_gone(ghost):
                        await make()
                answer = from_kernel(gone.value)
                assert (answer.status, answer.code, answer.param) == (404, "model_not_found", "model")
        finally:
            await store.close()
