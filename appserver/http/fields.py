"""The types of request fields: each checker takes a field's value and the `param` to name, and
returns the value when it has the type (and range, enum) OpenAI's API description gives the field,
else raises a 400 naming it. `None` (JSON null, or the field absent) passes where the description
allows null; with `nullable=False` a null is refused like any other wrong type."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

from appserver.http.common import json_int, json_type
from appserver.http.errors import ApiError

# An object's fields as `shaped` checks them: (name, JSON type), the type ending in "?" when the
# field is optional (absent or null: not given), else required.
Fields = tuple[tuple[str, str], ...]

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
SHOWN_MAX = 200  # characters of a client's value an error message quotes


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: a string in single quotes, as OpenAI's
    messages quote one ('bogus'), anything else as its JSON text (null, true, 5, {"a": 1}), never
    Python's spelling of it (None, True, {'a': 1}). Long values are cut."""
    text = f"'{value}'" if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= SHOWN_MAX else f"{text[:SHOWN_MAX]}…"


def listed(values: Collection[str]) -> str:
    """Allowed string values as a message lists them: 'a', 'b', 'c'."""
    return ", ".join(shown(v) for v in values)


def type_error(param: str, expected: str, value: Any) -> ApiError:
    return ApiError(
        400,
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        code="invalid_type",
        param=param,
    )


def empty_array(param: str) -> ApiError:
    """OpenAI's refusal of an empty array where its description asks for one entry at least."""
    return ApiError(
        400,
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        code="empty_array",
        param=param,
    )


def missing(param: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{param}'.", code="missing_required_parameter", param=param)


def unknown(param: str) -> ApiError:
    """A field the object does not have in OpenAI's description, refused as OpenAI refuses one."""
    return ApiError(400, f"Unknown parameter: '{param}'.", code="unknown_parameter", param=param)


def known_keys(value: dict[str, Any], param: str, keys: Collection[str]) -> dict[str, Any]:
    """`value` (the object at `param`), whose every key is one of `keys`: another is a 400
    `unknown_parameter` naming `param.key`, as an unknown top-level field is, never dropped (a
    misspelt option would otherwise silently do nothing)."""
    for key in value:
        if key not in keys:
            raise unknown(f"{param}.{key}")
    return value


def required(container: dict[str, Any], name: str, param: str) -> Any:
    """`container[name]`, which OpenAI requires: absent is a 400 naming `param`."""
    if name not in container:
        raise missing(param)
    return container[name]


def required_string(container: dict[str, Any], name: str, param: str) -> str:
    """`container[name]`, a string OpenAI requires: absent is `missing_required_parameter`, null or
    another JSON type `invalid_type`, both naming `param`."""
    value = string(required(container, name, param), param, nullable=False)
    assert value is not None
    return value


def boolean(value: Any, param: str, *, nullable: bool = True) -> bool | None:
    if value is None and nullable:
        return None
    if not isinstance(value, bool):
        raise type_error(param, "a boolean", value)
    return value


def string(value: Any, param: str, *, max_length: int | None = None, nullable: bool = True) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise type_error(param, "a string", value)
    if max_length is not None and len(value) > max_length:
        raise ApiError(
            400,
            f"Invalid '{param}': string too long. Expected a string with maximum length {max_length}, "
            f"but got a string with length {len(value)} instead.",
            code="string_above_max_length",
            param=param,
        )
    return value


def plain_text(value: str | None, param: str) -> str | None:
    """`value`, refused (400 naming `param`) when it holds a NUL character: a string the store keeps
    as it is (a conversation's `user`), which PostgreSQL cannot hold and `store copy` cannot move."""
    if value is not None and "\x00" in value:
        raise ApiError(
            400,
            f"Invalid '{param}': the string must not contain a NUL character (\\u0000).",
            code="invalid_value",
            param=param,
        )
    return value


def one_of(value: Any, param: str, values: tuple[str, ...], *, nullable: bool = True) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise type_error(param, f"one of {listed(values)}", value)
    if value not in values:
        raise ApiError(
            400,
            f"Invalid value for '{param}': {shown(value)}. Supported values are: {listed(values)}.",
            code="invalid_value",
            param=param,
        )
    return value


def integer(
    value: Any, param: str, *, low: int | None = None, high: int | None = None, nullable: bool = True
) -> int | None:
    if value is None and nullable:
        return None
    number = json_int(value)
    if number is None:
        raise type_error(param, "an integer", value)
    if low is not None and number < low:
        raise ApiError(
            400,
            f"Invalid '{param}': integer below minimum value. Expected a value >= {low}, but got {number} instead.",
            code="integer_below_min_value",
            param=param,
        )
    if high is not None and number > high:
        raise ApiError(
            400,
            f"Invalid '{param}': integer above maximum value. Expected a value <= {high}, but got {number} instead.",
            code="integer_above_max_value",
            param=param,
        )
    return number


def number(value: Any, param: str, *, low: float, high: float, nullable: bool = True) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise type_error(param, "a number", value)
    if not low <= value <= high:
        code = "decimal_below_min_value" if value < low else "decimal_above_max_value"
        raise ApiError(
            400, f"Invalid '{param}': {value} is outside the range [{low:g}, {high:g}]", code=code, param=param
        )
    return float(value)


def obj(value: Any, param: str, *, nullable: bool = True) -> dict[str, Any] | None:
    if value is None and nullable:
        return None
    if not isinstance(value, dict):
        raise type_error(param, "an object", value)
    return value


def array(value: Any, param: str, *, nullable: bool = True) -> list[Any] | None:
    if value is None and nullable:
        return None
    if not isinstance(value, list):
        raise type_error(param, "an array", value)
    return value


def strings(value: Any, param: str, values: tuple[str, ...] | None = None) -> list[str] | None:
    """An array of strings (each one of `values` when given), or null."""
    items = array(value, param)
    if items is None:
        return None
    for i, item in enumerate(items):
        if values is None:
            string(item, f"{param}[{i}]", nullable=False)
        else:
            one_of(item, f"{param}[{i}]", values, nullable=False)
    return items


def function_name(value: Any, param: str) -> str:
    """A function's name as OpenAI takes one: 1–64 of a-z, A-Z, 0-9, _ and -. Another JSON type (null
    too) is `invalid_type`; a string outside the pattern `invalid_function_name`."""
    if not isinstance(value, str):
        raise type_error(param, "a string", value)
    if not FUNCTION_NAME.fullmatch(value):
        raise ApiError(
            400,
            f"Invalid '{param}': {shown(value)} does not match pattern. Expected a string that matches the pattern "
            "'^[a-zA-Z0-9_-]{1,64}$'.",
            code="invalid_function_name",
            param=param,
        )
    return value


METADATA_PAIRS = 16
METADATA_KEY_LENGTH = 64
METADATA_VALUE_LENGTH = 512


def metadata(value: Any, param: str = "metadata") -> dict[str, str] | None:
    """An object of at most 16 strings, keys of at most 64 characters and values of at most 512, as
    OpenAI has it (a client that passes here passes there)."""
    pairs = obj(value, param)
    if pairs is None:
        return None
    if len(pairs) > METADATA_PAIRS:
        raise ApiError(
            400,
            f"Invalid '{param}': too many properties. Expected an object with at most {METADATA_PAIRS} "
            f"properties, but got an object with {len(pairs)} properties instead.",
            code="object_above_max_properties",
            param=param,
        )
    for key, v in pairs.items():
        if len(key) > METADATA_KEY_LENGTH:
            raise ApiError(
                400,
                f"Invalid '{param}': key too long. Expected keys of at most {METADATA_KEY_LENGTH} characters, "
                f"but got a key with {len(key)} characters instead.",
                code="string_above_max_length",
                param=param,
            )
        string(v, f"{param}.{key}", max_length=METADATA_VALUE_LENGTH, nullable=False)
    return pairs


TOKEN_ID = re.compile(r"[0-9]+")
LOGIT_BIAS_MAX = 100  # OpenAI's documented range of a bias: -100 to 100


def logit_bias(value: Any, param: str = "logit_bias") -> dict[str, int] | None:
    """An object mapping token ids (non-negative integers, written as JSON object keys: strings of
    ASCII digits) to integer biases from -100 to 100, as OpenAI takes it, or null. A key that is no
    token id is `invalid_value` naming the object (as OpenAI names it: "Invalid key in
    'logit_bias'"); a bias of another type `invalid_type`, one outside the range
    `integer_below_min_value` / `integer_above_max_value`, both naming `logit_bias.<token id>`."""
    biases = obj(value, param)
    if biases is None:
        return None
    for key, bias in biases.items():
        if not TOKEN_ID.fullmatch(key):
            raise ApiError(
                400,
                f"Invalid key in '{param}': {shown(key)}. Keys must be token ids: non-negative integers "
                "(strings of digits).",
                code="invalid_value",
                param=param,
            )
        integer(bias, f"{param}.{key}", low=-LOGIT_BIAS_MAX, high=LOGIT_BIAS_MAX, nullable=False)
    return biases


def any_number(value: Any, param: str, *, nullable: bool = True) -> float | None:
    """A JSON number without a range (a log probability)."""
    return number(value, param, low=-math.inf, high=math.inf, nullable=nullable)


TYPE_CHECKS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {"string": string, "integer": integer, "number": any_number, "boolean": boolean, "object": obj, "array": array}
)


