"""Polling for a condition with a deadline: the one copy of what tests used to define per file."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def eventually(check: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """The first truthy value of `check()` within `timeout` seconds, else the last (falsy) one."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_for(check: Callable[[], Any], timeout: float, what: str = "a condition") -> Any:
    """Like `eventually`, but a timeout fails the test with what was awaited."""
    value = eventually(check, timeout)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return value


async def wait_until(check: Callable[[], Any], timeout: float, what: str = "a condition") -> Any:
    """`wait_for` for async tests: yields to the loop between checks instead of blocking it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := check()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)
    return value
