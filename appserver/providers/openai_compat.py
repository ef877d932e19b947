"""The `openai` kind: any Chat Completions upstream (OpenAI, Ollama, vLLM, llama.cpp, LM Studio,
OpenRouter).

Every wire quirk of those servers is absorbed here so that the agent loop only sees typed chunks:
SSE split anywhere, `reasoning_content` vs `reasoning`, inline `<think>` tags, tool calls whose id
arrives late or whose index is missing, usage in a trailing chunk (or in every chunk), streams that
end without a finish reason, servers that ignore `stream: true`, and error bodies in several shapes.
The provider never retries: the agent loop owns that decision (retry.py).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

import httpx

from appserver import fastjson
from appserver.config import ProviderConfig
from appserver.providers.base import (
    ChatMessage,
    Done,
    FinishReason,
    ProviderChunk,
    ProviderError,
    ProviderRequest,
    Reasoning,
    Refusal,
    Text,
    ToolCallArgs,
    ToolCallStart,
    ToolSpec,
    Usage,
    error_from_status,
)
from appserver.providers.fasttransport import LeanClient, raw_headers
from appserver.providers.jsontext import loads, loads_event
from appserver.providers.sse import SSEDecoder
from appserver.providers.think import ThinkSplitter
from appserver.providers.upstream import (
    ACCEPT_ENCODING,
    ITEM_BYTES,
    AfterFinish,
    AnswerBudget,
    as_dict,
    as_str,
    check_answer_status,
    check_extra_headers,
    clip,
    decoded_body,
    default_client,
    describe_json,
    drain_rest,
    endpoint_url,
    error_message_from_body,
    finish_grace_s,
    key_for_header,
    read_answer,
    request_timeout,
    transport_error,
    unsendable_error,
)

# The request body as compact UTF-8 JSON, encoded here so that the lean transport gets bytes (a NaN
# or infinity, which no upstream accepts as a number, is written as null).
_encode_body = fastjson.dumps

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "eos": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "tool_use": "tool_calls",
    "length": "length",
    "max_tokens": "length",
    "content_filter": "content_filter",
}


def map_finish_reason(raw: Any) -> FinishReason:
    """Upstream finish reason → base.FinishReason (unknown values stay visible as "unknown")."""
    return _FINISH.get(raw, "unknown") if isinstance(raw, str) else "unknown"


# The `type` of a flat error chunk (vLLM's ErrorResponse, OpenAI's error types) → its HTTP status,
# for a chunk whose `code` says none.
_FLAT_ERROR_STATUS: dict[str, int] = {
    "BadRequestError": 400,
    "invalid_request_error": 400,
    "AuthenticationError": 401,
    "authentication_error": 401,
    "PermissionDeniedError": 403,
    "NotFoundError": 404,
    "not_found_error": 404,
    "RateLimitError": 429,
    "rate_limit_error": 429,
    "InternalServerError": 500,
    "server_error": 500,
}


def _http_status(value: Any) -> int | None:
    """`value` as an HTTP error status (an int, or its digits as text), or None."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) == 3:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
        return value
    return None


def flat_error(obj: dict[str, Any]) -> ProviderError | None:
    """The error a stream chunk without an `error` object holds: vLLM's flat ErrorResponse
    (`{"object": "error", "message", "type", "code": 400}`) or FastChat's (`{"text", "error_code":
    40303}`, its code the HTTP status and two more digits), both sent in a 200 stream and followed
    by `[DONE]`; None for any other chunk (the caller asks only of chunks without `choices`).
    Classified from its status as an error answer is."""
    if obj.get("object") == "error":
        status = _http_status(obj.get("code")) or _FLAT_ERROR_STATUS.get(as_str(obj.get("type")), 500)
        return error_from_status(status, error_message_from_body(obj, "upstream error"), body=obj)
    code = obj.get("error_code")
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        status = _http_status(code) or _http_status(code // 100 if code >= 10000 else None) or 500
        message = as_str(obj.get("text")) or error_message_from_body(obj, f"upstream error {code}")
        return error_from_status(status, message, body=obj)
    return None


# ---------------------------------------------------------------- response parsing


@dataclass(slots=True)
class _Call:
    index: int
    id: str = ""
    name: str = ""
    args: list[str] = field(default_factory=list)
    started: bool = False
    any_args: bool = False


def _arguments_text(args: Any, budget: AnswerBudget) -> str:
    """A call delta's `arguments` as text (a server that sends them as a JSON object: encoded),
    charged to the answer's budget; "" for none."""
    if isinstance(args, dict | list):
        text = json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):
        text = args
    else:
        return ""
    if text:
        budget.count(text)
    return text


