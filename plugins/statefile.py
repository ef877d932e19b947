"""A plugin's own state files (`AdapterContext.data_dir`), and user plugins' manifests: written
atomically, and a damaged one moved aside, never read as empty and then overwritten.

Plugins import only `plugins.*` (tests/test_import_rules.py), so this is the plugin side's copy of
appserver/fsutil.py's `atomic_write_bytes` and `move_aside`, with the same name on disk for a file set
aside (`<name>.corrupt-<UTC timestamp>`).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def move_aside(path: Path, label: str = "corrupt") -> Path:
    """Rename a file that cannot be read to `<name>.<label>-<UTC timestamp>` (never over an
    existing file) and return the new path; its content is kept, never emptied (the gateway's
    database is set aside the same way, and the write-ahead files a gone ledger left, `orphaned`)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved_to = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while os.path.lexists(moved_to):
        moved_to = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
        n += 1
    os.replace(path, moved_to)
    return moved_to


def atomic_write_text(path: Path, text: str, mode: int = 0o600) -> None:
    """Replace `path` with `text` whole: a temporary file beside it, fsynced, renamed over it, the
    directory fsynced. A crash leaves the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
