"""A Server-Sent Events response: a producer of `data:` payloads, keepalive comments, disconnect → callback.

The producer is an async iterator of strings (each one `data:` payload), `(event, data)` pairs
(the event is sent as an `event:` line first, as OpenAI's Responses streams do: EventSource-style
clients dispatch on it) or None (nothing new: the response sends a keepalive comment). A client
disconnect stops the producer and calls `on_disconnect` (the OpenAI routes cancel the turn the
request started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from appserver import fastjson
from appserver.store.base import StoreUnavailable

log = logging.getLogger("appserver.http.sse")

KEEPALIVE = b": keepalive\n\n"

WRITE_BODY = "appserver.write_body"
"""The ASGI scope extension under which the edge's HTTP protocol offers `write_body(bytes) -> bool`:
a piece of the streamed body written now, as `send` would, when the connection takes it as it is
(security/edge.py `EdgeHttpProtocol.write_body`); False: nothing was written."""


# JSON allows these raw inside strings, but line readers (httpx `iter_lines`, Python's
# `str.splitlines`) break lines at them and would cut a `data:` payload in two: escape them.
_LINE_BREAKS = ("\x85", "\u2028", "\u2029")
_ESCAPE_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in _LINE_BREAKS})


def line_safe(text: str) -> str:
    """JSON text with no character a line reader would split at (ASCII text, the common case, has
    none: one check; else three scans)."""
    if text.isascii():
        return text
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_ESCAPE_LINE_BREAKS)
    return text


def sse_data(payload: Any) -> str:
    return payload if isinstance(payload, str) else line_safe(fastjson.dumps(payload))


SSEItem = str | tuple[str, str] | None


class DirectWrites:
    """A producer's way to write a frame itself (`SSEResponse(direct=…)`): while the body streams
    on a connection that offers WRITE_BODY, `write_now(item)` writes one `data:` frame at once,
    from outside the pump, and says whether it did (else it is None, or returns False: yield the
    item instead). Only for a producer waiting for its next item (everything it yielded is
    written): a token shown by the turn's own task as it arrives (http/chat.py), with no wake-up
    of the stream's. Apart from the response, so a producer that holds it makes no reference
    cycle with the response that holds the producer."""

    __slots__ = ("write_now",)

    def __init__(self) -> None:
        self.write_now: Callable[[str], bool] | None = None


def sse_frame(item: str | tuple[str, str]) -> str:
    """One SSE frame: `data: …` alone, or `event: NAME` then `data: …` for an (event, data) pair."""
    if isinstance(item, tuple):
        return f"event: {item[0]}\ndata: {item[1]}\n\n"
    return f"data: {item}\n\n"


class SSEResponse:
    def __init__(
        self,
        producer: AsyncIterator[SSEItem],
        *,
        headers: dict[str, str] | None = None,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        on_close: Callable[[bool, list[str]], Awaitable[None]] | None = None,
        direct: DirectWrites | None = None,
    ) -> None:
        self.producer = producer
        self.headers = headers or {}
        self.on_disconnect = on_disconnect
        self.on_close = on_close  # (completed, frames sent) — for idempotent replay
        self.sent: list[str] = []
        self.direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *[(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()],
        ]

        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        completed = False

        async def pump() -> None:
            nonlocal completed
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            # The body goes straight to the server once the head passed the middleware (see
            # security/guard.py: they act on the head only).
            body_send: Send = (scope.get("state") or {}).get("body_send") or send
            keep, sent = self.on_close is not None, self.sent  # frames kept only for a replay
            direct = self.direct
            write_body: Callable[[bytes], bool] | None = (scope.get("extensions") or {}).get(WRITE_BODY)
            if direct is not None and write_body is not None:

                def write_now(item: str) -> bool:
                    frame = f"data: {item}\n\n"
                    if not write_body(frame.encode()):
                        return False
                    if keep:
                        sent.append(frame)
                    return True

                direct.write_now = write_now
            async for item in self.producer:
                if item is None:
                    chunk = KEEPALIVE
                else:
                    frame = sse_frame(item)
                    if keep:
                        sent.append(frame)
                    chunk = frame.encode()
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            if direct is not None:
                direct.write_now = None
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True

        listener = asyncio.create_task(listen())
        pumper = asyncio.create_task(pump())
        try:
            done, _ = await asyncio.wait({listener, pumper}, return_when=asyncio.FIRST_COMPLETED)
            if pumper in done and not pumper.cancelled():
                exc = pumper.exception()
                if isinstance(exc, StoreUnavailable):  # the store's doing (a full disk): one line
                    log.warning("SSE producer failed: %s", exc)
                elif exc is not None and not isinstance(exc, OSError):
                    log.error("SSE producer failed", exc_info=exc)
        finally:
            if self.direct is not None:
                self.direct.write_now = None
            disconnected = not completed
            for task in (listener, pumper):
                task.cancel()
            for task in (listener, pumper):
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(BaseException):
                await self.producer.aclose()  # type: ignore[attr-defined]
            if disconnected and self.on_disconnect is not None:
                try:
                    await self.on_disconnect()
                except Exception:
                    log.exception("disconnect handler failed")
            if self.on_close is not None:
                try:
                    await self.on_close(completed, list(self.sent))
                except StoreUnavailable as exc:
                    log.warning("stream close handler failed: %s", exc)
                except Exception:
                    log.exception("stream close handler failed")
