"""Runs the `message_channel` client tool for the turns this gateway submitted (see gateway/tool.py
for the tool's description and its argument rules)."""

from __future__ import annotations

import logging
import math
from typing import Any

from appserver.client import ProtocolError
from gateway.delivery import DeliveryFailed, Outbox, Outboxes, ReplySink
from gateway.ledger import Ledger
from gateway.link import ServerLink
from gateway.ratelimit import REACTION
from gateway.replies import Replies, TurnContext
from gateway.routing import Router
from gateway.split import DELIVER_MAX_CHARS, cap_text
from gateway.tool import NAME as TOOL_NAME
from gateway.tool import ToolRefusal, parse_call, target_name
from plugins.contract import Adapter, Target

log = logging.getLogger("gateway.tool")


class RateLimited(ToolRefusal):
    """The platform holds this kind of call back for a while: told to the model, not a failure of
    the channel (`channels status` counts none)."""


class MessageChannel:
    def __init__(self, ledger: Ledger, router: Router, link: ServerLink, outboxes: Outboxes, replies: Replies) -> None:
        self.ledger = ledger
        self.router = router
        self.link = link
        self.outboxes = outboxes
        self.replies = replies

    async def on_call(self, frame: dict[str, Any]) -> None:
        call_id = str(frame.get("call_id"))
        ctx = await self.replies.context(str(frame.get("turn_id")))
        if frame.get("name") != TOOL_NAME or ctx is None:
            await self.answer(call_id, f"{frame.get('name')} is not available here", True)
            return
        if not self.replies.admits(ctx):  # queued, and its sender was revoked meanwhile: being cancelled
            await self.answer(call_id, "not sent: the person who sent this message may no longer use the bot", True)
            return
        async with ctx.sends.lock:
            await self.run(ctx, call_id, frame)

    async def run(self, ctx: TurnContext, call_id: str, frame: dict[str, Any]) -> None:
        spec = ctx.runner.spec
        action = "call"
        try:
            call = parse_call(
                str(frame.get("arguments") or "{}"),
                channel=spec.channel,
                account=spec.name,
                here=ctx.here,
                reply_to=ctx.reply_to,
            )
            action = call.action
            outbox = self.outboxes.of(ctx.runner)
            where = target_name(spec.channel, spec.name, call.target)
            if call.action in ("send", "reply"):
                if ctx.sends.last == (where, call.text):
                    raise ToolRefusal("not sent: this is an exact repeat of your previous message in this turn")
                if not await self.allowed(ctx, outbox.adapter, call.target):
                    raise ToolRefusal(f"not sent: {where} is not a chat this account has talked to or routes")
                ids = await ReplySink(outbox, call.target, stream=False).finish(cap_text(call.text))
                ctx.sends.last = (where, call.text)
                ctx.sends.sent.update((i, call.target) for i in ids)
                result = f"sent to {where}; message id {', '.join(ids)}"
                if len(call.text) > DELIVER_MAX_CHARS:
                    result += (
                        f" (only the first {DELIVER_MAX_CHARS:,} of its {len(call.text):,} characters: a send is cut"
                        " there, with a note saying so)"
                    )
            elif call.action == "edit":
                where_sent = ctx.sends.sent.get(str(call.message_id))
                if where_sent is None:
                    raise ToolRefusal("edit only messages you sent with this tool in this turn")
                if not outbox.can_edit:
                    raise ToolRefusal("this channel cannot edit messages")
                await outbox.edit(where_sent, str(call.message_id), call.text)
                result = f"edited message {call.message_id}"
            else:
                await self.react(outbox, call.target, str(call.message_id), str(call.emoji))
                result = f"reacted {call.emoji} to message {call.message_id}"
        except DeliveryFailed as exc:  # the platform refused: counted and shown in `channels status` too
            self.replies.send_failed(ctx.runner, f"message_channel {action} failed: {exc}")
            await self.answer(call_id, str(exc), True)
            return
        except (ToolRefusal, RuntimeError) as exc:
            await self.answer(call_id, str(exc), True)
            return
        await self.answer(call_id, result, False)

    @staticmethod
    async def react(outbox: Outbox, target: Target, message_id: str, emoji: str) -> None:
        """A reaction the model asked for: one attempt, as the gateway's own 👀 (`best_effort`), so a
        platform's "wait" answer (up to 300 s) fails the call at once instead of holding the turn,
        and with it the chat's next message, while the limiter keeps sends and edits going. A rate
        limit is told as one, with how long reactions there are held back, so the model can retry."""
        try:
            await outbox.react(target, message_id, emoji, best_effort=True)
        except DeliveryFailed as exc:
            wait = outbox.limiter.blocked_for(target.chat, REACTION)
            if wait > 0:
                raise RateLimited(f"not reacted: rate limited, retry after {math.ceil(wait)} s") from exc
            raise DeliveryFailed(f"not reacted: {exc}") from exc

    async def allowed(self, ctx: TurnContext, adapter: Adapter, target: Target) -> bool:
        """Whether the model may send to `target`: this turn's own chat and thread, or a reachable chat
        and, when a thread is named, one the adapter confirms is inside that chat (a Discord thread is
        a channel of its own: unchecked, `chat:<any channel id>` reached channels and DMs that never
        talked to the bot). An adapter without `thread_in_chat` keeps threads inside their chat itself
        (Telegram's message_thread_id, Slack's thread_ts are addressed within `chat`)."""
        here = ctx.here
        if (target.chat, target.thread) == (here.chat, here.thread):
            return True
        spec = ctx.runner.spec
        if target.chat != here.chat and not self.reachable(spec.channel, spec.name, target.chat):
            return False
        if target.thread is None:
            return True
        check = getattr(adapter, "thread_in_chat", None)
        return check is None or bool(await check(target.chat, target.thread))

    def reachable(self, channel: str, account: str, chat: str) -> bool:
        """A chat the account can send to on the model's behalf: one access let a message in from,
        or one an operator routed (so the agent cannot message arbitrary chats it was never part of).
        A chat whose every message was refused (a stranger under `allowlist`, silent or not) is not:
        writing to the bot once must not make a chat somewhere a prompt-injected agent can post."""
        if self.ledger.last_admitted(channel, account, chat) is not None:
            return True
        return any(r.key.chat == chat for r in self.router.routes(channel, account))

    async def answer(self, call_id: str, output: str, is_error: bool) -> None:
        try:
            await self.link.tool_result(call_id, output, is_error)
        except (ProtocolError, TimeoutError) as exc:
            log.warning("tool result for %s not taken: %s", call_id, exc)
