"""Which conversation an OpenAI request belongs to (DESIGN §5), and the history-prefix index.

A request's transcript is reduced to the *client-visible view*: system text (unless the agent sets
`match_ignores_system`), user text (and image, file and audio references), assistant final text with
the client tool calls it made, tool results and approval answers. Server tool items
(`mcp_call`, `mcp_approval_request`) count as an empty assistant item, so they merge into the
reply around them. Each
view item extends a hash chain; the hash of a prefix names a point in a conversation. After every
turn the point the client now sees is recorded (`history_points`), so a client that resends the
whole transcript with no header lands in the same conversation, or forks one when it resends an
older point (a regenerate, an edited message).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from appserver import fastjson
from appserver.auth import namespace_allows
from appserver.errors import AgentGone, Conflict
from appserver.http.errors import ApiError
from appserver.runtime import Decision, new_id
from appserver.runtime.cluster import OwnedElsewhere
from appserver.runtime.kernel import NAMESPACE_DEFAULT_NAME, NAMESPACE_TAG_LEN, namespaced_id
from appserver.store.base import AgentMissing
from appserver.store.records import (
    AgentRecord,
    ConversationRecord,
    HistoryPoint,
    MessageRecord,
    PendingCall,
    TurnCommit,
    TurnRecord,
)

if TYPE_CHECKING:
    from appserver.server import Server

HEADER = "X-Conversation-Id"
CONVERSATION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
# A name qualified by its namespace (runtime.kernel.namespaced_id): NAME~<tag>, at most 128 + 1 + 24 characters
SERVER_ID_RE = re.compile(r"^conv_[0-9a-f]{16,32}$")  # what new_id("conv") makes (and made)
QUALIFIED_ID_RE = re.compile(CONVERSATION_ID_RE.pattern[:-1] + "~[0-9a-f]{" + str(NAMESPACE_TAG_LEN) + "}$")
EMPTY_HASH = hashlib.sha256(b"appserver-history-v1").hexdigest()
CALL_TAIL_MAX = 512  # messages read back from a point to find the calls open there (its results, then them)
CALL_TAIL_SHORT = 16  # the first read (most rounds have fewer results)
# Points of one history a request looks at (`by_prefix`): the newest recorded among the caller's
# own conversations of the agent. A client that opens every request with the same few messages
# forks a conversation each time, all at that point; the lookup reads these few, not them all.
PREFIX_CANDIDATES = 16


def name_ids(ref: str, namespace: str | None) -> list[str]:
    """The conversation ids a name in `X-Conversation-Id` (or a WebSocket frame) means for a caller,
    first found wins. A namespaced credential's bare name is its own `NAME~<tag>` (`namespaced_id`),
    then the bare name itself: a conversation it made under it before names were qualified (seen
    only when it is the caller's). Anything else (an admin's or the local owner's name, an id with
    a '~', an id the server made) is that id."""
    if namespace is None or not CONVERSATION_ID_RE.match(ref) or SERVER_ID_RE.match(ref):
        return [ref]
    return [namespaced_id(ref, namespace), ref]


@dataclass(slots=True)
class ViewItem:
    """One client-visible item. kind: system | user | assistant | tool | approval (text: approve|deny)."""

    kind: str
    text: str = ""
    images: list[str] = field(default_factory=list)
    calls: list[dict[str, str]] = field(default_factory=list)  # assistant: [{id, name, arguments}]
    call_id: str | None = None  # tool
    parts: list[dict[str, Any]] = field(default_factory=list)  # user: file / audio parts, as sent upstream
    # user: every content part in the order sent (text, image_url with its detail, file, audio), as
    # providers take them; None for plain string content
    content: list[dict[str, Any]] | None = None
    # system: the role it was sent with (`system` / `developer`) when the conversation keeps it (a
    # Responses input item: `seed_records`); None for a chat message's, which instructs its turn only
    role: str | None = None

    def key(self) -> list[Any]:
        if self.kind == "assistant":
            return ["assistant", self.text.strip(), [[c["name"], _canon_args(c["arguments"])] for c in self.calls]]
        if self.kind == "user":
            if self.content is not None and not _keyed_as_before(self.content):
                return ["user_parts", _digest([_part_key(p) for p in self.content])]
            if self.parts:
                return ["user", self.text.strip(), list(self.images), _digest(self.parts)]
            return ["user", self.text.strip(), list(self.images)]
        return [self.kind, self.text.strip()]


def _digest(value: Any) -> str:
    return hashlib.sha256(
        json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8", "surrogatepass")
    ).hexdigest()


def _part_key(part: dict[str, Any]) -> list[Any]:
    """A content part as the hash sees it: text stripped, an image's detail `auto` when not sent."""
    if part["type"] == "text":
        return ["text", part["text"].strip()]
    if part["type"] == "image_url":
        return ["image", part["image_url"]["url"], part["image_url"].get("detail") or "auto"]
    return ["part", part]


AUTO = (None, "auto")  # an image's detail when the client leaves it to the model


def _keyed_as_before(content: list[dict[str, Any]]) -> bool:
    """Content whose hash keeps the key the matcher gave it before it kept the parts' order (text,
    then images, then files and audio): at most one text part, first, then images of detail `auto`,
    then files and audio. Points recorded for such messages keep matching; a message with several
    text parts, or images between texts or with another detail, is keyed with its parts in order."""
    i = 1 if content and content[0]["type"] == "text" else 0
    while i < len(content) and content[i]["type"] == "image_url" and content[i]["image_url"].get("detail") in AUTO:
        i += 1
    return all(p["type"] not in ("text", "image_url") for p in content[i:])


def _canon_args(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError):
        return arguments or ""


def chain(items: list[ViewItem], start: str = EMPTY_HASH) -> str:
    h = start
    for item in items:
        # fastjson writes these lists of strings byte for byte as json.dumps(ensure_ascii=False) does
        # (checked over every code point): stored points keep matching.
        h = hashlib.sha256((h + fastjson.dumps(item.key())).encode("utf-8")).hexdigest()
    return h


def for_agent(items: list[ViewItem], agent: AgentRecord) -> list[ViewItem]:
    """The view an agent matches on: without system text when it opts out (`match_ignores_system`:
    clients whose system prompt changes every request, e.g. with a timestamp in it)."""
    if agent.params.get("match_ignores_system"):
        return [i for i in items if i.kind != "system"]
    return items


