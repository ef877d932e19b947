"""Text that arrives in many small pieces (a streamed reply's deltas, a tool call's arguments), kept
compactly while it grows.

A list with one string per piece costs a string object per piece: ~50 bytes of header and a list
slot beside a delta of a few characters, so a reply of 4 million two-character deltas (an 8 MB
paste echoed back) held ~230 MB until its conversation was evicted. Here every `FOLD` pieces are
joined into one string (each character is copied once more, in steps of `FOLD` pieces), and
`text()` joins what is there and keeps the result, so later reads, and whoever holds the text it
returned (a snapshot), share that one string.
"""

from __future__ import annotations

FOLD = 64


class TextParts:
    __slots__ = ("_parts", "_loose")

    def __init__(self, first: str = "") -> None:
        self._parts: list[str] = [first] if first else []
        self._loose = 0  # pieces at the end of `_parts` not folded yet

    def add(self, piece: str) -> None:
        parts = self._parts
        parts.append(piece)
        self._loose += 1
        if self._loose >= FOLD:
            parts[-FOLD:] = ["".join(parts[-FOLD:])]
            self._loose = 0

    def text(self) -> str:
        parts = self._parts
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return ""
        joined = "".join(parts)
        self._parts = [joined]
        self._loose = 0
        return joined

    def __bool__(self) -> bool:
        """Any text at all (pieces may be empty strings)."""
        return any(self._parts)


__all__ = ["FOLD", "TextParts"]
