"""A request whose credential stops being valid while it runs: a capability token revoked
(`appserver token revoke`, from any process) or a token or JWT past its expiry.

A WebSocket is closed with 4401 when that happens (security/ws_session.py). An HTTP request that
waits — a non-stream answer waiting for its turn, an SSE stream, either paused for an approval for
up to `approval_timeout_s` — ends the same way: its turn is cancelled (what it produced so far is
kept, as when its client leaves), and it answers with a 401 error object, or ends its stream with
the stream's error event. Polled every REVOCATION_POLL_S (one `stat` of the token file, shared), as
a WebSocket is; a request that is answered sooner never starts the poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.requests import Request

from appserver.auth import REVOCATION_POLL_S, Authenticator, Principal
from appserver.http.errors import ApiError

AUTHENTICATOR = "authenticator"  # scope["state"] key: the guard's Authenticator (security/guard.py)
REVOKED = "credential_revoked"
EXPIRED = "credential_expired"

CredentialCheck = Callable[[], ApiError | None]


def credential_check(request: Request) -> CredentialCheck | None:
    """For a request whose credential can end while it runs, a check that returns the error to
    answer with once it has; None for one that cannot end (auth mode none, a token without expiry
    that nobody can revoke here)."""
    state = request.scope.get("state") or {}
    principal, authenticator = state.get("principal"), state.get(AUTHENTICATOR)
    if not isinstance(principal, Principal) or not isinstance(authenticator, Authenticator):
        return None
    until = authenticator.valid_until(principal)
    revocable = principal.kind == "token" and authenticator.tokens is not None
    if until is None and not revocable:
        return None

    def check() -> ApiError | None:
        if revocable and authenticator.revoked(principal, max_age_s=REVOCATION_POLL_S / 2):
            return ApiError(
                401,
                "this request's credential was revoked while it ran: its turn was cancelled "
                "(what it produced so far is kept in the conversation)",
                code=REVOKED,
                headers={"x-should-retry": "false"},
            )
        if until is not None and time.time() >= until:
            return ApiError(
                401,
                "this request's credential expired while it ran: its turn was cancelled "
                "(what it produced so far is kept in the conversation)",
                code=EXPIRED,
                headers={"x-should-retry": "false"},
            )
        return None

    return check


async def ended(check: CredentialCheck) -> ApiError:
    """Wait until `check` says the credential ended; its error."""
    while True:
        await asyncio.sleep(REVOCATION_POLL_S)
        err = check()
        if err is not None:
            return err