def user_content(item: ViewItem) -> str | list[dict[str, Any]]:
    """Stored/provider content of a user message: its parts in the order sent, or plain text when
    it is text alone (a string, or one text part)."""
    parts = item.content
    if parts is None:
        return item.text
    if all(p["type"] == "text" and not p["text"] for p in parts):
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return [dict(p) for p in parts]


def users_content(users: list[ViewItem]) -> str | list[dict[str, Any]]:
    """The content of several user messages taken as one input: texts alone are joined by blank
    lines (one string); else every message's parts, in order."""
    contents = [user_content(u) for u in users]
    texts = [c for c in contents if isinstance(c, str)]
    if len(texts) == len(contents):
        return "\n\n".join(t for t in texts if t)
    out: list[dict[str, Any]] = []
    for c in contents:
        if isinstance(c, str):
            if c:
                out.append({"type": "text", "text": c})
        else:
            out.extend(c)
    return out


def merge_assistants(items: list[ViewItem]) -> list[ViewItem]:
    """Adjacent assistant items are one turn's reply (Responses splits text and calls into items)."""
    out: list[ViewItem] = []
    for item in items:
        if item.kind == "assistant" and out and out[-1].kind == "assistant":
            prev = out[-1]
            if item.text:
                prev.text = f"{prev.text}\n\n{item.text}" if prev.text else item.text
            prev.calls.extend(item.calls)
        else:
            out.append(
                ViewItem(
                    item.kind,
                    item.text,
                    list(item.images),
                    list(item.calls),
                    item.call_id,
                    list(item.parts),
                    None if item.content is None else list(item.content),
                    item.role,
                )
            )
    return out


def check_call_ids(items: list[ViewItem], param: str) -> None:
    """400 (before anything is written) for a reply that makes two calls with one id: a result
    could not say which it answers (and the server keeps one pending call per id)."""
    for n, item in enumerate(items):
        ids = [c["id"] for c in item.calls if c["id"]]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ApiError(
                400,
                f"{param}: the assistant reply at item {n} makes several tool calls with the id {', '.join(dup)}; "
                "tool call ids must be unique",
                code="duplicate_tool_call_id",
                param=param,
            )


def unanswered_calls(items: list[ViewItem], *, answering: bool) -> list[str]:
    """Ids of the calls of the transcript no later tool result answers: OpenAI refuses such a
    transcript (it would be seeded with made-up results). `answering`: the new input answers the
    last reply's calls (results, approvals), which may come in parts; its calls are not checked."""
    answered_at: dict[str, int] = {}
    last_reply = -1
    for n, item in enumerate(items):
        if item.kind == "tool" and item.call_id is not None:
            answered_at[item.call_id] = n
        elif item.kind == "assistant":
            last_reply = n
    out: list[str] = []
    for n, item in enumerate(items):
        if item.kind != "assistant" or (answering and n == last_reply):
            continue
        out += [c["id"] for c in item.calls if answered_at.get(c["id"], -1) < n]
    return out


def results_without_call(items: list[ViewItem]) -> list[str]:
    """Call ids of tool results that no assistant item before them made."""
    made: set[str] = set()
    out: list[str] = []
    for item in items:
        if item.kind == "assistant":
            made.update(c["id"] for c in item.calls)
        elif item.kind == "tool" and item.call_id not in made:
            out.append(item.call_id or "")
    return out


def split_new_input(items: list[ViewItem]) -> tuple[list[ViewItem], list[ViewItem]]:
    """(prefix up to and including the last assistant item, the trailing new input)."""
    last = -1
    for i, item in enumerate(items):
        if item.kind == "assistant":
            last = i
    return items[: last + 1], items[last + 1 :]


def split_after_results(
    prefix: list[ViewItem], new: list[ViewItem], param: str
) -> tuple[list[ViewItem], list[ViewItem]]:
    """A whole transcript's split (`split_new_input`) when its new input holds tool results and
    then user input: the results answer calls made before them, so that tool round is history
    (prefix up to and including the last result) and the user input after it is the new input, as
    OpenAI reads such a transcript (a client that ran a tool itself and stopped there, a few-shot
    history). Kept as given, for the route to refuse as a mix: user input before a result, or a
    result answering no call made before it."""
    results = [n for n, item in enumerate(new) if item.kind == "tool"]
    if not results:
        return prefix, new
    last = results[-1]
    if any(i.kind == "user" for i in new[:last]) or not any(i.kind == "user" for i in new[last + 1 :]):
        return prefix, new
    history = prefix + new[: last + 1]
    if results_without_call(history):
        return prefix, new
    check_answered_once(new[: last + 1], param)
    return history, new[last + 1 :]


def check_answered_once(items: list[ViewItem], param: str) -> None:
    """400 `invalid_input` for a call the items answer twice, differently (as the answers of a
    paused turn are refused): the model would see only one of them."""
    given: dict[str, str | None] = {}
    for item in items:
        if item.kind != "tool" or item.call_id is None:
            continue
        if item.call_id in given and given[item.call_id] != item.text:
            raise ApiError(
                400,
                f"{param}: call {item.call_id} is answered twice in this input, differently",
                code="invalid_input",
                param=param,
            )
        given[item.call_id] = item.text


def system_record(item: ViewItem) -> MessageRecord:
    """The message a kept system/developer item (`ViewItem.role`) is in a conversation."""
    meta = {"role": "developer"} if item.role == "developer" else {}
    return MessageRecord(role="system", content=item.text, source={"kind": "http_seed"}, meta=meta)


def seed_records(items: list[ViewItem]) -> list[MessageRecord]:
    """Messages that reproduce a client-sent transcript in a new conversation. System text is kept
    in its place when it is a Responses input item (`ViewItem.role`), as the conversation keeps
    those of each turn's input; a chat request's instructs its turn only."""
    names: dict[str, str] = {}
    out: list[MessageRecord] = []
    for item in items:
        if item.kind == "system":
            if item.role is not None and item.text:
                out.append(system_record(item))
        elif item.kind == "user":
            out.append(MessageRecord(role="user", content=user_content(item), source={"kind": "http_seed"}))
        elif item.kind == "assistant":
            calls = []
            for c in item.calls:
                cid = c.get("id") or f"call_{secrets.token_hex(10)}"
                names[cid] = c["name"]
                calls.append({"id": cid, "name": c["name"], "arguments": c["arguments"], "executor": "client"})
            out.append(MessageRecord(role="assistant", content=item.text, tool_calls=calls))
        elif item.kind == "tool":
            cid = item.call_id or ""
            out.append(MessageRecord(role="tool", content=item.text, tool_call_id=cid, name=names.get(cid, "tool")))
    return _valid_tool_pairs(out)


