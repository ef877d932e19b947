"""The provider boundary: typed requests in, typed chunks out.

Provider chunks are private to the provider/agent boundary; nothing past the agent loop sees them.
Every provider (echo, OpenAI-compatible, Anthropic) yields exactly these chunk kinds.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from appserver.values import value

# ---------------------------------------------------------------- chunks


@value
class Text:
    text: str


@value
class Reasoning:
    text: str


@value
class Refusal:
    """The model declined to answer (OpenAI's `refusal`): shown as its reply, marked as a refusal."""

    text: str


@value
class ToolCallStart:
    index: int
    id: str
    name: str


@value
class ToolCallArgs:
    index: int
    delta: str


@value
class ProviderState:
    """Opaque replay state (thinking signatures, encrypted reasoning). Stored, never shown."""

    data: dict[str, Any]


@value
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0


FinishReason = Literal["stop", "tool_calls", "length", "content_filter", "unknown"]


@value
class Done:
    finish_reason: FinishReason


ProviderChunk = Text | Reasoning | Refusal | ToolCallStart | ToolCallArgs | ProviderState | Usage | Done

# ---------------------------------------------------------------- requests


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text exactly as the model produced it


@dataclass(slots=True)
class ChatMessage:
    """One message of the context sent to a provider (provider-neutral)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] = ""  # str, or parts: {"type": "text"|"image_url", ...}
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # tool name on role "tool"
    reasoning: str | None = None
    # Replay state as stored: {"provider": <config name>, ...}. A provider replays it only when
    # the name matches its own; others must ignore it.
    provider_state: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


@value
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # the client's `strict` (OpenAI's schema-exact arguments), passed on as sent

    def to_record(self) -> dict[str, Any]:
        """As a turn record keeps a client tool."""
        record: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            record["strict"] = self.strict
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ToolSpec:
        strict = record.get("strict")
        return cls(
            record["name"],
            record.get("description", ""),
            record.get("parameters") or {"type": "object", "properties": {}},
            strict if isinstance(strict, bool) else None,
        )


@dataclass(slots=True)
class ProviderRequest:
    model: str
    messages: list[ChatMessage]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # sent to the upstream as extra body fields
    purpose: Literal["turn", "compaction"] = "turn"  # never sent: what the call is for (echo reads it)


def structured_format(response_format: dict[str, Any] | None) -> str | None:
    """The type of a structured-output `response_format` (json_schema, json_object): a provider
    that cannot follow one refuses it, never drops it. None for none or `text` (plain answers)."""
    if not isinstance(response_format, dict):
        return None
    kind = response_format.get("type")
    return None if kind == "text" else str(kind)


# ---------------------------------------------------------------- errors

ErrorKind = Literal[
    "network",  # connection refused/reset, DNS, read error before any byte
    "timeout",
    "rate_limit",  # 429 without a quota reason
    "quota",  # 429/403 insufficient_quota, billing
    "server",  # 5xx, 408, 409
    "auth",  # 401, 403
    "not_found",  # 404 (unknown model)
    "invalid_request",  # other 4xx
    "context_overflow",  # prompt too long for the model's window
    "protocol",  # upstream spoke something we cannot parse
]

# Transient kinds: the same request may succeed later. Whether to retry also depends on the
# attempt and on output already shown (see retry.py).
RETRYABLE_KINDS: frozenset[str] = frozenset({"network", "timeout", "rate_limit", "server"})


def is_retryable_kind(kind: ErrorKind | str) -> bool:
    return kind in RETRYABLE_KINDS


class ProviderError(Exception):
    """A structured upstream failure; the retry policy decides on (kind, status, attempt)."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s
        self.body = body

    def redact(self, redact: Callable[[str], str]) -> ProviderError:
        """Replace the secrets in what this error says (its message and the upstream's body) with
        what `redact` makes of them, in place; returns the error. An upstream may echo what it was
        sent (an API key in a 401, a `base_url` query in a 404), and the message reaches clients
        and the store: the agent loop redacts every ProviderError before either sees it, with the
        redactor of its Config (appserver.logredact.provider_error_redactor). The kind was
        classified already, from the unredacted text."""
        self.message = redact(self.message)
        self.args = (self.message,)
        if self.body is not None:
            self.body = _redact_json(self.body, redact)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "status": self.status,
            "retryable": is_retryable_kind(self.kind),
            "message": self.message,
        }

    def __repr__(self) -> str:
        return f"ProviderError({self.kind!r}, {self.message!r}, status={self.status})"


