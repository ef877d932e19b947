"""Markdown as agents write it → Discord message text.

Discord renders Markdown itself (bold, italic, strikethrough, code, code blocks with languages,
quotes, lists, headings, masked links), so the agent's text passes through. What must not pass:

- mentions that ping. `@everyone`, `@here`, `<@id>`, `<@&role>` are neutralised by the plugin's
  `allowed_mentions` (none) on every send and edit, which is Discord's own switch for this: the text
  still reads as written, nobody is notified. The text is not rewritten for it.
- control characters other than newline and tab, which Discord refuses or renders as boxes.
- a run of backticks inside a fenced code block (`FENCE = "```"`, or a ```` ```py ```` line in a
  block of four backticks that shows Markdown): Discord ends a block at the first ``` after its
  opener, wherever it is, so the code after it showed as prose and the prose after the block as
  code. Each ``` in a block's code gets a zero-width space (U+200B) before its third backtick, as
  on Slack, and the block's own fences of more than three backticks are written as three (Discord
  knows no longer ones: the extra backticks showed as code).
- a `~~~` block's fences: Discord knows none, so its code showed as Markdown (`a*b*c` in italics).
  They are written as ``` (the language kept), as on Slack and Telegram.
"""

from __future__ import annotations

import re

_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# A fence line (CommonMark, as the gateway's split reads it): up to three spaces, then ``` or ~~~
# (or more); after backticks, an info string without a backtick.
_FENCE_RE = re.compile(r"\s{0,3}(`{3,}|~{3,})")


def to_discord(text: str) -> str:
    """The agent's Markdown as Discord text: unchanged but for control characters, CR LF, the
    backticks of a code block that would end it early and the fences Discord does not know."""
    text = _CONTROL_RE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return _code_kept_in_blocks(text) if "```" in text or "~~~" in text else text


def _code_kept_in_blocks(text: str) -> str:
    """`text` with the backticks of each fenced block's code broken up, so none ends the block."""
    out: list[str] = []
    marker: str | None = None  # the fence open before the line
    for line in text.split("\n"):
        if marker is None:
            marker = _opener(line)
            out.append(_three_backticks(line, marker))
        elif _closes(line, marker):
            out.append(_three_backticks(line, marker))
            marker = None
        else:
            out.append(line.replace("```", "``\u200b`"))
    return "\n".join(out)


def _opener(line: str) -> str | None:
    """The marker when `line` opens a code block, else None. After backticks the rest of the line
    holds no backtick (CommonMark): ```` ```x` ```` is text."""
    m = _FENCE_RE.match(line)
    if m is None or m.group(1)[0] == "`" and "`" in line[m.end() :]:
        return None
    return m.group(1)


def _closes(line: str, marker: str) -> bool:
    """Whether `line` closes the block `marker` opened: the same character, at least as many, nothing else."""
    stripped = line.strip()
    return stripped.startswith(marker) and not stripped.strip(marker[0])


def _three_backticks(line: str, marker: str | None) -> str:
    """A fence line with its run (backticks or tildes) written as three backticks, Discord's only
    fence. A tilde opener's info string may hold backticks (CommonMark): they are dropped, as after
    ``` they would make the line no fence."""
    if marker is None:
        return line
    run = line.index(marker[0])
    end = run
    while end < len(line) and line[end] == marker[0]:
        end += 1
    return f"{line[:run]}```{line[end:].replace('`', '')}"
