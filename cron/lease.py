"""The scheduler lease: `scheduler_owner` in crons.json says which process may fire tasks.

An owner is judged by its process identity (pid plus the process start time from
`/proc/<pid>/stat` field 22), not by a heartbeat: a dead pid, a zombie, or a live pid whose start
time differs (the pid was reused by another program) is dead, and its lease may be taken. A live
owner is never displaced, so two `serve` processes on one home never both fire. Every function
here must be called with the store lock held; `LeaseHolder` does that for the scheduler.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import datetime

from appserver.procid import pid_alive, process_start_ticks
from cron.store import CronFile, CronStore, OwnerRecord

log = logging.getLogger("appserver.cron")


process_start = process_start_ticks  # the name the scheduler and its tests use


def owner_alive(owner: OwnerRecord) -> bool:
    """Could this owner still be running? Another host's pid cannot be checked: assume alive."""
    if owner.host and owner.host != socket.gethostname():
        return True
    if not pid_alive(owner.pid):
        return False
    if owner.proc_start is None:
        return True
    current = process_start(owner.pid)
    return current is None or current == owner.proc_start  # differs → the pid was reused


@dataclass(slots=True)
class LeaseHolder:
    """This process's identity as a lease candidate; claim/verify/release under the store lock."""

    store: CronStore
    started_at: datetime
    pid: int = field(default_factory=os.getpid)
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    def record(self) -> OwnerRecord:
        return OwnerRecord(
            pid=self.pid,
            token=self.token,
            started_at=self.started_at,
            proc_start=process_start(self.pid),
            host=socket.gethostname(),
            instance=self.store.instance_id,
        )

    def holds(self, state: CronFile) -> bool:
        owner = state.scheduler_owner
        return owner is not None and owner.token == self.token and owner.pid == self.pid

    def claim_in(self, state: CronFile) -> bool:
        """Verify or take the lease inside an open transaction; True when we hold it afterwards.
        On a take-over `state.scheduler_owner` is replaced and the caller must save."""
        if self.holds(state):
            return True
        owner = state.scheduler_owner
        if owner is not None and self._alive(owner):
            return False
        if owner is not None:
            log.warning(
                "cron: taking over the scheduler lease from dead owner pid %s (token %s…)",
                owner.pid,
                owner.token[:6],
            )
        state.scheduler_owner = self.record()
        return True

    def _alive(self, owner: OwnerRecord) -> bool:
        """A server of a cluster is judged by its instance row (any host); a process by its pid."""
        if owner.instance:
            judged = self.store.instance_alive(owner.instance)
            if judged is not None:
                return judged
        return owner_alive(owner)

    def claim(self) -> bool:
        """Claim or verify the lease in its own transaction."""
        with self.store.lock():
            state = self.store.load()
            held_before = self.holds(state)
            ok = self.claim_in(state)
            if ok and not held_before:
                self.store.save(state)
            else:
                self.store.keep(state)
            return ok

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
