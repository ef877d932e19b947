"""Split a long reply into parts a platform accepts, without breaking Markdown code fences.

Rules, in order of preference for where a part ends:

1. at a paragraph boundary (a blank line outside a code fence), if the part is at least half the
   limit;
2. at a line boundary outside a fence, with the same minimum;
3. at the last line boundary that fits, even inside a fence: the fence is then closed at the end of
   the part and reopened (with its info string, e.g. ```` ```python ````) at the start of the next;
4. a line longer than the room left (or one that would leave a part under half the limit) is
   cut at its last space that fits, else hard: at the last grapheme-cluster boundary that fits, so
   a cut never separates a letter from its combining accents, an emoji from its skin tone,
   variation selector or ZWJ sequence (a family stays one family), the two halves of a flag, a
   Hangul syllable's jamo, or CR from LF. Only a single cluster longer than the whole room (a
   pathological run of marks) is cut inside, because the limit comes first.

Blank lines at a cut are dropped, and so is the space a line is cut at; nothing else is (a hard cut
drops nothing: the parts joined give the line back). Every part is at most `limit` characters
(measured in `str` length, as the platforms document theirs) and has balanced fences.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# A fence opener or closer: up to three spaces, then ``` or ~~~ (3 or more).
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
MIN_LIMIT = 32


@dataclass(frozen=True)
class _Line:
    text: str
    fence_before: str | None  # reopening line of the fence open before this line
    fence_after: str | None  # reopening line of the fence open after this line


def split_message(text: str, limit: int) -> list[str]:
    """Parts of `text`, each at most `limit` characters; `[]` for empty text."""
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT}")
    if len(text) <= limit:
        return [text] if text.strip() else []
    lines = _annotate(text.split("\n"), limit)
    parts: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].text.strip() and lines[i].fence_before is None:
            i += 1  # blank lines at a cut
            continue
        j = _cut(lines, i, limit)
        if j == i:  # one line too long for any part: cut it, keep the rest for the next part
            head, rest = _wrap(lines[i], limit - _overhead(lines, i, i + 1))
            lines[i : i + 1] = [head, rest]
            j = i + 1
        elif j < len(lines) and len(lines[j].text) > limit // 2:
            j = _fill(lines, i, j, limit)
        part = _render(lines, i, j)
        if part.strip():  # a head of only indentation, cut off an over-long line, is not a part
            parts.append(part)
        i = j
    return parts


def fence_closer(opener: str) -> str:
    """The line that closes the fence `opener` opened."""
    m = _FENCE.match(opener)
    assert m is not None
    return m.group(1)


def _annotate(raw: list[str], limit: int) -> list[_Line]:
    """Mark each line with the fence open around it, as the line that would reopen it (the opener
    itself, or only its marker when the opener is too long to repeat in every part)."""
    out = []
    fence: str | None = None
    for line in raw:
        before = fence
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = line if len(line) <= limit // 4 else m.group(1)
            elif _closes(fence, m):
                fence = None
        out.append(_Line(line, before, fence))
    return out


def _closes(opener: str, m: re.Match[str]) -> bool:
    marker = fence_closer(opener)
    return m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker) and not m.group(2).strip()


def _prefix(lines: list[_Line], i: int) -> str | None:
    """The reopening line a part starting at `i` needs (None outside a fence)."""
    return lines[i].fence_before


def _suffix(lines: list[_Line], j: int) -> str | None:
    """The closing line a part ending before `j` needs (None when no fence is open there)."""
    opener = lines[j - 1].fence_after
    return fence_closer(opener) if opener is not None else None


def _overhead(lines: list[_Line], i: int, j: int) -> int:
    pre, suf = _prefix(lines, i), _suffix(lines, j)
    return (len(pre) + 1 if pre is not None else 0) + (len(suf) + 1 if suf is not None else 0)


def _render(lines: list[_Line], i: int, j: int) -> str:
    body = [line.text for line in lines[i:j]]
    while body and not body[-1].strip() and lines[i + len(body) - 1].fence_after is None:
        body.pop()
    pre, suf = _prefix(lines, i), _suffix(lines, j)
    return "\n".join(([pre] if pre is not None else []) + body + ([suf] if suf is not None else []))


def _cut(lines: list[_Line], i: int, limit: int) -> int:
    """The end (exclusive) of the best part starting at `i`; `i` when not even one line fits."""
    size = 0
    best_any = best_line = best_para = i
    for j in range(i + 1, len(lines) + 1):
        size += len(lines[j - 1].text) + (1 if j > i + 1 else 0)
        if size + _overhead(lines, i, j) > limit:
            break
        best_any = j
        outside = lines[j - 1].fence_after is None
        if outside and size >= limit // 2:
            best_line = j
            at_para = j == len(lines) or (not lines[j].text.strip() and lines[j].fence_before is None)
            if at_para:
                best_para = j
    if best_any == len(lines):
        return best_any
    return best_para if best_para > i else best_line if best_line > i else best_any


def _fill(lines: list[_Line], i: int, j: int, limit: int) -> int:
    """A part cut short by a long next line takes that line's head, so parts stay well filled."""
    used = len(_render(lines, i, j))
    if used >= limit // 2:
        return j
    room = limit - used - 1
    while room > 0:
        head, rest = _wrap(lines[j], room)
        trial = lines[:j] + [head]
        if len(_render(trial, i, j + 1)) <= limit:
            lines[j : j + 1] = [head, rest]
            return j + 1
        room -= len(_render(trial, i, j + 1)) - limit
    return j


