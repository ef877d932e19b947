"""The gateway: platform messages in through the ledger, turns on the server, replies back out.

    adapter ──on_message──► ledger.record (commit) ──► ack to the platform
                                  │
                     per-chat worker, in arrival order:
                     decide ─► route ─► envelope ─► submit_input (idempotency key) ─► mark_submitted
                                  │
                     per-turn follower: snapshots ─► ReplySink (edits ~1/s) ─► mark_finished ─► delivered

Every step reads and writes the ledger, so a restart resumes each row where it stood: undecided
rows are decided, allowed rows submitted again under the same key (the server makes that one
turn), accepted turns followed (never submitted again), finished replies delivered once, and a
notice still owed for a decision or a failure (a pairing code, "⚠ Could not start a turn") said.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from appserver.client import Closed, ProtocolError
from gateway.access import NOT_MENTIONED, POSTED_AS_CHAT
from gateway.accounts import AccountRunner, AccountSpec
from gateway.channeltool import MessageChannel
from gateway.chatops import DROPPED_BY_CANCEL, WITHDRAWN_BY_CANCEL, ChatOps, display_name
from gateway.commands import Command, bot_name, for_another_bot, parse_command
from gateway.debounce import Buffers
from gateway.delivery import DeliveryFailed, Outboxes
from gateway.intake import Intake, IntakeGate
from gateway.ledger import Entry, Ledger, Receipt, UpdateKey, notice_key, prune_settled, retention_s
from gateway.link import ServerLink
from gateway.pairing import EXPIRED_UNAPPROVED, TOO_MANY_PENDING, Pairing
from gateway.recent import Recent
from gateway.replies import (
    NO_LONGER_LET_IN,
    Replies,
    answer_target,
    chat_key,
    ledger_retry_delay,
    write_until_done,
)
from gateway.routing import RouteKey, Router
from gateway.split import DELIVER_MAX_CHARS, cap_text
from gateway.sqlstore import PG_KEY_BYTES, KeyTooLong, is_pg
from gateway.status import StatusBoard
from gateway.turninput import clean, payload_of, submit_frame
from plugins.contract import InboundMessage, IntakePaused, Target

log = logging.getLogger("gateway")

# `frame_too_large` is the protocol client's own refusal (the frame was never sent): the same
# message would be refused on every retry, and its chat's worker would wait behind it forever.
PERMANENT_CODES = frozenset(
    {
        "bad_frame",
        "forbidden",
        "agent_not_found",
        "agent_ambiguous",
        "invalid_request",
        "unknown_type",
        "frame_too_large",
    }
)
# The route a conversation was opened for, in its metadata: cut to this many characters (a plugin's
# chat id is unbounded; the server takes at most 16 KiB of metadata, control characters escaped ×6).
ROUTE_METADATA_MAX = 2000
SUBMIT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
NOTICE_EVERY_S = 600.0
PROCESS_RETRIES = 20  # tries of a message's step the database refuses for now (`_process_until_done`)
STATUS_FLUSH_S = 1.0
PRUNE_EVERY_S = 3600.0  # settled ledger rows past their retention are deleted at start, then hourly
MAX_HELD = 5  # messages kept per sender while their pairing is pending
KEPT_BEHIND_APPROVAL = "dm: kept behind the messages the sender's approval releases"
# A stranger's command (`/pair`, `/approve CODE`, `/new`, …) is not kept for the first turn: it was
# meant for the gateway, not the agent. The stranger still gets the pairing code.
COMMAND_NOT_KEPT = "dm: pairing pending; a command is not kept for the first turn"

EventSink = Callable[[str, dict[str, Any]], None]


class Gateway:
    def __init__(
        self,
        home: Path,
        ledger: Ledger,
        link: ServerLink,
        specs: list[AccountSpec],
        emit: EventSink,
        environ: dict[str, str] | None = None,
        on_secrets: Callable[[dict[str, str]], None] | None = None,
        gate: IntakeGate | None = None,
    ) -> None:
        self.home = home
        self.ledger = ledger
        self.router = Router(ledger.connection)
        self.board = StatusBoard(ledger.connection)
        self.intake = Intake(ledger)
        self.gate = gate if gate is not None else IntakeGate()
        self.pairing = Pairing(ledger.connection)
        self.link = link
        self.emit = emit
        self.runners = {
            s.ref: AccountRunner(
                s,
                home,
                self.on_message,
                self._state_changed,
                environ=environ,
                image_budget=link.image_budget,
                on_secrets=on_secrets,
                move_chat=self._move_chat,
                gate=self.gate,
            )
            for s in specs
        }
        self.outboxes = Outboxes()
        self.replies = Replies(
            ledger, link, self.outboxes, self._changed, self._turn_done, lambda e, r: self.chatops.lets_in(e, r)
        )
        self.chatops = ChatOps(
            ledger, self.router, self.pairing, link, self.outboxes, self.replies, self.runners, self._enqueue
        )
        self.tool = MessageChannel(ledger, self.router, link, self.outboxes, self.replies)
        self._queues: dict[str, asyncio.Queue[UpdateKey]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._notices: Recent[bool] = Recent(NOTICE_EVERY_S)  # chats told something lately
        self._odd_chat_types: set[tuple[str, str]] = set()  # (account, chat_type) outside the contract, logged once
        self._taken_here: set[UpdateKey] = set()  # commands this process took and has not answered yet
        self._dirty = True
        self._started = False  # start() has resumed the ledger
        link.on_tool_call(self.tool.on_call)
        link.on_approval(self.chatops.on_approval)
        link.on_reconnected(self.chatops.reconcile_prompts)  # answers given while away were not heard

    def _changed(self) -> None:
        self._dirty = True

    def _turn_done(self, turn_id: str) -> None:
        self.chatops.approvals.forget_turn(turn_id)

    def _follow(
        self, entry: Entry, *, resumed: bool = False, waited: bool = False, maybe_withdrawn: str | None = None
    ) -> None:
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        self.replies.follow(entry, runner, resumed=resumed, waited=waited, maybe_withdrawn=maybe_withdrawn)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, ready_timeout: float = 25.0) -> None:
        """Start every account (each reaches running or error), then resume the ledger, then act on
        the pairings: the first look (`ChatOps.watch_pairings`) refuses the resumed turns of senders
        revoked while no gateway ran before it says the revokes were acted on, which `pairing revoke`
        waits for (started earlier, it said so with no turn followed yet)."""
        self.board.mark_unconfigured({(r.spec.channel, r.spec.name) for r in self.runners.values()})
        self._restore_status()
        for runner in self.runners.values():
            self._spawn(runner.run())
        self._spawn(self._flush_status_forever())
        self._spawn(self._prune_forever())
        waits = [asyncio.wait_for(r.ready.wait(), ready_timeout) for r in self.runners.values()]
        for result in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, TimeoutError):
                raise result
        self._resume()
        self._spawn(self._keep_running("acting on pairing decisions", self.chatops.watch_pairings))
        self._started = True
        self._spawn(self.chatops.reconcile_prompts())  # prompts whose call ended while no gateway ran

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.runners.values()), return_exceptions=True)
        tasks = [*self._tasks, *self._workers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.replies.stop()
        self._save_status()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """Forget a background task; an error that ended it is logged here, with its traceback (it was
        "Task exception was never retrieved", at some garbage collection, if at all)."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a background task of the gateway failed: %r", exc, exc_info=exc)

    async def _keep_running(self, what: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run a loop meant to last as long as the gateway (`ChatOps.watch_pairings`); one ended by an
        error (gateway.db busy past its timeout, or full, as it acts on a decision) is logged and run
        again after a bounded backoff, instead of never acting on an approval again."""
        failures = 0
        while True:
            try:
                await run()
                return
            except Exception:  # noqa: BLE001 - whatever ended it, the loop is needed
                failures += 1
                delay = ledger_retry_delay(failures)
                log.exception("%s stopped on an error; started again in %g s", what, delay)
                await asyncio.sleep(delay)

    def _resume(self) -> None:
        cancels = [e for e in self.ledger.to_submit() if e.command_taken and self._is_cancel(e)]
        in_flight = self.ledger.in_flight()
        if in_flight:  # and those answered since (a second restart: the first one's notice ended them)
            cancels += self.ledger.answered_since(min(e.seq for e in in_flight), "command /cancel")
        # Followed in arrival order across both states: each takes its conversation's reply ticket as
        # it starts, and an earlier message's finished reply went out after a later one's running turn.
        for entry in sorted(in_flight + self.ledger.to_deliver(), key=lambda e: e.seq):
            withdrawn = self._withdrawn_by(entry, cancels) if entry.state == "submitted" else None
            self._follow(entry, resumed=True, maybe_withdrawn=withdrawn)
        # In arrival order across these states: a crash between deciding m1, m2 and m3 left m3
        # `received` and the others `allowed`, and m3 first made it the batch's first message. A
        # notice still owed (`to_tell`) goes out in its chat's order too.
        waiting = self.ledger.to_decide() + self.ledger.to_submit() + self.ledger.to_tell()
        for entry in sorted(waiting, key=lambda e: e.seq):
            self._enqueue(entry)

    def _is_cancel(self, entry: Entry) -> bool:
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        text = str(entry.payload.get("text") or "")
        command = parse_command(text, bot_name(runner.adapter) if runner is not None else None)
        return command is not None and command.name == "cancel"

    def _withdrawn_by(self, entry: Entry, cancels: list[Entry]) -> str | None:
        """Why `entry`'s turn, still `submitted`, may have been withdrawn before the restart: a `/cancel`
        that may stop it came after it in its chat and was taken (its effect may have been had, its
        answer never noted), so it withdrew the turn if it had not started; the server then writes
        nothing of it to the history and never reports it again, but shows it withdrawn when asked by
        id (`get_turn`, `Replies._first_snapshot`). Its rows then end failed with that reason and no
        reply, as they would have had the gateway lived (`Replies._ended`); None when no such one."""
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        for cancel in cancels:
            same_chat = (cancel.key.channel, cancel.key.account, cancel.chat, cancel.thread) == (
                entry.key.channel,
                entry.key.account,
                entry.chat,
                entry.thread,
            )
            may = cancel.sender == entry.sender or (runner is not None and runner.policy.is_admin(cancel.sender))
            if same_chat and cancel.seq > entry.seq and may:
                return WITHDRAWN_BY_CANCEL
        return None

    # ---------------------------------------------------------------- status

    def _state_changed(self, runner: AccountRunner) -> None:
        self._dirty = True
        live = runner.live
        self.emit(
            "account_state",
            {"channel": live.channel, "account": live.account, "state": live.state, "reason": live.reason},
        )
        if live.state in ("error", "stopped"):
            self._save_status()
        elif live.state == "running" and self._started:
            self._spawn(self.chatops.reconcile_prompts())  # back from backoff: its prompts can be edited now

    def _restore_status(self) -> None:
        """Carry each account's saved counters and last inbound and outbound times over a restart (the
        row is written over from memory every second: a fresh start used to show `never` and zeros
        seconds after a message). The times are also read from the ledger, which a kill -9 within
        the second before the next save does not lose; counters count from the account's first start."""
        for runner in self.runners.values():
            live = runner.live
            saved = self.board.get(live.channel, live.account)
            if saved is not None:
                live.messages_in += saved.messages_in
                live.turns += saved.turns
                live.replies += saved.replies
                live.failures += saved.failures
            last_in, last_out = self.ledger.last_activity(live.channel, live.account)
            before_in, before_out = (saved.last_inbound, saved.last_outbound) if saved is not None else (None, None)
            live.last_inbound = _latest(live.last_inbound, before_in, last_in)
            live.last_outbound = _latest(live.last_outbound, before_out, last_out)

    def statuses(self) -> list[dict[str, Any]]:
        return [r.live.snapshot().to_json() for r in self.runners.values()]

    def _save_status(self) -> bool:
        """Write the live counters and states to gateway.db. False when it refused (busy past its
        timeout, the disk full): logged, and still to save (the flush loop tries again)."""
        try:
            self.board.save([r.live.snapshot() for r in self.runners.values()])
        except sqlite3.Error as exc:
            self._dirty = True
            log.error("could not save the accounts' status to gateway.db (tried again shortly): %s", exc)
            return False
        self._dirty = False
        return True

    async def _flush_status_forever(self) -> None:
        """Save the status every second it changed; after a failed save, again after a bounded
        backoff, for as long as the gateway runs (it used to end on the first "database is locked")."""
        failures = 0
        while True:
            await asyncio.sleep(ledger_retry_delay(failures) if failures else STATUS_FLUSH_S)
            if self._dirty:
                failures = 0 if self._save_status() else failures + 1

    async def _prune_forever(self) -> None:
        """Keep gateway.db from growing for ever: settled rows past their retention go (ledger.py)."""
        while True:
            try:
                pruned = await prune_settled(self.ledger, time.time() - retention_s())
            except sqlite3.Error as exc:
                log.warning("could not prune the ledger (tried again in %g s): %s", PRUNE_EVERY_S, exc)
            else:
                if pruned:
                    log.info("pruned %d settled ledger row(s) older than the retention period", pruned)
            await asyncio.sleep(PRUNE_EVERY_S)

    # ---------------------------------------------------------------- inbound, per chat in order

    async def on_message(self, msg: InboundMessage) -> bool:
        """The adapters' callback: record first (committed), then ack, then process in order.
        Whether the message was recorded now (False: its id was recorded before). While the intake
        gate is closed (the server cannot vouch for the message) nothing is acknowledged
        (`IntakePaused`): a message recorded as the gate closed is processed, and its redelivery is
        a repeat the ledger drops, should the server come back still holding the account."""
        runner = self.runners.get(f"{msg.channel}:{msg.account}")
        if runner is None:
            raise ValueError(f"message for an unknown account {msg.channel}:{msg.account}")
        self._refuse_when_paused()
        key = UpdateKey(msg.channel, msg.account, clean(msg.message_id))
        thread = clean(msg.thread) if msg.thread is not None else None
        receipt = Receipt(key, clean(msg.chat), clean(msg.sender), thread, payload_of(msg, self.link.image_budget()))
        if is_pg(self.ledger.connection) and not self._keyable(receipt):
            if msg.ack is not None:  # recorded before (the cap came later): a repeat, as ever
                await msg.ack()
            return False
        entry, created = await self.intake.record(receipt)
        if not self.gate.is_open():  # closed as it was recorded: taken in, never acknowledged
            if created:
                self._take_in(runner, entry)
            self._refuse_when_paused()
        if msg.ack is not None:
            await msg.ack()
        if created:
            self._take_in(runner, entry)
        return created

    def _keyable(self, receipt: Receipt) -> bool:
        """On a PostgreSQL store, whether a message whose id or sender is longer than PG_KEY_BYTES is
        taken (`KeyTooLong` otherwise): an id recorded before is a repeat (False), a sender approved
        before is let in; SQLite homes have no such cap. What was taken stays taken."""

        def long(value: str) -> bool:
            return len(value.encode("utf-8", "surrogatepass")) > PG_KEY_BYTES

        key = receipt.key
        if long(key.message_id):
            if self.ledger.get(key) is not None:
                return False
            raise KeyTooLong("id")
        if long(receipt.sender) and not self.pairing.is_approved(key.channel, key.account, receipt.sender):
            raise KeyTooLong("sender")
        return True

    def _refuse_when_paused(self) -> None:
        if not self.gate.is_open():
            raise IntakePaused("the gateway takes no messages now: its server cannot vouch for them")

    def _take_in(self, runner: AccountRunner, entry: Entry) -> None:
        """Count a newly recorded message and queue it for its chat's worker."""
        runner.live.messages_in += 1
        runner.live.last_inbound = time.time()
        self._dirty = True
        self._enqueue(entry)

    async def _move_chat(self, channel: str, account: str, old: str, new: str) -> None:
        """An adapter learned that a chat has a new id for good (ChatOps.move_chat)."""
        await self.chatops.move_chat(channel, account, clean(old), clean(new))

    def _enqueue(self, entry: Entry) -> None:
        key_of_chat = chat_key(entry)
        queue = self._queues.get(key_of_chat)
        if queue is None:
            queue = self._queues[key_of_chat] = asyncio.Queue()
            self._workers[key_of_chat] = asyncio.ensure_future(self._work(key_of_chat, queue))
        queue.put_nowait(entry.key)

    async def _work(self, key_of_chat: str, queue: asyncio.Queue[UpdateKey]) -> None:
        """One chat's messages, in arrival order, with its debounce buffers; the worker ends when
        its queue runs dry and nothing is buffered."""
        buffers = Buffers()
        while True:
            deadline = buffers.next_deadline()
            try:
                if deadline is None:
                    key = queue.get_nowait()
                else:
                    key = await asyncio.wait_for(queue.get(), max(deadline - buffers.clock(), 0.0))
            except asyncio.QueueEmpty:
                del self._queues[key_of_chat]
                del self._workers[key_of_chat]
                return
            except TimeoutError:
                for batch in buffers.due():
                    await self._guarded(self._submit_batch(batch))
                continue
            await self._process_until_done(key, buffers)

    async def _process_until_done(self, key: UpdateKey, buffers: Buffers) -> None:
        """`_process`, tried again (its chat's later messages waiting behind it) while the database
        refuses it for now (`sqlite3.OperationalError`: gateway.db busy past its timeout, the
        PostgreSQL session lost, gateway/sqlstore.py): every step resumes from the message's row, so
        a message acknowledged just before is answered once the database is back, not at the next
        restart. Given up (logged) after PROCESS_RETRIES tries, as any other error is at once."""
        for attempt in range(1, PROCESS_RETRIES + 1):
            try:
                await self._process(key, buffers)
                return
            except asyncio.CancelledError:
                raise
            except sqlite3.OperationalError as exc:
                if attempt == PROCESS_RETRIES:
                    log.exception("processing a message failed")
                    return
                delay = ledger_retry_delay(attempt)
                log.error("%s: the database refused a step (%s); trying again in %g s", key, exc, delay)
                await asyncio.sleep(delay)
            except Exception:  # noqa: BLE001 - one bad message must not stop its chat
                log.exception("processing a message failed")
                return

    async def _guarded(self, step: Awaitable[None]) -> None:
        try:
            await step
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad message must not stop its chat
            log.exception("processing a message failed")

    async def _process(self, key: UpdateKey, buffers: Buffers) -> None:
        entry = self.ledger.get(key)
        runner = self.runners.get(f"{key.channel}:{key.account}")
        if entry is None or runner is None:
            return
        if entry.state == "received":
            entry = await write_until_done(f"{key}: the access decision", partial(self._decide, entry, runner))
            await self._tell_decision(entry, runner, resumed=False)
        elif entry.owes_notice:  # decided (or failed) before a restart, its notice not out yet
            await self._tell_decision(entry, runner, resumed=True)
        if entry.state != "allowed":
            return
        if entry.batch is not None:  # a batch written down before a crash: submit it as it was
            await self._submit_batch([e for e in self.ledger.batch_of(entry) if e.state == "allowed"])
            return
        command = parse_command(str(entry.payload.get("text") or ""), bot_name(runner.adapter))
        media = bool(entry.payload.get("images") or entry.payload.get("attachments"))
        settings = runner.debounce
        unsent: list[Entry] = []
        if command is not None and command.name == "cancel":
            # the sender's messages held by debounce are what `/cancel` drops first: never submitted
            # (a secret pasted by mistake never reaches the agent); `_run_command` fails their rows
            unsent = buffers.take(entry.sender)
        elif command is not None or media or not settings.enabled:
            waiting = buffers.take(entry.sender)  # a command or media flushes the sender's buffer first
            if waiting:
                await self._submit_batch(waiting)
        if command is not None:
            await self._run_command(entry, runner, command, unsent)
            return
        if media or not settings.enabled:
            await self._submit_batch([entry])
            return
        full = buffers.add(entry, settings)
        if full:
            await self._submit_batch(full)

    async def _run_command(
        self, entry: Entry, runner: AccountRunner, command: Command, unsent: list[Entry] | None = None
    ) -> None:
        """A chat command's effect at most once, its answer at least once under one key
        (`cmd:<ledger key>`). Taken is written down durably before the effect, the answer before it
        is sent; a restart that finds the command taken sends the answer it wrote down again under
        that key (deduped or looked up where the platform can), or, when the crash came before the
        answer was written, says so: a second `/cancel` would stop the turn that started after the
        first, a second `/new` drop the conversation begun since (docs/channels.md, "Commands in the chat").
        `unsent`: a `/cancel`'s sender's messages held by debounce, dropped (failed) here, also when
        the `/cancel` was taken before a restart: they came before it, so they were its to drop."""
        since: float | None = None
        key = entry.key
        # taken by this process and retried (a lost session in the command's own writes): run again,
        # not called interrupted - its writes are safe to repeat (`_taken_here`)
        rerun = entry.command_taken and entry.reply is None and key in self._taken_here
        taken = entry.command_taken and not rerun
        if not taken:
            if not entry.command_taken:
                taking = partial(self.ledger.take_command, key, command_answer_key(entry), time.time())
                entry = await write_until_done(f"{key}: /{command.name} taken", taking)
            self._taken_here.add(key)
        dropped = await write_until_done(f"{key}: /{command.name} drops", partial(self._drop_unsent, unsent or []))
        if not taken:
            answer = await self.chatops.command(entry, runner, command, dropped=dropped)
            await write_until_done(
                f"{key}: /{command.name}'s answer", partial(self.ledger.note_command_answer, key, answer)
            )
        else:
            since = entry.sending[1] if entry.sending is not None else None
            answer = entry.reply if entry.reply is not None else command_interrupted(command)
            log.info("%s: /%s was taken before a restart: not run again", entry.key, command.name)
        ids = await self._say_keyed(runner, entry, answer, since) if answer else []
        answered = partial(self.ledger.mark_command, key, f"command /{command.name}", ids)
        await write_until_done(f"{key}: /{command.name} answered", answered)
        self._taken_here.discard(key)

    async def _tell_decision(self, entry: Entry, runner: AccountRunner, *, resumed: bool) -> None:
        """Say what follows `entry`'s decision or failure, then note it said (`Ledger.told`): a
        stranger's pairing code (or "try later"), a refused answer's reason, a failed submit's
        notice. `resumed`: owed from before a restart; a pairing code is then said only while it is
        still valid (not expired, approved or denied meanwhile), a refusal or a failure as it was."""
        since = entry.sending[1] if resumed and entry.sending is not None else None
        if entry.state == "failed":
            if entry.reply:
                await self._say_keyed(runner, entry, entry.reply, since, key=notice_key(entry.key))
        elif tells_pairing(entry):
            if not resumed or entry.reason == TOO_MANY_PENDING or self._code_still_valid(entry):
                await self.chatops.pairing_prompt(entry, runner, since)
        elif entry.state == "denied":
            await self.chatops.refuse_answer(entry, runner, since)  # a refused approval answer still hears why
        if entry.owes_notice:
            await write_until_done(f"{entry.key}: its notice said", partial(self.ledger.told, entry.key))

    def _code_still_valid(self, entry: Entry) -> bool:
        key = entry.key
        return self.pairing.has_pending(key.channel, key.account, entry.sender)

    def _drop_unsent(self, unsent: list[Entry]) -> int:
        """Fail the messages `/cancel` drops before they were submitted; how many were still waiting.
        Safe to run again (a row already failed is left as it is)."""
        dropped = 0
        for waiting in unsent:
            now = self.ledger.get(waiting.key)
            if now is not None and now.state == "allowed":
                now = self.ledger.mark_failed(waiting.key, DROPPED_BY_CANCEL)
            if now is not None and now.state == "failed" and now.reason == DROPPED_BY_CANCEL:
                dropped += 1
        if dropped:
            log.info("%s: /cancel dropped %d message(s) held by debounce", unsent[0].key, dropped)
        return dropped

    async def _say_keyed(
        self, runner: AccountRunner, entry: Entry, text: str, since: float | None, *, key: str | None = None
    ) -> list[str]:
        """A command's answer (or, with `key`, another line answering `entry`), sent as `Outboxes.say`
        does (never raises) but under its stable key: `since` (a restart's resend) has the platform
        dedupe it or look it up instead of posting twice."""
        target = replace(answer_target(entry), key=key or command_answer_key(entry))
        return await self.outboxes.say_once(runner, target, text, since)

    def _decide(self, entry: Entry, runner: AccountRunner) -> Entry:
        """The account's access policy (gateway/access.py), recorded with its reason."""
        p = entry.payload
        key = entry.key
        if not str(p.get("text") or "").strip() and not p.get("images") and not p.get("attachments"):
            # A pin notice, a join, a sticker or an embed alone: nothing for an agent to answer.
            return self.ledger.decide(key, "deny", "empty message (no text and no files)")
        if for_another_bot(str(p.get("text") or ""), bot_name(runner.adapter)):
            # `/cancel@otherbot` in a group: not ours to act on, nor for our agent to read
            return self.ledger.decide(key, "deny", "a command addressed to another bot")
        chat_type = str(p.get("chat_type") or "")
        if chat_type not in ("dm", "group") and (runner.spec.ref, chat_type) not in self._odd_chat_types:
            self._odd_chat_types.add((runner.spec.ref, chat_type))
            log.warning(
                "%s: the plugin sent chat_type %r (the contract has 'dm' and 'group'); such chats are treated as "
                "groups, so nobody there is given a pairing code",
                runner.spec.ref,
                chat_type,
            )
        verdict, reason = runner.policy.decide(
            chat_type=chat_type,
            sender=entry.sender,
            sender_is_bot=bool(p.get("sender_is_bot")),
            mentions_bot=bool(p.get("mentions_bot")),
            approved=self.pairing.is_approved(key.channel, key.account, entry.sender),
        )
        parsed = parse_command(str(p.get("text") or ""), bot_name(runner.adapter))
        command = parsed is not None
        if verdict == "deny" and reason == NOT_MENTIONED and self.chatops.answers_own_prompt(entry, runner):
            verdict, reason = "allow", "group: an answer to the sender's own approval prompt"
        if verdict == "allow" and not command and self.ledger.held(key.channel, key.account, entry.sender):
            if self.pairing.approval_pending_release(key.channel, key.account, entry.sender):
                # approved a moment ago: the kept messages are the first turn, this one comes with them
                return self.ledger.decide(key, "pair", KEPT_BEHIND_APPROVAL)
        if verdict == "pair" and self.pairing.is_denied(key.channel, key.account, entry.sender):
            verdict, reason = "deny", "dm: the owner denied this sender's pairing"  # no new code
        elif verdict == "pair" and len(self._kept(key.channel, key.account, entry.sender)) >= MAX_HELD:
            verdict, reason = "deny", f"dm: pairing pending and {MAX_HELD} messages already kept"
        elif verdict == "pair" and command:
            verdict, reason = "deny", COMMAND_NOT_KEPT
        elif verdict == "pair":
            # kept only for a code: with every slot taken the stranger is told to try later, and a
            # message kept then would wait for no code (and be refused later as "expired")
            code, _new = self.pairing.code_for(key.channel, key.account, entry.sender, display_name(p), entry.chat)
            if code is None:
                verdict, reason = "deny", TOO_MANY_PENDING
        if verdict == "pair" or reason in (COMMAND_NOT_KEPT, TOO_MANY_PENDING):
            notice = not runner.policy.silent  # the code, or "try later"
        else:  # a refused answer to an approval prompt, or a post as the chat addressing the bot: told why
            answers = parsed is not None and parsed.name in ("approve", "deny") and not p.get("sender_is_bot")
            as_chat = reason == POSTED_AS_CHAT and bool(p.get("mentions_bot")) and not runner.policy.silent
            notice = verdict == "deny" and (answers or as_chat)
        return self.ledger.decide(key, verdict, reason, notice=notice)

    def _kept(self, channel: str, account: str, sender: str) -> list[Entry]:
        """The sender's messages kept for their pending code. Kept messages with no valid code left
        belong to one that expired unapproved: refused now (they can never be released), so they
        neither count against a new code's limit nor lock the sender out."""
        held = self.ledger.held(channel, account, sender)
        if held and not self.pairing.has_pending(channel, account, sender):
            for old in held:
                self.ledger.refuse(old.key, EXPIRED_UNAPPROVED)
            return []
        return held

    # ---------------------------------------------------------------- turns

    async def _submit_batch(self, entries: list[Entry]) -> None:
        """Submit one message, or a debounced batch of one sender's messages, as one turn."""
        if not entries:
            return
        # Read again: a message held by debounce may have moved with its chat since (a Telegram group
        # upgraded to a supergroup: Ledger.move_chat); it is routed as the chat is now, not by its old id.
        entries = [self.ledger.get(e.key) or e for e in entries]
        entry = entries[0]
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        if runner is None:
            return
        if len(entries) > 1 and entry.batch is None:
            batch = partial(self.ledger.assign_batch, [e.key for e in entries])
            await write_until_done(f"{entry.key}: the debounced batch", batch)
            entries = [e for e in self.ledger.batch_of(self.ledger.get(entry.key) or entry) if e.state == "allowed"]
        # The message that carries the turn's delivery is the batch's first (its id names the
        # batch), wherever it sorts: following another member delivered nothing at all.
        entry = next((e for e in entries if not e.is_batch_member), entries[0])
        if not self.chatops.lets_in(entry, runner):
            # allowed, then the sender's access was taken away (`pairing revoke`, out of `allow` and a
            # restart) before the turn started: a debounced batch, or a row resumed after a restart
            # (a turn the server queued is asked again as it starts: Replies.admits)
            await self._fail_all(entries, NO_LONGER_LET_IN)
            log.info("%s: not submitted: %s", entry.key, NO_LONGER_LET_IN)
            return
        route_key = RouteKey.of(entry.key.channel, entry.key.account, entry.chat, entry.thread)
        resolution = self.router.resolve(route_key, runner.settings.get("default_agent"))
        if resolution is None:
            log.warning(
                "%s: no route for %s and no default_agent; add one with `appserver channels route add`",
                entry.key,
                route_key,
            )
            unrouted = "This chat is not connected to an agent yet."
            await self._fail_telling(runner, entries, "no route for this chat and no default_agent", unrouted)
            return
        if resolution.pinned and is_conversation_keyword(resolution.conversation):
            # `new`/`default` name no conversation but make one (or take the agent's default): a pin
            # the server would never refuse, though it is no conversation the operator could list
            await self._pin_not_found(runner, entry, entries, route_key, resolution.agent)
            return
        attempt = 0
        tried = False  # a submit (or the conversation it needed) was attempted: time passed since the check
        first = False  # the conversation was opened for this message: the agent gets the note first
        while True:
            if tried and not self.chatops.lets_in(entry, runner):
                # revoked while the submit was being retried (the server unreachable, its store locked):
                # asked again before each resubmit, so a long outage does not keep the row going either
                await self._fail_all(entries, NO_LONGER_LET_IN)
                log.info("%s: not submitted again: %s", entry.key, NO_LONGER_LET_IN)
                return
            tried = True
            try:
                conversation = resolution.conversation
                if conversation is None:
                    conversation = await self.link.create_conversation(
                        resolution.agent, f"{route_key}", {"channel_route": str(route_key)[:ROUTE_METADATA_MAX]}
                    )
                    bind = partial(self.router.bind, route_key, conversation)
                    await write_until_done(f"{entry.key}: the chat's new conversation {conversation}", bind)
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                    first = True
                frame = submit_frame(entries, resolution.agent, conversation, first, self.link.max_frame_bytes)
                ack = await self.link.submit(frame)
                break
            except ProtocolError as exc:
                if exc.code == "conversation_not_found" and resolution.pinned:
                    await self._pin_not_found(runner, entry, entries, route_key, resolution.agent)
                    return
                if exc.code == "conversation_not_found" and resolution.conversation is not None:
                    # deleted on the server: start a fresh one
                    await write_until_done(f"{entry.key}: forget {route_key}", partial(self.router.forget, route_key))
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                    resolution = type(resolution)(resolution.key, resolution.agent, None, resolution.source)
                    continue
                if exc.code in PERMANENT_CODES:
                    refused = f"the server refused the message: {exc.code}: {exc}"
                    await self._fail_telling(runner, entries, refused, f"⚠ Could not start a turn: {exc}", force=True)
                    return
                delay = SUBMIT_BACKOFF_S[min(attempt, len(SUBMIT_BACKOFF_S) - 1)]
                log.warning("%s: submit failed (%s); retrying in %g s", entry.key, exc, delay)
            except (Closed, TimeoutError, OSError) as exc:
                delay = SUBMIT_BACKOFF_S[min(attempt, len(SUBMIT_BACKOFF_S) - 1)]
                log.warning("%s: server unreachable (%s); retrying in %g s", entry.key, exc, delay)
            attempt += 1
            await asyncio.sleep(delay)
        turn_id, conversation_id = str(ack["turn_id"]), str(ack["conversation_id"])
        # Retried until written: a row left `allowed` has no follower, and its reply waited for a restart.
        submitted = partial(self._record_submitted, entries, entry, turn_id, conversation_id)
        entry = await write_until_done(f"{entry.key}: the turn's submit", submitted)
        runner.live.turns += 1
        self._dirty = True
        if int(ack.get("queue_position") or 0) > 0:
            self._spawn(self._acknowledge_queued(runner, entries[-1]))
        # Access is asked again as the turn is first seen (its ack here, then its first snapshot, tool
        # call or approval request: `Replies.admits`), queued or not: a revoke made while the submit
        # was on its way (a stalled server, a retry) is not answered. Refused: cancelled on the server
        # before anything reaches the chat, its rows failed with NO_LONGER_LET_IN.
        self._follow(entry, waited=True)
        if entry.turn_id is not None:
            await self.replies.refuse_if_not_let_in(entry.turn_id)

    async def _fail_all(self, entries: list[Entry], reason: str, *, notice: tuple[Entry, str] | None = None) -> None:
        """Fail `entries` (not submitted), retried while gateway.db refuses it: a row left `allowed` has
        no follower, and was submitted at the next restart, after the chat's later messages.
        `notice`: the entry that carries the chat's notice of it, and its text (owed with the failure)."""
        for e in entries:
            text = notice[1] if notice is not None and notice[0].key == e.key else None
            await write_until_done(f"{e.key}: failed", partial(self.ledger.mark_failed, e.key, reason, notice=text))

    async def _fail_telling(
        self, runner: AccountRunner, entries: list[Entry], reason: str, text: str, *, force: bool = False
    ) -> None:
        """Fail `entries` and tell their chat `text`, at most once per chat per 10 minutes unless
        `force`. The notice is owed with the failure and said under its own key (`_tell_decision`),
        so a restart before it went out says it then instead of never."""
        entry = next((e for e in entries if not e.is_batch_member), entries[0])
        key_of_chat = chat_key(entry)
        tell = force or not self._notices.get(key_of_chat)
        if tell:
            self._notices.put(key_of_chat, True)
        await self._fail_all(entries, reason, notice=(entry, text) if tell else None)
        runner.live.failures += 1
        self._dirty = True
        failed = self.ledger.get(entry.key)
        if failed is not None and failed.owes_notice:
            await self._tell_decision(failed, runner, resumed=False)

    def _record_submitted(self, entries: list[Entry], entry: Entry, turn_id: str, conversation_id: str) -> Entry:
        """The server accepted `turn_id` for `entries` (whose reply goes out through `entry`). Safe to
        run again: a row already submitted under this turn is left as it is."""
        for e in entries:
            if e.key != entry.key:
                self.ledger.mark_submitted(e.key, turn_id, conversation_id)
        return self.ledger.mark_submitted(entry.key, turn_id, conversation_id)

    async def _pin_not_found(
        self, runner: AccountRunner, entry: Entry, entries: list[Entry], route_key: RouteKey, agent: str
    ) -> None:
        """The operator pinned this chat to a conversation the server does not find for the route's
        agent (deleted since, or never its own): fail the message and say so, rather than open a new
        conversation the operator did not choose and that `route list` would never show."""
        route = self.router.get(route_key)
        pin = route.conversation if route is not None else None
        reason = (
            f"the route {route_key} is pinned to conversation {pin}, which the server does not find"
            f" for agent {agent} (deleted, another agent's, or, in auth mode token, not the gateway's own:"
            " `appserver channels status` says which); fix the route with `appserver channels route add`"
        )
        log.warning("%s: not submitted: %s", entry.key, reason)
        notice = (
            f"⚠ This chat is pinned by the operator to conversation {pin}, which no longer exists;"
            " ask the operator to fix the route."
        )
        await self._fail_telling(runner, entries, reason, notice, force=True)

    async def _acknowledge_queued(self, runner: AccountRunner, entry: Entry) -> None:
        """A message that waits behind a running turn gets a reaction where the platform can: best
        effort, skipped when rate limited, so the cosmetic call never holds the chat's replies."""
        adapter = runner.adapter
        if adapter is None or not adapter.limits.can_react:
            return
        try:
            target = Target(entry.chat, entry.thread)
            await self.outboxes.of(runner).react(target, entry.key.message_id, "👀", best_effort=True)
        except (DeliveryFailed, RuntimeError) as exc:
            log.info("%s: could not mark the message as queued: %s", entry.key, exc)

    # ---------------------------------------------------------------- commands from the supervisor

    async def deliver_text(self, target: str, text: str) -> list[str]:
        """Send `text` to `channel:account:chat[:thread]` (cron `--deliver`); returns the ids. A text
        over DELIVER_MAX_CHARS is cut there, with a note saying so (`cap_text`)."""
        parts = target.split(":")
        if len(parts) not in (3, 4) or not all(parts):
            raise ValueError("target must be channel:account:chat[:thread]")
        runner = self.runners.get(f"{parts[0]}:{parts[1]}")
        if runner is None:
            raise ValueError(f"no running account {parts[0]}:{parts[1]}")
        where = Target(parts[2], parts[3] if len(parts) == 4 else None)
        if len(text) > DELIVER_MAX_CHARS:
            log.warning("delivering the first %d of %d characters to %s", DELIVER_MAX_CHARS, len(text), target)
        ids = await self.replies.deliver_text(runner, where, cap_text(text))
        return ids


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


def tells_pairing(entry: Entry) -> bool:
    """Whether what follows `entry`'s decision is a pairing answer (`ChatOps.pairing_prompt`: the
    code, or "try later"): a stranger's message kept for a code, or refused while one is pending."""
    kept = entry.state == "held" and entry.reason != KEPT_BEHIND_APPROVAL
    return kept or entry.reason in (COMMAND_NOT_KEPT, TOO_MANY_PENDING)


def command_answer_key(entry: Entry) -> str:
    """The key a command's answer goes out under (`Target.key`): one per inbound command, so a
    resend after a restart is the same message to a platform or receiver that dedupes by it."""
    return f"cmd:{entry.idempotency_key}"


def command_interrupted(command: Command) -> str:
    """Said instead of running a command again whose answer a restart lost (docs/channels.md)."""
    return (
        f"⚠️ The gateway restarted while /{command.name} was being handled; it is not run again, so it may or"
        " may not have taken effect. /status shows where things stand."
    )


def is_conversation_keyword(conversation: str | None) -> bool:
    """Whether a route's pin is one of the words the server reads as "make one" or "the agent's
    default" (in any case, spaces around it: as the server reads them) rather than a conversation."""
    return conversation is not None and conversation.strip().lower() in ("new", "default")
