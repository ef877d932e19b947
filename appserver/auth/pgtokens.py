"""Capability tokens in a PostgreSQL store's database, shared by every server using it.

Several servers on one database (docs/scale-out.md) must accept the same tokens: a token minted
through any of them (or `appserver token create` with the store's URL) works on all, and a revoke
reaches all within `REFRESH_S`. The rows hold what tokens.json holds (hashes only).

The server's event loop never reads the database for a token: each server keeps the records in
memory, and a thread of its own (`_Refresher`) asks the database whether they changed (one
`token_state.version` read, the rows only when it moved) every `POLL_S`, and at once (but at most
every `MISS_REFRESH_S`, so a flood of invalid tokens cannot make it query the database per
request) when a request needs it. `verify` answers from memory when memory can answer: a known
token from records read less than `REFRESH_S` ago (the hot path: no lock, no I/O). Otherwise (a
token it does not know, which may have been minted elsewhere a moment ago; records too old to
trust) it raises `TokensStale`, and the caller awaits a read that started after its request (at
most `WAIT_S`; a database that did not answer by then, or could not be reached: 503
`store_unavailable`), then asks again. A session the database ended (a restart, a failover,
`pg_terminate_backend`) is opened again and the read retried (store/pgsync.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from filelock import Timeout

from appserver.auth.errors import TokensStale, store_unavailable
from appserver.auth.principal import Principal
from appserver.auth.tokens import LOCK_TIMEOUT_S, TokenRecord, TokenStore, match_token
from appserver.store.pgsync import SyncConnection

log = logging.getLogger("appserver.auth")

REFRESH_S = 1.0  # records read longer ago than this never accept a token without a new read
POLL_S = REFRESH_S / 2  # the refresher's own pace: a known token's check never has to wait
MISS_REFRESH_S = 0.2  # reads asked for by requests: at most this often
WAIT_S = 2.0  # how long a request waits for a read before it is answered 503 store_unavailable
_SELECT = "SELECT id, name, hash, agents, scopes, created_at, expires_at FROM tokens ORDER BY created_at, id"


class _Snapshot(NamedTuple):
    """The records and when the read that got them started (monotonic; -inf: none yet): replaced
    as one, so a reader never pairs new records with an old time or the reverse."""

    read_at: float
    records: list[TokenRecord]


def _parse(rows: list[Any]) -> list[TokenRecord]:
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


class _Transaction:
    """What `TokenStore` takes for its file lock: a transaction holding the tokens' row lock."""

    def __init__(self, store: PgTokenStore) -> None:
        self._store = store

    @contextmanager
    def acquire(self, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        store = self._store
        with store._mutex:
            # A session the database ended is found (and opened again) before the transaction,
            # not by its first statement, which would fail the whole create or revoke.
            store._sync.run(lambda c: c.execute("SELECT 1"))
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
            if store._version is None:  # written and committed: this process's next check reads again
                store._snap = _Snapshot(-math.inf, store._snap.records)


class PgTokenStore(TokenStore):
    def __init__(self, home: Path, url: str) -> None:
        super().__init__(home)
        self._sync = SyncConnection(url, lambda why: RuntimeError(f"tokens: {why}"))
        self.shown = self._sync.shown
        self.path = Path(f"{self.shown} (table tokens)")  # what messages name
        self._mutex = self._sync.mutex
        self._in_tx = False
        self._version: int | None = None  # token_state.version of the records held (None: read them)
        self._snap = _Snapshot(-math.inf, [])
        self._loaded = False  # some records were read (until then `live` closes nothing)
        # The refresher: a thread started by the first check of a token (a CLI command has none).
        self._guard = threading.Lock()  # for `_next` and `_thread`
        self._next: concurrent.futures.Future[str | None] | None = None  # the next read's outcome
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None  # why the last read failed (logged once per reason)

    def _conn(self) -> psycopg.Connection[Any]:
        return self._sync.get()

    def _locked(self) -> Any:
        return _Transaction(self)

    def _read(self) -> list[TokenRecord]:
        with self._mutex:
            if self._in_tx:  # on the transaction's connection: never again on another one
                return _parse(self._conn().execute(_SELECT).fetchall())
            return self._sync.run(lambda c: _parse(c.execute(_SELECT).fetchall()))

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

    # ── reading: blocking, so only in the refresher's thread (or a CLI command, or the start) ──

    def _load(self) -> None:
        """Read the records if `token_state.version` moved since the last read."""

        def read(conn: psycopg.Connection[Any]) -> tuple[int, list[TokenRecord] | None]:
            row = conn.execute("SELECT version FROM token_state WHERE id = 1").fetchone()
            version = int(row[0]) if row else 0
            if version == self._version:
                return version, None
            return version, _parse(conn.execute(_SELECT).fetchall())

        with self._mutex:
            read_at = time.monotonic()  # what the read sees was committed before it began
            version, records = self._sync.run(read)
            self._version = version
            self._snap = _Snapshot(read_at, self._snap.records if records is None else records)
            self._loaded = True

    def _records(self) -> list[TokenRecord]:
        self._load()
        return self._snap.records

    def _refresh(self) -> str | None:
        """One read by the refresher: None, or why it failed."""
        try:
            self._load()
        except psycopg.Error as exc:
            error = self._sync.scrub(exc).strip() or type(exc).__name__
        except (RuntimeError, ValueError, TypeError) as exc:  # unreachable; a row no token can be
            error = str(exc).removeprefix("tokens: ")
        except Exception as exc:  # the refresher must outlive whatever a read raised
            log.exception("tokens: reading the capability tokens from %s failed", self.shown)
            error = type(exc).__name__
        else:
            if self._failing is not None:
                log.info("tokens: read from %s again", self.shown)
                self._failing = None
            return None
        error = " ".join(error.split())
        if error != self._failing:
            log.warning("tokens: cannot read the capability tokens (%s): %s", self.shown, error)
            self._failing = error
        return error

    def _refresh_loop(self) -> None:
        last = -math.inf
        while True:
            self._wake.wait(max(0.0, last + POLL_S - time.monotonic()))
            if self._closing.wait(max(0.0, last + MISS_REFRESH_S - time.monotonic())):
                break
            self._wake.clear()
            with self._guard:
                asked, self._next = self._next, None
            if asked is not None and not asked.set_running_or_notify_cancel():
                asked = None
            last = time.monotonic()
            error = self._refresh()
            if asked is not None:
                asked.set_result(error)
        with self._guard:
            asked, self._next = self._next, None
        if asked is not None and asked.set_running_or_notify_cancel():
            asked.set_result("the server is stopping")

    def _start(self) -> None:
        with self._guard:
            if self._thread is None and not self._closing.is_set():
                self._thread = threading.Thread(target=self._refresh_loop, name="appserver-tokens", daemon=True)
                self._thread.start()

    def _ask(self) -> concurrent.futures.Future[str | None]:
        """The outcome of the next read, one that starts after this call; asked for now."""
        with self._guard:
            fut = self._next
            if fut is None:
                fut = self._next = concurrent.futures.Future()
        self._start()
        self._wake.set()
        return fut

    async def _await_read(self, asked_at: float) -> None:
        """Wait (on the event loop, never blocking it) for a read that began after `asked_at`."""
        if self._snap.read_at >= asked_at:
            return
        if self._closing.is_set():
            error: str | None = "the server is stopping"
        else:
            try:
                error = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._ask())), WAIT_S)
            except TimeoutError:
                error = f"no answer within {WAIT_S:g} s"
        if self._snap.read_at < asked_at:
            # (why is in the log, said once by `_refresh`: nothing of the database for a caller not known yet)
            log.debug("tokens: a check waited in vain for a read of %s: %s", self.shown, error)
            raise store_unavailable("the capability tokens could not be read from the database: retry")

    # ── the checks: from memory, on the event loop ──

    def check(self) -> None:
        """Rows in the database, no file to find damaged at start; only the start's warning about
        tokens holding a name reserved for the gateway (the database may be away: then not)."""
        try:
            self._warn_reserved()
        except (psycopg.Error, RuntimeError, ValueError) as exc:
            log.debug("tokens: not checked at start: %s", exc)

    def live(self, token_id: str, *, max_age_s: float = 0.0) -> bool:
        """From memory; records older than `max_age_s` are read again in the background (the next
        poll sees what that read found). A database that cannot be reached closes nothing: the
        last records read decide."""
        snap = self._snap
        if time.monotonic() - snap.read_at >= max(max_age_s, MISS_REFRESH_S):
            if self._thread is None:
                self._start()
            self._wake.set()
        if not self._loaded:
            return True
        return any(r.id == token_id for r in snap.records)

    def verify(self, token: str, *, since: float | None = None) -> Principal | None:
        """From memory when memory can answer: a known token from records read less than
        REFRESH_S ago, any token from records read after `since`. Otherwise TokensStale: the
        caller awaits its `wait()` and asks again with `since`."""
        snap = self._snap
        found = match_token(snap.records, token)
        if found is not None and found.is_expired(time.time()):
            return None
        if since is None or snap.read_at < since:
            now = time.monotonic()
            if found is None or now - snap.read_at >= REFRESH_S:
                raise TokensStale(now, self._await_read)
            if self._thread is None:
                self._start()
        return found.principal() if found is not None else None

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
            if thread.is_alive():
                return  # still in a read of a database that does not answer: a daemon, it ends with us
        self._sync.close()


__all__ = ["PgTokenStore"]
