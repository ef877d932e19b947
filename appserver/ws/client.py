"""A small async client of the `/ws` protocol (used by `appserver chat`, `appserver run` beside a
live server, and `examples/ws_client.py`).

    async with await ProtocolClient.connect("http://127.0.0.1:8770", token=None) as c:
        ack = await c.request({"type": "submit_input", "agent": "assistant", "input": "hi"})
        async for frame in c.frames():   # turn_updated, approval_request, tool_call_request, …
            ...

Replies (frames carrying the `request_id` of a request) resolve `request()`; an `error` reply raises
`ProtocolError`. Every other frame goes to `frames()` in arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed

from appserver.ws.frames import PROTOCOL_VERSION

TERMINAL = ("completed", "cancelled", "failed")


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class Closed(ProtocolError):
    pass


def ws_url(base: str) -> str:
    base = base.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base if base.endswith("/ws") else base + "/ws"


class ProtocolClient:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.welcome: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._frames: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.close_reason: str | None = None

    @classmethod
    async def connect(cls, url: str, *, token: str | None = None, client: str = "appserver-client", open_timeout: float = 10.0) -> ProtocolClient:
        token = token if token is not None else os.environ.get("APPSERVER_TOKEN") or None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        ws = await websockets.connect(ws_url(url), additional_headers=headers, open_timeout=open_timeout, max_size=None, ping_interval=20, ping_timeout=60)
        self = cls(ws)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.welcome = await self.request({"type": "hello", "protocol": PROTOCOL_VERSION, "client": client}, timeout=open_timeout)
        return self

    async def __aenter__(self) -> ProtocolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self.ws.close()
        finally:
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                rid = frame.get("request_id")
                fut = self._waiting.pop(rid, None) if rid else None
                if fut is not None and not fut.done():
                    fut.set_result(frame)
                else:
                    self._frames.put_nowait(frame)
        except ConnectionClosed as exc:
            self.close_reason = f"{exc.rcvd.code if exc.rcvd else 1006} {exc.rcvd.reason if exc.rcvd else ''}".strip()
        finally:
            if self.close_reason is None:
                rcvd = getattr(self.ws, "close_code", None)
                self.close_reason = f"{rcvd} {getattr(self.ws, 'close_reason', '') or ''}".strip()
            err = Closed("connection_closed", f"the server closed the connection ({self.close_reason})")
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(err)
            self._waiting.clear()
            self._frames.put_nowait(None)

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(frame))

    async def request(self, frame: dict[str, Any], *, timeout: float | None = 30.0) -> dict[str, Any]:
        """Send a frame and wait for its reply (matched by request_id); `error` raises ProtocolError."""
        rid = frame.get("request_id") or f"r{next(self._ids)}"
        frame = {**frame, "request_id": rid}
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if self._reader is not None and self._reader.done():
            raise Closed("connection_closed", f"the server closed the connection ({self.close_reason})")
        self._waiting[rid] = fut
        await self.send(frame)
        reply = await asyncio.wait_for(fut, timeout) if timeout else await fut
        if reply.get("type") == "error":
            raise ProtocolError(reply.get("code", "error"), reply.get("message", ""), reply.get("param"))
        return reply

    async def next_frame(self, timeout: float | None = None) -> dict[str, Any]:
        """The next unsolicited frame; raises Closed when the connection is gone."""
        frame = await asyncio.wait_for(self._frames.get(), timeout) if timeout else await self._frames.get()
        if frame is None:
            self._frames.put_nowait(None)
            raise Closed("connection_closed", f"the server closed the connection ({self.close_reason})")
        return frame

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            try:
                yield await self.next_frame()
            except Closed:
                return

    # ------------------------------------------------------------ conveniences

    async def submit(self, agent: str, text: str | list[dict[str, Any]], conversation: str = "default", **extra: Any) -> dict[str, Any]:
        return await self.request({"type": "submit_input", "agent": agent, "conversation": conversation, "input": text, **extra})

    async def wait_turn(self, turn_id: str, *, after_revision: int = -1, settled: bool = True, timeout: float | None = None, on_frame: Any = None) -> dict[str, Any]:
        """Read frames until the turn's snapshot is terminal (or awaiting, with `settled`); returns it."""

        async def go() -> dict[str, Any]:
            while True:
                frame = await self.next_frame()
                if on_frame is not None:
                    await on_frame(frame)
                if frame.get("type") != "turn_updated":
                    continue
                snap = frame["snapshot"]
                if snap["turn_id"] != turn_id or snap["revision"] <= after_revision:
                    continue
                if snap["status"] in TERMINAL or (settled and snap["status"] == "awaiting"):
                    return snap

        return await asyncio.wait_for(go(), timeout) if timeout else await go()
