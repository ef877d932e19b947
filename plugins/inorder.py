"""Per-chat arrival order for adapters whose platform library handles each event in its own task.

slack_sdk (Socket Mode) and discord.py start one asyncio task per incoming event, in the order the
events arrived. An event whose handling awaits something slow (an attachment download) is then
overtaken by the next event of the same chat, and the gateway records, debounces and answers the
later message first. The gateway keeps each chat in the order `on_message` is called, so the
adapter has to call it in arrival order:

    with self._order.ticket(chat) as ticket:  # synchronously, before the handler's first await
        msg = await build(event)              # downloads and all, each with its own timeout
        await ticket.wait()                   # every earlier message of the chat handed on
        await self.context.on_message(msg)
    # leaving the block releases the ticket whatever happened (nothing to hand on, an error, a
    # cancellation); a ticket released early still never lets a later one overtake an earlier one

Tasks start in the order they were created, so tickets taken before the first await are numbered in
arrival order. Nothing waits forever: a ticket waits for its predecessors at most until `hold_s`
after it was taken (an adapter sets this above its download timeout), then goes ahead out of order
with a warning, so a stuck download or a hung hand-over delays the chat once and never blocks it.
Only the standard library is used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from types import TracebackType


class Ticket:
    """One event's place in its chat's line."""

    __slots__ = ("_line", "_key", "_prev", "_done", "_deadline", "_released", "_timer")

    def __init__(self, line: ChatOrder, key: Hashable, prev: Ticket | None) -> None:
        loop = asyncio.get_running_loop()
        self._line = line
        self._key = key
        self._prev = prev
        self._deadline = loop.time() + line.hold_s
        # Done once this ticket is released and every earlier one of the chat is done too (or this
        # ticket's wait ran out): what the next ticket waits for.
        self._done: asyncio.Future[None] = loop.create_future()
        self._released = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        return self._done.done()

    async def wait(self) -> bool:
        """Until every earlier ticket of the chat is through; True then, False when the wait ran
        out (`hold_s` after this ticket was taken) and the caller goes ahead anyway."""
        prev = self._prev
        if prev is None or prev._done.done():
            return True
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait_for(asyncio.shield(prev._done), remaining)
        except TimeoutError:
            self._line.log.warning(
                "chat %s: an earlier message is still being read after %g s; handing on a later one first",
                self._key,
                self._line.hold_s,
            )
            return False
        return True

    def release(self) -> None:
        """This ticket has handed on (or has nothing to hand on). The next one of the chat may go as
        soon as every earlier one is through as well, or this ticket's own wait has run out: a
        ticket released early never lets a later one overtake an earlier one. Idempotent."""
        if self._released:
            return
        self._released = True
        prev = self._prev
        loop = asyncio.get_running_loop()
        if prev is None or prev._done.done() or loop.time() >= self._deadline:
            self._complete()
            return
        prev._done.add_done_callback(self._prev_done)
        self._timer = loop.call_at(self._deadline, self._complete)

    def _prev_done(self, _: asyncio.Future[None]) -> None:
        self._complete()

    def _complete(self) -> None:
        if self._done.done():
            return
        self._done.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._prev = None  # no chain of finished tickets kept alive
        self._line._completed(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class ChatOrder:
    """The lines of one adapter, one per chat key."""

    def __init__(self, hold_s: float, log: logging.Logger | None = None) -> None:
        if not hold_s > 0:
            raise ValueError("hold_s must be positive")
        self.hold_s = hold_s
        self.log = log or logging.getLogger("plugins.inorder")
        self._tails: dict[Hashable, Ticket] = {}

    def ticket(self, key: Hashable) -> Ticket:
        """A place at the end of `key`'s line. Synchronous: take it before the handler's first await."""
        prev = self._tails.get(key)
        if prev is not None and prev.done:
            prev = None
        ticket = Ticket(self, key, prev)
        self._tails[key] = ticket
        return ticket

    def _completed(self, ticket: Ticket) -> None:
        if self._tails.get(ticket._key) is ticket:
            del self._tails[ticket._key]

    def __len__(self) -> int:
        """Chats with a ticket not yet through (for tests)."""
        return len(self._tails)
