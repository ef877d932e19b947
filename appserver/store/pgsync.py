"""One synchronous PostgreSQL connection for the parts of a cluster's shared state that are read
and written from plain (threaded) code: the capability tokens (auth/pgtokens.py). Reopened when
the database ended it; one thread at a time. Never used on the server's event loop: a query there
would stall every request while the database is slow or away."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

from appserver.store.url import redact_url, scrub

CONNECT_TIMEOUT_S = 5
# A database that goes silent in the middle of a query (a host gone, a network partition) ends the
# connection after about this long, instead of after the system's TCP retransmissions (~15 min):
# a thread reading the tokens gets to try again. Not where the URL sets them itself.
_TCP: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20000,
}

T = TypeVar("T")


class SyncConnection:
    def __init__(self, url: str, unreachable: Callable[[str], Exception]) -> None:
        self.url = url
        self.shown = redact_url(url)  # the only form of the URL that may reach a message
        self.mutex = threading.RLock()  # held while a caller uses the connection
        self._unreachable = unreachable
        self._db: psycopg.Connection[Any] | None = None
        try:
            given = conninfo_to_dict(url)
        except psycopg.Error:
            given = {}
        self._tcp: dict[str, Any] = {k: v for k, v in _TCP.items() if k not in given}

    def get(self) -> psycopg.Connection[Any]:
        """The connection (call with `mutex` held), opened again when it was closed or broke."""
        db = self._db
        if db is None or db.closed or db.broken:
            try:
                db = self._db = psycopg.connect(
                    self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **self._tcp
                )
            except psycopg.Error as exc:
                raise self._unreachable(f"cannot reach the database {self.shown}: {self.scrub(exc)}") from None
        return db

    def run(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """`work(connection)` (call with `mutex` held), run once more on a new connection when the
        database had ended this one: psycopg only learns that a session was ended (a database
        restart, a failover, `pg_terminate_backend`) from the first statement sent on it, which
        then fails. `work` must be safe to run twice: a read, or a transaction of its own (which
        the ended session did not commit). A second failure is the caller's."""
        db = self.get()
        try:
            return work(db)
        except psycopg.OperationalError:
            if not (db.closed or db.broken):
                raise  # the connection is fine: the statement itself failed
        return work(self.get())

    def scrub(self, exc: BaseException) -> str:
        """The driver's message without the URL's password."""
        return scrub(str(exc), self.url)

    def close(self) -> None:
        with self.mutex:
            if self._db is not None:
                self._db.close()
                self._db = None


__all__ = ["SyncConnection"]
