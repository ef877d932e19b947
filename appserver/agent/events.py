"""Turn events: what the agent loop reports as it works. The TurnController reduces them to snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Phase = Literal["queued", "reasoning", "responding", "acting", "compacting", "finalizing", "awaiting", "retrying"]
ToolStatus = Literal["streaming", "pending_approval", "awaiting_client", "running", "completed", "failed", "denied"]


@dataclass(slots=True, frozen=True)
class PhaseChanged:
    phase: Phase


@dataclass(slots=True, frozen=True)
class StepStarted:
    iteration: int


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ToolCallStarted:
    call_id: str
    name: str
    executor: Literal["server", "client"]


@dataclass(slots=True, frozen=True)
class ToolCallArgsDelta:
    call_id: str
    delta: str


@dataclass(slots=True, frozen=True)
class ToolCallStatus:
    call_id: str
    status: ToolStatus
    output: str | None = None
    is_error: bool = False
    reason: str | None = None


@dataclass(slots=True, frozen=True)
class UsageUpdated:
    usage: dict[str, int]


@dataclass(slots=True, frozen=True)
class Retrying:
    attempt: int
    delay_ms: int
    error: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class StreamDiscarded:
    """A failed attempt's partial output is dropped before a retry (only when nothing was shown)."""


@dataclass(slots=True, frozen=True)
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
