"""`SecurityGuard`: one pure ASGI middleware in front of every HTTP request and WebSocket.

Mounted outermost, it applies to every route that exists now or is added later, so no route can
forget a check: Host (DNS rebinding), Origin (browser pages), credentials in URLs, authentication,
coarse scopes, body size, per-client concurrency, WebSocket frame size, the 5 s `hello` window and
the expiry of a live WebSocket's credential. It also gives each request its id: the `x-request-id`
of every answer (refusals included) and the `[req_…]` prefix of the log lines written meanwhile.
(Limits that must hold before a request even exists, on the head and the connection, are in
`appserver.http.edge`.)

What the app sees in `scope["state"]` (Starlette: `request.state` / `websocket.state`):
  * `principal`: the `Principal`, or None on a public path (or a WebSocket awaiting `hello`);
  * `auth_pending`: True on a WebSocket upgraded without credentials (token/jwt mode); the
    protocol layer must authenticate the `hello` frame before doing anything else;
  * `authenticate_hello`: (WebSocket only) `fn(token) -> Principal`, raises `AuthError`. It checks
    the token, requires the `ws` scope, stores the principal, clears `auth_pending` and re-arms the
    expiry timer. Without it within `Authenticator.hello_timeout_s` the guard closes with 4401.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from appserver.auth import REVOCATION_POLL_S, Authenticator, AuthError, Principal
from appserver.config import Config, ConfigError
from appserver.http.requestid import HEADER as REQUEST_ID_HEADER
from appserver.http.requestid import begin_request, end_request
from appserver.netaddr import (
    BindRefused,
    check_bind_allowed,
    is_ip_literal,
    is_loopback,
    parse_listen,
    split_host_header,
)

log = logging.getLogger("appserver.guard")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS: frozenset[str] = frozenset({"/healthz", "/readyz"})
DEFAULT_PATH_SCOPES: Mapping[str, str] = {"/v1": "openai", "/admin": "admin"}
WS_SCOPE = "ws"
URL_CREDENTIAL_PARAMS = frozenset(
    {"token", "access_token", "api_key", "apikey", "api-key", "key", "jwt"}
)
CORS_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_EXPOSE_HEADERS = "X-Conversation-Id, X-Request-Id"

WS_CLOSE_AUTH = 4401  # credential missing/expired on a live socket (4000-4999: application codes)
WS_CLOSE_TOO_BIG = 1009
WS_CLOSE_POLICY = 1008
CONNECT_TIMEOUT_S = 5.0
CLOSE_SEND_TIMEOUT_S = 5.0

_GUARDED_HEADERS = frozenset(
    {
        b"host",
        b"origin",
        b"authorization",
        b"content-length",
        b"access-control-request-method",
        b"access-control-request-headers",
    }
)
_CONTROL = re.compile("[\x00-\x1f\x7f]")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_error(status: int, code: str, message: str) -> dict[str, Any]:
    """The OpenAI error object (`ErrorResponse` in the OpenAPI description)."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": None,
            "code": code,
        }
    }


_STAMPED = frozenset({"http.response.start", "websocket.accept", "websocket.http.response.start"})


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


