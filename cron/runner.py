"""Firing glue shared by the scheduler and `appserver cron run`: claim, envelope, run log, outcome.

The kernel is injected, never imported: callers pass `fire(task, occurrence) -> turn id` and,
optionally, `await_outcome(turn id)` (in the server both are `cron.adapter.KernelAdapter`'s). What
a fire submits is one typed `CronSubmission`. Everything else — the occurrence claim in crons.json,
the envelope text, the run-log records — is done here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from appserver.fsutil import error_text
from cron.envelope import build_envelope
from cron.runlog import delivery_record, highest_occurrence, outcome_record
from cron.store import (
    MISSED_PREFIX,
    CorruptStateFile,
    CronFile,
    CronStore,
    CronStoreError,
    CronTask,
    Occurrence,
    utcnow,
)

log = logging.getLogger("appserver.cron")

DEFAULT_FIRE_TIMEOUT_S = 30.0
DEFAULT_OUTCOME_TIMEOUT_S = 3600.0
FAILED_STATUSES = ("failed", "error", "cancelled", "interrupted", "timeout")


class ClaimUnverifiable(Exception):
    """`ClaimedTurnFn` cannot tell whether a claimed occurrence reached the kernel (the key it
    would be found by may have been purged): it must not be submitted again (at most once)."""


@dataclass(frozen=True, slots=True)
class CronSubmission:
    """Everything the kernel needs to submit the `cron_prompt` turn of one occurrence."""

    agent: str
    conversation: str  # new | default | <conversation id>
    input_text: str  # the envelope followed by the task's prompt
    task_id: str
    task_name: str
    occurrence: Occurrence
    # The channel target (channel:account:chat[:thread]) the final reply is delivered to.
    deliver: str | None
    kind: str = "cron_prompt"

    @classmethod
    def of(cls, task: CronTask, occurrence: Occurrence, agent_name: str | None = None) -> CronSubmission:
        """The submission of `occurrence` of `task`; `agent_name` lets the envelope name the agent
        the way its users do (None: the id is shown)."""
        return cls(
            agent=task.agent,
            conversation=task.conversation,
            input_text=build_envelope(task, occurrence, agent_name),
            task_id=task.id,
            task_name=task.name,
            occurrence=occurrence,
            deliver=task.deliver,
        )

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "cron_task_id": self.task_id,
            "cron_task_name": self.task_name,
            **self.occurrence.to_dict(),
        }

    @property
    def source(self) -> dict[str, Any]:
        """The turn's `source`: kind, the delivery target and the occurrence."""
        return {"kind": self.kind, "deliver": self.deliver, **self.metadata}

    @property
    def idempotency_key(self) -> str:
        """One occurrence is one turn, even if the submit is retried. The separator is a control
        character, which no protocol client can put in a key (appserver/ws/frames.py): a client
        submitting to the task's conversation can never take an occurrence's key. The scheduled
        time is part of it: a run number used again (an older crons.json restored while the run
        log that would have said so was lost) is another occurrence, never the earlier turn."""
        scheduled_ms = int(self.occurrence.scheduled_for.timestamp() * 1000)
        return f"cron\x1f{self.task_id}:{self.occurrence.number}@{scheduled_ms}"

    @property
    def legacy_idempotency_keys(self) -> tuple[str, str]:
        """The keys of an occurrence submitted by an older server (its claim may still be open)."""
        return f"cron\x1f{self.task_id}:{self.occurrence.number}", f"cron:{self.task_id}:{self.occurrence.number}"


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """How a fired turn ended, as reported by the kernel."""

    status: str  # e.g. completed | failed | cancelled
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    reply: str | None = None  # the turn's final text (what `--deliver` sends to a channel)


FireFn = Callable[[CronTask, Occurrence], Awaitable[str | None]]
AwaitOutcomeFn = Callable[[str], Awaitable[TurnOutcome]]
# The turn an occurrence was submitted as, if it was (found by its idempotency key), else None;
# raises ClaimUnverifiable when that can no longer be known.
ClaimedTurnFn = Callable[[CronTask, Occurrence], Awaitable[str | None]]
# Sends a reply to a channel target (`channel:account:chat[:thread]`) through the gateway; returns
# the platform's message ids. Injected by serve when channels run.
DeliverFn = Callable[[str, str], Awaitable[list[str]]]
# Longer than the gateway's own give-up (90 s) and the supervisor's `deliver` timeout (100 s), so
# the run log records the gateway's verdict, never a timeout while the reply may still go out.
DELIVER_TIMEOUT_S = 110.0
Clock = Callable[[], datetime]


