"""Replies: following each submitted turn and delivering what it says back to its chat.

One follower per turn (`follow`): the turn's snapshots grow a `ReplySink` in place (paced about one
edit per second, the end never held back long), the final text is written to the ledger before it
is delivered, and the platform ids are noted as each part goes out, so a restart continues the same
reply instead of sending it again. A part whose send was in flight at the crash was noted as
attempted first: after the restart it is looked up or deduped where the platform allows, and sent
again only where it allows neither (see `ReplySink.on_attempt`). Replies of one conversation in a
chat go out in their messages' order (`ChatOrder`, keyed by `order_key`); a chat's other
conversation (the one it left with `/new`, whose turn may wait ten minutes for an approval) holds
none of them back. The typing indicator runs while a turn does.

A turn `/cancel` took out of the server's queue before it started (`withdraw`) is answered with
nothing: its rows are failed with the reason `/cancel` gave.

Every turn is asked about again as its submit is acked (`refuse_if_not_let_in`), as it is first seen
out of the server's queue (`admits`), and at each change of gateway.db until then (`refuse_queued`):
one whose sender access no longer lets in (a `pairing revoke` while it waited in the queue, or while
its submit was on its way to a stalled server) is cancelled and answered with nothing, its rows failed
with `NO_LONGER_LET_IN` (`NO_LONGER_LET_IN_AS_STARTED` when the gateway saw it start first).
So is every turn a restarted gateway picks back up before any of its reply was noted: whether it was
queued, and whether it started before the revoke, is not known then (a restarted server starts a
queued turn at once, before the gateway is back), so it is asked again as the gateway sees it, and
first thing at the start (`Gateway.start`); one the server shows started fails with
`NO_LONGER_LET_IN_ONCE_STARTED`, never with a claim that it did not start.

A write to gateway.db that fails while a reply goes out (another process holds its write lock past
the busy timeout, the disk is full) is tried again until it goes through (`write_until_done`), each
failure logged as an error: a note of the reply's progress before the sink's next platform call
(`ReplyNotes`), its `delivered` before the chat's next reply. Given up, the row stayed `finished` with
the chat holding the reply, and the next restart sent it again, after the replies that came since.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from appserver.client import TERMINAL, Closed, ProtocolError, lost_snapshot
from gateway.accounts import AccountRunner
from gateway.delivery import ChatOrder, DeliveryFailed, Outboxes, ReplySink, reply_body, visible_text
from gateway.ledger import Entry, Ledger, UpdateKey
from gateway.link import ServerLink, TurnFollower, is_untraced
from gateway.status import StatusBoard
from gateway.tool import TurnSends
from plugins.contract import Target

log = logging.getLogger("gateway.replies")
T = TypeVar("T")

FIRST_SEND_GRACE_S = 0.3
TYPING_EVERY_S = 4.0
# A cron delivery (`deliver_text`) is given up after this, which is longer than the outbox's
# transient retries (sum(BACKOFF_S) ≈ 60 s plus the attempts) and shorter than the supervisor's
# `deliver` command timeout (gateway/supervisor.py), itself shorter than cron's DELIVER_TIMEOUT_S:
# each waiter outlasts the one it waits for, so the run log records the real outcome.
DELIVER_GIVE_UP_S = 90.0
CONTEXT_WAIT_S = 5.0  # how long a tool call or approval may wait for its turn's submit to be acked
# A turn picked back up after a restart that no snapshot has shown yet is asked about again this
# often (`Replies._first_snapshot`) by a server without `get_turn`: a turn withdrawn from the queue
# before the restart never reports again, and its follower holds its conversation's replies
# (`ChatOrder`) until it ends.
RECOVER_AGAIN_S = 2.0
RECOVER_AGAIN_MAX_S = 15.0  # while it may still wait in the queue (a turn ahead may wait for an approval)
# Why a message's turn was not started (a debounced batch) or was cancelled as it left the server's
# queue (a message queued behind a running turn): its sender was let in when it came, no longer.
NO_LONGER_LET_IN = "the sender's access was taken away before the turn started"
# ...and why one is cancelled that this gateway saw start (the revoke came as it left the queue):
# the agent may have read the message (the history keeps it), nothing of it is delivered.
NO_LONGER_LET_IN_AS_STARTED = "the sender's access was taken away as the turn started"
# ...and why one is cancelled that a restarted gateway picked back up and found started (the server
# ran it while no gateway was there to ask): whether the revoke came before its start is not known.
NO_LONGER_LET_IN_ONCE_STARTED = "the sender's access was taken away; the turn had started when the gateway saw it"

# A ledger write that gateway.db refuses while the gateway runs (busy past its 5 s timeout, the disk
# full) is tried again after these pauses, the last one repeated until it goes through: what it
# records (a reply's ids, its `delivered`, a turn's submit) is what keeps a restart from doing again
# what was done, so it is never given up (`write_until_done`).
LEDGER_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0)

LetsIn = Callable[[Entry, AccountRunner], bool]


def ledger_retry_delay(failures: int) -> float:
    """The pause after the `failures`-th failed write in a row (1 or more): `LEDGER_RETRY_S`, bounded."""
    return LEDGER_RETRY_S[min(max(failures, 1), len(LEDGER_RETRY_S)) - 1]


async def write_until_done(what: str, write: Callable[[], T]) -> T:
    """`write()` (ledger transactions safe to run again), tried again with a bounded backoff while
    gateway.db refuses it (`sqlite3.OperationalError`: busy past its timeout, locked, the disk full or
    failing), each failure logged as an error naming `what`: the bookkeeping of something already done
    (a reply in the chat, a turn on the server) is never dropped, nor its task ended by it. Any other
    error (a closed connection at shutdown, a constraint) is raised: no wait makes it pass."""
    failures = 0
    while True:
        try:
            result = write()
        except sqlite3.OperationalError as exc:  # busy, locked, full, I/O: what passes (not a bug, a closed file)
            failures += 1
            delay = ledger_retry_delay(failures)
            log.error("%s: gateway.db refused the write (%s); trying again in %g s", what, exc, delay)
            await asyncio.sleep(delay)
            continue
        if failures:
            log.warning("%s: written to gateway.db after %d failed attempt(s)", what, failures)
        return result


class LedgerBehind(Exception):
    """A note of a reply's progress could not be written yet (`ReplyNotes`): raised out of the sink
    before its next platform call, so nothing more reaches the chat than the ledger knows of."""


class ReplyNotes:
    """A sink's notes of one reply's progress (`on_attempt` before a part goes out, `on_sent` after),
    written as they come. One that gateway.db refuses is kept and `LedgerBehind` raised out of the sink;
    `run` then writes it (retrying) and runs the sink's step again, which goes on where it stopped (a
    part already sent is kept, one not yet sent goes out now). A restart thus finds every part that
    reached the chat, or the one whose send was in flight, instead of sending it again."""

    def __init__(self, ledger: Ledger, key: UpdateKey) -> None:
        self.ledger = ledger
        self.key = key
        self._pending: list[Callable[[], None]] = []

    def attempt(self, part: str, at: float) -> None:
        self._write(partial(self.ledger.note_sending, self.key, part, at))

    def sent(self, ids: list[str]) -> None:
        self._write(partial(self.ledger.note_sent, self.key, list(ids), None))

    def _write(self, write: Callable[[], None]) -> None:
        if not self._pending:
            try:
                write()
                return
            except sqlite3.OperationalError as exc:
                what = "gateway.db refused a note of the reply's progress"
                log.error("%s: %s (%s); nothing more is sent until it is written", self.key, what, exc)
        self._pending.append(write)
        raise LedgerBehind(str(self.key))

    async def run(self, step: Callable[[], Awaitable[T]]) -> T:
        """Run a sink step (`show`, `finish`) until it ends with its notes written."""
        while True:
            try:
                return await step()
            except LedgerBehind:
                while self._pending:
                    await write_until_done(f"{self.key}: the reply's progress", self._pending[0])
                    self._pending.pop(0)
                log.warning("%s: the reply's progress is noted now; the reply goes on", self.key)


class NotLetIn(Exception):
    """A queued turn's sender is no longer let in: it is cancelled, nothing is delivered, its rows
    fail with `reason`."""

    def __init__(self, reason: str = NO_LONGER_LET_IN) -> None:
        super().__init__(reason)
        self.reason = reason


class Withdrawn(Exception):
    """A queued turn `/cancel` took out of the server's queue before it started: nothing is
    delivered (not even "Cancelled"), its rows are failed with the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class TurnContext:
    """A turn this gateway submitted and follows: where it came from and who started it."""

    runner: AccountRunner
    key: UpdateKey
    here: Target
    reply_to: str
    starter: str
    conversation: str | None
    sends: TurnSends = field(default_factory=TurnSends)
    # not let in since its submit went out (every turn this gateway submits; a resumed one before any
    # of its reply was noted): access is asked again as it starts (or, when it started meanwhile, as it is seen)
    waited: bool = False
    admitted: bool | None = None  # that answer, once given (False: cancelled, never answered)
    left_queue: bool = False  # a snapshot showed it started (or ended): no longer one `withdraw` takes
    withdrawn: str | None = None  # why `/cancel` is taking it out of the queue (`Replies.withdraw`)
    # why it was likely withdrawn before a restart (a `/cancel` that may stop it was taken after it):
    # the reason its rows end with if the server shows it withdrawn, or no trace of it (`Replies._ended`)
    maybe_withdrawn: str | None = None
    resumed: bool = False  # picked back up after a restart: whether it started before the revoke is not known