def _valid_tool_pairs(messages: list[MessageRecord]) -> list[MessageRecord]:
    """Drop tool results without a call and give calls without a result a synthetic one. A system
    message among a call's results goes after them: nothing comes between a call and its result."""
    out: list[MessageRecord] = []
    open_calls: dict[str, str] = {}
    held: list[MessageRecord] = []  # system messages sent while calls were open
    for m in messages:
        if m.role == "system" and open_calls:
            held.append(m)
            continue
        if m.role == "tool":
            if m.tool_call_id in open_calls:
                open_calls.pop(m.tool_call_id)
                out.append(m)
            continue
        for cid, name in open_calls.items():
            out.append(
                MessageRecord(
                    role="tool", content="(no result was provided)", tool_call_id=cid, name=name, is_error=True
                )
            )
        open_calls = {}
        out.extend(held)
        held = []
        out.append(m)
        if m.role == "assistant":
            open_calls = {c["id"]: c["name"] for c in m.tool_calls}
    return out + held


def _round_made_at(messages: list[MessageRecord]) -> MessageRecord | None:
    """The last assistant message, past the tool results after it: the one that made the calls
    open at the end of `messages` (None when there is none)."""
    i = len(messages) - 1
    while i >= 0 and messages[i].role == "tool":
        i -= 1
    if i < 0 or messages[i].role != "assistant":
        return None
    return messages[i]


def _calls_of(message: MessageRecord | None) -> list[tuple[str, str]]:
    """(id, name) of the calls `message` made."""
    return [(c["id"], c["name"]) for c in message.tool_calls] if message is not None else []


def open_call_ids(messages: list[MessageRecord]) -> list[str]:
    """The calls open at the end of `messages` (the last assistant message's calls, past the results
    after it, that have none), as clients name them: a client tool's by its id, an approval's
    `mcpr_…`. New input after them would reach the model after calls without results (OpenAI
    refuses such a transcript, and every later turn would carry it)."""
    i = len(messages) - 1
    while i >= 0 and messages[i].role == "tool":
        i -= 1
    if i < 0 or messages[i].role != "assistant":
        return []
    answered = {m.tool_call_id for m in messages[i + 1 :]}
    return [
        c["id"] if c.get("executor") == "client" else f"mcpr_{c['id']}"
        for c in messages[i].tool_calls
        if c["id"] not in answered
    ]


def calls_open(call_ids: list[str]) -> ApiError:
    """New input at a point where calls wait for answers (when the route names no error of its own)."""
    return ApiError(
        409,
        f"the calls {', '.join(call_ids)} wait for answers at this point of the conversation: answer them "
        "before new input",
        code="calls_pending",
        param="input",
    )


def _answers_fit(call_ids: list[str], made: list[tuple[str, str]]) -> bool:
    """Every answered call is one of `made` (a legacy `function` answer by its function's name)."""
    known = {cid for cid, _ in made}
    return all(by_name(cid, made) in known for cid in call_ids)


@dataclass(slots=True)
class Placement:
    conversation_id: str
    how: str  # header | header_new | prefix | fork | new | previous_response | conversation | rerun
    claimed: bool = False  # this request holds the conversation's head claim (release it)
    # A request answering calls placed at its conversation's head (how "prefix"): the last message
    # of the point it continues, and the turn that made the calls there. Another request (on
    # another server of a cluster) may answer them first; this one then forks there (`fork_lost`).
    point_message: int | None = None
    paused_turn: str | None = None
    # The calls made there ({id, name, arguments}, in order): a legacy `function` message, which
    # names its call by the function only, answers one of these (`answer_at_round`), whatever
    # another request (on another server) did with them since.
    round_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Answers:
    """A request whose new input answers tool calls (results, approval decisions). A new
    conversation for it (a fork of a point already passed, or a history whose calls this server
    never issued) is written paused at those calls, so the answers resume it like any other."""

    call_ids: list[str]
    client_tools: list[dict[str, Any]]  # of the paused turn written (as TurnRecord.client_tools)
    options: dict[str, Any]
    param: str  # where a refusal points: messages | input
    given: list[Decision] = field(default_factory=list)  # the answers themselves (a fork checks them)
    # Legacy `functions`: the calls the transcript's last legacy replies showed one at a time (the
    # last one is the call answered now) and the results it gave the others (`legacy_round`).
    shown: list[dict[str, str]] = field(default_factory=list)
    shown_results: list[str] = field(default_factory=list)
    # Called just before a conversation paused at the answered calls is written for them (its
    # checks passed): raises to refuse the request with nothing written (the open-turn cap:
    # common.TurnSeat.admit_written).
    before_write: Callable[[], None] | None = None


@dataclass(slots=True)
class Paused:
    """The tail of a history that waits for answers: the assistant message with the calls (and the
    results some of them already have), and the calls still open."""

    messages: list[MessageRecord]
    open_calls: list[dict[str, Any]]
    # What the conversation this one is forked from did with the calls (`_carry_over`): approved
    # calls that ran there, by their result (text, is_error), which approving them reuses; denials
    # the request repeats (their reason and who decided); calls closed there that the request
    # does not answer, written closed as they were.
    ran: dict[str, tuple[str, bool]] = field(default_factory=dict)
    decided: dict[str, PendingCall] = field(default_factory=dict)
    carried: dict[str, PendingCall] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class ShownRound:
    """What a response showed of the round of calls its turn waited on: the turn, and the calls it
    still asked for. A response that answered part of a round (the rest left open) holds the other
    calls' answers in its context, though they wait in the turn's state, not as messages: a fork
    at it keeps them, as answering the rest there did (`_carry_over`), and names only the calls
    it asked for as open. A response that made the calls asked for them all."""

    turn_id: str
    still_open: frozenset[str]  # raw call ids (an approval's without its `mcpr_`)

    def answered(self, turn_id: str | None, call_id: str) -> bool:
        """Call `call_id` of turn `turn_id`'s round had its answer when the response was made."""
        return turn_id == self.turn_id and call_id not in self.still_open


def asked_at(messages: list[MessageRecord], shown: ShownRound | None) -> list[str]:
    """The calls open at the end of `messages` (`open_call_ids`) that the response the point is
    (`shown`) still asked for; all of them when it asked for none of its round (never none, while
    any is open: new input after them must be refused)."""
    waiting = open_call_ids(messages)
    made = _round_made_at(messages)
    if shown is None or made is None:
        return waiting
    return [w for w in waiting if not shown.answered(made.turn_id, w.removeprefix("mcpr_"))] or waiting


