"""POST /v1/responses (non-stream and SSE), GET/DELETE /v1/responses/{id}, GET …/input_items.

Responses are stored with opaque random ids. `previous_response_id` continues its conversation,
or forks it when the response is no longer the conversation's head. Client function calls end the
response with `function_call` items; server tools needing approval end it with
`mcp_approval_request` items; server-executed tools show as `mcp_call` items.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from starlette.requests import Request
from starlette.responses import Response

from appserver.agent.loop import ASKED_TOOLS, MAX_TOOL_CALLS, OFFERED_TOOLS, OWN_SYSTEM, model_call_params
from appserver.agent.tools import Tool
from appserver.auth import Principal, conversation_namespace, namespace_allows
from appserver.http import fields
from appserver.http.chat import (
    REASONING_EFFORTS,
    RESPONSES_PARTS,
    SERVICE_TIERS,
    VERBOSITY,
    allowed_tools_of,
    blank_input,
    check_format,
    check_media,
    content_of,
    join_texts,
    moderation_of,
    new_content,
    no_images,
    number_options,
    own_tool_names,
    parts_of,
    schema_fields,
    shared_param_types,
    show_reasoning,
    tool_choice_of,
    tool_names,
    turn_tools,
    user_and_metadata,
)
from appserver.http.common import (
    Idempotency,
    TurnRun,
    TurnSeat,
    advertised_ids,
    after_turn_refused,
    answer_paused,
    answer_settings,
    dumps,
    failed_answer,
    forget_answers_of,
    json_response,
    keep_or_free,
    max_steps_note,
    new_blocks,
    principal_of,
    read_json,
    request_usage,
    rerun_unnamed,
    resolve_model,
    round_answered,
    settle_or_cancel,
    start_turn,
    stream_replay,
    turn_error,
    unread_answer,
    until_credential_ends,
    watch_credential,
)
from appserver.http.conversation_match import (
    HEADER,
    Answers,
    ConversationMatcher,
    Placement,
    ShownRound,
    ViewItem,
    chain,
    check_call_ids,
    for_agent,
    merge_assistants,
    name_ids,
    split_after_results,
    split_new_input,
    unanswered_calls,
)
from appserver.http.errors import ApiError, bad_request, turn_failure
from appserver.http.sse import SSEItem, SSEResponse
from appserver.http.stopping import CODE as SHUTTING_DOWN
from appserver.http.stopping import Stopping, shutting_down
from appserver.providers.base import ToolSpec
from appserver.runtime import TERMINAL_STATUSES, Decision, TurnHandle, TurnSnapshot
from appserver.runtime.kernel import NAMESPACE_DEFAULT_NAME
from appserver.runtime.settle import not_run_text, stopped_text
from appserver.runtime.snapshot import answered_unrun
from appserver.store.base import StoreUnavailable, WriteRefused
from appserver.store.records import AgentRecord, ResponseRecord, TurnSettings

if TYPE_CHECKING:
    from appserver.http.metrics import Metrics
    from appserver.security.limits import TurnPlaces
from appserver.server import Server

log = logging.getLogger("appserver.http.responses")

# A stream that announced its response id but ends without its turn's outcome (the server stops,
# the client leaves) still stores the response: bounded, as the stop's drain (DRAIN_S) is.
KEEP_TIMEOUT_S = 2.0
CUT_SHORT = (
    "The server stopped before this response completed (it was killed mid-stream); the conversation "
    "keeps the turn as interrupted, with the text saved so far."
)


# A turn the store shows in one of these is still on its way: a stream (this server's, or, after a
# restart, none) may yet store how it ends.
ON_ITS_WAY = ("queued", "running")


# A response whose turn was withdrawn (settle.withdrawn, error kind `withdrawn`: its client went
# away before the turn showed or did anything, or a stop cut its request off before it started) is
# stored `cancelled` with this error (code from Response.error's closed enum, the specific one in
# brackets, as every other) and continues nothing: its input was never taken into the conversation.
WITHDRAWN = "input_withdrawn"


def withdrawn_error(error: dict[str, Any]) -> dict[str, Any]:
    """Response.error of a withdrawn turn of `error` (its turn error, which says why)."""
    why = str(error.get("message") or "its client went away before the turn showed or did anything")
    return {
        "code": "server_error",
        "message": f"The input of this response was withdrawn ({why}): the conversation does not hold it, and "
        f"no response can continue from this one; send the input again after the response before it. [{WITHDRAWN}]",
    }


def is_withdrawn(rec: ResponseRecord) -> bool:
    """`rec` is the stored response of a withdrawn turn (`withdrawn_error`)."""
    error = rec.body.get("error")
    return (
        rec.body.get("status") == "cancelled"
        and isinstance(error, dict)
        and str(error.get("message") or "").endswith(f"[{WITHDRAWN}]")
    )


def cut_short(rec: ResponseRecord) -> ResponseRecord:
    """`rec` as failed, as a server stop's stream ends: its turn was interrupted by a crash."""
    body = dict(rec.body, status="failed", error={"code": "server_error", "message": CUT_SHORT})
    return replace(rec, body=body)


def stopped_early(rec: ResponseRecord) -> bool:
    """`rec` was stored by a stream the server's stop ended (`response.failed`, server_shutting_down)
    while its turn still ran: the turn's end (its messages, the text it kept) was saved after it, by
    the kernel's stop (or the restart's crash settle). Its output and fork point are taken from the
    turn once that ended (`Responses.as_ended`), after which its `turn_id` is cleared."""
    error = rec.body.get("error")
    return (
        rec.turn_id is not None
        and rec.body.get("status") == "failed"
        and isinstance(error, dict)
        and str(error.get("message") or "").endswith(f"[{SHUTTING_DOWN}]")
    )


def shape_of(body: dict[str, Any], agent: AgentRecord) -> Shape:
    """The Shape of a stored Response object (the request's echoed fields), to render it again."""
    conversation = body.get("conversation")
    return Shape(
        id=str(body["id"]),
        model=str(body.get("model") or agent.id),
        agent=agent,
        created_at=int(body.get("created_at") or time.time()),
        instructions=None,
        tools=list(body.get("tools") or []),
        previous_response_id=body.get("previous_response_id"),
        store=bool(body.get("store", True)),
        metadata=dict(body.get("metadata") or {}),
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        max_output_tokens=body.get("max_output_tokens"),
        parallel_tool_calls=bool(body.get("parallel_tool_calls", True)),
        tool_choice=body.get("tool_choice", "auto"),
        conversation=conversation.get("id") if isinstance(conversation, dict) else None,
        reasoning=show_reasoning(agent),
        text=body.get("text") or {"format": {"type": "text"}},
        reasoning_params=body.get("reasoning") or {"effort": None, "summary": None},
        truncation=str(body.get("truncation") or "disabled"),
        max_tool_calls=body.get("max_tool_calls"),
        top_logprobs=int(body.get("top_logprobs") or 0),
        user=body.get("user"),
        safety_identifier=body.get("safety_identifier"),
        prompt_cache_key=body.get("prompt_cache_key"),
        prompt_cache_retention=body.get("prompt_cache_retention"),
        shown_instructions=body.get("instructions"),
        service_tier=str(body.get("service_tier") or "default"),
        label=label_of(body.get("tools"), body.get("tool_choice")),
    )


def label_of(tools: Any, choice: Any) -> str | None:
    """The `server_label` a request (or the Response object echoing it) named this agent by: its
    `mcp` tool's, else its `mcp` tool_choice's (or an `mcp` tool's of an allowed_tools choice);
    None when it named none (items then carry the id). Each was checked to name this agent when
    the request came."""
    named = [*(tools if isinstance(tools, list) else []), choice]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        nested = choice.get("allowed_tools")
        listed = (nested if isinstance(nested, dict) else choice).get("tools")
        named += listed if isinstance(listed, list) else []
    for value in named:
        if isinstance(value, dict) and value.get("type") == "mcp" and isinstance(value.get("server_label"), str):
            return str(value["server_label"])
    return None


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# Ids of items this server stores carry their response's id: msg_/fc_/rs_ + 32 hex (+ suffix).
REFERENCE_ID = re.compile(r"^(?:msg|fc|rs|fco|mcpa)_([0-9a-f]{32})")
# The ids of server tool items (`mcp_<call id>`, `mcpr_<call id>`: the approval_request_id clients
# answer with) cannot carry it: a record of the responses table under `item_index_id` lists the
# responses that hold such an item (stored false: never a response anyone can read).
ITEM_INDEX_PREFIX = "ref_"
ITEM_INDEX_MAX = 16  # responses listed per item id (call ids an upstream reuses: the latest ones)


