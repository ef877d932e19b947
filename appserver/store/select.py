"""Which Store a configuration names: `[store] url` (or `serve --store URL`).

Empty: the SQLite file in the home (`Config.db_path`). `postgresql://…`: a PostgreSQL database,
whose driver (psycopg) is imported only then, so `appserver --help` and SQLite homes never load it.

Either store upgrades an older schema when opened, except under a live server of the older version
(serverinfo.upgrade_refusal, serves_home): a read-only command of a newly installed CLI gave the
running server a schema it was never written for, and locked out its own CLI and its restart.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from appserver.serverinfo import serves_home, upgrade_refusal
from appserver.store.sqlite import SQLiteStore
from appserver.store.url import store_kind

if TYPE_CHECKING:
    from appserver.config import Config
    from appserver.store.postgres import PostgresStore


def make_store(config: Config, url: str | None = None) -> SQLiteStore | PostgresStore:
    """The store for `config` (not opened yet); `url` overrides `config.store.url`. A URL of an
    unknown kind raises ConfigError (the URL shown without its password)."""
    from appserver.config import ConfigError  # at call time: the config imports this package

    url = config.store.url if url is None else url
    try:
        kind = store_kind(url)
    except ValueError as exc:
        raise ConfigError(f"[store] url: {exc}") from None
    if kind == "sqlite":
        sqlite_store = SQLiteStore(config.db_path)
        sqlite_store.upgrade_refusal = partial(upgrade_refusal, config.server_json)
        return sqlite_store
    from appserver.store.postgres import PostgresStore  # the driver, only for a PostgreSQL store

    store = PostgresStore(url.strip())
    store.heartbeat_s = config.store.heartbeat_s
    store.instance_timeout_s = max(config.store.instance_timeout_s, 3 * config.store.heartbeat_s)
    store.lock_timeout_s = config.store.lock_timeout_s
    store.statement_timeout_s = config.store.statement_timeout_s
    store.connect_timeout_s = config.store.connect_timeout_s
    store.address = config.server.listen
    store.may_upgrade_live = partial(serves_home, config.server_json)
    return store
