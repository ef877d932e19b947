"""plugins/inorder.py: per-chat arrival order for adapters whose library runs each event as a task."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from plugins.inorder import ChatOrder


async def _handler(order: ChatOrder, chat: str, name: str, delay: float, out: list[str], *, skip: bool = False) -> None:
    with order.ticket(chat) as ticket:  # before the first await, as an adapter does
        await asyncio.sleep(delay)  # a download
        if skip:
            return  # nothing to hand on (an edit, a join): released early
        await ticket.wait()
        out.append(name)


def _spawn_in_order(*coros: Coroutine[Any, Any, None]) -> list[asyncio.Task[None]]:
    return [asyncio.ensure_future(c) for c in coros]


async def test_a_slow_event_is_not_overtaken_within_its_chat() -> None:
    order = ChatOrder(5.0)
    out: list[str] = []
    await asyncio.gather(
        *_spawn_in_order(
            _handler(order, "A", "a1-image", 0.2, out),
            _handler(order, "A", "a2-text", 0.0, out),
            _handler(order, "B", "b1-text", 0.0, out),
            _handler(order, "A", "a3-text", 0.0, out),
        )
    )
    assert [n for n in out if n.startswith("a")] == ["a1-image", "a2-text", "a3-text"]
    assert out.index("b1-text") < out.index("a1-image")  # another chat does not wait
    assert len(order) == 0


async def test_a_ticket_released_early_does_not_let_a_later_one_overtake() -> None:
    order = ChatOrder(5.0)
    out: list[str] = []
    await asyncio.gather(
        *_spawn_in_order(
            _handler(order, "A", "image", 0.2, out),
            _handler(order, "A", "edit", 0.0, out, skip=True),
            _handler(order, "A", "text", 0.0, out),
        )
    )
    assert out == ["image", "text"]
    assert len(order) == 0


async def test_an_error_or_a_cancellation_releases_the_ticket() -> None:
    order = ChatOrder(5.0)
    out: list[str] = []

    async def broken() -> None:
        with order.ticket("A"):
            await asyncio.sleep(0.05)
            raise ValueError("malformed")

    async def hanging() -> None:
        with order.ticket("A"):
            await asyncio.sleep(60)

    first = asyncio.ensure_future(broken())
    second = asyncio.ensure_future(hanging())
    third = asyncio.ensure_future(_handler(order, "A", "text", 0.0, out))
    await asyncio.sleep(0.1)
    assert first.done() and out == []
    second.cancel()
    await asyncio.wait_for(third, 1.0)
    assert out == ["text"]
    with pytest.raises(ValueError):
        first.result()
    assert len(order) == 0


async def test_nothing_waits_longer_than_hold_s() -> None:
    order = ChatOrder(0.3)
    out: list[str] = []
    stuck = asyncio.ensure_future(_handler(order, "A", "stuck", 30.0, out))
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.wait_for(_handler(order, "A", "later", 0.0, out), 2.0)
    assert out == ["later"] and 0.25 <= loop.time() - start < 1.0
    # the chat is not blocked for what comes after either: the late one is through
    start = loop.time()
    await asyncio.wait_for(_handler(order, "A", "next", 0.0, out), 2.0)
    assert out == ["later", "next"] and loop.time() - start < 0.5
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)
    await asyncio.sleep(0)
    assert len(order) == 0


async def test_the_wait_is_counted_from_the_ticket_not_from_the_wait() -> None:
    """A later event that itself took long to read does not wait a full hold_s more."""
    order = ChatOrder(0.4)
    out: list[str] = []
    stuck = asyncio.ensure_future(_handler(order, "A", "stuck", 30.0, out))
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.wait_for(_handler(order, "A", "slow-too", 0.3, out), 2.0)
    assert out == ["slow-too"] and loop.time() - start < 0.6
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)


async def test_released_tickets_are_forgotten() -> None:
    order = ChatOrder(1.0)
    out: list[str] = []
    for i in range(50):
        await _handler(order, f"chat-{i}", str(i), 0.0, out)
    assert len(order) == 0 and len(out) == 50
