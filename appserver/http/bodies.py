"""JSON request bodies of the OpenAI routes, with limits: anything the parser, a later encoder or
the store would choke on is a 400 here, before the route writes anything (appserver/strictjson.py),
and so is a `messages` / `input` array longer than `[limits] max_messages`.

Cost: a small body (the usual case) is parsed on the event loop as before. A body over
`OFFLOOP_BYTES` is parsed in a worker thread, one such parse at a time per server (the transient
memory of big parses never adds up across parallel requests), and when it could hold more objects
than `max_messages` justifies, the parser counts objects as it builds them and stops at the limit:
a request of 560k tiny messages is refused after building a few tens of thousands of objects,
instead of costing ~15 times its size and seconds of event-loop time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from appserver import strictjson
from appserver.http.errors import ApiError

OFFLOOP_BYTES = 256 * 1024
OBJECTS_PER_MESSAGE = 16  # content parts, tool calls and their functions, tool schemas: generous
LIST_KEYS = ("messages", "input")


def parse_json_body(raw: bytes, max_messages: int, *, object_limit: int | None = None) -> Any:
    """Parse and check a request body; raises `ApiError` 400."""
    try:
        data = strictjson.loads(raw, max_objects=object_limit, hint="; send fewer messages ([limits] max_messages)")
    except strictjson.JsonRejected as exc:
        raise ApiError(400, exc.about("the request body"), code=exc.code) from None
    if isinstance(data, dict):
        for key in LIST_KEYS:
            items = data.get(key)
            if isinstance(items, list) and len(items) > max_messages:
                raise ApiError(
                    400,
                    f"Invalid '{key}': array too long. Expected an array with maximum length {max_messages}, "
                    f"but got an array with length {len(items)} instead ([limits] max_messages).",
                    code="array_above_max_length",
                    param=key,
                )
    return data


class JsonBodies:
    """Body parsing for one server: its limits, and the one-at-a-time lane for big bodies."""

    def __init__(self, max_messages: int) -> None:
        self.max_messages = max_messages
        self.object_limit = max(4096, max_messages * OBJECTS_PER_MESSAGE)
        self._big: asyncio.Semaphore | None = None

    async def parse(self, raw: bytes) -> Any:
        if len(raw) <= OFFLOOP_BYTES:
            return parse_json_body(raw, self.max_messages)
        if self._big is None:
            self._big = asyncio.Semaphore(1)
        async with self._big:
            return await asyncio.to_thread(self._parse_big, raw)

    def _parse_big(self, raw: bytes) -> Any:
        # Counted before the parse (arrays and values too: a body of a million `[]` held the GIL,
        # and so the event loop, for most of a second even in this thread): strictjson.loads.
        return parse_json_body(raw, self.max_messages, object_limit=self.object_limit)


def json_bodies(request: Request) -> JsonBodies:
    """The app's `JsonBodies` (made by `build_app`; both OpenAI POST routes share it)."""
    bodies: JsonBodies = request.app.state.json_bodies
    return bodies
