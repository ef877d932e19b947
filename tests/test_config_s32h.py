"""Session 32, helper h: environment overrides that named a setting in another case, `~user`
paths of no user, and values nested too deeply: each one error line and exit code 2, or the
override applied to the table the file names (docs/configuration.md), never a traceback and never
silently a second provider or account. Through the real CLI, as a subprocess."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli

pytestmark = pytest.mark.timeout(120)

DEEP_JSON = '{"a":' * 5000 + "1" + "}" * 5000
NO_USER = "its ~ names no user of this system; give the path itself"


def _home(tmp_path: Path, toml: str = "") -> Path:
    home = tmp_path / "home"
    home.mkdir()
    if toml:
        (home / "config.toml").write_text(toml)
    return home


def _refused(r: CLIResult, *needles: str) -> str:
    """The one `error:` line of a refused command (exit 2), holding every needle."""
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


class MarkingUpstream:
    """An OpenAI-compatible upstream that answers every call 401 with a marker: a turn that shows
    the marker reached this server (the base_url the environment gave), not the file's."""

    MARK = "s32h-reached-the-environment-upstream"

    def __init__(self) -> None:
        mark = self.MARK

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                data = json.dumps({"error": {"message": mark, "type": "invalid_request_error"}}).encode()
                self.send_response(401)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[MarkingUpstream]:
    up = MarkingUpstream()
    yield up
    up.close()


# ── 1. names in the environment are not case-sensitive ─────────────────────────────────────────


def test_an_upper_case_variable_overrides_the_provider_the_file_names_with_capitals(
    tmp_path: Path, upstream: MarkingUpstream
) -> None:
    home = _home(tmp_path, '[providers.MyProv]\nbase_url = "http://127.0.0.1:9/v1"\nmax_attempts = 1\n')
    env = cli_env(home, APPSERVER_PROVIDERS__MYPROV__BASE_URL=f"http://127.0.0.1:{upstream.port}/v1")
    assert run_cli(home, "agents", "create", "--name", "mp", "--model", "MyProv:m", env=env).code == 0
    r = run_cli(home, "run", "--agent", "mp", "hello", env=env, timeout=60)
    assert MarkingUpstream.MARK in r.err, r.err  # the turn went to the environment's base_url


def test_two_variables_that_differ_only_in_case_are_refused_naming_both(tmp_path: Path) -> None:
    home = _home(tmp_path)
    env = cli_env(home, APPSERVER_AUTH__MODE="token", APPSERVER_auth__mode="none")
    _refused(run_cli(home, "agents", "list", env=env), "APPSERVER_AUTH__MODE", "APPSERVER_auth__mode")
    env = cli_env(home, APPSERVER_AUTH__MODE="token", APPSERVER_auth__mode="none")
    _refused(run_cli(home, "serve", "--listen", "127.0.0.1:0", env=env), "APPSERVER_auth__mode")


def test_both_spellings_of_the_cron_tick_are_refused(tmp_path: Path) -> None:
    home = _home(tmp_path)
    env = cli_env(home, APPSERVER_CRON_TICK_S="5", APPSERVER_CRON__TICK_S="7")
    _refused(run_cli(home, "cron", "list", env=env), "APPSERVER_CRON_TICK_S", "APPSERVER_CRON__TICK_S")


