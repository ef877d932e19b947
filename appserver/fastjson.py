"""JSON on the hot paths through orjson, with the standard library's answer wherever they differ.

A turn encodes and decodes JSON a dozen times (the upstream's stream chunks, the store's JSON
columns, the reply); orjson does each in a quarter of the time. Where orjson refuses what the
standard library accepts (non-string keys, integers beyond 64 bits, `NaN` literals, lone
surrogates), the standard library runs instead, so results and errors stay what they were. Two
differences stay: a float NaN or infinity is written as `null` (valid JSON), not as the bare `NaN`
that `json.dumps` writes and other parsers refuse; and `loads_chunk` reads an integer beyond 64
bits as a float (so it parses only what an upstream streams, never what we store).

Output is compact (no spaces) and UTF-8, as `json.dumps(..., ensure_ascii=False,
separators=(",", ":"))` gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

_STD_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_STD_DECODE = json.JSONDecoder().decode


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """Compact JSON text; `default` turns what JSON has no type for into something it has."""
    try:
        return orjson.dumps(value, default).decode()
    except TypeError:  # orjson.JSONEncodeError is one: keys that are not strings, huge ints, ...
        if default is None:
            return _STD_ENCODE(value)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=default)


def loads_chunk(data: str | bytes) -> Any:
    """Parse an upstream's JSON chunk (text or UTF-8 bytes); raises ValueError as json.loads does.

    Not exact for every input, so not for what we store: orjson reads an integer beyond 64 bits as
    a float, where json.loads keeps every digit. The providers read strings, small counts and
    indexes from a chunk, never such a number; looking for one first cost as much as json.loads.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data) if isinstance(data, bytes) else _STD_DECODE(data)