def _write_outcome(store: CronStore, task_id: str, occurrence: int, turn_id: str | None, outcome: TurnOutcome) -> None:
    store.runlog.record(
        task_id,
        "outcome",
        occurrence=occurrence,
        turn_id=turn_id,
        status=outcome.status,
        error=outcome.error,
        **({"detail": outcome.detail} if outcome.detail else {}),
    )


def _note_outcome(task: CronTask, occurrence: int, outcome: TurnOutcome, now: datetime) -> bool:
    """A failed run becomes the task's visible error, a later good one clears it (and a missed
    occurrence's): whether the task changed."""
    if outcome.status in FAILED_STATUSES:
        task.set_error(f"run #{occurrence} {outcome.status}: {outcome.error or 'no detail'}", now)
        return True
    if task.last_error and task.last_error.startswith(("run #", MISSED_PREFIX)):
        task.last_error, task.last_error_at = None, None
        return True
    return False


async def take_step(
    store: CronStore,
    task_id: str,
    occurrence: int,
    step: str,
    *,
    final: bool = False,
    unfollowed_ours: bool = True,
    recorded: Callable[[], bool] | None = None,
) -> bool:
    """Whether this process takes `step` of run `occurrence` (records its outcome, sends its reply):
    moved under the store lock (`CronStore.advance`), so of several processes following one run (a
    scheduler that took the lease over, a restarted server, the holder that lost its lease) only
    one does. A run the tasks do not follow (pushed out of the claims, its task removed) is taken
    by this process when `unfollowed_ours` (it fired the run, or recorded its outcome) unless
    `recorded()` (one home, whose run log is everyone's; asked under the lock) says the run log
    already holds the step's record; a store that cannot answer now leaves it to this process."""
    try:
        moved = await asyncio.to_thread(store.advance, task_id, occurrence, step, final=final, recorded=recorded)
    except (CronStoreError, OSError) as exc:
        log.warning("cron: could not record that task %s run #%d is %s: %s", task_id, occurrence, step, error_text(exc))
        return True
    return moved is True or (moved is None and unfollowed_ours)


async def take_recorded_step(
    store: CronStore,
    task_id: str,
    occurrence: int,
    step: str,
    write: Callable[[], object],
    *,
    final: bool = False,
    update: Callable[[CronTask], bool] | None = None,
    recorded: Callable[[], bool] | None = None,
    unfollowed_ours: bool = True,
    write_lost: bool = True,
) -> bool:
    """`take_step` for a step whose record is its run-log line (`write`: an outcome, a
    `delivery_failed`): under the store lock, by the one process that moves the claim to `step`,
    the record is written BEFORE the claim's move is saved. A process killed between the two leaves
    the record with the claim short of it, which a take-over reads as done (`Scheduler._orphan_stage`
    brings the claim up to the run log); never the claim moved on without its record, which nobody
    would write any more. `update(task)` changes the task in the same save (True: it changed).
    `recorded()` (one home, whose run log is everyone's) says whether the run log already holds the
    record: asked, under the lock, when the claim is already past `step`, so a record such a crash
    of an older server lost is written now, and only once. A run the tasks do not follow (pushed
    out of the claims, its task removed) is taken when `unfollowed_ours` and the run log (asked
    by `recorded()`) lacks its record: never a second record of a run another process follows
    too (a restarted server's recovery and a take-over, both following a queued run). Without
    `write_lost`, `recorded()` is asked only of a run the tasks do not follow. Whether this
    process took the step."""
    written = False

    def locked(state: CronFile) -> tuple[bool, bool]:
        """(taken, whether `state` changed), run under the store lock (`CronStore.combined`: the
        records of outcomes ending together are written one by one, their steps saved at once)."""
        nonlocal written
        task = state.get(task_id)
        moved = None if task is None else task.advance_claim(occurrence, step, final=final)
        if moved is None and (not unfollowed_ours or (recorded is not None and recorded())):
            return False, False  # not followed: the run log has it, or its owner writes it
        if moved is False and (recorded is None or not write_lost or recorded()):
            return False, False
        if moved is False:
            log.warning(
                "cron: task %s run #%d is past %s, but the run log lacks its record (a server "
                "stopped between the two): it is written now",
                task_id,
                occurrence,
                step,
            )
        write()  # the record first ...
        written = True
        changed = bool(moved)
        if task is not None and update is not None:
            changed = update(task) or changed
        return True, changed  # ... then the claim's step, saved after it (nothing of `state` is handed out)

    try:
        return await asyncio.to_thread(store.combined, locked)
    except (CorruptStateFile, CronStoreError, OSError) as exc:
        log.warning("cron: could not record that task %s run #%d is %s: %s", task_id, occurrence, step, error_text(exc))
        if not written:  # the store cannot answer now: taken by this process, as `take_step` does
            await asyncio.to_thread(write)
        return True


