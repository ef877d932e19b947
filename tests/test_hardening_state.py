"""Issue 11 (3, 13, 14, 15): config.toml never falls back to defaults silently, every value is
checked, operator errors are one line with exit code 2, the home is private. Real `appserver`
subprocesses on real homes."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import httpx
import pytest

from appserver.config import ConfigError, LimitsConfig, load_config
from tests.support.certs import self_signed
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import start_serve

STATE_FILES = ("config.toml", "appserver.db", "appserver.db-wal", "appserver.db-shm")


def serve_refused(home: Path, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    """`serve` that must refuse to start: its result (it would hang here if it started)."""
    return run_cli(home, "serve", "--listen", "127.0.0.1:0", *args, timeout=30, env=env)


def one_error_line(r: CLIResult) -> str:
    """The single `error:` line of a refused command; no traceback anywhere."""
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.err
    return lines[0]


def token_home(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text('[auth]\nmode = "token"\n')
    return home / "config.toml"


# ── 11.3 a damaged config never ends with defaults (auth off) ──────────────────────────────────


def test_damaged_config_refuses_every_start_until_repaired(home: Path) -> None:
    cfg = token_home(home)
    sp = start_serve(home)
    assert httpx.get(sp.url + "/v1/models", timeout=5).status_code == 401  # auth is on
    assert sp.stop() == 0
    good = cfg.read_bytes()
    cfg.write_bytes(good.replace(b'"token"', b'"token'))  # one byte gone: invalid TOML

    first = one_error_line(serve_refused(home))
    aside = list(home.glob("config.toml.corrupt-*"))
    assert len(aside) == 1 and "moved aside" in first and "not valid TOML" in first
    assert not cfg.exists()

    # The restart a supervisor does: before the fix it wrote a default config and served, auth off.
    second = one_error_line(serve_refused(home))
    assert "is missing" in second and aside[0].name in second and "move it back" in second
    assert not cfg.exists(), "no default config may be written while a set-aside copy exists"
    # Every command that reads the config refuses the same way.
    assert "is missing" in one_error_line(run_cli(home, "agents", "list"))
    assert "is missing" in one_error_line(run_cli(home, "token", "list"))
    assert "is missing" in one_error_line(run_cli(home, "cron", "list"))

    aside[0].replace(cfg)
    cfg.write_bytes(good)  # the operator repairs it and moves it back
    sp = start_serve(home)
    try:
        assert httpx.get(sp.url + "/v1/models", timeout=5).status_code == 401
    finally:
        sp.stop()


def test_empty_config_is_an_error_not_all_defaults(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_bytes(b"")
    line = one_error_line(serve_refused(home))
    assert "config.toml is empty" in line and "delete it" in line
    assert "config.toml is empty" in one_error_line(run_cli(home, "agents", "list"))
    assert (home / "config.toml").read_bytes() == b""  # left for the operator, not replaced
    assert not (home / "appserver.db").exists()
    (home / "config.toml").write_text("# all defaults, on purpose\n")
    assert run_cli(home, "agents", "list").code == 0


def test_config_older_than_its_set_aside_copy_refuses(home: Path) -> None:
    cfg = token_home(home)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() + 5))
    (home / f"config.toml.corrupt-{stamp}").write_text('[auth]\nmode = "tok')
    line = one_error_line(serve_refused(home))
    assert "set aside as unreadable after" in line and "delete it to use config.toml as it is" in line
    os.utime(cfg, (time.time() + 10, time.time() + 10))  # the operator wrote config.toml since
    sp = start_serve(home)
    try:
        r = httpx.get(sp.url + "/readyz", timeout=5)
        assert r.status_code == 200
        files = [c for c in r.json()["checks"] if c["name"] == "state_files"][0]
        assert files["status"] == "warn" and f"config.toml.corrupt-{stamp}" in files["detail"]
    finally:
        sp.stop()


def test_every_start_logs_which_config_it_loaded(home: Path) -> None:
    sp = start_serve(home)
    sp.stop()
    assert f"config: wrote a default {home.resolve() / 'config.toml'}" in sp.proc.stderr.read()
    sp = start_serve(home, env=cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="7"))
    sp.stop()
    err = sp.proc.stderr.read()
    assert f"config: loaded {home.resolve() / 'config.toml'}" in err
    assert "environment overrides: APPSERVER_LIMITS__QUEUE_MAX" in err


# ── 11.14 every value checked at load, the key named ───────────────────────────────────────────


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[limits]\nqueue_max = -5\n", "config.toml: [limits] queue_max must be an integer >= 1, got -5"),
        ("[limits]\nbody_max_bytes = 0\n", "[limits] body_max_bytes must be an integer >= 1024, got 0"),
        ('[limits]\napproval_timeout_s = "soon"\n', "[limits] approval_timeout_s must be a number > 0, got 'soon'"),
        ("[limits]\nmax_steps = 1.5\n", "[limits] max_steps must be an integer >= 1 and <= 1000, got 1.5"),
        ('[auth]\nmode = "tokn"\n', "[auth] mode must be one of 'none', 'token', 'jwt', got 'tokn'"),
        ('[auth]\nmdoe = "token"\n', "unknown key 'mdoe' in [auth]; known keys: mode, jwt_algorithms"),
        ("[cron]\nenabled = 1\n", "[cron] enabled must be true or false, got 1"),
        ('[server]\nallowed_hosts = "a.example"\n', "[server] allowed_hosts must be a list of strings"),
        ('[server]\nlisten = "127.0.0.1:99999"\n', "[server] listen: invalid port"),
        ('[providers.x]\nbase_url = "ftp://x"\n', "[providers.x] base_url: must be an http:// or https:// URL"),
        ("[providers.x]\nmax_attempts = 0\n", "[providers.x] max_attempts must be an integer >= 1 and <= 20, got 0"),
        (
            "[providers.x]\ncontext_windows = { m = -1 }\n",
            "[providers.x] context_windows must be a table of integers >= 1",
        ),
        ('[server]\ntls_cert = "c.pem"\n', "tls_cert and tls_key go together"),
    ],
)
def test_bad_values_in_the_file_are_refused_with_the_key_named(tmp_path: Path, toml: str, expected: str) -> None:
    (tmp_path / "config.toml").write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path, environ={})
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_bad_value_stops_every_command_with_one_line(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text("[limits]\nqueue_max = -5\n")
    expected = f"{home.resolve() / 'config.toml'}: [limits] queue_max must be an integer >= 1, got -5"
    assert expected in one_error_line(run_cli(home, "agents", "list"))
    assert expected in one_error_line(serve_refused(home))


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        (
            "APPSERVER_LIMITS__QUEUE_MAX",
            "-5",
            "APPSERVER_LIMITS__QUEUE_MAX: [limits] queue_max must be an integer >= 1, got '-5'",
        ),
        (
            "APPSERVER_LIMITS__BODY_MAX_BYTES",
            "lots",
            "APPSERVER_LIMITS__BODY_MAX_BYTES: [limits] body_max_bytes must be an integer >= 1024",
        ),
        ("APPSERVER_AUTH__MODE", "off", "APPSERVER_AUTH__MODE: [auth] mode must be one of 'none', 'token', 'jwt'"),
        ("APPSERVER_AUTH__MDOE", "token", "APPSERVER_AUTH__MDOE: unknown key 'mdoe' in [auth]"),
        ("APPSERVER_CRON_TICK_S", "0", "APPSERVER_CRON_TICK_S: [cron] tick_s must be a number > 0"),
        ("APPSERVER_SERVER__ALLOWED_ORIGINS", "*", "[server] allowed_origins: '*' is not supported"),
    ],
)
def test_bad_environment_overrides_are_refused_naming_the_variable(
    tmp_path: Path, var: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path, environ={var: value})
    assert expected in str(err.value)


def test_a_bad_environment_value_stops_serve_with_one_line(home: Path) -> None:
    line = one_error_line(serve_refused(home, env=cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="-5")))
    assert "APPSERVER_LIMITS__QUEUE_MAX: [limits] queue_max must be an integer >= 1, got '-5'" in line


def test_every_numeric_limit_is_type_checked_generically(tmp_path: Path) -> None:
    """No key escapes: each limit rejects a value of the wrong type, naming itself."""
    for f in LimitsConfig.__dataclass_fields__:
        with pytest.raises(ConfigError, match=rf"\[limits\] {f} must be"):
            load_config(tmp_path / f, environ={f"APPSERVER_LIMITS__{f.upper()}": "not-a-number"})
    cfg = load_config(
        tmp_path / "ok", environ={"APPSERVER_LIMITS__QUEUE_MAX": "5", "APPSERVER_LIMITS__SSE_KEEPALIVE_S": "0.2"}
    )
    assert cfg.limits.queue_max == 5 and cfg.limits.sse_keepalive_s == 0.2


# ── 11.13 operator errors: one line, exit 2, traceback only with --debug ───────────────────────


def test_busy_port_is_one_line(home: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(home, "serve", "--listen", f"127.0.0.1:{port}", timeout=30)
        line = one_error_line(r)
        assert f"cannot listen on 127.0.0.1:{port}" in line and "already in use" in line
        assert not (home / "server.json").exists()


def test_missing_or_bad_tls_file_is_one_line(home: Path, tmp_path: Path) -> None:
    line = one_error_line(
        serve_refused(home, "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tmp_path / "nope.key"))
    )
    assert f"TLS certificate file not found: {tmp_path / 'nope.pem'}" in line
    cert, key = self_signed(tmp_path)
    line = one_error_line(serve_refused(home, "--tls-cert", str(cert), "--tls-key", str(tmp_path / "nope.key")))
    assert "TLS key file not found" in line
    (tmp_path / "junk.pem").write_text("not a certificate")
    line = one_error_line(serve_refused(home, "--tls-cert", str(tmp_path / "junk.pem"), "--tls-key", str(key)))
    assert "TLS certificate or key unusable" in line


def test_allowed_origins_star_in_the_file_is_one_line(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text('[server]\nallowed_origins = ["*"]\n')
    line = one_error_line(serve_refused(home))
    assert "config.toml: [server] allowed_origins: '*' is not supported" in line


def test_debug_flag_shows_the_traceback(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_bytes(b"")
    r = run_cli(home, "--debug", "agents", "list")
    assert r.code != 0 and "Traceback" in r.err and "ConfigError" in r.err


# ── 11.15 everything under the home is private ────────────────────────────────────────────────


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_home_and_state_files_are_owner_only(home: Path) -> None:
    home.mkdir(parents=True)
    os.chmod(home, 0o755)  # a home made by hand, or by an older version
    (home / "config.toml").write_text("# defaults\n")
    os.chmod(home / "config.toml", 0o644)
    (home / "cron-runs").mkdir(mode=0o755)
    (home / "cron-runs" / "t.jsonl").write_text("")
    os.chmod(home / "cron-runs" / "t.jsonl", 0o644)
    (home / "notes.txt").write_text("mine")  # not appserver's: left alone
    os.chmod(home / "notes.txt", 0o644)
    sp = start_serve(home)
    try:
        r = httpx.post(
            sp.url + "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 200
        assert _mode(home) == 0o700
        for name in STATE_FILES + ("server.json", "crons.json"):
            assert _mode(home / name) == 0o600, name  # the WAL and SHM too, while they exist
        assert _mode(home / "cron-runs") == 0o700 and _mode(home / "cron-runs" / "t.jsonl") == 0o600
        assert _mode(home / "notes.txt") == 0o644
    finally:
        sp.stop()
    assert "permissions tightened to owner-only" in sp.proc.stderr.read()


def test_cli_tightens_an_open_home_and_keeps_new_files_private(home: Path) -> None:
    old = os.umask(0o022)
    try:
        home.mkdir(parents=True)  # 0755, as `mkdir` leaves it
        r = run_cli(home, "run", "hello")
    finally:
        os.umask(old)
    assert r.code == 0, r.err
    assert _mode(home) == 0o700
    for p in home.iterdir():
        assert _mode(p) & 0o077 == 0, (p, oct(_mode(p)))
