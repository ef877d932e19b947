"""Which conversation an OpenAI request belongs to (DESIGN §5), and the history-prefix index.

A request's transcript is reduced to the *client-visible view*: system text, user text (and image
references), assistant final text with the client tool calls it made, and tool results. Each
view item extends a hash chain; the hash of a prefix names a point in a conversation. After every
turn the point the client now sees is recorded (`history_points`), so a client that resends the
whole transcript with no header lands in the same conversation, or forks one when it resends an
older point (a regenerate, an edited message).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appserver.http.errors import ApiError
from appserver.store.records import AgentRecord, ConversationRecord, HistoryPoint, MessageRecord

if TYPE_CHECKING:
    from appserver.server import Server

HEADER = "X-Conversation-Id"
CONVERSATION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
EMPTY_HASH = hashlib.sha256(b"appserver-history-v1").hexdigest()


@dataclass(slots=True)
class ViewItem:
    """One client-visible item. kind: system | user | assistant | tool."""

    kind: str
    text: str = ""
    images: list[str] = field(default_factory=list)
    calls: list[dict[str, str]] = field(default_factory=list)  # assistant: [{id, name, arguments}]
    call_id: str | None = None  # tool

    def key(self) -> list[Any]:
        if self.kind == "assistant":
            return ["assistant", self.text.strip(), [[c["name"], _canon_args(c["arguments"])] for c in self.calls]]
        if self.kind == "user":
            return ["user", self.text.strip(), list(self.images)]
        return [self.kind, self.text.strip()]


def _canon_args(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError):
        return arguments or ""


def chain(items: list[ViewItem], start: str = EMPTY_HASH) -> str:
    h = start
    for item in items:
        h = hashlib.sha256((h + json.dumps(item.key(), ensure_ascii=False, separators=(",", ":"))).encode("utf-8")).hexdigest()
    return h


def merge_assistants(items: list[ViewItem]) -> list[ViewItem]:
    """Adjacent assistant items are one turn's reply (Responses splits text and calls into items)."""
    out: list[ViewItem] = []
    for item in items:
        if item.kind == "assistant" and out and out[-1].kind == "assistant":
            prev = out[-1]
            if item.text:
                prev.text = f"{prev.text}\n\n{item.text}" if prev.text else item.text
            prev.calls.extend(item.calls)
        else:
            out.append(ViewItem(item.kind, item.text, list(item.images), list(item.calls), item.call_id))
    return out


def split_new_input(items: list[ViewItem]) -> tuple[list[ViewItem], list[ViewItem]]:
    """(prefix up to and including the last assistant item, the trailing new input)."""
    last = -1
    for i, item in enumerate(items):
        if item.kind == "assistant":
            last = i
    return items[: last + 1], items[last + 1 :]


def seed_records(items: list[ViewItem]) -> list[MessageRecord]:
    """Messages that reproduce a client-sent transcript in a new conversation (system text is per turn)."""
    names: dict[str, str] = {}
    out: list[MessageRecord] = []
    for item in items:
        if item.kind == "user":
            content: Any = item.text
            if item.images:
                content = [{"type": "text", "text": item.text}] + [{"type": "image_url", "image_url": {"url": u}} for u in item.images]
            out.append(MessageRecord(role="user", content=content, source={"kind": "http_seed"}))
        elif item.kind == "assistant":
            calls = []
            for c in item.calls:
                cid = c.get("id") or f"call_{secrets.token_hex(10)}"
                names[cid] = c["name"]
                calls.append({"id": cid, "name": c["name"], "arguments": c["arguments"], "executor": "client"})
            out.append(MessageRecord(role="assistant", content=item.text, tool_calls=calls))
        elif item.kind == "tool":
            cid = item.call_id or ""
            out.append(MessageRecord(role="tool", content=item.text, tool_call_id=cid, name=names.get(cid, "tool")))
    return _valid_tool_pairs(out)


def _valid_tool_pairs(messages: list[MessageRecord]) -> list[MessageRecord]:
    """Drop tool results without a call and give calls without a result a synthetic one."""
    out: list[MessageRecord] = []
    open_calls: dict[str, str] = {}
    for m in messages:
        if m.role == "tool":
            if m.tool_call_id in open_calls:
                open_calls.pop(m.tool_call_id)
                out.append(m)
            continue
        for cid, name in open_calls.items():
            out.append(MessageRecord(role="tool", content="(no result was provided)", tool_call_id=cid, name=name, is_error=True))
        open_calls = {}
        out.append(m)
        if m.role == "assistant":
            open_calls = {c["id"]: c["name"] for c in m.tool_calls}
    return out


