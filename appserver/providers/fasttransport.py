"""A lean HTTP/1.1 transport for the providers' httpx clients: an asyncio protocol, the httptools C
parser, and a keep-alive pool.

httpx's default transport (httpcore + h11 + anyio) costs about 0.85 ms of CPU per streamed model
call — more than the rest of a request's path through the server. This transport keeps httpx's
client layer (headers, cookies, content decoding, exceptions, proxies) and replaces only the wire:
one write per request, C parsing, idle connections reused. A URL an env proxy covers still goes
through httpx's own proxy transport (`env_proxy_mounts`, mounted ahead of this one). Without
httptools, `lean_transport()` returns None and httpx's default transport is used.
"""

from __future__ import annotations

import asyncio
import math
import os
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, NamedTuple

import httpx
from httpx._utils import URLPattern, get_environment_proxies

try:
    import httptools
except ImportError:  # pragma: no cover - uvicorn[standard] brings it on every supported platform
    httptools = None  # type: ignore[assignment]

READ_BUFFER_MAX = 256 * 1024  # pause reading from the socket while this much is unconsumed
# An answer's head (status line and header fields, interim 1xx heads included) is refused past
# these: httpx's default transport lets h11 buffer at most 100 KiB of an incomplete head
# (httpcore's MAX_INCOMPLETE_EVENT_SIZE), and http.client (urllib3, requests) refuses more than
# 100 header fields. Past them the connection is dropped, and nothing more of the answer is read.
HEAD_MAX_BYTES = 100 * 1024
HEAD_MAX_FIELDS = 100
DEFAULT_PORTS = {"http": 80, "https": 443}

_Key = tuple[str, str, int]


_EXPIRED = object()  # a waiter's result when its timer fired first


class _StrayAnswer(Exception):
    """Raised in a parser callback to stop reading an answer nobody asked for."""


class _TooManyHeaders(Exception):
    """Raised in a parser callback to stop reading a head past `HEAD_MAX_FIELDS`."""


class ResponseHeadTooLarge(httpx.RemoteProtocolError):
    """An upstream's response head passed `HEAD_MAX_BYTES` or `HEAD_MAX_FIELDS`: a protocol
    violation (the providers' `protocol` kind, not retried), not a network fault to retry."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: parser callbacks fill the state a request awaits."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: Any = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[object] | None = None
        self.lost = False
        self.error: Exception | None = None
        self.idle_since = 0.0
        self.idle = False  # in the pool between requests: any byte arriving now is not ours
        self._deadline = 0.0  # the read timeout of the current wait (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.head_bytes = 0  # bytes received while the head was incomplete
        self.headers_done = False
        self.complete = False
        self.until_close = False
        self.keep_alive = False
        self.paused = False

    # -------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.idle:
            # Bytes nobody asked for (a stray or late reply): the next request on this
            # connection would read them as its answer, or wait for the rest of them.
            self.close()
            return
        in_head = not self.headers_done
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - we never ask for an upgrade
            self.error = httpx.RemoteProtocolError("unexpected protocol upgrade")
        except httptools.HttpParserError as exc:
            if self.error is None:  # else a callback stopped the parse and said why
                self.error = httpx.RemoteProtocolError(f"malformed HTTP response: {exc}")
        if in_head:
            self._count_head(len(data))
        if self.error is not None and self.transport is not None:
            self.transport.close()
        self._wake()

    def _count_head(self, size: int) -> None:
        """Refuse a head still incomplete after `HEAD_MAX_BYTES`: checked after each read (at most
        256 KiB), so the parser never holds more than that beyond the limit."""
        self.head_bytes += size
        if not self.headers_done and self.head_bytes > HEAD_MAX_BYTES and self.error is None:
            self.error = ResponseHeadTooLarge(
                f"the upstream's response head (status line and headers) is larger than {HEAD_MAX_BYTES} bytes"
            )

    def eof_received(self) -> bool:
        self._end()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        self.lost = True
        self._stop_timer()
        if self.until_close and self.headers_done:
            self.complete = True  # a body without length or chunking ends with the connection
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: stop reading, drop the connection
            self.error = httpx.RemoteProtocolError("the upstream sent data after its answer")
            raise _StrayAnswer

    def on_status(self, status: bytes) -> None:
        self.reason = status

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= HEAD_MAX_FIELDS:
            self.error = ResponseHeadTooLarge(f"the upstream's response head has more than {HEAD_MAX_FIELDS} headers")
            raise _TooManyHeaders  # stops the parse; data_received keeps self.error and closes
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim response: wait for the real one
            self.headers = []
            return
        names = {n.lower() for n, _ in self.headers}
        self.until_close = (
            b"content-length" not in names and b"transfer-encoding" not in names and self.status not in (204, 304)
        )
        self.keep_alive = self.parser.should_keep_alive()  # only valid while the message is parsed
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_BUFFER_MAX and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True

    # -------------------------------------------------------- for the request

    async def wait(self, timeout: float | None) -> None:
        """Until the parser made progress (or the connection ended); ReadTimeout after `timeout`.

        This runs once per streamed token, and the timeout almost never fires: one timer per
        connection, moved lazily (a wait only moves the deadline; the timer, when it fires early,
        re-arms for what is left), instead of a timer armed and cancelled per token."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        if timeout is None:
            self._deadline = math.inf
        else:
            self._deadline = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self.waiter = None
        if waiter.result() is _EXPIRED:
            raise httpx.ReadTimeout("timed out waiting for the upstream to send data")

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            if self._deadline != math.inf:
                self._timer = loop.call_at(self._deadline, self._check_deadline)
            return
        waiter.set_result(_EXPIRED)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.lost and self.error is None and not self.until_close

    def close(self) -> None:
        self.lost = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()


