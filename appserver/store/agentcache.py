"""The agents of a store, cached: read on every turn, changed rarely.

Our own writes drop the cache; another connection's commit (e.g. `appserver agents update` in
another process) changes `PRAGMA data_version`, which every read compares first.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable

from appserver.store.records import AgentRecord


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

    def drop(self) -> None:
        self._agents = None

    def agents(self, db: sqlite3.Connection) -> dict[str, AgentRecord]:
        version = db.execute("PRAGMA data_version").fetchone()[0]
        cache = self._agents
        if cache is None or version != self._data_version:
            self._data_version = version
            cache = self._agents = {a.id: a for a in self._load(db)}
        return cache
