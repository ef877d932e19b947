"""Issue 11 (5, 13, 16): an empty, damaged or foreign database is refused, never reset; a full disk
is one line at start and fails /readyz; state files set aside stay reported. Real `appserver serve`
subprocesses, real SQLite files, and a real (tiny tmpfs) full disk where this process may mount one."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import start_serve
from tests.support.state import chat, check, conversations, one_error_line, serve_refused, wait_ready

# ── 11.5 an empty or unreadable database is an error; only a missing one is a new home ────────


def test_empty_database_is_refused_not_reset(home: Path) -> None:
    assert run_cli(home, "agents", "create", "--name", "keeper", "--model", "echo").code == 0
    (home / "appserver.db").write_bytes(b"")
    line = one_error_line(serve_refused(home))
    assert "appserver.db is empty (0 bytes)" in line and "restore it from a backup" in line
    assert "is empty" in one_error_line(run_cli(home, "agents", "list"))
    assert (home / "appserver.db").stat().st_size == 0  # not turned into a new store
    (home / "appserver.db").unlink()  # a missing file: a new home, with its default agent
    r = run_cli(home, "agents", "list", "--json")
    assert r.code == 0 and [a["name"] for a in r.json()] == ["assistant"]


@pytest.mark.parametrize("kind", ["fifo", "/dev/null", "/dev/zero"])
def test_a_database_that_is_not_a_regular_file_is_named_so(home: Path, kind: str) -> None:
    """A FIFO or a link to a device in the store's place was called "empty (0 bytes)" with advice to
    delete it and start a new store; it is named for what it is, and left in place."""
    assert run_cli(home, "agents", "list").code == 0
    db = home / "appserver.db"
    db.unlink()
    if kind == "fifo":
        os.mkfifo(db)
    else:
        db.symlink_to(kind)
    what = "FIFO (named pipe)" if kind == "fifo" else "character device"
    for line in (one_error_line(run_cli(home, "agents", "list")), one_error_line(serve_refused(home))):
        assert f"appserver.db is a {what}, not a store" in line and "left in place" in line, line
    assert db.is_symlink() if kind != "fifo" else db.is_fifo()


def test_damaged_or_foreign_database_is_one_line(home: Path) -> None:
    assert run_cli(home, "agents", "list").code == 0
    db = home / "appserver.db"
    raw = bytearray(db.read_bytes())
    raw[100:4000] = bytes(3900)  # page 1's b-tree header and cells: the schema is unreadable
    db.write_bytes(bytes(raw))
    line = one_error_line(serve_refused(home))
    assert "appserver.db is damaged (database disk image is malformed)" in line
    db.write_bytes(b"PK\x03\x04 not a database at all" * 10)
    assert "is not an SQLite database" in one_error_line(serve_refused(home))
    db.unlink()
    with contextlib.closing(sqlite3.connect(db)) as other:  # someone else's database in its place
        other.execute("CREATE TABLE t (x)")
    assert "holds no appserver data" in one_error_line(serve_refused(home))


# ── a real full disk: a tiny tmpfs (needs root; skipped elsewhere) ────────────────────────────


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], capture_output=True, timeout=10
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill `fs` up to `leave` free bytes (0: until writes fail)."""
    filler = fs / f"filler-{len(list(fs.glob('filler-*')))}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        target = max(0, shutil.disk_usage(fs).free - leave) if leave else 1 << 40
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while target > 0:
                target -= os.write(fd, chunk[: min(len(chunk), target)])
    finally:
        os.close(fd)
    return filler


def test_full_disk_at_start_is_one_line(tiny_fs: Path) -> None:
    home = tiny_fs / "home"
    env = cli_env(home)
    sp = start_serve(home, env=env)
    chat(sp, "before the disk filled")
    sp.stop()
    filler = fill(tiny_fs)
    line = one_error_line(serve_refused(home, env=env))
    assert "no space left" in line and str(home) in line and "free some space" in line
    filler.unlink()
    sp = start_serve(home, env=env)
    sp.stop()
    assert conversations(home) == 1


def test_readyz_fails_while_the_disk_is_full(tiny_fs: Path) -> None:
    home = tiny_fs / "home"
    sp = start_serve(home, env=cli_env(home, APPSERVER_LIMITS__MIN_FREE_DISK_BYTES=str(8 << 20)))
    try:
        body = wait_ready(sp.url, 200)
        assert [c["name"] for c in body["checks"]][:3] == ["store", "kernel", "state_files"]
        assert check(body, "store")["status"] == "ok"
        filler = fill(tiny_fs, leave=2 << 20)  # below the configured minimum: not ready
        body = wait_ready(sp.url, 503)
        assert body["status"] == "not_ready" and "disk nearly full" in check(body, "store")["detail"]
        more = fill(tiny_fs)  # completely full: a small WAL write may still pass, the check does not
        body = wait_ready(sp.url, 503)
        assert check(body, "store")["status"] == "fail"
        filler.unlink()
        more.unlink()
        wait_ready(sp.url, 200)
        chat(sp, "still works")
    finally:
        sp.stop()


# ── 11.16 a state file set aside as corrupt stays reported until the operator acts ────────────


def test_set_aside_state_files_are_reported_at_every_start_and_in_readyz(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "config.toml").write_text('[auth]\nmode = "token"\n')
    (home / "auth").mkdir(mode=0o700)
    (home / "auth" / "tokens.json").write_text('{"tokens": [ {"id": ')  # truncated by a crash
    (home / "crons.json").write_text('{"version": 1, "tasks": [')
    env = cli_env(home, APPSERVER_CRON_TICK_S="0.2")
    sp = start_serve(home, env=env)
    try:
        r = httpx.get(sp.url + "/v1/models", headers={"Authorization": "Bearer aps_whatever"}, timeout=5)
        assert r.status_code == 401  # denied, never guessed; tokens.json is now set aside
        deadline = time.monotonic() + 10
        while len(list(home.glob("crons.json.corrupt-*"))) + len(list(home.glob("auth/tokens.json.corrupt-*"))) < 2:
            assert time.monotonic() < deadline, "both files should have been set aside"
            time.sleep(0.1)
        body = wait_ready(sp.url, 200)
        files = check(body, "state_files")
        assert files["status"] == "warn"
        assert "auth/tokens.json.corrupt-" in files["detail"] and "crons.json.corrupt-" in files["detail"]
    finally:
        sp.stop()
    sp = start_serve(home, env=env)  # a restart does not forget them
    try:
        assert check(wait_ready(sp.url, 200), "state_files")["status"] == "warn"
        for p in [*home.glob("crons.json.corrupt-*"), *home.glob("auth/tokens.json.corrupt-*")]:
            p.unlink()  # the operator dealt with them
        deadline = time.monotonic() + 10
        while check(wait_ready(sp.url, 200), "state_files")["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        sp.stop()
    err = sp.proc.stderr.read()
    assert "auth/tokens.json.corrupt-" in err and "crons.json.corrupt-" in err and "set aside as unreadable" in err
