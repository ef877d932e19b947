"""The scheduler lease: `scheduler_owner` in crons.json says which process may fire tasks.

An owner on this host is judged by its process identity (pid plus the process start time from
`/proc/<pid>/stat` field 22): a dead pid, a zombie, or a live pid whose start time differs (the pid
was reused by another program) is dead, and its lease may be taken. A record without a start time
cannot be told from an unrelated process that has the pid: it is judged by its heartbeat instead,
and expires like a lease from another host. A live owner is never
displaced, so two `serve` processes on one home never both fire.

An owner on another host (a home on shared storage, or a container that came back under a new
hostname) cannot be checked by pid, so the lease also carries a heartbeat: the holder renews
`renewed_at` every third of its `ttl_s`, and a lease from another host that was not renewed within
its TTL is expired and may be taken. That is judged by this process's own observation, so no
record can block every scheduler forever: a TTL counts for at most MAX_LEASE_TTL_S, and a heartbeat
in the future (beyond MAX_CLOCK_SKEW_S) counts from when this process first saw it. Waiting for a
live holder is logged once per holder, and so is taking the lease.

Every claim happens under the store lock and fires only what it claimed there, so a holder that was
only slow, not dead, finds the lease gone and fires nothing. Every function here must be called
with the store lock held; `LeaseHolder` does that.

A server of a cluster also judges itself there, as the others judge a holder (`LeaseHolder.fenced`):
once its own instance is judged gone (its row deleted by a survivor, its heartbeat stale, its
session away), it takes no lease and claims no run, even one it holds. Its kernel runs nothing
then, so every run it claimed would only fail and be lost to the healthy server that takes over.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from appserver.procid import pid_alive, process_start_ticks
from cron.store import CronFile, CronStore, OwnerRecord

log = logging.getLogger("appserver.cron")


process_start = process_start_ticks  # the name the scheduler and its tests use

DEFAULT_LEASE_TTL_S = 90.0  # a lease from another host not renewed for this long has expired
# The longest TTL a lease record is judged by (`[cron] lease_ttl_s` allows no more): a record that
# claims 100 years would otherwise block every other scheduler for that long once its holder died.
MAX_LEASE_TTL_S = 3600.0
# How far ahead of this host's clock a foreign heartbeat may be and still be believed. One later
# than that (a clock far ahead, a hand edit: 9999-12-31) counts from when this process first saw
# it, so a stuck record expires by our own observation rather than never.
MAX_CLOCK_SKEW_S = 60.0


class Sightings:
    """When this process first saw each heartbeat that lies in the future: such a lease expires by
    this process's own clock. Kept by the process that judges leases (its `LeaseHolder`)."""

    __slots__ = ("_first",)
    KEPT = 64  # (token, heartbeat) pairs remembered; only the current holder's matters

    def __init__(self) -> None:
        self._first: dict[tuple[str, datetime], datetime] = {}

    def first(self, owner: OwnerRecord, heartbeat: datetime, now: datetime) -> datetime:
        key = (owner.token, heartbeat)
        seen = self._first.get(key)
        if seen is None:
            if len(self._first) >= self.KEPT:
                self._first.clear()  # older holders' heartbeats: nobody judges them any more
            seen = self._first[key] = now
            log.warning(
                "cron: the scheduler lease of pid %s on %s says it was renewed at %s, in the future; it is "
                "counted from now (%s) instead",
                owner.pid,
                owner.host or "this host",
                heartbeat.isoformat(),
                now.isoformat(),
            )
        return seen


def last_renewal(owner: OwnerRecord, now: datetime, sightings: Sightings) -> datetime:
    """When the lease was last renewed, as far as this process can tell: the record's heartbeat
    (a record without one, written by an older version, counts from its start time), unless that
    lies in the future beyond MAX_CLOCK_SKEW_S: then the moment this process first saw it."""
    last = owner.renewed_at or owner.started_at
    if last - now <= timedelta(seconds=MAX_CLOCK_SKEW_S):
        return last
    return sightings.first(owner, last, now)


def lease_ttl(owner: OwnerRecord) -> float:
    """The record's TTL, at most MAX_LEASE_TTL_S (a record without one: the default)."""
    return min(owner.ttl_s or DEFAULT_LEASE_TTL_S, MAX_LEASE_TTL_S)


