"""Origin check and CORS: a browser page gets in only from an origin listed in
`[server] allowed_origins`; such a page gets its preflight answered and CORS headers on answers."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from appserver.config import ConfigError
from appserver.security.asgi import Refusal, Scope, Send
from appserver.security.headers import Headers, single

CORS_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_EXPOSE_HEADERS = "X-Conversation-Id, X-Request-Id"
_DEFAULT_ALLOW_HEADERS = b"authorization, content-type, idempotency-key, x-conversation-id"
_TOKEN_CHARS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_, "


def normalize_origin(value: str) -> str:
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


def cors_headers(origin: str | None) -> list[tuple[bytes, bytes]]:
    """The headers that let an allowed page read an answer (none without an Origin)."""
    if origin is None:
        return []
    return [
        (b"access-control-allow-origin", origin.encode("ascii")),
        (b"access-control-expose-headers", CORS_EXPOSE_HEADERS.encode()),
        (b"vary", b"Origin"),
    ]


def is_preflight(scope: Scope, hdrs: Headers) -> bool:
    return scope.get("method") == "OPTIONS" and bool(hdrs.get(b"access-control-request-method"))


class OriginCheck:
    def __init__(self, allowed_origins: Iterable[str]) -> None:
        self.allowed_origins = {normalize_origin(o) for o in allowed_origins if o.strip()}
        if "*" in self.allowed_origins:
            raise ConfigError("[server] allowed_origins: '*' is not supported; list each origin")

    def check(self, hdrs: Headers) -> str | None:
        """The request's Origin (None when not from a page); a page from elsewhere is refused (403)."""
        value = single(hdrs, b"origin", "invalid_origin")
        if value is None:
            return None
        if normalize_origin(value) not in self.allowed_origins:
            raise Refusal(
                403,
                "origin_not_allowed",
                "requests from web pages are refused unless their origin is listed in [server] allowed_origins",
            )
        return value


async def preflight(send: Send, origin: str, hdrs: Headers) -> None:
    """CORS preflight for an allowed origin: browsers send it without credentials."""
    req_headers = b", ".join(hdrs.get(b"access-control-request-headers") or [])
    if not req_headers or not all(c in _TOKEN_CHARS for c in req_headers):
        req_headers = _DEFAULT_ALLOW_HEADERS
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
