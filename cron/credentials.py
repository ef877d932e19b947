"""Is the credential a cron task was made for still there? A task the `schedule` tool made in a
credential's conversation carries that credential's namespace (`token:token:<name>` for a
capability token, see appserver.auth.namespace_of); once the token is revoked, deleted or expired,
its tasks must not go on submitting turns in its name. They are kept, not deleted: a token
re-created under the same name (a rotation) has the same namespace and gets its tasks back.

Only capability tokens can be checked (their store lists them); any other namespace (a JWT
subject, the tool's unowned marker) is taken as alive. A token store that cannot be read counts
every token as gone, as the server's own check of a presented token does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from appserver.auth import namespace_of
from appserver.auth.principal import Principal
from appserver.auth.stores import token_store_for
from appserver.auth.tokens import TokenRecord, TokenStore

log = logging.getLogger("appserver.cron")

TOKEN_KIND = "token"
CACHE_S = 1.0  # one read of the token store serves a whole tick

# Why a namespace's credential is gone (None: it is there, or it cannot be checked)
CredentialCheck = Callable[[str], str | None]


def token_namespace(record: TokenRecord) -> str:
    """The namespace of a capability token, exactly as a request made with it gets it (the
    principal `TokenStore.verify` builds from `TokenRecord.subject`: a reserved name of a token that
    is not the gateway's own gets a namespace of its own)."""
    return namespace_of(Principal(subject=record.subject, kind=TOKEN_KIND))


class TokenCredentials:
    """`CredentialCheck` backed by the home's token store, re-read at most every CACHE_S."""

    def __init__(self, tokens: TokenStore, *, cache_s: float = CACHE_S) -> None:
        self.tokens = tokens
        self.cache_s = cache_s
        self._live: tuple[float, frozenset[str] | str] | None = None  # (monotonic time, namespaces | error)

    @classmethod
    def for_home(cls, home: Path, store_url: str = "") -> TokenCredentials:
        return cls(token_store_for(home, store_url))

    def _namespaces(self) -> frozenset[str] | str:
        """The namespaces of the live (present, unexpired) tokens, or why they cannot be read."""
        now = time.monotonic()
        if self._live is not None and now - self._live[0] < self.cache_s:
            return self._live[1]
        try:
            wall = time.time()
            found: frozenset[str] | str = frozenset(
                token_namespace(r) for r in self.tokens.list() if not r.is_expired(wall)
            )
        except Exception as exc:  # noqa: BLE001 — a store that cannot answer revokes, never allows
            found = f"the token store cannot be read ({type(exc).__name__}: {exc})"
        self._live = (now, found)
        return found

    def close(self) -> None:
        """Let go of the token store (a database connection; the file store holds nothing)."""
        self.tokens.close()

    def __call__(self, namespace: str) -> str | None:
        if not namespace.startswith(f"{TOKEN_KIND}:"):
            return None
        live = self._namespaces()
        if isinstance(live, str):
            return live
        if namespace in live:
            return None
        return f"the token of its namespace {namespace!r} was revoked, deleted or has expired"
