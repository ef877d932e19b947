"""One synchronous PostgreSQL connection for the parts of a cluster's shared state that are read
and written from plain (threaded) code: the cron tasks (cron/pgstore.py) and the capability
tokens (auth/pgtokens.py). Reopened when the database ended it; one thread at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from appserver.store.url import redact_url, scrub

CONNECT_TIMEOUT_S = 5


class SyncConnection:
    def __init__(self, url: str, unreachable: Callable[[str], Exception]) -> None:
        self.url = url
        self.shown = redact_url(url)  # the only form of the URL that may reach a message
        self.mutex = threading.RLock()  # held while a caller uses the connection
        self._unreachable = unreachable
        self._db: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        """The connection (call with `mutex` held), opened again when it was closed or broke."""
        db = self._db
        if db is None or db.closed or db.broken:
            try:
                db = self._db = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            except psycopg.Error as exc:
                raise self._unreachable(f"cannot reach the database {self.shown}: {self.scrub(exc)}") from None
        return db

    def scrub(self, exc: BaseException) -> str:
        """The driver's message without the URL's password."""
        return scrub(str(exc), self.url)

    def close(self) -> None:
        with self.mutex:
            if self._db is not None:
                self._db.close()
                self._db = None


__all__ = ["SyncConnection"]
