"""server.json: written while `serve` runs, so CLI processes on the same home find (and never race) it.

`serve.lock` beside it is held (flock) by the one `serve` that owns the home, for its whole life.
The operating system drops the lock when that process dies, even on `kill -9`, so checking the lock
and server.json's process identity (pid + start time; a reused pid is dead) together means two
processes never run turns on one home, and a standby (`serve --standby`) knows when to take over.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from appserver.fsutil import (
    SERVER_JSON_MAX_BYTES,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_json,
    read_state_bytes,
)
from appserver.procid import identity, identity_alive

log = logging.getLogger("appserver.serverinfo")


def write_server_json(path: Path, url: str, auth_mode: str, **extra: Any) -> dict[str, Any]:
    info = {
        "url": url,
        "pid": os.getpid(),
        "identity": identity(),
        "auth": auth_mode,
        "started_at": time.time(),
        **extra,
    }
    atomic_write_json(path, info)
    return info


def read_live_server(path: Path) -> dict[str, Any] | None:
    """The server.json of a live server on this home, or None (a stale file from a dead one is ignored).
    One too large to be a server's is damaged, so ignored as garbage is (`serve` replaces it); one that
    is no regular file or a link to nothing raises StateFileRefused: a FIFO would block every command
    forever, and a file on an unmounted disk may name a live server."""
    try:
        info = json.loads(read_state_bytes(path, SERVER_JSON_MAX_BYTES).decode("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    except StateFileTooLarge as exc:
        log.warning("ignoring a damaged server.json: %s", exc)
        return None
    if not isinstance(info, dict) or not identity_alive(str(info.get("identity") or "")):
        return None
    return info


def remove_server_json(path: Path) -> None:
    """Remove server.json only when it is ours (another server may have started since)."""
    try:
        info = json.loads(read_state_bytes(path, SERVER_JSON_MAX_BYTES).decode("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return
    except StateFileRefused as exc:  # at a stop: say so, and leave it
        log.warning("not removing server.json: %s", exc)
        return
    if isinstance(info, dict) and info.get("identity") == identity():
        path.unlink(missing_ok=True)


PROBE_PATIENCE_S = 0.5


class HomeLock:
    """The exclusive, process-lifetime lock of one home (`serve.lock`, flock; never a soft lock,
    which would outlive a killed holder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, patience_s: float = PROBE_PATIENCE_S) -> bool:
        """Take the lock; False when another process holds it. Retries for `patience_s`, so a CLI
        process probing the lock for a moment (`held_elsewhere`) never turns a server away."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # non-blocking: the open of a FIFO put in its place must not wait (the flock's wait is LOCK_NB's)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        deadline = time.monotonic() + patience_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        return False
                    time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock (probed with a shared lock kept for microseconds)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's shared lock
        return False

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class HomeStarting(Exception):
    """A server holds this home but has not published server.json yet."""


def find_live_server(server_json: Path, wait_s: float = 20.0) -> dict[str, Any] | None:
    """The live server of this home, waiting while one is still starting (it holds `serve.lock`
    but has not written server.json), so a CLI command never runs turns beside it. None: no server."""
    lock = HomeLock(home_lock_path(server_json))
    deadline = time.monotonic() + wait_s
    while True:
        live = read_live_server(server_json)
        if live is not None or not lock.held_elsewhere():
            return live
        if time.monotonic() >= deadline:
            raise HomeStarting(
                f"a server holds this home ({lock.path}) but has not published server.json after {wait_s:g} s"
            )
        time.sleep(0.05)


def home_lock_path(server_json: Path) -> Path:
    return server_json.with_name("serve.lock")


def claim_home(server_json: Path) -> tuple[HomeLock | None, dict[str, Any] | None]:
    """(lock, None) when this process may serve the home, else (None, the live server's info or
    None while another `serve` is still starting). The caller holds the lock until it exits."""
    lock = HomeLock(home_lock_path(server_json))
    if not lock.try_acquire():
        return None, read_live_server(server_json)
    live = read_live_server(server_json)  # a live server that predates serve.lock still owns it
    if live is not None:
        lock.release()
        return None, live
    return lock, None
