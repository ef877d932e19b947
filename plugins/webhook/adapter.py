"""The webhook adapter: a small uvicorn/Starlette server for inbound deliveries, httpx for replies.

Inbound: `POST <path>` with a JSON message, signed (see `signing`). The signature and its timestamp
are checked on the raw bytes before anything is parsed; a bad or stale one is 401 and reaches
nothing. A good message goes to the gateway (`on_message` returns once the ledger committed it, and
the ledger drops a repeated `id`), then the sender gets 202 (200 with `duplicate` for a repeated
`id`); if the gateway cannot take it, 503 so the sender retries. While the gateway's intake is
paused (`AdapterContext.intake_open`: its server, one of a cluster, cannot vouch for messages now)
a good message is 503 with `Retry-After` at once, never 202: the sender retries, through a balancer
to the server that runs the account next. Outbound: `send` POSTs the reply as JSON to `reply_url`,
signed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import heapq
import json
import math
import re
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from plugins.contract import (
    ROUTE_PART_MAX,
    Account,
    AccountError,
    AdapterContext,
    DeliveryError,
    InboundMessage,
    IntakePaused,
    Limits,
    Target,
    env_seconds,
)
from plugins.webhook.edge import AUTHENTICATED_EXTENSION, REFUSAL_LOG_EVERY_S, Gate, protocol_class
from plugins.webhook.settings import (
    DEFAULT_CONNECTIONS_PER_CLIENT,
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TOLERANCE_S,
    SECRETS,
    check_settings,
    parse_listen,
)
from plugins.webhook.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify

MAX_LENGTH = 100_000
PAUSED_RETRY_AFTER = "2"  # seconds; a pause ends (or another server takes the account) within that
PAUSED = "paused: this gateway's server cannot vouch for messages now; retry later"
STOP_TIMEOUT_S = 5.0
SEND_TIMEOUT = httpx.Timeout(15.0, connect=5.0)
# One send, from connecting to the receiver's status line, is given this long in all (httpx's
# timeouts bound each read, so a head trickled a byte at a time never timed out); its body is not
# waited for on a 2xx, and on an error answer only its first ERROR_EXCERPT_BYTES, for the reason.
# APPSERVER_WEBHOOK_SEND_DEADLINE_S (a positive number of seconds) overrides it, for tests.
SEND_DEADLINE_S = 15.0
SEND_DEADLINE_ENV = "APPSERVER_WEBHOOK_SEND_DEADLINE_S"
ERROR_EXCERPT_BYTES = 1024
ERROR_EXCERPT_WAIT_S = 2.0
MAX_FIELD = 1024  # characters in id, sender, reply_to, sender_name (chat and thread: ROUTE_PART_MAX)
# ...and bytes (UTF-8) in id and sender, which key the ledger's and the approved senders' rows: an
# index row of PostgreSQL's (a store shared by a cluster) holds at most 2,704 bytes, so 1,000 CJK
# characters (3,000 bytes), accepted, could never be recorded there (SQLite has no such limit): the
# gateway refuses a new one there (gateway/sqlstore.py's PG_KEY_BYTES), answered 400 (`_unkeyable`).
MAX_ID_BYTES = 1024
# A shorter shared secret can be guessed (and, under 8 characters, is not masked in the gateway's
# logs and reasons): `openssl rand -hex 16` gives 32.
MIN_SECRET_CHARS = 16
BODY_TIMEOUT_S = 10.0  # a body must arrive within this (a slow sender holds a buffer and a slot)
MAX_RETRY_AFTER_S = 300.0  # a receiver's Retry-After beyond this (or "inf") is read as this
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
MAX_LENGTH_DIGITS = 18  # a Content-Length longer than this is beyond any body limit
# Signed requests remembered (while their timestamp is within tolerance_s) to tell a replay from a
# fresh one: about 4 MiB at most; only validly signed requests are added, so only the secret's holder
# can fill it, and past this many within the window the soonest to expire is forgotten first.
SEEN_SIGNATURES_MAX = 16_384


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """An account's settings, validated."""

    host: str
    port: int
    path: str
    secret: str
    reply_url: str | None
    max_body_bytes: int
    tolerance_s: float
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    connections_per_client: int = DEFAULT_CONNECTIONS_PER_CLIENT

    @classmethod
    def from_account(cls, account: Account) -> WebhookSettings:
        """Read and check `account.settings` / `account.secrets`; raise `AccountError` on a bad one."""
        s = account.settings
        where = f"webhook account '{account.name}'"
        secret = account.secrets.get("secret")
        if not secret:
            raise AccountError(f"{where}: no secret; set secret_env (an environment variable) or secret_file")
        if len(secret) < MIN_SECRET_CHARS:
            raise AccountError(
                f"{where}: the secret is {len(secret)} characters, fewer than {MIN_SECRET_CHARS}: anyone could guess "
                "it and sign messages; use a random one, such as the output of `openssl rand -hex 16`"
            )
        try:
            check_settings(s)
        except ValueError as exc:
            raise AccountError(f"{where}: {exc}") from None
        host, port = parse_listen(s.get("listen", DEFAULT_LISTEN))
        reply_url = s.get("reply_url")
        return cls(
            host,
            port,
            s.get("path", "/"),
            secret,
            reply_url or None,
            s.get("max_body_bytes", DEFAULT_MAX_BODY),
            float(s.get("tolerance_s", DEFAULT_TOLERANCE_S)),
            int(s.get("max_connections", DEFAULT_MAX_CONNECTIONS)),
            int(s.get("connections_per_client", DEFAULT_CONNECTIONS_PER_CLIENT)),
        )


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SeenSignatures:
    """The signed requests seen while they can still be replayed, by a digest of what the signature
    covers (the timestamp and the raw body: a header spelled another way is the same request).

    A replay of a captured request passes the signature and timestamp checks until `tolerance_s`
    has passed, but proves nothing: only a request signed for the first time shows that its sender
    holds the secret. Memory is bounded: an entry goes once its timestamp leaves the window, and
    past `capacity` entries the one expiring soonest (the oldest of a tie) goes first."""

    def __init__(self, tolerance_s: float, capacity: int = SEEN_SIGNATURES_MAX) -> None:
        self._tolerance_s = tolerance_s
        self._capacity = capacity
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, int, bytes]] = []  # (expiry, arrival, digest), soonest first
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def first_use(self, timestamp: str, body: bytes, now: float | None = None) -> bool:
        """Whether this signed request is new (and remember it); False for a replay."""
        now = time.time() if now is None else now
        self._forget(now)
        digest = hashlib.sha256(timestamp.encode("ascii") + b"." + body).digest()
        if digest in self._expiry:
            return False
        expiry = int(timestamp) + self._tolerance_s  # past this, the timestamp check refuses it
        self._expiry[digest] = expiry
        self._arrivals += 1  # of two expiring together, the older goes first
        heapq.heappush(self._heap, (expiry, self._arrivals, digest))
        self._forget(now)
        return True

    def _forget(self, now: float) -> None:
        while self._heap and (self._heap[0][0] < now or len(self._heap) > self._capacity):
            _, _, digest = heapq.heappop(self._heap)
            del self._expiry[digest]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class WebhookAdapter:
    """One webhook account: its own listener for inbound messages and a client for replies."""

    limits = Limits(max_length=MAX_LENGTH, can_edit=False)
    secret_keys = SECRETS  # a reference to any other name is refused (plugins/contract.py)
    # A reply's `id` is its part's key, the same when it is sent again: the receiver dedupes on it
    # (documented), so the gateway may repeat a send whose outcome is unknown.
    dedupes_sends = True
    # Every inbound message is signed with the account's secret: the sender is the integration the
    # owner configured, so direct messages default to open (no pairing).
    authenticated_senders = True

    def __init__(self, account: Account, context: AdapterContext) -> None:
        self.account = account
        self.context = context
        self.settings = WebhookSettings.from_account(account)
        self.bound_port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._stopping = False
        self._last_refusal_log = -float("inf")
        self._refusals_held_back = 0
        self._seen = SeenSignatures(self.settings.tolerance_s)

    # lifecycle

    @property
    def is_running(self) -> bool:
        return self._server is not None and self._server.started and self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Bind the listener (AccountError when the address cannot be bound) and serve."""
        if self.is_running:
            return
        st = self.settings
        family = socket.AF_INET6 if ":" in st.host else socket.AF_INET
        try:
            sock = socket.create_server((st.host, st.port), family=family)
        except OSError as exc:
            raise AccountError(
                f"webhook account '{self.account.name}': cannot listen on {st.host}:{st.port}: {exc}"
            ) from exc
        self.bound_port = int(sock.getsockname()[1])
        # Unauthenticated bodies are buffered until the signature can be checked: the edge caps how
        # many connections may be open at once, in all and per client address (503 beyond), and
        # closes one that has not sent a complete request head within HEAD_TIMEOUT_S; a body then
        # has BODY_TIMEOUT_S (below). So an unauthenticated connection holds a slot for at most
        # HEAD_TIMEOUT_S + BODY_TIMEOUT_S, and each error answer closes its connection.
        gate = Gate(st.max_connections, min(st.connections_per_client, st.max_connections), self.context.log)
        config = uvicorn.Config(
            self._asgi,
            interface="asgi3",
            http=protocol_class(gate),
            ws="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=3,
            timeout_keep_alive=5,
        )
        self._server = server = _Server(config)
        self._stopping = False
        self._task = task = asyncio.create_task(server.serve(sockets=[sock]), name=f"webhook:{self.account.name}")
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if not server.started:
            sock.close()
            failure = task.exception() if not task.cancelled() else None
            raise AccountError(f"webhook account '{self.account.name}': server did not start: {failure!r}")
        task.add_done_callback(self._on_server_exit)
        shown = f"[{st.host}]" if ":" in st.host else st.host
        self.context.log.info(
            "webhook account '%s' listening on http://%s:%d%s", self.account.name, shown, self.bound_port, st.path
        )
        self.context.report("running", None)

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (3 s), and close; done within 5 s."""
        self._stopping = True
        server, task = self._server, self._task
        if server is not None and task is not None and not task.done():
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(task), STOP_TIMEOUT_S - 0.5)
            except TimeoutError:
                server.force_exit = True
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            except Exception as exc:  # the server failed while stopping: it is stopped all the same
                self.context.log.warning("webhook account '%s' stopped with %r", self.account.name, exc)
        self._server = self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.context.report("stopped", None)

    def _on_server_exit(self, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        reason = "listener stopped"
        if not task.cancelled() and task.exception() is not None:
            reason = f"listener failed: {task.exception()!r}"
        self.context.log.error("webhook account '%s': %s", self.account.name, reason)
        self.context.report("error", reason)

    # inbound

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        response = await self._handle(Request(scope, receive))
        await response(scope, receive, send)

    async def _handle(self, request: Request) -> Response:
        if request.url.path != self.settings.path:
            return _error(404, "not found")
        if request.method != "POST":
            return _error(405, "use POST", headers={"Allow": "POST"})
        try:
            body = await self._read_body(request)
            self._check_signature(request, body)
            if self._seen.first_use(request.headers[TIMESTAMP_HEADER], body):
                # the edge keeps this connection's slot from now on; a replay (served all the same:
                # the ledger drops a repeated id) earns it nothing, or one captured request could
                # pin every slot for tolerance_s
                _mark_authenticated(request.scope)
            message = self._parse(body, request.headers[TIMESTAMP_HEADER])
        except _BadRequest as exc:
            if exc.status == 401:
                self._note_refusal(exc.message)
            return _error(exc.status, exc.message)
        if not self.context.intake_open():
            return _error(503, PAUSED, headers={"Retry-After": PAUSED_RETRY_AFTER})
        try:
            created = await self.context.on_message(message)
        except IntakePaused:
            return _error(503, PAUSED, headers={"Retry-After": PAUSED_RETRY_AFTER})
        except Exception as exc:
            unkeyable = _unkeyable(exc, message)
            if unkeyable is not None:  # for good: no retry passes it (nothing was recorded)
                return _error(400, unkeyable)
            self.context.log.error(
                "webhook account '%s': delivery %r not recorded: %r", self.account.name, message.message_id, exc
            )
            return _error(503, "not recorded; retry later", headers={"Retry-After": "5"})
        if created is False:  # a repeat of an id recorded before: nothing is done again
            return JSONResponse({"accepted": True, "duplicate": True, "id": message.message_id}, status_code=200)
        return JSONResponse({"accepted": True, "id": message.message_id}, status_code=202)

    def _note_refusal(self, reason: str) -> None:
        """One log line per REFUSAL_LOG_EVERY_S for refused signatures, with how many more there
        were: anyone who can connect could otherwise write a line per request into the log."""
        now = time.monotonic()
        if now - self._last_refusal_log < REFUSAL_LOG_EVERY_S:
            self._refusals_held_back += 1
            return
        more = f" ({self._refusals_held_back} more since the last notice)" if self._refusals_held_back else ""
        self.context.log.warning("webhook account '%s': refused a delivery: %s%s", self.account.name, reason, more)
        self._last_refusal_log, self._refusals_held_back = now, 0

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        # ASCII digits only (`isdigit` takes `٥`); more than MAX_LENGTH_DIGITS is over any limit, and
        # int() would raise on a few thousand of them
        if declared.isascii() and declared.isdigit() and (len(declared) > MAX_LENGTH_DIGITS or int(declared) > limit):
            raise _BadRequest(413, f"body larger than {limit} bytes")
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise _BadRequest(413, f"body larger than {limit} bytes")

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except TimeoutError as exc:
            raise _BadRequest(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s") from exc
        except ClientDisconnect as exc:
            raise _BadRequest(400, "client disconnected") from exc
        return bytes(body)

    def _check_signature(self, request: Request, body: bytes) -> None:
        timestamp = request.headers.get(TIMESTAMP_HEADER)
        signature = request.headers.get(SIGNATURE_HEADER)
        if not timestamp or not signature:
            raise _BadRequest(401, f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}")
        if not _TIMESTAMP_RE.fullmatch(timestamp):
            raise _BadRequest(401, f"{TIMESTAMP_HEADER} must be unix seconds")
        if not verify(self.settings.secret, timestamp, body, signature):
            raise _BadRequest(401, "bad signature")
        if abs(time.time() - int(timestamp)) > self.settings.tolerance_s:
            raise _BadRequest(401, f"timestamp outside ±{self.settings.tolerance_s:g} s of the server's clock")

    def _parse(self, body: bytes, timestamp: str) -> InboundMessage:
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _BadRequest(400, f"body is not valid JSON: {exc}") from exc
        except ValueError as exc:  # an integer past Python's digit limit (4300)
            raise _BadRequest(400, f"body is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # nesting deeper than the parser's recursion allows
            raise _BadRequest(400, "body is not valid JSON: nested too deeply") from exc
        if not isinstance(data, dict):
            raise _BadRequest(400, "body must be a JSON object")
        for name, value in data.items():
            # JSON may escape half a surrogate pair ("\ud800"), which is no text at all: it could not
            # be stored or answered, and cleaned up it would collide with a legitimate "\ufffd".
            if _has_lone_surrogate(name) or _has_lone_surrogate(value):
                shown = name if not _has_lone_surrogate(name) else "a field name"
                raise _BadRequest(400, f"{shown} holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text")
        chat_type = data.get("chat_type", "dm")
        if chat_type not in ("dm", "group"):
            raise _BadRequest(400, 'chat_type must be "dm" or "group"')
        mentions_bot = data.get("mentions_bot", True)
        if not isinstance(mentions_bot, bool):
            raise _BadRequest(400, "mentions_bot must be true or false")
        text = data.get("text")
        if not isinstance(text, str) or not text.strip():
            # blank text makes no turn: a 202 for it was an acceptance nothing ever answered
            raise _BadRequest(400, "text must be a non-empty string, not only whitespace")
        return InboundMessage(
            channel=self.account.channel,
            account=self.account.name,
            chat=_field(data, "chat", key_part=True),
            chat_type=chat_type,
            sender=_field(data, "sender", id_like=True, key=True),
            message_id=_field(data, "id", key=True),
            text=text,
            thread=_field(data, "thread", optional=True, key_part=True),
            sender_name=_field(data, "sender_name", optional=True),
            mentions_bot=mentions_bot,
            reply_to=_field(data, "reply_to", optional=True),
            ts=float(timestamp),
            raw=data,
        )

    # outbound

    async def send(self, target: Target, text: str) -> list[str]:
        """POST the reply to `reply_url`, signed; return its id. Raises `DeliveryError`."""
        url = self.settings.reply_url
        if url is None:
            raise DeliveryError("no reply_url configured", permanent=True)
        message_id = target.key or str(uuid.uuid4())  # stable for a resend: the receiver can dedupe
        payload = {
            "id": message_id,
            "chat": target.chat,
            "thread": target.thread,
            "reply_to": target.reply_to,
            "text": text,
            "account": self.account.name,
        }
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(self.settings.secret, timestamp, body),
        }
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=SEND_TIMEOUT, follow_redirects=False)
        deadline = env_seconds(SEND_DEADLINE_ENV, SEND_DEADLINE_S)
        try:
            request = self._client.build_request("POST", url, content=body, headers=headers)
            async with asyncio.timeout(deadline):
                response = await self._client.send(request, stream=True)
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:  # never sendable: no retry budget spent
            raise DeliveryError(f"reply_url cannot be requested: {type(exc).__name__}: {exc}", permanent=True) from exc
        except TimeoutError as exc:  # the request may have been received: sent again with the same id
            raise DeliveryError(f"reply_url did not answer within {deadline:g} s", uncertain=True) from exc
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:  # not sent
            raise DeliveryError(f"reply_url unreachable: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:  # a timeout, a dropped connection: it may have been received
            raise DeliveryError(f"reply_url unreachable: {type(exc).__name__}: {exc}", uncertain=True) from exc
        try:
            status = response.status_code
            if 200 <= status < 300:
                # Delivered: the receiver accepted it (its body is not ours to wait for; a body that
                # never ends must not hold the chat's replies, and a resend would only repeat it).
                return [message_id]
            excerpt = (await _excerpt(response)).strip()
        finally:
            await _close(response)
        reason = f"reply_url answered {status}" + (f": {excerpt}" if excerpt else "")
        if status in (429, 503):
            raise DeliveryError(reason, retry_after=_retry_after(response.headers))
        if status >= 500 or status == 408:
            raise DeliveryError(reason)
        raise DeliveryError(reason, permanent=True)


def _field(
    data: Mapping[str, Any],
    name: str,
    *,
    optional: bool = False,
    key_part: bool = False,
    id_like: bool = False,
    key: bool = False,
) -> Any:
    """A string field: non-empty, at most MAX_FIELD characters. An id the owner may type into config
    (`id_like`: sender; chat and thread, which are also route key parts) holds no control character
    and no whitespace at either end: the route CLI and `allow` lists take such an id as typed, so
    `" kit "` could never match a route or an allow entry. A route key part (chat, thread) also holds
    no ':' and no whitespace at all, and is at most ROUTE_PART_MAX characters, like a route key's
    part. A field that keys a stored row (`key`: id, sender) may be longer than MAX_ID_BYTES bytes in
    UTF-8: a PostgreSQL store refuses a new one (`_unkeyable`). None when optional and absent or null."""
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise _BadRequest(400, f"{name} must be a non-empty string" + (" or null" if optional else ""))
    limit = ROUTE_PART_MAX if key_part else MAX_FIELD
    if len(value) > limit:
        raise _BadRequest(400, f"{name} is longer than {limit} characters")
    if key_part and ":" in value:
        raise _BadRequest(400, f"{name} must not contain ':'")
    if (key_part or id_like) and any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in value):
        raise _BadRequest(400, f"{name} must not contain control characters")
    if key_part and any(ch.isspace() for ch in value):  # a route key part has none (gateway/routing.py)
        raise _BadRequest(400, f"{name} must not contain whitespace (a route key could never name it)")
    if id_like and value != value.strip():
        raise _BadRequest(400, f"{name} must not begin or end with whitespace")
    if key_part and value == "__root__":
        raise _BadRequest(400, f"{name} '__root__' is reserved (it names a chat's main line)")
    return value


def _unkeyable(exc: Exception, message: InboundMessage) -> str | None:
    """Why the gateway's store refused `message` for good (a 400), or None (503, retry): an id or a
    sender longer than MAX_ID_BYTES in UTF-8 that the store cannot key (a PostgreSQL store takes
    none, unless the id was recorded before or the sender approved before; SQLite takes them all).
    A database's refusal for now (`sqlite3.OperationalError`: busy, the session lost) is a 503."""
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.OperationalError):
        return None
    field = getattr(exc, "field", None)  # the gateway's `KeyTooLong` names it
    for name, value in (("id", message.message_id), ("sender", message.sender)):
        if (field is None or field == name) and len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
            return f"{name} is longer than {MAX_ID_BYTES} bytes in UTF-8 (the gateway's PostgreSQL store cannot key it)"
    return None


