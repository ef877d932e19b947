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


class Refusal(Exception):
    """A check refused the request: answered as an OpenAI error (refusals.py), never reaching the app."""

    def __init__(self, status: int, code: str, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = list(headers)
