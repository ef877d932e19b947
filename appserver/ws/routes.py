"""The WebSocket protocol endpoint at /ws (DESIGN §6, docs/protocol.md).

One reader (this endpoint: frames are handled in arrival order, replies queue in that order) and one
writer task per connection (drains the bounded outbound buffer). Nothing here awaits another
client's socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from appserver import __name__ as _pkg
from appserver.auth import AuthError, Principal
from appserver.errors import KernelError, NotFound
from appserver.providers.base import ToolSpec
from appserver.runtime.conversation import Decision
from appserver.runtime.kernel import SubmitRequest
from appserver.server import Server
from appserver.store.records import AgentRecord, ConversationRecord
from appserver.ws import frames as F
from appserver.ws.connection import Connection
from appserver.ws.hub import Hub
from cron.runlog import read_runs
from cron.service import SERVICE_KEY as CRON_SERVICE
from cron.service import CronService
from cron.store import CronNotFound, CronStoreError

log = logging.getLogger("appserver.ws")

SERVER_NAME = f"{_pkg}/0.1"
CLOSE_WAIT_S = 5.0


class FrameError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    # drop the discriminator tag pydantic puts first
    if len(loc) > 1:
        loc = loc[1:]
    param = ".".join(loc) or None
    kind = err.get("type")
    if kind == "missing":
        return f"missing field {param!r}", param
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param
    return f"{param or 'frame'}: {err.get('msg')}", param


def parse_client_frame(text: str | None) -> Any:
    if text is None:
        raise FrameError("bad_frame", "binary frames are not part of this protocol; send JSON text")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise FrameError("bad_json", "the frame is not valid JSON") from None
    if not isinstance(data, dict):
        raise FrameError("bad_frame", "a frame is a JSON object with a 'type'")
    kind = data.get("type")
    if not isinstance(kind, str) or not kind:
        raise FrameError("bad_frame", "missing field 'type'", "type")
    if kind not in F.CLIENT_TYPES:
        raise FrameError("unknown_type", f"unknown frame type {kind[:64]!r}", "type")
    try:
        return F.client_frame.validate_python(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise FrameError("bad_frame", message, param) from None


class Endpoint:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.hub = Hub(server)
        server.services["ws_hub"] = self.hub  # serve's signal handler tells clients it is stopping

    async def __call__(self, websocket: WebSocket) -> None:
        limits = self.server.config.limits
        await websocket.accept()
        conn = Connection(websocket.send_text, outbound_max=limits.ws_outbound_max, send_timeout_s=limits.ws_send_timeout_s)
        state = websocket.scope.get("state") or {}
        if not state.get("auth_pending"):
            conn.principal = state.get("principal") or Principal.local()
        self.hub.register(conn)
        sender = asyncio.get_running_loop().create_task(conn.run_sender(), name=f"ws-send:{conn.id}")
        reader = asyncio.get_running_loop().create_task(self._read(websocket, conn), name=f"ws-read:{conn.id}")
        closing = asyncio.get_running_loop().create_task(conn.closing.wait())
        try:
            await asyncio.wait({reader, closing, sender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
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
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            request_id = None
            try:
                frame = parse_client_frame(text)
                request_id = frame.request_id
                await self.dispatch(websocket, conn, frame)
            except FrameError as exc:
                if request_id is None and text:
                    request_id = _peek_request_id(text)
                conn.send({"type": "error", "request_id": request_id, "code": exc.code, "message": exc.message, "param": exc.param})
            except KernelError as exc:
                conn.send({"type": "error", "request_id": request_id, "code": exc.code, "message": exc.message, "param": exc.param})
            except AuthError as exc:
                conn.send({"type": "error", "request_id": request_id, "code": exc.code, "message": exc.message})
                conn.kill(F.CLOSE_AUTH, exc.message, flush=True)
                return
            except (WebSocketDisconnect, asyncio.CancelledError):
                raise
            except Exception as exc:
                log.exception("ws frame failed")
                conn.send({"type": "error", "request_id": request_id, "code": "internal_error", "message": f"{type(exc).__name__}: the server could not handle this frame"})
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
            agent_id = None
            if frame.agent:
                agent_id = (await self._agent(conn, frame.agent)).id
            allowed = {a.id for a in await self.server.store.list_agents() if self._allows(conn, a)}
            convs = await self.server.store.list_conversations(agent_id, limit=frame.limit, offset=frame.offset)
            conn.send({"type": "conversations", "request_id": rid, "conversations": [c.to_dict() for c in convs if c.agent_id in allowed]})
        elif isinstance(frame, F.CreateConversation):
            agent = await self._agent(conn, frame.agent)
            fields: dict[str, Any] = {"metadata": frame.metadata or {}}
            if frame.title:
                fields["title"] = frame.title
            conv = await self.server.kernel.resolve_conversation(agent, "new", fields=fields)
            w = await self.hub.watch(conv.id)
            conn.send(w.state_frame(conn, conv.to_dict(), rid))
            self.hub.maybe_release(w)
        elif isinstance(frame, F.GetHistory):
            conv = await self._conversation(conn, frame.conversation, frame.agent)
            messages = await self.server.store.list_messages(conv.id, before_id=frame.before, limit=frame.limit)
            conn.send({"type": "history", "request_id": rid, "conversation_id": conv.id, "messages": [m.to_dict() for m in messages]})
        elif isinstance(frame, F.Subscribe):
            conv = await self._conversation(conn, frame.conversation, frame.agent)
            await self.hub.subscribe(conn, conv.id, conv.to_dict(), rid)
        elif isinstance(frame, F.Unsubscribe):
            was = self.hub.unsubscribe(conn, frame.conversation)
            conn.send({"type": "ack", "request_id": rid, "conversation_id": frame.conversation, "results": [{"subscribed": False, "was_subscribed": was}]})
        elif isinstance(frame, F.SubmitInput):
            await self.on_submit(conn, frame)
        elif isinstance(frame, F.ApprovalResponse):
            conv = await self._conversation(conn, frame.conversation, None)
            who = conn.client_name or (conn.principal.subject if conn.principal else None) or conn.id
            decisions = [Decision(d.call_id, d.decision, reason=d.reason, decided_by=who) for d in frame.decisions]
            results = await self.hub.approve(conn, conv.id, decisions)
            conn.send({"type": "ack", "request_id": rid, "conversation_id": conv.id, "results": results})
        elif isinstance(frame, F.Cancel):
            conv = await self._conversation(conn, frame.conversation, None)
            cancelled = await self.server.kernel.cancel(conv.id)
            conn.send({"type": "ack", "request_id": rid, "conversation_id": conv.id, "cancelled": cancelled})
        elif isinstance(frame, F.ToolResult):
            results = await self.hub.tool_result(conn, frame.call_id, frame.output, frame.is_error)
            if not results or not results[0].get("accepted"):
                r = results[0] if results else {}
                raise FrameError(r.get("error") or "unknown_call", r.get("message") or f"call {frame.call_id} is not waiting for a result", "call_id")
            conn.send({"type": "ack", "request_id": rid, "results": results})
        elif isinstance(frame, F.CronRun):
            await self.on_cron_run(conn, frame)
        else:  # pragma: no cover - parse_client_frame only yields known frames
            raise FrameError("unknown_type", f"unhandled frame {frame.type}")

    async def on_hello(self, websocket: WebSocket, conn: Connection, frame: F.Hello) -> None:
        if conn.greeted:
            raise FrameError("already_greeted", "hello was already accepted on this connection")
        if frame.protocol != F.PROTOCOL_VERSION:
            conn.send({"type": "error", "request_id": frame.request_id, "code": "unsupported_protocol", "message": f"this server speaks protocol {F.PROTOCOL_VERSION}, not {frame.protocol}"})
            conn.kill(F.CLOSE_PROTOCOL, "unsupported protocol version", flush=True)
            return
        if conn.principal is None:
            authenticate = websocket.scope.get("state", {}).get("authenticate_hello")
            if authenticate is None:  # pragma: no cover - the guard always provides it
                raise AuthError(401, "auth_required", "this connection is not authenticated")
            conn.principal = authenticate(frame.token)
        conn.greeted = True
        conn.client_name = (frame.client or "")[:64] or None
        conn.send({"type": "welcome", "request_id": frame.request_id, "protocol": F.PROTOCOL_VERSION, "server": SERVER_NAME, "connection_id": conn.id, "subject": conn.principal.subject})

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
        source = dict(frame.source or {})
        source.setdefault("connection", conn.id)
        sub = await self.server.kernel.submit(
            SubmitRequest(
                agent=agent.id,
                input=content,
                conversation=frame.conversation,
                source=source,
                idempotency_key=frame.idempotency_key,
                client_tools=[ToolSpec(t.name, t.description, t.parameters) for t in frame.client_tools],
            )
        )
        # the ack first, then (synchronously after it) the subscription: the client sees the ack
        # before any turn_updated of this turn.
        conn.send({"type": "ack", "request_id": frame.request_id, "turn_id": sub.turn_id, "conversation_id": sub.conversation_id, "queue_position": sub.queue_position, "duplicate": sub.duplicate})
        await self.hub.adopt_submission(conn, sub.conversation_id, sub.handle, set(names), sub.duplicate)
        snap = sub.handle.controller.snapshot()
        if snap.terminal:  # a duplicate of a finished turn: show its result
            conn.send({"type": "turn_updated", "snapshot": snap.to_dict()})

    async def on_cron_run(self, conn: Connection, frame: F.CronRun) -> None:
        """`appserver cron run` beside a live server: this server fires the task through its cron
        service (the same claim, envelope, run log and outcome as the in-process run), so two
        processes never run turns on one home. Answered and subscribed like submit_input."""
        if conn.principal is None or not conn.principal.has_scope("admin"):
            raise FrameError("forbidden", "cron_run needs a credential with the 'admin' scope")
        service = self.server.services.get(CRON_SERVICE)
        if not isinstance(service, CronService):
            raise FrameError("cron_unavailable", "this server runs no cron service")
        agent_id = (await self._agent(conn, frame.agent)).id if frame.agent else None
        store = service.scheduler.store
        try:
            task = (await asyncio.to_thread(store.read)).find(frame.task, agent_id)
            owner = await self.server.store.get_agent(task.agent)
            if conn.principal.agents is not None and (owner is None or not self._allows(conn, owner)):
                raise FrameError("forbidden", f"this credential may not use the agent of task {task.name!r}", "task")
            result = await service.run_now(task.id, agent=task.agent)
        except CronNotFound as exc:
            raise NotFound(str(exc), param="task") from None
        except CronStoreError as exc:
            raise FrameError("invalid_request", str(exc), "task") from None
        number = result.occurrence.number
        turn = await self.server.store.get_turn(result.turn_id) if result.turn_id else None
        if turn is None:
            last = await asyncio.to_thread(read_runs, store.runs_dir, task.id, limit=1)
            detail = (last[-1].get("error") if last else None) or "no detail"
            raise FrameError("fire_failed", f"run #{number} of {task.name} could not be submitted: {detail}", "task")
        occurrence = {"task_id": task.id, "task_name": task.name, "agent_id": task.agent, **result.occurrence.to_dict()}
        conn.send({"type": "ack", "request_id": frame.request_id, "turn_id": turn.id, "conversation_id": turn.conversation_id, "results": [occurrence]})
        handle = await self.server.kernel.handle_for(turn)
        await self.hub.adopt_submission(conn, turn.conversation_id, handle, set(), False)
        snap = handle.controller.snapshot()
        if snap.terminal:  # the turn ended before the subscription: show its result
            conn.send({"type": "turn_updated", "snapshot": snap.to_dict()})

    # ------------------------------------------------------------ access

    @staticmethod
    def _allows(conn: Connection, agent: AgentRecord) -> bool:
        return conn.principal is not None and conn.principal.allows_agent(agent.id, agent.name)

    async def _agent(self, conn: Connection, ref: str) -> AgentRecord:
        agent = await self.server.kernel.resolve_agent(ref)
        if not self._allows(conn, agent):
            raise FrameError("forbidden", f"this credential may not use agent {ref!r}", "agent")
        return agent

    async def _conversation(self, conn: Connection, ref: str, agent_ref: str | None) -> ConversationRecord:
        if ref in ("default", "new"):
            if ref == "new" or not agent_ref:
                raise FrameError("bad_frame", "give a conversation id (or 'default' with an agent)", "conversation")
            agent = await self._agent(conn, agent_ref)
            return await self.server.kernel.resolve_conversation(agent, "default", create=True)
        conv = await self.server.store.get_conversation(ref)
        if conv is None:
            raise NotFound(f"unknown conversation {ref!r}", code="conversation_not_found", param="conversation")
        owner = await self.server.store.get_agent(conv.agent_id)
        if owner is None or not self._allows(conn, owner):
            raise FrameError("forbidden", f"this credential may not use conversation {ref!r}", "conversation")
        return conv


def _peek_request_id(text: str) -> str | None:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    rid = data.get("request_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) else None


def ws_routes(server: Server) -> list[BaseRoute]:
    endpoint = Endpoint(server)
    server.services["ws_hub"] = endpoint.hub

    async def ws_endpoint(websocket: WebSocket) -> None:
        await endpoint(websocket)

    return [WebSocketRoute("/ws", ws_endpoint)]
