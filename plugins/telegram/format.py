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
"""

from __future__ import annotations

import html
import re

_FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
_CODE_RE = re.compile(r"(`+)(.+?)\1")
_LINK_RE = re.compile(r"\[([^\]\n]+)\]\(\s*((?:https?://|tg://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_BOLD_RE = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_ITALIC_STAR_RE = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")
_ITALIC_UNDER_RE = re.compile(r"(?<![\w_])_(?=[^\s_])(.+?)(?<=[^\s_])_(?![\w_])")
_STRIKE_RE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_QUOTE_RE = re.compile(r"^\s{0,3}>\s?(.*)$")
_TAG_SPLIT_RE = re.compile(r"(<[^>]*>)")
_PLACEHOLDER_RE = re.compile(r"\x00(\d+)\x00")
_LANG_RE = re.compile(r"[A-Za-z0-9_+#.-]{1,32}")


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
        fence = _FENCE_RE.match(line)
        if fence:
            flush_quote()
            marker = fence.group(1)
            lang = fence.group(2)
            body: list[str] = []
            i += 1
            while i < len(lines) and not (
                lines[i].strip().startswith(marker[0] * len(marker)) and not lines[i].strip().strip(marker[0])
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
        return "<b>" + _inline(heading.group(1)) + "</b>" if heading.group(1) else ""
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

    def code(m: re.Match[str]) -> str:
        inner = m.group(2)
        if inner.strip() == "":
            return m.group(0)
        if inner.startswith(" ") and inner.endswith(" ") and inner.strip():
            inner = inner[1:-1]
        return keep(f"<code>{escape(inner)}</code>", inner, m.group(0))

    def link(m: re.Match[str]) -> str:
        # A code span inside a link's label shows as its text; inside the URL it is the URL's own text.
        label = _PLACEHOLDER_RE.sub(lambda p: plain[int(p.group(1))], m.group(1))
        url = _PLACEHOLDER_RE.sub(lambda p: source[int(p.group(1))], m.group(2))
        return keep(f'<a href="{escape(url)}">{escape(label)}</a>', label, m.group(0))

    text = _CODE_RE.sub(code, text)
    text = _LINK_RE.sub(link, text)
    text = escape(text).replace("&quot;", '"')
    for pattern, tag in ((_BOLD_RE, "b"), (_STRIKE_RE, "s"), (_ITALIC_STAR_RE, "i"), (_ITALIC_UNDER_RE, "i")):
        text = _between_tags(text, pattern, tag)
    return _PLACEHOLDER_RE.sub(lambda m: atoms[int(m.group(1))], text)


def _between_tags(text: str, pattern: re.Pattern[str], tag: str) -> str:
    pieces = _TAG_SPLIT_RE.split(text)
    for n, piece in enumerate(pieces):
        if n % 2 == 0 and piece:
            pieces[n] = pattern.sub(lambda m: f"<{tag}>{m.group(m.lastindex or 1)}</{tag}>", piece)
    return "".join(pieces)


_STRIP_TAGS_RE = re.compile(r"<[^>]*>")


def plain(html_text: str) -> str:
    """The text Telegram would show for our HTML: tags dropped, entities decoded."""
    return html.unescape(_STRIP_TAGS_RE.sub("", html_text))
