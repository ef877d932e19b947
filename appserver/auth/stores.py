"""Where a home's capability tokens live: tokens.json in the home, or, when the home's store is a
PostgreSQL database (which several servers may share), that database (auth/pgtokens.py)."""

from __future__ import annotations

from pathlib import Path

from appserver.auth.tokens import TokenStore
from appserver.store.url import store_kind


def token_store_for(home: Path, store_url: str = "") -> TokenStore:
    if store_kind(store_url) == "postgresql":
        from appserver.auth.pgtokens import PgTokenStore  # the driver, only then

        return PgTokenStore(home, store_url.strip())
    return TokenStore(home)


__all__ = ["token_store_for"]