class _ResponseBody(httpx.AsyncByteStream):
    def __init__(self, pool: LeanTransport, key: _Key, conn: _Connection, read_timeout: float | None) -> None:
        self.pool = pool
        self.key = key
        self.conn = conn
        self.read_timeout = read_timeout
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:  # whole: an error after it (bytes after the answer) only ends reuse
                return
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            await conn.wait(self.read_timeout)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._release(self.key, self.conn)


class LeanResponse:
    """A response's head and its streaming body, as the lean path reads them: the status, the raw
    header fields and `stream`. `full()` wraps them as an `httpx.Response` (built once, on demand)
    for callers that want httpx's view (`headers`, `aiter_bytes`, the generic transport path);
    the providers read the body through `providers/upstream.py` `decoded_body`.

    An `httpx.Response` per model call normalized every header and set up decoders the usual
    streamed answer never uses."""

    __slots__ = ("status_code", "raw_headers", "stream", "_reason", "_full")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], stream: _ResponseBody, reason: bytes):
        self.status_code = status_code
        self.raw_headers = raw_headers
        self.stream = stream
        self._reason = reason
        self._full: httpx.Response | None = None

    def full(self) -> httpx.Response:
        if self._full is None:
            self._full = httpx.Response(
                self.status_code,
                headers=self.raw_headers,
                stream=self.stream,
                extensions={"http_version": b"HTTP/1.1", "reason_phrase": self._reason},
            )
        return self._full

    @property
    def headers(self) -> httpx.Headers:
        return self.full().headers

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self.full().aiter_bytes()

    async def aclose(self) -> None:
        if self._full is not None:
            await self._full.aclose()
        else:
            await self.stream.aclose()


def raw_headers(response: LeanResponse | httpx.Response) -> list[tuple[bytes, bytes]]:
    return response.raw_headers if isinstance(response, LeanResponse) else response.headers.raw


