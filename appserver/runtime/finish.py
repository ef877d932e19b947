"""The one function that finishes a turn (segment): commit, then settle, then publish.

Every end goes through `finish_turn` with its typed `TurnEnd` (runtime/settle.py): the agent
loop's end, an accept that failed, a withdrawn queued input, a cancelled paused turn, and the
kernel's crash settle of a turn no runtime holds. A commit that fails ends the turn failed (a
store failure) and still settles and publishes it; the `Finished` outcome says so.

One exception: a commit (or a start) refused because the turn ended elsewhere (`TurnSettledElsewhere`:
another server of the cluster committed its end first, as a server judged gone mid-commit does
when it goes on) publishes the end the store holds, read back, never a failure of a turn that
ended: its clients would send again an input that did run (docs/scale-out.md). Likewise a turn
whose end (or start) could not be written while its server is cut off from its cluster: the others
may have taken it over (interrupted it, or run it), so it ends nothing here and its clients hear
the end the store holds once it can be read (`cut_off`, the kernel's `_cut_off`).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

from appserver.runtime.history import History
from appserver.runtime.lifecycle import Lease, TurnLifecycle
from appserver.runtime.pending import PendingAnswers
from appserver.runtime.restore import controller_from_store
from appserver.runtime.settle import TurnEnd, store_failure
from appserver.runtime.snapshot import TurnController, TurnSnapshot
from appserver.runtime.types import SETTLED_SNAPSHOT_STATUS
from appserver.store.base import ConversationGone, Store, StoreUnavailable, TurnSettledElsewhere, WriteRefused
from appserver.store.records import TurnCommit, TurnRecord
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
    and then `commit_error` is why). `elsewhere`: the turn had ended elsewhere (the commit was
    refused, `commit_error`), and `end` is the end the store holds, published instead.
    `published` is False when nothing was (a turn no runtime holds, that another server holds
    open now: that server ends it; or one not written while its server was cut off from its
    cluster: its clients get the end the store holds, `_unsaved_cut_off`)."""

    end: TurnEnd
    commit_error: Exception | None = None
    elsewhere: bool = False
    published: bool = True


async def finish_turn(
    store: Store,
    settled: Callable[[TurnRecord, TurnSnapshot], None],
    record: TurnRecord,
    controller: TurnController,
    end: TurnEnd,
    *,
    seat: Seat | None = None,
    lease: Lease | None = None,
    refused: TurnSettledElsewhere | None = None,
    cut_off: Callable[[TurnRecord, TurnController], bool] | None = None,
) -> Finished:
    """Commit `end`, settle the turn (record, lifecycle, the settle listeners) and publish its
    terminal or awaiting snapshot. `seat` is None for a turn no runtime holds (crash settle);
    `lease` is None for one that holds no lifecycle (a queued turn withdrawn before it began).
    `refused`: the turn's start was refused so (run.py), and `end` says the store failure; a
    commit refused so is handled alike (`_ended_elsewhere`). `cut_off`: asked when the turn could
    not be written; True when its server is cut off from its cluster (`_unsaved_cut_off`)."""
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
            if isinstance(exc, WriteRefused):  # known not written (not a commit cut off mid-way)
                end = _reply_unsaved(record, commit, end, exc)
            if seat is not None:
                seat.history.drop()
            if isinstance(exc, TurnSettledElsewhere):
                refused = exc
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
    if refused is not None:
        elsewhere = await _ended_elsewhere(store, settled, record, controller, refused, seat=seat, lease=lease)
        if elsewhere is not None:
            return elsewhere
    unsaved = failure if failure is not None else refused
    if unsaved is not None and cut_off is not None:
        left = _unsaved_cut_off(record, controller, end, unsaved, cut_off, seat=seat, lease=lease)
        if left is not None:
            return left
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


