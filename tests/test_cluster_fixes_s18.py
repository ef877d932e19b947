"""Cluster fixes (docs/scale-out.md): real PostgreSQL databases and real `appserver serve` processes.

- A CLI command on a PostgreSQL store is no server of its cluster: it settles, takes and runs no
  turn (it interrupted every turn the servers ran), and `appserver run` in it refuses.
- A server judged gone while stopped tells its clients how their turns really ended (the one the
  survivor completed: completed), not a failure of each (test_cluster_fixes_s18_b.py, with the
  other tests that start clusters of their own: split off so that neither file alone bounds the
  suite's wall time).
- Subscribing through a server that does not hold the conversation shows the turn running there
  as the active one, not idle with it queued.
- An answer passed to a holder that does not reply in time is `outcome_unknown`, not an
  `internal_error` saying "try again" (the holder applies it when it resumes).
- A bad schema is refused at start with one line; a complete schema with no agent gets `assistant`.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from appserver.procid import identity_alive
from appserver.store.pgschema import MIGRATIONS, expected_columns
from appserver.store.postgres import PostgresStore
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

# The module cluster: an instance timeout longer than the 10 s a call to a holder waits (the
# approval test stops the holder for that long without it being judged gone). Nothing waits for it
# to judge a server gone, so a heartbeat a second (the default's half), not 0.2 s: a fifth of the
# beats for the two servers and the database to run.
SLOW_TIMEOUT = {"APPSERVER_STORE__HEARTBEAT_S": "1", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "25"}
# Fast heartbeats, for clusters that fail over (test_cluster_fixes_s18_b.py).
FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}


def _env(home: Path, url: str, **extra: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, **extra)


def _start(tmp: Path, url: str, n: int, timing: dict[str, str]) -> list[ServeProcess]:
    return [start_serve(tmp / f"node{i}", env=_env(tmp / f"node{i}", url, **timing)) for i in range(n)]


def _stop_all(nodes: list[ServeProcess]) -> None:
    for sp in nodes:
        if sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGCONT)
    for sp in nodes:
        try:
            sp.stop(timeout=10)
        except Exception:
            pass
        sp.kill()


def _turns(url: str, conversation_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c:
        c.row_factory = psycopg.rows.dict_row
        return c.execute(
            "SELECT id, status, owner, stop_reason FROM turns WHERE conversation_id = %s ORDER BY seq",
            (conversation_id,),
        ).fetchall()


def _count(url: str, table: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


async def _create(ws: WS, agent: str = "assistant") -> str:
    reply = await ws.request({"type": "create_conversation", "agent": agent})
    assert "conversation" in reply, reply
    return str(reply["conversation"]["id"])


async def _submit(ws: WS, conversation: str, text: str, agent: str = "assistant") -> dict[str, Any]:
    ack = await ws.request({"type": "submit_input", "agent": agent, "conversation": conversation, "input": text})
    assert ack["type"] == "ack", ack
    return ack


async def _text_shown(ws: WS, turn_id: str) -> None:
    await ws.expect(
        lambda f: f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn_id and f["snapshot"]["blocks"],
        timeout=15,
    )


class Cluster:
    def __init__(self, url: str, tmp: Path, nodes: list[ServeProcess]) -> None:
        self.url = url
        self.tmp = tmp
        self.nodes = nodes

    def logs(self) -> str:
        return "".join(
            f"--- node{i}\n{sp.proc.stderr.so_far()}"  # type: ignore[union-attr]
            for i, sp in enumerate(self.nodes)
            if sp.proc.stderr is not None
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("s18")
    with temp_database("s18") as url:
        admin = tmp / "admin"
        made = run_cli(admin, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(admin, url))
        assert made.code == 0, made.err
        made = run_cli(admin, "agents", "create", "--name", "spare", env=_env(admin, url))
        assert made.code == 0, made.err
        nodes = _start(tmp, url, 2, SLOW_TIMEOUT)
        try:
            yield Cluster(url, tmp, nodes)
        finally:
            _stop_all(nodes)


# ------------------------------------------------------------------ 1: a CLI is no server


def test_identity_alive_never_judges_an_instance_id_dead() -> None:
    """An instance id names no process of this host: taken as dead, every turn of a live server
    was settled as a dead process's by whoever asked."""
    assert identity_alive("inst_0123456789abcdef") is True
    assert identity_alive("garbage") is False  # a name that is no process identity otherwise: gone, as before


