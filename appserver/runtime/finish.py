"""The one function that finishes a turn (segment): commit, then settle, then publish.

Every end goes through `finish_turn` with its typed `TurnEnd` (runtime/settle.py): the agent
loop's end, an accept that failed, a withdrawn queued input, a cancelled paused turn, and the
kernel's crash settle of a turn no runtime holds. A commit that fails ends the turn failed (a
store failure) and still settles and publishes it; the `Finished` outcome says so.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

from appserver.runtime.history import History
from appserver.runtime.lifecycle import Lease, TurnLifecycle
from appserver.runtime.pending import PendingAnswers
from appserver.runtime.settle import TurnEnd, store_failure
from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS
from appserver.store.base import ConversationGone, Store, StoreUnavailable, TurnSettledElsewhere
from appserver.store.records import TurnRecord
from appserver.values import value

log = logging.getLogger("appserver.runtime")


@value
class Seat:
    """The conversation runtime a turn ends in: its history in memory, its lifecycle (released
    or paused under the turn's lease) and its pending answers (a pause waits there)."""

    history: History
    lifecycle: TurnLifecycle
    answers: PendingAnswers


@value
class Finished:
    """How a turn ended: `end` is what was published (a store failure when the commit failed,
    and then `commit_error` is why)."""

    end: TurnEnd
    commit_error: Exception | None = None


async def finish_turn(
    store: Store,
    settled: Callable[[TurnRecord, TurnSnapshot], None],
    record: TurnRecord,
    controller: TurnController,
    end: TurnEnd,
    *,
    seat: Seat | None = None,
    lease: Lease | None = None,
) -> Finished:
    """Commit `end`, settle the turn (record, lifecycle, the settle listeners) and publish its
    terminal or awaiting snapshot. `seat` is None for a turn no runtime holds (crash settle);
    `lease` is None for one that holds no lifecycle (a queued turn withdrawn before it began)."""
    commit = end.commit
    failure: Exception | None = None
    if commit is not None:
        try:
            await store.commit_turn(record.conversation_id, commit)
        except Exception as exc:
            if isinstance(exc, (ConversationGone, TurnSettledElsewhere, StoreUnavailable)):  # no fault of ours to trace
                log.warning("turn %s not saved: %s", record.id, exc)
            elif isinstance(exc, sqlite3.Error):  # the store's trouble (damaged, full): no fault of ours to trace
                log.error("could not commit turn %s: %s", record.id, exc)
            else:
                log.exception("could not commit turn %s", record.id)
            failure = exc
            end = store_failure(exc)
            if seat is not None:
                seat.history.drop()
        else:
            record.input_committed = record.input_committed or commit.input_committed
            record.iteration = commit.iteration
            record.usage = dict(commit.usage)
            stored = [m.id for m in commit.messages if m.id is not None]
            if stored:
                controller.last_message_id = max(stored)
            controller.share_texts(commit.messages)
            controller.settle_calls(commit.messages)
            if seat is not None:
                seat.history.extend(commit.messages)
    # From here on nothing awaits: no other task sees the turn half settled.
    record.status = end.status
    if end.status == "awaiting" and commit is not None and lease is not None and seat is not None:
        controller.mark_pending_blocks(commit.pending)
        controller.pause(end.stop_reason, commit.pending)
        seat.lifecycle.pause(lease)
        seat.answers.paused(record, commit.pending)
        settled(record, controller.snapshot())
        if lease.cancel_event.is_set():  # a cancel accepted while the pause was being saved
            seat.answers.take(record, None).client_cancel = lease.client_cancel
        return Finished(end, failure)
    controller.finish(SETTLED_SNAPSHOT_STATUS[end.status], end.stop_reason, end.error)
    if lease is not None and seat is not None:
        seat.lifecycle.finish(lease)
    settled(record, controller.snapshot())
    return Finished(end, failure)


__all__ = ["Finished", "Seat", "finish_turn"]
