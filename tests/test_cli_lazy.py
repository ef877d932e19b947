"""The CLI imports a command's dependencies only when that command runs (issue 12.8)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from appserver.cli.main import COMMANDS, main
from tests.support.cli import ROOT

HEAVY = (
    "uvicorn",
    "starlette",
    "appserver.server",
    "appserver.runtime",
    "appserver.http",
    "appserver.ws",
)


def test_help_imports_no_server_code() -> None:
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['appserver', '--help']\n"
        "try:\n    runpy.run_module('appserver', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m in {HEAVY!r} or m.startswith({tuple(h + '.' for h in HEAVY)!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "serve" in out.stdout and "token" in out.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_recorded_help_line_is_the_commands_own(name: str) -> None:
    command = COMMANDS[name].load()
    assert isinstance(command, click.Command)
    assert COMMANDS[name].help == command.help


def test_every_command_resolves() -> None:
    ctx = click.Context(main)
    assert main.list_commands(ctx) == sorted(COMMANDS)
    assert all(main.get_command(ctx, name) is not None for name in COMMANDS)
