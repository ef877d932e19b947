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
   pathological run of marks) is cut inside, because the limit comes first. A cut is not made
   inside a Markdown link `[text](url)` (the link moves to the next part) unless that would leave
   a part under half the limit, and a word too long for any part is cut hard right away rather
   than after a tiny head (`echo:` alone). A cut that would leave a rest starting like a fence
   (``` or ~~~) moves back to where it does not; when that is no cut worth a part and the run of
   backticks (or tildes) is too long for the next part anyway (`echo: ` and 5,000 backticks), the
   cut stays hard at the limit and its rest, which reads as a fence but is text, is sent as a part
   of its own and never closed (a closer would make the platform show an empty code block, or the
   closer as more backticks, in place of the text).

Inline spans a cut goes through outside code (`||spoiler||`, `**bold**`, `__underline__`,
`~~strike~~`, `` `code` ``) are closed at the end of the part and reopened at the start of the next,
in order, within the limit: on Discord an unclosed `||` is text, which showed a long spoiler in the
clear. Only a span its text closes in the same paragraph counts; a lone marker is left alone.

Blank lines at a cut are dropped, and so is the space a line is cut at; nothing else is (a hard cut
drops nothing: the parts joined, less the markers added around a span, give the line back). Every
part is at most `limit` characters (measured in `str` length, as the platforms document theirs;
up to `most` when the platform's own test of a part decides: `split_message`) and has balanced
fences, save such a rest of a long run alone in its part. The grapheme-cluster
rules live in `plugins/graphemes.py` (re-exported by `plugins.contract`, so a plugin cuts text the
same way).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass

from plugins.contract import is_grapheme_boundary

# A fence opener or closer (CommonMark): up to three spaces, then ``` or ~~~ (3 or more); the info
# string after backticks holds no backtick (```` ```x``` ```` is inline code, no fence).
_FENCE = re.compile(r"^ {0,3}(`{3,}(?=[^`]*$)|~{3,})(.*)$")
_LINK_TAIL = re.compile(r"\([^()\s]*\)")  # the `(url)` of a Markdown link or image, kept whole by a cut
MIN_LIMIT = 32
# A caller whose `fits` is the platform's whole test of a part (the gateway's delivery) lets a part
# carry up to this many times `limit` characters of Markdown (`split_message`'s `most`): link URLs
# and markup are not what Telegram counts, so a reply of links needs no more messages than its shown
# text does; the bound keeps one request's text reasonable.
SOURCE_FACTOR = 4
# What one delivery outside a turn's own reply sends at most: a cron `--deliver` reply and a
# `message_channel` send or reply (10 Telegram messages, about 20 on Discord). A longer text is cut
# here with a note saying so (`cap_text`): a 6 MB reply would be 1,500 chat messages, and its
# command line to the gateway child would be larger than that child reads.
DELIVER_MAX_CHARS = 40_000

__all__ = ["DELIVER_MAX_CHARS", "MIN_LIMIT", "SOURCE_FACTOR", "cap_text", "is_grapheme_boundary", "split_message"]


def cap_text(text: str, limit: int = DELIVER_MAX_CHARS) -> str:
    """`text` when it has at most `limit` characters; else its beginning (cut at a grapheme-cluster
    boundary, a code fence it leaves open closed) and a note that the rest was cut, naming the sizes,
    together at most `limit` characters (so capping again changes nothing)."""
    if len(text) <= limit:
        return text
    note = f"\n\n✂ Cut here: the text has {len(text):,} characters, and one delivery sends at most {limit:,}."
    room = max(limit - len(note), 0)
    reserve = 0
    for _ in range(3):
        kept = _cut_at_cluster(text, max(room - reserve, 0))
        closer = _open_fence_closer(kept)
        if len(kept) + len(closer) <= room:
            return f"{kept}{closer}{note}"
        reserve = len(closer)
    return f"{_cut_at_cluster(text, room)}{note}"[:limit]


def _cut_at_cluster(text: str, room: int) -> str:
    cut = room
    while cut > 0 and not is_grapheme_boundary(text, cut):
        cut -= 1
    return text[: cut or room]  # one absurd cluster: the limit comes first


def _open_fence(text: str) -> str | None:
    """The opening line of a code fence `text` leaves open, or None."""
    opener: str | None = None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if m and opener is None:
            opener = line
        elif m and opener is not None and _closes(opener, m):
            opener = None
    return opener


def _open_fence_closer(text: str) -> str:
    opener = _open_fence(text)
    return f"\n{fence_closer(opener)}" if opener is not None else ""


@dataclass(frozen=True)
class _Line:
    text: str
    fence_before: str | None  # reopening line of the fence open before this line
    fence_after: str | None  # reopening line of the fence open after this line
    # The rest of a line `_wrap` cut: the links of the whole line (found once, by start) and where
    # this text starts in it. Searching each rest again made a long line quadratic (1 MB: seconds).
    links: tuple[tuple[int, int], ...] | None = None
    offset: int = 0
    # It starts with the rest of a run of backticks or tildes a hard cut went through: text, though
    # it reads as a fence. It is a part of its own, never closed.
    literal: bool = False


def split_message(
    text: str, limit: int, fits: Callable[[str], bool] | None = None, *, most: int | None = None
) -> list[str]:
    """Parts of `text`, each at most `limit` characters (`most`, given `fits`); `[]` for empty text.

    `fits` is the platform's own test of a part (Telegram counts the text it shows, in UTF-16 units,
    after formatting): a part it refuses is made again, as large as still passes, by a binary search
    over the room (at least `MIN_LIMIT`), and the next part starts right after it. So each part is
    filled greedily instead of the whole text being cut finer (which made many small parts). With
    `most` (more than `limit`), `fits` decides alone up to that many characters: a part of `limit`
    characters it passes with room to spare (link URLs and markup, which the platform does not
    count) grows the same way, so a reply is split only where the platform would refuse it."""
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT}")
    most = limit if most is None or fits is None else max(most, limit)  # the characters a part may carry
    if len(text) <= most and (fits is None or fits(text)):
        return [text] if text.strip() else []
    if "```" in text:
        text = fences_on_own_lines(text)
    parts = _split(text, limit, fits, most)
    reserve = 0
    for _ in range(6):  # room for the markers that balance the inline spans a cut goes through
        balanced = _balanced_spans(text, parts)
        if balanced is None or balanced == parts:
            return parts
        if all(len(part) <= most and (fits is None or fits(part)) for part in balanced):
            return balanced
        reserve = max(2 * reserve, _added(parts, balanced), 8)
        if limit - reserve < MIN_LIMIT:
            break
        parts = _split(text, limit - reserve, _padded(fits, reserve), most - reserve)
    return parts  # no room for the markers: the limit comes first


