"""Helpers of the state-file tests (issue 11): a `serve` that must refuse, its one error line, a chat
turn over HTTP, /readyz polled until it answers as expected."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.cli import CLIResult, run_cli
from tests.support.net import SSL
from tests.support.serve import ServeProcess


def serve_refused(home: Path, *args: str, env: dict[str, str] | None = None) -> CLIResult:
    """`serve` that must refuse to start: its result (it would hang here if it started)."""
    return run_cli(home, "serve", "--listen", "127.0.0.1:0", *args, timeout=30, env=env)


def one_error_line(r: CLIResult) -> str:
    """The single `error:` line of a refused command; no traceback anywhere."""
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.err
    return lines[0]


def token_home(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text('[auth]\nmode = "token"\n')
    return home / "config.toml"


def chat(sp: ServeProcess, text: str) -> None:
    r = httpx.post(
        sp.url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
        timeout=15,
        verify=SSL,
    )
    assert r.status_code == 200, r.text


def conversations(home: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT count(*) FROM conversations").fetchone()[0])


def wait_ready(url: str, want: int, timeout: float = 10) -> dict[str, Any]:
    """/readyz until it answers `want` (its checks are cached for 1.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/readyz", timeout=5, verify=SSL)
        if r.status_code == want or time.monotonic() > deadline:
            assert r.status_code == want, r.text
            return dict(r.json())
        time.sleep(0.1)


def check(body: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(next(c for c in body["checks"] if c["name"] == name))


def store_behind_symlink(home: Path, elsewhere: Path) -> Path:
    """Move the home's store to `elsewhere/real.db` and leave `appserver.db` a symbolic link to it
    (a store kept on another disk); the real file's path."""
    elsewhere.mkdir(parents=True, exist_ok=True)
    real = elsewhere / "real.db"
    (home / "appserver.db").replace(real)
    (home / "appserver.db").symlink_to(real)
    return real
