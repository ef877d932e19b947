"""A server that stops answers the OpenAI requests still waiting with an OpenAI error, never a cut.

uvicorn's graceful stop waits for the requests in flight, then cancels the rest: a cancelled route
was answered with uvicorn's plain-text "Internal Server Error" (or a stream cut mid-body). `serve`
calls `Stopping.stop()` when its graceful wait is over and before uvicorn cancels anything: each
request waiting in a section guarded here (a whole API route handler, a stream's wait for the next
snapshot) is cancelled by it, and the guard turns that cancellation into the answer — a 503
`server_shutting_down` error object, or a stream's own terminal error event (DESIGN §5). The turn
behind it is not touched here: the kernel's stop, which runs next, settles a running turn as
interrupted (its text so far kept), and a turn paused for an approval stays paused in the store.
"""

from __future__ import annotations

import asyncio
from typing import Any

from appserver.http.errors import ApiError

CODE = "server_shutting_down"
MESSAGE = (
    "The server is shutting down; this request was stopped before it completed (what its turn "
    "produced so far is kept in the conversation). Retry once the server is back."
)
# The turn behind the request may have run in part (its input is in the conversation): the SDKs
# must not resend it on their own, as for a failed turn (errors.turn_failure).
HEADERS = {"x-should-retry": "false"}


def shutting_down() -> ApiError:
    """The error a request stopped by the server's stop answers with (503, type `server_error`)."""
    return ApiError(503, MESSAGE, code=CODE, headers=dict(HEADERS))


class Stopping:
    """The tasks waiting in a guarded section, and the ones `stop` (or `end`) cancelled."""

    __slots__ = ("_waiting", "_cancelled", "_ended", "stopped")

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[Any]] = set()
        self._cancelled: set[asyncio.Task[Any]] = set()
        self._ended: dict[asyncio.Task[Any], ApiError] = {}  # one request ended early, and why
        self.stopped = False

    def end(self, task: asyncio.Task[Any], error: ApiError) -> None:
        """End one request early (its credential ended: http/credential_end.py), as `stop` ends
        them all: cancelled now if it waits in a guarded section, else its next guard sees it
        (`ended`). The caller says `forget` once the request is over."""
        self._ended[task] = error
        if task in self._waiting and task not in self._cancelled and not task.done():
            self._cancelled.add(task)
            task.cancel(error.code)

    def ended(self, task: asyncio.Task[Any] | None) -> ApiError | None:
        """Why `end` ended this request, or None."""
        return self._ended.get(task) if task is not None and self._ended else None

    def forget(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._ended.pop(task, None)

    def enter(self, task: asyncio.Task[Any] | None = None) -> asyncio.Task[Any] | None:
        """The current task (`task`, when the caller already knows it: a stream enters once per
        snapshot) enters a guarded section (a guard checks `stopped` first: once the stop came, it
        answers at once instead of entering)."""
        if task is None:
            task = asyncio.current_task()
        if task is not None:
            self._waiting.add(task)
        return task

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._waiting.discard(task)

    def caught(self, task: asyncio.Task[Any] | None) -> bool:
        """In `except CancelledError` of a guarded section: True when the cancellation is this
        stop's; the task is then uncancelled, and the caller answers with the stop's error.
        False for any other cancellation (a client gone, uvicorn's own), which goes on."""
        if task is None or task not in self._cancelled:
            return False
        self._cancelled.discard(task)
        task.uncancel()
        return True

    def stop(self) -> int:
        """Stop every request waiting in a guarded section (guards check `stopped` before they
        enter one); returns how many were waiting."""
        self.stopped = True
        waiting = [t for t in self._waiting if not t.done() and t not in self._cancelled]
        for task in waiting:
            self._cancelled.add(task)
            task.cancel(CODE)
        return len(waiting)
