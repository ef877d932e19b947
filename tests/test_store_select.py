"""Which store a configuration selects (`[store] url`, APPSERVER_STORE__URL, `serve --store`), a
password that is never shown, the driver loaded only for PostgreSQL, and a real `serve` on PostgreSQL."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
import pytest

from appserver.config import ConfigError, load_config
from appserver.store import SQLiteStore
from appserver.store.base import StoreError
from appserver.store.integrity import StoreOpenError
from appserver.store.postgres import PostgresStore
from appserver.store.select import make_store
from appserver.store.url import redact_url, scrub
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(90)

SECRET = "s3cret-never-logged"


def _with_password(url: str, password: str = SECRET) -> str:
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with temp_database("select") as url:
        yield url


def _write_config(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(text)


def test_default_is_the_sqlite_file_in_the_home(tmp_path: Path) -> None:
    config = load_config(tmp_path / "home", environ={})
    assert config.store.url == ""
    store = make_store(config)
    assert isinstance(store, SQLiteStore) and store.path == config.db_path


def test_file_then_environment_select_postgresql(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write_config(home, '[store]\nurl = "postgresql://app@db.example:5433/appserver"\n')
    config = load_config(home, environ={})
    store = make_store(config)
    assert isinstance(store, PostgresStore) and store.url == "postgresql://app@db.example:5433/appserver"

    env_url = f"postgres://app:{SECRET}@other.example/appserver"
    config = load_config(home, environ={"APPSERVER_STORE__URL": env_url})
    assert config.store.url == env_url
    assert "APPSERVER_STORE__URL" in config.source and SECRET not in config.source
    store = make_store(config)
    assert isinstance(store, PostgresStore)
    assert SECRET not in repr(store) and SECRET not in store.shown_url and ":***@" in store.shown_url

    config = load_config(home, environ={"APPSERVER_STORE__URL": ""})  # back to SQLite
    assert isinstance(make_store(config), SQLiteStore)
    # `make_store(config, url)`: what `serve --store` does
    assert isinstance(make_store(config, "postgresql://h/db"), PostgresStore)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"mysql://root:{SECRET}@db/app", "scheme 'mysql'"),
        (f"sqlite://root:{SECRET}@db/app", "scheme 'sqlite'"),
        ("just-a-path.db", "no scheme"),
        (f"postgresql://root:{SECRET}@db:notaport/app", "not a valid URL"),
        (f"postgresql://root:{SECRET}@db", "names no database"),
    ],
)
def test_a_bad_url_is_refused_naming_where_it_came_from_without_its_password(
    tmp_path: Path, url: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as from_env:
        load_config(tmp_path / "home", environ={"APPSERVER_STORE__URL": url})
    message = str(from_env.value)
    assert message.startswith("APPSERVER_STORE__URL: [store] url: ") and expected in message, message
    assert SECRET not in message

    home = tmp_path / "filehome"
    _write_config(home, f'[store]\nurl = "{url}"\n')
    with pytest.raises(ConfigError) as from_file:
        load_config(home, environ={})
    assert str(home / "config.toml") in str(from_file.value) and expected in str(from_file.value)
    assert SECRET not in str(from_file.value)


def test_unknown_store_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'path' in \[store\]; known keys: url"):
        load_config(tmp_path / "home", environ={"APPSERVER_STORE__PATH": "/x"})


def test_redaction_covers_the_authority_and_query_passwords() -> None:
    assert (
        redact_url("postgresql://u:p%40ss@h:5432/db?sslmode=require") == "postgresql://u:***@h:5432/db?sslmode=require"
    )
    assert redact_url("postgresql://u@h/db?password=pw&application_name=a") == (
        "postgresql://u@h/db?password=***&application_name=a"
    )
    assert redact_url("postgresql://h/db") == "postgresql://h/db"
    url = "postgresql://u:p%40ss@h/db"
    assert (
        scrub(f"failed for {url}: password p@ss or p%40ss", url)
        == "failed for postgresql://u:***@h/db: password *** or ***"
    )


async def test_an_unreachable_database_is_one_clear_error_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    store = PostgresStore(f"postgresql://postgres:{SECRET}@127.0.0.1:1/nowhere", connect_timeout_s=2)
    with pytest.raises(StoreOpenError) as err:
        await store.open()
    message = str(err.value)
    assert "postgresql://postgres:***@127.0.0.1:1/nowhere" in message and "cannot connect" in message
    assert SECRET not in message and SECRET not in caplog.text
    await store.close()


async def test_a_missing_database_names_it(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    missing = _with_password(pg_url.rsplit("/", 1)[0] + "/appserver_no_such_db")
    with pytest.raises(StoreOpenError, match='database "appserver_no_such_db" does not exist') as err:
        await PostgresStore(missing).open()
    assert SECRET not in str(err.value) and SECRET not in caplog.text


def test_the_driver_is_imported_only_for_a_postgresql_store(tmp_path: Path) -> None:
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['appserver', '--help']\n"
        "try:\n    runpy.run_module('appserver', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "from pathlib import Path\n"
        "from appserver.config import load_config\n"
        "from appserver.server import Server\n"
        f"Server(load_config(Path({str(tmp_path / 'home')!r}), environ={{}}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('psycopg', 'psycopg_pool')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_serve_refuses_a_bad_store_url_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", "--store", f"mysql://root:{SECRET}@db/app")
    assert r.code == 2, (r.out, r.err)
    assert "scheme 'mysql'" in r.err and SECRET not in r.err and "Traceback" not in r.err
    r = run_cli(home, "serve", "--listen", "127.0.0.1:0", "--store", f"postgresql://postgres:{SECRET}@127.0.0.1:1/x")
    assert r.code == 2, (r.out, r.err)
    assert "cannot connect" in r.err and "postgres:***@127.0.0.1:1/x" in r.err
    assert SECRET not in r.out + r.err and "Traceback" not in r.err


def test_serve_on_postgresql_answers_a_chat_completion_through_the_openai_sdk(tmp_path: Path, pg_url: str) -> None:
    import psycopg

    home = tmp_path / "home"
    url = _with_password(pg_url)
    with serving(home, "--store", url, env=cli_env(home)) as sp:
        client = openai.OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "hello pg"}])
        assert reply.choices[0].message.content == "echo: hello pg"
        ready = httpx.get(sp.url + "/readyz", timeout=10)
        assert ready.status_code == 200 and "writable (PostgreSQL" in ready.text, ready.text
        sp.stop()
        assert sp.proc.stderr is not None
        err = sp.proc.stderr.read()
    assert SECRET not in err
    assert not (home / "appserver.db").exists(), "a PostgreSQL server must not create the SQLite file"
    with psycopg.connect(pg_url) as conn:
        agents = [r[0] for r in conn.execute("SELECT name FROM agents")]
        texts = [r[0] for r in conn.execute("SELECT content FROM messages ORDER BY id")]
    assert agents == ["assistant"]  # the first start on an empty database made the default agent
    assert texts == ['"hello pg"', '"echo: hello pg"']
    # The CLI reads agents from the same store (no SQLite file in this home)
    env = cli_env(home, APPSERVER_STORE__URL=url)
    cron_add = ("cron", "add", "--name", "pg", "--agent", "assistant", "--every", "1h", "--prompt", "p")
    add = run_cli(home, *cron_add, env=env)
    assert add.code == 0 and "for agent assistant;" in add.out, add.out + add.err
    listed = run_cli(home, "cron", "list", env=env)
    assert listed.code == 0 and listed.out.splitlines()[1].split()[1:3] == ["pg", "assistant"], listed.out


@pytest.mark.parametrize(("ci", "outcome"), [("true", "Failed"), ("", "Skipped")])
def test_a_missing_postgresql_fails_in_ci_and_skips_locally(ci: str, outcome: str) -> None:
    probe = (
        "import pytest\n"
        "from tests.support.pg import require_postgres\n"
        "try:\n    require_postgres()\n"
        "except (pytest.fail.Exception, pytest.skip.Exception) as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**cli_env(Path("/nonexistent")), "CI": ci, "APPSERVER_TEST_PG": "postgresql://postgres@127.0.0.1:1/postgres"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(outcome), (out.stdout, out.stderr)
    assert "no PostgreSQL at postgresql://postgres@127.0.0.1:1/postgres" in out.stdout


def test_a_second_server_on_the_same_database_joins_it_and_outlives_the_first(tmp_path: Path, pg_url: str) -> None:
    """Several servers share one database (docs/scale-out.md): each registers an instance; one
    killed with -9 is judged gone by the others (its session lock is free at once, its heartbeat
    stops) and its row is removed. The password never reaches a log."""
    import psycopg

    url = _with_password(pg_url)
    first_home, second_home = tmp_path / "a", tmp_path / "b"
    fast = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}
    with (
        serving(first_home, "--store", url, env=cli_env(first_home, **fast), graceful=False) as first,
        serving(second_home, "--store", url, env=cli_env(second_home, **fast)) as second,
    ):
        for sp in (first, second):
            assert httpx.get(sp.url + "/readyz", timeout=10).status_code == 200
        with psycopg.connect(pg_url) as db:
            assert db.execute("SELECT count(*) FROM instances").fetchone() == (2,)
        first.proc.kill()
        first.proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with psycopg.connect(pg_url) as db:
                if db.execute("SELECT count(*) FROM instances").fetchone() == (1,):
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the killed server's instance was never judged gone")
        assert httpx.get(second.url + "/readyz", timeout=10).status_code == 200
        log = first.proc.stderr.read() if first.proc.stderr else ""
    assert SECRET not in log


def _end_instance_sessions(pg_url: str) -> None:
    """End every instance session, as a database restart would."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'appserver serve %%'"
        )


