"""Strict JSON for what clients send (HTTP bodies, WebSocket frames): anything the parser, a later
encoder or the store would choke on is refused here, before anything is written.

Refused: invalid UTF-8 (which includes UTF-8-encoded surrogates), invalid JSON, nesting deeper
than `MAX_DEPTH`, lone UTF-16 surrogates from `\\ud800`-style escapes (they cannot be encoded back
to UTF-8, so storing or answering them fails later), `NaN`/`Infinity`, and numbers that overflow a
double or a 64-bit integer. Optionally (`max_objects`) caps on what a big input holds: objects,
counted while parsing, and arrays and values, counted in the text before the parse (`check_counts`).

Cost on the usual small input: the C parser as before (number hooks run only for numbers) plus a
few C-speed scans; the tree is walked only when brackets or surrogate escapes make it necessary.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from dataclasses import astuple, dataclass
from typing import Any

import orjson

MAX_DEPTH = 64
DECODE_STEP = 1 << 20
INT64 = 1 << 63

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONG_NUMBER_B = re.compile(rb"[0-9]{19}")
FAST_MAX_BYTES = 64 * 1024  # orjson first up to this size (a bigger body is rarely small in objects)
# With `max_objects`: an input of up to this many bytes is parsed without counting (it cannot hold
# enough arrays or values to cost much); a bigger one holds at most `max_objects` objects and as
# many arrays, and VALUES_PER_OBJECT times as many values (a frame of 1.3 million `[]` or 2 million
# numbers cost 0.4-0.6 s of the event loop to parse: GC passes, number checks and the depth walk).
COUNT_FROM_BYTES = 64 * 1024
VALUES_PER_OBJECT = 4


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


def loads(
    data: bytes | str, *, object_budget: ObjectBudget | None = None, max_objects: int | None = None, hint: str = ""
) -> Any:
    """Parse `data` strictly (see the module doc); raises `JsonRejected`. `max_objects`: an input
    over COUNT_FROM_BYTES is refused (`request_too_complex`, `hint` appended) beyond that many
    objects or arrays, or VALUES_PER_OBJECT times as many values; the arrays and values before the
    parse (`check_counts`), the objects while parsing (`ObjectBudget`, when `{` is that frequent)."""
    if max_objects is not None and object_budget is None and len(data) > COUNT_FROM_BYTES:
        check_counts(data, max_arrays=max_objects, max_values=VALUES_PER_OBJECT * max_objects, hint=hint)
        if count(data, "{" if isinstance(data, str) else b"{") > max_objects:
            object_budget = ObjectBudget(max_objects, hint)
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


def check_counts(data: str | bytes, *, max_arrays: int, max_values: int, hint: str = "") -> None:
    """Refuse, before parsing, an input of more than `max_arrays` arrays or `max_values` values
    (strings, numbers, literals, arrays and objects; keys are not values). At C speed: counts of
    characters, and only when those could be over a limit, the same counts outside strings (which
    may hold any number of brackets and commas: a pasted CSV or source file)."""
    s = _Chars.of(data)
    arrays = count(data, s.open_array)
    if arrays <= max_arrays and _values_at_most(data, s, arrays) <= max_values:
        return
    bare = data
    for escape in (s.escaped_backslash, s.escaped_quote):  # in this order: `\\"` ends a string
        if escape in bare:
            bare = bare.replace(escape, s.empty)
    if count(bare, s.quote) > 4 * max_values:  # every string is a value or a key, and keys are fewer
        raise _too_many(f"more than {max_values} JSON values", hint)
    outside = s.quote.join(bare.split(s.quote)[::2])  # each string a lone `"`: `[""]` is no `[]`
    arrays = count(outside, s.open_array)
    if arrays > max_arrays:
        raise _too_many(f"{arrays} JSON arrays, more than {max_arrays}", hint)
    # (`[ ]` with a blank inside counts one value too many: no client writes that in bulk)
    values = _values_at_most(outside, s, arrays) - count(outside, s.empty_array) - count(outside, s.empty_object)
    if values > max_values:
        raise _too_many(f"{values} JSON values, more than {max_values}", hint)


def _too_many(what: str, hint: str) -> JsonRejected:
    return JsonRejected(f"holds {what}{hint}", code="request_too_complex")


def _values_at_most(data: str | bytes, s: _Chars, arrays: int) -> int:
    """Values if `data` (holding `arrays` `[`) holds no strings and no empty containers: one for
    the whole input, one for each container's first entry and one per comma; more otherwise."""
    return 1 + count(data, s.comma) + arrays + count(data, s.open_object)


@dataclass(frozen=True, slots=True)
class _Chars:
    """The characters `check_counts` looks for, as text or as bytes (the input's type)."""

    quote: Any
    comma: Any
    open_array: Any
    open_object: Any
    empty_array: Any
    empty_object: Any
    escaped_backslash: Any
    escaped_quote: Any
    empty: Any

    @staticmethod
    def of(data: str | bytes) -> _Chars:
        return _TEXT_CHARS if isinstance(data, str) else _BYTE_CHARS


_TEXT_CHARS = _Chars('"', ",", "[", "{", "[]", "{}", "\\\\", '\\"', "")
_BYTE_CHARS = _Chars(*(c.encode() for c in astuple(_TEXT_CHARS)))


def _has_surrogate_escape(text: str) -> bool:
    if len(text) <= DECODE_STEP:
        return _SURROGATE_ESCAPE.search(text) is not None
    # Steps overlap by 3 characters so that no 4-character escape prefix falls between two.
    return any(_SURROGATE_ESCAPE.search(text, at, at + DECODE_STEP + 3) for at in range(0, len(text), DECODE_STEP))
