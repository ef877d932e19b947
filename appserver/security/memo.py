"""A bounded memo for pure address checks: the same Host header or client address gives the same
answer, so the guard need not re-parse it on every request."""

from __future__ import annotations

from collections.abc import Callable, Hashable

MEMO_MAX = 1024


class Memo:
    """Speed only: cleared whole when full, which costs a few re-checks and nothing else."""

    def __init__(self) -> None:
        self._hits: dict[Hashable, bool] = {}

    def get(self, key: Hashable) -> bool | None:
        return self._hits.get(key)

    def check(self, key: Hashable, check: Callable[[], bool]) -> bool:
        hit = self._hits.get(key)
        if hit is None:
            if len(self._hits) >= MEMO_MAX:
                self._hits.clear()
            hit = self._hits[key] = check()
        return hit
