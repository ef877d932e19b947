"""Characters that do not show as themselves: one rule for every client that prints a value a
person must read exactly (the CLI's `exact`, the gateway's `/pair` listing), so `alice` and `alice`
with a zero-width space after it never print alike in one place and differently in another.

The same goes for two texts that differ only by Unicode normalization: `josé` (NFC, one
character é) and `jose\\u0301` (NFD, e and a combining acute) print the same raw. An NFC text (what
keyboards and nearly every platform send) prints as it is; in a text not in NFC, each character by
which it may print as another text is escaped (`shown`): `jose\\u0301`."""

from __future__ import annotations

import re
import unicodedata

# Controls (Cc), format characters (Cf: zero-width, joiners, BOM, soft hyphen, bidi, tags), line and
# paragraph separators, surrogates, unassigned and private-use code points: none shows as itself.
_HIDDEN_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs", "Cn", "Co"))
# Shown as nothing (or blank) although of another category: combining grapheme joiner, Hangul and
# Khmer fillers, the blank Braille pattern, and the variation selectors.
_INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u2800\u3164\uffa0")
# Every character but printable ASCII: only these can be escaped (ASCII controls are hidden ones).
_NOT_PLAIN = re.compile("[^\x20-\x7e]")


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


def unnormal(char: str) -> bool:
    """Whether `char`, in a text not in NFC, may make it print as another text: a mark (it composes
    with the letter before it or is reordered: `e` and U+0301 print as `é`), a character NFC
    replaces (U+212B ANGSTROM SIGN prints as `Å`, U+00C5), a Hangul conjoining jamo (jamo compose
    into syllables). Every character that NFC composes with the one before it is among these."""
    return (
        unicodedata.category(char).startswith("M")
        or unicodedata.normalize("NFC", char) != char
        or "\u1100" <= char <= "\u11ff"
        or "\ua960" <= char <= "\ua97f"
        or "\ud7b0" <= char <= "\ud7ff"
    )


def shown(text: str) -> str:
    """`text` with each character that could pass for something it is not as its escape: every
    hidden one, and in a text not in NFC every `unnormal` one. Two different texts never print the
    same (but for a backslash, which a caller showing ids doubles first)."""
    if unicodedata.is_normalized("NFC", text):
        return _NOT_PLAIN.sub(_escaped_if_hidden, text)
    return _NOT_PLAIN.sub(_escaped_if_hidden_or_unnormal, text)


def _escaped_if_hidden(match: re.Match[str]) -> str:
    char = match.group()
    return escape(char) if hidden(char) else char


def _escaped_if_hidden_or_unnormal(match: re.Match[str]) -> str:
    char = match.group()
    return escape(char) if hidden(char) or unnormal(char) else char


def escape(char: str) -> str:
    """`char` as an escape a person can read and type back: `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`."""
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


__all__ = ["escape", "hidden", "shown", "unnormal"]
