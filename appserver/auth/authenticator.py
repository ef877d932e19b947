"""The Authenticator: credentials → Principal for the configured mode (none | token | jwt).

Nothing here knows about HTTP or WebSocket framing: the security middleware (`appserver.security`)
and the protocol layer call `authenticate(header)` / `authenticate_hello(token)` and get a
`Principal` or a typed `AuthError` carrying the status and the OpenAI error code to answer with.

A credential it looked at and refused is a `CredentialRejected`, naming it by fingerprint. It logs
none of them itself: any client can send made-up credentials as fast as it can, so the guard logs
each refusal within its bounded refusal lines (`appserver.security.refusals.RefusalLog`), the
fingerprint in it.
"""

from __future__ import annotations

import logging
import math
import re
import time

from appserver.auth.errors import AuthError, TokensStale, unauthorized
from appserver.auth.jwt import JwtVerifier
from appserver.auth.principal import Principal
from appserver.auth.stores import token_store_for
from appserver.auth.tokens import TokenStore, fingerprint
from appserver.config import Config, ConfigError

log = logging.getLogger("appserver.auth")

HELLO_TIMEOUT_S = 5.0
# Past the hello window, before the close, once: after a stall of the event loop (a long GC, a VM
# pause) its timer fires before the reader has taken a hello that waits in the socket, and the
# client that sent it in time would be closed and blamed.
HELLO_GRACE_S = 0.5
# A capability token is 47 characters; anything far longer is no token.
TOKEN_MAX_CHARS = 8192
# A JWT carries its claims (groups, roles): 16 KiB, as common header limits, and well within the
# edge's 64 KiB head; verifying it is linear in its length.
JWT_MAX_CHARS = 16384
REVOCATION_POLL_S = 0.5  # how often a live WebSocket's capability token is re-checked
# A JWT the checks did not foresee: its traceback is logged at most this often (any client can send
# the same one again and again); otherwise its refusal is the guard's bounded line.
UNFORESEEN_TRACEBACK_EVERY_S = 60.0
_TOKEN68 = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")


class CredentialRejected(AuthError):
    """A credential that was checked and refused (unknown, expired, revoked, a JWT that fails a
    check). `credential` names it for the log without showing it (`capability token sha256:…`,
    `JWT sha256:…`); the caller logs it, bounded, among its refusals."""

    def __init__(self, status: int, code: str, message: str, credential: str) -> None:
        super().__init__(status, code, message)
        self.credential = credential


