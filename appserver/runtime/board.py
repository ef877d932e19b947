"""The turns a conversation shows: their handles by turn id (the live ones and a few recently
settled), and the watchers told of each turn as it becomes visible (accepted, or resumed)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from appserver.runtime.handle import TurnHandle

log = logging.getLogger("appserver.runtime")

RECENT_HANDLES = 16


class TurnBoard:
    __slots__ = ("handles", "watchers", "_live")

    def __init__(self, live: Callable[[], set[str | None]]) -> None:
        self.handles: dict[str, TurnHandle] = {}
        self.watchers: list[Callable[[TurnHandle], None]] = []
        self._live = live  # the turns that must keep their handle: queued, and the current one

    def notify(self, handle: TurnHandle) -> None:
        if not self.watchers:
            return
        for watcher in list(self.watchers):
            try:
                watcher(handle)
            except Exception:  # a broken watcher must not break the turn
                log.exception("turn watcher failed")

    def remember(self, handle: TurnHandle) -> None:
        """Show `handle`, and forget the oldest settled handles beyond RECENT_HANDLES. The only place
        a handle is forgotten: never a live turn's (queued, current or paused), and never the one
        remembered now, even when its turn is not live yet (its caller queues it right after)."""
        handles = self.handles
        handles[handle.turn_id] = handle
        if len(handles) > RECENT_HANDLES:
            live = self._live()
            live.add(handle.turn_id)
            for turn_id in list(handles):
                if len(handles) <= RECENT_HANDLES:
                    break
                if turn_id not in live:
                    del handles[turn_id]


__all__ = ["RECENT_HANDLES", "TurnBoard"]
