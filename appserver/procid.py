"""Process identity: pid plus the process start time, so a reused pid is not mistaken for a live owner."""

from __future__ import annotations

import os


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of `pid` from /proc/<pid>/stat (fields 3 and
    22), or None when the process is gone or /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else st[1]


def pid_alive(pid: int) -> bool:
    """True when `pid` runs (a zombie does not: it holds no lease and runs no turn)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    st = proc_stat(pid)
    return not (st is not None and st[0] in ("Z", "X"))


def identity(pid: int | None = None) -> str:
    """`pid:starttime` of this (or another) process."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start_ticks(pid) or 0}"


def identity_alive(ident: str | None) -> bool:
    """True when the process named by `pid:starttime` still runs (same pid AND same start time).

    A server of a PostgreSQL cluster stamps its turns with its instance id (`inst_…`), which names
    no process of this host: only the cluster can say whether that server lives
    (`Cluster.owner_alive`). Asked here, it is taken as alive, so that nothing is ever settled,
    taken or killed as a dead process's because of a name this function cannot judge."""
    if not ident:
        return False
    if ident.startswith("inst_"):
        return True
    try:
        pid_s, start_s = ident.split(":", 1)
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return False
    if not pid_alive(pid):
        return False
    current = process_start_ticks(pid)
    return current is None or start == 0 or current == start
