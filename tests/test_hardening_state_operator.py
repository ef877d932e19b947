"""Issue 11 (13, 15): operator errors are one line with exit code 2 (a traceback only with
--debug), and everything under the home is private. Real `appserver` subprocesses on real homes."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import httpx

from tests.support.certs import self_signed
from tests.support.cli import run_cli
from tests.support.serve import start_serve
from tests.support.state import one_error_line, serve_refused

STATE_FILES = ("config.toml", "appserver.db", "appserver.db-wal", "appserver.db-shm")


# ── 11.13 operator errors: one line, exit 2, traceback only with --debug ───────────────────────


def test_busy_port_is_one_line(home: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(home, "serve", "--listen", f"127.0.0.1:{port}", timeout=30)
        line = one_error_line(r)
        assert f"cannot listen on 127.0.0.1:{port}" in line and "already in use" in line
        assert not (home / "server.json").exists()


def test_missing_or_bad_tls_file_is_one_line(home: Path, tmp_path: Path) -> None:
    line = one_error_line(
        serve_refused(home, "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tmp_path / "nope.key"))
    )
    assert f"TLS certificate file not found: {tmp_path / 'nope.pem'}" in line
    cert, key = self_signed(tmp_path)
    line = one_error_line(serve_refused(home, "--tls-cert", str(cert), "--tls-key", str(tmp_path / "nope.key")))
    assert "TLS key file not found" in line
    (tmp_path / "junk.pem").write_text("not a certificate")
    line = one_error_line(serve_refused(home, "--tls-cert", str(tmp_path / "junk.pem"), "--tls-key", str(key)))
    assert "TLS certificate or key unusable" in line


def test_allowed_origins_star_in_the_file_is_one_line(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text('[server]\nallowed_origins = ["*"]\n')
    line = one_error_line(serve_refused(home))
    assert "config.toml: [server] allowed_origins: '*' is not supported" in line


def test_debug_flag_shows_the_traceback(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_bytes(b"")
    r = run_cli(home, "--debug", "agents", "list")
    assert r.code != 0 and "Traceback" in r.err and "ConfigError" in r.err


# ── 11.15 everything under the home is private ────────────────────────────────────────────────


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_home_and_state_files_are_owner_only(home: Path) -> None:
    home.mkdir(parents=True)
    os.chmod(home, 0o755)  # a home made by hand, or by an older version
    (home / "config.toml").write_text("# defaults\n")
    os.chmod(home / "config.toml", 0o644)
    (home / "cron-runs").mkdir(mode=0o755)
    (home / "cron-runs" / "t.jsonl").write_text("")
    os.chmod(home / "cron-runs" / "t.jsonl", 0o644)
    (home / "notes.txt").write_text("mine")  # not appserver's: left alone
    os.chmod(home / "notes.txt", 0o644)
    sp = start_serve(home)
    try:
        r = httpx.post(
            sp.url + "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 200
        assert _mode(home) == 0o700
        for name in STATE_FILES + ("server.json", "crons.json"):
            assert _mode(home / name) == 0o600, name  # the WAL and SHM too, while they exist
        assert _mode(home / "cron-runs") == 0o700 and _mode(home / "cron-runs" / "t.jsonl") == 0o600
        assert _mode(home / "notes.txt") == 0o644
    finally:
        sp.stop()
    assert "permissions tightened to owner-only" in sp.proc.stderr.read()


def test_cli_tightens_an_open_home_and_keeps_new_files_private(home: Path) -> None:
    old = os.umask(0o022)
    try:
        home.mkdir(parents=True)  # 0755, as `mkdir` leaves it
        r = run_cli(home, "run", "hello")
    finally:
        os.umask(old)
    assert r.code == 0, r.err
    assert _mode(home) == 0o700
    for p in home.iterdir():
        assert _mode(p) & 0o077 == 0, (p, oct(_mode(p)))
