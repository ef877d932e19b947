"""`$APPSERVER_HOME/crons.json`: the cron tasks and the scheduler lease, one file, one lock.

Every read-modify-write happens under `crons.json.lock` (a `filelock` with a timeout, so a stuck
process produces an error instead of a hang) and every write is atomic (temp file, fsync, rename),
so ten concurrent `appserver cron add` processes produce ten tasks and a valid file. The threads of
one process take the lock one at a time before the file lock (the timeout is another process's
doing, never this one's own), and the scheduler's steps that end together are saved at once
(`CronStore.combined`).

A file that cannot be understood is moved aside to `crons.json.corrupt-<timestamp>` by the first
*writer* that finds it (a command that changes tasks, or the scheduler), and `CorruptStateFile` is
raised: the command that found it fails loudly and writes nothing. Readers (`cron list`, `show`,
`logs`, `preview`) never move files: they raise `CronFileUnreadable` and leave the file for the user
to fix. After a writer moved it, the *next* command starts from an empty file — a user who was just
told "your file was moved aside to X" expects `cron add` to work again — while the moved file is
never touched, and `corrupt_files()` lets every CLI command keep warning about it until the user
restores or deletes it. Refusing all writes until the user acts was rejected: a forgotten corrupt
file would silently stop every scheduled job, which is the failure this package exists to prevent.
Valid JSON of the wrong shape (`null`, a list, a number, a task that is no object or has no string
id) is as unusable as torn JSON and is set aside the same way, never read as "no tasks". A second
task with an id already used is kept as invalid (the first stays in use). An
unusable `scheduler_owner` is not: the lease record is the scheduler's, so it is read as no owner
(with an error in the log) and a scheduler takes the lease over, with every task kept.

One task that can be named (it has a string id) but not used (a field of the wrong type, a
non-finite or absurd number, a time that is no ISO time, a missing or unknown field) does not take
the others down: it is kept in the file exactly as loaded (`CronFile.invalid`), skipped by the
scheduler, reported loudly until someone fixes it, and can be found (`CronTaskInvalid` names it to
the caller: `cron show` shows it, `cron remove` removes it) like any other task.

What is never moved aside: a crons.json that is no regular file (a FIFO would block every reader,
a device never ends; moving either is not ours to do) or a symbolic link to nothing (its disk not
mounted: the tasks are there, just not reachable). Readers and writers both refuse it with
CronStoreError naming the file, and nothing is written. A link to an existing file is written
through (the rename happens beside the target), so the tasks stay where the link says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import operator
import os
import re
import secrets
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast
from weakref import WeakValueDictionary

import filelock

from appserver.fsutil import (
    CRONS_MAX_BYTES,
    MIB,
    CorruptStateFile,
    StateFileRefused,
    StateFileTooLarge,
    atomic_write_bytes,
    ensure_private_dir,
    move_aside,
    read_state_bytes,
    state_file_stat,
)
from appserver.shown import shown
from cron.runlog import MAX_RUN_NUMBER, RunLog, append_run, removed_task, settled_record, utf8_json
from cron.schedule import MAX_DURATION_S, ScheduleError, ScheduleSpec, due_time, next_occurrence, validate_new

log = logging.getLogger("appserver.cron")

FORMAT_VERSION = 1
CRONS_FILE = "crons.json"
RUNS_DIR = "cron-runs"
DEFAULT_LOCK_TIMEOUT_S = 10.0
DEFAULT_MAX_LATENESS_S = 300.0  # 5 ticks: a restart or a slow tick is not a misfire
MISFIRE_POLICIES = ("skip", "run_once", "run_all")
# Matched with `fullmatch`: `re.match` lets `$` match before a trailing newline ("nightly\n").
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TARGET_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # it names the task's run-log file
MAX_OCCURRENCE = MAX_RUN_NUMBER  # a run counter beyond this was not written by a scheduler
# Longer JSON integers are not int()'d: Python refuses more than 4300 digits both ways (reading, and
# writing the number back), with a ValueError that would fail the whole file. Any value a field
# accepts has at most 19 (proc_start < 2**63); a longer one is kept as it is, up to this.
MAX_JSON_INT_DIGITS = 4000
_MISSING = object()  # crons.json does not exist (as opposed to holding `null`)
# The longest prompt a task may have, in UTF-8 bytes: a quarter of the default WebSocket frame
# limit ([limits] ws_frame_max_bytes, 4 MiB), so a prompt fits whole in any frame that carries it
# (its JSON escapes included), and some sixty of the largest fit in crons.json.
MAX_PROMPT_BYTES = MIB
# A task's last error is kept this short (the run log has the whole text): what the scheduler's
# bookkeeping may add to a task is bounded, so the room it keeps below the read limit is enough.
MAX_ERROR_CHARS = 400
# How a task's last error begins when an occurrence of it was missed (its misfire policy, its
# credential): a one-shot whose only run was missed shows the state `missed`, and a later good run
# of a recurring task clears it.
MISSED_PREFIX = "missed "
# crons.json is read with a limit (CRONS_MAX_BYTES); a file over it is unusable and set aside, and
# every task stops. A user's add or change is therefore refused (nothing written) when the file it
# would make leaves less than this room below that limit: the scheduler's own writes (claims, run
# counters, errors, the lease) never grow a task by more than BOOKKEEPING_TASK_BYTES, nor the rest by
# more than BOOKKEEPING_FIXED_BYTES, so they always fit. No write at all may pass the read limit.
BOOKKEEPING_FIXED_BYTES = 64 * 1024
BOOKKEEPING_TASK_BYTES = 2560
# How far a claimed run got, kept with the claim (`last_claimed["progress"]`, and for the earlier
# claims still open, `last_claimed["open"]`) in the shared tasks document, so every scheduler of the
# home or the cluster sees it, whichever run log recorded it: claimed (nothing yet), submitted (the
# turn reached the kernel), settled (its outcome is recorded; its reply is still to be delivered),
# delivering (a server is sending the reply), done (nothing more to do). A step is taken under the
# store lock only by the one process that moves the claim past it (`CronStore.advance`): an outcome
# is recorded, and a reply sent, once, by whoever gets there first.
PROGRESS_STAGES = ("claimed", "submitted", "settled", "delivering", "done")
_STAGE_RANK = {stage: rank for rank, stage in enumerate(PROGRESS_STAGES)}
# The earlier claims of a task kept while they are open (not done), newest first: a take-over
# resolves them, and a recovering server finds how far they got. A claim pushed out (more than this
# many of one task open at once) is resolved as before this was kept (by the run log and the key).
# A `run_all` catch-up claims up to its cap (cron.scheduler.RUN_ALL_CAP, 10) in one tick, submitted
# one after another, and a run before them may still be open: all are kept.
OPEN_CLAIMS_KEPT = 12
# `last_claimed["followed_from"]`: the lowest run number from which on the tasks follow every run
# until it is done. A run at or above it, below the last claim and no longer among the claims, was
# dropped because it is done (only a run pushed out by OPEN_CLAIMS_KEPT leaves the claims undone,
# and the mark moves above it then): `advance_claim` answers "taken" for it, never "not followed",
# so a second process following it (a restarted server's recovery, a take-over) neither records
# its outcome nor sends its reply again.
FOLLOWED_FROM = "followed_from"
_OPEN_KEYS = ("occurrence", "scheduled_for", "due_at", "fired_at", "manual", "catch_up", "by", "progress")
# The namespace of tasks the `schedule` tool makes in a conversation no credential owns (local,
# admin, CLI, cron conversations): the tool sees and cancels these, never the operator's CLI tasks
# (namespace None) of the same agent.
UNOWNED_TOOL_NAMESPACE = "schedule-tool:unowned"
# The outcome error of a claimed run that never started because its task was removed or disabled
# first: whoever stops it says the same (the scheduler holding it, or `remove`/`disable` itself).
NOT_STARTED_REMOVED = "not started: the task was removed before this run began"
NOT_STARTED_DISABLED = "not started: the task was disabled before this run began"
# `pairing revoke` records each sender it revoked (`CronFile.revoked`, the file's "revoked" list:
# channel, account, the SHA-256 of the sender's id, when), under the store lock, in the write that
# disables the sender's tasks (`CronStore.revoke_sender`); `add` refuses, under the same lock, a task
# whose origin sender was revoked after the turn asking for it began (`SenderRevoked`): a turn
# already running when the revoke was made (a slow model step) schedules nothing for the sender
# after it, while one of a sender approved again later does. Kept for REVOCATIONS_KEPT_S (no turn
# runs that long), at most REVOCATIONS_MAX of them, newest kept: a few dozen KB at most, whatever
# the ids. A turn accepted up to REVOKE_CLOCK_MARGIN_S after a revoke's time counts as begun before
# it: the two times come from different clocks (the CLI's host, the server's, a cluster's database).
REVOCATIONS_KEPT_S = 24 * 3600.0
REVOCATIONS_MAX = 128
REVOKE_CLOCK_MARGIN_S = 2.0

__all__ = [
    "CorruptStateFile",
    "CronFile",
    "CronFileUnreadable",
    "CronLockTimeout",
    "CronNotFound",
    "CronRefused",
    "CronStore",
    "CronStoreError",
    "CronTask",
    "CronTaskInvalid",
    "CronTasksTooLarge",
    "InvalidTask",
    "MISSED_PREFIX",
    "Occurrence",
    "OwnerRecord",
    "NOT_STARTED_DISABLED",
    "Revocation",
    "SenderRevoked",
    "NOT_STARTED_REMOVED",
    "UNOWNED_TOOL_NAMESPACE",
    "make_task",
]


class CronStoreError(Exception):
    """crons.json cannot be used as asked; the message is one line a user can act on."""


class CronLockTimeout(CronStoreError):
    """Another process held crons.json.lock for longer than the timeout."""


class CronNotFound(CronStoreError):
    """No task matches the given id or name."""


class CronTaskInvalid(CronStoreError):
    """The task asked for is kept in crons.json but cannot be used (`entry` says why): it can be
    shown and removed, not run, enabled or changed."""

    def __init__(self, message: str, entry: InvalidTask) -> None:
        super().__init__(message)
        self.entry = entry


class CronRefused(CronStoreError):
    """What was asked is refused as such (a name in use, a cap of the `schedule` tool reached):
    the asker's to change; the message names nothing of the server (no path, no other owner's
    tasks), so it may be shown to whoever asked."""


class CronFileUnreadable(CronStoreError):
    """A reader found crons.json unparseable; unlike a writer it leaves the file where it is."""


class CronTasksTooLarge(CronStoreError):
    """A write would make crons.json too large to be read back (or, for a user's add or change,
    leave too little room for the scheduler's bookkeeping); nothing was written."""


class SenderRevoked(CronRefused):
    """`add` refused a task whose origin sender was revoked (`pairing revoke`) after the turn that
    asked for it began: nothing was written."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def _iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.astimezone(UTC).isoformat()


def _dt(value: Any, key: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key} must be an ISO time string")
    try:  # the parser's own message does not say which field held the text
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{key} must be an ISO time string, got {value[:40]!r}") from None
    if dt.tzinfo is None:
        raise ValueError(f"{key} must carry a UTC offset")
    return dt


# ---------------------------------------------------------------- model


@dataclass(slots=True)
class OwnerRecord:
    """Who holds the scheduler lease: see cron/lease.py for how it is judged alive."""

    pid: int
    token: str
    started_at: datetime
    proc_start: int | None  # /proc/<pid>/stat field 22 (clock ticks since boot), None off Linux
    host: str
    # The server's instance id when the tasks live in a cluster's database (cron/pgstore.py): then
    # the owner is judged by its instance row, on any host.
    instance: str | None = None
    # The holder's heartbeat: when it last renewed the lease, and how long the lease lasts without
    # a renewal. A holder on another host cannot be checked by pid; its lease expires instead.
    renewed_at: datetime | None = None
    ttl_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": self.pid,
            "token": self.token,
            "started_at": _iso(self.started_at),
            "proc_start": self.proc_start,
            "host": self.host,
        }
        if self.instance:
            out["instance"] = self.instance
        if self.renewed_at is not None:
            out["renewed_at"] = _iso(self.renewed_at)
        if self.ttl_s is not None:
            out["ttl_s"] = self.ttl_s
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OwnerRecord:
        started = _dt(d.get("started_at"), "scheduler_owner.started_at")
        pid, token = d.get("pid"), d.get("token")
        if pid is None or not isinstance(token, str) or started is None:
            raise ValueError("scheduler_owner needs pid, token and started_at")
        # os.kill overflows beyond 2**31: the lease would stick (an over-long number is read as inf)
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
            raise ValueError(f"scheduler_owner.pid must be a process id, got {pid!r}"[:120])
        ps = d.get("proc_start")
        ps = ps if isinstance(ps, int) and not isinstance(ps, bool) and 0 <= ps < 2**63 else None
        inst = d.get("instance")
        ttl = d.get("ttl_s")
        if ttl is not None and not _finite_in(ttl, 0.001, MAX_DURATION_S):
            raise ValueError("scheduler_owner.ttl_s must be a positive number of seconds")
        return cls(
            pid,
            token,
            started,
            ps,
            str(d.get("host", "")),
            inst if isinstance(inst, str) and inst else None,
            _dt(d.get("renewed_at"), "scheduler_owner.renewed_at"),
            None if ttl is None else float(ttl),
        )


def short_error(message: str) -> str:
    """`message` on one line of at most MAX_ERROR_CHARS characters."""
    text = "".join(" " if _unfit_char(c) else c for c in message[: MAX_ERROR_CHARS * 2])
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _finite_in(value: Any, low: float, high: float) -> bool:
    """A JSON number (not a bool), finite, within [low, high]."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def check_lateness(value: Any) -> float:
    """A max lateness in seconds: finite, 0 … 100 years (ScheduleError otherwise)."""
    if not _finite_in(value, 0, MAX_DURATION_S):
        raise ScheduleError(f"max lateness must be a number of seconds from 0 to {MAX_DURATION_S}, got {shown(value)}")
    return float(value)


@dataclass(slots=True)
class CronTask:
    """One scheduled task. `next_fire_at` is the nominal time of the next occurrence (what the
    envelope calls "Scheduled for"); `next_due_at` is when the scheduler fires it (with jitter)."""

    id: str
    name: str
    agent: str
    schedule: ScheduleSpec
    prompt: str
    created_at: datetime
    conversation: str = "new"  # new | default | <conversation id>
    misfire: str = "skip"  # skip | run_once | run_all
    max_lateness_s: float = DEFAULT_MAX_LATENESS_S
    exact: bool = False
    # The channel target (channel:account:chat[:thread]) a run's final reply is sent to through
    # the gateway (cron.runner.deliver_reply); the run log records `delivered` or `delivery_failed`.
    deliver: str | None = None
    enabled: bool = True
    next_fire_at: datetime | None = None
    next_due_at: datetime | None = None
    last_claimed: dict[str, Any] | None = None  # {occurrence, scheduled_for, claimed_at, manual}
    occurrence: int = 0  # runs claimed so far (scheduled and manual); the envelope's number
    last_error: str | None = None
    last_error_at: datetime | None = None
    updated_at: datetime | None = None
    # When it was last disabled (`cron disable`, `pairing revoke`): a run asked by hand since then
    # still runs (`drops_run`). None: enabled, or disabled by a version that did not record it.
    disabled_at: datetime | None = None
    # The credential namespace of whoever created it through the `schedule` tool (None: unowned,
    # e.g. the CLI): task names are unique per agent and namespace, never across namespaces.
    namespace: str | None = None
    # The chat a task the `schedule` tool made from a channel came from (`ORIGIN_KEYS`: channel,
    # account, chat, thread when in one, sender when known), as the gateway submitted the turn that
    # made it: `cron list`/`show` name it, and `pairing revoke` of that sender disables the task.
    origin: dict[str, str] | None = None

    @property
    def state(self) -> str:
        """A one-word status for `cron list`: a one-shot whose run was missed (the server was
        down past its max lateness, …) is `missed`, never `done`."""
        if self.last_error and self.next_fire_at is None:
            missed = not self.schedule.recurring and self.last_error.startswith(MISSED_PREFIX)
            return "missed" if missed else "error"
        if not self.enabled:
            return "disabled"
        if self.next_fire_at is None:
            return "done" if not self.schedule.recurring else "error"
        return "scheduled"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "agent": self.agent,
            "schedule": self.schedule.to_dict(),
            "prompt": self.prompt,
            "conversation": self.conversation,
            "misfire": self.misfire,
            "max_lateness_s": self.max_lateness_s,
            "exact": self.exact,
            "deliver": self.deliver,
            "enabled": self.enabled,
            "next_fire_at": _iso(self.next_fire_at),
            "next_due_at": _iso(self.next_due_at),
            "last_claimed": self.last_claimed,
            "occurrence": self.occurrence,
            "last_error": self.last_error,
            "last_error_at": _iso(self.last_error_at),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            **({"disabled_at": _iso(self.disabled_at)} if self.disabled_at is not None else {}),
            **({"namespace": self.namespace} if self.namespace is not None else {}),
            **({"origin": dict(self.origin)} if self.origin is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CronTask:
        """Parse one task; every value is checked (types, finite numbers in range), since a value
        the scheduler cannot compute with would stall it. ValueError names the task and field."""
        if not isinstance(d, dict):
            raise ValueError("task must be an object")
        lone = lone_surrogate_in(d)
        if lone is not None:  # valid JSON (an escape), but no text: UTF-8 could not write the task back
            raise ValueError(
                f"{lone} holds a lone surrogate, which is not text and cannot be written in UTF-8: "
                "remove it or write the character it was meant to be"
            )
        for key in ("id", "name", "agent", "prompt"):
            if not isinstance(d.get(key), str):
                raise ValueError(f"task.{key} must be a string")
        tid = d["id"]
        if not _ID_RE.fullmatch(tid):
            raise ValueError(f"task {shown(tid)}: id must be 1-128 letters, digits, '.', '_' or '-'")
        unknown = sorted(k for k in d if k not in _TASK_KEYS)
        if unknown:  # a misspelt "enabled" would be dropped by the next write, the task left running
            raise ValueError(f"task {tid}: unknown field(s) {', '.join(repr(k[:40]) for k in unknown[:3])}")
        if not isinstance(d.get("conversation", "new"), str):
            raise ValueError(f"task {tid}: conversation must be a string")
        if d.get("last_error") is not None and not isinstance(d["last_error"], str):
            raise ValueError(f"task {tid}: last_error must be a string or null")
        sched = d.get("schedule")
        if not isinstance(sched, dict):
            raise ValueError(f"task {tid}: schedule must be an object")
        created = _dt(d.get("created_at"), "created_at")
        if created is None:
            raise ValueError(f"task {tid}: created_at is required")
        misfire = d.get("misfire", "skip")
        if misfire not in MISFIRE_POLICIES:
            raise ValueError(f"task {tid}: misfire must be one of {MISFIRE_POLICIES}")
        lateness = d.get("max_lateness_s", DEFAULT_MAX_LATENESS_S)
        if not _finite_in(lateness, 0, MAX_DURATION_S):
            raise ValueError(f"task {tid}: max_lateness_s must be a number of seconds from 0 to {MAX_DURATION_S}")
        occurrence = d.get("occurrence", 0)
        if not isinstance(occurrence, int) or isinstance(occurrence, bool) or not 0 <= occurrence <= MAX_OCCURRENCE:
            raise ValueError(f"task {tid}: occurrence must be a whole number from 0 to {MAX_OCCURRENCE}")
        for key in ("exact", "enabled"):
            if key in d and not isinstance(d[key], bool):
                raise ValueError(f"task {tid}: {key} must be true or false")
        claimed = d.get("last_claimed")
        if claimed is not None and not isinstance(claimed, dict):
            raise ValueError(f"task {tid}: last_claimed must be an object")
        ns = d.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise ValueError(f"task {tid}: namespace must be a string")
        deliver = d.get("deliver")
        if deliver is not None and not isinstance(deliver, str):
            raise ValueError(f"task {tid}: deliver must be a string or null")
        try:  # a hand edit the gateway would refuse at every run: kept as invalid, reported
            deliver = validate_deliver(deliver)
            origin = validate_origin(d.get("origin"))
        except ScheduleError as exc:
            raise ValueError(f"task {tid}: {exc}") from None
        return cls(
            id=tid,
            name=d["name"],
            agent=d["agent"],
            schedule=ScheduleSpec.from_dict(sched),
            prompt=d["prompt"],
            created_at=created,
            conversation=d.get("conversation", "new"),
            misfire=misfire,
            max_lateness_s=float(lateness),
            exact=d.get("exact", False),
            deliver=deliver,
            enabled=d.get("enabled", True),
            next_fire_at=_dt(d.get("next_fire_at"), "next_fire_at"),
            next_due_at=_dt(d.get("next_due_at"), "next_due_at"),
            last_claimed=claimed,
            occurrence=occurrence,
            last_error=d.get("last_error"),
            last_error_at=_dt(d.get("last_error_at"), "last_error_at"),
            updated_at=_dt(d.get("updated_at"), "updated_at"),
            disabled_at=_dt(d.get("disabled_at"), "disabled_at"),
            namespace=ns,
            origin=origin,
        )

    def drops_run(self, record: Any) -> bool:
        """Whether a queued run of this task, which still exists, is dropped before it starts for
        the task being disabled (NOT_STARTED_DISABLED). `record` is the run's occurrence as its
        claim or its turn's `source` holds it. Every run of a disabled task is, except one asked
        by hand (`cron run`: a `manual` occurrence) after the task was last disabled: the operator
        asked for it knowing the task was disabled, and it runs once, as it does when its
        conversation is idle; a disable after it (or again) drops it. (Not judged by `updated_at`,
        which every claim and every failure moves: two runs asked by hand dropped each other.)"""
        if self.enabled:
            return False
        occ = Occurrence.from_record(self.id, record) if isinstance(record, dict) else None
        disabled_at = self.disabled_at or self.updated_at  # (a file of a version that did not record it)
        if occ is None or not occ.manual or disabled_at is None:
            return True
        return disabled_at > occ.fired_at

    def made_by(self, channel: str, account: str, sender: str) -> bool:
        """Whether the `schedule` tool made this task at `sender`'s request in a chat of
        `channel:account` (its `origin`): what `pairing revoke` of that sender disables."""
        o = self.origin or {}
        return (o.get("channel"), o.get("account"), o.get("sender")) == (channel, account, sender)

    def set_error(self, message: str, now: datetime) -> None:
        """Record a visible failure, kept to MAX_ERROR_CHARS on one line (control characters, which
        JSON would spell in six bytes each, become spaces): the run log keeps the whole text."""
        self.last_error, self.last_error_at, self.updated_at = short_error(message), now, now

    def reschedule(self, after: datetime, now: datetime) -> None:
        """Set next_fire_at/next_due_at to the first occurrence after `after`; a schedule that can
        no longer be computed keeps the task and records the failure instead."""
        try:
            nominal = next_occurrence(self.schedule, after, self.created_at)
            self.next_fire_at = nominal
            self.next_due_at = (
                None
                if nominal is None
                else due_time(
                    self.schedule,
                    nominal,
                    task_id=self.id,
                    created_at=self.created_at,
                    exact=self.exact,
                )
            )
        except ScheduleError as exc:
            self.next_fire_at = self.next_due_at = None
            self.set_error(f"invalid schedule: {exc}", now)
        self.updated_at = now

    def claim(
        self,
        scheduled_for: datetime,
        due_at: datetime,
        now: datetime,
        *,
        manual: bool = False,
        catch_up: bool = False,
        by: str | None = None,
        floor: int = 0,
    ) -> Occurrence:
        """Count one more run and record it as the last claimed occurrence (before anything fires);
        `by`: the scheduler lease token that claimed it (a scheduler that takes the lease over
        from a dead one submits what that one claimed and never submitted); `floor`: the highest
        run number already used (the run log's), which the new number must exceed even when the
        counter here was rolled back by restoring an older crons.json. A number above
        MAX_OCCURRENCE (which crons.json refuses) is never claimed: CronStoreError, the task unchanged."""
        number = max(self.occurrence, floor) + 1
        if number > MAX_OCCURRENCE:
            raise CronStoreError(
                f"task {self.name} ({self.id}): its next run would be #{number}, above the highest run number "
                f"a task may have ({MAX_OCCURRENCE}); nothing was run"
            )
        self.occurrence = number
        occ = Occurrence(self.id, self.occurrence, scheduled_for, due_at, now, manual=manual, catch_up=catch_up)
        still_open, dropped = self._open_claims()
        self.last_claimed = {
            **occ.to_dict(),
            "claimed_at": now.isoformat(),
            **({"by": by} if by else {}),
            "progress": "claimed",
            **({"open": still_open} if still_open else {}),
            FOLLOWED_FROM: self._followed_from_after(number, still_open, dropped),
        }
        return occ

    def _followed_from_after(self, number: int, still_open: list[dict[str, Any]], dropped: list[int]) -> int:
        """FOLLOWED_FROM for a new claim `number` (see there): kept from the last claim, raised
        above the runs pushed out of the claims (`dropped`). A claim that follows no claim kept
        with progress, or that skips numbers (a counter rolled back, then raised by the run log:
        the runs between were claimed in a state this file lost), starts it anew; one made before
        the mark was kept starts it at its lowest claim still open (a run below that may have been
        pushed out)."""
        last = self.last_claimed
        previous = _claim_number(last) if isinstance(last, dict) else None
        if not isinstance(last, dict) or _stage(last) is None or previous is None or previous + 1 != number:
            return number
        start = _claim_number({"occurrence": last.get(FOLLOWED_FROM)})
        if start is None:
            start = min([previous, *(n for c in still_open if (n := _claim_number(c)) is not None)])
        if dropped:
            start = max(start, max(dropped) + 1)
        return start

    def _open_claims(self) -> tuple[list[dict[str, Any]], list[int]]:
        """The claims still open (their run not done) once a new claim replaces `last_claimed`:
        it (when open) and the open ones it kept, newest first, at most OPEN_CLAIMS_KEPT; and the
        numbers of the open runs pushed out (no longer followed)."""
        last = self.last_claimed
        if not isinstance(last, dict):
            return [], []
        kept = []
        if _stage(last) not in (None, "done"):  # (None: a claim made before progress was kept)
            kept.append({k: last[k] for k in _OPEN_KEYS if k in last and last[k] not in (None, False)})
        earlier = last.get("open")
        if isinstance(earlier, list):
            kept += [c for c in earlier if isinstance(c, dict) and _stage(c) not in (None, "done")]
        if len(kept) > OPEN_CLAIMS_KEPT:
            log.warning(
                "cron: task %s (%s): more than %d of its runs are open at once; run(s) %s are no longer "
                "followed in the tasks (their run logs still resolve them)",
                self.name,
                self.id,
                OPEN_CLAIMS_KEPT,
                ", ".join(f"#{c.get('occurrence')}" for c in kept[OPEN_CLAIMS_KEPT:]),
            )
        dropped = [n for c in kept[OPEN_CLAIMS_KEPT:] if (n := _claim_number(c)) is not None]
        return kept[:OPEN_CLAIMS_KEPT], dropped

    def known_done(self, occurrence: int) -> bool:
        """Is run `occurrence`, which is not among the claims, known to be done (see FOLLOWED_FROM)?"""
        last = self.last_claimed
        if not isinstance(last, dict) or _stage(last) is None:
            return False
        start, newest = _claim_number({"occurrence": last.get(FOLLOWED_FROM)}), _claim_number(last)
        return start is not None and newest is not None and start <= occurrence < newest

    def claimed_occurrence(self) -> Occurrence | None:
        """The last claimed occurrence, rebuilt from `last_claimed` (None when it cannot be)."""
        return Occurrence.from_record(self.id, self.last_claimed or {})

    def claim_records(self) -> list[dict[str, Any]]:
        """`last_claimed` and the earlier claims it keeps open, newest first."""
        last = self.last_claimed
        if not isinstance(last, dict):
            return []
        earlier = last.get("open")
        return [last, *(c for c in earlier if isinstance(c, dict))] if isinstance(earlier, list) else [last]

    def tracks_progress(self) -> bool:
        """Does the last claim say how far it got (a claim made by a scheduler that keeps it)?"""
        return isinstance(self.last_claimed, dict) and _stage(self.last_claimed) is not None

    def claim_progress(self, occurrence: int) -> tuple[bool, str | None]:
        """(whether the tasks hold claim `occurrence`, its stage): (False, None) when they do not
        (an earlier run that is done, or one claimed before progress was kept)."""
        for c in self.claim_records():
            if _claim_number(c) == occurrence:
                return True, _stage(c)
        if self.known_done(occurrence):
            return True, "done"
        return False, None

    def advance_claim(self, occurrence: int, step: str, *, final: bool = False) -> bool | None:
        """Move claim `occurrence` to `step` (to done with `final`) if it has not got that far:
        True when it moved (the caller takes the step), False when it was there already (another
        process took it, or the run is done: `known_done`), None when the tasks do not follow that
        claim. An open claim that is done is dropped from `open`."""
        rank = _STAGE_RANK[step]
        stage = "done" if final else step
        last = self.last_claimed
        if not isinstance(last, dict):
            return None
        if _claim_number(last) == occurrence:
            current = _stage(last)
            if current is None:
                return None
            if _STAGE_RANK[current] >= rank:
                return False
            self.last_claimed = {**last, "progress": stage}
            return True
        earlier = last.get("open")
        if not isinstance(earlier, list):
            return False if self.known_done(occurrence) else None
        for i, c in enumerate(earlier):
            if isinstance(c, dict) and _claim_number(c) == occurrence:
                current = _stage(c)
                if current is None:
                    return None
                if _STAGE_RANK[current] >= rank:
                    return False
                rest = earlier[:i] + earlier[i + 1 :]
                kept = rest if stage == "done" else [*earlier[:i], {**c, "progress": stage}, *earlier[i + 1 :]]
                self.last_claimed = {k: v for k, v in last.items() if k != "open"}
                if kept:
                    self.last_claimed["open"] = kept
                return True
        return False if self.known_done(occurrence) else None

    def fingerprint(self) -> tuple[Any, ...]:
        """Every field `to_dict` writes, by value: equal fingerprints give an equal JSON line, so
        `CronStore.save` re-encodes only the tasks that changed (`last_claimed`, the one mutable
        field, is compared by a copy)."""
        claimed = self.last_claimed
        return (_task_values(self), None if claimed is None else dict(claimed))


def _stage(claim: dict[str, Any]) -> str | None:
    """A claim's progress stage (None when it holds none it knows)."""
    stage = claim.get("progress")
    return stage if isinstance(stage, str) and stage in _STAGE_RANK else None


def _claim_number(claim: dict[str, Any]) -> int | None:
    n = claim.get("occurrence")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


_task_values = operator.attrgetter(*(f.name for f in dataclasses.fields(CronTask)))
# The fields a task of crons.json may hold (`CronTask.to_dict` writes exactly these).
_TASK_KEYS = frozenset(f.name for f in dataclasses.fields(CronTask))


@dataclass(frozen=True, slots=True)
class Occurrence:
    """One run of a task as handed to `fire`: its number (the task's run counter), the nominal
    time it stands for, when it was due (with jitter) and when it was actually claimed."""

    task_id: str
    number: int
    scheduled_for: datetime
    due_at: datetime
    fired_at: datetime
    manual: bool = False  # "run now", outside the schedule
    catch_up: bool = False  # fired late by the misfire policy (run_once / run_all)

    @classmethod
    def from_record(cls, task_id: str, c: dict[str, Any]) -> Occurrence | None:
        """An occurrence rebuilt from `last_claimed` or a `fired` run-log record (None when the
        record does not hold one)."""
        try:
            number = int(c["occurrence"])
            scheduled = _dt(c.get("scheduled_for"), "scheduled_for")
            due = _dt(c.get("due_at"), "due_at")
            fired = _dt(c.get("fired_at"), "fired_at")
        except (KeyError, TypeError, ValueError, OverflowError):
            return None
        if scheduled is None or due is None or fired is None:
            return None
        return cls(
            task_id, number, scheduled, due, fired, manual=bool(c.get("manual")), catch_up=bool(c.get("catch_up"))
        )

    @property
    def late_s(self) -> float:
        return max(0.0, (self.fired_at - self.scheduled_for).total_seconds())

    def to_dict(self) -> dict[str, Any]:
        return {
            "occurrence": self.number,
            "scheduled_for": _iso(self.scheduled_for),
            "due_at": _iso(self.due_at),
            "fired_at": _iso(self.fired_at),
            "manual": self.manual,
            "catch_up": self.catch_up,
        }


@dataclass(frozen=True, slots=True)
class InvalidTask:
    """A task of crons.json that names itself (a string id) but cannot be used: kept in the file
    as it was loaded, never scheduled, reported until someone fixes or removes it."""

    raw: dict[str, Any]
    reason: str

    @property
    def id(self) -> str:
        return str(self.raw["id"])

    def owns_name(self, agent: str, name: str) -> bool:
        return self.raw.get("agent") == agent and self.raw.get("name") == name

    def of_agent(self, agent: str | None) -> bool:
        """Is it a task of `agent` (None: of any)?"""
        return agent is None or self.raw.get("agent") == agent

    def has_run_log(self) -> bool:
        """Is its id one a run-log file may be named by (cron-runs/<id>.jsonl)?"""
        return _ID_RE.fullmatch(self.id) is not None


def sender_digest(sender: str) -> str:
    """How a revoked sender's id is kept (`Revocation.sender_sha256`): a fixed size whatever the id
    (a webhook's may be 1,024 characters), and not the id itself."""
    return hashlib.sha256(sender.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(slots=True)
class Revocation:
    """`pairing revoke` of a sender on one channel account, and when (see REVOCATIONS_KEPT_S)."""

    channel: str
    account: str
    sender_sha256: str
    revoked_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "account": self.account,
            "sender_sha256": self.sender_sha256,
            "revoked_at": _iso(self.revoked_at),
        }

    @classmethod
    def from_dict(cls, d: Any) -> Revocation:
        if not isinstance(d, dict):
            raise ValueError(f"a revocation must be an object, not {_json_kind(d)}")
        channel, account, digest = d.get("channel"), d.get("account"), d.get("sender_sha256")
        if not all(isinstance(v, str) and v for v in (channel, account, digest)):
            raise ValueError("a revocation needs channel, account and sender_sha256")
        at = _dt(d.get("revoked_at"), "revoked_at")
        if at is None:
            raise ValueError("a revocation needs revoked_at")
        return cls(cast(str, channel), cast(str, account), cast(str, digest), at)

    def of(self, channel: str, account: str, sender: str) -> bool:
        return (self.channel, self.account, self.sender_sha256) == (channel, account, sender_digest(sender))


@dataclass(slots=True)
class CronFile:
    """The whole of crons.json, parsed."""

    version: int = FORMAT_VERSION
    scheduler_owner: OwnerRecord | None = None
    tasks: list[CronTask] = field(default_factory=list)
    invalid: list[InvalidTask] = field(default_factory=list)
    owner_problem: str | None = None  # an unusable scheduler_owner, read as no owner
    revoked: list[Revocation] = field(default_factory=list)  # `pairing revoke`s of late (REVOCATIONS_KEPT_S)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "scheduler_owner": None if self.scheduler_owner is None else self.scheduler_owner.to_dict(),
        }
        if self.revoked:
            out["revoked"] = [r.to_dict() for r in self.revoked]
        out["tasks"] = [t.to_dict() for t in self.tasks] + [bad.raw for bad in self.invalid]
        return out

    def revoked_since(self, origin: dict[str, str] | None, began: datetime) -> Revocation | None:
        """The revocation of `origin`'s sender on its channel account made after `began` (less
        REVOKE_CLOCK_MARGIN_S), or None (also for an origin without a sender)."""
        o = origin or {}
        channel, account, sender = o.get("channel"), o.get("account"), o.get("sender")
        if not (channel and account and sender):
            return None
        after = began - timedelta(seconds=REVOKE_CLOCK_MARGIN_S)
        return next((r for r in self.revoked if r.of(channel, account, sender) and r.revoked_at >= after), None)

    def record_revocation(self, channel: str, account: str, sender: str, now: datetime) -> None:
        """Note that `sender` was revoked on `channel:account` at `now` (a later revoke of the same
        sender moves its time on), dropping those past REVOCATIONS_KEPT_S and beyond REVOCATIONS_MAX."""
        digest = sender_digest(sender)
        kept = [
            r
            for r in self.revoked
            if (r.channel, r.account, r.sender_sha256) != (channel, account, digest)
            and (now - r.revoked_at).total_seconds() < REVOCATIONS_KEPT_S
        ]
        kept.append(Revocation(channel, account, digest, now))
        kept.sort(key=operator.attrgetter("revoked_at"))
        self.revoked = kept[-REVOCATIONS_MAX:]

    @classmethod
    def from_dict(cls, d: Any) -> CronFile:
        """Parse crons.json's document. ValueError (the file is unusable: set it aside) for a
        document of the wrong shape; a task that has a string id but is otherwise unusable is
        kept in `invalid` instead, so one bad task never takes the others down."""
        if not isinstance(d, dict):
            raise ValueError(f"top level must be an object, not {_json_kind(d)}")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError("version must be an integer")
        if "tasks" not in d:  # every write has it (`[]` when empty): a file without it lost them
            raise ValueError('tasks is missing (an empty file still says "tasks": [])')
        tasks = d["tasks"]
        if not isinstance(tasks, list):
            raise ValueError("tasks must be a list")
        # The lease record is the scheduler's, not the user's data: an unusable one is read as no
        # owner (the next scheduler takes the lease over; a live holder sees that at its next
        # renewal and steps down) and the tasks stay in use, instead of the whole file set aside.
        raw_owner, owner, owner_problem = d.get("scheduler_owner"), None, None
        if raw_owner is not None and not isinstance(raw_owner, dict):
            owner_problem = f"scheduler_owner must be an object or null, not {_json_kind(raw_owner)}"
        elif raw_owner is not None:
            try:
                owner = OwnerRecord.from_dict(raw_owner)
            except (ValueError, TypeError, KeyError, OverflowError) as exc:
                owner_problem = str(exc) or type(exc).__name__
        parsed: list[CronTask] = []
        invalid: list[InvalidTask] = []
        seen: set[str] = set()
        for raw in tasks:
            if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
                raise ValueError("every task must be an object with a string id")
            if raw["id"] in seen:  # a hand edit that copied a task: the first one stays in use
                invalid.append(InvalidTask(raw, f"a second task with the id {shown(raw['id'])}; give it another id"))
                continue
            seen.add(raw["id"])
            try:
                parsed.append(CronTask.from_dict(raw))
            except (ValueError, TypeError, KeyError, OverflowError) as exc:
                invalid.append(InvalidTask(raw, f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)))
        return cls(
            version=version,
            scheduler_owner=owner,
            tasks=parsed,
            invalid=invalid,
            owner_problem=owner_problem,
            revoked=_revocations(d.get("revoked")),
        )

    def invalid_problem(self) -> str | None:
        """One line naming the tasks that are kept but not scheduled, else None."""
        if not self.invalid:
            return None
        shown = "; ".join(f"{bad.id}: {bad.reason}" for bad in self.invalid[:3])
        more = f" (and {len(self.invalid) - 3} more)" if len(self.invalid) > 3 else ""
        return (
            f"{len(self.invalid)} task(s) in the cron tasks are invalid and are not scheduled "
            f"(left in place: fix them, or remove them with appserver cron remove ID): {shown}{more}"
        )

    def find(self, ref: str, agent: str | None = None) -> CronTask:
        """By id, else by name (narrowed by agent); an ambiguous name is an error, not a guess."""
        for t in self.tasks:
            if t.id == ref and (agent is None or t.agent == agent):
                return t
        named = [t for t in self.tasks if t.name == ref and (agent is None or t.agent == agent)]
        if len(named) == 1:
            return named[0]
        if not named:
            bad = self.find_invalid(ref, agent)
            if bad is not None:
                raise CronTaskInvalid(
                    f"cron task {shown(ref)} is invalid and not scheduled ({bad.reason}); fix it in "
                    f"{CRONS_FILE}, or remove it: appserver cron remove {bad.id}",
                    bad,
                )
            who = f" for agent {shown(agent)}" if agent else ""
            raise CronNotFound(f"no cron task {shown(ref)}{who}")
        agents = sorted({t.agent for t in named})
        if len(agents) == 1:
            ids = ", ".join(t.id for t in named)
            raise CronStoreError(
                f"several tasks of agent {shown(agents[0])} are named {shown(ref)} ({ids}); give the task id"
            )
        raise CronStoreError(f"task name {shown(ref)} exists for several agents ({', '.join(agents)}); pass --agent")

    def find_invalid(self, ref: str, agent: str | None = None) -> InvalidTask | None:
        """The invalid task by id (the first of copies sharing it), else by name (an ambiguous
        name is an error), narrowed by agent; None when there is none."""
        mine = [bad for bad in self.invalid if bad.of_agent(agent)]
        by_id = [bad for bad in mine if bad.id == ref]
        if by_id:
            return by_id[0]
        named = [bad for bad in mine if bad.raw.get("name") == ref]
        if len(named) > 1:
            ids = ", ".join(bad.id for bad in named)
            raise CronStoreError(f"several invalid tasks are named {shown(ref)} ({ids}); give the task id")
        return named[0] if named else None

    def get(self, task_id: str) -> CronTask | None:
        return next((t for t in self.tasks if t.id == task_id), None)


