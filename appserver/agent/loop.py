"""The agent loop: provider stream → turn events; tool calls → policy → results → next step.

The loop never touches the store or the snapshot: it reads a `TurnWork` (history + this turn's new
messages), appends to it, reports `TurnEvent`s through `emit`, and returns a `LoopOutcome`. The
runtime owns persistence and the turn's lifecycle; on cancel it settles from the same `TurnWork`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from appserver.agent.context import (
    Budget,
    ContextDoesNotFit,
    ToolEstimates,
    anchor_basis,
    cannot_shrink,
    clip_oversized,
    compact,
    context_view,
    estimate_lead,
    estimate_message,
    estimate_request,
    lead_too_large,
    overflow_budget,
    own_system_too_large,
    to_chat_message,
    window_for,
)
from appserver.agent.events import (
    PhaseChanged,
    ReasoningDelta,
    Retrying,
    StepStarted,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStarted,
    ToolCallStatus,
    TurnEvent,
    UsageUpdated,
)
from appserver.agent.tools import Tool, ToolContext, ToolOutput, ToolRegistry, canonical_arguments, parse_arguments
from appserver.config import Config
from appserver.logredact import provider_error_redactor
from appserver.providers.base import (
    ChatMessage,
    Done,
    ProviderError,
    ProviderRequest,
    ProviderState,
    Reasoning,
    Refusal,
    Text,
    ToolCallArgs,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from appserver.providers.registry import ProviderRegistry
from appserver.providers.retry import RetryPolicy, retry_delay_ms
from appserver.shown import shown
from appserver.store.records import AgentRecord, MessageRecord, PendingCall
from appserver.textparts import TextParts, map_big_allocations
from appserver.values import value

# Chunks handled before the loop yields to the event loop once (each costs some microseconds).
CHUNKS_BETWEEN_YIELDS = 64

log = logging.getLogger("appserver.agent")

Emit = Callable[[TurnEvent], None]

PROVIDER_OPTION_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
)
# What a request may still set on an agent with `allow_overrides=false`: the shape of the answer the
# client needs, not the sampling the agent's owner chose.
# A model reply that ended before it was done: its stop reason, and why its calls are not run.
CUT_SHORT: dict[str, tuple[str, str]] = {
    "length": ("max_tokens", "the reply hit the output token limit"),
    "content_filter": ("content_filter", "the provider's content filter stopped the reply"),
}
REQUEST_SHAPE_KEYS = ("response_format", "tool_choice", "parallel_tool_calls")
# Turn options by which the request that started a turn narrows the agent's own tools for it (an
# `mcp` tool's allowed_tools and require_approval on /v1/responses), never widens them: the names
# of the only tools offered (absent: every one the agent's policies offer), and the names of tools
# asked about before each call even where the agent's policy is `allow`.
OFFERED_TOOLS = "agent_tools_offered"
ASKED_TOOLS = "agent_tools_asked"
# Turn option of a request that carries its whole transcript (every chat completion; a Responses
# request without previous_response_id or conversation): its own system/developer text instructs
# the turn (`instructions`), so the system messages the conversation keeps stay out of its model
# view (`turn_view`), which would otherwise show a stateless client's resent prompt twice.
OWN_SYSTEM = "own_system"
# Turn option written with a request's answers to a paused turn (runtime/pending.py): the iteration
# the turn paused at. The turn's options are then that request's (`TurnSettings`), its tool_choice
# for the first model call after its answers; a turn resumed without them (answers from the
# WebSocket protocol, calls that expired) makes that call with `auto` (`_drop_tool_choice`).
ANSWERED_AT = "answered_at"

# A Responses request's `max_tool_calls`: how many calls of the server's own tools (OpenAI's
# "built-in tools") its turn may process. Calls past it are not run (their result says so) and
# the server's tools are no longer offered to the model; the client's function tools are not
# counted (the client runs them).
MAX_TOOL_CALLS = "max_tool_calls"


def server_calls_made(work: TurnWork) -> int:
    """The calls of the server's tools the model asked for in the request's part of the turn: its
    steps in every segment (those of earlier segments are in the history: a turn's messages end
    it), after the step whose calls the request answered when it resumed the turn (ANSWERED_AT:
    the options, the cap among them, are that request's; OpenAI counts it per response). A call
    counts once, to the response whose step asked for it: an approved call was counted by the
    response that asked for the approval (its cap let it be asked), not again by the one that
    approves it and runs it (docs/openai.md, max_tool_calls)."""
    since = work.options.get(ANSWERED_AT)
    made = 0
    for m in reversed([*work.history, *work.new_messages]):
        if m.turn_id != work.turn_id:
            break
        if m.role == "assistant" and (not isinstance(since, int) or m.iteration > since):
            made += sum(1 for c in m.tool_calls if c.get("executor") != "client")
    return made


def tool_calls_left(work: TurnWork, *, besides: int = 0) -> int | None:
    """What the turn's MAX_TOOL_CALLS leaves of the server's tool calls (None: no cap; below 0:
    more were asked for), not counting the last `besides` calls asked for."""
    cap = work.options.get(MAX_TOOL_CALLS)
    if not isinstance(cap, int) or isinstance(cap, bool):
        return None
    return cap - server_calls_made(work) + besides


def provider_params(agent: AgentRecord, options: dict[str, Any]) -> dict[str, Any]:
    """The sampling and shape options a model call of `agent` is sent: the agent's params, and the
    request's where the agent lets them win (`allow_overrides`). The Responses route echoes these
    (what the model got), not what the request asked for."""
    params: dict[str, Any] = {k: agent.params.get(k) for k in PROVIDER_OPTION_KEYS if agent.params.get(k) is not None}
    overridable = PROVIDER_OPTION_KEYS if agent.params.get("allow_overrides", True) else REQUEST_SHAPE_KEYS
    params.update({k: options[k] for k in overridable if options.get(k) is not None})
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return params


def model_call_params(providers: ProviderRegistry, agent: AgentRecord, options: dict[str, Any]) -> dict[str, Any]:
    """`provider_params` as the agent's provider sends them: a provider that leaves some out or
    changes them (anthropic: no temperature with thinking, no effort without a thinking budget)
    says so by its `sent_params`, the rule its request body is built by. What the Responses route
    echoes as used."""
    params = provider_params(agent, options)
    try:
        provider, _ = providers.resolve(agent.model)
    except Exception:  # a misconfigured provider fails the turn with its own error
        return params
    adjust = getattr(provider, "sent_params", None)
    if not callable(adjust):
        return params
    spec = allowed_spec(params.get("tool_choice"))
    if spec is None:
        sent: dict[str, Any] = adjust(params)
        return sent
    # the provider is sent the choice's plain form (`plain_choice`): what it makes of that is
    # the mode it gets (a forced one it cannot send is `auto`)
    sent = adjust({**params, "tool_choice": plain_choice(spec.get("mode"), allowed_names(spec))})
    mode = "auto" if sent.get("tool_choice") == "auto" else spec.get("mode")
    sent["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {**spec, "mode": mode}}
    return sent


def choice_without_withheld(choice: Any, offered: set[str]) -> Any:
    """A tool choice for a model call offered only `offered` (the server's tools withheld past
    max_tool_calls), never one the provider refuses. A choice that names tools (a function, an
    `mcp` one, allowed_tools) still restricts the call to them: with none of them offered any
    more, it is an allowed_tools choice of no tools (`build_request` then offers none), never
    `auto` over the tools the client left out of it. None when no tool is offered."""
    if choice in (None, "none", "auto"):
        return choice
    if not offered:
        return None
    if isinstance(choice, dict):
        spec = allowed_spec(choice)
        names = (
            allowed_names(spec)
            if spec is not None
            else [choice.get("name") or (choice.get("function") or {}).get("name")]
        )
        if not any(n in offered for n in names):
            return {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}
    return choice


def allowed_spec(choice: Any) -> dict[str, Any] | None:
    """The `{mode, tools}` of an allowed_tools tool_choice (http/chat.tool_choice_of's shape), else None."""
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        spec = choice.get("allowed_tools")
        return spec if isinstance(spec, dict) else None
    return None


def allowed_names(spec: dict[str, Any]) -> list[str]:
    """The functions an allowed_tools choice lists."""
    fns = [t.get("function") for t in spec.get("tools") or [] if isinstance(t, dict)]
    return [fn["name"] for fn in fns if isinstance(fn, dict) and isinstance(fn.get("name"), str)]


def plain_choice(mode: Any, names: list[str]) -> Any:
    """An allowed_tools choice of `mode` over the tools `names`, once the call offers only those:
    `auto`, or `required` (one tool: that function), which every provider takes. Upstreams that
    know no allowed_tools (Anthropic's, most OpenAI-compatible servers) would otherwise offer every
    tool, or refuse the call."""
    if mode != "required":
        return "auto"
    if len(names) == 1:
        return {"type": "function", "function": {"name": names[0]}}
    return "required"


def turn_offers(options: dict[str, Any], name: str) -> bool:
    """Whether a turn of `options` may offer the agent's tool `name` (its OFFERED_TOOLS, when it
    has them, list it; a value that is no list offers none: narrowing fails closed)."""
    if OFFERED_TOOLS not in options:
        return True
    offered = options[OFFERED_TOOLS]
    return isinstance(offered, list) and name in offered


def narrowed_policy(options: dict[str, Any], name: str, policy: str | None) -> str | None:
    """The policy of the agent's tool `name` (`policy`: the agent's) in a turn of `options`: None
    (not offered, never run) for a tool outside the turn's OFFERED_TOOLS, `ask` for an `allow`ed
    one among its ASKED_TOOLS; the agent's own otherwise (an `ask` or `deny` is never loosened)."""
    if policy is None or policy == "deny":
        return policy
    if not turn_offers(options, name):
        return None
    asked = options.get(ASKED_TOOLS)
    if policy == "allow" and isinstance(asked, list) and name in asked:
        return "ask"
    return policy


@dataclass(slots=True)
class StreamingCall:
    id: str
    name: str
    executor: str
    args: TextParts = field(default_factory=TextParts)


@dataclass(slots=True)
class StreamingAssistant:
    """The assistant message being streamed right now (lost on retry, settled on cancel)."""

    text: TextParts = field(default_factory=TextParts)
    reasoning: TextParts = field(default_factory=TextParts)
    calls: dict[int, StreamingCall] = field(default_factory=dict)
    provider_state: dict[str, Any] | None = None
    shown: bool = False  # anything reached a client: a retry would contradict it
    usage: Usage | None = None
    refusal: TextParts = field(default_factory=TextParts)  # the model's refusal (also at the end of `text`)
    # What the provider's count of this reply's request describes (context.anchor_basis); None when
    # that request was clipped, so the count must never anchor a later estimate.
    basis: dict[str, Any] | None = None


@dataclass(slots=True)
class TurnWork:
    """Mutable working state of one running turn segment. Owned by the runtime's turn task."""

    agent: AgentRecord
    conversation_id: str
    turn_id: str
    history: list[MessageRecord]
    new_messages: list[MessageRecord] = field(default_factory=list)
    client_tools: list[ToolSpec] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    iteration: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    partial: StreamingAssistant | None = None
    pending: list[PendingCall] = field(default_factory=list)
    # Calls whose tool began to run in this segment: a turn stopped early says of the others that
    # they never ran (runtime/settle.py), of these that they were stopped.
    started_calls: set[str] = field(default_factory=set)
    # MessageRecord → ChatMessage; the runtime passes a per-conversation cache (runtime/chatcache.py).
    to_chat: Callable[[MessageRecord], ChatMessage] = to_chat_message
    # Awaited before the first tool runs: a turn whose accept is still committing (the runtime's
    # overlapped accept) must not act on the world until it durably exists. Raises if it never will.
    before_effects: Callable[[], Awaitable[None]] | None = None
    # Awaited (with this work) before server tools run: the runtime stores the calls first, so a
    # crash while they run leaves them in history (crash settle then closes them as interrupted).
    # Given the work rather than holding it, so a turn's work holds no reference cycle.
    before_tools: Callable[[TurnWork], Awaitable[None]] | None = None


def turn_view(work: TurnWork) -> list[MessageRecord]:
    """What the model sees of the turn's conversation (context.context_view), every model call
    and estimate alike: without its system messages for a turn whose request carried its own
    (OWN_SYSTEM), so each request message after the lead is one record of this view."""
    messages = [*work.history, *work.new_messages]
    if work.options.get(OWN_SYSTEM):
        messages = [m for m in messages if m.role != "system"]
    return context_view(messages)


@dataclass(slots=True)
class LoopOutcome:
    status: str  # completed | awaiting | failed
    stop_reason: str
    error: dict[str, Any] | None = None


@value
class Resolution:
    """The answer to one pending call, turned into a tool result when the turn resumes."""

    call: PendingCall


WAIT_SHOWN_S = 1.0  # a writer that waited this long for its resource's lock says so in its result


class KeyedLocks:
    """Writers that touch the same resource (e.g. an agent's workspace) run one at a time."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def get(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock


class AgentLoop:
    def __init__(self, config: Config, providers: ProviderRegistry, tools: ToolRegistry) -> None:
        self.config = config
        self.providers = providers
        self.tools = tools
        self._locks = KeyedLocks()
        self._tool_estimates = ToolEstimates()
        self._windows: dict[tuple[str, str], int | None] = {}
        # What an upstream says in an error reaches clients (`Retrying`, the failed turn) and the
        # store: secrets it echoes (the API key of a 401, a base_url query) are redacted first.
        self._redactor = provider_error_redactor(config)
        # A reply may be as long as answer_max_bytes (64 MiB): its copies must not stay with the
        # process once freed (textparts.py).
        map_big_allocations()

    # ------------------------------------------------------------ entry points

    async def run(self, work: TurnWork, emit: Emit, resolutions: list[PendingCall] | None = None) -> LoopOutcome:
        """Run (or resume) a turn until a final stop reason."""
        if resolutions:
            if work.options.get(ANSWERED_AT) != work.iteration:
                # it was the first call of the request that started the turn (a request that
                # answered the calls brought its own options for the calls after its answers: kept)
                _drop_tool_choice(work)
            emit(PhaseChanged("acting"))
            await self._apply_resolutions(work, resolutions, emit)
        max_steps = int(work.agent.params.get("max_steps") or self.config.limits.max_steps)
        while True:
            if work.iteration >= max_steps:
                return LoopOutcome("completed", "max_steps")
            work.iteration += 1
            emit(StepStarted(work.iteration))
            try:
                finish = await self._stream_step(work, emit)
            except ProviderError as exc:  # redacted in _stream_step
                return LoopOutcome("failed", "error", exc.to_dict())
            _drop_tool_choice(work)  # a request's tool_choice governs its first model call only
            partial = work.partial
            assert partial is not None
            work.partial = None
            calls = [partial.calls[i] for i in sorted(partial.calls)]
            assistant = MessageRecord(
                role="assistant",
                content=partial.text.text(),
                turn_id=work.turn_id,
                iteration=work.iteration,
                reasoning=partial.reasoning.text() or None,
                provider_state=partial.provider_state,
                tool_calls=[
                    {"id": c.id, "name": c.name, "arguments": c.args.text(), "executor": c.executor} for c in calls
                ],
            )
            refusal = partial.refusal.text()
            if refusal:
                # the part of the content that is the model's refusal (it follows any answer text):
                # front ends show it as a refusal (OpenAI's field), after a restart too
                assistant.meta["refusal"] = refusal
            if partial.usage is not None and partial.usage.input_tokens:
                # The provider's own count of the context up to this reply; it anchors later
                # estimates only with a basis (the request was sent as the history will send it again).
                assistant.meta["context_tokens"] = partial.usage.input_tokens + partial.usage.output_tokens
                if partial.basis is not None:
                    assistant.meta["context_basis"] = partial.basis
            work.new_messages.append(assistant)
            cut = CUT_SHORT.get(finish)
            if not calls:
                return LoopOutcome("completed", cut[0] if cut else "end_turn")
            if cut is not None:
                # The arguments may be cut off: fail the calls to the model, never execute them.
                for c in calls:
                    msg = f"The call to {c.name} was not executed: {cut[1]} before its arguments were complete."
                    emit(ToolCallStatus(c.id, "failed", msg, True))
                    work.new_messages.append(_tool_message(work, c.id, c.name, msg, True))
                return LoopOutcome("completed", cut[0])
            emit(PhaseChanged("acting"))
            if work.before_effects is not None:
                await work.before_effects()
                work.before_effects = None
            await self._dispatch_calls(work, assistant.tool_calls, emit)
            if work.pending:
                kinds = {p.kind for p in work.pending}
                emit(PhaseChanged("awaiting"))
                return LoopOutcome("awaiting", "requires_approval" if "approval" in kinds else "requires_client_tool")

    # ------------------------------------------------------------ one provider call

    def build_request(self, work: TurnWork, model: str, view: list[MessageRecord] | None = None) -> ProviderRequest:
        if view is None:
            view = turn_view(work)
        messages: list[ChatMessage] = []
        if work.agent.system:
            messages.append(ChatMessage("system", work.agent.system))
        instructions = work.options.get("instructions") or []
        if isinstance(instructions, str):
            instructions = [instructions]
        for text in instructions:
            messages.append(ChatMessage("system", text))
        for m in view:
            messages.append(work.to_chat(m))
        params = provider_params(work.agent, work.options)
        # a client tool shadows the agent's own tool of that name (it is the one executed: _stream_step)
        client_names = {t.name for t in work.client_tools}
        left = tool_calls_left(work)
        capped = left is not None and left <= 0  # max_tool_calls reached: the server's tools withheld
        tools = [
            t.spec()
            for t in ([] if capped else self.tools.offered(work.agent))
            if t.name not in client_names and turn_offers(work.options, t.name)
        ] + list(work.client_tools)
        if capped:
            params["tool_choice"] = choice_without_withheld(params.get("tool_choice"), {t.name for t in tools})
        spec = allowed_spec(params.get("tool_choice"))
        if spec is not None:
            names = allowed_names(spec)
            tools = [t for t in tools if t.name in names]
            # none of them offered any more (the agent's tools changed): a call without tools
            params["tool_choice"] = plain_choice(spec.get("mode"), [t.name for t in tools]) if tools else None
        return ProviderRequest(model=model, messages=messages, tools=tools, **params)

    def budget(self, work: TurnWork, provider: Any, model: str) -> Budget | None:
        """The context budget of this agent's model, or None when it has no window (echo)."""
        cfg = getattr(provider, "cfg", None)
        configured = getattr(cfg, "context_windows", None) or {}
        if work.agent.params.get("context_window") or model in configured:
            window = window_for(work.agent.params, configured, provider.kind, model)
        else:  # then a pure function of the kind and the model (it scans the known models): memoized
            key = (provider.kind, model)
            window = self._windows.get(key, -1)
            if window == -1:
                window = window_for(work.agent.params, configured, provider.kind, model)
                if len(self._windows) >= 1024:
                    self._windows.clear()
                self._windows[key] = window
        if window is None:
            return None
        max_output = work.options.get("max_tokens") or work.agent.params.get("max_tokens")
        return Budget.for_window(window, self.config.limits.context_reserve_tokens, max_output)

    def estimate(self, request: ProviderRequest, view: list[MessageRecord]) -> int:
        return estimate_request(request, view, self._tool_estimates)

    async def _prepare(
        self,
        work: TurnWork,
        provider: Any,
        model: str,
        emit: Emit,
        forced: Budget | None = None,
        refused: tuple[int, ProviderError] | None = None,
    ) -> tuple[ProviderRequest, int | None, dict[str, Any] | None]:
        """Build the next request, compacting first when it would not fit (or when `forced`).
        The estimate is None when no window applies (it is only needed against one). The basis is
        what the provider's count of this request will describe (context.anchor_basis), None when
        the request was clipped: a later request sends those messages whole.

        A lead (system prompt, instructions, tools, response schema) over the budget on its own
        fails the turn at once (ContextDoesNotFit): nothing folded could make room. `refused` is the
        size (estimate_request of the request alone) and error of a request the provider refused as
        too long: the request built now must be smaller, or the turn fails at once with why."""
        view = turn_view(work)
        request = self.build_request(work, model, view)
        real = self.budget(work, provider, model)
        budget = forced or real
        if budget is None:  # no window: no estimate now, and none later needs an anchor from here
            return request, None, None
        lead = len(request.messages) - len(view)
        estimate = self.estimate(request, view)
        if estimate <= budget.limit:
            self._check_smaller(request, lead, refused, real or budget)
            return request, estimate, self._basis(request, view)
        lead_tokens = estimate_lead(request, lead, self._tool_estimates)
        # How much denser than our estimate the provider counts (its measured count anchors `estimate`).
        pure = estimate_request(request, [], self._tool_estimates)
        scale = estimate / pure if pure else 1.0
        if real is not None and lead_tokens * min(1.0, scale) > real.limit:
            raise lead_too_large(real, math.ceil(lead_tokens * min(1.0, scale)))
        # The turn's own new system/developer messages (its request's input, not kept yet) are never
        # folded (context.compact): when they cannot fit beside the lead, nothing can make room.
        # (A turn whose request carried its own transcript has them in its instructions: the lead.)
        own = [
            m
            for m in work.new_messages
            if m.role == "system" and m.turn_id == work.turn_id and not work.options.get(OWN_SYSTEM)
        ]
        own_tokens = sum(estimate_message(work.to_chat(m)) for m in own)
        if real is not None and own_tokens and (lead_tokens + own_tokens) * min(1.0, scale) > real.limit:
            ratio = min(1.0, scale)
            raise own_system_too_large(real, math.ceil(lead_tokens * ratio), math.ceil(own_tokens * ratio))
        done = await compact(
            provider,
            model,
            view,
            budget,
            estimate,
            work.turn_id,
            work.iteration,
            emit,
            lead_tokens=lead_tokens,
            scale=scale,
            own=own,
        )
        if done is not None:
            work.new_messages.append(done.message)
            log.info(
                "turn %s: compacted %d messages (estimate %d tokens, window %d)",
                work.turn_id,
                done.folded,
                estimate,
                budget.window,
            )
            view = turn_view(work)
            request = self.build_request(work, model, view)
            estimate = self.estimate(request, view)
            done.message.meta["tokens_after"] = estimate
        basis: dict[str, Any] | None = self._basis(request, view)
        if estimate > budget.limit:
            # What is left does not fit even folded: a few huge items (a long tool output, a pasted
            # file). Clip them in this request only; the history keeps them whole.
            clipped = clip_oversized(request, budget)
            if clipped:
                log.info(
                    "turn %s: clipped %d oversized message(s) to fit the window of %d",
                    work.turn_id,
                    clipped,
                    budget.window,
                )
                estimate = estimate_request(request, [], self._tool_estimates)
                basis = None  # the provider counts the clipped text, not what later requests send
        self._check_smaller(request, lead, refused, real or budget)
        return request, estimate, basis

    def _check_smaller(
        self, request: ProviderRequest, lead: int, refused: tuple[int, ProviderError] | None, budget: Budget
    ) -> None:
        """After a refusal as too long, a request no smaller than the refused one is pointless."""
        if refused is None:
            return
        size = estimate_request(request, [], self._tool_estimates)
        if size < refused[0]:
            return
        lead_tokens = estimate_lead(request, lead, self._tool_estimates)
        system = sum(estimate_message(m) for m in request.messages[lead:] if m.role == "system")
        error = refused[1]
        raise cannot_shrink(budget, lead_tokens, max(0, size - lead_tokens), error.message, error.status, system)

    def _basis(self, request: ProviderRequest, view: list[MessageRecord]) -> dict[str, Any]:
        return anchor_basis(request, len(request.messages) - len(view), self._tool_estimates, view)

    async def _stream_step(self, work: TurnWork, emit: Emit) -> str:
        provider, model = self.providers.resolve(work.agent.model)
        forced: Budget | None = None
        overflowed = False
        refused: tuple[int, ProviderError] | None = None  # the request refused as too long, and why
        client_names = {t.name for t in work.client_tools}
        attempts = getattr(getattr(provider, "cfg", None), "max_attempts", None) or 4
        policy = RetryPolicy(max_attempts=attempts, base_ms=self.config.limits.retry_base_ms)
        attempt = 0
        while True:
            attempt += 1
            partial = work.partial = StreamingAssistant()
            finish = "unknown"
            step_usage: Usage | None = None
            estimate: int | None = 0
            request: ProviderRequest | None = None
            try:
                request, estimate, partial.basis = await self._prepare(work, provider, model, emit, forced, refused)
                unyielded = 0
                async for chunk in provider.stream(request):
                    unyielded += 1
                    if unyielded >= CHUNKS_BETWEEN_YIELDS:
                        # A provider whose chunks are ready at once (a big reply already read, the
                        # echo model) never suspends: let every other client run now and then.
                        unyielded = 0
                        await asyncio.sleep(0)
                    if isinstance(chunk, Text):
                        if chunk.text:
                            partial.shown = True
                            partial.text.add(chunk.text)
                            emit(TextDelta(chunk.text))
                    elif isinstance(chunk, Reasoning):
                        if chunk.text:
                            partial.shown = True
                            partial.reasoning.add(chunk.text)
                            emit(ReasoningDelta(chunk.text))
                    elif isinstance(chunk, Refusal):
                        if chunk.text:
                            partial.shown = True
                            partial.text.add(chunk.text)
                            partial.refusal.add(chunk.text)
                            emit(TextDelta(chunk.text, refusal=True))
                    elif isinstance(chunk, ToolCallStart):
                        partial.shown = True
                        call_id = _stored_call_id(work, partial, chunk.id)
                        name = chunk.name.replace("\x00", "\ufffd")  # PostgreSQL text holds no NUL
                        executor = "client" if name in client_names else "server"
                        partial.calls[chunk.index] = StreamingCall(call_id, name, executor)
                        emit(ToolCallStarted(call_id, name, executor))  # type: ignore[arg-type]
                    elif isinstance(chunk, ToolCallArgs):
                        call = partial.calls.get(chunk.index)
                        if call is None:
                            raise ProviderError("protocol", f"tool call arguments for unknown index {chunk.index}")
                        call.args.add(chunk.delta)
                        emit(ToolCallArgsDelta(call.id, chunk.delta))
                    elif isinstance(chunk, ProviderState):
                        partial.provider_state = {**(partial.provider_state or {}), **chunk.data}
                    elif isinstance(chunk, Usage):
                        step_usage = chunk
                    elif isinstance(chunk, Done):
                        finish = chunk.finish_reason
            except ProviderError as exc:
                exc.redact(self._redactor.redact)
                if (
                    exc.kind == "context_overflow"
                    and not isinstance(exc, ContextDoesNotFit)
                    and not partial.shown
                    and not overflowed
                ):
                    # Our estimate said it fits; the provider disagrees. Compact once, harder, and retry
                    # with a smaller request (_prepare fails the turn when it cannot make one).
                    overflowed = True
                    if request is not None:  # None: the provider refused a summary while compacting
                        refused = (estimate_request(request, [], self._tool_estimates), exc)
                        if estimate is None:  # no window applied, so it was not needed until now
                            estimate = self.estimate(request, turn_view(work))
                    estimate = estimate or 0
                    log.warning(
                        "turn %s: %s says the context is too long (estimate %d tokens); compacting and retrying",
                        work.turn_id,
                        work.agent.model,
                        estimate,
                    )
                    forced = overflow_budget(
                        self.budget(work, provider, model) or Budget.for_window(estimate, None, None), estimate
                    )
                    emit(Retrying(attempt, 0, exc.to_dict()))
                    attempt -= 1
                    continue
                delay = retry_delay_ms(exc, attempt, policy, output_shown=partial.shown)
                if delay is None:
                    raise
                log.warning(
                    "turn %s: %s failed (%s, status %s, attempt %d); retrying in %d ms",
                    work.turn_id,
                    work.agent.model,
                    exc.kind,
                    exc.status,
                    attempt,
                    delay,
                )
                emit(Retrying(attempt, delay, exc.to_dict()))
                await asyncio.sleep(delay / 1000)
                continue
            partial.usage = step_usage
            if step_usage is not None:
                for key in ("input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens"):
                    work.usage[key] = work.usage.get(key, 0) + getattr(step_usage, key)
                work.usage["last_input_tokens"] = step_usage.input_tokens
                emit(UsageUpdated(dict(work.usage)))
            if partial.calls and finish in ("stop", "unknown"):
                finish = "tool_calls"  # a turn that streamed a tool call never ends with end_turn
            return finish

    # ------------------------------------------------------------ tools

    async def _dispatch_calls(self, work: TurnWork, calls: list[dict[str, Any]], emit: Emit) -> None:
        runnable: list[tuple[dict[str, Any], Tool, dict[str, Any]]] = []
        now = time.time()
        # what the cap left before this step's calls (in the turn's messages now)
        left = tool_calls_left(work, besides=sum(1 for c in calls if c.get("executor") != "client"))
        for call in calls:
            call_id, name, arguments = call["id"], call["name"], call["arguments"]
            if left is not None and call.get("executor") != "client":
                left -= 1
                if left < 0:
                    cap = work.options.get(MAX_TOOL_CALLS)
                    msg = (
                        f"The call to {shown(name)} was not executed: the request allows {cap} tool calls "
                        "(max_tool_calls)."
                    )
                    self._result(work, call_id, name, ToolOutput(msg, True), emit)
                    continue
            if call.get("executor") == "client":
                timeout = float(work.options.get("client_tool_timeout_s") or self.config.limits.client_tool_timeout_s)
                work.pending.append(
                    PendingCall(
                        call_id,
                        work.conversation_id,
                        work.turn_id,
                        name,
                        arguments,
                        "client",
                        created_at=now,
                        expires_at=now + timeout,
                    )
                )
                emit(ToolCallStatus(call_id, "awaiting_client"))
                continue
            own = self.tools.policy(work.agent, name)
            policy = narrowed_policy(work.options, name, own)
            tool = self.tools.get(name)
            if tool is None or policy is None:
                msg = (
                    f"Tool {shown(name)} is not among the tools this request allows; it was not executed."
                    if own is not None
                    else f"Tool {shown(name)} is not available to this agent."
                )
                self._result(work, call_id, name, ToolOutput(msg, True), emit)
                continue
            if policy == "deny":
                msg = f"The call to {name} was refused: the agent's policy denies this tool."
                self._result(work, call_id, name, ToolOutput(msg, True), emit, status="denied")
                continue
            try:
                args = parse_arguments(arguments)  # a repeated key is refused here: nothing runs, nobody is asked
            except ValueError as exc:
                self._result(work, call_id, name, ToolOutput(f"Invalid arguments for {name}: {exc}", True), emit)
                continue
            problem = tool.check(args) if tool.check is not None else None
            if problem is not None:  # a call that can only fail is answered now, never put to a person
                self._result(work, call_id, name, ToolOutput(f"Invalid arguments for {name}: {problem}", True), emit)
                continue
            # From here on the call is its canonical form (what runs, written so that it reads as
            # what runs): in the history (what the provider is sent back), in the pending call
            # (approval requests of every front end) and in the turn's snapshot (its reducer
            # writes the block's arguments the same way when the call is pending or running).
            arguments = call["arguments"] = canonical_arguments(args)
            if policy == "ask":
                timeout = self.config.limits.approval_timeout_s
                work.pending.append(
                    PendingCall(
                        call_id,
                        work.conversation_id,
                        work.turn_id,
                        name,
                        arguments,
                        "approval",
                        created_at=now,
                        expires_at=now + timeout,
                    )
                )
                emit(ToolCallStatus(call_id, "pending_approval"))
                continue
            runnable.append((call, tool, args))
        await self._execute(work, runnable, emit)

    async def _execute(
        self, work: TurnWork, runnable: list[tuple[dict[str, Any], Tool, dict[str, Any]]], emit: Emit
    ) -> None:
        if not runnable:
            return
        if work.before_tools is not None:
            await work.before_tools(work)
        ctx = ToolContext(work.agent, work.conversation_id, work.turn_id, self.config)

        async def one(call: dict[str, Any], tool: Tool, args: dict[str, Any]) -> ToolOutput:
            work.started_calls.add(call["id"])
            emit(ToolCallStatus(call["id"], "running"))
            try:
                if tool.read_only or tool.resource_key is None:
                    return await tool.run(args, ctx)
                key = tool.resource_key(args, ctx)
                asked = time.monotonic()
                async with self._locks.get(key):
                    waited = time.monotonic() - asked
                    out = await tool.run(args, ctx)
                if waited < WAIT_SHOWN_S:
                    return out
                # writers of one resource (an agent's shell calls, in all its conversations) run one
                # at a time and a call's own timeout counts from its start: the wait is told
                note = f"[it waited {waited:.0f} s before running, until another call using {key} had ended]"
                text = out.text if not out.text or out.text.endswith("\n") else out.text + "\n"
                return ToolOutput(text + note, out.is_error)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a tool bug is the model's information, not a crashed turn
                return ToolOutput(f"{tool.name} failed: {type(exc).__name__}: {exc}", True)

        outputs = await asyncio.gather(*(one(c, t, a) for c, t, a in runnable))
        for (call, tool, _), out in zip(runnable, outputs, strict=True):
            self._result(work, call["id"], tool.name, out, emit)

    def _result(
        self, work: TurnWork, call_id: str, name: str, out: ToolOutput, emit: Emit, status: str | None = None
    ) -> None:
        emit(ToolCallStatus(call_id, status or ("failed" if out.is_error else "completed"), out.text, out.is_error))  # type: ignore[arg-type]
        work.new_messages.append(_tool_message(work, call_id, name, out.text, out.is_error))

    async def _apply_resolutions(self, work: TurnWork, resolved: list[PendingCall], emit: Emit) -> None:
        runnable: list[tuple[dict[str, Any], Tool, dict[str, Any]]] = []
        for p in resolved:
            if p.status == "approved":
                tool = self.tools.get(p.name)
                # The approval answers the question asked under the policy of then; the agent's
                # policy NOW decides whether the tool may run at all (`work.agent` is read from the
                # store when a paused turn resumes): a tool switched to `deny`, or taken from the
                # agent, while the call waited does not run, approved or not.
                policy = narrowed_policy(work.options, p.name, self.tools.policy(work.agent, p.name))
                if tool is not None and policy == "deny":
                    msg = (
                        f"The call to {p.name} was refused: the agent's policy denies this tool "
                        "(changed while the call waited for approval); it was not executed."
                    )
                    self._result(work, p.call_id, p.name, ToolOutput(msg, True), emit, status="denied")
                    continue
                if tool is not None and policy not in ("allow", "ask"):
                    msg = (
                        f"Tool {shown(p.name)} is no longer available to this agent (changed while the call "
                        "waited for approval); it was not executed."
                    )
                    self._result(work, p.call_id, p.name, ToolOutput(msg, True), emit)
                    continue
                try:
                    args = parse_arguments(p.arguments)
                except ValueError as exc:
                    self._result(
                        work, p.call_id, p.name, ToolOutput(f"Invalid arguments for {p.name}: {exc}", True), emit
                    )
                    continue
                if tool is None:
                    self._result(
                        work, p.call_id, p.name, ToolOutput(f"Tool {shown(p.name)} is no longer available.", True), emit
                    )
                    continue
                runnable.append(({"id": p.call_id, "name": p.name}, tool, args))
            else:
                self._result(
                    work,
                    p.call_id,
                    p.name,
                    ToolOutput(resolution_text(p, self.config), p.status != "result" or p.is_error),
                    emit,
                    status="denied" if p.status == "denied" else None,
                )
        await self._execute(work, runnable, emit)


def resolution_text(p: PendingCall, config: Config) -> str:
    """The model-visible tool result for an answered (not executed) pending call."""
    if p.status == "result":
        return p.output or ""
    if p.status == "denied":
        who = f" by {p.decided_by}" if p.decided_by else ""
        reason = f" Reason: {shown_reason(p.reason)}" if p.reason else ""
        return f"The user denied this call to {p.name}{who}; it was not executed.{reason}"
    if p.status == "expired":
        if p.kind == "approval":
            return (
                f"The approval request for {p.name} timed out after {config.limits.approval_timeout_s:g} s "
                "with no answer; it was not denied by a person. The call was not executed."
            )
        return p.reason or f"The client did not return a result for {p.name} in time; the call has no result."
    if p.status == "cancelled":
        return p.reason or f"The call to {p.name} was cancelled before it ran."
    return p.reason or f"The call to {p.name} has no result."


DENY_REASON_MAX = 4096  # characters of a deny reason the model is sent (and the history keeps)


def shown_reason(reason: str) -> str:
    """A person's deny reason as the model gets it: at most DENY_REASON_MAX characters, with a note
    saying how much was left out (a 3 MB reason was stored and sent on every later request)."""
    if len(reason) <= DENY_REASON_MAX:
        return reason
    return f"{reason[:DENY_REASON_MAX]}… [reason cut: {len(reason) - DENY_REASON_MAX:,} more characters not shown]"


def _drop_tool_choice(work: TurnWork) -> None:
    """Later steps of the loop use `auto` (DESIGN §13): a forced call repeated on every step would
    only ever call tools until max_steps. A new dict: the turn's record keeps what was asked."""
    if work.options.get("tool_choice") is not None:
        work.options = {k: v for k, v in work.options.items() if k != "tool_choice"}


def _tool_message(work: TurnWork, call_id: str, name: str, text: str, is_error: bool) -> MessageRecord:
    return MessageRecord(
        role="tool",
        content=text,
        turn_id=work.turn_id,
        iteration=work.iteration,
        tool_call_id=call_id,
        name=name,
        is_error=is_error,
    )


def _stored_call_id(work: TurnWork, partial: StreamingAssistant, upstream_id: str | None) -> str:
    """The id a streamed call is kept under: the upstream's, or a fresh one when it has none, when
    it names an earlier call (upstreams that number calls per reply, call_0 every time, would clash
    with one of this conversation: one pending call per id), or when it holds a NUL (PostgreSQL text
    cannot hold one: the call's result row would never be stored, leaving the call unanswered)."""
    if upstream_id and "\x00" not in upstream_id and not _call_id_taken(work, partial, upstream_id):
        return upstream_id
    return f"call_{uuid.uuid4().hex[:20]}"


def _call_id_taken(work: TurnWork, partial: StreamingAssistant, call_id: str) -> bool:
    """`call_id` already names a call of this conversation or of the reply being streamed."""
    if any(c.id == call_id for c in partial.calls.values()):
        return True
    return any(c.get("id") == call_id for m in (*work.history, *work.new_messages) for c in m.tool_calls)
