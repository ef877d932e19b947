"""Atomic state files: write to a temp file, fsync, rename; move unreadable files aside loudly."""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("appserver.fs")


class CorruptStateFile(Exception):
    """A state file could not be parsed; it was moved aside to `moved_to`."""

    def __init__(self, path: Path, moved_to: Path, reason: str) -> None:
        super().__init__(f"{path} could not be read ({reason}); moved aside to {moved_to}")
        self.path = path
        self.moved_to = moved_to
        self.reason = reason


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.errno is not None:
            # name the file the caller writes, not the temporary (a new random name at every try,
            # which would make a lasting problem look like a new one each time it is logged)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse directory fsync)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_text(path: Path, text: str, mode: int = 0o600) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, value: Any, mode: int = 0o600, *, indent: int | None = 2) -> None:
    """`indent=None` for a file written often by a machine: the indenting encoder is pure Python
    and leaves cyclic garbage (its nested closures) at every call; the compact one is C."""
    atomic_write_text(path, json.dumps(value, indent=indent, sort_keys=False) + "\n", mode)


def move_aside(path: Path, reason: str, *, quiet: bool = False) -> CorruptStateFile:
    """Rename an unreadable state file to `<name>.corrupt-<timestamp>` and return the error to raise
    (logged unless `quiet`: the caller reports it in its own words)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    err = CorruptStateFile(path, target, reason)
    if not quiet:
        log.error("%s", err)
    return err


def read_json_or_move_aside(path: Path) -> Any | None:
    """Parse a JSON state file. Missing → None. Unparseable → moved aside, CorruptStateFile raised."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise move_aside(path, f"invalid JSON: {exc}") from None


# Names appserver keeps in its home (top level); `tighten_home` leaves anything else alone.
HOME_ENTRIES = (
    "config.toml*",
    "appserver.db*",
    ".appserver.db*",
    "server.json",
    "serve.lock",
    "crons.json*",
    ".crons.json*",
    "auth",
    "cron-runs",
    "channels",
    "workspaces",
)
_RECURSE = ("auth", "cron-runs", "channels")  # workspaces: the directory is closed, its files are the agent's


def _tighten(path: Path, changed: list[Path]) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)
        changed.append(path)


def tighten_home(home: Path) -> list[Path]:
    """Remove group/other access from the home and appserver's files in it (umask 077 keeps new
    ones private; this fixes what an older version or a copy left open). Returns what changed."""
    changed: list[Path] = []
    try:
        st = os.stat(home)
    except FileNotFoundError:
        return changed
    if st.st_mode & stat.S_ISVTX or st.st_uid != os.geteuid():
        log.warning("%s is shared (sticky or owned by another user): its permissions are left alone", home)
        return changed
    _tighten(home, changed)
    for pattern in HOME_ENTRIES:
        for entry in home.glob(pattern):
            _tighten(entry, changed)
            if entry.name in _RECURSE and entry.is_dir() and not entry.is_symlink():
                for root, dirs, files in os.walk(entry):
                    for name in (*dirs, *files):
                        _tighten(Path(root) / name, changed)
            elif entry.name == "workspaces" and entry.is_dir() and not entry.is_symlink():
                for agent_dir in entry.iterdir():
                    _tighten(agent_dir, changed)
    return changed


def set_aside_files(home: Path) -> list[Path]:
    """State files moved aside as unreadable (`<name>.corrupt-*`) that are still in the home:
    reported at every start and by /readyz until the operator restores or deletes them."""
    if not home.is_dir():
        return []
    found = [*home.glob("*.corrupt-*"), *home.glob("auth/*.corrupt-*"), *home.glob("channels/*.corrupt-*")]
    return sorted(found)


def set_aside_notice(home: Path, path: Path) -> str:
    """What to tell the operator about a state file that was moved aside as unreadable."""
    original = path.name.split(".corrupt-", 1)[0]
    rel = path.relative_to(home)
    return (
        f"{rel} was set aside as unreadable ({original} lost what it held): repair it and move it back "
        f"over {original}, or delete it once nothing in it is needed"
    )