async def test_an_instance_whose_session_the_database_ended_takes_it_again(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    first, second = PostgresStore(pg_url), PostgresStore(pg_url)
    first.heartbeat_s = second.heartbeat_s = 0.2
    await first.open()
    await second.open()
    try:
        await first.claim_server()
        await second.claim_server()
        assert first.cluster is not None and second.cluster is not None
        me = first.cluster.instance_id
        with caplog.at_level(logging.WARNING, logger="appserver.cluster"):
            _end_instance_sessions(pg_url)  # as a database restart would
            for _ in range(50):
                await asyncio.sleep(0.1)
                if "taken again" in caplog.text and await second.cluster.owner_alive(me):
                    break
        assert "taken again" in caplog.text
        assert await second.cluster.owner_alive(me)  # its lock is held again: never judged gone
        await first.check_writable()
    finally:
        await first.close()
        await second.close()


async def test_an_instance_judged_gone_says_so_once_and_fails_readiness(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    import psycopg

    first = PostgresStore(pg_url)
    first.heartbeat_s = 0.2
    await first.open()
    try:
        await first.claim_server()
        assert first.cluster is not None
        with psycopg.connect(pg_url, autocommit=True) as db:  # what a survivor does to a gone instance
            db.execute("DELETE FROM instances WHERE id = %s", (first.cluster.instance_id,))
        with caplog.at_level(logging.ERROR, logger="appserver.cluster"):
            await asyncio.sleep(1.0)  # five heartbeats
        lost = [r for r in caplog.records if "judged gone" in r.getMessage()]
        assert len(lost) == 1, [r.getMessage() for r in caplog.records]
        with pytest.raises(StoreError, match="judged gone"):
            await first.check_writable()
    finally:
        await first.close()


async def test_one_turn_write_refused_for_a_lease_never_held_does_not_fence_a_live_server(pg_url: str) -> None:
    """A turn written for a conversation whose lease another live server holds is refused
    (TurnSettledElsewhere); the writer, which nobody judged gone, took that as proof it was judged
    gone and fenced itself (every request 503 until a restart: found by an outside test through a
    request that wrote a paused turn without the lease). A server judged gone still fences."""
    import psycopg

    from appserver.store.base import TurnSettledElsewhere
    from appserver.store.records import AgentRecord, ConversationRecord, MessageRecord, TurnCommit, TurnRecord

    first, second = PostgresStore(pg_url), PostgresStore(pg_url)
    first.heartbeat_s = second.heartbeat_s = 0.2
    await first.open()
    await second.open()
    try:
        await first.claim_server()
        await second.claim_server()
        assert first.cluster is not None and second.cluster is not None
        await first.create_agent(AgentRecord(id="agt_lease", name="lease"))
        for conv in ("conv_lease_1", "conv_lease_2"):
            await first.create_conversation(ConversationRecord(id=conv, agent_id="agt_lease"))
            assert (await second.cluster.take(conv)).token is not None
        commit = [MessageRecord(role="user", content="hi"), MessageRecord(role="assistant", content="echo: hi")]
        await first.accept_turn(
            TurnRecord(id="turn_lease_1", conversation_id="conv_lease_1", agent_id="agt_lease", status="running")
        )
        with pytest.raises(TurnSettledElsewhere):
            await first.commit_turn("conv_lease_1", TurnCommit("turn_lease_1", "completed", "end_turn", commit))
        assert not first.cluster.lost
        await first.check_writable()  # still serving
        with psycopg.connect(pg_url, autocommit=True) as db:  # what a survivor does to a gone instance
            db.execute("DELETE FROM instances WHERE id = %s", (first.cluster.instance_id,))
        await first.accept_turn(
            TurnRecord(id="turn_lease_2", conversation_id="conv_lease_2", agent_id="agt_lease", status="running")
        )
        with pytest.raises(TurnSettledElsewhere):
            await first.commit_turn("conv_lease_2", TurnCommit("turn_lease_2", "completed", "end_turn", commit))
        assert first.cluster.lost
    finally:
        await first.close()
        await second.close()
