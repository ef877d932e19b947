"""Kernel errors with stable codes. Front ends map codes to HTTP statuses and protocol error frames."""

from __future__ import annotations


class KernelError(Exception):
    code = "internal_error"
    http_status = 500

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class NotFound(KernelError):
    code = "not_found"
    http_status = 404


class AgentGone(NotFound):
    """The agent was deleted between the lookup of a request and the accept of its input."""

    code = "agent_not_found"


class InvalidInput(KernelError):
    code = "invalid_request"
    http_status = 400


class Conflict(KernelError):
    code = "conflict"
    http_status = 409


class QueueFull(KernelError):
    code = "queue_full"
    http_status = 429


class Unavailable(KernelError):
    """This server cannot take the request now; another can (a cluster's survivor)."""

    code = "server_unavailable"
    http_status = 503


class NotAwaiting(Conflict):
    code = "not_awaiting"
