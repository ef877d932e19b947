"""The run log `cron-runs/<task id>.jsonl`: one JSON object per line, append-only.

Events: `fired` (written when the occurrence is claimed, before the turn is submitted), `submitted`
(the turn id), `fire_failed`, `missed` (with its reason), `outcome` (the turn's end), `error`
(a visible task failure such as an invalid expression), `removed` (the task was removed; the record
keeps the task, so its log can still be found by name). A `fired` line without a later `submitted`
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

EVENTS = ("fired", "submitted", "fire_failed", "missed", "outcome", "error", "removed")
TAIL_BYTES = 64 * 1024  # how much of a log's end the start-up and removed-task scans read


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
    out = _parse(raw, path)
    _mark_lost(out)
    return out[-limit:] if limit else out


def _parse(raw: bytes, path: Path, *, quiet: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if not quiet:
                log.warning("%s:%d: skipping unreadable run-log line", path, n)
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The whole records in the last `max_bytes` of a log (a cut first line is dropped)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            raw = f.read()
    except OSError:
        return []
    if size > max_bytes:
        raw = raw.partition(b"\n")[2]
    return _parse(raw, path, quiet=True)


def unrecorded_turns(runs_dir: Path, before: datetime) -> list[tuple[str, int, str]]:
    """(task id, occurrence, turn id) of every turn submitted before `before` whose outcome was
    never logged: the process that fired it died (or stopped) before the turn ended. Only the tail
    of each log is read: an outcome still missing is recent."""
    if not runs_dir.is_dir():
        return []
    found: list[tuple[str, int, str]] = []
    for path in sorted(runs_dir.glob("*.jsonl")):
        records = _tail(path)
        ended = {r.get("occurrence") for r in records if r.get("event") == "outcome"}
        for r in records:
            n, turn_id = r.get("occurrence"), r.get("turn_id")
            if (
                r.get("event") == "submitted"
                and isinstance(n, int)
                and isinstance(turn_id, str)
                and n not in ended
                and _at(r) < before
            ):
                found.append((path.stem, n, turn_id))
    return found


def _at(record: dict[str, Any]) -> datetime:
    try:
        return datetime.fromisoformat(str(record.get("at")))
    except ValueError:
        return datetime.max.replace(tzinfo=UTC)  # undated: not known to be from before


def find_removed(runs_dir: Path, ref: str) -> list[dict[str, Any]]:
    """The tasks (as kept by their `removed` record) whose id or name is `ref`, newest removal
    last. A removed task's log stays in cron-runs/<task id>.jsonl."""
    if not runs_dir.is_dir():
        return []
    try:
        by_id = [run_log_path(runs_dir, ref)]
    except ValueError:
        by_id = []
    paths = [p for p in by_id if p.exists()] or sorted(runs_dir.glob("*.jsonl"))
    found: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        removed = [r for r in _tail(path) if r.get("event") == "removed"]
        task = removed[-1].get("task") if removed else None
        if path.stem == ref:
            found.append(
                (
                    str(removed[-1].get("at", "")) if removed else "",
                    task if isinstance(task, dict) else {"id": ref},
                )
            )
        elif isinstance(task, dict) and task.get("name") == ref:
            found.append((str(removed[-1].get("at", "")), task))
    return [task for _, task in sorted(found, key=lambda x: x[0])]


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
