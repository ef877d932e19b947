"""What a message becomes: its ledger payload (cleaned), and a turn's input built from entries.

Pure functions: the envelope of each message (a debounced batch marked as such, attachments named
inside the escaped body), images as image parts, the agent note for a new conversation, and the
`message_channel` client tool on every turn.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from appserver.client import encode_frame
from gateway.approvals import pressed_message_of
from gateway.envelope import AGENT_NOTE, Envelope, render, timestamp
from gateway.ledger import Entry
from gateway.tool import SPEC as TOOL_SPEC
from plugins.contract import IMAGE_MAX_BYTES, Attachment, InboundMessage

_IMAGE_MIME = re.compile(r"image/[A-Za-z0-9][A-Za-z0-9.+_-]*")
# Room kept in a frame for what the client adds to it (the request's id): a frame measured within
# the limit less this is never refused for its last few bytes.
FRAME_SLACK = 1024
TOO_BIG = "too big to pass on"


def submit_frame(
    entries: list[Entry], agent: str, conversation: str, first: bool, max_bytes: int | None = None
) -> dict[str, Any]:
    """The turn's input: the envelope of each message (a batch marked as such), their images. With
    `max_bytes` (the server's frame limit) the images that would make the frame too big are left
    out, biggest first, each named in its message's envelope as too big, so the text still goes
    through (several images of one message, or a debounced batch, can add up past the limit that
    each fits alone). A frame too big without any image is left to the client to refuse."""
    dropped: set[tuple[int, int]] = set()
    frame = _frame(entries, agent, conversation, first, dropped)
    if max_bytes is None:
        return frame
    sizes = sorted(
        ((len(str(url)), i, j) for i, e in enumerate(entries) for j, url in enumerate(e.payload.get("images") or [])),
        reverse=True,
    )
    for _size, i, j in sizes:
        if frame_size(frame) + FRAME_SLACK <= max_bytes:
            break
        dropped.add((i, j))
        frame = _frame(entries, agent, conversation, first, dropped)
    return frame


def frame_size(frame: dict[str, Any]) -> int:
    """The bytes `frame` takes as `submit_input` on the wire, as the protocol client encodes it
    (UTF-8: non-ASCII text is not escaped)."""
    return encode_frame({"type": "submit_input", **frame})[1]


def _frame(
    entries: list[Entry], agent: str, conversation: str, first: bool, dropped: set[tuple[int, int]]
) -> dict[str, Any]:
    batch = len(entries) if len(entries) > 1 else None
    blocks: list[str] = []
    images: list[str] = []
    for index, e in enumerate(entries, start=1):
        p = e.payload
        text = str(p.get("text") or "")
        for a in p.get("attachments") or []:  # named inside the body, escaped like the text
            text += _named(a)
        names = list(p.get("image_names") or [])
        for j, url in enumerate(p.get("images") or []):
            if (index - 1, j) not in dropped:
                images.append(str(url))
                continue
            name = names[j] if j < len(names) else "image"
            mime, _, data = str(url).partition(";base64,")
            size = len(data) * 3 // 4 - data[-2:].count("=")
            text += _named(
                {"kind": "image", "name": name, "mime": mime.removeprefix("data:"), "size": size, "note": TOO_BIG}
            )
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


def _named(a: dict[str, Any]) -> str:
    """An attachment that does not go to the model as an image, as a line of the envelope's body;
    an image too big for the server's frame says so, so the agent can tell the person."""
    what = f"{a.get('name')} ({a.get('mime')}, {a.get('size') or '?'} bytes)"
    if a.get("note") == TOO_BIG:
        return f"\n[image {TOO_BIG} to the model: {what}]"
    return f"\n[attachment: {what}]"


def clean(text: str) -> str:
    """`text` without lone surrogates (valid JSON can carry them; SQLite and UTF-8 cannot)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def payload_of(msg: InboundMessage, image_max: int = IMAGE_MAX_BYTES) -> dict[str, Any]:
    """What the ledger keeps of a message: enough to submit it again after a crash, images included
    (as data URLs, each at most `image_max` bytes: what fits in the server's frame, at most 5 MiB; a
    larger one is named as too big, any other file by its type and size)."""
    inline = [a for a in msg.attachments if _inline(a, image_max)]
    return {
        "images": [f"data:{a.mime};base64,{base64.b64encode(a.data or b'').decode()}" for a in inline],
        "image_names": [clean(a.name) for a in inline],
        "text": clean(msg.text),
        "chat_type": msg.chat_type,
        "sender_name": clean(msg.sender_name) if msg.sender_name is not None else None,
        "mentions_bot": msg.mentions_bot,
        "reply_to": msg.reply_to,
        "sender_is_bot": msg.sender_is_bot,
        "pressed": msg.pressed,
        # what the pressed message shows, as the platform delivered it: proves it an approval prompt
        "pressed_message": pressed_message_of(msg.raw) if msg.pressed else None,
        "ts": msg.ts,
        "attachments": [
            {"kind": a.kind, "name": clean(a.name), "mime": clean(a.mime), "size": a.size}
            | ({"note": TOO_BIG} if _too_big(a, image_max) else {})
            for a in msg.attachments
            if not _inline(a, image_max)
        ],
    }


def _inline(a: Attachment, image_max: int) -> bool:
    """Whether an attachment goes to the model as an image: image data of at most `image_max` bytes
    under a plain `image/<type>` (the server refuses a data: URL whose type holds a `,` or `;`, or that
    holds no data, and that refusal would sink the whole turn). Anything else is named as a file."""
    return (
        a.kind == "image"
        and a.data is not None
        and 0 < len(a.data) <= image_max
        and _IMAGE_MIME.fullmatch(a.mime) is not None
    )


def _too_big(a: Attachment, image_max: int) -> bool:
    """An image left out only for its size: fetched bigger than `image_max`, or not fetched because
    the platform said it was (`Attachment.size` without `data`)."""
    if a.kind != "image" or _IMAGE_MIME.fullmatch(a.mime) is None:
        return False
    size = len(a.data) if a.data is not None else a.size
    return size is not None and size > image_max
