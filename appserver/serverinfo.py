"""server.json: written while `serve` runs, so CLI processes on the same home find (and never race) it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from appserver.fsutil import atomic_write_json
from appserver.procid import identity, identity_alive


def write_server_json(path: Path, url: str, auth_mode: str, **extra: Any) -> dict[str, Any]:
    info = {"url": url, "pid": __import__("os").getpid(), "identity": identity(), "auth": auth_mode, "started_at": time.time(), **extra}
    atomic_write_json(path, info)
    return info


def read_live_server(path: Path) -> dict[str, Any] | None:
    """The server.json of a live server on this home, or None (a stale file from a dead one is ignored)."""
    try:
        info = json.loads(path.read_text("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(info, dict) or not identity_alive(str(info.get("identity") or "")):
        return None
    return info


def remove_server_json(path: Path) -> None:
    """Remove server.json only when it is ours (another server may have started since)."""
    try:
        info = json.loads(path.read_text("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return
    if info.get("identity") == identity():
        path.unlink(missing_ok=True)
