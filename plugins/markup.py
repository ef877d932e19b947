"""Markdown inline markup found in linear time, for the plugins' formatters (telegram, slack).

A model's reply is hostile input: one regular expression per markup (`(`+)(.+?)\\1`,
`\\[([^]]*)\\]\\((…)\\)`, `\\*\\*(.+?)\\*\\*`) searched the rest of a line again from every
opener nothing closes, so a run of 4,000 backticks took a second and 8,000 ten (on the gateway's
event loop, once per split probe and per send). Each scanner here looks at every position a bounded
number of times; what a platform makes of a match stays in its formatter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_TICKS = re.compile(r"`+")


@dataclass(frozen=True)
class Pair:
    """An inline markup that wraps text between two delimiters (`**bold**`). Both patterns are
    zero-width, with the delimiter as group 1, so each is tried once per position: pairing them is
    linear, where one pattern `delim(.+?)delim` searched the rest of the line from every opener
    that nothing closes (`**a ` 10,000 times: seconds)."""

    delimiters: tuple[str, ...]  # a text without any is left as it is, unsearched
    opener: re.Pattern[str]  # where a delimiter can open: the content starts right after it
    closer: re.Pattern[str]  # where one can close: the content ends right before it


def code_spans(text: str, code: Callable[[str, str], str]) -> str:
    """`text` with each code span replaced by `code(the span as written, its content)`.
    CommonMark: the next run of exactly as many backticks closes a run; a run nothing closes is
    literal, and the one after it may open. Each run learns its closer in one pass from the end."""
    runs = [m.span() for m in _TICKS.finditer(text)]
    closer = [-1] * len(runs)  # the index of the next run as long, or -1
    later: dict[int, int] = {}  # by length: the first run of that length after the one at hand
    for k in range(len(runs) - 1, -1, -1):
        size = runs[k][1] - runs[k][0]
        closer[k] = later.get(size, -1)
        later[size] = k
    out: list[str] = []
    done = k = 0  # the text up to `done` is in `out`; `k` is the next run that may open a span
    while k < len(runs):
        end = closer[k]
        if end < 0:
            k += 1
            continue
        start, stop = runs[k][0], runs[end][1]
        out += [text[done:start], code(text[start:stop], text[runs[k][1] : runs[end][0]])]
        done, k = stop, end + 1
    out.append(text[done:])
    return "".join(out)


def links(text: str, tail: re.Pattern[str]) -> Iterator[tuple[int, int, re.Match[str]]]:
    """Each `[label](url)` of `text`, left to right and not overlapping: (the index of its `[`, of
    its `]`, the match of `tail` (the `(url)`) right after the `]`). A label runs to the first `]`
    after its `[`, so when what follows that `]` is no `(url)`, no `[` before it starts a link
    either: the search goes on after it (searching again from each `[` of `[[[[…` was quadratic)."""
    start = text.find("[")
    while start >= 0:
        close = text.find("]", start + 1)
        if close < 0:
            return
        found = tail.match(text, close + 1) if close > start + 1 else None
        if found is None:
            start = text.find("[", close + 1)
            continue
        yield start, close, found
        start = text.find("[", found.end())


def paired(text: str, pair: Pair, before: str, after: str) -> str:
    """`text` with `pair`'s delimiters replaced by `before` and `after` around their content: from
    the leftmost opener to the first closer of the same delimiter that leaves some content, then on
    after that closer (what `re.sub` of `delim(?=\\S)(.+?)(?<=\\S)delim` did), with each closer
    list walked once."""
    if not any(delimiter in text for delimiter in pair.delimiters):
        return text
    closers: dict[str, list[int]] = {}
    for m in pair.closer.finditer(text):
        closers.setdefault(m.group(1), []).append(m.start())
    if not closers:
        return text
    walked = dict.fromkeys(closers, 0)  # by delimiter: the closers before this one are behind us
    out: list[str] = []
    done = 0
    for m in pair.opener.finditer(text):
        start, delim = m.start(), m.group(1)
        ends = closers.get(delim, [])
        k = walked.get(delim, 0)
        while k < len(ends) and ends[k] <= start + len(delim):
            k += 1
        walked[delim] = k
        if start < done or k == len(ends):
            continue
        end = ends[k]
        out += [text[done:start], before, text[start + len(delim) : end], after]
        done = end + len(delim)
    out.append(text[done:])
    return "".join(out)
