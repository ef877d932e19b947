"""POST /v1/chat/completions: one agent turn per request, non-stream or SSE, with client tools.

Conversation: `X-Conversation-Id` header, else the history-prefix match (conversation_match).
Deltas come from snapshots: the new suffix of each text block since the last snapshot sent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from appserver.http.common import (
    Idempotency,
    TurnRun,
    approval_pending,
    client_pending,
    dumps,
    json_int,
    log,
    namespace_of,
    principal_of,
    read_json,
    resolve_model,
    settle_or_cancel,
    start_turn,
    stream_replay,
)
from appserver.http.conversation_match import (
    HEADER,
    ConversationMatcher,
    ViewItem,
    chain,
    merge_assistants,
    split_new_input,
)
from appserver.http.errors import ApiError, bad_request, error_body, turn_failure
from appserver.http.sse import SSEResponse
from appserver.providers.base import ToolSpec
from appserver.runtime.conversation import Decision
from appserver.runtime.snapshot import TERMINAL_STATUSES, TurnSnapshot
from appserver.store.records import AgentRecord

if TYPE_CHECKING:
    from appserver.http.metrics import Metrics
    from appserver.server import Server

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
FINISH = {"end_turn": "stop", "max_tokens": "length", "max_steps": "stop", "cancelled": "stop", "requires_client_tool": "tool_calls"}


# ---------------------------------------------------------------- request parsing


def content_of(content: Any, where: str) -> tuple[str, list[str]]:
    """(text, image urls) of a chat message's content."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of parts", f"{where}.content")
    texts: list[str] = []
    images: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}.content[{j}] must be an object", f"{where}.content")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{j}].text must be a string", f"{where}.content")
            texts.append(text)
        elif kind in ("image_url", "input_image"):
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise bad_request(f"{where}.content[{j}].image_url.url must be a string", f"{where}.content")
            images.append(url)
        # audio and file parts are accepted and ignored: the agent's models take text and images
    return "".join(texts), images


def view_of_messages(messages: Any) -> tuple[list[ViewItem], list[str]]:
    """(view items, system/developer texts) of a chat `messages` array."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    items: list[ViewItem] = []
    instructions: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", "messages")
        text, images = content_of(m.get("content"), where)
        if role in ("system", "developer"):
            items.append(ViewItem("system", text))
            if text.strip():
                instructions.append(text)
        elif role == "user":
            items.append(ViewItem("user", text, images))
        elif role == "assistant":
            calls = []
            raw_calls = m.get("tool_calls") or []
            if not isinstance(raw_calls, list):
                raise bad_request(f"{where}.tool_calls must be an array", "messages")
            for c in raw_calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    continue  # custom tool calls are not client function calls
                args = fn.get("arguments")
                calls.append({"id": str(c.get("id") or ""), "name": fn["name"], "arguments": args if isinstance(args, str) else ""})
            items.append(ViewItem("assistant", text, calls=calls))
        else:  # tool, function
            call_id = m.get("tool_call_id") if role == "tool" else m.get("name")
            if not isinstance(call_id, str):  # "" is schema-valid; as new input it matches no call
                raise bad_request(f"{where}.tool_call_id is required for a tool message", "messages")
            items.append(ViewItem("tool", text, call_id=call_id))
    return merge_assistants(items), instructions


def client_tools_of(tools: Any) -> list[ToolSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools")
    out: list[ToolSpec] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") not in ("function", None) or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}]: only function tools are supported", "tools", code="unsupported_tool")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name is required", "tools", code="invalid_function_name")
        params = fn.get("parameters")
        out.append(ToolSpec(name, str(fn.get("description") or ""), params if isinstance(params, dict) else {"type": "object", "properties": {}}))
    return out


def sampling_options(body: dict[str, Any], *, max_key: tuple[str, ...]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad_request(f"'{key}' must be a number", key)
            opts[key] = float(v)
    for key in max_key:
        v = body.get(key)
        if v is not None:
            v = json_int(v)
            if v is None:
                raise bad_request(f"'{key}' must be a positive integer", key)
            if v < 1:
                raise bad_request(f"'{key}' must be a positive integer", key, code="integer_below_min_value")
            opts["max_tokens"] = v
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be a string or an array of strings", "stop")
        if stop:
            opts["stop"] = stop
    for key in ("response_format", "tool_choice", "reasoning_effort"):
        if body.get(key) is not None:
            opts[key] = body[key]
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        opts["parallel_tool_calls"] = body["parallel_tool_calls"]
    return opts


def user_and_metadata(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    return user, dict(metadata or {})


def show_reasoning(agent: AgentRecord) -> bool:
    """The agent's presentation policy for reasoning on HTTP (params.reasoning = hidden turns it off)."""
    return str(agent.params.get("reasoning", "shown")) != "hidden"


# ---------------------------------------------------------------- rendering


