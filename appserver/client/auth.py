"""Where the client connects and with which credential.

A token is a string, or a callable asked at every (re)connect so a long-lived client (the gateway)
can pick up a rotated token without restarting. Without one, `APPSERVER_TOKEN` is used, as the CLI
does. The token travels only in the `Authorization` header, never in a URL or a log line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from appserver.client.errors import ConnectError

TokenSource = str | Callable[[], str | None] | None
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")  # what a bearer token can be, in a header


_USERINFO = re.compile(r"(//)([^/?#]*)@")  # greedy: a password may hold an @ of its own


def shown_url(url: str) -> str:
    """`url` for an error line or a log: a password in its user part (or a user part that is
    one word: it may be a token) and each value of its query written `***`, as `appserver serve`
    writes a store URL. Also for a URL no parser takes (`https://alice:pw@[::1`), which is
    echoed in the error that says so."""

    def user(m: re.Match[str]) -> str:
        name, colon, _ = m.group(2).partition(":")
        return f"{m.group(1)}{name}:***@" if colon else f"{m.group(1)}***@"

    shown = _USERINFO.sub(user, url, count=1)
    head, mark, rest = shown.partition("?")
    if not mark:
        return shown
    query, hashmark, fragment = rest.partition("#")
    items = [f"{item.partition('=')[0]}=***" if "=" in item else "***" for item in query.split("&") if item]
    return f"{head}?{'&'.join(items)}{hashmark}{fragment}"


def ws_url(base: str) -> str:
    """The `/ws` URL of a server given by its base URL (http(s) or ws(s), with or without `/ws`)."""
    base = base.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base if base.endswith("/ws") else base + "/ws"


def check_url(base: str) -> str:
    """`ws_url(base)`, or `ConnectError` (`invalid_url`, fatal) saying what is wrong with it."""
    url = ws_url(base.strip())

    def bad(why: str) -> ConnectError:
        return ConnectError("invalid_url", f"invalid server URL {shown_url(base)!r}: {why}", fatal=True)

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.scheme not in ("ws", "wss"):
        raise bad("it must start with http://, https://, ws:// or wss://")
    if not parts.hostname:
        raise bad("it names no host")
    if parts.username is not None or parts.password is not None:
        raise bad("credentials do not go in the URL; give a token")
    return url


def default_token(token: TokenSource) -> TokenSource:
    """The token as given, else `APPSERVER_TOKEN` from the environment (read once, at connect)."""
    return token if token is not None else os.environ.get("APPSERVER_TOKEN") or None


def auth_headers(token: TokenSource) -> dict[str, str] | None:
    """The handshake headers for `token` (a callable is asked now), or None without a token.
    A token no header can carry (spaces, line breaks, non-ASCII) is `ConnectError` `invalid_api_key`."""
    value = token() if callable(token) else token
    if not value:
        return None
    if _HEADER_SAFE.fullmatch(value) is None:
        why = "the token holds characters no token has (spaces, line breaks, non-ASCII)"
        raise ConnectError("invalid_api_key", why, fatal=True)
    return {"Authorization": f"Bearer {value}"}
