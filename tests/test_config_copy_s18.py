"""Session 18 fixes: config checks (env typos, heartbeats, base_url, provider names, headers,
`[channels] enabled`), `store copy` (the serve lock, NUL characters, unknown columns) and NUL
characters refused at input (HTTP `user`, WebSocket title and tool output)."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appserver.config import load_config
from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database, truncate_all
from tests.support.serve import serving
from tests.support.ws import WS
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)


def _home(tmp_path: Path, toml: str = "") -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700, parents=True)
    (home / "config.toml").write_text(toml or "# defaults\n")
    return home


def _refused(home: Path, *needles: str, **env: str) -> str:
    r = run_cli(home, "agents", "list", env=cli_env(home, **env))
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err
    for needle in needles:
        assert needle in r.err, r.err
    return r.err


# ── F5: an APPSERVER_ variable that looks like a setting but is none ──────────────────────────


def test_a_setting_variable_with_one_underscore_is_refused(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _refused(home, "APPSERVER_AUTH_MODE", "did you mean APPSERVER_AUTH__MODE", APPSERVER_AUTH_MODE="token")
    _refused(home, "APPSERVER_LIMITS__QUEUE_MAX", APPSERVER_QUEUE_MAX="3")
    _refused(home, "APPSERVER_STORE__URL", APPSERVER_STORE_URL="postgresql://x@127.0.0.1/y")
    # the variables the project reads are not settings, and pass
    ok = run_cli(home, "agents", "list", env=cli_env(home, APPSERVER_CRON_TICK_S="5", APPSERVER_DISABLE_CRON="1"))
    assert ok.code == 0, ok.err


# ── F6: instance_timeout_s must cover 3 heartbeats ──────────────────────────────────────────────


def test_instance_timeout_below_three_heartbeats_is_refused(tmp_path: Path) -> None:
    home = _home(tmp_path, "[store]\nheartbeat_s = 2\ninstance_timeout_s = 5\n")
    _refused(home, "instance_timeout_s", "3 heartbeats")
    home2 = _home(tmp_path / "b")
    _refused(home2, "APPSERVER_STORE__INSTANCE_TIMEOUT_S", APPSERVER_STORE__INSTANCE_TIMEOUT_S="1")
    assert load_config(home2, environ={"APPSERVER_STORE__INSTANCE_TIMEOUT_S": "6"}).store.instance_timeout_s == 6


# ── F7: base_url and provider names ───────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[providers.x]\nbase_url = "http://"\n', "must name a host"),
        ('[providers.x]\nbase_url = "http://exa mple.com/v1"\n', "without spaces"),
        ('[providers.x]\nbase_url = "http://h:99999/v1"\n', "base_url"),
        ('[providers."bad:name"]\nkind = "openai"\n', "without ':'"),
        ('[providers.""]\nkind = "openai"\n', "non-empty"),
    ],
)
def test_unusable_base_urls_and_provider_names_are_refused(tmp_path: Path, toml: str, needle: str) -> None:
    _refused(_home(tmp_path, toml), needle)


def test_an_empty_provider_name_from_the_environment_is_refused(tmp_path: Path) -> None:
    _refused(_home(tmp_path), "non-empty", APPSERVER_PROVIDERS____KIND="openai")
    good = _home(tmp_path / "ok", '[providers.local]\nbase_url = "http://[::1]:8080/v1"\n')
    assert run_cli(good, "agents", "list").code == 0


# ── F4: provider headers ────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ('{ "X-A" = "v\\r\\nInjected: 1" }', "control character"),
        ('{ "X-A" = "v\\u0000" }', "control character"),
        ('{ "Bad Header" = "z" }', "not a valid header name"),
        ('{ "Content-Length" = "5" }', "set by the HTTP client"),
        ('{ "Host" = "other" }', "set by the HTTP client"),
        ('{ "Transfer-Encoding" = "chunked" }', "set by the HTTP client"),
    ],
)
def test_bad_provider_headers_are_refused_at_load(tmp_path: Path, headers: str, needle: str) -> None:
    toml = f'[providers.x]\nbase_url = "http://127.0.0.1:30999/v1"\nheaders = {headers}\n'
    _refused(_home(tmp_path, toml), "[providers.x] headers", needle)


def test_ordinary_provider_headers_load(tmp_path: Path) -> None:
    toml = (
        '[providers.x]\nbase_url = "http://127.0.0.1:30999/v1"\n'
        'headers = { "X-Title" = "a b\\tc", "HTTP-Referer" = "https://e.x" }\n'
    )
    assert run_cli(_home(tmp_path, toml), "agents", "list").code == 0


# ── F8: [channels] enabled must be a list in the file ─────────────────────────────────────────


def test_channels_enabled_as_a_string_is_refused_in_the_file(tmp_path: Path) -> None:
    _refused(_home(tmp_path, '[channels]\nenabled = "webhook"\n'), "enabled must be a list")
    # from the environment a comma-separated string is the documented form
    assert load_config(_home(tmp_path / "e"), environ={"APPSERVER_CHANNELS__ENABLED": "webhook"}).channels.enabled == [
        "webhook"
    ]


# ── F1: NUL characters refused at input ───────────────────────────────────────────────────────


def _nul_requests(url: str) -> None:
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "assistant", "user": "u\x00x", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert chat.status_code == 400, chat.text
    err = chat.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "user"), err
    resp = httpx.post(url + "/v1/responses", json={"model": "assistant", "user": "u\x00x", "input": "hi"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "user", resp.text
    ok = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "assistant", "user": "u", "messages": [{"role": "user", "content": "a\x00b"}]},
        timeout=10,
    )
    assert ok.status_code == 200, ok.text  # content is stored as JSON: a NUL there is kept, escaped

    async def ws() -> None:
        conn = await WS.open(url)
        try:
            r = await conn.request({"type": "create_conversation", "agent": "assistant", "title": "t\x00"})
            assert r["type"] == "error" and (r["code"], r["param"]) == ("bad_frame", "title"), r
            r = await conn.request({"type": "tool_result", "call_id": "c", "output": "o\x00"})
            assert r["type"] == "error" and (r["code"], r["param"]) == ("bad_frame", "output"), r
            r = await conn.request({"type": "create_conversation", "agent": "assistant", "title": "fine"})
            assert r["type"] != "error", r
        finally:
            await conn.close()

    asyncio.run(ws())


def test_nul_in_stored_text_is_refused_on_sqlite(tmp_path: Path) -> None:
    home = _home(tmp_path)
    with serving(home) as srv:
        _nul_requests(srv.url)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with temp_database("s18copy") as url:
        yield url


@pytest.fixture
def target(pg_url: str) -> str:
    truncate_all(pg_url)
    return pg_url


def test_nul_in_stored_text_is_refused_on_postgres(tmp_path: Path, target: str) -> None:
    home = _home(tmp_path, f'[store]\nurl = "{target}"\n')
    with serving(home) as srv:
        _nul_requests(srv.url)
    assert "DataError" not in (srv.proc.stderr.read() if srv.proc.stderr else "")


# ── store copy ──────────────────────────────────────────────────────────────────────────────────


def _sqlite_home_with_a_conversation(tmp_path: Path) -> Path:
    home = _home(tmp_path)
    made = run_cli(home, "run", "--agent", "assistant", "hello", timeout=60)
    assert made.code == 0, made.err
    return home


def test_copy_replaces_nul_characters_an_older_version_stored_and_says_where(tmp_path: Path, target: str) -> None:
    import psycopg

    home = _sqlite_home_with_a_conversation(tmp_path)
    with sqlite3.connect(home / "appserver.db") as db:
        (conv,) = db.execute("SELECT id FROM conversations LIMIT 1").fetchone()
        db.execute("UPDATE conversations SET user = ?, title = ? WHERE id = ?", ("u\x00x", "t\x00\x00", conv))
    r = run_cli(home, "store", "copy", "--to", target)
    assert r.code == 0, r.err
    assert "Traceback" not in r.err
    assert "conversations.user" in r.err and "conversations.title" in r.err and conv in r.err, r.err
    assert "U+FFFD" in r.err
    with psycopg.connect(target) as conn:
        row = conn.execute('SELECT "user", title FROM conversations WHERE id = %s', (conv,)).fetchone()
    assert row == ("u\ufffdx", "t\ufffd\ufffd")


def test_copy_refuses_a_column_no_schema_has(tmp_path: Path, target: str) -> None:
    import psycopg

    home = _sqlite_home_with_a_conversation(tmp_path)
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute("ALTER TABLE conversations ADD COLUMN extra_notes TEXT")
    r = run_cli(home, "store", "copy", "--to", target)
    assert r.code == 2, (r.code, r.err)
    assert "conversations" in r.err and "extra_notes" in r.err and "Traceback" not in r.err, r.err
    with psycopg.connect(target) as conn:
        assert conn.execute("SELECT count(*) FROM agents").fetchone() == (0,)


def test_copy_holds_the_serve_lock_and_refuses_a_live_server(tmp_path: Path, target: str) -> None:
    """A `serve` started while the copy runs is refused (it would write to SQLite only), and a
    copy is refused while a server runs."""
    import psycopg

    home = _sqlite_home_with_a_conversation(tmp_path)
    with serving(home):
        r = run_cli(home, "store", "copy", "--to", target)
        assert r.code == 3 and "stop it first" in r.err, (r.code, r.err)
    # the database's schema (run alone, this test meets a database no earlier test prepared)
    assert run_cli(home, "agents", "list", env=cli_env(home, APPSERVER_STORE__URL=target)).code == 0
    truncate_all(target)  # ...and nothing in it: a first open seeds the default agent
    # hold the copy inside PostgreSQL (its LOCK TABLE waits for ours), so that it runs for a while
    with psycopg.connect(target) as blocker:
        blocker.execute("LOCK TABLE agents IN ACCESS EXCLUSIVE MODE")
        copy = appserver_popen(
            ["store", "copy", "--to", target],
            env=cli_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the copy waits on our lock once it holds the home's
                waiting = blocker.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'agents'::regclass"
                ).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the copy never reached the database")
            serve = run_cli(home, "serve", "--listen", "127.0.0.1:0", timeout=30)
            assert serve.code == 3 and "another" in serve.err, (serve.code, serve.out, serve.err)
        finally:
            blocker.rollback()
    out, err = copy.communicate(timeout=60)
    assert copy.returncode == 0, err
    assert "copied" in out
