"""Cron tasks in a PostgreSQL store's database, for servers that share it (docs/scale-out.md).

The same document crons.json holds, kept in one row (`cron_state`), so every rule of the file
store holds unchanged: a read-modify-write is one transaction holding the row lock (`lock`), the
claim of an occurrence commits before it fires (claim-before-fire), and the scheduler lease
(`scheduler_owner`) names the instance that may fire, judged alive by its instance row
(appserver/store/cluster.py) from any host. One scheduler fires across the cluster; the others
judge the holder's instance every second (`Scheduler._sleep`), and once it is gone, one of them
takes the lease over at once (under the row lock). Run logs stay in each server's home; how far
each open claim got (submitted, settled, delivered) is kept with the claim in the row, so the
scheduler that takes over resolves only what the dead one left undone. A server judges its own
instance row too, before it claims the lease or a run and before it fires one: once it is judged
gone (fenced), it claims nothing and leaves the due runs to a healthy server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from appserver.store.cluster import AWAY, LIVE, LIVE_SINCE
from appserver.store.pgsync import SyncConnection
from cron.store import DEFAULT_LOCK_TIMEOUT_S, CronFile, CronLockTimeout, CronStore, CronStoreError

HEARTBEAT_GRACE = {"timeout": 30.0, "grace": 5.0}  # the cluster's defaults (see `instance_alive`)
# LIVE_SINCE's clock with each heartbeat counted as recorded (no `back`, no `until`): while this
# server's own heartbeat is stale it is fenced (`LeaseHolder.fenced`) and takes no lease to judge.
AS_RECORDED = {"back": 0.0, "until": AWAY}


class PgCronStore(CronStore):
    shared = True  # the servers of a cluster share the tasks, each with a run log of its own

    def __init__(self, home: Path, url: str, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        super().__init__(home, lock_timeout_s=lock_timeout_s)
        self._sync = SyncConnection(url, lambda why: CronStoreError(f"cron: {why}"))
        self.shown = self._sync.shown
        self.liveness = dict(HEARTBEAT_GRACE)  # the server sets its own [store] timings
        # How this server judges its own instance (`instance_alive` of its own id): as the others
        # judge it, a heartbeat sooner, as the cluster fences itself (`Cluster.fenced`)
        self.own_liveness = dict(HEARTBEAT_GRACE)
        self._mutex = self._sync.mutex
        self._held: tuple[str, int] | None = None  # (doc, version) of the row, while locked
        self._cached: tuple[int, CronFile] | None = None

    def _conn(self) -> psycopg.Connection[Any]:
        return self._sync.get()

    def close(self) -> None:
        self._sync.close()

    @contextmanager
    def lock(self) -> Iterator[None]:
        """One transaction holding the cron row's lock (CronLockTimeout after `lock_timeout_s`)."""
        with self._mutex:
            if self._held is not None:  # re-entered by the thread that holds it
                yield
                return
            conn = self._conn()
            try:
                with conn.transaction():
                    conn.execute(f"SET LOCAL lock_timeout = '{int(self.lock_timeout_s * 1000)}ms'")
                    conn.execute(
                        "INSERT INTO cron_state(id, doc, version) VALUES (1, '', 0) ON CONFLICT (id) DO NOTHING"
                    )
                    try:
                        row = conn.execute("SELECT doc, version FROM cron_state WHERE id = 1 FOR UPDATE").fetchone()
                    except psycopg.errors.LockNotAvailable:
                        raise CronLockTimeout(
                            f"timed out after {self.lock_timeout_s:g} s waiting for the cron tasks in {self.shown}; "
                            "another appserver process is holding them"
                        ) from None
                    assert row is not None
                    self._held = (str(row[0]), int(row[1]))
                    try:
                        yield
                    finally:
                        self._held = None
            except psycopg.Error as exc:
                raise CronStoreError(f"cron: the database {self.shown} failed: {self._sync.scrub(exc)}") from None

    def signature(self) -> tuple[int, int, int] | None:
        """The row's version (every save bumps it), in the file store's shape."""
        with self._mutex:
            if self._held is not None:
                return (self._held[1], 0, 0)
            try:
                row = self._conn().execute("SELECT version FROM cron_state WHERE id = 1").fetchone()
            except psycopg.Error as exc:
                raise CronStoreError(f"cron: the database {self.shown} failed: {self._sync.scrub(exc)}") from None
            return None if row is None else (int(row[0]), 0, 0)

    def cached_signature(self) -> tuple[int, int, int] | None:
        cached = self._cached
        return None if cached is None else (cached[0], 0, 0)

    def load(self, *, readonly: bool = False) -> CronFile:
        held = self._held
        if held is None:
            raise CronStoreError("cron: load() outside lock()")
        doc, version = held
        cached, self._cached = self._cached, None
        if cached is not None and cached[0] == version:
            return cached[1]
        if not doc.strip():
            return CronFile()
        try:
            return CronFile.from_dict(json.loads(doc))
        except (ValueError, TypeError, KeyError) as exc:
            raise CronStoreError(
                f"the cron tasks in {self.shown} (table cron_state) are not valid: {exc}; fix or empty the row"
            ) from None

    def save(self, state: CronFile, *, cache: bool = False, user_edit: bool = False) -> None:
        if self._held is None:
            raise CronStoreError("cron: save() outside lock()")
        text = self.checked_render(state, user_edit=user_edit).decode("utf-8")  # the file store's limits hold here too
        row = (
            self._conn()
            .execute("UPDATE cron_state SET doc = %s, version = version + 1 WHERE id = 1 RETURNING version", (text,))
            .fetchone()
        )
        assert row is not None
        self._held = (text, int(row[0]))
        self._cached = (int(row[0]), state) if cache else None

    def stored_size(self) -> int:
        held = self._held
        return 0 if held is None else len(held[0].encode("utf-8"))

    def keep(self, state: CronFile) -> None:
        held = self._held
        self._cached = None if held is None else (held[1], state)

    def join_cluster(self, instance_id: str, instance_timeout_s: float, heartbeat_s: float) -> None:
        super().join_cluster(instance_id, instance_timeout_s, heartbeat_s)
        self.liveness = {"timeout": instance_timeout_s, "grace": heartbeat_s * 2.5}
        self.own_liveness = {**self.liveness, "timeout": max(heartbeat_s, instance_timeout_s - heartbeat_s)}

    def corrupt_files(self) -> list[Path]:
        return []

    def problem(self) -> str | None:
        return None

    def instance_alive(self, instance_id: str) -> bool | None:
        """Is the instance alive? Asked under `lock()` by a claim, and without it by a scheduler
        waiting for the lease (every second; `Scheduler._sleep`). Another instance by the timings
        its row recorded (LIVE_SINCE, as the cluster judges it; this server's for a row without
        them): judged by this server's own, a short timeout took the lease from a healthy server
        with a longer heartbeat. Of this server's own instance (`LeaseHolder.fenced`), a heartbeat
        sooner than the others judge it: it stops claiming before they may take its lease over.
        A row deleted by a survivor (this server was judged gone) is never alive again."""
        if instance_id == self.instance_id:
            live, timings = LIVE, self.own_liveness
        else:
            live, timings = LIVE_SINCE, {**self.liveness, **AS_RECORDED}
        with self._mutex:
            try:
                row = (
                    self._conn()
                    .execute(
                        f"SELECT 1 FROM instances i WHERE i.id = %(id)s AND {live}",
                        {**timings, "id": instance_id},
                    )
                    .fetchone()
                )
            except psycopg.Error as exc:
                raise CronStoreError(f"cron: the database {self.shown} failed: {self._sync.scrub(exc)}") from None
        return row is not None


__all__ = ["PgCronStore"]
