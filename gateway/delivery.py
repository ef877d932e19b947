"""Replies back to chats: what a snapshot shows, the per-chat outbox, and the per-turn sink.

A turn's snapshots become the text a person sees (`visible_text`: reasoning never, tool use as one
compact status line while it runs, a failure or cancellation as one short line). The `Outbox` is
the one way out to a chat: every send and edit passes the per-chat rate limiter, honours the
platform's `retry_after`, retries transient errors with backoff and raises `DeliveryFailed` with
the reason in the end. A `ReplySink` grows one turn's reply in place where the platform can edit
(first send at the first visible text, then about one edit per `interval`, no-op edits skipped,
the last edit exact), splitting at the platform's limit without breaking code fences.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.ratelimit import ChatRateLimiter, RetryAfter
from gateway.split import MIN_LIMIT, split_message
from plugins.contract import Adapter, DeliveryError, Target

if TYPE_CHECKING:
    from gateway.accounts import AccountRunner

log = logging.getLogger("gateway.delivery")
T = TypeVar("T")

TRANSIENT_ATTEMPTS = 5
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
NO_REPLY = "(no reply)"
MAX_RETRY_AFTER_S = 300.0  # a platform's retry_after beyond this (or infinite) is read as this


class DeliveryFailed(Exception):
    """A reply or send that could not be delivered, with the platform's reason."""


def reply_body(snapshot: dict[str, Any]) -> str:
    """The text blocks of a snapshot (never reasoning), as one text."""
    blocks = snapshot.get("blocks") or []
    return "\n\n".join(str(b.get("text") or "").strip() for b in blocks if b.get("type") == "text" and b.get("text"))


def visible_text(snapshot: dict[str, Any], *, tool_status: bool = True) -> str:
    """The reply as a chat shows it: text blocks (never reasoning), plus a status line while a
    tool runs (when `tool_status`) and one short line when the turn failed or was cancelled."""
    blocks = snapshot.get("blocks") or []
    text = reply_body(snapshot)
    status = snapshot.get("status")
    lines = [text] if text else []
    if status in ("running", "awaiting") and tool_status:
        running = [b for b in blocks if b.get("type") == "tool_call" and b.get("status") not in ("completed", "failed")]
        if running:
            lines.append(f"⚙ {running[-1].get('name') or 'tool'}…")
    if status == "awaiting":
        waiting = [str(p.get("name")) for p in snapshot.get("pending") or [] if p.get("kind") == "approval"]
        if waiting:
            lines.append(f"⏸ waiting for approval of {', '.join(waiting)}")
    elif status == "failed":
        error = snapshot.get("error") or {}
        if error.get("kind") in ("interrupted", "unknown"):
            lines.append("⚠ The reply was interrupted (the server stopped while it was being written).")
        else:
            lines.append(f"⚠ The turn failed: {_short(str(error.get('message') or error.get('kind') or 'error'))}")
    elif status == "cancelled":
        lines.append("⏹ Cancelled.")
    return "\n\n".join(lines)


