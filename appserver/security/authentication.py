"""Authentication at the door: no credentials in URLs, a credential for every non-public path (or
a loopback client in auth mode `none`), and the coarse scope its path prefix needs.

A WebSocket upgraded without credentials is let through as *pending*: it must authenticate its
`hello` frame (ws_session.py).

The check is synchronous and reads no database: capability tokens in a PostgreSQL store are
checked against the records the server holds in memory; when those cannot answer (a token the
server does not know, records too old to trust) `authenticate` raises `TokensStale`, and the
guard awaits `authenticate_fresh`, which waits for a read of the database off the event loop
(bounded: 503 `store_unavailable` with Retry-After when the database does not answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl

from appserver.auth import Authenticator, AuthError, Principal, TokensStale
from appserver.netaddr import is_loopback
from appserver.security.asgi import BEARER_CHALLENGE, Refusal, Scope
from appserver.security.headers import Headers, single
from appserver.security.memo import Memo
from appserver.security.refusals import rejection_why

PUBLIC_PATHS: frozenset[str] = frozenset({"/healthz", "/readyz"})
DEFAULT_PATH_SCOPES: Mapping[str, str] = {"/v1": "openai", "/admin": "admin", "/metrics": "admin"}
WS_SCOPE = "ws"
RETRY_AFTER = (b"retry-after", b"1")
URL_CREDENTIAL_PARAMS = frozenset({"token", "access_token", "api_key", "apikey", "api-key", "key", "jwt"})


def check_query(scope: Scope) -> None:
    """Refuse credentials in the query string (401): they end up in logs and history."""
    raw = scope.get("query_string") or b""
    if not raw:
        return
    try:
        # `;` separates too for many servers, proxies and frameworks (parse_qsl splits on `&` only)
        pairs = parse_qsl(bytes(raw).decode("latin-1").replace(";", "&"), keep_blank_values=True)
    except ValueError:
        raise Refusal(400, "invalid_query", "malformed query string") from None
    for key, _ in pairs:
        if key.strip().lower() in URL_CREDENTIAL_PARAMS:
            raise Refusal(
                401,
                "credentials_in_url",
                "credentials in the URL are refused (they end up in logs and history); "
                "send Authorization: Bearer <token>",
                [BEARER_CHALLENGE],
            )


class Authentication:
    def __init__(
        self,
        authenticator: Authenticator,
        public_paths: Iterable[str],
        path_scopes: Mapping[str, str],
    ) -> None:
        self.authenticator = authenticator
        self.public_paths = frozenset(public_paths)
        self.path_scopes = dict(path_scopes)
        self._loopback = Memo()

    def required_scope(self, scope: Scope) -> str | None:
        if scope["type"] == "websocket":
            return WS_SCOPE
        path = scope.get("path") or "/"
        for prefix, needed in self.path_scopes.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return needed
        return None

    def authenticate(self, scope: Scope, hdrs: Headers, since: float | None = None) -> tuple[Principal | None, bool]:
        """→ (principal, auth_pending), or a Refusal (401/403/503), or `TokensStale` (then await
        `authenticate_fresh`)."""
        if self.authenticator.mode == "none":
            client = scope.get("client")
            if (
                client
                and not self._loopback.check(("loopback", client[0]), lambda: is_loopback(str(client[0])))
                and scope.get("path") not in self.public_paths
            ):
                raise Refusal(403, "loopback_only", "auth mode none serves loopback clients only")
            return Principal.local(), False
        if scope.get("path") in self.public_paths:
            return None, False
        authorization = single(hdrs, b"authorization", "invalid_authorization")
        if authorization is None and scope["type"] == "websocket":
            return None, True
        try:
            principal = self.authenticator.authenticate(authorization, since=since)
        except AuthError as exc:
            raise _refusal(exc) from None
        needed = self.required_scope(scope)
        if needed is not None and not principal.has_scope(needed):
            raise Refusal(403, "insufficient_scope", f"this credential lacks the '{needed}' scope")
        return principal, False

    async def authenticate_fresh(
        self, scope: Scope, hdrs: Headers, stale: TokensStale
    ) -> tuple[Principal | None, bool]:
        """`authenticate` once the token store has read its database (off the event loop)."""
        try:
            await stale.wait()
            return self.authenticate(scope, hdrs, since=stale.asked_at)
        except AuthError as exc:
            raise _refusal(exc) from None
        except TokensStale:  # not after a read that succeeded; never a 500 if it ever is
            raise Refusal(
                503, "store_unavailable", "the capability tokens could not be read: retry", [RETRY_AFTER]
            ) from None


class CredentialRefusal(Refusal):
    """A refusal the authenticator answered: `why` is what the guard's refusal line adds (the
    rejected credential's fingerprint and the reason, bounded; `refusals.rejection_why`)."""

    def __init__(self, exc: AuthError) -> None:
        headers = [BEARER_CHALLENGE] if exc.status == 401 else [RETRY_AFTER] if exc.status == 503 else []
        super().__init__(exc.status, exc.code, exc.message, headers)
        self.why = rejection_why(exc)


def _refusal(exc: AuthError) -> Refusal:
    return CredentialRefusal(exc)
