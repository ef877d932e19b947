"""Issue 11 (3, 14): config.toml never falls back to defaults silently, every value is checked.
Real `appserver` subprocesses on real homes. (11.13 and 11.15, one-line operator errors and the
private home, are in test_hardening_state_operator.py: two files, so that xdist runs them at once.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from appserver.config import ConfigError, LimitsConfig, load_config
from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import one_error_line, serve_refused, token_home

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