def blocks_after(snap: TurnSnapshot, run: TurnRun) -> list[dict[str, Any]]:
    return list(snap.blocks[run.base_blocks :])


def render_text(blocks: list[dict[str, Any]], kind: str = "text") -> str:
    return "\n\n".join(b["text"] for b in blocks if b["type"] == kind and b["text"])


def usage_of(snap: TurnSnapshot) -> dict[str, Any]:
    u = snap.usage or {}
    prompt, completion = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))},
        "completion_tokens_details": {"reasoning_tokens": int(u.get("reasoning_tokens", 0))},
    }


def finish_of(snap: TurnSnapshot) -> str:
    if snap.status == "awaiting":
        return "tool_calls"
    return FINISH.get(snap.stop_reason or "end_turn", "stop")


def tool_calls_of(snap: TurnSnapshot) -> list[dict[str, Any]]:
    return [{"id": p["call_id"], "type": "function", "function": {"name": p["name"], "arguments": p["arguments"] or ""}} for p in client_pending(snap)]


def failure(snap: TurnSnapshot) -> ApiError:
    return turn_failure(snap.error)


# ---------------------------------------------------------------- the route


class ChatCompletions:
    def __init__(self, server: Server, metrics: Metrics) -> None:
        self.server = server
        self.metrics = metrics
        self.matcher = ConversationMatcher(server)

    async def post(self, request: Request) -> Response:
        principal = principal_of(request)
        body, raw = await read_json(request)
        agent, model_id = await resolve_model(self.server, principal, body.get("model"))
        n = body.get("n")
        if n is not None and n != 1:
            raise bad_request("only n=1 is supported: an agent gives one reply per turn", "n", code="unsupported_value")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", "stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = bool(stream_options.get("include_usage"))
        items, instructions = view_of_messages(body.get("messages"))
        tools = client_tools_of(body.get("tools"))
        options = sampling_options(body, max_key=("max_tokens", "max_completion_tokens"))
        if instructions:
            options["instructions"] = instructions
        user, metadata = user_and_metadata(body)
        prefix, new = split_new_input(items)
        users = [i for i in new if i.kind == "user"]
        results = [i for i in new if i.kind == "tool"]
        if not users and not results:
            raise bad_request("the last message must be a user message or tool results", "messages", code="missing_input")
        if users and results:
            raise bad_request("send tool results and a new user message in separate requests", "messages", code="mixed_input")

        idem, replay = await Idempotency.begin(self.server, request, principal, "chat.completions", raw)
        if replay is not None:
            return replay
        try:
            ns = namespace_of(principal)
            header = request.headers.get(HEADER)
            if header:
                place = await self.matcher.by_header(agent, ns, header, prefix, user, metadata)
            else:
                place = await self.matcher.by_prefix(agent, ns, prefix, user, metadata)
            content: Any = None
            if users:
                texts = [u.text for u in users]
                images = [url for u in users for url in u.images]
                text = "\n\n".join(t for t in texts if t)
                content = ([{"type": "text", "text": text}] if text else []) + [{"type": "image_url", "image_url": {"url": u}} for u in images] if images else text
            decisions = [Decision(r.call_id or "", "result", output=r.text) for r in results]
            run = await start_turn(
                self.server,
                agent,
                place.conversation_id,
                content=content,
                decisions=decisions,
                client_tools=tools,
                options=options,
                source={"kind": "openai_chat", "user": user} if user else {"kind": "openai_chat"},
                overlap_accept=not stream,  # a non-stream reply acknowledges only once the turn settled
            )
        except BaseException:
            if idem is not None:
                await idem.abandon()
            raise
        if not stream:
            # Let the turn's worker run up to its model call before this request sets up its wait:
            # that setup then overlaps the wait for the model instead of delaying the call.
            await asyncio.sleep(0)
        prefix_hash = chain(prefix)
        ctx = _Ctx(self, agent, model_id, run, idem, new, prefix_hash, show_reasoning(agent))
        if stream:
            return ctx.stream_response(include_usage)
        return await ctx.complete(request)