def _json_int(text: str) -> int | float:
    """A JSON integer of crons.json. One longer than MAX_JSON_INT_DIGITS is no value this file holds
    (a pid, a run counter) and one int() may refuse: it is read as an infinity instead, which every
    check of a field refuses, so an owner with such a pid is no owner and a task with such a number
    is invalid (kept, not run; written back as Infinity, the value it was read as)."""
    if len(text.lstrip("-")) <= MAX_JSON_INT_DIGITS:
        return int(text)
    return -math.inf if text.startswith("-") else math.inf


def _revocations(raw: Any) -> list[Revocation]:
    """The file's "revoked" list (absent: none). Like the lease record it is bookkeeping, not the
    user's tasks: an unusable entry is dropped with an error in the log, never the file set aside."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        log.error("%s: revoked must be a list, not %s; read as none", CRONS_FILE, _json_kind(raw))
        return []
    found: list[Revocation] = []
    for item in raw:
        try:
            found.append(Revocation.from_dict(item))
        except (ValueError, TypeError) as exc:
            log.error("%s: an entry of revoked is unusable (%s); dropped", CRONS_FILE, exc)
    return found


def _owner_of(task: CronTask, per_conversation: bool) -> Callable[[Any, Any], bool]:
    """Whether a task of (namespace, conversation) has `task`'s owner (`CronStore.add`): its
    namespace, or with `per_conversation` its namespace in its conversation. An invalid task's raw
    fields may be anything: only equal values count."""

    def held(namespace: Any, conversation: Any) -> bool:
        return namespace == task.namespace and (not per_conversation or conversation == task.conversation)

    return held


def _check_loadable(task: CronTask, line: str) -> None:
    """Refuse (CronStoreError) to write a task as `line` when crons.json's loader would not load it
    back (it would be kept as invalid: never scheduled, `cron show` and `run` refusing it): whatever
    put a value out of range in it, nothing writes a file its own loader rejects."""
    try:
        CronTask.from_dict(json.loads(line, parse_int=_json_int))
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        why = str(exc) or type(exc).__name__
        raise CronStoreError(
            f"task {task.name} ({task.id}) would be written in a form {CRONS_FILE} cannot load back ({why}); "
            "nothing was written"
        ) from None


def _id_in_use(state: CronFile, task_id: str) -> bool:
    """Does a task crons.json still holds (valid or not) have this id?"""
    return state.get(task_id) is not None or any(bad.id == task_id for bad in state.invalid)


def plain_json(value: Any) -> Any:
    """`value` (as loaded from crons.json) with NaN and the infinities, which are no JSON, as the
    strings they were read as, so any JSON reader can read it."""
    return json.loads(json.dumps(value, allow_nan=True), parse_constant=str)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__
    )


# ---------------------------------------------------------------- the store


class _Gate:
    """This process's turn at one crons.json.lock. Its threads (the scheduler's outcomes, sent to
    worker threads all at once when many runs end together) queue here, so only one of them at a
    time waits for the file lock: that wait (`lock_timeout_s`) measures another process's hold,
    never this process's own work, which each holder ends in its own time."""

    __slots__ = ("__weakref__", "gave_up_at", "mutex", "owner")

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.owner: int | None = None  # the thread holding it (its re-entry holds it already)
        self.gave_up_at = -math.inf  # monotonic time a holder last timed out on the file lock


