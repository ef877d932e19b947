"""Which cron store a home uses: crons.json in the home, or the database of a PostgreSQL store."""

from __future__ import annotations

from pathlib import Path

from appserver.store.url import store_kind
from cron.store import CronStore


def cron_store_for(home: Path, store_url: str = "") -> CronStore:
    """Where a home's cron tasks live: crons.json in the home, or, when the home's store is a
    PostgreSQL database (which several servers may share), that database (cron/pgstore.py)."""
    if store_kind(store_url) == "postgresql":
        from cron.pgstore import PgCronStore  # the driver, only then

        return PgCronStore(home, store_url.strip())
    return CronStore(home)
