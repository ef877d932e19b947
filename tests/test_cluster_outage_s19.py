"""A cluster through outages of its whole database, with real PostgreSQL and real `serve` processes:
an outage longer than `instance_timeout_s` fences nobody; a request that ended with the database
away leaves no Idempotency-Key that a retry waits on forever (nor a turn left running); and
`store copy` into a database a server starts on meanwhile leaves one `assistant`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from appserver.store import AgentRecord, ConversationRecord, SQLiteStore
from appserver.store.cluster import INSTANCE_LOCK_CLASS
from appserver.store.postgres import FIRST_AGENT_LOCK, PostgresStore
from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database, url_for
from tests.support.serve import ServeProcess, start_serve
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(90)


def _env(home: Path, url: str, heartbeat_s: float, instance_timeout_s: float, **more: str) -> dict[str, str]:
    return cli_env(
        home,
        APPSERVER_STORE__URL=url,
        APPSERVER_STORE__HEARTBEAT_S=str(heartbeat_s),
        APPSERVER_STORE__INSTANCE_TIMEOUT_S=str(instance_timeout_s),
        **more,
    )


def _start(
    tmp: Path, url: str, n: int, heartbeat_s: float, instance_timeout_s: float, **more: str
) -> list[ServeProcess]:
    nodes: list[ServeProcess] = []
    try:
        for i in range(n):
            home = tmp / f"node{i}"
            nodes.append(start_serve(home, env=_env(home, url, heartbeat_s, instance_timeout_s, **more)))
    except BaseException:
        for sp in nodes:
            sp.kill()
        raise
    return nodes


def _logs(nodes: list[ServeProcess]) -> str:
    return "".join(
        f"--- node{i}\n{sp.proc.stderr.so_far()}"  # type: ignore[attr-defined]
        for i, sp in enumerate(nodes)
        if sp.proc.stderr is not None
    )


def _outage(url: str, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
    """The database refuses every connection and ends every session for `seconds`, or until
    `until()` holds (PostgreSQL itself keeps running: other tests use it)."""
    db = url.rsplit("/", 1)[1]
    with psycopg.connect(url_for("postgres"), autocommit=True) as c:
        c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end and not until():
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (db,),
                )
                time.sleep(0.1)
        finally:
            c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')


def _query(url: str, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute(query, args).fetchall()


def _chat(sp: ServeProcess, content: str, timeout: float = 30, **headers: str) -> httpx.Response:
    return httpx.post(
        sp.url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": content}]},
        headers=headers,
        timeout=timeout,
    )


def _all_ready(nodes: list[ServeProcess]) -> None:
    ready = [httpx.get(sp.url + "/readyz", timeout=10) for sp in nodes]
    if [r.status_code for r in ready] != [200] * len(nodes):
        pytest.fail(f"{[(r.status_code, r.text[:200]) for r in ready]}\n{_logs(nodes)}", pytrace=False)


@contextmanager
def _sessions_kept_away(url: str, pids: tuple[int, ...] = ()) -> Iterator[psycopg.Connection[Any]]:
    """Every session and pooled connection of the database ended, and each instance's lock (only
    those of the servers `pids`, when given) taken by a connection of the test's own (so those
    sessions cannot come back) before connections are allowed again: the pools reconnect, those
    sessions not. Yields that connection; the locks go with it."""
    db = url.rsplit("/", 1)[1]
    locks = [(key,) for key, pid in _query(url, "SELECT lock_key, pid FROM instances") if not pids or pid in pids]
    with psycopg.connect(url, autocommit=True) as lingering:
        lingering.execute("SET lock_timeout = '20s'")
        with psycopg.connect(url_for("postgres"), autocommit=True) as c:
            c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
            try:
                end = time.monotonic() + 1.0
                while time.monotonic() < end:  # also a connection that was being opened as it began
                    c.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
                        (db, lingering.info.backend_pid),
                    )
                    time.sleep(0.1)
                for (key,) in locks:  # waits for the ended sessions to let go of it
                    lingering.execute("SELECT pg_advisory_lock(%s, %s)", (INSTANCE_LOCK_CLASS, key))
            finally:
                c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
        yield lingering


def _store_check(sp: ServeProcess) -> str:
    """The detail of the `store` check of the server's /readyz ('' when it could not be read)."""
    try:
        body = httpx.get(sp.url + "/readyz", timeout=15).json()
    except (httpx.HTTPError, ValueError):
        return ""
    return " ".join(str(c.get("detail", "")) for c in body.get("checks", []) if c.get("name") == "store")


def _until_pools_back(nodes: list[ServeProcess], within: float = 40.0) -> None:
    """Until each server's pool writes again while its session is still away: its /readyz probe
    row is written, then refused for the lost session."""
    deadline = time.monotonic() + within
    waiting = list(nodes)
    while waiting:
        waiting = [sp for sp in waiting if "has lost its database session" not in _store_check(sp)]
        if waiting and time.monotonic() > deadline:
            pytest.fail(f"the pools did not come back: {[_store_check(sp) for sp in waiting]}\n{_logs(nodes)}")
        time.sleep(0.2)


