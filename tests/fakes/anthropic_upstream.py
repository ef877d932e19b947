"""A loopback fake of the Anthropic Messages API (same machinery as the OpenAI fake).

with FakeAnthropic() as fake:
    fake.script(anthropic_sse(text_answer("hello")), chunk_size=7)
    ... AnthropicProvider(ProviderConfig("claude", kind="anthropic", base_url=fake.base_url))
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tests.fakes.openai_upstream import FakeUpstream


class FakeAnthropic(FakeUpstream):
    """`base_url` is the host root, like https://api.anthropic.com; requests go to /v1/messages."""

    path_prefix = ""


def anthropic_sse(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE body with `event:` lines named after each event's `type`, as Anthropic sends them."""
    out = []
    for ev in events:
        out.append(f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n")
    return "".join(out).encode()


def message_start(input_tokens: int = 10, *, cache_read: int = 0) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": "claude-fake",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": 1,
                "cache_read_input_tokens": cache_read,
                "cache_creation_input_tokens": 0,
            },
        },
    }


def block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def block_stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def message_delta(stop_reason: str | None, output_tokens: int = 5) -> dict[str, Any]:
    return {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }


MESSAGE_STOP: dict[str, Any] = {"type": "message_stop"}
PING: dict[str, Any] = {"type": "ping"}


def text_block(index: int, pieces: Iterable[str]) -> list[dict[str, Any]]:
    evs = [block_start(index, {"type": "text", "text": ""})]
    evs += [block_delta(index, {"type": "text_delta", "text": p}) for p in pieces]
    evs.append(block_stop(index))
    return evs


def thinking_block(index: int, pieces: Iterable[str], signature: str) -> list[dict[str, Any]]:
    evs = [block_start(index, {"type": "thinking", "thinking": ""})]
    evs += [block_delta(index, {"type": "thinking_delta", "thinking": p}) for p in pieces]
    evs.append(block_delta(index, {"type": "signature_delta", "signature": signature}))
    evs.append(block_stop(index))
    return evs


def redacted_block(index: int, data: str) -> list[dict[str, Any]]:
    return [block_start(index, {"type": "redacted_thinking", "data": data}), block_stop(index)]


def tool_use_block(index: int, id: str, name: str, json_pieces: Iterable[str]) -> list[dict[str, Any]]:
    evs = [block_start(index, {"type": "tool_use", "id": id, "name": name, "input": {}})]
    evs += [block_delta(index, {"type": "input_json_delta", "partial_json": p}) for p in json_pieces]
    evs.append(block_stop(index))
    return evs


def text_answer(text: str, stop_reason: str = "end_turn") -> list[dict[str, Any]]:
    """A whole plain answer, streamed word by word."""
    words = [w + " " for w in text.split(" ")]
    words[-1] = words[-1].rstrip(" ")
    return [message_start(), *text_block(0, words), message_delta(stop_reason), MESSAGE_STOP]


def anthropic_error(etype: str, message: str) -> dict[str, Any]:
    """An Anthropic error body (also the payload of an `error` stream event)."""
    return {"type": "error", "error": {"type": etype, "message": message}}


def _text_problem(text: Any) -> str | None:
    if not isinstance(text, str) or text == "":
        return "messages: text content blocks must be non-empty"
    if text.isspace():
        return "messages: text content blocks must contain non-whitespace text"
    return None


def _content_problem(content: Any) -> str | None:
    """The first rule a message's (or a tool_result's) content breaks, as the API words it."""
    if isinstance(content, str):
        return _text_problem(content)
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            problem = _text_problem(block.get("text"))
        elif block.get("type") == "tool_result" and "content" in block:
            problem = _content_problem(block["content"])
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def messages_problem(body: Any) -> str | None:
    """The first rule of the real Messages API that a request body breaks (its 400 message), else
    None: messages non-empty, opening with the user, no message without content, no text block
    empty or of whitespace only (a string content or a tool_result's too), a thinking budget of at
    least 1024 and below max_tokens."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    if messages[0].get("role") != "user":
        return 'messages: first message must use the "user" role'
    for i, message in enumerate(messages):
        content = message.get("content")
        if content == [] or content is None:
            return f"messages.{i}: all messages must have non-empty content"
        problem = _content_problem(content)
        if problem is not None:
            return problem
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
        if budget >= body.get("max_tokens", 0):
            return "`max_tokens` must be greater than `thinking.budget_tokens`"
    return None
