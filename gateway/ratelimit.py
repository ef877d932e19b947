"""One token bucket per chat that every send and edit to that chat passes through.

Platforms limit per chat (Telegram about one message a second in a chat, Discord 5 per 5 s per
channel) and answer excess with a `retry_after`. Waiting here before we are told is cheaper than
being told; when we are told anyway, the chat is blocked for that long and the call retried, so a
reply is delayed, never dropped. Waiters of one chat are served in arrival order (an asyncio lock is
FIFO), which keeps a reply's parts and edits in order. Clock and sleep are injectable for tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class RetryAfter(Exception):
    """Raised by an adapter when the platform said to wait `seconds` before trying again."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"platform asked to retry after {seconds} s")
        self.seconds = seconds


@dataclass
class _Bucket:
    tokens: float
    updated: float
    blocked_until: float = 0.0
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
        self._sweep_at = self.SWEEP_MIN  # sweep when a new chat would take the count past this

    def __len__(self) -> int:
        """How many chats hold a bucket now."""
        return len(self._buckets)

    async def acquire(self, chat: str) -> float:
        """Wait for this chat's turn and take one token; returns the seconds waited."""
        bucket = self._bucket(chat)
        waited = 0.0
        async with bucket.lock:
            while True:
                now = self._clock()
                self._refill(bucket, now)
                delay = max(bucket.blocked_until - now, 0.0)
                if delay == 0.0 and bucket.tokens >= 1.0:
                    bucket.tokens -= 1.0
                    return waited
                if delay == 0.0:
                    delay = (1.0 - bucket.tokens) / self.rate
                await self._sleep(delay)
                waited += delay

    def retry_after(self, chat: str, seconds: float) -> None:
        """The platform said wait: nothing goes to this chat for `seconds` from now."""
        bucket = self._bucket(chat)
        now = self._clock()
        self._refill(bucket, now)
        bucket.blocked_until = max(bucket.blocked_until, now + max(seconds, 0.0))
        # One send may go when the block ends; the bucket refills only from then on.
        bucket.tokens = 1.0
        bucket.updated = bucket.blocked_until

    async def call(self, chat: str, op: Callable[[], Awaitable[T]], attempts: int = 5) -> T:
        """Run `op` (a send or an edit) under the limiter, honouring `RetryAfter` up to `attempts`
        times; the last `RetryAfter` propagates (the chat stays blocked for its wait). A count alone
        is no time budget (five `Retry-After: 0` answers pass in a blink): the outbox
        (`gateway/delivery.py` `Outbox._call`) calls with `attempts=1` and keeps its own budget."""
        for attempt in range(1, attempts + 1):
            await self.acquire(chat)
            try:
                return await op()
            except RetryAfter as exc:
                self.retry_after(chat, exc.seconds)
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
            if bucket.tokens >= self.burst and not bucket.lock.locked() and bucket.blocked_until <= now:
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

    def _refill(self, bucket: _Bucket, now: float) -> None:
        if now > bucket.updated:
            gained = (now - bucket.updated) * self.rate
            bucket.tokens = min(float(self.burst), bucket.tokens + gained)
            bucket.updated = now
