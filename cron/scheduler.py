"""The scheduler: one per home dir (whoever holds the lease). It sleeps until the earliest due time
of its tasks, so a task fires within a second of when it is due; a tick on every `tick_s` boundary
(minute boundaries by default) stays as the backstop, and a change of crons.json by another
process (`appserver cron add`, …) wakes it at once (the file's signature is watched every
`watch_s`).

A tick, under the crons.json lock: verify or claim the lease (without it, do nothing; the next tick
tries again, and meanwhile the holder it saw is judged again every LEASE_CHECK_S, without the lock:
once it is gone, the scheduler ticks at once, so a survivor takes over about a second after the
holder is judged dead, not at its next backstop tick); for each enabled task that is due,
list the occurrences that came due, apply the task's misfire policy, and CLAIM what will run —
advance `next_fire_at`, bump the run counter, record `last_claimed`, and save — before any turn is
submitted. A crash after the claim therefore loses that occurrence instead of running it twice.
Then, outside the lock, `fire(task, occurrence)` submits each claimed occurrence, and one save
moves them all to `submitted` (one crons.json write per tick, not one per run: thirty tasks due
together are all submitted within their second).

Runs of a task never overlap: an occurrence due while the task's previous run (followed here) is
still queued or running is skipped and recorded as `missed` ("skipped (previous run #N still
running)"), so a run slower than its interval cannot pile turns up in its conversation's queue; a
`run_all` catch-up's runs, all claimed in one tick, are submitted one after another, each once the
one before it has its outcome (`_start_in_turn`), and count as queued until then. A
run of a task removed or disabled since is dropped from its queue if it has not started
(`withdraw`); a started one finishes. A missed occurrence becomes the task's last error (a one-shot
whose run was missed shows the state `missed`) and one warning in the log.

The order is claim (saved), run-log records, submit. A save that fails fires and logs nothing (the
next tick claims again, FAILED_TICK_RETRY_S later: a failure that lasts is retried, never spun on,
and what the failed ticks found, a missed occurrence, is said once, by the tick that saves it); a
run-log record that fails is kept and retried (cron.runlog.RunLog) while the run still fires, so no
failure can lose a claimed run or fire it twice.

A server of a cluster that is judged gone (fenced: `LeaseHolder.fenced`) runs no cron: its tick
takes no lease and claims nothing, even with the lease in its name, and a run it claimed before
it was found fenced is not fired (its kernel would refuse it, and the run would be lost as
failed): the claim stays open for the server that takes the lease over, which adopts it.

A scheduler that takes the lease over from a dead one resolves what that one claimed last: where
the progress kept with the claim says it got (on one home, as far as the run log agrees: a reply
still to send is sent, one that was being sent is recorded `delivery_failed`, never sent twice),
else by the run log (durable: it names the turn), else by the kernel's idempotency key; when none
can tell (the key may have been purged, `ClaimUnverifiable`) the run is recorded as missed, never
refired. One that never reached the kernel is submitted, unless its task was disabled or removed
since: then it ends `cancelled`, not started, as a waiting run does (a task removed or disabled
while no scheduler ran had such runs cancelled by `cron remove`/`disable` itself, since a removed
task's claims are gone with it: `CronStore._cancel_waiting_runs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from appserver.fsutil import error_text
from cron.credentials import CredentialCheck, TokenCredentials
from cron.lease import DEFAULT_LEASE_TTL_S, MAX_LEASE_TTL_S, LeaseHolder
from cron.runlog import (
    aware_time,
    delivery_record,
    has_fired,
    prune_removed_logs,
    settled_record,
    unrecorded_turns,
    unsettled_claims,
    used_runs,
)
from cron.runner import (
    DEFAULT_FIRE_TIMEOUT_S,
    DEFAULT_OUTCOME_TIMEOUT_S,
    AwaitOutcomeFn,
    ClaimedTurnFn,
    ClaimUnverifiable,
    Clock,
    DeliverFn,
    FireFn,
    RunNowResult,
    TurnOutcome,
    deliver_reply,
    follow_outcome,
    not_delivered_text,
    run_task_now,
    settle,
    submit_claimed,
    take_recorded_step,
    take_step,
    watch_outcome,
)
from cron.schedule import ScheduleError, due_time, next_occurrence, parse_duration
from cron.store import (
    MISSED_PREFIX,
    NOT_STARTED_DISABLED,
    NOT_STARTED_REMOVED,
    CorruptStateFile,
    CronFile,
    CronStore,
    CronStoreError,
    CronTask,
    Occurrence,
    OwnerRecord,
    utcnow,
)
from cron.stores import cron_store_for

AgentNamesFn = Callable[[], Awaitable[dict[str, str]]]  # agent id -> name, read from the server's store
# Drop a submitted turn from its conversation's queue if it has not started (turn id, why): whether
# it was dropped. A started turn is left to finish.
WithdrawFn = Callable[[str, str], Awaitable[bool]]

log = logging.getLogger("appserver.cron")

RUN_ALL_CAP = 10  # run_all claims at most this many catch-up runs per task per tick (run one after another)
MAX_ENUMERATE = 1000  # missed occurrences listed one by one before the rest are summarised
CATCH_UP_AFTER_S = 2.0  # a run this late past its due time fires after downtime: "catch-up"
WATCH_S = 0.25  # how often the sleeping scheduler looks whether crons.json changed
MIN_TICK_GAP_S = 0.5  # due-time ticks are at least this far apart (each that fires saves crons.json)
PROBLEM_LOG_EVERY_S = 60.0  # a lasting problem (corrupt crons.json, …) is logged this often
# The backstop tick's range (config `cron.tick_s` is held to the same): a shorter one only busies
# the scheduler, a longer one would delay a take-over and overflow date arithmetic.
MIN_TICK_S = 0.1
MAX_TICK_S = 3600.0
# A scheduler without the lease judges the holder it last saw this often (a pid check on one host,
# a query of its instance row in a cluster), independent of tick_s: once the holder is judged gone
# (dead, or its lease expired), it ticks at once and takes the lease over under the store lock.
LEASE_CHECK_S = 1.0
LOOP_ERROR_PAUSE_S = 5.0  # after an unexpected error in the loop itself, pause this long and go on
# A tick whose save failed (a full disk, …) is tried again this soon (at the latest the backstop),
# so a run it could not claim fires late once writes work again, not a whole tick later.
FAILED_TICK_RETRY_S = 2.0
# A time this far ahead of the clock was set by a clock that was ahead (or has since been put back):
# a scheduled run is never claimed early and a one-shot at most ONESHOT_JITTER_EARLY_S early.
CLOCK_SLACK_S = 120.0
# The logs of tasks removed more than REMOVED_LOG_RETENTION_S ago are deleted at the first tick, then
# this often (`prune_removed_logs`), as the gateway prunes its settled ledger rows
PRUNE_LOGS_EVERY_S = 3600.0


def _claimed_at(task: CronTask) -> datetime | None:
    """When the task's last run was claimed (None when unknown)."""
    return aware_time((task.last_claimed or {}).get("claimed_at"))


def _stamped_after(task: CronTask, limit: datetime, limit_utc: str) -> bool:
    """Is a time stamped on the task (made, changed, claimed) later than `limit` (`limit_utc`: its
    UTC ISO text)? Cheap: asked of every task at every tick (a claim time in UTC, as the scheduler
    writes it, is compared as text)."""
    if task.created_at > limit or (task.updated_at is not None and task.updated_at > limit):
        return True
    value = (task.last_claimed or {}).get("claimed_at")
    if not isinstance(value, str):
        return False
    if value.endswith("+00:00"):
        return value > limit_utc  # the same shape: the text compares as the time does
    claimed = _claimed_at(task)
    return claimed is not None and claimed > limit


