"""gateway/ratelimit.py: per-chat token buckets on an injected clock; `retry_after` is honoured."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.ratelimit import ChatRateLimiter, RetryAfter


class FakeClock:
    """Time that moves only when someone sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def limiter(clock: FakeClock, rate: float = 1.0, burst: int = 2) -> ChatRateLimiter:
    return ChatRateLimiter(rate, burst, clock=clock, sleep=clock.sleep)


async def test_burst_then_steady_rate() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=2.0, burst=3)
    waits = [await rl.acquire("chat") for _ in range(6)]
    assert waits[:3] == [0.0, 0.0, 0.0]  # the burst
    assert waits[3:] == pytest.approx([0.5, 0.5, 0.5])  # then 2 per second
    assert clock.now == pytest.approx(1001.5)


async def test_chats_do_not_share_a_bucket() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=1)
    assert await rl.acquire("a") == 0.0
    assert await rl.acquire("b") == 0.0
    assert await rl.acquire("a") == pytest.approx(1.0)


async def test_idle_time_refills_up_to_the_burst_only() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=2)
    await rl.acquire("c")
    await rl.acquire("c")
    clock.now += 60
    waits = [await rl.acquire("c") for _ in range(3)]
    assert waits == pytest.approx([0.0, 0.0, 1.0])


async def test_retry_after_blocks_the_chat_for_at_least_that_long() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=10.0, burst=5)
    await rl.acquire("c")
    rl.retry_after("c", 2.0)
    start = clock.now
    waited = await rl.acquire("c")
    assert waited >= 2.0 and clock.now - start >= 2.0
    assert waited == pytest.approx(2.0)  # and not much more
    assert await rl.acquire("other") == 0.0  # other chats are not blocked
    # A shorter retry_after never shortens a longer block.
    rl.retry_after("c", 5.0)
    rl.retry_after("c", 1.0)
    assert await rl.acquire("c") == pytest.approx(5.0)


async def test_call_retries_after_a_429_and_loses_nothing() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=3)
    sent: list[float] = []
    answers: Iterator[RetryAfter | str] = iter([RetryAfter(2.0), "m-1"])

    async def send() -> str:
        sent.append(clock.now)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert await rl.call("c", send) == "m-1"
    assert len(sent) == 2 and sent[1] - sent[0] >= 2.0


async def test_call_gives_up_after_its_attempts() -> None:
    clock = FakeClock()
    rl = limiter(clock)
    calls = 0

    async def always_limited() -> None:
        nonlocal calls
        calls += 1
        raise RetryAfter(1.5)

    with pytest.raises(RetryAfter):
        await rl.call("c", always_limited, attempts=3)
    assert calls == 3
    assert clock.now - 1000.0 >= 3.0  # two waits of 1.5 s between the three tries


async def test_waiters_of_one_chat_go_in_arrival_order() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=1)
    order: list[int] = []

    async def send(n: int) -> None:
        await rl.acquire("c")
        order.append(n)

    await asyncio.gather(*(send(n) for n in range(6)))
    assert order == list(range(6))
    assert clock.now == pytest.approx(1005.0)


async def test_forget_idle_drops_only_full_unblocked_buckets() -> None:
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=2)
    await rl.acquire("busy")
    await rl.acquire("busy")
    await rl.acquire("idle")
    rl.retry_after("blocked", 30)
    clock.now += 1.0
    assert rl.forget_idle() == 1  # "idle" has refilled; "busy" has not, "blocked" is blocked
    clock.now += 60
    assert rl.forget_idle() == 2


async def test_buckets_of_idle_chats_are_dropped_as_new_chats_come() -> None:
    """Nobody has to call `forget_idle`: a gateway that meets 1,000 new chats a day for ten days
    keeps the buckets of about the latest day's chats, not 10,000; a chat the platform blocked keeps
    its block."""
    clock = FakeClock()
    rl = limiter(clock, rate=1.0, burst=2)
    rl.retry_after("blocked", 3600)
    for day in range(10):
        for i in range(1000):
            await rl.acquire(f"chat-{day}-{i}")  # each leaves its bucket below full: not idle yet
        assert len(rl) <= 2 * 1000 + ChatRateLimiter.SWEEP_MIN
        clock.now += 10  # the day's chats refill: idle
    assert len(rl) <= 2 * 1000 + ChatRateLimiter.SWEEP_MIN
    assert await rl.acquire("blocked") >= 3600 - 100


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ChatRateLimiter(0, 1)
    with pytest.raises(ValueError):
        ChatRateLimiter(1, 0)