_R = TypeVar("_R")


class _Job:
    """One read-modify-write handed to `CronStore.combined`, and what came of it."""

    __slots__ = ("done", "error", "result", "run")

    def __init__(self, run: Callable[[CronFile], tuple[Any, bool]]) -> None:
        self.run = run
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True


def _flock_holder(path: Path) -> str | None:
    """Which process holds the flock on `path`, as Linux's /proc/locks names it, for messages;
    None when that cannot be told (another system, the file gone, a holder not seen from here)."""
    try:
        st = os.stat(path)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            pids = [row[4] for row in map(str.split, f) if row[1:2] == ["FLOCK"] and row[5:6] == [inode]]
    except OSError:
        return None
    if not pids or not pids[0].isdigit() or int(pids[0]) <= 0:
        return None
    pid = int(pids[0])
    if pid == os.getpid():
        return f"this process (pid {pid}) outside its cron store"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read(400).replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        command = ""
    return f"process {pid}" + (f" ({short_error(command)[:120]})" if command else "")


class CronStore:
    """crons.json under its lock. Use `transaction()` for read-modify-write, `read()` to look."""

    # Do servers with other homes (other run logs) share these tasks? (a cluster's database)
    shared = False
    # The gate of each lock file, shared by every CronStore of it in this process (the scheduler's,
    # each `schedule` tool call's): what it fronts, a file lock, is held by a process. Process-wide
    # by nature; it holds no configuration, and a gate no store refers to any more is dropped.
    _gates: ClassVar[WeakValueDictionary[str, _Gate]] = WeakValueDictionary()
    _gates_guard: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, home: Path, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.home = Path(home)
        self.path = self.home / CRONS_FILE
        self.lock_path = self.home / f"{CRONS_FILE}.lock"
        self.runs_dir = self.home / RUNS_DIR
        self.lock_timeout_s = lock_timeout_s
        # the last state this object loaded or saved, with the file's (inode, mtime, size) at
        # that moment; every atomic write makes a new inode, so a match means nobody else wrote
        self._cache: tuple[tuple[int, int, int], CronFile] | None = None
        # task id -> (fingerprint, JSON line) of the last save: unchanged tasks are not re-encoded
        self._lines: dict[str, tuple[tuple[Any, ...], bytes]] = {}
        self.instance_id: str | None = None  # this server's cluster instance (a database-backed store)
        self.runlog = RunLog(self.runs_dir)  # the scheduler's writer: never raises, retries
        self._gate = self._gate_of(os.path.realpath(self.lock_path))
        self._jobs: list[_Job] = []  # handed to `combined`, not yet run
        self._jobs_guard = threading.Lock()

    @classmethod
    def _gate_of(cls, key: str) -> _Gate:
        with cls._gates_guard:
            gate = cls._gates.get(key)
            if gate is None:
                gate = cls._gates[key] = _Gate()
            return gate

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold crons.json.lock; CronLockTimeout after `lock_timeout_s` rather than hanging. This
        process's threads take it one at a time (`_Gate`), so the timeout is only ever another
        process's doing; re-entered by the thread that holds it, it is held already."""
        gate, me = self._gate, threading.get_ident()
        if gate.owner == me:
            yield
            return
        queued = time.monotonic()
        with gate.mutex:
            gate.owner = me
            try:
                if gate.gave_up_at > queued:  # queued behind a holder that timed out: so do we
                    raise self._timed_out()
                with self._file_lock(gate):
                    yield
            finally:
                gate.owner = None

    @contextmanager
    def _file_lock(self, gate: _Gate) -> Iterator[None]:
        ensure_private_dir(self.home)
        lk = filelock.FileLock(str(self.lock_path), timeout=self.lock_timeout_s, mode=0o600)
        try:
            lk.acquire()
        except filelock.Timeout:
            gate.gave_up_at = time.monotonic()
            raise self._timed_out() from None
        try:
            yield
        finally:
            lk.release()

    def _timed_out(self) -> CronLockTimeout:
        """The timeout, naming the holder when this system says who it is: never this process's
        cron store (see `lock`), and not necessarily an appserver."""
        holder = _flock_holder(self.lock_path) or "another process"
        waited = f"timed out after {self.lock_timeout_s:g} s waiting for {self.lock_path}"
        return CronLockTimeout(f"{waited}, held by {holder}")

    def signature(self) -> tuple[int, int, int] | None:
        """(inode, mtime, size) of crons.json now, None when there is none. Every atomic write
        makes a new inode, so a different signature means someone wrote the file."""
        try:
            st = state_file_stat(self.path)
        except StateFileRefused as exc:  # a link to nothing: the next load says so
            raise CronStoreError(str(exc)) from None
        if st is None:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def cached_signature(self) -> tuple[int, int, int] | None:
        """The signature of the state this object last saved or kept (None when it holds none):
        a file with this signature was written by this process, not by someone else."""
        cached = self._cache
        return None if cached is None else cached[0]

    def load(self, *, readonly: bool = False) -> CronFile:
        """Parse crons.json (call with the lock held). Missing → empty; unusable → moved aside
        (CorruptStateFile, not logged here: every caller reports it, so it is said once), or with
        `readonly` left in place (CronFileUnreadable).
        The caller owns the returned object: it leaves the cache until `save` or `keep`."""
        cached, self._cache = self._cache, None
        if cached is not None and cached[0] == self.signature():
            return cached[1]
        raw = self._read_json(readonly)
        if raw is _MISSING:
            return CronFile()
        if isinstance(raw, dict) and isinstance(raw.get("version"), int) and raw["version"] > FORMAT_VERSION:
            raise CronStoreError(
                f"{self.path} has format version {raw['version']}, newer than this appserver "
                f"understands ({FORMAT_VERSION}); upgrade appserver"
            )
        try:
            state = CronFile.from_dict(raw)
        except (ValueError, TypeError, KeyError) as exc:
            reason = f"not a valid crons.json: {exc}"
            if readonly:
                raise self._unreadable(reason) from None
            raise move_aside(self.path, reason, quiet=True) from None
        if state.owner_problem is not None:
            log.error(
                "%s: the scheduler lease record is unusable (%s); read as no owner, so a scheduler takes "
                "the lease over (the tasks are kept)",
                self.path,
                state.owner_problem,
            )
        return state

    def _read_json(self, readonly: bool) -> Any:
        """The parsed document, or `_MISSING` when there is no file (a JSON `null` is a document,
        and not one of cron tasks: `load` sets it aside like any other wrong shape). A file too large
        to be appserver's is unusable like torn JSON; one that is no regular file (a FIFO, a device)
        or a link to nothing (an unmounted disk) is never read, moved or replaced: CronStoreError."""
        try:
            raw = read_state_bytes(self.path, CRONS_MAX_BYTES)
        except FileNotFoundError:
            return _MISSING
        except StateFileTooLarge as exc:
            if readonly:
                raise self._unreadable(exc.reason) from None
            raise move_aside(self.path, exc.reason, quiet=True) from None
        except StateFileRefused as exc:
            raise CronStoreError(f"{exc}; nothing was changed") from None
        try:
            return json.loads(raw.decode("utf-8"), parse_int=_json_int)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            reason = "invalid JSON: nested too deeply" if isinstance(exc, RecursionError) else f"invalid JSON: {exc}"
            if readonly:
                raise self._unreadable(reason) from None
            raise move_aside(self.path, reason, quiet=True) from None

    def _unreadable(self, reason: str) -> CronFileUnreadable:
        return CronFileUnreadable(
            f"{self.path} cannot be read ({reason}); it was left in place: fix it, or let a "
            "command that changes tasks (cron add, remove, enable, disable) or the running "
            f"server's scheduler set it aside as {CRONS_FILE}.corrupt-<time>"
        )

    def save(self, state: CronFile, *, cache: bool = False, user_edit: bool = False) -> None:
        """Write atomically (call with the lock held), one task per line: readable, and several
        times faster than indenting every key of ten thousand tasks. `cache=True` (the scheduler
        only) keeps `state` for the next `load`; the caller must then hold no references into it
        that it hands out, since the next loader will mutate those objects. A file too large to be
        read back is never written (`user_edit`: a user's add or change, held to the room the
        scheduler's bookkeeping needs; see `checked_render`): CronTasksTooLarge, file unchanged."""
        atomic_write_bytes(self.path, self.checked_render(state, user_edit=user_edit))
        self._cache = None
        if cache:
            self.keep(state)

    def stored_size(self) -> int:
        """The size in bytes of the tasks as stored now (call with the lock held); 0 for none."""
        try:
            st = state_file_stat(self.path)
        except StateFileRefused:
            return 0
        return 0 if st is None else st.st_size

    def checked_render(self, state: CronFile, *, user_edit: bool = False) -> bytes:
        """`render_bytes(state)`, refused (CronTasksTooLarge) when it is more than crons.json is read
        with (CRONS_MAX_BYTES: a larger file would be set aside as corrupt, every task stopped).
        With `user_edit` (`add`, `enable`, `disable`) a text that grows the stored one is also refused
        when it leaves less than the scheduler's bookkeeping room below that limit, so the
        scheduler's own writes (which are not so held) always fit; one that does not grow it
        (a removal, or a change in place) always passes."""
        data = self.render_bytes(state)
        size = len(data)
        if size > CRONS_MAX_BYTES:
            raise CronTasksTooLarge(
                f"the cron tasks would take {size} bytes, more than the {CRONS_MAX_BYTES // MIB} MiB "
                f"{self.path} is read with; nothing was written: remove tasks or shorten their prompts"
            )
        if user_edit:
            room = user_limit(len(state.tasks))
            if size > room and size > self.stored_size():
                raise CronTasksTooLarge(
                    f"the cron tasks would take {size} bytes, more than the {room} bytes they may fill "
                    f"({CRONS_MAX_BYTES // MIB} MiB, less room kept for the scheduler's bookkeeping of "
                    f"{len(state.tasks)} task(s)); nothing was written: remove tasks or shorten their prompts"
                )
        return data

    def render(self, state: CronFile) -> str:
        """crons.json's text for `state`."""
        return self.render_bytes(state).decode("utf-8")

    def render_bytes(self, state: CronFile) -> bytes:
        """crons.json's bytes for `state`, joined from each task's line already in UTF-8: one task
        whose text is outside Latin-1 (an emoji in an error) would otherwise widen the whole
        file's text to four bytes a character before its encoding (a 64 MiB file: ~1 GB copied)."""
        state.version = FORMAT_VERSION
        owner = None if state.scheduler_owner is None else state.scheduler_owner.to_dict()
        lines = self._encode_tasks(state.tasks)
        lines += [utf8_json(bad.raw, allow_nan=True, separators=_COMPACT["separators"]) for bad in state.invalid]
        head = f'{{\n  "version": {state.version},\n  "scheduler_owner": {json.dumps(owner, **_COMPACT)},\n'
        if state.revoked:  # ASCII-escaped: an id is only hashed, and no stray character stops the write
            revoked = ",\n    ".join(json.dumps(r.to_dict(), separators=_COMPACT["separators"]) for r in state.revoked)
            head += f'  "revoked": [\n    {revoked}\n  ],\n'
        head += '  "tasks": ['
        if not lines:
            return head.encode("utf-8") + b"]\n}\n"
        return b"".join((head.encode("utf-8"), b"\n    ", b",\n    ".join(lines), b"\n  ]\n}\n"))

    def join_cluster(self, instance_id: str, instance_timeout_s: float, heartbeat_s: float) -> None:
        """This store's scheduler is a server of a cluster: its lease is stamped `instance_id`,
        and others are judged with the cluster's timings."""
        self.instance_id = instance_id

    def close(self) -> None:
        """Let go of what the store holds open (a database connection; a file store: nothing)."""

    def instance_alive(self, instance_id: str) -> bool | None:
        """Is this cluster instance alive? None: this store cannot tell (a file in one home)."""
        return None

    def _encode_tasks(self, tasks: list[CronTask]) -> list[bytes]:
        """One JSON line per task (in UTF-8), reusing the last save's line of every task whose fingerprint
        is unchanged (a tick that fires a few of ten thousand tasks encodes only those)."""
        previous, lines = self._lines, {}
        out = []
        for t in tasks:
            key = t.fingerprint()
            hit = previous.get(t.id)
            if hit is not None and hit[0] == key:
                line = hit[1]
            else:
                text = json.dumps(t.to_dict(), **_COMPACT)
                _check_loadable(t, text)
                line = text.encode("utf-8")
            lines[t.id] = (key, line)
            out.append(line)
        self._lines = lines
        return out

    def keep(self, state: CronFile) -> None:
        """Hand an unmodified loaded state back to the cache (call with the lock held), so the
        scheduler's next tick need not parse ten thousand tasks again. Same ownership rule as
        `save(cache=True)`."""
        sig = self.signature()
        self._cache = None if sig is None else (sig, state)

    @contextmanager
    def transaction(self, *, user_edit: bool = False) -> Iterator[CronFile]:
        """Lock, load, yield, and save unless the block raised (`user_edit`: see `save`)."""
        with self.lock():
            state = self.load()
            yield state
            self.save(state, user_edit=user_edit)

    def read(self) -> CronFile:
        """A consistent snapshot (taken under the lock, so never a half-written file). The caller
        may do what it likes with it; it is not cached. A reader: an unparseable file raises
        CronFileUnreadable and stays where it is."""
        with self.lock():
            return self.load(readonly=True)

    def corrupt_files(self) -> list[Path]:
        """Files set aside as corrupt; the CLI warns about them until the user deals with them."""
        if not self.home.is_dir():
            return []
        return sorted(self.home.glob(f"{CRONS_FILE}.corrupt-*"))

    def problem(self) -> str | None:
        """One line when a crons.json was set aside as corrupt and not yet dealt with (its tasks
        are not running), else None. Cheap: one directory listing."""
        aside = self.corrupt_files()
        if not aside:
            return None
        more = f" (and {len(aside) - 1} older)" if len(aside) > 1 else ""
        return (
            f"{self.path} was unreadable and was set aside as {aside[-1].name}{more}; the tasks "
            f"in it are not scheduled: fix it and move it back to {CRONS_FILE}, or delete it"
        )

    # ------------------------------------------------------------ task operations

    def add(
        self,
        task: CronTask,
        *,
        max_in_namespace: int | None = None,
        max_namespace_bytes: int | None = None,
        max_tool_bytes: int | None = None,
        per_conversation: bool = False,
        asked_at: datetime | None = None,
    ) -> CronTask:
        """Insert a task; a duplicate name for the same agent and namespace is refused and nothing
        is written. `asked_at`: when the turn asking for it (the `schedule` tool's) began; a task
        whose origin sender `pairing revoke` revoked since is refused (SenderRevoked), checked
        under the lock the revoke records under (`revoke_sender`), so it is either refused or
        there to be disabled by the revoke. Names are scoped to (agent, namespace): another
        agent's or another credential namespace's tasks neither collide with nor show through
        this one. The `schedule` tool's
        caps, counted under the lock so concurrent creations cannot pass them together (CronRefused,
        nothing written): `max_in_namespace` tasks in the task's namespace; `max_namespace_bytes` of
        crons.json for them, and `max_tool_bytes` for every namespaced task (all the tool made), each
        task charged its line and the bookkeeping room kept for it (`charged_bytes`), so the tool's
        tasks together never crowd the operator's `cron add` out of the file. With
        `per_conversation` the owner is the task's namespace in its conversation (names, count and
        bytes): the channel gateway's one namespace holds the conversations of every chat."""
        held_by_owner = _owner_of(task, per_conversation)
        with self.lock():
            state = self.load()
            revoked = None if asked_at is None else state.revoked_since(task.origin, asked_at)
            if revoked is not None:
                self.keep(state)
                raise SenderRevoked(
                    "the person who asked for it in this chat had their access revoked (appserver pairing revoke) "
                    f"at {revoked.revoked_at.isoformat(timespec='seconds')}, after this turn began; nothing was "
                    "scheduled: a turn of a revoked sender schedules nothing for them"
                )
            if max_in_namespace is not None:
                held = sum(1 for t in state.tasks if held_by_owner(t.namespace, t.conversation)) + sum(
                    1 for bad in state.invalid if held_by_owner(bad.raw.get("namespace"), bad.raw.get("conversation"))
                )
                if held >= max_in_namespace:
                    self.keep(state)
                    raise CronRefused(
                        f"there are already {held} scheduled tasks of this owner, the most allowed "
                        f"({max_in_namespace}); cancel some first"
                    )
            if max_namespace_bytes is not None or max_tool_bytes is not None:
                problem = self._budget_problem(state, task, held_by_owner, max_namespace_bytes, max_tool_bytes)
                if problem is not None:
                    self.keep(state)
                    raise CronRefused(problem)
            if any(
                t.agent == task.agent and t.name == task.name and held_by_owner(t.namespace, t.conversation)
                for t in state.tasks
            ) or any(
                bad.owns_name(task.agent, task.name)
                and held_by_owner(bad.raw.get("namespace"), bad.raw.get("conversation"))
                for bad in state.invalid
            ):
                self.keep(state)
                raise CronRefused(f"agent {shown(task.agent)} already has a cron task named {shown(task.name)}")
            state.tasks.append(task)
            try:
                self.save(state, user_edit=True)
            except CronTasksTooLarge:
                self._lines.pop(task.id, None)
                raise
        return task

    def _budget_problem(
        self,
        state: CronFile,
        task: CronTask,
        held_by_owner: Callable[[Any, Any], bool],
        namespace_max: int | None,
        tool_max: int | None,
    ) -> str | None:
        """Why `task` may not join `state` under the `schedule` tool's byte caps, or None. The text
        says only what the task's own namespace holds and may hold: nothing of other namespaces'
        tasks, nor where the file is."""
        cost = charged_bytes(utf8_json(task.to_dict(), separators=_COMPACT["separators"]))
        own = tool = 0
        for t, line in zip(state.tasks, self._encode_tasks(state.tasks), strict=True):
            own += charged_bytes(line) if held_by_owner(t.namespace, t.conversation) else 0
            tool += charged_bytes(line) if t.namespace is not None else 0
        for bad in state.invalid:
            line = utf8_json(bad.raw, allow_nan=True, separators=_COMPACT["separators"])
            own += charged_bytes(line) if held_by_owner(bad.raw.get("namespace"), bad.raw.get("conversation")) else 0
            tool += charged_bytes(line) if bad.raw.get("namespace") is not None else 0
        if namespace_max is not None and own + cost > namespace_max:
            return (
                f"the scheduled tasks of this owner would take {own + cost} bytes with this one ({cost}), "
                f"more than the {namespace_max} allowed; cancel some or shorten the prompt"
            )
        if tool_max is not None and tool + cost > tool_max:
            return (
                "the tasks scheduled through this tool on this server leave no room for this one now; "
                f"this owner's take {own} bytes: cancel some, or ask the operator"
            )
        return None

    def remove(
        self, ref: str, agent: str | None = None, *, scheduler_alive: Callable[[OwnerRecord], bool] | None = None
    ) -> CronTask:
        """Remove a task; its run log stays (30 days: `REMOVED_LOG_RETENTION_S`), ending with a
        `removed` record that keeps the task (so `cron logs NAME` still finds it by name; a long
        prompt cut short: `removed_task`).
        With `scheduler_alive`, its runs still waiting for a scheduler that stopped are cancelled
        (`_cancel_waiting_runs`). An invalid task is refused (CronTaskInvalid): only `remove_any`
        (the operator's `cron remove`) removes one, the `schedule` tool cannot tell whose it is."""
        with self.transaction() as state:
            task = state.find(ref, agent)
            self._cancel_waiting_runs(state, task, NOT_STARTED_REMOVED, scheduler_alive)
            state.tasks.remove(task)
        append_run(self.runs_dir, task.id, "removed", task=removed_task(task.to_dict()))
        return task

    def remove_any(
        self, ref: str, agent: str | None = None, *, scheduler_alive: Callable[[OwnerRecord], bool] | None = None
    ) -> CronTask | InvalidTask:
        """`remove`, and an invalid task too (`cron remove` always works): it leaves the file and
        every other task is written back as it was. Its run log gets the `removed` record when its
        id names one and no task left holds that id (a copy's id names another task's log)."""
        removed: CronTask | InvalidTask
        logged = True
        with self.transaction() as state:
            try:
                task = state.find(ref, agent)
                self._cancel_waiting_runs(state, task, NOT_STARTED_REMOVED, scheduler_alive)
                state.tasks.remove(task)
                removed = task
            except CronTaskInvalid as exc:
                removed = exc.entry
                state.invalid = [other for other in state.invalid if other is not removed]
                logged = removed.has_run_log() and not _id_in_use(state, removed.id)
        if logged:
            kept = removed.to_dict() if isinstance(removed, CronTask) else plain_json(removed.raw)
            append_run(self.runs_dir, removed.id, "removed", task=removed_task(kept))
        return removed

    def set_enabled(
        self,
        ref: str,
        enabled: bool,
        *,
        agent: str | None = None,
        now: datetime | None = None,
        scheduler_alive: Callable[[OwnerRecord], bool] | None = None,
    ) -> CronTask:
        """Disable keeps the task (with `scheduler_alive`, its runs still waiting for a scheduler
        that stopped are cancelled: `_cancel_waiting_runs`); enable recomputes a recurring task's
        next time from now, so the occurrences that passed while it was disabled are not treated
        as misfires."""
        now = now or utcnow()
        with self.transaction(user_edit=True) as state:
            task = state.find(ref, agent)
            was = task.enabled
            task.enabled = enabled
            task.updated_at = now
            task.disabled_at = None if enabled else now
            if not enabled:
                self._cancel_waiting_runs(state, task, NOT_STARTED_DISABLED, scheduler_alive, now)
            if enabled and not was:
                if task.schedule.recurring or task.last_error:
                    task.last_error = None
                    task.reschedule(
                        now if task.schedule.recurring else task.created_at - timedelta(microseconds=1),
                        now,
                    )
        return task

    def disable_where(
        self,
        wanted: Callable[[CronTask], bool],
        *,
        now: datetime | None = None,
        scheduler_alive: Callable[[OwnerRecord], bool] | None = None,
    ) -> list[CronTask]:
        """Disable, in one write, every enabled task `wanted` picks, each as `set_enabled(False)`
        does (kept; its runs waiting for a scheduler that stopped cancelled): the tasks disabled.
        One transaction, so a task made or removed meanwhile is either seen whole or not at all;
        nothing is written when none is picked. (`pairing revoke` uses `revoke_sender`, which also
        records the revoke.)"""
        now = now or utcnow()
        with self.lock():
            state = self.load()
            picked = [t for t in state.tasks if t.enabled and wanted(t)]
            if not picked:
                self.keep(state)
                return []
            for task in picked:
                task.enabled = False
                task.updated_at = task.disabled_at = now
                self._cancel_waiting_runs(state, task, NOT_STARTED_DISABLED, scheduler_alive, now)
            self.save(state, user_edit=True)
        return picked

    def revoke_sender(
        self,
        accounts: Sequence[tuple[str, str]],
        sender: str,
        *,
        now: datetime | None = None,
        scheduler_alive: Callable[[OwnerRecord], bool] | None = None,
    ) -> list[CronTask]:
        """`pairing revoke` of `sender` on `accounts` ((channel, account) pairs), in one write under
        the lock: the revocation is recorded (`CronFile.record_revocation`: `add` refuses what a
        turn of theirs that began before it asks for, `SenderRevoked`), and every enabled task the
        `schedule` tool made at their request from a chat of those accounts (`CronTask.made_by`) is
        disabled, as `disable_where` does: the tasks disabled. Written even when none is (the
        record is the point), also where there was no crons.json yet. Not held to the room a user's
        change leaves the scheduler (`checked_render`): a revoke is never refused for it; the
        records it adds are few and small (REVOCATIONS_MAX)."""
        now = now or utcnow()
        with self.lock():
            state = self.load()
            for channel, account in accounts:
                state.record_revocation(channel, account, sender, now)
            picked = [
                t
                for t in state.tasks
                if t.enabled and any(t.made_by(channel, account, sender) for channel, account in accounts)
            ]
            for task in picked:
                task.enabled = False
                task.updated_at = task.disabled_at = now
                self._cancel_waiting_runs(state, task, NOT_STARTED_DISABLED, scheduler_alive, now)
            self.save(state)
        return picked

    def list(self, agent: str | None = None) -> list[CronTask]:
        return [t for t in self.read().tasks if agent is None or t.agent == agent]

    def _cancel_waiting_runs(
        self,
        state: CronFile,
        task: CronTask,
        why: str,
        scheduler_alive: Callable[[OwnerRecord], bool] | None,
        now: datetime | None = None,
    ) -> None:
        """Record as cancelled (`why`) the runs of `task` that were claimed, never submitted, and
        that no running scheduler has in hand: claimed by one that stopped (a `run_all` catch-up's
        runs waiting their turn when it was killed). The scheduler that takes the lease over would
        submit them, and their task's owner has just removed or disabled it; once the task is
        removed its claims are gone, and nothing else would ever settle them. `scheduler_alive`
        judges the lease's holder as a scheduler does (`cron.lease.LeaseHolder.alive`, which
        builds on this module: handed in); without it nothing is cancelled here. Called by
        `remove` and `disable` under the lock, so a scheduler takes such a claim over (stamping it
        with its own lease: `Scheduler._adopt`) either before, and is left it (it cancels it
        itself), or after, and finds it settled. Each outcome is written before the claim moves
        on or the task goes, as every outcome is (a failed save leaves it cancelled, never
        submitted). A run the run log shows submitted is left to its turn. (One whose scheduler was
        killed in the instant between the kernel's accepting it and its `submitted` record cannot
        be told from one never submitted: it is recorded cancelled, its turn runs.) Not on a
        cluster's database: this home's run log is not every server's, so only the scheduler that
        takes over, asking the kernel, can tell whether a dead server submitted its claim."""
        if self.shared or scheduler_alive is None:
            return
        waiting = {
            number: claim["by"]
            for claim in task.claim_records()
            if _stage(claim) == "claimed"
            and isinstance(claim.get("by"), str)
            and (number := _claim_number(claim)) is not None
        }
        if not waiting:
            return
        owner = state.scheduler_owner
        live = owner.token if owner is not None and scheduler_alive(owner) else None
        cancelled: list[int] = []
        for number in sorted(n for n, by in waiting.items() if by != live):  # oldest first, as they would run
            try:
                if settled_record(self.runs_dir, task.id, number) is not None:
                    continue
                append_run(
                    self.runs_dir, task.id, "outcome", occurrence=number, turn_id=None, status="cancelled", error=why
                )
            except (OSError, ValueError) as exc:  # left as it was (a disabled task's: the next scheduler cancels it)
                log.warning("cron: could not record that task %s run #%d is cancelled: %s", task.id, number, exc)
                continue
            task.advance_claim(number, "settled", final=True)
            cancelled.append(number)
        if cancelled:
            log.info("cron: task %s run(s) %s cancelled: %s", task.id, ", ".join(f"#{n}" for n in cancelled), why)
            task.set_error(f"run #{max(cancelled)} cancelled: {why}", now or utcnow())

    def combined(self, run: Callable[[CronFile], tuple[_R, bool]]) -> _R:
        """`run(state)` under the lock: (its result, whether it changed `state`), saved when it did.
        The jobs this process's threads hand in while one of them holds the lock run together, one
        after another on one load, and are saved at once: a thousand runs ending in the same moment
        rewrite crons.json a few dozen times, not a thousand (each write rewrites the whole file).
        A job that raises gets its error, and nothing of its batch is saved: the jobs run before it
        fail too (CronStoreError), those after it run in the next batch. The scheduler's only (the
        state is cached, as by `save(cache=True)`)."""
        job = _Job(run)
        with self._jobs_guard:
            self._jobs.append(job)
        with self.lock():
            while not job.done:
                self._run_jobs()
        if job.error is not None:
            raise job.error
        return cast(_R, job.result)

    def _run_jobs(self) -> None:
        """Run the jobs handed in so far on one load and save them at once (call with the lock held);
        the jobs it leaves undone go back to be run next."""
        with self._jobs_guard:
            jobs, self._jobs = self._jobs, []
        try:
            self._run_batch(jobs)
        finally:
            left = [job for job in jobs if not job.done]
            if left:
                with self._jobs_guard:
                    self._jobs[:0] = left

    def _run_batch(self, jobs: Sequence[_Job]) -> None:
        try:
            state = self.load()
        except Exception as exc:  # noqa: BLE001 - each job's own thread raises it
            for job in jobs:
                job.finish(exc)
            return
        changed = False
        for i, job in enumerate(jobs):
            try:
                job.result, moved = job.run(state)
            except Exception as exc:  # noqa: BLE001 - raised by the job's own thread, the batch unsaved
                job.finish(exc)
                for earlier in jobs[:i]:
                    earlier.finish(CronStoreError(f"not saved: a change made with it failed: {exc}"))
                return
            changed = moved or changed
        try:
            if changed:
                self.save(state, cache=True)
            else:
                self.keep(state)
        except Exception as exc:  # noqa: BLE001 - each job's own thread raises it
            for job in jobs:
                job.finish(exc)
            return
        for job in jobs:
            job.finish()

    def advance(
        self,
        task_id: str,
        occurrence: int,
        step: str,
        *,
        final: bool = False,
        recorded: Callable[[], bool] | None = None,
    ) -> bool | None:
        """`CronTask.advance_claim` under the lock, saved when it moved (`combined`): whether this
        process takes `step` of run `occurrence` (True), another one took it (False), or the tasks
        do not follow that run (None: a task removed, a run pushed out of the claims, a claim made
        before progress was kept), for the caller to decide. `recorded()`, asked under the lock for
        a run the tasks do not follow, says whether the run log already holds the step's record:
        then it was taken (False)."""

        def run(state: CronFile) -> tuple[bool | None, bool]:
            task = state.get(task_id)
            moved = None if task is None else task.advance_claim(occurrence, step, final=final)
            if moved is None and recorded is not None and recorded():
                return False, False
            return moved, bool(moved)

        return self.combined(run)

    def advance_many(self, steps: Sequence[tuple[str, int, str]]) -> None:
        """Move each (task id, run, step) as `advance` does, all in one save: a tick that submitted
        thirty runs writes crons.json once, not thirty times (each write rewrites the whole file)."""
        with self.lock():
            state = self.load()
            moved = False
            tasks = {t.id: t for t in state.tasks}
            for task_id, occurrence, step in steps:
                task = tasks.get(task_id)
                moved = (task is not None and task.advance_claim(occurrence, step) is True) or moved
            if moved:
                self.save(state, cache=True)
            else:
                self.keep(state)

    def claim_progress(self, task_id: str, occurrence: int) -> tuple[bool, str | None]:
        """How far run `occurrence` of task `task_id` got, as the tasks say (`CronTask.claim_progress`)."""
        with self.lock():
            state = self.load()
            task = state.get(task_id)
            self.keep(state)
            return (False, None) if task is None else task.claim_progress(occurrence)


