"""A live WebSocket under the guard: serialised sends, the close the guard may impose (oversized
frame, revoked or expired credential, the `hello` window running out) and the authentication of
the `hello` frame for a socket upgraded without credentials.

The protocol calls `authenticate_hello` synchronously. When the token store cannot answer for the
hello's token from memory (auth/pgtokens.py: a token it does not know, records too old), the
session has already waited for its read of the database when the frame arrived (`settle_hello`,
off the event loop, bounded), so that call answers from memory: never a database read on the
loop, never a 500 (503 `store_unavailable` when the database did not answer).

A socket that never authenticated is any client's: its refused hello and its close (the hello
window ran out, an oversized frame, the protocol's close after a refused hello) are logged through
the guard's `RefusalLog` (bounded, shared with the guard's other refusals), one line per socket;
the closes of authenticated sockets (expired, revoked) are logged as they are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from appserver.auth import HELLO_GRACE_S, REVOCATION_POLL_S, Authenticator, AuthError, Principal, TokensStale
from appserver.security.asgi import ASGIApp, Message, Receive, Refusal, Scope, Send, prove
from appserver.security.authentication import WS_SCOPE
from appserver.security.limits import TOO_MANY_CONNECTIONS, SlotHold, slot_key
from appserver.security.refusals import RefusalLog, error_json, rejection_why
from appserver.ws.connection import WRITE_FRAME, close_reason

log = logging.getLogger("appserver.guard")

WS_CLOSE_AUTH = 4401  # credential missing/expired on a live socket (4000-4999: application codes)
WS_CLOSE_TOO_BIG = 1009
CLOSE_SEND_TIMEOUT_S = 5.0
# A socket waiting for its hello that gave up its place to a newer one (limits.PendingSockets).
EVICTED_WHY = "newer sockets of this address are waiting for their hello"
EVICTED_REASON = "authentication timeout: " + EVICTED_WHY  # a close reason: at most 123 bytes


class ClientGone(OSError):
    """Raised to the app when it sends on a WebSocket the guard already closed (Starlette turns an
    OSError from send into WebSocketDisconnect, as it does for a vanished client)."""


class WsSession:
    """Per-WebSocket state: serialised sends, the close the guard may impose, the auth timers."""

    def __init__(
        self,
        state: dict[str, Any],
        send: Send,
        authenticator: Authenticator,
        hello_deadline: float | None,
        path: str = "/ws",
        http_refusals: bool = False,
        hold: SlotHold | None = None,
        scope: Scope | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.state = state
        # the guard's, shared by all its refusal lines (one of its own only when run without a guard)
        self.refusals = refusals if refusals is not None else RefusalLog()
        self.refusal_logged = False  # its refused hello was logged: its close says nothing new
        # The connection slot the socket holds (guard.py): its address's until `hello` names a
        # credential, then the credential's (`[limits] connections_per_client` is per credential).
        self.hold = hold
        self.scope: Scope = scope or {"type": "websocket"}
        self.path = path
        # The server can answer a refused upgrade with an HTTP response (`websocket.http.response`).
        self.http_refusals = http_refusals
        self._send = send
        self.authenticator = authenticator
        self.hello_deadline = hello_deadline
        self.lock = asyncio.Lock()
        self.changed = asyncio.Event()
        self.accepted = False
        self.closed = False
        self.closed_by_guard: tuple[int, str] | None = None
        self._watcher: asyncio.Task[None] | None = None
        # the hello's token whose read `settle_hello` waited for: (token, since or its failure)
        self._hello_ready: tuple[object, float | AuthError] | None = None
        # a newer socket of its address took its place while it waited for its hello (`evict`)
        self.evicted = False
        self._evicting: asyncio.Task[None] | None = None
        if hold is not None and hold.pending is not None:
            hold.on_evict = self.evict

    def ensure_watch(self) -> None:
        """Run the deadline watcher if there is a deadline (or a revocable credential) and it is
        not running yet."""
        if self.closed or (self.next_deadline() is None and not self.revocable()):
            return
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self.watch())

    async def stop_watch(self) -> None:
        task, self._watcher = self._watcher, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await asyncio.wait_for(task, 1.0)
        except (asyncio.CancelledError, TimeoutError):
            pass

    def evict(self) -> None:
        """Closed (4401) to make room for a newer socket of its address still waiting for its hello
        (`limits.PendingSockets`): it waited longest without authenticating."""
        self.evicted = True
        if not self.closed:
            self._evicting = asyncio.get_running_loop().create_task(
                self.close(WS_CLOSE_AUTH, EVICTED_REASON, logged=False)  # PendingSockets logs, throttled
            )

    def authenticate_hello(self, token: str | None) -> Principal:
        """`_authenticate_hello`, its refusal logged among the guard's refusals (bounded)."""
        try:
            return self._authenticate_hello(token)
        except AuthError as exc:
            self.refusals.refused("websocket", self.path, exc.status, exc.code, " in hello" + rejection_why(exc))
            self.refusal_logged = True
            raise

    def _authenticate_hello(self, token: str | None) -> Principal:
        if self.closed:
            raise AuthError(401, "connection_closed", "the connection is closed")
        if self.evicted:
            raise AuthError(401, "auth_timeout", "authentication timeout: " + EVICTED_WHY)
        ready, self._hello_ready = self._hello_ready, None
        settled = ready[1] if ready is not None and ready[0] == token else None
        try:
            principal = self.authenticator.authenticate_hello(
                token, since=settled if isinstance(settled, float) else None
            )
        except TokensStale:
            if isinstance(settled, AuthError):
                raise settled from None
            raise AuthError(
                503, "store_unavailable", "the capability tokens could not be read from the database: retry"
            ) from None
        if not principal.has_scope(WS_SCOPE):
            raise AuthError(403, "insufficient_scope", f"this credential lacks the '{WS_SCOPE}' scope")
        if self.hold is not None:
            try:
                self.hold.move(slot_key(self.scope, principal))
            except Refusal as r:
                # What an upgrade with this credential in its Authorization header gets (429), as
                # an error frame; the protocol then closes with 4429.
                raise AuthError(
                    429,
                    TOO_MANY_CONNECTIONS,
                    "too many concurrent requests and WebSockets of this credential ([limits] connections_per_client)",
                ) from r
        self.state["principal"] = principal
        self.state["auth_pending"] = False
        prove(self.scope)  # the connection keeps its slot at the cap (edge.py)
        self.changed.set()
        self.ensure_watch()
        return principal

    async def settle_hello(self, message: Message) -> None:
        """A frame of a socket still waiting for its hello, before the app reads it: when it is the
        hello and the token store must read its database to answer for its token, wait for that
        read here (off the event loop, bounded), so that `authenticate_hello` answers from memory."""
        text = message.get("text")
        if self.authenticator.tokens is None or not isinstance(text, str) or '"hello"' not in text:
            return
        try:
            frame = json.loads(text)
        except (ValueError, RecursionError):
            return  # the protocol answers it
        if not isinstance(frame, dict) or frame.get("type") != "hello":
            return
        token = frame.get("token")
        try:
            since = await self.authenticator.settle_hello(token)
        except AuthError as exc:
            self._hello_ready = (token, exc)
            return
        if since is not None:
            self._hello_ready = (token, since)

    async def send(self, message: Message) -> None:
        async with self.lock:
            if self.closed_by_guard is not None:
                if message["type"] == "websocket.close":
                    return
                raise ClientGone(f"websocket closed by the server: {self.closed_by_guard[1]}")
            t = message["type"]
            if t == "websocket.close" and not self.accepted and not self.closed and self.http_refusals:
                await self._refuse_upgrade()
                return
            if t == "websocket.accept":
                self.accepted = True
            elif t in ("websocket.close", "websocket.http.response.start"):
                if t == "websocket.close" and not self.closed:
                    self._log_close(int(message.get("code") or 1000), str(message.get("reason") or ""))
                self.closed = True
                self.changed.set()
            await self._send(message)

    def _log_close(self, code: int, reason: str) -> None:
        """The app's close of a socket that never authenticated, as a refusal (the protocol logs
        the closes of others): unless its refused hello was logged already."""
        if self.state.get("auth_pending") and not self.refusal_logged:
            self.refusals.closed(self.path, code, reason)
            self.refusal_logged = True

    async def _refuse_upgrade(self) -> None:
        """The app closed before accepting (no WebSocket endpoint at this path): answer with an
        HTTP error like every other refusal (OpenAI error JSON, `x-request-id` added by the
        stamping `send`), not the server's bare `403 text/plain`."""
        self.closed = True
        self.changed.set()
        shown = self.path[:200]
        body, headers = error_json(
            403, "websocket_refused", f"no WebSocket endpoint at {shown}; the protocol is at /ws"
        )
        await self._send({"type": "websocket.http.response.start", "status": 403, "headers": headers})
        await self._send({"type": "websocket.http.response.body", "body": body})

    async def close(self, code: int, reason: str, *, logged: bool = True) -> None:
        """Close on the app's behalf (expiry, timeout, oversized frame); the app then sees a
        disconnect on receive and `ClientGone` on send."""
        async with self.lock:
            if self.closed:
                return
            self.closed = True
            reason = close_reason(reason)
            self.closed_by_guard = (code, reason)
            self.changed.set()
            msg: Message = {"type": "websocket.close", "code": code, "reason": reason}
            if logged and self.state.get("auth_pending"):
                self.refusals.closed(self.path, code, reason)  # any client's: bounded
            elif logged:
                log.info("closing websocket %s: %s", code, reason)
            try:
                await asyncio.wait_for(self._send(msg), CLOSE_SEND_TIMEOUT_S)
            except (OSError, RuntimeError, TimeoutError) as exc:
                log.debug("websocket close failed: %r", exc)

    def revocable(self) -> bool:
        p = self.state.get("principal")
        return isinstance(p, Principal) and p.kind == "token" and self.authenticator.tokens is not None

    def revoked(self, max_age_s: float = 0.0) -> bool:
        """The socket's capability token was revoked (`appserver token revoke`, any process)."""
        p = self.state.get("principal")
        return isinstance(p, Principal) and self.authenticator.revoked(p, max_age_s=max_age_s)

    def next_deadline(self) -> tuple[float, str] | None:
        if self.state.get("auth_pending"):
            if self.hello_deadline is None:
                return None
            return self.hello_deadline, "authentication timeout: no valid token in hello"
        p = self.state.get("principal")
        if isinstance(p, Principal):
            until = self.authenticator.valid_until(p)
            if until is not None:
                return until, "credential expired"
        return None

    async def watch(self) -> None:
        """Close the socket when the hello window or the credential's lifetime runs out, or when
        its token is revoked (polled every REVOCATION_POLL_S: one `stat` shared by all sockets)."""
        graced = False
        while not self.closed:
            if self.revoked(max_age_s=REVOCATION_POLL_S / 2):
                await self.close(WS_CLOSE_AUTH, "credential revoked")
                return
            nxt = self.next_deadline()
            poll = REVOCATION_POLL_S if self.revocable() else None
            if nxt is None and poll is None:
                return
            delay = 3600.0
            if nxt is not None:
                deadline, reason = nxt
                delay = deadline - time.time()
                if delay <= 0 and self.state.get("auth_pending") and not graced:
                    # once more after HELLO_GRACE_S: a hello in the socket is read first (a stall)
                    graced, delay = True, HELLO_GRACE_S
                elif delay <= 0:
                    await self.close(WS_CLOSE_AUTH, reason)
                    return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(delay, poll or 3600.0, 3600.0))
            except TimeoutError:
                pass