def shaped(value: Any, param: str, spec: Fields) -> dict[str, Any]:
    """`value`, an object (null is refused too), with each field of `spec` of its JSON type: a
    required one left out is `missing_required_parameter`, null or another type `invalid_type`; an
    optional one may be absent or null (not given), each named by its path (`param.name`). Other
    keys are not looked at: the objects checked so (an annotation, a log probability, a listed
    tool) are open in OpenAI's description."""
    entry = obj(value, param, nullable=False)
    assert entry is not None
    for name, kind in spec:
        at = f"{param}.{name}"
        if kind.endswith("?"):
            TYPE_CHECKS[kind[:-1]](entry.get(name), at)
        else:
            TYPE_CHECKS[kind](required(entry, name, at), at, nullable=False)
    return entry


def typed(value: Any, param: str, shapes: Mapping[str, Fields]) -> dict[str, Any]:
    """`value`, an object whose required `type` is one of `shapes` (else `invalid_value` naming
    `param.type`), with that type's fields (`shaped`): a member of a union OpenAI discriminates by
    `type` (an annotation, an MCP call's error)."""
    entry = obj(value, param, nullable=False)
    assert entry is not None
    kind = one_of(required(entry, "type", f"{param}.type"), f"{param}.type", tuple(shapes), nullable=False)
    assert kind is not None
    return shaped(entry, param, shapes[kind])


def each(value: Any, param: str, check: Callable[[Any, str], Any], *, nullable: bool = True) -> None:
    """`value`, an array (null too when `nullable`), each entry passing `check(entry, param[k])`."""
    for k, entry in enumerate(array(value, param, nullable=nullable) or ()):
        check(entry, f"{param}[{k}]")
