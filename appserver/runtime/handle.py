"""The two values a front end holds between kernel calls: a turn's handle and an answer to a
pending call."""

from __future__ import annotations

from dataclasses import dataclass

from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.values import value


@dataclass(slots=True)
class TurnHandle:
    """A turn as its submitter follows it: the controller publishes its snapshots latest-wins."""

    turn_id: str
    conversation_id: str
    controller: TurnController

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