class LeanTransport(httpx.AsyncBaseTransport):
    """Keep-alive pool of `_Connection`s per (scheme, host, port); at most `max_connections` busy."""

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 1000,
        max_keepalive: int = 1000,
        keepalive_expiry: float = 5.0,
    ) -> None:
        self._ssl = ssl_context
        self._idle: dict[_Key, list[_Connection]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry
        self._sweeper: asyncio.TimerHandle | None = None
        self._fallback: httpx.AsyncHTTPTransport | None = None

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method in ("HEAD", "CONNECT"):  # bodies we do not frame: let httpx do it
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        url = request.url
        key = (url.scheme, url.host, url.port or DEFAULT_PORTS.get(url.scheme, 80))
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), url.raw_path)]
        chunked = False
        for name, value in request.headers.raw:
            head.append(b"%s: %s\r\n" % (name, value))
            if name.lower() == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
        head.append(b"\r\n")
        body = [part async for part in request.stream]  # type: ignore[union-attr]
        if chunked:
            body = [b"%x\r\n%s\r\n" % (len(p), p) for p in body if p] + [b"0\r\n\r\n"]
        return (await self.exchange(key, b"".join(head + body), timeouts)).full()

    async def exchange(self, key: _Key, payload: bytes, timeouts: dict[str, float | None]) -> LeanResponse:
        """Write one whole request (head and framed body) to a pooled connection to `key` and
        return the response once its head arrived; the body streams from `response.stream`."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(timeouts.get("pool")):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection slot became free in time") from None
        else:
            await self._slots.acquire()  # free: returns at once
        conn: _Connection | None = None
        try:
            conn = self._checkout(key) or await self._connect(key, timeouts.get("connect"))
            assert conn.transport is not None
            conn.transport.write(payload)
            await self._head(conn, timeouts.get("read"))
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise
        return LeanResponse(
            conn.status, conn.headers, _ResponseBody(self, key, conn, timeouts.get("read")), conn.reason
        )

    @staticmethod
    async def _head(conn: _Connection, timeout: float | None) -> None:
        """Until `conn`'s answer head is complete. The read timeout bounds the head as a whole, not
        each piece of it: an upstream trickling header bytes must not hold the call forever."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not conn.headers_done:
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            await conn.wait(None if deadline is None else deadline - loop.time())

    def _checkout(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.error is None and now - conn.idle_since < self._expiry:
                conn.idle = False
                conn.reset()
                return conn
            conn.close()
        return None

    async def _connect(self, key: _Key, timeout: float | None) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        tls = self._ssl_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    _Connection, host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or f"cannot connect to {host}:{port}") from exc
        return conn

    def _release(self, key: _Key, conn: _Connection) -> None:
        self._slots.release()
        idle = self._idle.setdefault(key, [])
        if conn.reusable and len(idle) < self._max_keepalive:
            conn.idle_since = time.monotonic()
            conn.idle = True
            idle.append(conn)
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().call_later(self._expiry, self._sweep)
        else:
            conn.close()

    def _sweep(self) -> None:
        """Close idle connections past their expiry, and drop those the upstream closed.

        Checkout alone skips only what it meets: after a burst, the connections below the top of
        the pool would stay open (sockets on both ends) until traffic reached down to them."""
        self._sweeper = None
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if not conn.lost and conn.error is None and now - conn.idle_since < self._expiry:
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle:  # each list is in release order: its first connection expires first
            oldest = min(idle[0].idle_since for idle in self._idle.values())
            delay = max(oldest + self._expiry - now, 0.05)
            self._sweeper = asyncio.get_running_loop().call_later(delay, self._sweep)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


class _NoCookies(httpx.Cookies):
    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _Route:
    """A prepared POST target: the transport, the pool key and the request head around its
    Content-Length, exactly as httpx's client layer would have written them."""

    __slots__ = ("transport", "key", "before", "after")

    def __init__(self, transport: LeanTransport, key: _Key, before: bytes, after: bytes) -> None:
        self.transport = transport
        self.key = key
        self.before = before
        self.after = after


