"""Atomic state files: write to a temp file, fsync, rename; move unreadable files aside loudly."""

from __future__ import annotations

import json
import logging
import os
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
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_text(path: Path, text: str, mode: int = 0o600) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, value: Any, mode: int = 0o600) -> None:
    atomic_write_text(path, json.dumps(value, indent=2, sort_keys=False) + "\n", mode)


def move_aside(path: Path, reason: str) -> CorruptStateFile:
    """Rename an unreadable state file to `<name>.corrupt-<timestamp>` and return the error to raise."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    err = CorruptStateFile(path, target, reason)
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