def item_index_id(agent_id: str, item_id: str) -> str:
    digest = hashlib.sha256(f"{agent_id}\x00{item_id}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{ITEM_INDEX_PREFIX}{digest[:40]}"


def shown_choice(value: Any) -> Any:
    """tool_choice as the Response object echoes it (the request's, when it is a valid shape)."""
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    if isinstance(value, dict) and value.get("type") == "mcp" and isinstance(value.get("server_label"), str):
        return {k: v for k, v in value.items() if k in ("type", "server_label", "name")}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":  # checked by tool_choice_of
        spec, listed, _ = allowed_tools_of(value)
        return {"type": "allowed_tools", "mode": spec["mode"], "tools": [shown_allowed(t) for t in listed]}
    return "auto"


def echoed_choice(asked: Any, sent: Any) -> Any:
    """tool_choice as the Response object echoes it: the request's (`shown_choice`), unless the
    provider could not send it as forced (anthropic with thinking: `auto`, an allowed_tools choice
    of mode `auto`; loop.model_call_params)."""
    shown = shown_choice(asked)
    if sent == "auto":
        return "auto"
    sent_mode = sent.get("allowed_tools", {}).get("mode") if isinstance(sent, dict) else None
    if sent_mode != "auto" or not isinstance(shown, dict):
        return shown
    if shown.get("type") == "allowed_tools":
        return {**shown, "mode": "auto"}
    # an `mcp` choice without a name: the agent's own tools only, not forced
    return {"type": "allowed_tools", "mode": "auto", "tools": [shown]}


def shown_allowed(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool of an allowed_tools choice as a Response object lists it (Responses shape)."""
    fn = tool.get("function")
    if "name" not in tool and isinstance(fn, dict) and isinstance(fn.get("name"), str):  # Chat's shape
        return {"type": "function", "name": fn["name"]}
    return dict(tool)


# ---------------------------------------------------------------- request parsing


@dataclass(slots=True)
class ParsedInput:
    items: list[ViewItem] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    stored: list[dict[str, Any]] = field(default_factory=list)  # input items as listed by input_items


# Input items accepted but carrying nothing for the model: this server's own output items resent
# by stateless clients (reasoning is not replayed; mcp_list_tools is never produced here).
ECHOED_ITEMS = ("reasoning", "mcp_list_tools")
# Server tool items count as an empty assistant item: they merge into the reply around them.
SERVER_TOOL_ITEMS = ("mcp_call", "mcp_approval_request")
INPUT_ROLES = ("user", "system", "developer", "assistant")
SUPPORTED_ITEMS = (
    "message",
    "function_call",
    "function_call_output",
    "mcp_approval_response",
    "item_reference",
    *SERVER_TOOL_ITEMS,
    *ECHOED_ITEMS,
)


# The keys of each input item type this server takes, as OpenAI's API description has them
# (`EasyInputMessage`, `InputMessage` and `OutputMessage` for a message, `FunctionToolCall`,
# `FunctionCallOutputItemParam`, `MCPApprovalResponse` — whose `request_id` its description requires
# —, `MCPApprovalRequest`, `MCPToolCall`, `ReasoningItem`, `MCPListTools`, `ItemReferenceParam`; a
# function call's `async`: the openai SDK's, newer than that description):
# every key of this server's own output items among them, so that items a client resends
# (`input += response.output`, input_items) pass. Another key is a 400 `unknown_parameter` naming
# its path (`input[0].foo`), never dropped.
ITEM_KEYS = MappingProxyType(
    {
        "message": ("type", "role", "content", "status", "id", "phase"),
        "function_call": ("type", "id", "call_id", "name", "arguments", "status", "namespace", "caller", "async"),
        "function_call_output": ("type", "id", "call_id", "output", "status", "name", "namespace", "caller"),
        "mcp_approval_response": ("type", "id", "approval_request_id", "approve", "reason", "request_id"),
        "mcp_approval_request": ("type", "id", "server_label", "name", "arguments"),
        "mcp_call": (
            "type",
            "id",
            "server_label",
            "name",
            "arguments",
            "output",
            "error",
            "status",
            "approval_request_id",
        ),
        "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
        "mcp_list_tools": ("type", "id", "server_label", "tools", "error"),
        "item_reference": ("type", "id"),
    }
)
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
MCP_CALL_STATUSES = (*ITEM_STATUSES, "calling", "failed")
MESSAGE_PHASES = ("commentary", "final_answer")
# The keys of each content part type (`InputTextContent`, `InputImageContent`, `InputFileContent`,
# `OutputTextContent`, `RefusalContent`; the Chat Completions parts this route takes as well).
PART_KEYS = MappingProxyType(
    {
        "input_text": ("type", "text", "prompt_cache_breakpoint"),
        "input_image": ("type", "image_url", "file_id", "detail", "prompt_cache_breakpoint"),
        "input_file": ("type", "file_id", "filename", "file_data", "file_url", "detail", "prompt_cache_breakpoint"),
        "output_text": ("type", "text", "annotations", "logprobs"),
        "refusal": ("type", "refusal"),
        "text": ("type", "text"),
        "image_url": ("type", "image_url"),
        "file": ("type", "file"),
        "input_audio": ("type", "input_audio"),
    }
)
FILE_DETAILS = ("auto", "low", "high")
CACHE_BREAKPOINT_MODES = ("explicit",)

# The fields of the items taken without being read for the model (this server's output items a
# stateless client resends), as OpenAI's description types them (`ReasoningItem`, `MCPToolCall`,
# `MCPApprovalRequest`, `MCPListTools`; "?": optional): a malformed one is refused as any other
# item is, never taken silently.
MCP_CALL_FIELDS: fields.Fields = (
    ("id", "string"),
    ("server_label", "string"),
    ("name", "string"),
    ("arguments", "string"),
)
ITEM_FIELDS: Mapping[str, fields.Fields] = MappingProxyType(
    {
        "reasoning": (("id", "string"), ("summary", "array"), ("content", "array?"), ("encrypted_content", "string?")),
        "mcp_call": (*MCP_CALL_FIELDS, ("output", "string?"), ("approval_request_id", "string?")),
        "mcp_approval_request": MCP_CALL_FIELDS,
        "mcp_list_tools": (("id", "string"), ("server_label", "string"), ("tools", "array"), ("error", "string?")),
    }
)
TEXT_FIELDS: fields.Fields = (("text", "string"),)
SUMMARY_PARTS: Mapping[str, fields.Fields] = MappingProxyType({"summary_text": TEXT_FIELDS})
REASONING_PARTS: Mapping[str, fields.Fields] = MappingProxyType({"reasoning_text": TEXT_FIELDS})
LISTED_TOOL_FIELDS: fields.Fields = (
    ("name", "string"),
    ("input_schema", "object"),
    ("description", "string?"),
    ("annotations", "object?"),
)
# `MCPToolCallError`: `mcp_tool_execution_error`'s `content` may be anything
MCP_CALL_ERRORS: Mapping[str, fields.Fields] = MappingProxyType(
    {
        "mcp_protocol_error": (("code", "integer"), ("message", "string")),
        "mcp_tool_execution_error": (),
        "http_error": (("code", "integer"), ("message", "string")),
    }
)
# an output_text part's `annotations` (`Annotation`, by type) and `logprobs` (`LogProb`, `TopLogProb`)
ANNOTATIONS: Mapping[str, fields.Fields] = MappingProxyType(
    {
        "file_citation": (("file_id", "string"), ("index", "integer"), ("filename", "string")),
        "url_citation": (("url", "string"), ("start_index", "integer"), ("end_index", "integer"), ("title", "string")),
        "container_file_citation": (
            ("container_id", "string"),
            ("file_id", "string"),
            ("start_index", "integer"),
            ("end_index", "integer"),
            ("filename", "string"),
        ),
        "file_path": (("file_id", "string"), ("index", "integer")),
    }
)
TOP_LOGPROB_FIELDS: fields.Fields = (("token", "string"), ("logprob", "number"), ("bytes", "array"))
LOGPROB_FIELDS: fields.Fields = (*TOP_LOGPROB_FIELDS, ("top_logprobs", "array"))


def item_keys(item: dict[str, Any], where: str, kind: str) -> None:
    """An input item of type `kind` (one of ITEM_KEYS) holds only that type's keys, its `status`
    (and a message's `phase`) one of OpenAI's values and its `id` a string, each named by its path
    when not. Its content parts (a message's `content`, a function_call_output's `output`) are
    checked by `part_keys`, the fields of an item taken unread (ITEM_FIELDS) by `item_fields`."""
    fields.known_keys(item, where, ITEM_KEYS[kind])
    fields.string(item.get("id"), f"{where}.id")
    statuses = MCP_CALL_STATUSES if kind == "mcp_call" else ITEM_STATUSES
    if kind in ("message", "function_call", "function_call_output", "reasoning", "mcp_call"):
        fields.one_of(item.get("status"), f"{where}.status", statuses)
    if kind == "message":
        fields.one_of(item.get("phase"), f"{where}.phase", MESSAGE_PHASES)
        part_keys(item.get("content"), f"{where}.content")
    elif kind == "function_call_output":
        part_keys(item.get("output"), f"{where}.output")
    elif kind in ITEM_FIELDS:
        item_fields(item, where, kind)


def item_fields(item: dict[str, Any], where: str, kind: str) -> None:
    """The fields of an item this server takes without reading it (ITEM_FIELDS), down to its
    entries (a reasoning item's summary and text parts, an MCP call's error, a listed tool): what
    is not read is still what OpenAI takes, so a client that passes here passes there."""
    fields.shaped(item, where, ITEM_FIELDS[kind])
    if kind == "reasoning":
        fields.each(item["summary"], f"{where}.summary", lambda p, at: fields.typed(p, at, SUMMARY_PARTS))
        fields.each(item.get("content"), f"{where}.content", lambda p, at: fields.typed(p, at, REASONING_PARTS))
    elif kind == "mcp_list_tools":
        fields.each(item["tools"], f"{where}.tools", lambda t, at: fields.shaped(t, at, LISTED_TOOL_FIELDS))
    elif kind == "mcp_call" and item.get("error") is not None:
        fields.typed(item["error"], f"{where}.error", MCP_CALL_ERRORS)


def logprob(value: Any, param: str, *, top: bool = True) -> None:
    """An output_text's `logprobs` entry (OpenAI's `LogProb`: token, logprob, bytes of integers and
    its `top_logprobs`, each a `TopLogProb` of the first three; `top` False), all required."""
    entry = fields.shaped(value, param, LOGPROB_FIELDS if top else TOP_LOGPROB_FIELDS)
    fields.each(entry["bytes"], f"{param}.bytes", lambda b, at: fields.integer(b, at, nullable=False))
    if top:
        fields.each(entry["top_logprobs"], f"{param}.top_logprobs", lambda t, at: logprob(t, at, top=False))


def part_keys(parts: Any, where: str) -> None:
    """Each content part of `parts` (when an array; `parts_of` checks the rest) holds only its
    type's keys (PART_KEYS; an unknown type is refused by `parts_of`), with the values OpenAI takes
    for those `parts_of` leaves unread (an input_file's `detail`, `prompt_cache_breakpoint`, an
    output_text's `annotations` and `logprobs`)."""
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in PART_KEYS:
            continue
        at = f"{where}[{j}]"
        fields.known_keys(part, at, PART_KEYS[kind])
        if kind == "input_file":
            fields.one_of(part.get("detail"), f"{at}.detail", FILE_DETAILS)
        elif kind == "output_text":
            fields.each(part.get("annotations"), f"{at}.annotations", lambda a, p: fields.typed(a, p, ANNOTATIONS))
            fields.each(part.get("logprobs"), f"{at}.logprobs", logprob)
        breakpoint_ = fields.obj(part.get("prompt_cache_breakpoint"), f"{at}.prompt_cache_breakpoint")
        if breakpoint_ is not None:
            fields.known_keys(breakpoint_, f"{at}.prompt_cache_breakpoint", ("mode",))
            mode = fields.required(breakpoint_, "mode", f"{at}.prompt_cache_breakpoint.mode")
            fields.one_of(mode, f"{at}.prompt_cache_breakpoint.mode", CACHE_BREAKPOINT_MODES, nullable=False)


def parse_input(value: Any, response_id: str = "") -> ParsedInput:
    """`response_id`: the response these inputs belong to; their stored ids point back to it (so an
    `item_reference` to one can be resolved)."""
    out = ParsedInput()
    tag = response_id.removeprefix("resp_") or secrets.token_hex(16)

    def item_id(prefix: str) -> str:
        return f"{prefix}_{tag}i{len(out.stored):03d}"

    if isinstance(value, str):
        out.items.append(ViewItem("user", value))
        out.stored.append(
            {
                "id": item_id("msg"),
                "type": "message",
                "role": "user",
                "status": "completed",
                "content": [{"type": "input_text", "text": value}],
            }
        )
        return out
    if not isinstance(value, list):
        raise fields.type_error("input", "one of a string or array of input items", value)
    if not value:
        raise bad_request("'input' is empty: there is nothing to answer", "input", code="missing_input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        fields.obj(item, where, nullable=False)
        kind = item_type(item, where)
        if kind in ITEM_KEYS:
            item_keys(item, where, kind)
        if kind == "message":
            role = fields.one_of(
                fields.required(item, "role", f"{where}.role"), f"{where}.role", INPUT_ROLES, nullable=False
            )
            assert role is not None
            # every message item of the input, not only the new one: content is required (OpenAI)
            content = message_content(item, where)
            text, images, media, ordered = parts_of(content, where, media=role == "user", named=RESPONSES_PARTS)
            if images and role != "user":
                raise no_images(where, role, "input", "input_image")
            # input_items lists every text part as sent (the model gets them as one text: join_texts)
            texts = [p["text"] for p in ordered if p["type"] == "text"] if ordered else [text]
            if role == "assistant":
                out.items.append(ViewItem("assistant", text))
                out.decisions.clear()  # approvals before a later reply are history, not new answers
                out.stored.append(
                    {
                        "id": item_id("msg"),
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": assistant_parts(content),
                    }
                )
            elif role == "user":
                out.items.append(ViewItem("user", text, images, parts=media, content=ordered))
                parts: list[dict[str, Any]] = (
                    ([{"type": "input_text", "text": text}] if text else [])
                    if ordered is None
                    else [_input_part(p) for p in ordered]
                )
                out.stored.append(
                    {"id": item_id("msg"), "type": "message", "role": "user", "status": "completed", "content": parts}
                )
            else:
                # kept in the conversation, and instructs a turn, only with visible text: a blank
                # one is no message (an anthropic upstream refuses blank system text), only listed
                out.items.append(ViewItem("system", text if text.strip() else "", role=role))
                out.stored.append(
                    {
                        "id": item_id("msg"),
                        "type": "message",
                        "role": role,
                        "status": "completed",
                        "content": [{"type": "input_text", "text": t} for t in texts],
                    }
                )
        elif kind == "function_call":
            call_id, name, arguments = (
                fields.string(fields.required(item, key, f"{where}.{key}"), f"{where}.{key}", nullable=False)
                for key in ("call_id", "name", "arguments")
            )
            assert call_id is not None and name is not None and arguments is not None
            out.items.append(ViewItem("assistant", "", calls=[{"id": call_id, "name": name, "arguments": arguments}]))
            out.stored.append(
                {
                    "id": item_id("fc"),
                    "type": "function_call",
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
            out.decisions.clear()
        elif kind == "function_call_output":
            # call_id is optional and nullable in OpenAI's description, but answers nothing without it
            call_id = fields.string(item.get("call_id"), f"{where}.call_id")
            output = fields.required(item, "output", f"{where}.output")
            if not call_id:
                raise bad_request(f"{where}.call_id is required", f"{where}.call_id", code="missing_call_id")
            shown_output: str | list[dict[str, Any]] = output if isinstance(output, str) else ""
            if isinstance(output, list):
                output, images, _, ordered = parts_of(output, where, media=False, named=RESPONSES_PARTS, key="output")
                if images:
                    raise no_images(where, "function_call_output", "input", "input_image")
                # the model gets the parts as one text; input_items lists each as sent
                shown_output = [{"type": "input_text", "text": p["text"]} for p in ordered or () if p["type"] == "text"]
            if not isinstance(output, str):
                raise fields.type_error(f"{where}.output", "one of a string or array of content parts", output)
            out.items.append(ViewItem("tool", output, call_id=call_id))
            out.stored.append(
                {
                    "id": item_id("fco"),
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": shown_output,
                    "status": "completed",
                }
            )
        elif kind == "mcp_approval_response":
            rid = fields.required_string(item, "approval_request_id", f"{where}.approval_request_id")
            approve = fields.boolean(fields.required(item, "approve", f"{where}.approve"), f"{where}.approve")
            if approve is None:
                raise fields.type_error(f"{where}.approve", "a boolean", None)
            reason = fields.string(item.get("reason"), f"{where}.reason")
            call_id = rid[len("mcpr_") :] if rid.startswith("mcpr_") else rid
            out.items.append(ViewItem("approval", "approve" if approve else "deny"))
            out.decisions.append(Decision(call_id, "approve" if approve else "deny", reason=reason, decided_by="http"))
            out.stored.append(
                {
                    "id": item_id("mcpa"),
                    "type": "mcp_approval_response",
                    "request_id": rid,
                    "approval_request_id": rid,
                    "approve": approve,
                    "reason": reason,
                }
            )
        elif kind in SERVER_TOOL_ITEMS:
            out.items.append(ViewItem("assistant", ""))
            out.decisions.clear()
        elif kind in ECHOED_ITEMS:
            continue
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item_reference {fields.shown(item.get('id'))} names no item stored on this server",
                "input",
                code="item_not_found",
            )
        else:
            raise bad_request(
                f"{where}: unsupported input item type {fields.shown(kind)}; "
                f"this server takes {', '.join(SUPPORTED_ITEMS)}",
                "input",
                code="unsupported_item_type",
            )
    return out


def item_type(item: dict[str, Any], where: str) -> str:
    """An input item's type: an item without one (or with a null one, an optional field read as
    not given, as SDKs dump a typeless message) is a message (OpenAI's EasyInputMessage, whose
    role is then required); a `type` given must name one: another JSON type is `invalid_type`, an
    empty string `invalid_value`, both naming `input[i].type`, never read as a message (a
    `function_call_output` so typed would otherwise be refused for its `call_id`)."""
    if item.get("type") is None:
        return "message"
    kind = fields.string(item["type"], f"{where}.type", nullable=False)
    if not kind:
        raise ApiError(
            400,
            f"Invalid value for '{where}.type': ''. Supported values are: {fields.listed(SUPPORTED_ITEMS)}.",
            code="invalid_value",
            param=f"{where}.type",
        )
    return kind


def assistant_parts(content: str | list[Any]) -> list[dict[str, Any]]:
    """An assistant message's content as input_items lists it: each part as sent, in the types an
    assistant message has (OpenAI's `OutputMessage`): a `refusal` a refusal, an `output_text` with
    its `annotations` and `logprobs`, a text part of another type (`input_text`, Chat's `text`) an
    `output_text`. String content is one `output_text`. `parts_of` has checked the parts (an
    assistant message holds text parts only)."""
    if isinstance(content, str):
        return [text_part({}, content)]
    shown: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == "refusal" and "text" not in part:
            shown.append({"type": "refusal", "refusal": part["refusal"]})
            continue
        listed = text_part({}, part["text"])
        if part["type"] == "output_text":
            listed["annotations"] = part.get("annotations") or []
            listed["logprobs"] = part.get("logprobs") or []
        shown.append(listed)
    return shown


def _input_part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part (in the shape providers take) as input_items lists it."""
    if part["type"] == "text":
        return {"type": "input_text", "text": part["text"]}
    if part["type"] == "image_url":
        image = part["image_url"]
        return {"type": "input_image", "image_url": image["url"], "detail": image.get("detail") or "auto"}
    if part["type"] == "file":
        return {"type": "input_file", **part["file"]}
    return dict(part)


async def resolve_references(value: Any, lookup: Any) -> Any:
    """`input` with every `item_reference` replaced by the stored item it names (400 when none is):
    `lookup(id)` returns the item or None."""
    if not isinstance(value, list) or not any(is_reference(i) for i in value):
        return value
    out: list[Any] = []
    for i, item in enumerate(value):
        if is_reference(item):
            fields.known_keys(item, f"input[{i}]", ITEM_KEYS["item_reference"])
            where = f"input[{i}].id"
            ref = fields.string(fields.required(item, "id", where), where, nullable=False)
            found = await lookup(ref) if ref else None
            if found is None:
                raise bad_request(
                    f"input[{i}]: item_reference {fields.shown(ref)} names no item stored on this server "
                    "(for this model)",
                    "input",
                    code="item_not_found",
                )
            out.append(found)
        else:
            out.append(item)
    return out


def is_reference(item: Any) -> bool:
    """An `item_reference` input item: so typed, or (OpenAI's ItemReferenceParam, whose `type` is
    optional) an object of an `id` alone (with a null `type`); one with more keys is no reference:
    without a `type` it is read as the message it would be (and refused for its missing role),
    with a null one refused for that (`item_type`)."""
    if not isinstance(item, dict):
        return False
    if item.get("type") == "item_reference":
        return True
    return "id" in item and item.get("type") is None and set(item) <= {"id", "type"}


INSTRUCTION_ROLES = ("system", "developer")


def message_content(item: dict[str, Any], where: str) -> str | list[Any]:
    """A message item's `content`, which OpenAI requires, as a string or an array of parts: a
    message without it (or with null) is refused naming it, never taken as empty text."""
    content = fields.required(item, "content", f"{where}.content")
    if not isinstance(content, str | list):
        raise fields.type_error(f"{where}.content", "one of a string or array of objects", content)
    return content


def instructions_of(value: Any) -> tuple[str | None, str | list[dict[str, Any]] | None]:
    """(the text for the model, the value the Response object echoes). A string, or (as a Response
    object shows instructions) an array of system/developer messages, echoed as messages."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, value
    if not isinstance(value, list):
        raise fields.type_error("instructions", "a string or an array of system/developer messages", value)
    texts: list[str] = []
    shown: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"instructions[{i}]"
        fields.obj(item, where, nullable=False)
        fields.one_of(item.get("type"), f"{where}.type", ("message",))
        fields.required(item, "role", f"{where}.role")
        fields.one_of(item.get("role"), f"{where}.role", INSTRUCTION_ROLES, nullable=False)
        text, images = content_of(message_content(item, where), where, named=RESPONSES_PARTS)
        if images:
            raise no_images(where, "instructions", "instructions", "input_image")
        texts.append(text)
        shown.append({"type": "message", "role": item["role"], "content": text})
    return "\n\n".join(t for t in texts if t), shown


# The keys of the tools this server takes, as OpenAI's API description has them (`FunctionTool`,
# `MCPTool`, `MCPToolFilter`, the approval filter; a function's `async`: the openai SDK's, newer than
# that description): another key is a 400 `unknown_parameter` naming its path
# (`tools[0].paramters`, a Chat-style nested `tools[0].function`), never dropped.
FUNCTION_TOOL_KEYS = (
    "type",
    "name",
    "description",
    "parameters",
    "strict",
    "output_schema",
    "defer_loading",
    "allowed_callers",
    "async",
)
MCP_TOOL_KEYS = (
    "type",
    "server_label",
    "server_url",
    "connector_id",
    "tunnel_id",
    "authorization",
    "server_description",
    "headers",
    "allowed_tools",
    "allowed_callers",
    "require_approval",
    "defer_loading",
)
MCP_SHOWN_KEYS = tuple(k for k in MCP_TOOL_KEYS if k != "authorization")  # a token is never echoed
MCP_FILTER_KEYS = ("tool_names", "read_only")
APPROVAL_SETTINGS = ("always", "never")
MCP_CONNECTORS = (
    "connector_dropbox",
    "connector_gmail",
    "connector_googlecalendar",
    "connector_googledrive",
    "connector_microsoftteams",
    "connector_outlookcalendar",
    "connector_outlookemail",
    "connector_sharepoint",
)
TUNNEL_ID = re.compile(r"tunnel_[a-z0-9]{32}")
TOOL_CALLERS = ("direct", "programmatic")
FUNCTION_TOOL_ECHOED = ("output_schema", "defer_loading", "allowed_callers")  # the SDK's `async` is no Response field


def function_tools(value: Any, agent: AgentRecord) -> tuple[list[ToolSpec], list[dict[str, Any]]]:
    """Client function tools, and the `mcp` tool that names this agent: it declares nothing new
    (the agent's own tools run here) but lets clients such as the Agents SDK answer its approvals,
    and narrows the agent's tools for the turn (`agent_tool_scope`)."""
    if fields.array(value, "tools") is None:
        return [], []
    specs: list[ToolSpec] = []
    names: set[str] = set()
    shown: list[dict[str, Any]] = []
    for i, t in enumerate(value):
        at = f"tools[{i}]"
        fields.obj(t, at, nullable=False)
        fields.string(fields.required(t, "type", f"{at}.type"), f"{at}.type", nullable=False)
        if t.get("type") == "mcp":
            shown.append(mcp_tool(t, at, agent))
            continue
        if t.get("type") != "function":
            raise bad_request(
                f"{at}: only function tools are supported (the agent's own tools run on the server)",
                "tools",
                code="unsupported_tool",
            )
        fields.known_keys(t, at, FUNCTION_TOOL_KEYS)
        name = fields.function_name(fields.required(t, "name", f"{at}.name"), f"{at}.name")
        fields.obj(t.get("parameters"), f"{at}.parameters")
        fields.string(t.get("description"), f"{at}.description")
        fields.boolean(t.get("strict"), f"{at}.strict")
        fields.obj(t.get("output_schema"), f"{at}.output_schema")
        for key in ("defer_loading", "async"):
            if key in t:
                fields.boolean(t[key], f"{at}.{key}", nullable=False)
        fields.strings(t.get("allowed_callers"), f"{at}.allowed_callers", TOOL_CALLERS)
        if name in names:
            raise bad_request(
                f"{at}: a second function named {fields.shown(name)}; function names must be unique",
                "tools",
                code="duplicate_function_name",
            )
        raw_params = t.get("parameters")
        params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {"type": "object", "properties": {}}
        desc = t.get("description") if isinstance(t.get("description"), str) else None
        strict = t.get("strict")
        names.add(name)
        specs.append(ToolSpec(name, desc or "", params, strict if isinstance(strict, bool) else None))
        shown.append(
            {
                "type": "function",
                "name": name,
                "description": desc,
                "parameters": params,
                "strict": bool(t.get("strict")) if t.get("strict") is not None else None,
                # the fields of OpenAI's FunctionTool taken and not used, echoed when sent
                **{k: t[k] for k in FUNCTION_TOOL_ECHOED if t.get(k) is not None},
            }
        )
    return specs, shown


def mcp_tool(t: dict[str, Any], at: str, agent: AgentRecord) -> dict[str, Any]:
    """An `mcp` tool (at `at`) as the Response object echoes it, each field checked against
    OpenAI's `MCPTool` (a wrong type `invalid_type`, a value outside an enum or pattern
    `invalid_value`, an unknown key `unknown_parameter`, each naming its path): an invalid value
    echoed would make the Response fail OpenAI's schema. It must name this agent."""
    fields.known_keys(t, at, MCP_TOOL_KEYS)
    label = fields.required_string(t, "server_label", f"{at}.server_label")
    for key in ("server_url", "authorization", "server_description"):
        if key in t:
            fields.string(t[key], f"{at}.{key}", nullable=False)
    if "connector_id" in t:
        fields.one_of(t["connector_id"], f"{at}.connector_id", MCP_CONNECTORS, nullable=False)
    if "tunnel_id" in t:
        tunnel = fields.string(t["tunnel_id"], f"{at}.tunnel_id", nullable=False)
        if not TUNNEL_ID.fullmatch(tunnel or ""):
            raise ApiError(
                400,
                f"Invalid '{at}.tunnel_id': {fields.shown(tunnel)} does not match pattern. Expected a string that "
                "matches the pattern '^tunnel_[a-z0-9]{32}$'.",
                code="invalid_value",
                param=f"{at}.tunnel_id",
            )
    if "defer_loading" in t:
        fields.boolean(t["defer_loading"], f"{at}.defer_loading", nullable=False)
    headers = fields.obj(t.get("headers"), f"{at}.headers")
    for key, v in (headers or {}).items():
        fields.string(v, f"{at}.headers.{key}", nullable=False)
    callers = fields.strings(t.get("allowed_callers"), f"{at}.allowed_callers", TOOL_CALLERS)
    if callers == []:
        raise fields.empty_array(f"{at}.allowed_callers")
    allowed = t.get("allowed_tools")
    if isinstance(allowed, dict):
        mcp_filter(allowed, f"{at}.allowed_tools")
    elif allowed is not None and not isinstance(allowed, list):
        raise fields.type_error(f"{at}.allowed_tools", "one of an array of strings or an object", allowed)
    fields.strings(allowed if isinstance(allowed, list) else None, f"{at}.allowed_tools")
    approval = t.get("require_approval")
    if isinstance(approval, dict):
        fields.known_keys(approval, f"{at}.require_approval", APPROVAL_SETTINGS)
        for key in APPROVAL_SETTINGS:
            if key in approval:
                mcp_filter(approval[key], f"{at}.require_approval.{key}")
    elif approval is not None and not isinstance(approval, str):
        raise fields.type_error(f"{at}.require_approval", "one of 'always', 'never' or an object", approval)
    fields.one_of(approval if isinstance(approval, str) else None, f"{at}.require_approval", APPROVAL_SETTINGS)
    if label not in (agent.id, agent.name):
        raise bad_request(
            f"{at}: MCP server {fields.shown(label)} is not this agent; "
            f"its own tools run here under server_label {fields.shown(agent.id)} (or its name, "
            f"{fields.shown(agent.name)})",
            "tools",
            code="unsupported_tool",
        )
    return {k: v for k, v in t.items() if k in MCP_SHOWN_KEYS}


def mcp_filter(value: Any, at: str) -> dict[str, Any]:
    """An `MCPToolFilter` (allowed_tools, or a require_approval's always/never): `tool_names`, an
    array of strings, and `read_only`, a boolean; neither null."""
    flt = fields.obj(value, at, nullable=False)
    assert flt is not None
    fields.known_keys(flt, at, MCP_FILTER_KEYS)
    if "tool_names" in flt:
        fields.array(flt["tool_names"], f"{at}.tool_names", nullable=False)
        fields.strings(flt["tool_names"], f"{at}.tool_names")
    if "read_only" in flt:
        fields.boolean(flt["read_only"], f"{at}.read_only", nullable=False)
    return flt


def filter_takes(flt: Any, tool: Tool) -> bool:
    """Whether an MCP tool filter (checked: `mcp_filter`; a list is allowed_tools' array of names)
    takes `tool`: its name among `tool_names`, and its `read_only` (the tool's own declaration:
    clock is read-only, shell and schedule are not) the filter's, where the filter gives each."""
    if isinstance(flt, list):
        return tool.name in flt
    if not isinstance(flt, dict):
        return False
    named = flt.get("tool_names")
    return (named is None or tool.name in named) and flt.get("read_only") in (None, tool.read_only)


def agent_tool_scope(offered: list[Tool], mcp: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The turn options (loop.OFFERED_TOOLS, loop.ASKED_TOOLS) by which the request's `mcp` tools
    naming this agent narrow the agent's `offered` tools: only those an `allowed_tools` takes are
    offered (every one when a tool gives none), and those `require_approval` asks for (`always`,
    or its `always` filter) are asked about before each call even where the agent's policy is
    `allow`. `never` loosens nothing: the agent's `ask` is its owner's, and stays."""
    if not mcp:
        return {}
    allowed: set[str] = set()
    asked: set[str] = set()
    every = False
    for t in mcp:
        flt = t.get("allowed_tools")
        every = every or flt is None
        taken = [tool for tool in offered if flt is None or filter_takes(flt, tool)]
        allowed.update(tool.name for tool in taken)
        approval = t.get("require_approval")
        asked.update(
            tool.name
            for tool in taken
            if approval == "always" or (isinstance(approval, dict) and filter_takes(approval.get("always"), tool))
        )
    scope: dict[str, list[str]] = {}
    if not every:
        scope[OFFERED_TOOLS] = sorted(allowed)
    if asked:
        scope[ASKED_TOOLS] = sorted(asked)
    return scope


# The top-level fields of OpenAI's Responses create request: the properties of `CreateResponse` and
# of the schemas it composes (allOf) in OpenAI's API description (../shared/conformance; a test
# checks this literal against it). Kept here, not read: the server never reads ../shared.
RESPONSES_FIELDS = frozenset(
    {
        "background",
        "context_management",
        "conversation",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "moderation",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
    }
)
# Fields the openai SDK's `responses.create` sends that that description predates (request-level
# options OpenAI takes): accepted, type-checked, not acted on. `verbosity`: `responses.parse`
# sends it at the top (a string, checked as `text.verbosity` is).
SDK_ONLY_FIELDS = frozenset({"access_programs", "background_options", "image", "verbosity"})
# Chat Completions fields the Responses API spells otherwise: where each one moved.
MOVED_FIELDS = MappingProxyType(
    {
        "messages": "input",
        "response_format": "text.format",
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "reasoning_effort": "reasoning.effort",
    }
)
# Chat Completions fields the Responses API has no counterpart of.
CHAT_ONLY_FIELDS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "modalities",
        "n",
        "prediction",
        "presence_penalty",
        "seed",
        "stop",
        "web_search_options",
    }
)


def refuse_unknown_fields(body: dict[str, Any]) -> None:
    """A field the Responses API does not take is refused as OpenAI refuses it, never dropped: a
    client using a Chat Completions spelling (`response_format`, `max_tokens`, `stop`) would get
    no structured output, token cap or stop sequence without knowing. A Chat field is
    `unsupported_parameter` (saying where it moved), any other `unknown_parameter`."""
    for name in body:
        if name in RESPONSES_FIELDS or name in SDK_ONLY_FIELDS:
            continue
        if name in MOVED_FIELDS:
            raise ApiError(
                400,
                f"Unsupported parameter: '{name}'. In the Responses API, this parameter has moved to "
                f"'{MOVED_FIELDS[name]}'.",
                code="unsupported_parameter",
                param=name,
            )
        if name in CHAT_ONLY_FIELDS:
            raise ApiError(
                400,
                f"Unsupported parameter: '{name}'. The Responses API has no such parameter "
                "(it is a Chat Completions parameter).",
                code="unsupported_parameter",
                param=name,
            )
        raise ApiError(400, f"Unknown parameter: '{name}'.", code="unknown_parameter", param=name)


TRUNCATION = ("auto", "disabled")
INCLUDABLE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
)
REASONING_SUMMARIES = ("auto", "concise", "detailed")
REASONING_CONTEXTS = ("auto", "current_turn", "all_turns")
TEXT_FORMATS = ("text", "json_schema", "json_object")
# The keys of the request's nested objects, as OpenAI's API description has them (`Reasoning`,
# `ResponseTextParam`, the `TextResponseFormatConfiguration` formats, `ResponseStreamOptions`, the
# `ToolChoiceParam` objects this server takes, `ConversationParam`, `ModerationParam`,
# `ContextManagementParam`; `PromptCacheOptionsParam` with the keys the openai SDK adds to it): any
# other key is refused as an unknown top-level field is, never dropped.
REASONING_KEYS = ("effort", "summary", "generate_summary", "context", "mode")
TEXT_KEYS = ("format", "verbosity")
FORMAT_KEYS = MappingProxyType(
    {
        "text": ("type",),
        "json_object": ("type",),
        "json_schema": ("type", "name", "schema", "description", "strict"),
    }
)
STREAM_OPTION_KEYS = ("include_obfuscation",)
CHOICE_KEYS = MappingProxyType(
    {
        "function": ("type", "name"),
        "mcp": ("type", "server_label", "name"),
        "allowed_tools": ("type", "mode", "tools"),
    }
)
CONVERSATION_KEYS = ("id",)
CONTEXT_MANAGEMENT_KEYS = ("type", "compact_threshold")
COMPACT_THRESHOLD_MIN = 1000
PROMPT_CACHE_KEYS = ("ttl", "mode", "prewarm", "comparison_response_id")
PROMPT_CACHE_TTLS = ("30m", "12h")
PROMPT_CACHE_MODES = ("implicit", "explicit")


def response_param_types(body: dict[str, Any]) -> bool:
    """Type checks of the fields not checked where they are used (OpenAI's types and enums; null
    where OpenAI allows it); returns `stream`. `background: true` stays unsupported."""
    refuse_unknown_fields(body)
    shared_param_types(body, (*SERVICE_TIERS, "ultrafast"))
    stream = bool(fields.boolean(body.get("stream"), "stream"))
    if fields.boolean(body.get("background"), "background"):
        raise bad_request("background responses are not supported", "background", code="unsupported_parameter")
    if body.get("prompt") is not None:  # a stored prompt template (OpenAI's dashboard): none here
        raise bad_request(
            "'prompt' (a reusable prompt template) is not supported: this server stores no prompt templates; "
            "send the text as instructions and input",
            "prompt",
            code="unsupported_parameter",
        )
    stream_options = fields.obj(body.get("stream_options"), "stream_options")
    if stream_options is not None:
        fields.known_keys(stream_options, "stream_options", STREAM_OPTION_KEYS)
        if "include_obfuscation" in stream_options:
            fields.boolean(stream_options["include_obfuscation"], "stream_options.include_obfuscation", nullable=False)
    fields.boolean(body.get("parallel_tool_calls"), "parallel_tool_calls")
    fields.one_of(body.get("truncation"), "truncation", TRUNCATION)
    fields.strings(body.get("include"), "include", INCLUDABLE)
    fields.integer(body.get("max_tool_calls"), "max_tool_calls", low=0)
    context_management_of(body.get("context_management"))
    moderation_of(body.get("moderation"))
    prompt_cache_options_of(body.get("prompt_cache_options"))
    for name in ("access_programs", "background_options", "image"):  # the SDK's; OpenAI's document has none
        fields.obj(body.get(name), name)
    fields.one_of(body.get("verbosity"), "verbosity", VERBOSITY)
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        fields.required_string(conversation, "id", "conversation.id")  # a misspelt id is named as missing
        fields.known_keys(conversation, "conversation", CONVERSATION_KEYS)
    choice_keys(body.get("tool_choice"))
    text_of(body.get("text"))
    reasoning_of(body.get("reasoning"))
    return stream


def choice_keys(value: Any) -> None:
    """A `tool_choice` object holds only the keys of its type's shape in the Responses API (the
    function's name beside `type`, not Chat's nested `function`); the values are checked by
    `tool_choice_of`, which knows the tools."""
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] in CHOICE_KEYS:
        fields.known_keys(value, "tool_choice", CHOICE_KEYS[value["type"]])


def context_management_of(value: Any) -> None:
    """`context_management`: entries of a `type` (a string) and a `compact_threshold` (an integer
    of at least 1000, or null). Accepted, not used."""
    entries = fields.array(value, "context_management")
    if entries == []:
        raise fields.empty_array("context_management")
    for i, entry in enumerate(entries or []):
        at = f"context_management[{i}]"
        fields.obj(entry, at, nullable=False)
        fields.known_keys(entry, at, CONTEXT_MANAGEMENT_KEYS)
        fields.required_string(entry, "type", f"{at}.type")
        fields.integer(entry.get("compact_threshold"), f"{at}.compact_threshold", low=COMPACT_THRESHOLD_MIN)


def prompt_cache_options_of(value: Any) -> None:
    """`prompt_cache_options`: `ttl`, `mode`, `prewarm`, `comparison_response_id`. Accepted, not used."""
    options = fields.obj(value, "prompt_cache_options")
    if options is None:
        return
    fields.known_keys(options, "prompt_cache_options", PROMPT_CACHE_KEYS)
    for key, values in (("ttl", PROMPT_CACHE_TTLS), ("mode", PROMPT_CACHE_MODES)):
        if key in options:  # not nullable in OpenAI's description
            fields.one_of(options[key], f"prompt_cache_options.{key}", values, nullable=False)
    if "prewarm" in options:
        fields.boolean(options["prewarm"], "prompt_cache_options.prewarm", nullable=False)
    fields.string(options.get("comparison_response_id"), "prompt_cache_options.comparison_response_id")


INCLUDE_QUERY = re.compile(r"include(?:\[\d*\])?")  # include=, include[]= (the SDKs), include[0]=


def check_include(request: Request) -> None:
    """GET's `include` query parameter is an array of the values POST's `include` takes: one the API
    does not know is refused as POST refuses it (400 `invalid_value`), not ignored."""
    for key, value in request.query_params.multi_items():
        if INCLUDE_QUERY.fullmatch(key):
            fields.one_of(value, "include", INCLUDABLE, nullable=False)


def text_of(value: Any) -> dict[str, Any]:
    """`text` as the Response object echoes it: format (text, json_schema, json_object), verbosity."""
    text = fields.obj(value, "text")
    if text is None:
        return {"format": {"type": "text"}}
    fields.known_keys(text, "text", TEXT_KEYS)
    fmt = fields.obj(text.get("format"), "text.format")
    shown: dict[str, Any] = {"format": {"type": "text"}}
    if fmt is not None:
        fields.one_of(
            fields.required(fmt, "type", "text.format.type"), "text.format.type", TEXT_FORMATS, nullable=False
        )
        fields.known_keys(fmt, "text.format", FORMAT_KEYS[fmt["type"]])
        if fmt["type"] == "json_schema":
            schema_fields(fmt, "text.format")
            if fmt.get("schema") is None:
                raise bad_request(
                    "Missing required parameter: 'text.format.schema'.",
                    "text.format.schema",
                    code="missing_required_parameter",
                )
            # strict always (false when not sent: OpenAI's default); description when sent (OpenAI's
            # document types it a string, so no null stands in for it)
            shown["format"] = {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"]}
            if isinstance(fmt.get("description"), str):
                shown["format"]["description"] = fmt["description"]
            shown["format"]["strict"] = bool(fmt.get("strict"))
        else:
            shown["format"] = {"type": fmt["type"]}
    verbosity = fields.one_of(text.get("verbosity"), "text.verbosity", VERBOSITY)
    if verbosity is not None:
        shown["verbosity"] = verbosity
    return shown


def reasoning_of(value: Any) -> dict[str, Any]:
    """`reasoning` as the Response object echoes it: effort and summary (null when not sent), and
    the other fields of OpenAI's `Reasoning` when sent (`generate_summary`, the deprecated
    spelling of `summary`, `context`, `mode`): what is accepted is echoed, never dropped."""
    reasoning = fields.obj(value, "reasoning")
    if reasoning is None:
        return {"effort": None, "summary": None}
    fields.known_keys(reasoning, "reasoning", REASONING_KEYS)
    effort = fields.one_of(reasoning.get("effort"), "reasoning.effort", REASONING_EFFORTS)
    summary = fields.one_of(reasoning.get("summary"), "reasoning.summary", REASONING_SUMMARIES)
    shown: dict[str, Any] = {"effort": effort, "summary": summary}
    sent = {
        "generate_summary": fields.one_of(
            reasoning.get("generate_summary"), "reasoning.generate_summary", REASONING_SUMMARIES
        ),
        "context": fields.one_of(reasoning.get("context"), "reasoning.context", REASONING_CONTEXTS),
        "mode": fields.string(reasoning.get("mode"), "reasoning.mode"),
    }
    shown.update((k, v) for k, v in sent.items() if v is not None)
    return shown


def response_options(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling and limits (range-checked); tool_choice is checked by the caller, which knows the tools.
    The other fields' types are checked by `response_param_types`."""
    opts: dict[str, Any] = number_options(body, ("max_output_tokens",))
    if isinstance(body.get("parallel_tool_calls"), bool):
        opts["parallel_tool_calls"] = body["parallel_tool_calls"]
    # the server's tool calls its turn may process: the integer the type check took and the Response
    # echoes (1.0 and 1e0 are JSON Schema integers), never only an exact `int`
    cap = fields.integer(body.get("max_tool_calls"), "max_tool_calls", low=0)
    if cap is not None:
        opts[MAX_TOOL_CALLS] = cap
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        opts["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        opts["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
        }
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        opts["response_format"] = {"type": "json_object"}
    return opts


def previous_not_found(prev_id: str) -> ApiError:
    return ApiError(
        404,
        f"Previous response with id '{prev_id}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


def calls_pending(call_ids: list[str]) -> ApiError:
    """New input while the conversation waits for answers: 409 naming what it waits for."""
    return ApiError(
        409,
        f"this conversation is waiting for answers to {', '.join(call_ids)}: send function_call_output "
        "(client tools) or mcp_approval_response (approvals) items for them before new input",
        code="calls_pending",
        param="input",
    )


def calls_pending_at(response_id: str) -> Callable[[list[str]], ApiError]:
    """New input after a response that left calls unanswered, which is no longer its
    conversation's head (a fork): 409 naming the calls, as while its conversation waited. Answered
    later in that conversation or not, they are open at that response, and a fork from it keeps
    them open until this client answers them."""

    def refuse(call_ids: list[str]) -> ApiError:
        return ApiError(
            409,
            f"response {response_id} left the calls {', '.join(call_ids)} unanswered: new input continuing "
            f"from it needs their answers first. Send function_call_output (client tools) or "
            f"mcp_approval_response (approvals) items for them with previous_response_id {response_id}, "
            "then the new input with the id of the response that answers",
            code="calls_pending",
            param="input",
        )

    return refuse


# ---------------------------------------------------------------- rendering


@dataclass(slots=True)
class Shape:
    """Everything of a Response object that does not come from the turn."""

    id: str
    model: str
    agent: AgentRecord
    created_at: int
    instructions: str | None
    tools: list[dict[str, Any]]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, Any]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    parallel_tool_calls: bool
    tool_choice: Any
    conversation: str | None
    reasoning: bool
    # echoed as sent (validated by response_param_types): text, reasoning and the identifiers
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning_params: dict[str, Any] = field(default_factory=lambda: {"effort": None, "summary": None})
    truncation: str = "disabled"
    max_tool_calls: int | None = None
    top_logprobs: int = 0
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    shown_instructions: str | list[dict[str, Any]] | None = None
    service_tier: str = "default"
    # the `server_label` the request named this agent by (its id or its name): its server tool
    # items carry it, as a client (the Agents SDK) finds the MCP tool they belong to by it
    label: str | None = None

    @property
    def server_label(self) -> str:
        return self.label or self.agent.id


def output_blocks(snap: TurnSnapshot, run: TurnRun, steps_note: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(absolute block index, block): calls answered by this request first, then calls of earlier
    requests still waiting, then new blocks, then (a turn stopped at max_steps) a text block saying so."""
    out: list[tuple[int, dict[str, Any]]] = []
    for cid in run.resolved_calls:
        for i, b in enumerate(snap.blocks):
            if b["type"] == "tool_call" and b["call_id"] == cid and not _answered_unrun(snap, b):
                out.append((i, b))
    if snap.status == "awaiting":
        # calls of earlier requests still waiting (some of a round were answered): the client must
        # see what is left to answer, or it would take the response as finished
        waiting = {p["call_id"] for p in snap.pending}
        out.extend(
            (i, b)
            for i, b in enumerate(snap.blocks[: run.base_blocks])
            if b["type"] == "tool_call" and b["call_id"] in waiting and b["call_id"] not in run.resolved_calls
        )
    out.extend(new_blocks(snap, run))
    if steps_note and snap.stop_reason == "max_steps" and snap.status in TERMINAL_STATUSES:
        out.append((len(snap.blocks), {"type": "text", "text": steps_note}))
    return out


def resumed_run(server: Server, rec: ResponseRecord, handle: TurnHandle) -> TurnRun | None:
    """The part of a turn a stored response that answered calls resumed: the calls its input
    answered, and the blocks after them; None when the turn shows none of those calls."""
    approvals: list[str] = []
    answered: set[str] = set()
    for item in rec.input_items:
        if item.get("type") == "mcp_approval_response" and isinstance(item.get("approval_request_id"), str):
            approvals.append(item["approval_request_id"].removeprefix("mcpr_"))
        elif item.get("type") == "function_call_output" and isinstance(item.get("call_id"), str):
            answered.add(item["call_id"])
    answered.update(approvals)
    blocks = handle.controller.snapshot().blocks
    at = [i for i, b in enumerate(blocks) if b["type"] == "tool_call" and b["call_id"] in answered]
    if not at:
        return None
    return TurnRun(server, rec.conversation_id, handle, base_blocks=max(at) + 1, resolved_calls=approvals)


def _answered_unrun(snap: TurnSnapshot, b: dict[str, Any]) -> bool:
    """An answered approval whose call has not run yet (the turn still waits for other answers, or
    is just resuming): neither an open request any more nor an `mcp_call` with a result yet. It is
    shown once it ran, by the response that resumed the turn."""
    return snap.status not in TERMINAL_STATUSES and (
        b.get("status") in ("pending_approval", "streaming") or answered_unrun(b)
    )


def text_part(b: dict[str, Any], text: str) -> dict[str, Any]:
    """A text block's content part: the answer's `output_text`, or the model's `refusal`."""
    if b.get("refusal"):
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_for(
    shape: Shape,
    turn_id: str,
    index: int,
    b: dict[str, Any],
    *,
    final: bool,
    cut: bool = False,
    approvals: Collection[str] = (),
) -> dict[str, Any] | None:
    """`cut`: the item is `incomplete`, not `completed` (`item_cut`: the one the response's early
    end cut off, or a client call of such a response). `approvals`: the agent tool calls that
    went through an approval request: their `mcp_call` names it (`approval_request_id`, the
    `mcpr_…` id the client answered), any other has null there."""
    tag = f"{shape.id.removeprefix('resp_')}{index:04d}"  # points back to the response (item_reference)
    done = "incomplete" if cut else "completed"
    if b["type"] == "text":
        return {
            "id": f"msg_{tag}",
            "type": "message",
            "role": "assistant",
            "status": done if final else "in_progress",
            "content": [text_part(b, b["text"])] if final else [],
        }
    if b["type"] == "reasoning":
        if not shape.reasoning:
            return None
        return {
            "id": f"rs_{tag}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": b["text"]}] if final else [],
            "status": done if final else "in_progress",
        }
    if b["type"] == "tool_call":
        if b.get("executor") == "client":
            return {
                "id": f"fc_{tag}",
                "type": "function_call",
                "call_id": b["call_id"],
                "name": b["name"],
                "arguments": b["arguments"] if final else "",
                # a call of a response that did not complete (cut off by the token limit, say)
                # can never be answered: incomplete, not completed (item_cut)
                "status": done if final else "in_progress",
            }
        if b.get("status") == "pending_approval":
            return {
                "id": f"mcpr_{b['call_id']}",
                "type": "mcp_approval_request",
                "server_label": shape.server_label,
                "name": b["name"],
                "arguments": b["arguments"],
            }
        status = (
            {"completed": "completed", "failed": "failed", "denied": "failed"}.get(str(b.get("status")), "in_progress")
            if final
            else "in_progress"
        )
        failed = final and status == "failed"  # denied, or the tool failed: its output says why
        return {
            "id": f"mcp_{b['call_id']}",
            "type": "mcp_call",
            "server_label": shape.server_label,
            "name": b["name"],
            "arguments": b["arguments"] if final else "",
            "output": b.get("output") if final and not failed else None,
            "error": {
                "type": "mcp_tool_execution_error",
                "content": [{"type": "text", "text": b.get("output") or f"the call was {b.get('status')}"}],
            }
            if failed
            else None,
            "status": status,
            "approval_request_id": f"mcpr_{b['call_id']}" if b["call_id"] in approvals else None,
        }
    return None  # compaction blocks are not output


def item_cut(ended: bool, pos: int, count: int, b: dict[str, Any]) -> bool:
    """Whether the item of block `b`, at `pos` of the response's `count` output blocks, is
    `incomplete`: of a response that `ended` without completing (the token limit, max_steps, the
    content filter, a cancel, a failure), the last one (being written when it stopped, or the
    max_steps note), and every client call, which can never be answered now. An item finished
    before that stays `completed`, as its `response.output_item.done` said when it streamed: the
    stream, the final response and `GET` agree on every item's status."""
    if not ended:
        return False
    return pos + 1 == count or (b["type"] == "tool_call" and b.get("executor") == "client")


def usage_of(snap: TurnSnapshot | None, base: dict[str, int] | None = None) -> dict[str, Any]:
    """The usage of this request's model calls (`base`: the turn's when the request resumed it)."""
    u = request_usage(snap.usage if snap is not None else None, base)
    i, o = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
    return {
        "input_tokens": i,
        "input_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0)), "cache_write_tokens": 0},
        "output_tokens": o,
        "output_tokens_details": {"reasoning_tokens": int(u.get("reasoning_tokens", 0))},
        "total_tokens": i + o,
    }


def response_body(
    shape: Shape,
    *,
    status: str,
    output: list[dict[str, Any]],
    snap: TurnSnapshot | None,
    failed: ApiError | None = None,
    base_usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`failed`: the error of a failed turn as the route worded it (`turn_error`), else from the
    snapshot's error. `base_usage`: the turn's usage when this request resumed it (`TurnRun`)."""
    error = None
    incomplete = None
    if snap is not None and failed_answer(snap):
        # Response.error.code is a closed enum: the specific reason travels in the message.
        failed = failed or turn_failure(snap.error)
        code = (
            "rate_limit_exceeded"
            if failed.status == 429
            else "invalid_prompt"
            if failed.status == 400
            else "server_error"
        )
        error = {"code": code, "message": f"{failed.message} [{failed.code}]"}
    elif snap is not None and snap.status == "cancelled" and (snap.error or {}).get("kind") == "withdrawn":
        error = withdrawn_error(snap.error or {})  # why its input is nowhere in the conversation
    if status == "incomplete":
        # OpenAI's schema allows only max_output_tokens and content_filter here; a max_steps stop
        # says what happened in the text block output_blocks adds (docs/openai.md).
        filtered = snap is not None and snap.stop_reason == "content_filter"
        incomplete = {"reason": "content_filter" if filtered else "max_output_tokens"}
    body: dict[str, Any] = {
        "id": shape.id,
        "object": "response",
        "created_at": shape.created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "incomplete_details": incomplete,
        "model": shape.model,
        "previous_response_id": shape.previous_response_id,
        "instructions": shape.shown_instructions,
        "output": output,
        "error": error,
        "tools": shape.tools,
        "tool_choice": shape.tool_choice,
        "truncation": shape.truncation,
        "parallel_tool_calls": shape.parallel_tool_calls,
        "text": shape.text,
        "top_p": shape.top_p,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": shape.top_logprobs,
        "temperature": shape.temperature,
        "reasoning": shape.reasoning_params,
        "usage": usage_of(snap, base_usage),
        "max_output_tokens": shape.max_output_tokens,
        "max_tool_calls": shape.max_tool_calls,
        "store": shape.store,
        "background": False,
        "service_tier": shape.service_tier,
        "metadata": shape.metadata,
        "safety_identifier": shape.safety_identifier,
        "prompt_cache_key": shape.prompt_cache_key,
        "prompt_cache_retention": shape.prompt_cache_retention,
    }
    if shape.user is not None:  # Response.user is a string (not nullable): present when sent
        body["user"] = shape.user
    if shape.conversation:
        body["conversation"] = {"id": shape.conversation}
    return body


def final_status(snap: TurnSnapshot) -> str:
    if failed_answer(snap):  # an interrupted turn too: nobody cancelled it
        return "failed"
    if snap.status == "cancelled":
        return "cancelled"
    if snap.stop_reason in ("max_tokens", "max_steps", "content_filter"):
        return "incomplete"
    return "completed"


# ---------------------------------------------------------------- the routes


class Responses:
    def __init__(
        self,
        server: Server,
        metrics: Metrics,
        matcher: ConversationMatcher,
        places: TurnPlaces,
        stopping: Stopping | None = None,
    ) -> None:
        self.server = server
        self.metrics = metrics
        self.places = places  # the open-turn count the WebSocket's turns take places in too
        self.matcher = matcher
        self.stopping = stopping or Stopping()  # the server's stop ends a waiting stream with an error
        # ids of the responses whose stream in this process stored them in progress and will store
        # how they end (`as_ended` leaves them to it)
        self.live: set[str] = set()

    async def as_ended(self, rec: ResponseRecord) -> ResponseRecord:
        """`rec`, or, when its stream stored it in progress (`response.created`) and can no longer
        store how it ended (the server was killed, or restarted while the turn waited in the queue),
        `rec` as its turn ended, whatever that was: rendered from the turn in the store, and kept so.
        A turn interrupted by the crash answers `failed`, as a server stop's stream ends, with the
        text it kept as its (incomplete) output, and a response continuing from it goes on after
        that turn's messages, as from any other."""
        stopped = stopped_early(rec)
        if (rec.body.get("status") != "in_progress" and not stopped) or rec.turn_id is None or rec.id in self.live:
            return rec  # done, or its stream (in this process) stores the outcome itself
        store = self.server.store
        turn = await store.get_turn(rec.turn_id)
        if turn is not None and turn.status in ON_ITS_WAY:
            return rec  # still on its way (a queued turn requeued at the restart, say)
        agent = await store.get_agent(rec.agent_id)
        if turn is None or agent is None:
            return replace(rec, turn_id=None) if stopped else cut_short(rec)
        handle = await self.server.kernel.handle_for(turn)
        snap = handle.controller.snapshot()
        if snap.status not in TERMINAL_STATUSES and snap.status != "awaiting":
            if stopped:
                return rec
            return cut_short(rec)  # an end this route does not know how to show: never in progress
        shape = shape_of(rec.body, agent)
        # The request's own blocks are the turn's from its start when it sent new input; a request
        # that answered calls resumed a turn whose earlier blocks are not its output: its own are
        # the calls it answered and what followed them.
        fresh = any(i.get("type") == "message" and i.get("role") == "user" for i in rec.input_items)
        run = TurnRun(self.server, rec.conversation_id, handle) if fresh else resumed_run(self.server, rec, handle)
        cut = final_status(snap) != "completed"
        steps_note = max_steps_note(self.server, agent)
        if run is not None:
            blocks = output_blocks(snap, run, steps_note)
            # every call its turn asked approval for (an approval request a stopped stream showed too)
            asked = {p.call_id for p in await store.list_pending(turn.id) if p.kind == "approval"}
            approvals = asked | set(run.resolved_calls)
            items = (
                item_for(shape, turn.id, n, b, final=True, cut=item_cut(cut, pos, len(blocks), b), approvals=approvals)
                for pos, (n, b) in enumerate(blocks)
            )
            output = [i for i in items if i is not None]
        else:
            output = list(rec.body.get("output") or [])
        failed = await turn_error(self.server, agent.id, snap.error) if failed_answer(snap) else None
        body = response_body(
            shape,
            status=final_status(snap),
            output=output,
            snap=snap,
            failed=failed,
            base_usage=run.base_usage if run is not None else None,
        )
        if body["completed_at"] is not None and turn.ended_at:
            body["completed_at"] = int(turn.ended_at)
        if stopped:  # ended as its response.failed event said; only its output is the turn's
            body = dict(rec.body, output=output, usage=body["usage"])
        own = [m.id for m in await store.list_messages(rec.conversation_id) if m.turn_id == turn.id and m.id]
        ended = replace(rec, body=body, last_message_id=max([rec.last_message_id, *own]))
        if stopped:
            ended = replace(ended, turn_id=None)  # settled: nothing more to take from its turn
        if await store.get_response(rec.id) is not None:  # deleted meanwhile: it stays deleted
            try:
                await store.save_response(ended)
                await self.index_items(ended)
            except Exception as exc:  # answered all the same; the next read renders it again
                log.warning("could not store the ended response %s: %r", rec.id, exc)
        return ended

    async def index_items(self, rec: ResponseRecord) -> None:
        """Make the server tool items of `rec`'s output (ids built from their call id, which cannot
        name the response: `mcp_…`, `mcpr_…`) resolvable by an `item_reference`: each gets an index
        record listing the responses that hold it (`item_index_id`). Best effort: a failure is
        logged, the response stays stored (its other items resolve as ever)."""
        store = self.server.store
        for item in rec.body.get("output") or []:
            item_id = item.get("id") if isinstance(item, dict) else None
            if not isinstance(item_id, str) or REFERENCE_ID.match(item_id):
                continue
            key = item_index_id(rec.agent_id, item_id)
            try:
                index = await store.get_response(key)
                listed = [str(r) for r in index.body.get("responses") or []] if index is not None else []
                if rec.id in listed:
                    continue
                listed = [*listed, rec.id][-ITEM_INDEX_MAX:]
                await store.save_response(
                    ResponseRecord(
                        id=key,
                        agent_id=rec.agent_id,
                        conversation_id=rec.conversation_id,
                        body={"object": "item_index", "item_id": item_id, "responses": listed},
                        stored=False,
                    )
                )
            except Exception as exc:
                log.warning("could not index item %s of response %s: %r", item_id, rec.id, exc)

    async def _stored(self, request: Request) -> ResponseRecord:
        """The response the path names, for a caller it is for. Whose it is is read first without
        its body (`get_response_owner`): another credential's response is refused as fast as an
        unknown id, so the time of the 404 tells neither that it exists nor how large it is."""
        rid = request.path_params["response_id"]
        store = self.server.store
        principal = principal_of(request)
        not_found = ApiError(404, f"No response found with id '{rid}'.", code="response_not_found", param="response_id")
        owner = await store.get_response_owner(rid)
        conv = await store.get_conversation(owner.conversation_id) if owner is not None else None
        # a stored response belongs to its conversation's namespace (the one rule: namespace_allows)
        if owner is None or conv is None or not namespace_allows(conversation_namespace(principal), conv.namespace):
            raise not_found
        agent = await store.get_agent(owner.agent_id)
        if agent is None or not principal.allows_agent(agent.id, agent.name):
            raise not_found
        rec = await store.get_response(rid)
        if rec is None or not rec.stored:  # an item index, a response kept with store false, or deleted since
            raise not_found
        return await self.as_ended(rec)

    async def get(self, request: Request) -> Response:
        rec = await self._stored(request)  # an unknown id is a 404 whatever else the request asks
        check_include(request)
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise bad_request("'stream' must be true or false", "stream", code="invalid_value")
        if stream == "true":
            # OpenAI streams a background response's events on retrieve; this server runs none
            # (`background` is refused): an empty event stream would look like success
            raise bad_request(
                "stream=true on retrieve follows a background response, and this server runs no background "
                "responses (each one streams in the request that created it): retrieve it without stream",
                "stream",
                code="unsupported_parameter",
            )
        return json_response(rec.body, headers={HEADER: rec.conversation_id})

    async def delete(self, request: Request) -> Response:
        rec = await self._stored(request)
        deleted = await self.server.store.delete_response(rec.id)
        await forget_answers_of(self.server, rec.conversation_id, rec.id)
        if not deleted:  # another DELETE (on this server or another) took it since it was read
            raise ApiError(
                404, f"No response found with id '{rec.id}'.", code="response_not_found", param="response_id"
            )
        return json_response({"id": rec.id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        """POST /v1/responses/{id}/cancel: OpenAI cancels background responses only, and this server
        runs none (`background` is refused): a stored response is answered as OpenAI answers a
        synchronous one (400), an unknown one 404 as GET (same credential and agent rules)."""
        rec = await self._stored(request)
        raise ApiError(
            400,
            f"Only responses created with background=true can be cancelled; response '{rec.id}' was not "
            "(this server runs no background responses: a response's turn is cancelled by its client "
            "disconnecting, or from another front end)",
            param="response_id",
        )

    async def input_items(self, request: Request) -> Response:
        rec = await self._stored(request)
        check_include(request)
        items = list(rec.input_items)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be asc or desc", "order", code="invalid_value")
        if order == "desc":
            items.reverse()
        after = request.query_params.get("after")
        if after:
            ids = [i.get("id") for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        raw_limit = request.query_params.get("limit", "20")
        # ASCII digits only: int() also reads "١٠", " 5 " and "1_0"
        if not (raw_limit.isascii() and raw_limit.lstrip("-").isdigit()) or len(raw_limit) > 12:
            raise bad_request("'limit' must be an integer", "limit", code="invalid_type")
        limit = int(raw_limit)
        if not 1 <= limit <= 100:
            raise bad_request(
                f"Invalid 'limit': {limit}; use 1 to 100",
                "limit",
                code="integer_below_min_value" if limit < 1 else "integer_above_max_value",
            )
        page = items[:limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else "",
                "last_id": page[-1]["id"] if page else "",
                "has_more": len(items) > limit,
            }
        )

    async def post(self, request: Request) -> Response:
        principal = principal_of(request)
        ns = conversation_namespace(principal)
        body, _ = await read_json(request)
        # a read, which may wait for the writer (a lock held elsewhere): a revoke meanwhile ends it
        agent, model_id = await until_credential_ends(request, resolve_model(self.server, principal, body.get("model")))
        stream = response_param_types(body)
        store_flag = fields.boolean(body.get("store"), "store")
        store_flag = True if store_flag is None else store_flag
        if body.get("input") is None:
            raise bad_request("'input' is required", "input", code="missing_input")
        if body.get("stream_options") is not None and not stream:
            raise bad_request(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
                code="invalid_stream_options",
            )
        prev_id = body.get("previous_response_id")
        response_id = _id("resp")
        raw_input = await resolve_references(body.get("input"), lambda ref: self._stored_item(agent, ns, ref, prev_id))
        parsed = parse_input(raw_input, response_id)
        instructions, shown_instructions = instructions_of(body.get("instructions"))
        specs, shown_tools = function_tools(body.get("tools"), agent)
        options = response_options(body)
        scope = agent_tool_scope(self.server.tools.offered(agent), [t for t in shown_tools if t["type"] == "mcp"])
        options.update(scope)
        # an agent tool its mcp tool's allowed_tools leaves out is not offered: no choice names it
        own = own_tool_names(self.server, agent, specs)
        hidden = own - set(scope.get(OFFERED_TOOLS, own))
        choice = tool_choice_of(
            body.get("tool_choice"), tool_names(self.server, agent, specs) - hidden, agent, own - hidden
        )
        if choice is not None:
            options["tool_choice"] = choice
        user, metadata = user_and_metadata(body)
        conv_param = body.get("conversation")
        if isinstance(conv_param, dict):
            conv_param = fields.required_string(conv_param, "id", "conversation.id")
        if conv_param == "":  # names no conversation, as an unknown id does (not "start a new one")
            raise ApiError(
                404, "Conversation with id '' not found.", code="conversation_not_found", param="conversation"
            )
        fields.string(prev_id, "previous_response_id")
        if prev_id is not None and not prev_id.strip():  # names no response (not "none"), as a blank id
            raise previous_not_found(prev_id)
        if conv_param is not None and not isinstance(conv_param, str):
            raise fields.type_error("conversation", "one of a string or object", conv_param)
        if prev_id and conv_param:
            raise bad_request(
                "use either previous_response_id or conversation, not both",
                "conversation",
                code="conflicting_parameters",
            )

        whole = merge_assistants(parsed.items)  # system items kept, whatever the agent matches on
        items = merge_assistants(for_agent(parsed.items, agent))
        check_call_ids(items, "input")
        prefix, new = split_new_input(items)
        whole_prefix, whole_new = split_new_input(whole)
        stateful = bool(prev_id or conv_param)  # continues server state: not the whole transcript
        if not stateful and not parsed.decisions:  # a whole transcript's tool round before new user input
            prefix, new = split_after_results(prefix, new, "input")  # is history, not answers (OpenAI reads it so)
            whole_prefix, whole_new = split_after_results(whole_prefix, whole_new, "input")
        added = history_to_add(whole_prefix) if stateful else []
        users = [i for i in new if i.kind == "user"]
        results = [i for i in new if i.kind == "tool"]
        decisions = [Decision(r.call_id or "", "result", output=r.text) for r in results] + parsed.decisions
        # System/developer items of `input` are kept in the conversation, in their place: those of
        # the new input with its turn (before its user message), those of earlier input seeded
        # with it (`added`, a new conversation's history). A request continuing server state sees
        # them there, and those the conversation kept before. One that sends its whole transcript
        # (neither previous_response_id nor conversation) has them instruct its turn after
        # `instructions`, as a chat request's do, and sees none the conversation kept (OWN_SYSTEM);
        # so does one answering calls (its answers resume a turn, no new one keeps them).
        kept_system = [i for i in whole_new if i.kind == "system" and i.text] if users else []
        if stateful and users and not added:  # earlier system items with nothing else to add: the turn's
            kept_system = [i for i in whole_prefix if i.kind == "system" and i.text] + kept_system
        told = [] if stateful and users else [i.text for i in parsed.items if i.kind == "system" and i.text]
        if instructions or told:
            options["instructions"] = ([instructions] if instructions else []) + told
        if not stateful:
            options[OWN_SYSTEM] = True
        if not users and not decisions:
            raise bad_request(
                "the input has no new user message, function_call_output or mcp_approval_response",
                "input",
                code="missing_input",
            )
        content = new_content(users)  # computed once: checked here, submitted below
        if users and blank_input(content):  # the kernel's rule, before anything is placed
            raise bad_request("the new user input is empty: there is nothing to answer", "input", code="missing_input")
        if users and decisions:
            raise bad_request(
                "send tool results (or approval answers) and new user input in separate requests",
                "input",
                code="mixed_input",
            )
        unanswered = unanswered_calls(items, answering=not users)
        if unanswered:  # OpenAI's refusal of a call left without its output
            raise bad_request(
                f"No tool output found for function call {', '.join(unanswered)}.",
                "input",
                code="tool_calls_unanswered",
            )
        if added and (decisions or conv_param):
            # never dropped silently: a stored conversation takes new input at its end only
            raise bad_request(
                "earlier messages cannot be added to a stored conversation ahead of "
                + ("tool results or approval answers" if decisions else "the new input (with 'conversation')")
                + ": send only the new input, or use previous_response_id with the messages and a new user message",
                "input",
                code="unsupported_input",
            )
        # every user message's parts, the history's too: a part seeded into a conversation reaches
        # the model as much as the new input's
        check_media(self.server, agent, [p for u in items if u.kind == "user" for p in u.parts], "input")
        check_format(self.server, agent, options.get("response_format"), "text.format")
        answers = (
            Answers([d.call_id for d in decisions], turn_tools(specs), options, "input", given=decisions)
            if decisions and not users
            else None
        )

        idem, replay = await Idempotency.begin(self.server, request, principal, "responses", body)
        if replay is not None:
            return replay
        place: Placement | None = None
        seat = TurnSeat(self.places, principal)  # the turn's open-turn place, held until it ends
        if answers is not None:  # a fork or seeded history paused for them: past the cap, refused unwritten
            answers.before_write = seat.admit_written
        try:
            # A request answering calls follows the turn its answers resumed (its key is filed under
            # it: `keep_answers_key`), from after those calls.
            earlier, key = (
                await idem.earlier(
                    [d.call_id for d in decisions], [d.call_id for d in decisions if d.action in ("approve", "deny")]
                )
                if idem is not None
                else (None, None)
            )
            if earlier is not None:
                run = earlier  # this key's turn, accepted before the server stopped: follow it
            else:
                seat.take(options, answering=not users)  # past the cap: 429 before anything is written
                # a keyed repeat of a turn that answered nothing, naming no conversation: re-run where it ran
                rerun = None if conv_param else rerun_unnamed(key, request.headers.get(HEADER))
                place = await until_credential_ends(  # a credential revoked while the store keeps it waiting: 401
                    request,
                    self._place(
                        agent,
                        ns,
                        request,
                        prev_id,
                        conv_param,
                        prefix,
                        user,
                        metadata,
                        answers,
                        added,
                        whole_prefix,
                        rerun=rerun,
                    ),
                )
                head = place
                resumed, lost = await self._answer_head(head, prev_id, decisions, answer_settings(options, specs), key)
                if lost:
                    place = await self._fork_lost(agent, ns, head, prev_id, answers)
                # answers to calls the conversation's history closed: a 400 `already_resolved`
                # (`refuse_closed_calls`), as on chat
                run = resumed or await start_turn(
                    self.server,
                    agent,
                    place.conversation_id,
                    content=content,
                    system=[{"role": i.role or "system", "text": i.text} for i in kept_system],
                    decisions=decisions,
                    client_tools=specs,
                    options=options,
                    source={"kind": "openai_responses"},
                    while_pending=calls_pending,
                    idempotency=key,
                    request=request,  # a credential revoked while the accept waits ends it (401)
                )
                seat.settle(run)
        except BaseException:
            seat.settle(None)
            if idem is not None:
                await idem.abandon()
            raise
        finally:
            self.matcher.release(place)  # the turn is queued: the runtime now shows it
        # the sampling the turn's model calls get (the agent's params, the request's where they may
        # win), as its provider sends them
        sent = model_call_params(self.server.providers, agent, await self._turn_options(run, options, bool(decisions)))
        shape = Shape(
            id=response_id,
            model=model_id,
            agent=agent,
            created_at=int(time.time()),
            instructions=instructions,
            tools=shown_tools,
            previous_response_id=prev_id,
            store=store_flag,
            metadata={str(k): str(v) for k, v in metadata.items()},
            temperature=float(sent.get("temperature", 1.0)),
            top_p=float(sent.get("top_p", 1.0)),
            max_output_tokens=sent.get("max_tokens"),
            parallel_tool_calls=bool(options.get("parallel_tool_calls", True)),
            # a forced choice the provider cannot send (anthropic with thinking) goes as `auto`
            tool_choice=echoed_choice(body.get("tool_choice"), sent.get("tool_choice")),
            conversation=run.conversation_id if conv_param else None,
            reasoning=show_reasoning(agent),
            text=text_of(body.get("text")),
            reasoning_params=dict(reasoning_of(body.get("reasoning")), effort=sent.get("reasoning_effort")),
            truncation=body.get("truncation") or "disabled",
            max_tool_calls=fields.integer(body.get("max_tool_calls"), "max_tool_calls"),
            top_logprobs=fields.integer(body.get("top_logprobs"), "top_logprobs") or 0,
            user=user,
            safety_identifier=body.get("safety_identifier"),
            prompt_cache_key=body.get("prompt_cache_key"),
            prompt_cache_retention=body.get("prompt_cache_retention"),
            shown_instructions=shown_instructions,
            label=label_of(shown_tools, body.get("tool_choice")),
        )
        # A history point is the hash of the whole transcript a client holds: only a request that sent
        # the whole history has it. With previous_response_id or conversation the input is only the
        # new part, and a point made from it would let a stateless request with that little history
        # continue a conversation holding context it never saw.
        point_base = None if prev_id or conv_param else chain(new, chain(prefix))
        ctx = _Run(self, shape, run, idem, parsed, point_base)
        if stream:
            return ctx.stream_response(request)
        return await ctx.complete(request)

    async def _turn_options(self, run: TurnRun, options: dict[str, Any], resumed: bool) -> dict[str, Any]:
        """The options the turn's model calls get: this request's for a turn it started; for a
        paused turn it answered, the turn's as stored, which its answers replaced with this
        request's (`answer_settings`; the kernel keeps only its own entries), or which it left
        unchanged when it brought nothing new to answer."""
        turn = await self.server.store.get_turn(run.turn_id) if resumed else None
        return turn.options if turn is not None else options

    async def _answer_head(
        self,
        place: Placement,
        prev_id: str | None,
        decisions: list[Decision],
        settings: TurnSettings,
        idempotency: tuple[str, str] | None = None,
    ) -> tuple[TurnRun | None, bool]:
        """The paused turn `place` continues (at `prev_id`), resumed with the answers it has not
        yet and the request's `settings` for its model calls after them (common.answer_paused):
        (the run, False). (None, True) when other requests answered
        all of its round first, so that its turn moved on while `place` continued its conversation:
        answering again forks from `prev_id`, as the second of two requests racing on one server
        does (docs/openai.md "Racing requests"). (None, False): start_turn answers as ever."""
        turn_id = await self._paused_turn(place, prev_id, decisions)
        if not turn_id:
            return None, False
        resumed = await answer_paused(self.server, place.conversation_id, turn_id, decisions, settings, idempotency)
        if resumed is not None:
            return resumed, False
        return None, await round_answered(self.server, turn_id, decisions)

    async def _paused_turn(self, place: Placement, prev_id: str | None, decisions: list[Decision]) -> str | None:
        """The turn of `prev_id`, which made the calls `decisions` answer, when `place` continues it."""
        if place.how != "previous_response" or not decisions or prev_id is None:
            return None
        rec = await self.server.store.get_response(prev_id)
        return rec.turn_id if rec is not None else None

    async def _fork_lost(
        self, agent: AgentRecord, ns: str | None, head: Placement, prev_id: str | None, answers: Answers | None
    ) -> Placement:
        """The fork from `prev_id` a request answering its calls goes to once another request
        continued its conversation first (see `_answer_head`); the head's claim is given up."""
        self.matcher.release(head)
        rec = await self.server.store.get_response(prev_id or "")
        if rec is None:  # placed at it a moment ago: deleted since
            raise previous_not_found(prev_id or "")
        fork = await self.matcher.fork_at(
            agent,
            ns,
            rec.conversation_id,
            rec.last_message_id,
            answers,
            while_pending=calls_pending_at(prev_id or ""),
            shown=shown_round(rec),
        )
        return Placement(fork, "fork", claimed=True)

    async def _stored_item(self, agent: AgentRecord, ns: str | None, ref: str, prev_id: Any) -> dict[str, Any] | None:
        """The stored item an `item_reference` names: found in the response its id points back to
        (`msg_<response hex>…`), else along the previous_response_id chain; of this agent only."""
        store = self.server.store
        candidates: list[str] = []
        m = REFERENCE_ID.match(ref)
        if m:
            candidates.append(f"resp_{m.group(1)}")
        else:  # a server tool item (mcp_/mcpr_ + call id): the responses its index lists, latest first
            index = await store.get_response(item_index_id(agent.id, ref))
            if index is not None and not index.stored and index.agent_id == agent.id:
                candidates.extend(str(r) for r in reversed(index.body.get("responses") or []))
        # An approval request a stream showed before the server's stop interrupted its turn: after
        # the restart its response shows the call as the turn kept it (a failed `mcp_call`), which
        # the reference then names (both are empty assistant history alike).
        called = f"mcp_{ref.removeprefix('mcpr_')}" if ref.startswith("mcpr_") else None
        seen = 0
        rid = prev_id if isinstance(prev_id, str) else None
        while rid and seen < 50:  # the chain's links, read without bodies (get_response_owner)
            candidates.append(rid)
            link = await store.get_response_owner(rid)
            rid = link.previous_response_id if link is not None else None
            seen += 1
        for rid in candidates:
            if not await self._visible_response(rid, agent, ns):
                continue  # another credential's: its body is never read
            rec = await store.get_response(rid)
            if rec is None or not rec.stored or rec.agent_id != agent.id:
                continue
            for item in [*rec.input_items, *(rec.body.get("output") or [])]:
                if isinstance(item, dict) and item.get("id") == ref:
                    return dict(item)
            if called is not None and rec.body.get("status") == "failed":
                for item in rec.body.get("output") or []:
                    if isinstance(item, dict) and item.get("id") == called and item.get("type") == "mcp_call":
                        return dict(item)
        return None

    async def _visible_response(self, rid: str, agent: AgentRecord, ns: str | None) -> bool:
        """Response `rid` is in a conversation of `agent` namespace `ns` sees: checked on a read
        without its body, before the body is read (a refusal takes as long whatever it refuses)."""
        owner = await self.server.store.get_response_owner(rid)
        if owner is None:
            return False
        conv = await self.server.store.get_conversation(owner.conversation_id)
        return conv is not None and self.matcher.visible(conv, agent, ns)

    async def _previous(self, prev_id: str, ns: str | None, principal: Principal) -> ResponseRecord | None:
        """The stored response `previous_response_id` names, if the caller may continue it: whose it
        is first (`_readable_response`: another credential's body is never read); None for an
        item index (item_index_id) or a response kept with store false, as for an unknown id."""
        readable = await self._readable_response(prev_id, ns, principal)
        rec = await self.server.store.get_response(prev_id) if readable else None
        return rec if rec is not None and rec.stored else None

    async def _readable_response(self, rid: str, ns: str | None, principal: Principal) -> bool:
        """Response `rid` is one this caller may GET (its namespace, an agent its credential may
        use), of whichever agent: previous_response_id continues any of them, as on OpenAI, where
        any model continues any response (an Agents SDK handoff). Checked without its body, before
        the body is read (a refusal takes as long whatever it refuses)."""
        store = self.server.store
        owner = await store.get_response_owner(rid)
        conv = await store.get_conversation(owner.conversation_id) if owner is not None else None
        if conv is None or not namespace_allows(ns, conv.namespace):
            return False
        source = await store.get_agent(conv.agent_id)
        return source is not None and principal.allows_agent(source.id, source.name)

    async def _model_of(self, agent_id: str) -> str:
        """The id GET /v1/models advertises for agent `agent_id` (the `model` that reaches it)."""
        agents = await self.server.store.agents_to_read()
        return advertised_ids(agents).get(agent_id, agent_id)

    async def _refuse_foreign_approvals(self, rec: ResponseRecord, answers: Answers | None) -> None:
        """Answers to another agent's response that asks for approvals are refused (400): its
        calls are that agent's tools, run under that agent's policy; only the agent that asked
        may run or deny them (a fork answering its client calls alone would leave them open to
        this agent). Tool results (a handoff's function_call_output) are the client's and go on."""
        if answers is None:
            return  # new input after open calls: 409 calls_pending, as for the agent's own fork
        asks = _call_ids(rec.body.get("output"), ("mcp_approval_request",))
        if not asks and all(d.action == "result" for d in answers.given):
            return
        model = await self._model_of(rec.agent_id)
        raise bad_request(
            f"Previous response with id '{rec.id}' is of model '{model}', and its approval requests are that "
            f"model's to answer (its tools run under its policy): send the mcp_approval_response items with model "
            f"'{model}', then continue from that response with this model.",
            "input",
            code="unsupported_input",
        )

    async def _refuse_other_agents(
        self, agent_id: str, conv_param: str, agent: AgentRecord, principal: Principal
    ) -> None:
        """A conversation of another agent the caller may use is a 400 naming that agent's model (a
        conversation is continued by its own agent, DESIGN §5), and saying how to hand it over:
        previous_response_id forks its history for this agent. One it may not use stays a 404."""
        source = await self.server.store.get_agent(agent_id)
        if source is None or not principal.allows_agent(source.id, source.name):
            return
        model, own = await self._model_of(source.id), await self._model_of(agent.id)
        raise bad_request(
            f"Conversation with id '{conv_param}' belongs to model '{model}': a conversation is continued by its "
            f"own model. Send model '{model}' with it; or, to hand it to model '{own}', continue from its last "
            "response with previous_response_id (its history is forked into a new conversation of that model), "
            "or send the history as input without 'conversation'.",
            "conversation",
            code="conversation_model_mismatch",
        )

    async def _withdrawn(self, rec: ResponseRecord) -> bool:
        """`rec` is a withdrawn turn's response: stored so (`is_withdrawn`), or stored `cancelled`
        before its turn's end was known (a stream that gave up waiting) by a turn withdrawn."""
        if is_withdrawn(rec):
            return True
        if rec.body.get("status") != "cancelled" or rec.turn_id is None:
            return False
        turn = await self.server.store.get_turn(rec.turn_id)
        return turn is not None and turn.status == "cancelled" and (turn.error or {}).get("kind") == "withdrawn"

    async def _refuse_other_header(
        self, request: Request, agent: AgentRecord, ns: str | None, conversation_id: str, named_by: str
    ) -> None:
        """An `X-Conversation-Id` sent beside `previous_response_id` or `conversation` must name the
        conversation that one names (`conversation_id`), never be dropped for it: a client pinning one
        conversation would otherwise write into another without a word. Another (or `new`) is a 400
        `conflicting_parameters`, as previous_response_id with conversation is."""
        header = (request.headers.get(HEADER) or "").strip()
        if not header or await self._header_names(header, agent, ns, conversation_id):
            return
        raise bad_request(
            f"{HEADER} {fields.shown(header)} names another conversation than {named_by} does: send one of them, "
            "or the same conversation in both",
            HEADER,
            code="conflicting_parameters",
        )

    async def _header_names(self, header: str, agent: AgentRecord, ns: str | None, conversation_id: str) -> bool:
        """Whether `X-Conversation-Id: header` names `conversation_id`, as `by_header` reads it
        (`default`, a name of this credential's, an id), without making anything: `new` names none."""
        keyword = header.lower()
        if keyword == "new":
            return False
        if keyword == "default" or (ns is not None and header == NAMESPACE_DEFAULT_NAME):
            return (await self.server.kernel.default_conversation(agent, ns)).id == conversation_id
        return conversation_id in name_ids(header, ns)

    async def _place(
        self,
        agent: AgentRecord,
        ns: str | None,
        request: Request,
        prev_id: str | None,
        conv_param: str | None,
        prefix: list[ViewItem],
        user: str | None,
        metadata: dict[str, Any],
        answers: Answers | None = None,
        added: list[ViewItem] | None = None,
        seed: list[ViewItem] | None = None,
        *,
        rerun: str | None = None,
    ) -> Placement:
        """`added`: messages of `input` before its new input, with previous_response_id: they go
        after the previous response's context, in a conversation forked from it. `seed`: the
        history a new conversation for a whole transcript is seeded with (`prefix`, which is
        matched, may leave its system items out: `match_ignores_system`). `rerun`: the turn a keyed
        repeat naming no conversation re-runs (`rerun_unnamed`): its conversation when it can
        (`ConversationMatcher.by_rerun`; the same body matched it then), else placed as ever."""
        store = self.server.store
        principal = principal_of(request)
        if rerun is not None:
            if prev_id and await self._previous(prev_id, ns, principal) is None:
                raise previous_not_found(prev_id)  # deleted since the attempt it repeats: as for any request
            again = await self.matcher.by_rerun(agent, ns, rerun)
            if again is not None:
                return again
        if prev_id:
            rec = await self._previous(prev_id, ns, principal)
            if rec is None:
                raise previous_not_found(prev_id)
            await self._refuse_other_header(request, agent, ns, rec.conversation_id, "previous_response_id")
            rec = await self.as_ended(rec)
            if await self._withdrawn(rec):
                raise bad_request(
                    f"Previous response with id '{prev_id}' was withdrawn: its input was dropped before the "
                    "conversation took it in (its client went away before anything was shown, or a server stop "
                    "cut its request off before it started), so nothing can continue from it. Continue from the "
                    "response before it"
                    + (f" ('{rec.previous_response_id}')" if rec.previous_response_id else "")
                    + ", sending that input again.",
                    "previous_response_id",
                    code="previous_response_withdrawn",
                )
            if answers is not None:
                ended_calls(rec, answers)
            if rec.body.get("status") == "in_progress":
                raise ApiError(
                    409,
                    f"Previous response with id '{prev_id}' is still in progress; continue from it once it "
                    "has completed.",
                    code="previous_response_in_progress",
                    param="previous_response_id",
                )
            # New input after calls the response left open is refused (409 calls_pending) wherever
            # it would go: at the head by the paused turn itself (start_turn), in a fork by fork_at.
            refuse = calls_pending_at(prev_id)
            shown = shown_round(rec)  # a response that answered part of a round: a fork keeps its answers
            if rec.agent_id != agent.id:  # a handoff: another agent's response, continued by this one
                await self._refuse_foreign_approvals(rec, answers)
                fork = await self.matcher.fork_at(
                    agent,
                    ns,
                    rec.conversation_id,
                    rec.last_message_id,
                    answers,
                    seed=added or None,
                    while_pending=refuse,
                    shown=shown,
                )
                return Placement(fork, "fork", claimed=True)
            if added:
                fork = await self.matcher.fork_at(
                    agent, ns, rec.conversation_id, rec.last_message_id, seed=added, while_pending=refuse, shown=shown
                )
                return Placement(fork, "fork", claimed=True)
            head = await store.last_message_id(rec.conversation_id)
            answering = answers is not None
            at_head = head == rec.last_message_id and not await self.matcher.moving_elsewhere(
                rec.conversation_id, answering=answering
            )  # another server of a cluster runs a turn of it: that request continues it, this one forks
            if at_head and self.matcher.free(rec.conversation_id, answering=answering):  # no await in between
                self.matcher.claim(rec.conversation_id)
                return Placement(rec.conversation_id, "previous_response", claimed=True)
            # an older response, or one whose conversation another request is already continuing
            return Placement(
                await self.matcher.fork_at(
                    agent, ns, rec.conversation_id, rec.last_message_id, answers, while_pending=refuse, shown=shown
                ),
                "fork",
                claimed=True,
            )
        if conv_param:
            if conv_param.strip().lower() == "default":  # this credential's own, as X-Conversation-Id
                default = (await self.server.kernel.default_conversation(agent, ns)).id
                await self._refuse_other_header(request, agent, ns, default, "conversation")
                return Placement(default, "conversation")
            conv = foreign = None
            for cid in name_ids(conv_param.strip(), ns):  # a name reads as X-Conversation-Id reads it
                found = await store.get_conversation(cid)
                if found is not None and self.matcher.visible(found, agent, ns):
                    conv = found
                    break
                if found is not None and foreign is None and namespace_allows(ns, found.namespace):
                    foreign = found  # this caller's, of another agent
            if conv is None and foreign is not None:
                await self._refuse_other_agents(foreign.agent_id, conv_param, agent, principal)
            if conv is None:
                raise ApiError(
                    404,
                    f"Conversation with id '{conv_param}' not found.",
                    code="conversation_not_found",
                    param="conversation",
                )
            await self._refuse_other_header(request, agent, ns, conv.id, "conversation")
            return Placement(conv.id, "conversation")
        header = request.headers.get(HEADER)
        if header:
            return await self.matcher.by_header(agent, ns, header, prefix, user, metadata, answers, seed=seed)
        return await self.matcher.by_prefix(
            agent, ns, prefix, user, metadata, answers, while_pending=calls_pending, seed=seed
        )


CALL_ITEMS = ("function_call", "mcp_call", "mcp_approval_request")
ASKING_ITEMS = ("function_call", "mcp_approval_request")  # the calls a response leaves to its client


def _call_ids(output: Any, kinds: tuple[str, ...] = CALL_ITEMS) -> set[str]:
    """The call ids of the tool call items (of `kinds`) of a response's output (`mcp_`/`mcpr_` +
    call id, a function call's `call_id`)."""
    ids: set[str] = set()
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict) or item.get("type") not in kinds:
            continue
        kind, item_id = item.get("type"), str(item.get("id") or "")
        if kind == "function_call" and isinstance(item.get("call_id"), str):
            ids.add(item["call_id"])
        elif kind == "mcp_call" and item_id.startswith("mcp_"):
            ids.add(item_id.removeprefix("mcp_"))
        elif kind == "mcp_approval_request" and item_id.startswith("mcpr_"):
            ids.add(item_id.removeprefix("mcpr_"))
    return ids


def shown_round(rec: ResponseRecord) -> ShownRound | None:
    """What `rec` showed of the round its turn waited on: the calls it still asked for. One that
    answered part of a round lists only the rest, the others' answers being its context; a fork at
    it keeps them (ShownRound). None when its turn is not known."""
    if rec.turn_id is None:
        return None
    return ShownRound(rec.turn_id, frozenset(_call_ids(rec.body.get("output"), ASKING_ITEMS)))


def ended_calls(rec: ResponseRecord, answers: Answers) -> None:
    """Answers to calls of a response that failed (a server stop interrupted its turn, or the turn
    failed) are a 400 `already_resolved`, as answers to calls of a cancelled turn are: its turn
    ended, closing every call it left open (not run, or stopped while it ran); nothing resumes it.
    Refused before anything is placed (no fork is written for them)."""
    if rec.body.get("status") != "failed":
        return
    closed = [d.call_id for d in answers.given if d.call_id in _call_ids(rec.body.get("output"))]
    if closed:
        raise ApiError(
            400,
            f"call {', '.join(closed)} of response {rec.id} can no longer be answered: its turn ended "
            "(failed, or interrupted by a server stop) before the call was answered, and closed it",
            code="already_resolved",
            param=answers.param,
        )


def history_to_add(prefix: list[ViewItem]) -> list[ViewItem]:
    """What of `input` before its new input must reach the model after a previous response (or a
    conversation): its user messages and assistant text with the calls and results around them,
    and its system/developer messages in their place (the conversation keeps them). A prefix of
    only function calls (some clients resend the calls they answer) repeats what the previous
    response holds: nothing to add."""
    history = [i for i in prefix if i.kind in ("user", "assistant", "tool") or i.kind == "system" and i.text]
    if any(i.kind == "user" or (i.kind == "assistant" and i.text.strip()) for i in history):
        return history
    return []


class _Run:
    def __init__(
        self,
        route: Responses,
        shape: Shape,
        run: TurnRun,
        idem: Idempotency | None,
        parsed: ParsedInput,
        point_base: str | None,
    ) -> None:
        self.route = route
        self.server = route.server
        self.shape = shape
        self.run = run
        self.idem = idem
        self.parsed = parsed
        self.point_base = point_base  # hash of the transcript up to and including the new input, if sent whole
        self.headers = {HEADER: run.conversation_id}
        self.keepalive = float(self.server.config.limits.sse_keepalive_s)
        self.steps_note = max_steps_note(self.server, shape.agent)
        self.kept_in_progress = False  # the stream stored its response as in progress (response.created)
        self.noted = False  # the key (if any) names the response (`note_start`)

    def settled(self, snap: TurnSnapshot) -> bool:
        return snap.status in TERMINAL_STATUSES or (
            snap.status == "awaiting" and snap.revision > self.run.after_revision
        )

    def output(
        self, snap: TurnSnapshot, cut: bool | None = None, closed: dict[int, dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """`cut`: the response did not complete (default: as the snapshot's status says).
        `closed`: agent tool call items (by block index) as a stream closed them, which the body
        must show as its events did (the server's stop closed calls the snapshot shows unfinished)."""
        if cut is None:
            cut = final_status(snap) != "completed"
        blocks = output_blocks(snap, self.run, self.steps_note)
        items = [
            (closed or {}).get(i)
            or item_for(
                self.shape,
                self.run.turn_id,
                i,
                b,
                final=True,
                cut=item_cut(cut, pos, len(blocks), b),
                approvals=self.run.resolved_calls,
            )
            for pos, (i, b) in enumerate(blocks)
        ]
        return [i for i in items if i is not None]

    async def finalize(self, snap: TurnSnapshot) -> dict[str, Any]:
        output = self.output(snap)
        failed = await turn_error(self.server, self.shape.agent.id, snap.error) if failed_answer(snap) else None
        body = response_body(
            self.shape,
            status=final_status(snap),
            output=output,
            snap=snap,
            failed=failed,
            base_usage=self.run.base_usage,
        )
        if not failed_answer(snap) and self.point_base is not None:
            view = merge_assistants(_reply_view(output))
            await self.route.matcher.record(self.shape.agent.id, self.run.conversation_id, chain(view, self.point_base))
        await self.keep(body)
        return body

    async def keep(self, body: dict[str, Any]) -> None:
        """Store the Response object under its id (unless `store` is false)."""
        if not self.shape.store:
            return
        store = self.server.store
        if self.kept_in_progress and await store.get_response(self.shape.id) is None:
            return  # deleted (DELETE /v1/responses/{id}) while its stream ran: it stays deleted
        if not self.noted:
            # Before the response is stored, never after: a kill between the two writes then
            # leaves a key a DELETE of the response finds (stream or not).
            await self.note_start()
            self.noted = True
        rec = ResponseRecord(
            id=self.shape.id,
            agent_id=self.shape.agent.id,
            conversation_id=self.run.conversation_id,
            body=body,
            turn_id=self.run.turn_id,
            previous_response_id=self.shape.previous_response_id,
            namespace=None,
            last_message_id=await store.last_message_id(self.run.conversation_id),
            input_items=self.parsed.stored,
            stored=True,
        )
        await store.save_response(rec)
        await self.route.index_items(rec)

    async def unkept(self, snap: TurnSnapshot, exc: StoreUnavailable) -> dict[str, Any]:
        """The `response.failed` body of a stream whose turn ended but whose response could not be
        stored (`finalize` refused): its output as the stream's events showed it, and the error the
        non-stream answer gives (`after_turn_refused`: what was saved, do not send the input
        again), or the turn's own failure when it failed. One log line; nothing more is written."""
        failed = after_turn_refused(exc, self.run.conversation_id)
        why = exc.cause if isinstance(exc, WriteRefused) else str(exc)
        log.warning("could not store response %s of conversation %s: %s", self.shape.id, self.run.conversation_id, why)
        if failed_answer(snap):
            try:
                failed = await turn_error(self.server, self.shape.agent.id, snap.error)
            except StoreUnavailable:
                failed = turn_failure(snap.error)
        body = response_body(
            self.shape,
            status="failed",
            output=self.output(snap),
            snap=snap,
            failed=failed,
            base_usage=self.run.base_usage,
        )
        if body["error"] is None:  # (a failed turn's is its own) Response.error.code is a closed enum
            body["error"] = {"code": "server_error", "message": f"{failed.message} [{failed.code}]"}
        return body

    async def keep_unfinished(self, body: dict[str, Any]) -> bool:
        """A stream told the client its response id (`response.created`) and ends without the
        turn's outcome: the id must still name the response, with how it ended, after a restart.
        Best effort within KEEP_TIMEOUT_S: the stream's end is never held up for long. True once
        stored."""
        try:
            await asyncio.wait_for(self.keep(body), KEEP_TIMEOUT_S)
        except Exception as exc:  # the store is failing or stopping: the stream still ends as it must
            log.warning("could not store unfinished response %s: %r", self.shape.id, exc)
            return False
        return True

    async def note_start(self) -> None:
        """The key (if any) learns the id of the response before it is first stored, so that
        deleting that response forgets the key's answer even when the server is killed before the
        key's answer is stored (a stream's end, or a non-stream reply's: `forget_answers_of`). A
        keyed request's one extra write; none without a key. Best effort within KEEP_TIMEOUT_S,
        as the response's own keep."""
        if self.idem is None:
            return
        try:
            await asyncio.wait_for(self.idem.note_start(self.shape.id, self.run.conversation_id), KEEP_TIMEOUT_S)
        except Exception as exc:
            log.warning("could not note response %s with its Idempotency-Key: %r", self.shape.id, exc)

    async def client_gone(self) -> None:
        """A stream's client left: cancel the turn, then keep the response as the turn ended
        (cancelled, or whatever it reached first), or as cancelled if it does not settle in time."""
        await self.run.cancel()
        try:
            snap = await self.run.handle.wait_settled(KEEP_TIMEOUT_S, after_revision=self.run.after_revision)
        except TimeoutError:
            snap = None
        if snap is not None and snap.status in TERMINAL_STATUSES:
            try:
                await asyncio.wait_for(self.finalize(snap), KEEP_TIMEOUT_S)
                return
            except Exception as exc:
                log.warning("could not store response %s after its client left: %r", self.shape.id, exc)
        await self.keep_unfinished(response_body(self.shape, status="cancelled", output=[], snap=None))

    async def complete(self, request: Request) -> Response:
        try:
            snap = await settle_or_cancel(request, self.run, self.settled)
            if failed_answer(snap) and (
                not any(b["type"] == "text" and b["text"] for _, b in output_blocks(snap, self.run))
                or (snap.error or {}).get("kind") == "store"
            ):
                # As on chat: an HTTP error the SDK raises (and retries when it may), not a 200 with
                # status "failed". Streams keep ending with `response.failed`.
                raise await turn_error(self.server, self.shape.agent.id, snap.error)
            body = await self.finalize(snap)
        except BaseException as exc:
            if self.idem is not None:
                await self.idem.abandon()
            if isinstance(exc, ApiError):  # the turn was accepted: its input is in this conversation
                exc.headers.setdefault(HEADER, self.run.conversation_id)
            raise
        data = dumps(body)
        if self.idem is not None:
            await keep_or_free(self.idem, snap, data, self.run.conversation_id)
        return Response(data, media_type="application/json", headers=self.headers)

    def stream_response(self, request: Request) -> Response:
        metrics = self.route.metrics
        finished = False
        announced = False  # the client may have the response id (response.created went out)
        kept = False  # the response's outcome is (being) stored: a disconnect must not overwrite it
        seq = 0

        def ev(kind: str, **fields: Any) -> tuple[str, str]:
            nonlocal seq
            payload = {"type": kind, **fields, "sequence_number": seq}
            seq += 1
            return kind, dumps(payload)  # sent with an `event: <type>` line, as OpenAI does

        async def produce() -> AsyncIterator[SSEItem]:
            nonlocal finished, announced, kept
            metrics.active_streams.inc()
            stopping = self.route.stopping
            watcher = watch_credential(request, stopping)  # its end ends the stream (credential_end.py)
            try:
                shape = self.shape
                created = response_body(shape, status="in_progress", output=[], snap=None)
                if shape.store:
                    # The id goes out with response.created: stored first, in progress, so it names
                    # the response even if the server is killed before the stream ends (GET then
                    # answers it as its turn ended: `as_ended`). Best effort, like keep_unfinished.
                    self.route.live.add(shape.id)
                    self.kept_in_progress = await self.keep_unfinished(created)
                announced = True
                yield ev("response.created", response=created)
                yield ev(
                    "response.in_progress", response=response_body(shape, status="in_progress", output=[], snap=None)
                )
                states: dict[int, dict[str, Any]] = {}  # absolute block index → progress
                out_index = 0

                def advance(
                    snap: TurnSnapshot, settled: bool, cut: bool | None = None, stopped: bool = False
                ) -> list[tuple[str, str]]:
                    """The events that bring every output item up to `snap` (`settled`: closing them;
                    `stopped`: the server's stop ends the stream, whatever the turn still does)."""
                    nonlocal out_index
                    out: list[tuple[str, str]] = []
                    blocks = output_blocks(snap, self.run, self.steps_note)
                    if cut is None:  # the response did not complete (known once its turn ended)
                        cut = snap.status in TERMINAL_STATUSES and final_status(snap) != "completed"
                    for pos, (bi, b) in enumerate(blocks):
                        st = states.get(bi)
                        if st is None:
                            st = states[bi] = {"added": False, "sent": 0, "done": False, "index": None, "kind": None}
                        if st["done"]:
                            continue
                        # An item is closed once a later one follows it (finished: `completed`, as
                        # the final response says too), the last one only with the response's
                        # outcome; a client call always then (`item_cut`: incomplete when the
                        # response did not complete, which no block of it says before).
                        client_call = b["type"] == "tool_call" and b.get("executor") == "client"
                        closed = settled or (pos + 1 < len(blocks) and not client_call)
                        events, progressed = self._advance(
                            snap,
                            bi,
                            b,
                            st,
                            closed,
                            out_index,
                            ev,
                            cut=item_cut(cut, pos, len(blocks), b),
                            stopped=stopped,
                        )
                        out.extend(events)
                        if st.get("counted") is None and st["added"]:
                            st["counted"] = True
                            out_index += 1
                        if st.get("skip"):
                            st["done"] = True
                            continue
                        if not st["done"]:
                            break
                    return out

                last: TurnSnapshot | None = None
                async for snap in self.run.snapshots(self.keepalive, self.route.stopping):
                    if snap is None:
                        yield None
                        continue
                    last = snap
                    settled = self.settled(snap)
                    for e in advance(snap, settled):
                        yield e
                    if settled:
                        break
                if self.run.handle.unreadable and (last is None or not self.settled(last)):
                    # its end cannot be read here (cut off from the cluster): an `error` event with
                    # the 503 a retry with the key answers (`unread_answer`), nothing stored
                    err = unread_answer(self.run)
                    kept = True
                    yield ev("error", code=err.code, message=err.message, param=None)
                    return
                ended = stopping.ended(asyncio.current_task())
                if ended is not None and (last is None or not self.settled(last)):
                    # The credential ended (credential_end.py): the turn is cancelled and the
                    # response kept as when its client leaves; the stream ends with an `error`
                    # event (the SDKs raise it), its code saying why.
                    await self.client_gone()
                    kept = True
                    yield ev("error", code=ended.code, message=ended.message, param=None)
                    return
                if last is None or not self.settled(last):  # the server stops (the only other way out)
                    # `response.failed`, as a failed turn's stream ends, with what the turn showed
                    # so far (its items incomplete; the kernel's stop keeps that text as
                    # interrupted); stored as sent (the client has the id: GET answers with it after
                    # the restart, its output and fork point then taken from the turn as it was
                    # kept: `as_ended`), no replay.
                    await self.run.withdraw_if_queued()  # a turn that never started does not run later
                    now = self.run.handle.controller.snapshot()  # the latest: what was shown so far
                    shown = now if now.revision > self.run.after_revision else None
                    if shown is not None:
                        # every item the body holds is announced and closed first, in order: an
                        # agent tool call still running (or not run yet) as a failed `mcp_call`
                        for e in advance(shown, True, cut=True, stopped=True):
                            yield e
                    err = shutting_down()
                    closed = {bi: st["final"] for bi, st in states.items() if st.get("final") is not None}
                    output = self.output(shown, cut=True, closed=closed) if shown is not None else []
                    body = response_body(
                        shape, status="failed", output=output, snap=shown, base_usage=self.run.base_usage
                    )
                    body["error"] = {"code": "server_error", "message": f"{err.message} [{err.code}]"}
                    kept = True
                    await self.keep_unfinished(body)
                    yield ev("response.failed", response=body)
                    return
                kept = True  # from here on, the outcome is stored by finalize (or the stream says it is not)
                try:
                    body = await self.finalize(last)
                except StoreUnavailable as exc:
                    # The turn ended, what it saved stays, but its Response object (or its history
                    # point) could not be stored (a full disk): the stream ends with
                    # `response.failed` saying so, as the non-stream answer's 503 does, not cut off.
                    yield ev("response.failed", response=await self.unkept(last, exc))
                    return  # not `finished`: no answer is kept for its key (released, or taken over)
                # A cancelled response (another client cancelled or dropped its turn) ends as it is
                # stored and as the non-stream answer says: status `cancelled`, in the event OpenAI
                # has for a response that ended early without failing (it has no event of its own).
                terminal = {
                    "completed": "response.completed",
                    "incomplete": "response.incomplete",
                    "failed": "response.failed",
                    "cancelled": "response.incomplete",
                }[body["status"]]
                yield ev(terminal, response=body)
                finished = body["status"] in ("completed", "incomplete")  # an answer: kept for replay
            finally:
                metrics.active_streams.dec()
                if watcher is not None:
                    watcher.cancel()
                    stopping.forget(asyncio.current_task())
                if not announced or kept:
                    self.route.live.discard(self.shape.id)

        async def on_disconnect() -> None:
            try:
                if announced and not kept:
                    await self.client_gone()
                else:
                    await self.run.cancel()
            finally:
                self.route.live.discard(self.shape.id)

        on_close = stream_replay(self.idem, self.run.conversation_id, lambda: finished)
        return SSEResponse(produce(), headers=self.headers, on_disconnect=on_disconnect, on_close=on_close)  # type: ignore[return-value]

    def _advance(
        self,
        snap: TurnSnapshot,
        bi: int,
        b: dict[str, Any],
        st: dict[str, Any],
        closed: bool,
        out_index: int,
        ev: Any,
        *,
        cut: bool,
        stopped: bool = False,
    ) -> tuple[list[tuple[str, str]], bool]:
        """Events that bring one output item up to date; marks st['done'] when its item is finished.
        `cut`: the item, once closed, is `incomplete` (`item_cut`). `stopped`:
        the server's stop ends the stream while the turn runs (`closed` then too): an agent tool
        call without its result is closed as the stop leaves it (`st['final']`, the item the body
        shows)."""
        shape = self.shape
        events: list[tuple[str, str]] = []
        kind = b["type"]
        if kind == "compaction" or (kind == "reasoning" and not shape.reasoning):
            st["skip"] = True
            return events, True
        if st["index"] is None and not st["added"]:
            st["index"] = out_index
        idx = st["index"]
        if kind in ("text", "reasoning"):
            item = item_for(shape, self.run.turn_id, bi, b, final=False)
            assert item is not None
            item_id = item["id"]

            def part_event(name: str, **fields: Any) -> tuple[str, str]:
                """An event of the item's one content part."""
                return cast(tuple[str, str], ev(name, item_id=item_id, output_index=idx, content_index=0, **fields))

            # the part's own events: an answer's output_text, a refusal's refusal, reasoning's text
            refusal = kind == "text" and b.get("refusal")
            delta_event, done_event, done_field = (
                ("response.refusal.delta", "response.refusal.done", "refusal")
                if refusal
                else ("response.output_text.delta", "response.output_text.done", "text")
                if kind == "text"
                else ("response.reasoning_text.delta", "response.reasoning_text.done", "text")
            )
            logprobs: dict[str, Any] = {"logprobs": []} if kind == "text" and not refusal else {}
            if not st["added"]:
                events.append(ev("response.output_item.added", output_index=idx, item=item))
                if kind == "text":
                    events.append(part_event("response.content_part.added", part=text_part(b, "")))
                st["added"] = True
            text = b["text"]
            if len(text) > st["sent"]:
                piece = text[st["sent"] :]
                st["sent"] = len(text)
                events.append(part_event(delta_event, delta=piece, **logprobs))
            if closed:
                final = item_for(shape, self.run.turn_id, bi, b, final=True, cut=cut)
                events.append(part_event(done_event, **{done_field: text}, **logprobs))
                if kind == "text":
                    events.append(part_event("response.content_part.done", part=text_part(b, text)))
                events.append(ev("response.output_item.done", output_index=idx, item=final))
                st["done"] = True
            return events, True
        # tool calls
        status = b.get("status")
        approvals = self.run.resolved_calls  # the calls this request's approvals (or its round's) let run
        if b.get("executor") == "client":
            item = item_for(shape, self.run.turn_id, bi, b, final=False, approvals=approvals)
            assert item is not None
            if not st["added"]:
                events.append(ev("response.output_item.added", output_index=idx, item=item))
                st["added"] = True
            args = b.get("arguments") or ""
            if len(args) > st["sent"]:
                events.append(
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=idx,
                        delta=args[st["sent"] :],
                    )
                )
                st["sent"] = len(args)
            if closed:
                events.append(
                    ev(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        name=b["name"],
                        output_index=idx,
                        arguments=args,
                    )
                )
                events.append(
                    ev(
                        "response.output_item.done",
                        output_index=idx,
                        item=item_for(shape, self.run.turn_id, bi, b, final=True, cut=cut, approvals=approvals),
                    )
                )
                st["done"] = True
            return events, True
        if stopped and status not in ("completed", "failed", "denied"):
            return self._stopped_call(bi, b, st, idx, ev), True
        if status == "streaming" and not closed:
            return events, False  # a server call is shown once its policy is known
        if status == "pending_approval":
            item = item_for(shape, self.run.turn_id, bi, b, final=True, approvals=approvals)
            events.append(ev("response.output_item.added", output_index=idx, item=item))
            events.append(ev("response.output_item.done", output_index=idx, item=item))
            st["added"] = st["done"] = True
            return events, True
        item = item_for(shape, self.run.turn_id, bi, b, final=False, approvals=approvals)
        assert item is not None
        if not st["added"]:
            args = b.get("arguments") or ""
            events.append(ev("response.output_item.added", output_index=idx, item=item))
            events.append(ev("response.mcp_call_arguments.delta", output_index=idx, item_id=item["id"], delta=args))
            events.append(ev("response.mcp_call_arguments.done", output_index=idx, item_id=item["id"], arguments=args))
            events.append(ev("response.mcp_call.in_progress", output_index=idx, item_id=item["id"]))
            st["added"] = True
        if status in ("completed", "failed", "denied") or (closed and snap.status in TERMINAL_STATUSES):
            events.append(
                ev(
                    "response.mcp_call.completed" if status == "completed" else "response.mcp_call.failed",
                    item_id=item["id"],
                    output_index=idx,
                )
            )
            events.append(
                ev(
                    "response.output_item.done",
                    output_index=idx,
                    item=item_for(shape, self.run.turn_id, bi, b, final=True, approvals=approvals),
                )
            )
            st["done"] = True
        return events, True

    def _stopped_call(self, bi: int, b: dict[str, Any], st: dict[str, Any], idx: int, ev: Any) -> list[tuple[str, str]]:
        """The server's stop ends the stream while an agent tool call has no result: it runs (the
        stop ends it), or it was not run yet (its arguments streaming, an approval not yet shown,
        an approved call waiting for its turn). Closed as the kernel's stop keeps it in the history
        and as `GET` shows it after the restart: a `failed` `mcp_call` (`response.mcp_call.failed`)
        whose error says why. An approval request never goes out here: the interrupted turn can no
        longer be answered (an answer is a 400 `already_resolved`)."""
        shape = self.shape
        events: list[tuple[str, str]] = []
        running = b.get("status") == "running"
        # an approval not shown yet was never asked (its request is stored when the turn pauses)
        approvals = self.run.resolved_calls
        ended = dict(b, status="failed", output=(stopped_text if running else not_run_text)(str(b["name"])))
        item = item_for(shape, self.run.turn_id, bi, ended, final=False, approvals=approvals)
        assert item is not None
        if not st["added"]:
            args = b.get("arguments") or ""
            events.append(ev("response.output_item.added", output_index=idx, item=item))
            events.append(ev("response.mcp_call_arguments.delta", output_index=idx, item_id=item["id"], delta=args))
            events.append(ev("response.mcp_call_arguments.done", output_index=idx, item_id=item["id"], arguments=args))
            if running:
                events.append(ev("response.mcp_call.in_progress", output_index=idx, item_id=item["id"]))
            st["added"] = True
        final = item_for(shape, self.run.turn_id, bi, ended, final=True, approvals=approvals)
        events.append(ev("response.mcp_call.failed", item_id=item["id"], output_index=idx))
        events.append(ev("response.output_item.done", output_index=idx, item=final))
        st["final"] = final
        st["done"] = True
        return events


def _reply_view(output: list[dict[str, Any]]) -> list[ViewItem]:
    view: list[ViewItem] = []
    for item in output:
        if item["type"] == "message":
            # a refusal part reads as text, as parse_input reads it when a client resends it
            text = join_texts([c.get("text", c.get("refusal", "")) for c in item["content"]])
            view.append(ViewItem("assistant", text))
        elif item["type"] == "function_call":
            view.append(
                ViewItem(
                    "assistant",
                    "",
                    calls=[{"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}],
                )
            )
        elif item["type"] in SERVER_TOOL_ITEMS:
            view.append(ViewItem("assistant", ""))  # as parse_input reads it when a client resends it
    return view