def _wrap(line: _Line, room: int) -> tuple[_Line, _Line]:
    """Cut an over-long content line at its last space within `room`, else at the last grapheme
    boundary within `room` (exactly at `room` only when one cluster is longer than that)."""
    room = max(room, 1)
    text = line.text
    indent = len(text) - len(text.lstrip(" "))
    cut = text.rfind(" ", indent + 1, room + 1)  # never in the indentation: that would leave a blank head
    while cut > 0 and not (is_grapheme_boundary(text, cut) and is_grapheme_boundary(text, cut + 1)):
        cut = text.rfind(" ", indent + 1, cut)  # a space carrying a combining mark, or inside a ZWJ sequence
    if cut <= 0:
        at = min(room, len(text))
        while at > 0 and not is_grapheme_boundary(text, at):
            at -= 1
        if at == 0:
            at = room  # a single cluster longer than the room: the limit wins
        head, rest = text[:at], text[at:]
    else:
        head, rest = text[:cut], text[cut + 1 :]
    fence = line.fence_before if line.fence_before == line.fence_after else None
    return _Line(head, line.fence_before, fence), _Line(rest, fence, line.fence_after)


# ---------------------------------------------------------------------------- grapheme clusters
#
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


def _extend(ch: str) -> bool:
    """Grapheme_Cluster_Break Extend (or SpacingMark, also never cut before): combining marks,
    variation selectors, emoji modifiers (skin tones), tag characters, ZWNJ."""
    cp = ord(ch)
    if unicodedata.category(ch) in ("Mn", "Me", "Mc"):
        return True
    return cp == 0x200C or 0x1F3FB <= cp <= 0x1F3FF or 0xE0020 <= cp <= 0xE007F or 0xFF9E <= cp <= 0xFF9F


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
    if unicodedata.category(b) == "Lo":  # GB9c: consonant + linker (+ marks / ZWJ) + consonant
        i = k - 1
        while i > 0 and (text[i] == _ZWJ or (_extend(text[i]) and ord(text[i]) not in _LINKERS)):
            i -= 1
        if ord(text[i]) in _LINKERS and i > 0 and unicodedata.category(text[i - 1]) == "Lo":
            return False
    return True  # GB999
