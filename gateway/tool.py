"""`message_channel`: a client tool the gateway declares on the turns it submits and runs itself.

The model can send on purpose: to this chat, to another chat this account reaches
(`channel:account:chat[:thread]`, same channel and account), as a reply to the message it answers,
a reaction, or an edit of a message it sent in this turn. An exact repeat of the previous send of
the same turn is refused with an error telling the model it was not sent (models loop on sends).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from plugins.contract import Target

NAME = "message_channel"

SPEC: dict[str, Any] = {
    "name": NAME,
    "description": (
        "Send a message through the chat channel this conversation comes from. Your normal reply is "
        "delivered to the chat anyway: use this only to send something extra or elsewhere. Actions: "
        "send (to this chat, or to target 'channel:account:chat[:thread]' on the same account), "
        "reply (to the message you are answering), react (emoji on that message), "
        "edit (a message you sent in this turn, by message_id)."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["send", "reply", "react", "edit"]},
            "text": {"type": "string", "description": "the message (send, reply, edit)"},
            "target": {"type": "string", "description": "channel:account:chat[:thread]; default: this chat"},
            "message_id": {"type": "string", "description": "edit: the id a previous send returned"},
            "emoji": {"type": "string", "description": "react: one emoji"},
        },
        "required": ["action"],
    },
}


class ToolRefusal(Exception):
    """A call the tool refuses; the message goes back to the model as an error result."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    action: str
    text: str
    target: Target
    message_id: str | None
    emoji: str | None


@dataclass
class TurnSends:
    """What one turn sent with the tool: the previous send (for the repeat rule) and its ids."""

    last: tuple[str, str] | None = None  # (target, text)
    sent: dict[str, Target] = field(default_factory=dict)  # message id -> where it went (for edits)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time, in the model's order


def parse_call(arguments: str, *, channel: str, account: str, here: Target, reply_to: str | None) -> ToolCall:
    try:
        args = json.loads(arguments or "{}")
    except (ValueError, RecursionError):  # not JSON, an integer past the digit limit, or nested too deeply
        raise ToolRefusal("arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolRefusal("arguments must be a JSON object")
    action = args.get("action")
    if action not in ("send", "reply", "react", "edit"):
        raise ToolRefusal("action must be one of send, reply, react, edit")
    text = args.get("text")
    if action in ("send", "reply", "edit") and (not isinstance(text, str) or not text.strip()):
        raise ToolRefusal(f"{action} needs a non-empty text")
    target = here
    raw_target = args.get("target")
    if raw_target not in (None, ""):
        if action != "send":
            raise ToolRefusal("target applies only to send")
        target = _parse_target(str(raw_target), channel, account)
    message_id = args.get("message_id")
    if action == "edit" and not isinstance(message_id, str):
        raise ToolRefusal("edit needs the message_id of a message you sent in this turn")
    if action in ("reply", "react"):
        if reply_to is None:
            raise ToolRefusal(f"there is no message to {action} to in this turn")
        message_id = reply_to
    emoji = args.get("emoji")
    if action == "react" and (not isinstance(emoji, str) or not emoji.strip()):
        raise ToolRefusal("react needs an emoji")
    if action == "reply":
        target = Target(here.chat, here.thread, reply_to)
    return ToolCall(str(action), str(text or ""), target, message_id, emoji)


def _parse_target(text: str, channel: str, account: str) -> Target:
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(parts):
        raise ToolRefusal("target must be channel:account:chat or channel:account:chat:thread")
    if (parts[0], parts[1]) != (channel, account):
        raise ToolRefusal(f"this conversation can only send through {channel}:{account}")
    return Target(parts[2], parts[3] if len(parts) == 4 else None)


def target_name(channel: str, account: str, target: Target) -> str:
    return f"{channel}:{account}:{target.chat}" + (f":{target.thread}" if target.thread else "")
