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
from gateway.delivery import ChatOrder, DeliveryFailed, Outbox, ReplySink, reply_body, visible_text
from gateway.envelope import AGENT_NOTE, Envelope, render, timestamp
from gateway.intake import Intake
from gateway.ledger import Entry, Ledger, Receipt, UpdateKey
from gateway.link import ServerLink
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
FIRST_SEND_GRACE_S = 0.3

EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class _TurnContext:
    runner: AccountRunner
    key: UpdateKey
    here: Target
    reply_to: str
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
        self._dirty = True
        link.on_tool_call(self._tool_call)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, ready_timeout: float = 25.0) -> None:
        """Start every account (each reaches running or error), then resume the ledger."""
        self.board.mark_unconfigured({(r.spec.channel, r.spec.name) for r in self.runners.values()})
        for runner in self.runners.values():
            self._spawn(runner.run())
        self._spawn(self._flush_status_forever())
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
        key = UpdateKey(msg.channel, msg.account, msg.message_id)
        entry, created = await self.intake.record(Receipt(key, msg.chat, msg.sender, msg.thread, _payload(msg)))
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
        """One chat's messages, in arrival order; the worker ends when its queue runs dry."""
        while True:
            try:
                key = queue.get_nowait()
            except asyncio.QueueEmpty:
                del self._queues[chat_key]
                del self._workers[chat_key]
                return
            try:
                await self._process(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad message must not stop its chat
                log.exception("processing %s failed", key)

    async def _process(self, key: UpdateKey) -> None:
        entry = self.ledger.get(key)
        runner = self.runners.get(f"{key.channel}:{key.account}")
        if entry is None or runner is None:
            return
        if entry.state == "received":
            entry = self._decide(entry, runner)
        if entry.state == "allowed":
            await self._submit(entry, runner)

    def _decide(self, entry: Entry, runner: AccountRunner) -> Entry:
        """Access (issue 16 widens this): other bots' and the bot's own messages never get through."""
        if entry.payload.get("sender_is_bot"):
            return self.ledger.decide(entry.key, "deny", "message from a bot")
        return self.ledger.decide(entry.key, "allow", "open")

    async def _submit(self, entry: Entry, runner: AccountRunner) -> None:
        route_key = RouteKey.of(entry.key.channel, entry.key.account, entry.chat, entry.thread)
        resolution = self.router.resolve(route_key, runner.settings.get("default_agent"))
        if resolution is None:
            self.ledger.mark_failed(entry.key, "no route for this chat and no default_agent")
            runner.live.failures += 1
            log.warning(
                "%s: no route for %s and no default_agent; add one with `appserver channels route add`",
                entry.key,
                route_key,
            )
            await self._notice(runner, entry, "This chat is not connected to an agent yet.")
            return
        attempt = 0
        while True:
            try:
                conversation = resolution.conversation
                if conversation is None:
                    conversation = await self.link.create_conversation(
                        resolution.agent, f"{route_key}", {"channel_route": str(route_key)}
                    )
                    self.router.bind(route_key, conversation)
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                ack = await self.link.submit(self._submit_frame(entry, resolution.agent, conversation))
                break
            except ProtocolError as exc:
                if exc.code == "conversation_not_found" and resolution.conversation is not None:
                    self.router.forget(route_key)  # deleted on the server: start a fresh one
                    resolution = self.router.resolve(route_key, runner.settings.get("default_agent")) or resolution
                    resolution = type(resolution)(resolution.key, resolution.agent, None, resolution.source)
                    continue
                if exc.code in PERMANENT_CODES:
                    self.ledger.mark_failed(entry.key, f"the server refused the message: {exc.code}: {exc}")
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
        entry = self.ledger.mark_submitted(entry.key, str(ack["turn_id"]), str(ack["conversation_id"]))
        runner.live.turns += 1
        self._dirty = True
        self._follow(entry)

    def _submit_frame(self, entry: Entry, agent: str, conversation: str) -> dict[str, Any]:
        p = entry.payload
        envelope = Envelope(
            channel=entry.key.channel,
            account=entry.key.account,
            chat=entry.chat,
            chat_type="group" if p.get("chat_type") == "group" else "dm",
            sender=entry.sender,
            message_id=entry.key.message_id,
            text=str(p.get("text") or ""),
            thread=entry.thread,
            sender_name=p.get("sender_name"),
            ts=timestamp(float(p.get("ts") or entry.received_at)),
        )
        text = render(envelope)
        for a in p.get("attachments") or []:
            text += f"\n[attachment: {a.get('name')} ({a.get('mime')}, {a.get('size') or '?'} bytes)]"
        images = [str(url) for url in p.get("images") or []]
        content: str | list[dict[str, Any]] = text
        if images:
            content = [{"type": "text", "text": text}, *({"type": "image", "url": url} for url in images)]
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
                "note": AGENT_NOTE,
            },
            "client_tools": [TOOL_SPEC],
        }

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
        if entry.turn_id is None or entry.turn_id in self._followers:
            return
        runner = self.runners.get(f"{entry.key.channel}:{entry.key.account}")
        if runner is None:
            log.error("%s: the account is no longer configured; its reply cannot be delivered", entry.key)
            return
        turn_id = entry.turn_id
        self._turns[turn_id] = _TurnContext(runner, entry.key, Target(entry.chat, entry.thread), entry.key.message_id)
        task = asyncio.ensure_future(self._deliver(entry, runner, turn_id, resumed))
        self._followers[turn_id] = task
        task.add_done_callback(lambda _t: (self._followers.pop(turn_id, None), self._turns.pop(turn_id, None)))

    async def _deliver(self, entry: Entry, runner: AccountRunner, turn_id: str, resumed: bool) -> None:
        target = Target(entry.chat, entry.thread)
        before, mine = self._order.ticket(_chat_key(entry))
        try:
            await runner.ready.wait()
            while runner.adapter is None or not runner.adapter.is_running:
                await asyncio.sleep(0.5)  # the account restarts; the reply waits for it
            outbox = self._outbox(runner)
            stream = bool(runner.settings.get("stream", True))
            tool_status = bool(runner.settings.get("tool_status", True))
            sink = ReplySink.resumed(outbox, target, entry.remote_ids, stream=stream)
            text = entry.reply
            if entry.state == "submitted":
                text = await self._run_sink(entry, sink, turn_id, before, tool_status, resumed)
                entry = self.ledger.mark_finished(entry.key, text)
            if before is not None:
                await before.wait()
            ids = await sink.finish(text or "")
            self.ledger.mark_delivered(entry.key, ids)
            runner.live.replies += 1
            runner.live.last_outbound = time.time()
        except DeliveryFailed as exc:
            log.error("%s: reply not delivered: %s", entry.key, exc)
            self.ledger.mark_failed(entry.key, f"delivery failed: {exc}")
            runner.live.failures += 1
        finally:
            self._dirty = True
            self.link.unfollow(turn_id)
            self._order.release(_chat_key(entry), mine)

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
                self.ledger.note_sent(entry.key, ids, shown)

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
        turn_id = str(frame.get("turn_id"))
        ctx = self._turns.get(turn_id)
        for _ in range(50):  # the call can overtake the submit's ack: give the turn a moment to register
            if ctx is not None:
                break
            await asyncio.sleep(0.1)
            ctx = self._turns.get(turn_id)
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
                ids = await outbox.send(call.target, call.text)
                ctx.sends.last = (where, call.text)
                ctx.sends.sent_ids.update(ids)
                result = f"sent to {where}; message id {', '.join(ids)}"
            elif call.action == "edit":
                if call.message_id not in ctx.sends.sent_ids:
                    raise ToolRefusal("edit only messages you sent with this tool in this turn")
                if not outbox.can_edit:
                    raise ToolRefusal("this channel cannot edit messages")
                await outbox.edit(call.target, str(call.message_id), call.text)
                result = f"edited message {call.message_id}"
            else:
                await outbox.react(call.target, str(call.message_id), str(call.emoji))
                result = f"reacted {call.emoji} to message {call.message_id}"
        except (ToolRefusal, DeliveryFailed, RuntimeError) as exc:
            await self._answer(call_id, str(exc), True)
            return
        await self._answer(call_id, result, False)

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
        "text": msg.text,
        "chat_type": msg.chat_type,
        "sender_name": msg.sender_name,
        "mentions_bot": msg.mentions_bot,
        "reply_to": msg.reply_to,
        "sender_is_bot": msg.sender_is_bot,
        "ts": msg.ts,
        "attachments": [
            {"kind": a.kind, "name": a.name, "mime": a.mime, "size": a.size}
            for a in msg.attachments
            if not (a.kind == "image" and a.data is not None and len(a.data) <= IMAGE_MAX_BYTES)
        ],
    }
