"""The bounded buffer between the client's reader and whoever consumes `frames()`.

A consumer that falls behind must not grow the client's memory without end. Turn snapshots are
whole states (the newest revision wins), so when the buffer is full an older unread snapshot of the
same turn is dropped first, as the server's outbound buffer does; when nothing can be dropped the
buffer reports an overflow and the client ends the connection rather than lose a frame silently.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

DEFAULT_LIMIT = 10_000


class FrameBuffer:
    """A FIFO of frames with a limit, and an end mark that every later `get()` sees."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError("a frame buffer needs room for at least one frame")
        self.limit = limit
        self._items: deque[dict[str, Any]] = deque()
        self._ready = asyncio.Event()
        self._ended = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, frame: dict[str, Any]) -> bool:
        """Append `frame`; False when the buffer is full and no older snapshot could make room."""
        if len(self._items) >= self.limit and not self._coalesce(frame):
            return False
        self._items.append(frame)
        self._ready.set()
        return True

    def end(self) -> None:
        """No more frames: `get()` returns None once the frames already buffered are read."""
        self._ended = True
        self._ready.set()

    async def get(self) -> dict[str, Any] | None:
        """The next frame, or None after the end mark."""
        while not self._items:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def _coalesce(self, frame: dict[str, Any]) -> bool:
        """Drop an unread snapshot of the turn `frame` updates (or, failing that, any older one of
        a turn that has a newer snapshot buffered); True when room was made."""
        turn = _turn_of(frame)
        seen: set[str] = set()
        for i in range(len(self._items) - 1, -1, -1):
            other = _turn_of(self._items[i])
            if other is None:
                continue
            if other == turn or other in seen:
                del self._items[i]
                return True
            seen.add(other)
        return False


def _turn_of(frame: dict[str, Any]) -> str | None:
    if frame.get("type") != "turn_updated":
        return None
    snap = frame.get("snapshot")
    return str(snap.get("turn_id") or "") if isinstance(snap, dict) else None
