"""Markdown as agents write it → Telegram's HTML (`parse_mode=HTML`).

Telegram's HTML knows a few tags (`b i s u code pre a blockquote …`) and only the entities `&lt; &gt;
&amp; &quot;`; anything else makes it refuse the whole message ("can't parse entities"). So the output
is built to be well formed by construction: every `<`, `>` and `&` of the text is escaped, and the only
tags are the ones emitted here, always closed and never crossing:

- fenced code blocks (```` ```lang ````, closed or left open) → `<pre><code class="language-lang">…</code></pre>`
  (`<pre>…</pre>` without a language); inline `` `code` `` → `<code>…</code>`;
- `**bold**` / `__bold__` → `<b>`, `*italic*` / `_italic_` → `<i>` (not inside words, so
  `snake_case_names` stay as they are), `~~strike~~` → `<s>`;
- `[text](http…)` → `<a href="…">text</a>` (http, https, tg and mailto links only; others stay text);
- `# Heading` → a bold line; `- item` / `* item` → `• item`; `> quote` lines → `<blockquote>`.

Inline markup never spans lines. `plain(html)` gives back the text Telegram would show for our
output (tags dropped, entities decoded): the fallback when Telegram refuses the entities anyway.

A code span follows CommonMark: a run of backticks opens one and the next run of exactly as many
closes it; a run nothing closes is literal backticks (5,000 of them show as 5,000). The text is
formatted in time linear in its length, whatever it holds (runs of `` ` * _ ~ [ # ``): the gateway
formats every reply on its event loop, several times per part while it splits, and the patterns
this replaced backtracked (a reply of 4,000 backticks took a second, 8,000 ten).
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass

# A fence line: up to three spaces and ``` or ~~~ (or more), then an info string without a backtick.
_FENCE_RE = re.compile(r"\s{0,3}(`{3,}|~{3,})")
_TICKS_RE = re.compile(r"`+")
# What follows a link's `[label]`: `(url)`, the URL's parentheses balanced one level deep.
_LINK_TAIL_RE = re.compile(r"\(\s*((?:https?://|tg://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_HEADING_RE = re.compile(r"\s{0,3}#{1,6}\s+")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_QUOTE_RE = re.compile(r"^\s{0,3}>\s?(.*)$")
_TAG_SPLIT_RE = re.compile(r"(<[^>]*>)")
_PLACEHOLDER_RE = re.compile(r"\x00(\d+)\x00")
_LANG_RE = re.compile(r"[A-Za-z0-9_+#.-]{1,32}")


@dataclass(frozen=True)
class _Pair:
    """An inline markup that wraps text between two delimiters (`**bold**`). Both patterns are
    zero-width, with the delimiter as group 1, so each is tried once per position: pairing them is
    linear, where one pattern `delim(.+?)delim` searched the rest of the line from every opener
    that nothing closes (`**a ` 10,000 times: seconds)."""

    delimiters: tuple[str, ...]  # a text without any is left as it is, unsearched
    opener: re.Pattern[str]  # where a delimiter can open: the content starts right after it
    closer: re.Pattern[str]  # where one can close: the content ends right before it
    tag: str


# `**bold**` / `__bold__`, `~~strike~~`, `*italic*` / `_italic_` (not inside words: snake_case stays).
_PAIRS = (
    _Pair(("**", "__"), re.compile(r"(?=(\*\*|__)\S)"), re.compile(r"(?<=\S)(?=(\*\*|__))"), "b"),
    _Pair(("~~",), re.compile(r"(?=(~~)\S)"), re.compile(r"(?<=\S)(?=(~~))"), "s"),
    _Pair(("*",), re.compile(r"(?<![\w*])(?=(\*)[^\s*])"), re.compile(r"(?<=[^\s*])(?=(\*)(?![\w*]))"), "i"),
    _Pair(("_",), re.compile(r"(?<![\w_])(?=(_)[^\s_])"), re.compile(r"(?<=[^\s_])(?=(_)(?![\w_]))"), "i"),
)


def escape(text: str) -> str:
    """`&`, `<`, `>` (and `"`, for attribute values) as Telegram's entities."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def to_html(text: str) -> str:
    """The Markdown `text` as Telegram HTML; always well formed."""
    text = text.replace("\x00", "").replace("\r\n", "\n")
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    quote: list[str] = []

    def flush_quote() -> None:
        if quote:
            out.append("<blockquote>" + "\n".join(quote) + "</blockquote>")
            quote.clear()

    while i < len(lines):
        line = lines[i]
        fence = _fence(line)
        if fence:
            flush_quote()
            marker, lang = fence
            body: list[str] = []
            i += 1
            while i < len(lines) and not (
                lines[i].strip().startswith(marker) and not lines[i].strip().strip(marker[0])
            ):
                body.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of the text)
            code = escape("\n".join(body))
            if lang and _LANG_RE.fullmatch(lang):
                out.append(f'<pre><code class="language-{escape(lang)}">{code}</code></pre>')
            else:
                out.append(f"<pre>{code}</pre>")
            continue
        quoted = _QUOTE_RE.match(line)
        if quoted:
            quote.append(_inline_line(quoted.group(1)))
            i += 1
            continue
        flush_quote()
        out.append(_inline_line(line))
        i += 1
    flush_quote()
    html = _join(out)
    if text.strip() and not plain(html).strip():
        return escape(text)  # only markup (a lone ">" or "#"): show it as it was written, never an empty message
    return html


