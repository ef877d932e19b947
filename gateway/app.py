"""The gateway: platform messages in through the ledger, turns on the server, replies back out.

    adapter ──on_message──► ledger.record (commit) ──► ack to the platform
                                  │
                     per-chat worker, in arrival order:
                     decide ─► route ─► envelope ─► submit_input (idempotency key) ─► mark_submitted
                                  │
                     per-turn follower: snapshots ─► ReplySink (edits ~1/s) ─► mark_finished ─► delivered

Every step reads and writes the ledger, so a restart resumes each row where it stood: undecided
rows are decided, allowed rows submitted again under the same key (the server makes that one
turn), accepted turns followed (never submitted again), finished replies delivered once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appserver.client import TERMINAL, Closed, ProtocolError
from gateway.accounts import AccountRunner, AccountSpec
from gateway.approvals import OUTCOME_LINES, ApprovalBoard, Prompt
from gateway.commands import HELP, Command, parse_command
from gateway.debounce import Buffers
from gateway.delivery import ChatOrder, DeliveryFailed, Outbox, ReplySink, reply_body, visible_text
from gateway.envelope import AGENT_NOTE, Envelope, render, timestamp
from gateway.intake import Intake
from gateway.ledger import Entry, Ledger, Receipt, UpdateKey
from gateway.link import ServerLink
from gateway.pairing import Pairing
from gateway.ratelimit import ChatRateLimiter
from gateway.routing import RouteKey, Router
from gateway.status import StatusBoard
from gateway.tool import NAME as TOOL_NAME
from gateway.tool import SPEC as TOOL_SPEC
from gateway.tool import ToolRefusal, TurnSends, parse_call, target_name
from plugins.contract import InboundMessage, Target

log = logging.getLogger("gateway")

PERMANENT_CODES = frozenset(
    {"bad_frame", "forbidden", "agent_not_found", "agent_ambiguous", "invalid_request", "unknown_type"}
)
SUBMIT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
NOTICE_EVERY_S = 600.0
STATUS_FLUSH_S = 1.0
PAIRING_POLL_S = 1.0
PROMPT_EVERY_S = 60.0
MAX_HELD = 5  # messages kept per sender while their pairing is pending
FIRST_SEND_GRACE_S = 0.3
TYPING_EVERY_S = 4.0

EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class _TurnContext:
    runner: AccountRunner
    key: UpdateKey
    here: Target
    reply_to: str
    starter: str
    conversation: str | None
    sends: TurnSends = field(default_factory=TurnSends)


class Gateway:
    def __init__(
        self,
        home: Path,
        ledger: Ledger,
        link: ServerLink,
        specs: list[AccountSpec],
        emit: EventSink,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.home = home
        self.ledger = ledger
        self.router = Router(ledger.connection)
        self.board = StatusBoard(ledger.connection)
        self.intake = Intake(ledger)
        self.pairing = Pairing(ledger.connection)
        self.link = link
        self.emit = emit
        self.runners = {
            s.ref: AccountRunner(s, home, self.on_message, self._state_changed, environ=environ) for s in specs
        }
        self._limiters: dict[str, ChatRateLimiter] = {}
        self._order = ChatOrder()
        self._queues: dict[str, asyncio.Queue[UpdateKey]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._turns: dict[str, _TurnContext] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._notices: dict[str, float] = {}
        self._prompted: dict[str, tuple[str, float]] = {}  # sender -> (what they were told, when)
        self._dirty = True
        self.approvals = ApprovalBoard()
        link.on_tool_call(self._tool_call)
        link.on_approval(self._approval_frame)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, ready_timeout: float = 25.0) -> None:
        """Start every account (each reaches running or error), then resume the ledger."""
        self.board.mark_unconfigured({(r.spec.channel, r.spec.name) for r in self.runners.values()})
        for runner in self.runners.values():
            self._spawn(runner.run())
        self._spawn(self._flush_status_forever())
        self._spawn(self._watch_pairings())
        waits = [asyncio.wait_for(r.ready.wait(), ready_timeout) for r in self.runners.values()]
        for result in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, TimeoutError):
                raise result
        self._resume()

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.runners.values()), return_exceptions=True)
        tasks = [*self._tasks, *self._workers.values(), *self._followers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._save_status()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _resume(self) -> None:
        for entry in self.ledger.in_flight() + self.ledger.to_deliver():
            self._follow(entry, resumed=True)
        for entry in self.ledger.to_decide() + self.ledger.to_submit():
            self._enqueue(entry)

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

    def statuses(self) -> list[dict[str, Any]]:
        return [r.live.snapshot().to_json() for r in self.runners.values()]

    def _save_status(self) -> None:
        self._dirty = False
        self.board.save([r.live.snapshot() for r in self.runners.values()])

    async def _flush_status_forever(self) -> None:
        while True:
            await asyncio.sleep(STATUS_FLUSH_S)
            if self._dirty:
                self._save_status()

    # ---------------------------------------------------------------- inbound

    async def on_message(self, msg: InboundMessage) -> None:
        """The adapters' callback: record first (committed), then ack, then process in order."""
        runner = self.runners.get(f"{msg.channel}:{msg.account}")
        if runner is None:
            raise ValueError(f"message for an unknown account {msg.channel}:{msg.account}")
        key = UpdateKey(msg.channel, msg.account, clean(msg.message_id))
        thread = clean(msg.thread) if msg.thread is not None else None
        receipt = Receipt(key, clean(msg.chat), clean(msg.sender), thread, _payload(msg))
        entry, created = await self.intake.record(receipt)
        if msg.ack is not None:
            await msg.ack()
        if created:
            runner.live.messages_in += 1
            runner.live.last_inbound = time.time()
            self._dirty = True
            self._enqueue(entry)

    def _enqueue(self, entry: Entry) -> None:
        chat_key = _chat_key(entry)
        queue = self._queues.get(chat_key)
        if queue is None:
            queue = self._queues[chat_key] = asyncio.Queue()
            self._workers[chat_key] = asyncio.ensure_future(self._work(chat_key, queue))
        queue.put_nowait(entry.key)

    async def _work(self, chat_key: str, queue: asyncio.Queue[UpdateKey]) -> None:
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
                del self._queues[chat_key]
                del self._workers[chat_key]
                return
            except TimeoutError:
                for batch in buffers.due():
                    await self._guarded(self._submit_batch(batch))
                continue
            await self._guarded(self._process(key, buffers))

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
            entry = self._decide(entry, runner)
            if entry.state == "held":
                await self._pairing_prompt(entry, runner)
        if entry.state != "allowed":
            return
        if entry.batch is not None:  # a batch written down before a crash: submit it as it was
            await self._submit_batch([e for e in self.ledger.batch_of(entry) if e.state == "allowed"])
            return
        command = parse_command(str(entry.payload.get("text") or ""))
        media = bool(entry.payload.get("images") or entry.payload.get("attachments"))
        settings = runner.debounce
        if command is not None or media or not settings.enabled:
            waiting = buffers.take(entry.sender)  # a command or media flushes the sender's buffer first
            if waiting:
                await self._submit_batch(waiting)
        if command is not None:
            answer = await self._command(entry, runner, command)
            ids = await self._say(runner, Target(entry.chat, entry.thread), answer) if answer else []
            self.ledger.mark_command(entry.key, f"command /{command.name}", ids)
            return
        if media or not settings.enabled:
            await self._submit_batch([entry])
            return
        full = buffers.add(entry, settings)
        if full:
            await self._submit_batch(full)

    def _decide(self, entry: Entry, runner: AccountRunner) -> Entry:
        """The account's access policy (gateway/access.py), recorded with its reason."""
        p = entry.payload
        key = entry.key
        verdict, reason = runner.policy.decide(
            chat_type=str(p.get("chat_type") or "dm"),
            sender=entry.sender,
            sender_is_bot=bool(p.get("sender_is_bot")),
            mentions_bot=bool(p.get("mentions_bot")),
            approved=self.pairing.is_approved(key.channel, key.account, entry.sender),
        )
        if verdict == "pair" and len(self.ledger.held(key.channel, key.account, entry.sender)) >= MAX_HELD:
            verdict, reason = "deny", f"dm: pairing pending and {MAX_HELD} messages already kept"
        return self.ledger.decide(key, verdict, reason)

    async def _pairing_prompt(self, entry: Entry, runner: AccountRunner) -> None:
        """Tell an unknown sender how to get through: their code, or "try later" (not when silent)."""
        key = entry.key
        code, _new = self.pairing.code_for(
            key.channel, key.account, entry.sender, entry.payload.get("sender_name"), entry.chat
        )
        if runner.policy.silent:
            return
        asked = f"{key.channel}:{key.account}:{entry.sender}"
        said = code.code if code is not None else "later"
        now = time.monotonic()
        last = self._prompted.get(asked)
        if last is not None and last[0] == said and now - last[1] < PROMPT_EVERY_S:
            return  # a burst of messages from one stranger gets one answer, not one each
        self._prompted[asked] = (said, now)
        if code is None:
            text = "Too many people are waiting to be let in right now; please try again later."
        else:
            pretty = f"{code.code[:4]}-{code.code[4:]}"
            text = (
                f"Hi! This assistant only talks to people its owner has approved. Your pairing code is {pretty} "
                f"(valid for an hour). Ask the owner to run: appserver pairing approve {code.code}"
            )
        await self._say(runner, Target(entry.chat, entry.thread), text)

    async def _watch_pairings(self) -> None:
        """Act on approvals and denials (from the CLI or elsewhere) within a second, live."""
        while True:
            for decided in self.pairing.decided_unhandled():
                runner = self.runners.get(f"{decided.channel}:{decided.account}")
                if runner is None or runner.adapter is None or not runner.adapter.is_running:
                    continue  # not configured or not running here: act on it once it runs
                held = self.ledger.held(decided.channel, decided.account, decided.sender)
                target = Target(decided.chat)
                if decided.status == "approved":
                    released = [self.ledger.release(e.key, f"pairing {decided.code} approved") for e in held]
                    if len(released) > 1:  # the kept messages are the first turn, together
                        self.ledger.assign_batch([e.key for e in released])
                    if released:
                        self._enqueue(released[0])
                    await self._say(
                        runner, target, "✅ You're approved. Your messages are on their way to the assistant."
                    )
                else:
                    for entry in held:
                        self.ledger.refuse(entry.key, f"pairing {decided.code} denied")
                    notice = runner.settings.get("deny_notice")
                    if isinstance(notice, str) and notice.strip():
                        await self._say(runner, target, notice)
                self.pairing.mark_handled(decided.code)
            await asyncio.sleep(PAIRING_POLL_S)

    async def _say(self, runner: AccountRunner, target: Target, text: str) -> list[str]:
        try:
            ids = await self._outbox(runner).send(target, text)
            runner.live.last_outbound = time.time()
            return ids
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not tell %s: %s", runner.spec.ref, target.chat, exc)
            return []

    # ---------------------------------------------------------------- chat commands

    async def _command(self, entry: Entry, runner: AccountRunner, command: Command) -> str:
        """The gateway's answer to a chat command (gateway/commands.py); never a turn."""
        route_key = RouteKey.of(entry.key.channel, entry.key.account, entry.chat, entry.thread)
        resolution = self.router.resolve(route_key, runner.settings.get("default_agent"))
        conversation = resolution.conversation if resolution is not None else None
        try:
            if command.name == "help":
                return HELP
            if command.name == "new":
                self.router.forget(route_key)
                return "🆕 Your next message starts a new conversation."
            if command.name == "cancel":
                if conversation is None:
                    return "Nothing is running."
                running = [c for c in self._turns.values() if c.conversation == conversation]
                if (
                    running
                    and all(c.starter != entry.sender for c in running)
                    and not runner.policy.is_admin(entry.sender)
                ):
                    return "Only the person who started the running reply, or an admin, can cancel it."
                ack = await self.link.request({"type": "cancel", "conversation": conversation})
                return "⏹ Cancelled." if ack.get("cancelled") else "Nothing is running."
            if command.name == "status":
                return await self._status_text(resolution.agent if resolution else None, conversation)
            if command.name == "pair":
                if not runner.policy.is_admin(entry.sender):
                    return "Only an admin of this bot can list pairing requests."
                pending = [
                    p
                    for p in self.pairing.pending()
                    if (p.channel, p.account) == (entry.key.channel, entry.key.account)
                ]
                if not pending:
                    return "No pending pairing requests."
                lines = [f"{p.code}  {p.sender_name or p.sender}" for p in pending]
                return "Pending pairing requests (approve with: appserver pairing approve CODE):\n" + "\n".join(lines)
            return await self._answer_approval(entry, runner, command)
        except (ProtocolError, Closed, TimeoutError) as exc:
            return f"⚠ The server did not answer: {exc}"

    async def _status_text(self, agent: str | None, conversation: str | None) -> str:
        if agent is None:
            return "This chat is not connected to an agent yet."
        if conversation is None:
            return f"Agent: {agent}. No conversation yet: your next message starts one."
        state = await self.link.request({"type": "subscribe", "conversation": conversation})
        active = state.get("active_turn") or {}
        running = f"; running {active.get('turn_id')} ({active.get('phase')})" if active else ""
        return (
            f"Agent: {agent}. Conversation {conversation}: {state.get('state')}, "
            f"{int(state.get('queued') or 0)} queued{running}."
        )

    # ---------------------------------------------------------------- approvals in the chat

    async def _approval_frame(self, frame: dict[str, Any]) -> None:
        call_id = str(frame.get("call_id") or "")
        if frame.get("type") == "approval_resolved":
            prompt = self.approvals.prompts.get(call_id)
            if prompt is not None and prompt.decided is None:
                who = frame.get("decided_by")
                line = OUTCOME_LINES.get(str(frame.get("status")), str(frame.get("status")))
                await self._decided(
                    prompt, f"{line}" + (f" by {who}" if who and frame.get("status") in ("approved", "denied") else "")
                )
            return
        ctx = await self._turn_context(str(frame.get("turn_id")))
        if ctx is None or ctx.conversation is None and not frame.get("conversation_id"):
            return  # not a turn this gateway started
        spec = ctx.runner.spec
        prompt = Prompt(
            call_id=call_id,
            conversation=str(frame.get("conversation_id") or ctx.conversation),
            turn_id=str(frame.get("turn_id")),
            account=spec.ref,
            target=ctx.here,
            starter=ctx.starter,
            name=str(frame.get("name") or "a tool"),
            arguments=str(frame.get("arguments") or ""),
        )
        if not self.approvals.add(prompt):
            return
        buttons = getattr(ctx.runner.adapter, "prompt_approval", None)
        try:
            if callable(buttons):
                prompt.message_ids = list(await buttons(ctx.here, prompt.text(), prompt.short_id))
            else:
                prompt.message_ids = await self._say(ctx.runner, ctx.here, prompt.text())
        except Exception as exc:  # noqa: BLE001 - a prompt that cannot be shown leaves the CLI to answer
            log.warning("%s: could not show the approval prompt: %s", spec.ref, exc)

    async def _answer_approval(self, entry: Entry, runner: AccountRunner, command: Command) -> str:
        found = self.approvals.find(runner.spec.ref, entry.chat, command.args[0] if command.args else None)
        if found is None:
            return "No request waiting for an answer here" + (f" with ID {command.args[0]}." if command.args else ".")
        if isinstance(found, list):
            return "Several requests are waiting; answer with the ID: " + ", ".join(p.short_id for p in found)
        prompt = found
        if entry.sender != prompt.starter and not runner.policy.is_admin(entry.sender):
            return "Only the person who started this, or an admin, can answer it."
        decision = "approve" if command.name == "approve" else "deny"
        ack = await self.link.request(
            {
                "type": "approval_response",
                "conversation": prompt.conversation,
                "decisions": [{"call_id": prompt.call_id, "decision": decision}],
            }  # fmt: skip
        )
        result = (ack.get("results") or [{}])[0]
        if result.get("accepted") is False:
            return "That request was already answered."
        who = entry.payload.get("sender_name") or entry.sender
        await self._decided(prompt, f"{OUTCOME_LINES['approved' if decision == 'approve' else 'denied']} by {who}")
        return ""

    async def _decided(self, prompt: Prompt, line: str) -> None:
        """Show the decision on the prompt: edited in place where the platform can, else a line."""
        prompt.decided = line
        runner = self.runners.get(prompt.account)
        if runner is None:
            return
        try:
            outbox = self._outbox(runner)
            if outbox.can_edit and prompt.message_ids:
                await outbox.edit(prompt.target, prompt.message_ids[0], prompt.text())
            else:
                await outbox.send(prompt.target, f"{prompt.name}: {line}")
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not update the approval prompt: %s", prompt.account, exc)

    async def _turn_context(self, turn_id: str) -> _TurnContext | None:
        """The context of a turn this gateway follows; a frame can overtake the submit's ack, so
        give the turn a moment to register."""
        for _ in range(50):
            ctx = self._turns.get(turn_id)
            if ctx is not None:
                return ctx
            await asyncio.sleep(0.1)
        return None

    async def _submit_batch(self, entries: list[Entry]) -> None:
        """Submit one message, or a debounced batch of one sender's messages, as one turn."""
        if not entries:
            return
        entry = entries[0]
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        if runner is None:
            return
        if len(entries) > 1 and entry.batch is None:
            self.ledger.assign_batch([e.key for e in entries])
            entries = [e for e in self.ledger.batch_of(self.ledger.get(entry.key) or entry) if e.state == "allowed"]
            entry = entries[0]
        route_key = RouteKey.of(entry.key.channel, entry.key.account, entry.chat, entry.thread)
        resolution = self.router.resolve(route_key, runner.settings.get("default_agent"))
        if resolution is None:
            for e in entries:
                self.ledger.mark_failed(e.key, "no route for this chat and no default_agent")
            runner.live.failures += 1
            log.warning(
                "%s: no route for %s and no default_agent; add one with `appserver channels route add`",
                entry.key,
                route_key,
            )
            await self._notice(runner, entry, "This chat is not connected to an agent yet.")
            return
        attempt = 0
        first = False  # the conversation was opened for this message: the agent gets the note first
        while True:
            try:
                conversation = resolution.conversation
                if conversation is None:
                    conversation = await self.link.create_conversation(
                        resolution.agent, f"{route_key}", {"channel_route": str(route_key)}
                    )
                    self.router.bind(route_key, conversation)
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                    first = True
                ack = await self.link.submit(submit_frame(entries, resolution.agent, conversation, first))
                break
            except ProtocolError as exc:
                if exc.code == "conversation_not_found" and resolution.conversation is not None:
                    self.router.forget(route_key)  # deleted on the server: start a fresh one
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                    resolution = type(resolution)(resolution.key, resolution.agent, None, resolution.source)
                    continue
                if exc.code in PERMANENT_CODES:
                    for e in entries:
                        self.ledger.mark_failed(e.key, f"the server refused the message: {exc.code}: {exc}")
                    runner.live.failures += 1
                    await self._notice(runner, entry, f"⚠ Could not start a turn: {exc}", force=True)
                    return
                delay = SUBMIT_BACKOFF_S[min(attempt, len(SUBMIT_BACKOFF_S) - 1)]
                log.warning("%s: submit failed (%s); retrying in %g s", entry.key, exc, delay)
            except (Closed, TimeoutError, OSError) as exc:
                delay = SUBMIT_BACKOFF_S[min(attempt, len(SUBMIT_BACKOFF_S) - 1)]
                log.warning("%s: server unreachable (%s); retrying in %g s", entry.key, exc, delay)
            attempt += 1
            await asyncio.sleep(delay)
        turn_id, conversation_id = str(ack["turn_id"]), str(ack["conversation_id"])
        for e in entries[1:]:
            self.ledger.mark_submitted(e.key, turn_id, conversation_id)
        entry = self.ledger.mark_submitted(entry.key, turn_id, conversation_id)
        runner.live.turns += 1
        self._dirty = True
        if int(ack.get("queue_position") or 0) > 0:
            self._spawn(self._acknowledge_queued(runner, entries[-1]))
        self._follow(entry)

    async def _acknowledge_queued(self, runner: AccountRunner, entry: Entry) -> None:
        """A message that waits behind a running turn gets a reaction where the platform can."""
        adapter = runner.adapter
        if adapter is None or not adapter.limits.can_react:
            return
        try:
            await self._outbox(runner).react(Target(entry.chat, entry.thread), entry.key.message_id, "👀")
        except (DeliveryFailed, RuntimeError) as exc:
            log.info("%s: could not mark the message as queued: %s", entry.key, exc)

    async def _notice(self, runner: AccountRunner, entry: Entry, text: str, *, force: bool = False) -> None:
        """A short line to the chat, at most one per chat per 10 minutes unless `force`."""
        chat_key = _chat_key(entry)
        now = time.monotonic()
        if not force and now - self._notices.get(chat_key, -1e9) < NOTICE_EVERY_S:
            return
        self._notices[chat_key] = now
        try:
            await self._outbox(runner).send(Target(entry.chat, entry.thread), text)
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not send a notice: %s", entry.key, exc)

    # ---------------------------------------------------------------- outbound

    def _outbox(self, runner: AccountRunner) -> Outbox:
        adapter = runner.adapter
        if adapter is None or not adapter.is_running:
            raise RuntimeError(f"{runner.spec.ref} is not running")
        limiter = self._limiters.get(runner.spec.ref)
        if limiter is None:
            rate = float(runner.settings.get("chat_rate") or adapter.limits.edits_per_second)
            limiter = self._limiters[runner.spec.ref] = ChatRateLimiter(rate=rate, burst=max(3, int(rate)))
        return Outbox(adapter, limiter, asyncio.sleep)

    def _follow(self, entry: Entry, *, resumed: bool = False) -> None:
        if entry.turn_id is None or entry.turn_id in self._followers or entry.is_batch_member:
            return  # a batch's reply is delivered through its first message
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        if runner is None:
            log.error("%s: the account is no longer configured; its reply cannot be delivered", entry.key)
            return
        turn_id = entry.turn_id
        self._turns[turn_id] = _TurnContext(
            runner, entry.key, Target(entry.chat, entry.thread), entry.key.message_id, entry.sender, entry.conversation
        )
        task = asyncio.ensure_future(self._deliver(entry, runner, turn_id, resumed))
        self._followers[turn_id] = task
        task.add_done_callback(lambda _t: self._turn_done(turn_id))

    def _turn_done(self, turn_id: str) -> None:
        self._followers.pop(turn_id, None)
        self._turns.pop(turn_id, None)
        self.approvals.forget_turn(turn_id)

    async def _deliver(self, entry: Entry, runner: AccountRunner, turn_id: str, resumed: bool) -> None:
        # The reply answers the message (a platform may thread it, a webhook receiver correlates it).
        target = Target(entry.chat, entry.thread, entry.key.message_id)
        before, mine = self._order.ticket(_chat_key(entry))
        try:
            await runner.ready.wait()
            while runner.adapter is None or not runner.adapter.is_running:
                await asyncio.sleep(0.5)  # the account restarts; the reply waits for it
            outbox = self._outbox(runner)
            stream = bool(runner.settings.get("stream", True))
            tool_status = bool(runner.settings.get("tool_status", True))
            sink = ReplySink.resumed(outbox, target, entry.remote_ids, stream=stream)
            key = entry.key
            sink.on_sent = lambda ids: self.ledger.note_sent(key, ids, None)
            sink.key = str(key)
            text = entry.reply
            if entry.state == "submitted":
                typing = asyncio.ensure_future(self._keep_typing(runner, target))
                try:
                    text = await self._run_sink(entry, sink, turn_id, before, tool_status, resumed)
                finally:
                    typing.cancel()
                entry = self.ledger.mark_finished(entry.key, text)
            if before is not None:
                await before.wait()
            await asyncio.sleep(sink.final_due())
            ids = await sink.finish(text or "")
            self.ledger.mark_delivered(entry.key, ids)
            for member in self.ledger.batch_of(entry)[1:]:  # the other messages of a debounced batch
                if member.state == "submitted":
                    member = self.ledger.mark_finished(member.key, text or "")
                if member.state == "finished":
                    self.ledger.mark_delivered(member.key, ids)
            runner.live.replies += 1
            runner.live.last_outbound = time.time()
        except DeliveryFailed as exc:
            log.error("%s: reply not delivered: %s", entry.key, exc)
            for member in self.ledger.batch_of(entry):
                if member.state in ("submitted", "finished"):
                    self.ledger.mark_failed(member.key, f"delivery failed: {exc}")
            runner.live.failures += 1
        finally:
            self._dirty = True
            self.link.unfollow(turn_id)
            self._order.release(_chat_key(entry), mine)

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
    ) -> str:
        """Follow the turn to its end, growing the reply in place; returns the final text."""
        follower = self.link.follow(turn_id)
        if resumed and entry.conversation:
            recovered = await self._recover(entry.conversation, turn_id)
            if recovered is not None:
                follower.offer(recovered)
        shown = entry.reply or ""  # the reply's text as last shown: kept if the turn ends without its text
        loop = asyncio.get_running_loop()
        while True:
            snap = await follower.next()
            if snap.get("status") in TERMINAL:
                return _final_text(snap, shown)
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
                if snap.get("status") in TERMINAL:
                    return _final_text(snap, shown)
            snap = follower.latest or snap
            try:
                ids = await sink.show(visible_text(snap, tool_status=tool_status))
            except DeliveryFailed as exc:
                log.warning("%s: a streaming edit failed (%s); the final text will still be sent", entry.key, exc)
                continue
            body = reply_body(snap)
            if body and body != shown:
                shown = body
                self.ledger.note_sent(entry.key, ids, shown)  # after on_sent: the text too

    async def _recover(self, conversation: str, turn_id: str) -> dict[str, Any] | None:
        while True:
            try:
                return await self.link.recover(conversation, turn_id)
            except ProtocolError as exc:
                if exc.code in ("conversation_not_found", "forbidden"):
                    return {
                        "turn_id": turn_id,
                        "status": "failed",
                        "revision": 1 << 30,
                        "blocks": [],
                        "error": {"message": f"the conversation is gone ({exc.code})"},
                    }
                log.warning("recovering %s failed (%s); retrying", turn_id, exc)
            except (Closed, TimeoutError) as exc:
                log.warning("recovering %s failed (%s); retrying", turn_id, exc)
            await asyncio.sleep(1.0)

    # ---------------------------------------------------------------- commands from the supervisor

    async def deliver_text(self, target: str, text: str) -> list[str]:
        """Send `text` to `channel:account:chat[:thread]` (cron `--deliver`); returns the ids."""
        parts = target.split(":")
        if len(parts) not in (3, 4) or not all(parts):
            raise ValueError("target must be channel:account:chat[:thread]")
        runner = self.runners.get(f"{parts[0]}:{parts[1]}")
        if runner is None:
            raise ValueError(f"no running account {parts[0]}:{parts[1]}")
        sink = ReplySink(self._outbox(runner), Target(parts[2], parts[3] if len(parts) == 4 else None), stream=False)
        ids = await sink.finish(text)
        runner.live.replies += 1
        runner.live.last_outbound = time.time()
        self._dirty = True
        return ids

    # ---------------------------------------------------------------- message_channel

    async def _tool_call(self, frame: dict[str, Any]) -> None:
        call_id = str(frame.get("call_id"))
        ctx = await self._turn_context(str(frame.get("turn_id")))
        if frame.get("name") != TOOL_NAME or ctx is None:
            await self._answer(call_id, f"{frame.get('name')} is not available here", True)
            return
        async with ctx.sends.lock:
            await self._run_tool(ctx, call_id, frame)

    async def _run_tool(self, ctx: _TurnContext, call_id: str, frame: dict[str, Any]) -> None:
        spec = ctx.runner.spec
        try:
            call = parse_call(
                str(frame.get("arguments") or "{}"),
                channel=spec.channel,
                account=spec.name,
                here=ctx.here,
                reply_to=ctx.reply_to,
            )
            outbox = self._outbox(ctx.runner)
            where = target_name(spec.channel, spec.name, call.target)
            if call.action in ("send", "reply"):
                if ctx.sends.last == (where, call.text):
                    raise ToolRefusal("not sent: this is an exact repeat of your previous message in this turn")
                if call.target.chat != ctx.here.chat and not self._reachable(spec.channel, spec.name, call.target.chat):
                    raise ToolRefusal(f"not sent: {where} is not a chat this account has talked to or routes")
                ids = await ReplySink(outbox, call.target, stream=False).finish(call.text)
                ctx.sends.last = (where, call.text)
                ctx.sends.sent.update((i, call.target) for i in ids)
                result = f"sent to {where}; message id {', '.join(ids)}"
            elif call.action == "edit":
                where_sent = ctx.sends.sent.get(str(call.message_id))
                if where_sent is None:
                    raise ToolRefusal("edit only messages you sent with this tool in this turn")
                if not outbox.can_edit:
                    raise ToolRefusal("this channel cannot edit messages")
                await outbox.edit(where_sent, str(call.message_id), call.text)
                result = f"edited message {call.message_id}"
            else:
                await outbox.react(call.target, str(call.message_id), str(call.emoji))
                result = f"reacted {call.emoji} to message {call.message_id}"
        except (ToolRefusal, DeliveryFailed, RuntimeError) as exc:
            await self._answer(call_id, str(exc), True)
            return
        await self._answer(call_id, result, False)

    def _reachable(self, channel: str, account: str, chat: str) -> bool:
        """A chat the account can send to on the model's behalf: one it has heard from, or one an
        operator routed (so the agent cannot message arbitrary chats it was never part of)."""
        heard = self.ledger.connection.execute(
            "SELECT 1 FROM ledger WHERE channel=? AND account=? AND chat=? LIMIT 1", (channel, account, chat)
        ).fetchone()
        return heard is not None or bool([r for r in self.router.routes(channel, account) if r.key.chat == chat])

    async def _answer(self, call_id: str, output: str, is_error: bool) -> None:
        try:
            await self.link.tool_result(call_id, output, is_error)
        except (ProtocolError, TimeoutError) as exc:
            log.warning("tool result for %s not taken: %s", call_id, exc)