class _Refusal(Exception):
    def __init__(
        self, status: int, code: str, message: str, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = list(headers)


class ClientGone(OSError):
    """Raised to the app when it sends on a WebSocket the guard already closed (Starlette turns an
    OSError from send into WebSocketDisconnect, as it does for a vanished client)."""


def _normalize_origin(value: str) -> str:
    """`HTTPS://Example.com:443/` → `https://example.com`; opaque/odd values compare literally."""
    v = value.strip()
    if v.lower() == "null" or "://" not in v:
        return v.lower()
    try:
        parts = urlsplit(v)
        host = (parts.hostname or "").lower()
        port = parts.port
    except ValueError:
        return v.lower()
    scheme = parts.scheme.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or (scheme, port) in (("http", 80), ("https", 443)):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


class _WsSession:
    """Per-WebSocket state: serialised sends, the close the guard may impose, the auth timers."""

    def __init__(
        self,
        state: dict[str, Any],
        send: Send,
        authenticator: Authenticator,
        hello_deadline: float | None,
        path: str = "/ws",
        http_refusals: bool = False,
    ) -> None:
        self.state = state
        self.path = path
        # The server can answer a refused upgrade with an HTTP response (`websocket.http.response`).
        self.http_refusals = http_refusals
        self._send = send
        self.authenticator = authenticator
        self.hello_deadline = hello_deadline
        self.lock = asyncio.Lock()
        self.changed = asyncio.Event()
        self.accepted = False
        self.closed = False
        self.closed_by_guard: tuple[int, str] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def ensure_watch(self) -> None:
        """Run the deadline watcher if there is a deadline (or a revocable credential) and it is
        not running yet."""
        if self.closed or (self.next_deadline() is None and not self.revocable()):
            return
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self.watch())

    async def stop_watch(self) -> None:
        task, self._watcher = self._watcher, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await asyncio.wait_for(task, 1.0)
        except (asyncio.CancelledError, TimeoutError):
            pass

    def authenticate_hello(self, token: str | None) -> Principal:
        if self.closed:
            raise AuthError(401, "connection_closed", "the connection is closed")
        if (
            self.state.get("auth_pending")
            and self.hello_deadline is not None
            and time.time() > self.hello_deadline
        ):
            raise AuthError(401, "auth_timeout", "authentication window elapsed")
        principal = self.authenticator.authenticate_hello(token)
        if not principal.has_scope(WS_SCOPE):
            raise AuthError(
                403, "insufficient_scope", f"this credential lacks the '{WS_SCOPE}' scope"
            )
        self.state["principal"] = principal
        self.state["auth_pending"] = False
        self.changed.set()
        self.ensure_watch()
        return principal

    async def send(self, message: Message) -> None:
        async with self.lock:
            if self.closed_by_guard is not None:
                if message["type"] == "websocket.close":
                    return
                raise ClientGone(f"websocket closed by the server: {self.closed_by_guard[1]}")
            t = message["type"]
            if t == "websocket.close" and not self.accepted and not self.closed and self.http_refusals:
                await self._refuse_upgrade()
                return
            if t == "websocket.accept":
                self.accepted = True
            elif t in ("websocket.close", "websocket.http.response.start"):
                self.closed = True
                self.changed.set()
            await self._send(message)

    async def _refuse_upgrade(self) -> None:
        """The app closed before accepting (no WebSocket endpoint at this path): answer with an
        HTTP error like every other refusal (OpenAI error JSON, `x-request-id` added by the
        stamping `send`), not the server's bare `403 text/plain`."""
        self.closed = True
        self.changed.set()
        shown = self.path[:200]
        body = json.dumps(
            openai_error(403, "websocket_refused", f"no WebSocket endpoint at {shown}; the protocol is at /ws")
        ).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await self._send({"type": "websocket.http.response.start", "status": 403, "headers": headers})
        await self._send({"type": "websocket.http.response.body", "body": body})

    async def close(self, code: int, reason: str) -> None:
        """Close on the app's behalf (expiry, timeout, oversized frame); the app then sees a
        disconnect on receive and `ClientGone` on send."""
        async with self.lock:
            if self.closed:
                return
            self.closed = True
            self.closed_by_guard = (code, reason)
            self.changed.set()
            msg: Message = {"type": "websocket.close", "code": code, "reason": reason}
            log.info("closing websocket %s: %s", code, reason)
            try:
                await asyncio.wait_for(self._send(msg), CLOSE_SEND_TIMEOUT_S)
            except (OSError, RuntimeError, TimeoutError) as exc:
                log.debug("websocket close failed: %r", exc)

    def revocable(self) -> bool:
        p = self.state.get("principal")
        return isinstance(p, Principal) and p.kind == "token" and self.authenticator.tokens is not None

    def revoked(self, max_age_s: float = 0.0) -> bool:
        """The socket's capability token was revoked (`appserver token revoke`, any process)."""
        p = self.state.get("principal")
        return isinstance(p, Principal) and self.authenticator.revoked(p, max_age_s=max_age_s)

    def next_deadline(self) -> tuple[float, str] | None:
        if self.state.get("auth_pending"):
            if self.hello_deadline is None:
                return None
            return self.hello_deadline, "authentication timeout: no valid token in hello"
        p = self.state.get("principal")
        if isinstance(p, Principal):
            until = self.authenticator.valid_until(p)
            if until is not None:
                return until, "credential expired"
        return None

    async def watch(self) -> None:
        """Close the socket when the hello window or the credential's lifetime runs out, or when
        its token is revoked (polled every REVOCATION_POLL_S: one `stat` shared by all sockets)."""
        while not self.closed:
            if self.revoked(max_age_s=REVOCATION_POLL_S / 2):
                await self.close(WS_CLOSE_AUTH, "credential revoked")
                return
            nxt = self.next_deadline()
            poll = REVOCATION_POLL_S if self.revocable() else None
            if nxt is None and poll is None:
                return
            delay = 3600.0
            if nxt is not None:
                deadline, reason = nxt
                delay = deadline - time.time()
                if delay <= 0:
                    await self.close(WS_CLOSE_AUTH, reason)
                    return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(delay, poll or 3600.0, 3600.0))
            except TimeoutError:
                pass


