"""The account settings the webhook plugin itself reads, checked with the standard library
and `plugins.contract` (itself standard library only).

`check_settings` is what the adapter applies when it starts (a bad value is an `AccountError`), and
what `appserver channels add` / `channels list` apply before a server runs: the CLI loads this file
by its path. The secret is read from the environment or a file when the account starts, so it is
the adapter's to check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from plugins.contract import check_keys, number_setting, url_setting

DEFAULT_LISTEN = "127.0.0.1:8788"
DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_TOLERANCE_S = 300.0
MAX_BODY_LIMIT = 64 << 20  # a body is held in memory whole
MAX_TOLERANCE_S = 86_400.0  # a signature older than a day is no clock skew
MIN_TOLERANCE_S = 1.0  # X-Webhook-Timestamp is in whole seconds: less refused most fresh requests
DEFAULT_MAX_CONNECTIONS = 64  # connections open at once to one account's listener
DEFAULT_CONNECTIONS_PER_CLIENT = 16  # of those, from one client address (an IPv6 /64)
MAX_CONNECTIONS_LIMIT = 4096  # each is a file descriptor of the gateway process

# The keys this plugin reads; with the gateway's (plugins.contract.GATEWAY_SETTINGS) the only ones
# an account may have, so a misspelt one is refused instead of silently ignored.
SETTINGS = frozenset(
    {"listen", "path", "reply_url", "max_body_bytes", "tolerance_s", "max_connections", "connections_per_client"}
)

# The secrets this plugin reads (the shared signing secret): the only names an account may give
# by reference (`<name>_env`, `<name>_file`); any other such key is refused instead of ignored.
SECRETS = frozenset({"secret"})

# The type of each setting that is not a string: an environment override (text) is read as it
# (appserver/channelconfig.py), as `APPSERVER_LIMITS__QUEUE_MAX=64` is.
SETTING_TYPES: dict[str, type] = {
    "max_body_bytes": int,
    "tolerance_s": float,
    "max_connections": int,
    "connections_per_client": int,
}


def check_settings(settings: Mapping[str, Any], refs: Collection[str] = ()) -> None:
    """Raise ValueError (one line, naming the setting) when a setting cannot work or is unknown, or
    when one of `refs` (the account's `<name>_env` / `<name>_file` keys) names no secret it reads."""
    check_keys(settings, SETTINGS, secrets=SECRETS, refs=refs)
    listen = settings.get("listen", DEFAULT_LISTEN)
    if not isinstance(listen, str):
        raise ValueError("listen must be a string host:port")
    parse_listen(listen)
    check_path(settings.get("path", "/"))
    url_setting(settings, "reply_url", None)
    what = f"a positive integer of at most {MAX_BODY_LIMIT} (64 MiB)"
    number_setting(settings, "max_body_bytes", DEFAULT_MAX_BODY, low=1, high=MAX_BODY_LIMIT, what=what, integer=True)
    what = f"a positive number of seconds from {MIN_TOLERANCE_S:g} (timestamps are whole seconds) to 86400 (a day)"
    number_setting(settings, "tolerance_s", DEFAULT_TOLERANCE_S, low=MIN_TOLERANCE_S, high=MAX_TOLERANCE_S, what=what)
    what = f"a positive integer of at most {MAX_CONNECTIONS_LIMIT}"
    for key, default in (
        ("max_connections", DEFAULT_MAX_CONNECTIONS),
        ("connections_per_client", DEFAULT_CONNECTIONS_PER_CLIENT),
    ):
        number_setting(settings, key, default, low=1, high=MAX_CONNECTIONS_LIMIT, what=what, integer=True)


def check_path(path: Any) -> None:
    """Refuse a `path` no request can match: a request's path is compared decoded and without its
    query, so `/hook?key=abc` or `/caf%C3%A9` was logged as the URL to use and answered 404 for
    ever. A `.` or `..` segment is resolved away by clients; a control character is no path's."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError("path must be a string starting with '/'")
    odd = next((c for c in path if c in "?#%" or ord(c) < 0x20 or c == "\x7f"), None)
    if odd is not None or any(part in (".", "..") for part in path.split("/")):
        why = f"it holds {odd!r}" if odd is not None else "it holds a '.' or '..' segment"
        shown = path.partition("?")[0] + ("?…" if "?" in path else "")  # a query may hold a token
        raise ValueError(
            f"path must be a plain URL path, got {shown!r}: {why}; a request's path is matched decoded and without "
            "its query, so no request could reach it (no '?', '#' or %-escape: write the characters themselves, "
            'path = "/café")'
        )


def parse_listen(listen: str) -> tuple[str, int]:
    """(host, port) of `host:port` (`[::1]:8788` for IPv6); ValueError for anything else."""
    host, sep, port_text = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    port_ok = port_text.isascii() and port_text.isdigit() and len(port_text) <= 5  # int() refuses 5000 digits
    if not sep or not host or not port_ok or int(port_text) > 65535:
        raise ValueError(f"listen must be host:port (e.g. 127.0.0.1:8788), not {listen!r}")
    return host, int(port_text)