def test_a_lower_case_prefix_is_refused_not_ignored(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _refused(run_cli(home, "agents", "list", env=cli_env(home, appserver_auth__mode="token")), "appserver_auth__mode")
    # somebody else's variable that only begins like ours is none of the server's business
    assert run_cli(home, "agents", "list", env=cli_env(home, appserver_helper_url="x")).code == 0


def test_a_variable_for_two_providers_that_differ_only_in_case_is_refused(tmp_path: Path) -> None:
    toml = '[providers.MyProv]\nbase_url = "http://127.0.0.1:9/v1"\n[providers.myprov]\nbase_url = "http://127.0.0.1:8/v1"\n'
    home = _home(tmp_path, toml)
    assert run_cli(home, "agents", "list").code == 0  # the file alone is fine
    env = cli_env(home, APPSERVER_PROVIDERS__MYPROV__TIMEOUT_S="5")
    _refused(run_cli(home, "agents", "list", env=env), "APPSERVER_PROVIDERS__MYPROV__TIMEOUT_S", "'MyProv', 'myprov'")


def test_an_account_named_with_capitals_is_overridden_not_doubled(tmp_path: Path) -> None:
    home = _home(tmp_path, '[channels.webhook.accounts.Main]\nsecret_env = "S32H_SECRET"\n')
    env = cli_env(home, APPSERVER_CHANNELS__WEBHOOK__ACCOUNTS__MAIN__DEFAULT_AGENT="zed")
    r = run_cli(home, "channels", "list", "--json", env=env)
    assert r.code == 0, r.err
    webhook = next(c for c in r.json()["channels"] if c["id"] == "webhook")
    assert webhook["accounts"] == ["Main"], webhook


# ── 2. a `~user` of no user ────────────────────────────────────────────────────────────────────


def test_a_home_whose_tilde_names_no_user_is_one_line(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _refused(run_cli(home, "--home", "~nosuchuser32h/x", "cron", "list"), NO_USER, "~nosuchuser32h/x")
    env = cli_env(home, APPSERVER_HOME="~nosuchuser32h/x")
    _refused(run_cli(home, "agents", "list", env=env), NO_USER)


def test_a_secret_file_whose_tilde_names_no_user_is_one_line(tmp_path: Path) -> None:
    toml = '[channels]\nenabled = ["telegram"]\n[channels.telegram.accounts.a]\ntoken_file = "~nosuchuser32h/t"\n'
    home = _home(tmp_path, toml)
    for args in (("channels", "list"), ("channels", "status"), ("serve", "--listen", "127.0.0.1:0")):
        _refused(run_cli(home, *args), NO_USER, "token_file")


def test_channels_add_with_a_secret_file_of_no_user_writes_nothing(tmp_path: Path) -> None:
    home = _home(tmp_path)
    r = run_cli(home, "channels", "add", "telegram", "b", "--secret", "token=file:~nosuchuser32h/t")
    _refused(r, NO_USER)
    config = home / "config.toml"
    assert not config.exists() or "~nosuchuser32h" not in config.read_text()


# ── 3, 4. values nested too deeply ─────────────────────────────────────────────────────────────


@pytest.mark.parametrize("variable", ["APPSERVER_PROVIDERS__X__HEADERS", "APPSERVER_PROVIDERS__X__CONTEXT_WINDOWS"])
def test_a_deeply_nested_json_table_from_the_environment_is_one_line(tmp_path: Path, variable: str) -> None:
    home = _home(tmp_path)
    _refused(run_cli(home, "agents", "list", env=cli_env(home, **{variable: DEEP_JSON})), variable, "nested too deeply")


@pytest.mark.parametrize(
    "value", ["[" * 500 + "]" * 500, "[" * 40 + "]" * 40, "{a=" * 500 + "1" + "}" * 500], ids=["500", "40", "table"]
)
def test_channels_add_with_a_deeply_nested_set_value_is_a_usage_error(tmp_path: Path, value: str) -> None:
    home = _home(tmp_path)
    r = run_cli(home, "channels", "add", "webhook", "g", "--set", f"secret_env={value}")
    _refused(r, "--set", "deep")
    assert not (home / "config.toml").exists() or "[channels" not in (home / "config.toml").read_text()


@pytest.mark.parametrize("table_var", ["APPSERVER_PROVIDERS__myprov__headers", "APPSERVER_PROVIDERS__MYPROV__HEADERS"])
def test_a_table_and_a_key_of_it_from_two_variables_are_refused_naming_both(tmp_path: Path, table_var: str) -> None:
    """Whichever case each is written in: the table variable silently replaced the key's (its name
    sorted after the other's), the key still listed among the overrides."""
    home = _home(tmp_path, '[providers.MyProv]\nbase_url = "http://127.0.0.1:9/v1"\n')
    env = cli_env(home, APPSERVER_PROVIDERS__MYPROV__HEADERS__X_KEY="k1", **{table_var: '{"X-Other": "v"}'})
    _refused(run_cli(home, "agents", "list", env=env), "APPSERVER_PROVIDERS__MYPROV__HEADERS__X_KEY", table_var)
