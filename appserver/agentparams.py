"""Per-agent parameters (`agents.params`): each key's kind and range, in one table.

Both ends check against it: `appserver agents create/update --param` parses a value from its text
(agent_admin.py), and the store checks each value it reads back (store/rows.py), so a value the
command would refuse (a hand edit, a damaged cell: `{"context_window": [1]}`) never reaches the
agent loop, which did `int(...)` on it and answered HTTP 500. Imports nothing of appserver: the
store uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class BadParam(ValueError):
    """A value that is not of its key's kind or range; the message says what it must be."""


@dataclass(frozen=True, slots=True)
class Param:
    """One key: `parse` reads it from a command's text (BadParam when it does not fit); `fits`
    tells whether a stored value is one `parse` could have made; `what` says what it must be."""

    what: str
    parse: Callable[[str], Any]
    fits: Callable[[Any], bool]


def _is_number(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


def number(kind: type, low: float, high: float) -> Param:
    """An integer (`kind` int) or a number between `low` and `high`."""
    noun = "an integer" if kind is int else "a number"

    def fits(value: Any) -> bool:
        return _is_number(value, kind) and low <= value <= high

    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise BadParam(f"expected {noun}") from None
        if not fits(value):
            raise BadParam(f"must be between {low:g} and {high:g}")
        return value

    return Param(f"{noun} between {low:g} and {high:g}", parse, fits)


def choice(*choices: str) -> Param:
    def parse(raw: str) -> Any:
        if raw not in choices:
            raise BadParam(f"use {', '.join(choices)}")
        return raw

    return Param(f"one of {', '.join(choices)}", parse, lambda value: value in choices and isinstance(value, str))


def _flag(raw: str) -> bool:
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(raw.lower())
    if value is None:
        raise BadParam("use true or false")
    return value


def _texts(value: Any) -> bool:
    """Text, or a list of texts (a provider's stop sequences, as the store's API may hold them)."""
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


TEXT = Param("text or a list of texts", lambda raw: raw, _texts)
FLAG = Param("true or false", _flag, lambda value: isinstance(value, bool))

# Provider sampling/length settings, context and loop limits, presentation.
AGENT_PARAMS: dict[str, Param] = {
    "temperature": number(float, 0, 2),
    "top_p": number(float, 0, 1),
    "max_tokens": number(int, 1, 10_000_000),
    "reasoning_effort": choice("minimal", "low", "medium", "high"),
    "stop": TEXT,
    "context_window": number(int, 512, 100_000_000),
    "max_steps": number(int, 1, 1_000),
    "reasoning": choice("shown", "hidden"),
    "allow_overrides": FLAG,
    # OpenAI routes: leave system text out of the history hash (docs/openai.md, issue 13.15)
    "match_ignores_system": FLAG,
}


def param_problem(key: str, value: Any) -> str | None:
    """Why a stored `key: value` is not one the command could have set, else None. A key this
    version does not know is left alone (nothing reads it); null reads as not set, as `KEY=` sets."""
    param = AGENT_PARAMS.get(key)
    if param is None or value is None or param.fits(value):
        return None
    return f"not {param.what}"


__all__ = ["AGENT_PARAMS", "FLAG", "TEXT", "BadParam", "Param", "choice", "number", "param_problem"]