def _padded(fits: Callable[[str], bool] | None, reserve: int) -> Callable[[str], bool] | None:
    """`fits` with room left for `reserve` more characters (the markers a part may get)."""
    if fits is None:
        return None
    platform_fits = fits
    return lambda part: platform_fits(part + "." * reserve)


def _added(parts: list[str], balanced: list[str]) -> int:
    return max(len(b) - len(p) for p, b in zip(parts, balanced, strict=True))


def _split(text: str, limit: int, fits: Callable[[str], bool] | None, most: int) -> list[str]:
    """The parts of `text` (fences on their own lines), code fences balanced; a part `fits` passes
    with room to spare grows up to `most` characters (`_grown`)."""
    lines = _annotate(text.split("\n"), limit)
    parts: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].text.strip() and lines[i].fence_before is None:
            i += 1  # blank lines at a cut
            continue
        part, j, cut = _next_part(lines, i, limit)
        if fits is not None and not fits(part):
            part, j, cut = _largest_fitting(lines, i, MIN_LIMIT, limit, fits)
        elif fits is not None and j < len(cut) and most > limit and (_in_link(cut, j) or _has_room(part, limit, fits)):
            part, j, cut = _grown(lines, i, limit, most, fits)
        lines = cut
        if part.strip():  # a head of only indentation, cut off an over-long line, is not a part
            parts.append(part if lines[i].literal else _closed(part, most, fits))
        i = j
    return parts