def _redact_json(value: Any, redact: Callable[[str], str], depth: int = 0) -> Any:
    """`redact` applied to the strings of a JSON-like value (an upstream's error body)."""
    if isinstance(value, str):
        return redact(value)
    if depth > 32:
        return None  # nested deeper than any error body: dropped rather than walked
    if isinstance(value, dict):
        return {redact(str(k)): _redact_json(v, redact, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_json(v, redact, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        return redact(bytes(value).decode("utf-8", errors="replace"))
    return value


# "The prompt does not fit the model's window", as upstreams say it. Each is one seen in the
# server's code or in its verbatim error bodies. An error code or type is looked for in the error's
# own `code`, `type` or `status` field; a wording in the error's own message (never the rest of the
# body: a validation error may quote the user's text), whole — "this model's maximum context length
# is N", not "maximum context length" — and where the provider puts it: at the start of the message
# or of one of its sentences (or after a proxy's "… - " or "…: "). A broader word ("tokens",
# "context length") would also match errors that compacting cannot fix (a max_tokens over the
# model's output limit, a rate limit "too many tokens per minute"). A message that quotes user text
# right where a provider's wording would start cannot be told apart.
OVERFLOW_CODES = (
    "context_length_exceeded",  # OpenAI, Azure, Groq: error.code
    "exceed_context_size_error",  # llama.cpp server: error.type
)
_N = r"\d(?:[\d,]*\d)?"  # a number, thousands separated or not
_OVERFLOW_WORDINGS = (
    # OpenAI, vLLM, DeepSeek, Azure ("This model's …"), OpenRouter ("This endpoint's …")
    rf"(?:this|the) (?:model|endpoint)'s maximum context length is {_N}",
    # a proxy's or provider's "the model's maximum context length of N" (Fireworks, DeepInfra…)
    r"requested token count exceeds the model's maximum context length",
    rf"prompt contains {_N} tokens.{{0,60}}?too large for model with {_N} maximum context length",  # Mistral
    r"(?:your |the )?(?:input|prompt|request) exceeds the context window",  # OpenAI
    r"(?:the )?prompt is too long\b",  # Anthropic ("prompt is too long: N tokens > M maximum"), Fireworks
    r"input length and .max_tokens. exceed context limit",  # Anthropic ("…: A + B > C")
    rf"(?:the )?request \({_N} tokens\) exceeds the available context size",  # llama.cpp
    r"(?:the )?input token count(?: \(\d[\d,]*\))? exceeds the maximum number of tokens allowed",  # Gemini
    rf"(?:this|the) model's maximum prompt length is {_N}",  # xAI ("… but the request contains M tokens")
    r"input is too long for requested model",  # Amazon Bedrock
    r"(?:the )?number of tokens to keep from the initial prompt is greater than the context length",  # LM Studio
    r"prompt too long; exceeded (?:max )?context length",  # Ollama ("… by N tokens")
    r"(?:the )?input length exceeds the context length",  # Ollama
    r"context[ _]length[ _]exceeded",  # the code's words, as some proxies write them
    r"litellm\.contextwindowexceedederror",  # LiteLLM's proxy
)
_OVERFLOW = re.compile(r"(?:^|[.:;!?]\s+|\s-\s+)(?:" + "|".join(_OVERFLOW_WORDINGS) + ")", re.S)
# The reply alone cannot fit: max_tokens over the window (compacting the prompt cannot help).
# vLLM: "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context
# length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778)"; older vLLM:
# "... maximum context length is 4096 tokens. However, you requested 9000 tokens (1000 in the
# messages, 8000 in the completion)"; OpenRouter: "This endpoint's maximum context length is 131072
# tokens. However, you requested about 140000 tokens (1000 of text input, 139000 in the output)";
# "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a
# total of 9000 tokens: 1000 tokens from the input messages and 8000 tokens for the completion";
# Anthropic: "... exceed context limit: 199759 + 8192 > 200000". Each gives (output, window), in
# that order or (window, output) — `_WINDOW_FIRST`.
_OUTPUT_VS_WINDOW = (
    re.compile(rf"\(({_N}) > ({_N}) - {_N}\)"),
    re.compile(rf"maximum context length is ({_N})\D.*?\b({_N}) in the (?:completion|output)\b", re.S),
    re.compile(rf"maximum context length of ({_N})\D.*?\b({_N}) tokens for the completion\b", re.S),
    re.compile(rf"exceed context limit: {_N} \+ ({_N}) > ({_N})"),
)
_WINDOW_FIRST = frozenset({1, 2})


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _error_fields(body: Any) -> tuple[list[str], list[str]]:
    """The codes (`code`, `type`, `status`) and messages an upstream's error body gives about the
    error itself, lowercased: OpenAI's and Gemini's {"error": {...}}, Anthropic's {"type": "error",
    "error": {...}}, vLLM's and others' flat {"message", "type", "code"}, Ollama's {"error": "..."},
    FastAPI's {"detail": "..."}, a bare text; a list of them (Gemini's stream) by its first."""
    codes: list[str] = []
    messages: list[str] = []
    if isinstance(body, list) and body:
        body = body[0]
    if isinstance(body, str):
        messages.append(body.lower())
    elif isinstance(body, dict):
        for where in (body.get("error"), body):
            if isinstance(where, str):
                messages.append(where.lower())
            elif isinstance(where, dict):
                for key in ("code", "type", "status"):
                    v = where.get(key)
                    if isinstance(v, str):
                        codes.append(v.lower())
                for key in ("message", "detail"):
                    v = where.get(key)
                    if isinstance(v, str):
                        messages.append(v.lower())
    return codes, messages


def is_context_overflow(message: str, body: Any = None) -> bool:
    """Whether an upstream's error says the prompt is too long for the model's window, and a shorter
    prompt would be taken: `message` is the error's message (as the provider extracted it), `body`
    the upstream's error body, from which only the error's own fields are read."""
    codes, messages = _error_fields(body)
    text = (message or "").lower()
    if text and text not in messages:
        messages.append(text)
    if not (any(c in OVERFLOW_CODES for c in codes) or any(_OVERFLOW.search(m) for m in messages)):
        return False
    for m in messages:
        for i, pattern in enumerate(_OUTPUT_VS_WINDOW):
            found = pattern.search(m)
            if found is not None:
                a, b = _number(found.group(1)), _number(found.group(2))
                output, window = (b, a) if i in _WINDOW_FIRST else (a, b)
                if output >= window:
                    return False
    return True


# "The account has no credit left", which waiting does not fix (never retried). Codes are looked
# for in the error's own `code`, `type` or `status`; wordings in its own message, whole. Nothing
# broader: an ordinary per-minute limit names quotas and billing too (Azure's "Please go here:
# https://aka.ms/oai/quotaincrease", OpenAI's free tier "Visit https://platform.openai.com/account/billing
# to add a payment method", Gemini's "Resource has been exhausted (e.g. check quota)").
QUOTA_CODES = (
    "insufficient_quota",  # OpenAI, Azure, DeepSeek…: error.code and error.type
    "billing_hard_limit_reached",  # OpenAI: the organization's spending limit
    "billing_error",  # Anthropic: error.type (HTTP 402)
    "billing_not_active",  # OpenAI: an account with no active billing (HTTP 429)
)
_QUOTA_WORDINGS = (
    "insufficient_quota",  # the code, as a proxy writes it into its own message
    "you exceeded your current quota",  # OpenAI's insufficient_quota message
    "credit balance is too low",  # Anthropic (sent as a 400 invalid_request_error)
    "insufficient credits",  # OpenRouter (402)
)
# A 429 that says outright it is a rate limit: retried even when its message names a quota.
RATE_LIMIT_CODES = (
    "rate_limit_exceeded",  # OpenAI, Groq: error.code
    "rate_limit_error",  # Anthropic: error.type
    "resource_exhausted",  # Gemini: error.status (its per-minute limit, whatever the message says)
    "requests",  # OpenAI: error.type of a requests-per-minute limit
    "tokens",  # OpenAI: error.type of a tokens-per-minute limit
)


def is_out_of_quota(message: str, body: Any = None, *, retry_after_s: float | None = None) -> bool:
    """Whether an upstream's error says the account has no credit or quota left (not a limit per
    minute, which passes): an OpenAI-style `insufficient_quota` code, or else its wording, unless
    the error is a rate limit by its code or says when to retry (`Retry-After`)."""
    codes, messages = _error_fields(body)
    if any(c in QUOTA_CODES for c in codes):
        return True
    if retry_after_s is not None or any(c in RATE_LIMIT_CODES for c in codes):
        return False
    text = (message or "").lower()
    return any(w in m for m in (*messages, text) for w in _QUOTA_WORDINGS)


def error_from_status(
    status: int, message: str, *, body: Any = None, retry_after_s: float | None = None
) -> ProviderError:
    """Classify an upstream HTTP status (+ body) into a ProviderError kind. A 429 is a rate limit
    (retried, after its Retry-After) unless the error's code or wording says the quota is gone."""
    kind: ErrorKind
    if status not in (401, 402, 403, 429) and is_context_overflow(message, body):
        kind = "context_overflow"
    elif status == 429:
        kind = "quota" if is_out_of_quota(message, body, retry_after_s=retry_after_s) else "rate_limit"
    elif status == 402:  # Payment Required: Anthropic's billing_error, OpenRouter's "insufficient credits"
        kind = "quota"
    elif status in (401, 403):
        kind = "quota" if is_out_of_quota(message, body) else "auth"
    elif status == 404:
        kind = "not_found"
    elif status in (408, 409) or status >= 500:
        kind = "server"
    elif status == 400 and is_out_of_quota(message, body):  # Anthropic's "credit balance is too low"
        kind = "quota"
    else:
        kind = "invalid_request"
    return ProviderError(
        kind, message or f"upstream answered HTTP {status}", status=status, body=body, retry_after_s=retry_after_s
    )


# ---------------------------------------------------------------- the interface


class Provider(Protocol):
    """A model backend. `name` is the config name (e.g. "ollama"); `kind` its wire format."""

    name: str
    kind: str

    def stream(self, request: ProviderRequest) -> AsyncIterator[ProviderChunk]:
        """Yield chunks; end with exactly one Done. Raise ProviderError on failure."""
        ...

    async def aclose(self) -> None: ...
