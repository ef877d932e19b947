"""A value as an error message shows it: its repr, cut short, so a pasted megabyte (or a 5,000-digit
number) never becomes the message."""

from __future__ import annotations

from typing import Any


def shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


# An error message is a sentence or two, a relayed upstream error a few kilobytes: one that quotes a
# client's megabyte (an id, a name) is cut here, at the one place each front end builds its errors.
MESSAGE_MAX = 4096


def capped_message(message: str, limit: int = MESSAGE_MAX) -> str:
    """`message` as an error object or frame carries it: whole, or its head and its length."""
    return message if len(message) <= limit else f"{message[:limit]}… ({len(message)} characters)"


__all__ = ["MESSAGE_MAX", "capped_message", "shown"]
