"""The `anthropic` kind: the Messages API with streaming.

Thinking blocks carry a signature that Anthropic checks when they come back in a later request
(required around tool use). They are collected into one ProviderState tagged with this provider's
config name, stored with the assistant message, and replayed verbatim only to the same provider;
state written by any other provider is ignored, so switching an agent's model drops it safely.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx

from appserver.config import ProviderConfig
from appserver.providers.base import (
    ChatMessage,
    Done,
    FinishReason,
    ProviderChunk,
    ProviderError,
    ProviderRequest,
    ProviderState,
    Reasoning,
    Text,
    ToolCallArgs,
    ToolCallStart,
    ToolSpec,
    Usage,
    error_from_status,
    structured_format,
)
from appserver.providers.jsontext import loads, loads_event
from appserver.providers.sse import SSEDecoder
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
    finish_grace_s,
    key_for_header,
    read_answer,
    request_timeout,
    transport_error,
    unsendable_error,
)

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 8192
THINKING_MIN_BUDGET = 1024
# reasoning_effort → thinking budget. "none"/"minimal"-style values that are absent disable it.
# Without a max_tokens the call gets the budget plus DEFAULT_MAX_TOKENS for the answer: `max` needs
# 57344, within the 64K output tokens of current Claude models.
THINKING_BUDGETS: dict[str, int] = {"low": 2048, "medium": 8192, "high": 24576, "xhigh": 32768, "max": 49152}
# What a placeholder first user message says when the context would open with the assistant (a
# client's transcript that starts with a greeting): the API wants the user first.
OPENING_USER_TEXT = "(start of the conversation)"
REPLAYED_BLOCK_TYPES = frozenset({"thinking", "redacted_thinking"})
_NOT_A_STREAM_MAX = 64 * 1024  # what is read of a JSON answer that came instead of the stream
# The content blocks this parser reads; any other type (server_tool_use, web_search_tool_result, a
# type added later) is skipped whole: its start, its deltas of any kind and its stop.
KNOWN_BLOCK_TYPES = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})

_STOP: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}

# Error event types → the HTTP status Anthropic uses for them, so one classifier serves both.
_ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def map_stop_reason(raw: Any) -> FinishReason:
    return _STOP.get(raw, "unknown") if isinstance(raw, str) else "unknown"


def block_index(obj: dict[str, Any]) -> int | None:
    """A block event's `index`: an integer (JSON `true` is none), None when absent or null, and a
    protocol error for anything else (a list or object would not even serve as a key)."""
    idx = obj.get("index")
    if idx is None or (isinstance(idx, int) and not isinstance(idx, bool)):
        return idx
    raise ProviderError(
        "protocol", f"{as_str(obj.get('type')) or 'an event'} with an index that is not an integer", body=obj
    )


# ---------------------------------------------------------------- response parsing


@dataclass(slots=True)
class _Block:
    type: str
    text: list[str] = field(default_factory=list)  # a thinking block's deltas (its replay state); text is not kept
    signature: list[str] = field(default_factory=list)
    data: str = ""
    tool_index: int = -1
    tool_input: Any = None
    any_args: bool = False


class AnthropicStreamParser:
    """Messages API stream events → provider chunks. Pure, so split tests can be exhaustive.

    `max_bytes`: the most the answer's text, thinking (and its signatures) and tool inputs may hold
    together (UTF-8 bytes, as received): the event that would pass it raises `answer_too_large`
    before any of its content is handed out."""

    def __init__(self, provider_name: str, max_bytes: int | None = None) -> None:
        self._provider = provider_name
        self._budget = AnswerBudget(max_bytes, provider_name)
        self._blocks: dict[int, _Block] = {}
        self._state: list[dict[str, Any]] = []
        self._tools = 0
        self._stop: str | None = None
        self._usage: dict[str, int] = {}
        self._answered = False  # text came: the answer is not empty
        self.events = 0
        self.saw_stop = False

    @property
    def finished(self) -> bool:
        """A stop_reason came: what may still follow is `message_stop` (providers/upstream.py
        `AfterFinish`)."""
        return self._stop is not None

    def feed_data(self, data: str) -> list[ProviderChunk]:
        if self.saw_stop:
            return []
        self.events += 1
        try:
            obj = loads_event(data)  # lone surrogates as U+FFFD (jsontext.py)
        except ValueError as exc:
            raise ProviderError("protocol", f"upstream sent malformed JSON: {exc}", body=data[:500]) from None
        if not isinstance(obj, dict):
            raise ProviderError("protocol", "upstream event is not an object", body=obj)
        return self.feed_event(obj)

    def feed_event(self, obj: dict[str, Any]) -> list[ProviderChunk]:
        out: list[ProviderChunk] = []
        kind = obj.get("type")
        if kind == "message_start":
            msg = obj.get("message")
            if isinstance(msg, dict):
                self._take_usage(msg.get("usage"))
        elif kind == "content_block_start":
            self._block_start(obj, out)
        elif kind == "content_block_delta":
            self._block_delta(obj, out)
        elif kind == "content_block_stop":
            self._block_stop(obj, out)
        elif kind == "message_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self._stop = delta["stop_reason"]
            self._take_usage(obj.get("usage"))
        elif kind == "message_stop":
            self.saw_stop = True
        elif kind == "error":
            err = as_dict(obj.get("error"))
            etype = as_str(err.get("type"))
            message = as_str(err.get("message")) or etype
            raise error_from_status(_ERROR_STATUS.get(etype, 500), message or "upstream stream error", body=obj)
        # "ping" and event types added later are ignored on purpose.
        return out

    def _take_usage(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        for key in (
            "input_tokens",
            "output_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
        ):
            val = raw.get(key)
            if isinstance(val, int) and not isinstance(val, bool):
                self._usage[key] = val  # message_delta counts are cumulative

    def _block_start(self, obj: dict[str, Any], out: list[ProviderChunk]) -> None:
        idx = block_index(obj)
        cb = obj.get("content_block")
        if idx is None or not isinstance(cb, dict):
            raise ProviderError("protocol", "content_block_start without index or block", body=obj)
        btype = str(cb.get("type", ""))
        block = _Block(type=btype)
        self._blocks[idx] = block
        self._budget.charge(ITEM_BYTES)  # a block is stored with the answer, even an empty one
        if btype == "text":
            self._text(block, cb.get("text"), out)
        elif btype == "thinking":
            self._thinking(block, cb.get("thinking"), out)
            if isinstance(cb.get("signature"), str):
                block.signature.append(cb["signature"])
        elif btype == "redacted_thinking":
            block.data = as_str(cb.get("data"))
            self._budget.count(block.data)
        elif btype == "tool_use":
            block.tool_index = self._tools
            self._tools += 1
            block.tool_input = cb.get("input")
            call_id, name = as_str(cb.get("id")), as_str(cb.get("name"))
            self._budget.count(call_id)
            self._budget.count(name)
            out.append(ToolCallStart(block.tool_index, call_id, name))

    def _text(self, block: _Block, text: Any, out: list[ProviderChunk]) -> None:
        # Not kept in the block: only a thinking block's text is needed again (its replay state);
        # a text block's deltas held here were a second copy of a runaway answer.
        if isinstance(text, str) and text:
            self._answered = True
            self._budget.count(text)
            out.append(Text(text))

    def _thinking(self, block: _Block, text: Any, out: list[ProviderChunk]) -> None:
        if isinstance(text, str) and text:
            self._budget.count(text)
            block.text.append(text)
            out.append(Reasoning(text))

    def _block_delta(self, obj: dict[str, Any], out: list[ProviderChunk]) -> None:
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return
        idx = block_index(obj)
        block = None if idx is None else self._blocks.get(idx)
        dtype = delta.get("type")
        if block is None:
            if dtype == "text_delta":  # lenient: text needs no block bookkeeping
                block = _Block(type="text")
            else:
                raise ProviderError("protocol", f"{dtype} for a block never started", body=obj)
        elif block.type not in KNOWN_BLOCK_TYPES:
            return  # a block this parser skips: so are its deltas, whatever they carry
        if dtype == "text_delta":
            self._text(block, delta.get("text"), out)
        elif dtype == "thinking_delta":
            self._thinking(block, delta.get("thinking"), out)
        elif dtype == "signature_delta":
            if isinstance(delta.get("signature"), str):
                self._budget.count(delta["signature"])  # kept with the answer (its replay state)
                block.signature.append(delta["signature"])
        elif dtype == "input_json_delta":
            part = delta.get("partial_json")
            if block.tool_index < 0:
                raise ProviderError("protocol", "input_json_delta outside a tool_use block", body=obj)
            if isinstance(part, str) and part:
                self._budget.count(part)
                block.any_args = True
                out.append(ToolCallArgs(block.tool_index, part))
        # citations_delta and unknown deltas carry nothing the loop uses.

    def _block_stop(self, obj: dict[str, Any], out: list[ProviderChunk]) -> None:
        idx = block_index(obj)
        block = None if idx is None else self._blocks.pop(idx, None)
        if block is not None:
            self._close_block(block, out)

    def _close_block(self, block: _Block, out: list[ProviderChunk]) -> None:
        if block.type == "thinking":
            self._state.append(
                {
                    "type": "thinking",
                    "thinking": "".join(block.text),
                    "signature": "".join(block.signature),
                }
            )
        elif block.type == "redacted_thinking":
            self._state.append({"type": "redacted_thinking", "data": block.data})
        elif block.type == "tool_use" and not block.any_args:
            # No input_json_delta at all: the input (usually {}) came whole in the start event.
            given = block.tool_input if isinstance(block.tool_input, dict) else {}
            out.append(ToolCallArgs(block.tool_index, json.dumps(given, ensure_ascii=False)))

    def check_ended(self) -> None:
        """A stream that stops with neither `message_stop` nor a `stop_reason` was cut off between
        two events: its answer is incomplete and must not be reported as finished."""
        if not self.saw_stop and self._stop is None:
            raise ProviderError(
                "network", "upstream stream ended before the answer did (no stop_reason and no message_stop)"
            )

    def finish(self) -> list[ProviderChunk]:
        """End of stream: close blocks left open, then state, usage and exactly one Done."""
        if self._stop == "tool_use" and not self._tools and not self._answered:
            # Never an empty answer: the call came in a block this parser does not read.
            raise ProviderError("protocol", "upstream stopped for tool_use but sent no tool_use block and no text")
        out: list[ProviderChunk] = []
        for idx in sorted(self._blocks):
            self._close_block(self._blocks[idx], out)
        self._blocks.clear()
        if self._state:
            out.append(ProviderState({"provider": self._provider, "blocks": list(self._state)}))
        if self._usage:
            u = self._usage
            cache_read = u.get("cache_read_input_tokens", 0)
            out.append(
                Usage(
                    # Anthropic's input_tokens excludes cached tokens; the window counts them all.
                    input_tokens=u.get("input_tokens", 0) + cache_read + u.get("cache_creation_input_tokens", 0),
                    output_tokens=u.get("output_tokens", 0),
                    cached_tokens=cache_read,
                )
            )
        out.append(Done(map_stop_reason(self._stop)))
        return out


def parse_sse_bytes(parts: Iterable[bytes], provider_name: str = "anthropic") -> list[ProviderChunk]:
    """Decode a whole scripted Messages SSE body given as byte pieces (tests, offline replay)."""
    dec = SSEDecoder()
    parser = AnthropicStreamParser(provider_name)
    out: list[ProviderChunk] = []
    for part in parts:
        for ev in dec.feed(part):
            out.extend(parser.feed_data(ev.data))
    for ev in dec.close():
        out.extend(parser.feed_data(ev.data))
    out.extend(parser.finish())
    return out


# ---------------------------------------------------------------- request building


def _image_block(part: dict[str, Any]) -> dict[str, Any] | None:
    img = part.get("image_url")
    url = img.get("url") if isinstance(img, dict) else img if isinstance(img, str) else part.get("url")
    if not isinstance(url, str) or not url:
        return None
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        media_type = header[5:].split(";", 1)[0] or "image/png"
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    return {"type": "image", "source": {"type": "url", "url": url}}


def visible(text: Any) -> bool:
    """Whether `text` may be a text block: the API refuses empty ones and those of whitespace only
    ("text content blocks must contain non-whitespace text"), so such text is left out, never sent."""
    return isinstance(text, str) and text.strip() != ""


def _content_blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral content → Anthropic blocks; blank text (refused upstream) is dropped."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if visible(content) else []
    blocks: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            if visible(part.get("text")):
                blocks.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image"):
            if kind == "image" and isinstance(part.get("source"), dict):
                blocks.append(part)  # already Anthropic-shaped
            else:
                img = _image_block(part)
                if img is not None:
                    blocks.append(img)
        elif kind == "file":  # a PDF as a document block (the HTTP routes refuse other files)
            data = (part.get("file") or {}).get("file_data") or ""
            header, _, payload = data.partition(",")
            if header == "data:application/pdf;base64" and payload:
                blocks.append(
                    {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": payload}}
                )
    return blocks


def _user_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages`, opening with a placeholder user message when they would open with the assistant
    (the API refuses that): a transcript that starts with a greeting, or whose first user message
    was blank and so dropped. The assistant's words stay in the context."""
    if messages and messages[0]["role"] == "assistant":
        messages.insert(0, {"role": "user", "content": [{"type": "text", "text": OPENING_USER_TEXT}]})
    return messages


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}  # e.g. cut by max_tokens; the API only accepts an object
    return value if isinstance(value, dict) else {}


