"""Where the client connects and with which credential.

A token is a string, or a callable asked at every (re)connect so a long-lived client (the gateway)
can pick up a rotated token without restarting. Without one, `APPSERVER_TOKEN` is used, as the CLI
does. The token travels only in the `Authorization` header, never in a URL or a log line.
"""

from __future__ import annotations

import os
from collections.abc import Callable

TokenSource = str | Callable[[], str | None] | None


def ws_url(base: str) -> str:
    """The `/ws` URL of a server given by its base URL (http(s) or ws(s), with or without `/ws`)."""
    base = base.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base if base.endswith("/ws") else base + "/ws"


def default_token(token: TokenSource) -> TokenSource:
    """The token as given, else `APPSERVER_TOKEN` from the environment (read once, at connect)."""
    return token if token is not None else os.environ.get("APPSERVER_TOKEN") or None


def auth_headers(token: TokenSource) -> dict[str, str] | None:
    """The handshake headers for `token` (a callable is asked now), or None without a token."""
    value = token() if callable(token) else token
    return {"Authorization": f"Bearer {value}"} if value else None
