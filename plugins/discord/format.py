"""Markdown as agents write it → Discord message text.

Discord renders Markdown itself (bold, italic, strikethrough, code, code blocks with languages,
quotes, lists, headings, masked links), so the agent's text passes through. What must not pass:

- mentions that ping. `@everyone`, `@here`, `<@id>`, `<@&role>` are neutralised by the plugin's
  `allowed_mentions` (none) on every send and edit, which is Discord's own switch for this: the text
  still reads as written, nobody is notified. The text is not rewritten for it.
- control characters other than newline and tab, which Discord refuses or renders as boxes.
"""

from __future__ import annotations

import re

_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def to_discord(text: str) -> str:
    """The agent's Markdown as Discord text: unchanged but for control characters and CR LF."""
    return _CONTROL_RE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