def _record_fire_failure(store: CronStore, task_id: str, occurrence: int, message: str, now: datetime) -> None:
    with store.lock():
        state = store.load()
        task = state.get(task_id)
        if task is not None:
            task.set_error(f"run #{occurrence} could not be submitted: {message}", now)
            store.save(state, cache=True)
        else:
            store.keep(state)


async def submit_claimed(
    store: CronStore,
    task: CronTask,
    occurrence: Occurrence,
    fire: FireFn,
    *,
    fire_timeout_s: float = DEFAULT_FIRE_TIMEOUT_S,
    clock: Clock = utcnow,
    recovered: bool = False,
    step: bool = True,
) -> tuple[str | None, str | None]:
    """Call `fire` for an occurrence that is already claimed, and log what happened: (turn id, None),
    or (None, the reason nothing was submitted). A failure is recorded (run log + task error) and
    not retried: the occurrence was claimed, so at most once. Never raises: a run-log or crons.json
    failure after the fire is logged, never allowed to stop the other claimed runs of a tick.
    Without `step` the caller moves the claim to `submitted` itself (a tick does it for all its
    runs in one save: `CronStore.advance_many`)."""
    try:
        turn_id = await asyncio.wait_for(fire(task, occurrence), timeout=fire_timeout_s)
    except Exception as exc:  # noqa: BLE001 — any kernel failure must be logged, not kill the loop
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning("cron: task %s run #%d could not be submitted: %s", task.id, occurrence.number, message)
        store.runlog.record(task.id, "fire_failed", occurrence=occurrence.number, error=message)
        await take_step(store, task.id, occurrence.number, "settled", final=True)
        try:
            await asyncio.to_thread(_record_fire_failure, store, task.id, occurrence.number, message, clock())
        except (CronStoreError, OSError) as exc2:
            log.error(
                "cron: could not record the failure of task %s run #%d: %s",
                task.id,
                occurrence.number,
                error_text(exc2),
            )
        return None, message
    extra = {"recovered": True} if recovered else {}  # a claim a dead scheduler left, submitted now
    # the record first, then the step (known cluster-wide from then on): a crash between the two
    # leaves the claim short of the run log, which a take-over brings up to it
    store.runlog.record(task.id, "submitted", occurrence=occurrence.number, turn_id=turn_id, **extra)
    if step:
        await take_step(store, task.id, occurrence.number, "submitted")
    return turn_id, None


async def watch_outcome(
    store: CronStore,
    task_id: str,
    occurrence: int,
    turn_id: str,
    await_outcome: AwaitOutcomeFn,
    *,
    timeout_s: float = DEFAULT_OUTCOME_TIMEOUT_S,
    deliver_to: str | None = None,
    deliver: DeliverFn | None = None,
    delivery_follows: bool = False,
) -> TurnOutcome:
    """Wait (bounded) for the turn to end and record its outcome (`delivery_follows`: the caller
    delivers its reply itself, so the run is not done yet); with `deliver_to`, send the
    final reply there and record how that went (`delivered` or `delivery_failed`). Each only when
    no other process did it already (`take_step`): a run followed by two processes (the scheduler
    that took the lease over and the one that fired it, …) is recorded and delivered once."""
    final = not (deliver_to or delivery_follows)
    outcome, taken = await follow_outcome(
        store, task_id, occurrence, turn_id, await_outcome, timeout_s=timeout_s, final=final
    )
    if deliver_to:
        await deliver_reply(store, task_id, occurrence, turn_id, outcome, deliver_to, deliver, outcome_ours=taken)
    return outcome