def test_cli_commands_on_a_cluster_store_leave_the_servers_turns_alone(cluster: Cluster) -> None:
    """`agents list`, `conversations list` and `agents delete` from another home on the same
    database, while a turn streams on A: none of them settles it (they interrupted it, and A's
    client saw `taken over`), and `agents delete` succeeds. `appserver run` in such a process
    refuses (exit 2), accepting nothing: it holds no lease, so it would run beside the servers."""
    url = cluster.url
    cli_home = cluster.tmp / "cli"
    env = _env(cli_home, url)

    async def go() -> None:
        a = await WS.open(cluster.nodes[0].url)
        conv = await _create(a)
        ack = await _submit(a, conv, "/slow 50")
        await _text_shown(a, ack["turn_id"])
        for args in (
            ("agents", "list"),
            ("conversations", "list", "--agent", "assistant"),
            ("agents", "delete", "spare"),
        ):
            r = await asyncio.to_thread(run_cli, cli_home, *args, env=env)
            assert r.code == 0, (args, r.err)
            assert "interrupted" not in r.err and "taken over" not in r.err, (args, r.err)
        # still running, or (a loaded machine runs the commands slowly) completed on its own: never settled by them
        assert [t["status"] for t in _turns(url, conv)] in (["running"], ["completed"]), _turns(url, conv)
        turns_before, convs_before = _count(url, "turns"), _count(url, "conversations")
        r = await asyncio.to_thread(run_cli, cli_home, "run", "--conversation", conv, "hello from the cli", env=env)
        assert r.code == 2, (r.code, r.out, r.err)
        assert "run only in its servers" in r.err and "Traceback" not in r.err, r.err
        new = await asyncio.to_thread(run_cli, cli_home, "run", "--conversation", "new", "hi", env=env)
        assert new.code == 2, (new.code, new.err)
        assert (_count(url, "turns"), _count(url, "conversations")) == (turns_before, convs_before)
        final = await a.terminal(ack["turn_id"], timeout=20)
        assert final["status"] == "completed", (final, cluster.logs())
        assert final["blocks"][-1]["text"].endswith("w50")
        rows = _turns(url, conv)
        assert [t["status"] for t in rows] == ["completed"], rows
        await a.close()

    asyncio.run(go())


def test_cron_run_on_a_cluster_store_without_a_server_refuses_before_claiming(cluster: Cluster) -> None:
    """`cron run` in a process that is no server of the cluster refuses (exit 2) before it claims a
    run: it claimed one, then failed to submit it, leaving a run number used by nothing."""
    cli_home = cluster.tmp / "cli-cron"
    env = _env(cli_home, cluster.url)
    added = run_cli(cli_home, "cron", "add", "--name", "s18-now", "--agent", "assistant", "--every", "1h",
                    "--prompt", "hi", env=env)  # fmt: skip
    assert added.code == 0, added.err
    r = run_cli(cli_home, "cron", "run", "s18-now", env=env)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "run only in its servers" in r.err and "Traceback" not in r.err, r.err
    logs = run_cli(cli_home, "cron", "logs", "s18-now", "--json", env=env)
    assert "claimed" not in logs.out and "submitted" not in logs.out, logs.out
    removed = run_cli(cli_home, "cron", "remove", "s18-now", env=env)
    assert removed.code == 0, removed.err


# ------------------------------------------------------------------ 3: the same state everywhere


def test_a_subscriber_elsewhere_sees_the_running_turn_as_active(cluster: Cluster) -> None:
    """B subscribes while a turn runs on A and A publishes nothing (B's mirror is rebuilt from the
    database, where a running turn has no phase): B said idle, no active turn, two queued. Now B
    says what A says: active, that turn, one queued."""

    async def go() -> None:
        a, b = await WS.open(cluster.nodes[0].url), await WS.open(cluster.nodes[1].url)
        conv = await _create(a)
        ack = await _submit(a, conv, "/slow 40")
        await _text_shown(a, ack["turn_id"])
        queued = await _submit(a, conv, "after it")
        await asyncio.sleep(0.6)  # a draft checkpoint (draft_interval_s) holds the text so far
        # A stopped for a moment (far from being judged gone): B hears nothing from it and shows
        # the turns as the database has them
        cluster.nodes[0].proc.send_signal(signal.SIGSTOP)
        try:
            on_b = await b.request({"type": "subscribe", "conversation": conv})
        finally:
            cluster.nodes[0].proc.send_signal(signal.SIGCONT)
        on_a = await a.request({"type": "subscribe", "conversation": conv})
        for state in (on_a, on_b):
            assert state["type"] == "conversation_state", state
            assert state["state"] == "active", state
            assert state["active_turn"] is not None and state["active_turn"]["turn_id"] == ack["turn_id"], state
            assert state["queued"] == 1, state
        # and B shows the reply so far from the checkpoint (was: no blocks at revision 0)
        shown = "".join(x.get("text") or "" for x in on_b["active_turn"]["blocks"] if x["type"] == "text")
        assert shown.startswith("w1 w2"), on_b["active_turn"]
        assert on_b["active_turn"]["revision"] > 1, on_b["active_turn"]
        assert (await b.terminal(queued["turn_id"], timeout=20))["status"] == "completed"
        await a.close()
        await b.close()

    asyncio.run(go())


