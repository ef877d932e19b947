"""Typed rows of the store. Plain dataclasses: the store hands these to the runtime and front ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TurnStatus = Literal["queued", "running", "awaiting", "completed", "cancelled", "failed", "interrupted"]
TERMINAL_TURN_STATUSES: frozenset[str] = frozenset({"completed", "cancelled", "failed", "interrupted"})
Policy = Literal["allow", "ask", "deny"]
POLICIES: tuple[str, ...] = ("allow", "ask", "deny")


# A policy key for every tool the agent's policies do not name. No command sets it (a policy names a
# tool); an agent whose stored policies are damaged reads as {EVERY_TOOL: "deny"} (rows.py), so a
# tool its lost policies denied is never let run by its default.
EVERY_TOOL = "*"


@dataclass(slots=True)
class AgentRecord:
    id: str
    name: str
    model: str = "echo"
    system: str = ""
    tools: dict[str, str] = field(default_factory=dict)  # tool name → allow | ask | deny
    params: dict[str, Any] = field(default_factory=dict)  # temperature, max_tokens, reasoning_effort, max_steps
    created_at: float = 0.0
    updated_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "model": self.model,
            "system": self.system,
            "tools": dict(self.tools),
            "params": dict(self.params),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(slots=True)
class ConversationRecord:
    id: str
    agent_id: str
    is_default: bool = False
    title: str = ""
    user: str | None = None
    namespace: str | None = None  # the caller namespace that created it (HTTP X-Conversation-Id)
    forked_from: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "agent_id": self.agent_id,
            "default": self.is_default,
            "title": self.title,
            "user": self.user,
            "forked_from": self.forked_from,
            "metadata": dict(self.metadata),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(slots=True)
class MessageRecord:
    """One persisted message. `content` is text or a list of parts (text/image)."""

    role: Literal["system", "user", "assistant", "tool", "compaction"]
    content: str | list[dict[str, Any]] = ""
    id: int | None = None
    conversation_id: str = ""
    turn_id: str | None = None
    iteration: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{id, name, arguments, kind}]
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    reasoning: str | None = None
    provider_state: dict[str, Any] | None = None
    completion_status: str = "completed"  # completed | cancelled | interrupted | incomplete
    source: dict[str, Any] | None = None
    created_at: float = 0.0
    # Context bookkeeping: assistant {"context_tokens": N} (the provider-measured size of the
    # context up to and including this reply); compaction {"kept": K, ...} (see agent/context.py).
    meta: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") in ("text", "input_text"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "turn_id": self.turn_id,
            "role": self.role,
            "content": self.content,
            "completion_status": self.completion_status,
            "created_at": self.created_at,
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c["id"], "name": c["name"], "arguments": c["arguments"]} for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
            out["name"] = self.name
            out["is_error"] = self.is_error
        if self.reasoning:
            out["reasoning"] = self.reasoning
        if isinstance(self.meta.get("refusal"), str):
            out["refusal"] = self.meta["refusal"]  # the part of the content that is the model's refusal
        if self.source:
            out["source"] = self.source
        if self.role == "compaction":
            out["meta"] = {
                k: self.meta[k] for k in ("kept", "folded", "tokens_before", "tokens_after", "window") if k in self.meta
            }
        elif self.role == "system" and self.meta.get("role") == "developer":
            out["meta"] = {"role": "developer"}  # a developer message (Responses input), kept as system
        return out  # provider_state is never part of a client view


@dataclass(slots=True)
class TurnRecord:
    id: str
    conversation_id: str
    agent_id: str
    status: TurnStatus = "queued"
    stop_reason: str | None = None
    error: dict[str, Any] | None = None
    idempotency_key: str | None = None
    source: dict[str, Any] | None = None
    input: dict[str, Any] = field(default_factory=dict)  # {"content": ..., "instructions": ...}
    input_committed: bool = False
    client_tools: list[dict[str, Any]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    owner: str | None = None  # process identity running it
    draft: dict[str, Any] | None = None  # checkpoint of visible text while running
    usage: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    iteration: int = 0
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    # A cancel acknowledged to a client while the turn was open (`cancelled`: true), saved before
    # the acknowledgement so that a restart ends the turn cancelled too (runtime/settle.py
    # `cancel_ack`): the calls whose tool had begun (`started`), and those of them that had
    # returned a result not saved yet (`ran`). None: no cancel was acknowledged.
    cancel_ack: dict[str, Any] | None = None
    # No column: which of TURN_RUN_COLUMNS were damaged when read (rows.py). Such a turn reads with
    # stand-ins for them, to be shown; it never runs with them (runtime/run.py ends it failed).
    damaged: tuple[str, ...] = field(default=(), metadata={"column": False})


# The columns a turn runs with: its input (the user's message), the client's tools (a call to one runs
# in the client, never on the server) and its request options (instructions among them).
TURN_RUN_COLUMNS: tuple[str, ...] = ("input", "client_tools", "options")


@dataclass(slots=True)
class TurnSettings:
    """What a request answering a paused turn brings for the turn's model calls after its answers
    (on the OpenAI surfaces every request is its own model call, with its own parameters): its
    options and client tools. They replace the turn's (`TurnRecord.options`, `.client_tools`) in
    the transaction that writes its answer (`Store.resolve_pending`), so whoever resumes the turn
    (this server, one after a restart, another of a cluster) runs its calls with them."""

    options: dict[str, Any]
    client_tools: list[dict[str, Any]]


PendingKind = Literal["approval", "client"]
PendingStatus = Literal["pending", "approved", "denied", "result", "expired", "cancelled"]


@dataclass(slots=True)
class PendingCall:
    call_id: str
    conversation_id: str
    turn_id: str
    name: str
    arguments: str
    kind: PendingKind
    status: PendingStatus = "pending"
    output: str | None = None
    is_error: bool = False
    reason: str | None = None
    decided_by: str | None = None
    created_at: float = 0.0
    expires_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
            "kind": self.kind,
            "status": self.status,
            "expires_at": self.expires_at,
        }


@dataclass(slots=True)
class TurnCommit:
    """Everything one turn (or one segment of it, up to a pause) writes, in one transaction."""

    turn_id: str
    status: TurnStatus
    stop_reason: str | None
    messages: list[MessageRecord] = field(default_factory=list)
    pending: list[PendingCall] = field(default_factory=list)
    error: dict[str, Any] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    iteration: int = 0
    input_committed: bool = True


@dataclass(slots=True)
class ResponseRecord:
    """A stored `/v1/responses` object: its body as sent, its input items, where it left its conversation."""

    id: str
    agent_id: str
    conversation_id: str
    body: dict[str, Any]
    turn_id: str | None = None
    previous_response_id: str | None = None
    namespace: str | None = None
    last_message_id: int = 0  # the conversation's last message when this response ended (fork point)
    input_items: list[dict[str, Any]] = field(default_factory=list)
    stored: bool = True
    created_at: float = 0.0


@dataclass(slots=True, frozen=True)
class ResponseOwner:
    """Whose a stored response is, read without its body or input items: a caller it is not
    for is refused before those are read, so the time a refusal takes does not tell whether
    (or how large) another credential's response is."""

    id: str
    agent_id: str
    conversation_id: str
    previous_response_id: str | None = None


@dataclass(slots=True)
class HttpIdempotency:
    """An `Idempotency-Key` seen on an HTTP POST: the body hash and, once done, the stored reply."""

    scope: str
    key: str
    body_hash: str
    state: str = "pending"  # pending | done
    status_code: int | None = None
    content_type: str | None = None
    body: str | None = None
    conversation_id: str | None = None
    created_at: float = 0.0
    owner: str | None = None  # process identity (pid:starttime) of the request that claimed it


@dataclass(slots=True, frozen=True)
class HistoryPoint:
    """A client-visible history prefix (its hash) that a conversation reached, and its last message id."""

    agent_id: str
    prefix_hash: str
    conversation_id: str
    last_message_id: int
    created_at: float = 0.0