# The id a legacy assistant `function_call` (which has none) is known by: a `function` message
# answers it by the function's name. A legacy reply shows one call (the model may have made several:
# they come back one at a time, the first open one first).
LEGACY_CALL_ID = "call_function_"


def legacy_name(call_id: str) -> str | None:
    """The function a legacy `function` message answers (its id names it), else None."""
    return call_id[len(LEGACY_CALL_ID) :] if call_id.startswith(LEGACY_CALL_ID) else None


def legacy_round(prefix: list[ViewItem]) -> tuple[list[dict[str, str]], list[str]]:
    """The calls a legacy transcript's last replies showed one at a time, each answered by the
    `function` message after it, up to its last reply (whose call the request answers now), and
    the results of all but that last: ([call, ...], [result, ...]). Which of them were one model
    message's calls only the store knows (`answer_shown`)."""
    if not prefix or prefix[-1].kind != "assistant" or not _one_legacy_call(prefix[-1]):
        return [], []
    calls: list[dict[str, str]] = [prefix[-1].calls[0]]
    results: list[str] = []
    i = len(prefix) - 1
    while i >= 2 and prefix[i - 1].kind == "tool" and _one_legacy_call(prefix[i - 2]):
        if legacy_name(prefix[i - 1].call_id or "") != prefix[i - 2].calls[0]["name"]:
            break
        calls.insert(0, prefix[i - 2].calls[0])
        results.insert(0, prefix[i - 1].text)
        i -= 2
    return calls, results


def _one_legacy_call(item: ViewItem) -> bool:
    return item.kind == "assistant" and len(item.calls) == 1 and legacy_name(item.calls[0]["id"]) is not None


def answer_shown(paused: Paused, answers: Answers) -> None:
    """A legacy reply shows one call of a model message; its answer comes back and the next call
    is shown, until all are answered. A point past the first of them is still at that message
    (the earlier answers wait with the paused turn, not in its history), so a fork from it (a
    resent transcript) would find them all open: the transcript's answers to the calls shown
    before the one answered now are written into it, as tool results, and the answer goes to the
    next call, as where it was. Those calls are the first open calls that, in order, are the last
    ones the transcript showed (name and arguments)."""
    shown = answers.shown
    for k in range(min(len(shown), len(paused.open_calls)), 1, -1):
        first = paused.open_calls[:k]
        if all(_same_call(a, b) for a, b in zip(first, shown[-k:], strict=True)):
            results = answers.shown_results[len(shown) - k :]
            for c, output in zip(first[:-1], results, strict=False):
                paused.messages.append(MessageRecord(role="tool", content=output, tool_call_id=c["id"], name=c["name"]))
            paused.open_calls = paused.open_calls[k - 1 :]
            return


