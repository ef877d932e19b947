"""An upstream's JSON → Python values whose strings UTF-8 can always carry.

JSON may escape a lone UTF-16 surrogate (`"\\ud800"`); the standard parser takes it, and the text
it yields cannot be encoded as UTF-8: the store's insert, an SSE event or a frame would fail on it,
and with it the whole turn. Here, where upstream text enters the server, each lone surrogate
becomes U+FFFD (as a decoder shows bytes it cannot read), so streaming clients and the store see
the same text. orjson refuses lone surrogates, so what it returns needs no look: the check runs
only when the standard parser had to (a surrogate, a `NaN` literal, a long integer kept exact).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins every valid pair: any left is lone
_LONG_INT = re.compile(r"[0-9]{20}")


def without_lone_surrogates(value: Any) -> Any:
    """`value` (decoded JSON) with every lone surrogate in its strings and keys as U+FFFD."""
    if isinstance(value, str):
        return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    return value


def loads_exact(data: str | bytes | bytearray) -> Any:
    """The standard parser (every digit of a long integer kept), its strings made safe. JSON nested
    deeper than Python's recursion allows (an upstream's arrays in arrays) is malformed here too:
    ValueError, as for any JSON that cannot be read, never a RecursionError."""
    try:
        return without_lone_surrogates(json.loads(data))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def loads(data: str | bytes | bytearray) -> Any:
    """orjson, else the standard parser made safe; ValueError on malformed JSON, as json.loads."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return loads_exact(data)


def loads_event(data: str) -> Any:
    """A stream event's JSON: `loads`, except for a usage event with a number orjson would round
    (token counts are stored and reported, so every digit is kept)."""
    if '"usage"' in data and _LONG_INT.search(data) is not None:
        return loads_exact(data)
    return loads(data)
