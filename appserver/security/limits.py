"""Size and concurrency limits the guard enforces on requests that reached the app: the declared
and the streamed body size (`[limits] body_max_bytes`) and concurrent requests per client
(`[limits] connections_per_client`). Head and connection limits are in edge.py."""

from __future__ import annotations

from appserver.auth.principal import Principal
from appserver.security.asgi import CLOSE, Refusal, Scope
from appserver.security.headers import Headers


class BodyLimit:
    def __init__(self, body_max: int) -> None:
        self.body_max = body_max

    def check_length(self, hdrs: Headers) -> None:
        """Refuse a malformed or conflicting Content-Length (400) or one over the limit (413)."""
        values = hdrs.get(b"content-length")
        if not values:
            return
        parsed: set[int] = set()
        for v in values:
            for part in v.split(b","):
                p = part.strip()
                if not p.isdigit() or len(p) > 18:
                    raise Refusal(400, "invalid_content_length", "malformed Content-Length", [CLOSE])
                parsed.add(int(p))
        if len(parsed) != 1:
            raise Refusal(400, "invalid_content_length", "conflicting Content-Length headers", [CLOSE])
        if parsed.pop() > self.body_max:
            raise self.too_large()

    def too_large(self) -> Refusal:
        return Refusal(
            413,
            "request_too_large",
            f"request body exceeds the limit of {self.body_max} bytes ([limits] body_max_bytes)",
            [CLOSE],
        )


def client_key(scope: Scope) -> str | None:
    client = scope.get("client")
    if not client:
        return None
    return str(client[0])


TOO_MANY_CONNECTIONS = "too_many_connections"

HEALTH_PATHS = frozenset({"/healthz", "/readyz"})


def slot_key(scope: Scope, principal: Principal | None) -> str | None:
    """Whose slots a request takes: an authenticated credential's own (so connections nobody
    authenticated, all from one address on a local server, cannot use up a token's), else its
    address. Health probes take none: they must answer while a client floods the server."""
    if scope["type"] == "http" and scope.get("path") in HEALTH_PATHS:
        return None
    if principal is not None and principal.kind in ("token", "jwt"):
        return f"{principal.kind}:{principal.subject}"
    return client_key(scope)


class ClientSlots:
    """Concurrent requests and sockets per client address; 0 means unlimited."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._active: dict[str, int] = {}

    def check(self, client: str | None) -> None:
        if client is not None and self.per_client > 0 and self._active.get(client, 0) >= self.per_client:
            raise Refusal(429, TOO_MANY_CONNECTIONS, "too many concurrent requests from this client")

    def acquire(self, client: str | None) -> None:
        if client is not None:
            self._active[client] = self._active.get(client, 0) + 1

    def release(self, client: str | None) -> None:
        if client is None:
            return
        left = self._active.get(client, 1) - 1
        if left > 0:
            self._active[client] = left
        else:
            self._active.pop(client, None)


class SlotHold:
    """The one slot a request or WebSocket holds, and whose it is. A WebSocket upgraded without
    credentials holds its address's slot until `hello` authenticates it; then `move` takes the
    credential's slot instead (refused like an over-cap upgrade when that is full) and gives the
    address's back, so the cap of a credential counts its hello-authenticated sockets too."""

    def __init__(self, slots: ClientSlots, key: str | None) -> None:
        self.slots = slots
        self.key = key
        self.released = False

    def acquire(self) -> None:
        self.slots.acquire(self.key)

    def move(self, key: str | None) -> None:
        """Hold `key`'s slot instead of the current one; raises the 429 `Refusal` (holding the
        current one still) when `key`'s slots are all taken."""
        if key == self.key or self.released:
            return
        self.slots.check(key)
        self.slots.acquire(key)  # nothing awaits between the check and the take
        self.slots.release(self.key)
        self.key = key

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.release(self.key)
