"""The run log `cron-runs/<task id>.jsonl`: one JSON object per line, append-only.

Events: `fired` (written when the occurrence is claimed, before the turn is submitted), `submitted`
(the turn id), `fire_failed`, `missed` (with its reason), `outcome` (the turn's end), `delivered`
and `delivery_failed` (where a `--deliver` reply went, or why it did not), `error`
(a visible task failure such as an invalid expression), `removed` (the task was removed; the record
keeps the task, so its log can still be found by name). A `fired` line that no later `submitted`,
`fire_failed`, `outcome` or `missed` line settles is a run not submitted yet: `queued` while the
scheduler that runs now has it in hand (a `run_all` catch-up's runs wait for their turn),
`unresolved` while its claim waits for the scheduler that takes the lease over, else `lost` (its
process died before submitting it: it is never fired again, at most once), so it is not silently
missing (`read_run_log`, `ClaimsInHand`).

The scheduler writes through `RunLog`, which never raises: a record the disk refuses (full, a
directory in the way) is logged loudly, kept in memory and retried (in order, per task) at the next
write or tick, so a run-log failure can never stop a claimed run from firing.

Retention: a log is kept under RUN_LOG_MAX_BYTES. The write that would pass it first drops the
oldest records of runs that ended (down to RUN_LOG_TRIM_TO_BYTES), writing the log anew (temporary
file, fsync, rename: a kill at any instant leaves the old log or the new one, whole). What recovery
and numbering read is never dropped: every record of a run no `outcome`, `fire_failed` or `missed`
record ended (a claim not yet submitted, a turn whose outcome is not recorded), the newest
`removed` record, the record naming the highest run number and the newest scheduled `fired` one
(`_trim_plan`). Every writer appends under the log's flock and writes to the file the path names
once it holds it (`_open_locked`), so a record is never appended to a log a trim just replaced.
The log of a removed task goes REMOVED_LOG_RETENTION_S after its removal (`prune_removed_logs`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appserver.fsutil import (
    MIB,
    StateFileRefused,
    atomic_write_bytes,
    ensure_private_dir,
    error_text,
    open_state_file,
    remove_stale_temporaries,
    state_file_stat,
)
from appserver.shown import shown

log = logging.getLogger("appserver.cron")

EVENTS = ("fired", "submitted", "fire_failed", "missed", "outcome", "delivered", "delivery_failed", "error", "removed")
TAIL_BYTES = 64 * 1024  # how much of a log's end the start-up and removed-task scans read
# How much of a log's end `cron logs` reads: a log written by an older version (never trimmed) may
# hold years of runs; its newest records are what is asked for, and memory must not grow with the
# file (or a link to /dev/zero). Scans for one record read the whole file a line at a time instead.
READ_MAX_BYTES = 16 * MIB
# The size a task's log is kept under. A run writes about 800 bytes (fired, submitted, outcome), so
# a trim (down to RUN_LOG_TRIM_TO_BYTES) keeps the last ~2,000 runs: 33 hours of a task run every
# minute, 80 days of an hourly one. A namespace's 100 tool-made tasks hold at most ~200 MiB, however
# long they run; a fraction of READ_MAX_BYTES, so `cron logs` always reads a trimmed log whole. The
# trim rewrites ~1.5 MiB once per ~650 runs, not at every write.
RUN_LOG_MAX_BYTES = 2 * MIB
RUN_LOG_TRIM_TO_BYTES = RUN_LOG_MAX_BYTES * 3 // 4
# The records that end a run: once one is written the run's records may be trimmed away.
ENDING_EVENTS = ("outcome", "fire_failed", "missed")
# How long a writer waits for another one's hold of a log (an append takes microseconds, a trim of
# an older version's huge log seconds) before its write fails (RunLog keeps the record to retry).
LOG_LOCK_WAIT_S = 30.0
# The log of a removed task is deleted this long after its removal (and its last write), as the
# gateway's settled ledger rows are: `cron logs` of a task removed a month ago finds nothing.
REMOVED_LOG_RETENTION_S = 30 * 86400.0
MAX_LINE_BYTES = 1 * MIB  # a longer "line" (a sparse file of zeros) is skipped, never held whole
# Records are kept small, so the scans that read a log's end see many of them: a string in a record
# (an error text, …) is cut to MAX_FIELD_CHARS, and the task a `removed` record keeps has its prompt
# cut to REMOVED_PROMPT_CHARS (it is there to find the log by name, not to restore the task). Logs
# written before that may hold longer records: the scans read backward a line at a time
# (`_records_from_end`), and of a line over MAX_LINE_BYTES use what its first HEAD_BYTES hold.
MAX_FIELD_CHARS = 4000
REMOVED_PROMPT_CHARS = 200
HEAD_BYTES = 64 * 1024
CHUNK_BYTES = 64 * 1024
# Records that may follow a task's `removed` one: the end of runs it had in flight
AFTER_REMOVAL = ("submitted", "fire_failed", "outcome", "delivered", "delivery_failed")
BACKLOG_MAX = 10_000  # records kept for a retry while the disk refuses them; the oldest go first
# The highest run number a task can have (crons.json refuses a counter above it: exact in every
# JSON reader). A record naming a higher one was not written by appserver (a hand edit, bit rot):
# like a run number that is no whole number (`1e999`), it names no run, and it never sets the floor
# of the next run's number, which would make the task unloadable.
MAX_RUN_NUMBER = 2**53
# The records that settle a claimed occurrence: it reached the kernel, or it was recorded as not run.
SETTLING_EVENTS = ("submitted", "fire_failed", "outcome", "missed")


def run_log_path(runs_dir: Path, task_id: str) -> Path:
    if not task_id or "/" in task_id or task_id.startswith("."):
        raise ValueError(f"bad task id {shown(task_id)}")
    return runs_dir / f"{task_id}.jsonl"


def run_record(task_id: str, event: str, **fields: Any) -> dict[str, Any]:
    """One run-log record, stamped now."""
    record: dict[str, Any] = {
        "event": event,
        "at": datetime.now(UTC).isoformat(),
        "task_id": task_id,
    }
    record.update({k: (v.isoformat() if isinstance(v, datetime) else _bounded(v)) for k, v in fields.items()})
    return record


def _bounded(value: Any, depth: int = 0) -> Any:
    """`value` with every string in it cut to MAX_FIELD_CHARS (lists to 100 items)."""
    if isinstance(value, str):
        return value if len(value) <= MAX_FIELD_CHARS else value[: MAX_FIELD_CHARS - 1] + "…"
    if depth < 4 and isinstance(value, dict):
        return {k: _bounded(v, depth + 1) for k, v in value.items()}
    if depth < 4 and isinstance(value, list):
        return [_bounded(v, depth + 1) for v in value[:100]]
    return value


def removed_task(task: dict[str, Any]) -> dict[str, Any]:
    """What a `removed` record keeps of a task (`CronTask.to_dict()`): all of it but a long prompt,
    which is cut to REMOVED_PROMPT_CHARS (`prompt_chars` says how long it was)."""
    prompt = task.get("prompt")
    if not isinstance(prompt, str) or len(prompt) <= REMOVED_PROMPT_CHARS:
        return task
    return {**task, "prompt": prompt[: REMOVED_PROMPT_CHARS - 1] + "…", "prompt_chars": len(prompt)}


def utf8_json(value: Any, **dumps: Any) -> bytes:
    """`value` as JSON in UTF-8, non-ASCII text kept as it is unless a lone surrogate (kept from a
    hand-written escape) makes that impossible: then everything is escaped, nothing lost."""
    try:
        return json.dumps(value, ensure_ascii=False, **dumps).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True, **dumps).encode("ascii")


def write_record(runs_dir: Path, record: dict[str, Any], *, max_bytes: int = RUN_LOG_MAX_BYTES) -> None:
    """Append one record with a single O_APPEND write under the log's flock, so concurrent writers
    never interleave; one that would take the log past `max_bytes` trims it first (`_trim`). A
    log whose last line was cut short (a full disk) gets a line break first: the torn line stays
    unreadable on its own instead of swallowing this record too."""
    line = utf8_json(record) + b"\n"
    ensure_private_dir(runs_dir)
    path = run_log_path(runs_dir, str(record["task_id"]))
    state_file_stat(path)  # a link to nothing (an unmounted disk) is refused, never created anew
    fd = _open_locked(path)
    try:
        size = os.fstat(fd).st_size
        if size + len(line) > max_bytes and _trim(fd, path, size, line, max_bytes):
            return
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) != len(line):
            raise OSError(f"short write to the run log of task {record['task_id']}")
    finally:
        os.close(fd)  # (releases the flock)


def _open_locked(path: Path) -> int:
    """The log open for appending, under its exclusive flock, and still the file `path` names: a
    writer that waited while another trimmed the log (renamed a new one into place) or deleted it
    opens the file there now, so no record goes into a file nobody reads again."""
    deadline = time.monotonic() + LOG_LOCK_WAIT_S
    while True:
        # non-blocking: a FIFO in the log's place must fail the write, not hang the scheduler
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StateFileRefused(path, "not a regular file: a run log must be one; replace it with the log")
            _flock(fd, path, deadline)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _flock(fd: int, path: Path, deadline: float) -> None:
    """Take the exclusive flock of an open log, waiting until `deadline` (monotonic) at most."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(
                    errno.EWOULDBLOCK, f"held by another process for over {LOG_LOCK_WAIT_S:g} s", str(path)
                ) from None
            time.sleep(0.005)