def answer_target(entry: Entry) -> Target:
    """Where an answer to `entry` goes: its chat and thread, as a reply to it (a platform may thread
    it, a webhook receiver correlates it by `reply_to`). Replies, command answers and notices alike."""
    return Target(entry.chat, entry.thread, entry.key.message_id)


def chat_key(entry: Entry) -> str:
    return f"{entry.key.channel}:{entry.key.account}:{entry.chat}:{entry.thread or ''}"


def order_key(entry: Entry) -> str:
    """What a reply keeps its place in (`ChatOrder`): its chat and thread, and its conversation. The
    turns of one conversation run one after another, so their replies keep their messages' order;
    after `/new` the previous conversation's reply (paused for an approval, it may wait ten minutes)
    does not hold back the new conversation's."""
    return f"{chat_key(entry)}:{entry.conversation or ''}"


def unproven(entry: Entry) -> bool:
    """Whether a turn picked back up after a restart may not have been let in as it started: it is
    not finished and nothing of its reply was noted (sent, being sent, or its text: each is noted
    only after the turn was let in, `_check_start`). Such a turn, queued or not before the restart,
    is asked again as the gateway sees it: the revoke (or the `allow` edit) may have come while it
    waited, and a restarted server starts a queued turn before the gateway is back to ask."""
    return entry.state == "submitted" and not entry.remote_ids and entry.sending is None and not entry.reply


