"""The ASGI types the guards speak, and the one exception every check raises to refuse."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CLOSE = (b"connection", b"close")
BEARER_CHALLENGE = (b"www-authenticate", b'Bearer realm="appserver"')
# A scope extension the edge (edge.py) puts on requests and WebSockets of a connection that has not
# authenticated yet: the guard calls it once one does, and the connection keeps its slot at the cap.
PROVE = "appserver.prove"


def prove(scope: Scope) -> None:
    """Tell the edge that the connection behind `scope` authenticated (a credential, or a loopback
    client in auth mode none): from now on it is never evicted to make room for a newcomer."""
    extensions = scope.get("extensions")
    if extensions:
        done = extensions.get(PROVE)
        if done is not None:
            done()


# A scope extension the edge puts on every WebSocket: the app calls it once the socket's `hello` is
# accepted, with whose share of the server's inbound budget its big frames take (a credential's,
# else an address's). Until then the edge reads only small messages, one at a time (ws_inbound.py).
GREETED = "appserver.greeted"


def greeted(scope: Scope, group: str) -> None:
    """Tell the edge that the WebSocket behind `scope` said a `hello` that was accepted: the
    limits before `hello` end, and its big frames count in `group`'s share of the inbound budget."""
    extensions = scope.get("extensions")
    if extensions:
        done = extensions.get(GREETED)
        if done is not None:
            done(group)


class Refusal(Exception):
    """A check refused the request: answered as an OpenAI error (refusals.py), never reaching the app."""

    def __init__(self, status: int, code: str, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = list(headers)