def thinking_budget(effort: str | None, max_tokens: int | None) -> tuple[int, int]:
    """(thinking budget, max_tokens) for a reasoning effort. Without a max_tokens the call gets the
    effort's whole budget plus DEFAULT_MAX_TOKENS for the answer; a max_tokens that was set holds
    thinking and answer together (the API wants budget < max_tokens), so the budget is at most
    half of it, and thinking is off below THINKING_MIN_BUDGET."""
    budget = THINKING_BUDGETS.get(effort or "", 0)
    if max_tokens is None:
        return budget, budget + DEFAULT_MAX_TOKENS
    return min(budget, max_tokens // 2), max_tokens


# With thinking on, the API rejects a temperature, and a top_p below this.
THINKING_TOP_P_MIN = 0.95


def sent_params(params: dict[str, Any]) -> dict[str, Any]:
    """The sampling params of a call (loop.provider_params: temperature, top_p, max_tokens,
    reasoning_effort, …) as the request body carries them: the one rule `build_body` and what the
    Responses route echoes as used (loop.model_call_params) both follow. An effort that gives no
    thinking budget of at least THINKING_MIN_BUDGET (one with no budget, or a max_tokens too small
    for it: `thinking_budget`) leaves thinking off, as if none were asked for. `max_tokens` is
    the one sent: without a limit, DEFAULT_MAX_TOKENS (plus the thinking budget). With thinking
    on, a temperature and a top_p below THINKING_TOP_P_MIN are left out and a tool_choice that
    forces tool use (`required`, a function) is `auto` (the API refuses them): changed rather
    than failing the call."""
    out = {k: v for k, v in params.items() if v is not None}
    budget, out["max_tokens"] = thinking_budget(out.get("reasoning_effort"), out.get("max_tokens") or None)
    if budget < THINKING_MIN_BUDGET:
        out.pop("reasoning_effort", None)
        return out
    out.pop("temperature", None)
    top_p = out.get("top_p")
    if isinstance(top_p, int | float) and top_p < THINKING_TOP_P_MIN:
        out.pop("top_p")
    if (anthropic_tool_choice(out.get("tool_choice")) or {}).get("type") in ("any", "tool"):
        out["tool_choice"] = "auto"
    return out


def anthropic_tool_choice(choice: Any) -> dict[str, Any] | None:
    """OpenAI-style tool_choice → Anthropic's (None: not sent, the API's auto). An explicit `auto`
    is sent as such: what `sent_params` makes of a forced choice with thinking on."""
    if choice is None:
        return None
    if choice == "auto":
        return {"type": "auto"}
    if choice == "none":
        return {"type": "none"}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict):
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return {"type": "tool", "name": fn["name"]}
        if choice.get("type") in ("auto", "any", "tool", "none"):
            return dict(choice)
    return None


