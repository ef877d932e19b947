"""A value as an error message shows it: its repr, cut short, so a pasted megabyte (or a 5,000-digit
number) never becomes the message."""

from __future__ import annotations

from typing import Any


def shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


__all__ = ["shown"]
