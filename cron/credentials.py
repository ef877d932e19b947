"""Is the credential a cron task was made for still there, and may it still use the task's agent?
A task the `schedule` tool made in a credential's conversation carries that credential's namespace
(`token:token:<name>` for a capability token, see appserver.auth.namespace_of); once the token is
revoked, deleted or expired, its tasks must not go on submitting turns in its name. Nor once it was
narrowed (a rotation to a token of the same name limited to other agents, or without a scope that
submits turns): the task runs only what a request made with the live token could run. Tasks are
kept, not deleted: a token re-created under the same name (a rotation) has the same namespace and
gets its tasks back when it may use their agent.

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

TURN_SCOPES = frozenset({"openai", "ws"})  # a request with either may submit turns

# Why the credential of a namespace (1st) may not run a turn on an agent (2nd: its id; 3rd: its
# name, None when unknown): None when it may, or when it cannot be checked
CredentialCheck = Callable[[str, str, str | None], str | None]


def token_namespace(record: TokenRecord) -> str:
    """The namespace of a capability token, exactly as a request made with it gets it (the
    principal `TokenStore.verify` builds from `TokenRecord.subject`: a reserved name of a token that
    is not the gateway's own gets a namespace of its own)."""
    return namespace_of(record.principal())


class TokenCredentials:
    """`CredentialCheck` backed by the home's token store, re-read at most every CACHE_S."""

    def __init__(self, tokens: TokenStore, *, cache_s: float = CACHE_S) -> None:
        self.tokens = tokens
        self.cache_s = cache_s
        # (monotonic time, the live tokens' principals by namespace | why they cannot be read)
        self._live: tuple[float, dict[str, list[Principal]] | str] | None = None

    @classmethod
    def for_home(cls, home: Path, store_url: str = "") -> TokenCredentials:
        return cls(token_store_for(home, store_url))

    def _namespaces(self) -> dict[str, list[Principal]] | str:
        """The live (present, unexpired) tokens by namespace, as the principals a request made with
        each would get, or why they cannot be read."""
        now = time.monotonic()
        if self._live is not None and now - self._live[0] < self.cache_s:
            return self._live[1]
        found: dict[str, list[Principal]] | str
        try:
            wall = time.time()
            live: dict[str, list[Principal]] = {}
            for r in self.tokens.list():
                if not r.is_expired(wall):
                    live.setdefault(token_namespace(r), []).append(r.principal())
            found = live
        except Exception as exc:  # noqa: BLE001 — a store that cannot answer revokes, never allows
            found = f"the token store cannot be read ({type(exc).__name__}: {exc})"
        self._live = (now, found)
        return found

    def close(self) -> None:
        """Let go of the token store (a database connection; the file store holds nothing)."""
        self.tokens.close()

    def __call__(self, namespace: str, agent_id: str, agent_name: str | None = None) -> str | None:
        if not namespace.startswith(f"{TOKEN_KIND}:"):
            return None
        live = self._namespaces()
        if isinstance(live, str):
            return live
        principals = live.get(namespace)
        if not principals:
            return f"the token of its namespace {namespace!r} was revoked, deleted or has expired"
        if not any(p.scopes & TURN_SCOPES for p in principals):
            return (
                f"the token of its namespace {namespace!r} may no longer submit turns (its scopes: "
                f"{', '.join(sorted(principals[0].scopes)) or 'none'})"
            )
        if not any(p.scopes & TURN_SCOPES and p.allows_agent(agent_id, agent_name) for p in principals):
            shown = f"{agent_name} ({agent_id})" if agent_name else agent_id
            return f"the token of its namespace {namespace!r} may no longer use the task's agent {shown}"
        return None
