"""A latest-value cell: publishers overwrite, consumers wake and read the newest value.

Never a queue: a slow consumer skips intermediate values and can never slow the publisher.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Quiet:
    """A consumer's keepalive clock: due once nothing newer reached it for `interval_s`.

    One timer per consumer, moved lazily: a new value only pushes the deadline (no timer work per
    value; a timer armed and cancelled per token was a tenth of a streaming token's cost), and the
    timer, when it fires early, re-arms for what is left.
    """

    __slots__ = ("_loop", "interval_s", "_deadline", "_timer", "due", "waiter")

    def __init__(self, interval_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.interval_s = interval_s
        self._deadline = self._loop.time() + interval_s
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self._deadline, self._fire)
        self.due = False
        self.waiter: asyncio.Future[None] | None = None

    def activity(self) -> None:
        self._deadline = self._loop.time() + self.interval_s
        self.due = False

    def _fire(self) -> None:
        now = self._loop.time()
        if now < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._fire)
            return
        self.due = True
        self._deadline = now + self.interval_s
        self._timer = self._loop.call_at(self._deadline, self._fire)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Latest(Generic[T]):
    __slots__ = ("_value", "_version", "_waiters", "_closed")

    def __init__(self, value: T, version: int = 0) -> None:
        self._value = value
        self._version = version
        self._waiters: list[asyncio.Future[None]] = []
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
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

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

    async def wait_newer_or_quiet(self, seen_version: int, quiet: Quiet) -> bool:
        """True once the version is > seen_version; False when `quiet` fell due first."""
        if self._version <= seen_version:
            loop = asyncio.get_running_loop()
            while self._version <= seen_version:
                if quiet.due:
                    quiet.due = False
                    return False
                waiter = quiet.waiter = loop.create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    quiet.waiter = None
                    if self._version <= seen_version:  # not woken by a publish (which emptied the list)
                        self._forget(waiter)
        quiet.activity()
        return True

    async def _wait(self, seen_version: int) -> None:
        loop = asyncio.get_running_loop()
        while self._version <= seen_version:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if self._version <= seen_version:  # not woken by a publish (which emptied the list)
                    self._forget(waiter)

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        """A waiter woken by something else than a publish (a timeout, a cancel, `Quiet`) leaves the
        list now: a consumer that times out again and again must not grow it until the next value."""
        waiters = self._waiters
        if waiters and waiters[-1] is waiter:
            waiters.pop()
        elif waiter in waiters:
            waiters.remove(waiter)
