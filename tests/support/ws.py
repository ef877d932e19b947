"""Helpers for the /ws tests: a thin frame-level wrapper over the `websockets` client."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websockets

TERMINAL = ("completed", "cancelled", "failed")


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://", 1) + "/ws"


class WS:
    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.seen: list[dict[str, Any]] = []
        self._n = 0

    @classmethod
    async def open(cls, http_url: str, *, hello: bool = True, headers: dict[str, str] | None = None, **kw: Any) -> WS:
        # A test that leaves a socket's frames unread past the client's queue limit never reads the
        # server's close frame either: its close() would wait out the default 10 s close_timeout.
        kw.setdefault("close_timeout", 1)
        conn = await websockets.connect(ws_url(http_url), additional_headers=headers, max_size=None, **kw)
        self = cls(conn)
        if hello:
            welcome = await self.request({"type": "hello", "protocol": 1, "client": "test"})
            assert welcome["type"] == "welcome", welcome
        return self

    async def close(self) -> None:
        await self.conn.close()

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.conn.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = 10) -> dict[str, Any]:
        frame = json.loads(await asyncio.wait_for(self.conn.recv(), timeout))
        self.seen.append(frame)
        return frame

    async def expect(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 10) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            frame = await self.recv(max(0.01, deadline - loop.time()))
            if pred(frame):
                return frame

    async def request(self, frame: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
        self._n += 1
        rid = f"t{self._n}"
        await self.send({**frame, "request_id": rid})
        return await self.expect(lambda f: f.get("request_id") == rid, timeout)

    async def terminal(self, turn_id: str, timeout: float = 20) -> dict[str, Any]:
        """The turn's terminal snapshot, whether it already arrived (while another `expect` was
        waiting for a different frame) or is still to come."""

        def is_terminal(f: dict[str, Any]) -> bool:
            return (
                f["type"] == "turn_updated"
                and f["snapshot"]["turn_id"] == turn_id
                and f["snapshot"]["status"] in TERMINAL
            )

        for f in self.seen:
            if is_terminal(f):
                return f["snapshot"]
        frame = await self.expect(is_terminal, timeout)
        return frame["snapshot"]

    async def drain(self, quiet: float = 0.3) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(await self.recv(quiet))
            except TimeoutError:
                return out

    def snapshots(self, turn_id: str) -> list[dict[str, Any]]:
        return [f["snapshot"] for f in self.seen if f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn_id]


def db_messages(home: Path, conversation_id: str) -> list[tuple[str, str, str]]:
    with sqlite3.connect(home / "appserver.db") as c:
        rows = c.execute(
            "SELECT role, content, completion_status FROM messages WHERE conversation_id=? ORDER BY id",
            (conversation_id,),
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]