ROUTES_MAX = 64  # prepared (url, headers) pairs per client; a provider uses one or two


class LeanClient(httpx.AsyncClient):
    """An httpx client that keeps no cookies: model APIs authenticate with headers, and the
    cookie jar's bookkeeping on every response costs more than the rest of the client layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cookies = _NoCookies()
        self._routes: dict[tuple[str, tuple[tuple[str, str], ...]], _Route | None] = {}

    def _route(self, url: str, headers: dict[str, str]) -> _Route | None:
        """The prepared route for `url` with `headers`, or None when the lean transport does not
        serve it (an env proxy is mounted for it, or the client was given another transport)."""
        cache_key = (url, tuple(headers.items()))
        try:
            return self._routes[cache_key]
        except KeyError:
            pass
        template = self.build_request("POST", url, content=b"{}", headers=headers)
        transport = self._transport_for_url(template.url)
        route: _Route | None = None
        if isinstance(transport, LeanTransport) and not self.auth and not any(self.event_hooks.values()):
            u = template.url
            if u.username or u.password:
                # A user and password in the URL (`http://user:pw@host/v1`): Basic auth, as httpx's
                # client layer sends it (`_build_request_auth`: the percent-decoded user and
                # password; its Authorization header replaces one the caller set, an API key's).
                # The request line and the Host header never carry them.
                next(httpx.BasicAuth(u.username, u.password).sync_auth_flow(template))
            key = (u.scheme, u.host, u.port or DEFAULT_PORTS.get(u.scheme, 80))
            before = [b"POST %s HTTP/1.1\r\n" % u.raw_path]
            after: list[bytes] = []
            current = before
            for name, value in template.headers.raw:
                if name.lower() == b"content-length":
                    current = after  # written per request, in this place
                    continue
                current.append(b"%s: %s\r\n" % (name, value))
            route = _Route(transport, key, b"".join(before), b"".join(after) + b"\r\n")
        if len(self._routes) >= ROUTES_MAX:
            self._routes.clear()
        self._routes[cache_key] = route
        return route

    def post_stream(
        self, url: str, content: bytes, headers: dict[str, str], timeout: httpx.Timeout
    ) -> _LeanPost | AbstractAsyncContextManager[httpx.Response]:
        """POST `content` and stream the answer, like `stream("POST", url, content=..., ...)` and
        with the same bytes on the wire, without httpx's per-request client work (URL parsing,
        header merging, request and response wrapping: about 0.1 ms of CPU per model call). The
        answer is a `LeanResponse`; proxied URLs take the ordinary path (an `httpx.Response`)."""
        route = self._route(url, headers)
        if route is None:
            return self.stream("POST", url, content=content, headers=headers, timeout=timeout)
        payload = b"%sContent-Length: %d\r\n%s%s" % (
            route.before,
            len(content),
            route.after,
            content,
        )
        return _LeanPost(route, payload, {"connect": timeout.connect, "read": timeout.read, "pool": timeout.pool})


class _LeanPost:
    """`LeanClient.post_stream`'s context: the response once its head arrived; closed on exit."""

    __slots__ = ("route", "payload", "timeouts", "response")

    def __init__(self, route: _Route, payload: bytes, timeouts: dict[str, float | None]) -> None:
        self.route = route
        self.payload = payload
        self.timeouts = timeouts
        self.response: LeanResponse | None = None

    async def __aenter__(self) -> LeanResponse:
        self.response = await self.route.transport.exchange(self.route.key, self.payload, self.timeouts)
        return self.response

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.response is not None:
            await self.response.aclose()


class EnvProxy(NamedTuple):
    """An environment proxy: the variable that names it (as set: `HTTP_PROXY`, `https_proxy`...)
    and its URL."""

    variable: str
    url: str


