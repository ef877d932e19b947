"""HTTP plumbing shared by the upstream providers (`openai` and `anthropic` kinds): the pooled
client, timeouts, and the mapping of error answers and transport faults to ProviderError kinds.

Kept apart from any one provider so that a new kind imports the plumbing, not a sibling provider.
"""

from __future__ import annotations

import asyncio
import re
import sys
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from appserver.client.auth import shown_url
from appserver.config import Config, ProviderConfig, api_key_problem, describe_char, header_text_problem
from appserver.logredact import SecretRedactor, provider_secrets
from appserver.providers.base import ProviderError, error_from_status
from appserver.providers.fasttransport import (
    LeanClient,
    LeanResponse,
    ResponseHeadTooLarge,
    UnusableProxy,
    env_proxy_mounts,
    lean_transport,
    raw_headers,
)
from appserver.providers.jsontext import loads
from appserver.providers.retry import parse_retry_after

_ERROR_BODY_MAX = 64 * 1024
_DECODED_PIECE = 1024 * 1024  # what one step of decompression may produce
_ZLIB_WBITS = {b"gzip": zlib.MAX_WBITS | 16, b"x-gzip": zlib.MAX_WBITS | 16, b"deflate": zlib.MAX_WBITS}
_CODINGS_MAX = 4  # content codings applied one over another (servers apply one; a proxy may add one)
# What the providers offer (sent on every request, whatever httpx would add when brotli or
# zstandard is installed): the codings `decoded_body` undoes in bounded steps.
ACCEPT_ENCODING = "gzip, deflate"


