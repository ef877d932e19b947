"""A server.json whose pid and start time match a live process that is no server (pid reuse after a
reboot, pid 1 in a container) while nobody holds `serve.lock`: `serve` was refused ("a server already
runs on this home") and `run` failed to connect instead of running in-process (found by an outside
test). Such a file is stale when nothing answers at its URL; a live server that predates
`serve.lock` (holds no lock, answers) still owns the home."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appserver.procid import identity
from appserver.serverinfo import read_live_server
from tests.support.cli import cli_env, run_cli
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def bystander() -> Iterator[int]:
    """A live process that is no server."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def _server_json(home: Path, pid: int, port: int) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "server.json"
    info = {"url": f"http://127.0.0.1:{port}", "pid": pid, "identity": identity(pid), "auth": "none", "home": str(home)}
    path.write_text(json.dumps(info))
    return path


def test_a_stale_server_json_naming_a_live_bystander_lets_run_work_in_process(tmp_path: Path, bystander: int) -> None:
    home = tmp_path / "home"
    path = _server_json(home, bystander, free_port())
    assert read_live_server(path) is None
    done = run_cli(home, "run", "hello", env=cli_env(home))
    assert done.code == 0 and "echo: hello" in done.out, done


def test_a_server_that_answers_without_the_lock_still_owns_the_home(tmp_path: Path, bystander: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        path = _server_json(tmp_path / "home", bystander, listening.getsockname()[1])
        live = read_live_server(path)
    assert live is not None and live["pid"] == bystander
