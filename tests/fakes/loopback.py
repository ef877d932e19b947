"""The harness the loopback platform fakes share (fakechat, Telegram, Slack, Discord).

A `LoopbackServer` is a real HTTP (and WebSocket) server, starlette + uvicorn, on 127.0.0.1 and an ephemeral
port (or a given one), running its own event loop in a background daemon thread, so sync tests, async tests
and subprocesses can all talk to it. A fake subclasses it and supplies its routes:

    class FakeThing(LoopbackServer):
        _label = "fake thing"                        # in error messages ("fake thing: timed out after …")
        _thread_name = "fakething"

        def _routes(self) -> list[BaseRoute]:
            return [Route("/api/{method}", self._api, methods=["POST"])]

    with FakeThing() as thing:                       # start() … stop()
        requests.post(f"{thing.url}/api/x")
        thing.wait_for(lambda: thing.calls(), timeout=5, what="a call")

Hooks: `_on_loop_start()` runs on the server's loop before it serves (the base arms `self._wake`);
`_serve()` is the coroutine the thread runs (override to run tasks beside the server); `_before_stop()`
runs first in `stop()`, while the loop still runs. From any thread, `_notify()` wakes what waits on the
loop for news (via `_wake_all`, on the loop), `_call_soon(fn)` runs `fn` on the loop, and
`_run_on_loop(coro)` runs a coroutine there and waits for it (up to 5 s, errors swallowed).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Self, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.routing import BaseRoute

T = TypeVar("T")
M = TypeVar("M")

# uvicorn options of a fake that serves WebSockets (Slack's Socket Mode, Discord's gateway).
WEBSOCKET_OPTIONS: dict[str, Any] = {
    "timeout_graceful_shutdown": 1,
    "ws": "websockets-sansio",
    "ws_ping_interval": None,
}


class QuickServer(uvicorn.Server):
    """uvicorn, stopping in milliseconds instead of a few tenths of a second: a test sets
    `should_exit` (from any thread), and uvicorn looked at it every 0.1 s, then paused 0.1 s after
    asking the connections to close and polled every 0.1 s until they had. Here the main loop looks
    every few milliseconds (its once-a-tick work still runs every 0.1 s), and the stop waits for the
    connections as long as they need (at most `timeout_graceful_shutdown`), without the pause."""

    POLL_S = 0.005

    async def main_loop(self) -> None:
        counter, ticked = 0, time.monotonic()
        should_exit = await self.on_tick(counter)
        while not should_exit:
            await asyncio.sleep(self.POLL_S)
            if self.should_exit:
                break
            if time.monotonic() - ticked >= 0.1:
                counter, ticked = (counter + 1) % 864000, time.monotonic()
                should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            await asyncio.wait_for(self._drained(), timeout=self.config.timeout_graceful_shutdown)
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drained(self) -> None:
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:
            await asyncio.sleep(self.POLL_S)
        for listener in self.servers:
            await listener.wait_closed()


def first_match(
    items: Callable[[], Iterable[M]], predicate: str | Callable[[str], bool], text: Callable[[M], str]
) -> Callable[[], M | None]:
    """A `wait_for` condition: the first of `items()` whose `text` is `predicate` (or satisfies it), else None."""
    check: Callable[[str], bool] = (lambda t: t == predicate) if isinstance(predicate, str) else predicate
    return lambda: next((m for m in items() if check(text(m))), None)


class LoopbackServer:
    """A starlette app served by uvicorn on 127.0.0.1 in a background thread; a context manager."""

    _label: ClassVar[str] = "loopback server"
    _thread_name: ClassVar[str] = "loopback"
    _server_options: ClassVar[dict[str, Any]] = {"timeout_graceful_shutdown": 2}

    def __init__(self, *, port: int = 0) -> None:
        self._port = port  # the port to bind; 0 picks a free one
        # event-loop side (only touched on the server's loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    # ------------------------------------------------------------------ what a fake supplies

    def _routes(self) -> list[BaseRoute]:
        raise NotImplementedError

    def _on_loop_start(self) -> None:
        """On the server's loop, before it serves."""
        self._wake = asyncio.Event()

    async def _serve(self) -> None:
        assert self._server is not None and self._sock is not None
        await self._server.serve(sockets=[self._sock])

    def _before_stop(self) -> None:
        """First thing `stop()` does, while the server still runs."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self._port))
        app = Starlette(routes=self._routes())
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **self._server_options)
        self._server = QuickServer(config)
        started = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._on_loop_start()
            started.set()
            await self._serve()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name=self._thread_name, daemon=True)
        self._thread.start()
        started.wait(5)
        deadline = time.monotonic() + 5
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self._label} server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._before_stop()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._sock is not None, f"{self._label} not started"
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ waiting (any thread)

    def wait_for(self, condition: Callable[[], T | None], timeout: float = 5.0, what: str = "condition") -> T:
        """Poll `condition()` until truthy; return its value or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._label}: timed out after {timeout} s waiting for {what}")
            time.sleep(0.01)

    async def wait_for_async(
        self, condition: Callable[[], T | None], timeout: float = 5.0, what: str = "condition"
    ) -> T:
        """`wait_for` for a test whose event loop also runs the client (the sync one would block it)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._label}: timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ reaching the loop (any thread)

    def _call_soon(self, callback: Callable[[], object]) -> None:
        """Run `callback` on the server's loop (dropped when the loop is not running)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(callback)

    def _run_on_loop(self, coro: Any) -> None:
        """Run `coro` on the server's loop and wait for it (up to 5 s; its errors are swallowed)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            return
        with contextlib.suppress(Exception):  # e.g. a socket already gone
            asyncio.run_coroutine_threadsafe(coro, loop).result(5)

    def _notify(self) -> None:
        """Something changed: wake what waits on the loop for news."""
        self._call_soon(self._wake_all)

    def _wake_all(self) -> None:
        """On the loop: set the current wake event and arm a fresh one for the next waiters."""
        assert self._wake is not None
        self._wake.set()
        self._wake = asyncio.Event()
