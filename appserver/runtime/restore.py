"""Rebuild a turn's snapshot controller from the store: for a turn no runtime holds in memory
(settled earlier, or paused when the server restarted).

Revisions of a turn strictly increase (docs/protocol.md), also across a restart. A turn a stop
or a crash interrupted is the one case where the store does not know the last revision clients
saw: a process killed mid-turn published revisions (one per streamed change) that it never wrote
down (its draft checkpoint is written every `draft_interval_s` at most, and not at all while no
text is visible), and the crash settle of the next process stores the turn at the revision it
started running with + 1. So its rebuilt snapshot takes a revision from the time it was settled:
`interrupted_revision`, microseconds since 1970 (about 1.8e15 today, below 2**53, so exact in
JSON numbers of every client until the year 2255). A turn's own revisions count its changes from
near 0 (an interrupted turn never runs again, so they never start from such a value), and no turn
changes a million times a second, so that is higher than any revision a client can have seen of
it. It is the same each time the turn is rebuilt (taken from the stored `ended_at`), so showing
the settled turn again repeats the revision, as a snapshot may.
"""

from __future__ import annotations

import time
from typing import cast

from appserver.runtime.snapshot import TurnController
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS, StopReason
from appserver.store.base import Store
from appserver.store.records import PendingCall, TurnRecord


async def controller_from_store(store: Store, turn: TurnRecord, pending: list[PendingCall]) -> TurnController:
    messages = [m for m in await store.list_messages(turn.conversation_id) if m.turn_id == turn.id]
    revision = max(turn.revision - 1, 0)
    if turn.status == "interrupted":
        revision = max(revision, interrupted_revision(turn) - 1)  # finish() below adds the 1
    controller = TurnController(turn.id, turn.conversation_id, turn.agent_id, revision=revision)
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


REVISIONS_PER_SECOND = 1_000_000


def interrupted_revision(turn: TurnRecord) -> int:
    """The revision of an interrupted turn's rebuilt snapshot: the time it was settled in
    microseconds (see the module's docstring), never below its stored revision + 1."""
    settled_at = turn.ended_at or turn.started_at or turn.created_at or time.time()
    return max(turn.revision + 1, int(settled_at * REVISIONS_PER_SECOND))
