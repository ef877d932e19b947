"""One token bucket per chat that every call to that chat passes through.

Platforms limit per chat (Telegram about one message a second in a chat, Discord 5 per 5 s per
channel) and answer excess with a `retry_after`. Waiting here before we are told is cheaper than
being told; when we are told anyway, that kind of call is blocked in the chat for that long and the
call retried, so a reply is delayed, never dropped. Waiters of one chat are served in arrival order
(an asyncio lock is FIFO), which keeps a reply's parts and edits in order.

A "wait" answer holds back only the kind of call that got it (`MESSAGE`: sends and edits; `REACTION`;
`LOOKUP`: history lookups): Slack limits per API method, Discord per route, so a rate limit on the
cosmetic 👀 reaction froze every reply of the chat for up to 300 s while the platform never asked to
stop posting. A side kind waits out its own block outside the chat's queue, so the chat's messages
go on meanwhile. Where the platform's answer says the limit is wider (`RetryAfter.scope`: the whole
chat, or the whole account: Discord's global limit), every kind of call in the chat, or in every
chat of the account, waits. Clock and sleep are injectable for tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

T = TypeVar("T")
# The kinds of call to a chat, each held back on its own by a platform's "wait" answer.
MESSAGE = "message"  # sends and edits (replies, prompts, notices): the chat's queue, kept in order
REACTION = "reaction"  # a reaction on a message
LOOKUP = "lookup"  # a history lookup (was a send performed, did an edit land)
_ANY = "*"  # a block of every kind in the chat
Scope = Literal["call", "chat", "account"]  # how far a "wait" answer reaches (plugins.contract RetryScope)


class RetryAfter(Exception):
    """The platform said to wait `seconds` before trying again. `kind`: the kind of call that got
    the answer (None: the call being made); `scope`: "call" holds back that kind in the chat,
    "chat" every call to the chat, "account" every call of the account."""

    def __init__(self, seconds: float, kind: str | None = None, scope: Scope = "call") -> None:
        super().__init__(f"platform asked to retry after {seconds} s")
        self.seconds = seconds
        self.kind = kind
        self.scope = scope


@dataclass
class _Bucket:
    tokens: float
    updated: float
    blocked: dict[str, float] = field(default_factory=dict)  # kind (or _ANY) -> blocked until
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ChatRateLimiter:
    """`rate` operations per second per chat, with bursts of up to `burst`.

    A long-running gateway sees many chats: each time the number of buckets doubles, the idle ones
    are dropped (`forget_idle`), so memory follows the chats active lately, not every chat ever."""

    SWEEP_MIN = 64  # buckets kept before the first sweep

    def __init__(
        self,
        rate: float = 1.0,
        burst: int = 3,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._buckets: dict[str, _Bucket] = {}
        self._blocked_all = 0.0  # every chat waits until then (a platform's global limit)
        self._sweep_at = self.SWEEP_MIN  # sweep when a new chat would take the count past this

    def __len__(self) -> int:
        """How many chats hold a bucket now."""
        return len(self._buckets)

    async def acquire(self, chat: str, kind: str = MESSAGE) -> float:
        """Wait for this chat's turn for a call of `kind` and take one token; returns the seconds
        waited. A side kind (not `MESSAGE`) waits out its own block before it joins the chat's queue."""
        bucket = self._bucket(chat)
        waited = 0.0
        while True:
            if kind != MESSAGE:
                waited += await self.wait_out(chat, kind)
            async with bucket.lock:
                while True:
                    now = self._clock()
                    self._refill(bucket, now)
                    if kind != MESSAGE and bucket.blocked.get(kind, 0.0) > now:
                        break  # blocked meanwhile: waited out again, outside the queue
                    delay = max(self._until(bucket, kind) - now, 0.0)
                    if delay == 0.0 and bucket.tokens >= 1.0:
                        bucket.tokens -= 1.0
                        return waited
                    if delay == 0.0:
                        delay = (1.0 - bucket.tokens) / self.rate
                    await self._sleep(delay)
                    waited += delay

    async def wait_out(self, chat: str, kind: str) -> float:
        """Sleep until calls of `kind` to `chat` are no longer blocked by a wait of their own kind
        (without joining the chat's queue); returns the seconds slept."""
        bucket = self._bucket(chat)
        waited = 0.0
        while (delay := bucket.blocked.get(kind, 0.0) - self._clock()) > 0:
            await self._sleep(delay)
            waited += delay
        return waited

    def blocked_for(self, chat: str, kind: str = MESSAGE) -> float:
        """Seconds from now until a call of `kind` to `chat` is no longer held back by a wait."""
        bucket = self._buckets.get(chat)
        until = self._blocked_all if bucket is None else self._until(bucket, kind)
        return max(until - self._clock(), 0.0)

    def retry_after(self, chat: str, seconds: float, kind: str = MESSAGE, scope: Scope = "call") -> None:
        """The platform said wait: no call of `kind` goes to this chat for `seconds` from now (no call
        at all to the chat for scope "chat", to any chat for "account")."""
        bucket = self._bucket(chat)
        now = self._clock()
        self._refill(bucket, now)
        until = now + max(seconds, 0.0)
        if scope == "account":
            self._blocked_all = max(self._blocked_all, until)
        key = kind if scope == "call" else _ANY
        bucket.blocked[key] = max(bucket.blocked.get(key, 0.0), until)
        if key in (MESSAGE, _ANY):
            # One send may go when the block ends; the bucket refills only from then on.
            bucket.tokens = 1.0
            bucket.updated = max(bucket.updated, self._until(bucket, MESSAGE))

    async def call(self, chat: str, op: Callable[[], Awaitable[T]], attempts: int = 5, kind: str = MESSAGE) -> T:
        """Run `op` (a call of `kind`) under the limiter, honouring `RetryAfter` up to `attempts`
        times; the last `RetryAfter` propagates (the chat stays blocked for its wait). A count alone
        is no time budget (five `Retry-After: 0` answers pass in a blink): the outbox
        (`gateway/delivery.py` `Outbox._call`) calls with `attempts=1` and keeps its own budget."""
        for attempt in range(1, attempts + 1):
            await self.acquire(chat, kind)
            try:
                return await op()
            except RetryAfter as exc:
                self.retry_after(chat, exc.seconds, exc.kind or kind, exc.scope)
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    def forget_idle(self) -> int:
        """Drop buckets that are full and unused: such a bucket is the same as a new one, so
        forgetting it changes nothing for its chat (a long-running gateway sees many chats)."""
        now = self._clock()
        idle = []
        for chat, bucket in self._buckets.items():
            self._refill(bucket, now)
            blocked = any(until > now for until in bucket.blocked.values())
            if bucket.tokens >= self.burst and not bucket.lock.locked() and not blocked:
                idle.append(chat)
        for chat in idle:
            del self._buckets[chat]
        return len(idle)

    def _bucket(self, chat: str) -> _Bucket:
        bucket = self._buckets.get(chat)
        if bucket is None:
            if len(self._buckets) >= self._sweep_at:  # amortised: O(1) per new chat
                self.forget_idle()
                self._sweep_at = max(self.SWEEP_MIN, 2 * len(self._buckets))
            bucket = self._buckets[chat] = _Bucket(tokens=float(self.burst), updated=self._clock())
        return bucket

    def _until(self, bucket: _Bucket, kind: str) -> float:
        """Until when a call of `kind` waits: its own kind's block, the chat's, the account's."""
        return max(bucket.blocked.get(kind, 0.0), bucket.blocked.get(_ANY, 0.0), self._blocked_all)

    def _refill(self, bucket: _Bucket, now: float) -> None:
        if now > bucket.updated:
            gained = (now - bucket.updated) * self.rate
            bucket.tokens = min(float(self.burst), bucket.tokens + gained)
            bucket.updated = now
