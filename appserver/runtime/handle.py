"""The two values a front end holds between kernel calls: a turn's handle and an answer to a
pending call."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.values import value


@dataclass(slots=True)
class TurnHandle:
    """A turn as its submitter follows it: the controller publishes its snapshots latest-wins."""

    turn_id: str
    conversation_id: str
    controller: TurnController
    # Done once this server gave up reading the turn's end: cut off from its cluster, it let the
    # turn go unsaved and could not read how it ended in time (`ClusterLink.give_up_reading`).
    _unread: asyncio.Future[None] | None = field(default=None, init=False, repr=False, compare=False)

    def unread(self) -> asyncio.Future[None]:
        """What a request answering with the turn's end waits on beside the turn: once done, that
        end cannot be read here (the turn may have run elsewhere), and the request says so."""
        if self._unread is None:
            self._unread = asyncio.get_running_loop().create_future()
        return self._unread

    def give_up_reading(self) -> None:
        waiter = self.unread()
        if not waiter.done():
            waiter.set_result(None)

    @property
    def unreadable(self) -> bool:
        return self._unread is not None and self._unread.done()

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
