"""Watch: a front end's pinned, read-only view of one conversation's runtime.

While a watch is open the runtime is not evicted and its callback hears of every turn that
becomes visible (accepted, or resumed). The front end reads state through it and never touches
the runtime itself: the runtime stays the only owner of its turns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appserver.runtime.conversation import ConversationRuntime
    from appserver.runtime.handle import TurnHandle
    from appserver.runtime.types import LifecycleState


class Watch:
    def __init__(self, rt: ConversationRuntime, on_turn: Callable[[TurnHandle], None]) -> None:
        self._rt = rt
        self._on_turn = on_turn
        self._open = True
        rt.pins += 1
        rt.watchers.append(on_turn)

    @property
    def conversation_id(self) -> str:
        return self._rt.conversation_id

    @property
    def state(self) -> LifecycleState:
        return self._rt.lifecycle.state

    @property
    def active_handle(self) -> TurnHandle | None:
        return self._rt.active_handle

    @property
    def queued(self) -> int:
        return len(self._rt.queue)

    def handles(self) -> list[TurnHandle]:
        """The turns the runtime still remembers (live ones and a few recent settled ones)."""
        return list(self._rt.handles.values())

    def close(self) -> None:
        """Unpin and stop hearing of turns; closing twice is harmless."""
        if not self._open:
            return
        self._open = False
        self._rt.pins = max(0, self._rt.pins - 1)
        try:
            self._rt.watchers.remove(self._on_turn)
        except ValueError:
            pass

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
