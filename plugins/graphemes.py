"""Grapheme clusters, for cutting text where a person sees a cut: never inside a character.

`is_grapheme_boundary` tells whether a cut between two code points separates two user-perceived
characters; `shorten` cuts a text to a length with "…" at such a boundary. The gateway splits long
replies with it (`gateway/split.py`) and shortens what it shows (a tool's arguments, a failure
reason); a plugin shortens platform fields with it (a Slack section's text). Standard library only,
so a plugin may import it (through `plugins.contract`).
"""

from __future__ import annotations

import unicodedata

ELLIPSIS = "…"

# The standard library has no grapheme segmentation (and the `regex` module is not a dependency):
# these are UAX #29's extended grapheme cluster rules, with the properties derived from `unicodedata`
# categories and a few explicit ranges. They cover what replies contain: accents and other combining
# marks, emoji with skin tones, variation selectors and ZWJ sequences, flags (regional-indicator
# pairs) and tag-sequence flags, Hangul jamo, CRLF, Indic conjuncts. Where they are simpler than the
# standard they keep more together, never less (every spacing mark is kept with what precedes it,
# whatever follows a ZWJ stays with it, any letter after a virama joins the conjunct), with one
# exception: only the Prepend characters listed below are known.

_ZWJ = "\u200d"
_CR, _LF = "\r", "\n"
_PREPEND = frozenset(
    [*range(0x0600, 0x0606), 0x06DD, 0x070F, 0x0890, 0x0891, 0x08E2, 0x0D4E, 0x110BD, 0x110CD, 0x111C2, 0x111C3]
)
# Indic virama-like "linkers" (InCB=Linker): consonant + linker (+ ZWJ/marks) + consonant is one cluster.
_LINKERS = frozenset([0x094D, 0x09CD, 0x0ACD, 0x0B4D, 0x0C4D, 0x0D4D])


# SpacingMark characters that are letters (Lo), not Mc: Thai SARA AM and Lao AM ("น้ำ", "ทำ" are one
# cluster each, and Thai is written without spaces, so a hard cut often lands right before one).
_SPACING_LETTERS = frozenset([0x0E33, 0x0EB3])


def _extend(ch: str) -> bool:
    """Grapheme_Cluster_Break Extend (or SpacingMark, also never cut before): combining marks,
    variation selectors, emoji modifiers (skin tones), tag characters, ZWNJ, Thai/Lao AM."""
    cp = ord(ch)
    if unicodedata.category(ch) in ("Mn", "Me", "Mc"):
        return True
    return (
        cp == 0x200C
        or cp in _SPACING_LETTERS
        or 0x1F3FB <= cp <= 0x1F3FF
        or 0xE0020 <= cp <= 0xE007F
        or 0xFF9E <= cp <= 0xFF9F
    )


def _control(ch: str) -> bool:
    """Grapheme_Cluster_Break Control (CR and LF apart): always a boundary on both sides."""
    cat = unicodedata.category(ch)
    if cat in ("Cc", "Zl", "Zp"):
        return True
    if cat == "Cf":
        cp = ord(ch)
        return not (cp in (0x200C, 0x200D) or cp in _PREPEND or 0xE0020 <= cp <= 0xE007F)
    return False


def _regional(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _hangul(ch: str) -> str | None:
    """The Hangul syllable type: L, V, T, LV, LVT (None for anything else)."""
    cp = ord(ch)
    if 0x1100 <= cp <= 0x115F or 0xA960 <= cp <= 0xA97C:
        return "L"
    if 0x1160 <= cp <= 0x11A7 or 0xD7B0 <= cp <= 0xD7C6:
        return "V"
    if 0x11A8 <= cp <= 0x11FF or 0xD7CB <= cp <= 0xD7FB:
        return "T"
    if 0xAC00 <= cp <= 0xD7A3:
        return "LV" if (cp - 0xAC00) % 28 == 0 else "LVT"
    return None


def is_grapheme_boundary(text: str, k: int) -> bool:
    """Whether `text[:k]` / `text[k:]` is a cut between two user-perceived characters."""
    if k <= 0 or k >= len(text):
        return True
    a, b = text[k - 1], text[k]
    if a == _CR and b == _LF:  # GB3
        return False
    if 0xD800 <= ord(a) <= 0xDBFF and 0xDC00 <= ord(b) <= 0xDFFF:  # a UTF-16 surrogate pair left unjoined
        return False
    if a in (_CR, _LF) or b in (_CR, _LF) or _control(a) or _control(b):  # GB4, GB5
        return True
    ha, hb = _hangul(a), _hangul(b)
    if ha is not None and hb is not None:  # GB6-GB8
        if ha == "L" and hb in ("L", "V", "LV", "LVT"):
            return False
        if ha in ("LV", "V") and hb in ("V", "T"):
            return False
        if ha in ("LVT", "T") and hb == "T":
            return False
    if b == _ZWJ or _extend(b):  # GB9, GB9a
        return False
    if ord(a) in _PREPEND:  # GB9b
        return False
    if a == _ZWJ:  # GB11 (kept with whatever it joins)
        return False
    if _regional(a) and _regional(b):  # GB12, GB13: flags are pairs
        run = 0
        i = k - 1
        while i >= 0 and _regional(text[i]):
            run += 1
            i -= 1
        return run % 2 == 0
    if unicodedata.category(b) == "Lo":  # GB9c: consonant [marks | linker | ZWJ]* with a linker × consonant
        i = k - 1  # marks may stand on either side of the linker: a nukta before it (ज़्य), a ZWJ after it
        linked = False
        while i > 0 and (text[i] == _ZWJ or _extend(text[i])):
            linked = linked or ord(text[i]) in _LINKERS
            i -= 1
        if linked and unicodedata.category(text[i]) == "Lo":
            return False
    return True  # GB999


def shorten(text: str, limit: int, ellipsis: str = ELLIPSIS) -> str:
    """`text` when it has at most `limit` characters, else its start cut at the last grapheme-cluster
    boundary that leaves room for `ellipsis`, followed by it: never half a character (an accent
    without its letter, half a flag, a family emoji broken into people). A single cluster longer
    than the room is cut inside, since the limit comes first."""
    if len(text) <= limit:
        return text
    room = max(limit - len(ellipsis), 0)
    cut = room
    while cut > 0 and not is_grapheme_boundary(text, cut):
        cut -= 1
    if cut == 0:
        cut = room
    return text[:cut] + ellipsis[: max(limit - cut, 0)]
