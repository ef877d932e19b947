"""Process identity: pid plus the process start time, so a reused pid is not mistaken for a live owner."""

from __future__ import annotations

import os
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def identity(pid: int | None = None) -> str:
    """`pid:starttime` of this (or another) process."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start_ticks(pid) or 0}"


def identity_alive(ident: str | None) -> bool:
    """True when the process named by `pid:starttime` still runs (same pid AND same start time)."""
    if not ident:
        return False
    try:
        pid_s, start_s = ident.split(":", 1)
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return False
    if not pid_alive(pid):
        return False
    current = process_start_ticks(pid)
    return current is None or start == 0 or current == start