def _check_seconds(name: str, value: float, low: float, high: float) -> float:
    """A duration argument: finite and in range, else ValueError (never a stalled or dead loop)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low:g} to {high:g} seconds, got {value!r}")
    return float(value)


_Missed = tuple[datetime, str]  # nominal time, reason
_ABSENT = object()  # no entry (in the journal of a tick)


def apply_misfire(
    policy: str,
    due: list[tuple[datetime, datetime]],
    now: datetime,
    max_lateness: timedelta,
    run_all_cap: int = RUN_ALL_CAP,
    catch_up_after: timedelta = timedelta(seconds=CATCH_UP_AFTER_S),
    running_since: datetime | None = None,
) -> tuple[list[tuple[datetime, datetime, bool]], list[_Missed]]:
    """Split the (nominal, due) occurrences that came due, oldest first, into runs
    (nominal, due, catch_up) and misses. One tick sees several only after downtime (the scheduler
    wakes at every due time), so:
    `skip` runs at most the most recent occurrence that is at most `max_lateness` late, and records
    the others as missed (a lateness below `catch_up_after` counts as that: a run the scheduler
    starts on time, a few ms past its due time, is on time, so `--max-lateness 0s` means "never
    late", not "never"); `run_once` runs only the most recent one, however late; `run_all` runs
    them all, keeping the most recent `run_all_cap`. Every run later than `catch_up_after` past its
    due time fired after downtime and is labelled catch-up. `running_since`: since when the
    scheduler has been running (holding the lease); an occurrence due after it was missed because
    the scheduler fell behind, not because it was down, and its reason says so."""

    def run(o: tuple[datetime, datetime]) -> tuple[datetime, datetime, bool]:
        return (o[0], o[1], now - o[1] > catch_up_after)

    if not due:
        return [], []
    if policy == "run_all":
        cap = max(1, run_all_cap)
        runs = [run(o) for o in due[-cap:]]
        missed = [(n, f"beyond the run_all cap of {cap} catch-up runs") for n, _ in due[:-cap]]
        return runs, missed
    if policy == "run_once":
        missed = [(n, "coalesced into one run of the most recent occurrence (misfire=run_once)") for n, _ in due[:-1]]
        return [run(due[-1])], missed
    # skip, and anything unknown: never run late work by accident
    window = max(max_lateness, catch_up_after)
    limit = window.total_seconds()
    on_time = [o for o in due if now - o[1] <= window]
    missed = []
    for n, d in due:
        down = running_since is None or d < running_since
        if now - d > window:
            why = "the scheduler was not running" if down else "the scheduler could not keep up"
            late = f"late by {(now - d).total_seconds():.0f} s (> max lateness {limit:g} s; misfire=skip)"
            missed.append((n, f"{late}: {why}"))
        elif (n, d) != on_time[-1]:
            missed.append((n, _coalesced_reason(limit, down)))
    return ([run(on_time[-1])] if on_time else []), missed


def _coalesced_reason(limit: float, down: bool) -> str:
    """Why an occurrence within the lateness window was skipped for a later one (misfire=skip):
    after downtime, or because the scheduler fell behind while it ran."""
    if down:
        return (
            "skipped: after downtime only the most recent occurrence within the max "
            f"lateness of {limit:g} s runs (misfire=skip)"
        )
    return (
        "skipped: a later occurrence came due before this one was started (the scheduler fell "
        f"behind); only the most recent within the max lateness of {limit:g} s runs (misfire=skip)"
    )


@dataclass(slots=True)
class _Planned:
    task: CronTask
    occurrence: Occurrence
    adopted: bool = False  # a run a stopped scheduler claimed (resolved as such: `_submit_orphan`)


# What a tick may change besides its journal (`_used`, `_fits`): kept before it plans, put back
# when it fails (`Scheduler._claim_due`, `_undo_tick`). One list, so the two never drift apart.
_TICK_STATE = (
    "has_lease",
    "_next_due",
    "_renew_at",
    "lease_state",
    "_orphans",
    "_adopting",
    "_invalid",
    "_held_since",
)


def _missed_error(missed: list[_Missed]) -> str:
    """The task's last error for the occurrences a tick missed: the latest and its reason."""
    nominal, reason = missed[-1]
    when = nominal.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    more = f" (and {len(missed) - 1} earlier)" if len(missed) > 1 else ""
    return f"{MISSED_PREFIX}the run scheduled for {when}{more}: {reason}"


@dataclass(slots=True)
class TickReport:
    """What one tick did (for tests, logs and the benchmark)."""

    has_lease: bool = False
    fired: list[tuple[str, int, str | None]] = field(default_factory=list)  # task id, number, turn id
    missed: int = 0
    errors: list[str] = field(default_factory=list)


class Scheduler:
    """Fires due cron tasks through an injected `fire(task, occurrence) -> turn id | None`.

    `clock` returns an aware datetime (faked in tests). `await_outcome(turn_id)`, when given, waits
    for a fired turn to end; its result goes to the run log.
    """

    def __init__(
        self,
        home: Path | CronStore,
        *,
        fire: FireFn,
        clock: Clock = utcnow,
        tick_s: float = 60.0,
        await_outcome: AwaitOutcomeFn | None = None,
        deliver: DeliverFn | None = None,
        fire_timeout_s: float = DEFAULT_FIRE_TIMEOUT_S,
        outcome_timeout_s: float = DEFAULT_OUTCOME_TIMEOUT_S,
        run_all_cap: int = RUN_ALL_CAP,
        lock_timeout_s: float | None = None,
        watch_s: float = WATCH_S,
        problem_log_every_s: float = PROBLEM_LOG_EVERY_S,
        claimed_turn: ClaimedTurnFn | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        credentials: CredentialCheck | None = None,
        agent_names: AgentNamesFn | None = None,
        before_recovered_delivery: Callable[[], Awaitable[None]] | None = None,
        withdraw: WithdrawFn | None = None,
    ) -> None:
        if isinstance(home, CronStore):
            self.store = home
        elif lock_timeout_s is not None:
            self.store = CronStore(home, lock_timeout_s=lock_timeout_s)
        else:
            self.store = CronStore(home)
        self.fire = fire
        self.clock = clock
        self.tick_s = _check_seconds("tick_s", tick_s, MIN_TICK_S, MAX_TICK_S)
        self.await_outcome = await_outcome
        self.deliver = deliver
        self.fire_timeout_s = _check_seconds("fire_timeout_s", fire_timeout_s, 0.001, 86400)
        self.outcome_timeout_s = _check_seconds("outcome_timeout_s", outcome_timeout_s, 0.001, 366 * 86400)
        self.run_all_cap = max(1, run_all_cap)
        self.watch_s = _check_seconds("watch_s", watch_s, 0.01, 60)
        self.problem_log_every_s = problem_log_every_s
        ttl = _check_seconds("lease_ttl_s", lease_ttl_s, 1, MAX_LEASE_TTL_S)  # as others judge it
        self.lease = LeaseHolder(self.store, started_at=clock(), ttl_s=ttl)
        self.has_lease = False
        self.started_at = utcnow()  # real time, as run-log records are stamped
        self._watchers: set[asyncio.Task[TurnOutcome]] = set()
        # A run_all catch-up's claimed runs waiting for the run before them (`_start_in_turn`)
        self._chains: set[asyncio.Task[None]] = set()
        self._in_turn: set[tuple[str, int]] = set()
        # (task id, run number) -> the watcher that records its outcome and sends its reply: one
        # per run in this process, whichever path (a fire, a take-over, a restart's recovery) asks
        self._following: dict[tuple[str, int], asyncio.Task[TurnOutcome]] = {}
        self._next_due: datetime | None = None  # earliest due time of an enabled task (lease held)
        self.claimed_turn = claimed_turn
        # Why the credential a task was made for is gone or may not use its agent (None: it may),
        # asked at fire time; a limit by agent name is checked against the names read each tick
        self.credentials = credentials
        self.agent_names = agent_names
        # Awaited before the reply of a run taken over from a scheduler that stopped is sent (the
        # server waits until its channels run: its first tick comes before its gateway is up)
        self.before_recovered_delivery = before_recovered_delivery
        self._agent_name: dict[str, str] = {}  # agent id -> name, as read at the last tick
        # A run of a task removed or disabled since it was submitted is dropped from its queue if
        # it has not started (`withdraw`); (task id, run) -> its turn, of the runs followed here
        self.withdraw = withdraw
        self._turn_of: dict[tuple[str, int], str] = {}
        self._withdrawing: list[tuple[tuple[str, int], str, str]] = []  # found by the tick: key, turn, why
        self._withdrawn: dict[str, str] = {}  # turn id -> why it was dropped (its outcome's error)
        # The runs a later occurrence was skipped behind (overlap), and the tasks whose overlap the
        # log said: once, until one of the task's runs ends with nothing skipped behind it
        self._overlap_noted: set[tuple[str, int]] = set()
        self._overlap_said: set[str] = set()
        # Since when this scheduler holds the lease: an occurrence due after it that is missed was
        # missed while the scheduler ran (it fell behind), not during downtime
        self._held_since: datetime | None = None
        # Occurrences a dead scheduler claimed (the lease was taken over from it this tick): each is
        # submitted now unless it reached the kernel (the idempotency key makes that exactly once).
        self._orphans: list[tuple[CronTask, list[Occurrence]]] = []
        # (task id, run number) of those claims while the take-over tick plans (outcomes followed
        # here only): resolved right after it, the ones never submitted count as queued meanwhile
        self._adopting: frozenset[tuple[str, int]] = frozenset()
        # Runs claimed (or adopted) here whose fire was held back because this server was found
        # fenced after the claim: fired once it is live again and still held the lease throughout,
        # else left to the server that took the lease over (it adopts them with the lease)
        self._deferred: list[_Planned] = []
        self._held_through = False  # the last tick found the lease held by this process already
        # task id -> (the highest run number used, the latest scheduled time run), by this process's
        # claims, else the run log's: a task rolled back by restoring an older crons.json neither
        # reuses a run number nor runs an occurrence again.
        self._used: dict[str, tuple[int, datetime | None]] = {}
        # While a tick plans: what `_used` and `_fits` held before it changed them (_ABSENT: no
        # entry), so a tick whose save fails leaves no trace in memory (see `_undo_tick`)
        self._journal: dict[tuple[str, str], Any] | None = None
        # While a tick plans: the log lines it has to say, said once its claim is saved (`_say`)
        self._said: list[tuple[int, str, tuple[Any, ...]]] | None = None
        # Monotonic time before which the loop does not tick again after a tick that failed: a
        # failure that lasts (a full disk, a read-only crons.json) is retried, never spun on
        self._retry_at = 0.0
        self._last_tick: datetime | None = None
        # The clock went back since the last tick: every recurring task's next time is checked
        self._clock_back = False
        self._clock_back_unsaved = False  # … and the tick that saw it could not save
        # task id -> (next_fire_at, now) of a next time found to fit the schedule at that now: it
        # still does at every later now, so it is not computed again
        self._fits: dict[str, tuple[datetime, datetime]] = {}
        # (now, now + CLOCK_SLACK_S, that in UTC ISO text): the limit of `_clock_check`, per tick
        # The tasks as last looked at, and whether this tick looks at their time stamps: only when
        # they were read anew (the first tick, a change by another process), not the kept ones
        self._stamps_seen: CronFile | None = None
        self._look_at_stamps = True
        self._stamp_limit: tuple[datetime, datetime, str] | None = None
        self._seen: tuple[int, int, int] | None = None  # crons.json signature after our last look
        self._tick_error: str | None = None
        self._loop_error: str | None = None  # the loop itself failed (outside a tick)
        self._invalid: str | None = None  # tasks kept in crons.json but not scheduled
        self._problem_logged: tuple[str, float] | None = None  # (text, monotonic time)
        self._renew_at = math.inf  # monotonic time our lease heartbeat is due (lease held)
        self.lease_state: str | None = None  # who holds the lease, as seen by the last tick
        # The holder the last tick found holding the lease (None: this process holds it, or no tick
        # has read it yet), and when the sleeping loop judges it again (monotonic; `_sleep`)
        self._holder_seen: OwnerRecord | None = None
        self._holder_check_at = 0.0
        self.alive_at = time.monotonic()  # the loop's own heartbeat, for readiness
        self._pruned_at: float | None = None  # monotonic time of the last `_prune_logs`

    @classmethod
    def from_config(cls, cfg: Any, *, fire: FireFn, **kwargs: Any) -> Scheduler:
        """Build from `appserver.config.Config` (home, cron.tick_s). The caller checks
        `cfg.cron.enabled` (APPSERVER_DISABLE_CRON=1) and does not start one when it is off. The
        home's token store says whether a task's credential still exists."""
        kwargs.setdefault("credentials", TokenCredentials.for_home(cfg.home, cfg.store.url))
        return cls(
            cron_store_for(cfg.home, cfg.store.url),
            fire=fire,
            tick_s=cfg.cron.tick_s,
            lease_ttl_s=cfg.cron.lease_ttl_s,
            **kwargs,
        )

    # ------------------------------------------------------------ the tick

    async def tick(self) -> TickReport:
        """One pass: lease, claim what is due (saved before firing), then fire it."""
        report = TickReport()
        now = self.clock()
        before, self._last_tick = self._last_tick, now
        # (a clock found gone back by a tick that failed is checked again by the next one)
        self._clock_back = self._clock_back_unsaved or (
            before is not None and now < before - timedelta(seconds=CLOCK_SLACK_S)
        )
        self._clock_back_unsaved = False
        if self._clock_back:
            assert before is not None
            log.warning(
                "cron: the clock went back by %s since the last tick (from %s to %s); every recurring "
                "task's next run is checked against its schedule",
                before - now,
                before.isoformat(),
                now.isoformat(),
            )
        if self.credentials is not None and self.agent_names is not None:
            await self._read_agent_names()
        planned = await asyncio.to_thread(self._claim_due, now, report)
        orphans, self._orphans, self._adopting = self._orphans, [], frozenset()
        deferred = self._take_deferred()
        for task, claims in orphans:
            for occurrence in await asyncio.to_thread(self._orphan_occurrences, task, claims):
                deferred.append(_Planned(task, occurrence, adopted=True))
        submitted: list[tuple[str, int, str]] = []
        held_back: list[_Planned] = []
        in_turn: dict[str, list[_Planned]] = {}  # task id -> its runs that wait for the one before
        for item in deferred + planned:
            if held_back or await self._fenced_now():  # (every fire is after an await: judged again)
                held_back.append(item)
                continue
            if self._waits_turn(item.task.id, in_turn):
                in_turn.setdefault(item.task.id, []).append(item)
                continue
            if item.adopted:
                await self._submit_orphan(item.task, item.occurrence, report)
                continue
            turn_id, _ = await submit_claimed(
                self.store,
                item.task,
                item.occurrence,
                self.fire,
                fire_timeout_s=self.fire_timeout_s,
                clock=self.clock,
                step=False,
            )
            report.fired.append((item.task.id, item.occurrence.number, turn_id))
            if turn_id is not None:
                submitted.append((item.task.id, item.occurrence.number, "submitted"))
                if self.await_outcome is not None:
                    self._watch(item.task.id, item.occurrence.number, turn_id, item.task.deliver)
        await self._mark_submitted(submitted)
        self._hold_back(held_back)
        for items in in_turn.values():
            self._start_in_turn(items)
        await self._withdraw_runs()
        await self._prune_logs()
        return report

    async def _prune_logs(self) -> None:
        """Delete the run logs of tasks removed long ago (`prune_removed_logs`), at the first tick
        and then every PRUNE_LOGS_EVERY_S; never fails the tick (a failure is logged, tried again
        then). The ids crons.json holds are read first: a task it holds keeps its log. Judged by the
        wall clock, as the records' times and the files' are written (not the injected clock)."""
        if self._pruned_at is not None and time.monotonic() - self._pruned_at < PRUNE_LOGS_EVERY_S:
            return
        self._pruned_at = time.monotonic()

        def prune() -> None:
            state = self.store.read()
            live = {t.id for t in state.tasks} | {bad.id for bad in state.invalid}
            prune_removed_logs(self.store.runs_dir, live, datetime.now(UTC))

        try:
            await asyncio.to_thread(prune)
        except (CorruptStateFile, CronStoreError, OSError) as exc:
            log.warning("cron: could not prune the run logs of removed tasks: %s", error_text(exc))

    # ------------------------------------------------------------ catch-ups, one after another

    def _waits_turn(self, task_id: str, in_turn: dict[str, list[_Planned]]) -> bool:
        """Does a claimed run of `task_id` wait for the task's run before it to end? Runs of one
        task never overlap: a `run_all` catch-up claims several runs in one tick (so each is
        claimed, logged and adopted by a take-over exactly once), and submits them one after
        another; so does a take-over with the runs it adopts. Without outcomes followed here
        (`await_outcome`) nothing can tell when a run ends, so they are all submitted at once."""
        if self.await_outcome is None:
            return False
        return task_id in in_turn or self._follows_run_of(task_id)

    def _follows_run_of(self, task_id: str, below: int | None = None) -> bool:
        """Is a run of `task_id` (numbered below `below`) followed here and not ended yet?"""
        return any(
            key[0] == task_id and (below is None or key[1] < below) and not watcher.done()
            for key, watcher in self._following.items()
        )

    def _start_in_turn(self, items: list[_Planned]) -> None:
        """Submit a task's claimed runs one after another, each once the one before it ended
        (outside the tick: other tasks' runs fire on time meanwhile). Until submitted they count as
        queued (`_running_run`), so an occurrence due meanwhile is skipped, never run beside them."""
        keys = {(i.task.id, i.occurrence.number) for i in items}
        self._in_turn |= keys
        chain = asyncio.create_task(self._submit_in_turn(items))
        self._chains.add(chain)

        def ended(done: asyncio.Task[None]) -> None:
            self._chains.discard(done)
            self._in_turn -= keys

        chain.add_done_callback(ended)

    async def _submit_in_turn(self, items: list[_Planned]) -> None:
        """Each run once the task's run before it ended; held back when this server is fenced
        (`_hold_back`: the claims stay open for a take-over), settled as cancelled when its task was
        removed or disabled meanwhile (it never started). A stop leaves the rest claimed: the
        scheduler that takes the lease over adopts and submits them (`_submit_orphan`)."""
        for n, item in enumerate(items):
            task, occ = item.task, item.occurrence
            while self._follows_run_of(task.id, below=occ.number):
                running = [w for k, w in self._following.items() if k[0] == task.id and k[1] < occ.number]
                await asyncio.wait(running)
            if await self._fenced_now():
                self._in_turn -= {(i.task.id, i.occurrence.number) for i in items[n:]}
                self._hold_back(items[n:])
                return
            if item.adopted:  # a stopped scheduler's claim: resolved as such, submitted only if never
                await self._submit_orphan(task, occ, TickReport())
                self._in_turn.discard((task.id, occ.number))
                continue
            why = await asyncio.to_thread(self._stopped_why, task.id)
            if why is not None:
                log.info("cron: task %s run #%d not submitted: %s", task.id, occ.number, why)
                await settle(self.store, task.id, occ.number, None, TurnOutcome("cancelled", error=why), final=True)
                self._in_turn.discard((task.id, occ.number))
                continue
            turn_id, _ = await submit_claimed(
                self.store, task, occ, self.fire, fire_timeout_s=self.fire_timeout_s, clock=self.clock
            )
            if turn_id is not None and self.await_outcome is not None:
                self._watch(task.id, occ.number, turn_id, task.deliver)
            self._in_turn.discard((task.id, occ.number))

    def _stopped_why(self, task_id: str) -> str | None:
        """Why a run of `task_id` waiting for its turn is not to start (removed or disabled since
        it was claimed), or None. Blocking file I/O."""
        try:
            task = self.store.read().get(task_id)
        except (CorruptStateFile, CronStoreError, OSError):
            return None  # cannot tell: the run goes on, as one submitted before would have
        if task is None:
            return NOT_STARTED_REMOVED
        if not task.enabled:
            return NOT_STARTED_DISABLED
        return None

    async def _fenced_now(self) -> bool:
        """Is this server fenced (judged gone by its cluster, or about to be) right now? Asked
        before every fire: its kernel would refuse the run, which would then be lost as failed.
        A database that cannot answer counts as fenced (the run waits: it is never lost)."""
        if not self.store.instance_id:  # no cluster: nothing fences this process
            return False
        try:
            return await asyncio.to_thread(self.lease.fenced)
        except (CorruptStateFile, CronStoreError, OSError) as exc:
            log.warning("cron: cannot tell whether this server is still live in its cluster: %s", exc)
            return True

    def _hold_back(self, items: list[_Planned]) -> None:
        """Keep claimed runs this tick did not fire because this server was fenced: their claims
        stay open, so whoever takes the lease over adopts and submits them (exactly once, by the
        kernel's idempotency key); this process fires them itself if it is live again first."""
        if not items:
            return
        self._deferred.extend(items)
        log.warning(
            "cron: this server is judged gone by its cluster, or its database session is away: %d claimed run(s) "
            "(%s) are not fired now; they stay claimed for the server that takes the scheduler over",
            len(items),
            ", ".join(f"{i.task.id} #{i.occurrence.number}" for i in items),
        )

    def _take_deferred(self) -> list[_Planned]:
        """The runs held back by a fence (`_hold_back`), to fire now: only when this process held
        the lease throughout (a server that took it over meanwhile adopted and resolved them, so
        they are dropped here); kept while this process holds no lease."""
        if not self.has_lease or not self._deferred:
            return []
        deferred, self._deferred = self._deferred, []
        return deferred if self._held_through else []

    async def _mark_submitted(self, steps: list[tuple[str, int, str]]) -> None:
        """Move the tick's submitted runs to `submitted` in one save (each is in the run log
        already: a crash before this save leaves claims short of it, which a take-over brings up
        to the run log or finds by the kernel's idempotency key, never submitting one twice)."""
        if not steps:
            return
        try:
            await asyncio.to_thread(self.store.advance_many, steps)
        except (CorruptStateFile, CronStoreError, OSError) as exc:
            log.warning("cron: could not record that %d run(s) were submitted: %s", len(steps), error_text(exc))

    def _runs_to_withdraw(self, state: CronFile) -> list[tuple[tuple[str, int], str, str]]:
        """The runs followed here whose task was removed or disabled since (key, turn, why): each
        is dropped from its conversation's queue if it has not started (`_withdraw_runs`); not
        one asked by hand (`cron run`) of a task disabled before it was asked (`CronTask.drops_run`)."""
        if self.withdraw is None or not self._turn_of:
            return []
        tasks = {t.id: t for t in state.tasks}
        found = []
        for key, turn_id in self._turn_of.items():
            task = tasks.get(key[0])
            if turn_id in self._withdrawn or (task is not None and task.enabled):
                continue
            if task is None:
                found.append((key, turn_id, NOT_STARTED_REMOVED))
                continue
            # (a run asked by hand after the task was disabled goes ahead: `CronTask.drops_run`)
            claim = next((c for c in task.claim_records() if c.get("occurrence") == key[1]), None)
            if task.drops_run(claim):
                found.append((key, turn_id, NOT_STARTED_DISABLED))
        return found

    async def _withdraw_runs(self) -> None:
        """Drop the queued runs of tasks removed or disabled (no model work for a task its owner
        stopped); a run that already started finishes. Its outcome says why it was dropped."""
        found, self._withdrawing = self._withdrawing, []
        for (task_id, number), turn_id, why in found:
            await self.withdraw_run(task_id, number, turn_id, why)

    async def withdraw_run(self, task_id: str, number: int, turn_id: str, why: str) -> bool:
        """Drop run `number` of `task_id` (its turn `turn_id`, followed here: `watch`) from its
        queue if it has not started, its outcome saying `why`: whether it was dropped. Also for a
        restart's recovery, which finds runs of tasks removed or disabled while no server ran
        (their claims are gone with a removed task: no tick of this process would follow them in
        time)."""
        if self.withdraw is None or turn_id in self._withdrawn:
            return False
        self._withdrawn[turn_id] = why
        try:
            dropped = await asyncio.wait_for(self.withdraw(turn_id, why), self.fire_timeout_s)
        except Exception as exc:  # noqa: BLE001 — the run then goes on; said, not raised into the loop
            log.warning("cron: could not drop queued run #%d of task %s: %s", number, task_id, exc)
            return False
        if dropped:
            log.info("cron: task %s run #%d (turn %s) dropped from its queue: %s", task_id, number, turn_id, why)
        else:
            self._withdrawn.pop(turn_id, None)  # it started: its outcome is its own
        return dropped

    async def _read_agent_names(self) -> None:
        """The agents' names, for credentials limited by name; on failure the last ones read stay
        (a name limit then judges by them, or by the id alone) and the failure is logged."""
        assert self.agent_names is not None
        try:
            self._agent_name = await asyncio.wait_for(self.agent_names(), self.fire_timeout_s)
        except Exception as exc:  # noqa: BLE001 — a store that cannot answer now: judged by what was read
            log.warning("cron: cannot read the agents' names for the credential check: %s", exc)

    def credential_problem(self, task: CronTask, agent_name: str | None = None) -> str | None:
        """Why the credential `task` was made for (the `schedule` tool's, its namespace) may not
        run it now: gone, or narrowed to other agents or scopes. None when it may, or when the
        task has no such credential."""
        if task.namespace is None or self.credentials is None:
            return None
        return self.credentials(task.namespace, task.agent, agent_name or self._agent_name.get(task.agent))

    @staticmethod
    def _claimed_by(
        state: CronFile, tokens: set[str], *, shared: bool = False
    ) -> list[tuple[CronTask, list[Occurrence]]]:
        """The occurrences the schedulers holding leases `tokens` claimed and the tasks still
        follow, task by task: the last claim, and the earlier ones kept while open (a scheduler
        that took over and claimed the next run in the same tick, then died before resolving the
        one it adopted, leaves it there)."""
        found = []
        for task in state.tasks:
            claims = [
                occ
                for c in task.claim_records()
                # on a cluster's database, a run the dead holder saw through (`progress` done:
                # recorded, delivered) is not adopted: claiming the next run in the same tick drops
                # it from the tasks, and its recovery would then go by this server's own run log,
                # which knows nothing of it (one home's run log is everyone's: it decides, as before)
                if c.get("by") in tokens
                and not (shared and c.get("progress") == "done")
                and (occ := Occurrence.from_record(task.id, c)) is not None
            ]
            if claims:
                found.append((dataclasses.replace(task), claims))
        return found

    def _dead_tokens(self, state: CronFile, previous: OwnerRecord | None) -> set[str]:
        """The lease tokens whose claims this take-over must resolve: the dead holder's; when the
        lease record was null or unusable (a hand edit, a damaged file; a clean stop too), every
        other scheduler's that left a claim, since nobody can say it was resolved (the run log and
        the kernel's key answer that, claim by claim)."""
        if previous is not None:
            return set() if previous.token == self.lease.token else {previous.token}
        return {
            by
            for task in state.tasks
            if isinstance(by := (task.last_claimed or {}).get("by"), str) and by != self.lease.token
        }

    def _adopt(self, state: CronFile, tokens: set[str]) -> None:
        """Stamp the claims of the dead schedulers `tokens` with our lease token, saved with the
        take-over: should this process die too before it has resolved them, the next one to take
        the lease over finds them as ours and resolves them (by the run log, the kernel's key, or
        as missed) instead of losing them without a word."""
        for task in state.tasks:
            claimed = task.last_claimed
            if not isinstance(claimed, dict):
                continue
            earlier = claimed.get("open")
            if isinstance(earlier, list) and any(isinstance(c, dict) and c.get("by") in tokens for c in earlier):
                claimed = {
                    **claimed,
                    "open": [
                        {**c, "by": self.lease.token} if isinstance(c, dict) and c.get("by") in tokens else c
                        for c in earlier
                    ],
                }
            if claimed.get("by") in tokens:
                claimed = {**claimed, "by": self.lease.token}
            if claimed is not task.last_claimed:
                task.last_claimed = claimed

    def _orphan_occurrences(self, task: CronTask, claims: list[Occurrence]) -> list[Occurrence]:
        """Every run of `task` a dead scheduler claimed and did not settle, oldest first: the run
        log's unsettled `fired` records of other leases (a `run_all` catch-up claims several in one
        tick) and the claims the tasks follow (`claims`). Said loudly when there is more than one."""
        try:
            records = unsettled_claims(self.store.runs_dir, task.id, self.lease.token)
        except (OSError, ValueError) as exc:
            log.warning("cron: could not read the run log of task %s: %s", task.id, exc)
            records = []
        found = {c.number: c for c in claims}
        last = max(found)
        for r in records:
            occ = Occurrence.from_record(task.id, r)
            if occ is not None and occ.number <= last:
                found.setdefault(occ.number, occ)
        if len(found) > 1:
            log.warning(
                "cron: task %s (%s): %d runs (%s) were claimed by a scheduler that stopped; each is "
                "resolved now: submitted if it never reached the kernel, else recorded as it went",
                task.name,
                task.id,
                len(found),
                ", ".join(f"#{n}" for n in sorted(found)),
            )
        return [found[n] for n in sorted(found)]

    async def _submit_orphan(self, task: CronTask, occurrence: Occurrence, report: TickReport) -> None:
        """An occurrence the previous scheduler claimed before it died (or stopped), however long
        ago, whichever the store: taken up where it got (`_orphan_stage`: the progress kept with its
        claim in the tasks; on one home's crons.json only as far as the home's run log, everyone's,
        agrees), so a reply the stopped server was sending, or had still to send, is never silently
        dropped; else settled when the run log says what became of it; else found by the kernel's
        idempotency key (the run log completed, the run then taken up where its claim says it
        got); submitted only when the kernel can say it never got it (and its task is still there
        and enabled: else it ends `cancelled`, not started); recorded as missed when nobody can
        tell any more. Never submitted twice; its outcome recorded and its reply sent only when
        nobody did (`take_step`)."""
        number = occurrence.number
        resume, followed, stage, turn_id, settled = await self._orphan_stage(task, number)
        if resume and stage is not None:
            await self._resume_orphan(task, occurrence, stage, turn_id)
            return
        if self.store.shared:  # (its run log is this server's: read only when the tasks cannot tell)
            try:
                settled = await asyncio.to_thread(settled_record, self.store.runs_dir, task.id, number)
            except (OSError, ValueError) as exc:  # the kernel's answer still decides
                log.warning("cron: could not read the run log of task %s: %s", task.id, exc)
                settled = None
        if settled is not None or self.claimed_turn is None:
            return
        try:
            turn_id = await self.claimed_turn(task, occurrence)
        except ClaimUnverifiable as exc:
            await self._orphan_missed(task, occurrence, str(exc), report)
            return
        except Exception as exc:  # noqa: BLE001 — the kernel could not tell: never guess, say so
            why = f"whether it reached the kernel could not be checked ({type(exc).__name__}: {exc})"
            await self._orphan_missed(task, occurrence, why, report)
            return
        if turn_id is not None:  # it reached the kernel; the log lost it: complete the log, follow it
            if not self.store.shared or await take_step(self.store, task.id, number, "submitted"):
                self.store.runlog.record(task.id, "submitted", occurrence=number, turn_id=turn_id, recovered=True)
            if followed and stage not in (None, "claimed"):  # (one home: its run log had lost the run)
                await self._resume_orphan(task, occurrence, stage, turn_id)
            elif self.await_outcome is not None:
                self._watch(task.id, number, turn_id, task.deliver, before_delivery=self.before_recovered_delivery)
            return
        stopped = await asyncio.to_thread(self._stopped_why, task.id)
        if stopped is not None:  # its task was removed or disabled since: the run never starts
            log.info(
                "cron: run #%d of task %s, claimed by a scheduler that stopped before submitting it, is not "
                "submitted: %s",
                number,
                task.id,
                stopped,
            )
            await settle(self.store, task.id, number, None, TurnOutcome("cancelled", error=stopped), final=True)
            return
        log.warning(
            "cron: run #%d of task %s was claimed by a scheduler that stopped before submitting it; submitting it now",
            number,
            task.id,
        )
        try:
            logged = await asyncio.to_thread(has_fired, self.store.runs_dir, task.id, number)
        except (OSError, ValueError):
            logged = False
        if not logged:  # the claim's own `fired` line did not make it before the crash
            self.store.runlog.record(task.id, "fired", recovered=True, **occurrence.to_dict())
        turn_id, _ = await submit_claimed(
            self.store,
            task,
            occurrence,
            self.fire,
            fire_timeout_s=self.fire_timeout_s,
            clock=self.clock,
            recovered=True,
        )
        report.fired.append((task.id, occurrence.number, turn_id))
        if turn_id is not None and self.await_outcome is not None:
            self._watch(task.id, occurrence.number, turn_id, task.deliver)

    async def _orphan_stage(
        self, task: CronTask, number: int
    ) -> tuple[bool, bool, str | None, str | None, dict[str, Any] | None]:
        """How far run `number` of a stopped scheduler got: (whether it is taken up by its stage,
        whether the tasks follow its claim, its stage, its turn id when the run log names it, the
        run log's record settling it when it is not taken up by its stage). The stage is the one
        kept with the claim (`CronStore.claim_progress`), known cluster-wide. On one home's
        crons.json the home's run log is everyone's and is read too: a run it has no `submitted`
        or `outcome` of is left to it and the kernel's key (returned with the record that settles
        it, if any, as before); else a step it records that the claim does not show yet (the
        step's save failed, and `take_step` went on) counts, and the claim is brought up to it, so
        nothing it records is done again (an outcome, a reply)."""
        try:
            followed, stage = await asyncio.to_thread(self.store.claim_progress, task.id, number)
        except (CorruptStateFile, CronStoreError, OSError) as exc:  # the run log and the kernel decide
            log.warning("cron: could not read how far run #%d of task %s got: %s", number, task.id, exc)
            followed, stage = False, None
        if self.store.shared:
            return followed and stage not in (None, "claimed"), followed, stage, None, None
        try:
            settled = await asyncio.to_thread(settled_record, self.store.runs_dir, task.id, number)
        except (OSError, ValueError) as exc:  # the kernel's answer decides
            log.warning("cron: could not read the run log of task %s: %s", task.id, exc)
            return False, followed, stage, None, None
        event = settled.get("event") if settled is not None else None
        if settled is None or event not in ("submitted", "outcome") or not followed or stage is None:
            return False, followed, stage, None, settled
        turn = settled.get("turn_id")
        turn_id = turn if isinstance(turn, str) and turn else None
        logged = "settled" if event == "outcome" else "submitted"
        if stage in ("claimed", "submitted") and stage != logged:  # the claim is brought up to the log
            await take_step(self.store, task.id, number, logged)
            stage = logged
        if stage in ("settled", "delivering"):
            try:
                sent = await asyncio.to_thread(delivery_record, self.store.runs_dir, task.id, number) is not None
            except (OSError, ValueError) as exc:
                log.warning("cron: could not read the run log of task %s: %s", task.id, exc)
                sent = False
            if sent:  # recorded; only the claim's own step was not saved: close it now
                await take_step(self.store, task.id, number, "done", final=True)
                stage = "done"
        return True, followed, stage, turn_id, None

    async def _resume_orphan(
        self, task: CronTask, occurrence: Occurrence, stage: str, turn_id: str | None = None
    ) -> None:
        """A dead scheduler's run that got to `stage` (submitted or further): the steps it did are
        not done again (no second `submitted`, `outcome` or reply). Its outcome recorded and its
        reply not yet being sent (`settled`): the reply is sent now (once the channels run, with
        `before_recovered_delivery`). A reply it was sending when it died (`delivering`) may or may
        not have arrived: it is not sent again (at most once), and the run log says so. `turn_id`:
        the run's turn, when the run log names it (else found by the kernel's idempotency key)."""
        number = occurrence.number
        if stage == "done":
            return
        if stage == "delivering":
            if await take_step(self.store, task.id, number, "done", final=True):
                why = (
                    "the server sending this reply stopped before it recorded the result: it may or may "
                    "not have arrived; it is not sent again (a reply is sent at most once)"
                )
                log.warning("cron: task %s run #%d: %s", task.id, number, why)
                extra = {"turn_id": turn_id} if turn_id else {}
                self.store.runlog.record(
                    task.id,
                    "delivery_failed",
                    occurrence=number,
                    target=task.deliver,
                    error=why,
                    recovered=True,
                    **extra,
                )
            return
        if stage == "settled" and not task.deliver:  # its reply was to go nowhere after all: nothing is left
            await take_step(self.store, task.id, number, "done", final=True)
            return
        if self.await_outcome is None or (turn_id is None and self.claimed_turn is None):
            return
        why = "its turn is not found by its idempotency key"
        if turn_id is None:
            assert self.claimed_turn is not None
            try:
                turn_id = await self.claimed_turn(task, occurrence)
            except Exception as exc:  # noqa: BLE001 — ClaimUnverifiable or a store that cannot answer
                turn_id, why = None, f"{type(exc).__name__}: {exc}"
        if turn_id is None:
            log.error(
                "cron: task %s (%s) run #%d was %s by a scheduler that stopped, but %s; "
                "its outcome is not recorded here",
                task.name,
                task.id,
                number,
                stage,
                why,
            )
            return
        if stage == "settled":
            log.info(
                "cron: task %s run #%d: sending the reply a scheduler that stopped had still to send", task.id, number
            )
        # submitted: follow it (its outcome, then its reply); settled: only its reply is left
        self._watch(task.id, number, turn_id, task.deliver, before_delivery=self.before_recovered_delivery)

    async def _orphan_missed(self, task: CronTask, occurrence: Occurrence, why: str, report: TickReport) -> None:
        """A claimed run nobody can resolve is recorded as missed (at most once), loudly."""
        reason = (
            f"run #{occurrence.number} was claimed by a scheduler that stopped, and {why}; "
            "it is not submitted again (a run fires at most once)"
        )
        log.error("cron: task %s (%s): %s", task.name, task.id, reason)
        self.store.runlog.record(
            task.id, "missed", occurrence=occurrence.number, scheduled_for=occurrence.scheduled_for, reason=reason
        )
        report.missed += 1
        await take_step(self.store, task.id, occurrence.number, "settled", final=True)

    def _claim_due(self, now: datetime, report: TickReport) -> list[_Planned]:
        """Claim what is due, saved before anything fires. A tick that fails (above all its save:
        a full disk, a read-only file) leaves no trace in memory: the next one plans again from
        what is on disk, so a run it could not claim is claimed then (late, or logged as missed
        by its misfire policy), never taken for done."""
        undo = tuple(getattr(self, name) for name in _TICK_STATE)
        self._journal = {}
        said: list[tuple[int, str, tuple[Any, ...]]] = []
        self._said = said
        try:
            return self._claim_due_journaled(now, report)
        except BaseException:
            if self._journal is not None:  # (None: it failed after its save; what it planned holds)
                self._undo_tick(undo, now)
                said.clear()  # planned, never saved: the tick that saves it says it, once
            raise
        finally:
            self._journal = None
            self._said = None
            for level, text, args in said:
                log.log(level, text, *args)

    def _say(self, level: int, text: str, *args: Any) -> None:
        """Log a line of a tick's planning (a missed occurrence, a rolled-back counter, …) once the
        tick's claim is saved, with its run-log records: a tick whose save fails (a full disk) and
        each of its retries would otherwise say it again, every FAILED_TICK_RETRY_S."""
        if self._said is None:
            log.log(level, text, *args)
        else:
            self._said.append((level, text, args))

    def _undo_tick(self, undo: tuple[Any, ...], now: datetime) -> None:
        """Forget what a failed tick planned: the run numbers and times it claimed (`_used`), the
        next times it found to fit (`_fits`), the lease it took or renewed, the tasks it looked at
        (whose objects it changed: the store's cache was dropped by its load, so the next tick
        reads the file), and its earliest due time; it is tried again soon."""
        journal = self._journal or {}
        for (kind, task_id), value in journal.items():
            table: dict[str, Any] = self._used if kind == "used" else self._fits
            if value is _ABSENT:
                table.pop(task_id, None)
            else:
                table[task_id] = value
        for name, value in zip(_TICK_STATE, undo, strict=True):
            setattr(self, name, value)
        self._stamps_seen = None
        self._clock_back_unsaved = self._clock_back
        retry = now + timedelta(seconds=FAILED_TICK_RETRY_S)
        if self._next_due is None or self._next_due < retry:
            self._next_due = retry

    def _remember(self, kind: str, task_id: str, value: Any) -> None:
        """Set `_used` (kind "used") or `_fits` ("fits") of a task, journaled while a tick plans."""
        table: dict[str, Any] = self._used if kind == "used" else self._fits
        journal = self._journal
        if journal is not None and (kind, task_id) not in journal:
            journal[(kind, task_id)] = table.get(task_id, _ABSENT)
        table[task_id] = value

    def _claim_due_journaled(self, now: datetime, report: TickReport) -> list[_Planned]:
        self.store.runlog.flush()  # records a failing disk refused earlier, oldest first
        self.lease_state = None  # unknown until this tick reads the lease
        with self.store.lock():
            state = self.store.load()
            self._withdrawing = self._runs_to_withdraw(state)
            had = self.lease.holds(state)
            previous = state.scheduler_owner
            self._invalid = state.invalid_problem()
            if not self.lease.claim_in(state):  # (a fenced server claims nothing: `LeaseHolder.fenced`)
                if self.has_lease and not self.lease.is_fenced:
                    self._say(logging.WARNING, "cron: lost the scheduler lease; another process owns it now")
                self.has_lease = report.has_lease = self._held_through = False
                self._held_since = None
                self._next_due = None
                self._renew_at = math.inf
                self.lease_state = self.lease.describe_holder(state)
                self._holder_seen = state.scheduler_owner
                self._holder_check_at = time.monotonic() + LEASE_CHECK_S
                self.store.keep(state)
                self._seen = self.store.signature()
                return []
            if not self.has_lease:
                self._say(logging.INFO, "cron: this process now runs the scheduler (pid %s)", self.lease.pid)
                self._held_since = now
            if not had:
                dead = self._dead_tokens(state, previous)
                self._orphans = self._claimed_by(state, dead, shared=self.store.shared)
                if self.await_outcome is not None:
                    self._adopting = frozenset((t.id, o.number) for t, claims in self._orphans for o in claims)
                self._adopt(state, dead)
            self.has_lease = report.has_lease = True
            self._held_through = had
            self._holder_seen = None
            changed = self.lease.renew_in(state) or not had
            self.lease_state = self.lease.describe_holder(state)
            self._renew_at = time.monotonic() + self.lease.seconds_to_renewal(state)
            planned: list[_Planned] = []
            logs: list[tuple[str, str, dict[str, Any]]] = []
            next_due: datetime | None = None
            self._look_at_stamps, self._stamps_seen = state is not self._stamps_seen, state
            for index, task in enumerate(state.tasks):
                if not task.enabled:
                    continue
                if self._plan_isolated(state, index, now, planned, logs, report):
                    changed = True
                task = state.tasks[index]
                if task.next_due_at is not None and (next_due is None or task.next_due_at < next_due):
                    next_due = task.next_due_at
            self._next_due = next_due
            if changed:
                self.store.save(state, cache=True)  # the claim, persisted before anything fires
            else:
                self.store.keep(state)
            self._journal = None  # saved: nothing of this tick is undone any more
            self._seen = self.store.signature()
            for task_id, event, fields_ in logs:  # never raises: a failing disk keeps them to retry
                self.store.runlog.record(task_id, event, **fields_)
            return planned

    def _plan_isolated(
        self,
        state: CronFile,
        index: int,
        now: datetime,
        planned: list[_Planned],
        logs: list[tuple[str, str, dict[str, Any]]],
        report: TickReport,
    ) -> bool:
        """`_plan_task` for one task, fenced: a value the schedule arithmetic cannot handle (a date
        past the year 9999, …) undoes what that task's planning did and turns it into a visible
        error, so one bad task never stalls the others."""
        task = state.tasks[index]
        moved = self._clock_check(task, now)
        if task.next_fire_at is not None and task.next_due_at is not None and task.next_due_at > now:
            return moved  # not due (most tasks, most ticks): nothing to plan, nothing to copy
        before = dataclasses.replace(task)
        marks = (len(planned), len(logs), report.missed)
        try:
            return self._plan_task(task, now, planned, logs, report)
        except Exception as exc:  # noqa: BLE001 — confined to this task, reported loudly below
            del planned[marks[0] :], logs[marks[1] :]
            report.missed = marks[2]
            state.tasks[index] = before
            message = f"cannot be scheduled ({type(exc).__name__}: {exc})"
            self._fail(before, ScheduleError(message), now, logs, report)
            return True

    def _clock_check(self, task: CronTask, now: datetime) -> bool:
        """A recurring task whose next run lies beyond its schedule's next occurrence after `now`
        was scheduled by a clock that was ahead (a bad RTC, a restored VM) and has since been put
        back: left alone it would stay silent for the size of the jump. It is rescheduled from now,
        loudly; its run counter is untouched, so run numbers (and the turns' idempotency keys) go on
        above those already used. Checked when the clock went back during this process's life, or,
        for tasks read anew (the first tick, a change by another process), when a time stamped on
        the task (made, changed, claimed) is ahead of now; a next time found to fit is not computed
        again (cheap for ten thousand tasks). A one-shot keeps its time. True when the task changed."""
        limit = self._stamp_limit
        if limit is None or limit[0] is not now:  # once per tick
            later = now + timedelta(seconds=CLOCK_SLACK_S)
            limit = self._stamp_limit = (now, later, later.astimezone(UTC).isoformat())
        if not self._clock_back and not (self._look_at_stamps and _stamped_after(task, limit[1], limit[2])):
            return False  # (most tasks, most ticks)
        nominal = task.next_fire_at
        if nominal is None or nominal <= now or not task.schedule.recurring:
            return False
        slack = timedelta(seconds=CLOCK_SLACK_S)
        stamps = [task.created_at, task.updated_at, _claimed_at(task)]
        ahead = max((t for t in stamps if t is not None), default=now)
        fits = self._fits.get(task.id)
        if fits is not None and fits[0] == nominal and fits[1] <= now:
            return False
        try:
            expected, anchor = self._next_from_now(task, now)
        except (ScheduleError, ValueError, OverflowError):
            return False  # the planning of a due task says what is wrong with it
        if expected is None or nominal <= expected:
            self._remember("fits", task.id, (nominal, now))
            return False
        self._say(
            logging.WARNING,
            "cron: task %s (%s): its next run was set for %s, but its schedule's next occurrence from now "
            "(%s) is %s: the clock was ahead by about %s when it was set (last stamped %s) and has been "
            "put back; rescheduled from now (run numbers go on from #%d)",
            task.name,
            task.id,
            nominal.isoformat(),
            now.isoformat(),
            expected.isoformat(),
            max(ahead - now, nominal - expected),
            ahead.isoformat(),
            task.occurrence + 1,
        )
        task.created_at = anchor
        task.next_fire_at, task.next_due_at = expected, self._due(task, expected)
        task.updated_at = now
        self._remember("fits", task.id, (expected, now))
        used = self._used.get(task.id)
        if used is not None and used[1] is not None and used[1] > now + slack:
            self._remember("used", task.id, (used[0], None))  # those runs were claimed by the clock that was ahead
        return True

    @staticmethod
    def _next_from_now(task: CronTask, now: datetime) -> tuple[datetime | None, datetime]:
        """(the schedule's next occurrence after `now`, the creation time to keep). An interval
        counts from its creation time; one stamped by the clock that was ahead is moved back by
        whole intervals to before now, which keeps the task's phase (at :15 past every hour stays
        so) while letting it run before that time comes round again."""
        anchor = task.created_at
        if task.schedule.kind == "every" and anchor > now:
            step = parse_duration(task.schedule.expr)
            anchor -= step * -((now - anchor) // step)  # whole steps, to at or before now
        return next_occurrence(task.schedule, now, anchor), anchor

    def _plan_task(
        self,
        task: CronTask,
        now: datetime,
        planned: list[_Planned],
        logs: list[tuple[str, str, dict[str, Any]]],
        report: TickReport,
    ) -> bool:
        """Apply the schedule and misfire policy to one task; True when the task changed."""
        if task.next_fire_at is None:
            if task.schedule.recurring and task.last_error is None:  # hand-edited or pre-existing
                task.reschedule(now, now)
                self._note_error(task, logs, report)
                return True
            return False
        if task.next_due_at is None:
            try:
                task.next_due_at = self._due(task, task.next_fire_at)
            except ScheduleError as exc:
                return self._fail(task, exc, now, logs, report)
        if task.next_due_at > now:
            return False

        try:
            due, following, skipped = self._due_occurrences(task, now)
        except ScheduleError as exc:
            return self._fail(task, exc, now, logs, report)
        used, ran_until = self._used_runs(task)
        if ran_until is not None and ran_until > now + timedelta(seconds=CLOCK_SLACK_S):
            self._say(
                logging.WARNING,
                "cron: task %s (%s): the run log shows a run scheduled for %s, later than now (%s): the clock "
                "was ahead when it was claimed and has been put back; the schedule goes on from now (run "
                "numbers go on from #%d)",
                task.name,
                task.id,
                ran_until.isoformat(),
                now.isoformat(),
                max(used, task.occurrence) + 1,
            )
            ran_until = None
            self._remember("used", task.id, (used, None))
        if ran_until is not None and due and due[0][0] <= ran_until:  # a rolled-back schedule: not rerun
            self._say(
                logging.WARNING,
                "cron: task %s (%s): the tasks say it is due from %s, but the run log shows it ran up to %s "
                "(was an older copy of the tasks restored?); those occurrences are not run again",
                task.name,
                task.id,
                due[0][0].isoformat(),
                ran_until.isoformat(),
            )
            due = [o for o in due if o[0] > ran_until]
        fire, missed = apply_misfire(
            task.misfire,
            due,
            now,
            timedelta(seconds=task.max_lateness_s),
            self.run_all_cap,
            running_since=self._held_since,
        )
        if skipped is not None:
            missed.insert(0, skipped)
        self._warn_missed(task, missed)
        overlapped: list[_Missed] = []
        busy = self._running_run(task) if fire else None
        if busy is not None:  # never a second run of the task queued behind one still going
            why = f"skipped (previous run #{busy} still queued or running)"
            overlapped = [(nominal, why) for nominal, _, _ in fire]
            self._note_overlap(task, busy, fire[0][0])
            fire = []
        if fire:
            gone = self.credential_problem(task)
            if gone is not None:  # never submit turns for a credential that is no more
                reason = (
                    f"not run: {gone}; the task is kept (it runs again once a live token of that name "
                    "may use its agent; `appserver cron remove` deletes it)"
                )
                self._say(logging.ERROR, "cron: task %s (%s) run skipped: %s", task.name, task.id, reason)
                missed.extend((nominal, reason) for nominal, _, _ in fire)
                fire = []

        missed += overlapped
        if missed:  # skips behind a run that does not end (queued behind a pending approval) show too
            task.set_error(_missed_error(missed), now)
        for nominal, reason in missed:
            logs.append((task.id, "missed", {"scheduled_for": nominal, "reason": reason}))
        report.missed += len(missed)
        occurrences: list[Occurrence] = []
        floor = used if fire else 0
        for nominal, due_at, catch_up in fire:
            occ = task.claim(nominal, due_at, now, catch_up=catch_up, by=self.lease.token, floor=floor)
            occurrences.append(occ)
            # `by` names the claiming lease: a take-over finds every claim of a dead scheduler's tick
            logs.append((task.id, "fired", {**occ.to_dict(), "by": self.lease.token}))
        if occurrences:
            latest = max(o.scheduled_for for o in occurrences)
            self._remember("used", task.id, (task.occurrence, latest))  # the newest claim, as `used_runs` reads the log
        task.next_fire_at, task.next_due_at = following if following is not None else (None, None)
        task.updated_at = now
        snapshot = dataclasses.replace(task)  # `fire` gets a copy, not the store's cached object
        planned.extend(_Planned(snapshot, occ) for occ in occurrences)
        return True

    def _running_run(self, task: CronTask) -> int | None:
        """The number of a run of `task` still queued or running (claimed or submitted, its
        outcome not recorded yet) that this process follows, or None. Only runs followed here
        count: a claim a stopped server left open is resolved by the take-over, never waited for;
        but one it never submitted (a catch-up's run waiting its turn), adopted by this tick, counts
        while the tick plans: the take-over submits it right after, so an occurrence due now would
        run behind it, where without the stop it would be skipped."""
        for claim in task.claim_records():
            number = claim.get("occurrence")
            if claim.get("progress") not in ("claimed", "submitted") or not isinstance(number, int):
                continue
            if (task.id, number) in self._in_turn:  # claimed, waiting for the run before it
                return number
            if claim.get("progress") == "claimed" and (task.id, number) in self._adopting:
                return number
            watcher = self._following.get((task.id, number))
            if watcher is not None and not watcher.done():
                return number
        return None

    def _note_overlap(self, task: CronTask, busy: int, nominal: datetime) -> None:
        """Say once that occurrences of `task` are skipped behind its running runs (the run log
        has each): again only after one of its runs ended with nothing skipped behind it."""
        self._overlap_noted.add((task.id, busy))
        if task.id in self._overlap_said:
            return
        self._overlap_said.add(task.id)
        log.warning(
            "cron: task %s (%s): run #%d is still queued or running at the occurrence scheduled for %s; occurrences "
            "that come due while a run of it is queued or running are skipped (each is recorded in the run "
            "log; said again only after a run ends with none skipped)",
            task.name,
            task.id,
            busy,
            nominal.isoformat(),
        )

    def _warn_missed(self, task: CronTask, missed: list[_Missed]) -> None:
        """One warning line for the occurrences a tick found missed (never repeated: the next tick
        starts after them; a tick whose save fails says nothing, `_say`)."""
        if not missed:
            return
        nominal, reason = missed[-1]
        more = f" and {len(missed) - 1} earlier occurrence(s)" if len(missed) > 1 else ""
        self._say(
            logging.WARNING,
            "cron: task %s (%s) missed the occurrence scheduled for %s%s: %s",
            task.name,
            task.id,
            nominal.isoformat(),
            more,
            reason,
        )

    def _used_runs(self, task: CronTask) -> tuple[int, datetime | None]:
        """The highest run number of `task` already used and the latest scheduled time it ran: what
        this process claimed, else what the run log names (read once per task). A counter below it
        was rolled back (an older crons.json restored): said loudly, and numbering goes on above
        it, so no run reuses an earlier run's number, whose idempotency key would make the kernel
        answer with that earlier turn (nothing would run)."""
        found = self._used.get(task.id)
        if found is None:
            try:
                found = used_runs(self.store.runs_dir, task.id)
            except (OSError, ValueError) as exc:
                self._say(logging.WARNING, "cron: could not read the run log of task %s: %s", task.id, exc)
                found = (0, None)
            self._remember("used", task.id, found)
        used = found[0]
        if used > task.occurrence:
            self._say(
                logging.WARNING,
                "cron: task %s (%s): its run counter in the tasks (%d) is behind the runs already made "
                "(#%d; was an older copy of the tasks restored?); the next run is #%d",
                task.name,
                task.id,
                task.occurrence,
                used,
                used + 1,
            )
        return found

    def _due_occurrences(
        self, task: CronTask, now: datetime
    ) -> tuple[list[tuple[datetime, datetime]], tuple[datetime, datetime] | None, _Missed | None]:
        """(nominal, due) pairs that came due, oldest first; the occurrence after them; and, after
        an outage too long to list, one summary `missed` entry for the occurrences jumped over."""
        assert task.next_fire_at is not None and task.next_due_at is not None
        due = [(task.next_fire_at, task.next_due_at)]
        following = self._walk(task, due, now)
        if following is None or following[1] > now:
            return due, following, None
        # more than MAX_ENUMERATE came due: summarise the bulk, handle only the most recent ones
        period = (due[-1][0] - due[0][0]) / max(1, len(due) - 1)
        restart = max(
            due[-1][0],
            now - period * (self.run_all_cap + 2) - timedelta(seconds=task.max_lateness_s),
        )
        first_skipped = due[0][0]
        nominal = next_occurrence(task.schedule, restart, task.created_at)
        tail: list[tuple[datetime, datetime]] = []
        if nominal is not None and self._due(task, nominal) <= now:
            tail = [(nominal, self._due(task, nominal))]
            following = self._walk(task, tail, now)
            if following is not None and following[1] <= now:  # still too many: jump to now
                nominal = next_occurrence(task.schedule, now, task.created_at)
                following = None if nominal is None else (nominal, self._due(task, nominal))
        else:
            following = None if nominal is None else (nominal, self._due(task, nominal))
        summary = (
            first_skipped,
            f"more than {MAX_ENUMERATE} occurrences came due between {first_skipped.isoformat()} and "
            f"{restart.isoformat()} while the scheduler was not running; not listed one by one",
        )
        return tail, following, summary

    def _walk(
        self, task: CronTask, due: list[tuple[datetime, datetime]], now: datetime
    ) -> tuple[datetime, datetime] | None:
        """Extend `due` with occurrences due by `now` (at most MAX_ENUMERATE in all); return the
        first one not appended (None when a one-shot has no more)."""
        while True:
            nominal = next_occurrence(task.schedule, due[-1][0], task.created_at)
            if nominal is None:
                return None
            nxt = (nominal, self._due(task, nominal))
            if nxt[1] > now or len(due) >= MAX_ENUMERATE:
                return nxt
            due.append(nxt)

    def _due(self, task: CronTask, nominal: datetime) -> datetime:
        return due_time(task.schedule, nominal, task_id=task.id, created_at=task.created_at, exact=task.exact)

    def _fail(
        self,
        task: CronTask,
        exc: ScheduleError,
        now: datetime,
        logs: list[tuple[str, str, dict[str, Any]]],
        report: TickReport,
    ) -> bool:
        """An expression that no longer works keeps the task and becomes a visible failure."""
        task.next_fire_at = task.next_due_at = None
        task.set_error(f"invalid schedule: {exc}", now)
        self._note_error(task, logs, report)
        return True

    def _note_error(self, task: CronTask, logs: list[tuple[str, str, dict[str, Any]]], report: TickReport) -> None:
        if task.next_fire_at is None and task.last_error:
            logs.append((task.id, "error", {"error": task.last_error}))
            report.errors.append(f"{task.id}: {task.last_error}")
            self._say(logging.ERROR, "cron: task %s (%s): %s", task.name, task.id, task.last_error)

    # ------------------------------------------------------------ outcomes

    def watch(
        self,
        task_id: str,
        occurrence: int,
        turn_id: str,
        deliver_to: str | None = None,
        *,
        not_delivered: str | None = None,
        before_delivery: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Record the outcome of a submitted turn when it ends (needs `await_outcome`), then send
        its reply to `deliver_to`, after awaiting `before_delivery` when given (a restarted
        server waits for its channels: outside the delivery's own timeout, which must outlast
        the gateway's tries). With `not_delivered` (why the reply must not go there, e.g. the
        task was removed) a `delivery_failed` record says so instead."""
        self._watch(task_id, occurrence, turn_id, deliver_to, not_delivered, before_delivery)

    def unrecorded_turns(self) -> list[tuple[str, int, str]]:
        """Turns submitted before this scheduler started whose outcome was never logged (their
        process died or stopped first): (task id, occurrence, turn id). Blocking file I/O."""
        return unrecorded_turns(self.store.runs_dir, self.started_at)

    def _watch(
        self,
        task_id: str,
        occurrence: int,
        turn_id: str,
        deliver_to: str | None,
        not_delivered: str | None = None,
        before_delivery: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        assert self.await_outcome is not None
        key = (task_id, occurrence)
        if key in self._following:
            # followed here already (a restarted server's recovery of the turns a previous one
            # did not see end, and its scheduler's take-over of the runs that one claimed, both
            # find a run queued behind a slow turn): one owner records and delivers it
            log.debug("cron: task %s run #%d is already followed in this process", task_id, occurrence)
            return
        outcome: Coroutine[Any, Any, TurnOutcome]
        if deliver_to and (not_delivered or before_delivery):
            outcome = self._outcome_then_delivery(
                task_id, occurrence, turn_id, deliver_to, not_delivered, before_delivery
            )
        else:
            outcome = watch_outcome(
                self.store,
                task_id,
                occurrence,
                turn_id,
                self._outcome,
                timeout_s=self.outcome_timeout_s,
                deliver_to=deliver_to,
                deliver=self.deliver,
            )
        t = asyncio.create_task(outcome)
        self._watchers.add(t)
        self._following[key] = t
        self._turn_of[key] = turn_id

        def ended(done: asyncio.Task[TurnOutcome]) -> None:
            self._watchers.discard(done)
            if self._following.get(key) is done:
                del self._following[key]
                self._turn_of.pop(key, None)
                if key not in self._overlap_noted:
                    self._overlap_said.discard(task_id)
                self._overlap_noted.discard(key)
                self._withdrawn.pop(turn_id, None)

        t.add_done_callback(ended)

    async def _outcome(self, turn_id: str) -> TurnOutcome:
        """`await_outcome`; a run dropped from its queue (`_withdraw_runs`) says why in its error."""
        assert self.await_outcome is not None
        outcome = await self.await_outcome(turn_id)
        why = self._withdrawn.get(turn_id)
        if why is not None and outcome.status == "cancelled":
            return dataclasses.replace(outcome, error=why)
        return outcome

    async def _outcome_then_delivery(
        self,
        task_id: str,
        occurrence: int,
        turn_id: str,
        target: str,
        not_delivered: str | None,
        before_delivery: Callable[[], Awaitable[None]] | None,
    ) -> TurnOutcome:
        """The outcome, then the delivery (or the `delivery_failed` record of a reply that must
        not be sent): in the order of any other run, so `cron logs` reads the same."""
        assert self.await_outcome is not None
        ended, ours = await follow_outcome(
            self.store,
            task_id,
            occurrence,
            turn_id,
            self._outcome,
            timeout_s=self.outcome_timeout_s,
            final=False,
        )
        if not_delivered:

            def write() -> None:
                log.warning(
                    "cron: task %s run #%d: reply to %s %s",
                    task_id,
                    occurrence,
                    target,
                    not_delivered_text(not_delivered),
                )
                self.store.runlog.record(
                    task_id,
                    "delivery_failed",
                    occurrence=occurrence,
                    turn_id=turn_id,
                    target=target,
                    error=not_delivered,
                )

            def sent() -> bool:
                try:
                    return delivery_record(self.store.runs_dir, task_id, occurrence) is not None
                except (OSError, ValueError):
                    return True  # cannot tell: never a second record

            # the record, then the claim done (a crash between them leaves the record: never lost)
            await take_recorded_step(
                self.store,
                task_id,
                occurrence,
                "delivering",
                write,
                final=True,
                unfollowed_ours=ours,
                recorded=None if self.store.shared else sent,
                write_lost=False,
            )
            return ended  # (not taken: another process has its delivery in hand)
        if before_delivery is not None and ended.status == "completed":
            await before_delivery()
        await deliver_reply(self.store, task_id, occurrence, turn_id, ended, target, self.deliver, outcome_ours=ours)
        return ended

    async def wait_outcomes(self, timeout_s: float) -> None:
        """Wait (bounded) for outcome watchers, and runs waiting for their turn; used by tests
        and a graceful stop."""
        deadline = time.monotonic() + timeout_s
        while (pending := self._watchers | self._chains) and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(pending, timeout=left)

    # ------------------------------------------------------------ run now

    async def run_now(self, ref: str, *, agent: str | None = None) -> RunNowResult:
        """Fire a task immediately, outside its schedule; needs no lease."""
        result = await run_task_now(
            self.store,
            ref,
            fire=self.fire,
            agent=agent,
            clock=self.clock,
            fire_timeout_s=self.fire_timeout_s,
        )
        if result.turn_id is not None and self.await_outcome is not None:
            self._watch(result.task.id, result.occurrence.number, result.turn_id, result.task.deliver)
        return result

    # ------------------------------------------------------------ the loop

    def seconds_to_next_tick(self) -> float:
        """Ticks land on multiples of tick_s since the epoch (minute boundaries for 60 s), plus a
        few ms so a timer that fires a hair early still sees the boundary passed."""
        now = self.clock().timestamp()
        return self.tick_s - (now % self.tick_s) + 0.005

    def next_wake(self) -> datetime:
        """When the loop ticks next: the earliest due time of a task (while holding the lease;
        a failed tick's retry, with or without it), the next tick boundary at the latest, and not
        sooner than MIN_TICK_GAP_S after the last tick (so ten thousand tasks with spread-out due
        times do not save crons.json nonstop)."""
        now = self.clock()
        wake = now + timedelta(seconds=self.seconds_to_next_tick())
        # (without the lease `_next_due` is set only by a failed tick: its retry, `_undo_tick`)
        if self._next_due is not None and self._next_due < wake:
            wake = self._next_due
        if self._last_tick is not None and self._last_tick <= now:  # (a tick shorter than the gap is honoured)
            gap = min(MIN_TICK_GAP_S, self.tick_s)
            wake = max(wake, self._last_tick + timedelta(seconds=gap))
        return wake

    def failed_tick_pause_s(self) -> float:
        """How long the loop waits after a tick that failed before it ticks again, whatever else
        is due meanwhile (the lease's renewal above all: a tick that could not save restores the
        renewal time it found, already past): FAILED_TICK_RETRY_S, or the backstop tick when that
        is shorter. A failure that lasts costs one tick per pause, not a spinning loop."""
        return min(FAILED_TICK_RETRY_S, self.tick_s)

    def changed_elsewhere(self) -> bool:
        """Did another process write crons.json since our last tick? (Our own writes, such as an
        outcome recorded by a watcher, are recognised by the store's cached signature.)"""
        sig = self.store.signature()
        if sig == self._seen:
            return False
        if sig is not None and sig == self.store.cached_signature():
            self._seen = sig
            return False
        return True

    def problem(self) -> str | None:
        """Why cron is not doing its job right now, in one line (None when all is well): a
        crons.json that was set aside as corrupt, a tick or the loop that fails, tasks that are
        invalid, run-log records the disk refuses. For /readyz and the log."""
        found = [
            p
            for p in (
                self.store.problem(),
                self._tick_error,
                self._loop_error,
                self._invalid,
                self.store.runlog.problem(),
            )
            if p
        ]
        return "; ".join(found) or None

    def _log_problem(self) -> None:
        """Log a lasting problem at every tick, at most once per `problem_log_every_s` (and at
        once when it changes), so a broken crons.json cannot go quiet after one line."""
        text = self.problem()
        if text is None:
            self._problem_logged = None
            return
        now = asyncio.get_running_loop().time()
        last = self._problem_logged
        if last is None or last[0] != text or now - last[1] >= self.problem_log_every_s:
            log.error("cron: %s", text)
            self._problem_logged = (text, now)

    async def _sleep(self, stop: asyncio.Event) -> None:
        """Sleep until `next_wake()`, waking early when stopped, when crons.json is changed by
        another process while we hold the lease (a new task may be due before then) or while no
        holder is known (the last tick failed before it could read the lease: a crons.json set
        aside as corrupt, a store that could not answer; the change, a `cron add`, lets the tick
        take the lease), or, without the lease, when the holder the last tick saw is judged gone
        (`holder_gone`, every LEASE_CHECK_S): the tick then takes the lease over. Measured on the
        wall clock, so a suspended machine ticks as soon as it resumes. After a tick that failed,
        nothing but a stop ends the sleep before `failed_tick_pause_s` has passed."""
        wake = self.next_wake()
        while not stop.is_set():
            self.alive_at = time.monotonic()
            held_off = self._retry_at - time.monotonic()
            if held_off > 0:  # the last tick failed: nothing (a renewal due, a change) ticks before its pause
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(held_off, self.watch_s))
                except TimeoutError:
                    pass
                continue
            left = (wake - self.clock()).total_seconds()
            if left <= 0 or (self.has_lease and time.monotonic() >= self._renew_at):  # tick, or renew
                return
            if left > self.tick_s + 1:  # more than a tick away: the clock was put back since; tick now
                return
            try:
                await asyncio.wait_for(stop.wait(), timeout=min(left, self.watch_s))
            except TimeoutError:
                pass
            if (self.has_lease or self._holder_seen is None) and await self._changed_elsewhere_safely():
                return
            if not self.has_lease and self._holder_seen is not None and time.monotonic() >= self._holder_check_at:
                self._holder_check_at = time.monotonic() + LEASE_CHECK_S
                if await self._holder_gone_safely():
                    return

    def holder_gone(self) -> bool:
        """Is the holder the last tick saw judged gone now (dead, or its lease expired)? Judged
        as the tick's claim judges it, but without the store lock: only a hint to tick now. The
        tick takes the lease under the lock and judges again there (another scheduler may have
        taken it meanwhile, or the holder renewed it), so this can never make two fire."""
        owner = self._holder_seen
        return owner is not None and not self.lease.alive(owner)

    async def _holder_gone_safely(self) -> bool:
        """`holder_gone` off the event loop; a store that cannot answer now (the database is
        away) counts as no: the backstop tick says what is wrong and tries again."""
        try:
            return await asyncio.to_thread(self.holder_gone)
        except (CorruptStateFile, CronStoreError, OSError) as exc:
            log.debug("cron: cannot judge the scheduler lease's holder now: %s", exc)
            return False

    async def _changed_elsewhere_safely(self) -> bool:
        """`changed_elsewhere` off the event loop (a database-backed store asks the database), and
        an unreachable store only noted: the next tick says what is wrong and tries again."""
        try:
            return await asyncio.to_thread(self.changed_elsewhere)
        except (CorruptStateFile, CronStoreError, OSError) as exc:
            self._tick_error = f"cannot look for changes: {exc}"
            self._log_problem()
            return False

    async def _note_seen(self) -> None:
        try:
            self._seen = await asyncio.to_thread(self.store.signature)
        except (CorruptStateFile, CronStoreError, OSError):
            self._seen = None

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop` is set; then close (release the lease, stop outcome watchers): the
        loop's owner does not close it again."""
        try:
            while not stop.is_set():
                self.alive_at = time.monotonic()
                try:
                    await self.tick()
                    self._tick_error = None
                except (CorruptStateFile, CronStoreError) as exc:
                    self._tick_error = f"tick skipped: {exc}"
                    await self._note_seen()
                except OSError as exc:  # crons.json or its folder not writable (read-only, immutable, full)
                    where = f": {exc.filename}" if exc.filename else ""
                    self._tick_error = f"tick skipped: {exc.strerror or exc}{where}"
                    await self._note_seen()
                except Exception as exc:
                    log.exception("cron: tick failed")
                    self._tick_error = f"tick failed: {type(exc).__name__}: {exc}"
                    await self._note_seen()
                failed = self._tick_error is not None
                self._retry_at = time.monotonic() + self.failed_tick_pause_s() if failed else 0.0
                try:
                    self._log_problem()
                    await self._sleep(stop)
                    self._loop_error = None
                except Exception as exc:  # the loop must outlive its own bugs: say so, pause, go on
                    log.exception("cron: the scheduler loop failed; retrying in %g s", LOOP_ERROR_PAUSE_S)
                    self._loop_error = f"scheduler loop failed: {type(exc).__name__}: {exc}"
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=LOOP_ERROR_PAUSE_S)
                    except TimeoutError:
                        pass
        finally:
            await self.close()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Release the lease (so another process need not wait for our death) and cancel watchers
        (runs still waiting for their turn stay claimed: the next scheduler adopts them)."""
        for chain in list(self._chains):
            chain.cancel()
        for t in list(self._watchers):
            t.cancel()
        if self._watchers:
            await asyncio.wait(set(self._watchers), timeout=timeout_s)
        if self.has_lease:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.lease.release), timeout=timeout_s)
            except (TimeoutError, CronStoreError, CorruptStateFile) as exc:
                log.warning("cron: could not release the scheduler lease: %s", exc)
            except OSError as exc:  # crons.json not written (a full disk, a quota, read-only): one line
                log.warning(
                    "cron: could not release the scheduler lease: %s; another process takes it over once it "
                    "expires (%g s)",
                    error_text(exc),
                    self.lease.ttl_s,
                )
            self.has_lease = False
        await asyncio.to_thread(self.store.runlog.close)
        await asyncio.to_thread(self.store.close)
        if isinstance(self.credentials, TokenCredentials):  # the one this scheduler made (from_config)
            await asyncio.to_thread(self.credentials.close)