def lease_expired(owner: OwnerRecord, now: datetime | None = None, sightings: Sightings | None = None) -> bool:
    """Was the lease not renewed within its TTL, by this process's own observation? (Without the
    judge's `sightings`, a heartbeat in the future counts from now.)"""
    now = now or datetime.now(UTC)
    return now - last_renewal(owner, now, sightings or Sightings()) > timedelta(seconds=lease_ttl(owner))


def owner_alive(owner: OwnerRecord, now: datetime | None = None, sightings: Sightings | None = None) -> bool:
    """Could this owner still be running? A pid on this host is checked; another host's pid cannot
    be, so there the lease's heartbeat decides."""
    if owner.host and owner.host != socket.gethostname():
        return not lease_expired(owner, now, sightings)
    if not pid_alive(owner.pid):
        return False
    if owner.proc_start is None:
        # Nothing to tell this holder from any other process that has its pid (a hand edit, a
        # record from a system without /proc): a live pid proves nothing, so its heartbeat decides,
        # as for a holder on another host. A real holder renews every third of its TTL.
        return not lease_expired(owner, now, sightings)
    current = process_start(owner.pid)
    return current is None or current == owner.proc_start  # differs → the pid was reused


@dataclass(slots=True)
class LeaseHolder:
    """This process's identity as a lease candidate; claim/verify/release under the store lock."""

    store: CronStore
    started_at: datetime
    pid: int = field(default_factory=os.getpid)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    ttl_s: float = DEFAULT_LEASE_TTL_S
    # the token of the live holder this process last said it waits for (said once per holder)
    waiting_for: str | None = None
    sightings: Sightings = field(default_factory=Sightings)
    # this process's own server was judged fenced by the last claim (said once per fencing)
    is_fenced: bool = False

    def __post_init__(self) -> None:
        # others judge our lease by at most MAX_LEASE_TTL_S: renewing less often would lose it
        self.ttl_s = min(self.ttl_s, MAX_LEASE_TTL_S)

    def record(self) -> OwnerRecord:
        return OwnerRecord(
            pid=self.pid,
            token=self.token,
            started_at=self.started_at,
            proc_start=process_start(self.pid),
            host=socket.gethostname(),
            instance=self.store.instance_id,
            renewed_at=datetime.now(UTC),
            ttl_s=self.ttl_s,
        )

    def renew_due(self, state: CronFile, now: datetime | None = None) -> bool:
        """Is our heartbeat due (a third of the TTL since the last renewal)?"""
        owner = state.scheduler_owner
        if owner is None or not self.holds(state):
            return False
        now = now or datetime.now(UTC)
        last = owner.renewed_at or owner.started_at
        return owner.ttl_s != self.ttl_s or now - last >= timedelta(seconds=self.ttl_s / 3)

    def seconds_to_renewal(self, state: CronFile) -> float:
        """How long until our heartbeat is due (0 when it is, or when we do not hold the lease)."""
        owner = state.scheduler_owner
        if owner is None or not self.holds(state):
            return 0.0
        age = (datetime.now(UTC) - (owner.renewed_at or owner.started_at)).total_seconds()
        return max(0.0, self.ttl_s / 3 - age)

    def renew_in(self, state: CronFile) -> bool:
        """Renew the heartbeat of a lease we hold when it is due; True when `state` changed (the
        caller saves)."""
        if not self.renew_due(state):
            return False
        owner = state.scheduler_owner
        assert owner is not None
        owner.renewed_at, owner.ttl_s = datetime.now(UTC), self.ttl_s
        return True

    def holds(self, state: CronFile) -> bool:
        owner = state.scheduler_owner
        return owner is not None and owner.token == self.token and owner.pid == self.pid

    def claim_in(self, state: CronFile) -> bool:
        """Verify or take the lease inside an open transaction; True when we hold it afterwards.
        On a take-over `state.scheduler_owner` is replaced and the caller must save. A fenced
        server (`fenced`) neither takes nor keeps using the lease: False, and `state` unchanged."""
        if self._note_fenced():
            return False
        if self.holds(state):
            return True
        owner = state.scheduler_owner
        if owner is not None and self._alive(owner):
            if self.waiting_for != owner.token:  # once per holder, not every tick
                self.waiting_for = owner.token
                log.warning(
                    "cron: waiting for the scheduler lease held by %s since %s (last renewed %s); this "
                    "process fires no task until that holder stops or its lease expires",
                    _holder(owner),
                    owner.started_at.isoformat(),
                    owner.renewed_at.isoformat() if owner.renewed_at is not None else "never",
                )
            return False
        if owner is not None:
            log.warning(
                "cron: taking over the scheduler lease from %s owner %s (token %s…)",
                "expired" if owner.host and owner.host != socket.gethostname() else "dead",
                _holder(owner),
                owner.token[:6],
            )
        elif self.waiting_for is not None:
            log.warning("cron: the scheduler lease was released; this process takes it (pid %s)", self.pid)
        self.waiting_for = None
        state.scheduler_owner = self.record()
        return True

    def fenced(self) -> bool:
        """Is this process's own server judged gone by its cluster, or may it be at any moment (its
        instance row deleted or not renewed, judged as the others judge a lease holder, with a
        margin)? Asked by every claim under the store lock and again before every fire. Always
        False outside a cluster (a home's crons.json; a CLI process)."""
        me = self.store.instance_id
        return me is not None and self.store.instance_alive(me) is False

    def _note_fenced(self) -> bool:
        """`fenced`, remembered in `is_fenced` and said once when it starts and once when it ends."""
        fenced = self.fenced()
        if fenced and not self.is_fenced:
            log.error(
                "cron: this server (%s) is judged gone by its cluster, or its database session is away: "
                "its scheduler takes no lease and claims no run (a healthy server takes the due runs over)",
                self.store.instance_id,
            )
        elif self.is_fenced and not fenced:
            log.warning(
                "cron: this server (%s) is live in its cluster again; its scheduler goes on", self.store.instance_id
            )
        self.is_fenced = fenced
        return fenced

    def alive(self, owner: OwnerRecord) -> bool:
        """Could this holder still be running (its lease may not be taken)? The same judgement as
        `claim_in`'s; without the store lock it is only a hint (the scheduler's standby check)."""
        return self._alive(owner)

    def _alive(self, owner: OwnerRecord) -> bool:
        """A server of a cluster is judged by its instance row (any host); a process by its pid."""
        if owner.instance:
            judged = self.store.instance_alive(owner.instance)
            if judged is not None:
                return judged
        return owner_alive(owner, sightings=self.sightings)

    def claim(self) -> bool:
        """Claim or verify the lease in its own transaction (renewing its heartbeat when due)."""
        with self.store.lock():
            state = self.store.load()
            held_before = self.holds(state)
            ok = self.claim_in(state)
            if ok and (not held_before or self.renew_in(state)):
                self.store.save(state)
            else:
                self.store.keep(state)
            return ok

    def describe_holder(self, state: CronFile) -> str:
        """Who holds the lease, in words (for readiness and the log)."""
        owner = state.scheduler_owner
        if self.is_fenced:
            return (
                f"this server ({self.store.instance_id}) is judged gone by its cluster, or its database session "
                "is away: it takes no scheduler lease"
            )
        if owner is None:
            return "nobody holds the scheduler lease"
        if self.holds(state):
            return "this process holds the scheduler lease"
        now = datetime.now(UTC)
        age = (now - last_renewal(owner, now, self.sightings)).total_seconds()
        return f"the scheduler lease is held by {_holder(owner)} (renewed {age:.0f} s ago)"

    def verify(self) -> bool:
        """Do we still hold it? (Someone may have deleted or rewritten crons.json.)"""
        return self.holds(self.store.read())

    def release(self) -> None:
        """Give the lease up on a clean stop so a waiting process need not wait for our death."""
        with self.store.lock():
            state = self.store.load()
            if self.holds(state):
                state.scheduler_owner = None
                self.store.save(state)
            else:
                self.store.keep(state)


def _holder(owner: OwnerRecord) -> str:
    """A lease holder in words: its cluster instance, else its pid and host."""
    return owner.instance or f"pid {owner.pid} on {owner.host or 'this host'}"