def final_text(snapshot: dict[str, Any], shown: str) -> str:
    """The reply's last text. A turn that ended without all of its text (interrupted by a crash,
    failed or cancelled mid-stream) keeps what the chat already showed, followed by the one-line
    reason: the server's saved text is taken only where it extends that (a killed server's is its
    last draft, which lags the stream by up to a second; a text that differs otherwise is not what
    the person read). A completed turn's text is the reply, whatever was shown on the way."""
    final = visible_text(snapshot, tool_status=False)
    if not shown or snapshot.get("status") not in ("failed", "cancelled") or reply_body(snapshot).startswith(shown):
        return final
    reason = visible_text({**snapshot, "blocks": []}, tool_status=False)
    return f"{shown}\n\n{reason}"


def _refused_reason(ctx: TurnContext, snap: dict[str, Any]) -> str:
    """Why a turn refused at `snap` fails: before it started when the server dropped it from the
    queue (`withdrawn`) or it still waits there; as it started when this gateway saw it leave the
    queue (the revoke lost the race with its start); for one picked back up after a restart that
    the server shows started, only that it had started (it may have run while no gateway ran)."""
    if snap.get("status") in TERMINAL:
        started = (snap.get("error") or {}).get("kind") != "withdrawn" and not is_untraced(snap)
    else:
        started = snap.get("phase") != "queued"
    if not started:
        return NO_LONGER_LET_IN
    return NO_LONGER_LET_IN_ONCE_STARTED if ctx.resumed else NO_LONGER_LET_IN_AS_STARTED


def _gone(turn_id: str, code: str) -> dict[str, Any]:
    """The outcome of a resumed turn whose conversation the server no longer shows this gateway."""
    return {
        "turn_id": turn_id,
        "status": "failed",
        "revision": 1 << 30,
        "blocks": [],
        "error": {"message": f"the conversation is gone ({code})"},
    }


