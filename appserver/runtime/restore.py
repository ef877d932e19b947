"""Rebuild a turn's snapshot controller from the store: for a turn no runtime holds in memory
(settled earlier, or paused when the server restarted).

Revisions of a turn strictly increase (docs/protocol.md), also across a restart and a takeover
by another server of a cluster. A new turn counts its changes from 0, but the store does not
know the last revision clients saw of a turn an earlier process (or another server) held: a
queued turn's queue positions, a paused turn's answers, a running turn's streamed changes are
published and never written down (a running turn's revision is stored when it begins and when it
settles; its draft checkpoint every `draft_interval_s` at most). So a controller this process
builds for a turn that existed before it (a queued turn it requeues, a paused turn it adopts, a
turn a stop or a crash interrupted that it settles) starts at a *clock revision*
(`restart_revision`): the time it is built in microseconds since 1970 (about 1.8e15 today,
below 2**53, so exact in JSON numbers of every client until the year 2255), never below the
stored revision + 1. No turn changes a million times a second, so that is higher than any
revision an earlier process published for it, from 0 or from a clock revision of its own. (Across
servers of a cluster this takes their clocks to agree to well within the seconds a takeover
takes.) The revisions stored from then on (`mark_turn_running`, `commit_turn`) are such values:
PostgreSQL's `turns.revision` is a BIGINT since schema version 4.

A settled turn rebuilt again shows its stored revision, as published, so showing it again
repeats the revision, as a snapshot may. One exception: an interrupted turn settled before
version 4 stored its revision + 1 but published a clock revision; it is shown at the time it was
settled (`interrupted_revision`, taken from the stored `ended_at`, the same each time).
"""

from __future__ import annotations

import time
from typing import cast

from appserver.agent.events import TextDelta
from appserver.runtime.snapshot import TurnController
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS, StopReason
from appserver.store.base import Store
from appserver.store.records import PendingCall, TurnRecord


async def controller_from_store(
    store: Store, turn: TurnRecord, pending: list[PendingCall], *, follower: bool = False
) -> TurnController:
    """The turn's controller, rebuilt: a settled turn at its stored revision; a paused one, which
    this process adopts (its runtime drives it from now on), at a `restart_revision`, unless
    `follower`: a mirror of a turn another server holds, which takes that server's revisions, so
    starts at the stored one."""
    messages = [m for m in await store.list_messages(turn.conversation_id) if m.turn_id == turn.id]
    revision = max(turn.revision - 1, 0)
    if turn.status == "interrupted":
        revision = max(revision, interrupted_revision(turn) - 1)  # finish() below adds the 1
    elif turn.status == "awaiting" and not follower:
        revision = restart_revision(turn) - 1  # pause() below adds the 1
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
    elif follower and turn.status == "running" and isinstance(turn.draft, dict):
        # Another server runs it: its last checkpoint (the text past what history holds, and the
        # revision it had then), so a subscriber here sees the reply so far, not an empty turn at
        # revision 0, until that server's next snapshot arrives.
        text = turn.draft.get("text")
        if isinstance(text, str) and text:
            controller.apply(TextDelta(text))
        seen = turn.draft.get("revision")
        if isinstance(seen, int) and not isinstance(seen, bool) and seen > controller.revision:
            controller.revision = seen
    return controller


REVISIONS_PER_SECOND = 1_000_000
# A revision at least this big was taken from a clock (10**15 µs: September 2001); a turn's own
# changes counted from 0 never get there.
CLOCK_REVISIONS = 10**15

_last_clock = 0


def clock_revision() -> int:
    """Now in microseconds since 1970; in this process each call higher than the one before
    (the wall clock may step back)."""
    global _last_clock
    _last_clock = max(_last_clock + 1, int(time.time() * REVISIONS_PER_SECOND))
    return _last_clock


def restart_revision(turn: TurnRecord) -> int:
    """The first revision of a controller this process builds for a turn that existed before it
    (see the module's docstring): a clock revision, never below the stored revision + 1."""
    return max(turn.revision + 1, clock_revision())


def interrupted_revision(turn: TurnRecord) -> int:
    """The revision of an interrupted turn's rebuilt snapshot: the one stored with it (its
    settle stores what it publishes, a clock revision), or for a turn settled before that (a
    small stored revision) the time it was settled in microseconds, never below its stored
    revision + 1 (see the module's docstring)."""
    if turn.revision >= CLOCK_REVISIONS:
        return turn.revision
    settled_at = turn.ended_at or turn.started_at or turn.created_at or time.time()
    return max(turn.revision + 1, int(settled_at * REVISIONS_PER_SECOND))