class UnusableProxy(Exception):
    """The environment proxy that covers a URL cannot be used: httpx cannot build its transport."""

    def __init__(self, proxy: EnvProxy, reason: str) -> None:
        super().__init__(reason)
        self.proxy = proxy
        self.reason = reason


def env_proxy_for(url: httpx.URL) -> EnvProxy | None:
    """The environment proxy httpx would send `url` through, or None (direct), decided as httpx's
    client decides it: the patterns `get_environment_proxies` reads (HTTP_PROXY, HTTPS_PROXY,
    ALL_PROXY; a NO_PROXY host as None), the most specific first, the first that matches wins.
    An entry httpx cannot read as a pattern (`NO_PROXY=[::1]`, `é.com`) matches no URL, so it is
    skipped: httpx's own client refuses to be made at all, which failed every model call."""
    patterns: list[tuple[URLPattern, str | None]] = []
    for key, proxy in get_environment_proxies().items():
        try:
            patterns.append((URLPattern(key), proxy))
        except (ValueError, httpx.InvalidURL):
            continue
    patterns.sort(key=lambda entry: entry[0].priority)  # httpx's order (a stable sort, as its own)
    for pattern, proxy in patterns:
        if pattern.matches(url):
            return None if proxy is None else EnvProxy(_proxy_variable(pattern.scheme or "all"), proxy)
    return None


def _proxy_variable(scheme: str) -> str:
    """The variable urllib read `scheme`'s proxy from: the lower-case one when set (it wins there)."""
    lower = f"{scheme}_proxy"
    return lower if os.environ.get(lower) else lower.upper()


def _unusable_reason(url: str) -> str:
    """Why httpx cannot use the proxy URL `url`, without quoting any of it."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in ("http", "https", "socks5", "socks5h"):
        return "its scheme must be http, https, socks5 or socks5h"
    return "httpx cannot read it as a URL (its host or port)"


def env_proxy_mounts(base_url: str, limits: httpx.Limits) -> dict[str, httpx.AsyncBaseTransport]:
    """The mount for `base_url` when an environment proxy covers it (`env_proxy_for`), else none:
    httpx reads the environment's proxies only for a client given no transport (`allow_env_proxies
    = trust_env and transport is None`), so a client on the lean transport is given this. The proxy
    transport is httpx's, with its default TLS verification (certifi, or SSL_CERT_FILE /
    SSL_CERT_DIR), and only the proxy that applies is built: one that cannot be (SOCKS without
    socksio, a URL httpx cannot read) is `UnusableProxy` for the URLs it covers, and nothing to
    the others. A `base_url` httpx cannot read gets no mount (its call is refused as before)."""
    try:  # the URL called: a fragment is never sent (`upstream.endpoint_url` drops it)
        target = httpx.URL(base_url.partition("#")[0])
    except httpx.InvalidURL:
        return {}
    proxy = env_proxy_for(target)
    if proxy is None:
        return {}
    try:
        transport = httpx.AsyncHTTPTransport(proxy=proxy.url, limits=limits)
    except ImportError:  # httpx's only one here: a socks5:// proxy without the socksio package
        needs = "a SOCKS proxy needs the socksio package (httpx[socks]), which is not installed"
        raise UnusableProxy(proxy, needs) from None
    except (ValueError, httpx.InvalidURL):
        # in our words: httpx's quote the URL, and a token as its user (`ftp://TOKEN@host`) or the
        # head of a password holding a / (taken for the port) would be shown to the API's callers
        raise UnusableProxy(proxy, _unusable_reason(proxy.url)) from None
    return {f"{target.scheme}://{target.netloc.decode('ascii')}": transport}


def lean_transport(max_connections: int = 1000) -> LeanTransport | None:
    """The lean transport, or None (use httpx's default) when httptools is not installed."""
    if httptools is None:
        return None
    return LeanTransport(max_connections=max_connections, max_keepalive=max_connections)
