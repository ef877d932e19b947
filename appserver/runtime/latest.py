"""A latest-value cell: publishers overwrite, consumers wake and read the newest value.

Never a queue: a slow consumer skips intermediate values and can never slow the publisher.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Latest(Generic[T]):
    __slots__ = ("_value", "_version", "_waiter", "_closed")

    def __init__(self, value: T, version: int = 0) -> None:
        self._value = value
        self._version = version
        self._waiter: asyncio.Event | None = None
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def value(self) -> T:
        return self._value

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, value: T, *, version: int | None = None, final: bool = False) -> None:
        """Store a new value; `version` (if given) must be greater than the current one."""
        self._value = value
        self._version = self._version + 1 if version is None else version
        if final:
            self._closed = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    async def wait_newer(self, seen_version: int, timeout: float | None = None) -> tuple[int, T]:
        """Return (version, value) once version > seen_version (at once if already newer).

        Raises TimeoutError after `timeout` seconds without a newer value.
        """
        if self._version <= seen_version:
            if timeout is None:
                await self._wait(seen_version)
            else:
                # asyncio.timeout, not wait_for: no extra task per wait.
                async with asyncio.timeout(timeout):
                    await self._wait(seen_version)
        return self._version, self._value

    async def _wait(self, seen_version: int) -> None:
        while self._version <= seen_version:
            if self._waiter is None:
                self._waiter = asyncio.Event()
            await self._waiter.wait()
