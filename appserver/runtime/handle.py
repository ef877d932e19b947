"""The two values a front end holds between kernel calls: a turn's handle and an answer to a
pending call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.values import value


@dataclass(slots=True)
class TurnHandle:
    """A turn as its submitter follows it: the controller publishes its snapshots latest-wins."""

    turn_id: str
    conversation_id: str
    controller: TurnController
    # Set once this server gave up reading the turn's end: cut off from its cluster, it let the
    # turn go unsaved and could not read how it ended in time (`ClusterLink.give_up_reading`).
    unreadable: bool = field(default=False, init=False, repr=False, compare=False)
    # What each request waiting on the turn's end is woken by then (`http/common.py Unread`): a
    # list made only for a waiter, as the request path makes one per turn.
    _readers: list[Callable[[], None]] | None = field(default=None, init=False, repr=False, compare=False)

    def add_reader(self, wake: Callable[[], None]) -> None:
        if self._readers is None:
            self._readers = []
        self._readers.append(wake)

    def remove_reader(self, wake: Callable[[], None]) -> None:
        if self._readers is not None and wake in self._readers:
            self._readers.remove(wake)

    def give_up_reading(self) -> None:
        """The turn's end cannot be read here (it may have run elsewhere): each request waiting for
        it is woken to say so."""
        if self.unreadable:
            return
        self.unreadable = True
        for wake in list(self._readers or ()):
            wake()

    async def wait_settled(self, timeout: float | None = None, *, after_revision: int = -1) -> TurnSnapshot:
        return await self.controller.wait_settled(timeout, after_revision=after_revision)


@value
class Decision:
    """An answer to a pending call: approve/deny (approvals) or a result (client tools)."""

    call_id: str
    action: str  # approve | deny | result
    output: str | None = None
    is_error: bool = False
    reason: str | None = None
    decided_by: str | None = None
