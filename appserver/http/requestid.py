"""Request ids: one per HTTP request or WebSocket upgrade, in the `x-request-id` response header and
in every log line written while that request is handled.

The id is always generated here (`req_` + 24 hex digits), never taken from the client: an incoming
`X-Request-Id` could repeat or imitate another request's id and so mislead whoever reads the logs.
A proxy that has its own id correlates by logging ours (the response header) next to it.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from appserver.http.errors import new_request_id

HEADER = b"x-request-id"

# Per task (asyncio copies the context into each task), not process-wide state.
_CURRENT: ContextVar[str | None] = ContextVar("appserver_request_id", default=None)


def current_request_id() -> str | None:
    return _CURRENT.get()


def begin_request() -> tuple[str, Any]:
    """A new id, made current for this task: → (id, token for `end_request`)."""
    rid = new_request_id()
    return rid, _CURRENT.set(rid)


def end_request(token: Any) -> None:
    _CURRENT.reset(token)


class RequestIdFilter(logging.Filter):
    """On log handlers: prefix the message of a record logged while a request is handled with
    `[req_…]`, once even when several handlers share the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            rid = _CURRENT.get()
            record.request_id = rid or ""
            if rid and isinstance(record.msg, str):
                record.msg = f"[{rid}] {record.msg}"
        return True


def install(logger_names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "uvicorn.access")) -> RequestIdFilter:
    """Attach one `RequestIdFilter` to every handler of the named loggers (root = "")."""
    flt = RequestIdFilter()
    for name in logger_names:
        for handler in logging.getLogger(name or None).handlers:
            if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
                handler.addFilter(flt)
    return flt
