"""`ProtocolClient`: one connection to `/ws` that survives a server restart or a failover.

    async with await ProtocolClient.connect("http://127.0.0.1:8770", reconnect=True) as c:
        ack = await c.request({"type": "submit_input", "agent": "assistant", "input": "hi"})
        async for frame in c.frames():   # turn_updated, approval_request, tool_call_request, …
            ...

Replies (frames carrying the `request_id` of a request) resolve `request()`; an `error` reply raises
`ProtocolError`. Every other frame goes to `frames()` in arrival order, through a bounded buffer
(`buffer.py`): a consumer that falls too far behind ends the connection instead of the memory.

Reconnect (`reconnect=True`): when the server stops (1012) or dies (1006), a standby may take over
(docs/protocol.md), so the client retries with capped backoff for at most `reconnect_s` seconds,
asking `url_source()` each time where the server now is (the CLI re-reads server.json: a standby may
listen elsewhere). Then it says hello, re-subscribes to its conversations and resumes the turns it
was following: the active turn's snapshot is replayed as `turn_updated`; every other followed turn
(still queued, ended meanwhile, e.g. settled as interrupted by the standby, or withdrawn from the
queue) is asked for by id (`get_turn`): its current snapshot, for an ended one the server's own
outcome. Only a turn `get_turn` does not answer for (no record of it, or a server without
`get_turn`) gets a terminal snapshot rebuilt from the committed history (`resume.py`), else the
`lost` one; so is each followed turn of a conversation the server will not subscribe it to again
(deleted meanwhile) asked for: its outcome, else `lost` saying why. A
`store_unavailable`, `server_unavailable` or `outcome_unknown` answer is no refusal: the reconnect is
tried again. So a caller waiting for an outcome always gets a truthful one. (A server without
`get_turn` leaves a turn unsettled while inputs are queued, as before: they may hold it.)
On one connection (across its reconnects), a `turn_updated` whose revision is not higher than the
last one delivered for that turn is not delivered (to `frames()`, `next_frame()`, `wait_turn()`):
revisions of a turn strictly increase, also across a server's restart or a failover, so it is an
old or repeated view. Nor is any `turn_updated` of a turn after its terminal snapshot: that one is
the turn's last (a terminal snapshot rebuilt from history after a reconnect, then the server's own
when the input is sent again with its idempotency key, would be two). A frame nested deeper than
64 levels, like one that is no JSON, is ignored.
Callers see two local frames, `{"type": "event", "name": "connection_lost" | "reconnected",
"local": true, …}` (clients ignore event names they do not know). Requests in flight are re-sent
when that is safe (`resendable`: a `cancel` only when it names its turn) and fail with `Closed`
`connection_lost` otherwise. A re-sent `approval_response` whose first send was applied reports
the caller's own answer as accepted, marked `resent` (`own_answers`), not as `already_resolved`.
Without a server after `reconnect_s`, `frames()` ends and requests raise `Closed` with the reason;
a server that refuses the credential (401/403 at the upgrade) ends it at once, since retrying
cannot help.

Opening: a network failure is `OSError`; a bad URL or an upgrade the server refuses with an HTTP
status is `ConnectError` (a `ProtocolError`), in one line (`the server at … refused the token (401
invalid_api_key: …)`), and so is a server that takes the connection but sends no welcome in time
(`welcome_timeout`: not the turn's timeout, not a refused connection); one that closes it before
its welcome is `Closed`. A proxy of the environment that does not open the tunnel (an HTTP error
to the CONNECT, no HTTP, the connection closed) is `ConnectError` `proxy_failed`, saying so of the
proxy (its URL masked), not of the server. A frame bigger than the server takes (its welcome's
`max_frame_bytes`, else 4 MiB) is refused before it is sent (`ProtocolError` `frame_too_large`):
sent, it would end the connection. Frames are sent as UTF-8 JSON (non-ASCII text unescaped) and measured in those bytes,
as the server measures them (`encode_frame`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from websockets.asyncio.client import ClientConnection, HTTPProxyConnection
from websockets.asyncio.client import connect as library_connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidProxy,
    InvalidProxyMessage,
    InvalidProxyStatus,
    InvalidStatus,
    InvalidURI,
    ProxyError,
)
from websockets.frames import CloseCode
from websockets.proxy import get_proxy, parse_proxy
from websockets.uri import WebSocketURI, parse_uri

from appserver.client.auth import TokenSource, auth_headers, check_url, default_token, shown_url
from appserver.client.buffer import DEFAULT_LIMIT, FrameBuffer
from appserver.client.errors import Closed, ConnectError, ProtocolError
from appserver.client.frames import PROTOCOL_VERSION, TERMINAL, ClientFrame, Snapshot
from appserver.client.resume import lost_snapshot, settled_from_history

RECONNECT_CODES = frozenset({1001, 1006, 1011, 1012, 1013, 1014})  # stop, death, restart, overload
FATAL_CODES = frozenset(
    {
        "invalid_api_key",
        "missing_api_key",
        "invalid_token",
        "token_expired",
        "insufficient_scope",
        "unsupported_protocol",
        "forbidden",
    }
)
# Codes that say "not now", not "no": a reconnect whose resubscribe or resume hits one is tried again
# (docs/protocol.md: the store, a server of a cluster that lost its database or was judged gone).
TRANSIENT_CODES = frozenset({"store_unavailable", "server_unavailable", "outcome_unknown"})
RESENDABLE = frozenset(
    {
        "subscribe",
        "unsubscribe",
        "get_history",
        "get_turn",
        "list_agents",
        "list_conversations",
        "ping",
        "cancel",
        "approval_response",
    }
)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 2.0
HISTORY_LIMIT = 500
HISTORY_PAGES = 20  # pages read back at most to rebuild the turns a reconnect finds ended
PIPELINED = 64  # requests a reconnect sends before reading their replies (`_call_all`)
# The biggest frame a server takes when its welcome does not say (docs/protocol.md: 4 MiB); a
# bigger one would end the connection (1009), so the client refuses to send it.
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024


_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_frame(frame: dict[str, Any]) -> tuple[str, int]:
    """`frame` as the JSON text sent, and its size in bytes on the wire (UTF-8), which is what the
    server's limit counts. Non-ASCII text is written as it is (UTF-8), not as `\\uXXXX` escapes,
    which would make a frame of non-ASCII text up to three times bigger than it needs to be (and a
    line refused far below the limit). A lone surrogate (a `str` can hold one; UTF-8 cannot) is
    written as its JSON escape, the one form of it JSON has: the same value, as `ensure_ascii`
    writes it. A frame of such text cannot be sent otherwise (a text frame must be UTF-8)."""
    text = json.dumps(frame, ensure_ascii=False)
    if _SURROGATE.search(text) is not None:  # (only inside strings: JSON's own syntax is ASCII)
        text = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text, len(text) if text.isascii() else len(text.encode("utf-8"))


def _closed(exc: ConnectionClosed) -> str:
    """`code reason` of a closed connection, as the close frame said (1006 when there was none)."""
    frame = exc.rcvd or exc.sent
    return f"{frame.code} {frame.reason}".strip() if frame is not None else "1006 no close frame"


def resendable(frame: dict[str, Any]) -> bool:
    """Whether sending `frame` twice does no harm (an input only with a key on a known conversation).
    A `cancel` only when it names its turn: one without `turn_id` that was applied before the
    connection dropped would, sent again, stop the next turn (another client's input, say); it
    fails with `Closed` `connection_lost` ("may or may not have been applied") as other frames do."""
    kind = frame.get("type")
    if kind == "submit_input":
        return bool(frame.get("idempotency_key")) and frame.get("conversation") not in (None, "new")
    if kind == "cancel":
        return bool(frame.get("turn_id"))
    return kind in RESENDABLE


# The status a call settled by each decision of an `approval_response` has (docs/protocol.md).
DECISION_STATUS = {"approve": "approved", "deny": "denied"}


def own_answers(sent: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """The reply to an `approval_response` the client sent again after a reconnect, each call
    found `already_resolved` with the very status this frame's decision gives reported as
    accepted (`accepted: true`, `resent: true`, no `error`): the first send was applied before the
    connection dropped, and the caller's own answer is no loss. (Another client's identical answer
    first cannot be told apart; either way the call is settled as the caller said.) A different
    status stays `already_resolved`: somebody else answered first."""
    if sent.get("type") != "approval_response" or not isinstance(reply.get("results"), list):
        return reply
    decisions = {d.get("call_id"): d.get("decision") for d in sent.get("decisions") or [] if isinstance(d, dict)}
    results: list[Any] = []
    for r in reply["results"]:
        if (
            isinstance(r, dict)
            and r.get("error") == "already_resolved"
            and r.get("status") is not None
            and r.get("status") == DECISION_STATUS.get(str(decisions.get(r.get("call_id"))))
        ):
            r = {"call_id": r.get("call_id"), "accepted": True, "status": r["status"], "resent": True}
        results.append(r)
    return {**reply, "results": results}


class _Connection(ClientConnection):
    """websockets' client connection whose keepalive takes the server's bytes, while they arrive,
    as a sign of life: the server answers a ping behind what it is already sending (an 8 MiB
    `get_history` page takes two minutes at 64 KiB/s), and the library closed (1011) a server
    that was sending it a page steadily, and lost the page. A server that sends no byte for
    `ping_timeout` while a ping waits for its pong is closed as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received = 0  # bytes read from the server so far

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        super().data_received(data)

    async def keepalive(self) -> None:
        """websockets' own loop (a ping every `ping_interval`, less the last latency), waiting for
        each pong as `_pong` does."""
        assert self.ping_interval is not None
        latency = 0.0
        try:
            while True:
                await asyncio.sleep(self.ping_interval - latency)
                pong = await self.ping()
                if self.ping_timeout is None:
                    continue
                answered = await self._pong(pong, self.ping_timeout)
                if answered is None:
                    async with self.send_context():  # (waits until the connection is lost, which cancels this)
                        self.protocol.fail(CloseCode.INTERNAL_ERROR, "keepalive ping timeout")
                    return
                latency = answered
        except Exception:
            self.logger.error("keepalive ping failed", exc_info=True)

    async def _pong(self, pong: Awaitable[float], timeout: float) -> float | None:
        """The pong's latency; None once the server has sent no byte for `timeout` (since the
        ping, or since the last bytes that came before its pong)."""
        waiter = asyncio.ensure_future(pong)
        seen, since = self.received, self.loop.time()
        while True:
            left = since + timeout - self.loop.time()
            if left <= 0:
                return None
            done, _ = await asyncio.wait((waiter,), timeout=min(left, timeout / 4))
            if done:
                return waiter.result()
            if self.received > seen:
                seen, since = self.received, self.loop.time()


