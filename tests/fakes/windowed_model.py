"""A fake OpenAI-compatible *model* with a small context window, for context-management tests.

Plugged into `FakeOpenAI.responder`: it counts each request's prompt tokens with its own tokenizer
(words and punctuation, as a real BPE roughly does — not the server's estimate), refuses a prompt
over the window with OpenAI's real `context_length_exceeded` error, and otherwise answers like a
small model: a summary when asked to summarise, a `clock` or `shell` call when told to use one, a short
reply that mentions the turn it answers, with honest `usage`.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.openai_upstream import (
    RecordedRequest,
    Reply,
    chunk,
    openai_error,
    openai_sse,
    tool_delta,
    usage_chunk,
)

_TOKEN = re.compile(r"\w+|[^\w\s]")
# Top-level fields of OpenAI's CreateChatCompletionRequest this fake accepts; like the real API it
# refuses anything else ("Unrecognized request argument supplied").
KNOWN_FIELDS = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "response_format",
    "reasoning_effort",
    "n",
    "seed",
    "user",
    "metadata",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "store",
    "service_tier",
    "modalities",
    "prediction",
}
PER_MESSAGE = 4


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def prompt_tokens(body: dict[str, Any]) -> int:
    total = 0
    for m in body.get("messages", []):
        total += PER_MESSAGE
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content)
        total += count_tokens(content or "")
        for call in m.get("tool_calls") or []:
            total += PER_MESSAGE + count_tokens(call["function"]["name"]) + count_tokens(call["function"]["arguments"])
    if body.get("tools"):
        total += count_tokens(json.dumps(body["tools"]))
    return total


@dataclass
class WindowedModel:
    window: int
    seen: list[dict[str, Any]] = field(default_factory=list)  # {"tokens", "summary", "rejected", "body"}
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _calls: int = 0

    def __call__(self, request: RecordedRequest) -> Reply:
        body = request.json
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            return _json_reply(400, openai_error(f"Unrecognized request argument supplied: {unknown[0]}"))
        tokens = prompt_tokens(body)
        messages = body["messages"]
        summary = any(
            m["role"] == "system" and "summary" in str(m.get("content", "")).lower() for m in messages
        ) and not body.get("tools")
        rejected = tokens > self.window
        with self._lock:
            self.seen.append({"tokens": tokens, "summary": summary, "rejected": rejected, "body": body})
            self._calls += 1
            call_no = self._calls
        if rejected:
            message = (
                f"This model's maximum context length is {self.window} tokens. However, your messages resulted in "
                f"{tokens} tokens. Please reduce the length of the messages."
            )
            return _json_reply(400, openai_error(message, code="context_length_exceeded"))
        last = messages[-1]
        if summary:
            text = last["content"] if isinstance(last["content"], str) else ""
            turns = sorted(
                {n for group in re.findall(r"turns? ((?:\d+(?:, )?)+)", text) for n in group.split(", ") if n},
                key=int,
            )
            reply = f"Summary: the user sent turns {', '.join(turns) or 'none'}; the assistant acknowledged each."
            return _stream(reply, tokens, body)
        if last["role"] == "tool":
            return _stream(f"The clock said {last['content'][:40]}.", tokens, body)
        text = str(last.get("content", ""))
        if text.startswith(("use clock", "use shell: ")):
            if text.startswith("use shell: "):
                name, args = "shell", json.dumps({"command": text.removeprefix("use shell: ")})
            else:
                name, args = "clock", json.dumps({"timezone": "UTC"})
            chunks = [
                chunk(role="assistant", tool_calls=[tool_delta(0, id=f"call_{call_no}", name=name)]),
                chunk(tool_calls=[tool_delta(0, arguments=args[:5])]),
                chunk(tool_calls=[tool_delta(0, arguments=args[5:])]),
                chunk(finish_reason="tool_calls"),
                usage_chunk(tokens, 12),
            ]
            return Reply(pieces=[openai_sse(chunks)])
        number = re.search(r"turn (\d+)", text)
        return _stream(
            f"Acknowledged turn {number.group(1) if number else '?'}: noted, and I will keep it in mind for later.",
            tokens,
            body,
        )

    def answered(self) -> list[dict[str, Any]]:
        return [s for s in self.seen if not s["rejected"]]


def _stream(text: str, prompt: int, body: dict[str, Any]) -> Reply:
    words = re.findall(r"\s*\S+", text)
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    finish = "stop"
    if limit is not None and len(words) > limit:
        words, finish = words[:limit], "length"
    chunks = [chunk(role="assistant", content=w) for w in words[:1]] + [chunk(content=w) for w in words[1:]]
    chunks += [chunk(finish_reason=finish), usage_chunk(prompt, count_tokens("".join(words)))]
    return Reply(pieces=[openai_sse(chunks)])


def _json_reply(status: int, body: dict[str, Any]) -> Reply:
    return Reply(
        status=status,
        pieces=[json.dumps(body).encode()],
        content_type="application/json",
        chunked=False,
    )