class Replies:
    def __init__(
        self,
        ledger: Ledger,
        link: ServerLink,
        outboxes: Outboxes,
        changed: Callable[[], None],
        on_turn_done: Callable[[str], None],
        lets_in: LetsIn,
    ) -> None:
        self.ledger = ledger
        self.lets_in = lets_in  # whether access lets a message's sender in now (ChatOps.lets_in)
        self.link = link
        self.outboxes = outboxes
        self.changed = changed  # the account counters moved: save them soon
        self.board = StatusBoard(ledger.connection)  # the last failure of a send without a ledger row
        self.on_turn_done = on_turn_done
        self.order = ChatOrder()
        self.followers: dict[str, asyncio.Task[None]] = {}
        self.turns: dict[str, TurnContext] = {}
        self._registered: dict[str, asyncio.Future[TurnContext]] = {}  # frames that overtook the ack

    async def stop(self) -> None:
        tasks = list(self.followers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def starter_of(self, turn_id: str) -> str | None:
        """Who started `turn_id`, if this gateway submitted and follows it (else nobody in a chat did)."""
        ctx = self.turns.get(turn_id)
        return ctx.starter if ctx is not None else None

    def turns_in(self, account: str, chat: str, thread: str | None) -> list[tuple[str, TurnContext]]:
        """The turns this gateway follows that were started in `chat` (and `thread`) of `account`,
        oldest first: after `/new` the previous conversation's turn is still one of them."""
        return [
            (turn_id, ctx)
            for turn_id, ctx in self.turns.items()
            if ctx.runner.spec.ref == account and ctx.here.chat == chat and ctx.here.thread == thread
        ]

    def follow(
        self,
        entry: Entry,
        runner: AccountRunner | None,
        *,
        resumed: bool = False,
        waited: bool = False,
        maybe_withdrawn: str | None = None,
    ) -> None:
        """Follow `entry`'s turn and deliver its reply; `waited`: access was asked before its submit
        went out, so it is asked again as the turn starts. A `resumed` turn nothing of whose reply was
        noted yet is asked again too (`unproven`). `maybe_withdrawn`: a resumed turn's reason to fail
        with, unanswered, when the server shows it withdrawn (`get_turn`; a server without it: no
        trace of it), as a `/cancel` taken after it before the restart did (`Gateway._resume`)."""
        if entry.turn_id is None or entry.turn_id in self.followers or entry.is_batch_member:
            return  # a batch's reply is delivered through its first message
        if runner is None:
            log.error("%s: the account is no longer configured; its reply cannot be delivered", entry.key)
            return
        turn_id = entry.turn_id
        waited = waited or (resumed and unproven(entry))
        ctx = self.turns[turn_id] = TurnContext(
            runner,
            entry.key,
            Target(entry.chat, entry.thread),
            entry.key.message_id,
            entry.sender,
            entry.conversation,
            waited=waited,
            maybe_withdrawn=maybe_withdrawn,
            resumed=resumed,
        )
        waiter = self._registered.pop(turn_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(ctx)
        task = asyncio.ensure_future(self._deliver(entry, runner, turn_id, resumed))
        self.followers[turn_id] = task
        task.add_done_callback(lambda t: self._follower_done(turn_id, t))

    def admits(self, ctx: TurnContext) -> bool:
        """Whether `ctx`'s turn may go on and be answered. A turn is asked before its submit
        (`Gateway._submit_batch`) and as it is acked; one this gateway submitted (a submit can wait
        on a stalled server, and the server may queue it), or one a restart picked back up before any
        of its reply was noted (`unproven`), is asked again, once, as it leaves the queue or is first
        seen out of it (running, or ended while the gateway was away): at its first such snapshot,
        or its first approval request or tool call, whichever comes first."""
        if ctx.waited and ctx.admitted is None:
            ctx.admitted = self._still_let_in(ctx)
            if not ctx.admitted:
                log.info("%s: cancelled as it left the queue: the sender's access was taken away", ctx.key)
        return ctx.admitted is not False

    def _still_let_in(self, ctx: TurnContext) -> bool:
        entry = self.ledger.get(ctx.key)
        return entry is not None and self.lets_in(entry, ctx.runner)

    async def refuse_queued(self) -> None:
        """Cancel each turn not yet let in (still waiting in the server's queue, or not seen to start)
        whose sender access no longer lets in (a `pairing revoke` reaches the gateway only through
        gateway.db: asked by `ChatOps.watch_pairings` as soon as it changes), so it never starts; its
        follower then fails its rows. Newest first: cancelling a turn that runs (one a restart picked
        back up) starts the next one in its conversation's queue at once, which must be out by then."""
        for turn_id in reversed(list(self.turns)):
            await self.refuse_if_not_let_in(turn_id)

    async def refuse_if_not_let_in(self, turn_id: str) -> None:
        """Cancel `turn_id` if it was not let in yet (`admits`) and access no longer lets its sender
        in: its follower then fails its rows and delivers nothing. Also asked as a submit is acked."""
        ctx = self.turns.get(turn_id)
        if ctx is not None and ctx.waited and ctx.admitted is None and not self._still_let_in(ctx):
            ctx.admitted = False
            log.info("%s: cancelled before it was answered: %s", ctx.key, NO_LONGER_LET_IN)
            await self._cancel(ctx, turn_id)

    async def _cancel(self, ctx: TurnContext, turn_id: str) -> None:
        """The protocol's `cancel` naming the turn (never another one that runs by then)."""
        if ctx.conversation is None:
            return
        try:
            await self.link.request({"type": "cancel", "conversation": ctx.conversation, "turn_id": turn_id})
        except (ProtocolError, Closed, TimeoutError) as exc:  # its reply is still never delivered
            log.warning("%s: could not cancel %s: %s", ctx.key, turn_id, exc)

    async def withdraw(self, turn_id: str, reason: str) -> int:
        """Take `turn_id` out of the server's queue before it starts (`/cancel`): the protocol's
        `cancel` naming it drops a turn that has not started (docs/protocol.md), and its follower then
        delivers nothing and fails its rows with `reason`. Returns how many messages it carried (a
        debounced batch is one turn); 0 when it is no turn this gateway follows, was seen to start,
        or the server no longer had it (ended meanwhile)."""
        ctx = self.turns.get(turn_id)
        if ctx is None or ctx.left_queue or ctx.conversation is None:
            return 0
        ctx.withdrawn = reason  # before the request: its terminal snapshot can overtake the ack
        try:
            ack = await self.link.request({"type": "cancel", "conversation": ctx.conversation, "turn_id": turn_id})
        except BaseException:
            ctx.withdrawn = None
            raise
        if not ack.get("cancelled"):
            ctx.withdrawn = None
            return 0
        entry = self.ledger.get(ctx.key)
        return len(self.ledger.batch_of(entry)) if entry is not None else 1

    async def _check_start(self, ctx: TurnContext | None, turn_id: str, snap: dict[str, Any]) -> None:
        """Raise NotLetIn (after cancelling the turn, unless it ended) for a queued turn whose sender
        access no longer lets in, as soon as a snapshot shows it out of the queue."""
        if ctx is None:
            return
        if snap.get("status") in TERMINAL or snap.get("phase") != "queued":
            ctx.left_queue = True
        if snap.get("status") not in TERMINAL and snap.get("phase") == "queued":
            ctx.waited = ctx.waited or int(snap.get("queue_position") or 0) > 0  # resumed: seen waiting
            if ctx.admitted is not False:
                return
        elif self.admits(ctx):
            return
        if snap.get("status") not in TERMINAL:
            await self._cancel(ctx, turn_id)
        raise NotLetIn(_refused_reason(ctx, snap))

    def _follower_done(self, turn_id: str, task: asyncio.Task[None]) -> None:
        """Forget the turn; an error that ended its follower is logged here, with its traceback (it
        was "Task exception was never retrieved", at some garbage collection, if at all)."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("following turn %s failed; its reply was left as the ledger says", turn_id, exc_info=exc)
        self._turn_done(turn_id)

    def _turn_done(self, turn_id: str) -> None:
        self.followers.pop(turn_id, None)
        self.turns.pop(turn_id, None)
        self.on_turn_done(turn_id)

    async def _deliver(self, entry: Entry, runner: AccountRunner, turn_id: str, resumed: bool) -> None:
        target = answer_target(entry)
        place = order_key(entry)
        before, mine = self.order.ticket(place)
        try:
            await runner.ready.wait()
            while runner.adapter is None or not runner.adapter.is_running:
                await asyncio.sleep(0.5)  # the account restarts; the reply waits for it
            outbox = self.outboxes.of(runner)
            stream = bool(runner.settings.get("stream", True))
            tool_status = bool(runner.settings.get("tool_status", True))
            sink = ReplySink.resumed(outbox, target, entry.remote_ids, stream=stream)
            key = entry.key
            notes = ReplyNotes(self.ledger, key)
            sink.on_sent = notes.sent
            sink.on_attempt = notes.attempt
            sink.key = str(key)
            if entry.sending is not None:  # a part was being sent when the gateway stopped
                sink.attempted[entry.sending[0]] = entry.sending[1]
            text = entry.reply
            ctx = self.turns.get(turn_id)
            if entry.state == "submitted" and ctx is not None and ctx.admitted is False:
                raise NotLetIn  # cancelled already (refuse_if_not_let_in): not even a typing indicator
            if entry.state == "submitted":
                typing = asyncio.ensure_future(self._keep_typing(runner, target))
                try:
                    text = await self._run_sink(entry, sink, turn_id, before, tool_status, resumed, notes)
                finally:
                    typing.cancel()
                entry = await write_until_done(
                    f"{key}: the reply's final text", partial(self.ledger.mark_finished, key, text)
                )
            if before is not None:
                await before.wait()
            await asyncio.sleep(sink.final_due())
            whole = text or ""
            ids = await notes.run(partial(sink.finish, whole))
            await write_until_done(f"{key}: the reply's delivery", partial(self._record_delivered, entry, whole, ids))
            runner.live.replies += 1
            runner.live.last_outbound = time.time()
        except NotLetIn as refused:  # as a batch never submitted for it: nothing said, the rows say why
            await write_until_done(f"{entry.key}: not let in", partial(self._record_failed, entry, refused.reason))
        except Withdrawn as dropped:  # `/cancel` took it out of the queue, and its answer said so
            await write_until_done(f"{entry.key}: withdrawn", partial(self._record_failed, entry, dropped.reason))
        except DeliveryFailed as exc:
            log.error("%s: reply not delivered: %s", entry.key, exc)
            failure = partial(self._record_failed, entry, f"delivery failed: {exc}")
            await write_until_done(f"{entry.key}: the reply's failure", failure)
            runner.live.failures += 1
        finally:
            self.changed()
            self.link.unfollow(turn_id)
            self.order.release(place, mine)  # given up: the next reply still waits for the one before

    def _record_delivered(self, entry: Entry, text: str, ids: list[str]) -> None:
        """`entry`'s reply (and its debounced batch's: one reply for all) is in the chat as `ids`.
        Each row is moved from where it stands, so running this again after a failure is safe."""
        for member in self.ledger.batch_of(entry):
            if member.state == "submitted" and member.key != entry.key:
                member = self.ledger.mark_finished(member.key, text)
            if member.state == "finished":
                self.ledger.mark_delivered(member.key, ids)

    def _record_failed(self, entry: Entry, reason: str) -> None:
        """`entry`'s rows (its batch's) that were not settled are failed with `reason`; safe to run again."""
        for member in self.ledger.batch_of(entry):
            if member.state in ("submitted", "finished"):
                self.ledger.mark_failed(member.key, reason)

    async def _keep_typing(self, runner: AccountRunner, target: Target) -> None:
        """The platform's typing indicator while the turn runs (it fades after ~5 s: renew it)."""
        typing = getattr(runner.adapter, "typing", None)
        if not callable(typing):
            return
        while True:
            try:
                await typing(target)
            except Exception as exc:  # noqa: BLE001 - a missing indicator is not worth a failure
                log.debug("typing indicator failed: %s", exc)
            await asyncio.sleep(TYPING_EVERY_S)

    async def _run_sink(
        self,
        entry: Entry,
        sink: ReplySink,
        turn_id: str,
        before: asyncio.Event | None,
        tool_status: bool,
        resumed: bool,
        notes: ReplyNotes,
    ) -> str:
        """Follow the turn to its end, growing the reply in place; returns the final text. Raises
        NotLetIn for a queued turn whose sender access no longer lets in when it starts."""
        follower = self.link.follow(turn_id)
        ctx = self.turns.get(turn_id)
        if resumed and entry.conversation:
            await self._first_snapshot(follower, entry.conversation, turn_id)
        shown = entry.reply or ""  # the reply's text as last shown: kept if the turn ends without its text
        loop = asyncio.get_running_loop()
        while True:
            snap = await follower.next()
            await self._check_start(ctx, turn_id, snap)
            if snap.get("status") in TERMINAL:
                return self._ended(ctx, snap, shown, sink)
            if before is not None and not before.is_set():
                continue  # the previous reply in this chat is still going out
            # Pace the edits (~1/s), taking the newest snapshot when the time comes; the end of the
            # turn does not wait for the pace. The first send waits a moment too, so a reply that
            # is done within it goes out as one message instead of a send and an edit.
            deadline = loop.time() + (sink.due() if sink.ids else FIRST_SEND_GRACE_S)
            while (remaining := deadline - loop.time()) > 0:
                try:
                    snap = await asyncio.wait_for(follower.next(), remaining)
                except TimeoutError:
                    break
                await self._check_start(ctx, turn_id, snap)
                if snap.get("status") in TERMINAL:
                    return self._ended(ctx, snap, shown, sink)
            snap = follower.latest or snap
            await self._check_start(ctx, turn_id, snap)
            try:
                ids = await notes.run(partial(sink.show, visible_text(snap, tool_status=tool_status)))
            except DeliveryFailed as exc:
                log.warning("%s: a streaming edit failed (%s); the final text will still be sent", entry.key, exc)
                continue
            body = reply_body(snap)
            if body and body != shown:
                shown = body
                text_so_far = partial(self.ledger.note_sent, entry.key, ids, shown)  # after on_sent: the text too
                await write_until_done(f"{entry.key}: the reply's text so far", text_so_far)

    async def _first_snapshot(self, follower: TurnFollower, conversation: str, turn_id: str) -> None:
        """A resumed turn's first snapshot, offered to `follower`: the active turn where the server
        shows it so (`ServerLink.recover`), else as the server knows it by id (`get_turn`, after the
        subscribe so that no later snapshot is missed): queued or running, it is followed on; ended,
        also withdrawn from the queue while the gateway was down (which left nothing in the history),
        or cancelled at a tool call (which the history shows only as "ended, outcome unknown"), that
        is its outcome, at once. A server without `get_turn`: settled by the history, that is the
        outcome; else it is asked again after `RECOVER_AGAIN_S`, then less often (up to
        `RECOVER_AGAIN_MAX_S`), until a snapshot comes. A turn withdrawn from the queue (or one the
        server no longer knows) never sends one there: it ends once two answers in a row, the later
        one with no snapshot of it in between, show no trace of it (`is_untraced`); the first alone
        could be the moment between its leaving the queue and starting, after which it reports live.
        The conversation's later replies wait for its end (`ChatOrder`): there it comes only once no
        input waits in the conversation's queue."""
        untraced = False
        pause = RECOVER_AGAIN_S
        look_up = True
        while follower.latest is None:
            recovered = await self._recover(conversation, turn_id)
            if follower.latest is not None:
                return  # the active turn: `recover` offered it
            if look_up:
                # asked also for a turn the history shows settled: the history keeps no outcome of a
                # turn that ended at a tool result (cancelled while the gateway was down), which it
                # can only guess as "failed, unknown", shown as a server stop
                now = await self._turn_now(conversation, turn_id)
                if now is not None:
                    follower.offer(now)
                    return
                look_up = False  # a server without `get_turn`: guessed from the history and the queue
            if recovered is not None and (untraced or not is_untraced(recovered)):
                follower.offer(recovered)  # settled by the history (or the conversation is gone)
                return
            untraced = recovered is not None
            if untraced:
                pause = RECOVER_AGAIN_S  # confirmed soon
            try:
                await asyncio.wait_for(follower.arrived(), pause)
            except TimeoutError:
                pause = min(pause * 2, RECOVER_AGAIN_MAX_S)  # it may wait long in the queue: asked less often

    async def _turn_now(self, conversation: str, turn_id: str) -> dict[str, Any] | None:
        """`turn_id` as the server knows it now (`get_turn`): its current snapshot, whatever its state
        (a turn withdrawn from the queue: `cancelled`, `error.kind` `withdrawn`); the `lost` outcome
        when it has no record of it. None from a server without `get_turn` (or an answer that is not
        this turn's snapshot): the caller guesses from the history and the queue, as before it."""
        while True:
            try:
                reply = await self.link.request({"type": "get_turn", "conversation": conversation, "turn_id": turn_id})
            except ProtocolError as exc:
                if exc.code == "unknown_type":
                    return None
                if exc.code == "turn_not_found":
                    return dict(lost_snapshot(turn_id, conversation, "", 1 << 30))
                if exc.code in ("conversation_not_found", "forbidden"):
                    return _gone(turn_id, exc.code)
                log.warning("looking up %s failed (%s); retrying", turn_id, exc)
            except (Closed, TimeoutError) as exc:
                log.warning("looking up %s failed (%s); retrying", turn_id, exc)
            else:
                snap = reply.get("snapshot")
                return snap if isinstance(snap, dict) and snap.get("turn_id") == turn_id else None
            await asyncio.sleep(1.0)

    @staticmethod
    def _ended(ctx: TurnContext | None, snap: dict[str, Any], shown: str, sink: ReplySink) -> str:
        """The final text of a turn that ended; `Withdrawn` for one `/cancel` took out of the queue
        (nothing of it was shown: a turn that started in the meantime keeps its reply, cut short),
        also for one a `/cancel` taken before a restart may have withdrawn (`maybe_withdrawn`) that
        the server shows withdrawn (`get_turn`) or, a server without `get_turn`, no trace of."""
        if ctx is not None and not sink.ids:
            if ctx.withdrawn is not None and snap.get("status") == "cancelled":
                raise Withdrawn(ctx.withdrawn)
            withdrawn = is_untraced(snap) or (snap.get("error") or {}).get("kind") == "withdrawn"
            if ctx.maybe_withdrawn is not None and withdrawn:
                raise Withdrawn(ctx.maybe_withdrawn)
        return final_text(snap, shown)

    async def _recover(self, conversation: str, turn_id: str) -> dict[str, Any] | None:
        while True:
            try:
                return await self.link.recover(conversation, turn_id)
            except ProtocolError as exc:
                if exc.code in ("conversation_not_found", "forbidden"):
                    return _gone(turn_id, exc.code)
                log.warning("recovering %s failed (%s); retrying", turn_id, exc)
            except (Closed, TimeoutError) as exc:
                log.warning("recovering %s failed (%s); retrying", turn_id, exc)
            await asyncio.sleep(1.0)

    async def deliver_text(
        self, runner: AccountRunner, target: Target, text: str, *, give_up_s: float = DELIVER_GIVE_UP_S
    ) -> list[str]:
        """Send `text` as a whole reply to `target` (cron `--deliver`); returns the ids. Given up
        after `give_up_s` (a platform may ask to wait minutes), before the caller stops waiting, so
        the caller's verdict is the outcome: nothing goes out after a `DeliveryFailed`."""
        try:
            outbox = self.outboxes.of(runner)
            sink = ReplySink(outbox, target, stream=False)
            try:
                ids = await asyncio.wait_for(sink.finish(text), give_up_s)
            except TimeoutError:
                raise DeliveryFailed(outbox.gave_up(give_up_s)) from None
        except (DeliveryFailed, RuntimeError) as exc:  # RuntimeError: the account is not running
            where = target.chat if target.thread is None else f"{target.chat}:{target.thread}"
            self.send_failed(runner, f"cron delivery to {where} failed: {exc}")
            raise
        runner.live.replies += 1
        runner.live.last_outbound = time.time()
        self.changed()
        return ids

    def send_failed(self, runner: AccountRunner, reason: str) -> None:
        """Count a failed send that no ledger row records (a cron delivery) in the account's
        failures and keep `reason` as its last failure, so `channels status` shows it like a reply
        that failed (whose reason the ledger keeps)."""
        runner.live.failures += 1
        try:
            self.board.note_failure(runner.live.snapshot(), reason, time.time())
        except sqlite3.Error as exc:  # the caller's verdict is the send's, not the bookkeeping's
            log.warning("%s: could not record the failure in gateway.db: %s", runner.spec.ref, exc)
        self.changed()

    async def context(self, turn_id: str) -> TurnContext | None:
        """The context of a turn this gateway follows; a frame can overtake the submit's ack, so
        give the turn a moment to register."""
        ctx = self.turns.get(turn_id)
        if ctx is not None:
            return ctx
        waiter = self._registered.setdefault(turn_id, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), CONTEXT_WAIT_S)
        except TimeoutError:
            return None  # not a turn this gateway submitted
        finally:
            if self._registered.get(turn_id) is waiter and not waiter.done():
                del self._registered[turn_id]