def _final_text(snapshot: dict[str, Any], shown: str) -> str:
    """The reply's last text: a turn that ended without its text (interrupted by a crash, failed
    mid-stream) keeps what the chat already showed, followed by the one-line reason."""
    final = visible_text(snapshot, tool_status=False)
    if shown and not reply_body(snapshot) and snapshot.get("status") in ("failed", "cancelled"):
        return f"{shown}\n\n{final}"
    return final


def _chat_key(entry: Entry) -> str:
    return f"{entry.key.channel}:{entry.key.account}:{entry.chat}:{entry.thread or ''}"


IMAGE_MAX_BYTES = 5 << 20


def submit_frame(entries: list[Entry], agent: str, conversation: str, first: bool) -> dict[str, Any]:
    """The turn's input: the envelope of each message (a batch marked as such), their images."""
    batch = len(entries) if len(entries) > 1 else None
    blocks: list[str] = []
    images: list[str] = []
    for index, e in enumerate(entries, start=1):
        p = e.payload
        text = str(p.get("text") or "")
        for a in p.get("attachments") or []:  # named inside the body, escaped like the text
            text += f"\n[attachment: {a.get('name')} ({a.get('mime')}, {a.get('size') or '?'} bytes)]"
        envelope = Envelope(
            channel=e.key.channel,
            account=e.key.account,
            chat=e.chat,
            chat_type="group" if p.get("chat_type") == "group" else "dm",
            sender=e.sender,
            message_id=e.key.message_id,
            text=text,
            thread=e.thread,
            sender_name=p.get("sender_name"),
            ts=timestamp(float(p.get("ts") or e.received_at)),
            batch=batch,
            batch_index=index if batch else None,
        )
        blocks.append(render(envelope))
        images += [str(url) for url in p.get("images") or []]
    text = "\n".join(blocks)
    if first:
        text = f"{AGENT_NOTE}\n\n{text}"
    content: str | list[dict[str, Any]] = text
    if images:
        content = [{"type": "text", "text": text}, *({"type": "image", "url": url} for url in images)]
    entry = entries[0]
    return {
        "agent": agent,
        "conversation": conversation,
        "input": content,
        "idempotency_key": entry.idempotency_key,
        "source": {
            "kind": "channel",
            "channel": entry.key.channel,
            "account": entry.key.account,
            "chat": entry.chat,
            "thread": entry.thread,
            "sender": entry.sender,
            "messages": [e.key.message_id for e in entries],
        },
        "client_tools": [TOOL_SPEC],
    }


def clean(text: str) -> str:
    """`text` without lone surrogates (valid JSON can carry them; SQLite and UTF-8 cannot)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _payload(msg: InboundMessage) -> dict[str, Any]:
    """What the ledger keeps of a message: enough to submit it again after a crash, images included
    (as data URLs, each at most 5 MiB; a larger one is named like any other file)."""
    images = [
        f"data:{a.mime};base64,{base64.b64encode(a.data).decode()}"
        for a in msg.attachments
        if a.kind == "image" and a.data is not None and len(a.data) <= IMAGE_MAX_BYTES and a.mime.startswith("image/")
    ]
    return {
        "images": images,
        "text": clean(msg.text),
        "chat_type": msg.chat_type,
        "sender_name": clean(msg.sender_name) if msg.sender_name is not None else None,
        "mentions_bot": msg.mentions_bot,
        "reply_to": msg.reply_to,
        "sender_is_bot": msg.sender_is_bot,
        "ts": msg.ts,
        "attachments": [
            {"kind": a.kind, "name": clean(a.name), "mime": clean(a.mime), "size": a.size}
            for a in msg.attachments
            if not (a.kind == "image" and a.data is not None and len(a.data) <= IMAGE_MAX_BYTES)
        ],
    }