@dataclass(slots=True)
class Placement:
    conversation_id: str
    how: str  # header | header_new | prefix | fork | new | previous_response | conversation


class ConversationMatcher:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.store = server.store

    async def _new(self, agent: AgentRecord, namespace: str | None, *, conv_id: str | None = None, seed: list[ViewItem] | None = None, user: str | None = None, metadata: dict[str, Any] | None = None, forked_from: str | None = None, copy: list[int] | None = None) -> ConversationRecord:
        conv = ConversationRecord(
            id=conv_id or f"conv_{secrets.token_hex(8)}",
            agent_id=agent.id,
            title="http",
            user=user,
            namespace=namespace,
            forked_from=forked_from,
            metadata=dict(metadata or {}),
        )
        await self.store.create_conversation(conv, copy_messages=copy)
        records: list[MessageRecord] = seed_records(seed) if seed else []
        if records:
            await self.store.append_messages(conv.id, records)
        # No turns yet and (unless copied) exactly these messages: the submit that follows finds its
        # runtime loaded, with no lookups.
        await self.server.kernel.runtime(conv.id, conv=conv, fresh=True, history=None if copy else records)
        return conv

    def visible(self, conv: ConversationRecord, agent: AgentRecord, namespace: str | None) -> bool:
        return conv.agent_id == agent.id and (conv.namespace is None or namespace is None or conv.namespace == namespace)

    async def by_header(self, agent: AgentRecord, namespace: str | None, value: str, prefix: list[ViewItem], user: str | None, metadata: dict[str, Any] | None) -> Placement:
        value = value.strip()
        if not CONVERSATION_ID_RE.match(value):
            raise ApiError(400, f"invalid {HEADER}: letters, digits, '_', '.', ':', '-', at most 128 characters", code="invalid_conversation_id", param=HEADER)
        conv = await self.store.get_conversation(value)
        if conv is not None:
            if not self.visible(conv, agent, namespace):
                raise ApiError(404, f"conversation {value!r} does not belong to this model", code="conversation_not_found", param=HEADER)
            return Placement(conv.id, "header")
        await self._new(agent, namespace, conv_id=value, seed=prefix, user=user, metadata=metadata)
        return Placement(value, "header_new")

    async def by_prefix(self, agent: AgentRecord, namespace: str | None, prefix: list[ViewItem], user: str | None, metadata: dict[str, Any] | None) -> Placement:
        if not prefix:
            conv = await self._new(agent, namespace, user=user, metadata=metadata)
            return Placement(conv.id, "new")
        h = chain(prefix)
        candidates = []
        for point in await self.store.find_history_points(agent.id, h):
            found = await self.store.get_conversation(point.conversation_id)
            if found is None or not self.visible(found, agent, namespace):
                continue
            candidates.append(point)
            if await self.store.last_message_id(point.conversation_id) == point.last_message_id:
                return Placement(point.conversation_id, "prefix")
        if candidates:
            src = candidates[0]
            ids = [m.id for m in await self.store.list_messages(src.conversation_id) if m.id is not None and m.id <= src.last_message_id]
            conv = await self._new(agent, namespace, user=user, metadata=metadata, forked_from=src.conversation_id, copy=ids)  # type: ignore[arg-type]
            await self.record(agent.id, conv.id, h)
            return Placement(conv.id, "fork")
        conv = await self._new(agent, namespace, seed=prefix, user=user, metadata=metadata)
        await self.record(agent.id, conv.id, h)
        return Placement(conv.id, "new")

    async def fork_at(self, agent: AgentRecord, namespace: str | None, source_conversation: str, last_message_id: int) -> str:
        ids = [m.id for m in await self.store.list_messages(source_conversation) if m.id is not None and m.id <= last_message_id]
        conv = await self._new(agent, namespace, forked_from=source_conversation, copy=ids)  # type: ignore[arg-type]
        return conv.id

    async def record(self, agent_id: str, conversation_id: str, prefix_hash: str) -> None:
        last = await self.store.last_message_id(conversation_id)
        await self.store.add_history_point(HistoryPoint(agent_id, prefix_hash, conversation_id, last))