def _fence(line: str) -> tuple[str, str] | None:
    """The marker and the language (its info string's first word, maybe "") when `line` opens a
    code block, else None. A backtick after the marker makes the line no fence (CommonMark); the
    rest is read without a pattern that backtracks (``` then 50,000 spaces and a backtick)."""
    m = _FENCE_RE.match(line)
    if m is None:
        return None
    info = line[m.end() :]
    if "`" in info:
        return None
    words = info.split(None, 1)
    return m.group(1), words[0] if words else ""


def _join(parts: list[str]) -> str:
    """Lines joined by newlines, without doubling the line break around block elements."""
    result = ""
    for n, part in enumerate(parts):
        if n and not (part.startswith(("<pre>", "<pre><code", "<blockquote>")) and result.endswith("\n")):
            result += "\n"
        result += part
    return result


def _inline_line(line: str) -> str:
    heading = _HEADING_RE.match(line)
    if heading:
        title = line[heading.end() :].rstrip().rstrip("#").rstrip()  # a closing run of #s is no text
        return "<b>" + _inline(title) + "</b>" if title else ""
    bullet = _BULLET_RE.match(line)
    if bullet:
        return bullet.group(1) + "• " + _inline(line[bullet.end() :])
    return _inline(line)


def _inline(text: str) -> str:
    """One line: code spans and links become atomic placeholders, the rest is escaped and given
    bold, italic and strikethrough on the text between tags only (so tags never cross)."""
    atoms: list[str] = []  # each placeholder's HTML
    plain: list[str] = []  # ... its text as shown (a code span's content)
    source: list[str] = []  # ... and the Markdown it came from

    def keep(fragment: str, shown: str, raw: str) -> str:
        atoms.append(fragment)
        plain.append(shown)
        source.append(raw)
        return f"\x00{len(atoms) - 1}\x00"

    def code(raw: str, inner: str) -> str:
        if inner.strip() == "":
            return raw
        if inner.startswith(" ") and inner.endswith(" "):
            inner = inner[1:-1]
        return keep(f"<code>{escape(inner)}</code>", inner, raw)

    def link(label: str, url: str, raw: str) -> str:
        # A code span inside a link's label shows as its text; inside the URL it is the URL's own text.
        label = _PLACEHOLDER_RE.sub(lambda p: plain[int(p.group(1))], label)
        url = _PLACEHOLDER_RE.sub(lambda p: source[int(p.group(1))], url)
        return keep(f'<a href="{escape(url)}">{escape(label)}</a>', label, raw)

    text = _code_spans(text, code)
    text = _links(text, link)
    text = escape(text).replace("&quot;", '"')
    for pair in _PAIRS:
        text = _between_tags(text, pair)
    return _PLACEHOLDER_RE.sub(lambda m: atoms[int(m.group(1))], text)


def _code_spans(text: str, code: Callable[[str, str], str]) -> str:
    """`text` with each code span given to `code` (the span as written, its content). CommonMark:
    the next run of exactly as many backticks closes a run; a run nothing closes is literal, and
    the one after it may open. Each run learns its closer in one pass from the end of the line."""
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
        start, stop = runs[k][0], runs[end][1]
        out += [text[done:start], code(text[start:stop], text[runs[k][1] : runs[end][0]])]
        done, k = stop, end + 1
    out.append(text[done:])
    return "".join(out)


def _links(text: str, link: Callable[[str, str, str], str]) -> str:
    """`text` with each `[label](url)` given to `link` (label, URL, the link as written). A label
    runs to the first `]` after its `[`, so when what follows that `]` is no `(url)`, no `[` before
    it starts a link either: the search goes on after it (searching again from each `[` of
    `[[[[…` made a line of them quadratic)."""
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
        out += [text[done:start], link(text[start + 1 : close], tail.group(1), text[start : tail.end()])]
        done = tail.end()
        start = text.find("[", done)
    out.append(text[done:])
    return "".join(out)


def _between_tags(text: str, pair: _Pair) -> str:
    pieces = _TAG_SPLIT_RE.split(text)
    for n, piece in enumerate(pieces):
        if n % 2 == 0 and piece:
            pieces[n] = _paired(piece, pair)
    return "".join(pieces)


def _paired(text: str, pair: _Pair) -> str:
    """`text` with `pair`'s markup as tags: from the leftmost opener to the first closer of the same
    delimiter that leaves some content, then on after that closer (what `re.sub` of
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
        out += [text[done:start], f"<{pair.tag}>", text[start + len(delim) : end], f"</{pair.tag}>"]
        done = end + len(delim)
    out.append(text[done:])
    return "".join(out)


_STRIP_TAGS_RE = re.compile(r"<[^>]*>")


def plain(html_text: str) -> str:
    """The text Telegram would show for our HTML: tags dropped, entities decoded."""
    return html.unescape(_STRIP_TAGS_RE.sub("", html_text))
