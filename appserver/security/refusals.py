"""How a refusal is answered: an OpenAI error object (the one shape, from http/errors.py) over
HTTP, or over the WebSocket upgrade when the server can answer it with HTTP, else a policy close.

And how it is logged (`RefusalLog`): any client can be refused as fast as it sends, so every line
a client without a valid credential can cause (a refused request, a credential the authenticator
rejected, the close of a socket that never authenticated, and the edge's lines: its own refusals
and what connections that never authenticated do, `edge.EdgeSlot.say`) goes through the guard's
one `RefusalLog`, which `serve` hands the edge too (`EdgeLimits.from_config`): it writes the first
10 of every 10 s and counts the rest, and every part of such a line the client chose is
repr-escaped and cut (`shown`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from appserver.auth import AuthError
from appserver.auth.authenticator import CredentialRejected
from appserver.http.errors import error_body
from appserver.security.asgi import Receive, Refusal, Scope, Send
from appserver.security.edge import REFUSAL_LOG_INTERVAL_S, REFUSALS_LOGGED, TEXT_SHOWN, RefusalLines

log = logging.getLogger("appserver.guard")

WS_CLOSE_POLICY = 1008
CONNECT_TIMEOUT_S = 5.0
# A client's text in a refusal line (a path, an error message quoting its credential's header):
# this many characters of it (a path may fill the 64 KiB head); the edge's lines cut theirs so too.
PATH_SHOWN = TEXT_SHOWN


def shown(text: str, limit: int = PATH_SHOWN) -> str:
    """A client's text as a log line shows it: repr-escaped (no control character reaches the log),
    and bounded: its first `limit` characters and its length."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def shown_path(path: str) -> str:
    """A refused request's path in the log (`shown`)."""
    return shown(path)


def rejection_why(exc: AuthError) -> str:
    """What a refusal line adds for a credential the authenticator checked and refused: which one
    (by fingerprint) and why, bounded; nothing for any other refusal (no credential, a bad scope)."""
    if isinstance(exc, CredentialRejected):
        return f" ({exc.credential}: {shown(exc.message)})"
    return ""


class RefusalLog(RefusalLines):
    """The guard's lines of refusals, bounded in rate and size (`RefusalLines`): one 401 line per
    request with its 60 KiB path wrote ~5 MB/s of log; one `rejected capability token` line per
    made-up token, and an 11 KB one per JWT with an 11,500-character `alg`, came on top of it.
    One per server: the guard's requests, credentials and WebSockets, and the edge's lines (`serve`
    hands it this one), share the 10 lines per 10 s."""

    def __init__(self, per_interval: int = REFUSALS_LOGGED, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        super().__init__(log, per_interval, interval_s)

    def refused(self, kind: str, path: str, status: int, code: str, why: str = "") -> None:
        self.line(logging.INFO, "refused %s %s: %d %s%s", kind, shown_path(path), status, code, why)

    def ignored(self, path: str, exc: AuthError) -> None:
        """A credential offered on a public path (never refused there) that the authenticator
        refused: said, as a refusal, so a probe with a stale token shows, a flood of them does not."""
        self.line(
            logging.INFO,
            "ignored the credential offered on %s: %d %s%s",
            shown_path(path),
            exc.status,
            exc.code,
            rejection_why(exc),
        )

    def closed(self, path: str, code: int, reason: str) -> None:
        """The close of a WebSocket that never authenticated (its hello timed out, was refused…)."""
        self.refused("websocket", path, code, shown(reason))


def error_json(status: int, code: str, message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, content headers) of an OpenAI error answer."""
    body = json.dumps(error_body(status, message, code=code)).encode("utf-8")
    return body, [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]


async def send_http_error(send: Send, r: Refusal, extra: list[tuple[bytes, bytes]]) -> None:
    body, headers = error_json(r.status, r.code, r.message)
    await send(
        {
            "type": "http.response.start",
            "status": r.status,
            "headers": [*headers, *r.headers, *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def refuse_ws(scope: Scope, receive: Receive, send: Send, r: Refusal) -> None:
    try:
        first = await asyncio.wait_for(receive(), CONNECT_TIMEOUT_S)
    except (TimeoutError, OSError):
        return
    if first.get("type") != "websocket.connect":
        return
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body, headers = error_json(r.status, r.code, r.message)
        headers += [(k, v) for k, v in r.headers if k != b"connection"]
        await send({"type": "websocket.http.response.start", "status": r.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": WS_CLOSE_POLICY, "reason": r.code})