def _short(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Outbox:
    """All traffic to one account's chats: rate limited per chat, retried, never silently dropped."""

    def __init__(self, adapter: Adapter, limiter: ChatRateLimiter, sleep: Callable[[float], Awaitable[None]]) -> None:
        self.adapter = adapter
        self.limiter = limiter
        self._sleep = sleep

    def format(self, text: str) -> str:
        fmt = getattr(self.adapter, "format", None)
        return str(fmt(text)) if callable(fmt) else text

    @property
    def can_edit(self) -> bool:
        return bool(self.adapter.limits.can_edit and callable(getattr(self.adapter, "edit", None)))

    async def send(self, target: Target, text: str) -> list[str]:
        formatted = self.format(text)
        return await self._call(target.chat, lambda: self.adapter.send(target, formatted))

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        formatted = self.format(text)
        edit = getattr(self.adapter, "edit")  # noqa: B009 - optional method of the contract
        await self._call(target.chat, lambda: edit(target, message_id, formatted))

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        react = getattr(self.adapter, "react", None)
        if not callable(react):
            raise DeliveryFailed("this channel cannot react to messages")
        await self._call(target.chat, lambda: react(target, message_id, emoji))

    async def _call(self, chat: str, op: Callable[[], Awaitable[T]]) -> T:
        async def attempt() -> T:
            try:
                return await op()
            except DeliveryError as exc:
                if exc.retry_after is not None and not exc.permanent:
                    wait = exc.retry_after if math.isfinite(exc.retry_after) else MAX_RETRY_AFTER_S
                    raise RetryAfter(min(max(wait, 0.0), MAX_RETRY_AFTER_S)) from exc
                raise
            except RetryAfter:
                raise
            except Exception as exc:  # noqa: BLE001 - a plugin may fail any way: transient, never lost
                raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc

        for n in range(TRANSIENT_ATTEMPTS):
            try:
                return await self.limiter.call(chat, attempt)
            except RetryAfter as exc:
                raise DeliveryFailed(f"rate limited: the platform kept asking to wait ({exc.seconds:g} s)") from exc
            except DeliveryError as exc:
                if exc.permanent or n == TRANSIENT_ATTEMPTS - 1:
                    raise DeliveryFailed(exc.reason) from exc
                log.warning("send to %s failed (%s); retrying in %g s", chat, exc.reason, BACKOFF_S[n])
                await self._sleep(BACKOFF_S[n])
        raise AssertionError("unreachable")


@dataclass
class _Part:
    message_id: str
    text: str | None  # None: sent before a restart, content unknown (always re-edited)


@dataclass
class ReplySink:
    """One turn's reply in one chat. `show(text)` while it runs, `finish(text)` once at the end;
    both return the platform ids of the messages the reply occupies so far."""

    outbox: Outbox
    target: Target
    stream: bool = True
    interval: float = 1.0
    parts: list[_Part] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    # Called with every id the reply occupies as soon as a new part was sent (no await in between), so
    # a restart continues in those messages instead of sending them again (the ledger notes them).
    # The one exception: a crash while a send is in flight (performed by the platform, its answer not
    # read yet) sends that part again after the restart; a platform without idempotent sends
    # (Telegram's sendMessage) cannot be asked whether it arrived. docs/channels.md, "Exactly once".
    on_sent: Callable[[list[str]], None] | None = None
    key: str | None = None  # the reply's identity; each part is sent with `key:index` (Target.key)
    _last: float = -1e9

    @classmethod
    def resumed(cls, outbox: Outbox, target: Target, remote_ids: tuple[str, ...], **kw: Any) -> ReplySink:
        return cls(outbox, target, parts=[_Part(i, None) for i in remote_ids], **kw)

    @property
    def ids(self) -> list[str]:
        return [p.message_id for p in self.parts]

    def due(self) -> float:
        """Seconds until the next in-place update may go (the sink's own ~1/s pace)."""
        return max(self._last + self.interval - self.clock(), 0.0)

    def final_due(self) -> float:
        """Seconds until the final update may go: the end of a turn waits at most half the pace,
        so a reply is exact quickly and edits stay at about one per second."""
        return max(self._last + self.interval / 2 - self.clock(), 0.0)

    async def show(self, text: str) -> list[str]:
        if not (self.stream and self.outbox.can_edit) or not text.strip():
            return self.ids
        await self._apply(text)
        return self.ids

    async def finish(self, text: str) -> list[str]:
        if not text.strip():
            text = NO_REPLY if self.parts else ""
        if text:
            await self._apply(text, final=True)
        return self.ids

    async def _apply(self, text: str, *, final: bool = False) -> None:
        self._last = self.clock()
        chunks = self._chunks(text)
        if not self.outbox.can_edit:
            chunks = chunks[len(self.parts) :] if final else []
        for i, chunk in enumerate(chunks):
            if self.outbox.can_edit and i < len(self.parts):
                part = self.parts[i]
                if part.text != chunk:
                    try:
                        await self.outbox.edit(self.target, part.message_id, chunk)
                    except DeliveryFailed:
                        if not final:
                            raise
                        # The platform will not edit this message (too old, deleted): the final text
                        # goes out as a new message rather than leave the chat with a partial reply.
                        ids = await self.outbox.send(self.target, chunk)
                        part.message_id = ids[0] if ids else part.message_id
                        self._sent()
                    part.text = chunk
                continue
            where = self.target if self.key is None else replace(self.target, key=f"{self.key}:{len(self.parts)}")
            for message_id in await self.outbox.send(where, chunk):
                self.parts.append(_Part(message_id, chunk))
            self._sent()
        if self.outbox.can_edit and len(self.parts) > len(chunks) and final:
            # The reply shrank (a status line went away): blank the surplus rather than leave stale text.
            for part in self.parts[len(chunks) :]:
                if part.text != "…":
                    await self.outbox.edit(self.target, part.message_id, "…")
                    part.text = "…"

    def _sent(self) -> None:
        if self.on_sent is not None:
            self.on_sent(self.ids)

    def _chunks(self, text: str) -> list[str]:
        """The parts of `text`. `max_length` counts after `format` (markup and escapes can grow a
        part), so a part whose formatted form is too long is split finer."""
        limit = self.outbox.adapter.limits.max_length
        measure = getattr(self.outbox.adapter, "measure", None) or len  # e.g. Telegram counts UTF-16 units
        out: list[str] = []
        for chunk in split_message(text, limit):
            room, parts = limit, [chunk]
            while room > MIN_LIMIT and any(measure(self.outbox.format(p)) > limit for p in parts):
                room = max(MIN_LIMIT, room * 4 // 5)
                parts = split_message(chunk, room)
            out.extend(parts)
        return out


class ChatOrder:
    """Replies to one chat go out in the order their messages arrived: each sink waits for the
    previous sink of its chat to finish before its first send."""

    def __init__(self) -> None:
        self._tail: dict[str, asyncio.Event] = {}

    def ticket(self, chat_key: str) -> tuple[asyncio.Event | None, asyncio.Event]:
        before = self._tail.get(chat_key)
        mine = asyncio.Event()
        self._tail[chat_key] = mine
        return before, mine

    def release(self, chat_key: str, mine: asyncio.Event) -> None:
        mine.set()
        if self._tail.get(chat_key) is mine:
            del self._tail[chat_key]


class Outboxes:
    """One `Outbox` per account, each with its per-chat limiter for the gateway's lifetime."""

    def __init__(self) -> None:
        self._limiters: dict[str, ChatRateLimiter] = {}

    def of(self, runner: AccountRunner) -> Outbox:
        adapter = runner.adapter
        if adapter is None or not adapter.is_running:
            raise RuntimeError(f"{runner.spec.ref} is not running")
        limiter = self._limiters.get(runner.spec.ref)
        if limiter is None:
            rate = float(runner.settings.get("chat_rate") or adapter.limits.edits_per_second)
            limiter = self._limiters[runner.spec.ref] = ChatRateLimiter(rate=rate, burst=max(3, int(rate)))
        return Outbox(adapter, limiter, asyncio.sleep)

    async def say(self, runner: AccountRunner, target: Target, text: str) -> list[str]:
        """A short line from the gateway itself (a notice, a command's answer); never raises."""
        try:
            ids = await self.of(runner).send(target, text)
            runner.live.last_outbound = time.time()
            return ids
        except (DeliveryFailed, RuntimeError) as exc:
            log.warning("%s: could not tell %s: %s", runner.spec.ref, target.chat, exc)
            return []
