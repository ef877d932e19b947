"""A value as an error message shows it: its repr, cut short, so a pasted megabyte (or a 5,000-digit
number) never becomes the message."""

from __future__ import annotations

from typing import Any


def shown(value: Any, limit: int = 80) -> str:
    """A string as `'head…' (N characters)`, as the CLI's error lines cut one (`cli/common.quoted`),
    so a message passed on to a command reads the same; anything else as its repr cut."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        head = repr(value[:limit])
        return f"{head[:-1]}…{head[-1]} ({len(value)} characters)"
    return f"{text[:limit]}… ({len(text)} characters)"


def clipped(text: str, limit: int = 80) -> str:
    """An id a message names unquoted (`no pending call call_1 …`), cut as `shown` cuts: the
    client's own characters stay as they are, for the front end to show safely."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


# An error message is a sentence or two, a relayed upstream error a few kilobytes: one that quotes a
# client's megabyte (an id, a name) is cut here, at the one place each front end builds its errors.
MESSAGE_MAX = 4096


def capped_message(message: str, limit: int = MESSAGE_MAX) -> str:
    """`message` as an error object or frame carries it: whole, or its head and its length."""
    return clipped(message, limit)


__all__ = ["MESSAGE_MAX", "capped_message", "clipped", "shown"]
