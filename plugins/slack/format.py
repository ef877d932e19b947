"""Markdown as agents write it → Slack's `mrkdwn` (the `text` of `chat.postMessage`).

Slack reads `&`, `<` and `>` as control characters: `<https://x|label>` is a link, `<@U123>` a
mention, `<!channel>` pings everyone. Every one of them in the agent's text is therefore escaped
(`&amp;`, `&lt;`, `&gt;`, as Slack asks), so no text can mention, ping or forge a link; the only
`<…>` in the output are the links emitted here. Conversions:

- fenced code blocks (```` ```lang ````, closed or left open) → ```` ``` ```` blocks (Slack has no
  languages); inline `` `code` `` stays; code is escaped but never otherwise formatted;
- `**bold**` / `__bold__` → `*bold*`, `*italic*` / `_italic_` → `_italic_` (not inside words, so
  `snake_case_names` stay), `~~strike~~` → `~strike~`;
- `[text](url)` / `![alt](url)` → `<url|text>` (http, https and mailto only; others stay text);
- `# Heading` → a bold line; `- item` / `* item` → `• item`; `> quote` stays a quote.

Inline markup never spans lines. A code span follows CommonMark: a run of backticks opens one and
the next run of exactly as many closes it; a run nothing closes is literal backticks. The text is
formatted in time linear in its length, whatever it holds (runs of `` ` * _ ~ [ # `` or spaces): the
gateway formats every reply on its event loop, several times per part while it splits, and the
patterns this replaced backtracked (4,000 backticks took a second, a heading line of spaces minutes).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_TICKS_RE = re.compile(r"`+")
# What follows a link's `[label]`: `(url)`, the URL's parentheses balanced one level deep.
_LINK_TAIL_RE = re.compile(r"\(\s*((?:https?://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_HEADING_RE = re.compile(r"\s{0,3}#{1,6}\s+")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")
_BOLD_MARK = "\x01"  # bold while italics are converted, `*` at the end
_EMPTY_BLOCK = "```\n```"


@dataclass(frozen=True)
class _Pair:
    """An inline markup that wraps text between two delimiters (`**bold**`). Both patterns are
    zero-width, with the delimiter as group 1, so each is tried once per position: pairing them is
    linear, where one pattern `delim(.+?)delim` searched the rest of the line from every opener
    that nothing closes (`**a ` 10,000 times: seconds). As in plugins/telegram/format.py."""

    delimiters: tuple[str, ...]  # a text without any is left as it is, unsearched
    opener: re.Pattern[str]  # where a delimiter can open: the content starts right after it
    closer: re.Pattern[str]  # where one can close: the content ends right before it
    mark: str  # what stands for the delimiter on both sides in mrkdwn


# `**bold**` / `__bold__` first (as a mark, so the italics do not take its `*`), then `*italic*`
# (not inside words: 2*3*4 stays), then `~~strike~~`. Slack's own `_italic_` passes as it is.
_PAIRS = (
    _Pair(("**", "__"), re.compile(r"(?=(\*\*|__)\S)"), re.compile(r"(?<=\S)(?=(\*\*|__))"), _BOLD_MARK),
    _Pair(("*",), re.compile(r"(?<![\w*])(?=(\*)[^\s*])"), re.compile(r"(?<=[^\s*])(?=(\*)(?![\w*]))"), "_"),
    _Pair(("~~",), re.compile(r"(?=(~~)\S)"), re.compile(r"(?<=\S)(?=(~~))"), "~"),
)


def escape(text: str) -> str:
    """`&`, `<`, `>` as Slack's entities (the only three Slack wants escaped)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_mrkdwn(text: str) -> str:
    """The Markdown `text` as Slack mrkdwn, with every `&`, `<`, `>` of the text escaped."""
    text = text.replace("\x00", "").replace(_BOLD_MARK, "").replace("\r\n", "\n")
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        marker = _fence(lines[i])
        if marker:
            body: list[str] = []
            i += 1
            while i < len(lines) and not (
                lines[i].strip().startswith(marker[0] * len(marker)) and not lines[i].strip().strip(marker[0])
            ):
                body.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of the text: an open fence is closed)
            code = escape("\n".join(body)).replace("```", "``\u200b`")  # a fence inside cannot close it
            out.append(f"```\n{code}\n```" if code else _EMPTY_BLOCK)
            continue
        out.append(_line(lines[i]))
        i += 1
    mrkdwn = "\n".join(out)
    if text.strip() and not mrkdwn.replace(_EMPTY_BLOCK, "").strip():
        # Only markup (a lone run of backticks, the rest of one the split cut, or `# `): shown as
        # written, never as an empty block or an empty message.
        return escape(text)
    return mrkdwn


