"""What a message becomes: its ledger payload (cleaned), and a turn's input built from entries.

Pure functions: the envelope of each message (a debounced batch marked as such, attachments named
inside the escaped body), images as image parts, the agent note for a new conversation, and the
`message_channel` client tool on every turn.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from gateway.envelope import AGENT_NOTE, Envelope, render, timestamp
from gateway.ledger import Entry
from gateway.tool import SPEC as TOOL_SPEC
from plugins.contract import Attachment, InboundMessage

IMAGE_MAX_BYTES = 5 << 20
_IMAGE_MIME = re.compile(r"image/[A-Za-z0-9][A-Za-z0-9.+_-]*")


def submit_frame(entries: list[Entry], agent: str, conversation: str, first: bool) -> dict[str, Any]:
    """The turn's input: the envelope of each message (a batch marked as such), their images."""
    batch = len(entries) if len(entries) > 1 else None
    blocks: list[str] = []
    images: list[str] = []
    for index, e in enumerate(entries, start=1):
        p = e.payload
        text = str(p.get("text") or "")
        for a in p.get("attachments") or []:  # named inside the body, escaped like the text
            text += f"\n[attachment: {a.get('name')} ({a.get('mime')}, {a.get('size') or '?'} bytes)]"
        envelope = Envelope(
            channel=e.key.channel,
            account=e.key.account,
            chat=e.chat,
            chat_type="dm" if p.get("chat_type") == "dm" else "group",  # as access decided it
            sender=e.sender,
            message_id=e.key.message_id,
            text=text,
            thread=e.thread,
            sender_name=p.get("sender_name"),
            ts=timestamp(float(p.get("ts") or e.received_at)),
            batch=batch,
            batch_index=index if batch else None,
        )
        blocks.append(render(envelope))
        images += [str(url) for url in p.get("images") or []]
    text = "\n".join(blocks)
    if first:
        text = f"{AGENT_NOTE}\n\n{text}"
    content: str | list[dict[str, Any]] = text
    if images:
        content = [{"type": "text", "text": text}, *({"type": "image", "url": url} for url in images)]
    entry = entries[0]
    return {
        "agent": agent,
        "conversation": conversation,
        "input": content,
        "idempotency_key": entry.idempotency_key,
        "source": {
            "kind": "channel",
            "channel": entry.key.channel,
            "account": entry.key.account,
            "chat": entry.chat,
            "thread": entry.thread,
            "sender": entry.sender,
            "messages": [e.key.message_id for e in entries],
        },
        "client_tools": [TOOL_SPEC],
    }


def clean(text: str) -> str:
    """`text` without lone surrogates (valid JSON can carry them; SQLite and UTF-8 cannot)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def payload_of(msg: InboundMessage) -> dict[str, Any]:
    """What the ledger keeps of a message: enough to submit it again after a crash, images included
    (as data URLs, each at most 5 MiB; a larger one is named like any other file)."""
    images = [f"data:{a.mime};base64,{base64.b64encode(a.data or b'').decode()}" for a in msg.attachments if _inline(a)]
    return {
        "images": images,
        "text": clean(msg.text),
        "chat_type": msg.chat_type,
        "sender_name": clean(msg.sender_name) if msg.sender_name is not None else None,
        "mentions_bot": msg.mentions_bot,
        "reply_to": msg.reply_to,
        "sender_is_bot": msg.sender_is_bot,
        "pressed": msg.pressed,
        "ts": msg.ts,
        "attachments": [
            {"kind": a.kind, "name": clean(a.name), "mime": clean(a.mime), "size": a.size}
            for a in msg.attachments
            if not _inline(a)
        ],
    }


def _inline(a: Attachment) -> bool:
    """Whether an attachment goes to the model as an image: image data of at most 5 MiB under a
    plain `image/<type>` (the server refuses a data: URL whose type holds a `,` or `;`, or that
    holds no data, and that refusal would sink the whole turn). Anything else is named as a file."""
    return (
        a.kind == "image"
        and a.data is not None
        and 0 < len(a.data) <= IMAGE_MAX_BYTES
        and _IMAGE_MIME.fullmatch(a.mime) is not None
    )