# ------------------------------------------------------------------ 4: an answer whose outcome is unknown


def test_an_answer_the_stopped_holder_does_not_acknowledge_is_outcome_unknown(cluster: Cluster) -> None:
    """A turn waits for an approval on A; A is stopped (not long enough to be judged gone); the
    approval sent through B gets no reply from A within 10 s: B says `outcome_unknown` (it was
    `internal_error` "try again", and a retry then found it `already_resolved`). When A resumes it
    applies the answer and the turn completes."""
    url = cluster.url

    async def go() -> None:
        a, b = await WS.open(cluster.nodes[0].url), await WS.open(cluster.nodes[1].url)
        conv = await _create(a, "careful")
        ack = await _submit(a, conv, "/call clock {}", agent="careful")
        request = await a.expect(lambda f: f["type"] == "approval_request", timeout=15)
        cluster.nodes[0].proc.send_signal(signal.SIGSTOP)
        try:
            answer = await b.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [{"call_id": request["call_id"], "decision": "approve"}],
                },
                timeout=30,
            )
        finally:
            cluster.nodes[0].proc.send_signal(signal.SIGCONT)
        assert answer["type"] == "error" and answer["code"] == "outcome_unknown", answer
        assert "subscribe" in answer["message"], answer
        final = await a.terminal(ack["turn_id"], timeout=20)
        assert final["status"] == "completed", (final, cluster.logs())
        assert [t["status"] for t in _turns(url, conv)] == ["completed"]
        await a.close()
        await b.close()

    asyncio.run(go())


# ------------------------------------------------------------------ 5: bad schemas


def _serve_refused(home: Path, url: str) -> str:
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", env=_env(home, url), timeout=30)
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err, r.err
    return r.err


def _migrate(url: str) -> None:
    """What a first start does to the database: the migrations, nothing else."""
    store = PostgresStore(url)

    async def open_close() -> None:
        await store.open()
        await store.close()

    asyncio.run(open_close())


def test_serve_refuses_a_schema_version_that_is_no_number(tmp_path: Path) -> None:
    with temp_database("s18_badver") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE schema_version (version TEXT)")
            c.execute("INSERT INTO schema_version VALUES ('abc')")
        err = _serve_refused(tmp_path / "home", url)
        assert "schema_version" in err and "'abc'" in err, err


def test_serve_refuses_a_schema_missing_a_column(tmp_path: Path) -> None:
    with temp_database("s18_nocol") as url:
        _migrate(url)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("ALTER TABLE turns DROP COLUMN draft")
        err = _serve_refused(tmp_path / "home", url)
        assert "turns.draft" in err, err


def test_expected_columns_are_those_of_a_migrated_database() -> None:
    """The start's schema check reads the migrations' statements: they say what a migrated
    database holds, table for table and column for column."""
    with temp_database("s18_cols") as url:
        _migrate(url)
        with psycopg.connect(url) as c:
            rows = c.execute(
                "SELECT table_name, column_name FROM information_schema.columns "
                "WHERE table_schema = current_schema() AND table_name <> 'schema_version'"
            ).fetchall()
    present: dict[str, set[str]] = {}
    for table, column in rows:
        present.setdefault(table, set()).add(column)
    assert {t: set(cs) for t, cs in expected_columns().items()} == present


def test_serve_creates_the_default_agent_on_a_complete_schema_with_none(tmp_path: Path) -> None:
    """A first start killed between its migrations and the default agent left a schema and no
    agent: docs/scale-out.md says serve creates `assistant` on a database with no agent yet."""
    with temp_database("s18_noagent") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            for version, script in MIGRATIONS:
                c.execute(script)  # type: ignore[arg-type]
                c.execute("INSERT INTO schema_version VALUES (%s)", (version,))
        home = tmp_path / "home"
        listed = run_cli(home, "agents", "list", "--json", env=_env(home, url))
        assert listed.code == 0 and listed.json() == [], (listed.out, listed.err)  # a CLI creates none
        sp = start_serve(home, env=_env(home, url, **FAST))
        try:
            with psycopg.connect(url) as c:
                names = [r[0] for r in c.execute("SELECT name FROM agents").fetchall()]
            assert names == ["assistant"], names
        finally:
            sp.stop()
            sp.kill()
