"""Session 27 (g): an outside tester's finding on the history-prefix match, on SQLite (the
PostgreSQL cases are in tests/test_match_s27g_pg.py).

Stateless requests that share an opening (`[user "hello", assistant "echo: hello", user "qN"]`:
the same few-shot preamble on every request) each fork a conversation at that point and record
another point of the same hash. Every request with that opening then read every point of the
hash, unbounded, and for each conversation the caller could see read the conversation and its
newest message id, a round trip each, on the event loop: with 3,035 such points one credential's
requests went 0.04 s -> 0.35 s, another credential's (which read them only to drop them) 0.05 s
-> 0.22 s, and other credentials' unrelated requests stalled up to 3.8 s while 16 ran at once.

The store now reads the newest few points of the caller's own conversations of the agent through
an index (`history_points.namespace`, schema 7), and their heads in one read. Counted here on the
store's real connection: the statements a request runs (`set_trace_callback`) and the SQLite
virtual-machine steps spent reading `history_points` (`set_progress_handler`), with three times
as many conversations sharing the opening, for the credential that made them and for another.
No times are measured.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import openai
import pytest
import uvicorn

from appserver.auth import Authenticator
from appserver.http.app import build_app
from appserver.http.conversation_match import PREFIX_CANDIDATES
from appserver.security.edge import EdgeLimits, EdgeWebSocketProtocol, protocol_class
from appserver.security.guard import SecurityGuard
from appserver.server import Server
from appserver.services import build_services
from appserver.store import AgentRecord, ConversationRecord, MessageRecord, SQLiteStore
from appserver.store.migrations import MIGRATIONS
from appserver.store.records import HistoryPoint
from tests.support.kernel import open_server

pytestmark = pytest.mark.timeout(120)
T = 30.0  # every wait's bound
OPENING = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "echo: hello"}]
# bob's conversations sharing the opening, then this many more: both past what a lookup reads
# (PREFIX_CANDIDATES, 16); a read of every point would walk MANY more points (some 40 steps each)
# and two more statements for each, far past the slack the checks allow
FEW, MANY = 30, 40


@dataclass
class Served:
    server: Server
    url: str
    bob: str
    alice: str
    admin: str
    # one SDK client per credential, kept for the test's requests (a client per request built a
    # new SDK client and connection pool each time: CPU on both sides, nothing the tests look at)
    clients: dict[str, openai.AsyncOpenAI] = field(default_factory=dict)


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Served]:
    """The app behind the guard and the edge, as `serve` runs it, in token mode, in this test's
    loop (so the store's connection can be watched); bob and alice are plain credentials, each a
    namespace of its own."""
    server = await open_server(tmp_path / "home", APPSERVER_AUTH__MODE="token")
    authenticator = Authenticator(server.config)
    assert authenticator.tokens is not None
    bob = authenticator.tokens.create(name="bob")[1]
    alice = authenticator.tokens.create(name="alice")[1]
    admin = authenticator.tokens.create(name="ops", scopes="openai,admin")[1]
    app = SecurityGuard(build_app(server, build_services(server)), server.config, authenticator)
    limits = EdgeLimits.from_config(server.config.limits, refusal_lines=app.refusals)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=protocol_class(limits),
        ws=EdgeWebSocketProtocol,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    web = uvicorn.Server(config)
    task = asyncio.create_task(web.serve())
    async with asyncio.timeout(T):
        while not web.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
    port = web.servers[0].sockets[0].getsockname()[1]
    served = Served(server, f"http://127.0.0.1:{port}/v1", bob, alice, admin)
    try:
        yield served
    finally:
        for made in served.clients.values():
            await made.close()
        web.should_exit = True
        await asyncio.wait_for(task, T)
        authenticator.close()
        await server.close()


def client(srv: Served, token: str) -> openai.AsyncOpenAI:
    if token not in srv.clients:
        srv.clients[token] = openai.AsyncOpenAI(base_url=srv.url, api_key=token, max_retries=0, timeout=T)
    return srv.clients[token]


async def chat(srv: Served, token: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    """(the conversation the request went to, the reply's text), through the real SDK."""
    raw = await client(srv, token).chat.completions.with_raw_response.create(
        model="assistant",
        messages=messages,  # type: ignore[arg-type]
    )
    conv = raw.headers.get("x-conversation-id")
    assert conv, raw.headers
    text = raw.parse().choices[0].message.content
    return conv, text or ""


async def fork_many(srv: Served, token: str, tag: str, n: int) -> list[str]:
    """`n` requests opening with OPENING, ten at a time: each forks a conversation at its point."""
    convs: list[str] = []
    for at in range(0, n, 10):
        done = await asyncio.gather(
            *(
                chat(srv, token, [*OPENING, {"role": "user", "content": f"{tag}{i}"}])
                for i in range(at, min(n, at + 10))
            )
        )
        convs += [c for c, _ in done]
    return convs


@dataclass
class Reads:
    """What the store's one connection runs meanwhile: each statement, and the virtual-machine
    steps it took (the progress handler, called at every step, counts them for the statement
    traced last; reads and the group commit's writes all run on the event loop's thread)."""

    db: sqlite3.Connection
    statements: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    def __enter__(self) -> Reads:
        self.db.set_trace_callback(self._trace)
        self.db.set_progress_handler(self._step, 1)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.db.set_progress_handler(None, 1)
        self.db.set_trace_callback(None)

    def _trace(self, statement: str) -> None:
        self.statements.append(" ".join(statement.split()))
        self.steps.append(0)

    def _step(self) -> int:
        if self.steps:
            self.steps[-1] += 1
        return 0  # go on

    def selects(self) -> list[str]:
        return [s for s in self.statements if s.upper().startswith("SELECT")]

    def point_steps(self) -> int:
        """Steps of the reads of `history_points` (its writes left out)."""
        return sum(
            n
            for s, n in zip(self.statements, self.steps, strict=True)
            if s.upper().startswith("SELECT") and "history_points" in s
        )


async def watched(srv: Served, token: str, text: str) -> tuple[Reads, str]:
    """One request opening with OPENING, watched: (what it read, its conversation)."""
    store = srv.server.store
    assert isinstance(store, SQLiteStore)
    with Reads(store.db) as reads:
        conv, reply = await chat(srv, token, [*OPENING, {"role": "user", "content": text}])
    assert reply == f"echo: {text}"
    return reads, conv


async def conversation(srv: Served, conv_id: str) -> ConversationRecord:
    found = await srv.server.store.get_conversation(conv_id)
    assert found is not None
    return found


async def test_a_shared_opening_costs_the_same_few_reads_however_many_conversations_share_it(tmp_path: Path) -> None:
    async with serving(tmp_path) as srv:
        bobs = await fork_many(srv, srv.bob, "q", FEW)
        assert len(set(bobs)) == FEW  # a conversation each: the first ten seeded, the others forked
        alices = await fork_many(srv, srv.alice, "a", PREFIX_CANDIDATES + 2)  # more than a lookup reads
        bob_ns = (await conversation(srv, bobs[0])).namespace
        alice_ns = (await conversation(srv, alices[0])).namespace
        assert bob_ns and alice_ns and bob_ns != alice_ns
        # alice's first request found none of bob's conversations: a new one, seeded
        assert (await conversation(srv, alices[0])).forked_from is None

        bob_before, _ = await watched(srv, srv.bob, "bob-1")
        alice_before, _ = await watched(srv, srv.alice, "alice-1")
        await fork_many(srv, srv.bob, "r", MANY)
        bob_after, bob_conv = await watched(srv, srv.bob, "bob-2")
        alice_after, alice_conv = await watched(srv, srv.alice, "alice-2")

        # Statements per request: none per conversation sharing the opening (before: two each, the
        # conversation and its newest message, for every one of bob's).
        assert len(bob_after.selects()) <= len(bob_before.selects()) + 2, (bob_before.selects(), bob_after.selects())
        assert len(alice_after.selects()) <= len(alice_before.selects()) + 2, alice_after.selects()
        # The points read: the newest few of the caller's own, not every point of the hash (bob's
        # read walked MANY more points; alice's walked bob's to drop them). Each point read is some
        # 40 steps; a few steps' slack for a deeper b-tree.
        for before, after in ((bob_before, bob_after), (alice_before, alice_after)):
            assert 0 < after.point_steps() <= before.point_steps() + 20, (before.point_steps(), after.point_steps())

        # Each still forked from its own credential's conversation, never another's.
        bob_fork, alice_fork = await conversation(srv, bob_conv), await conversation(srv, alice_conv)
        assert bob_fork.namespace == bob_ns and bob_fork.forked_from is not None
        assert (await conversation(srv, bob_fork.forked_from)).namespace == bob_ns
        assert alice_fork.namespace == alice_ns and alice_fork.forked_from is not None
        assert (await conversation(srv, alice_fork.forked_from)).namespace == alice_ns


async def test_continuation_and_forks_are_as_before_with_many_conversations_sharing_the_opening(tmp_path: Path) -> None:
    async with serving(tmp_path) as srv:
        await fork_many(srv, srv.bob, "q", PREFIX_CANDIDATES + 8)
        # bob's own conversation, continued by its transcript, with more than a lookup's worth of
        # other conversations at the opening's point
        mine, reply = await chat(srv, srv.bob, [*OPENING, {"role": "user", "content": "mine"}])
        assert reply == "echo: mine"
        turn2 = [*OPENING, {"role": "user", "content": "mine"}, {"role": "assistant", "content": reply}]
        again, reply2 = await chat(srv, srv.bob, [*turn2, {"role": "user", "content": "more"}])
        assert (again, reply2) == (mine, "echo: more")
        # a regenerate of that turn: it moved past that point, so a fork from it
        regen, reply3 = await chat(srv, srv.bob, [*turn2, {"role": "user", "content": "more"}])
        assert regen != mine and reply3 == "echo: more"
        assert (await conversation(srv, regen)).forked_from == mine
        # alice's first request with that history: none of bob's is hers, a new conversation seeded
        hers, _ = await chat(srv, srv.alice, [*turn2, {"role": "user", "content": "more"}])
        assert (await conversation(srv, hers)).forked_from is None
        # admin sees every conversation: its request forks from the most recently active there
        ops, _ = await chat(srv, srv.admin, [*turn2, {"role": "user", "content": "more"}])
        assert (await conversation(srv, ops)).forked_from in (regen, hers)


def _at_version(path: Path, upto: int) -> None:
    """A store as a server of schema version `upto` left it."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version, script in MIGRATIONS:
            if version > upto:
                break
            for statement in script.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT INTO schema_version(version) VALUES (?)", (version,))
    finally:
        db.close()


async def test_points_recorded_before_the_upgrade_are_found_by_their_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    newest = max(v for v, _ in MIGRATIONS)
    _at_version(path, newest - 1)
    db = sqlite3.connect(path, isolation_level=None)
    rows: list[tuple[Any, ...]] = [("c_bob", "ns:bob"), ("c_alice", "ns:alice"), ("c_ops", None)]
    db.execute("INSERT INTO agents(id, name, model, created_at, updated_at) VALUES ('agt_1', 'a', 'echo', 1, 1)")
    for n, (conv, ns) in enumerate(rows):
        db.execute(
            "INSERT INTO conversations(id, agent_id, namespace, created_at, updated_at) VALUES (?, 'agt_1', ?, ?, ?)",
            (conv, ns, n, n),
        )
        db.execute(
            "INSERT INTO history_points(agent_id, prefix_hash, conversation_id, last_message_id, created_at) "
            "VALUES ('agt_1', 'h', ?, 0, ?)",
            (conv, n),
        )
    db.close()
    store = SQLiteStore(path)
    await store.open()
    try:
        assert [p.conversation_id for p in await store.find_history_points("agt_1", "h", namespace="ns:bob")] == [
            "c_bob"
        ]
        assert [p.conversation_id for p in await store.find_history_points("agt_1", "h", namespace="ns:alice")] == [
            "c_alice"
        ]
        everyone = await store.find_history_points("agt_1", "h")
        assert [p.conversation_id for p in everyone] == ["c_ops", "c_alice", "c_bob"]  # most recently active first
    finally:
        await store.close()


async def test_a_lookup_reads_the_newest_points_of_the_callers_own_conversations(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "store.db")
    await store.open()
    try:
        await store.create_agent(AgentRecord(id="agt_1", name="a"))
        await store.create_agent(AgentRecord(id="agt_2", name="b"))
        for n in range(40):
            ns = "ns:bob" if n % 4 else "ns:alice"
            await store.create_conversation(ConversationRecord(id=f"c{n:02}", agent_id="agt_1", namespace=ns))
            await store.add_history_point(HistoryPoint("agt_1", "h", f"c{n:02}", n, created_at=100.0 + n))
        # a point naming another agent's conversation (never recorded so) is never handed out
        await store.create_conversation(ConversationRecord(id="other_agent", agent_id="agt_2", namespace="ns:bob"))
        await store.add_history_point(HistoryPoint("agt_1", "h", "other_agent", 0, created_at=50.0))

        bob = await store.find_history_points("agt_1", "h", namespace="ns:bob", limit=5)
        # the five most recently recorded of bob's, most recently active first (created in order)
        assert [p.conversation_id for p in bob] == ["c39", "c38", "c37", "c35", "c34"]
        # activity reorders them, not which five are read
        await store.append_messages("c34", [MessageRecord(role="user", content="later")])
        bob = await store.find_history_points("agt_1", "h", namespace="ns:bob", limit=5)
        assert [p.conversation_id for p in bob] == ["c34", "c39", "c38", "c37", "c35"]
        alice = await store.find_history_points("agt_1", "h", namespace="ns:alice", limit=5)
        assert [p.conversation_id for p in alice] == ["c36", "c32", "c28", "c24", "c20"]
        assert len(await store.find_history_points("agt_1", "h", limit=7)) == 7
        assert len(await store.find_history_points("agt_1", "h")) == 40  # other_agent's left out
        assert await store.find_history_points("agt_1", "h", namespace="ns:carol") == []

        heads = await store.last_message_ids(["c34", "c02", "nope"])
        assert heads == {"c34": await store.last_message_id("c34"), "c02": 0, "nope": 0} and heads["c34"] > 0
    finally:
        await store.close()
