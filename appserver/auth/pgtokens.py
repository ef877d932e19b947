"""Capability tokens in a PostgreSQL store's database, shared by every server using it.

Several servers on one database (docs/scale-out.md) must accept the same tokens: a token minted
through any of them (or `appserver token create` with the store's URL) works on all, and a revoke
reaches all within `REFRESH_S`. The rows hold what tokens.json holds (hashes only). Each server
keeps the records in memory and asks the database whether they changed (one `token_state.version`
read) at most every `REFRESH_S`; a token it does not know makes it look at once (at most every
`MISS_REFRESH_S`, so invalid tokens cannot make it query the database per request).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from filelock import Timeout

from appserver.auth.principal import Principal
from appserver.auth.tokens import LOCK_TIMEOUT_S, TokenRecord, TokenStore
from appserver.store.pgsync import SyncConnection

log = logging.getLogger("appserver.auth")

REFRESH_S = 1.0
MISS_REFRESH_S = 0.2


class _Transaction:
    """What `TokenStore` takes for its file lock: a transaction holding the tokens' row lock."""

    def __init__(self, store: PgTokenStore) -> None:
        self._store = store

    @contextmanager
    def acquire(self, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        store = self._store
        with store._mutex:
            conn = store._conn()
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{int(timeout * 1000)}ms'")
                conn.execute("INSERT INTO token_state(id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
                try:
                    conn.execute("SELECT version FROM token_state WHERE id = 1 FOR UPDATE")
                except psycopg.errors.LockNotAvailable:
                    raise Timeout(f"the tokens in {store.shown}") from None
                store._in_tx = True
                try:
                    yield
                finally:
                    store._in_tx = False


class PgTokenStore(TokenStore):
    def __init__(self, home: Path, url: str) -> None:
        super().__init__(home)
        self._sync = SyncConnection(url, lambda why: RuntimeError(f"tokens: {why}"))
        self.shown = self._sync.shown
        self.path = Path(f"{self.shown} (table tokens)")  # what messages name
        self._mutex = self._sync.mutex
        self._in_tx = False
        self._version: int | None = None
        self._refreshed_at = 0.0

    def _conn(self) -> psycopg.Connection[Any]:
        return self._sync.get()

    def _locked(self) -> Any:
        return _Transaction(self)

    def _read(self) -> list[TokenRecord]:
        with self._mutex:
            rows = (
                self._conn()
                .execute(
                    "SELECT id, name, hash, agents, scopes, created_at, expires_at FROM tokens ORDER BY created_at, id"
                )
                .fetchall()
            )
        return [
            TokenRecord.from_json(
                {
                    "id": r[0],
                    "name": r[1],
                    "hash": r[2],
                    "agents": json.loads(r[3]) if r[3] is not None else None,
                    "scopes": json.loads(r[4]),
                    "created_at": r[5],
                    "expires_at": r[6],
                }
            )
            for r in rows
        ]

    def _write(self, records: list[TokenRecord]) -> None:
        if not self._in_tx:
            raise RuntimeError("tokens: written outside their transaction")
        conn = self._conn()
        conn.execute("DELETE FROM tokens")
        for r in records:
            d = r.to_json()
            conn.execute(
                "INSERT INTO tokens(id, name, hash, agents, scopes, created_at, expires_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (
                    d["id"],
                    d["name"],
                    d["hash"],
                    json.dumps(d["agents"]) if d["agents"] is not None else None,
                    json.dumps(d["scopes"]),
                    d["created_at"],
                    d["expires_at"],
                ),
            )
        conn.execute("UPDATE token_state SET version = version + 1 WHERE id = 1")
        self._version = None  # the next look reloads

    def _records(self, *, within: float = REFRESH_S) -> list[TokenRecord]:
        now = time.monotonic()
        if self._version is not None and now - self._refreshed_at < within:
            return self._cache
        with self._mutex:
            row = self._conn().execute("SELECT version FROM token_state WHERE id = 1").fetchone()
            version = int(row[0]) if row else 0
            if version != self._version:
                self._cache = self._read()
                self._version = version
            self._refreshed_at = now
            self._cache_key = (version, 0, 0)
        return self._cache

    def check(self) -> None:
        """Rows in the database, no file to find damaged at start; only the start's warning about
        tokens holding a name reserved for the gateway (the database may be away: then not)."""
        try:
            self._warn_reserved()
        except (psycopg.Error, RuntimeError, ValueError) as exc:
            log.debug("tokens: not checked at start: %s", exc)

    def live(self, token_id: str, *, max_age_s: float = 0.0) -> bool:
        try:
            records = self._records(within=max(max_age_s, MISS_REFRESH_S))
        except (psycopg.Error, RuntimeError):
            return True  # the database is unreachable: a socket is not closed for it (verify decides new ones)
        return any(r.id == token_id for r in records)

    def verify(self, token: str) -> Principal | None:
        found = super().verify(token)
        if found is None and time.monotonic() - self._refreshed_at >= MISS_REFRESH_S:
            self._records(within=0.0)  # minted on another server a moment ago?
            found = super().verify(token)
        return found

    def close(self) -> None:
        self._sync.close()


__all__ = ["PgTokenStore"]
