"""Type and range checks for config values, generic over the config dataclasses.

Every key is checked against its dataclass type hint (int, float, bool, str, `str | None`,
`list[str]`, `dict[str, X]`) plus an optional `Rule` (bounds or choices), so a new key is
type-checked the moment it is declared, and a typo'd or out-of-range value fails at load with the
key named, instead of surfacing later as odd behaviour (`queue_max = -5`, `body_max_bytes = 0`).
Environment values arrive as text and are parsed to the declared type first.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Rule:
    """Bounds (`ge`/`gt` below, `le` above) or a fixed set of `choices` for one key."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()


class Invalid(Exception):
    """A value does not fit its key; `expected` reads after "must be"."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def describe(hint: Any, rule: Rule | None = None) -> str:
    """What a key must be, in words: `an integer >= 1`, `one of 'none', 'token', 'jwt'`."""
    if rule is not None and rule.choices:
        return "one of " + ", ".join(repr(c) for c in rule.choices)
    base = _base(hint)
    words = (
        {
            int: "an integer",
            float: "a number",
            bool: "true or false",
            str: "a string",
        }.get(base)
        if isinstance(base, type)
        else None
    )
    if words is None:
        origin = typing.get_origin(base)
        args = typing.get_args(base)
        if origin is list:
            words = f"a list of {_plural(args[0] if args else str)}"
        elif origin is dict:
            words = f"a table of {_plural(args[1] if len(args) > 1 else str)}"
        else:
            words = f"a {base}"
    if rule is not None:
        bounds = []
        if rule.gt is not None:
            bounds.append(f"> {_num(rule.gt)}")
        if rule.ge is not None:
            bounds.append(f">= {_num(rule.ge)}")
        if rule.le is not None:
            bounds.append(f"<= {_num(rule.le)}")
        if bounds:
            words += " " + " and ".join(bounds)
    return words


def _plural(hint: Any) -> str:
    return {int: "integers", float: "numbers", bool: "booleans", str: "strings"}.get(hint, "values")


def _base(hint: Any) -> Any:
    """`str | None` → str (None is only ever a default: TOML has no null)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def convert(value: Any, hint: Any, rule: Rule | None, *, from_env: bool) -> Any:
    """`value` as the declared type, or Invalid. Environment text is parsed; TOML values must
    already have the right type (an integer key given "5" in TOML is a mistake worth naming)."""
    expected = describe(hint, rule)
    base = _base(hint)
    if from_env and isinstance(value, str):
        if value == "" and _optional(hint):
            return None
        value = _parse_env(value, base, expected)
    out = _typed(value, base, expected)
    if rule is not None:
        _check_rule(out, rule, expected)
    return out


# A number from the environment is what TOML would take, in ASCII: int() and float() also read `٥`
# as 5, `1_0` as 10 and `+5`, and int() refuses 5000 digits with its own message. Bounded length.
MAX_ENV_NUMBER_CHARS = 32
_ENV_INT_RE = re.compile(rf"-?[0-9]{{1,{MAX_ENV_NUMBER_CHARS}}}")
_ENV_FLOAT_RE = re.compile(
    rf"(?=.{{1,{MAX_ENV_NUMBER_CHARS}}}\Z)-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
)


def _parse_env(text: str, base: Any, expected: str) -> Any:
    t = text.strip()
    if base is bool:
        low = t.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise Invalid(expected)
    if base is int:
        if not _ENV_INT_RE.fullmatch(t):
            raise Invalid(expected)
        return int(t)
    if base is float:
        if not _ENV_FLOAT_RE.fullmatch(t):
            raise Invalid(expected)
        return float(t)
    origin = typing.get_origin(base)
    if origin is list:
        return [v.strip() for v in text.split(",") if v.strip()]
    if origin is dict:
        try:
            return json.loads(text)  # a table from the environment is a JSON object
        except json.JSONDecodeError:
            raise Invalid(expected + " (from the environment: a JSON object)") from None
        except RecursionError:  # arrays or objects nested thousands deep: no setting needs them
            raise Invalid(expected + " (from the environment: a JSON object; this one is nested too deeply)") from None
    return text


def _typed(value: Any, base: Any, expected: str) -> Any:
    if base is bool:
        if isinstance(value, bool):
            return value
        raise Invalid(expected)
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Invalid(expected)
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise Invalid(expected)
    if base is str:
        if isinstance(value, str):
            return value
        raise Invalid(expected)
    origin = typing.get_origin(base)
    args = typing.get_args(base)
    if origin is list:
        item = args[0] if args else str
        if not isinstance(value, list):
            raise Invalid(expected)
        return [_typed(v, item, expected) for v in value]
    if origin is dict:
        item = args[1] if len(args) > 1 else str
        if not isinstance(value, dict):
            raise Invalid(expected)
        return {str(k): _typed(v, item, expected) for k, v in value.items()}
    return value


def _check_rule(value: Any, rule: Rule, expected: str) -> None:
    if rule.choices:
        if value not in rule.choices:
            raise Invalid(expected)
        return
    if value is None:
        return
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
    for v in items:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if (
            (rule.ge is not None and v < rule.ge)
            or (rule.gt is not None and v <= rule.gt)
            or (rule.le is not None and v > rule.le)
        ):
            raise Invalid(expected)


def not_utf8_problem(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8, completing "the value …"; None when it can. A byte of
    the environment that is not UTF-8 reaches Python as a lone surrogate (U+DC80-U+DCFF), which
    passed as text and failed with a traceback wherever it was first encoded (a URL quoted for the
    log, a database's connection string). Names the byte and its position, never the text: it may
    hold a secret."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"the byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        return f"holds {what} at position {exc.start + 1}, which is not UTF-8: set it again as UTF-8 text"
    return None


# ── names and paths shared by config.py and channelconfig.py ──────────────────────────────────

NO_SUCH_USER = "its ~ names no user of this system; give the path itself"


class NoSuchUser(ValueError):
    """A path's `~user` names no user (or `~` no home directory): pathlib raises RuntimeError."""


def expand_user(value: str | Path) -> Path:
    """`Path(value).expanduser()`, or NoSuchUser: pathlib's RuntimeError ("Could not determine home
    directory") is no operator error, and escaped as a traceback. The caller names the setting and
    says NO_SUCH_USER, as `[server] tls_cert` does."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise NoSuchUser(NO_SUCH_USER) from None


class AmbiguousName(ValueError):
    """Several names of a table differ only in case, so an environment variable cannot pick one."""

    def __init__(self, candidates: list[str]) -> None:
        super().__init__(", ".join(repr(c) for c in candidates))
        self.candidates = candidates


def fold_name(env_name: str, known: Iterable[str]) -> str:
    """The name among `known` (a table's names from config.toml, built-in ones) that `env_name`
    means: an environment variable's parts are not case-sensitive (`APPSERVER_PROVIDERS__MYPROV__…`
    is `[providers.MyProv]`), so the one known name equal to it ignoring case; `env_name` itself
    when none is (a new table). AmbiguousName when two known names differ only in case."""
    matches = sorted({k for k in known if k.lower() == env_name.lower()})
    if len(matches) > 1:
        raise AmbiguousName(matches)
    return matches[0] if matches else env_name