class AnthropicProvider:
    """Streams from `{base_url}/v1/messages`; one instance per configured provider."""

    kind = "anthropic"

    def __init__(self, cfg: ProviderConfig, *, http: httpx.AsyncClient | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self._http = http
        self._owns_http = http is None

    @cached_property
    def url(self) -> str:  # parsed once: a provider's base_url does not change
        return endpoint_url(self.cfg.base_url, "/v1/messages", unless_ends="/v1")

    def replay_blocks(self, msg: ChatMessage) -> list[dict[str, Any]]:
        """Thinking blocks stored by *this* provider for `msg`, in their original order."""
        state = msg.provider_state
        if not isinstance(state, dict) or state.get("provider") != self.name:
            return []
        blocks = state.get("blocks")
        if not isinstance(blocks, list):
            return []
        return [b for b in blocks if isinstance(b, dict) and b.get("type") in REPLAYED_BLOCK_TYPES]

    def build_messages(self, messages: list[ChatMessage]) -> tuple[str, list[dict[str, Any]]]:
        """(system text, Messages API messages). Consecutive same-role messages are merged, which
        also puts consecutive tool results into one user message as the API requires. Blank text
        (a reply of only "\n\n", a client's whitespace message) is left out, as the API refuses
        it: a message left with nothing is dropped, its neighbours merged, and the context still
        opens with the user (`_user_first`)."""
        system: list[str] = []
        out: list[dict[str, Any]] = []
        for msg in messages:
            blocks: list[dict[str, Any]]
            if msg.role == "system":
                if visible(msg.text()):  # blank system text is refused as a blank text block is
                    system.append(msg.text())
                continue
            if msg.role == "tool":
                role = "user"
                result: dict[str, Any] = {
                    "type": "tool_result",
                    "tool_use_id": msg.tool_call_id or "",
                }
                if visible(msg.text()):  # a blank result is sent without content (it must still answer its call)
                    result["content"] = msg.text()
                blocks = [result]
            elif msg.role == "assistant":
                role = "assistant"
                text = msg.text()
                # A thinking-only message would be empty once the API strips old thinking: skip it.
                replay = visible(text) or msg.tool_calls
                blocks = [dict(b) for b in self.replay_blocks(msg)] if replay else []
                if visible(text):
                    blocks.append({"type": "text", "text": text})
                for tc in msg.tool_calls:
                    blocks.append(
                        {
                            "type": "tool_use",
                            "id": tc.id,
                            "name": tc.name,
                            "input": _tool_input(tc.arguments),
                        }
                    )
            else:
                role = "user"
                blocks = _content_blocks(msg.content)
            if not blocks:
                continue
            if out and out[-1]["role"] == role:
                out[-1]["content"].extend(blocks)
            else:
                out.append({"role": role, "content": blocks})
        return "\n\n".join(system), _user_first(out)

    @staticmethod
    def sent_params(params: dict[str, Any]) -> dict[str, Any]:
        """`sent_params`: the call's params as this provider sends them (loop.model_call_params)."""
        return sent_params(params)

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        """The exact JSON body sent upstream (public so tests and logs can inspect it)."""
        system, messages = self.build_messages(request.messages)
        sent = sent_params(
            {
                "temperature": request.temperature,
                "top_p": request.top_p,
                "max_tokens": request.max_tokens,
                "reasoning_effort": request.reasoning_effort,
                "tool_choice": request.tool_choice,
            }
        )
        budget, _ = thinking_budget(sent.get("reasoning_effort"), request.max_tokens or None)
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": sent["max_tokens"],
            "messages": messages,
            "stream": True,
        }
        if system:
            body["system"] = system
        thinking = budget >= THINKING_MIN_BUDGET
        if thinking:
            body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        # With thinking the API rejects temperature, top_p below 0.95 and forced tool use:
        # `sent_params` left them out (the choice is `auto`).
        if "temperature" in sent:
            body["temperature"] = sent["temperature"]
        if "top_p" in sent:
            body["top_p"] = sent["top_p"]
        if request.stop:
            body["stop_sequences"] = list(request.stop)
        if request.tools:
            body["tools"] = [self._tool(t) for t in request.tools]
            choice = anthropic_tool_choice(sent.get("tool_choice"))
            if request.parallel_tool_calls is False:
                choice = dict(choice or {"type": "auto"})
                if choice.get("type") != "none":
                    choice["disable_parallel_tool_use"] = True
            if choice is not None:
                body["tool_choice"] = choice
        # response_format has no Messages API equivalent: `stream` refuses a structured one (json_schema,
        # json_object) before any call, and `text` is what the API answers anyway.
        body.update(request.extra)
        return body

    @staticmethod
    def _tool(tool: ToolSpec) -> dict[str, Any]:
        out: dict[str, Any] = {"name": tool.name, "input_schema": tool.parameters}
        if tool.description:
            out["description"] = tool.description
        return out

    def build_headers(self) -> dict[str, str]:
        headers = {
            "Accept": "text/event-stream",
            "Accept-Encoding": ACCEPT_ENCODING,
            "Content-Type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
        }
        key = key_for_header(self.cfg)
        if key:
            headers["x-api-key"] = key
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
        refused = structured_format(request.response_format)
        if refused is not None:  # never dropped: the client would take free text for its JSON
            raise ProviderError(
                "invalid_request",
                f"a '{refused}' response format is not supported by provider {self.name!r} (anthropic kind): "
                "the Messages API has no structured output parameter",
            )
        body = self.build_body(request)
        client = self._client()
        try:
            async with client.stream(
                "POST",
                self.url,
                json=body,
                headers=self.build_headers(),
                timeout=request_timeout(self.cfg),
            ) as resp:
                await check_answer_status(resp, self.cfg, self.url)
                ctype = resp.headers.get("content-type", "").lower()
                if "json" in ctype and "event-stream" not in ctype:
                    raise await self._not_a_stream(resp)
                # The answer as a whole is bounded too (a model looping without max_tokens): its
                # content is counted event by event, and the stream closed once it passes the limit.
                parser = AnthropicStreamParser(self.name, self.cfg.answer_max_bytes)
                dec = SSEDecoder(self.cfg.answer_max_bytes)
                parts = decoded_body(resp)
                source: AsyncIterator[bytes] = parts
                after: AfterFinish | None = None  # the rest of the body once the stop_reason came
                while True:
                    async for part in source:
                        for ev in dec.feed(part):
                            for chunk in parser.feed_data(ev.data):
                                yield chunk
                        # The answer ends at message_stop: an upstream that holds the body open
                        # after it (pings, a stalled proxy) must not hold the answer, or fail it.
                        # After a stop_reason the rest is read within a short grace, not the
                        # read timeout.
                        if parser.saw_stop or (after is None and parser.finished):
                            break
                    else:
                        break  # the body ended (or went quiet after the stop_reason)
                    if parser.saw_stop:
                        break
                    after = AfterFinish(parts, finish_grace_s(self.cfg))
                    source = after.pieces(lambda: parser.events)
                if parser.saw_stop:
                    await drain_rest(parts)
                elif after is None or not after.quiet:  # a line cut by the quiet end is not dispatched
                    for ev in dec.close():
                        for chunk in parser.feed_data(ev.data):
                            yield chunk
                if parser.events == 0:
                    what = clip(ctype, 80) or "no Content-Type"
                    raise ProviderError(
                        "protocol", f"upstream answered HTTP {resp.status_code} ({what}) without any event"
                    )
                parser.check_ended()
                for chunk in parser.finish():
                    yield chunk
        except httpx.RequestError as exc:
            raise transport_error(exc) from exc
        except UnicodeEncodeError as exc:  # a header or URL the checks missed: no internal error
            raise unsendable_error(self.cfg, exc) from None

    async def _not_a_stream(self, resp: httpx.Response) -> ProviderError:
        """The error for a 2xx JSON answer to a streamed request: the error it holds, classified
        (a proxy that answers errors with 200), or a protocol error saying what came instead. At
        most 64 KiB of it is read (as of an error answer): it is not an answer either way."""
        status = resp.status_code
        try:
            obj = loads(await read_answer(resp, min(self.cfg.answer_max_bytes, _NOT_A_STREAM_MAX)))
        except ValueError as exc:
            return ProviderError("protocol", f"upstream answered HTTP {status} with malformed JSON: {exc}")
        except ProviderError:  # larger than that
            return ProviderError(
                "protocol", f"upstream answered HTTP {status} with a large JSON body, not the event stream asked for"
            )
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err:
            etype = as_str(err.get("type"))
            message = as_str(err.get("message")) or etype or "upstream error"
            return error_from_status(_ERROR_STATUS.get(etype, 500), message, body=obj)
        return ProviderError(
            "protocol",
            f"upstream answered HTTP {status} with {describe_json(obj)}, not the event stream asked for "
            "(the Messages API streams with `stream: true`)",
        )

    async def aclose(self) -> None:
        if self._owns_http and self._http is not None:
            await self._http.aclose()
            self._http = None
