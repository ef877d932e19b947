"""gateway/delivery.py: the transient budget is wall-clock from the first attempt.

A reply target that accepts the request and never answers spends its whole send deadline in every
attempt; the budget used to count only the sleeps between attempts, so such a reply (and its chat's
later replies behind it) was retried for three minutes instead of about one. Time runs on a fake
clock here (the adapter "hangs" by sleeping on it), so nothing takes a minute.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.delivery import BACKOFF_S, TRANSIENT_ATTEMPTS, TRANSIENT_BUDGET_S, DeliveryFailed, Outbox
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import DeliveryError, Limits, Target

HERE = Target("chat1")
DEADLINE_S = 15.0  # the webhook's send deadline


class FakeClock:
    """Time that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)


class HangingTarget:
    """A platform that takes the request and never answers: each send spends the deadline, then
    fails with the outcome unknown. `answers` replace the hang for the first sends; with `hang`
    false, a send after them is answered."""

    dedupes_sends = True  # like the webhook: the part's id is sent along, the receiver dedupes

    def __init__(self, clock: FakeClock, answers: list[BaseException] | None = None, *, hang: bool = True) -> None:
        self.hang = hang
        self.limits = Limits(max_length=4096, can_edit=False)
        self.clock = clock
        self.sends: list[float] = []
        self.answers = list(answers or [])

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    @property
    def is_running(self) -> bool:
        return True

    async def send(self, target: Target, text: str) -> list[str]:
        self.sends.append(self.clock())
        if self.answers:
            raise self.answers.pop(0)
        if not self.hang:
            return ["ok"]
        await self.clock.sleep(DEADLINE_S)
        raise DeliveryError(f"reply_url did not answer within {DEADLINE_S:g} s", uncertain=True)


class HangingLookupTarget(HangingTarget):
    """A platform that cannot dedupe but can be asked (Slack): every resend is preceded by a lookup."""

    dedupes_sends = False

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.events: list[str] = []

    async def send(self, target: Target, text: str) -> list[str]:
        self.events.append("send")
        return await super().send(target, text)

    async def find_sent(self, target: Target, since: float) -> list[str]:
        self.events.append("find")
        return []


def outbox_for(adapter: HangingTarget) -> Outbox:
    clock = adapter.clock
    limiter = ChatRateLimiter(100.0, 100, clock=clock, sleep=clock.sleep)
    return Outbox(adapter, limiter, clock.sleep, wall=clock, clock=clock)


async def test_a_hanging_target_is_given_up_after_about_a_minute() -> None:
    clock = FakeClock()
    adapter = HangingTarget(clock)
    start = clock()
    with pytest.raises(DeliveryFailed, match="did not answer") as failed:
        await outbox_for(adapter).send(HERE, "hi")
    spent = clock() - start
    # no retry began after the minute; the last attempt ran its deadline out (was 8 attempts, 181 s)
    assert adapter.sends[-1] - start < TRANSIENT_BUDGET_S
    assert spent <= TRANSIENT_BUDGET_S + DEADLINE_S
    assert 1 < len(adapter.sends) < TRANSIENT_ATTEMPTS
    assert f"after {len(adapter.sends)} attempts over {spent:.0f} s" in str(failed.value)


async def test_fast_failures_still_get_every_attempt() -> None:
    # an error answered at once: the 8 attempts over about a minute, as before
    clock = FakeClock()
    adapter = HangingTarget(clock, [DeliveryError(f"502 #{i}") for i in range(TRANSIENT_ATTEMPTS)])
    with pytest.raises(DeliveryFailed, match=f"502 #{TRANSIENT_ATTEMPTS - 1}"):
        await outbox_for(adapter).send(HERE, "hi")
    assert len(adapter.sends) == TRANSIENT_ATTEMPTS
    gaps = [b - a for a, b in zip(adapter.sends, adapter.sends[1:], strict=False)]
    assert gaps == list(BACKOFF_S)


async def test_a_hanging_lookup_platform_looks_up_before_each_resend_and_stops_in_time() -> None:
    clock = FakeClock()
    adapter = HangingLookupTarget(clock)
    start = clock()
    with pytest.raises(DeliveryFailed, match="did not answer"):
        await outbox_for(adapter).send(HERE, "hi")
    assert adapter.events[0] == "send"
    sends = adapter.events.count("send")
    assert 1 < sends < TRANSIENT_ATTEMPTS
    # every resend came after a lookup that found nothing (never sent twice unasked)
    for i, event in enumerate(adapter.events):
        if event == "send" and i > 0:
            assert adapter.events[i - 1] == "find"
    assert clock() - start <= TRANSIENT_BUDGET_S + DEADLINE_S + 2 * 3.0  # + the lookups' settle waits


async def test_a_long_retry_after_keeps_its_longer_allowance() -> None:
    clock = FakeClock()
    adapter = HangingTarget(clock, [DeliveryError("429", retry_after=40.0) for _ in range(20)])
    with pytest.raises(DeliveryFailed, match="rate limited"):
        await outbox_for(adapter).send(HERE, "hi")
    assert len(adapter.sends) == 5  # five answers waited out in full: over three minutes
    assert adapter.sends[-1] - adapter.sends[0] >= 4 * 40.0


async def test_waits_the_platform_asked_for_do_not_use_up_the_transient_minute() -> None:
    clock = FakeClock()
    answers: list[BaseException] = [DeliveryError("429", retry_after=300.0) for _ in range(2)]
    answers += [DeliveryError(f"502 #{i}") for i in range(3)]
    adapter = HangingTarget(clock, answers, hang=False)
    assert await outbox_for(adapter).send(HERE, "hi") == ["ok"]
    assert len(adapter.sends) == 6  # two waits of 5 minutes, then three 502s retried, then sent