# ---------------------------------------------------------------- building a task


_TASK_ID_SHAPE = re.compile(r"cron_[0-9a-f]{12}")  # what new_task_id makes


def validate_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ScheduleError(
            f"invalid task name {shown(name)}: 1-64 characters, letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if _TASK_ID_SHAPE.fullmatch(name):  # commands take an id or a name: this one could be either
        raise ScheduleError(f"invalid task name {shown(name)}: it has the shape of a task id (cron_ and 12 hex digits)")
    return name


_LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")  # in a str every surrogate is a lone one


def lone_surrogate_in(value: Any, where: str = "task") -> str | None:
    """Where a loaded JSON value (`where.key[i]…`) holds a lone surrogate (from a `\\udc80` escape a
    hand edit wrote), in a key or a string; None when it holds none."""
    if isinstance(value, str):
        return where if _LONE_SURROGATE_RE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _LONE_SURROGATE_RE.search(str(key)):
                return f"a key of {where}"
            found = lone_surrogate_in(item, f"{where}.{key}")
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_in(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def validate_prompt(prompt: str) -> str:
    """Text that UTF-8 can encode (no lone surrogate), at most MAX_PROMPT_BYTES of it (ScheduleError
    otherwise: nothing is written)."""
    lone = _LONE_SURROGATE_RE.search(prompt)
    if lone is not None:
        raise ScheduleError(
            f"prompt contains a lone surrogate (U+{ord(lone.group()):04X} at character {lone.start()}), which is not "
            "text: remove it or write the character it was meant to be"
        )
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > MAX_PROMPT_BYTES:
        raise ScheduleError(
            f"prompt too long: {size} bytes in UTF-8, at most {MAX_PROMPT_BYTES} ({MAX_PROMPT_BYTES // MIB} MiB)"
        )
    return prompt


def charged_bytes(line: bytes) -> int:
    """What a task whose line in crons.json is `line` may come to take of the file: the line and the
    room kept for the scheduler's bookkeeping of it (claims, counters, its last error)."""
    return len(line) + BOOKKEEPING_TASK_BYTES


def user_limit(tasks: int) -> int:
    """How large a user's add or change may make the cron tasks of `tasks` tasks: the read limit
    less the room the scheduler's bookkeeping of them may need."""
    return CRONS_MAX_BYTES - BOOKKEEPING_FIXED_BYTES - BOOKKEEPING_TASK_BYTES * tasks


def validate_deliver(target: str | None) -> str | None:
    """`channel:account:chat[:thread]`: exactly what the gateway delivers to (3 or 4 parts, none
    empty; gateway/app.py `deliver_text`), so a target it would refuse at every run is refused
    when the task is made instead."""
    if target is None or target == "":
        return None
    parts = target.split(":")
    if len(parts) not in (3, 4) or not all(parts) or not all(_TARGET_PART_RE.fullmatch(p) for p in parts[:2]):
        raise ScheduleError(
            f"invalid deliver target {shown(target)}: use channel:account:chat or channel:account:chat:thread "
            "(no part empty, none with a ':')"
        )
    if any(_unfit_char(c) for c in target):  # no chat is named so: the channels refuse such ids
        raise ScheduleError(f"invalid deliver target {shown(target)}: a control character or a lone surrogate in it")
    return target


# What a task's `origin` may hold (`CronTask.origin`): channel, account and chat always, thread and
# sender when known; each a platform's id, at most ORIGIN_PART_MAX characters: the longest id a
# first-party channel takes (the webhook's senders, plugins/webhook/adapter.py MAX_FIELD), since a
# sender whom access let in but whose id the task cannot record could schedule nothing.
ORIGIN_KEYS = ("channel", "account", "chat", "thread", "sender")
ORIGIN_REQUIRED = ("channel", "account", "chat")
ORIGIN_PART_MAX = 1024


def validate_origin(origin: Any) -> dict[str, str] | None:
    """A task's `origin` (None: not made from a chat), checked as a hand edit may have left it
    (ScheduleError): an object of ORIGIN_KEYS, channel, account and chat present, every value
    non-empty text of at most ORIGIN_PART_MAX characters without a control character."""
    if origin is None:
        return None
    if not isinstance(origin, dict):
        raise ScheduleError("origin must be an object or null")
    unknown = sorted(str(k)[:40] for k in origin if k not in ORIGIN_KEYS)
    if unknown:
        raise ScheduleError(f"origin has unknown field(s) {', '.join(map(repr, unknown[:3]))}")
    missing = [k for k in ORIGIN_REQUIRED if k not in origin]
    if missing:
        raise ScheduleError(f"origin lacks {', '.join(missing)}")
    for key, value in origin.items():
        if not isinstance(value, str) or not value or len(value) > ORIGIN_PART_MAX:
            raise ScheduleError(f"origin.{key} must be text of 1 to {ORIGIN_PART_MAX} characters")
        if any(_unfit_char(c) for c in value):
            raise ScheduleError(f"origin.{key} holds a control character or a lone surrogate")
    return {k: origin[k] for k in ORIGIN_KEYS if k in origin}


def _unfit_char(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cs")


def validate_conversation(conv: str) -> str:
    if conv in ("new", "default"):
        return conv
    if not conv or len(conv) > 200 or any(c.isspace() for c in conv):
        raise ScheduleError(f"invalid conversation {shown(conv)}: use new, default or a conversation id")
    return conv


_COMPACT: dict[str, Any] = {"separators": (", ", ": "), "ensure_ascii": False}


def new_task_id() -> str:
    return "cron_" + secrets.token_hex(6)


def make_task(
    *,
    name: str,
    agent: str,
    schedule: ScheduleSpec,
    prompt: str,
    now: datetime,
    conversation: str = "new",
    misfire: str = "skip",
    max_lateness_s: float = DEFAULT_MAX_LATENESS_S,
    exact: bool = False,
    deliver: str | None = None,
    enabled: bool = True,
    task_id: str | None = None,
    namespace: str | None = None,
    origin: dict[str, str] | None = None,
) -> CronTask:
    """Validate everything `add` must refuse (ScheduleError, nothing written) and compute the first
    fire time."""
    validate_name(name)
    if not agent or not agent.strip():
        raise ScheduleError("agent must not be empty")
    if not prompt.strip():
        raise ScheduleError("prompt must not be empty")
    validate_prompt(prompt)
    if misfire not in MISFIRE_POLICIES:
        raise ScheduleError(f"invalid misfire policy {shown(misfire)}: use skip, run_once or run_all")
    max_lateness_s = check_lateness(max_lateness_s)
    first = validate_new(schedule, now)
    tid = task_id or new_task_id()
    return CronTask(
        id=tid,
        name=name,
        agent=agent,
        schedule=schedule,
        prompt=prompt,
        created_at=now,
        conversation=validate_conversation(conversation),
        misfire=misfire,
        max_lateness_s=float(max_lateness_s),
        exact=exact,
        deliver=validate_deliver(deliver),
        enabled=enabled,
        next_fire_at=first,
        next_due_at=due_time(schedule, first, task_id=tid, created_at=now, exact=exact),
        updated_at=now,
        namespace=namespace,
        origin=validate_origin(origin),
    )
