"""How a refusal is answered: an OpenAI error object (the one shape, from http/errors.py) over
HTTP, or over the WebSocket upgrade when the server can answer it with HTTP, else a policy close."""

from __future__ import annotations

import asyncio
import json

from appserver.http.errors import error_body
from appserver.security.asgi import Receive, Refusal, Scope, Send

WS_CLOSE_POLICY = 1008
CONNECT_TIMEOUT_S = 5.0


def error_json(status: int, code: str, message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, content headers) of an OpenAI error answer."""
    body = json.dumps(error_body(status, message, code=code)).encode("utf-8")
    return body, [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]


async def send_http_error(send: Send, r: Refusal, extra: list[tuple[bytes, bytes]]) -> None:
    body, headers = error_json(r.status, r.code, r.message)
    await send(
        {
            "type": "http.response.start",
            "status": r.status,
            "headers": [*headers, *r.headers, *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def refuse_ws(scope: Scope, receive: Receive, send: Send, r: Refusal) -> None:
    try:
        first = await asyncio.wait_for(receive(), CONNECT_TIMEOUT_S)
    except (TimeoutError, OSError):
        return
    if first.get("type") != "websocket.connect":
        return
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body, headers = error_json(r.status, r.code, r.message)
        headers += [(k, v) for k, v in r.headers if k != b"connection"]
        await send({"type": "websocket.http.response.start", "status": r.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": WS_CLOSE_POLICY, "reason": r.code})
