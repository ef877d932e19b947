"""`SecurityGuard`: one pure ASGI middleware in front of every HTTP request and WebSocket.

Mounted outermost, it applies to every route that exists now or is added later, so no route can
forget a check. It runs the checks of this package in order: Host (hostcheck.py), Origin and CORS
preflight (origin.py), credentials in URLs, authentication and coarse scopes (authentication.py),
body size and per-client concurrency (limits.py); then the app, with the streamed body limited
(HTTP) or under a session (WebSocket: frame size, the 5 s `hello` window, the expiry and
revocation of a live socket's credential, ws_session.py). It also gives each request its id: the
`x-request-id` of every answer (refusals included) and the `[req_…]` prefix of the log lines
written meanwhile. (Limits that must hold before a request even exists, on the head and the
connection, are in `appserver.security.edge`.)

What the app sees in `scope["state"]` (Starlette: `request.state` / `websocket.state`):
  * `principal`: the `Principal`, or None on a public path (or a WebSocket awaiting `hello`);
  * `auth_pending`: True on a WebSocket upgraded without credentials (token/jwt mode); the
    protocol layer must authenticate the `hello` frame before doing anything else;
  * `authenticate_hello`: (WebSocket only) `fn(token) -> Principal`, raises `AuthError`. It checks
    the token, requires the `ws` scope, moves the socket from its address's sockets waiting for
    their hello (`limits.PendingSockets`) to a slot of the credential (`AuthError` 429
    `too_many_connections` when the credential's are all taken: the protocol closes with 4429),
    stores the principal, clears `auth_pending` and re-arms the expiry timer. Without it within
    `Authenticator.hello_timeout_s`, or when newer sockets of its address took its place, the
    guard closes with 4401.

Refused WebSocket upgrades get a real HTTP response (403/401/421/400) through the
`websocket.http.response` extension when the server offers it, else a close before accept
(which servers turn into 403).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from appserver.auth import Authenticator, TokensStale
from appserver.config import Config, ConfigError
from appserver.http.requestid import HEADER as REQUEST_ID_HEADER
from appserver.http.requestid import begin_request, end_request
from appserver.netaddr import BindRefused, check_bind_allowed, parse_listen
from appserver.security.asgi import ASGIApp, Message, Receive, Refusal, Scope, Send, prove
from appserver.security.authentication import (
    DEFAULT_PATH_SCOPES,
    PUBLIC_PATHS,
    Authentication,
    check_query,
)
from appserver.security.headers import guarded_headers
from appserver.security.hostcheck import HostCheck
from appserver.security.limits import BodyLimit, ClientSlots, PendingSockets, SlotHold, slot_key
from appserver.security.origin import OriginCheck, cors_headers, is_preflight, preflight
from appserver.security.refusals import refuse_ws, send_http_error
from appserver.security.ws_session import run_ws

log = logging.getLogger("appserver.guard")

_STAMPED = frozenset({"http.response.start", "websocket.accept", "websocket.http.response.start"})


BODY_SEND = "body_send"


def _stamp_request_id(send: Send, rid: bytes) -> Send:
    """`send` that adds `x-request-id` to the response head (unless the app set it already)."""

    async def stamped(message: Message) -> None:
        if message["type"] in _STAMPED:
            headers = list(message.get("headers") or ())
            if not any(bytes(k).lower() == REQUEST_ID_HEADER for k, _ in headers):
                headers.append((REQUEST_ID_HEADER, rid))
            message = {**message, "headers": headers}
        await send(message)

    return stamped


class SecurityGuard:
    """Pure ASGI middleware enforcing §7 on all `http` and `websocket` scopes."""

    def __init__(
        self,
        app: ASGIApp,
        config: Config,
        authenticator: Authenticator,
        *,
        public_paths: Iterable[str] = PUBLIC_PATHS,
        path_scopes: Mapping[str, str] = DEFAULT_PATH_SCOPES,
        enforce_bind_rule: bool = True,
    ) -> None:
        self.app = app
        self.authenticator = authenticator
        listen = parse_listen(config.server.listen)
        if enforce_bind_rule:
            try:
                check_bind_allowed(listen, authenticator.mode)
            except BindRefused as exc:
                raise ConfigError(str(exc)) from None
        self.hosts = HostCheck(listen, config.server.allowed_hosts)
        self.origins = OriginCheck(config.server.allowed_origins)
        self.authentication = Authentication(authenticator, public_paths, path_scopes)
        self.body = BodyLimit(int(config.limits.body_max_bytes))
        self.slots = ClientSlots(int(config.limits.connections_per_client))
        self.pending = PendingSockets(int(config.limits.connections_per_client))
        self.frame_max = int(config.limits.ws_frame_max_bytes)
        self.hello_timeout_s = float(authenticator.hello_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # Every answer, the guard's own refusals included, carries the request id that the log
        # lines written while handling it carry (appserver/http/requestid.py).
        rid, token = begin_request()
        try:
            await self._handle(scope, receive, _stamp_request_id(send, rid.encode("ascii")), kind, send)
        finally:
            end_request(token)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, kind: str, server_send: Send) -> None:
        origin: str | None = None
        try:
            hdrs = guarded_headers(scope)
            self.hosts.check(hdrs)
            origin = self.origins.check(hdrs)
            if kind == "http" and origin is not None and is_preflight(scope, hdrs):
                await preflight(send, origin, hdrs)
                return
            check_query(scope)
            try:
                principal, pending = self.authentication.authenticate(scope, hdrs)
            except TokensStale as stale:  # the token store reads its database first, off the loop
                principal, pending = await self.authentication.authenticate_fresh(scope, hdrs, stale)
            if principal is not None:
                prove(scope)  # the connection keeps its slot at the cap (edge.py)
            if kind == "http":
                self.body.check_length(hdrs)
            client = slot_key(scope, principal)
            # A WebSocket that will authenticate in `hello` is never refused for its address's
            # unauthenticated sockets: it waits among them (limits.PendingSockets), not in the slots.
            waiting = kind == "websocket" and pending
            if not waiting:
                self.slots.check(client)
        except Exception as exc:
            if isinstance(exc, Refusal):
                r = exc
                log.info("refused %s %r: %d %s", kind, scope.get("path", "?"), r.status, r.code)
            else:  # a check's own failure: still an error object with the request id, never a bare 500
                log.exception("the guard's checks failed on %s %r", kind, scope.get("path", "?"))
                r = Refusal(500, "internal_error", "the server could not check this request")
            if kind == "http":
                await send_http_error(send, r, cors_headers(origin))
            else:
                await refuse_ws(scope, receive, send, r)
            return

        scope = dict(scope)
        state = dict(scope.get("state") or {})
        state["principal"] = principal
        state["auth_pending"] = pending
        state["hello_timeout_s"] = self.hello_timeout_s  # every WebSocket owes its hello within it
        # For a request that waits: its credential may end meanwhile (http/credential_end.py).
        state["authenticator"] = self.authenticator
        # The server's own `send`, for a streamed body once its head went out through the whole
        # chain (the wrappers only touch the head: request id, CORS): one call per chunk instead
        # of five (appserver/http/sse.py).
        state[BODY_SEND] = server_send
        scope["state"] = state
        hold = SlotHold(self.slots, client, self.pending if waiting else None)
        hold.acquire()
        try:
            if kind == "http":
                await self._run_http(scope, receive, send, origin)
            else:
                await run_ws(
                    self.app,
                    scope,
                    receive,
                    send,
                    state,
                    self.authenticator,
                    self.hello_timeout_s,
                    self.frame_max,
                    hold,
                )
        finally:
            # (a WebSocket authenticated by `hello` holds its credential's slot by now: that one)
            hold.release()

    async def _run_http(self, scope: Scope, receive: Receive, send: Send, origin: str | None) -> None:
        """Run the app with CORS headers on its answer and its streamed body held to the limit."""
        limit = self.body.body_max
        received = 0
        tripped = False
        started = False
        cors = cors_headers(origin)

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if tripped:
                return  # the guard already answered 413
            if message["type"] == "http.response.start":
                started = True
                if cors:
                    message = dict(message)
                    message["headers"] = [*(message.get("headers") or []), *cors]
            await send(message)

        async def guarded_receive() -> Message:
            nonlocal received, tripped, started
            if tripped:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body") or b"")
                if received > limit:
                    tripped = True
                    log.info("refused http %r: 413 streamed body over limit", scope.get("path"))
                    if not started:
                        started = True
                        await send_http_error(send, self.body.too_large(), cors)
                    return {"type": "http.disconnect"}
            return message

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if tripped:
                return  # the app choked on the disconnect we injected; the client has its 413
            raise