class Authenticator:
    """Turns credentials into a Principal for the configured mode (none | token | jwt).

    Built once at startup; key material is loaded here so a bad config fails `serve` early.
    """

    hello_timeout_s: float = HELLO_TIMEOUT_S

    def __init__(self, config: Config, token_store: TokenStore | None = None) -> None:
        self.mode = config.auth.mode
        if self.mode not in ("none", "token", "jwt"):
            raise ConfigError(f"[auth] mode must be none, token or jwt; got {self.mode!r}")
        self.tokens: TokenStore | None = None
        self.jwt: JwtVerifier | None = None
        self._traceback_logged_at = -math.inf
        if self.mode == "token":
            self.tokens = token_store or token_store_for(config.home, config.store.url)
            self.tokens.check()
        elif self.mode == "jwt":
            self.jwt = JwtVerifier(config.auth, base_dir=config.home)

    def close(self) -> None:
        """Let go of the token store's database connection (and its reader thread)."""
        if self.tokens is not None:
            self.tokens.close()

    @property
    def required(self) -> bool:
        return self.mode != "none"

    def secrets(self) -> list[str]:
        """Configured secrets the log redactor should know about."""
        return self.jwt.secrets() if self.jwt else []

    def valid_until(self, principal: Principal) -> float | None:
        """When a live connection authenticated as `principal` must end (Unix time; None: never).

        A JWT stays valid for `jwt_leeway_s` past its `exp`: that is the instant a new request
        with the same JWT starts failing, so a socket closed any earlier could simply reconnect.
        A capability token's expiry is our own clock: no leeway.
        """
        if principal.expires_at is None:
            return None
        if principal.kind == "jwt" and self.jwt is not None:
            return principal.expires_at + self.jwt.leeway
        return principal.expires_at

    def revoked(self, principal: Principal, *, max_age_s: float = 0.0) -> bool:
        """Has the credential behind a live connection been revoked since it authenticated?

        Capability tokens only (`appserver token revoke`, from any process: the token file is
        re-read when it changes); a JWT cannot be revoked, it ends at its expiry.
        """
        if self.tokens is None or principal.kind != "token" or principal.token_id is None:
            return False
        return not self.tokens.live(principal.token_id, max_age_s=max_age_s)

    def authenticate(self, authorization: str | None, *, since: float | None = None) -> Principal:
        """From an `Authorization` header value (None if absent) → Principal, or AuthError.

        With capability tokens in a database (auth/pgtokens.py) it may raise `TokensStale`
        instead: await its `wait()` and call again with `since=stale.asked_at`."""
        if self.mode == "none":
            return Principal.local()
        if authorization is None or not authorization.strip():
            raise unauthorized("missing_api_key", "authentication required: send Authorization: Bearer <token>")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise unauthorized("invalid_api_key", "unsupported authorization scheme; use Bearer")
        return self.verify_token(token.strip(), since=since)

    def authenticate_hello(self, token: str | None, *, since: float | None = None) -> Principal:
        """For the WebSocket `hello {token}` frame: the same check as a Bearer header (and the
        same `TokensStale`)."""
        if self.mode == "none":
            return Principal.local()
        if not isinstance(token, str) or not token.strip():
            raise unauthorized("missing_api_key", "authentication required: send a token in hello")
        return self.verify_token(_hello_token(token), since=since)

    async def settle_hello(self, token: object) -> float | None:
        """Before `authenticate_hello(token, since=…)` on the event loop: when the token store
        must read its database to answer for this token, wait for that read (off the loop; AuthError
        503 when the database does not answer in time) and return the `since` to pass; else None."""
        if self.mode != "token" or self.tokens is None or not isinstance(token, str):
            return None
        tok = _hello_token(token)
        if not tok or len(tok) > TOKEN_MAX_CHARS or not _TOKEN68.match(tok):
            return None
        try:
            self.tokens.verify(tok)
        except TokensStale as stale:
            await stale.wait()
            return stale.asked_at
        return None

    def verify_token(self, token: str, *, since: float | None = None) -> Principal:
        if self.mode == "jwt":
            return self._verify_jwt(token)
        if not token or len(token) > TOKEN_MAX_CHARS or not _TOKEN68.match(token):
            raise unauthorized("invalid_api_key", "malformed bearer token")
        if self.mode == "token":
            assert self.tokens is not None
            p = self.tokens.verify(token) if since is None else self.tokens.verify(token, since=since)
            if p is None:
                raise CredentialRejected(
                    401,
                    "invalid_api_key",
                    "invalid, expired or revoked token",
                    f"capability token {fingerprint(token)}",
                )
            return p
        return Principal.local()

    def _verify_jwt(self, token: str) -> Principal:
        assert self.jwt is not None
        if len(token) > JWT_MAX_CHARS:
            raise unauthorized(
                "invalid_token",
                f"the JWT has {len(token)} characters, more than the limit of {JWT_MAX_CHARS} "
                "(docs/security.md, auth mode jwt): issue it with fewer claims",
            )
        if not token or not _TOKEN68.match(token):
            raise unauthorized("invalid_token", "malformed bearer token: not a JWT")
        try:
            return self.jwt.verify(token)
        except AuthError as exc:
            raise CredentialRejected(exc.status, exc.code, exc.message, f"JWT {fingerprint(token)}") from None
        except Exception as exc:  # a claim the checks did not foresee: refused, and loudly, never a 500
            self._log_unforeseen(token, exc)
            raise CredentialRejected(
                401, "invalid_token", "the JWT could not be verified", f"JWT {fingerprint(token)}"
            ) from None

    def _log_unforeseen(self, token: str, exc: Exception) -> None:
        """Its traceback (a bug to report) at most every UNFORESEEN_TRACEBACK_EVERY_S, so a client
        repeating such a JWT cannot fill the log with them; each refusal is the guard's line."""
        now = time.monotonic()
        if now - self._traceback_logged_at >= UNFORESEEN_TRACEBACK_EVERY_S:
            self._traceback_logged_at = now
            log.error(
                "JWT %s could not be verified (its traceback is logged at most every %.0f s)",
                fingerprint(token),
                UNFORESEEN_TRACEBACK_EVERY_S,
                exc_info=exc,
            )


def _hello_token(token: str) -> str:
    tok = token.strip()
    if tok[:7].lower() == "bearer ":
        tok = tok[7:].strip()
    return tok
