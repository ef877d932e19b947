"""TurnLifecycle: the only owner of a conversation's turn state. Everyone else reads properties."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Literal

LifecycleState = Literal["idle", "active", "awaiting", "cancelling"]


class StaleLease(Exception):
    """Raised inside a turn whose lease is no longer current: the code must go quiet."""


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    turn_id: str
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)


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
        if self._state == "awaiting":
            if self._awaiting_turn != turn_id:
                raise RuntimeError(f"conversation awaits turn {self._awaiting_turn}, cannot begin {turn_id}")
        elif self._state != "idle":
            raise RuntimeError(f"cannot begin a turn while {self._state}")
        self._lease = Lease(next(self._ids), turn_id)
        self._awaiting_turn = None
        self._state = "active"
        return self._lease

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
        """Mark the active turn as cancelling; returns its lease (None when nothing runs)."""
        if self._state != "active" or self._lease is None:
            return None
        self._state = "cancelling"
        self._lease.cancel_event.set()
        return self._lease

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

    def drop_awaiting(self, turn_id: str) -> None:
        """An awaiting turn was closed without running (cancelled while paused)."""
        if self._state == "awaiting" and self._awaiting_turn == turn_id:
            self._state = "idle"
            self._awaiting_turn = None
