"""Per-conversation cache of provider messages: each stored message is converted once, not per turn.

History is append-only and a MessageRecord is not edited once it is in a turn's work, so the
conversion (agent/context.py `to_chat_message`) is a function of the record: the cache is keyed by
the record itself. Whoever edits a record's content in place, or replaces the history, must call
`clear()` (the runtime does whenever it drops its history).
"""

from __future__ import annotations

from appserver.agent.context import to_chat_message
from appserver.providers.base import ChatMessage
from appserver.store.records import MessageRecord


class ChatCache:
    __slots__ = ("_items", "limit")

    def __init__(self, limit: int = 100_000) -> None:
        # id(record) → (record, converted); holding the record keeps its id from being reused.
        self._items: dict[int, tuple[MessageRecord, ChatMessage]] = {}
        self.limit = limit

    def __call__(self, m: MessageRecord) -> ChatMessage:
        hit = self._items.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        if len(self._items) >= self.limit:
            self._items.clear()
        chat = to_chat_message(m)
        self._items[id(m)] = (m, chat)
        return chat

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
