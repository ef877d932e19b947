"""Shared fixtures: a fresh home per test, the CLI as a real subprocess, a real `serve` on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("APPSERVER_HOME", str(h))
    monkeypatch.setenv("APPSERVER_LIMITS__RETRY_BASE_MS", "10")
    return h


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["APPSERVER_HOME"] = str(home)
    env.setdefault("APPSERVER_LIMITS__RETRY_BASE_MS", "10")
    env.update(extra)
    return env


@dataclass
class CLIResult:
    code: int
    out: str
    err: str

    def json(self):  # type: ignore[no-untyped-def]
        return json.loads(self.out)


def run_cli(home: Path, *args: str, timeout: float = 60, env: dict[str, str] | None = None) -> CLIResult:
    proc = subprocess.run(
        [sys.executable, "-m", "appserver", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(home),
        cwd=ROOT,
    )
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli(home: Path):  # type: ignore[no-untyped-def]
    def _cli(*args: str, **kw):  # type: ignore[no-untyped-def]
        return run_cli(home, *args, **kw)

    return _cli


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    home: Path
    url: str

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_serve(home: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 20) -> ServeProcess:
    home.mkdir(parents=True, exist_ok=True)
    server_json = home / "server.json"
    server_json.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "appserver", "serve", "--listen", "127.0.0.1:0", *extra],
        env=env or cli_env(home),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {proc.stderr.read()}")
        if server_json.exists():
            try:
                info = json.loads(server_json.read_text())
            except json.JSONDecodeError:
                info = None
            if info and info.get("pid") == proc.pid:
                return ServeProcess(proc, home, info["url"])
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("serve did not write server.json in time")


@pytest.fixture
def serve(home: Path) -> Iterator[ServeProcess]:
    sp = start_serve(home)
    try:
        yield sp
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(10)


def wait_http(url: str, timeout: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"{url} did not answer: {last}")


CONFORMANCE_SKIP = "conformance data not found"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips for missing conformance data are loud (issue 14.11): those tests validate every HTTP
    shape against OpenAI's published schema, and a clone without ../shared/conformance skips them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if CONFORMANCE_SKIP in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_sep("!", f"WARNING: {len(skipped)} tests skipped: {CONFORMANCE_SKIP} (../shared/conformance beside the repo); HTTP shapes were NOT validated", red=True, bold=True)
