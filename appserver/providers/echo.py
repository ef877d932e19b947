"""The built-in offline model: deterministic, no key, no network. Its behaviour is documented in README."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from appserver.providers.base import (
    ChatMessage,
    Done,
    ProviderChunk,
    ProviderRequest,
    Reasoning,
    Text,
    ToolCallArgs,
    ToolCallStart,
    Usage,
    error_from_status,
)

SLOW_WORD_INTERVAL_S = 0.05
SLOW_MAX_WORDS = 100_000
_MAX_ARG_DIGITS = 9  # `/slow 999999999` is already capped at SLOW_MAX_WORDS
_CALL = re.compile(r"^/call\s+([A-Za-z0-9_.\-]+)\s*(.*)$", re.DOTALL)
# One `/call` per line: a line ends at \n or \r only (str.splitlines also ends one at U+2028 and
# U+0085, which JSON arguments may hold raw in a string: the call was cut short).
_LINES = re.compile(r"\r\n|\r|\n")
# A message from a chat channel arrives wrapped in the gateway's envelope; echo answers its body,
# so `/slow 30` typed in a chat works as it does everywhere else.
_CHANNEL_MESSAGE = re.compile(r"<channel-message [^<>]*>([^<>]*)</channel-message>$")
_ENTITIES = {"&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'", "&amp;": "&"}
_WORD = re.compile(r"\s*\S+")  # a word with the whitespace before it
_NON_SPACE = re.compile(r"\S")
# A reply longer than this (a big paste echoed back) streams many words per chunk: one chunk per
# word would cost seconds of server time for a few megabytes.
WORD_BY_WORD_MAX_CHARS = 1 << 20
WORDS_PER_BIG_CHUNK = 256


def _words(text: str) -> int:
    return len(text.split())


def _small_number(arg: str) -> int | None:
    """A command's argument as a number: ASCII digits (`str.isdigit` also takes `٥` and `²`), and
    few enough that int() takes them (it refuses 5000 in its own words); else None, the default."""
    if arg.isascii() and arg.isdigit() and len(arg) <= _MAX_ARG_DIGITS:
        return int(arg)
    return None


class EchoProvider:
    name = "echo"
    kind = "echo"

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ProviderRequest) -> AsyncIterator[ProviderChunk]:
        messages = request.messages
        input_tokens = sum(_words(m.text()) for m in messages)
        if request.purpose == "compaction":
            async for c in self._words_out(_summary(messages[-1].text()), request, input_tokens):
                yield c
            return
        trailing_results = _trailing_tool_results(messages)
        if trailing_results:
            async for c in self._words_out(
                "\n".join(f"{m.name} -> {m.text()}" for m in trailing_results), request, input_tokens
            ):
                yield c
            return

        users = [m for m in messages if m.role == "user"]
        text = _unwrap_channel_message(_said(users[-1]).strip()) if users else ""

        calls = [_CALL.match(line.strip()) for line in _LINES.split(text) if line.strip().startswith("/call")]
        if text.startswith("/call") and all(calls):
            for index, match in enumerate(calls):
                assert match is not None
                name, args = match.group(1), (match.group(2).strip() or "{}")
                yield ToolCallStart(index=index, id=f"call_{uuid.uuid4().hex[:20]}", name=name)
                half = max(1, len(args) // 2)
                yield ToolCallArgs(index=index, delta=args[:half])
                yield ToolCallArgs(index=index, delta=args[half:])
            yield Usage(input_tokens=input_tokens, output_tokens=len(calls))
            yield Done("tool_calls")
            return
        if text == "/recall" or text.startswith("/recall "):
            earlier = [_said(m) for m in users[:-1]]
            async for c in self._words_out(" | ".join(earlier) if earlier else "(nothing)", request, input_tokens):
                yield c
            return
        if text.startswith("/think"):
            thought = text[len("/think") :].strip()
            if thought:
                yield Reasoning(thought)
            async for c in self._words_out("done thinking", request, input_tokens, extra_tokens=_words(thought)):
                yield c
            return
        if text.startswith("/slow"):
            arg = text[len("/slow") :].strip() or "10"
            asked = _small_number(arg)
            n = 10 if asked is None else min(asked, SLOW_MAX_WORDS)
            produced = 0
            for i in range(1, n + 1):
                if request.max_tokens is not None and produced >= request.max_tokens:
                    yield Usage(input_tokens=input_tokens, output_tokens=produced)
                    yield Done("length")
                    return
                if i > 1:
                    await asyncio.sleep(SLOW_WORD_INTERVAL_S)
                yield Text(("" if i == 1 else " ") + f"w{i}")
                produced += 1
            yield Usage(input_tokens=input_tokens, output_tokens=produced)
            yield Done("stop")
            return
        if text.startswith("/error"):
            arg = text[len("/error") :].strip()
            code = _small_number(arg)
            if code is None or not 400 <= code <= 599:  # a 200 or a 99999 is no upstream error
                code = 500
            raise error_from_status(
                code, f"echo: simulated upstream error {code}", body={"error": {"message": f"simulated {code}"}}
            )
        async for c in self._words_out(f"echo: {text}", request, input_tokens):
            yield c

    async def _words_out(
        self, reply: str, request: ProviderRequest, input_tokens: int, extra_tokens: int = 0
    ) -> AsyncIterator[ProviderChunk]:
        """Stream `reply` word by word (whitespace preserved), honouring max_tokens as words."""
        # One word at a time, not a list of every word first: a reply of millions of words (a big
        # paste echoed back) would hold ~50 bytes per word for as long as the reply streams.
        pieces: Iterator[str] = (
            (m.group() for m in _WORD.finditer(reply)) if _NON_SPACE.search(reply) is not None else iter((reply,))
        )
        limit = request.max_tokens
        per_chunk = WORDS_PER_BIG_CHUNK if len(reply) > WORD_BY_WORD_MAX_CHARS else 1
        produced = 0
        if per_chunk == 1:  # the usual reply: a word a chunk
            for piece in pieces:
                if limit is not None and produced >= limit:  # words left that max_tokens cuts off
                    yield Usage(input_tokens=input_tokens, output_tokens=produced + extra_tokens)
                    yield Done("length")
                    return
                yield Text(piece)
                produced += 1
        else:
            while True:
                take = per_chunk if limit is None else min(per_chunk, limit - produced)
                if take <= 0:
                    if next(pieces, None) is not None:  # words left that max_tokens cuts off
                        yield Usage(input_tokens=input_tokens, output_tokens=produced + extra_tokens)
                        yield Done("length")
                        return
                    break
                words = list(itertools.islice(pieces, take))
                if not words:
                    break
                yield Text("".join(words))
                produced += len(words)
        yield Usage(input_tokens=input_tokens, output_tokens=produced + extra_tokens)
        yield Done("stop")


def _said(message: ChatMessage) -> str:
    """A user message's text: its text parts one per line (each part is its own piece of text,
    never glued to the next)."""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(p["text"] for p in message.content if p.get("type") == "text" and p.get("text"))


def _unwrap_channel_message(text: str) -> str:
    match = _CHANNEL_MESSAGE.search(text)
    if match is None:
        return text
    return re.sub(r"&(lt|gt|quot|#39|amp);", lambda m: _ENTITIES[m.group(0)], match.group(1)).strip()


def _summary(transcript: str) -> str:
    """Echo's compaction summary: the earlier summary's user lines and the folded user messages."""
    said: list[str] = []
    for block in transcript.split("\n\n"):
        head, _, body = block.partition("\n")
        if head in ("[Summary so far]", "[Earlier summary]"):
            said.extend(line.strip() for line in body.removeprefix("summary: users said ").split(" | ") if line.strip())
        elif head == "[User]":
            said.append(" ".join(body.split()))
    return "summary: users said " + " | ".join(said) if said else "summary: (nothing)"


def _trailing_tool_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for m in reversed(messages):
        if m.role != "tool":
            break
        out.append(m)
    out.reverse()
    return out


def parse_call_arguments(arguments: str) -> dict[str, Any]:
    """Helper for tests and tools: echo passes arguments through verbatim."""
    parsed: dict[str, Any] = json.loads(arguments or "{}")
    return parsed