def as_dict(value: Any) -> dict[str, Any]:
    """Upstream JSON is untrusted: a field that should be an object but isn't counts as empty."""
    return value if isinstance(value, dict) else {}


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, `…` where it was cut. A cut never keeps part of a word:
    the run of non-space characters it falls in is dropped whole, so a secret there (a key, a
    token, in any encoding) is either kept whole, for the redactor (which matches whole secrets
    only), or not at all; never a prefix of it that no redactor would recognise."""
    if len(text) <= limit:
        return text
    kept = text[: limit - 1]
    if not text[limit - 1].isspace():
        kept = re.sub(r"\S+\Z", "", kept)  # the cut fell inside a word: drop the word
    return kept.rstrip() + "…"


def error_message_from_body(body: Any, fallback: str) -> str:
    """Pull a human message out of the error shapes upstreams use (OpenAI, Ollama, FastAPI...); a
    text body is clipped (`clip`) to 500 characters, or the fallback when nothing of it is left. A
    list of errors (Gemini's `[{"error": {...}}]`) is read by its first."""
    if isinstance(body, list) and body and isinstance(body[0], dict):
        body = body[0]
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
        said = clip(body.strip(), 500)
        return said if said != "…" else fallback
    return fallback


def content_encoding(response: LeanResponse | httpx.Response) -> bytes:
    """The answer's content-encoding, lower-cased (repeated fields joined as httpx joins them)."""
    return b", ".join(value.lower() for name, value in raw_headers(response) if name.lower() == b"content-encoding")


def content_codings(encoding: bytes) -> list[bytes]:
    """The codings of a (lower-cased) content-encoding value, in the order to undo them: the last
    one applied first. `identity` adds none. A coding we cannot decode in bounded steps (one we did
    not offer: br, zstd, compress, anything unknown) raises `httpx.DecodingError`."""
    codings: list[bytes] = []
    for token in encoding.split(b","):
        coding = token.strip()
        if not coding or coding == b"identity":
            continue
        if coding not in _ZLIB_WBITS:
            name = clip(coding.decode("latin-1"), 40)
            raise httpx.DecodingError(
                f"the upstream answered with content-encoding {name!r}, which was not offered "
                f"(Accept-Encoding: {ACCEPT_ENCODING})"
            )
        codings.append(coding)
    if len(codings) > _CODINGS_MAX:
        raise httpx.DecodingError(f"the upstream applied {len(codings)} content codings (at most {_CODINGS_MAX})")
    codings.reverse()
    return codings


async def decoded_body(response: LeanResponse | httpx.Response) -> AsyncIterator[bytes]:
    """The answer's body, decoded, in pieces of at most 1 MiB.

    httpx decompresses each network read whole, so a few kilobytes of gzip can become gigabytes in
    one piece before anything can look at its size. Every coding of the chain (gzip, x-gzip,
    deflate; `gzip, gzip` is two) is undone here by zlib with a bound on each step, so no stage
    holds more than a piece at a time; the encoded body is never handed to httpx's decoders.
    Faults, and codings other than those, raise `httpx.DecodingError`, as httpx's would.
    """
    encoding = content_encoding(response)
    raw: AsyncIterator[bytes]
    if isinstance(response, LeanResponse):
        raw = response.stream.__aiter__()
    else:
        raw = response.aiter_raw()
    stages = [_Inflater(coding) for coding in content_codings(encoding)]
    if not stages:  # none, `identity`, `identity, identity`
        async for part in raw:
            yield part
        return
    try:
        async for part in raw:
            for piece in _through(stages, 0, part):
                yield piece
        for i, stage in enumerate(stages):  # each stage's last output still goes through the rest
            for rest in stage.flush():
                for piece in _through(stages, i + 1, rest):
                    yield piece
    except zlib.error as exc:
        raise httpx.DecodingError(f"cannot decode the {clip(encoding.decode('latin-1'), 80)} body: {exc}") from None


def _through(stages: list[_Inflater], i: int, data: bytes) -> Iterator[bytes]:
    """`data` decoded by stages[i:], piece by piece (each stage steps at most 1 MiB at a time)."""
    if i == len(stages):
        yield data
        return
    for piece in stages[i].feed(data):
        yield from _through(stages, i + 1, piece)


class _Inflater:
    """One gzip or deflate stage: decoded output in pieces of at most `_DECODED_PIECE`. Bytes after
    the end of the compressed data are dropped (tolerated, as httpx does, but not kept: zlib
    would hold them all in `unused_data`)."""

    __slots__ = ("_wbits", "_zobj", "_head")

    def __init__(self, coding: bytes) -> None:
        self._wbits = _ZLIB_WBITS[coding]
        self._zobj: Any = None if self._wbits == zlib.MAX_WBITS else zlib.decompressobj(self._wbits)
        self._head = b""  # deflate: the first bytes, until there are enough to tell zlib from raw

    def feed(self, data: bytes) -> Iterator[bytes]:
        z = self._zobj
        if z is None:
            data = self._head + data
            if len(data) < _DEFLATE_SNIFF:
                self._head = data
                return
            self._head = b""
            z = self._zobj = _zlib_decoder(self._wbits, data)
        if z.eof or not data:
            return
        out = z.decompress(data, _DECODED_PIECE)
        while True:
            if out:
                yield out
            tail = z.unconsumed_tail
            if not tail or z.eof:
                return
            out = z.decompress(tail, _DECODED_PIECE)

    def flush(self) -> Iterator[bytes]:
        if self._zobj is None:  # a deflate body shorter than the sniff: decide on what came
            if not self._head:
                return
            head, self._head = self._head, b""
            self._zobj = _zlib_decoder(self._wbits, head)
            yield from self.feed(head)
        z = self._zobj
        if not z.eof:
            rest = z.flush()  # every input is consumed already: what zlib still holds (a few bytes)
            if rest:
                yield rest


# zlib's header is 2 bytes, and zlib rejects a wrong one on those alone: a first piece of 1 byte
# cannot tell zlib from raw deflate (it passed as zlib, and the raw stream then failed).
_DEFLATE_SNIFF = 2


def _zlib_decoder(wbits: int, first: bytes) -> Any:
    """A decompressor for `wbits`; `deflate` is meant with a zlib header, but some servers send it
    raw (httpx accepts both, so do we). `first`: at least `_DEFLATE_SNIFF` bytes, unless that is
    the whole body."""
    if wbits == zlib.MAX_WBITS:
        try:
            zlib.decompressobj(wbits).decompress(first[:64])
        except zlib.error:
            return zlib.decompressobj(-zlib.MAX_WBITS)
    return zlib.decompressobj(wbits)


async def read_answer(response: LeanResponse | httpx.Response, limit: int) -> bytearray:
    """The whole decoded body; ProviderError once it passes `limit` (a runaway or hostile upstream
    must not fill the server's memory). The buffer itself, not a `bytes` copy of it: the JSON
    parsers read either, and an answer near the limit was held twice."""
    out = bytearray()
    async for part in decoded_body(response):
        out += part
        if len(out) > limit:
            raise ProviderError("protocol", f"upstream answer is larger than {limit} bytes")
    return out


# How long the rest of a body is read after the answer's own end (`[DONE]`, `message_stop`), as the
# OpenAI SDK does: a body read to its end lets the connection serve the next call; one the upstream
# holds open past this (a proxy that keeps the stream, keep-alive comments) is dropped, never pooled.
DRAIN_AFTER_END_S = 0.1


async def drain_rest(parts: AsyncIterator[bytes], limit_s: float = DRAIN_AFTER_END_S) -> None:
    """Read and drop what is left of a body whose answer already ended, for at most `limit_s`. The
    answer does not wait on the upstream: a body that has not ended by then is left unread, and
    its connection is closed when the response is (neither transport pools an unfinished body).
    A fault of the transport here is no fault of the answer, which is whole."""
    try:
        async with asyncio.timeout(limit_s):
            async for _ in parts:
                await asyncio.sleep(0)  # pieces ready at once (a decoder's) must not outrun the limit
    except (TimeoutError, httpx.HTTPError):
        pass


# How long a body may go without an event once its answer has a finish reason (`finish_reason`,
# Anthropic's `stop_reason`) but not its end (`[DONE]`, `message_stop`). What may still come is a
# usage chunk and the end, which upstreams send in the same write as the finish or milliseconds
# after it; 5 s leaves a loaded proxy room, and an upstream that stalls there costs the answer a
# few seconds instead of failing it at `timeout_s` (300 s by default).
FINISH_GRACE_S = 5.0


def finish_grace_s(cfg: ProviderConfig) -> float:
    """`FINISH_GRACE_S`, or half of the provider's read timeout if that is less: the grace must run
    out before the read timeout would fail the finished answer."""
    return min(FINISH_GRACE_S, cfg.timeout_s / 2)


class AfterFinish:
    """The rest of a streamed body whose answer already has its finish reason: its pieces until
    the body ends, or until `grace_s` pass without a new event (`events()`, the parser's count; a
    comment or part of a line does not count). A body that goes quiet there ends as one that
    closed would (`quiet` then says so): the answer is whole, and is not held until the read
    timeout fails it. A new event restarts the grace (an upstream that repeats its finish reason
    on every chunk still streams its whole answer)."""

    __slots__ = ("_parts", "_grace_s", "quiet")

    def __init__(self, parts: AsyncIterator[bytes], grace_s: float) -> None:
        self._parts = parts
        self._grace_s = grace_s
        self.quiet = False

    async def pieces(self, events: Callable[[], int]) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        seen = events()
        deadline = loop.time() + self._grace_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    part = await anext(self._parts, None)
            except TimeoutError:
                # The read was cancelled mid-body: its connection is closed with the response,
                # never pooled (as `drain_rest` leaves it).
                self.quiet = True
                return
            if part is None:
                return
            yield part
            if events() != seen:
                seen = events()
                deadline = loop.time() + self._grace_s


def endpoint_url(base_url: str, path: str, *, unless_ends: str = "") -> str:
    """`path` appended to `base_url`'s path, before any query string (`?api-version=…`, `?api-key=…`
    for gateways that take them) and without a doubled slash; `unless_ends` is a path suffix the
    base may already carry (`/v1`), and then is not added twice."""
    parts = urlsplit(base_url)
    base = parts.path.rstrip("/")
    if unless_ends and base.endswith(unless_ends) and path.startswith(unless_ends + "/"):
        path = path[len(unless_ends) :]
    return urlunsplit(parts._replace(path=base + path, fragment=""))


def utf8_size(text: str) -> int:
    """`text`'s size in UTF-8 bytes (ASCII: its length, which CPython knows without a scan)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


# What one tool call or content block adds to a stored answer besides its text: charged against
# answer_max_bytes, so a model looping on empty calls or blocks is stopped as one looping on text is.
ITEM_BYTES = 32


class AnswerBudget:
    """What a streamed answer may still add under `answer_max_bytes` (None: no limit), in UTF-8
    bytes as its strings decode; past it `answer_too_large`, before the event's content is handed
    out. One per model call, shared by the stream parsers of every kind."""

    __slots__ = ("left", "limit", "provider")

    def __init__(self, limit: int | None, provider: str) -> None:
        self.limit = sys.maxsize if limit is None else limit
        self.left = self.limit
        self.provider = provider

    def count(self, text: str) -> None:
        """Charge `text` to the answer."""
        self.charge(utf8_size(text))

    def charge(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise answer_too_large(self.provider, self.limit)


def answer_too_large(provider: str, limit: int) -> ProviderError:
    """The error of a streamed answer whose text, reasoning and tool-call arguments together passed
    `answer_max_bytes` (a model looping without a `max_tokens`): a protocol error like the other
    answer size limits (not retried, HTTP 502); the text shown so far is kept, marked incomplete."""
    where = f"[providers.{provider}] answer_max_bytes" if provider else "the provider's answer_max_bytes"
    return ProviderError(
        "protocol",
        f"the model's answer passed answer_max_bytes ({limit} bytes of text, reasoning and tool-call "
        f"arguments) and was stopped: raise {where} or give the agent a max_tokens",
    )


def sent_secrets_redactor(cfg: ProviderConfig) -> Callable[[str], str]:
    """What masks the secrets this provider sends upstream (its API key, its headers' values, what
    its `base_url` carries: `logredact.provider_secrets`) in every form an upstream may quote them,
    as the agent loop's redactor does. An error answer is redacted with it whole, before any part of
    it is cut for a message: a cut copy of a secret is no longer one the loop could recognise."""
    return SecretRedactor(secrets=provider_secrets(Config(home=Path(), providers={cfg.name: cfg}))).redact


async def read_error_response(
    resp: httpx.Response | LeanResponse, redact: Callable[[str], str] | None = None
) -> ProviderError:
    """Turn a non-2xx upstream answer into a classified ProviderError (Retry-After honoured); its
    text redacted with `redact` (`sent_secrets_redactor`) before it is parsed or clipped."""
    raw = bytearray()
    try:
        async for part in decoded_body(resp):
            raw += part
            if len(raw) >= _ERROR_BODY_MAX:
                break
    except httpx.HTTPError:
        pass  # the status alone still classifies the failure
    text = raw.decode("utf-8", errors="replace")
    if redact is not None:
        text = redact(text)
    body: Any
    try:
        body = loads(text) if text.strip() else None  # lone surrogates as U+FFFD (jsontext.py)
    except ValueError:
        body = text
    message = error_message_from_body(body, f"upstream answered HTTP {resp.status_code}")
    return error_from_status(resp.status_code, message, body=body, retry_after_s=parse_retry_after(resp.headers))


async def check_answer_status(response: httpx.Response | LeanResponse, cfg: ProviderConfig, url: str) -> None:
    """Raise the ProviderError of an answer that is not a 2xx: an error answer (4xx, 5xx) classified
    by `read_error_response`; a redirect (3xx), which the providers never follow (the request would
    go, with its key, wherever the upstream says), or any other status, as a protocol error naming
    the status and the redirect's Location, so that the operator can fix `base_url`."""
    status = response.status_code
    if 200 <= status < 300:
        return
    redact = sent_secrets_redactor(cfg)  # what the upstream says is redacted whole, before it is clipped
    if status >= 400:
        raise await read_error_response(response, redact)
    where = f"[providers.{cfg.name}] base_url" if cfg.name else "the provider's base_url"
    if 300 <= status < 400:
        location = header_text(response, b"location", redact)
        if location:
            target = redirect_target(location, url)
            message = (
                f"the upstream redirected ({status} to {target}): redirects are not followed, "
                f"set {where} to where it points"
            )
        else:
            message = (
                f"the upstream answered HTTP {status}, a redirect without a Location "
                f"(redirects are not followed): check {where}"
            )
    else:
        message = f"the upstream answered HTTP {status}, which is not a model answer: check {where}"
    raise ProviderError("protocol", message, status=status)


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HEADER_TEXT_MAX = 300


def header_text(
    response: httpx.Response | LeanResponse, name: bytes, redact: Callable[[str], str] | None = None
) -> str:
    """A response header's value (the first one) as text fit for a message: control characters as
    `?`, redacted whole with `redact`, then clipped to 300 characters (`clip`); "" when absent."""
    for key, value in raw_headers(response):
        if key.lower() == name:
            text = _UNPRINTABLE.sub("?", value.decode("latin-1").strip())
            return clip(text if redact is None else redact(text), _HEADER_TEXT_MAX)
    return ""


def redirect_target(location: str, url: str) -> str:
    """A Location resolved against the request's URL without its user, password and query (so that
    a relative one says where it points, and no credential of `base_url` is copied into it)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        return urljoin(urlunsplit((parts.scheme, netloc, parts.path, "", "")), location)
    except ValueError:
        return location


_JSON_TYPES = {
    list: "a JSON array",
    str: "a JSON string",
    int: "a JSON number",
    float: "a JSON number",
    bool: "JSON true/false",
}


def _short(text: str, limit: int = 40) -> str:
    return clip(text, limit)


def describe_json(value: Any) -> str:
    """What a JSON answer that is not the expected one holds, in a few words for an error message:
    its `object`/`type` when it says one, and its first keys."""
    if not isinstance(value, dict):
        return _JSON_TYPES.get(type(value), "JSON null")
    said = [f"{k} {_short(value[k])!r}" for k in ("object", "type") if isinstance(value.get(k), str)]
    keys = ", ".join(_short(str(k)) for k in list(value)[:8]) + (", …" if len(value) > 8 else "")
    return "a JSON object" + (f" with {' and '.join(said)}" if said else "") + (f" (keys: {keys})" if keys else " ({})")


def key_for_header(cfg: ProviderConfig) -> str | None:
    """The provider's API key as read now from its variable (`ProviderConfig.api_key`: at every
    model call, not only at load), or None; a ProviderError naming the variable, the character and
    its position (never the key) when it cannot go into a header: the HTTP client would fail on it
    with an encoding error, or a control character would end the header line."""
    key = cfg.api_key()
    if not key:
        return None
    problem = api_key_problem(key, cfg.name, cfg.api_key_env or "the API key variable")
    if problem is not None:
        raise ProviderError("auth", f"cannot call the model: {problem}")
    return key


def check_extra_headers(cfg: ProviderConfig) -> None:
    """ProviderError when a configured header value cannot be sent (checked at load already: this
    covers a ProviderConfig made another way), naming the header, never quoting its value."""
    for name, value in cfg.headers.items():
        problem = header_text_problem(value) if isinstance(value, str) else "is not text"
        if problem is not None:
            raise ProviderError(
                "auth", f"cannot call the model: [providers.{cfg.name}] headers: the value of {name!r} {problem}"
            )


def unsendable_error(cfg: ProviderConfig, exc: UnicodeEncodeError) -> ProviderError:
    """A request the HTTP client could not encode (a header value or URL beyond ASCII that no check
    caught) as a clear ProviderError instead of an internal error with a traceback."""
    bad = exc.object[exc.start : exc.start + 1] if isinstance(exc.object, str) else ""
    what = f"the character {describe_char(bad)}" if bad else "a character"
    return ProviderError(
        "auth",
        f"cannot call the model: the request to [providers.{cfg.name}] holds {what}, which HTTP headers cannot "
        "carry (only ASCII): check its headers, its API key variable and its base_url",
    )


def transport_error(exc: Exception) -> ProviderError:
    """httpx failures → ProviderError kinds (timeouts and network faults are retryable)."""
    if isinstance(exc, httpx.TimeoutException):
        return ProviderError("timeout", f"upstream timed out: {type(exc).__name__}")
    if isinstance(exc, httpx.DecodingError):
        return ProviderError("protocol", f"cannot decode upstream body: {exc}")
    if isinstance(exc, ResponseHeadTooLarge):  # an upstream that sends it will send it again
        return ProviderError("protocol", f"upstream answer refused: {exc}")
    detail = str(exc) or type(exc).__name__
    return ProviderError("network", f"upstream connection failed: {detail}")


def default_client(cfg: ProviderConfig) -> httpx.AsyncClient:
    """One pooled keep-alive client per provider, on the lean transport (providers/fasttransport.py)
    unless the provider's config asks for httpx's own (`transport = "httpx"`). Either way the
    environment's proxies (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY) apply as httpx reads them,
    when the client is made. On the lean transport only the proxy that covers `base_url` is built:
    an unusable one is this provider's error (`unusable_proxy`), and one that covers other URLs,
    or an entry httpx cannot read, no error at all."""
    # At most `max_connections` calls in flight (httpx's default was 100: the 101st concurrent
    # stream waited for a whole generation); the others wait for a slot up to the read timeout.
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    if cfg.transport == "httpx":
        try:  # httpx builds every environment proxy here, the ones for other hosts too
            return httpx.AsyncClient(timeout=request_timeout(cfg), limits=limits)
        except (ImportError, ValueError, httpx.InvalidURL):
            raise ProviderError(
                "network",
                "httpx cannot use a proxy the environment names (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY or NO_PROXY):"
                ' fix it, or use transport = "lean", which builds only the proxy that covers base_url',
            ) from None
    try:
        mounts = env_proxy_mounts(cfg.base_url, limits)
    except UnusableProxy as exc:
        raise unusable_proxy(exc) from None
    # httpx's default transport when httptools is missing (given here, so httpx does not build
    # every env proxy itself). A URL the env proxy covers goes through its mount; the others
    # (NO_PROXY's hosts among them) through the lean one, settled once per URL (`LeanClient._route`).
    wire = lean_transport(cfg.max_connections) or httpx.AsyncHTTPTransport(limits=limits)
    return LeanClient(timeout=request_timeout(cfg), limits=limits, transport=wire, mounts=mounts)


def unusable_proxy(exc: UnusableProxy) -> ProviderError:
    """The proxy the environment names for this provider cannot be used: said of the variable and
    the proxy (its password masked), not of the upstream. `network`, as a proxy that does not answer."""
    said = f"cannot use the proxy {exc.proxy.variable} names ({shown_url(exc.proxy.url)}) for this provider"
    return ProviderError("network", f"{said}: {exc.reason}")


def request_timeout(cfg: ProviderConfig) -> httpx.Timeout:
    """Read timeout is between bytes, so long generations are fine (the lean transport also bounds
    an answer's head as a whole by it); connect fails fast."""
    return httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