def _until_heartbeats_stale(conn: psycopg.Connection[Any], age: float, within: float = 40.0) -> None:
    """Until every instance's heartbeat is older than `age` s by the database's clock."""
    deadline = time.monotonic() + within
    while True:
        row = conn.execute(
            "SELECT extract(epoch from clock_timestamp()) - max(heartbeat_at), count(*) FROM instances"
        ).fetchone()
        if row is None or row[1] < 3 or row[0] > age:  # a server judged gone: the assertions say so
            return
        assert time.monotonic() < deadline, row
        time.sleep(0.2)


def _until_ready(nodes: list[ServeProcess], within: float = 30.0) -> None:
    """Until every server answers /readyz 200 (its session back), or fail with what they say (at
    once when one was judged gone: it never will)."""
    deadline = time.monotonic() + within
    while True:
        ready = [httpx.get(sp.url + "/readyz", timeout=15) for sp in nodes]
        if [r.status_code for r in ready] == [200] * len(nodes):
            return
        if time.monotonic() > deadline or any("was judged gone" in r.text for r in ready):
            pytest.fail(f"{[(r.status_code, r.text[:300]) for r in ready]}\n{_logs(nodes)}", pytrace=False)
        time.sleep(0.3)


def test_an_outage_longer_than_the_instance_timeout_fences_no_server(tmp_path: Path) -> None:
    """Heartbeat 1 s, instance timeout 6 s, outages of 8 s: when the database is back every
    heartbeat is older than the timeout. Each server judges the others only once its own session
    is back, and their heartbeats from no earlier than that moment: nobody is judged gone.

    Then the servers' sessions are kept away (their instance locks held, as by sessions that linger
    in the database) while their pools are back, until every heartbeat is older than the timeout:
    before, each server's sweep ran on its pool and judged the others gone by their stale
    heartbeats, and every server was fenced. The test waits for what it needs (each pool back, as
    its /readyz write says; the heartbeats stale by the database's clock), not for fixed times: the
    pool reconnects with a backoff of 1, 2, 4, 8 s, and a fixed wait ended before the pools were
    back, so the sweep never ran while the sessions were away."""
    require_postgres()
    with temp_database("s19_long_outage") as url:
        nodes = _start(tmp_path, url, 3, 1.0, 6)
        try:
            for sp in nodes:  # each holds a conversation: a lease to keep through the outage
                assert _chat(sp, "before").status_code == 200
            _outage(url, 8.0)
            time.sleep(7.0)  # past the timeout, counted from the end of the outage
            _all_ready(nodes)
            assert len(_query(url, "SELECT id FROM instances")) == 3

            with _sessions_kept_away(url) as lingering:
                _until_pools_back(nodes)
                _until_heartbeats_stale(lingering, 6.0 + 4.0)  # a few sweeps (1 s apart) past the timeout
            _until_ready(nodes)
            assert len(_query(url, "SELECT id FROM instances")) == 3
            for sp in nodes:
                reply = _chat(sp, "after")
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"] == "echo: after"
            assert "is gone" not in _logs(nodes)
        finally:
            for sp in nodes:
                sp.kill()


def test_a_retry_after_an_outage_runs_the_request_its_key_did_not_answer(tmp_path: Path) -> None:
    """A request with an Idempotency-Key runs on A when the database goes away (for less than the
    instance timeout: nobody is judged gone): its turn cannot be saved and its key cannot be
    released, and the client gets 503. Once the database is back, A writes both (the key released,
    the turn settled failed), so a retry on B runs the request: 200, one completed turn for it,
    its input once in history, and no turn left running. Before, the key stayed pending under the
    live A and every retry anywhere waited 120 s for a 409 idempotency_key_in_progress."""
    require_postgres()
    with temp_database("s19_idem_outage") as url:
        # A short connect timeout: the request waits for it once, for its turn's commit.
        nodes = _start(tmp_path, url, 2, 0.5, 30, APPSERVER_STORE__CONNECT_TIMEOUT_S="2")
        a, b = nodes
        try:
            text = "/slow 30"  # 1.5 s of model output: it ends while the database is away
            key = "s19-outage-key"
            first: dict[str, Any] = {}

            def send() -> None:
                try:
                    r = _chat(a, text, timeout=60, **{"Idempotency-Key": key})
                    first["status"], first["body"] = r.status_code, r.text
                except Exception as exc:  # pragma: no cover - shown by the assertion below
                    first["error"] = repr(exc)

            sender = threading.Thread(target=send)
            sender.start()
            deadline = time.monotonic() + 10
            while not _query(url, "SELECT 1 FROM turns WHERE status = 'running'"):
                assert time.monotonic() < deadline, "the turn never started"
                time.sleep(0.05)
            # Without a connection within the connect timeout the turn's commit fails, and the key's
            # release is left for A to write once the database is back: the outage lasts until the answer.
            _outage(url, 40.0, until=lambda: not sender.is_alive())
            sender.join(20)
            assert first.get("status") == 503, (first, _logs(nodes))
            assert "store_unavailable" in first["body"], first
            deadline = time.monotonic() + 20  # A repairs after its next heartbeat (once its pool is back)
            while _query(url, "SELECT 1 FROM turns WHERE status = 'running'") or _query(
                url, "SELECT 1 FROM http_idempotency WHERE key = %s AND state = 'pending'", (key,)
            ):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"{_query(url, 'SELECT id, status, owner FROM turns')} "
                        f"{_query(url, 'SELECT key, state, owner FROM http_idempotency')}\n{_logs(nodes)}",
                        pytrace=False,
                    )
                time.sleep(0.1)
            started = time.monotonic()
            retry = _chat(b, text, timeout=30, **{"Idempotency-Key": key})
            assert retry.status_code == 200, retry.text
            assert retry.json()["choices"][0]["message"]["content"] == " ".join(f"w{i}" for i in range(1, 31))
            assert time.monotonic() - started < 15
            again = _chat(a, text, timeout=30, **{"Idempotency-Key": key})  # now answered: replayed
            assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
            assert again.json() == retry.json()
            statuses = sorted(
                s for (s,) in _query(url, "SELECT status FROM turns WHERE input::text LIKE %s", ("%/slow 30%",))
            )
            assert statuses == ["completed", "failed"]  # the one the outage failed, and the retry's
            users = _query(
                url, "SELECT count(*) FROM messages WHERE role = 'user' AND content::text LIKE %s", ("%/slow 30%",)
            )
            assert users == [(1,)]  # the failed turn wrote nothing
        finally:
            for sp in nodes:
                sp.kill()


