"""A real `appserver serve` on an ephemeral loopback port, found through the server.json it writes."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.net import SSL
from tests.support.zygote_client import appserver_popen


class DrainedStream:
    """A child's text output pipe, read by a thread as it comes, so the child never blocks on a full
    pipe: a server whose log a test reads only at the end (`proc.stderr.read()`) stalled once its
    lines passed 64 KiB (a thousand refused requests, clients leaving). `read` and `readline` as a
    text file's: `read` waits for the end (the child closed it)."""

    def __init__(self, pipe: IO[str]) -> None:
        self._lines: list[str] = []
        self._pos = 0
        self._done = False
        self._cond = threading.Condition()
        threading.Thread(target=self._drain, args=(pipe,), daemon=True, name="serve-output").start()

    def _drain(self, pipe: IO[str]) -> None:
        try:
            for line in iter(pipe.readline, ""):
                with self._cond:
                    self._lines.append(line)
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass  # closed under us
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def readline(self) -> str:
        with self._cond:
            while self._pos >= len(self._lines) and not self._done:
                self._cond.wait()
            if self._pos < len(self._lines):
                self._pos += 1
                return self._lines[self._pos - 1]
            return ""

    def read(self, timeout: float = 30) -> str:
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout)
            rest = "".join(self._lines[self._pos :])
            self._pos = len(self._lines)
            return rest

    def seen(self, text: str) -> bool:
        """Whether a line so far holds `text` (for `wait_for`; reads nothing away from `readline`)."""
        with self._cond:
            return any(text in line for line in self._lines)

    def so_far(self) -> str:
        """Every line so far, reading nothing away (for a failing test's message)."""
        with self._cond:
            return "".join(self._lines)

    def __iter__(self) -> Iterator[str]:
        return iter(self.readline, "")

    def close(self) -> None:
        pass


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
    if proc.stderr is not None:
        proc.stderr = DrainedStream(proc.stderr)  # type: ignore[assignment]
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


def start_serve_at(home: Path, port: int, env: dict[str, str], *, last: int, step: int) -> ServeProcess:
    """`serve` on a fixed port (a cluster member is reached at its listen address), or on the next
    ones (`step` apart, up to `last`) while one is taken: another test's client may hold it."""
    while True:
        try:
            return start_serve(home, "--listen", f"127.0.0.1:{port}", env=env)
        except RuntimeError as exc:
            if "already in use" not in str(exc) or port >= last:
                raise
            port += step


def serve_with_timings(home: Path, url: str, heartbeat_s: float, instance_timeout_s: float) -> ServeProcess:
    """`serve` of `home` on the PostgreSQL database `url`, with cluster timings of its own."""
    env = cli_env(
        home,
        APPSERVER_STORE__URL=url,
        APPSERVER_STORE__HEARTBEAT_S=str(heartbeat_s),
        APPSERVER_STORE__INSTANCE_TIMEOUT_S=str(instance_timeout_s),
    )
    return start_serve(home, env=env)


@contextmanager
def killed_at_exit() -> Iterator[list[ServeProcess]]:
    """A list to put servers in; each is killed when the block ends."""
    nodes: list[ServeProcess] = []
    try:
        yield nodes
    finally:
        for sp in nodes:
            sp.kill()


def ready_status(sp: ServeProcess) -> int:
    """The status of the server's /readyz (200: it serves)."""
    return httpx.get(sp.url + "/readyz", timeout=10, verify=SSL).status_code


def log_so_far(sp: ServeProcess) -> str:
    """What a `start_serve` server has written to stderr so far."""
    return sp.proc.stderr.so_far() if sp.proc.stderr is not None else ""  # type: ignore[attr-defined]


def stop_all(*servers: ServeProcess) -> None:
    """Stop each server (SIGTERM, then SIGKILL if it hangs or is already gone)."""
    for sp in servers:
        try:
            sp.stop(timeout=15)
        except Exception:
            pass
        sp.kill()


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


@contextmanager
def serving_provider(home: Path, kind: str, base_url: str, agents: dict[str, str]) -> Iterator[ServeProcess]:
    """`serving` a new `home` whose one provider `up` (of `kind`, at `base_url`: a loopback fake,
    no key, one attempt) serves `agents` (name → model, as `up:MODEL`)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[providers.up]\nkind = "{kind}"\nbase_url = "{base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
    )
    env = cli_env(home)
    for name, model in agents.items():
        made = run_cli(home, "agents", "create", "--name", name, "--model", f"up:{model}", env=env)
        assert made.code == 0, made.err
    with serving(home, env=env) as sp:
        yield sp


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