def parse_usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None

    def num(d: Any, key: str) -> int:
        v = d.get(key) if isinstance(d, dict) else None
        if isinstance(v, float):
            return int(v) if math.isfinite(v) else 0  # NaN, Infinity, 1e400: no count
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    return Usage(
        input_tokens=num(raw, "prompt_tokens"),
        output_tokens=num(raw, "completion_tokens"),
        reasoning_tokens=num(raw.get("completion_tokens_details"), "reasoning_tokens"),
        cached_tokens=num(raw.get("prompt_tokens_details"), "cached_tokens"),
    )


class OpenAIStreamParser:
    """Chat Completions stream chunks (already JSON-decoded or raw SSE data) → provider chunks.

    Pure and synchronous so that the split-anywhere guarantees can be tested exhaustively.

    `max_bytes`: the most the answer's text, reasoning, refusal and tool-call arguments may hold
    together (UTF-8 bytes, as received): the event that would pass it raises `answer_too_large`
    (naming `provider`'s config) before any of its content is handed out.
    """

    def __init__(self, max_bytes: int | None = None, provider: str = "") -> None:
        self._budget = AnswerBudget(max_bytes, provider)
        self._think = ThinkSplitter()
        self._calls: list[_Call] = []
        self._by_key: dict[int, _Call] = {}
        self._by_id: dict[str, _Call] = {}  # calls by their id, for servers that send no index
        self._legacy: _Call | None = None  # the call of a legacy `function_call` answer (one at most)
        self._refused = False  # a refusal came: with answer text (`ThinkSplitter.texted`), no empty answer
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._answered = False  # a chunk held choice 0: the stream carried an answer, however empty
        self.events = 0
        self.saw_done = False

    @property
    def finished(self) -> bool:
        """A finish reason came: what may still follow is usage and `[DONE]` (providers/upstream.py
        `AfterFinish`)."""
        return self._finish is not None

    def feed_data(self, data: str) -> list[ProviderChunk]:
        """One SSE `data:` payload."""
        if self.saw_done:
            return []  # anything after [DONE] is noise
        self.events += 1
        if "[DONE]" in data and data.strip() == "[DONE]":
            self.saw_done = True
            return []
        try:
            obj = loads_event(data)
        except ValueError as exc:
            raise ProviderError("protocol", f"upstream sent malformed JSON: {exc}", body=data[:500]) from None
        if not isinstance(obj, dict):
            raise ProviderError("protocol", "upstream stream chunk is not an object", body=obj)
        return self.feed_chunk(obj)

    def feed_chunk(self, obj: dict[str, Any]) -> list[ProviderChunk]:
        err = obj.get("error")
        if err:  # OpenRouter, vLLM: an error in the middle of a 200 stream
            status = err.get("code") if isinstance(err, dict) else None
            status = status if isinstance(status, int) and 400 <= status <= 599 else 500
            raise error_from_status(status, error_message_from_body(obj, "upstream error"), body=obj)
        if "choices" not in obj:
            flat = flat_error(obj)
            if flat is not None:
                raise flat
        out: list[ProviderChunk] = []
        raw_usage = obj.get("usage")
        if raw_usage is not None:
            usage = parse_usage(raw_usage)
            if usage is not None:
                self._usage = usage  # cumulative when repeated: the last one wins
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return out
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue  # n > 1 is not supported; choice 0 is the answer
            self._answered = True
            delta = choice.get("delta")
            self._delta(delta if isinstance(delta, dict) else as_dict(choice.get("message")), out)
            fr = choice.get("finish_reason")
            if isinstance(fr, str) and fr:
                self._finish = fr
        return out

    def _delta(self, delta: dict[str, Any], out: list[ProviderChunk]) -> None:
        if (
            "reasoning_content" not in delta
            and "reasoning" not in delta
            and "tool_calls" not in delta
            and "function_call" not in delta
            and not delta.get("refusal")
        ):
            content = delta.get("content")  # the usual delta: text only, in fewer steps
            if content and type(content) is str:
                self._budget.count(content)
                out.extend(self._think.feed(content))
                return
        # vLLM sends `reasoning_content`, OpenRouter/Ollama `reasoning`; some send both, identical.
        reasoning = delta.get("reasoning_content")
        if not (isinstance(reasoning, str) and reasoning):
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._budget.count(reasoning)
            out.append(Reasoning(reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._budget.count(content)
            out.extend(self._think.feed(content))
        elif isinstance(content, list):  # a few servers stream content parts
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    self._budget.count(part["text"])
                    out.extend(self._think.feed(part["text"]))
        refusal = delta.get("refusal")  # OpenAI: the model declined (structured outputs, safety)
        tool_calls = delta.get("tool_calls")
        # The legacy shape (OpenAI's `functions` API, still sent by some servers): one call, no id.
        function_call = delta.get("function_call")
        if (
            (isinstance(refusal, str) and refusal)
            or (isinstance(tool_calls, list) and tool_calls)
            or (isinstance(function_call, dict) and function_call)
        ):
            out.extend(self._think.settle())  # text held back at the start comes before them
        if isinstance(refusal, str) and refusal:
            self._refused = True
            self._budget.count(refusal)
            out.append(Refusal(refusal))
        if isinstance(tool_calls, list):
            for tc in tool_calls:
                if isinstance(tc, dict):
                    self._tool_delta(tc, out)
        if isinstance(function_call, dict) and function_call:
            self._function_call_delta(function_call, out)

    def _slot(self, tc: dict[str, Any], call_id: str, name: str) -> _Call:
        wire = tc.get("index")
        if isinstance(wire, int) and not isinstance(wire, bool):
            slot = self._by_key.get(wire)
            # Same index but a different id: a server that numbers every call 0.
            if slot is not None and not (call_id and slot.id and call_id != slot.id):
                return slot
            key = wire
        else:
            existing = self._by_id.get(call_id) if call_id else None
            if existing is not None:
                return existing
            if not (call_id or name) and self._calls:
                return self._calls[-1]  # a bare argument fragment continues the last call
            key = -1 - len(self._calls)  # never collides with a wire index
        self._budget.charge(ITEM_BYTES)  # a call is stored with the answer, even one with no arguments
        slot = _Call(index=len(self._calls))
        self._calls.append(slot)
        self._by_key[key] = slot
        return slot

    def _function_call_delta(self, fn: dict[str, Any], out: list[ProviderChunk]) -> None:
        """A legacy `function_call` delta: the answer's one call, under an id made here (the
        format has none), streamed as a `tool_calls` call is."""
        slot = self._legacy
        if slot is None:
            self._budget.charge(ITEM_BYTES)
            slot = self._legacy = _Call(index=len(self._calls))
            self._calls.append(slot)
            slot.id = f"call_{uuid.uuid4().hex[:24]}"
            self._budget.count(slot.id)
        self._fill(slot, "", as_str(fn.get("name")), _arguments_text(fn.get("arguments"), self._budget), out)

    def _tool_delta(self, tc: dict[str, Any], out: list[ProviderChunk]) -> None:
        fn = as_dict(tc.get("function"))
        call_id = as_str(tc.get("id"))
        name = as_str(fn.get("name"))
        args = _arguments_text(fn.get("arguments"), self._budget)
        self._fill(self._slot(tc, call_id, name), call_id, name, args, out)

    def _fill(self, slot: _Call, call_id: str, name: str, args: str, out: list[ProviderChunk]) -> None:
        """One delta of a call (its id, name, a piece of its arguments), started once it has an
        id and a name; arguments that came before that are held until then."""
        if call_id and not slot.id:
            self._budget.count(call_id)
            slot.id = call_id
            self._by_id.setdefault(call_id, slot)
        if name and not slot.name:
            self._budget.count(name)
            slot.name = name  # servers that repeat the name on every delta: first one wins
        if slot.started:
            if args:
                slot.any_args = True
                out.append(ToolCallArgs(slot.index, args))
            return
        if args:
            slot.args.append(args)
        if slot.id and slot.name:
            self._start(slot, out)

    def _start(self, slot: _Call, out: list[ProviderChunk]) -> None:
        slot.started = True
        out.append(ToolCallStart(slot.index, slot.id, slot.name))
        buffered = "".join(slot.args)
        slot.args.clear()
        if buffered:
            slot.any_args = True
            out.append(ToolCallArgs(slot.index, buffered))

    def check_ended(self) -> None:
        """A stream that stops with neither a finish reason nor `[DONE]` was cut off (a proxy or
        the server closed it between two events): its answer is incomplete and must not be
        reported as finished. A stream that sent a finish reason, or `[DONE]` after a choice, ended
        as it meant to."""
        if not self.saw_done and self._finish is None:
            raise ProviderError(
                "network", "upstream stream ended before the answer did (no finish_reason and no [DONE])"
            )
        if not self._answered and self._finish is None:
            # `[DONE]` after no choice at all (only usage, metadata, an error shape not read here):
            # no answer came, and an empty one must not pass for it.
            raise ProviderError(
                "protocol", "upstream ended its stream with [DONE] but sent no choice (no answer and no finish_reason)"
            )

    def finish(self) -> list[ProviderChunk]:
        """End of stream: flush held text, start calls still missing an id, usage, one Done."""
        out: list[ProviderChunk] = list(self._think.flush())
        for slot in self._calls:
            if not slot.started:
                if not slot.name:
                    raise ProviderError("protocol", "upstream sent a tool call without a name")
                slot.id = slot.id or f"call_{uuid.uuid4().hex[:24]}"
                self._start(slot, out)
            if not slot.any_args:
                out.append(ToolCallArgs(slot.index, "{}"))  # "" is not valid JSON arguments
        finish = map_finish_reason(self._finish)
        # answer text, not what the think splitter took as reasoning (`<think>…</think>` alone)
        if finish == "tool_calls" and not self._calls and not (self._think.texted or self._refused):
            # Never an empty answer: the call came in a shape this parser does not read.
            raise ProviderError(
                "protocol",
                f"upstream finished with finish_reason {clip(str(self._finish), 40)!r} but sent no tool call "
                "(neither `tool_calls` nor `function_call`) and no text",
            )
        if self._usage is not None:
            out.append(self._usage)
        if finish == "stop" and self._calls:
            finish = "tool_calls"  # Ollama reports "stop" for tool-call answers
        out.append(Done(finish))
        return out


def no_event_error(status: int, ctype: bytes) -> ProviderError:
    """The error of a 2xx answer whose body held no server-sent event at all (an empty body, an
    HTML page): it names the status and the content type that came."""
    what = clip(ctype.decode("latin-1"), 80) if ctype else "no Content-Type"
    return ProviderError("protocol", f"upstream answered HTTP {status} ({what}) without any event")


def _delta_text(chunk: ProviderChunk) -> str | None:
    """The text of a delta `joined` may merge (text, reasoning, a call's arguments), else None."""
    if isinstance(chunk, Text | Reasoning):
        return chunk.text
    if isinstance(chunk, ToolCallArgs):
        return chunk.delta
    return None


def _same_run(first: ProviderChunk, chunk: ProviderChunk) -> bool:
    if type(first) is not type(chunk):
        return False
    return not isinstance(first, ToolCallArgs) or first.index == chunk.index  # type: ignore[union-attr]


def _with_text(first: ProviderChunk, text: str) -> ProviderChunk:
    if isinstance(first, ToolCallArgs):
        return ToolCallArgs(first.index, text)
    return Reasoning(text) if isinstance(first, Reasoning) else Text(text)


def joined(chunks: list[ProviderChunk]) -> list[ProviderChunk]:
    """Adjacent text (reasoning, one call's arguments) deltas as one: the events of one network
    read reach the turn together, so no one could see the states between them, and each delta
    costs a snapshot revision. A run's pieces are joined once: adding them one by one copied the
    run so far at every delta (quadratic in the size of a read)."""
    if len(chunks) < 2:
        return chunks
    out: list[ProviderChunk] = []
    run: list[str] = []  # the texts of the delta `out[-1]` begins, while it is one

    def close_run() -> None:
        if len(run) > 1:
            out[-1] = _with_text(out[-1], "".join(run))
        run.clear()

    for chunk in chunks:
        text = _delta_text(chunk)
        if text is not None and run and _same_run(out[-1], chunk):
            run.append(text)
            continue
        close_run()
        out.append(chunk)
        if text is not None:
            run.append(text)
    close_run()
    return out


def parse_sse_bytes(parts: Iterable[bytes]) -> list[ProviderChunk]:
    """Decode a whole scripted SSE body given as byte pieces (tests, offline replay)."""
    dec = SSEDecoder()
    parser = OpenAIStreamParser()
    out: list[ProviderChunk] = []
    for part in parts:
        for ev in dec.feed(part):
            out.extend(parser.feed_data(ev.data))
    for ev in dec.close():
        out.extend(parser.feed_data(ev.data))
    out.extend(parser.finish())
    return out


# ---------------------------------------------------------------- request building


# Chat Completions takes an image `detail` of auto, low or high; Responses' `original` (the image
# at its own resolution, never scaled down) is sent as the finest of those.
CHAT_IMAGE_DETAIL = {"original": "high"}


def _image_part(part: dict[str, Any]) -> dict[str, Any]:
    img = part.get("image_url")
    if isinstance(img, str):
        img = {"url": img}
    elif not isinstance(img, dict):
        img = {"url": part.get("url", "")}
    elif img.get("detail") in CHAT_IMAGE_DETAIL:
        img = {**img, "detail": CHAT_IMAGE_DETAIL[img["detail"]]}
    return {"type": "image_url", "image_url": img}


def _user_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind in ("image_url", "image"):
            parts.append(_image_part(part))
        else:
            parts.append(part)  # input_audio, file...: the upstream decides
    return parts


def message_to_wire(msg: ChatMessage) -> dict[str, Any]:
    """Provider-neutral message → Chat Completions message.

    Reasoning and provider_state are never sent: several servers reject unknown fields, and the
    reasoning of earlier turns is not meant to be fed back to these models.
    """
    if msg.role == "user":
        return {"role": "user", "content": _user_content(msg.content)}
    if msg.role == "tool":
        return {"role": "tool", "tool_call_id": msg.tool_call_id or "", "content": msg.text()}
    if msg.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": msg.text()}
        if msg.tool_calls:
            out["content"] = msg.text() or None
            out["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments or "{}"},
                }
                for tc in msg.tool_calls
            ]
        return out
    return {"role": "system", "content": msg.text()}


def tool_to_wire(tool: ToolSpec) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description:
        fn["description"] = tool.description
    if tool.strict is not None:
        fn["strict"] = tool.strict
    return {"type": "function", "function": fn}


class _ToolsJSON:
    """The encoded `tools` array per tool set. A set is keyed by its specs' names, descriptions
    and schema objects (held, so their ids stay theirs): schemas are static definitions."""

    __slots__ = ("_items", "marker")

    def __init__(self) -> None:
        self._items: dict[tuple[tuple[str, str, int, bool | None], ...], tuple[list[dict[str, Any]], str]] = {}
        # A placeholder value no request carries by chance; checked anyway (see encode_body).
        self.marker = f"tools-{uuid.uuid4().hex}"

    def get(self, tools: list[ToolSpec], wire: list[dict[str, Any]]) -> str:
        key = tuple((t.name, t.description, id(t.parameters), t.strict) for t in tools)
        hit = self._items.get(key)
        if hit is not None and all(a is b.parameters for a, b in zip(hit[0], tools, strict=True)):
            return hit[1]
        if len(self._items) >= 64:
            self._items.clear()
        text = _encode_body(wire)
        self._items[key] = ([t.parameters for t in tools], text)
        return text


def _content_headers(raw: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """(content-type, content-encoding) of a response's raw header fields, lower-cased, in one
    pass (repeated fields joined as httpx joins them)."""
    ctype: list[bytes] = []
    encoding: list[bytes] = []
    for name, value in raw:
        lname = name.lower()
        if lname == b"content-type":
            ctype.append(value.lower())
        elif lname == b"content-encoding":
            encoding.append(value.lower())
    return b", ".join(ctype), b", ".join(encoding)


# ---------------------------------------------------------------- the provider


class OpenAICompatProvider:
    """Streams from `{base_url}/chat/completions`; one instance per configured provider."""

    kind = "openai"

    def __init__(self, cfg: ProviderConfig, *, http: httpx.AsyncClient | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self._http = http
        self._owns_http = http is None
        self._tools_json = _ToolsJSON()
        self._timeout = request_timeout(cfg)

    @cached_property
    def url(self) -> str:  # parsed once: a provider's base_url does not change
        return endpoint_url(self.cfg.base_url, "/chat/completions")

    def _uses_max_completion_tokens(self) -> bool:
        # api.openai.com rejects `max_tokens` for reasoning models; compatible servers only know it.
        return (urlsplit(self.cfg.base_url).hostname or "").endswith("api.openai.com")

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        """The exact JSON body sent upstream (public so tests and logs can inspect it)."""
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [message_to_wire(m) for m in request.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = [tool_to_wire(t) for t in request.tools]
            # Both are rejected by OpenAI when no tools are sent.
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
            if request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.max_tokens is not None:
            key = "max_completion_tokens" if self._uses_max_completion_tokens() else "max_tokens"
            body[key] = request.max_tokens
        if request.stop:
            body["stop"] = list(request.stop)
        if request.response_format is not None:
            body["response_format"] = request.response_format
        if request.reasoning_effort is not None:
            body["reasoning_effort"] = request.reasoning_effort
        body.update(request.extra)
        return body

    def encode_body(self, request: ProviderRequest) -> bytes:
        """`build_body` as the bytes sent: the tools' JSON, the bulk of a small request, is encoded
        once per tool set and spliced in (byte for byte what encoding it each time gives)."""
        body = self.build_body(request)
        if not request.tools or "tools" in request.extra:
            return _encode_body(body).encode("utf-8")
        tools_json = self._tools_json.get(request.tools, body["tools"])
        body["tools"] = self._tools_json.marker
        text = _encode_body(body)
        marker = f'"{self._tools_json.marker}"'
        if text.count(marker) != 1:  # the marker also appears in the input: no splicing
            body["tools"] = [tool_to_wire(t) for t in request.tools]
            return _encode_body(body).encode("utf-8")
        return text.replace(marker, tools_json).encode("utf-8")

    def build_headers(self) -> dict[str, str]:
        headers = {
            "Accept": "text/event-stream",
            "Accept-Encoding": ACCEPT_ENCODING,
            "Content-Type": "application/json",
        }
        key = key_for_header(self.cfg)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if self.cfg.headers:
            check_extra_headers(self.cfg)
            headers.update(self.cfg.headers)
        return headers

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = default_client(self.cfg)
        return self._http

    async def stream(self, request: ProviderRequest) -> AsyncIterator[ProviderChunk]:
        """Yield chunks ending with exactly one Done; raise ProviderError on any failure."""
        content = self.encode_body(request)
        client = self._client()
        headers = self.build_headers()
        timeout = self._timeout
        try:
            if isinstance(client, LeanClient):
                opened = client.post_stream(self.url, content, headers, timeout)
            else:
                opened = client.stream("POST", self.url, content=content, headers=headers, timeout=timeout)
            async with opened as answer:
                await check_answer_status(answer, self.cfg, self.url)
                ctype, encoding = _content_headers(raw_headers(answer))
                if b"json" in ctype and b"event-stream" not in ctype:
                    # The server ignored `stream: true` and answered one completion object.
                    raw = await read_answer(answer, self.cfg.answer_max_bytes)
                    for chunk in self._whole_completion(raw, answer.status_code):
                        yield chunk
                    return
                # The answer as a whole is bounded too (a model looping without max_tokens): its
                # content is counted event by event, and the stream closed once it passes the limit.
                parser = OpenAIStreamParser(self.cfg.answer_max_bytes, self.name)
                dec = SSEDecoder(self.cfg.answer_max_bytes)
                # Undecoded bytes need no decoder layers (the body arrives as the transport read it).
                identity = encoding in (b"", b"identity")
                parts = aiter(answer.stream if identity else decoded_body(answer))  # type: ignore[arg-type]
                source: AsyncIterator[bytes] = parts
                after: AfterFinish | None = None  # the rest of the body once the finish reason came
                while True:
                    async for part in source:
                        events = dec.feed(part)
                        if len(events) == 1:
                            for chunk in parser.feed_data(events[0].data):
                                yield chunk
                        else:
                            got: list[ProviderChunk] = []
                            try:
                                for ev in events:
                                    got.extend(parser.feed_data(ev.data))
                            except ProviderError:
                                for chunk in joined(got):  # what came before an error event still counts
                                    yield chunk
                                raise
                            for chunk in joined(got):
                                yield chunk
                        # The answer ends at [DONE], as the OpenAI SDK reads it: an upstream that
                        # holds the body open after it (keep-alive comments, a stalled proxy) must
                        # not hold the answer, or fail it at the read timeout. After a finish
                        # reason the rest is read within a short grace, not the read timeout.
                        if parser.saw_done or (after is None and parser.finished):
                            break
                    else:
                        break  # the body ended (or went quiet after the finish reason)
                    if parser.saw_done:
                        break
                    after = AfterFinish(parts, finish_grace_s(self.cfg))
                    source = after.pieces(lambda: parser.events)
                if parser.saw_done:
                    await drain_rest(parts)
                elif after is None or not after.quiet:  # a line cut by the quiet end is not dispatched
                    for ev in dec.close():
                        for chunk in parser.feed_data(ev.data):
                            yield chunk
                if parser.events == 0:
                    raise no_event_error(answer.status_code, ctype)
                parser.check_ended()
                for chunk in parser.finish():
                    yield chunk
        except httpx.RequestError as exc:
            raise transport_error(exc) from exc
        except UnicodeEncodeError as exc:  # a header or URL the checks missed: no internal error
            raise unsendable_error(self.cfg, exc) from None

    @staticmethod
    def _whole_completion(raw: bytes | bytearray, status: int = 200) -> list[ProviderChunk]:
        try:
            obj = loads(raw)
        except ValueError as exc:
            raise ProviderError("protocol", f"upstream sent malformed JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ProviderError(
                "protocol", f"upstream answered HTTP {status} with {describe_json(obj)}, not a completion"
            )
        if obj.get("error"):
            OpenAIStreamParser().feed_chunk(obj)  # raises the error it holds
        flat = flat_error(obj) if "choices" not in obj else None
        if flat is not None:
            raise flat
        choices = obj.get("choices")
        answered = False
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                msg = choice.get("message")
                if isinstance(msg if isinstance(msg, dict) else choice.get("delta"), dict):
                    answered = answered or choice.get("index", 0) in (0, None)
                if isinstance(msg, dict) and isinstance(msg.get("tool_calls"), list):
                    for i, tc in enumerate(msg["tool_calls"]):
                        if isinstance(tc, dict):
                            tc.setdefault("index", i)
        if not answered:
            # A 200 that is no completion (a model list, a proxy's own JSON): never an empty answer.
            raise ProviderError(
                "protocol",
                f"upstream answered HTTP {status} with {describe_json(obj)}, not a chat completion "
                "(no choice with a message)",
            )
        parser = OpenAIStreamParser()
        out = parser.feed_chunk(obj)
        out.extend(parser.finish())
        return out

    async def aclose(self) -> None:
        if self._owns_http and self._http is not None:
            await self._http.aclose()
            self._http = None