def _fence(line: str) -> str | None:
    """The marker when `line` opens a code block, else None. After backticks the rest of the line
    holds no backtick (CommonMark, and the gateway's split reads fences so): ```` ```x` ```` is text."""
    m = _FENCE_RE.match(line)
    if m is None or m.group(1)[0] == "`" and "`" in line[m.end() :]:
        return None
    return m.group(1)


def _line(line: str) -> str:
    heading = _HEADING_RE.match(line)
    if heading:
        title = line[heading.end() :].rstrip().rstrip("#").rstrip()  # a closing run of #s is no text
        inner = _inline(title.replace("**", "").replace("__", ""))
        return f"*{inner}*" if inner.strip() else inner
    bullet = _BULLET_RE.match(line)
    if bullet:
        return bullet.group(1) + "• " + _inline(line[bullet.end() :])
    return _inline(line)


def _inline(text: str) -> str:
    """One line: code spans and links become placeholders (never formatted further), the rest is
    escaped and given bold, italic and strikethrough."""
    saved: list[str] = []

    def keep(value: str) -> str:
        saved.append(value)
        return f"\x00{len(saved) - 1}\x00"

    text = _code_spans(text, lambda inner: keep(f"`{escape(inner)}`"))
    text = _links(text, lambda label, url: keep(_link(url, label)))
    text = escape(text)
    for pair in _PAIRS:
        text = _paired(text, pair)
    text = text.replace(_BOLD_MARK, "*")
    while _PLACEHOLDER_RE.search(text):  # a link's label may hold a code span
        text = _PLACEHOLDER_RE.sub(lambda m: saved[int(m.group(1))], text)
    return text


def _code_spans(text: str, code: Callable[[str], str]) -> str:
    """`text` with each code span replaced by what `code` makes of its content. CommonMark: the
    next run of exactly as many backticks closes a run; a run nothing closes is literal, and the
    one after it may open. Each run learns its closer in one pass from the end of the line."""
    runs = [m.span() for m in _TICKS_RE.finditer(text)]
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
        out += [text[done : runs[k][0]], code(text[runs[k][1] : runs[end][0]])]
        done, k = runs[end][1], end + 1
    out.append(text[done:])
    return "".join(out)


def _links(text: str, link: Callable[[str, str], str]) -> str:
    """`text` with each `[label](url)` / `![alt](url)` replaced by what `link` makes of its label
    and URL. A label runs to the first `]` after its `[`, so when what follows that `]` is no
    `(url)`, no `[` before it starts a link either: the search goes on after it (searching again
    from each `[` of `[[[[…` made a line of them quadratic)."""
    out: list[str] = []
    done = 0
    start = text.find("[")
    while start >= 0:
        close = text.find("]", start + 1)
        if close < 0:
            break
        tail = _LINK_TAIL_RE.match(text, close + 1) if close > start + 1 else None
        if tail is None:
            start = text.find("[", close + 1)
            continue
        head = start - 1 if start > done and text[start - 1] == "!" else start  # an image's `!` goes too
        out += [text[done:head], link(text[start + 1 : close], tail.group(1))]
        done = tail.end()
        start = text.find("[", done)
    out.append(text[done:])
    return "".join(out)


def _paired(text: str, pair: _Pair) -> str:
    """`text` with `pair`'s delimiters as its mark: from the leftmost opener to the first closer of
    the same delimiter that leaves some content, then on after that closer (what `re.sub` of
    `delim(?=\\S)(.+?)(?<=\\S)delim` did), with each closer list walked once."""
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
        out += [text[done:start], pair.mark, text[start + len(delim) : end], pair.mark]
        done = end + len(delim)
    out.append(text[done:])
    return "".join(out)


def _link(url: str, label: str) -> str:
    # In `<url|label>` the first `|` ends the URL and `>` ends the link: neither may appear raw.
    safe_url = escape(url).replace("|", "%7C")
    safe_label = escape(label).replace("|", "¦").strip()
    return f"<{safe_url}|{safe_label}>" if safe_label else f"<{safe_url}>"