def _trim(fd: int, path: Path, size: int, line: bytes, max_bytes: int) -> bool:
    """Write the log anew (atomically) as what `_trim_plan` keeps of it followed by `line`, the
    caller holding its flock; False when nothing can go (`line` is then appended as usual) or the
    new log could not be written (said once: the log stays whole, the record is appended to it)."""
    keep = max(0, max_bytes * 3 // 4 - len(line))  # (RUN_LOG_TRIM_TO_BYTES for the default cap)
    plan = _trim_plan(fd, size, size - keep)
    if plan is None:
        return False
    cut, pinned = plan
    parts = [os.pread(fd, length, offset) for offset, length in pinned]
    parts = [p if p.endswith(b"\n") else p + b"\n" for p in parts]
    tail = os.pread(fd, size - cut, cut) if cut < size else b""
    data = b"".join(parts) + tail
    if data and not data.endswith(b"\n"):
        data += b"\n"
    try:
        atomic_write_bytes(path, data + line)
    except OSError as exc:
        log.warning(
            "cron: could not trim the run log %s (%s); the record is appended to it as it is", path, error_text(exc)
        )
        return False
    if len(data) + len(line) > max_bytes:
        log.warning(
            "cron: the run log %s holds %d bytes of runs not ended yet (or the records numbering needs): it "
            "stays above its %d-byte bound until they end",
            path,
            len(data) + len(line),
            max_bytes,
        )
    return True


def _trim_plan(fd: int, size: int, keep_from: int) -> tuple[int, list[tuple[int, int]]] | None:
    """What a trim keeps of a log of `size` bytes: (the offset from which on everything is kept: the
    first line at or after `keep_from` that is not one of the last records of a run begun before it,
    so no run is kept without its start; the (offset, length) of the lines before it that are kept
    too), or None when every line before that offset must be kept. Kept: each record of a run that
    no ENDING_EVENTS record ended (it may be claimed and not submitted, or submitted with its
    outcome not recorded: recovery resolves it by these records), the newest `removed` record (how
    `cron logs NAME` finds a removed task), the newest record naming the highest run number and the
    newest scheduled `fired` record (`used_runs`: a restored older crons.json neither reuses a run
    number nor runs an occurrence again). Read a line at a time (an older version's log may be far
    larger than memory should hold)."""
    open_runs: dict[int, list[tuple[int, int]]] = {}
    marks: dict[str, tuple[int, int]] = {}
    highest = -1
    begun: deque[int] = deque(maxlen=64)  # the runs of the last records before `keep_from`
    cut: int | None = None
    cut_found = False
    offset = 0
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        while offset < size:
            start = offset
            line = f.readline(min(MAX_LINE_BYTES, size - offset))
            if not line:
                break
            offset += len(line)
            rec: dict[str, Any] | None = None
            if not line.endswith(b"\n") and len(line) == MAX_LINE_BYTES:  # no record: skipped whole
                while offset < size and line and not line.endswith(b"\n"):
                    line = f.readline(min(MAX_LINE_BYTES, size - offset))
                    offset += len(line)
            else:
                rec = _trim_record(line)
            n = None if rec is None else _number(rec)
            if start < keep_from:
                if n is not None:
                    begun.append(n)
            elif not cut_found:
                if n is not None and n in begun:  # the end of a run begun before: goes with it if it ended
                    cut = offset
                else:
                    cut, cut_found = start, True
            if rec is None:
                continue
            span, event = (start, len(line)), rec.get("event")
            if event == "removed":
                marks["removed"] = span
            if n is None:
                continue
            if event in ENDING_EVENTS:
                open_runs.pop(n, None)
            elif event in ("fired", "submitted") or n in open_runs:
                open_runs.setdefault(n, []).append(span)
            if n >= highest:
                highest, marks["highest"] = n, span
            if event == "fired" and not rec.get("manual") and not rec.get("recovered"):
                marks["scheduled"] = span
    if cut is None or not cut_found:  # (every line from `keep_from` on ends a run begun before)
        cut = size
    pinned = sorted({s for spans in open_runs.values() for s in spans} | set(marks.values()))
    pinned = [s for s in pinned if s[0] < cut]
    if sum(length for _, length in pinned) >= cut:
        return None
    return cut, pinned


def _trim_record(line: bytes) -> dict[str, Any] | None:
    """The record of a line as far as a trim needs it (its event text, its run number read by
    `_number`), else None; quicker than `is_record` (an older version's log may be huge)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("event"), str) else None


def append_run(runs_dir: Path, task_id: str, event: str, **fields: Any) -> dict[str, Any]:
    """Append one record now; raises when the disk refuses it (see `RunLog` for a writer that
    never raises)."""
    record = run_record(task_id, event, **fields)
    write_record(runs_dir, record)
    return record


class RunLog:
    """The run logs of one home, written without ever raising: a record that cannot be written
    is logged as an error and kept for a retry (at the next write or `flush`), in order per task,
    so neither a full disk nor one broken log file stops claimed runs from firing."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = runs_dir
        self._backlog: list[dict[str, Any]] = []
        self._error: str | None = None
        self._mutex = threading.Lock()  # the scheduler writes from the loop and from worker threads
        self.max_bytes = RUN_LOG_MAX_BYTES  # each log's bound (`write_record`)
        # A command that ends right after its run (`cron run` in-process) cannot retry: it reports
        # what was not written once, at its end (`unwritten`), instead of a line per record
        self.retries = True

    def record(self, task_id: str, event: str, **fields: Any) -> dict[str, Any]:
        """Append a record, or keep it for a retry when that fails (logged loudly)."""
        record = run_record(task_id, event, **fields)
        with self._mutex:
            if any(r["task_id"] == task_id for r in self._backlog):
                self._flush_locked()  # older records of this task go first
            if any(r["task_id"] == task_id for r in self._backlog):
                self._keep(record, None)
                return record
            try:
                write_record(self.runs_dir, record, max_bytes=self.max_bytes)
            except (OSError, ValueError) as exc:
                self._keep(record, exc)
        return record

    def flush(self) -> int:
        """Retry the records kept after a failure; how many are still waiting."""
        with self._mutex:
            self._flush_locked()
            return len(self._backlog)

    def close(self) -> None:
        """At stop: a last try, then every record the disk still refuses goes whole into the
        server's log, so a run that fired is never without a trace (the next server cannot know)."""
        with self._mutex:
            self._flush_locked()
            for record in self._backlog:
                log.error(
                    "cron: stopping with a run-log record never written (%s): %s",
                    self._error,
                    json.dumps(record, ensure_ascii=False),
                )
            self._backlog = []

    def unwritten(self) -> tuple[int, str | None]:
        """After a last try: how many records the disk still refuses, and why (for a command that
        ends now; the records are then given up)."""
        with self._mutex:
            self._flush_locked()
            count, self._backlog = len(self._backlog), []
            return count, self._error if count else None

    def problem(self) -> str | None:
        """One line while records are waiting for the disk, else None."""
        with self._mutex:
            if not self._backlog:
                return None
            return (
                f"{len(self._backlog)} run-log record(s) could not be written to {self.runs_dir} "
                f"({self._error}); retrying at every tick"
            )

    def _keep(self, record: dict[str, Any], exc: Exception | None) -> None:
        if exc is not None:
            self._error = f"{type(exc).__name__}: {exc}"
        if exc is not None and self.retries:
            log.error(
                "cron: could not write the %s record of task %s to its run log (%s); keeping it to retry",
                record["event"],
                record["task_id"],
                self._error,
            )
        self._backlog.append(record)
        if len(self._backlog) > BACKLOG_MAX:
            dropped = self._backlog.pop(0)
            log.error(
                "cron: run-log backlog full; dropped a %s record of task %s", dropped["event"], dropped["task_id"]
            )

    def _flush_locked(self) -> None:
        waiting, self._backlog = self._backlog, []
        failed: set[str] = set()
        for record in waiting:
            task_id = str(record["task_id"])
            if task_id not in failed:
                try:
                    write_record(self.runs_dir, record, max_bytes=self.max_bytes)
                    continue
                except (OSError, ValueError) as exc:
                    self._error = f"{type(exc).__name__}: {exc}"
                    failed.add(task_id)
            self._backlog.append(record)
        if waiting and not self._backlog:
            log.warning("cron: the run-log records kept after a write failure are written now")
            self._error = None


@dataclass(frozen=True, slots=True)
class RunLogRead:
    """What could be read of one run log: its records (oldest first) and the numbers of the lines
    that are no record (a write cut short by a crash, a hand edit, garbage), which are skipped
    rather than hiding the rest of the history, and reported by the reader."""

    path: Path
    records: list[dict[str, Any]]
    unreadable: list[int]  # 1-based line numbers (of the part read, when `skipped` > 0)
    skipped: int = 0  # bytes at the start of a log too large to read whole, not read

    @property
    def unusable(self) -> bool:
        """Lines were there, but none of them could be read: the history is unknown, not empty."""
        return not self.records and bool(self.unreadable)

    def problem(self) -> str | None:
        """One line about the unreadable lines, else None."""
        if not self.unreadable:
            return None
        shown = ", ".join(str(n) for n in self.unreadable[:5]) + (", …" if len(self.unreadable) > 5 else "")
        if self.skipped:
            shown += f" of its last {READ_MAX_BYTES // MIB} MiB"
        if self.unusable:
            return (
                f"the run log {self.path} cannot be read: none of its {len(self.unreadable)} line(s) "
                f"is a run-log record (line {shown}); fix or delete the file"
            )
        return (
            f"{self.path}: skipped {len(self.unreadable)} unreadable line(s) of the run log (line {shown}): "
            "cut short, or no run-log record (a hand edit, damage)"
        )


@dataclass(frozen=True, slots=True)
class ClaimsInHand:
    """What the tasks (crons.json), read just before the run log, say of a task's claimed runs, so
    a reader tells a run still to be submitted from one lost: a `run_all` catch-up claims all its
    runs at once and submits them one after another, so several runs may wait at once."""

    live: str | None  # the lease token of the scheduler running now (None: none runs)
    open: dict[int, str | None]  # run number -> the lease token holding its claim, of claims not done
    counter: int | None  # the task's run counter then (None: unknown, a removed task)

    def state(self, number: int, by: Any) -> str | None:
        """What became of claimed run `number` (its `fired` record's `by`) that no record settles:
        `queued` (the running scheduler has it in hand: it waits for the run before it, or is being
        submitted), `unresolved` (claimed by a scheduler that stopped: the one that takes the lease
        over resolves it), `lost` (nobody will submit it), or None (claimed after the tasks were
        read: not known yet)."""
        if self.counter is not None and number > self.counter:
            return None
        holder = self.open.get(number, by) if number in self.open else by
        if self.live is not None and holder == self.live:
            return "queued"
        if number in self.open and isinstance(holder, str):
            return "unresolved"
        return "lost"


def read_run_log(
    runs_dir: Path, task_id: str, *, limit: int | None = None, claims: ClaimsInHand | None = None
) -> RunLogRead:
    """The records of a task's run log, oldest first (the last `limit` of them), with the lines
    that could not be read; a missing log has neither. Logs nothing: the caller reports. Of a log
    over READ_MAX_BYTES only the end is read (`skipped` says how much was not). A log that is no
    regular file or a link to nothing raises StateFileRefused: an unknown history, never "no runs".
    A claimed run no record settles is marked by what `claims` says of it (`queued`, `unresolved`,
    `lost`); without `claims`, every such run but the newest is marked `lost`."""
    path = run_log_path(runs_dir, task_id)
    try:
        f = open_state_file(path)
    except FileNotFoundError:
        return RunLogRead(path, [], [])
    with f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - READ_MAX_BYTES)
        f.seek(start)
        raw = f.read(READ_MAX_BYTES)
    if start:
        if b"\n" not in raw:  # no line ends in the part read: nothing there is a record
            return RunLogRead(path, [], [1], start)
        raw = raw.partition(b"\n")[2]  # the first line is cut
    out, bad = _parse_lines(raw)
    _mark_lost(out, claims)
    return RunLogRead(path, out[-limit:] if limit else out, bad, start)


