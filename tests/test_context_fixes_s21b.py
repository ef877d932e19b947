"""Context management fixes (s21b): the kept part of a compaction is sized from what the system
prompt, instructions and tools leave; a lead too big on its own, or a refused request that cannot be
made smaller, fails the turn at once saying why; "context too long" is read from the error's own
fields, whole wordings where the providers put them, numbers with thousands separators."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from appserver.agent.context import Budget, compact, estimate_message, to_chat_message
from appserver.config import load_config
from appserver.providers.base import (
    Done,
    ProviderChunk,
    ProviderRequest,
    Text,
    ToolSpec,
    error_from_status,
)
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.records import MessageRecord
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_error, openai_sse, usage_chunk
from tests.fakes.windowed_model import _json_reply

WORD = "abcdefg "  # 8 characters
LINE = "The quarterly report mentions budgets, hiring plans, a product launch and several open risks. "


@dataclass
class CharModel:
    """A model that counts `chars_per_token` characters a token (the server estimates 3.5) and, like
    vLLM, refuses a request whose prompt plus max_tokens passes its window, with vLLM's words."""

    window: int
    chars_per_token: float = 3.5
    seen: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, body: dict[str, Any]) -> int:
        chars = extra = 0
        for m in body["messages"]:
            extra += 4
            content = m.get("content") or ""
            chars += len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
            for call in m.get("tool_calls") or []:
                chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
                extra += 4
        if body.get("tools"):
            chars += len(json.dumps(body["tools"]))
        return math.ceil(chars / self.chars_per_token) + extra

    def __call__(self, request: RecordedRequest) -> Reply:
        body = request.json
        tokens = self.count(body)
        wanted = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        summary = not body.get("tools") and "summar" in str(body["messages"][0].get("content", "")).lower()
        rejected = tokens + wanted > self.window
        with self._lock:
            self.seen.append({"tokens": tokens, "rejected": rejected, "summary": summary, "body": body})
        if rejected:
            message = (
                f"This model's maximum context length is {self.window} tokens. However, you requested "
                f"{tokens + wanted} tokens ({tokens} in the messages, {wanted} in the completion). Please reduce "
                "the length of the messages or completion."
            )
            return _json_reply(400, {"object": "error", "type": "BadRequestError", "code": 400, "message": message})
        text = "Summary: earlier turns discussed plans." if summary else "Acknowledged: noted."
        chunks = [chunk(role="assistant", content=text), chunk(finish_reason="stop"), usage_chunk(tokens, 5)]
        return Reply(pieces=[openai_sse(chunks)])

    def turns(self) -> list[dict[str, Any]]:
        return [s for s in self.seen if not s["summary"]]


async def _server(home: Path, base_url: str, windows: str | None = "model = 3000") -> Server:
    home.mkdir(parents=True, exist_ok=True)
    extra = f"\ncontext_windows = {{ {windows} }}\n" if windows else "\n"
    (home / "config.toml").write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{base_url}"\napi_key_env = ""{extra}'
    )
    server = Server(load_config(home, environ={"APPSERVER_LIMITS__RETRY_BASE_MS": "5"}))
    await server.open()
    return server


async def _turn(
    server: Server, agent: str, text: str, conv: str = "new", tools: list[ToolSpec] | None = None, **options: Any
) -> tuple[str, Any]:
    sub = await server.kernel.submit(
        SubmitRequest(agent=agent, input=text, conversation=conv, client_tools=tools or [], options=options)
    )
    return sub.conversation_id, await sub.wait(30)


def _client_tools() -> list[ToolSpec]:
    return [
        ToolSpec(
            name=f"tool{j}",
            description=LINE * 3,
            parameters={
                "type": "object",
                "properties": {f"p{q}": {"type": "string", "description": LINE} for q in range(3)},
            },
        )
        for j in range(4)
    ]


# ---------------------------------------------------------------- bug 1: a big lead


