"""A conversation's messages in memory: read from the store once, then kept in step with what the
runtime commits, with their provider conversions (`ChatCache`) beside them."""

from __future__ import annotations

from collections.abc import Iterable

from appserver.runtime.chatcache import ChatCache
from appserver.store.base import Store
from appserver.store.records import MessageRecord


class History:
    __slots__ = ("_store", "_conversation_id", "_messages", "chat")

    def __init__(self, store: Store, conversation_id: str) -> None:
        self._store = store
        self._conversation_id = conversation_id
        self._messages: list[MessageRecord] | None = None
        self.chat = ChatCache()  # provider messages of the history, converted once (cleared with it)

    def adopt(self, messages: list[MessageRecord]) -> None:
        """The whole history, from a caller that just wrote it (a new conversation): no store read."""
        if self._messages is None:
            self._messages = list(messages)

    async def read(self) -> list[MessageRecord]:
        if self._messages is None:
            self._messages = await self._store.list_messages(self._conversation_id)
        return self._messages

    def extend(self, messages: Iterable[MessageRecord]) -> None:
        """Messages just committed: kept when the history is in memory (else the next read has them)."""
        if self._messages is not None:
            self._messages.extend(messages)

    def drop(self) -> None:
        """A commit failed, so what the store holds is not known here: read it again next time."""
        self._messages = None
        self.chat.clear()


__all__ = ["History"]
