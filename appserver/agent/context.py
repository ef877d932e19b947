"""Context management: keep every request inside the model's context window.

The stored history is append-only and complete. What a provider sees is a *view* of it: the last
`compaction` message (a summary of everything before its cut) followed by the messages it kept and
everything after it. Before each provider call the loop estimates the request — anchored on the
size the provider itself reported for the newest reply in the view whose request was sent as the
view is sent now (see `estimate_request`), plus a character estimate of what came after — and,
when it would pass the window minus a reserve, folds the oldest part of the view into a new summary
written by the same provider. Cuts never fall between a tool call and its
result: a kept part never starts with a `tool` message. System messages a conversation keeps stay
verbatim beside the lead while they fit (`pinned_cap`); beyond it the oldest are folded too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from appserver.agent.events import Compacted, PhaseChanged, TurnEvent
from appserver.providers.base import (
    ChatMessage,
    Done,
    Provider,
    ProviderError,
    ProviderRequest,
    Text,
    ToolCall,
    ToolSpec,
)
from appserver.store.records import MessageRecord
from appserver.values import value

CHARS_PER_TOKEN = 3.5  # deliberately pessimistic: real tokenizers average ~4 characters on English
MESSAGE_OVERHEAD_TOKENS = 6  # role, separators and the like, per message
IMAGE_TOKENS = 1_000
IMAGE_PARTS = ("image_url", "input_image", "image")
TEXT_PARTS = ("text", "input_text")
# Files and audio are counted from the size of their data (base64, as sent). A PDF costs a few
# thousand tokens a page (its text and a picture of each page) in some tens of kilobytes: about one
# token per 16 bytes. Audio costs some 10-32 tokens a second, and a second of compressed or
# low-rate speech is some 16 kB: about one token per 500 bytes. A file sent by id (no data here)
# counts as an image.
FILE_BYTES_PER_TOKEN = 16
AUDIO_BYTES_PER_TOKEN = 500
MIN_WINDOW = 512
SUMMARY_MAX_TOKENS = 1_024
SUMMARY_INSTRUCTIONS = (
    "You are compacting a long conversation so that it can continue within a limited context window. "
    "Write a concise summary of the transcript below for the assistant who will continue it: the user's "
    "goals and preferences, decisions made, facts and names learned, tool results that still matter, and "
    "open questions or unfinished work. Write plain prose, no preamble. Do not address the user."
)

# Context windows of common models, matched by the longest prefix of the model name (after any
# "vendor/" part). Configuration (`context_windows` of a provider, or the agent's `context_window`
# parameter) always wins; an unknown model gets DEFAULT_WINDOW.
DEFAULT_WINDOW = 32_768
KNOWN_WINDOWS: dict[str, int] = {
    "gpt-3.5-turbo": 16_385,
    "gpt-4": 8_192,
    "gpt-4-turbo": 128_000,
    "gpt-4o": 128_000,
    "gpt-4.1": 1_047_576,
    "gpt-5": 400_000,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "claude": 200_000,
    "gemini": 1_048_576,
    "llama3": 8_192,
    "llama-3": 8_192,
    "llama3.1": 131_072,
    "llama-3.1": 131_072,
    "llama3.2": 131_072,
    "llama3.3": 131_072,
    "qwen2.5": 32_768,
    "qwen3": 40_960,
    "mistral": 32_768,
    "mixtral": 32_768,
    "deepseek": 65_536,
    "gemma": 8_192,
    "gemma3": 131_072,
    "phi3": 4_096,
    "phi4": 16_384,
}


def default_window(model: str) -> int:
    name = model.rsplit("/", 1)[-1].lower()
    best = ""
    for prefix in KNOWN_WINDOWS:
        if name.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return KNOWN_WINDOWS[best] if best else DEFAULT_WINDOW


@value
class Budget:
    """How much of the window a request may use: the window minus room for the reply."""

    window: int
    reserve: int

    @property
    def limit(self) -> int:
        return self.window - self.reserve

    @classmethod
    def for_window(cls, window: int, reserve: int | None, max_output: int | None) -> Budget:
        window = max(MIN_WINDOW, int(window))
        if not reserve:
            reserve = min(8_192, window // 4)
        if max_output:
            reserve = max(reserve, min(int(max_output), window // 2))
        return cls(window, min(int(reserve), window // 2))


# ---------------------------------------------------------------- estimates


def estimate_text(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _data_bytes(data: Any) -> int:
    """Decoded size of base64 data (a bare string or a `data:` URL)."""
    if not isinstance(data, str):
        return 0
    if data.startswith("data:"):
        data = data[data.find(",") + 1 :]
    return len(data) * 3 // 4


def estimate_part(part: dict[str, Any]) -> int:
    kind = part.get("type")
    if kind in IMAGE_PARTS:
        return IMAGE_TOKENS
    if kind == "input_audio":
        audio = part.get("input_audio")
        size = _data_bytes(audio.get("data") if isinstance(audio, dict) else None)
        return max(1, math.ceil(size / AUDIO_BYTES_PER_TOKEN))
    if kind in ("file", "input_file"):
        fields = part.get("file") if kind == "file" else part
        size = _data_bytes(fields.get("file_data") if isinstance(fields, dict) else None)
        return max(IMAGE_TOKENS, math.ceil(size / FILE_BYTES_PER_TOKEN))
    return estimate_text(str(part.get("text", "")))


def estimate_message(m: ChatMessage) -> int:
    tokens = MESSAGE_OVERHEAD_TOKENS
    if isinstance(m.content, str):
        tokens += estimate_text(m.content)
    else:
        for part in m.content:
            tokens += estimate_part(part)
    for call in m.tool_calls:
        tokens += MESSAGE_OVERHEAD_TOKENS + estimate_text(call.name) + estimate_text(call.arguments)
    if m.reasoning:
        tokens += estimate_text(m.reasoning)
    return tokens


def estimate_tool(t: ToolSpec) -> int:
    return (
        estimate_text(t.name + t.description + json.dumps(t.parameters, separators=(",", ":")))
        + MESSAGE_OVERHEAD_TOKENS
    )


def estimate_tools(tools: Sequence[ToolSpec]) -> int:
    return sum(estimate_tool(t) for t in tools)


class ToolEstimates:
    """`estimate_tools` that serialises each tool schema once, not before every provider call.

    Schemas are static definitions (a server tool's, or a turn's client tools): an entry is keyed
    by the schema object and holds it, so its id cannot be reused while the entry lives.
    """

    __slots__ = ("_items", "limit")

    def __init__(self, limit: int = 1_024) -> None:
        self._items: dict[int, tuple[dict[str, Any], str, str, int]] = {}
        self.limit = limit

    def __call__(self, tools: Sequence[ToolSpec]) -> int:
        total = 0
        items = self._items
        for t in tools:
            hit = items.get(id(t.parameters))
            if hit is not None and hit[0] is t.parameters and hit[1] == t.name and hit[2] == t.description:
                total += hit[3]
                continue
            tokens = estimate_tool(t)
            if len(items) >= self.limit:
                items.clear()
            items[id(t.parameters)] = (t.parameters, t.name, t.description, tokens)
            total += tokens
        return total


def estimate_lead(
    request: ProviderRequest,
    lead: int,
    tools_estimate: Callable[[Sequence[ToolSpec]], int] = estimate_tools,
) -> int:
    """Estimate what a request sends besides its conversation: the first `lead` messages (system
    prompt, instructions), the tool schemas and a response schema. They may change from one
    request to the next (a turn's instructions and client tools are its own)."""
    tokens = sum(estimate_message(m) for m in request.messages[:lead]) + tools_estimate(request.tools)
    if request.response_format:
        tokens += estimate_text(json.dumps(request.response_format, separators=(",", ":")))
    return tokens


def anchor_basis(
    request: ProviderRequest,
    lead: int,
    tools_estimate: Callable[[Sequence[ToolSpec]], int],
    view: Sequence[MessageRecord] = (),
) -> dict[str, Any]:
    """What an assistant reply records (meta `context_basis`) beside the provider's count of the
    request that produced it (`context_tokens`), so that a later estimate can tell whether that
    count still describes the same request: the model that counted, the estimate of the lead, and
    how many system messages the view (`view`, before the reply) showed when there were any (a
    turn whose request carried its own leaves out those the conversation keeps).
    Only recorded for a request sent as the history says (see `estimate_request`)."""
    basis: dict[str, Any] = {"model": request.model, "lead": estimate_lead(request, lead, tools_estimate)}
    shown = _system_count(view)
    if shown:
        basis["system"] = shown
    return basis


def _system_count(messages: Sequence[MessageRecord]) -> int:
    return sum(1 for m in messages if m.role in PINNED_ROLES)


def estimate_request(
    request: ProviderRequest,
    view: Sequence[MessageRecord],
    tools_estimate: Callable[[Sequence[ToolSpec]], int] = estimate_tools,
) -> int:
    """Estimate a request's input tokens: the provider's own count for the newest reply that has a
    usable one, plus estimates of everything after it; a pure estimate when no reply in the view was
    measured. `tools_estimate` may be a `ToolEstimates` cache.

    A count is usable only when it describes the messages before it as they are sent now: the reply
    recorded a `context_basis` (it is not recorded when the request was clipped, as a clipped
    request is never sent again), it was counted by the same model (another tokenizer counts
    differently), it was not kept by a compaction (measured with the old, longer context), and the
    view shows as many system messages before it as it was counted with. A changed system prompt,
    instructions or tools are corrected by the difference of their estimates."""
    lead = len(request.messages) - len(view)  # system prompt and instructions come first
    first = _after_kept(view)
    for i in range(len(view) - 1, first - 1, -1):
        if view[i].role != "assistant":
            continue
        measured = view[i].meta.get("context_tokens")
        basis = view[i].meta.get("context_basis")
        if not measured or not isinstance(basis, dict) or basis.get("model") != request.model:
            continue
        if basis.get("system", 0) != _system_count(view[:i]):
            continue  # counted with other system messages in view (shown to one turn, not to another)
        after = sum(estimate_message(m) for m in request.messages[lead + i + 1 :])
        lead_now = estimate_lead(request, lead, tools_estimate)
        return max(0, int(measured) + lead_now - int(basis.get("lead") or 0)) + after
    return sum(estimate_message(m) for m in request.messages) + estimate_lead(request, 0, tools_estimate)


# ---------------------------------------------------------------- the view


def to_chat_message(m: MessageRecord) -> ChatMessage:
    if m.role == "compaction":
        return ChatMessage("user", f"{SUMMARY_PREFIX}{m.text()}")
    if m.role == "tool":
        return ChatMessage("tool", m.text(), tool_call_id=m.tool_call_id, name=m.name)
    if m.role == "assistant":
        return ChatMessage(
            "assistant",
            m.text(),
            tool_calls=[ToolCall(c["id"], c["name"], c.get("arguments", "")) for c in m.tool_calls],
            reasoning=m.reasoning,
            provider_state=m.provider_state,
        )
    return ChatMessage(m.role, m.content)


# Roles a compaction folds only when they no longer fit: `system` messages (a Responses request's
# system/developer input, kept in the conversation) stay verbatim while they fit (`pinned_cap`), in
# the view ahead of the summary when older than what it kept, and are never counted in its `kept`.
# So the view is the same whether a turn sees the system messages or not (agent/loop.py `turn_view`
# leaves them out for some): counted, a `kept` made without them would keep fewer messages in a
# view with them. Those a compaction folds are always the oldest: its meta `system_folded` is how
# many of the history's system messages, counted from its start, the summaries hold so far.
PINNED_ROLES = ("system",)


def pinned_cap(budget: Budget, lead_tokens: int) -> int:
    """The most the system messages a conversation keeps may take of a request and stay verbatim:
    half of what the budget leaves beside the lead. Beyond it a compaction folds the oldest into
    its summary (a turn's own, new ones excepted), so kept messages never leave too little room
    for the rest of the conversation, however many turns sent them."""
    return max(0, budget.limit - lead_tokens) // 2


def context_view(messages: Sequence[MessageRecord]) -> list[MessageRecord]:
    """What the provider sees of a history: the system messages older than what the last
    compaction kept (but those summaries folded: its `system_folded`), that compaction, the
    messages it kept, the rest; each round's tool results in the order of its calls
    (`in_call_order`)."""
    for c in range(len(messages) - 1, -1, -1):
        if messages[c].role != "compaction":
            continue
        kept = int(messages[c].meta.get("kept", 0))
        gone = _folded_system(messages, c, int(messages[c].meta.get("system_folded", 0) or 0))
        before: list[MessageRecord] = []
        counted = 0
        i = c - 1
        while counted < kept and i >= 0:
            m = messages[i]
            if m.role != "compaction" and i not in gone:
                before.append(m)
                counted += m.role not in PINNED_ROLES
            i -= 1
        while i >= 0 and messages[i].role in PINNED_ROLES:  # sent just before the kept part: with it
            if i not in gone:
                before.append(messages[i])
            i -= 1
        before.reverse()
        pinned = [m for j, m in enumerate(messages[: i + 1]) if m.role in PINNED_ROLES and j not in gone]
        return in_call_order([*pinned, messages[c], *before, *messages[c + 1 :]])
    return in_call_order(list(messages))


def _folded_system(messages: Sequence[MessageRecord], end: int, count: int) -> set[int]:
    """Indices of the first `count` system messages of `messages[:end]`: those folded into summaries."""
    gone: set[int] = set()
    j = 0
    while len(gone) < count and j < end:
        if messages[j].role in PINNED_ROLES:
            gone.add(j)
        j += 1
    return gone


def in_call_order(view: list[MessageRecord]) -> list[MessageRecord]:
    """`view` with each run of tool results that follows an assistant message with tool calls in
    the order of those calls (the history holds them in the order they finished: a server tool's
    result before the client's answer to an earlier call). Some OpenAI-compatible servers and chat
    templates match results to calls by position. A result that answers none of that message's
    calls keeps its place. The same records, permuted (`view` itself when nothing moves): every
    request and every estimate is built from this view, one request message per record."""
    out = view
    n = len(view)
    i = 0
    while i < n:
        m = view[i]
        i += 1
        if m.role != "assistant" or len(m.tool_calls) < 2:
            continue
        start = i
        while i < n and view[i].role == "tool":
            i += 1
        if i - start < 2:
            continue
        order = {c.get("id"): k for k, c in enumerate(m.tool_calls)}
        slots = [j for j in range(start, i) if view[j].tool_call_id in order]
        ranked = sorted(slots, key=lambda j: order[view[j].tool_call_id])  # stable: repeats keep theirs
        if ranked == slots:
            continue
        if out is view:
            out = list(view)
        for j, k in zip(slots, ranked, strict=True):
            out[j] = view[k]
    return out


def _after_kept(view: Sequence[MessageRecord]) -> int:
    """Index in `view` (a `context_view`) of the first message after its compaction's kept part (0
    when it has no compaction): measured counts before it were made with the older context."""
    c = next((i for i, m in enumerate(view) if m.role == "compaction"), None)
    if c is None:
        return 0
    kept = int(view[c].meta.get("kept", 0))
    i = c + 1
    while kept > 0 and i < len(view):
        kept -= view[i].role not in PINNED_ROLES
        i += 1
    return i


def choose_cut(view: Sequence[MessageRecord], sizes: Sequence[int], keep_tokens: int) -> int | None:
    """Index of the first kept message: as much recent context as fits `keep_tokens`, at least the
    newest message, never starting on a tool result (its call would be folded away). None when
    nothing can be folded (the view is one compaction and its tail)."""
    cut = len(view)
    used = 0
    for i in range(len(view) - 1, -1, -1):
        if used + sizes[i] > keep_tokens and cut < len(view):
            break
        used += sizes[i]
        cut = i
    while cut < len(view) and view[cut].role == "tool":
        cut += 1  # drop the orphan results into the folded part, with their call
    if cut >= len(view):
        # Even the newest message alone is too big to keep beside a summary: keep from the newest
        # place a cut is allowed, which may mean keeping more than asked.
        cut = len(view) - 1
        while cut > 0 and view[cut].role == "tool":
            cut -= 1
    if cut <= 0 or (cut == 1 and view[0].role == "compaction"):
        return None
    return cut


def transcript(messages: Sequence[MessageRecord], max_chars: int) -> str:
    """Render folded messages as plain text for the summariser; huge items are clipped in the middle."""
    lines: list[str] = []
    for m in messages:
        if m.role == "compaction":
            body = f"[Earlier summary]\n{m.text()}"
        elif m.role == "tool":
            body = f"[Tool result from {m.name}]{' (error)' if m.is_error else ''}\n{m.text()}"
        elif m.role == "assistant":
            calls = "".join(f"\n[Called {c['name']} with {c.get('arguments', '')}]" for c in m.tool_calls)
            body = f"[Assistant]\n{m.text()}{calls}"
        else:
            images = (
                sum(1 for p in m.content if isinstance(p, dict) and p.get("type") in ("image_url", "input_image"))
                if isinstance(m.content, list)
                else 0
            )
            role = "developer" if m.role == "system" and m.meta.get("role") == "developer" else m.role
            body = f"[{role.capitalize()}]\n{m.text()}" + (f"\n[{images} image(s)]" if images else "")
        lines.append(clip(body, max_chars))
    return "\n\n".join(lines)


def clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max(1, (max_chars - 60) // 2)
    return f"{text[:half]}\n[… {len(text) - 2 * half} characters omitted …]\n{text[-half:]}"


def clip_parts(parts: list[dict[str, Any]], cap: int) -> list[dict[str, Any]] | None:
    """The parts of a message, their text clipped so that the message fits `cap` tokens beside its
    other parts (images, files and audio are kept whole); None when the text needs no clipping.
    Short text parts stay whole; the long ones share what is left equally."""
    texts = [
        (i, p["text"]) for i, p in enumerate(parts) if p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
    ]
    if not texts:
        return None
    others = sum(estimate_part(p) for i, p in enumerate(parts) if i not in {j for j, _ in texts})
    allowance = int(max(64, cap - MESSAGE_OVERHEAD_TOKENS - others) * CHARS_PER_TOKEN)
    share = None
    lengths = sorted(len(t) for _, t in texts)
    for k, length in enumerate(lengths):
        fair = allowance // (len(lengths) - k)
        if length > fair:
            share = max(200, fair)
            break
        allowance -= length
    if share is None:
        return None
    out = list(parts)
    for i, text in texts:
        if len(text) > share:
            out[i] = {**parts[i], "text": clip(text, share)}
    return out


def clip_oversized(request: ProviderRequest, budget: Budget) -> int:
    """Clip, in this request only, every user or tool text bigger than a quarter of the budget
    (keeping its head and tail; in a message of parts, its text parts, never its images or files);
    returns how many messages were clipped. Cached messages are never edited."""
    cap = max(64, budget.limit // 4)
    clipped = 0
    for i, m in enumerate(request.messages):
        if m.role not in ("user", "tool") or estimate_message(m) <= cap:
            continue
        if isinstance(m.content, str):
            request.messages[i] = replace(m, content=clip(m.content, int(cap * CHARS_PER_TOKEN)))
            clipped += 1
        else:
            parts = clip_parts(m.content, cap)
            if parts is not None:
                request.messages[i] = replace(m, content=parts)
                clipped += 1
    return clipped


# ---------------------------------------------------------------- compaction


def split_for_summary(messages: Sequence[MessageRecord], chunk_tokens: int) -> list[list[MessageRecord]]:
    """Cut the folded part into pieces that each fit one summarisation request."""
    chunks: list[list[MessageRecord]] = [[]]
    used = 0
    for m in messages:
        size = (
            estimate_text(m.text())
            + sum(estimate_text(c.get("arguments", "")) for c in m.tool_calls)
            + MESSAGE_OVERHEAD_TOKENS
        )
        size = min(size, chunk_tokens)  # a huge message is clipped by transcript()
        if chunks[-1] and used + size > chunk_tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(m)
        used += size
    return chunks


def summary_tokens_for(budget: Budget) -> int:
    """The most a summary may be (its request's max_tokens)."""
    return max(64, min(SUMMARY_MAX_TOKENS, budget.limit // 5))


SUMMARY_PREFIX = "[Summary of the earlier conversation]\n"


def summary_room(budget: Budget) -> int:
    """What a summary can take of a request (at most its max_tokens, its heading and separators)."""
    return summary_tokens_for(budget) + estimate_text(SUMMARY_PREFIX) + MESSAGE_OVERHEAD_TOKENS


async def summarize(provider: Provider, model: str, folded: Sequence[MessageRecord], budget: Budget) -> str:
    """Summarise `folded` with the conversation's own provider, in pieces when it is large."""
    summary_tokens = summary_tokens_for(budget)
    overhead = estimate_text(SUMMARY_INSTRUCTIONS) + 3 * MESSAGE_OVERHEAD_TOKENS
    chunk_tokens = max(64, budget.limit - summary_tokens - overhead - 32)
    chunk_chars = int(chunk_tokens * CHARS_PER_TOKEN)
    summary = ""
    for chunk in split_for_summary(folded, chunk_tokens - summary_tokens):
        text = transcript(chunk, max(200, chunk_chars - int(summary_tokens * CHARS_PER_TOKEN)))
        if summary:
            text = f"[Summary so far]\n{summary}\n\n{text}"
        request = ProviderRequest(
            model=model,
            messages=[ChatMessage("system", SUMMARY_INSTRUCTIONS), ChatMessage("user", clip(text, chunk_chars))],
            max_tokens=summary_tokens,
            purpose="compaction",
        )
        parts: list[str] = []
        async for piece in provider.stream(request):
            if isinstance(piece, Text):
                parts.append(piece.text)
            elif isinstance(piece, Done):
                break
        summary = "".join(parts).strip() or summary
    if not summary:
        raise ProviderError("protocol", "the model returned an empty summary while compacting the conversation")
    return summary


@dataclass(slots=True)
class Compaction:
    """Result of one compaction: the message to append and what it replaced."""

    message: MessageRecord
    folded: int
    tokens_before: int


async def compact(
    provider: Provider,
    model: str,
    view: Sequence[MessageRecord],
    budget: Budget,
    tokens_before: int,
    turn_id: str,
    iteration: int,
    emit: Callable[[TurnEvent], None],
    lead_tokens: int = 0,
    scale: float = 1.0,
    own: Sequence[MessageRecord] = (),
) -> Compaction | None:
    """Fold the oldest part of `view` into a summary; None when nothing can be folded.

    The kept part is sized from what the request has left beside its lead (`lead_tokens`: system
    prompt, instructions, tools, response schema), the system messages that stay and the summary:
    at most 40 % of the budget, and when the lead leaves less, less — down to the newest message
    (never cut from its tool call). System messages stay verbatim wherever the cut while they fit
    `pinned_cap` — `own` (the turn's new ones, its request's input, not kept yet) always, then the
    newest first — and the older ones are folded into the summary with the rest (`system_folded`).
    `scale` (at least 1) is how much denser than our estimate the provider counted this request
    (its measured count against our estimate of the same messages): sizes are scaled by it."""
    scale = max(1.0, scale)
    sizes = [math.ceil(estimate_message(to_chat_message(m)) * scale) for m in view]
    lead = math.ceil(lead_tokens * scale)
    system = [i for i, m in enumerate(view) if m.role in PINNED_ROLES]
    stay = {i for i in system if any(view[i] is m for m in own)}
    pinned = sum(sizes[i] for i in stay)
    cap = pinned_cap(budget, lead)
    for i in reversed(system):
        if i in stay:
            continue
        if pinned + sizes[i] > cap:
            break  # this one and every older one are folded
        stay.add(i)
        pinned += sizes[i]
    unpinned = {i for i in system if i not in stay}
    # the system messages are not in the cut's reckoning: those that stay are beside the lead
    # wherever the cut, those that go are folded wherever they are
    sizes = [0 if m.role in PINNED_ROLES else size for m, size in zip(view, sizes, strict=True)]
    room = budget.limit - lead - pinned - summary_room(budget)
    keep_tokens = max(0, min(budget.limit * 2 // 5, room))
    cut = choose_cut(view, sizes, keep_tokens)
    if cut is None and unpinned:  # nothing else to fold: the system messages that go (and the last summary)
        cut = 0
        while cut < len(view) and view[cut].role in (*PINNED_ROLES, "compaction"):
            cut += 1
    folded = [
        m for i, m in enumerate(view) if i in unpinned or (cut is not None and i < cut and m.role not in PINNED_ROLES)
    ]
    if cut is None or not folded or (not unpinned and all(m.role == "compaction" for m in folded)):
        return None  # nothing to fold, or only the last summary (folding it alone gains nothing)
    emit(PhaseChanged("compacting"))
    summary = await summarize(provider, model, folded, budget)
    kept = sum(1 for m in view[cut:] if m.role != "compaction" and m.role not in PINNED_ROLES)
    meta: dict[str, Any] = {
        "kept": kept,
        "folded": len(folded),
        "tokens_before": tokens_before,
        "window": budget.window,
    }
    earlier = next((m for m in view if m.role == "compaction"), None)
    system_folded = len(unpinned) + (int(earlier.meta.get("system_folded", 0) or 0) if earlier is not None else 0)
    if system_folded:
        meta["system_folded"] = system_folded
    message = MessageRecord(role="compaction", content=summary, turn_id=turn_id, iteration=iteration, meta=meta)
    emit(Compacted(summary, len(folded)))
    return Compaction(message, len(folded), tokens_before)


class ContextDoesNotFit(ProviderError):
    """The request cannot be made to fit the model's window (its lead alone is too big, or folding
    and clipping cannot make a refused request smaller): the turn fails at once with why, rather
    than sending a request known to be too long (again)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__("context_overflow", message, status=status)


def lead_too_large(budget: Budget, lead: int) -> ContextDoesNotFit:
    return ContextDoesNotFit(
        f"The agent's system prompt, instructions and tool definitions alone come to about {lead} tokens, "
        f"more than the {budget.limit} tokens the model's context window of {budget.window} leaves beside "
        f"the {budget.reserve} kept for the reply; compacting the conversation cannot make room. Shorten the "
        "system prompt or instructions, offer fewer tools, lower max_tokens or use a model with a larger "
        "context window."
    )


def own_system_too_large(budget: Budget, lead: int, own: int) -> ContextDoesNotFit:
    """The turn's own new system/developer messages (its request's input) cannot fit beside the lead:
    refused before anything is sent (the turn keeps none of them: runtime/settle.py `loop_end`)."""
    return ContextDoesNotFit(
        f"The system/developer messages of this request's input come to about {own} tokens; beside about "
        f"{lead} tokens of system prompt, instructions and tool definitions that is more than the "
        f"{budget.limit} tokens the model's context window of {budget.window} leaves beside the "
        f"{budget.reserve} kept for the reply. Nothing was sent to the model and the conversation does not "
        "keep them: shorten them, lower max_tokens or use a model with a larger context window."
    )


def cannot_shrink(
    budget: Budget, lead: int, rest: int, refusal: str, status: int | None, system: int = 0
) -> ContextDoesNotFit:
    """The error of an upstream's refusal that folding and clipping cannot answer with a smaller
    request. `system`: what of `rest` the system/developer messages the conversation keeps take."""
    if lead * 2 >= budget.limit:
        why = (
            f"the system prompt, instructions and tool definitions take about {lead} of the {budget.limit} "
            f"tokens the model's context window of {budget.window} leaves beside the {budget.reserve} kept for "
            "the reply. Shorten them, offer fewer tools, lower max_tokens or use a model with a larger "
            "context window."
        )
    elif system:
        why = (
            f"beside about {lead} tokens of system prompt, instructions and tool definitions, the "
            f"system/developer messages the conversation keeps take about {system} and the newest messages "
            f"(never folded) about {max(0, rest - system)} of the {budget.limit} tokens the model's context "
            f"window of {budget.window} leaves beside the {budget.reserve} kept for the reply."
        )
    else:
        why = (
            f"beside about {lead} tokens of system prompt, instructions and tool definitions, the newest "
            f"messages (never folded) take about {rest} of the {budget.limit} tokens the model's context "
            f"window of {budget.window} leaves beside the {budget.reserve} kept for the reply."
        )
    return ContextDoesNotFit(
        f"The model refused the request as too long ({refusal.strip()[:300]}) and compacting cannot make it "
        f"smaller: {why}",
        status=status,
    )


def overflow_budget(budget: Budget, estimate: int) -> Budget:
    """After the provider said "too long" to a request we thought fit, trust our estimate less."""
    shrunk = max(MIN_WINDOW // 2, min(budget.limit, estimate) * 3 // 4)
    return Budget(shrunk + budget.reserve, budget.reserve)


def window_for(agent_params: dict[str, Any], configured: dict[str, int], provider_kind: str, model: str) -> int | None:
    """The context window that applies, or None for a model without one (the offline echo)."""
    override = agent_params.get("context_window")
    if override:
        return int(override)
    if model in configured:
        return int(configured[model])
    if provider_kind == "echo":
        return None
    return default_window(model)
