"""Issue 11 (5, 6, 13, 16, 17): the store is never silently reset or truncated, state files set
aside stay reported, /readyz sees a full disk. Real `appserver serve` subprocesses, real SQLite
files, kill -9, and a real (tiny tmpfs) full disk where this process may mount one."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.test_hardening_state import one_error_line, serve_refused


def chat(sp: ServeProcess, text: str) -> None:
    r = httpx.post(
        sp.url + "/v1/chat/completions",
        json={"model": "assistant", "messages": [{"role": "user", "content": text}]},
        timeout=15,
    )
    assert r.status_code == 200, r.text


def conversations(home: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT count(*) FROM conversations").fetchone()[0])


def wait_ready(url: str, want: int, timeout: float = 10) -> dict:  # type: ignore[type-arg]
    """/readyz until it answers `want` (its checks are cached for 1.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/readyz", timeout=5)
        if r.status_code == want or time.monotonic() > deadline:
            assert r.status_code == want, r.text
            return dict(r.json())
        time.sleep(0.2)


def check(body: dict, name: str) -> dict:  # type: ignore[type-arg]
    return next(c for c in body["checks"] if c["name"] == name)


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


# ── 11.6 a damaged WAL after kill -9 is refused loudly, the files kept ─────────────────────────


def _live_frames(wal: Path) -> list[int]:
    """Offsets of the frames of the WAL's current generation (their salt matches the header's)."""
    data = wal.read_bytes()
    page_size = struct.unpack(">I", data[8:12])[0]
    salt = data[16:24]
    frame = 24 + page_size
    return [
        32 + i * frame
        for i in range((len(data) - 32) // frame)
        if data[32 + i * frame + 8 : 32 + i * frame + 16] == salt
    ]


def test_damaged_wal_after_kill9_is_refused_and_kept(home: Path) -> None:
    sp = start_serve(home)
    for i in range(40):
        chat(sp, f"conversation {i} " + "x" * 2000)
    sp.stop(signal.SIGKILL)
    wal = home / "appserver.db-wal"
    frames = _live_frames(wal)
    assert len(frames) >= 4, "the commits should still be in the WAL right after kill -9"
    with open(wal, "r+b") as f:  # one bad byte in the page of a frame in the middle of the live log
        f.seek(frames[len(frames) // 2] + 24 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    damaged = hashlib.sha256(wal.read_bytes()).hexdigest()

    line = one_error_line(serve_refused(home))
    assert "write-ahead log" in line and "is damaged" in line and "committed transaction(s)" in line
    assert "--accept-data-loss" in line and "Nothing was changed" in line
    kept = list(home.glob("appserver.db.damaged-*"))
    assert len(kept) == 1 and str(kept[0]) in line
    assert hashlib.sha256((kept[0] / "appserver.db-wal").read_bytes()).hexdigest() == damaged
    assert hashlib.sha256(wal.read_bytes()).hexdigest() == damaged  # the live WAL untouched too
    # Every start refuses the same way (and reuses the copy); so does an in-process command.
    assert "is damaged" in one_error_line(serve_refused(home))
    assert "is damaged" in one_error_line(run_cli(home, "conversations", "list"))
    assert len(list(home.glob("appserver.db.damaged-*"))) == 1

    sp = start_serve(home, "--accept-data-loss")  # the operator's deliberate choice
    sp.stop()
    assert "accepted data loss" in sp.proc.stderr.read()
    sp = start_serve(home)  # accepted once: later starts are normal
    sp.stop()


def test_clean_stops_and_kill9_never_refuse(home: Path) -> None:
    """The checks must not cry wolf: SIGTERM and plain kill -9 leave a store that opens."""
    total = 0
    for stop in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL, signal.SIGTERM):
        sp = start_serve(home)
        for i in range(8):
            chat(sp, f"turn {total + i}")
        total += 8
        sp.stop(stop)
    sp = start_serve(home)
    sp.stop()
    assert "Traceback" not in sp.proc.stderr.read()
    assert conversations(home) == total
    assert not list(home.glob("appserver.db.damaged-*"))


def test_store_behind_its_recorded_position_is_refused(home: Path, tmp_path: Path) -> None:
    sp = start_serve(home)
    chat(sp, "first")
    sp.stop()
    old = (home / "appserver.db").read_bytes()  # clean stop: the whole store is in this file
    sp = start_serve(home)
    for i in range(3):
        chat(sp, f"later {i}")
    sp.stop()
    (home / "appserver.db").write_bytes(old)  # an older copy put back (or a WAL lost)
    line = one_error_line(serve_refused(home))
    assert "behind its last recorded position" in line and "--accept-data-loss" in line
    assert conversations(home) == 1  # nothing changed
    sp = start_serve(home, "--accept-data-loss")
    sp.stop()
    sp = start_serve(home)
    sp.stop()


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