def _reply_unsaved(record: TurnRecord, commit: TurnCommit, end: TurnEnd, exc: WriteRefused) -> TurnEnd:
    """The end of an accepted turn was refused (a full disk, the file size limit, the file locked):
    its input was saved by the accept (its turn's row; the history too once a checkpoint wrote it),
    so the error says that, where, and that sending it again would store it twice, never the
    write's own "nothing of this request was written". Nothing more is written: the turn stays
    open in the store as it is, and the server's next start settles it as interrupted, its input
    kept. Error kind `store` (a reply that was not stored is no answer: never a 200 `failed`
    Response) marked `input_saved`: HTTP 503 `store_unavailable` with `x-should-retry: false`
    (http/common.py `turn_error`). An input withdrawn from the queue (never in the conversation)
    keeps the plain failure."""
    if end.error is None or not (commit.input_committed or record.input_committed):
        return end
    where = (
        f"is in conversation {record.conversation_id}'s history"
        if record.input_committed
        else f"was saved in conversation {record.conversation_id}"
    )
    message = (
        f"the turn's input {where}, but its reply could not be saved: {exc.cause}. Its turn {record.id} stays "
        "open in the store until the server's next start settles it as interrupted, the input kept in the "
        "conversation. Do not send the input again (it would be stored a second time): once the store takes "
        "writes again, continue the conversation"
    )
    return TurnEnd(end.status, end.stop_reason, dict(end.error, kind="store", input_saved=True, message=message))


def _unsaved_cut_off(
    record: TurnRecord,
    controller: TurnController,
    end: TurnEnd,
    unsaved: Exception,
    cut_off: Callable[[TurnRecord, TurnController], bool],
    *,
    seat: Seat | None,
    lease: Lease | None,
) -> Finished | None:
    """The turn could not be written while its server is cut off from its cluster (`cut_off` says
    so, and then its conversation's open turns here follow the store): the others may have taken
    it over, so it is neither settled nor published here. A failure it published would be no end
    the database holds (a turn the survivor interrupted, or ran and completed) and its client would
    send its input again. Its lease here is let go (nothing more runs on it). None when this server
    is not cut off: the turn ends failed, as the store failure it is (a conversation deleted meanwhile
    too: no store holds an end of it to read)."""
    if isinstance(unsaved, ConversationGone) or not cut_off(record, controller):
        return None
    if lease is not None and seat is not None:
        seat.lifecycle.finish(lease)
    log.warning(
        "turn %s could not be saved while this server is cut off from its cluster (%s): its clients here "
        "get the end the database holds once it can be read",
        record.id,
        unsaved,
    )
    return Finished(end, unsaved, published=False)


async def _ended_elsewhere(
    store: Store,
    settled: Callable[[TurnRecord, TurnSnapshot], None],
    record: TurnRecord,
    controller: TurnController,
    refused: TurnSettledElsewhere,
    *,
    seat: Seat | None,
    lease: Lease | None,
) -> Finished | None:
    """The turn's end (or start) was refused: read how the store holds it. Ended (another server
    committed its end first): that end is settled and published, at a revision above any this
    controller showed. Still open, the turn is another server's: a turn no runtime holds here
    publishes nothing (its holder ends it, and a mirror here reads that end); one a runtime here
    holds returns None, and ends failed `taken_over` as before (its clients must hear an end).
    None too when the store cannot be read (a turn no runtime holds then fails its take-over,
    which the next sweep makes again)."""
    rebuilt: TurnController | None = None
    stored_ids: list[int] = []
    try:
        stored = await store.get_turn(record.id)
        if stored is not None and stored.status in SETTLED_SNAPSHOT_STATUS:
            rebuilt = await controller_from_store(store, stored, [])
            messages = await store.list_messages(record.conversation_id)
            stored_ids = [m.id for m in messages if m.turn_id == record.id and m.id is not None]
    except Exception as exc:
        log.warning("turn %s: how it ended elsewhere could not be read: %s", record.id, exc)
        if seat is None:
            return Finished(store_failure(exc), exc, published=False)
        return None
    if stored is None or rebuilt is None:
        if seat is None:
            log.warning("turn %s is held by another server, which ends it: %s", record.id, refused)
            return Finished(store_failure(refused), refused, published=False)
        return None
    # From here on nothing awaits: no other task sees the turn half settled.
    snap = rebuilt.snapshot()
    controller.mirror(snap)  # never below a revision shown here (a terminal one is always taken)
    if stored_ids:
        controller.last_message_id = max(stored_ids)
    record.status = stored.status
    record.stop_reason = stored.stop_reason
    record.error = stored.error
    record.usage = dict(stored.usage)
    record.iteration = stored.iteration
    record.input_committed = stored.input_committed
    if seat is not None:
        seat.history.drop()  # the other server wrote the turn's messages: read them again
        if lease is not None:
            seat.lifecycle.finish(lease)
    settled(record, controller.snapshot())
    log.warning("turn %s had ended elsewhere (%s): its stored end is published", record.id, stored.status)
    return Finished(TurnEnd(stored.status, snap.stop_reason or "end_turn", stored.error), refused, elsewhere=True)


__all__ = ["Finished", "Seat", "finish_turn"]
