"""What happened lately, per key, forgotten once it no longer matters.

The gateway remembers a few things per chat or sender only for a while: when a chat was last sent a
notice (one per 10 minutes), what a stranger was last told (one answer per burst). A long-running
gateway meets many chats and senders, so such a memory must not keep every key it ever saw: entries
older than the window are worth nothing and are swept out each time the map doubles (amortised
O(1) per insert), which bounds it by the keys seen within one window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    """`key -> (value, when)` for at most `window` seconds."""

    SWEEP_MIN = 64  # entries kept before the first sweep

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._entries: dict[str, tuple[V, float]] = {}
        self._sweep_at = self.SWEEP_MIN

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> V | None:
        """The value noted for `key` within the window, else None."""
        found = self._entries.get(key)
        if found is None or self._clock() - found[1] >= self.window:
            return None
        return found[0]

    def put(self, key: str, value: V) -> None:
        """Note `value` for `key` as of now."""
        if key not in self._entries and len(self._entries) >= self._sweep_at:
            self.forget_old()
            self._sweep_at = max(self.SWEEP_MIN, 2 * len(self._entries))
        self._entries[key] = (value, self._clock())

    def forget_old(self) -> int:
        """Drop the entries older than the window; returns how many went."""
        now = self._clock()
        old = [k for k, (_, when) in self._entries.items() if now - when >= self.window]
        for key in old:
            del self._entries[key]
        return len(old)
