"""A conversation's messages in memory: read from the store once, then kept in step with what the
runtime commits, with their provider conversions (`ChatCache`) beside them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


def last_input(history: Sequence[MessageRecord]) -> str | None:
    """The turn whose user message is the history's last one: every message after it is that
    turn's or a re-run's of its input (`Kernel._rerun`), the only turns that write no input."""
    for m in reversed(history):
        if m.role == "user":
            return m.turn_id
    return None


def model_view(history: Sequence[MessageRecord], rerun_of: str | None = None) -> list[MessageRecord]:
    """The history a turn's model calls see: all of it but the replies a re-run replaced. A turn
    ended without an answer (stopped, crashed, failed, cancelled) whose input a keyed retry ran
    again leaves a reply text cut short in the history, kept there as what was shown; the model
    sees the input once and answers it anew, never after its own cut-off answer. Such a text is an
    assistant message without calls followed by another turn's assistant message (no user input
    between: only a re-run does that), or, for the re-run being run now (`rerun_of`: the turn
    whose input it answers, the history's last), the history's last message. Calls and their
    results stay: what ran is known."""
    out: list[MessageRecord] = []
    last = len(history) - 1
    for i, m in enumerate(history):
        if m.role == "assistant" and not m.tool_calls and m.turn_id is not None:
            after = history[i + 1] if i < last else None
            if after is None and rerun_of is not None:
                continue
            if after is not None and after.role == "assistant" and after.turn_id not in (None, m.turn_id):
                continue
        out.append(m)
    return out if len(out) < len(history) else list(history)


__all__ = ["History", "last_input", "model_view"]
