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
from plugins.contract import number_setting

# Bounds of the gateway's numeric settings: a finite value past these is a typo or a probe
# (`inf` would hold every message forever), never a wish.
DEBOUNCE_MAX_MS = 600_000  # ten minutes of quiet before a burst is answered
MAX_WAIT_MAX_MS = 3_600_000  # an hour (at least 4 × DEBOUNCE_MAX_MS, the default's factor)
MAX_ITEMS_MAX = 1000
CHAT_RATE_MAX = 100.0  # sends and edits per second per chat


class DebounceError(ValueError):
    """A bad debounce setting, or another of the gateway's numeric settings (the account does not start)."""


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
        """The account's debounce, its settings checked. `appserver channels add` and the account's
        start both come here, so the gateway's other numeric setting (`chat_rate`) is checked here too."""
        debounce = _ms(settings, "debounce_ms", 0, DEBOUNCE_MAX_MS)
        max_wait = _ms(settings, "max_wait_ms", max(debounce * 4, 2000), MAX_WAIT_MAX_MS)
        what = f"a positive integer of at most {MAX_ITEMS_MAX}"
        items = int(
            number_setting(
                settings, "max_items", 10, low=1, high=MAX_ITEMS_MAX, what=what, integer=True, error=DebounceError
            )
        )
        if debounce and max_wait < debounce:
            raise DebounceError(f"max_wait_ms ({max_wait:g}) must be at least debounce_ms ({debounce:g})")
        if "chat_rate" in settings:
            what = f"a positive number of sends per second of at most {CHAT_RATE_MAX:g}"
            number_setting(settings, "chat_rate", 1, low=0.001, high=CHAT_RATE_MAX, what=what, error=DebounceError)
        return cls(debounce / 1000.0, max_wait / 1000.0, items)


def _ms(settings: Mapping[str, Any], key: str, default: float, high: int) -> float:
    what = f"a number of milliseconds ≥ 0 and at most {high} ({high // 60_000} min)"
    return number_setting(settings, key, default, low=0, high=high, what=what, error=DebounceError)


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
