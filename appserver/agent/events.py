"""Turn events: what the agent loop reports as it works. The TurnController reduces them to snapshots."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

from appserver.values import value

Phase = Literal["queued", "reasoning", "responding", "acting", "compacting", "finalizing", "awaiting", "retrying"]
ToolStatus = Literal["streaming", "pending_approval", "awaiting_client", "running", "completed", "failed", "denied"]


@value
class PhaseChanged:
    phase: Phase


@value
class StepStarted:
    iteration: int


@value
class ReasoningDelta:
    text: str


@value
class TextDelta:
    text: str
    refusal: bool = False  # the model's refusal (OpenAI `refusal`), shown as text and marked so


@value
class ToolCallStarted:
    call_id: str
    name: str
    executor: Literal["server", "client"]


@value
class ToolCallArgsDelta:
    call_id: str
    delta: str


@value
class ToolCallStatus:
    call_id: str
    status: ToolStatus
    output: str | None = None
    is_error: bool = False
    reason: str | None = None


@value
class UsageUpdated:
    usage: dict[str, int]


@value
class Retrying:
    attempt: int
    delay_ms: int
    error: dict[str, Any] = field(default_factory=dict)


@value
class StreamDiscarded:
    """A failed attempt's partial output is dropped before a retry (only when nothing was shown)."""


@value
class Compacted:
    summary: str
    messages_folded: int


TurnEvent = (
    PhaseChanged
    | StepStarted
    | ReasoningDelta
    | TextDelta
    | ToolCallStarted
    | ToolCallArgsDelta
    | ToolCallStatus
    | UsageUpdated
    | Retrying
    | StreamDiscarded
    | Compacted
)
