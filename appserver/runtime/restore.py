"""Rebuild a turn's snapshot controller from the store: for a turn no runtime holds in memory
(settled earlier, or paused when the server restarted)."""

from __future__ import annotations

from typing import cast

from appserver.runtime.snapshot import TurnController
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS, StopReason
from appserver.store.base import Store
from appserver.store.records import PendingCall, TurnRecord


async def controller_from_store(store: Store, turn: TurnRecord, pending: list[PendingCall]) -> TurnController:
    messages = [m for m in await store.list_messages(turn.conversation_id) if m.turn_id == turn.id]
    controller = TurnController(turn.id, turn.conversation_id, turn.agent_id, revision=max(turn.revision - 1, 0))
    controller.load_messages(messages)
    controller.usage = dict(turn.usage)
    stored = cast("StopReason | None", turn.stop_reason)  # the store keeps what the runtime wrote
    if turn.status == "awaiting":
        controller.mark_pending_blocks(pending)
        has_approval = any(p.kind == "approval" and p.status == "pending" for p in pending)
        controller.pause(stored or ("requires_approval" if has_approval else "requires_client_tool"), pending)
    elif turn.status in SETTLED_SNAPSHOT_STATUS:
        controller.finish(SETTLED_SNAPSHOT_STATUS[turn.status], stored or "end_turn", turn.error)
    return controller
