"""The request headers the guards judge, read once; a malformed, duplicated or non-ASCII value of
one of them is refused (400) before anything trusts it."""

from __future__ import annotations

import re

from appserver.netaddr import FORWARDING_HEADERS
from appserver.security.asgi import CLOSE, Refusal, Scope

Headers = dict[bytes, list[bytes]]

# The forwarding headers are read in the same pass: whether a front end forwarded it (LocalOwner).
GUARDED_HEADERS = FORWARDING_HEADERS | {
    b"host",
    b"origin",
    b"authorization",
    b"content-length",
    b"access-control-request-method",
    b"access-control-request-headers",
}
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def guarded_headers(scope: Scope) -> Headers:
    """Every value of each guarded header, by lower-cased name."""
    out: Headers = {}
    for item in scope.get("headers") or ():
        try:
            name, value = item
        except (TypeError, ValueError):
            raise Refusal(400, "invalid_header", "malformed header") from None
        if type(name) is not bytes or type(value) is not bytes:  # bytes: the usual case
            if not isinstance(name, bytes | bytearray) or not isinstance(value, bytes | bytearray):
                raise Refusal(400, "invalid_header", "malformed header")
            name, value = bytes(name), bytes(value)
        lname = name.lower()
        if lname in GUARDED_HEADERS:
            out.setdefault(lname, []).append(value)
    return out


def single(hdrs: Headers, name: bytes, code: str) -> str | None:
    """The one value of `name` (None if absent); duplicates, non-ASCII and control characters refused."""
    values = hdrs.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise Refusal(400, code, f"duplicate {name.decode()} header", [CLOSE])
    try:
        text = values[0].decode("ascii")
    except UnicodeDecodeError:
        raise Refusal(400, code, f"{name.decode()} header is not ASCII", [CLOSE]) from None
    if _CONTROL.search(text):
        raise Refusal(400, code, f"{name.decode()} header contains control characters", [CLOSE])
    return text
