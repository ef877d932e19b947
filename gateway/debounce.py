"""Debounce: a burst of messages from one sender in one chat (and thread) becomes one turn.

Per account: `debounce_ms` (default 0: off), `max_wait_ms` (a steady stream is flushed this long
after its first message; default four times `debounce_ms`, at least 2 s) and `max_items` (a buffer
this full is flushed at once; default 10). A buffer lives in one chat's worker, so a later message
never overtakes an earlier buffered one of the same sender; a command or a message with media flushes
the sender's buffer first. The messages are in the ledger all along (decided `allowed`), and a batch
is written to the ledger before it is submitted, so a crash inside the window loses nothing and a
resubmission after a crash is the same batch (the same turn).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.ledger import Entry


class DebounceError(ValueError):
    """A bad debounce setting (the account does not start)."""


@dataclass(frozen=True, slots=True)
class DebounceSettings:
    debounce_s: float = 0.0
    max_wait_s: float = 2.0
    max_items: int = 10

    @property
    def enabled(self) -> bool:
        return self.debounce_s > 0

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> DebounceSettings:
        debounce = _number(settings, "debounce_ms", 0)
        max_wait = _number(settings, "max_wait_ms", max(debounce * 4, 2000))
        items = settings.get("max_items", 10)
        if not isinstance(items, int) or isinstance(items, bool) or items < 1:
            raise DebounceError(f"max_items must be a positive integer, got {items!r}")
        if debounce and max_wait < debounce:
            raise DebounceError(f"max_wait_ms ({max_wait:g}) must be at least debounce_ms ({debounce:g})")
        return cls(debounce / 1000.0, max_wait / 1000.0, items)


def _number(settings: Mapping[str, Any], key: str, default: float) -> float:
    value = settings.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise DebounceError(f"{key} must be a number of milliseconds ≥ 0, got {value!r}")
    return float(value)


@dataclass
class _Buffer:
    entries: list[Entry]
    first_at: float
    last_at: float


@dataclass
class Buffers:
    """The open buffers of one chat's worker, by sender."""

    clock: Callable[[], float] = time.monotonic
    _open: dict[str, tuple[_Buffer, DebounceSettings]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self._open)

    def add(self, entry: Entry, settings: DebounceSettings) -> list[Entry] | None:
        """Buffer `entry`; returns the batch to submit now when the buffer reached `max_items`."""
        now = self.clock()
        found = self._open.get(entry.sender)
        if found is None:
            self._open[entry.sender] = (_Buffer([entry], now, now), settings)
        else:
            found[0].entries.append(entry)
            found[0].last_at = now
        if len(self._open[entry.sender][0].entries) >= settings.max_items:
            return self.take(entry.sender)
        return None

    def take(self, sender: str) -> list[Entry]:
        found = self._open.pop(sender, None)
        return found[0].entries if found else []

    def due(self) -> list[list[Entry]]:
        """Batches whose quiet time (`debounce_ms`) or whose `max_wait_ms` has passed."""
        now = self.clock()
        ready = [sender for sender, (b, s) in self._open.items() if self._deadline(b, s) <= now]
        return [self.take(sender) for sender in ready]

    def next_deadline(self) -> float | None:
        if not self._open:
            return None
        return min(self._deadline(b, s) for b, s in self._open.values())

    @staticmethod
    def _deadline(buffer: _Buffer, settings: DebounceSettings) -> float:
        return min(buffer.last_at + settings.debounce_s, buffer.first_at + settings.max_wait_s)
