"""Chat commands the gateway answers itself; they never reach the agent (issue 16).

`/new`, `/cancel`, `/status`, `/help`, `/approve ID`, `/deny ID`, and for admins `/pair`. A slash
word that is not one of these (`/slow 30`, `/recall`) is ordinary text for the agent. Telegram's
`/cmd@botname` form is understood.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def parse_command(text: str) -> Command | None:
    stripped = text.strip()
    if not stripped.startswith("/") or len(stripped) < 2:
        return None
    head, *args = stripped[1:].split()
    name = head.split("@", 1)[0].lower()
    if name not in COMMANDS:
        return None
    return Command(name, tuple(args))