def _has_lone_surrogate(value: Any) -> bool:
    """A string anywhere in `value` (keys included) with a code point U+D800-U+DFFF: only a lone
    half of a pair survives `json.loads`. Walked without recursion (the nesting may be deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE_RE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def _excerpt(response: httpx.Response) -> str:
    """The start of an error answer's body, for the reason: at most ERROR_EXCERPT_BYTES, read for at
    most ERROR_EXCERPT_WAIT_S (a body that trickles or never ends gives what came by then)."""
    got = bytearray()
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(ERROR_EXCERPT_WAIT_S):
            async for chunk in response.aiter_bytes():
                got.extend(chunk)
                if len(got) >= ERROR_EXCERPT_BYTES:
                    break
    return bytes(got[:ERROR_EXCERPT_BYTES]).decode("utf-8", "replace")[:200]


async def _close(response: httpx.Response) -> None:
    """Close a response whose body may be unread (the connection is dropped, not reused)."""
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(ERROR_EXCERPT_WAIT_S):
            await response.aclose()


def _retry_after(headers: httpx.Headers) -> float | None:
    """`Retry-After` in seconds (a number or an HTTP date), None when absent or unreadable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return min(max(0.0, seconds), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else MAX_RETRY_AFTER_S
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return min(max(0.0, when.timestamp() - time.time()), MAX_RETRY_AFTER_S)


def _mark_authenticated(scope: Scope) -> None:
    """Tell the listener's edge this connection sent a validly signed request, signed for the first
    time (never evicted)."""
    marker = (scope.get("extensions") or {}).get(AUTHENTICATED_EXTENSION)
    if isinstance(marker, dict) and callable(marker.get("mark")):
        marker["mark"]()


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The channel's error answer; it closes the connection (a sender that got one, or a stranger,
    does not keep a slot of the listener by keeping the connection alive)."""
    return JSONResponse(
        {"accepted": False, "error": message}, status_code=status, headers={**(headers or {}), "Connection": "close"}
    )


def create_adapter(account: Account, context: AdapterContext) -> WebhookAdapter:
    """The plugin entry point (see `plugins.contract`)."""
    return WebhookAdapter(account, context)
