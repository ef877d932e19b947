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

Every refusal is logged, bounded (`refusals.RefusalLog`): any client can be refused as fast as it
can send, so only the first lines of each interval are written, each path shortened, and the rest
counted. The guard's one `RefusalLog` takes every line a client without a valid credential can
cause: its refused requests (with the fingerprint of a credential the authenticator rejected), a
rejected credential offered on a public path, and the hello refusals and closes of WebSockets that
never authenticated (ws_session.py); the Authenticator logs no rejection itself. `serve` hands the
same one to the edge (`EdgeLimits.from_config`), for the lines of its own refusals and of
connections that never authenticated: one limit for the server.
An app with a `count_refusal(scope, status)` method (http/app.py: the metrics) hears of each HTTP
refusal. `scope["state"][OPS_DETAIL]` says whether the request's credential may see operational
detail (the checks' details in `/readyz`): one with the scope `/metrics` needs, offered even on a
public path (never refused there), or the local owner (`LocalOwner`: a loopback peer of the
server's own Unix user or root that no proxy forwarded); in auth mode `none` only the local owner
passes the public paths (403 `forwarded_needs_auth` / `other_user`).

Refused WebSocket upgrades get a real HTTP response (403/401/421/400) through the
`websocket.http.response` extension when the server offers it, else a close before accept
(which servers turn into 403).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from appserver.auth import Authenticator, AuthError, Principal, TokensStale
from appserver.auth.authenticator import CredentialRejected
from appserver.config import Config, ConfigError
from appserver.http.requestid import HEADER as REQUEST_ID_HEADER
from appserver.http.requestid import begin_request, end_request
from appserver.netaddr import (
    FORWARDING_HEADERS,
    PEER_GONE,
    BindRefused,
    TrustedProxies,
    check_bind_allowed,
    forwarded_for_hops,
    forwarded_host,
    forwarded_list_hops,
    is_loopback,
    kernel_tells_peers,
    parse_listen,
    tcp_peer_uid,
)
from appserver.security.asgi import ASGIApp, Message, Receive, Refusal, Scope, Send, prove
from appserver.security.authentication import (
    DEFAULT_PATH_SCOPES,
    PUBLIC_PATHS,
    Authentication,
    CredentialRefusal,
    check_query,
)
from appserver.security.headers import Headers, guarded_headers, single
from appserver.security.hostcheck import HostCheck
from appserver.security.limits import BodyLimit, ClientSlots, PendingSockets, SlotHold, slot_key
from appserver.security.memo import Memo
from appserver.security.origin import OriginCheck, cors_headers, is_preflight, preflight
from appserver.security.refusals import RefusalLog, refuse_ws, send_http_error, shown_path
from appserver.security.ws_session import run_ws

log = logging.getLogger("appserver.guard")

_STAMPED = frozenset({"http.response.start", "websocket.accept", "websocket.http.response.start"})


BODY_SEND = "body_send"
OPS_DETAIL = "ops_detail"  # the `scope["state"]` key: may this request see operational detail?
OPS_PATH = "/metrics"  # whose scope rule says who may (DEFAULT_PATH_SCOPES: `admin`)
# The `scope["state"]` key set when the guard answered 413 to a body streamed over the limit while
# the app ran: the app's own answer never went out (nor counts in the metrics: the guard's does).
GUARD_ANSWERED = "guard_answered"

CountRefusal = Callable[[Scope, int], None]


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
        self.refusals = RefusalLog()
        self.count_refusal: CountRefusal | None = getattr(app, "count_refusal", None)
        self.ops_scope = self.authentication.required_scope({"type": "http", "path": OPS_PATH})
        self.owner = LocalOwner(config.server.trusted_proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, self._flush_at_stop(receive), send)
            return
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
            # Whose Unix user a loopback peer is matters in mode none, and for /readyz's details.
            public = scope.get("path") in self.authentication.public_paths
            whose = self.owner.judge(scope, hdrs, server_send, check_user=self.authenticator.mode == "none" or public)
            if whose.client != scope.get("client"):  # a trusted proxy named it in Forwarded/X-Real-IP
                scope = {**scope, "client": whose.client}
            self._refuse_strangers_in_mode_none(scope, whose)
            try:
                principal, pending = self.authentication.authenticate(scope, hdrs)
            except TokensStale as stale:  # the token store reads its database first, off the loop
                principal, pending = await self.authentication.authenticate_fresh(scope, hdrs, stale)
            if principal is not None:
                prove(scope)  # the connection keeps its slot at the cap (edge.py)
            # On a public path (no principal) a credential offered, or the owner on this machine,
            # may still see the details (only /readyz reads them: nothing more is done per request).
            ops_detail = self._may_see_detail(principal)
            if self.authenticator.mode == "none":
                ops_detail = whose.local  # everyone may reach /readyz in mode none; the owner sees more
            elif principal is None and kind == "http":
                offered = await self._offered(hdrs, scope.get("path", "?"))
                ops_detail = self._may_see_detail(offered) or whose.local
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
                why = r.why if isinstance(r, CredentialRefusal) else ""
                self.refusals.refused(kind, scope.get("path", "?"), r.status, r.code, why)
            else:  # a check's own failure: still an error object with the request id, never a bare 500
                log.exception("the guard's checks failed on %s %s", kind, shown_path(scope.get("path", "?")))
                r = Refusal(500, "internal_error", "the server could not check this request")
            if kind == "http":
                self._count(scope, r.status)
                await send_http_error(send, r, cors_headers(origin))
            else:
                await refuse_ws(scope, receive, send, r)
            return

        scope = dict(scope)
        state = dict(scope.get("state") or {})
        state["principal"] = principal
        state["auth_pending"] = pending
        state[OPS_DETAIL] = ops_detail
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
                    refusals=self.refusals,
                )
        finally:
            # (a WebSocket authenticated by `hello` holds its credential's slot by now: that one)
            hold.release()

    def _refuse_strangers_in_mode_none(self, scope: Scope, whose: Whose) -> None:
        """Auth mode none: only the local owner past the public paths. (A peer that is not loopback
        at all is refused by `Authentication`, as `loopback_only`.)"""
        if self.authenticator.mode != "none" or whose.local or scope.get("path") in self.authentication.public_paths:
            return
        if not whose.same_user:
            raise Refusal(403, "other_user", OTHER_USER_NEEDS_AUTH)
        if whose.forwarded:
            raise Refusal(403, "forwarded_needs_auth", FORWARDED_NEEDS_AUTH)

    def _may_see_detail(self, principal: Principal | None) -> bool:
        """The rule of `/metrics`: a credential with the scope its path needs (any in mode none)."""
        return principal is not None and (self.ops_scope is None or principal.has_scope(self.ops_scope))

    async def _offered(self, hdrs: Headers, path: str) -> Principal | None:
        """The principal of the credential a request to a public path offers, None when it offers
        none or one that is not valid: a probe is never refused for its credential (one the
        authenticator rejected is logged among the refusals, bounded: any client can offer one)."""
        try:
            authorization = single(hdrs, b"authorization", "invalid_authorization")
            if authorization is None:
                return None
            try:
                return self.authenticator.authenticate(authorization)
            except TokensStale as stale:  # the token store reads its database first, off the loop
                await stale.wait()
                return self.authenticator.authenticate(authorization, since=stale.asked_at)
        except AuthError as exc:
            if isinstance(exc, CredentialRejected):
                self.refusals.ignored(path, exc)
            return None
        except (Refusal, TokensStale):
            return None

    def _count(self, scope: Scope, status: int) -> None:
        """Tell the app of an HTTP refusal (the metrics count those on the OpenAI routes)."""
        if self.count_refusal is not None:
            self.count_refusal(scope, status)

    def _flush_at_stop(self, receive: Receive) -> Receive:
        """The lifespan's `receive`, which logs the count of refusals not logged yet at the stop."""

        async def received() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                self.refusals.flush()
            return message

        return received

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
                    refusal = self.body.too_large()
                    self.refusals.refused("http", scope.get("path", "?"), refusal.status, refusal.code, " (streamed)")
                    if not started:
                        started = True
                        scope["state"][GUARD_ANSWERED] = True
                        self._count(scope, refusal.status)
                        await send_http_error(send, refusal, cors)
                    return {"type": "http.disconnect"}
            return message

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if tripped:
                return  # the app choked on the disconnect we injected; the client has its 413
            raise


FORWARDED_NEEDS_AUTH = (
    "auth mode none serves only the owner on this machine, and this request was passed on by a reverse "
    "proxy or tunnel for someone else (it carries Forwarded, X-Forwarded-For or X-Real-IP): behind a "
    "proxy, turn on auth (--auth token, then `appserver token create`)"
)
OTHER_USER_NEEDS_AUTH = (
    "auth mode none serves only the Unix user running the server (and root), and this connection "
    "comes from another user of this machine: to share the server, turn on auth (--auth token, then "
    "`appserver token create`)"
)
UNREADABLE_FORWARDING = (
    "the forwarding headers a trusted proxy sent do not name the client's IP address "
    "(Forwarded for=, X-Forwarded-For, X-Real-IP): configure the proxy to send it"
)


@dataclass(frozen=True, slots=True)
class Whose:
    """Who a request is from: the client address to count it by, whether it is the local owner (a
    loopback client that nobody forwarded, or that a trusted proxy forwarded for a loopback
    address) and whether it came through a front end at all."""

    client: tuple[str, int] | None
    local: bool
    forwarded: bool
    same_user: bool = True  # False: a loopback peer run by another Unix user of this machine


class LocalOwner:
    """The one rule of "this request is the server's owner, on this machine", for auth mode none, the
    details of /readyz and WebSockets alike. A loopback peer is the owner unless the request says it
    is someone else's: a front end on this machine that passes requests on names their client in
    Forwarded, X-Forwarded-For or X-Real-IP. From a peer in `[server] trusted_proxies` those name
    the client (all three kinds: uvicorn reads only X-Forwarded-For, so a proxy sending only the
    others would make every client look like itself); from anyone else they make a request nobody's
    on this machine."""

    def __init__(self, trusted_proxies: list[str]) -> None:
        self.proxies = TrustedProxies(trusted_proxies)
        self._loopback = Memo()
        self.owner_uids = frozenset({os.geteuid(), 0})  # the server's own Unix user, and root
        # A connection's peer user, asked of the kernel once per connection (~0.1 ms): by transport.
        self._peer_uids: weakref.WeakKeyDictionary[object, int | None] = weakref.WeakKeyDictionary()
        self._peers: weakref.WeakKeyDictionary[object, tuple[str, int] | None] = weakref.WeakKeyDictionary()
        self._kernel_tells: bool | None = None  # `kernel_tells_peers`, asked at the first peer not found

    def judge(self, scope: Scope, hdrs: Headers, send: Send | None = None, *, check_user: bool = True) -> Whose:
        """Raises a 400 Refusal when a trusted proxy's forwarding header names no readable address.
        `hdrs`: the request's guarded headers (`guarded_headers`), the forwarding ones among them.
        `send` (the server's own) tells the connection: its TCP peer (uvicorn has put a trusted
        proxy's X-Forwarded-For client in `scope["client"]`: whether the peer is trusted is judged
        by the peer itself) and that peer's Unix user, looked up once (unless `check_user` is
        False: then a loopback peer counts as the owner's)."""
        client = scope.get("client")
        connection = _connection_of(send)
        peer = self._peer_of(connection, client)
        forwarding = _forwarding_values(hdrs)
        if not forwarding:
            if peer is None or not self._is_loopback(peer):
                return Whose(client, False, False)
            same_user = not check_user or self._peer_is_owner(peer, scope.get("server"), connection)
            return Whose(client, same_user, False, same_user)
        if client is None or peer is None or str(peer[0]) not in self.proxies:
            return Whose(client, False, True)  # its headers are ignored, and it is nobody's here
        try:
            named = self._named_by_proxy(str(client[0]), forwarding)
        except ValueError:
            raise Refusal(400, "unreadable_forwarding", UNREADABLE_FORWARDING) from None
        if not named:
            return Whose(client, False, True)
        port = int(client[1]) if client[0] == named[0] else 0
        local = all(self._is_loopback((host, 0)) for host in named)
        # A trusted proxy on this machine is a loopback peer too: another Unix user sending the
        # headers itself would pose as the proxy forwarding the owner.
        same_user = not (local and check_user) or self._peer_is_owner(peer, scope.get("server"), connection)
        return Whose((named[0], port), local and same_user, True, same_user)

    def _named_by_proxy(self, client: str, forwarding: dict[bytes, str]) -> list[str]:
        """The client addresses each forwarding header of a trusted proxy's request names,
        X-Forwarded-For's first; [] when uvicorn read X-Forwarded-For otherwise (`client`, which
        it put in the scope, is that header's client: the two must agree)."""
        named: list[str] = []
        xff = forwarding.get(b"x-forwarded-for")
        if xff is not None:
            try:
                first = self.proxies.client_of(forwarded_list_hops(xff))
            except ValueError:
                return []  # uvicorn read it more leniently, or not at all: never the owner
            if first != _normalised(client):
                return []
            named.append(first)
        if (value := forwarding.get(b"forwarded")) is not None:
            named.append(self.proxies.client_of(forwarded_for_hops(value)))
        if (value := forwarding.get(b"x-real-ip")) is not None:
            named.append(self.proxies.client_of(forwarded_list_hops(value)))
        return named

    def _peer_of(self, connection: object | None, client: tuple[str, int] | None) -> tuple[str, int] | None:
        """The connection's TCP peer (asked of its transport once per connection), or `client`
        where the connection cannot be told (an ASGI server other than uvicorn's)."""
        if connection is None:
            return client
        known = self._peers.get(connection)
        if known is None:
            address = getattr(connection, "get_extra_info", lambda _name: None)("peername")
            known = self._peers[connection] = (str(address[0]), int(address[1])) if address else client
        return known

    def _peer_is_owner(self, peer: tuple[str, int], server: tuple[str, int] | None, connection: object | None) -> bool:
        """A loopback peer run by the server's Unix user or root (Linux); another user of this machine
        is not the owner, nor a peer the kernel says is closed or gone (`PEER_GONE`: a request sent
        and hung up on at once). Where the kernel cannot say (not Linux), every loopback peer is."""
        if server is None:
            return True
        if connection is None:  # no connection to ask about (not uvicorn's): only a uid found counts
            uid = tcp_peer_uid(peer, server)
            uid = None if uid == PEER_GONE else uid
        elif connection in self._peer_uids:
            uid = self._peer_uids[connection]
        else:
            uid = self._peer_uids[connection] = self._kernel_says(tcp_peer_uid(peer, server))
        return uid is None or uid in self.owner_uids

    def _kernel_says(self, uid: int | None) -> int | None:
        """`uid`, except a `PEER_GONE` from a kernel that finds no TCP socket at all (no sock_diag
        for TCP: it says "no such socket" of every one): None, cannot tell. Asked once."""
        if uid != PEER_GONE:
            return uid
        if self._kernel_tells is None:
            self._kernel_tells = kernel_tells_peers()
            if not self._kernel_tells:
                log.warning("this kernel does not say whose a loopback connection is: every local user is the owner")
        return uid if self._kernel_tells else None

    def _is_loopback(self, client: tuple[str, int] | None) -> bool:
        if client is None:
            return False
        host = str(client[0])
        return self._loopback.check(host, lambda: is_loopback(host))


def _forwarding_values(hdrs: Headers) -> dict[bytes, str]:
    """Each forwarding header's values (several lines joined by commas, as one list), by name."""
    return {
        name: ", ".join(value.decode("latin-1") for value in hdrs[name]) for name in FORWARDING_HEADERS if name in hdrs
    }


def _connection_of(send: Send | None) -> object | None:
    """The transport of the connection a server's `send` writes to (uvicorn's request cycle and
    WebSocket protocol hold it), unwrapped to the one asyncio made; None when it cannot be told
    or cannot be weakly referenced."""
    held: object = getattr(getattr(send, "__self__", None), "transport", None)
    transport: object = getattr(held, "raw", held)
    if transport is None:
        return None
    try:
        weakref.ref(transport)
    except TypeError:
        return None
    return transport


def _normalised(host: str) -> str:
    try:
        return forwarded_host(host)
    except ValueError:
        return host