class _Ctx:
    def __init__(self, route: ChatCompletions, agent: AgentRecord, model_id: str, run: TurnRun, idem: Idempotency | None, new: list[ViewItem], prefix_hash: str, reasoning: bool) -> None:
        self.route = route
        self.server = route.server
        self.agent = agent
        self.model_id = model_id
        self.run = run
        self.idem = idem
        self.new = new
        self.prefix_hash = prefix_hash
        self.reasoning = reasoning
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.headers = {HEADER: run.conversation_id}
        self.keepalive = float(self.server.config.limits.sse_keepalive_s)

    def settled(self, snap: TurnSnapshot) -> bool:
        if snap.status in TERMINAL_STATUSES:
            return True
        # a client tool call ends the request; an approval waits for a WebSocket client (or the timeout)
        return snap.status == "awaiting" and bool(client_pending(snap)) and snap.revision > self.run.after_revision

    async def record_point(self, snap: TurnSnapshot, text: str, calls: list[dict[str, Any]]) -> None:
        if snap.status == "failed":
            return
        reply = ViewItem("assistant", text, calls=[{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls])
        await self.route.matcher.record(self.agent.id, self.run.conversation_id, chain([*self.new, reply], self.prefix_hash))

    # -------------------------------------------------------- non-stream

    async def complete(self, request: Request) -> Response:
        try:
            snap = await settle_or_cancel(request, self.run, self.settled)
            blocks = blocks_after(snap, self.run)
            text = render_text(blocks)
            if snap.status == "failed" and (not text or (snap.error or {}).get("kind") == "store"):
                raise failure(snap)  # a reply the store could not keep is no reply
            calls = tool_calls_of(snap) if snap.status == "awaiting" else []
            message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None, "refusal": None, "annotations": []}
            if calls:
                message["tool_calls"] = calls
            if self.reasoning:
                thought = render_text(blocks, "reasoning")
                if thought:
                    message["reasoning_content"] = thought
            body = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model_id,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_of(snap)}],
                "usage": usage_of(snap),
            }
        except BaseException:
            if self.idem is not None:
                await self.idem.abandon()
            raise
        data = dumps(body)
        if self.idem is not None:
            await self.idem.finish(200, "application/json", data, self.run.conversation_id)
        return Response(data, media_type="application/json", headers=self.headers, background=BackgroundTask(self.record_point_after, snap, text, calls))

    async def record_point_after(self, snap: TurnSnapshot, text: str, calls: list[dict[str, Any]]) -> None:
        """The history point, written once the reply is on the wire (off the latency path). It only
        serves the client's next request; the SQLite store writes it without yielding, so it lands
        before the server starts on that request."""
        try:
            await self.record_point(snap, text, calls)
        except Exception:
            log.exception("could not record the history point of conversation %s", self.run.conversation_id)

    # -------------------------------------------------------- stream

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        return dumps(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
        )

    def stream_response(self, include_usage: bool) -> Response:
        metrics = self.route.metrics
        finished = False

        async def produce() -> AsyncIterator[str | None]:
            nonlocal finished
            metrics.active_streams.inc()
            try:
                yield self.chunk({"role": "assistant", "content": ""})
                sent: dict[int, int] = {}  # block index → characters sent
                call_index: dict[str, int] = {}
                any_text = False
                last: TurnSnapshot | None = None
                async for snap in self.run.snapshots(self.keepalive):
                    if snap is None:
                        yield None
                        continue
                    last = snap
                    blocks = blocks_after(snap, self.run)
                    for i, b in enumerate(blocks):
                        if b["type"] == "text" or (b["type"] == "reasoning" and self.reasoning):
                            full = b["text"]
                            done = sent.get(i, 0)
                            if len(full) > done:
                                piece = full[done:]
                                if b["type"] == "text":
                                    if done == 0 and any_text:
                                        piece = "\n\n" + piece
                                    any_text = True
                                    yield self.chunk({"content": piece})
                                else:
                                    yield self.chunk({"reasoning_content": piece})
                                sent[i] = len(full)
                        elif b["type"] == "tool_call" and b.get("executor") == "client":
                            cid = b["call_id"]
                            args = b.get("arguments") or ""
                            if cid not in call_index:
                                call_index[cid] = len(call_index)
                                sent[i] = 0
                                yield self.chunk({"tool_calls": [{"index": call_index[cid], "id": cid, "type": "function", "function": {"name": b["name"], "arguments": ""}}]})
                            done = sent.get(i, 0)
                            if len(args) > done:
                                yield self.chunk({"tool_calls": [{"index": call_index[cid], "function": {"arguments": args[done:]}}]})
                                sent[i] = len(args)
                    if self.settled(snap):
                        break
                    if snap.status == "awaiting" and approval_pending(snap):
                        continue  # waiting for an approval from a WebSocket client, with keepalives
                assert last is not None
                if last.status == "failed" and not any_text:
                    err = failure(last)
                    yield dumps(error_body(err.status, err.message, code=err.code))
                    yield "[DONE]"
                    finished = True
                    return
                calls = tool_calls_of(last) if last.status == "awaiting" else []
                for c in calls:  # calls made before this request (not streamed above)
                    if c["id"] not in call_index:
                        call_index[c["id"]] = len(call_index)
                        yield self.chunk({"tool_calls": [{"index": call_index[c["id"]], **c}]})
                yield self.chunk({}, finish_of(last))
                if include_usage:
                    yield dumps({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id, "choices": [], "usage": usage_of(last)})
                yield "[DONE]"
                finished = True
                await self.record_point(last, render_text(blocks_after(last, self.run)), calls)
            finally:
                metrics.active_streams.dec()

        on_close = stream_replay(self.idem, self.run.conversation_id, lambda: finished)
        return SSEResponse(produce(), headers=self.headers, on_disconnect=self.run.cancel, on_close=on_close)  # type: ignore[return-value]
