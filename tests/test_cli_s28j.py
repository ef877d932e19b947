"""Session 28 J: an outside tester's CLI findings.

- A home whose absolute path is not UTF-8 (the default home under such a $HOME, a relative --home
  in such a working directory, a link that leads to such a place) was a traceback at the first
  encode, after appserver.db and config.toml were made there: now one `error:` line and exit
  code 2 from every command, before anything is made.
- Relative paths in config.toml: tls_cert/tls_key were the working directory's, jwt_secret_file the
  home's. Every file setting (and its environment variable) is now the home's.
- `store copy` of a value SQLite cannot decode as UTF-8 named neither the table nor the row.
- `cron logs` showed run-log lines that are no record (`{"event": 1}`, a run number `1e999`) as rows.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.config import FILE_KEYS, load_config
from tests.support import zygote_client
from tests.support.certs import self_signed
from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.pg import ADMIN_URL, require_postgres, url_for
from tests.support.serve import start_serve
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

NOT_UTF8 = os.fsdecode(b"x\xffhome")  # a name with a byte that is no UTF-8 (a surrogate in Python)

# every command, each in a form that would touch the home (or start to)
COMMANDS = [
    ["agents", "list"],
    ["token", "list"],
    ["cron", "list"],
    ["conversations", "list"],
    ["channels", "status"],
    ["pairing", "list"],
    ["run", "hello"],
    ["chat"],
    ["serve", "--listen", "127.0.0.1:32720"],
    ["store", "copy", "--to", "postgresql://nobody@127.0.0.1:32721/none"],
]


def _appserver(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real executable's entry (`python -m appserver`) in `cwd` with exactly `env`'s home variables:
    a fork of the worker's zygote (as run_cli's are: `appserver/__main__.py` run as `-m` runs it, in
    `cwd` with `env`; the home checks read $HOME, $APPSERVER_HOME and the working directory when
    the command runs), or a new interpreter, which needs the repository on its path, when a fork
    cannot stand in for one. 32 new interpreters were ~10 CPU-s."""
    if not zygote_client._can_fork(env):
        env = {**env, "PYTHONPATH": str(ROOT)}
    with appserver_popen(
        list(args),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    ) as proc:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _refused(r: subprocess.CompletedProcess[str], why: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: the home "), r.stderr
    assert "\\xff" in lines[0] and "is not valid UTF-8" in lines[0] and why in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def bare_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPSERVER_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_the_default_home_under_a_home_that_is_not_utf8_is_refused_before_anything_is_made(
    tmp_path: Path, bare_env: dict[str, str], args: list[str]
) -> None:
    user_home = tmp_path / NOT_UTF8
    user_home.mkdir()
    r = _appserver(args, cwd=tmp_path, env={**bare_env, "HOME": str(user_home)})
    _refused(r, "$HOME is not UTF-8")
    assert not (user_home / ".appserver").exists()


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_a_relative_home_in_a_directory_that_is_not_utf8_is_refused_before_anything_is_made(
    tmp_path: Path, bare_env: dict[str, str], args: list[str]
) -> None:
    cwd = tmp_path / NOT_UTF8 / "sub"
    cwd.mkdir(parents=True)
    r = _appserver(["--home", "relh", *args], cwd=cwd, env=bare_env)
    _refused(r, "relative to the current directory")
    assert not (cwd / "relh").exists()
    # the same home given by $APPSERVER_HOME
    r = _appserver(args, cwd=cwd, env={**bare_env, "APPSERVER_HOME": "relh"})
    _refused(r, "$APPSERVER_HOME 'relh' is relative")
    assert not (cwd / "relh").exists()


def test_a_home_that_is_a_link_to_a_path_that_is_not_utf8_is_refused(tmp_path: Path, bare_env: dict[str, str]) -> None:
    target = tmp_path / NOT_UTF8
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    r = _appserver(["--home", str(tmp_path / "link"), "agents", "list"], cwd=tmp_path, env=bare_env)
    _refused(r, "symbolic link")
    assert list(target.iterdir()) == []
    # a UTF-8 home still works from that same directory
    ok = _appserver(["--home", "good", "agents", "list"], cwd=tmp_path, env=bare_env)
    assert ok.returncode == 0 and "assistant" in ok.stdout, ok.stderr


# ── relative paths in config.toml ──────────────────────────────────────────────────────────────


def test_every_file_setting_is_the_homes_from_the_file_and_from_the_environment(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[server]\ntls_cert = "certs/cert.pem"\ntls_key = "/abs/key.pem"\n'
        '[auth]\njwt_secret_file = "jwt.secret"\njwt_public_key_file = "~/pub.pem"\n'
    )
    cfg = load_config(home, environ={"HOME": str(tmp_path / "user")})
    assert cfg.server.tls_cert == str(home / "certs" / "cert.pem")
    assert cfg.server.tls_key == "/abs/key.pem"
    assert cfg.auth.jwt_secret_file == str(home / "jwt.secret")
    assert cfg.auth.jwt_public_key_file == str(Path("~/pub.pem").expanduser())
    env = {f"APPSERVER_{s.upper()}__{k.upper()}": f"env-{k}" for s, k in FILE_KEYS}
    cfg = load_config(home, environ=env)
    for section, key in FILE_KEYS:
        assert getattr(getattr(cfg, section), key) == str(home / f"env-{key}"), (section, key)


def test_serve_finds_relative_tls_files_in_the_home_wherever_it_starts(home: Path) -> None:
    home.mkdir(parents=True)
    self_signed(home)
    (home / "config.toml").write_text('[server]\ntls_cert = "cert.pem"\ntls_key = "key.pem"\n')
    assert Path.cwd().resolve() != home.resolve()
    sp = start_serve(home, "--listen", "127.0.0.1:32722")  # its working directory is the repository
    try:
        assert sp.url.startswith("https://"), sp.url
    finally:
        sp.stop()
        sp.kill()
    # a missing one is named as it was resolved, from the environment too
    env = cli_env(home, APPSERVER_SERVER__TLS_CERT="nope.pem")
    r = run_cli(home, "serve", "--listen", "127.0.0.1:32723", env=env)
    assert r.code == 2 and f"TLS certificate file not found: {home / 'nope.pem'}" in r.err, r.err


# ── store copy of text that is not UTF-8 ───────────────────────────────────────────────────────


@pytest.fixture
def pg_target() -> Iterator[str]:
    import psycopg
    from psycopg import sql

    require_postgres()
    name = f"fixj28_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield url_for(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_store_copy_names_the_table_row_and_column_of_text_that_is_not_utf8(home: Path, pg_target: str) -> None:
    assert run_cli(home, "run", "hello").code == 0
    made = run_cli(home, "agents", "create", "--name", "ops", "--json")
    assert made.code == 0, made.err
    agent_id = made.json()["id"]
    db = sqlite3.connect(home / "appserver.db")
    with db:
        db.execute("UPDATE agents SET system = CAST(x'41ff42' AS TEXT) WHERE name = 'ops'")
    r = run_cli(home, "store", "copy", "--to", pg_target)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1, (r.code, r.err)
    assert f"the SQLite table agents cannot be copied: the row with id {agent_id}: its column system" in lines[0]
    assert "not UTF-8" in lines[0] and "nothing was copied" in lines[0], lines[0]
    with db:
        db.execute("UPDATE agents SET system = '' WHERE name = 'ops'")
        last = db.execute("SELECT max(id) FROM messages").fetchone()[0]
        db.execute("UPDATE messages SET content = CAST(x'41ff42' AS TEXT) WHERE id = ?", (last,))
    db.close()
    r = run_cli(home, "store", "copy", "--to", pg_target)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1, (r.code, r.err)
    assert f"the SQLite table messages cannot be copied: the row with id {last}: its column content" in lines[0]
    # the target was left empty: a repaired store copies into it
    with sqlite3.connect(home / "appserver.db") as db:
        db.execute("UPDATE messages SET content = 'fixed' WHERE id = ?", (last,))
    r = run_cli(home, "store", "copy", "--to", pg_target)
    assert r.code == 0, r.err


# ── cron logs of lines that are no record ──────────────────────────────────────────────────────


def test_cron_logs_skips_lines_that_are_no_record_with_one_warning(home: Path) -> None:
    add = run_cli(home, "cron", "add", "--name", "brief", "--agent", "assistant", "--every", "1h", "--prompt", "hi")
    assert add.code == 0, add.err
    assert run_cli(home, "cron", "run", "brief").code == 0
    (path,) = (home / "cron-runs").glob("*.jsonl")
    good = len(path.read_text().splitlines())
    bad = [
        {"event": 1},
        {"event": None, "occurrence": 1},
        {"event": "", "occurrence": 1},
        {"event": "outcome", "occurrence": True, "status": "completed"},
        {"event": "outcome", "occurrence": 1.5, "status": "completed"},
        {"event": "outcome", "occurrence": 1, "status": 7},
        {"event": "fired", "occurrence": 1, "at": 5},
        {"event": "fired", "occurrence": 1, "manual": "yes"},
        {"event": "delivered", "occurrence": 1, "remote_ids": "m1"},
    ]
    with path.open("a") as f:
        f.writelines(json.dumps(x) + "\n" for x in bad)
        f.write('{"event":"fired","occurrence":1e999}\n')
    r = run_cli(home, "cron", "logs", "brief")
    assert r.code == 0, r.err
    assert [line.split()[3] for line in r.out.splitlines()] == ["fired", "submitted", "outcome"], r.out
    warnings = r.err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), r.err
    assert f"skipped {len(bad) + 1} unreadable line(s)" in warnings[0], r.err
    assert f"line {good + 1}, {good + 2}," in warnings[0], r.err
    r = run_cli(home, "cron", "logs", "brief", "--json")
    assert r.code == 0 and [x["event"] for x in r.json()] == ["fired", "submitted", "outcome"], r.out
