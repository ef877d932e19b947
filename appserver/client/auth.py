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


# A user part runs from the `//` (the start, for a URL without one: `alice:pw@host`) to the LAST @: a
# password pasted unencoded may hold an @, a /, a ? or a # of its own (`alice:s3/cr?t#@host`),
# which would otherwise end it early and show it whole. (An @ further on, in a path or a query,
# makes more of the URL masked than needed, never less.) The two characters NFKC makes an @ of
# (U+FE6B, U+FF20) end it too: urllib reads them so, and quotes the whole part when refusing them.
_AT = "@\ufe6b\uff20"
_USERINFO = re.compile(rf"^([^{_AT}]*?//)?(.*)[{_AT}]", re.DOTALL)


def shown_url(url: str) -> str:
    """`url` for an error line or a log: a password in its user part (or a user part that is
    one word: it may be a token) and each value of its query and of its fragment written `***`
    (`#access_token=…` is one), as `appserver serve` writes a store URL. Also for a URL no parser
    takes (`https://alice:pw@[::1`, a password holding `/`), which is echoed in the error that
    says so."""

    found = _USERINFO.search(url)
    if found is None:
        head, mark, query, hashmark, fragment = _query_and_fragment(url)
        return f"{head}{mark}{_masked_values(query)}{hashmark}{_masked_values(fragment)}"
    start = found.group(1) or ""
    name, colon, _ = found.group(2).partition(":")
    if any(c in name for c in "/?#" + _AT):
        # not a user name: a host and a path or a query (`h/ws?token=…&next=mailto:me@x`), or a
        # token before another @ (`TOKEN@host/?next=a@b`): none of it is shown
        name, colon = "***", ""
    user = f"{start}{name}:***@" if colon else f"{start}***@"
    after = url[found.end() :]
    if any(c in found.group(2) for c in "?#"):
        # The @ may be in a query or a fragment (`/ws?key=ab@cd…`): what follows it is then part of a
        # value, masked as one (for a password holding a ? or a #, the host goes masked too).
        rest, hashmark, fragment = after.partition("#")
        return f"{user}{_masked_values(rest)}{hashmark}{_masked_values(fragment)}"
    head, mark, query, hashmark, fragment = _query_and_fragment(after)
    return f"{user}{head}{mark}{_masked_values(query)}{hashmark}{_masked_values(fragment)}"


def _query_and_fragment(url: str) -> tuple[str, str, str, str, str]:
    """`url` as (before the query, "?", query, "#", fragment), the marks empty where absent."""
    rest, hashmark, fragment = url.partition("#")
    head, mark, query = rest.partition("?")
    return head, mark, query, hashmark, fragment


def _masked_values(params: str) -> str:
    """`a=1&b` as `a=***&***`: the names of a query's (or fragment's) parameters, none of their values."""
    return "&".join(f"{item.partition('=')[0]}=***" if "=" in item else "***" for item in params.split("&") if item)


def ws_url(base: str) -> str:
    """The `/ws` URL of a server given by its base URL (http(s) or ws(s), with or without `/ws`)."""
    base, mark, query = base.partition("?")  # `/ws` goes on the path, before a query
    base = base.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return (base if base.endswith("/ws") else base + "/ws") + mark + query


def check_url(base: str) -> str:
    """`ws_url(base)`, or `ConnectError` (`invalid_url`, fatal) saying what is wrong with it."""
    url = ws_url(base.strip())

    def bad(why: str) -> ConnectError:
        return ConnectError("invalid_url", f"invalid server URL {shown_url(base)!r}: {why}", fatal=True)

    # Said in our own words: a parser's message quotes the part it could not read, which may be a
    # password (`Port could not be cast to integer value as 's3cr3t'` for `alice:s3cr3t/pw@host`).
    if _USERINFO.search(url) is not None:
        raise bad("credentials do not go in the URL; give a token")
    if "#" in url:
        raise bad("a fragment (the part from #) does not go in a server URL")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise bad(_unreadable_host(url)) from None
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        raise bad(_bad_port(parts.netloc)) from None
    if parts.scheme not in ("ws", "wss"):
        raise bad("it must start with http://, https://, ws:// or wss://")
    if not parts.hostname:
        raise bad("it names no host")
    return url


def _unreadable_host(url: str) -> str:
    """Why urlsplit refused `url`, in our words (its own message may quote the host)."""
    if "[" in url or "]" in url:
        return "Invalid IPv6 URL (an IPv6 address is written in brackets: ws://[::1]:8770)"
    return "its host cannot be read"


def _bad_port(netloc: str) -> str:
    """Why the port of `netloc` is refused, in our words (urllib's message quotes the port)."""
    port = netloc.rpartition("]")[2].rpartition(":")[2]
    if port.isascii() and port.isdigit():
        return "Port out of range 0-65535"
    return "its port is not a number from 0 to 65535"


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