def read_runs(runs_dir: Path, task_id: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Records oldest first (the last `limit` of them). Unreadable lines are skipped with one
    warning for the whole log (`read_run_log` tells the caller about them instead)."""
    found = read_run_log(runs_dir, task_id, limit=limit)
    problem = found.problem()
    if problem is not None:
        log.warning("cron: %s", problem)
    return found.records


def _parse_lines(raw: bytes) -> tuple[list[dict[str, Any]], list[int]]:
    """(the records, the numbers of the non-blank lines that are no record: not a JSON object, or
    one whose fields are not what a record holds, `is_record`)."""
    out: list[dict[str, Any]] = []
    bad: list[int] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            bad.append(n)
            continue
        if is_record(rec):
            out.append(rec)
        else:  # valid JSON, but no record (`42`, `{"event": 1}`): as unreadable as torn JSON
            bad.append(n)
    return out, bad


# The fields a reader of the run log uses, and what each must be when it is there (null is none):
# text, flags, the list of a delivery's message ids, the task a `removed` record keeps.
_TEXT_FIELDS = ("at", "task_id", "scheduled_for", "turn_id", "status", "target", "reason", "error", "by")
_FLAG_FIELDS = ("manual", "catch_up", "recovered")


def is_record(rec: Any) -> bool:
    """Is this parsed line a run-log record? A JSON object with `event` text, a run number (when it
    has one) that is a whole number a run can have (0 to MAX_RUN_NUMBER: never `1e999`, `1.5`, `"x"`
    or `true`), and the other fields a reader uses of their type: what appserver writes. Anything
    else (a hand edit, damage, another program's line) is skipped as unreadable and reported by
    the reader, never shown as a run or counted as one."""
    if not isinstance(rec, dict):
        return False
    event = rec.get("event")
    if not isinstance(event, str) or not event.strip():
        return False
    if rec.get("occurrence") is not None and _number(rec) is None:
        return False
    if any(rec.get(k) is not None and not isinstance(rec[k], str) for k in _TEXT_FIELDS):
        return False
    if any(rec.get(k) is not None and not isinstance(rec[k], bool) for k in _FLAG_FIELDS):
        return False
    if rec.get("remote_ids") is not None and not isinstance(rec["remote_ids"], list):
        return False
    task = rec.get("task")
    return task is None or isinstance(task, dict)


def _tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The whole records in the last `max_bytes` of a log (a cut first line is dropped). A log that
    is no regular file (a FIFO would block the scheduler) or a link to nothing is logged as an
    error and read as empty, as an unreadable one always was: the scheduler goes on."""
    try:
        with open_state_file(path) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            raw = f.read(max_bytes)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.error("cron: cannot read the run log: %s", exc)
        return []
    if size > max_bytes:
        raw = raw.partition(b"\n")[2]
    return _parse_lines(raw)[0]


def unrecorded_turns(runs_dir: Path, before: datetime) -> list[tuple[str, int, str]]:
    """(task id, occurrence, turn id) of every turn submitted before `before` whose outcome was
    never logged: the process that fired it died (or stopped) before the turn ended. Only the tail
    of each log is read: an outcome still missing is recent."""
    if not runs_dir.is_dir():
        return []
    found: list[tuple[str, int, str]] = []
    for path in sorted(runs_dir.glob("*.jsonl")):
        records = _tail(path)
        ended = {_number(r) for r in records if r.get("event") == "outcome"}  # a hand-edited list: no crash
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


def open_runs(runs_dir: Path, task_id: str) -> list[tuple[int, str]]:
    """(run number, turn id) of each run of `task_id` submitted whose outcome is not logged yet,
    oldest first: the runs `cron remove`/`disable` wait to see dropped (or started) before they
    say done. Only the tail of the log is read, as `unrecorded_turns` reads it."""
    records = _tail(run_log_path(runs_dir, task_id))
    ended = {_number(r) for r in records if r.get("event") == "outcome"}
    found: list[tuple[int, str]] = []
    for r in records:
        n, turn_id = _number(r), r.get("turn_id")
        if r.get("event") == "submitted" and n is not None and isinstance(turn_id, str) and n not in ended:
            found.append((n, turn_id))
    return found


def _at(record: dict[str, Any]) -> datetime:
    try:
        return datetime.fromisoformat(str(record.get("at")))
    except ValueError:
        return datetime.max.replace(tzinfo=UTC)  # undated: not known to be from before


def find_removed(runs_dir: Path, ref: str) -> list[dict[str, Any]]:
    """The tasks (as kept by their `removed` record) whose id or name is `ref`, newest removal
    last. A removed task's log stays in cron-runs/<task id>.jsonl for REMOVED_LOG_RETENTION_S
    (`prune_removed_logs`)."""
    if not runs_dir.is_dir():
        return []
    try:
        by_id = [run_log_path(runs_dir, ref)]
    except ValueError:
        by_id = []
    paths = [p for p in by_id if p.exists()] or sorted(runs_dir.glob("*.jsonl"))
    found: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        removed = _removal(path)
        task = removed.get("task") if removed is not None else None
        at = str(removed.get("at", "")) if removed is not None else ""
        if path.stem == ref:
            found.append((at, task if isinstance(task, dict) else {"id": ref}))
        elif isinstance(task, dict) and task.get("name") == ref:
            found.append((at, task))
    return [task for _, task in sorted(found, key=lambda x: x[0])]


def prune_removed_logs(
    runs_dir: Path, live: set[str], now: datetime, *, max_age_s: float = REMOVED_LOG_RETENTION_S
) -> list[Path]:
    """Delete the logs of removed tasks whose removal (their newest `removed` record) and last
    write are both more than `max_age_s` before `now`, and the temporaries of trims that were killed
    (`remove_stale_temporaries`). A log whose id a task in `live` (the ids crons.json holds) has is
    kept, as is one with no `removed` record (its tasks file was lost: the log is the history, and
    the floor of the run numbers if an older copy is restored). Deleted under the log's flock, so a
    record appended meanwhile (a removed task's run ending late) keeps it. Returns what went."""
    if not runs_dir.is_dir():
        return []
    cutoff = now.timestamp() - max_age_s
    gone: list[Path] = []
    try:
        entries = list(os.scandir(runs_dir))
    except OSError as exc:
        log.warning("cron: cannot list the run logs in %s: %s", runs_dir, error_text(exc))
        return gone
    trimmed = {e.name[1:].split(".jsonl.")[0] for e in entries if e.name.startswith(".") and ".jsonl." in e.name}
    for name in sorted(trimmed):
        try:
            remove_stale_temporaries(run_log_path(runs_dir, name))
        except ValueError:
            continue
    for entry in sorted(entries, key=lambda e: e.name):
        if not entry.name.endswith(".jsonl") or entry.name.startswith(".") or entry.name[:-6] in live:
            continue
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_mtime > cutoff:
            continue
        removed = _removal(path)
        at = aware_time(removed.get("at")) if removed is not None else None
        if at is None or at.timestamp() > cutoff:
            continue
        try:
            if _delete_unchanged(path, st):
                gone.append(path)
        except OSError as exc:
            log.warning("cron: could not delete the run log %s of a removed task: %s", path, error_text(exc))
    if gone:
        log.info(
            "cron: deleted the run logs of %d task(s) removed more than %g days ago: %s",
            len(gone),
            max_age_s / 86400,
            ", ".join(p.name for p in gone),
        )
    return gone


def _delete_unchanged(path: Path, seen: os.stat_result) -> bool:
    """Unlink `path` under its flock if it is still the file `seen` describes, unwritten since."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        _flock(fd, path, time.monotonic() + LOG_LOCK_WAIT_S)
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (
            seen.st_dev,
            seen.st_ino,
            seen.st_size,
            seen.st_mtime_ns,
        ):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _removal(path: Path) -> dict[str, Any] | None:
    """The newest `removed` record of a log, else None. Found however long it is (an older one
    keeps the whole prompt): the log is read backward, the whole of its last TAIL_BYTES and beyond
    that only past records that may follow a removal (the end of runs in flight), so a log of a
    task that was not removed costs about what its end holds."""
    for back, r in _records_from_end(path, max_bytes=READ_MAX_BYTES):
        event = r.get("event")
        if event == "removed":
            return r
        if back > TAIL_BYTES and event not in AFTER_REMOVAL:
            return None
    return None


def _records_from_end(path: Path, *, max_bytes: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """A log's records newest first, each as (bytes from its line's start to the end of the log,
    record), read backward CHUNK_BYTES at a time: memory stays bounded whatever the log's size or
    its lines' length. A line longer than MAX_LINE_BYTES yields the fields its first HEAD_BYTES
    hold (`_head_record`, marked `partial`); a line that is no record is skipped. With `max_bytes`
    it stops once that much of the end was read. A log that cannot be read yields nothing (logged,
    as `_tail` does)."""
    try:
        f = open_state_file(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.error("cron: cannot read the run log: %s", exc)
        return
    with f:
        try:
            size = pos = f.seek(0, os.SEEK_END)
            pending, long = b"", False  # the end of the line being put together, which starts before pos
            while pos > 0:
                if max_bytes is not None and size - pos >= max_bytes:
                    return
                start = max(0, pos - CHUNK_BYTES)
                f.seek(start)
                data = f.read(pos - start)
                pos = start
                end = len(data)
                while True:
                    i = data.rfind(b"\n", 0, end) if end else -1
                    if i < 0:
                        if not long:
                            pending = data[:end] + pending
                            if len(pending) > MAX_LINE_BYTES:
                                pending, long = b"", True
                        break
                    record = _line_record(f, None if long else data[i + 1 : end] + pending, start + i + 1)
                    if record is not None:
                        yield size - (start + i + 1), record
                    end, pending, long = i, b"", False
            record = _line_record(f, None if long else pending, 0)
            if record is not None:
                yield size, record
        except OSError as exc:
            log.error("cron: cannot read the run log %s: %s", path, exc)


def _line_record(f: Any, line: bytes | None, start: int) -> dict[str, Any] | None:
    """The record of one line, or (`line` None: too long to hold) of its head at offset `start`."""
    if line is None:
        f.seek(start)
        head = _head_record(f.read(HEAD_BYTES))
        return None if head is None else {**head, "partial": True}
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _head_record(head: bytes) -> dict[str, Any] | None:
    """The leading fields of a record cut short (the start of a line too long to read whole): every
    key whose value is complete, and the complete leading fields of a nested object that is cut
    (an older `removed` record's task: id, name, agent and schedule come before its prompt)."""
    found = _partial_object(head.decode("utf-8", "ignore"), 0)[0]
    return found if isinstance(found, dict) and found else None


def _partial_object(text: str, pos: int) -> tuple[dict[str, Any] | None, bool]:
    """(the fields of the JSON object at `pos` that are complete, whether the object is)."""
    pos = _skip_ws(text, pos)
    if not text.startswith("{", pos):
        return None, False
    out: dict[str, Any] = {}
    pos = _skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        return out, True
    while True:
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return out, False
        pos = _skip_ws(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            return out, False
        pos = _skip_ws(text, pos + 1)
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            inner, _ = _partial_object(text, pos) if text.startswith("{", pos) else (None, False)
            if inner:
                out[key] = inner
            return out, False
        out[key] = value
        pos = _skip_ws(text, pos)
        if text.startswith("}", pos):
            return out, True
        if not text.startswith(",", pos):
            return out, False
        pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    found = _WS.match(text, pos)
    return pos if found is None else found.end()


def _mark_lost(records: list[dict[str, Any]], claims: ClaimsInHand | None = None) -> None:
    """Flag the `fired` records no record settles (submitted, failed to submit, ended: a run of a
    removed or disabled task cancelled before its turn, or recorded as missed) by what `claims`
    says became of each; without it, and for a run now (which no scheduler claimed), each but the
    newest (which may still be in flight) as lost."""
    settled = {_number(r) for r in records if r.get("event") in SETTLING_EVENTS} - {None}
    # a `fired` record whose run number is no whole number (`1e999`, "x": a hand edit, damage) is
    # skipped by the reader (`is_record`); one read otherwise names no run, so no run is lost by it
    fired = [r for r in records if r.get("event") == "fired" and _number(r) is not None]
    for i, r in enumerate(fired):
        number = _number(r)
        if number is None or number in settled:
            continue
        if claims is None or not isinstance(r.get("by"), str):  # (a run now: no scheduler claimed it)
            state = "lost" if i < len(fired) - 1 else None
        else:
            state = claims.state(number, r.get("by"))
        if state is not None:
            r[state] = True


def _number(record: dict[str, Any]) -> int | None:
    """A record's occurrence number; None when it holds none or something else (a hand-edited
    `[1]` or `{}` must not make a set lookup raise and hide the whole log), or a whole number no run
    can have (below 0, above MAX_RUN_NUMBER)."""
    n = record.get("occurrence")
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_RUN_NUMBER:
        return n
    return None


def _unusable_number(record: dict[str, Any]) -> bool:
    """The record holds a run number, but one that names no run (`1e999`, 2**60, -1, "x")."""
    return "occurrence" in record and record["occurrence"] is not None and _number(record) is None


def settled_record(runs_dir: Path, task_id: str, occurrence: int) -> dict[str, Any] | None:
    """The record saying what became of claimed `occurrence` (its `submitted` turn, a failed
    submit, an outcome, or a `missed` verdict), or None when the log has none: the durable answer
    to "did this claim reach the kernel?", which no purge window limits. The log is read backward
    to the occurrence's `fired` record (the records settling it come after it), the whole log
    when it has none; a long record on the way (an older log's) hides nothing."""
    for _, r in _records_from_end(run_log_path(runs_dir, task_id)):
        if r.get("event") in SETTLING_EVENTS and r.get("occurrence") == occurrence:
            return r
        if _fired(r, occurrence):
            return None
    return None


def outcome_record(runs_dir: Path, task_id: str, occurrence: int) -> dict[str, Any] | None:
    """The `outcome` record of run `occurrence`, or None when the log has none (read backward as
    `settled_record` is, to the run's `fired` record)."""
    return _run_record(runs_dir, task_id, occurrence, ("outcome",))


def delivery_record(runs_dir: Path, task_id: str, occurrence: int) -> dict[str, Any] | None:
    """The record of where the reply of run `occurrence` went (`delivered`, or `delivery_failed`
    with the reason), or None when the log has none. Read backward as `settled_record` is (the
    records of a run follow its `fired` one), so its cost is what the log holds since that run,
    never the whole log."""
    return _run_record(runs_dir, task_id, occurrence, ("delivered", "delivery_failed"))


def _run_record(runs_dir: Path, task_id: str, occurrence: int, events: tuple[str, ...]) -> dict[str, Any] | None:
    """The newest record of run `occurrence` that is one of `events`, read backward to the run's
    `fired` record (the whole log when it has none); None when there is none."""
    for _, r in _records_from_end(run_log_path(runs_dir, task_id)):
        if r.get("event") in events and _number(r) == occurrence:
            return r
        if _fired(r, occurrence):
            return None
    return None


def _scan(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of a whole log, one line at a time (memory bounded by MAX_LINE_BYTES, whatever
    the file's size); nothing when it cannot be read (as `_tail` says why)."""
    try:
        f = open_state_file(path)
    except OSError:
        return
    with f:
        while True:
            try:
                line = f.readline(MAX_LINE_BYTES)
            except OSError as exc:
                log.error("cron: cannot read the run log %s: %s", path, exc)
                return
            if not line:
                return
            if not line.endswith(b"\n") and len(line) == MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # too long to be a record: skip to its end
                    line = f.readline(MAX_LINE_BYTES)
                continue
            records, _ = _parse_lines(line)
            yield from records


def has_fired(runs_dir: Path, task_id: str, occurrence: int) -> bool:
    """Whether the log already holds the `fired` record of `occurrence` (a claim the scheduler
    logged before it died): a recovered run then adds no second one."""
    path = run_log_path(runs_dir, task_id)
    records = _tail(path)
    if any(_fired(r, occurrence) for r in records):
        return True
    return any(_fired(r, occurrence) for r in _scan(path))


def _fired(record: dict[str, Any], occurrence: int) -> bool:
    return record.get("event") == "fired" and _number(record) == occurrence


def _settling(records: list[dict[str, Any]], occurrence: int) -> dict[str, Any] | None:
    found = [r for r in records if r.get("event") in SETTLING_EVENTS and r.get("occurrence") == occurrence]
    return found[-1] if found else None


def highest_occurrence(runs_dir: Path, task_id: str) -> int:
    """The highest run number the log's tail names (0 for none): a run counter in crons.json below
    it was rolled back (an older copy restored), and numbering must go on above it, or a new run
    would take an earlier run's number and with it that run's idempotency key and its records."""
    return used_runs(runs_dir, task_id)[0]


def used_runs(runs_dir: Path, task_id: str) -> tuple[int, datetime | None]:
    """(the highest run number the log's end names, the scheduled time of the newest scheduled run
    it claimed): what a rolled-back crons.json (an older copy restored) must not repeat, neither a
    run number nor an occurrence that already ran. The newest claim, not the latest time: after the
    clock was corrected backward, runs claimed while it was ahead name times still to come, and the
    newer ones claimed since say how far the schedule really got. Read backward: the last
    TAIL_BYTES, and on (up to READ_MAX_BYTES) until a scheduled run's `fired` record is found, so
    long records at the end (an older log's) cannot hide it."""
    best = 0
    latest: datetime | None = None
    path = run_log_path(runs_dir, task_id)
    skipped: list[Any] = []
    for back, r in _records_from_end(path, max_bytes=READ_MAX_BYTES):
        n = _number(r)
        if n is not None and n > best:
            best = n
        elif n is None and _unusable_number(r):
            skipped.append(r["occurrence"])
        if latest is None and r.get("event") == "fired" and not r.get("manual") and not r.get("recovered"):
            latest = aware_time(r.get("scheduled_for"))
        if back >= TAIL_BYTES and latest is not None:
            break
    if skipped:
        shown = ", ".join(_shown(v) for v in skipped[:3]) + (", …" if len(skipped) > 3 else "")
        log.warning(
            "cron: %s: skipped %d record(s) whose run number names no run (%s: not a whole number from 0 to "
            "%d; a hand edit or damage): the numbers of the next runs do not follow it",
            path,
            len(skipped),
            shown,
            MAX_RUN_NUMBER,
        )
    return best, latest


def _shown(value: Any) -> str:
    text = json.dumps(value, allow_nan=True, default=str)
    return text if len(text) <= 40 else text[:39] + "…"


def aware_time(value: Any) -> datetime | None:
    """An ISO time with its zone, as records and task state hold them; None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def unsettled_claims(runs_dir: Path, task_id: str, exclude_by: str) -> list[dict[str, Any]]:
    """The `fired` records of scheduled runs claimed by a scheduler lease other than `exclude_by`
    (the caller's own) that no record settles: what a scheduler that died mid-tick had claimed but
    not submitted (a `run_all` catch-up claims several at once), oldest first. Records written
    before claims named their scheduler (no `by`) are not listed: `last_claimed` covers those.
    Read backward (a settling record follows its claim): the last TAIL_BYTES, and on (up to
    READ_MAX_BYTES) until a settled claim, before which the claims were settled too, so long
    records at the end (an older log's) cannot push a claim out of sight."""
    settled: set[int] = set()
    found: dict[int, dict[str, Any]] = {}
    for back, r in _records_from_end(run_log_path(runs_dir, task_id), max_bytes=READ_MAX_BYTES):
        n, by, event = _number(r), r.get("by"), r.get("event")
        if n is None:
            continue
        if event in SETTLING_EVENTS:
            settled.add(n)
        elif event == "fired":
            if isinstance(by, str) and by != exclude_by and n not in settled and not r.get("manual"):
                found[n] = r  # read backward: the oldest record of a number is kept
            if back > TAIL_BYTES and n in settled:
                break
    return [found[n] for n in sorted(found)]