def _in_link(lines: list[_Line], j: int) -> bool:
    """Whether line `j` starts inside a Markdown link: a hard cut went through a link longer than the
    room (a long URL), which a larger part may keep whole."""
    line = lines[j]
    links = line.links or ()
    k = bisect.bisect_left(links, (line.offset, -1)) - 1  # the last link starting before it (they do not overlap)
    return k >= 0 and links[k][1] > line.offset


def _has_room(part: str, limit: int, fits: Callable[[str], bool]) -> bool:
    """Whether the platform would take an eighth of `limit` more shown text after `part`: only then
    is a larger part worth the search (a part of plain prose fills the limit as it is)."""
    return fits(part + "\n" + "." * max(limit // 8, 1))


def _grown(
    lines: list[_Line], i: int, limit: int, most: int, fits: Callable[[str], bool]
) -> tuple[str, int, list[_Line]]:
    """The part starting at line `i` with the largest room from `limit` (where it fits) up to `most`
    characters that `fits` still passes: the room doubles while the part fits, then a binary search
    finds it to within a sixteenth of `limit` (each trial formats the part, and the gateway splits
    the whole reply at every update of it, so the trials are few and small)."""
    low = room = limit
    best = None
    while room < most:
        room = min(2 * room, most)
        trial = _next_part(lines, i, room)
        if not fits(trial[0]):
            return _largest_fitting(lines, i, low, room, fits, step=max(limit // 16, 1))
        low, best = room, trial
        if trial[1] >= len(trial[2]):
            break  # the rest of the text
    return best or _next_part(lines, i, low)


def _next_part(lines: list[_Line], i: int, room: int) -> tuple[str, int, list[_Line]]:
    """The part starting at line `i` within `room`, the line after it, and the lines as they are then
    (an over-long line cut in two: a copy, so another room can be tried on the original)."""
    j = _cut(lines, i, room)
    if j == i:  # one line too long for any part: cut it, keep the rest for the next part
        head, rest = _wrap(lines[i], room - _overhead(lines, i, i + 1), alone=True)
        lines = [*lines[:i], head, rest, *lines[i + 1 :]]
        j = i + 1
    elif lines[i].literal:
        j = i + 1  # alone: a line after it would be read as the code of a block it opened
    elif j < len(lines) and len(lines[j].text) > room // 2:
        lines = list(lines)
        j = _fill(lines, i, j, room)
    return _render(lines, i, j), j, lines


def _largest_fitting(
    lines: list[_Line], i: int, low: int, high: int, fits: Callable[[str], bool], step: int = 1
) -> tuple[str, int, list[_Line]]:
    """`_next_part` with the largest room from `low` up to below `high` (to within `step`) whose part
    `fits` (the room `low` when none does: at `MIN_LIMIT` the part cannot be made smaller without
    breaking the splitting rules). The part at `high` is known not to fit."""
    best = _next_part(lines, i, low)
    while high - low > step:
        mid = (low + high) // 2
        trial = _next_part(lines, i, mid)
        if fits(trial[0]):
            low, best = mid, trial
        else:
            high = mid
    return best


_TICKS = re.compile(r"`{3,}")
_FENCE_START = re.compile(r" {0,3}(```|~~~)")
_RUN = re.compile(r" {0,3}(`+|~+)")


def fences_on_own_lines(text: str) -> str:
    """`text` with each code fence that opens or closes in the middle of a line moved to a line of
    its own (`Here: ```python` → `Here: ` and ```` ```python ````; `x = 1```` → `x = 1` and
    ```` ``` ````), as chat platforms (Discord, Slack, Telegram) open and close code blocks there
    too: the splitter follows fences by line, and a part cut after such an opener was left open, or
    prose after its closer was taken for code. Only line breaks are added (and blank pieces of a
    line dropped), so the text renders the same:

    - a fence line (CommonMark: up to three spaces, then 3 or more backticks with no backtick
      after them, or 3 or more tildes) stays as it is: outside a fence it opens one; inside, it
      closes it with the same character, at least as many of it and nothing after, else it is code;
    - outside a fence, a run of 3 or more backticks in mid-line pairs with the next run on its line
      at least as long (```` ```x``` ````: inline, it stays); one left unpaired opens a code block
      only when a later line closes it, else it is literal backticks and stays (a lone `` ``````
      `` was made a fence the split then closed: an empty code block in place of the text);
    - inside a backtick fence, a run at least as long as its opener closes it in mid-line only at
      the end of its line (`print(x)```` → `print(x)` and ```` ``` ````): one with more after it
      (`FENCE = "```"`, `echo "```" >> README.md`) is code, as are shorter runs and anything inside
      a tilde fence. Taking the first such run for a closer ended the block there, and the code
      after it was shown as prose and the prose after the real closer as code;
    - an opener after prose that would read as a fence on a line of its own when it is none
      (```` ```` a ```py ```` when nothing closes the ```` ```` ````) keeps its line whole: that
      opener is literal. So does a closer after code that would (```` ``` ``` ````: its piece
      ```` ``` ```` closed the block, and the closer moved after it opened one around the prose).
    """
    lines = text.split("\n")
    closers = _Closers(lines)
    out: list[str] = []
    fence: str | None = None  # the marker of the fence open before the line
    for k, line in enumerate(lines):
        m = _FENCE.match(line)
        if m or (fence is not None and fence[0] == "~") or "```" not in line:
            if m and fence is None:
                fence = m.group(1)
            elif m and fence is not None and _closes(fence, m):
                fence = None
            out.append(line)
            continue
        pieces, fence = _line_pieces(line, fence, k, closers)
        out.extend(pieces)
    return "\n".join(out)


class _Closers:
    """Which later line closes a backtick fence of each length (`fences_on_own_lines`): a mid-line
    run opens a code block only when one does. Built from the last line up, in time linear in the
    text (each line marks the lengths up to its longest run)."""

    def __init__(self, lines: list[str]) -> None:
        self.last: list[int] = []  # by length: the last line that closes a fence that long, or -1
        for k in range(len(lines) - 1, -1, -1):
            for low, high in self._closes(lines[k]):
                if high >= len(self.last):
                    self.last += [-1] * (high + 1 - len(self.last))
                for n in range(low, high + 1):
                    if self.last[n] < 0:
                        self.last[n] = k

    def after(self, n: int, k: int) -> bool:
        """Whether a line after line `k` closes a backtick fence of `n`."""
        return n < len(self.last) and self.last[n] > k

    @staticmethod
    def _closes(line: str) -> list[tuple[int, int]]:
        """The lengths of the backtick fences `line` closes, as ranges (what `_line_pieces` does)."""
        m = _FENCE.match(line)
        if m:
            return [(3, len(m.group(1)))] if m.group(1)[0] == "`" and not m.group(2).strip() else []
        run = _closing_run(line)
        return [(3, run.end() - run.start())] if run and not _reads_as_fence(line[: run.start()]) else []


def _closing_run(line: str) -> re.Match[str] | None:
    """The run of 3 or more backticks that ends `line` (only whitespace after it): the one run in
    mid-line that can close a backtick fence (`print(x)````). A run with more after it on its line
    (`FENCE = "```"`) is code the agent quotes, not the end of its block."""
    end = len(line.rstrip())
    start = end
    while start > 0 and line[start - 1] == "`":
        start -= 1
    return _TICKS.match(line, start, end)


def _reads_as_fence(text: str) -> bool:
    """Whether `text`, the piece of a line before a mid-line fence, would read as a fence line on
    its own: the line is then kept whole, its run literal (the piece would open or close a block)."""
    return bool(_FENCE_START.match(text) and _FENCE.match(text))


def _line_pieces(line: str, fence: str | None, k: int, closers: _Closers) -> tuple[list[str], str | None]:
    """Line `k` (no fence line) as lines of the text, and the backtick fence open after it; `fence`
    is the one open before it."""
    runs = list(_TICKS.finditer(line))
    longest_after = [0] * (len(runs) + 1)  # the longest run after each: pairs found in linear time
    for q in range(len(runs) - 1, -1, -1):
        longest_after[q] = max(longest_after[q + 1], len(runs[q].group(0)))
    pieces: list[str] = []
    start = 0  # where the text not yet in `pieces` starts
    q = 0
    while q < len(runs):
        run = runs[q].group(0)
        if fence is not None:  # inside: a run at least as long closes the fence at the line's end only
            before = line[start : runs[q].start()]
            if len(run) >= len(fence) and not line[runs[q].end() :].strip() and not _reads_as_fence(before):
                pieces += [before, run]
                fence, start = None, runs[q].end()
            q += 1
            continue
        if longest_after[q + 1] >= len(run):  # an inline pair: on to after its closing run
            q += 1
            while len(runs[q].group(0)) < len(run):
                q += 1
            q += 1
            continue
        before = line[start : runs[q].start()]
        if not closers.after(len(run), k) or _reads_as_fence(before):
            q += 1  # nothing closes it, or the prose before it would be a fence: literal backticks
            continue
        rest = line[runs[q].end() :]
        pieces.append(before)
        if "`" not in rest:  # the opener with its info string
            return _kept([*pieces, run + rest]), run
        pieces.append(run)  # an info string holds no backtick: the rest is code
        fence, start = run, runs[q].end()
        q += 1
    pieces.append(line[start:])
    return _kept(pieces), fence


def _kept(pieces: list[str]) -> list[str]:
    """The pieces of a line but blank ones (a fence piece is never blank)."""
    return [piece for piece in pieces if piece.strip()]


def fence_closer(opener: str) -> str:
    """The line that closes the fence `opener` opened."""
    m = _FENCE.match(opener)
    assert m is not None
    return m.group(1)


def _annotate(raw: list[str], limit: int) -> list[_Line]:
    """Mark each line with the fence open around it, as the line that would reopen it (the opener
    itself, or only its marker when the opener is too long to repeat in every part). A fence whose
    marker alone is too long to close and reopen around a character of code in one part is not
    followed (its lines are cut as prose: the limit comes first); that made parts of nothing but
    the two markers, without end."""
    out = []
    fence: str | None = None
    unfollowed: str | None = None  # the marker of such a fence, while it is open
    for line in raw:
        before = fence
        m = _FENCE.match(line)
        if m and unfollowed is not None:
            if _closes(unfollowed, m):
                unfollowed = None
        elif m:
            if fence is None and 2 * len(m.group(1)) + 3 > limit:
                unfollowed = m.group(1)
            elif fence is None:
                fence = line if len(line) <= limit // 4 else m.group(1)
            elif _closes(fence, m):
                fence = None
        out.append(_Line(line, before, fence))
    return out


def _closed(part: str, limit: int, fits: Callable[[str], bool] | None) -> str:
    """`part` with a closer for a fence it leaves open, when that fits. Only a hard cut through a
    run of fence characters (a line of 40 backticks in a room of 32) makes one: the rest of the
    run, at the start of the next part, is an opener no line after it closes."""
    opener = _open_fence(part)
    if opener is None:
        return part
    closed = f"{part}\n{fence_closer(opener)}"
    return closed if len(closed) <= limit and (fits is None or fits(closed)) else part


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


def _wrap(line: _Line, room: int, alone: bool = False) -> tuple[_Line, _Line]:
    """Cut an over-long content line at its last space within `room`, else at the last grapheme
    boundary within `room` (exactly at `room` only when one cluster is longer than that). Markdown
    links `[text](url)` are kept whole: a space inside one is no cut, and the start of a link is
    one, where it leaves a head of at least half the room. A space that would leave a shorter
    head before a word too long for any part is passed over: that word is cut hard anyway, so it
    is cut here (`echo: ` alone would be a part). `alone`: the head is a part of its own (not the
    end of a part `_fill` fills), and the next part has as much room."""
    room = max(room, 1)
    text = line.text
    literal = False
    indent = len(text) - len(text.lstrip(" "))
    every = line.links if line.links is not None else _links(text)
    links = _links_near(every, line.offset, room)
    cut = text.rfind(" ", indent + 1, room + 1)  # never in the indentation: that would leave a blank head
    while cut > 0 and not (
        is_grapheme_boundary(text, cut) and is_grapheme_boundary(text, cut + 1) and _outside(links, cut)
    ):
        cut = text.rfind(" ", indent + 1, cut)  # a space carrying a combining mark, inside a ZWJ sequence or a link
    before_link = max(
        (a for a, _ in links if max(indent + 1, room // 2) <= a <= room and is_grapheme_boundary(text, a)), default=-1
    )
    if before_link > cut + 1:  # (right after a space: the space is the cut)
        head, rest = text[:before_link], text[before_link:]  # nothing dropped: the link goes on in the next part
    elif cut > 0 and (cut >= room // 2 or _word_end(text, cut + 1, links) - (cut + 1) <= room):
        head, rest = text[:cut], text[cut + 1 :]
    else:
        at = min(room, len(text))
        while at > 0 and not is_grapheme_boundary(text, at):
            at -= 1
        if at == 0:
            at = room  # a single cluster longer than the room: the limit wins
        head, rest = text[:at], text[at:]
    lo, hi = _fence_heads(text)
    if lo <= len(head) <= hi or _FENCE_START.match(rest):
        # On a line of its own, the head or the rest would open or close a code block: the last
        # hard cut where neither does (none: a line of only fence characters, cut as it was).
        at = min(room, len(text))
        while at > indent and (lo <= at <= hi or _FENCE_START.match(text, at) or not is_grapheme_boundary(text, at)):
            at -= 1
        if alone and _run_too_long(line, at, room, indent, (lo, hi)):
            head, rest, literal = text[:room], text[room:], True
        elif at > indent:
            head, rest = text[:at], text[at:]
    fence = line.fence_before if line.fence_before == line.fence_after else None
    opener = _FENCE.match(text) if line.fence_before is None and line.fence_after is not None else None
    if opener and len(head) > opener.end(1) and rest.strip():
        fence = line.fence_after  # an opener longer than a part: the rest of its info string is code
    offset = line.offset + len(text) - len(rest)
    return (
        _Line(head, line.fence_before, fence, literal=line.literal),
        _Line(rest, fence, line.fence_after, every, offset, literal),
    )


def _run_too_long(line: _Line, at: int, room: int, indent: int, heads: tuple[int, int]) -> bool:
    """Whether to cut `line` hard at `room` though its rest starts like a fence, rather than at `at`,
    the last cut before the run of fence characters whose rest does not (none when `at` is at most
    `indent`). Yes when `at` leaves a head under half the room, no backtick follows the run on the
    line, and the run is too long for a part starting before it to reach its last two characters:
    then the rest of some cut inside it is a fence line whatever is done, and the tiny head would
    only add a part (`echo` and `: ` + 5,000 backticks). Only for prose outside a fence (the rest
    of an earlier such cut included): a fence line or code keeps the cut it had. `heads` is
    `_fence_heads(line.text)`."""
    text = line.text
    if at > indent and at >= room // 2 or room >= len(text) or line.fence_before or line.fence_after:
        return False
    if not line.literal and _FENCE.match(text) or heads[0] <= room <= heads[1]:
        return False
    run = _RUN.match(text, room)
    if run is None or len(run.group(1)) < 3 or not is_grapheme_boundary(text, room):
        return False
    if run.group(1)[0] == "`" and text.find("`", run.end()) >= 0:
        return False  # a part that reaches that backtick is no fence line
    start = run.start(1)
    while start > 0 and text[start - 1] == run.group(1)[0]:
        start -= 1
    lead = text[max(start - 3, 0) : start]
    before = start - (len(lead) - len(lead.rstrip(" "))) - 1  # the last start of a part that is no fence
    return before < 0 or run.end() - 2 > before + room


def _fence_heads(text: str) -> tuple[int, int]:
    """The ends of the heads of `text` (no fence line) that would read as a fence line, as a range
    (empty when none does): a line starting like a fence with a backtick further on (```` ```a`b
    ````), or ~~~ with more on it than the head."""
    start = _FENCE_START.match(text)
    if start is None or _FENCE.match(text):
        return 1, 0
    if start.group(1)[0] == "~":
        return start.end(), len(text)
    run_end = start.end()
    while run_end < len(text) and text[run_end] == "`":
        run_end += 1
    return start.end(), text.find("`", run_end)


def _links(text: str) -> tuple[tuple[int, int], ...]:
    """The spans of the Markdown links and images `[text](url)` / `![alt](url)` in `text`, left to
    right. A label runs to the first `]` after its `[` (no line break in it), so when no `(url)`
    follows that `]`, no `[` before it starts a link either and the search goes on after it: a
    pattern tried at each `[` of `[[[[…` read to the end of the line from each (40,000: 11 s)."""
    out: list[tuple[int, int]] = []
    newline = -1  # the first line break after `start` (len(text) when none)
    start = text.find("[")
    while start >= 0:
        if newline <= start:
            newline = text.find("\n", start + 1) % (len(text) + 1)
        close = text.find("]", start + 1, newline)
        if close < 0:
            start = text.find("[", newline + 1)
            continue
        tail = _LINK_TAIL.match(text, close + 1)
        if tail is None:
            start = text.find("[", close + 1)
            continue
        bang = start > 0 and text[start - 1] == "!" and (not out or out[-1][1] < start)
        out.append((start - bang, tail.end()))
        start = text.find("[", tail.end())
    return tuple(out)


def _links_near(links: tuple[tuple[int, int], ...], offset: int, room: int) -> list[tuple[int, int]]:
    """The links starting in the text from `offset` up to `room` past it (the only ones a cut within
    `room` can meet; links do not overlap), as spans within that text."""
    k = bisect.bisect_left(links, (offset, -1))
    out = []
    while k < len(links) and links[k][0] <= offset + room + 1:
        out.append((links[k][0] - offset, links[k][1] - offset))
        k += 1
    return out


def _outside(links: list[tuple[int, int]], cut: int) -> bool:
    """A space at `cut` is not inside a link."""
    return all(not start < cut < end for start, end in links)


def _word_end(text: str, start: int, links: list[tuple[int, int]]) -> int:
    """Where the word starting at `start` ends (the next space outside `links`, which are no cuts,
    or the end of the text): a link longer than a part is one long word."""
    end = text.find(" ", start)
    while end >= 0 and not _outside(links, end):
        end = text.find(" ", end + 1)
    return len(text) if end < 0 else end


# Inline spans a cut may go through: `||spoiler||`, `**bold**`, `__underline__`, `~~strike~~` (runs
# of exactly two) and code spans (a backtick run closed by the next run as long). A backslash before
# a run escapes it.
_SPAN_RUN = re.compile(r"\\?(?:`+|\|+|\*+|_+|~+)")
_PAIRED = frozenset({"||", "**", "__", "~~"})
_FLANKED = frozenset({"**", "__", "~~"})  # a delimiter only next to text on its inner side


@dataclass(frozen=True)
class _Run:
    start: int
    end: int
    text: str


def _span_runs(text: str) -> list[_Run | None]:
    """The candidate runs of `text` outside code fences, in order; None between paragraphs (a blank
    line, or a fence: inline spans never cross one)."""
    out: list[_Run | None] = []
    fence: str | None = None
    offset = 0
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is not None or m or not line.strip():
            if m and fence is None:
                fence = line
            elif m and fence is not None and _closes(fence, m):
                fence = None
            out.append(None)
        else:
            out += [_Run(offset + r.start(), offset + r.end(), r.group(0)) for r in _SPAN_RUN.finditer(line)]
        offset += len(line) + 1
    return out


def _span_pairs(text: str, runs: list[_Run | None]) -> list[tuple[int, int, str]]:
    """The paired spans among `runs` (indexes of opener and closer, and the marker), each within one
    paragraph. An opener nothing closes is text, and so is everything inside a code span."""
    closers = _code_closers(runs)
    pairs: list[tuple[int, int, str]] = []
    stack: list[tuple[int, str]] = []
    k = 0
    while k < len(runs):
        run = runs[k]
        if run is None:
            stack = []  # left open at a paragraph's end: never markup
        elif run.text[0] == "`" and closers[k] >= 0:
            pairs.append((k, closers[k], run.text))
            k = closers[k]
        elif run.text in _PAIRED:
            _pair_marker(text, run, k, stack, pairs)
        k += 1
    return sorted(pairs)


def _code_closers(runs: list[_Run | None]) -> list[int]:
    """For each run, the next run in its paragraph that would close a code span it opens (the same
    backticks, a backslash before them being code), or -1: found from the end, in linear time."""
    out = [-1] * len(runs)
    later: dict[str, int] = {}
    for k in range(len(runs) - 1, -1, -1):
        run = runs[k]
        if run is None:
            later = {}
            continue
        out[k] = later.get(run.text, -1)
        later[run.text.lstrip("\\")] = k
    return out


def _pair_marker(text: str, run: _Run, k: int, stack: list[tuple[int, str]], pairs: list[tuple[int, int, str]]) -> None:
    """Close the span `run` ends (markers opened inside it and left open are text), or open one.
    `**`, `__` and `~~` close only after text and open only before it (`a ** b` is text)."""
    opened = [marker for _, marker in stack]
    if run.text in opened and not (run.text in _FLANKED and text[run.start - 1 : run.start].isspace()):
        at = len(opened) - 1 - opened[::-1].index(run.text)
        pairs.append((stack[at][0], k, run.text))
        del stack[at:]
    elif not (run.text in _FLANKED and text[run.end : run.end + 1].isspace()):
        if run.text in opened:  # `**a **b**`: the nearer opener pairs (at most one of each is open)
            del stack[opened.index(run.text)]
        stack.append((k, run.text))


def _balanced_spans(text: str, parts: list[str]) -> list[str] | None:
    """`parts` with each inline span a cut goes through closed at the end of its part and reopened
    (in the same order) at the start of the next: an unclosed `||` or `**` shows as text on the
    platforms, so most of a spoiler was shown in the clear. None when the parts' runs are not the
    text's (a hard cut through a run): they are left as they are."""
    original = _span_runs(text)
    pairs = _span_pairs(text, original)
    if len(parts) < 2 or not pairs:
        return parts
    joined = "\n".join(parts)
    ends = [len(part) for part in parts]
    for q in range(1, len(ends)):
        ends[q] += ends[q - 1] + 1
    cut_runs = [run for run in _span_runs(joined) if run is not None]
    if [run.text for run in cut_runs] != [run.text for run in original if run is not None]:
        return None
    index = [k for k, run in enumerate(original) if run is not None]  # a run of the text → its place in cut_runs
    place = {k: n for n, k in enumerate(index)}
    part_of = [bisect.bisect_left(ends, run.start) for run in cut_runs]
    openers: list[list[str]] = [[] for _ in parts]  # reopened at the start of each part
    for start, end, marker in pairs:
        for q in range(part_of[place[start]], part_of[place[end]]):
            openers[q + 1].append(marker)
    return [_wrapped(part, openers[q], openers[q + 1] if q + 1 < len(parts) else []) for q, part in enumerate(parts)]


def _wrapped(part: str, reopen: list[str], close: list[str]) -> str:
    """`part` with the spans open before it reopened after its indentation and those open after it
    closed before its trailing whitespace."""
    body = part.lstrip()
    lead = part[: len(part) - len(body)]
    core = body.rstrip()
    return f"{lead}{''.join(reopen)}{core}{''.join(reversed(close))}{body[len(core) :]}"
