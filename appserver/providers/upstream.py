"""HTTP plumbing shared by the upstream providers (`openai` and `anthropic` kinds): the pooled
client, timeouts, and the mapping of error answers and transport faults to ProviderError kinds.

Kept apart from any one provider so that a new kind imports the plumbing, not a sibling provider.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from appserver.config import ProviderConfig
from appserver.providers.base import ProviderError, error_from_status
from appserver.providers.fasttransport import LeanClient, lean_transport
from appserver.providers.retry import parse_retry_after

_ERROR_BODY_MAX = 64 * 1024


def as_dict(value: Any) -> dict[str, Any]:
    """Upstream JSON is untrusted: a field that should be an object but isn't counts as empty."""
    return value if isinstance(value, dict) else {}


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def error_message_from_body(body: Any, fallback: str) -> str:
    """Pull a human message out of the error shapes upstreams use (OpenAI, Ollama, FastAPI...)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            msg = err.get("message")
            if isinstance(msg, str) and msg:
                return msg
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            val = body.get(key)
            if isinstance(val, str) and val:
                return val
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return fallback


async def read_error_response(resp: httpx.Response) -> ProviderError:
    """Turn a non-2xx upstream answer into a classified ProviderError (Retry-After honoured)."""
    raw = bytearray()
    try:
        async for part in resp.aiter_bytes():
            raw += part
            if len(raw) >= _ERROR_BODY_MAX:
                break
    except httpx.HTTPError:
        pass  # the status alone still classifies the failure
    text = raw.decode("utf-8", errors="replace")
    body: Any
    try:
        body = json.loads(text) if text.strip() else None
    except ValueError:
        body = text
    message = error_message_from_body(body, f"upstream answered HTTP {resp.status_code}")
    return error_from_status(resp.status_code, message, body=body, retry_after_s=parse_retry_after(resp.headers))


def transport_error(exc: Exception) -> ProviderError:
    """httpx failures → ProviderError kinds (timeouts and network faults are retryable)."""
    if isinstance(exc, httpx.TimeoutException):
        return ProviderError("timeout", f"upstream timed out: {type(exc).__name__}")
    if isinstance(exc, httpx.DecodingError):
        return ProviderError("protocol", f"cannot decode upstream body: {exc}")
    detail = str(exc) or type(exc).__name__
    return ProviderError("network", f"upstream connection failed: {detail}")


def default_client(cfg: ProviderConfig) -> httpx.AsyncClient:
    """One pooled keep-alive client per provider, on the lean transport (providers/fasttransport.py)
    unless the provider's config asks for httpx's own (`transport = "httpx"`)."""
    # At most `max_connections` calls in flight (httpx's default was 100: the 101st concurrent
    # stream waited for a whole generation); the others wait for a slot up to the read timeout.
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    if cfg.transport == "httpx":
        return httpx.AsyncClient(timeout=request_timeout(cfg), limits=limits)
    return LeanClient(timeout=request_timeout(cfg), limits=limits, transport=lean_transport(cfg.max_connections))


def request_timeout(cfg: ProviderConfig) -> httpx.Timeout:
    """Read timeout is between bytes, so long generations are fine; connect fails fast."""
    return httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
