"""The two errors a protocol client raises: the server refused a frame, or the connection is gone."""

from __future__ import annotations


class ProtocolError(Exception):
    """An `error` frame from the server (or the client's own refusal), with its protocol code."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class Closed(ProtocolError):
    """The connection is gone for good (or was lost before a reply that is unsafe to re-send)."""
