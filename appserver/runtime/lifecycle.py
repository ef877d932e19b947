"""TurnLifecycle: the only owner of a conversation's turn state. Everyone else reads properties."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from appserver.runtime.types import LifecycleState


class StaleLease(Exception):
    """Raised inside a turn whose lease is no longer current: the code must go quiet."""


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    turn_id: str
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)
    # The turn's outcome is decided and being saved (see TurnLifecycle.settle): a cancel is too late.
    final: bool = False
    # The cancel came from a client (acknowledged `cancelled`: true, and saved with the turn for a
    # restart, `Store.record_cancel`), not from the server's stop: the turn ends cancelled even
    # when the server stops before it settled.
    client_cancel: bool = False
    # Every cancel accepted for it came from its HTTP client going away (`Kernel.cancel`
    # `client_left`), none from a client naming it: if the turn showed and did nothing, its input
    # is withdrawn as a queued one's is (`settle.left_unseen`).
    left_only: bool = False


class TurnLifecycle:
    def __init__(self) -> None:
        self._state: LifecycleState = "idle"
        self._lease: Lease | None = None
        self._awaiting_turn: str | None = None
        self._ids = itertools.count(1)

    @property
    def state(self) -> LifecycleState:
        return self._state

    @property
    def turn_id(self) -> str | None:
        if self._lease is not None:
            return self._lease.turn_id
        return self._awaiting_turn

    @property
    def busy(self) -> bool:
        return self._state != "idle"

    def begin(self, turn_id: str) -> Lease:
        """idle → active for a new turn, or awaiting → active for the awaiting turn (its resume, or
        its cancel). Synchronous, so whoever takes the lease owns the turn from that instant: an
        answer and a cancel racing for a paused turn cannot both act on it."""
        if self._state == "awaiting":
            if self._awaiting_turn != turn_id:
                raise RuntimeError(f"conversation awaits turn {self._awaiting_turn}, cannot begin {turn_id}")
        elif self._state != "idle":
            raise RuntimeError(f"cannot begin a turn while {self._state}")
        lease = Lease(next(self._ids), turn_id)
        self._lease = lease
        self._awaiting_turn = None
        self._state = "active"
        return lease

    def restore_awaiting(self, turn_id: str) -> None:
        """Adopt a turn that the store says is paused (after a restart or in another process)."""
        if self._state != "idle":
            raise RuntimeError(f"cannot restore an awaiting turn while {self._state}")
        self._state = "awaiting"
        self._awaiting_turn = turn_id

    def is_current(self, lease: Lease) -> bool:
        return self._lease is lease

    def check(self, lease: Lease) -> None:
        if self._lease is not lease:
            raise StaleLease(lease.turn_id)

    def request_cancel(self) -> Lease | None:
        """Mark the active turn as cancelling; returns its lease, or None when nothing runs or the
        turn's outcome is already decided (then the cancel changes nothing and must not say so).
        A turn whose cancel was accepted here always ends cancelled (see `settle`)."""
        lease = self._lease
        if lease is None:
            return None
        if self._state == "cancelling":
            return lease  # accepted before: the turn ends cancelled
        if self._state != "active" or lease.final:
            return None
        self._state = "cancelling"
        lease.cancel_event.set()
        return lease

    def settle(self, lease: Lease, *, pausing: bool) -> bool:
        """The turn's loop is over and its outcome is about to be saved: True when a cancel was
        accepted, so the outcome must be `cancelled` whatever the loop returned. From here on a
        cancel is refused, except while a pause is being saved: that cancel closes the paused
        turn right after (the lease's cancel_event tells `finish_turn`, runtime/finish.py)."""
        self.check(lease)
        cancelled = self._state == "cancelling"
        if cancelled or not pausing:
            lease.final = True
        return cancelled

    @property
    def cancelling(self) -> bool:
        return self._state == "cancelling"

    def pause(self, lease: Lease) -> None:
        self.check(lease)
        self._state = "awaiting"
        self._awaiting_turn = lease.turn_id
        self._lease = None

    def finish(self, lease: Lease) -> None:
        self.check(lease)
        self._state = "idle"
        self._lease = None
