"""The WebSocket protocol endpoint at /ws (DESIGN §6, docs/protocol.md).

One reader (this endpoint: frames are handled in arrival order, replies queue in that order) and one
writer task per connection (drains the bounded outbound buffer). Nothing here awaits another
client's socket.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from appserver import __name__ as _pkg
from appserver import strictjson
from appserver.auth import (
    HELLO_GRACE_S,
    HELLO_TIMEOUT_S,
    AuthError,
    Principal,
    conversation_namespace,
    namespace_allows,
    namespace_of,
    speaks_for_chats,
)
from appserver.channels import LedgerUnavailable, PairingRefused, pairing_decide, pairing_pending
from appserver.errors import KernelError, NotFound
from appserver.fsutil import os_error_line
from appserver.http.conversation_match import name_ids
from appserver.providers.base import ToolSpec
from appserver.runtime import Decision, SubmitRequest, TurnHandle
from appserver.runtime.kernel import COUNTED_FOR, NAMESPACE_DEFAULT_PREFIX, Submission
from appserver.security.asgi import greeted
from appserver.security.limits import TOO_MANY_OPEN_TURNS, TurnPlaces, open_turns_key
from appserver.server import Server
from appserver.shown import capped_message, shown
from appserver.store.base import StoreUnavailable, StoreValueRefused
from appserver.store.records import AgentRecord, ConversationRecord, TurnRecord
from appserver.ws.connection import WRITE_FRAME, Connection
from appserver.ws.hub import Hub
from cron.runlog import read_runs
from cron.service import CronService
from cron.store import CronNotFound, CronStoreError

if TYPE_CHECKING:
    from pydantic import ValidationError

    from appserver.ws import frames as F
    from cron.runner import RunNowResult
else:

    class _Frames:
        """`appserver.ws.frames`, imported at its first use: pydantic and the frame models cost
        ~80 ms of every `serve` start, and a server may never see a WebSocket frame. The first
        attribute read imports the module and puts it in place of this stand-in."""

        def __getattr__(self, name: str) -> Any:
            global F
            F = importlib.import_module("appserver.ws.frames")
            return getattr(F, name)

    F = _Frames()

log = logging.getLogger("appserver.ws")
T = TypeVar("T")

SERVER_NAME = f"{_pkg}/0.1"
CLOSE_WAIT_S = 5.0
# A namespaced credential's own "default" conversation has a derived id with a '~' (namespaced_id),
# which only its namespace may create: nobody can create it ahead of its owner (squatting).
OWNER_CACHE_MAX = 10_000  # conversation id -> (agent id, namespace); both never change


class FrameError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


_BRANCH_MISMATCH = frozenset(
    {"string_type", "list_type", "dict_type", "int_type", "bool_type", "model_type", "model_attributes_type"}
)


def _path(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a client reads it: `input[0].detail`, without the union branch
    labels (`str`, `list[tagged-union[…]]`) and discriminator tags pydantic inserts."""
    out = ""
    skip_tag = False
    for part in loc[1:]:  # loc[0] is the frame's own tag
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if skip_tag:
            skip_tag = False
            continue  # the tag of a tagged-union member, right after its index
        if "[" in part or part in ("str", "int", "bool", "float", "list", "dict", "none"):
            skip_tag = "tagged-union" in part
            continue
        out += f".{part}" if out else part
    return out


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One clear sentence for the client. A union (`input` is text or a list of parts) reports one
    error per branch: the deepest one is the branch the client meant."""
    errors = exc.errors()
    err = max(errors, key=lambda e: (e.get("type") not in _BRANCH_MISMATCH, len(e.get("loc", ()))))
    param = _path(tuple(err.get("loc", ()))) or None
    kind = err.get("type")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return f"missing field {param!r}", param
    if kind == "union_tag_invalid":
        where = f"{param}.{ctx.get('discriminator', 'type').strip(chr(39))}" if param else "type"
        return f"{where}: unknown type {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}", where
    if len(errors) > 1 and all(
        e.get("type") in _BRANCH_MISMATCH and _path(tuple(e.get("loc", ()))) == param for e in errors
    ):
        return f"{param or 'frame'}: expected a string or a list of parts", param  # no branch fits
    message = str(err.get("msg") or "invalid value")
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    return f"{param or 'frame'}: {message}", param


# The most stored text one `history` reply carries (at least one message, whatever its size): a
# page of a thousand 4 MiB messages was gigabytes read, encoded and queued at once, stalling every
# client of the server. A client pages on with `before` while `has_more` says so.
HISTORY_PAGE_BYTES = 8 * 1024 * 1024
# How much one frame may hold (issue 11.10 on this front end): a 4 MiB frame of 150,000 tiny client
# tools or input parts cost seconds of event-loop time to validate, so the counts are checked on
# the parsed JSON, before the frame models see it, and big frames are parsed with an object budget
# and refused beyond as many arrays or 4 times as many values (strictjson.loads `max_objects`).
MAX_CLIENT_TOOLS = 128  # OpenAI's limit on `tools` per request
# `source` kinds the server's own submitters write (the gateway's chats, cron's runs): believed by
# the schedule tool, so from another credential kept only as `claimed_kind` (`speaks_for_chats`).
SERVER_SOURCE_KINDS = frozenset({"channel", "cron_prompt"})
BUDGET_FROM_CHARS = strictjson.COUNT_FROM_BYTES  # a refused frame this small is parsed again for its request_id


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """`max_items`: entries in `input` / `decisions` (`[limits] max_messages`, as on HTTP);
    `max_objects`: JSON objects in one frame (as for HTTP bodies: 16 per item, at least 4,096), and
    as many arrays, and 4 times as many values (strings, numbers, ...)."""

    max_items: int = 2048
    max_objects: int = 16 * 2048

    @classmethod
    def from_max_messages(cls, max_messages: int) -> FrameLimits:
        return cls(max_items=max_messages, max_objects=max(4096, 16 * max_messages))


_LIST_CAPS = (("input", None), ("decisions", None), ("client_tools", MAX_CLIENT_TOOLS))


def parse_client_frame(text: str | None, limits: FrameLimits = FrameLimits()) -> Any:
    if text is None:
        raise FrameError("bad_frame", "binary frames are not part of this protocol; send JSON text")
    try:
        # also refuses what the store could not encode (lone surrogates), and a frame over
        # COUNT_FROM_BYTES of more objects or arrays than `max_objects` or 4 times as many values
        data = strictjson.loads(text, max_objects=limits.max_objects, hint="; send fewer items per frame")
    except strictjson.JsonRejected as exc:
        code = "bad_frame" if exc.code == "request_too_complex" else "bad_json"
        raise FrameError(code, exc.about("the frame")) from None
    if not isinstance(data, dict):
        raise FrameError("bad_frame", "a frame is a JSON object with a 'type'")
    for key, cap in _LIST_CAPS:
        items = data.get(key)
        most = cap or limits.max_items
        if isinstance(items, list) and len(items) > most:
            raise FrameError("bad_frame", f"{key}: at most {most} entries per frame, got {len(items)}", key)
    if "type" not in data:
        raise FrameError("bad_frame", "missing field 'type'", "type")
    kind = data["type"]
    if not isinstance(kind, str) or not kind:
        raise FrameError(
            "bad_frame",
            f"field 'type' must be a non-empty string naming the frame (e.g. \"hello\"), not {json.dumps(kind)[:64]}",
            "type",
        )
    if kind not in F.CLIENT_TYPES:
        raise FrameError("unknown_type", f"unknown frame type {kind[:64]!r}", "type")
    try:
        return F.client_frame.validate_python(data)
    except F.ValidationError as exc:
        message, param = _validation_message(exc)
        raise FrameError("bad_frame", message, param) from None


class Endpoint:
    def __init__(
        self, server: Server, hub: Hub, cron: CronService | None = None, places: TurnPlaces | None = None
    ) -> None:
        self.server = server
        self.hub = hub  # serve's signal handler holds it too: it tells clients the server is stopping
        self.cron = cron  # the `cron_run` frame fires tasks through it
        self._owners: dict[str, tuple[str, str | None]] = {}  # conversation id -> (agent id, namespace)
        self.frame_limits = FrameLimits.from_max_messages(int(server.config.limits.max_messages))
        # the turns each credential holds open (`[limits] open_turns_per_client`), with the HTTP routes
        self.places = places or TurnPlaces(server)
        self.open_turns = self.places.open_turns
        # (idempotency scope, credential's key) -> the first of a submit's copies in flight: True
        # once its turn is accepted (`_first_copy`)
        self._flights: dict[tuple[str, str], asyncio.Future[bool]] = {}

    async def __call__(self, websocket: WebSocket) -> None:
        limits = self.server.config.limits
        await websocket.accept()
        extensions = websocket.scope.get("extensions") or {}
        write_frame = extensions.get(WRITE_FRAME)
        transport = _transport_of(extensions)
        client = websocket.scope.get("client")
        conn = Connection(
            websocket.send_text,
            outbound_max=limits.ws_outbound_max,
            outbound_max_bytes=limits.ws_outbound_max_bytes,
            send_timeout_s=limits.ws_send_timeout_s,
            write_frame=write_frame,
            unsent=_unsent_of(transport) if transport is not None else None,
            abort=transport.abort if transport is not None else None,
            budget=self.hub.outbound_budget,
            address=str(client[0]) if client else None,
        )
        state = websocket.scope.get("state") or {}
        if not state.get("auth_pending"):
            conn.principal = state.get("principal") or Principal.local()
        self.hub.register(conn)
        sender = asyncio.get_running_loop().create_task(conn.run_sender(), name=f"ws-send:{conn.id}")
        reader = asyncio.get_running_loop().create_task(self._read(websocket, conn), name=f"ws-read:{conn.id}")
        closing = asyncio.get_running_loop().create_task(conn.closing.wait())
        # A socket authenticated at the upgrade (or in auth mode `none`) has no authentication
        # window (the guard's): it still owes its hello, or it held a connection slot for good
        # (256 local sockets that never said hello locked every local client out).
        overdue = None
        if not state.get("auth_pending"):
            hello_timeout_s = float(state.get("hello_timeout_s") or HELLO_TIMEOUT_S)
            loop = asyncio.get_running_loop()
            overdue = loop.call_later(hello_timeout_s, _hello_overdue, conn, hello_timeout_s, True)
        try:
            await asyncio.wait({reader, closing, sender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                await self._end(websocket, conn, reader, closing, sender, overdue)
            finally:
                conn.detach()  # what its transport still holds counts until it is sent or dropped

    async def _end(
        self,
        websocket: WebSocket,
        conn: Connection,
        reader: asyncio.Task[None],
        closing: asyncio.Task[Any],
        sender: asyncio.Task[None],
        overdue: asyncio.TimerHandle | None,
    ) -> None:
        if overdue is not None:
            overdue.cancel()
        reader.cancel()
        closing.cancel()
        await self.hub.disconnect(conn)
        request = conn.close_request
        if request is not None:
            # Let queued frames (an auth error, say) go out first, then close with the reason.
            if not sender.done():
                await asyncio.wait({sender}, timeout=0.5)
            sender.cancel()
            try:
                await asyncio.wait_for(websocket.close(request[0], request[1]), CLOSE_WAIT_S)
            except Exception as exc:  # the socket is gone or stuck: nothing more to say
                log.debug("close of %s failed: %r", conn.id, exc)
        else:
            sender.cancel()
        await asyncio.gather(sender, reader, return_exceptions=True)

    async def _read(self, websocket: WebSocket, conn: Connection) -> None:
        while True:
            # Backpressure: a client whose downlink is full sends no further request until it reads
            # (150 `get_history` of 100 bytes each queued 150 pages of 8 MiB for a client reading none).
            # Never for others' bytes alone: a connection holding next to nothing (before its
            # `hello`, say) is read, so the hello deadline only runs while the server reads.
            await conn.wait_for_room()
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            request_id = None
            try:
                frame = parse_client_frame(text, self.frame_limits)
                request_id = frame.request_id
                await self.dispatch(websocket, conn, frame)
            except FrameError as exc:
                if request_id is None and text:
                    request_id = _peek_request_id(text)
                if exc.code == "unknown_type" and not conn.greeted:
                    exc = FrameError("hello_required", "send hello first")  # any frame but hello, before it
                conn.send(_error(request_id, exc.code, exc.message, exc.param))
            except KernelError as exc:
                conn.send(_error(request_id, exc.code, exc.message, exc.param))
            except AuthError as exc:
                conn.send(_error(request_id, exc.code, exc.message))
                # neither a credential over its connection cap (429 at an upgrade) nor a token store
                # that could not answer (503) is an authentication failure
                code = {429: F.CLOSE_TOO_MANY, 503: F.CLOSE_TRY_AGAIN}.get(exc.status, F.CLOSE_AUTH)
                conn.kill(code, exc.message, flush=True)
                return
            except (WebSocketDisconnect, asyncio.CancelledError):
                raise
            except StoreValueRefused as exc:  # the client's value (a NUL the database cannot hold)
                conn.send(_error(request_id, "bad_frame", str(exc)))
            except StoreUnavailable as exc:  # the database's doing (a restart, a terminated session)
                log.warning("ws frame failed: %s", exc)
                conn.send(_error(request_id, "store_unavailable", str(exc)))
            except Exception as exc:
                said = os_error_line(exc) if isinstance(exc, OSError) else None
                if said is not None:  # a file of the home the disk refused (full, a quota, read-only): no bug
                    log.error("ws frame failed: %s", said)
                    conn.send(_error(request_id, "storage_error", said))
                else:
                    log.exception("ws frame failed")
                    self.server.store.note_failure(exc)  # the store's damage shows in /readyz
                    conn.send(
                        {
                            "type": "error",
                            "request_id": request_id,
                            "code": "internal_error",
                            "message": f"{type(exc).__name__}: the server could not handle this frame",
                        }
                    )
            # Nothing of the frame is kept while the next one is awaited: every socket held its last
            # message (up to the 4 MiB frame limit) and its parse for as long as its client sent
            # nothing more, outside the edge's inbound budget (250 sockets held ~1 GB so).
            del message
            text = frame = request_id = None
            if not conn.alive:
                return

    # ------------------------------------------------------------ frames

    async def dispatch(self, websocket: WebSocket, conn: Connection, frame: Any) -> None:
        rid = frame.request_id
        if isinstance(frame, F.Hello):
            await self.on_hello(websocket, conn, frame)
            return
        if not conn.greeted:
            raise FrameError("hello_required", "send hello first")
        if isinstance(frame, F.Ping):
            conn.send({"type": "pong", "request_id": rid})
        elif isinstance(frame, F.ListAgents):
            agents = [a.to_dict() for a in await self.server.store.list_agents() if self._allows(conn, a)]
            conn.send({"type": "agents", "request_id": rid, "agents": agents})
        elif isinstance(frame, F.ListConversations):
            convs = await self._list_conversations(conn, frame)
            more = len(convs) > frame.limit
            del convs[frame.limit :]
            reply: dict[str, Any] = {"type": "conversations", "request_id": rid}
            reply["conversations"] = [_view(c) for c in convs]
            reply["has_more"] = more
            reply["next"] = F.page_cursor(convs[-1].updated_at, convs[-1].id) if more else None
            conn.send(reply)
        elif isinstance(frame, F.CreateConversation):
            agent = await self._agent(conn, frame.agent)
            fields: dict[str, Any] = {"metadata": frame.metadata or {}, "namespace": _namespace(conn)}
            if frame.title:
                fields["title"] = frame.title
            conv = await self.server.kernel.resolve_conversation(agent, "new", fields=fields)
            self._remember(conv)
            w = await self.hub.watch(conv.id)
            conn.send(w.state_frame(conn, _view(conv), rid))
            self.hub.maybe_release(w)
        elif isinstance(frame, F.GetHistory):
            self.server.kernel.refuse_if_fenced()  # as subscribe: a server judged gone serves no conversation
            conv = await self._conversation(conn, frame.conversation, frame.agent)
            messages, more = await self.server.store.history_page(
                conv.id, before_id=frame.before, limit=frame.limit, max_bytes=HISTORY_PAGE_BYTES
            )
            conn.send(
                {
                    "type": "history",
                    "request_id": rid,
                    "conversation_id": conv.id,
                    "messages": [m.to_dict() for m in messages],
                    "has_more": more,
                }
            )
        elif isinstance(frame, F.Subscribe):
            conv = await self._conversation(conn, frame.conversation, frame.agent)
            await self.hub.subscribe(conn, conv.id, _view(conv), rid)
        elif isinstance(frame, F.Unsubscribe):
            conv_id = await self._unsubscribe_target(conn, frame)
            was = self.hub.unsubscribe(conn, conv_id)
            conn.send(
                {
                    "type": "ack",
                    "request_id": rid,
                    "conversation_id": conv_id,
                    "results": [{"subscribed": False, "was_subscribed": was}],
                }
            )
        elif isinstance(frame, F.SubmitInput):
            await self.on_submit(conn, frame)
        elif isinstance(frame, F.ApprovalResponse):
            conv = await self._conversation(conn, frame.conversation, None, with_agent=False)  # no `agent` field
            who = conn.client_name or _display_name(conn.principal.subject if conn.principal else None) or conn.id
            person = _display_name(frame.on_behalf_of)
            if person:
                who = f"{person} (via {who})"
            decisions = [Decision(d.call_id, d.decision, reason=d.reason, decided_by=who) for d in frame.decisions]
            results = await self.hub.approve(conn, conv.id, decisions)
            conn.send({"type": "ack", "request_id": rid, "conversation_id": conv.id, "results": results})
        elif isinstance(frame, F.Cancel):
            conv = await self._conversation(conn, frame.conversation, None, with_agent=False)  # no `agent` field
            cancelled = await self.server.kernel.cancel(conv.id, frame.turn_id)
            conn.send({"type": "ack", "request_id": rid, "conversation_id": conv.id, "cancelled": cancelled})
        elif isinstance(frame, F.GetTurn):
            self.server.kernel.refuse_if_fenced()  # as get_history
            conv = await self._conversation(conn, frame.conversation, None, with_agent=False)  # no `agent` field
            snapshot = await self._turn_snapshot(conv.id, frame.turn_id)
            conn.send({"type": "turn", "request_id": rid, "snapshot": snapshot})
        elif isinstance(frame, F.ToolResult):
            results = await self.hub.tool_result(conn, frame.call_id, frame.output, frame.is_error)
            if not results or not results[0].get("accepted"):
                r = results[0] if results else {}
                raise FrameError(
                    r.get("error") or "unknown_call",
                    r.get("message") or f"call {frame.call_id} is not waiting for a result",
                    "call_id",
                )
            conn.send({"type": "ack", "request_id": rid, "results": results})
        elif isinstance(frame, F.CronRun):
            await self.on_cron_run(conn, frame)
        elif isinstance(frame, F.PairingList | F.PairingDecide):
            if conn.principal is None or not conn.principal.has_scope("admin"):
                raise FrameError("forbidden", f"{frame.type} needs a credential with the 'admin' scope")
            if conn.principal.agents is not None:
                # A pairing lets a chat sender reach every agent its channel account routes to: a
                # credential limited to some agents (`--agents`) could open the others to anyone.
                raise FrameError(
                    "forbidden",
                    f"{frame.type} needs an admin credential for every agent; this one is limited to some "
                    "(token --agents), and a pairing opens a channel account's agents to its sender",
                )
            home = self.server.config.home
            store_url = self.server.config.store.url
            try:
                if isinstance(frame, F.PairingList):
                    results = await asyncio.to_thread(pairing_pending, home, store_url)
                else:
                    results = [await asyncio.to_thread(pairing_decide, home, frame.code, frame.decision, store_url)]
            except PairingRefused as exc:
                raise FrameError("invalid_request", str(exc), "code") from None
            except LedgerUnavailable as exc:
                raise FrameError("ledger_unavailable", str(exc)) from None
            conn.send({"type": "ack", "request_id": rid, "results": results})
        else:  # pragma: no cover - parse_client_frame only yields known frames
            raise FrameError("unknown_type", f"unhandled frame {frame.type}")

    async def _turn_snapshot(self, conversation_id: str, turn_id: str) -> dict[str, Any]:
        """The current snapshot of a turn of a conversation the caller may see (`get_turn`): the
        live one while it is open here, else rebuilt from the store (which keeps a turn withdrawn
        from the queue, and a turn another server of a cluster runs). A turn of another
        conversation is as unknown as one that never was."""
        turn = await self.server.store.get_turn(turn_id)
        if turn is None or turn.conversation_id != conversation_id:
            raise FrameError("turn_not_found", f"no turn {shown(turn_id)} in conversation {conversation_id}", "turn_id")
        handle = await self.server.kernel.handle_for(turn)
        return handle.controller.snapshot().to_dict()

    async def on_hello(self, websocket: WebSocket, conn: Connection, frame: F.Hello) -> None:
        if conn.greeted:
            raise FrameError("already_greeted", "hello was already accepted on this connection")
        if frame.protocol != F.PROTOCOL_VERSION:
            conn.send(
                {
                    "type": "error",
                    "request_id": frame.request_id,
                    "code": "unsupported_protocol",
                    "message": f"this server speaks protocol {F.PROTOCOL_VERSION}, not {frame.protocol}",
                }
            )
            conn.kill(F.CLOSE_PROTOCOL, "unsupported protocol version", flush=True)
            return
        if conn.principal is not None and conn.principal.kind != "none" and frame.token and frame.token.strip():
            # The upgrade carried a credential and hello another: which one should act? Taking the
            # upgrade's silently left a client believing it acted as the hello's credential.
            upgrade = _bearer(websocket.headers.get("authorization"))
            if upgrade is not None and upgrade != _bearer(frame.token):
                raise AuthError(
                    401,
                    "conflicting_credentials",
                    "two different credentials were given: one in the Authorization header of the upgrade and "
                    "another in hello.token; send one of them (or the same token in both)",
                )
        if conn.principal is None:
            authenticate = websocket.scope.get("state", {}).get("authenticate_hello")
            if authenticate is None:  # pragma: no cover - the guard always provides it
                raise AuthError(401, "auth_required", "this connection is not authenticated")
            conn.principal = authenticate(frame.token)
        conn.greeted = True
        # the edge reads this socket under the limits after `hello` from its next frame on
        greeted(websocket.scope, conn.group)
        # Shown to other clients (`approval_resolved.decided_by`) and to the model (a denial's
        # text): one line like `on_behalf_of`, never a "\nSYSTEM: …" or a bidi override.
        conn.client_name = _display_name(frame.client) or None
        conn.send(
            {
                "type": "welcome",
                "request_id": frame.request_id,
                "protocol": F.PROTOCOL_VERSION,
                "server": SERVER_NAME,
                "connection_id": conn.id,
                "subject": conn.principal.subject,
                "max_frame_bytes": int(self.server.config.limits.ws_frame_max_bytes),
            }
        )

    async def on_submit(self, conn: Connection, frame: F.SubmitInput) -> None:
        agent = await self._agent(conn, frame.agent)
        content: str | list[dict[str, Any]]
        if isinstance(frame.input, str):
            content = frame.input
        else:
            content = []
            for part in frame.input:
                if isinstance(part, F.TextPart):
                    content.append({"type": "text", "text": part.text})
                else:
                    image: dict[str, Any] = {"url": part.url}
                    if part.detail:
                        image["detail"] = part.detail
                    content.append({"type": "image_url", "image_url": image})
        names = [t.name for t in frame.client_tools]
        if len(set(names)) != len(names):
            raise FrameError("bad_frame", "client_tools names must be unique", "client_tools")
        ns = _namespace(conn)
        # Idempotency keys belong to the credential: another credential's key never matches (it
        # would hand over that credential's turn and subscribe to its conversation). Admin
        # credentials see every conversation, but their keys are still their own.
        if frame.idempotency_key == "":  # a mistake, not "no key": two copies would run twice
            raise FrameError(
                "bad_frame", "idempotency_key: give 1 to 256 characters, or leave it out", "idempotency_key"
            )
        key = frame.idempotency_key
        scope = _key_scope(conn)
        if key is not None and scope is not None:
            key = f"{scope}\x1f{key}"
        spec = _conversation_ref(frame.conversation, "give 'default', 'new' or a conversation id")
        fields: dict[str, Any] = {}
        if spec == "new":
            fields["namespace"] = ns
        elif spec == "default":
            if ns is not None:
                spec = await self._namespace_default(agent, ns)
            elif key is not None:
                spec = (await self.server.kernel.resolve_conversation(agent, "default")).id
        elif ns is not None:
            spec = await self._owned(conn, spec, agent)
        if key is not None and spec != "new":
            # The same input first sent to "new" and re-sent (after a reconnect) to the id its ack
            # named is one turn: the "new" submit keyed it by agent, not by conversation.
            earlier = await self.server.store.lookup_idempotency(_new_scope(agent.id), key)
            if earlier is not None and earlier.conversation_id == spec:
                await self._ack_earlier(conn, frame.request_id, earlier)
                return
        flight = (_new_scope(agent.id) if spec == "new" else spec, key) if key is not None else None
        mine: asyncio.Future[bool] | None = None
        while flight is not None and (mine := await self._first_copy(flight)) is None:
            # a copy sent at the same time was accepted: its turn, neither a place nor a conversation
            earlier = await self._keyed_earlier(agent, spec, key)
            if earlier is not None:
                await self._ack_earlier(conn, frame.request_id, earlier)
                return
        try:
            got = await self._accept(conn, frame, agent, spec, key, content, fields)
        except BaseException:
            self._land(flight, mine, False)
            raise
        self._land(flight, mine, True)  # the key names a turn now: its copies ask for it
        if isinstance(got, TurnRecord):
            await self._ack_earlier(conn, frame.request_id, got)  # a resend over the cap runs nothing
            return
        if got.duplicate:
            await self._may_show(conn, got.conversation_id)
        await self._acked(
            conn,
            frame.request_id,
            got.turn_id,
            got.conversation_id,
            got.handle,
            set(names),
            got.queue_position,
            got.duplicate,
        )

    async def _accept(
        self,
        conn: Connection,
        frame: F.SubmitInput,
        agent: AgentRecord,
        spec: str,
        key: str | None,
        content: str | list[dict[str, Any]],
        fields: dict[str, Any],
    ) -> Submission | TurnRecord:
        """Submit with a place of the credential's open turns; over the cap, the turn the key
        already names (a resend), else refused `too_many_open_turns`."""
        cap_key = open_turns_key(conn.principal)
        self._count_restored()
        if not self.open_turns.take(cap_key):
            earlier = await self._keyed_earlier(agent, spec, key)
            if earlier is None:
                raise FrameError(TOO_MANY_OPEN_TURNS, self.open_turns.refusal())
            return earlier
        source = dict(frame.source or {})
        speaks = conn.principal is not None and speaks_for_chats(conn.principal)
        if source.get("kind") in SERVER_SOURCE_KINDS and not speaks:
            # a chat's or a scheduled run's turn is the gateway's or cron's to say: kept as a claim
            source["claimed_kind"] = source.pop("kind")
        source.setdefault("connection", conn.id)
        request = SubmitRequest(
            agent=agent.id,
            input=content,
            conversation=spec,
            source=source,
            idempotency_key=key,
            client_tools=[ToolSpec(t.name, t.description, t.parameters, t.strict) for t in frame.client_tools],
            # whose place it holds, stored with the turn: a restart counts it again
            options={COUNTED_FOR: cap_key} if cap_key is not None else {},
            conversation_fields=fields,
            resolved=agent,
        )
        return await self._counted(cap_key, lambda: self._submit(request))

    def _count_restored(self) -> None:
        """Before the first place is taken: the turns the kernel takes up open are counted
        (`TurnPlaces.count_restored`). Never awaits."""
        self.places.count_restored()

    async def _first_copy(self, flight: tuple[str, str]) -> asyncio.Future[bool] | None:
        """Wait while copies of this input (one credential's, one conversation, one idempotency key,
        on any socket) are submitted: None once one was accepted; else this submit goes first, and
        its flight (resolved by `_land`) is returned. A copy that took a place or resolved "new"
        before the first committed was refused `too_many_open_turns` or left an empty conversation.
        Shielded: a copy whose socket closes leaves the first alone. The wait is the first's
        submit, bounded as every submit is."""
        while (ahead := self._flights.get(flight)) is not None:
            if await asyncio.shield(ahead):
                return None
        mine: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._flights[flight] = mine  # nothing awaited since the look: one first per flight
        return mine

    def _land(self, flight: tuple[str, str] | None, mine: asyncio.Future[bool] | None, accepted: bool) -> None:
        """The first copy's outcome: waiting copies ask for its turn, or (it failed) the next tries."""
        if flight is None or mine is None:
            return
        if self._flights.get(flight) is mine:
            del self._flights[flight]
        if not mine.done():
            mine.set_result(accepted)

    async def _submit(self, request: SubmitRequest) -> tuple[Submission, TurnHandle | None]:
        sub = await self.server.kernel.submit(request)
        return sub, None if sub.duplicate else sub.handle  # a duplicate accepted nothing new

    async def _counted(self, cap_key: str | None, start: Callable[[], Awaitable[tuple[T, TurnHandle | None]]]) -> T:
        """Run `start`, which accepts a turn (its handle) or none (None), with the place `cap_key`
        took for it: kept until that turn ends, given back when nothing was accepted or `start`
        failed. Shielded: a connection whose reader is cancelled meanwhile (its socket closed) must
        leave neither an accepted turn without its place nor a place without its turn."""
        if cap_key is None or self.open_turns.per_client <= 0:
            return (await start())[0]

        async def counted() -> T:
            try:
                result, handle = await start()
            except BaseException:
                self.open_turns.give_back(cap_key)
                raise
            if handle is None:
                self.open_turns.give_back(cap_key)
            else:
                self.places.hold(cap_key, handle)
            return result

        task = asyncio.get_running_loop().create_task(counted())
        task.add_done_callback(_retrieve)  # its error is the caller's, unless the caller left
        return await asyncio.shield(task)

    async def _keyed_earlier(self, agent: AgentRecord, spec: str, key: str | None) -> TurnRecord | None:
        """The turn an idempotency key already names (a resend of an accepted input), for a submit
        over the open-turn cap or a copy that waited for its first: answered as the duplicate it
        is, neither refused nor submitted."""
        if key is None:
            return None
        scope = _new_scope(agent.id) if spec == "new" else spec
        return await self.server.store.lookup_idempotency(scope, key)

    async def _ack_earlier(self, conn: Connection, rid: str | None, earlier: TurnRecord) -> None:
        """Ack the turn a key named before this submit (`duplicate`), if this credential may see it."""
        await self._may_show(conn, earlier.conversation_id)
        handle = await self.server.kernel.handle_for(earlier)
        await self._acked(
            conn, rid, earlier.id, earlier.conversation_id, handle, set(), handle.controller.queue_position, True
        )

    async def _may_show(self, conn: Connection, conversation_id: str) -> None:
        """Refuse a duplicate ack of a turn in a conversation this credential may not see: keys
        belong to a credential's name, and a token rotated under it without `admin` (which sees
        every conversation) keeps them. Every path that acks a duplicate asks this first (an ack
        subscribes and shows the turn's snapshot)."""
        ns = _namespace(conn)
        if ns is None:
            return
        conv = await self.server.store.get_conversation(conversation_id)
        if conv is None or not namespace_allows(ns, conv.namespace):
            raise FrameError(
                "invalid_request",
                "this idempotency_key was used for a conversation this credential may not see; use another key",
                "idempotency_key",
            )

    async def _acked(
        self,
        conn: Connection,
        rid: str | None,
        turn_id: str,
        conversation_id: str,
        handle: TurnHandle,
        tools: set[str],
        position: int,
        duplicate: bool,
    ) -> None:
        # the ack first, then (synchronously after it) the subscription: the client sees the ack
        # before any turn_updated of this turn.
        conn.send(
            {
                "type": "ack",
                "request_id": rid,
                "turn_id": turn_id,
                "conversation_id": conversation_id,
                "queue_position": position,
                "duplicate": duplicate,
            }
        )
        # subscribes, and shows the turn to a connection that missed it (Hub.adopt_submission)
        await self.hub.adopt_submission(conn, conversation_id, handle, tools, duplicate)

    async def on_cron_run(self, conn: Connection, frame: F.CronRun) -> None:
        """`appserver cron run` beside a live server: this server fires the task through its cron
        service (the same claim, envelope, run log and outcome as the in-process run), so two
        processes never run turns on one home. Answered and subscribed like submit_input."""
        if conn.principal is None or not conn.principal.has_scope("admin"):
            raise FrameError("forbidden", "cron_run needs a credential with the 'admin' scope")
        service = self.cron
        if service is None:
            raise FrameError("cron_unavailable", "this server runs no cron service")
        agent_id = (await self._agent(conn, frame.agent)).id if frame.agent else None
        store = service.scheduler.store
        try:
            task = (await asyncio.to_thread(store.read)).find(frame.task, agent_id)
            owner = await self.server.store.get_agent(task.agent)
            if conn.principal.agents is not None and (owner is None or not self._allows(conn, owner)):
                raise FrameError("forbidden", f"this credential may not use the agent of task {task.name!r}", "task")
            cap_key = open_turns_key(conn.principal)  # the run's turn counts against the credential that asked
            self._count_restored()
            if not self.open_turns.take(cap_key):
                raise FrameError(TOO_MANY_OPEN_TURNS, self.open_turns.refusal())
            result, turn, handle = await self._counted(cap_key, lambda: self._fire(service, task.id, task.agent))
        except CronNotFound as exc:
            raise NotFound(str(exc), param="task") from None
        except CronStoreError as exc:
            raise FrameError("invalid_request", str(exc), "task") from None
        number = result.occurrence.number
        if turn is None or handle is None:
            last = await asyncio.to_thread(read_runs, store.runs_dir, task.id, limit=1)
            detail = (last[-1].get("error") if last else None) or "no detail"
            raise FrameError("fire_failed", f"run #{number} of {task.name} could not be submitted: {detail}", "task")
        occurrence = {"task_id": task.id, "task_name": task.name, "agent_id": task.agent, **result.occurrence.to_dict()}
        conn.send(
            {
                "type": "ack",
                "request_id": frame.request_id,
                "turn_id": turn.id,
                "conversation_id": turn.conversation_id,
                "results": [occurrence],
            }
        )
        # the turn ended before the subscription: adopt_submission shows its result
        await self.hub.adopt_submission(conn, turn.conversation_id, handle, set(), False)

    async def _fire(
        self, service: CronService, task_id: str, agent_id: str
    ) -> tuple[tuple[RunNowResult, TurnRecord | None, TurnHandle | None], TurnHandle | None]:
        """Run a cron task now: (the run, its turn and handle, None when it could not be
        submitted), and the handle again for `_counted`."""
        result = await service.run_now(task_id, agent=agent_id)
        turn = await self.server.store.get_turn(result.turn_id) if result.turn_id else None
        handle = await self.server.kernel.handle_for(turn) if turn is not None else None
        return (result, turn, handle), handle

    # ------------------------------------------------------------ access

    @staticmethod
    def _allows(conn: Connection, agent: AgentRecord) -> bool:
        return conn.principal is not None and conn.principal.allows_agent(agent.id, agent.name)

    async def _agent(self, conn: Connection, ref: str) -> AgentRecord:
        agent = await self.server.kernel.resolve_agent(ref)
        if not self._allows(conn, agent):
            raise FrameError("forbidden", f"this credential may not use agent {shown(ref)}", "agent")
        return agent

    async def _conversation(
        self, conn: Connection, ref: str, agent_ref: str | None, *, with_agent: bool = True
    ) -> ConversationRecord:
        """The conversation a frame names, if this credential may see it (namespace_allows);
        unknown and not-yours get the same `conversation_not_found`. An `agent` given with an id
        must be the conversation's agent, as for `submit_input` (a client that shows "chatting with
        X" must not be handed a conversation of Y)."""
        agent: AgentRecord | None = None
        ref = _conversation_ref(
            ref, "give a conversation id (or 'default' with an agent)" if with_agent else "give a conversation id"
        )
        if ref.lower() in ("default", "new"):  # in any case, as over HTTP
            ref = ref.lower()
            if ref == "default" and agent_ref == "":  # given, but empty (`--agent "$UNSET"`)
                raise FrameError("bad_frame", "agent: give an agent name or id (it was empty)", "agent")
            if ref == "new" or not agent_ref:
                raise FrameError(
                    "bad_frame",
                    "give a conversation id (or 'default' with an agent)" if with_agent else "give a conversation id",
                    "conversation",
                )
            agent = await self._agent(conn, agent_ref)
            ns = _namespace(conn)
            if ns is None:
                return await self.server.kernel.resolve_conversation(agent, "default", create=True)
            ref = await self._namespace_default(agent, ns)
        elif agent_ref:
            agent = await self._agent(conn, agent_ref)
        conv: ConversationRecord | None = None
        ns = _namespace(conn)
        # Another namespace's conversation costs what an unknown one costs (one read per id, no
        # cache, no agent look-up), so that neither the answer nor its time tells them apart.
        for cid in name_ids(ref, ns):  # a name as X-Conversation-Id takes it: this caller's own
            found = await self.server.store.get_conversation(cid)
            if found is not None and namespace_allows(ns, found.namespace):
                conv = found
                break
        if conv is None:
            raise _not_found(ref, agent)
        self._remember(conv)
        owner = await self.server.store.get_agent(conv.agent_id)
        if owner is None or not self._allows(conn, owner) or (agent is not None and conv.agent_id != agent.id):
            raise _not_found(ref, agent)
        return conv

    async def _unsubscribe_target(self, conn: Connection, frame: F.Unsubscribe) -> str:
        """The conversation an `unsubscribe` names, read as `subscribe` reads it (`default` with
        `agent`; an `agent` with an id must be its agent; unknown, another agent's and another
        namespace's are `conversation_not_found`). An id this connection is subscribed to needs no
        look-up: `subscribe` checked it (and it stays removable if the conversation was deleted)."""
        ref = _conversation_ref(frame.conversation, "give a conversation id (or 'default' with an agent)")
        if not frame.agent and ref in conn.subscriptions and ref not in ("default", "new"):
            return ref
        return (await self._conversation(conn, ref, frame.agent)).id

    async def _owned(self, conn: Connection, ref: str, agent: AgentRecord) -> str:
        """The id of the conversation a submit names (a name as X-Conversation-Id takes it:
        `name_ids`); refused (as not found) when it is outside the caller's namespace or of another
        agent. Cached: a conversation's agent and namespace never change."""
        ns = _namespace(conn)
        for cid in name_ids(ref, ns):
            known = self._owners.get(cid)
            if known is None or not namespace_allows(ns, known[1]):
                # Only what a caller may see is cached: another namespace's conversation is read
                # each time, as an unknown one is (neither the answer nor its time tells them apart).
                conv = await self.server.store.get_conversation(cid)
                if conv is None or not namespace_allows(ns, conv.namespace):
                    continue
                known = self._remember(conv)
            if known[0] == agent.id:
                return cid
        raise _not_found(ref)

    def _remember(self, conv: ConversationRecord) -> tuple[str, str | None]:
        if len(self._owners) >= OWNER_CACHE_MAX:
            self._owners.pop(next(iter(self._owners)))
        entry = self._owners[conv.id] = (conv.agent_id, conv.namespace)
        return entry

    async def _namespace_default(self, agent: AgentRecord, ns: str) -> str:
        """The id of this namespace's own default conversation of `agent` (Kernel.default_conversation)."""
        conv = await self.server.kernel.default_conversation(agent, ns)
        self._remember(conv)
        return conv.id

    async def _list_conversations(self, conn: Connection, frame: F.ListConversations) -> list[ConversationRecord]:
        """The page of conversations this credential may see (its agents, its namespace), newest
        first, and one more when there is one (`has_more`); `offset` counts visible conversations
        only, `after` starts the page after the one its cursor names."""
        agent_id = (await self._agent(conn, frame.agent)).id if frame.agent else None
        ns = _namespace(conn)
        store = self.server.store
        assert conn.principal is not None
        agent_ids = None
        if conn.principal.agents is not None:
            agent_ids = {a.id for a in await store.agents_to_read() if self._allows(conn, a)}
        after = F.read_cursor(frame.after) if frame.after is not None else None
        return await store.list_conversations(
            agent_id, limit=frame.limit + 1, offset=frame.offset, after=after, agent_ids=agent_ids, namespace=ns
        )


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Read a finished task's outcome, so that an error nobody awaited any more is not logged as
    "never retrieved" (the caller of a shielded submit that left)."""
    if not task.cancelled():
        task.exception()


def _namespace(conn: Connection) -> str | None:
    """The connection's conversation namespace (None: admin or local, sees every conversation).
    Fails closed: a connection without a principal (unreachable after `hello`) sees nothing."""
    return conversation_namespace(conn.principal) if conn.principal is not None else "\x00unauthenticated"


def _key_scope(conn: Connection) -> str | None:
    """Whose `idempotency_key`s a connection's are: its credential's identity (`namespace_of`:
    kind and subject, so a rotated token of the same name keeps its keys), also for an `admin`
    credential, which sees every conversation but shares no keys with another admin. None (the
    key unprefixed, as stored before keys were per credential) for the local owner of auth mode
    `none`, the only caller of such a server. Fails closed like `_namespace`."""
    principal = conn.principal
    if principal is None:
        return "\x00unauthenticated"
    return None if principal.kind == "none" else namespace_of(principal)


def _conversation_ref(value: str, expected: str = "give a conversation id") -> str:
    """The conversation a frame names, read the same way by every frame (get_history, subscribe,
    unsubscribe, submit_input, approval_response, cancel): surrounding whitespace is not part of
    it (`" default "` is `default`, as submit_input always read it); nothing left is `bad_frame`."""
    ref = value.strip()
    if not ref:
        raise FrameError("bad_frame", f"conversation: {expected}", "conversation")
    return ref


def _transport_of(extensions: dict[str, Any]) -> Any | None:
    """The socket's transport, found through the edge's scope extensions (methods of its WebSocket
    protocol; the guard wraps `write_frame`, not `prove`): what it holds unsent counts in the
    connection's budget, and a connection evicted for the server's budget is aborted through it.
    None without the edge (a bare uvicorn): then only the queue is counted."""
    for offered in extensions.values():
        transport = getattr(getattr(offered, "__self__", None), "transport", None)
        if hasattr(transport, "get_write_buffer_size") and hasattr(transport, "abort"):
            return transport
    return None


def _unsent_of(transport: Any) -> Callable[[], int]:
    """The bytes `transport` holds unsent, 0 once it is gone: asyncio's TLS transport drops its
    protocol when it closes, and asking it then raises (AttributeError) instead of answering 0."""

    def unsent() -> int:
        try:
            return int(transport.get_write_buffer_size())
        except (AttributeError, RuntimeError):
            return 0

    return unsent


def _hello_overdue(conn: Connection, hello_timeout_s: float, first: bool) -> None:
    """The hello window ran out: closed, after one more look HELLO_GRACE_S later (a stall)."""
    if conn.greeted:
        return
    if first:
        asyncio.get_running_loop().call_later(HELLO_GRACE_S, _hello_overdue, conn, hello_timeout_s, False)
        return
    conn.kill(F.CLOSE_AUTH, f"hello timeout: no hello within {hello_timeout_s:g} s", flush=True)


def _bearer(value: str | None) -> str | None:
    """The token of an `Authorization` value or of `hello.token` (either may say `Bearer `)."""
    if value is None:
        return None
    token = value.strip()
    if token[:7].lower() == "bearer ":
        token = token[7:].strip()
    return token or None


def _new_scope(agent_id: str) -> str:
    """The idempotency scope `Kernel.submit` files a keyed submit to "new" under."""
    return f"new:{agent_id}"


def _error(request_id: Any, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An `error` frame answering a request: its message cut to a bounded size (it may quote the
    client's own values)."""
    return {"type": "error", "request_id": request_id, "code": code, "message": capped_message(message), "param": param}


