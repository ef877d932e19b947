"""gateway/sqlstore.py: the gateway's statements on SQLite (gateway.db) and on PostgreSQL alike.

The same ledger, route, pairing, status and approval-prompt operations run on both backends and
read back the same; on PostgreSQL the statements are translated, a shared database is read per
gateway (its scope), writes are fenced by the cluster's `channel_owners`, reasons are masked in
Python, the schema is made once when two start at once, and a home's gateway.db is imported once.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from gateway.approvals import ApprovalBoard
from gateway.db import open_db, transaction
from gateway.ledger import Ledger, UpdateKey
from gateway.pairing import Pairing
from gateway.redact import MASKED_COLUMNS, SecretMask, mask_stored
from gateway.routing import RouteKey, Router
from gateway.sqlstore import (
    MASKED,
    Fenced,
    PgConnection,
    PgOperationalError,
    import_sqlite,
    masked_positions,
    open_pg,
    translate,
)
from gateway.status import AccountStatus, StatusBoard
from tests.support.pg import temp_database

OWNERS = (
    "CREATE TABLE IF NOT EXISTS channel_owners (account TEXT PRIMARY KEY, instance_id TEXT NOT NULL,"
    " since DOUBLE PRECISION NOT NULL)"
)


@pytest.fixture
def pg_url() -> Iterator[str]:
    with temp_database("gw_sqlstore") as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        c: Any = open_db(tmp_path / "channels" / "gateway.db")
        yield c
        c.close()
        return
    with temp_database("gw_sqlstore") as url:
        c = open_pg(url)
        yield c
        c.close()


# ---------------------------------------------------------------- statements


def test_translate_covers_the_sqlite_forms_the_gateway_writes() -> None:
    assert translate("SELECT agent FROM routes WHERE key=?") == "SELECT agent FROM gateway_routes WHERE key=%s"
    assert translate("INSERT OR IGNORE INTO ledger (a, b) VALUES (?,'x?')") == (
        "INSERT INTO gateway_ledger (a, b) VALUES (%s,'x?') ON CONFLICT DO NOTHING"
    )
    assert translate("INSERT OR REPLACE INTO approved_senders (channel, account, sender, code) VALUES (?,?,?,?)") == (
        "INSERT INTO gateway_approved_senders (channel, account, sender, code) VALUES (%s,%s,%s,%s)"
        " ON CONFLICT (channel, account, sender) DO UPDATE SET code=EXCLUDED.code"
    )
    assert translate("UPDATE pairing_revokes SET applied=MAX(applied, ?)") == (
        "UPDATE gateway_pairing_revokes SET applied=GREATEST(applied, %s)"
    )
    assert translate("SET expires_at=MIN(expires_at, ?)").endswith("LEAST(expires_at, %s)")
    assert translate("SELECT MAX(n.id) FROM ledger n WHERE n.chat=ledger.chat") == (
        "SELECT MAX(n.id) FROM gateway_ledger n WHERE n.chat=gateway_ledger.chat"
    )
    assert translate("SELECT 1 FROM route_conversations WHERE key LIKE '5%'").endswith("'5%%'")


def test_the_masked_columns_are_those_of_the_sqlite_triggers() -> None:
    assert {(t, c) for t, cols in MASKED.items() for c in cols} == set(MASKED_COLUMNS)
    assert masked_positions("UPDATE ledger SET state=?, updated_at=?, reason=? WHERE channel=?") == (2,)
    assert masked_positions("UPDATE ledger SET state=?, decision=? WHERE reason=?") == ()
    assert masked_positions(
        "INSERT INTO account_status (channel, account, state, reason, x) VALUES (?,?,'s',?,?) ON CONFLICT DO NOTHING"
    ) == (2,)
    assert masked_positions("UPDATE account_status SET last_failure_at=?, last_failure_reason=? WHERE channel=?") == (
        1,
    )
    assert masked_positions("UPDATE routes SET reason=?") == ()


# ---------------------------------------------------------------- both backends


def test_ledger_routes_pairing_and_status_read_back_the_same_on_both(conn: Any) -> None:
    ledger = Ledger(conn, clock=lambda: 1000.0)
    key = UpdateKey("webhook", "main", "m1")
    entry, new = ledger.record(key, chat="c1", sender="s1", payload={"text": "hé"})
    assert (entry.state, new, entry.payload) == ("received", True, {"text": "hé"})
    assert ledger.record(key, chat="c1", sender="s1")[1] is False  # a redelivery changes nothing
    ledger.decide(key, "allow", "ok")
    assert [e.key for e in ledger.to_submit()] == [key]
    ledger.mark_failed(key, "boom")
    assert ledger.counts() == {"failed": 1}
    assert ledger.last_failures() == {("webhook", "main"): ("m1", "boom", 1000.0)}

    router = Router(conn, clock=lambda: 5.0)
    router.add(RouteKey("webhook", "main", "c1"), "assistant")
    router.bind(RouteKey("webhook", "main", "c1"), "conv-1")
    router.bind(RouteKey("webhook", "main", "c1"), "conv-2")  # the upsert
    resolved = router.resolve(RouteKey("webhook", "main", "c1"))
    assert resolved is not None and (resolved.agent, resolved.conversation) == ("assistant", "conv-2")
    moved = ledger.move_chat("webhook", "main", "c1", "c9")
    assert (moved.routes, moved.conversations) == (1, 1)
    assert [str(r.key) for r in router.routes("webhook", "main")] == ["webhook:main:c9:__root__"]
    assert router.forget(RouteKey("webhook", "main", "c9")) is True

    pairing = Pairing(conn)
    code, fresh = pairing.code_for("webhook", "main", "s2", "S", "c2")
    assert fresh and code is not None
    assert pairing.code_for("webhook", "main", "s2", "S", "c2") == (code, False)
    pairing.approve(code.code)
    assert pairing.is_approved("webhook", "main", "s2")
    assert [p.code for p in pairing.decided_unhandled()] == [code.code]
    before = pairing.data_version()
    assert pairing.revoke("s2") == 1
    assert pairing.changes() == (1, 0)
    if isinstance(conn, PgConnection):  # SQLite's moves only for another connection's commit
        assert pairing.data_version() != before
    pairing.mark_applied(1)
    pairing.mark_applied(0)  # never backwards
    assert pairing.changes() == (1, 1)

    board = StatusBoard(conn)
    status = AccountStatus("webhook", "main", "running", None, None, None, 1, 2, 3, 0, 7.0)
    board.save([status])
    board.save([AccountStatus("webhook", "main", "error", "why", None, None, 1, 2, 3, 1, 8.0)])
    board.note_failure(status, "send failed", 9.0)
    assert [(s.state, s.failures) for s in board.all()] == [("running", 0)]
    assert board.last_failures() == {("webhook", "main"): ("send failed", 9.0)}

    ApprovalBoard(conn)  # its start prunes old prompts
    deleted, _ = ledger.prune(2000.0)
    assert deleted == 0  # the newest row of its chat is kept


def test_a_failed_transaction_leaves_nothing_on_both(conn: Any) -> None:
    router = Router(conn)
    with pytest.raises(RuntimeError), transaction(conn) as c:
        c.execute(
            "INSERT INTO routes (key, agent, conversation, created_at) VALUES (?,?,?,?)", ("a:b:c:d", "x", None, 1)
        )
        raise RuntimeError("undone")
    assert router.routes() == []
    router.add(RouteKey("a", "b", "c"), "x")  # the connection is usable after the rollback
    assert len(router.routes()) == 1


# ---------------------------------------------------------------- PostgreSQL only


def test_a_shared_database_is_read_per_gateway_scope(pg_url: str) -> None:
    one = open_pg(pg_url, scope=[("webhook", "a")])
    two = open_pg(pg_url, scope=[("webhook", "b")])
    owner = open_pg(pg_url)
    try:
        for conn, account in ((one, "a"), (two, "b")):
            ledger = Ledger(conn)
            ledger.record(UpdateKey("webhook", account, "m"), chat="c", sender="s")
            code, _ = Pairing(conn).code_for("webhook", account, "s", None, "c")
            assert code is not None
            Pairing(owner).approve(code.code)
        assert [e.key.account for e in Ledger(one).to_decide()] == ["a"]
        assert [e.key.account for e in Ledger(two).to_decide()] == ["b"]
        assert {e.key.account for e in Ledger(owner).to_decide()} == {"a", "b"}
        assert [p.account for p in Pairing(one).decided_unhandled()] == ["a"]
        StatusBoard(owner).save([AccountStatus("webhook", "b", "running", None, None, None, 0, 0, 0, 0, 1.0)])
        StatusBoard(one).mark_unconfigured({("webhook", "a")})  # b is another server's: left alone
        assert [s.state for s in StatusBoard(owner).all()] == ["running"]
    finally:
        for conn in (one, two, owner):
            conn.close()


def test_writes_are_fenced_by_the_channel_owners_row(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(OWNERS)
        admin.execute("INSERT INTO channel_owners VALUES ('webhook:main', 'inst-a', 0)")
    said: list[str] = []
    conn = open_pg(pg_url, instance="inst-a", scope=[("webhook", "main")], on_fenced=said.append)
    try:
        ledger = Ledger(conn)
        ledger.record(UpdateKey("webhook", "main", "m1"), chat="c", sender="s")  # held: written
        with psycopg.connect(pg_url, autocommit=True) as admin:  # a survivor takes the account over
            admin.execute("UPDATE channel_owners SET instance_id = 'inst-b'")
        with pytest.raises(Fenced):
            ledger.record(UpdateKey("webhook", "main", "m2"), chat="c", sender="s")
        assert said and "no longer holds webhook:main" in said[0]
        assert isinstance(Fenced("x"), sqlite3.OperationalError)
        assert [e.key.message_id for e in Ledger(open_pg(pg_url)).to_decide()] == ["m1"]
    finally:
        conn.close()


def test_a_takeover_waits_for_a_fenced_write_in_flight(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(OWNERS)
        admin.execute("INSERT INTO channel_owners VALUES ('webhook:main', 'inst-a', 0)")
    conn = open_pg(pg_url, instance="inst-a", scope=[("webhook", "main")])
    took: list[float] = []

    def take() -> None:
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("UPDATE channel_owners SET instance_id = 'inst-b'")
            took.append(time.monotonic())

    try:
        with transaction(conn) as c:
            thread = threading.Thread(target=take)
            thread.start()
            time.sleep(0.3)
            assert not took  # the owner row is locked for share until this write commits
            c.execute("INSERT INTO routes (key, agent, created_at) VALUES (?,?,?)", ("webhook:main:c:__root__", "x", 1))
            committed = time.monotonic()
        thread.join(10)
        assert took and took[0] >= committed
    finally:
        conn.close()


def test_reasons_are_masked_in_python_on_postgresql(pg_url: str) -> None:
    conn = open_pg(pg_url)
    try:
        mask = SecretMask()
        mask.add("bot_token", "123456:SECRET-token-value")
        mask_stored(conn, mask)  # type: ignore[arg-type]
        ledger = Ledger(conn)
        key = UpdateKey("telegram", "main", "1")
        ledger.record(key, chat="c", sender="s", payload={"text": "123456:SECRET-token-value"})
        ledger.decide(key, "deny", "refused: /bot123456:SECRET-token-value/getMe")
        StatusBoard(conn).save(
            [AccountStatus("telegram", "main", "error", "401 for 123456:SECRET-token-value", None, None, 0, 0, 0, 0, 1)]
        )
        with psycopg.connect(pg_url, autocommit=True) as c:
            reasons = [
                r[0]
                for r in c.execute(
                    "SELECT reason FROM gateway_ledger UNION ALL SELECT reason FROM gateway_account_status"
                )
            ]
            payload = c.execute("SELECT payload FROM gateway_ledger").fetchone()[0]
        assert reasons and all("SECRET" not in r and "<bot_token>" in r for r in reasons), reasons
        assert "SECRET" in payload  # the sender's own words are kept as they are (as on SQLite)
    finally:
        conn.close()


def test_two_gateways_starting_at_once_make_the_schema_once(pg_url: str) -> None:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            open_pg(pg_url).close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    with psycopg.connect(pg_url, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM gateway_schema").fetchone()[0] == 1
        assert c.execute("SELECT count(*) FROM gateway_pairing_revokes").fetchone()[0] == 1


def test_a_lost_session_is_read_again_and_a_write_fails_as_a_busy_database(pg_url: str) -> None:
    conn = open_pg(pg_url)
    try:
        pid = conn.raw("SELECT pg_backend_pid()")[0][0]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert Router(conn).routes() == []  # read again on a new session
        assert conn.raw("SELECT pg_backend_pid()")[0][0] != pid
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.raw("SELECT pg_backend_pid()")[0][0],))
        with pytest.raises(PgOperationalError), transaction(conn) as c:  # a write fails: its caller tries again
            c.execute("DELETE FROM routes")
        assert Router(conn).routes() == []
    finally:
        conn.close()


def test_a_homes_gateway_db_is_imported_once_per_account(pg_url: str, tmp_path: Path) -> None:
    source = open_db(tmp_path / "channels" / "gateway.db")
    for account in ("a", "b"):
        ledger = Ledger(source)
        ledger.record(UpdateKey("webhook", account, "m"), chat="c", sender="s")
        Router(source).bind(RouteKey("webhook", account, "c"), f"conv-{account}")
        code, _ = Pairing(source).code_for("webhook", account, "s", None, "c")
        assert code is not None
        Pairing(source).approve(code.code)
    conn = open_pg(pg_url, scope=[("webhook", "a")])
    try:
        assert import_sqlite(conn, source, tmp_path) == 4  # ledger, binding, code, approval of a
        assert import_sqlite(conn, source, tmp_path) is None
        assert Pairing(conn).is_approved("webhook", "a", "s")
        assert not Pairing(conn).is_approved("webhook", "b", "s")
        assert Router(conn).resolve(RouteKey("webhook", "a", "c"), "x").conversation == "conv-a"  # type: ignore[union-attr]
        conn.scope = frozenset({("webhook", "a"), ("webhook", "b")})  # the account moved here later
        assert import_sqlite(conn, source, tmp_path) == 4
        assert Pairing(conn).is_approved("webhook", "b", "s")
    finally:
        conn.close()
        source.close()


# ---------------------------------------------------------------- the CLI on a PostgreSQL home


def test_channels_and_pairing_commands_use_the_postgresql_tables(pg_url: str, tmp_path: Path) -> None:
    from gateway.db import default_path
    from tests.support.cli import cli_env, run_cli
    from tests.support.gateway import write_config

    home = tmp_path / "home"
    write_config(home, {"webhook": {"main": {"listen": "127.0.0.1:0", "secret_env": "S"}}}, ["webhook"])
    env = cli_env(home, APPSERVER_STORE__URL=pg_url)
    seeded = open_pg(pg_url)
    try:
        code, _ = Pairing(seeded).code_for("webhook", "main", "alice", "Alice", "c1")
        assert code is not None
    finally:
        seeded.close()

    listed = run_cli(home, "pairing", "list", "--json", env=env)
    assert listed.code == 0, listed.err
    assert [p["code"] for p in listed.json()] == [code.code]
    approved = run_cli(home, "pairing", "approve", code.code, env=env)
    assert approved.code == 0, approved.err
    senders = run_cli(home, "pairing", "approved", "--json", env=env)
    assert senders.code == 0 and "alice" in senders.out, senders.err

    added = run_cli(home, "channels", "route", "add", "webhook:main:c1", "assistant", env=env)
    assert added.code == 0, added.err
    routes = run_cli(home, "channels", "route", "list", "--json", env=env)
    assert routes.code == 0 and "webhook:main:c1:__root__" in routes.out, routes.err
    status = run_cli(home, "channels", "status", "--json", env=env)
    assert status.code == 0, status.err

    revoked = run_cli(home, "pairing", "revoke", "alice", env=env)
    assert revoked.code == 0, revoked.err
    check = open_pg(pg_url)
    try:
        assert not Pairing(check).is_approved("webhook", "main", "alice")
        assert [str(r.key) for r in Router(check).routes()] == ["webhook:main:c1:__root__"]
    finally:
        check.close()
    assert not default_path(home).exists()  # nothing in the home's gateway.db
