"""A real `appserver serve` on an ephemeral loopback port, found through the server.json it writes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.cli import ROOT, cli_env
from tests.support.net import SSL
from tests.support.zygote_client import appserver_popen


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    home: Path
    url: str

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Make sure the process is gone (teardown: the test may have stopped it already)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_serve(home: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 20) -> ServeProcess:
    home.mkdir(parents=True, exist_ok=True)
    server_json = home / "server.json"
    server_json.unlink(missing_ok=True)
    proc = appserver_popen(
        ["serve", "--listen", "127.0.0.1:0", *extra],
        env=env or cli_env(home),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        if server_json.exists():
            try:
                info = json.loads(server_json.read_text())
            except json.JSONDecodeError:
                info = None
            if info and info.get("pid") == proc.pid:
                return ServeProcess(proc, home, info["url"])
        time.sleep(0.005)  # a start takes a few tens of milliseconds (tests/support/zygote.py)
    proc.kill()
    raise RuntimeError("serve did not write server.json in time")


@contextmanager
def serving(
    home: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float = 20,
    graceful: bool = True,
) -> Iterator[ServeProcess]:
    """`start_serve` that always cleans up: the body of every `srv`/`server` fixture.

    `graceful` ends it with SIGTERM as an operator would; otherwise (or if that hangs) SIGKILL."""
    sp = start_serve(home, *extra, env=env, timeout=timeout)
    try:
        yield sp
    finally:
        if graceful and sp.proc.poll() is None:
            try:
                sp.stop()
            except subprocess.TimeoutExpired:
                pass
        sp.kill()


def wait_http(url: str, timeout: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return httpx.get(url, timeout=2, verify=SSL)
        except httpx.HTTPError as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"{url} did not answer: {last}")