@dataclass
class _Pending:
    frame: dict[str, Any]
    future: asyncio.Future[dict[str, Any]]
    sent: bool = False
    resent: bool = False  # sent again after a reconnect: its first send may have been applied


def server_frame(raw: str | bytes) -> dict[str, Any] | None:
    """A frame the server sent, or None for one that is no protocol frame (not JSON, not an
    object, nested deeper than MAX_DEPTH): ignored, as an unknown frame type is. A `local` flag is
    removed: only this library's own frames (connection lost, reconnected) carry it, so a server
    cannot fake them."""
    try:
        frame = json.loads(raw)
    except (ValueError, RecursionError):  # (nesting past the parser's recursion limit)
        return None
    if not isinstance(frame, dict) or _too_deep(raw, frame):
        return None
    frame.pop("local", None)
    return frame


# The deepest nesting a protocol frame has: the server's own limit for what it takes (docs/protocol.md,
# `bad_json`). Deeper is no protocol frame, and code that walks frames recursively (printing them,
# json.dumps) could hit the recursion limit on it.
MAX_DEPTH = 64


def _too_deep(raw: str | bytes, frame: dict[str, Any]) -> bool:
    """Whether `frame` nests deeper than MAX_DEPTH (the frame itself is level 1). Without a walk
    when `raw` holds too few brackets to be that deep (nearly every frame); the walk uses no
    recursion."""
    if isinstance(raw, str):
        brackets = raw.count("{") + raw.count("[")
    else:
        brackets = raw.count(b"{") + raw.count(b"[")
    if brackets <= MAX_DEPTH:
        return False
    stack: list[tuple[Any, int]] = [(frame, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _unfollowable_snapshot(turn_id: str, conversation_id: str, agent_id: str, revision: int, why: str) -> Snapshot:
    """The outcome the client reports for a followed turn it can no longer follow: after a
    reconnect the server refused to subscribe it to the turn's conversation again (`why`), and did
    not give the turn's own outcome either. `failed`, `error.kind` `lost`, as a turn the server has
    no record of (`lost_snapshot`), with a message saying what happened."""
    snap = lost_snapshot(turn_id, conversation_id, agent_id, revision)
    snap["error"] = {
        "kind": "lost",
        "message": (
            "the client can no longer follow this turn: after the reconnect the server refused to "
            f"subscribe to its conversation again ({why}); its outcome is unknown"
        ),
        "retryable": False,
        "status": None,
    }
    return snap


def _revision(snap: Mapping[str, Any]) -> int:
    """A snapshot's revision; -1 (before any) when it is missing or no integer."""
    value = snap.get("revision", -1)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


@dataclass
class _Followed:
    conversation_id: str
    revision: int = -1


SEEN_TURNS_MAX = 4096  # turns whose newest revision the client remembers (the oldest forgotten first)
ENDED = 1 << 63  # noted in `_seen` for a turn whose terminal snapshot was delivered: nothing follows it


class ProtocolClient:
    # websockets' keepalive (`_Connection`): a ping every PING_INTERVAL_S; closed (1011) when the
    # server sends nothing for PING_TIMEOUT_S while its pong is awaited
    PING_INTERVAL_S: ClassVar[float] = 20.0
    PING_TIMEOUT_S: ClassVar[float] = 60.0

    def __init__(
        self,
        url: str,
        *,
        token: TokenSource,
        client: str,
        open_timeout: float,
        reconnect: bool,
        reconnect_s: float,
        url_source: Callable[[], str | None] | None,
        max_buffered: int = DEFAULT_LIMIT,
    ) -> None:
        self.url = url
        self.ws: Any = None
        self.welcome: dict[str, Any] = {}
        self.close_reason: str | None = None
        self.reconnects = 0
        self._token = token
        self._client = client
        self._open_timeout = open_timeout
        self._reconnect = reconnect
        self._reconnect_s = reconnect_s
        self._url_source = url_source
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._frames = FrameBuffer(max_buffered)
        self._overflow: str | None = None  # why the client gave up on a consumer that fell behind
        self._reader: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._gone = False
        self._subscribed: dict[str, str | None] = {}  # conversation id -> agent id
        self._turns: dict[str, _Followed] = {}  # turns this client follows until their terminal snapshot
        # turn id -> the newest revision delivered on this connection (across its reconnects): an
        # older or equal snapshot of the turn is not delivered again (revisions strictly increase);
        # ENDED once its terminal snapshot was delivered (it is the turn's last)
        self._seen: OrderedDict[str, int] = OrderedDict()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        token: TokenSource = None,
        client: str = "appserver-client",
        open_timeout: float = 10.0,
        reconnect: bool = False,
        reconnect_s: float = 30.0,
        url_source: Callable[[], str | None] | None = None,
        max_buffered: int = DEFAULT_LIMIT,
    ) -> ProtocolClient:
        """Open, say hello and start reading. `token` is a string or a callable asked at every
        (re)connect; None falls back to `APPSERVER_TOKEN`."""
        self = cls(
            url,
            token=default_token(token),
            client=client,
            open_timeout=open_timeout,
            reconnect=reconnect,
            reconnect_s=reconnect_s,
            url_source=url_source,
            max_buffered=max_buffered,
        )
        ws = await self._open(url)
        early: list[dict[str, Any]] = []
        try:
            self.welcome = await asyncio.wait_for(self._call(ws, self._hello(), early), open_timeout)
        except TimeoutError:
            # Not the turn's timeout nor a refused connection: the upgrade succeeded, hello went unanswered.
            await ws.close()
            raise ConnectError(
                "welcome_timeout",
                f"the server at {shown_url(url)} accepted the WebSocket connection but sent no welcome within "
                f"{open_timeout:g} s (it may be overloaded or stuck, or not an appserver)",
            ) from None
        except ConnectionClosed as exc:
            raise Closed(
                "connection_closed",
                f"the server at {shown_url(url)} closed the connection before its welcome ({_closed(exc)})",
            ) from None
        except ValueError:
            await ws.close()
            raise ConnectError(
                "handshake_failed",
                f"the server at {shown_url(url)} answered hello with something other than a protocol frame",
            ) from None
        except BaseException:
            await ws.close()
            raise
        self.ws = ws
        self._connected.set()
        for frame in early:
            self._deliver(frame)
        self._reader = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aenter__(self) -> ProtocolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closing = True
        try:
            if self.ws is not None:
                await self.ws.close()
        finally:
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)

    # ------------------------------------------------------------ connection

    def _hello(self) -> dict[str, Any]:
        return {"type": "hello", "protocol": PROTOCOL_VERSION, "client": self._client}

    async def _open(self, url: str) -> Any:
        """A connection to `url`; what is not a network error (OSError) is `ConnectError`."""
        target = check_url(url)
        headers = auth_headers(self._token)
        proxy = _environment_proxy(target)
        try:
            return await _Connect(
                target,
                proxy=proxy,
                additional_headers=headers,
                open_timeout=self._open_timeout,
                max_size=None,
                ping_interval=self.PING_INTERVAL_S,
                ping_timeout=self.PING_TIMEOUT_S,
                create_connection=_Connection,
            )
        except InvalidStatus as exc:
            raise _refused(url, exc.response.status_code, bytes(exc.response.body or b"")) from None
        except InvalidURI as exc:
            raise ConnectError("invalid_url", f"invalid server URL {shown_url(url)!r}: {exc.msg}", fatal=True) from None
        except TimeoutError:
            raise ConnectError(
                "connect_timeout",
                f"the server at {shown_url(url)} did not accept a connection within {self._open_timeout:g} s",
            ) from None
        except ProxyError as exc:  # (an InvalidHandshake, but the proxy's, not the server's)
            raise _proxy_failed(proxy or "", target, exc) from None
        except (InvalidHandshake, ConnectionClosed) as exc:
            raise ConnectError(
                "handshake_failed", f"no WebSocket server answered at {shown_url(target)}: {exc}"
            ) from None

    async def _call(self, ws: Any, frame: dict[str, Any], out: list[dict[str, Any]]) -> dict[str, Any]:
        """One request on a connection nobody else reads yet (handshakes); other frames go to `out`."""
        rid = f"h{next(self._ids)}"
        await ws.send(encode_frame({**frame, "request_id": rid})[0])
        while True:
            reply = server_frame(await ws.recv())
            if reply is None:
                continue
            if reply.get("request_id") != rid:
                out.append(reply)
                continue
            if reply.get("type") == "error":
                raise ProtocolError(reply.get("code", "error"), reply.get("message", ""), reply.get("param"))
            self._note_reply(frame, reply)
            return reply

    async def _call_all(
        self, ws: Any, frames: list[dict[str, Any]], out: list[dict[str, Any]]
    ) -> list[dict[str, Any] | ProtocolError]:
        """`_call` for many requests at once: each batch of up to PIPELINED is sent before its
        replies are read, so a reconnect following hundreds of turns costs a few round trips, not
        one per turn. A request's `error` is its item (a ProtocolError), not raised."""
        results: list[dict[str, Any] | ProtocolError] = []
        for start in range(0, len(frames), PIPELINED):
            batch = frames[start : start + PIPELINED]
            rids = [f"h{next(self._ids)}" for _ in batch]
            for rid, frame in zip(rids, batch, strict=True):
                await ws.send(encode_frame({**frame, "request_id": rid})[0])
            replies: dict[str, dict[str, Any]] = {}
            while len(replies) < len(rids):
                reply = server_frame(await ws.recv())
                if reply is None:
                    continue
                answered = reply.get("request_id")
                if not isinstance(answered, str) or answered not in rids or answered in replies:
                    out.append(reply)
                    continue
                replies[answered] = reply
            for rid, frame in zip(rids, batch, strict=True):
                reply = replies[rid]
                if reply.get("type") == "error":
                    code, message = reply.get("code", "error"), reply.get("message", "")
                    results.append(ProtocolError(code, message, reply.get("param")))
                else:
                    self._note_reply(frame, reply)
                    results.append(reply)
        return results

    async def _run(self) -> None:
        """Read frames; when the connection ends, reconnect if asked and allowed, else finish."""
        try:
            while True:
                code, reason = await self._pump()
                self.close_reason = self._overflow or f"{code} {reason}".strip()
                if self._closing or self._overflow or not self._reconnect or code not in RECONNECT_CODES:
                    return
                if not await self._reconnect_loop(code, reason):
                    return
        finally:
            self._gone = True
            err = Closed("connection_closed", self.closed_message())
            for p in self._pending.values():
                if not p.future.done():
                    p.future.set_exception(err)
            self._pending.clear()
            self._frames.end()
            self._connected.set()  # wakes senders waiting for a reconnect; they see _gone

    async def _pump(self) -> tuple[int, str]:
        try:
            if self._overflow is None:
                async for raw in self.ws:
                    frame = server_frame(raw)
                    if frame is None:
                        continue
                    self._dispatch(frame)
                    if self._overflow is not None:
                        break
            if self._overflow is not None:
                await self._drop(self.ws)
                return 1000, "client fell behind"
        except ConnectionClosed as exc:
            if exc.rcvd is None:
                return 1006, "the connection dropped"
            return exc.rcvd.code, exc.rcvd.reason
        return int(self.ws.close_code or 1006), str(self.ws.close_reason or "")

    @staticmethod
    async def _drop(ws: Any) -> None:
        """Close a connection whose frames nobody reads any more: reading on (and discarding) lets
        the server's close reply through the library's own bounded receive queue."""
        closing = asyncio.ensure_future(ws.close(1000, "client fell behind"))
        try:
            async for _ in ws:
                pass
        except ConnectionClosed:
            pass
        await closing

    async def _reconnect_loop(self, code: int, reason: str) -> bool:
        self._connected.clear()
        start = time.monotonic()
        deadline = start + self._reconnect_s
        for rid, p in list(self._pending.items()):
            if p.sent and not resendable(p.frame):
                self._pending.pop(rid)
                if not p.future.done():
                    p.future.set_exception(
                        Closed(
                            "connection_lost",
                            f"the connection to the server was lost before it answered {p.frame.get('type')}; "
                            "it may or may not have been applied",
                        )
                    )
        self._deliver(
            {
                "type": "event",
                "name": "connection_lost",
                "local": True,
                # shown, never a secret of the URL (`client.url` is the URL itself)
                "data": {"code": code, "reason": reason, "url": shown_url(self.url), "reconnect_s": self._reconnect_s},
            }
        )
        delay, last, fatal = BACKOFF_FIRST_S, f"{code} {reason}".strip(), False
        while not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            url = self._where()
            ws = None
            try:
                ws = await asyncio.wait_for(self._open(url), left)
                out: list[dict[str, Any]] = []
                welcome = await asyncio.wait_for(self._rehandshake(ws, out), max(0.5, deadline - time.monotonic()))
            except ProtocolError as exc:
                last = exc.message if isinstance(exc, ConnectError) else f"{exc.code}: {exc.message}"
                if exc.code in FATAL_CODES or getattr(exc, "fatal", False):
                    fatal = True
                    break
            except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake, InvalidURI, ValueError) as exc:
                last = str(exc) or type(exc).__name__
            else:
                self.ws, self.url, self.welcome = ws, url, welcome
                self.reconnects += 1
                # `_seen` is kept: another server process may answer now, and revisions of a turn
                # strictly increase across a restart or a takeover too (docs/protocol.md).
                self._deliver(
                    {
                        "type": "event",
                        "name": "reconnected",
                        "local": True,
                        "data": {"url": shown_url(url), "after_s": round(time.monotonic() - start, 3)},
                    }
                )
                for frame in out:
                    self._deliver(frame)
                try:
                    for p in list(self._pending.values()):
                        if p.sent:
                            try:
                                text = self._encode(p.frame)  # this server may take less than the last
                            except ProtocolError as exc:
                                if not p.future.done():
                                    p.future.set_exception(exc)
                                continue
                            await ws.send(text)
                            p.resent = True
                except ConnectionClosed:
                    pass  # dropped again at once: the reader sees it and starts over
                self._connected.set()
                return True
            if ws is not None:
                await ws.close()
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, BACKOFF_MAX_S)
        lost = f"lost the server at {shown_url(self.url)} ({code} {reason}".strip() + ")"
        if fatal:
            self.close_reason = f"{lost} and it refused to reconnect: {last}"
        else:
            self.close_reason = f"{lost} and could not reconnect within {self._reconnect_s:g} s (last error: {last})"
        return False

    def _where(self) -> str:
        if self._url_source is not None:
            try:
                url = self._url_source()
            except Exception:
                url = None
            if url:
                return url
        return self.url

    async def _rehandshake(self, ws: Any, out: list[dict[str, Any]]) -> dict[str, Any]:
        """hello, then re-subscribe and resume every followed turn; frames to deliver go to `out`."""
        welcome = await self._call(ws, self._hello(), out)
        refused: list[str] = []  # forgotten only once this reconnect holds (a retry starts over)
        for conv_id in list(self._subscribed):
            try:
                state = await self._call(ws, {"type": "subscribe", "conversation": conv_id}, out)
            except ProtocolError as exc:
                if exc.code in FATAL_CODES or exc.code in TRANSIENT_CODES:
                    raise  # (transient: this reconnect is tried again)
                await self._settle_unfollowable(ws, conv_id, exc, out)
                refused.append(conv_id)
                continue
            active = state.get("active_turn")
            if active:
                out.append({"type": "turn_updated", "snapshot": active})
            missing = [
                t
                for t, f in self._turns.items()
                if f.conversation_id == conv_id and (not active or active.get("turn_id") != t)
            ]
            if missing:
                await self._resume_missing(ws, conv_id, state, missing, out)
        for conv_id in refused:
            self._forget(conv_id)
        return welcome

    async def _resume_missing(
        self, ws: Any, conv_id: str, state: dict[str, Any], missing: list[str], out: list[dict[str, Any]]
    ) -> None:
        """The snapshot of each followed turn of `conv_id` that is not its active one. A turn the
        committed history shows completed is rebuilt from it (`resume.py`: its status and text are
        the server's; the stop reason is taken for `end_turn`). Every other one is asked for by id
        (`get_turn`, pipelined: `_call_all`): an ended turn's snapshot is its outcome
        (docs/protocol.md "Reconnect"), which the history cannot tell for a cancelled turn or a
        retryable 429. One `get_turn` does not answer for (a server without it, or with no record:
        `turn_not_found`) keeps the history's guess; with none there either it is `lost`, or
        followed on when the server without `get_turn` still holds queued inputs (they may hold it)."""
        messages = await self._history_with(ws, conv_id, set(missing), out)
        agent_id = (state.get("conversation") or {}).get("agent_id") or self._subscribed.get(conv_id) or ""
        revisions = {t: self._turns[t].revision + 1 for t in missing}
        guessed = {t: settled_from_history(t, conv_id, agent_id, messages, revisions[t]) for t in missing}
        ask = [t for t in missing if (g := guessed[t]) is None or g.get("status") != "completed"]
        now: dict[str, Mapping[str, Any]] = {}
        unknown: set[str] = set()  # turns the server has no record of
        asks = [{"type": "get_turn", "conversation": conv_id, "turn_id": t} for t in ask]
        for turn_id, reply in zip(ask, await self._call_all(ws, asks, out), strict=True):
            if isinstance(reply, ProtocolError):
                if reply.code == "turn_not_found":
                    unknown.add(turn_id)
                elif reply.code != "unknown_type":  # (a server without get_turn: the history's guess)
                    raise reply  # (the store, the cluster: this reconnect is tried again)
                continue
            snap = reply.get("snapshot")
            if isinstance(snap, dict) and snap.get("turn_id") == turn_id:
                now[turn_id] = snap
        for turn_id in missing:
            revision = revisions[turn_id]
            found = now.get(turn_id) or guessed[turn_id]
            if found is None and turn_id not in unknown and (state.get("queued") or 0) > 0:
                # a server without `get_turn`: still queued, its snapshots follow on this subscription
                continue
            if found is None:
                found = lost_snapshot(turn_id, conv_id, agent_id, revision)
            elif found.get("status") in TERMINAL and _revision(found) < revision:
                # the outcome is news whatever its number: never dropped as an old view (`_saw`)
                found = {**found, "revision": revision}
            out.append({"type": "turn_updated", "snapshot": found})

    async def _settle_unfollowable(
        self, ws: Any, conv_id: str, refusal: ProtocolError, out: list[dict[str, Any]]
    ) -> None:
        """The outcome of each followed turn of a conversation the server would not subscribe this
        client to again (`conversation_not_found`: its agent was deleted meanwhile, say): no more
        snapshot of them would come, and a caller waiting for one would wait forever. The turn's
        own terminal snapshot when the server still gives it (`get_turn`), else a `failed` one
        (`error.kind` `lost`) saying why; then the local `error` frame naming the conversation."""
        why = f"{refusal.code}: {refusal.message}"
        agent_id = self._subscribed.get(conv_id) or ""
        for turn_id, followed in [(t, f) for t, f in self._turns.items() if f.conversation_id == conv_id]:
            revision = followed.revision + 1
            snap: Mapping[str, Any] | None = None
            try:
                snap = await self._turn_now(ws, conv_id, turn_id, out)
            except ProtocolError as exc:
                if exc.code in FATAL_CODES or exc.code in TRANSIENT_CODES:
                    raise
            if snap is None or snap.get("status") not in TERMINAL:
                snap = _unfollowable_snapshot(turn_id, conv_id, agent_id, revision, why)
            elif _revision(snap) < revision:
                snap = {**snap, "revision": revision}  # the outcome is news whatever its number (`_saw`)
            out.append({"type": "turn_updated", "snapshot": snap})
        out.append(
            {
                "type": "error",
                "code": refusal.code,
                "message": f"could not resubscribe to {conv_id} after reconnecting: {refusal.message}",
                "local": True,
            }
        )

    async def _turn_now(self, ws: Any, conv_id: str, turn_id: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A followed turn as the server knows it now (`get_turn`): its current snapshot (queued or
        running: followed on; ended: its outcome, also that of a turn withdrawn from the queue,
        which left no message). None from a server without `get_turn` (the caller guesses from the
        history, as before it); `ProtocolError` `turn_not_found`: no record of it."""
        try:
            reply = await self._call(ws, {"type": "get_turn", "conversation": conv_id, "turn_id": turn_id}, out)
        except ProtocolError as exc:
            if exc.code == "unknown_type":
                return None
            raise
        snap = reply.get("snapshot")
        return snap if isinstance(snap, dict) and snap.get("turn_id") == turn_id else None

    async def _history_with(
        self, ws: Any, conv_id: str, turns: set[str], out: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The conversation's newest messages, paging back (a page stops at about 8 MiB: big
        messages after the turn pushed it off the first page) until every one of `turns` is
        reached, or the start, or HISTORY_PAGES pages."""
        messages: list[dict[str, Any]] = []
        before: int | None = None
        for _ in range(HISTORY_PAGES):
            frame: dict[str, Any] = {"type": "get_history", "conversation": conv_id, "limit": HISTORY_LIMIT}
            if before is not None:
                frame["before"] = before
            page = await self._call(ws, frame, out)
            got = list(page.get("messages") or [])
            messages = got + messages
            seen = {m.get("turn_id") for m in messages}
            if not got or not page.get("has_more") or turns <= seen or not isinstance(got[0].get("id"), int):
                break
            before = got[0]["id"]
        return messages

    def _forget(self, conv_id: str) -> None:
        self._subscribed.pop(conv_id, None)
        for t in [t for t, f in self._turns.items() if f.conversation_id == conv_id]:
            del self._turns[t]

    # ------------------------------------------------------------ bookkeeping

    def _dispatch(self, frame: dict[str, Any]) -> None:
        rid = frame.get("request_id")
        p = self._pending.pop(rid, None) if isinstance(rid, str) and rid else None
        if p is None:
            self._deliver(frame)
            return
        if frame.get("type") != "error":
            self._note_reply(p.frame, frame)
        if not p.future.done():
            p.future.set_result(frame)

    def _note_reply(self, sent: dict[str, Any], reply: dict[str, Any]) -> None:
        """Remember what to restore after a reconnect: subscriptions and turns being followed."""
        kind = sent.get("type")
        if kind == "subscribe" and reply.get("type") == "conversation_state":
            conv = reply.get("conversation")
            if not isinstance(conv, dict) or not isinstance(conv.get("id"), str):
                return
            self._subscribed[conv["id"]] = conv.get("agent_id")
            active = reply.get("active_turn")
            if (
                isinstance(active, dict)
                and isinstance(active.get("turn_id"), str)
                and active.get("status") not in TERMINAL
            ):
                self._turns.setdefault(active["turn_id"], _Followed(conv["id"])).revision = _revision(active)
        elif kind == "unsubscribe" and (reply.get("conversation_id") or sent.get("conversation")):
            # the ack names the id (`default` with an agent is resolved by the server)
            self._forget(str(reply.get("conversation_id") or sent["conversation"]))
        elif (
            kind in ("submit_input", "cron_run")
            and isinstance(reply.get("turn_id"), str)
            and isinstance(reply.get("conversation_id"), str)
        ):
            self._subscribed.setdefault(reply["conversation_id"], None)
            if not reply.get("duplicate"):
                self._turns.setdefault(reply["turn_id"], _Followed(reply["conversation_id"]))

    def _saw(self, turn_id: str, revision: int) -> bool:
        """Note `revision` of `turn_id`; False (and nothing noted) when it is not newer than one
        seen before: a snapshot older than what the caller was shown, or the same one again."""
        last = self._seen.get(turn_id)
        if last is not None and (revision <= last or last == ENDED):
            return False
        self._seen[turn_id] = revision
        self._seen.move_to_end(turn_id)
        if len(self._seen) > SEEN_TURNS_MAX:
            self._seen.popitem(last=False)
        return True

    def _deliver(self, frame: dict[str, Any]) -> None:
        snap = frame.get("snapshot")
        if frame.get("type") == "turn_updated" and isinstance(snap, dict):
            turn_id, conv_id = str(snap.get("turn_id") or ""), str(snap.get("conversation_id") or "")
            if turn_id and not self._saw(turn_id, _revision(snap)):
                # Revisions of a turn strictly increase (docs/protocol.md): an older snapshot (a
                # confused or hostile server; a restarted one before it kept revisions rising) would
                # show older text as the turn's, a second terminal one a different outcome. A
                # restarted server's snapshot of a turn it settled has a higher revision (restore.py).
                # Nothing after a terminal one: it is the turn's last.
                return
            if snap.get("status") in TERMINAL:
                self._turns.pop(turn_id, None)
                if turn_id:
                    self._seen[turn_id] = ENDED
            elif turn_id and conv_id in self._subscribed:
                self._turns.setdefault(turn_id, _Followed(conv_id)).revision = _revision(snap)
        if not self._frames.put(frame) and self._overflow is None:
            self._overflow = f"the client fell behind: {self._frames.limit} frames were left unread"

    def closed_message(self) -> str:
        """Why the connection is gone for good, as one line."""
        reason = self.close_reason or "closed"
        if reason.startswith("lost the server") or reason == self._overflow:
            return reason
        return f"the server closed the connection ({reason})"

    # ------------------------------------------------------------ sending

    async def _usable(self) -> None:
        while not self._connected.is_set():
            await self._connected.wait()
        if self._gone:
            raise Closed("connection_closed", self.closed_message())

    @property
    def max_frame_bytes(self) -> int:
        """The biggest frame the server takes: what its welcome says, else the documented 4 MiB."""
        limit = self.welcome.get("max_frame_bytes")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
        return DEFAULT_MAX_FRAME_BYTES

    @property
    def gone(self) -> bool:
        """Whether the connection is gone for good (`closed_message()` says why)."""
        return self._gone

    def _encode(self, frame: dict[str, Any]) -> str:
        """The frame as sent; one bigger than the server takes is refused here (`frame_too_large`):
        the server would close the connection over it (1009). Its size is its UTF-8 bytes, as the
        server counts them (`encode_frame`)."""
        text, size = encode_frame(frame)
        limit = self.max_frame_bytes
        if size > limit:
            raise ProtocolError(
                "frame_too_large",
                f"the {frame.get('type')} frame would be {size:,} bytes, over the server's limit of "
                f"{limit:,} bytes per frame; it was not sent",
            )
        return text

    async def _send_raw(self, frame: dict[str, Any], pending: _Pending | None = None) -> None:
        """Send once a connection is up; a send that hits a dropped connection waits for the next."""
        while True:
            await self._usable()
            ws = self.ws
            text = self._encode(frame)
            try:
                await ws.send(text)
            except ConnectionClosed:
                if not self._reconnect:
                    raise Closed("connection_closed", self.closed_message()) from None
                if self.ws is ws and not self._gone:
                    self._connected.clear()  # the reader sees the close too and reconnects (or gives up)
                continue
            if pending is not None:
                pending.sent = True
            return

    async def send(self, frame: ClientFrame | dict[str, Any]) -> None:
        """Send a frame without waiting for a reply (e.g. `tool_result`)."""
        await self._send_raw(dict(frame))

    async def request(self, frame: ClientFrame | dict[str, Any], *, timeout: float | None = 30.0) -> dict[str, Any]:
        """Send a frame and wait for its reply (matched by request_id); `error` raises ProtocolError.
        A frame in flight when the connection drops is sent again only when that is safe
        (`resendable`), else fails with `Closed` `connection_lost`; an `approval_response` sent
        again reports each call its first send settled as accepted, marked `resent` (`own_answers`).
        Replies are matched by request_id: a caller's id still waiting for its reply is refused
        (ValueError), and the client's own ids skip the ones callers have in flight."""
        given = frame.get("request_id")
        if given:
            rid = str(given)
            if rid in self._pending:
                raise ValueError(f"request_id {rid!r} is already waiting for its reply on this connection")
        else:
            rid = f"r{next(self._ids)}"
            while rid in self._pending:
                rid = f"r{next(self._ids)}"
        sent: dict[str, Any] = {**frame, "request_id": rid}
        if self._gone:
            raise Closed("connection_closed", self.closed_message())
        pending = _Pending(sent, asyncio.get_running_loop().create_future())
        # the connection may fail this request while nobody awaits its future any more (a caller
        # that gave up, or one still waiting to send when the client closes): mark it seen
        pending.future.add_done_callback(_consume)
        self._pending[rid] = pending

        async def go() -> dict[str, Any]:
            await self._send_raw(sent, pending)
            return await pending.future

        try:
            reply = await asyncio.wait_for(go(), timeout) if timeout else await go()
        finally:
            self._pending.pop(rid, None)
        if reply.get("type") == "error":
            raise ProtocolError(reply.get("code", "error"), reply.get("message", ""), reply.get("param"))
        return own_answers(sent, reply) if pending.resent else reply

    # ------------------------------------------------------------ receiving

    async def next_frame(self, timeout: float | None = None) -> dict[str, Any]:
        """The next unsolicited frame; raises Closed when the connection is gone for good."""
        frame = await asyncio.wait_for(self._frames.get(), timeout) if timeout else await self._frames.get()
        if frame is None:
            raise Closed("connection_closed", self.closed_message())
        return frame

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            try:
                yield await self.next_frame()
            except Closed:
                return

    # ------------------------------------------------------------ conveniences

    async def submit(
        self, agent: str, text: str | list[dict[str, Any]], conversation: str = "default", **extra: Any
    ) -> dict[str, Any]:
        return await self.request(
            {"type": "submit_input", "agent": agent, "conversation": conversation, "input": text, **extra}
        )

    async def wait_turn(
        self,
        turn_id: str,
        *,
        after_revision: int = -1,
        settled: bool = True,
        timeout: float | None = None,
        on_frame: Callable[[dict[str, Any]], Awaitable[object]] | None = None,
    ) -> dict[str, Any]:
        """Read frames until the turn's snapshot is terminal (or awaiting, with `settled`); returns it."""

        async def go() -> dict[str, Any]:
            while True:
                frame = await self.next_frame()
                if on_frame is not None:
                    await on_frame(frame)
                snap = frame.get("snapshot")
                if frame.get("type") != "turn_updated" or not isinstance(snap, dict):
                    continue  # (a snapshot of the wrong shape is no news of the turn)
                if snap.get("turn_id") != turn_id or _revision(snap) <= after_revision:
                    continue
                if snap.get("status") in TERMINAL or (settled and snap.get("status") == "awaiting"):
                    return snap

        return await asyncio.wait_for(go(), timeout) if timeout else await go()


def _environment_proxy(target: str) -> str | None:
    """The proxy the environment names for `target` (websockets' own choice), checked here: a URL
    it cannot read is a `ConnectError` in our words, its password masked (urllib's message quotes
    the whole user part; a bad port or host was a traceback), as is a SOCKS proxy without the
    package it needs."""
    proxy = get_proxy(parse_uri(target))
    if proxy is None:
        return None

    def bad(why: str) -> ConnectError:
        said = f"invalid proxy URL {shown_url(proxy)!r} in the environment: {why}"
        return ConnectError("invalid_proxy", said, fatal=True)

    try:
        parsed = parse_proxy(proxy)
    except InvalidProxy as exc:  # (its own text quotes the proxy URL whole, password and all)
        raise bad(exc.msg) from None
    except ValueError:
        raise bad("its host or port cannot be read") from None
    if parsed.scheme.startswith("socks") and importlib.util.find_spec("python_socks") is None:
        raise bad("a SOCKS proxy needs the python-socks package, which is not installed")
    return proxy


class _ProxyTunnel(HTTPProxyConnection):
    """websockets' CONNECT to an HTTP proxy, told of the end of the stream once and settling its
    answer once. The library's fed its reader the end twice when the proxy closed the connection
    (`eof_received`, then `connection_lost`): the second raised `EOFError` inside a loop callback,
    which asyncio printed as a traceback. A connection lost before an answer is `InvalidProxyMessage`
    (the library's left the answer pending when the loss came without an error)."""

    def run_parser(self) -> None:
        if not self.response.done():
            super().run_parser()

    def eof_received(self) -> None:
        if not self.reader.eof:
            super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.reader.eof:
            self.reader.feed_eof()
        if not self.response.done():
            lost = InvalidProxyMessage("the proxy closed the connection")
            lost.__cause__ = exc if exc is not None else EOFError("the proxy closed the connection")
            self.response.set_exception(lost)


class _Connect(library_connect):
    """websockets' `connect`, through an HTTP(S) proxy by way of `_ProxyTunnel`, as the library's
    own `create_connection` goes through one (the proxy over TLS for https://, then the server's
    TLS inside the tunnel for wss://). Directly, or through a SOCKS proxy, it is the library's."""

    async def create_connection(self) -> ClientConnection:
        proxy = parse_proxy(self.proxy) if isinstance(self.proxy, str) else None
        if proxy is None or not proxy.scheme.startswith("http") or self.connection_kwargs:
            return await super().create_connection()  # (no loop arguments are passed: `_open`)
        ws_uri = parse_uri(self.uri)
        loop = asyncio.get_running_loop()
        transport, tunnel = await loop.create_connection(
            lambda: _ProxyTunnel(ws_uri, proxy, self.user_agent_header),
            proxy.host,
            proxy.port,
            ssl=True if proxy.scheme == "https" else None,
        )
        try:
            await tunnel.response
        except BaseException:
            transport.close()
            raise
        return await self._upgrade_in(transport, ws_uri)

    async def _upgrade_in(self, transport: asyncio.Transport, ws_uri: WebSocketURI) -> ClientConnection:
        """The WebSocket connection over the proxy's tunnel `transport` (TLS inside it for wss://)."""
        connection = self.protocol_factory(ws_uri)
        transport.set_protocol(connection)
        if ws_uri.secure:
            tls = await asyncio.get_running_loop().start_tls(
                transport, connection, ssl.create_default_context(), server_hostname=ws_uri.host
            )
            assert tls is not None
            transport = tls
        connection.connection_made(transport)
        return connection


def _proxy_failed(proxy: str, target: str, exc: ProxyError) -> ConnectError:
    """The proxy's failure to open the tunnel to the server, said of the proxy (its URL masked):
    what it answered the CONNECT with, as the status's standard phrase (its own reason phrase is
    any text it likes, a request header echoed say), or that it closed the connection. A 407 is
    fatal: the credentials the environment gives it are what it refuses, and will refuse again."""
    uri = parse_uri(target)
    where = f"the proxy {shown_url(proxy)} (from the environment)"
    connect = f"the CONNECT to {uri.host}:{uri.port}"
    if isinstance(exc, InvalidProxyStatus):
        status = exc.response.status_code
        said = f"{where} answered {connect} with HTTP {status} {_phrase(status)}"
        return ConnectError("proxy_failed", said, fatal=status == 407)
    if isinstance(exc, InvalidProxyMessage) and isinstance(exc.__cause__, (EOFError, OSError)):
        return ConnectError("proxy_failed", f"{where} closed the connection before answering {connect}")
    if isinstance(exc, InvalidProxyMessage):
        return ConnectError("proxy_failed", f"{where} answered {connect} with something other than HTTP")
    return ConnectError("proxy_failed", f"{where} did not open a connection to {uri.host}:{uri.port} ({exc})")


def _phrase(status: int) -> str:
    """The standard reason phrase of an HTTP status."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "(a status HTTP does not define)"


def _refused(url: str, status: int, body: bytes) -> ConnectError:
    """The upgrade the server answered with an HTTP error, said in one line: its status and, from
    its JSON error body (the OpenAI shape), its code and message."""
    code, said = f"http_{status}", ""
    try:
        error = json.loads(body.decode("utf-8")).get("error") or {}
        if isinstance(error.get("code"), str) and error["code"]:
            code = error["code"]
        if isinstance(error.get("message"), str):
            said = " ".join(error["message"].split())[:300]
    except (ValueError, AttributeError):
        pass
    detail = f"{status} {code}" + (f": {said}" if said else "")
    if status == 401:
        what = "refused the token" if code != "missing_api_key" else "requires a token"
    elif status == 403:
        what = "refused the connection"
    else:
        what = "refused the WebSocket connection"
    return ConnectError(
        code, f"the server at {shown_url(url)} {what} ({detail})", status=status, fatal=status in (401, 403)
    )


def _consume(future: asyncio.Future[dict[str, Any]]) -> None:
    if not future.cancelled():
        future.exception()
