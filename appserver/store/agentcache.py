"""The agents of a store, cached: read on every turn, changed rarely.

Our own writes drop the cache; another connection's commit (e.g. `appserver agents update` in
another process) changes `PRAGMA data_version`, which a read compares first (at most once a
millisecond).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable

from appserver.store.records import AgentRecord

RECHECK_S = 0.001  # another process's change (`appserver agents update`) is seen this much later at most


def copy_agent(a: AgentRecord) -> AgentRecord:
    """Callers may edit the record they get (`agents update` does): hand out copies of cached ones."""
    params = {
        k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in a.params.items()
    }
    return AgentRecord(a.id, a.name, a.model, a.system, dict(a.tools), params, a.created_at, a.updated_at)


class AgentCache:
    """Every agent by id, in (created_at, id) order, valid for one `PRAGMA data_version`."""

    def __init__(self, load: Callable[[sqlite3.Connection], Iterable[AgentRecord]]) -> None:
        self._load = load
        self._agents: dict[str, AgentRecord] | None = None
        self._data_version = -1
        self._checked_at = -1.0

    def drop(self) -> None:
        self._agents = None

    def agents(self, db: sqlite3.Connection) -> dict[str, AgentRecord]:
        cache = self._agents
        now = time.monotonic()
        if cache is not None and now - self._checked_at < RECHECK_S:
            return cache  # a request reads the agents three times: one look at the version will do
        version = db.execute("PRAGMA data_version").fetchone()[0]
        self._checked_at = now
        if cache is None or version != self._data_version:
            self._data_version = version
            cache = self._agents = {a.id: a for a in self._load(db)}
        return cache
