"""HTTP plumbing shared by the upstream providers (`openai` and `anthropic` kinds): the pooled
client, timeouts, and the mapping of error answers and transport faults to ProviderError kinds.

Kept apart from any one provider so that a new kind imports the plumbing, not a sibling provider.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from appserver.config import ProviderConfig
from appserver.providers.base import ProviderError, error_from_status
from appserver.providers.fasttransport import LeanClient, LeanResponse, lean_transport, raw_headers
from appserver.providers.retry import parse_retry_after

_ERROR_BODY_MAX = 64 * 1024
_DECODED_PIECE = 1024 * 1024  # what one step of decompression may produce
_ZLIB_WBITS = {b"gzip": zlib.MAX_WBITS | 16, b"x-gzip": zlib.MAX_WBITS | 16, b"deflate": zlib.MAX_WBITS}


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


def content_encoding(response: LeanResponse | httpx.Response) -> bytes:
    """The answer's content-encoding, lower-cased (repeated fields joined as httpx joins them)."""
    return b", ".join(value.lower() for name, value in raw_headers(response) if name.lower() == b"content-encoding")


async def decoded_body(response: LeanResponse | httpx.Response) -> AsyncIterator[bytes]:
    """The answer's body, decoded, in pieces of at most 1 MiB.

    httpx decompresses each network read whole, so a few kilobytes of gzip can become gigabytes in
    one piece before anything can look at its size. gzip and deflate are decompressed here with
    zlib's own bound per step; any other encoding goes through httpx's decoders. Faults raise
    `httpx.DecodingError`, as httpx's would.
    """
    encoding = content_encoding(response)
    raw: AsyncIterator[bytes]
    if isinstance(response, LeanResponse):
        raw = response.stream.__aiter__()
    else:
        raw = response.aiter_raw()
    if encoding in (b"", b"identity"):
        async for part in raw:
            yield part
        return
    wbits = _ZLIB_WBITS.get(encoding)
    if wbits is None:
        async for part in (response.full() if isinstance(response, LeanResponse) else response).aiter_bytes():
            yield part
        return
    decoder: Any = None
    try:
        async for part in raw:
            if not part:
                continue
            if decoder is None:
                decoder = _zlib_decoder(wbits, part)
            data = decoder.decompress(part, _DECODED_PIECE)
            while True:
                if data:
                    yield data
                if not decoder.unconsumed_tail:
                    break
                data = decoder.decompress(decoder.unconsumed_tail, _DECODED_PIECE)
        rest = decoder.flush() if decoder is not None else b""
        if rest:
            yield rest
    except zlib.error as exc:
        raise httpx.DecodingError(f"cannot decode the {encoding.decode('latin-1')} body: {exc}") from None


def _zlib_decoder(wbits: int, first: bytes) -> Any:
    """A decompressor for `wbits`; `deflate` is meant with a zlib header, but some servers send it
    raw (httpx accepts both, so do we)."""
    if wbits == zlib.MAX_WBITS:
        try:
            zlib.decompressobj(wbits).decompress(first[:64])
        except zlib.error:
            return zlib.decompressobj(-zlib.MAX_WBITS)
    return zlib.decompressobj(wbits)


async def read_answer(response: LeanResponse | httpx.Response, limit: int) -> bytes:
    """The whole decoded body; ProviderError once it passes `limit` (a runaway or hostile upstream
    must not fill the server's memory)."""
    out = bytearray()
    async for part in decoded_body(response):
        out += part
        if len(out) > limit:
            raise ProviderError("protocol", f"upstream answer is larger than {limit} bytes")
    return bytes(out)


async def read_error_response(resp: httpx.Response | LeanResponse) -> ProviderError:
    """Turn a non-2xx upstream answer into a classified ProviderError (Retry-After honoured)."""
    raw = bytearray()
    try:
        async for part in decoded_body(resp):
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
