"""A long refused value reads once in an error line: `'head…' (N characters)`, N its own length.

The kernel and the agent admin quoted a client's whole value (`unknown agent {ref!r}`); the server
cut the message at its cap and the CLI quoted the cut text again, so a 10,000-character agent name
gave `unknown agent "'AAAA…" (4083 characters) (10016 characters)`. Real `appserver serve`, the
real CLI as a subprocess."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.cli.common import short_values
from appserver.shown import capped_message
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

N = 10_000


def cut(ch: str) -> str:
    """How a value of N `ch` reads in an error line: its head, quoted once, and its own length."""
    return f"'{ch * 80}…' ({N} characters)"


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[:2000]
    assert err.count("characters)") == 1, err[:2000]  # one length: the value's, never the message's
    return lines[0]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One server for the module: each test only sends a refused request."""
    with serving(tmp_path_factory.mktemp("shown") / "home") as sp:
        yield sp


def test_an_unknown_long_agent_reads_once_with_its_length(serve: ServeProcess) -> None:
    r = run_cli(serve.home, "run", "--agent", "A" * N, "hi", env=cli_env(serve.home))
    assert r.code != 0
    assert error_line(r.err) == f"error: unknown agent {cut('A')}"


def test_an_unknown_long_conversation_reads_once_with_its_length(serve: ServeProcess) -> None:
    r = run_cli(serve.home, "run", "--conversation", "B" * N, "hi", env=cli_env(serve.home))
    assert r.code != 0
    assert error_line(r.err) == f"error: unknown conversation {cut('B')} for agent assistant"


def test_a_long_param_value_reads_once_with_its_length(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "agents", "create", "--name", "zz", "--param", "temperature=" + "[" * N, env=cli_env(home))
    assert r.code == 2, r.err[:2000]
    assert error_line(r.err) == f"error: invalid --param temperature={cut('[')}: expected a number"


def test_a_long_channel_id_in_the_environment_reads_once_with_its_length(tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "agents", "list", env=cli_env(home, APPSERVER_CHANNELS__ENABLED="[" * N))
    assert r.code == 2, r.err[:2000]
    line = error_line(r.err)
    assert f"[channels] enabled: {cut('[')} is not a channel id" in line, line[:2000]


def test_a_message_cut_inside_a_value_it_quoted_whole_shows_the_value_once() -> None:
    """A server that still quotes a value whole (an older one): the CLI shows that value with its
    own length where the server's cap cut it, not the cut text quoted again."""
    value = "A" * N
    message = capped_message(f"unknown conversation {value!r} for agent assistant")
    shown = short_values(message, ["run", "--conversation", value, "hi"])
    cli_cut = f"'{'A' * 100}…' ({N} characters)"  # the CLI's own cut (100 characters)
    assert shown == f"unknown conversation {cli_cut} (the rest of the message was cut)"
