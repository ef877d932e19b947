"""Strict JSON for what clients send (HTTP bodies, WebSocket frames): anything the parser, a later
encoder or the store would choke on is refused here, before anything is written.

Refused: invalid UTF-8 (which includes UTF-8-encoded surrogates), invalid JSON, nesting deeper
than `MAX_DEPTH`, lone UTF-16 surrogates from `\\ud800`-style escapes (they cannot be encoded back
to UTF-8, so storing or answering them fails later), `NaN`/`Infinity`, and numbers that overflow a
double or a 64-bit integer. Optionally a cap on the number of objects, checked while parsing.

Cost on the usual small input: the C parser as before (number hooks run only for numbers) plus a
few C-speed scans; the tree is walked only when brackets or surrogate escapes make it necessary.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from typing import Any

import orjson

MAX_DEPTH = 64
DECODE_STEP = 1 << 20
INT64 = 1 << 63

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONG_NUMBER_B = re.compile(rb"[0-9]{19}")
FAST_MAX_BYTES = 64 * 1024  # orjson first up to this size (a bigger body is rarely small in objects)


class JsonRejected(ValueError):
    """Input refused: `reason` completes "the request body …" or "the frame …"; `code` is stable."""

    def __init__(self, reason: str, code: str = "invalid_json") -> None:
        super().__init__(f"the JSON {reason}")
        self.reason = reason
        self.code = code

    def about(self, subject: str) -> str:
        return f"{subject} {self.reason}"


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRejected(f"contains the number {text[:40]}, which is out of range")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -INT64 <= value < INT64:
        raise JsonRejected(
            f"contains the integer {text[:40]}{'…' if len(text) > 40 else ''}, which is outside the 64-bit range"
        )
    return value


def _no_constant(name: str) -> Any:
    raise JsonRejected(f"contains {name}, which is not a JSON number")


class ObjectBudget:
    """`object_pairs_hook` that stops the parse once `limit` objects were built. Calling back into
    Python per object also lets other threads (the event loop) take the GIL during a long parse."""

    def __init__(self, limit: int, hint: str = "") -> None:
        self.left = limit
        self.limit = limit
        self.hint = hint

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.left -= 1
        if self.left < 0:
            raise JsonRejected(f"holds more than {self.limit} JSON objects{self.hint}", code="request_too_complex")
        return dict(pairs)


def _decoder(object_pairs_hook: ObjectBudget | None = None) -> json.JSONDecoder:
    return json.JSONDecoder(
        parse_float=_finite_float,
        parse_int=_int64,
        parse_constant=_no_constant,
        object_pairs_hook=object_pairs_hook,
    )


_DECODER = _decoder()  # stateless; built once, not per call


def _too_deep() -> JsonRejected:
    return JsonRejected(f"nests deeper than {MAX_DEPTH} levels", code="json_too_deep")


def _lone_surrogate() -> JsonRejected:
    return JsonRejected(
        "contains a lone UTF-16 surrogate escape (such as \\ud800) in a string, which is not a "
        "Unicode character; send valid text",
        code="invalid_unicode",
    )


def _walk(value: Any, check_strings: bool) -> None:
    """Nesting depth (always) and lone surrogates in strings and keys (when escapes were seen)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for k, v in node.items():
                if check_strings and _SURROGATE.search(k):
                    raise _lone_surrogate()
                if isinstance(v, dict | list):
                    stack.append((v, depth + 1))
                elif check_strings and isinstance(v, str) and _SURROGATE.search(v):
                    raise _lone_surrogate()
        else:
            for v in node:
                if isinstance(v, dict | list):
                    stack.append((v, depth + 1))
                elif check_strings and isinstance(v, str) and _SURROGATE.search(v):
                    raise _lone_surrogate()


def _decode(raw: bytes) -> str:
    """Strict UTF-8; a big input in steps of DECODE_STEP bytes, so that a thread decoding it lets
    go of the GIL between steps instead of holding it for the whole body."""
    if len(raw) <= DECODE_STEP:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonRejected(f"is not valid UTF-8 (byte {exc.start})") from None
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[str] = []
    view = memoryview(raw)
    for at in range(0, len(raw), DECODE_STEP):
        try:
            parts.append(decoder.decode(view[at : at + DECODE_STEP], final=at + DECODE_STEP >= len(raw)))
        except UnicodeDecodeError as exc:
            raise JsonRejected(f"is not valid UTF-8 (byte {at + exc.start})") from None
    return "".join(parts)


def loads(data: bytes | str, *, object_budget: ObjectBudget | None = None) -> Any:
    """Parse `data` strictly (see the module doc); raises `JsonRejected`."""
    if isinstance(data, bytes | bytearray):
        raw = bytes(data)
        if raw.startswith(codecs.BOM_UTF8):
            raw = raw[3:]
        if object_budget is None and len(raw) <= FAST_MAX_BYTES:
            fast = _fast(raw)
            if fast is not _NO:
                return fast
        text = _decode(raw)
    else:
        text = data
    decoder = _DECODER if object_budget is None else _decoder(object_budget)
    try:
        value = decoder.decode(text)
    except RecursionError:
        raise _too_deep() from None
    except JsonRejected:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRejected(f"is not valid JSON: {exc}") from None
    except ValueError:  # int() beyond sys.get_int_max_str_digits
        raise JsonRejected("contains an integer with too many digits") from None
    if isinstance(value, dict | list):
        escapes = _has_surrogate_escape(text)
        if escapes or count(text, "{") + count(text, "[") > MAX_DEPTH:
            _walk(value, escapes)
    return value


_NO = object()


def _fast(data: bytes) -> Any:
    """orjson when it agrees with the rules above, else `_NO` (the standard path then parses, and
    words any refusal). It refuses what they refuse (invalid UTF-8, lone surrogate escapes, NaN
    and infinities, numbers that overflow a double) except integers from 2**63 up, which it reads
    (past 2**64 as floats): an input with a run of 19 digits goes the standard way, as does one
    with more brackets than `MAX_DEPTH` (only then can it nest that deep)."""
    if data.count(b"{") + data.count(b"[") > MAX_DEPTH or _LONG_NUMBER_B.search(data) is not None:
        return _NO
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _NO


def count(data: str | bytes, needle: Any) -> int:
    """`data.count(needle)`, over a big input in steps (see `_decode`)."""
    if len(data) <= DECODE_STEP:
        return data.count(needle)
    return sum(data.count(needle, at, at + DECODE_STEP) for at in range(0, len(data), DECODE_STEP))


def _has_surrogate_escape(text: str) -> bool:
    if len(text) <= DECODE_STEP:
        return _SURROGATE_ESCAPE.search(text) is not None
    # Steps overlap by 3 characters so that no 4-character escape prefix falls between two.
    return any(_SURROGATE_ESCAPE.search(text, at, at + DECODE_STEP + 3) for at in range(0, len(text), DECODE_STEP))
