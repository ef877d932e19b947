"""Characters that do not show as themselves: one rule for every client that prints a value a
person must read exactly (the CLI's `exact`, the gateway's `/pair` listing), so `alice` and `alice`
with a zero-width space after it never print alike in one place and differently in another."""

from __future__ import annotations

import unicodedata

# Controls (Cc), format characters (Cf: zero-width, joiners, BOM, soft hyphen, bidi, tags), line and
# paragraph separators, surrogates, unassigned and private-use code points: none shows as itself.
_HIDDEN_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs", "Cn", "Co"))
# Shown as nothing (or blank) although of another category: combining grapheme joiner, Hangul and
# Khmer fillers, the blank Braille pattern, and the variation selectors.
_INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u2800\u3164\uffa0")


def hidden(char: str) -> bool:
    """Whether `char` can pass for something it is not: nothing, a plain space, another order."""
    category = unicodedata.category(char)
    return (
        category in _HIDDEN_CATEGORIES
        or (category == "Zs" and char != " ")  # no-break, em, thin, ideographic… spaces
        or char in _INVISIBLE
        or "\ufe00" <= char <= "\ufe0f"
        or "\U000e0100" <= char <= "\U000e01ef"
    )


def escape(char: str) -> str:
    """`char` as an escape a person can read and type back: `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`."""
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


__all__ = ["escape", "hidden"]