async def run_ws(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    state: dict[str, Any],
    authenticator: Authenticator,
    hello_timeout_s: float,
    frame_max: int,
    hold: SlotHold | None = None,
    *,
    refusals: RefusalLog | None = None,
) -> None:
    """Run the app on a WebSocket under its session: frame size, revocation, hello and expiry;
    `hold` is the socket's connection slot, which a `hello` that authenticates it moves;
    `refusals` the guard's refusal lines, which log what a socket that never authenticated causes."""
    pending = bool(state.get("auth_pending"))
    session = WsSession(
        state,
        send,
        authenticator,
        time.time() + hello_timeout_s if pending else None,
        path=str(scope.get("path") or "/"),
        http_refusals="websocket.http.response" in (scope.get("extensions") or {}),
        hold=hold,
        scope=scope,
        refusals=refusals,
    )
    state["authenticate_hello"] = session.authenticate_hello

    async def guarded_receive() -> Message:
        if session.closed_by_guard is not None:
            code, reason = session.closed_by_guard
            return {"type": "websocket.disconnect", "code": code, "reason": reason}
        message = await receive()
        t = message["type"]
        if t == "websocket.receive" and (session.closed_by_guard is not None or session.revoked()):
            # No frame is acted on once the credential is revoked, even before the poll sees it.
            await session.close(WS_CLOSE_AUTH, "credential revoked")
            code, reason = session.closed_by_guard or (WS_CLOSE_AUTH, "credential revoked")
            return {"type": "websocket.disconnect", "code": code, "reason": reason}
        if t == "websocket.receive" and frame_max > 0:
            data = message.get("bytes")
            size = len(data) if data is not None else len(message.get("text") or "")
            if size > frame_max // 4 and data is None:
                size = len((message.get("text") or "").encode("utf-8"))
            if size > frame_max:
                await session.close(WS_CLOSE_TOO_BIG, f"frame larger than {frame_max} bytes")
                return {"type": "websocket.disconnect", "code": WS_CLOSE_TOO_BIG}
        elif t == "websocket.disconnect":
            session.closed = True
            session.changed.set()
        if t == "websocket.receive" and state.get("auth_pending"):
            await session.settle_hello(message)
        return message

    extensions = scope.get("extensions") or {}
    write_frame = extensions.get(WRITE_FRAME)
    if write_frame is not None:
        # Frames written straight to the socket pass the session too: none once the guard closed
        # it (revoked, expired, too big), and none past a send holding the lock (it keeps its place).
        def guarded_write_frame(frame: bytes) -> bool:
            return not session.closed and not session.lock.locked() and write_frame(frame)

        scope = {**scope, "extensions": {**extensions, WRITE_FRAME: guarded_write_frame}}
    session.ensure_watch()
    try:
        await app(scope, guarded_receive, session.send)
    finally:
        await session.stop_watch()
        # Both refer back to the session, which refers to them: reference cycles that kept every
        # closed socket's session (its scope, hold, principal) until a full collection, which the
        # server makes rare (cli/serve.py).
        state.pop("authenticate_hello", None)
        if hold is not None:
            hold.on_evict = None
