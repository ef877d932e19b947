"""Approval prompts in the chat: what the gateway shows for a paused turn and who may answer.

When a channel turn pauses for an `ask` tool, the chat gets a prompt naming the tool and its
arguments (shortened), answered with `/approve ID` / `/deny ID` (or a plugin's buttons, which send
the same). Only the sender who started the turn or an admin may answer. The prompt is updated when
the call is decided here, elsewhere (CLI, desktop) or times out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from plugins.contract import Target, shorten

SHORT_ID = 8
ARGS_SHOWN = 300

OUTCOME_LINES = {
    "approved": "✅ Approved",
    "denied": "❌ Denied",
    "expired": "⌛ Timed out (not run)",
    "cancelled": "⏹ Cancelled",
}


@dataclass
class Prompt:
    """One pending approval as shown in one chat."""

    call_id: str
    conversation: str
    turn_id: str
    account: str  # channel:account of the chat
    target: Target
    starter: str  # the sender whose message started the turn
    name: str
    arguments: str
    message_ids: list[str] = field(default_factory=list)
    decided: str | None = None
    shown: asyncio.Event = field(default_factory=asyncio.Event)  # set once the prompt's send returned

    @property
    def short_id(self) -> str:
        return self.call_id[-SHORT_ID:]

    def text(self) -> str:
        args = shorten(" ".join(self.arguments.split()), ARGS_SHOWN)
        head = f"🔐 The agent wants to use {self.name} with {args or '{}'}"
        if self.decided:
            return f"{head}\n{self.decided}"
        return f"{head}\nReply /approve {self.short_id} or /deny {self.short_id}"


class ApprovalBoard:
    """The pending prompts of this gateway, by call id."""

    def __init__(self) -> None:
        self.prompts: dict[str, Prompt] = {}

    def add(self, prompt: Prompt) -> bool:
        """False when this call already has a prompt (a re-sent request after a reconnect)."""
        if prompt.call_id in self.prompts:
            return False
        self.prompts[prompt.call_id] = prompt
        return True

    def find(self, account: str, chat: str, ref: str | None) -> Prompt | None | list[Prompt]:
        """The open prompt in this chat that `ref` names (by its short id or whole call id; the only
        open one when `ref` is None); a list when several match."""
        open_here = [
            p for p in self.prompts.values() if p.account == account and p.target.chat == chat and p.decided is None
        ]
        if ref is None:
            return open_here[0] if len(open_here) == 1 else (open_here or None)
        wanted = ref.strip().lower()
        hits = [p for p in open_here if p.call_id.lower() == wanted or p.call_id.lower().endswith(wanted)]
        if not hits:
            return None
        return hits[0] if len(hits) == 1 else hits

    def forget_turn(self, turn_id: str) -> None:
        for call_id in [c for c, p in self.prompts.items() if p.turn_id == turn_id]:
            del self.prompts[call_id]