def _waits_for_first_agent_lock(url: str) -> bool:
    """A session of the database waits for the first-agent lock (a server starting, at its
    first-agent check, behind the copy that holds it)."""
    key = FIRST_AGENT_LOCK & 0xFFFFFFFFFFFFFFFF
    return bool(
        _query(
            url,
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = %s AND objid = %s",
            (key >> 32, key & 0xFFFFFFFF),
        )
    )


class _PausedSource:
    """The SQLite connection `store copy` reads, pausing the copy (its PostgreSQL transaction
    open, the agents copied) when it first reads the table named by `at`."""

    def __init__(self, db: Any, at: str) -> None:
        self.db = db
        self.at = at
        self.reached = threading.Event()
        self.go = threading.Event()

    def execute(self, query: str, *args: Any) -> Any:
        if f'FROM "{self.at}"' in query and not self.reached.is_set():
            self.reached.set()
            self.go.wait(30)
        return self.db.execute(query, *args)


def test_store_copy_while_a_server_starts_on_the_database_leaves_one_assistant(tmp_path: Path) -> None:
    """`store copy` into an empty database, and a `serve` starting on it while the copy's
    transaction is open (its agents copied, not committed): the server, finding no agent, waits for
    the copy and then finds the copied `assistant`. Before, it created one more, and every request
    for `assistant` was refused as ambiguous."""
    require_postgres()
    with temp_database("s19_copy_race") as url:

        async def fill() -> SQLiteStore:
            store = SQLiteStore(tmp_path / "source.db")
            await store.open()
            await store.create_agent(AgentRecord(id="agt_copied", name="assistant"))
            await store.create_conversation(ConversationRecord(id="conv_copied", agent_id="agt_copied"))
            return store

        source = asyncio.run(fill())
        paused = _PausedSource(source.db, "conversations")
        copied: dict[str, Any] = {}

        def copy() -> None:
            async def go() -> dict[str, int]:
                target = PostgresStore(url)
                await target.open()
                try:
                    return await target.copy_from_sqlite(paused)  # type: ignore[arg-type]
                finally:
                    await target.close()

            try:
                copied["counts"] = asyncio.run(go())
            except Exception as exc:  # pragma: no cover - shown by the assertion below
                copied["error"] = repr(exc)

        copier = threading.Thread(target=copy)
        copier.start()
        server: dict[str, Any] = {}

        def serve() -> None:
            home = tmp_path / "node"
            try:
                server["sp"] = start_serve(home, env=_env(home, url, 0.5, 30), timeout=40)
            except Exception as exc:  # pragma: no cover - shown by the assertion below
                server["error"] = repr(exc)

        starter = threading.Thread(target=serve)
        try:
            assert paused.reached.wait(20), copied
            starter.start()
            # the server is at its first-agent check: waiting for the lock the copy holds (at most
            # 10 s, then on as before: the assertions say what the server did)
            eventually(lambda: _waits_for_first_agent_lock(url), 10)
            paused.go.set()
            copier.join(30)
            starter.join(45)
            assert "error" not in copied, copied
            assert copied["counts"]["agents"] == 1
            assert "sp" in server, server
            agents = _query(url, "SELECT id FROM agents WHERE name = 'assistant'")
            assert agents == [("agt_copied",)], agents
            reply = _chat(server["sp"], "hello")
            assert reply.status_code == 200, reply.text
        finally:
            paused.go.set()
            copier.join(30)
            starter.join(45)
            if "sp" in server:
                server["sp"].kill()
            asyncio.run(source.close())
