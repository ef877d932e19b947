"""server.json: written while `serve` runs, so CLI processes on the same home find (and never race) it.

`serve.lock` beside it is held (flock) by the one process that runs turns on the home: `serve`, for
its whole life, or an in-process `appserver run` (no server running) for its turn. The operating
system drops the lock when that process dies, even on `kill -9`, so checking the lock and
server.json's process identity (pid + start time; a reused pid is dead) together means two
processes never run turns on one home, and a standby (`serve --standby`) knows when to take over.
While held, the lock file names its holder (command, pid, identity), so a refusal can say who.

server.json also records the store the server uses (`store`: its URL without the password), so
CLI commands on the home act on that store, not on the one config.toml names (cli/common.py).

It names its home too (`home_id`: the directory's device and inode), because a home copied while
its server runs (`cp -a home home-copy`) carries the original's server.json, naming a live process
whose URL answers: read in the copy, it describes no server of the copy (the copy's commands went
to the original's server and store, and `serve` on the copy was refused). A home reached through a
symlink, a bind mount or after `mv` is the same directory, so it still matches.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from appserver.fsutil import (
    SERVER_JSON_MAX_BYTES,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_json,
    read_state_bytes,
)
from appserver.procid import identity, identity_alive
from appserver.readiness import CheckResult
from appserver.store.url import redact_url

log = logging.getLogger("appserver.serverinfo")


def write_server_json(path: Path, url: str, auth_mode: str, **extra: Any) -> dict[str, Any]:
    info = {
        "url": url,
        "pid": os.getpid(),
        "identity": identity(),
        "auth": auth_mode,
        "started_at": time.time(),
        "home_id": home_id(path.parent),
        **extra,
    }
    atomic_write_json(path, info)
    return info


def home_id(home: Path) -> dict[str, int]:
    """The home directory's identity (device, inode): the same through a symlink or after `mv`,
    another for a copy. A dict, not a tuple, so it reads back from JSON equal to what was written
    (ServerJsonKeeper compares the two)."""
    st = os.stat(home)
    return {"dev": st.st_dev, "ino": st.st_ino}


def _of_this_home(info: dict[str, Any], path: Path) -> bool:
    """Whether server.json `info`, read at `path`, was written for the home it lies in, not copied
    from another (a copy carries the original's file). One from before `home_id` is judged by the
    `home` path it names (resolved); one naming neither is taken as this home's, as before."""
    try:
        here = os.stat(path.parent)
        recorded = info.get("home_id")
        if isinstance(recorded, dict):
            return (recorded.get("dev"), recorded.get("ino")) == (here.st_dev, here.st_ino)
        named = info.get("home")
        if not isinstance(named, str) or not named:
            return True
        return os.path.samestat(os.stat(named), here)
    except (OSError, ValueError):  # the named home is gone (or no path): not this one
        return False


def store_record(url: str) -> dict[str, Any]:
    """What server.json says about the server's store: its URL without a password (`url`; empty:
    the SQLite file of the home), and whether that is the whole URL (`complete`: nothing was
    withheld, so a CLI command may connect with it)."""
    shown = redact_url(url.strip())
    return {"url": shown, "complete": shown == url.strip()}


def read_live_server(path: Path) -> dict[str, Any] | None:
    """The server.json of a live server on this home, or None (a stale file from a dead one, or one
    copied with the home from another, is ignored).
    One too large to be a server's is damaged, so ignored as garbage is (`serve` replaces it); one that
    is no regular file or a link to nothing raises StateFileRefused: a FIFO would block every command
    forever, and a file on an unmounted disk may name a live server."""
    info = _named_alive(path)
    if info is None or HomeLock(home_lock_path(path)).held_elsewhere():
        return info
    return _answering(info)


def _named_alive(path: Path) -> dict[str, Any] | None:
    """server.json when the process it names (pid and start time) is alive."""
    try:
        info = json.loads(read_state_bytes(path, SERVER_JSON_MAX_BYTES).decode("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    except StateFileTooLarge as exc:
        log.warning("ignoring a damaged server.json: %s", exc)
        return None
    if not isinstance(info, dict) or not identity_alive(str(info.get("identity") or "")):
        return None
    if not _of_this_home(info, path):
        log.info("ignoring a server.json copied from another home (%s): it names no server here", info.get("home"))
        return None
    return info


def _answering(info: dict[str, Any]) -> dict[str, Any] | None:
    """`info` of a process that holds no `serve.lock`: a live server that predates the lock answers at
    its URL; when nothing does, the file is stale and its process another one that got the dead
    server's pid and start time (a reboot, pid 1 in a container)."""
    if _answers(info.get("url")):
        return info
    log.info("ignoring a stale server.json: nobody holds the home and %s does not answer", info.get("url"))
    return None


def _predating_lock(path: Path) -> dict[str, Any] | None:
    """With the home's lock held here: a live server of the home that predates `serve.lock`."""
    info = _named_alive(path)
    return None if info is None else _answering(info)


PROBE_CONNECT_S = 1.0


def _answers(url: object) -> bool:
    """Whether something accepts a connection at the server's URL (a live server that predates
    `serve.lock` does, and holds no lock)."""
    try:
        parts = urlsplit(str(url))
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    if not host:
        return False
    try:
        socket.create_connection((host, port), timeout=PROBE_CONNECT_S).close()
    except OSError:
        return False
    return True


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


SERVER_JSON_CHECK_S = 2.0  # how often `serve` looks whether its server.json is still as it wrote it


class ServerJsonKeeper:
    """`serve`'s server.json, kept as written for the server's life: deleted, damaged or changed by
    hand while the server runs, it is rewritten (atomically, logged as a warning) at the next
    `check`, so CLI commands on this home keep finding the server. A check is one stat while the
    file is as written (the signature of our own write: every atomic write makes a new inode)."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self._written = self._signature()
        self.problem: str | None = None  # why it could not be rewritten (for /readyz), else None

    def readiness(self) -> CheckResult | None:
        """For /readyz `state_files`: a warning while server.json cannot be rewritten."""
        return None if self.problem is None else CheckResult("warn", self.problem)

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def check(self) -> bool:
        """Rewrite server.json when it is no longer what this server wrote; True when it did."""
        now = self._signature()
        if now is not None and now == self._written:
            return False
        why = self._why_not_ours()
        if why is None:  # the same content (touched, or copied back): ours
            self._written, self.problem = now, None
            return False
        try:
            atomic_write_json(self.path, self.info)
        except OSError as exc:  # a full disk, a directory in its place, a link to nothing
            problem = (
                f"{self.path} {why} and cannot be rewritten ({exc}): `appserver run`, `chat` and `cron run` "
                "on this home cannot find this server"
            )
            if problem != self.problem:
                log.error("%s", problem)
            self.problem = problem
            return False
        self._written, self.problem = self._signature(), None
        log.warning("%s %s while the server runs; rewritten (it serves on %s)", self.path, why, self.info.get("url"))
        return True

    def _why_not_ours(self) -> str | None:
        try:
            raw = read_state_bytes(self.path, SERVER_JSON_MAX_BYTES)
        except FileNotFoundError:
            return "was deleted"
        except StateFileTooLarge as exc:
            return f"is damaged ({exc.reason})"
        except OSError as exc:  # StateFileRefused too: a FIFO, a directory, a link to nothing
            return f"cannot be read ({exc})"
        try:
            info = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return "is damaged (not the JSON this server wrote)"
        return None if info == self.info else "was changed"


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

    def try_acquire(self, patience_s: float = PROBE_PATIENCE_S, holder: str | None = None) -> bool:
        """Take the lock; False when another process holds it. Retries for `patience_s`, so a CLI
        process probing the lock for a moment (`held_elsewhere`) never turns a server away.
        `holder` (the command, e.g. "appserver run") is written into the file while it is held."""
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
        if holder is not None:
            _write_holder(fd, holder)
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
            with contextlib.suppress(OSError):  # still held: the next holder never finds our name
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


HOLDER_MAX_BYTES = 4096
IN_PROCESS_RUN = "appserver run"  # the holder an in-process `appserver run` writes


def _write_holder(fd: int, command: str) -> None:
    """Name this process in the lock file it holds (best effort: a lock file that is no regular
    file, or a full disk, only makes refusals less specific)."""
    data = json.dumps({"command": command, "pid": os.getpid(), "identity": identity(), "since": time.time()})
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data.encode(), 0)


def lock_holder(lock_path: Path) -> dict[str, Any] | None:
    """The live process the lock file names as its holder (`command`, `pid`), or None: none named
    (an older appserver, `store copy`), or the one named is gone."""
    try:
        info = json.loads(read_state_bytes(lock_path, HOLDER_MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # missing, no regular file, too large, not JSON
        return None
    if not isinstance(info, dict) or not identity_alive(str(info.get("identity") or "")):
        return None
    return info


def holder_text(holder: dict[str, Any]) -> str:
    """`appserver run` (pid 123), for messages."""
    return f"`{holder.get('command')}` (pid {holder.get('pid')})"


class HomeStarting(Exception):
    """A server holds this home but has not published server.json yet."""


class HomeBusy(HomeStarting):
    """An in-process `appserver run` holds this home (runs a turn without a server)."""


def busy_text(server_json: Path, holder: dict[str, Any]) -> str:
    """Why this home is busy without a server: an in-process run holds it."""
    return (
        f"{holder_text(holder)} is running a turn in-process on this home ({server_json.parent}), without a "
        "server: wait for it to end (or stop it)"
    )


STARTING_QUIET_S = 1.0  # a wait for a starting server up to this long is not worth a word (`on_starting`)

OnStarting = Callable[[dict[str, Any] | None], None]


def find_live_server(
    server_json: Path, wait_s: float = 20.0, on_starting: OnStarting | None = None
) -> dict[str, Any] | None:
    """The live server of this home, waiting while one is still starting (it holds `serve.lock`
    but has not written server.json), so a CLI command never runs turns beside it. None: no server.
    `on_starting(holder)` is told once when that wait lasts longer than STARTING_QUIET_S (`holder`:
    the starting process as `lock_holder` names it, or None), so that the command can say why it
    is silent."""
    lock = HomeLock(home_lock_path(server_json))
    start = time.monotonic()
    told = False
    while True:
        live = read_live_server(server_json)
        if live is not None or not lock.held_elsewhere():
            return live
        holder = lock_holder(lock.path)
        if holder is not None and holder.get("command") == IN_PROCESS_RUN:
            raise HomeBusy(busy_text(server_json, holder))  # it may run for minutes: say so now
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise HomeStarting(_not_published(server_json, lock.path, wait_s))
        if on_starting is not None and not told and waited >= STARTING_QUIET_S:
            told = True
            on_starting(holder)
        time.sleep(0.05)


def _not_published(server_json: Path, lock: Path, wait_s: float) -> str:
    """Why no server could be found though one holds the home, as far as this process can tell."""
    try:
        raw: bytes | None = read_state_bytes(server_json, SERVER_JSON_MAX_BYTES)
    except FileNotFoundError:
        raw = None
    except OSError as exc:  # StateFileRefused too
        return (
            f"a server holds this home ({lock}) but its {server_json} cannot be read ({exc}); "
            "remove what is in its place: the server writes it again within seconds"
        )
    if raw is None:
        state = "is missing"
    else:
        try:
            info = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            info = None
        if not isinstance(info, dict):
            state = "is damaged"
        elif not _of_this_home(info, server_json):
            state = "is a copy of another home's"
        else:
            state = "names a process that is gone"
    return (
        f"a server holds this home ({lock}) but {server_json} {state} after {wait_s:g} s: a server that "
        f"started within that time is still starting; a running one rewrites the file within "
        f"{SERVER_JSON_CHECK_S:g} s (one that does not is an older appserver or is stuck: restart it)"
    )


def home_lock_path(server_json: Path) -> Path:
    return server_json.with_name("serve.lock")


def upgrade_refusal(server_json: Path) -> str | None:
    """Why this process may not bring the home's SQLite store to a newer schema now, or None.
    Another process using the home says no: a live server (an older version still running after
    the user upgraded), or another holder of `serve.lock` (an in-process run). The home's owner
    (this `serve`, or this in-process run) may; so may any command on a home nobody holds."""
    me = identity()
    live = read_live_server(server_json)
    if live is not None and live.get("identity") != me:
        return f"the server running on this home ({live.get('url')}, pid {live.get('pid')}) uses it"
    holder = lock_holder(home_lock_path(server_json))
    if holder is not None and holder.get("identity") != me:
        return f"{holder_text(holder)} holds this home"
    return None


def serves_home(server_json: Path) -> bool:
    """Whether this process is the home's `serve` (it holds `serve.lock`, not as an in-process
    run): a shared PostgreSQL store's schema may be upgraded under live servers of other homes only
    by a server starting (a rolling upgrade), never by a command. A lock held without a name (its
    file could not be written, or an older appserver starting) may be this process's: taken as
    serving unless a live server.json names another process."""
    lock = home_lock_path(server_json)
    holder = lock_holder(lock)
    if holder is None:
        return HomeLock(lock).held_elsewhere() and read_live_server(server_json) is None
    return holder.get("identity") == identity() and holder.get("command") != IN_PROCESS_RUN


def claim_home(server_json: Path, holder: str | None = None) -> tuple[HomeLock | None, dict[str, Any] | None]:
    """(lock, None) when this process may serve the home, else (None, the live server's info or
    None while another `serve` is still starting or an in-process run holds it: `lock_holder`).
    The caller holds the lock until it exits; `holder` names it in the lock file."""
    lock = HomeLock(home_lock_path(server_json))
    if not lock.try_acquire(holder=holder):
        return None, read_live_server(server_json)
    live = _predating_lock(server_json)  # a live server that predates serve.lock still owns it
    if live is not None:
        lock.release()
        return None, live
    return lock, None


def claim_for_turns(
    server_json: Path,
    busy_wait_s: float,
    on_busy: Callable[[dict[str, Any]], None],
    start_wait_s: float = 20.0,
    on_starting: OnStarting | None = None,
) -> tuple[dict[str, Any] | None, HomeLock | None]:
    """For a command that runs turns in-process when no server runs (`appserver run`): (the live
    server's info, None) to go through it, or (None, the home's lock, held) to run here as `serve`
    would (so a `serve` started meanwhile is refused, and a second in-process run waits). Waits while
    another in-process run holds the home (up to `busy_wait_s`; `on_busy` is told once), or a server
    starts (up to `start_wait_s`; `on_starting` is told once, as `find_live_server` tells it); then
    HomeBusy / HomeStarting."""
    lock = HomeLock(home_lock_path(server_json))
    start = time.monotonic()
    told = told_starting = False
    while True:
        live = read_live_server(server_json)
        if live is not None:
            return live, None
        if lock.try_acquire(holder=IN_PROCESS_RUN):
            live = _predating_lock(server_json)  # a live server that predates serve.lock still owns it
            if live is None:
                return None, lock
            lock.release()
            return live, None
        holder = lock_holder(lock.path)
        waited = time.monotonic() - start
        if holder is not None and holder.get("command") == IN_PROCESS_RUN:
            if waited >= busy_wait_s:
                raise HomeBusy(f"{busy_text(server_json, holder)}; waited {busy_wait_s:g} s")
            if not told:
                told = True
                on_busy(holder)
        elif waited >= start_wait_s:
            raise HomeStarting(_not_published(server_json, lock.path, start_wait_s))
        elif on_starting is not None and not told_starting and waited >= STARTING_QUIET_S:
            told_starting = True
            on_starting(holder)
        time.sleep(0.05)