def _not_found(ref: str, agent: AgentRecord | None = None) -> NotFound:
    """Unknown, not this credential's and (with `agent`) another agent's look the same."""
    of = f" for agent {agent.name}" if agent is not None else ""
    return NotFound(f"unknown conversation {shown(ref)}{of}", code="conversation_not_found", param="conversation")


def _view(conv: ConversationRecord) -> dict[str, Any]:
    """A conversation as clients see it; a namespace's own default says `default: true` too."""
    d = conv.to_dict()
    if conv.id.startswith(NAMESPACE_DEFAULT_PREFIX):
        d["default"] = True
    return d


_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"([^"\\]{0,256})"')
_SURROGATE = re.compile("[\ud800-\udfff]")


def _peek_request_id(text: str) -> str | None:
    """The `request_id` of a refused frame, for the error frame. A big frame (refused for its
    size or shape) is not parsed again: a look for the field is enough.

    Never raises: it runs while the refusal is answered, so anything escaping it would end the
    connection without an answer. Invalid JSON has no request_id; JSON the standard parser cannot
    hold (nesting too deep, an integer beyond `sys.get_int_max_str_digits`: a ValueError) gets
    the look for the field. A request_id that is not valid Unicode (a lone surrogate escape) is not
    echoed: the error frame could not be sent."""
    rid: Any = None
    try:
        if len(text) <= BUDGET_FROM_CHARS:
            data = json.loads(text)
            rid = data.get("request_id") if isinstance(data, dict) else None
        else:
            rid = _look_for_request_id(text)
    except json.JSONDecodeError:
        return None
    except (ValueError, RecursionError):
        rid = _look_for_request_id(text)
    if not isinstance(rid, str) or _SURROGATE.search(rid) is not None:
        return None
    return rid


def _look_for_request_id(text: str) -> str | None:
    m = _REQUEST_ID.search(text)
    return m.group(1) if m else None


def ws_routes(
    server: Server, hub: Hub, cron: CronService | None = None, places: TurnPlaces | None = None
) -> list[BaseRoute]:
    endpoint = Endpoint(server, hub, cron, places)

    async def ws_endpoint(websocket: WebSocket) -> None:
        await endpoint(websocket)

    return [WebSocketRoute("/ws", ws_endpoint)]


NAME_MAX_CHARS = 100  # `hello.client`, `on_behalf_of` as `decided_by` records them (display names)


def _display_name(name: str | None) -> str:
    """A name a client gives (`hello.client`, `approval_response.on_behalf_of`) as other clients
    and the model are shown it: one line (whitespace, control and format characters, bidi
    overrides among them, collapsed to single spaces), at most `NAME_MAX_CHARS` characters."""
    if not name:
        return ""
    flat = " ".join("".join(" " if not c.isprintable() else c for c in name).split())
    return flat[:NAME_MAX_CHARS].rstrip()