@pytest.mark.parametrize("extra", ["none", "client_tools", "instructions"])
async def test_a_big_system_prompt_beside_max_tokens_compacts_and_every_turn_completes(
    tmp_path: Path, extra: str
) -> None:
    model = CharModel(window=3_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            # ~1,400 tokens of system prompt, or ~450 beside ~1,000 of client tools, or ~700 beside ~650 of instructions
            system = "Rules: " + WORD * {"none": 612, "client_tools": 200, "instructions": 300}[extra]
            await server.agents.create("a", "fake:model", system=system, params={"max_tokens": 1_000})
            options: dict[str, Any] = {"instructions": LINE * 24} if extra == "instructions" else {}
            tools = _client_tools() if extra == "client_tools" else None
            conv = "new"
            statuses = []
            for i in range(5):
                conv, snap = await _turn(server, "a", f"turn {i}: " + WORD * 65, conv, tools, **options)
                statuses.append((snap.status, snap.error))
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    assert statuses == [("completed", None)] * 5
    assert not [s["tokens"] for s in model.seen if s["rejected"]]
    # every later turn folded what came before its newest message; nothing folded is lost
    compactions = [m for m in history if m.role == "compaction"]
    assert compactions and all(m.meta["kept"] >= 1 for m in compactions)
    last = model.turns()[-1]["body"]["messages"]
    assert last[-1]["content"].startswith("turn 4: ")
    assert any("[Summary of the earlier conversation]" in str(m.get("content")) for m in last)


async def test_a_denser_tokenizer_refusal_is_retried_with_a_smaller_request(tmp_path: Path) -> None:
    # The model counts 2 characters a token, the estimate 3.5: the first request of a conversation
    # with a big system prompt is refused; the retry folds down to the newest message and fits.
    model = CharModel(window=3_000, chars_per_token=2.0)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("a", "fake:model", system="Rules: " + WORD * 180, params={"max_tokens": 1_000})
            conv = "new"
            snaps = []
            for i in range(4):
                conv, snap = await _turn(server, "a", f"turn {i}: " + WORD * 60, conv)
                snaps.append((snap.status, snap.error))
        finally:
            await server.close()
    assert snaps == [("completed", None)] * 4
    turns = model.turns()
    refused = [s for s in turns if s["rejected"]]
    # a refused request is never sent again as it was: each retry is smaller than what it answers
    for i, s in enumerate(turns[:-1]):
        if s["rejected"]:
            assert turns[i + 1]["tokens"] < s["tokens"]
    assert len(refused) <= 1


async def test_a_lead_too_big_for_the_window_fails_at_once_saying_why(tmp_path: Path) -> None:
    model = CharModel(window=3_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("a", "fake:model", system="Rules: " + WORD * 1_000, params={"max_tokens": 1_000})
            conv, first = await _turn(server, "a", "turn 0: hello")
            conv, second = await _turn(server, "a", "turn 1: hello again", conv)
        finally:
            await server.close()
    for snap in (first, second):
        assert snap.status == "failed" and snap.error["kind"] == "context_overflow", snap.error
        assert snap.error["retryable"] is False
        message = snap.error["message"]
        assert "system prompt" in message and "tool" in message and "3000" in message, message
    assert model.seen == []  # a request known to be too big is never sent


async def test_a_refusal_that_compacting_cannot_answer_fails_without_resending_the_same_request(
    tmp_path: Path,
) -> None:
    async with FakeOpenAI() as fake:
        server = await _server(tmp_path / "h", fake.base_url, windows=None)  # default window: the estimate fits
        try:
            await server.agents.create("a", "fake:model")
            for _ in range(4):
                fake.fail(
                    400,
                    openai_error("This model's maximum context length is 10 tokens.", code="context_length_exceeded"),
                )
            _, snap = await _turn(server, "a", "hi")
        finally:
            await server.close()
    assert snap.status == "failed" and snap.error["kind"] == "context_overflow", snap.error
    assert "compacting cannot make it smaller" in snap.error["message"], snap.error
    assert "maximum context length is 10 tokens" in snap.error["message"]
    assert len(fake.requests) == 1  # the retry would have been the same request


@dataclass
class _Summariser:
    name: str = "stub"
    kind: str = "openai"
    requests: list[ProviderRequest] = field(default_factory=list)

    async def stream(self, request: ProviderRequest) -> AsyncIterator[ProviderChunk]:
        self.requests.append(request)
        yield Text("short summary")
        yield Done("stop")

    async def aclose(self) -> None:
        pass


def _history() -> list[MessageRecord]:
    call = {"id": "c1", "name": "clock", "arguments": "{}", "executor": "server"}
    return [
        MessageRecord(role="user", content="turn 1: " + WORD * 60),
        MessageRecord(role="assistant", content="ok"),
        MessageRecord(role="user", content="turn 2: " + WORD * 60),
        MessageRecord(role="assistant", content="", tool_calls=[call]),
        MessageRecord(role="tool", content="12:00 " * 30, tool_call_id="c1", name="clock"),
    ]


async def test_compact_keeps_what_the_lead_leaves_never_splitting_a_call_from_its_result() -> None:
    view = _history()
    size = sum(estimate_message(to_chat_message(m)) for m in view)
    budget = Budget(3_000, 1_000)
    provider = _Summariser()
    # A small lead leaves room for the whole short view: nothing to fold.
    assert await compact(provider, "m", view, budget, 2_100, "t", 1, lambda e: None, lead_tokens=100) is None
    assert size < budget.limit * 2 // 5
    # A lead of most of the budget: fold down to the newest message, which starts at the tool call.
    done = await compact(provider, "m", view, budget, 2_100, "t", 1, lambda e: None, lead_tokens=1_500)
    assert done is not None and done.folded == 3 and done.message.meta["kept"] == 2
    # A provider counting twice our estimate: the same lead and view leave less room.
    half = await compact(provider, "m", view, budget, 2_100, "t", 1, lambda e: None, lead_tokens=700)
    double = await compact(provider, "m", view, budget, 2_100, "t", 1, lambda e: None, lead_tokens=700, scale=2.0)
    assert half is None and double is not None and double.message.meta["kept"] == 2


# ---------------------------------------------------------------- bug 2: classification


@pytest.mark.parametrize(
    ("status", "message", "body", "kind"),
    [
        # OpenRouter: the reply alone is bigger than the window
        (
            400,
            "This endpoint's maximum context length is 131072 tokens. However, you requested about 140000 tokens "
            "(1000 of text input, 139000 in the output). Please reduce the length of either one, or use the "
            '"middle-out" transform to compress your prompt automatically.',
            None,
            "invalid_request",
        ),
        (
            400,
            "This endpoint's maximum context length is 131072 tokens. However, you requested about 140000 tokens "
            "(130000 of text input, 10000 in the output).",
            None,
            "context_overflow",
        ),
        # thousands separators
        (
            400,
            "This model's maximum context length is 4,096 tokens. However, you requested 9,000 tokens (1,000 in the "
            "messages, 8,000 in the completion).",
            None,
            "invalid_request",
        ),
        (
            400,
            "This model's maximum context length is 8,192 tokens. However, you requested 9,000 tokens (8,000 in the "
            "messages, 1,000 in the completion).",
            None,
            "context_overflow",
        ),
        (
            400,
            "input length and `max_tokens` exceed context limit: 1,000 + 300,000 > 200,000, decrease input length",
            None,
            "invalid_request",
        ),
        (
            400,
            "input length and `max_tokens` exceed context limit: 199,759 + 8,192 > 200,000, decrease input length",
            None,
            "context_overflow",
        ),
        (
            400,
            "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total "
            "of 12000 tokens: 3000 tokens from the input messages and 9000 tokens for the completion.",
            None,
            "invalid_request",
        ),
        # user text quoted by a validation error is not the provider saying "too long"
        (
            400,
            "1 validation error: messages.0.content input_value='what is the maximum context length of gpt-4?' "
            "extra field 'foo' not permitted",
            None,
            "invalid_request",
        ),
        (
            422,
            "Unprocessable Entity",
            {"detail": [{"msg": "extra field", "input": "This model's maximum context length is 8192 tokens."}]},
            "invalid_request",
        ),
        (
            400,
            "Invalid 'messages[0].name': string does not match pattern.",
            {
                "error": {
                    "message": "Invalid 'messages[0].name': string does not match pattern.",
                    "param": "messages[0].name",
                    "input": "my prompt is too long: shorten it, and the maximum context length is 10",
                    "code": "invalid_value",
                }
            },
            "invalid_request",
        ),
        (400, "Bad request: the user wrote 'prompt is too long' in their message", None, "invalid_request"),
        # the error's own fields, as providers send them
        (
            400,
            "Please reduce the length of the messages.",
            {"error": {"message": "Please reduce the length of the messages.", "code": "context_length_exceeded"}},
            "context_overflow",
        ),
        (
            400,
            "upstream answered HTTP 400",
            {"error": "prompt too long; exceeded max context length by 120 tokens"},
            "context_overflow",
        ),
        (
            400,
            "Error code: 400 - This model's maximum context length is 8192 tokens. However, your messages resulted in "
            "9000 tokens.",
            None,
            "context_overflow",
        ),
        (
            400,
            "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError",
            {"error": {"message": "litellm.ContextWindowExceededError: ...", "type": None, "code": "400"}},
            "context_overflow",
        ),
    ],
)
def test_context_overflow_is_read_from_the_errors_own_fields(status: int, message: str, body: Any, kind: str) -> None:
    assert error_from_status(status, message, body=body).kind == kind
