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
from collections.abc import Callable, Iterator

from plugins.markup import Pair, code_spans, links, paired

# A fence line: up to three spaces and ``` or ~~~ (or more), then an info string without a backtick.
_FENCE_RE = re.compile(r"\s{0,3}(`{3,}|~{3,})")
# What follows a link's `[label]`: `(url)`, the URL's parentheses balanced one level deep.
_LINK_TAIL_RE = re.compile(r"\(\s*((?:https?://|tg://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_HEADING_RE = re.compile(r"\s{0,3}#{1,6}\s+")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_QUOTE_RE = re.compile(r"^\s{0,3}>\s?(.*)$")
_TAG_SPLIT_RE = re.compile(r"(<[^>]*>)")
_PLACEHOLDER_RE = re.compile(r"\x00(\d+)\x00")
_LANG_RE = re.compile(r"[A-Za-z0-9_+#.-]{1,32}")


# `**bold**` / `__bold__`, `~~strike~~`, `*italic*` / `_italic_` (not inside words: snake_case stays),
# each with the tag it becomes.
_PAIRS = (
    (Pair(("**", "__"), re.compile(r"(?=(\*\*|__)\S)"), re.compile(r"(?<=\S)(?=(\*\*|__))")), "b"),
    (Pair(("~~",), re.compile(r"(?=(~~)\S)"), re.compile(r"(?<=\S)(?=(~~))")), "s"),
    (Pair(("*",), re.compile(r"(?<![\w*])(?=(\*)[^\s*])"), re.compile(r"(?<=[^\s*])(?=(\*)(?![\w*]))")), "i"),
    (Pair(("_",), re.compile(r"(?<![\w_])(?=(_)[^\s_])"), re.compile(r"(?<=[^\s_])(?=(_)(?![\w_]))")), "i"),
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

    text = code_spans(text, code)
    text = "".join(_linked(text, link))
    text = escape(text).replace("&quot;", '"')
    for pair, tag in _PAIRS:
        text = _between_tags(text, pair, tag)
    return _PLACEHOLDER_RE.sub(lambda m: atoms[int(m.group(1))], text)


def _linked(text: str, link: Callable[[str, str, str], str]) -> Iterator[str]:
    """`text` in pieces, each `[label](url)` given to `link` (label, URL, the link as written)."""
    done = 0
    for start, close, tail in links(text, _LINK_TAIL_RE):
        yield text[done:start]
        yield link(text[start + 1 : close], tail.group(1), text[start : tail.end()])
        done = tail.end()
    yield text[done:]


def _between_tags(text: str, pair: Pair, tag: str) -> str:
    pieces = _TAG_SPLIT_RE.split(text)
    for n, piece in enumerate(pieces):
        if n % 2 == 0 and piece:
            pieces[n] = paired(piece, pair, f"<{tag}>", f"</{tag}>")
    return "".join(pieces)


_STRIP_TAGS_RE = re.compile(r"<[^>]*>")


def plain(html_text: str) -> str:
    """The text Telegram would show for our HTML: tags dropped, entities decoded."""
    return html.unescape(_STRIP_TAGS_RE.sub("", html_text))
