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
from collections.abc import Callable, Iterator

from plugins.markup import Pair, code_spans, links, paired

_FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# What follows a link's `[label]`: `(url)`, the URL's parentheses balanced one level deep.
_LINK_TAIL_RE = re.compile(r"\(\s*((?:https?://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_HEADING_RE = re.compile(r"\s{0,3}#{1,6}\s+")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")
_BOLD_MARK = "\x01"  # bold while italics are converted, `*` at the end
_EMPTY_BLOCK = "```\n```"


# `**bold**` / `__bold__` first (as a mark, so the italics do not take its `*`), then `*italic*`
# (not inside words: 2*3*4 stays), then `~~strike~~`. Slack's own `_italic_` passes as it is.
_PAIRS = (
    (Pair(("**", "__"), re.compile(r"(?=(\*\*|__)\S)"), re.compile(r"(?<=\S)(?=(\*\*|__))")), _BOLD_MARK),
    (Pair(("*",), re.compile(r"(?<![\w*])(?=(\*)[^\s*])"), re.compile(r"(?<=[^\s*])(?=(\*)(?![\w*]))")), "_"),
    (Pair(("~~",), re.compile(r"(?=(~~)\S)"), re.compile(r"(?<=\S)(?=(~~))")), "~"),
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

    text = code_spans(text, lambda _written, inner: keep(f"`{escape(inner)}`"))
    text = "".join(_linked(text, lambda label, url: keep(_link(url, label))))
    text = escape(text)
    for pair, mark in _PAIRS:
        text = paired(text, pair, mark, mark)
    text = text.replace(_BOLD_MARK, "*")
    while _PLACEHOLDER_RE.search(text):  # a link's label may hold a code span
        text = _PLACEHOLDER_RE.sub(lambda m: saved[int(m.group(1))], text)
    return text


def _linked(text: str, link: Callable[[str, str], str]) -> Iterator[str]:
    """`text` in pieces, each `[label](url)` / `![alt](url)` replaced by what `link` makes of its
    label and URL (an image's `!` goes with it)."""
    done = 0
    for start, close, tail in links(text, _LINK_TAIL_RE):
        head = start - 1 if start > done and text[start - 1] == "!" else start
        yield text[done:head]
        yield link(text[start + 1 : close], tail.group(1))
        done = tail.end()
    yield text[done:]


def _link(url: str, label: str) -> str:
    # In `<url|label>` the first `|` ends the URL and `>` ends the link: neither may appear raw.
    safe_url = escape(url).replace("|", "%7C")
    safe_label = escape(label).replace("|", "¦").strip()
    return f"<{safe_url}|{safe_label}>" if safe_label else f"<{safe_url}>"