class SecurityGuard:
    """Pure ASGI middleware enforcing §7 on all `http` and `websocket` scopes.

    Host policy: a Host that is well formed but not ours (not loopback, not the listen host, not in
    `allowed_hosts`) gets **421 Misdirected Request**: RFC 9110 §15.5.20 defines it for a request
    aimed at an authority this server does not serve, which is exactly what a DNS-rebinding page
    produces; a client may legitimately retry elsewhere. A Host that is missing, duplicated or
    malformed gets 400 because the request itself is broken. On a wildcard bind (0.0.0.0 / ::) IP
    literals are accepted too: the server cannot know its addresses, and a rebinding attack always
    arrives with the attacker's DNS name, never an IP literal.

    Refused WebSocket upgrades get a real HTTP response (403/401/421/400) through the
    `websocket.http.response` extension when the server offers it, else a close before accept
    (which servers turn into 403).
    """

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
        self.listen = parse_listen(config.server.listen)
        if enforce_bind_rule:
            try:
                check_bind_allowed(self.listen, authenticator.mode)
            except BindRefused as exc:
                raise ConfigError(str(exc)) from None
        self.public_paths = frozenset(public_paths)
        self.path_scopes = dict(path_scopes)
        self.body_max = int(config.limits.body_max_bytes)
        self.frame_max = int(config.limits.ws_frame_max_bytes)
        self.per_client = int(config.limits.connections_per_client)
        self.hello_timeout_s = float(authenticator.hello_timeout_s)
        self.allow_any_host = False
        self.allowed_hosts: set[tuple[str, int | None]] = set()
        for entry in config.server.allowed_hosts:
            if entry.strip() == "*":
                self.allow_any_host = True
                continue
            try:
                self.allowed_hosts.add(split_host_header(entry))
            except ValueError:
                raise ConfigError(f"[server] allowed_hosts: invalid entry {entry!r}") from None
        self.allowed_origins = {
            _normalize_origin(o) for o in config.server.allowed_origins if o.strip()
        }
        if "*" in self.allowed_origins:
            raise ConfigError("[server] allowed_origins: '*' is not supported; list each origin")
        self._active: dict[str, int] = {}
        # Results of the pure address checks (Host allowed, client on loopback), bounded.
        self._memo: dict[tuple[Any, ...], bool] = {}

    def _memoized(self, key: tuple[Any, ...], check: Callable[[], bool]) -> bool:
        """Speed only: the same Host header or client address gives the same answer."""
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= 1024:
                self._memo.clear()
            hit = self._memo[key] = check()
        return hit

    # ── entry point ───────────────────────────────────────────────────────────────────────────

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # Every answer, the guard's own refusals included, carries the request id that the log
        # lines written while handling it carry (appserver/http/requestid.py).
        rid, token = begin_request()
        try:
            await self._handle(scope, receive, _stamp_request_id(send, rid.encode("ascii")), kind)
        finally:
            end_request(token)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        origin: str | None = None
        try:
            hdrs = self._headers(scope)
            self._check_host(hdrs)
            origin = self._check_origin(hdrs)
            if kind == "http" and origin is not None and self._is_preflight(scope, hdrs):
                await self._preflight(send, origin, hdrs)
                return
            self._check_query(scope)
            principal, pending = self._authenticate(scope, hdrs)
            if kind == "http":
                self._check_length(hdrs)
            client = self._client_key(scope)
            if (
                client is not None
                and self.per_client > 0
                and self._active.get(client, 0) >= self.per_client
            ):
                raise _Refusal(
                    429, "too_many_connections", "too many concurrent requests from this client"
                )
        except _Refusal as r:
            log.info("refused %s %r: %d %s", kind, scope.get("path", "?"), r.status, r.code)
            if kind == "http":
                await self._send_http_error(send, r, origin)
            else:
                await self._refuse_ws(scope, receive, send, r)
            return

        scope = dict(scope)
        state = dict(scope.get("state") or {})
        state["principal"] = principal
        state["auth_pending"] = pending
        scope["state"] = state
        if client is not None:
            self._active[client] = self._active.get(client, 0) + 1
        try:
            if kind == "http":
                await self._run_http(scope, receive, send, origin)
            else:
                await self._run_ws(scope, receive, send, state)
        finally:
            if client is not None:
                left = self._active.get(client, 1) - 1
                if left > 0:
                    self._active[client] = left
                else:
                    self._active.pop(client, None)

    # ── checks ────────────────────────────────────────────────────────────────────────────────

    @staticmethod
    def _headers(scope: Scope) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for item in scope.get("headers") or ():
            try:
                name, value = item
            except (TypeError, ValueError):
                raise _Refusal(400, "invalid_header", "malformed header") from None
            if type(name) is not bytes or type(value) is not bytes:  # bytes: the usual case
                if not isinstance(name, bytes | bytearray) or not isinstance(
                    value, bytes | bytearray
                ):
                    raise _Refusal(400, "invalid_header", "malformed header")
                name, value = bytes(name), bytes(value)
            lname = name.lower()
            if lname in _GUARDED_HEADERS:
                out.setdefault(lname, []).append(value)
        return out

    @staticmethod
    def _single(hdrs: dict[bytes, list[bytes]], name: bytes, code: str) -> str | None:
        values = hdrs.get(name)
        if not values:
            return None
        close = [(b"connection", b"close")]
        if len(values) > 1:
            raise _Refusal(400, code, f"duplicate {name.decode()} header", close)
        try:
            text = values[0].decode("ascii")
        except UnicodeDecodeError:
            raise _Refusal(400, code, f"{name.decode()} header is not ASCII", close) from None
        if _CONTROL.search(text):
            raise _Refusal(400, code, f"{name.decode()} header contains control characters", close)
        return text

    def host_allowed(self, host: str, port: int | None) -> bool:
        if self.allow_any_host or is_loopback(host):
            return True
        if not self.listen.is_wildcard and host == self.listen.host:
            return True
        if (host, None) in self.allowed_hosts or (host, port) in self.allowed_hosts:
            return True
        return self.listen.is_wildcard and is_ip_literal(host)

    def _check_host(self, hdrs: dict[bytes, list[bytes]]) -> None:
        values = hdrs.get(b"host")
        if values and len(values) == 1 and self._memo.get(("host-ok", values[0])):
            return  # this exact Host value passed every check below before
        value = self._single(hdrs, b"host", "invalid_host")
        if value is None:
            raise _Refusal(400, "invalid_host", "missing Host header", [(b"connection", b"close")])
        try:
            host, port = split_host_header(value)
        except ValueError:
            raise _Refusal(
                400, "invalid_host", "malformed Host header", [(b"connection", b"close")]
            ) from None
        if not self._memoized(("host", host, port), lambda: self.host_allowed(host, port)):
            raise _Refusal(
                421,
                "host_not_allowed",
                "this server does not serve that Host; add it to [server] allowed_hosts if intended",
                [(b"connection", b"close")],
            )
        self._memoized(("host-ok", hdrs[b"host"][0]), lambda: True)

    def _check_origin(self, hdrs: dict[bytes, list[bytes]]) -> str | None:
        value = self._single(hdrs, b"origin", "invalid_origin")
        if value is None:
            return None
        norm = _normalize_origin(value)
        if norm not in self.allowed_origins:
            raise _Refusal(
                403,
                "origin_not_allowed",
                "requests from web pages are refused unless their origin is listed in [server] allowed_origins",
            )
        return value

    @staticmethod
    def _check_query(scope: Scope) -> None:
        raw = scope.get("query_string") or b""
        if not raw:
            return
        try:
            pairs = parse_qsl(bytes(raw).decode("latin-1"), keep_blank_values=True)
        except ValueError:
            raise _Refusal(400, "invalid_query", "malformed query string") from None
        for key, _ in pairs:
            if key.strip().lower() in URL_CREDENTIAL_PARAMS:
                raise _Refusal(
                    401,
                    "credentials_in_url",
                    "credentials in the URL are refused (they end up in logs and history); "
                    "send Authorization: Bearer <token>",
                    [(b"www-authenticate", b'Bearer realm="appserver"')],
                )

    def _required_scope(self, scope: Scope) -> str | None:
        if scope["type"] == "websocket":
            return WS_SCOPE
        path = scope.get("path") or "/"
        for prefix, needed in self.path_scopes.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return needed
        return None

    def _authenticate(
        self, scope: Scope, hdrs: dict[bytes, list[bytes]]
    ) -> tuple[Principal | None, bool]:
        """→ (principal, auth_pending)."""
        if self.authenticator.mode == "none":
            client = scope.get("client")
            if (
                client
                and not self._memoized(("loopback", client[0]), lambda: is_loopback(str(client[0])))
                and scope.get("path") not in self.public_paths
            ):
                raise _Refusal(403, "loopback_only", "auth mode none serves loopback clients only")
            return Principal.local(), False
        if scope.get("path") in self.public_paths:
            return None, False
        authorization = self._single(hdrs, b"authorization", "invalid_authorization")
        if authorization is None and scope["type"] == "websocket":
            return None, True
        try:
            principal = self.authenticator.authenticate(authorization)
        except AuthError as exc:
            headers = (
                [(b"www-authenticate", b'Bearer realm="appserver"')] if exc.status == 401 else []
            )
            raise _Refusal(exc.status, exc.code, exc.message, headers) from None
        needed = self._required_scope(scope)
        if needed is not None and not principal.has_scope(needed):
            raise _Refusal(403, "insufficient_scope", f"this credential lacks the '{needed}' scope")
        return principal, False

    def _check_length(self, hdrs: dict[bytes, list[bytes]]) -> None:
        values = hdrs.get(b"content-length")
        if not values:
            return
        parsed: set[int] = set()
        for v in values:
            for part in v.split(b","):
                p = part.strip()
                if not p.isdigit() or len(p) > 18:
                    raise _Refusal(
                        400,
                        "invalid_content_length",
                        "malformed Content-Length",
                        [(b"connection", b"close")],
                    )
                parsed.add(int(p))
        if len(parsed) != 1:
            raise _Refusal(
                400,
                "invalid_content_length",
                "conflicting Content-Length headers",
                [(b"connection", b"close")],
            )
        if parsed.pop() > self.body_max:
            raise self._too_large()

    def _too_large(self) -> _Refusal:
        return _Refusal(
            413,
            "request_too_large",
            f"request body exceeds the limit of {self.body_max} bytes ([limits] body_max_bytes)",
            [(b"connection", b"close")],
        )

    @staticmethod
    def _client_key(scope: Scope) -> str | None:
        client = scope.get("client")
        if not client:
            return None
        return str(client[0])

    @staticmethod
    def _is_preflight(scope: Scope, hdrs: dict[bytes, list[bytes]]) -> bool:
        return scope.get("method") == "OPTIONS" and bool(hdrs.get(b"access-control-request-method"))

    # ── responses ─────────────────────────────────────────────────────────────────────────────

    @staticmethod
    def _cors_headers(origin: str | None) -> list[tuple[bytes, bytes]]:
        if origin is None:
            return []
        return [
            (b"access-control-allow-origin", origin.encode("ascii")),
            (b"access-control-expose-headers", CORS_EXPOSE_HEADERS.encode()),
            (b"vary", b"Origin"),
        ]

    async def _preflight(self, send: Send, origin: str, hdrs: dict[bytes, list[bytes]]) -> None:
        """CORS preflight for an allowed origin: browsers send it without credentials."""
        req_headers = b", ".join(hdrs.get(b"access-control-request-headers") or [])
        if not req_headers or not all(
            c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_, "
            for c in req_headers
        ):
            req_headers = b"authorization, content-type, idempotency-key, x-conversation-id"
        headers = [
            (b"access-control-allow-origin", origin.encode("ascii")),
            (b"access-control-allow-methods", CORS_ALLOW_METHODS.encode()),
            (b"access-control-allow-headers", req_headers),
            (b"access-control-max-age", b"600"),
            (b"vary", b"Origin"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _send_http_error(self, send: Send, r: _Refusal, origin: str | None) -> None:
        body = json.dumps(openai_error(r.status, r.code, r.message)).encode("utf-8")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *r.headers,
            *self._cors_headers(origin),
        ]
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _refuse_ws(self, scope: Scope, receive: Receive, send: Send, r: _Refusal) -> None:
        try:
            first = await asyncio.wait_for(receive(), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError):
            return
        if first.get("type") != "websocket.connect":
            return
        if "websocket.http.response" in (scope.get("extensions") or {}):
            body = json.dumps(openai_error(r.status, r.code, r.message)).encode("utf-8")
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *[(k, v) for k, v in r.headers if k != b"connection"],
            ]
            await send(
                {"type": "websocket.http.response.start", "status": r.status, "headers": headers}
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": WS_CLOSE_POLICY, "reason": r.code})

    # ── running the app ───────────────────────────────────────────────────────────────────────

    async def _run_http(
        self, scope: Scope, receive: Receive, send: Send, origin: str | None
    ) -> None:
        limit = self.body_max
        received = 0
        tripped = False
        started = False
        cors = self._cors_headers(origin)

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
                        await self._send_http_error(send, self._too_large(), origin)
                    return {"type": "http.disconnect"}
            return message

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if tripped:
                return  # the app choked on the disconnect we injected; the client has its 413
            raise

    async def _run_ws(
        self, scope: Scope, receive: Receive, send: Send, state: dict[str, Any]
    ) -> None:
        pending = bool(state.get("auth_pending"))
        session = _WsSession(
            state,
            send,
            self.authenticator,
            time.time() + self.hello_timeout_s if pending else None,
            path=str(scope.get("path") or "/"),
            http_refusals="websocket.http.response" in (scope.get("extensions") or {}),
        )
        state["authenticate_hello"] = session.authenticate_hello
        frame_max = self.frame_max

        async def guarded_receive() -> Message:
            if session.closed_by_guard is not None:
                code, reason = session.closed_by_guard
                return {"type": "websocket.disconnect", "code": code, "reason": reason}
            message = await receive()
            t = message["type"]
            if t == "websocket.receive" and (session.closed_by_guard is not None or session.revoked()):
                # No frame is acted on once the credential is revoked, even before the poll sees it.
                await session.close(WS_CLOSE_AUTH, "credential revoked")
                code, reason = session.closed_by_guard or (WS_CLOSE_AUTH, "credential revoked")
                return {"type": "websocket.disconnect", "code": code, "reason": reason}
            if t == "websocket.receive" and frame_max > 0:
                data = message.get("bytes")
                size = len(data) if data is not None else len(message.get("text") or "")
                if size > frame_max // 4 and data is None:
                    size = len((message.get("text") or "").encode("utf-8"))
                if size > frame_max:
                    await session.close(WS_CLOSE_TOO_BIG, f"frame larger than {frame_max} bytes")
                    return {"type": "websocket.disconnect", "code": WS_CLOSE_TOO_BIG}
            elif t == "websocket.disconnect":
                session.closed = True
                session.changed.set()
            return message

        session.ensure_watch()
        try:
            await self.app(scope, guarded_receive, session.send)
        finally:
            await session.stop_watch()
