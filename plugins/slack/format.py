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

Inline markup never spans lines.
"""

from __future__ import annotations

import re

_FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_RE = re.compile(r"(`+)(.+?)\1")
_LINK_RE = re.compile(r"!?\[([^\]\n]+)\]\(\s*((?:https?://|mailto:)[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)\s*\)")
_BOLD_RE = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_ITALIC_STAR_RE = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])")
_STRIKE_RE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_BULLET_RE = re.compile(r"^(\s*)[-*+]\s+(?=\S)")
_PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")
_BOLD_MARK = "\x01"  # bold while italics are converted, `*` at the end


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
        fence = _FENCE_RE.match(lines[i])
        if fence:
            marker = fence.group(1)
            body: list[str] = []
            i += 1
            while i < len(lines) and not (
                lines[i].strip().startswith(marker[0] * len(marker)) and not lines[i].strip().strip(marker[0])
            ):
                body.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of the text: an open fence is closed)
            code = escape("\n".join(body)).replace("```", "``\u200b`")  # a fence inside cannot close it
            out.append(f"```\n{code}\n```" if code else "```\n```")
            continue
        out.append(_line(lines[i]))
        i += 1
    return "\n".join(out)


def _line(line: str) -> str:
    heading = _HEADING_RE.match(line)
    if heading:
        inner = _inline(heading.group(1).replace("**", "").replace("__", ""))
        return f"*{inner}*" if inner.strip() else inner
    bullet = _BULLET_RE.match(line)
    if bullet:
        return bullet.group(1) + "• " + _inline(line[bullet.end() :])
    return _inline(line)


def _inline(text: str) -> str:
    saved: list[str] = []

    def keep(value: str) -> str:
        saved.append(value)
        return f"\x00{len(saved) - 1}\x00"

    text = _CODE_RE.sub(lambda m: keep(f"`{escape(m.group(2))}`"), text)
    text = _LINK_RE.sub(lambda m: keep(_link(m.group(2), m.group(1))), text)
    text = escape(text)
    text = _BOLD_RE.sub(lambda m: f"{_BOLD_MARK}{m.group(2)}{_BOLD_MARK}", text)
    text = _ITALIC_STAR_RE.sub(r"_\1_", text)
    text = _STRIKE_RE.sub(r"~\1~", text)
    text = text.replace(_BOLD_MARK, "*")
    while _PLACEHOLDER_RE.search(text):  # a link's label may hold a code span
        text = _PLACEHOLDER_RE.sub(lambda m: saved[int(m.group(1))], text)
    return text


def _link(url: str, label: str) -> str:
    # In `<url|label>` the first `|` ends the URL and `>` ends the link: neither may appear raw.
    safe_url = escape(url).replace("|", "%7C")
    safe_label = escape(label).replace("|", "¦").strip()
    return f"<{safe_url}|{safe_label}>" if safe_label else f"<{safe_url}>"