async def follow_outcome(
    store: CronStore,
    task_id: str,
    occurrence: int,
    turn_id: str,
    await_outcome: AwaitOutcomeFn,
    *,
    timeout_s: float,
    final: bool,
) -> tuple[TurnOutcome, bool]:
    """Wait (bounded) for the turn to end and `settle` it: (its outcome, whether this process
    recorded it). Of the processes following a run the tasks no longer follow, the one that
    recorded its outcome sends its reply (`deliver_reply`'s `outcome_ours`)."""
    try:
        outcome = await asyncio.wait_for(await_outcome(turn_id), timeout=timeout_s)
    except TimeoutError:
        outcome = TurnOutcome(status="unknown", error=f"no outcome within {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001
        outcome = TurnOutcome(status="unknown", error=f"{type(exc).__name__}: {exc}")
    taken = await settle(store, task_id, occurrence, turn_id, outcome, final=final)
    return outcome, taken


async def settle(
    store: CronStore,
    task_id: str,
    occurrence: int,
    turn_id: str | None,
    outcome: TurnOutcome,
    *,
    final: bool,
    now: datetime | None = None,
) -> bool:
    """Record the run's outcome and move its claim to `settled` (`final`: to done), in that order
    (`take_recorded_step`): whatever instant a process is killed at, the outcome is in the run log
    once. Only by the process that takes the step; on one home a claim already past it whose
    outcome the run log lacks (an older server stopped between the two) gets it now."""
    moment = now or utcnow()

    def recorded() -> bool:
        try:
            return outcome_record(store.runs_dir, task_id, occurrence) is not None
        except (OSError, ValueError) as exc:  # cannot tell: never record it twice
            log.warning("cron: could not read the run log of task %s: %s", task_id, exc)
            return True

    return await take_recorded_step(
        store,
        task_id,
        occurrence,
        "settled",
        lambda: _write_outcome(store, task_id, occurrence, turn_id, outcome),
        final=final,
        update=lambda task: _note_outcome(task, occurrence, outcome, moment),
        recorded=None if store.shared else recorded,
    )


async def deliver_reply(
    store: CronStore,
    task_id: str,
    occurrence: int,
    turn_id: str,
    outcome: TurnOutcome,
    target: str,
    deliver: DeliverFn | None,
    *,
    outcome_ours: bool = True,
) -> None:
    """Send a finished run's reply to its channel target; the run log says what happened. Only by
    the process that moves the run to `delivering` (`take_step`): a reply is sent at most once
    across the servers sharing the tasks, and the run is `done` once the result is recorded. A
    run the tasks no longer follow is delivered by the process that recorded its outcome
    (`outcome_ours`), and on one home never when its run log already says where the reply went."""
    if not await take_step(
        store,
        task_id,
        occurrence,
        "delivering",
        unfollowed_ours=outcome_ours,
        recorded=None if store.shared else lambda: _delivery_recorded(store, task_id, occurrence),
    ):
        log.info("cron: task %s run #%d: its reply is delivered by another process", task_id, occurrence)
        return
    await _deliver_once(store, task_id, occurrence, turn_id, outcome, target, deliver)
    # (a process stopped while sending leaves it `delivering`: who takes over says so, never resends)
    await take_step(store, task_id, occurrence, "done", final=True)


async def _deliver_once(
    store: CronStore,
    task_id: str,
    occurrence: int,
    turn_id: str,
    outcome: TurnOutcome,
    target: str,
    deliver: DeliverFn | None,
) -> None:
    error: str | None = None
    if deliver is None:
        error = "channels are not running in this server (enable the channel and restart serve)"
    elif outcome.status != "completed":
        error = f"not delivered: the run {outcome.status}"
    elif not (outcome.reply or "").strip():
        error = "not delivered: the run produced no reply text"
    else:
        try:
            ids = await asyncio.wait_for(deliver(target, str(outcome.reply)), DELIVER_TIMEOUT_S)
        except TimeoutError:
            error = f"the gateway did not answer within {DELIVER_TIMEOUT_S:g} s; the reply may still arrive"
        except Exception as exc:  # noqa: BLE001 - a failed delivery is recorded, never raised into the loop
            error = str(exc) or type(exc).__name__  # the reason, as the docs show it: no class name before it
        else:
            store.runlog.record(
                task_id,
                "delivered",
                occurrence=occurrence,
                turn_id=turn_id,
                target=target,
                remote_ids=ids,
            )
            return
    log.warning("cron: task %s run #%d: reply to %s %s", task_id, occurrence, target, not_delivered_text(error))
    store.runlog.record(task_id, "delivery_failed", occurrence=occurrence, turn_id=turn_id, target=target, error=error)


def not_delivered_text(error: str) -> str:
    """`error` said after "reply to TARGET": "not delivered: WHY", the prefix once (the reasons
    recorded in the run log begin with it, or do not)."""
    return error if error.startswith("not delivered") else f"not delivered: {error}"


def _delivery_recorded(store: CronStore, task_id: str, occurrence: int) -> bool:
    """Does the home's run log say where the reply of run `occurrence` went? (Cannot tell: yes,
    a reply is never sent twice.)"""
    try:
        return delivery_record(store.runs_dir, task_id, occurrence) is not None
    except (OSError, ValueError) as exc:
        log.warning("cron: could not read the run log of task %s: %s", task_id, exc)
        return True


def claim_manual(store: CronStore, ref: str, *, agent: str | None, now: datetime) -> tuple[CronTask, Occurrence]:
    """Claim a "run now" occurrence: bump the run counter and log `fired`, leaving the schedule
    (next_fire_at) alone. Needs no lease: it is an extra run, not a scheduled one."""
    with store.lock():
        state = store.load()
        task = state.find(ref, agent)
        used = highest_occurrence(store.runs_dir, task.id)  # a rolled-back counter reuses no number
        occ = task.claim(now, now, now, manual=True, floor=used)
        task.updated_at = now
        copy = dataclasses.replace(task)  # handed out; the cached state stays the store's
        store.save(state, cache=True)  # the claim first: a log failure never unclaims nor refires
        store.runlog.record(task.id, "fired", **occ.to_dict())
    return copy, occ


@dataclass(frozen=True, slots=True)
class RunNowResult:
    task: CronTask
    occurrence: Occurrence
    turn_id: str | None
    outcome: TurnOutcome | None
    error: str | None = None  # why no turn was submitted (turn_id None)


async def run_task_now(
    home: Path | CronStore,
    ref: str,
    *,
    fire: FireFn,
    agent: str | None = None,
    clock: Clock = utcnow,
    await_outcome: AwaitOutcomeFn | None = None,
    fire_timeout_s: float = DEFAULT_FIRE_TIMEOUT_S,
    outcome_timeout_s: float = DEFAULT_OUTCOME_TIMEOUT_S,
    deliver: DeliverFn | None = None,
) -> RunNowResult:
    """`appserver cron run N` in-process: claim, fire (envelope and submit), and (when
    `await_outcome` is given) wait for the turn and log its outcome."""
    store = home if isinstance(home, CronStore) else CronStore(home)
    task, occ = await asyncio.to_thread(claim_manual, store, ref, agent=agent, now=clock())
    turn_id, error = await submit_claimed(store, task, occ, fire, fire_timeout_s=fire_timeout_s, clock=clock)
    outcome = None
    if turn_id is not None and await_outcome is not None:
        outcome = await watch_outcome(
            store,
            task.id,
            occ.number,
            turn_id,
            await_outcome,
            timeout_s=outcome_timeout_s,
            deliver_to=task.deliver,
            deliver=deliver,
        )
    await asyncio.to_thread(store.runlog.flush)
    return RunNowResult(task, occ, turn_id, outcome, error)
