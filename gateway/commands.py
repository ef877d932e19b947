"""Chat commands the gateway answers itself; they never reach the agent (issue 16).

`/new`, `/cancel`, `/status`, `/help`, `/approve ID`, `/deny ID`, and for admins `/pair`. A slash
word that is not one of these (`/slow 30`, `/recall`) is ordinary text for the agent. Telegram's
`/cmd@botname` form is understood when it names this bot; `/cmd@otherbot` is another bot's command
(in an open group it would otherwise act here). A leading mention of this bot (`@bot /approve ID`)
is dropped before parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

COMMANDS = ("new", "cancel", "status", "help", "approve", "deny", "pair")

HELP = (
    "Commands:\n"
    "/new — start a new conversation here\n"
    "/cancel — stop the reply being written\n"
    "/status — the agent, conversation and what is running\n"
    "/approve ID, /deny ID — answer the agent's request to use a tool\n"
    "/pair — pending pairing requests (admins)\n"
    "/help — this list\n"
    "Anything else goes to the agent."
)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    args: tuple[str, ...]


def bot_name(adapter: Any) -> str | None:
    """The username this account's bot is addressed by in text (`@name`), where the adapter knows
    one (Telegram's `username`); None elsewhere (Slack and Discord drop their own mention)."""
    name = getattr(adapter, "username", None)
    return name if isinstance(name, str) and name else None


def parse_command(text: str, me: str | None = None) -> Command | None:
    """The command in `text`, or None. `me` is this bot's username: `@me /cmd` and `/cmd@me` are
    commands; `/cmd@someone_else` is not (nor `/cmd@x` when `me` is unknown)."""
    stripped = _without_mention(text.strip(), me)
    if not stripped.startswith("/") or len(stripped) < 2 or stripped[1].isspace():
        return None  # "/ help me write…" is text for the agent, not `/help`
    head, *args = stripped[1:].split()
    name, at, addressee = head.partition("@")
    if at and (me is None or addressee.lower() != me.lower()):
        return None  # another bot's command
    name = name.lower()
    if name not in COMMANDS:
        return None
    return Command(name, tuple(args))


def for_another_bot(text: str, me: str | None) -> bool:
    """`/cmd@otherbot …`: a command of ours addressed to another bot, which this one ignores."""
    stripped = _without_mention(text.strip(), me)
    match = re.match(r"/(\w+)@(\w+)", stripped)
    if match is None or match.group(1).lower() not in COMMANDS:
        return False
    return me is None or match.group(2).lower() != me.lower()


def _without_mention(text: str, me: str | None) -> str:
    """`text` without a leading `@me` (and the whitespace after it)."""
    if me and text[: len(me) + 1].lower() == f"@{me}".lower():
        rest = text[len(me) + 1 :]
        if not rest or rest[0].isspace():
            return rest.lstrip()
    return text
