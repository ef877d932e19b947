"""The run log `cron-runs/<task id>.jsonl`: one JSON object per line, append-only.

Events: `fired` (written when the occurrence is claimed, before the turn is submitted), `submitted`
(the turn id), `fire_failed`, `missed` (with its reason), `outcome` (the turn's end), `error`
(a visible task failure such as an invalid expression). A `fired` line without a later `submitted`
or `fire_failed` line is an occurrence claimed by a process that died before submitting it: it is
never fired again (at most once), and the reader marks it `lost` so it is not silently missing.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appserver.fsutil import ensure_private_dir

log = logging.getLogger("appserver.cron")

EVENTS = ("fired", "submitted", "fire_failed", "missed", "outcome", "error")


def run_log_path(runs_dir: Path, task_id: str) -> Path:
    if not task_id or "/" in task_id or task_id.startswith("."):
        raise ValueError(f"bad task id {task_id!r}")
    return runs_dir / f"{task_id}.jsonl"


def append_run(runs_dir: Path, task_id: str, event: str, **fields: Any) -> dict[str, Any]:
    """Append one record with a single O_APPEND write, so concurrent writers never interleave."""
    record: dict[str, Any] = {
        "event": event,
        "at": datetime.now(UTC).isoformat(),
        "task_id": task_id,
    }
    record.update({k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in fields.items()})
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    ensure_private_dir(runs_dir)
    fd = os.open(run_log_path(runs_dir, task_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def read_runs(runs_dir: Path, task_id: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Records oldest first (the last `limit` of them). Unparseable lines — e.g. a write cut short
    by a crash — are skipped with a warning rather than hiding the rest of the history."""
    path = run_log_path(runs_dir, task_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("%s:%d: skipping unreadable run-log line", path, n)
            continue
        if isinstance(rec, dict):
            out.append(rec)
    _mark_lost(out)
    return out[-limit:] if limit else out


def _mark_lost(records: list[dict[str, Any]]) -> None:
    """Flag `fired` records whose submission never got recorded, except the newest per task
    (which may still be in flight)."""
    settled = {
        r.get("occurrence")
        for r in records
        if r.get("event") in ("submitted", "fire_failed") and r.get("occurrence") is not None
    }
    fired = [r for r in records if r.get("event") == "fired"]
    for r in fired[:-1]:
        if r.get("occurrence") not in settled:
            r["lost"] = True
