"""The CLI as a real subprocess, with its home and environment pinned to one test.

The process is a fork of a zygote that imported the CLI once (tests/support/zygote.py): it runs
`appserver/__main__.py` as `python -m appserver` does, without paying the imports every call."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.zygote_client import appserver_popen

ROOT = Path(__file__).resolve().parent.parent.parent

# Waits meant for real platforms, shortened for the loopback fakes (each knob's default is unchanged
# when unset): the gateway child's first restart (1 s), discord.py's wait before a re-IDENTIFY (5 s)
# and its wait for GUILD_CREATEs after READY (0.5 s; the fake sends its one guild with READY).
FAST_WAITS = {
    "APPSERVER_GATEWAY_RESTART_BACKOFF_S": "0.1",
    "APPSERVER_DISCORD_REIDENTIFY_WAIT_S": "0.2",
    "APPSERVER_DISCORD_GUILD_READY_TIMEOUT_S": "0.1",
}


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment with the home pinned and retries fast, so tests never wait on backoff,
    and bytecode cached, so that no subprocess compiles the package again."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # each subprocess would compile the package anew
    env["APPSERVER_HOME"] = str(home)
    env.setdefault("APPSERVER_LIMITS__RETRY_BASE_MS", "10")
    for name, value in FAST_WAITS.items():
        env.setdefault(name, value)
    env.update(extra)
    return env


@dataclass
class CLIResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(
    home: Path, *args: str, timeout: float = 60, env: dict[str, str] | None = None, stdin: str | None = None
) -> CLIResult:
    """`python -m appserver ARGS` in a child process, as `subprocess.run` would (pipes, timeout),
    forked from this worker's zygote (tests/support/zygote.py) when one can stand in for it.
    `stdin`: the child's input, through a pipe (no terminal)."""
    with appserver_popen(
        list(args),
        env=env or cli_env(home),
        cwd=ROOT,
        stdin=subprocess.PIPE if stdin is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return CLIResult(proc.returncode, out, err)


def careful_home(parent: Path) -> Path:
    """`parent/home` with an agent `careful` that asks before each `clock` call (the approval tests' agent)."""
    home = parent / "home"
    r = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=cli_env(home))
    assert r.code == 0, r.err
    return home
