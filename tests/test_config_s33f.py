"""Session 33, helper f: config loading found by an outside attacker (docs/configuration.md).

* A value of an APPSERVER_ variable holding a byte that is not UTF-8 (a lone surrogate in Python)
  passed the load and failed where it was first encoded: `serve` died at start with a traceback
  (a provider's base_url quoted for the log, the store URL handed to the database driver). Now any
  such setting is refused at load in one line naming the variable, never showing the value.
* A config.toml saved with a UTF-8 byte-order mark (Windows editors) was moved aside as corrupt.
* A variable with an empty or an extra name part was reported under another variable's name.

Through the real CLI, as a subprocess."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(120)

BOM = b"\xef\xbb\xbf"


def _home(tmp_path: Path, toml: bytes | None = None) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_bytes(toml or f'[server]\nlisten = "127.0.0.1:{free_port()}"\n'.encode())
    return home


def _refused(r: CLIResult, start: str, *needles: str) -> str:
    """The one `error:` line of a refused command (exit 2): it starts with `start` and holds every needle."""
    assert "Traceback" not in r.err + r.out, r.err
    assert r.code == 2, (r.code, r.err)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), r.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "secret"),
    [
        ("APPSERVER_PROVIDERS__FAKE__BASE_URL", b"http://127.0.0.1:9/v1?k=S3CRET\xff", "S3CRET"),
        ("APPSERVER_STORE__URL", b"postgresql://u:pw5ecret\xff@127.0.0.1:5432/db", "pw5ecret"),
    ],
)
def test_serve_refuses_a_url_from_the_environment_that_is_not_utf8_in_one_line(
    tmp_path: Path, variable: str, value: bytes, secret: str
) -> None:
    home = _home(tmp_path)
    env = cli_env(home, **{variable: os.fsdecode(value)})
    r = run_cli(home, "serve", env=env, timeout=30)
    line = _refused(r, f"error: {variable}: ", "the byte 0xFF at position", "not UTF-8")
    assert secret not in r.err + r.out, line


def test_any_setting_from_the_environment_that_is_not_utf8_is_refused_at_load(tmp_path: Path) -> None:
    home = _home(tmp_path)
    for variable in ("APPSERVER_AUTH__JWT_ISSUER", "APPSERVER_SERVER__ALLOWED_HOSTS"):
        env = cli_env(home, **{variable: os.fsdecode(b"ab\xfe")})
        _refused(run_cli(home, "agents", "list", env=env), f"error: {variable}: ", "byte 0xFE at position 3")
    assert run_cli(home, "agents", "list", env=cli_env(home, APPSERVER_AUTH__JWT_ISSUER="ïssuer")).code == 0


def test_a_config_with_a_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    home = _home(tmp_path, BOM + b"[server]\r\nlisten = '127.0.0.1:8770'\r\n[limits]\r\nqueue_max = 0\r\n")
    # refused for its content (so it was read, not set aside or taken as defaults)
    _refused(run_cli(home, "agents", "list"), "error: ", "queue_max must be an integer >= 1, got 0")
    (home / "config.toml").write_bytes(BOM + b"[limits]\nqueue_max = 3\n")
    r = run_cli(home, "agents", "list")
    assert r.code == 0, r.err
    assert sorted(p.name for p in home.iterdir() if "corrupt" in p.name) == []
    (home / "config.toml").write_bytes(BOM + b"\n")
    _refused(run_cli(home, "agents", "list"), "error: ", "is empty")


@pytest.mark.parametrize(
    ("variable", "needles"),
    [
        ("APPSERVER_LIMITS__QUEUE_MAX__X", ("a name part too many", "[limits] queue_max has no sub-keys")),
        ("APPSERVER_LIMITS__NOPE__X", ("'nope' is no key of [limits]",)),
        ("APPSERVER_PROVIDERS__LOCAL__HEADERS__X_KEY__Y", ("headers takes one name part after",)),
        ("APPSERVER_PROVIDERS__LOCAL__KIND__X", ("[providers.local] kind has no sub-keys",)),
        ("APPSERVER_CHANNELS__ENABLED__X", ("[channels] enabled has no sub-keys",)),
        ("APPSERVER_LIMITS____QUEUE_MAX", ("empty", "did you mean APPSERVER_LIMITS__QUEUE_MAX?")),
        ("APPSERVER_LIMITS__", ("empty",)),
        ("APPSERVER___LIMITS", ("empty",)),
    ],
)
def test_a_variable_with_an_empty_or_extra_name_part_is_named_itself(
    tmp_path: Path, variable: str, needles: tuple[str, ...]
) -> None:
    home = _home(tmp_path)
    env = cli_env(home, **{variable: "3"})
    _refused(run_cli(home, "agents", "list", env=env), f"error: {variable}: ", *needles)


def test_a_table_setting_still_takes_one_name_part(tmp_path: Path) -> None:
    home = _home(tmp_path)
    env = cli_env(
        home,
        APPSERVER_PROVIDERS__LOCAL__BASE_URL="http://127.0.0.1:9/v1",
        APPSERVER_PROVIDERS__LOCAL__HEADERS__X_KEY="v",
    )
    r = run_cli(home, "agents", "list", env=env)
    assert r.code == 0, r.err
