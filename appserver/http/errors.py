"""OpenAI error objects (`ErrorResponse`) for the OpenAI-compatible routes."""

from __future__ import annotations

import secrets
from typing import Any

from starlette.responses import JSONResponse

from appserver.errors import AgentGone, KernelError
from appserver.shown import capped_message, clipped

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "invalid_request_error",  # a transfer coding the client applied and this server does not undo
}


# The OpenAI SDKs retry every 409 unless told not to. Only these conflicts can clear by waiting
# (another request holds what this one needs); every other 409 answers the same on a retry.
RETRYABLE_CONFLICTS = frozenset({"idempotency_key_in_progress", "previous_response_in_progress", "already_resolving"})


class ApiError(Exception):
    """Raised inside a route; rendered as an OpenAI error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers) if headers else {}
        if status == 409 and code not in RETRYABLE_CONFLICTS:
            self.headers.setdefault("x-should-retry", "false")


# A `param` is a field's path (`input[0].content[1].text`): one that holds a client's key (an
# unknown one, a `logit_bias` token id) is cut as a message is, so a megabyte key is no megabyte param.
PARAM_MAX = 256


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The error object every OpenAI route answers with: its message and its `param` capped, so a
    client's megabyte never comes back whole (nor into a log that keeps error bodies)."""
    return {
        "error": {
            "message": capped_message(message),
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": None if param is None else clipped(param, PARAM_MAX),
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code, param=param), status_code=status, headers=headers)


def from_kernel(exc: KernelError) -> ApiError:
    if isinstance(exc, AgentGone):  # deleted while the request ran: that model is gone
        return agent_deleted()
    return ApiError(exc.http_status, exc.message, code=exc.code, param=exc.param)


def agent_deleted() -> ApiError:
    """A request whose agent was deleted while it ran: that model does not exist, as the next
    request for it hears."""
    return ApiError(404, "The model's agent was deleted while this request ran.", code="model_not_found", param="model")


# A failed turn's provider error → (HTTP status, OpenAI error code). The turn already ran (and the
# server already retried what was worth retrying), so a client retry would submit the input again:
# every such answer carries `x-should-retry: false`, which the OpenAI SDKs honour.
PROVIDER_FAILURES: dict[str, tuple[int, str]] = {
    "context_overflow": (400, "context_length_exceeded"),
    "rate_limit": (429, "upstream_rate_limited"),
    "quota": (429, "insufficient_quota"),
    "auth": (502, "upstream_auth_failed"),
    "not_found": (502, "upstream_model_not_found"),
    "invalid_request": (400, "upstream_invalid_request"),  # the request's own fault: relayed as a 400
    "timeout": (504, "upstream_timeout"),
    "network": (502, "upstream_unreachable"),
    "server": (502, "upstream_server_error"),
    "protocol": (502, "upstream_protocol_error"),
    "taken_over": (503, "server_unavailable"),  # not upstream: a cluster's survivor has the conversation now
    "store_unavailable": (503, "store_unavailable"),  # not upstream: the database ended the connection
    "interrupted": (503, "turn_interrupted"),  # not upstream: the server running the turn stopped
}


def turn_failure(error: dict[str, Any] | None) -> ApiError:
    """The OpenAI error for a turn that failed: upstream trouble is named, our own is a 500."""
    err = error or {}
    kind = str(err.get("kind") or "internal")
    status, code = PROVIDER_FAILURES.get(kind, (500, "internal_error"))
    if err.get("input_saved"):  # its input was saved, its reply refused (a full disk): runtime/finish.py
        status, code = 503, "store_unavailable"
    detail = f" (upstream HTTP {err['status']})" if err.get("status") else ""
    return ApiError(
        status,
        f"the agent's turn failed: {err.get('message') or 'unknown error'}{detail}",
        code=code,
        headers={"x-should-retry": "false"},
    )


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)