def _same_call(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(
        a["name"] == b["name"] and _canon_args(a.get("arguments") or "") == _canon_args(b.get("arguments") or "")
    )


def by_name(call_id: str, calls: list[tuple[str, str]]) -> str:
    """The id of the call (id, name) a legacy answer names: the first of that name, which is the
    one a legacy reply showed (calls come back one at a time, in order); else `call_id` as it is."""
    name = legacy_name(call_id)
    if name is None or any(cid == call_id for cid, _ in calls):
        return call_id
    named = [cid for cid, n in calls if n == name]
    return named[0] if named else call_id


def answer_at_round(call_id: str, made: list[dict[str, Any]], shown: list[dict[str, str]]) -> str:
    """The id of the call of the round `made` (a point's calls) that a legacy answer (`call_id`
    names its function) answers: the call the transcript showed last, its legacy replies having
    shown the round's calls one at a time from the first (`shown`, see `legacy_round`); else the
    first call of that name. Read from the history, not from the calls still waiting: an answer
    racing another one (on another server) that was applied first still names its call, and forks
    from the point like any other (`fork_lost`)."""
    name = legacy_name(call_id)
    if name is None:
        return call_id
    for k in range(min(len(shown), len(made)), 0, -1):
        if made[k - 1]["name"] == name and all(_same_call(a, b) for a, b in zip(made[:k], shown[-k:], strict=True)):
            return str(made[k - 1]["id"])
    return by_name(call_id, [(c["id"], c["name"]) for c in made])


def repeats_answer(p: PendingCall | None, d: Decision) -> bool:
    """`d` is the answer call `p` already has (a stateless client resending its history, a retry)."""
    if p is None:
        return False
    if d.action == "result":
        return p.kind == "client" and p.status == "result" and (p.output or "") == (d.output or "")
    if p.kind == "approval" and p.status == "result":  # approved in a fork: the result it reused
        return d.action == "approve"
    return p.status == {"approve": "approved", "deny": "denied"}.get(d.action)


def split_paused(messages: list[MessageRecord], answers: Answers) -> tuple[list[MessageRecord], Paused]:
    """(messages before the paused tail, the tail) for a history whose last assistant message has
    calls without results; 400 (before anything is written) when the answers fit no open call."""
    i = len(messages) - 1
    while i >= 0 and messages[i].role == "tool":
        i -= 1
    open_calls: list[dict[str, Any]] = []
    if i >= 0 and messages[i].role == "assistant" and messages[i].tool_calls:
        answered = {m.tool_call_id for m in messages[i + 1 :]}
        open_calls = [c for c in messages[i].tool_calls if c["id"] not in answered]
    known = {c["id"] for c in open_calls}
    named = [(c["id"], c["name"]) for c in open_calls]
    stray = [c for c in answers.call_ids if by_name(c, named) not in known]
    if stray:
        waiting = f"the calls waiting there are {', '.join(sorted(known))}" if known else "no call is waiting there"
        raise ApiError(
            400,
            f"the tool results / approval answers for {', '.join(stray)} "
            f"answer no tool call of the assistant message before them ({waiting})",
            code="unknown_tool_call",
            param=answers.param,
        )
    return messages[:i], Paused(messages[i:], open_calls)


class ConversationMatcher:
    """Places requests. A conversation found by its history (prefix, previous response) is continued
    only when nothing else is on its way into it: requests racing with the same history (an SDK
    retry, two tabs, a double click) would otherwise all queue into one conversation, each answered
    after the others' input. So the request that continues a head *claims* it, synchronously after
    its last look at the store, until its turn is queued (`release`); a conversation that is claimed
    or has a turn running or queued has moved past that point, and the others fork from it (input
    queued behind a turn paused for answers has not: answers to that turn continue it). New
    conversations (seeded, forked) are claimed from birth: their point is recorded before their
    turn is queued."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.store = server.store
        # one matcher serves the chat and responses routes (both match on the same history points)
        self.claims: set[str] = set()

    def free(self, conversation_id: str, *, answering: bool = False) -> bool:
        """Nothing is on its way into this conversation: unclaimed, no turn running or queued (a
        turn paused for answers is at its head: the answers continue it). `answering`: the request
        answers tool calls; input queued behind a paused turn has not run, so the paused turn is
        still the head and its answers continue it (the queued input runs after)."""
        if conversation_id in self.claims:
            return False
        kernel = self.server.kernel
        if not kernel.in_flight(conversation_id):
            return True
        rt = kernel.runtimes.get(conversation_id)
        return answering and rt is not None and rt.awaiting_turn is not None

    async def moving_elsewhere(self, conversation_id: str, *, answering: bool = False) -> bool:
        """Another server of a cluster runs a turn of this conversation or holds one queued: it
        moves past its stored head there. `answering`: as `free`, input queued there behind a turn
        paused for answers has not moved it."""
        if not await self.server.kernel.in_flight_elsewhere(conversation_id):
            return False
        if not answering:
            return True
        turns = await self.store.list_turns(conversation_id, statuses=("queued", "running", "awaiting"))
        statuses = {t.status for t in turns}
        return "running" in statuses or "awaiting" not in statuses

    def claim(self, conversation_id: str) -> None:
        self.claims.add(conversation_id)

    def release(self, place: Placement | None) -> None:
        """The request's turn is queued (or it gave up): the runtime shows what the claim held."""
        if place is not None and place.claimed:
            self.claims.discard(place.conversation_id)
            place.claimed = False

    async def _new(
        self,
        agent: AgentRecord,
        namespace: str | None,
        *,
        conv_id: str | None = None,
        seed: list[ViewItem] | None = None,
        user: str | None = None,
        metadata: dict[str, Any] | None = None,
        forked_from: str | None = None,
        copy: list[int] | None = None,
        answers: Answers | None = None,
        paused: Paused | None = None,
    ) -> ConversationRecord:
        """`answers`: write the conversation paused at the calls they answer: `paused` (a fork's
        tail, not among `copy`), else the tail of the seeded messages."""
        made, created = await self._new_or_there(
            agent,
            namespace,
            conv_id=conv_id,
            seed=seed,
            user=user,
            metadata=metadata,
            forked_from=forked_from,
            copy=copy,
            answers=answers,
            paused=paused,
        )
        assert created  # only a client-chosen id (`conv_id`) can be there already
        return made

    async def _new_or_there(
        self,
        agent: AgentRecord,
        namespace: str | None,
        *,
        conv_id: str | None = None,
        seed: list[ViewItem] | None = None,
        user: str | None = None,
        metadata: dict[str, Any] | None = None,
        forked_from: str | None = None,
        copy: list[int] | None = None,
        answers: Answers | None = None,
        paused: Paused | None = None,
    ) -> tuple[ConversationRecord, bool]:
        """`_new` and True; with a client-chosen `conv_id` the conversation may have been created
        meanwhile (requests racing with the same unseen `X-Conversation-Id`, on this server or
        another): then nothing is written, and the one there and False are returned (unclaimed),
        for the caller to check as one it found (it may be another agent's or credential's)."""
        records: list[MessageRecord] = seed_records(seed) if seed else []
        if answers is not None and paused is None:
            records, paused = split_paused(records, answers)  # refuses before anything is written
        if answers is not None and answers.before_write is not None:
            answers.before_write()  # a turn paused for them is about to be written: the last refusal
        conv = ConversationRecord(
            id=conv_id or new_id("conv"),
            agent_id=agent.id,
            title="http",
            user=user,
            namespace=namespace,
            forked_from=forked_from,
            metadata=dict(metadata or {}),
        )
        # The caller releases the claim once its turn is queued (or on failure). A request of this
        # server creating the same client-chosen id right now holds it already: its write was
        # queued first, so this one finds the conversation there and leaves that claim alone.
        mine = conv.id not in self.claims
        self.claim(conv.id)
        try:
            there = await self._write_new(conv, records, copy, answers, paused, once=conv_id is not None)
        except BaseException:
            if mine:
                self.claims.discard(conv.id)
            raise
        if there is not None:
            if mine:
                self.claims.discard(conv.id)
            return there, False
        self.claim(conv.id)
        return conv, True

    async def _write_new(
        self,
        conv: ConversationRecord,
        records: list[MessageRecord],
        copy: list[int] | None,
        answers: Answers | None,
        paused: Paused | None,
        *,
        once: bool = False,
    ) -> ConversationRecord | None:
        """None once written; with `once` (a client-chosen id), the conversation already there
        instead, when there is one (nothing written)."""
        try:
            if once:
                # with its seed in the same step: a request that finds it (on another server, which
                # may load it first) finds its history whole
                there, created = await self.store.ensure_conversation(conv, copy_messages=copy, messages=records)
                if not created:
                    return there
            else:
                await self.store.create_conversation(conv, copy_messages=copy)
        except AgentMissing:  # deleted since the request found it (another request or server)
            raise AgentGone(f"agent {conv.agent_id} was deleted while the request ran", param="model") from None
        if not once and records:
            await self.store.append_messages(conv.id, records)
        if answers is not None and paused is not None:
            await self._hold(conv.id)
            await self._write_paused(conv, paused, answers)
            await self.server.kernel.adopt(conv, paused=True)
            return None
        # No turns yet and (unless copied) exactly these messages: the submit that follows finds its
        # runtime loaded, with no lookups.
        await self.server.kernel.adopt(conv, history=None if copy else records)
        return None

    async def _hold(self, conversation_id: str) -> None:
        """This server takes the new conversation's lease before writing its paused turn: in a
        cluster a turn's writes are its holder's alone (another server's would be refused)."""
        try:
            await self.server.kernel.hold(conversation_id)
        except OwnedElsewhere:  # another request named this client-chosen id on another server just now
            raise Conflict(
                f"conversation {conversation_id} was taken up by another server while this request wrote it: "
                "retry the request"
            ) from None

    async def _write_paused(self, conv: ConversationRecord, paused: Paused, answers: Answers) -> None:
        """A turn of `conv` paused at the open calls, as the runtime leaves one (DESIGN §4.4)."""
        now = time.time()
        limits = self.server.config.limits
        turn = TurnRecord(
            id=new_id("turn"),
            conversation_id=conv.id,
            agent_id=conv.agent_id,
            status="running",
            source={"kind": "http_seed"},
            input={"content": ""},
            client_tools=answers.client_tools,
            options=dict(answers.options),
            owner=self.server.kernel.owner,
            started_at=now,
        )
        await self.store.accept_turn(turn)
        messages = [
            MessageRecord(
                role=m.role,
                content=m.content,
                iteration=1,
                tool_calls=[dict(c) for c in m.tool_calls],
                tool_call_id=m.tool_call_id,
                name=m.name,
                is_error=m.is_error,
                reasoning=m.reasoning,
                provider_state=m.provider_state,
                source=m.source,
            )
            for m in paused.messages
        ]
        pending = []
        for c in paused.open_calls:
            carried = paused.carried.get(c["id"])
            if carried is not None:  # closed where this was forked from: closed here as it was
                pending.append(replace(carried, conversation_id=conv.id, turn_id=turn.id, created_at=now))
                continue
            client = c.get("executor") == "client"
            timeout = limits.client_tool_timeout_s if client else limits.approval_timeout_s
            output, is_error = paused.ran.get(c["id"], (None, False))
            earlier = paused.decided.get(c["id"])
            pending.append(
                PendingCall(
                    c["id"],
                    conv.id,
                    turn.id,
                    c["name"],
                    c.get("arguments") or "",
                    "client" if client else "approval",
                    output=output,  # ran where this was forked from: an approval reuses it
                    is_error=is_error,
                    reason=earlier.reason if earlier is not None else None,  # a denial repeated keeps its words
                    decided_by=earlier.decided_by if earlier is not None else None,
                    created_at=now,
                    expires_at=now + timeout,
                )
            )
        still_open = [p for p in pending if p.status == "pending"]
        stop = "requires_approval" if any(p.kind == "approval" for p in still_open) else "requires_client_tool"
        await self.store.commit_turn(
            conv.id, TurnCommit(turn.id, "awaiting", stop, messages, pending, revision=1, iteration=1)
        )

    def visible(self, conv: ConversationRecord, agent: AgentRecord, namespace: str | None) -> bool:
        """`namespace`: the caller's `conversation_namespace` (None: admin or local, sees all)."""
        return conv.agent_id == agent.id and namespace_allows(namespace, conv.namespace)

    async def by_header(
        self,
        agent: AgentRecord,
        namespace: str | None,
        value: str,
        prefix: list[ViewItem],
        user: str | None,
        metadata: dict[str, Any] | None,
        answers: Answers | None = None,
        *,
        seed: list[ViewItem] | None = None,
    ) -> Placement:
        """The conversation an `X-Conversation-Id` names. A conversation made for it is seeded with
        `seed` (default `prefix`: the history the request sent). Admin and the local owner (`namespace`
        None) use the name as the id. A namespaced credential's name is its own: `NAME` is the
        conversation `NAME~<tag>` of its namespace (`namespaced_id`), so two credentials' equal
        names are two conversations and neither learns whether the other uses a name; a
        conversation it made under the bare name before names were qualified is still found under
        it. The `NAME~<tag>` id the answer echoes, sent back, is that same conversation (never
        qualified twice); nobody creates an id with a '~' but its namespace."""
        seed = prefix if seed is None else seed
        value = value.strip()
        keyword = value.lower()
        if keyword == "default":  # this credential's default conversation, never an id named so
            return await self._default(agent, namespace)
        if keyword == "new":  # a conversation of its own, whatever the history says
            made = await self._new(agent, namespace, seed=seed, user=user, metadata=metadata, answers=answers)
            return Placement(made.id, "header_new", claimed=True)
        qualified = QUALIFIED_ID_RE.match(value)
        if not qualified and not CONVERSATION_ID_RE.match(value):
            raise ApiError(
                400,
                f"invalid {HEADER}: letters, digits, '_', '.', ':', '-', at most 128 characters "
                "(or such a name with the '~' suffix an answer's X-Conversation-Id gave it)",
                code="invalid_conversation_id",
                param=HEADER,
            )
        # `own`: created when unknown. Admin's and the local owner's names are ids, as they are; a
        # namespaced credential's name is its own `NAME~<tag>` (`name_ids`). Ids as the server gives
        # them out are that conversation or none, never created by a namespaced credential: an id
        # with a '~' only by the namespace it names (nobody makes another's ahead of it), an id the
        # server made (`conv_…`) never (another credential's is "not found", as an unknown one is).
        if namespace is not None and value == NAMESPACE_DEFAULT_NAME:
            return await self._default(agent, namespace)  # its own default is `conv_default~…`
        ids = name_ids(value, namespace)
        if namespace is None:
            own = not qualified
        elif qualified:
            own = value == namespaced_id(value.partition("~")[0], namespace)
        else:
            own = len(ids) > 1  # a bare name (its own NAME~<tag>), not an id the server made
        conv_id = ids[0]
        conv = await self.store.get_conversation(conv_id)
        if conv is None:
            for legacy_id in ids[1:]:  # made under the bare name before names were qualified
                legacy = await self.store.get_conversation(legacy_id)
                if legacy is not None and self.visible(legacy, agent, namespace):
                    return Placement(legacy.id, "header")
        if conv is None and own:
            # "Created when unknown": requests racing with the same unseen id (on this server or
            # others) create it once; the rest find that one, as if they had come after it, and
            # are refused like any other when it is another agent's or credential's.
            conv, created = await self._new_or_there(
                agent, namespace, conv_id=conv_id, seed=seed, user=user, metadata=metadata, answers=answers
            )
            if created:
                return Placement(conv_id, "header_new", claimed=True)
        if conv is None or not self.visible(conv, agent, namespace):
            raise ApiError(
                404,
                f"Conversation with id {value!r} not found for this model and credential.",
                code="conversation_not_found",
                param=HEADER,
            )
        return Placement(conv.id, "header")

    async def by_rerun(self, agent: AgentRecord, namespace: str | None, turn_id: str | None) -> Placement | None:
        """A keyed repeat that names no conversation, whose earlier attempt's turn `turn_id`
        answered nothing (`TurnKey.rerun`): that turn's conversation, claimed, when the turn can be
        re-run there (`Kernel.rerun_conversation`) and the caller sees it (`visible`: a token
        re-created under the name with fewer rights does not). The same body matched that
        conversation then (the same transcript, previous response or `new`); matched again now,
        its cut-off reply would fork it and the input be stored twice. None (nothing claimed):
        placed as ever. Only a keyed repeat after such an end reads anything here."""
        if turn_id is None:
            return None
        conv_id = await self.server.kernel.rerun_conversation(turn_id, agent.id)
        conv = await self.store.get_conversation(conv_id) if conv_id is not None else None
        if conv is None or not self.visible(conv, agent, namespace):
            return None
        # a last look with no await before the claim: nothing queued or claimed since
        if not self.free(conv.id):
            return None
        self.claim(conv.id)
        return Placement(conv.id, "rerun", claimed=True)

    async def _default(self, agent: AgentRecord, namespace: str | None) -> Placement:
        return Placement((await self.server.kernel.default_conversation(agent, namespace)).id, "header")

    async def by_prefix(
        self,
        agent: AgentRecord,
        namespace: str | None,
        prefix: list[ViewItem],
        user: str | None,
        metadata: dict[str, Any] | None,
        answers: Answers | None = None,
        *,
        while_pending: Callable[[list[str]], ApiError] = calls_open,
        seed: list[ViewItem] | None = None,
    ) -> Placement:
        """`seed`: what a new conversation for it is seeded with (default `prefix`, which is hashed).
        `answers`: the new input answers tool calls; a fork or a new conversation is then made
        paused at them (a resent finished tool round forks and is answered; a history whose calls
        this server never issued is seeded and answered). `while_pending`: the route's refusal of
        new input at a point whose calls wait for answers (a fork never takes it: `fork_at`).

        The candidates are the `PREFIX_CANDIDATES` points of the history most recently recorded in
        conversations the caller sees (`visible`, decided in the store's read), most recently
        active first: the first still at that point and free is continued, else the first is
        forked from. Each reply records its conversation's point as it is made, so the one a client
        goes on with is among them unless as many others of the caller's reached that history since."""
        if not prefix:
            if answers is not None:  # results with no call before them: refused, nothing written
                split_paused([], answers)
            conv = await self._new(agent, namespace, user=user, metadata=metadata)
            return Placement(conv.id, "new", claimed=True)
        h = chain(prefix)
        points = await self.store.find_history_points(agent.id, h, namespace=namespace, limit=PREFIX_CANDIDATES)
        rounds: dict[str, MessageRecord | None] = {}  # conversation → the message that made the answered calls
        if answers is not None and points:
            rounds = await self._answerable(points, answers)
            points = [p for p in points if p.conversation_id in rounds]
        heads = await self.store.last_message_ids([p.conversation_id for p in points])
        for point in points:
            if heads[point.conversation_id] != point.last_message_id:
                continue  # moved past it: only forked from
            if await self.moving_elsewhere(point.conversation_id, answering=answers is not None):
                continue
            if self.free(point.conversation_id, answering=answers is not None):  # no await between check and claim
                self.claim(point.conversation_id)
                made = rounds.get(point.conversation_id)
                if made is None:
                    return Placement(point.conversation_id, "prefix", True, point.last_message_id)
                calls = [dict(c) for c in made.tool_calls]
                return Placement(point.conversation_id, "prefix", True, point.last_message_id, made.turn_id, calls)
        if points:
            src = points[0]
            conv_id = await self.fork_at(
                agent,
                namespace,
                src.conversation_id,
                src.last_message_id,
                answers,
                user=user,
                metadata=metadata,
                while_pending=while_pending,
            )
            place = Placement(conv_id, "fork", claimed=True)
        else:
            conv = await self._new(
                agent, namespace, seed=prefix if seed is None else seed, user=user, metadata=metadata, answers=answers
            )
            place = Placement(conv.id, "new", claimed=True)
        try:
            # serves a retry of this request only (the reply records the point its next request needs)
            await self.record(agent.id, place.conversation_id, h, wait=False)
        except BaseException:
            self.release(place)
            raise
        return place

    async def _answerable(self, points: list[HistoryPoint], answers: Answers) -> dict[str, MessageRecord | None]:
        """The points where the answered calls were made, by conversation (a conversation has one
        point of a hash), with the message that made them. The view leaves call ids out, so two
        histories whose turns made the same call (`f` with the same arguments, under other ids)
        share a point; answers to one conversation's calls belong there (or in a fork of it), never
        in another, which would refuse them as calls it never made. When no point made them (a
        history whose calls this server never issued, resent with other ids than one it seeded
        before), there is none: the history is seeded as a new conversation, paused at its own
        calls, and the answers answer those."""
        fitting: dict[str, MessageRecord | None] = {}
        for point in points:
            made = await self._round_at(point)
            if _answers_fit(answers.call_ids, _calls_of(made)):
                fitting[point.conversation_id] = made
        return fitting

    async def _round_at(self, point: HistoryPoint) -> MessageRecord | None:
        """The last assistant message at `point` (past the results after it), which made its calls:
        a short read first, the long one only when the round's results fill it."""
        for limit in (CALL_TAIL_SHORT, CALL_TAIL_MAX):
            tail = await self.store.list_messages(
                point.conversation_id, before_id=point.last_message_id + 1, limit=limit
            )
            if len(tail) < limit or any(m.role != "tool" for m in tail):
                break
        return _round_made_at(tail)

    async def fork_at(
        self,
        agent: AgentRecord,
        namespace: str | None,
        source_conversation: str,
        last_message_id: int,
        answers: Answers | None = None,
        *,
        user: str | None = None,
        metadata: dict[str, Any] | None = None,
        seed: list[ViewItem] | None = None,
        while_pending: Callable[[list[str]], ApiError] = calls_open,
        shown: ShownRound | None = None,
    ) -> str:
        """A new conversation with the source's messages up to `last_message_id`, then `seed`'s;
        with `answers`, paused at the calls open there (checked before anything is written).
        `shown`: the point is a response that answered part of its round: the answers it had stay
        given in the fork (see ShownRound).

        Without `answers` (new user input) the point must have no call waiting for an answer: a
        client tool's call stays the client's, open in the fork unless the request answers it, and
        an approval is never decided by new input. Whatever became of the calls in the source
        conversation later (answered there, run, expired), new input after them is refused with
        `while_pending(their ids)` (Responses 409 `calls_pending`, chat 400
        `tool_calls_unanswered`), before anything is written: continued, the fork would send the
        model an assistant message with tool calls and no results, on this turn and every later one."""
        source = await self.store.list_messages(source_conversation)
        messages = [m for m in source if m.id is not None and m.id <= last_message_id]
        paused: Paused | None = None
        if answers is None:
            waiting = asked_at(messages, shown)
            if waiting:
                raise while_pending(waiting)
        else:
            later = [m for m in source if m.id is not None and m.id > last_message_id]
            messages, paused = split_paused(messages, answers)  # the tail is written again, paused
            answer_shown(paused, answers)
            await self._carry_over(paused, answers, later, source_conversation, shown)
        ids = [m.id for m in messages if m.id is not None]
        conv = await self._new(
            agent,
            namespace,
            user=user,
            metadata=metadata,
            forked_from=source_conversation,
            copy=ids,
            answers=answers,
            paused=paused,
            seed=seed,
        )
        return conv.id

    async def fork_lost(
        self,
        agent: AgentRecord,
        namespace: str | None,
        head: Placement,
        answers: Answers,
        *,
        user: str | None = None,
        metadata: dict[str, Any] | None = None,
        while_pending: Callable[[list[str]], ApiError] = calls_open,
    ) -> Placement:
        """The fork a request answering the calls of `head`'s point goes to once another request
        answered them first and continued the conversation (on another server of a cluster: see
        common.round_answered), as the second of two racing on one server forks: from that point,
        paused at the calls, to be answered there. The head's claim is given up."""
        self.release(head)
        assert head.point_message is not None  # set with `paused_turn`, which the caller checked
        fork = await self.fork_at(
            agent,
            namespace,
            head.conversation_id,
            head.point_message,
            answers,
            user=user,
            metadata=metadata,
            while_pending=while_pending,
        )
        return Placement(fork, "fork", claimed=True)

    async def _carry_over(
        self,
        paused: Paused,
        answers: Answers,
        later: list[MessageRecord],
        source: str,
        shown: ShownRound | None = None,
    ) -> None:
        """What the source conversation did with the calls open at the fork point goes into the
        fork (checked before anything is written); `later` is the source's messages after it.

        Every approval closed there stays closed in the fork, whether or not this request answers
        it: a call run there keeps its result, a denied, expired or cancelled one its end, with who
        denied it and why (`Paused.carried`). A client tool's call is the client's to answer: open
        in the fork unless this request answers it, with whatever result it sends (nothing of the
        server runs for it; a retry of a partial answer is asked for the rest again), except where
        the fork point is a response that answered part of the round (`shown`): the client calls
        answered by then keep their results, as that response's context holds them (answering
        the rest there is what answering them after it did; another result for one of them is a
        400 `already_resolved`, as at that response while it was its conversation's head). An
        approval resent for a call that ran there reuses the result instead of running again (`Paused.ran`),
        one resent for a denied call keeps the denial's words (`Paused.decided`). A fork never decides an
        approval anew: one given otherwise (approving what a person denied, an expired or
        cancelled call) is a 400 `already_resolved`. An approved call with no result yet while the
        source runs its turn (two requests sending the same answer at once) is a 409
        `already_resolving`, to retry once that request is done; one that waits there for the
        other answers of its round is a 400 naming the conversation to answer them in."""
        turn_id = paused.messages[0].turn_id if paused.messages else None
        if turn_id is None or not answers.given:
            return  # a seeded history's calls: never answered on this server
        calls = {p.call_id: p for p in await self.store.list_pending(turn_id)}
        if not calls:
            return
        results = {m.tool_call_id: m for m in later if m.role == "tool" and m.tool_call_id}
        named = [(c["id"], c["name"]) for c in paused.open_calls]
        given = {by_name(d.call_id, named): d for d in answers.given}
        running = source in self.claims or self.server.kernel.turn_active(source)
        if not running:
            turn = await self.store.get_turn(turn_id)
            running = turn is not None and turn.status == "running"  # resumed, maybe on another server
        clashes: list[str] = []
        busy: list[str] = []
        waiting: list[str] = []
        for c in paused.open_calls:
            cid = c["id"]
            p, d = calls.get(cid), given.get(cid)
            if p is None or p.status == "pending" and not (running and d is not None and d.action == "approve"):
                continue  # never asked here, or still open there and nobody answers it: open in the fork
            if p.kind == "client":
                if p.status == "result" and shown is not None and shown.answered(turn_id, cid):
                    if d is None:
                        paused.carried[cid] = p  # answered before the response forked at: kept
                    elif not repeats_answer(p, d):
                        clashes.append(f"call {cid} was already answered ({p.status})")
                continue  # nothing of the server ran for it: open, or this request's result, as sent
            if p.status == "pending" or (p.status in ("approved", "result") and cid not in results):
                (busy if running else waiting).append(cid)
                continue
            if d is not None and not repeats_answer(p, d):
                clashes.append(f"call {cid} was already answered ({p.status})")
                continue
            if p.status in ("approved", "result"):  # "result": approved in a fork, its result reused there
                done = results[cid]
                output = (done.content if isinstance(done.content, str) else "", done.is_error)
                if d is None:
                    paused.carried[cid] = replace(p, status="result", output=output[0], is_error=output[1])
                else:
                    paused.ran[cid] = output
            elif d is None:
                paused.carried[cid] = p
            else:
                paused.decided[cid] = p
        if clashes:
            raise ApiError(
                400,
                "; ".join(clashes) + ": an answer given there cannot be changed by answering the call again",
                code="already_resolved",
                param=answers.param,
            )
        if busy:
            raise ApiError(
                409,
                f"call {', '.join(busy)} is being answered by another request right now; an approval runs its "
                "call once: retry once that request is done, and this one reuses the call's result",
                code="already_resolving",
                param=answers.param,
            )
        if waiting:
            raise ApiError(
                400,
                f"call {', '.join(waiting)} was approved in conversation {source}, where it waits for the other "
                "answers of its round and has not run yet: answer those there (conversation or X-Conversation-Id "
                f"{source}), not in a fork of an earlier response",
                code="already_resolved",
                param=answers.param,
            )

    async def record(
        self,
        agent_id: str,
        conversation_id: str,
        prefix_hash: str,
        last_message_id: int | None = None,
        *,
        wait: bool = True,
    ) -> None:
        """A point at `last_message_id` (a turn's own newest message, when known), else at the
        conversation's newest message now: read before a later turn can commit behind it.
        Committed on return (a reply's point), unless `wait` is false (see Store.add_history_point)."""
        last = last_message_id if last_message_id is not None else await self.store.last_message_id(conversation_id)
        await self.store.add_history_point(HistoryPoint(agent_id, prefix_hash, conversation_id, last), wait=wait)
