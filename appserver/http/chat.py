"""POST /v1/chat/completions: one agent turn per request, non-stream or SSE, with client tools.

Conversation: `X-Conversation-Id` header, else the history-prefix match (conversation_match).
Deltas come from snapshots: the new suffix of each text block since the last snapshot sent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from appserver.agent.loop import OWN_SYSTEM
from appserver.auth import conversation_namespace
from appserver.http import fields
from appserver.http.common import (
    NOT_ANSWERS,
    Idempotency,
    JSONReply,
    TurnRun,
    TurnSeat,
    answer_paused,
    answer_settings,
    approval_pending,
    client_pending,
    dumps,
    failed_answer,
    keep_or_free,
    log,
    max_steps_note,
    named_answers,
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
    LEGACY_CALL_ID,
    Answers,
    ConversationMatcher,
    Placement,
    ViewItem,
    chain,
    check_call_ids,
    for_agent,
    legacy_name,
    legacy_round,
    merge_assistants,
    results_without_call,
    split_after_results,
    split_new_input,
    unanswered_calls,
    users_content,
)
from appserver.http.errors import ApiError, bad_request, error_body
from appserver.http.sse import DirectWrites, SSEResponse
from appserver.http.stopping import Stopping, shutting_down
from appserver.images import image_url_problem
from appserver.providers.base import ToolSpec, structured_format
from appserver.runtime import TERMINAL_STATUSES, Decision, TurnSnapshot
from appserver.runtime.kernel import blank_input as kernel_blank_input  # the kernel's submit rule
from appserver.store.base import StoreUnavailable
from appserver.store.records import AgentRecord, TurnSettings

if TYPE_CHECKING:
    from appserver.http.metrics import Metrics
    from appserver.security.limits import TurnPlaces
from appserver.server import Server

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# roles whose messages may carry an optional `name` (a function message's is required; a tool
# message has none in OpenAI's description)
NAMED_ROLES = ("system", "developer", "user", "assistant")
# max_steps: the server's loop was stopped before the reply was done, like a token limit (DESIGN §13)
FINISH = {
    "end_turn": "stop",
    "max_tokens": "length",
    "max_steps": "length",
    "content_filter": "content_filter",
    "cancelled": "stop",
    "requires_client_tool": "tool_calls",
}


# ---------------------------------------------------------------- request parsing


MEDIA_PARTS = ("file", "input_file", "input_audio")
# The part types a refusal of an unknown one lists, in the spelling of the API the client called
# (`parts_of` takes either route's parts: a client is pointed to its own API's).
CHAT_PARTS = ("text", "image_url", "file", "input_audio")
RESPONSES_PARTS = ("input_text", "input_image", "input_file", "input_audio", "output_text", "refusal")


def content_of(content: Any, where: str, *, named: tuple[str, ...] = CHAT_PARTS) -> tuple[str, list[str]]:
    """(text, image urls) of a message's content; file and audio parts only come from users."""
    text, images, _, _ = parts_of(content, where, media=False, named=named)
    return text, images


def media_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A file or audio part as Chat Completions upstreams take it (Responses `input_file` → `file`).
    The fields OpenAI requires (`input_audio` and its `data` and `format`, a `file` part's `file`)
    are required here too, and every field is type-checked, each error naming its path: none is
    dropped or coerced."""
    kind = part.get("type")
    if kind == "input_audio":
        at = f"{where}.input_audio"
        audio = fields.obj(fields.required(part, "input_audio", at), at, nullable=False)
        assert audio is not None
        data = fields.required_string(audio, "data", f"{at}.data")
        audio_format = fields.required_string(audio, "format", f"{at}.format")
        return {"type": "input_audio", "input_audio": {"data": data, "format": audio_format}}
    if kind == "file":
        at = f"{where}.file"
        spec = fields.obj(fields.required(part, "file", at), at, nullable=False)
        assert spec is not None
    else:
        at, spec = where, part
    for key in FILE_FIELDS:  # each optional; Responses' input_file may give a null file_id
        if key in spec:
            fields.string(spec[key], f"{at}.{key}", nullable=kind == "input_file")
    if kind == "input_file" and spec.get("file_url"):
        raise bad_request(
            f"{where}: unsupported content part 'input_file' with file_url: send the file's content as file_data",
            where,
            code="unsupported_content_part",
        )
    out = {k: spec[k] for k in FILE_FIELDS if isinstance(spec.get(k), str)}
    if not out.get("file_data") and not out.get("file_id"):
        raise bad_request(f"{where}: a file part needs file_data or file_id", where, code="invalid_content_part")
    return {"type": "file", "file": out}


FILE_FIELDS = ("file_data", "file_id", "filename")


# image detail levels: Chat Completions takes these; Responses' ImageDetail adds `original`
IMAGE_DETAILS = ("auto", "low", "high")
INPUT_IMAGE_DETAILS = ("low", "high", "auto", "original")


def image_url_of(part: dict[str, Any], kind: str, at: str) -> tuple[str, Any]:
    """(the url, the `image_url` value) of an image part: Chat's `image_url` is an object with a
    `url` (a plain string is taken too), Responses' `input_image` has the url as a string. Absent
    is `missing_required_parameter`, another type `invalid_type`, naming the path. An
    `input_image` may name an uploaded file (`file_id`, its `image_url` then null or absent, as
    OpenAI's schema allows): refused by name (`unsupported_value`), as this server has no Files
    API to read it from."""
    if kind == "input_image" and fields.string(part.get("file_id"), f"{at}.file_id") is not None:
        raise ApiError(
            400,
            f"Invalid '{at}.file_id': images given by file_id are not supported: this server has no "
            "Files API (uploaded files cannot be read from it); send the image in image_url, as an "
            "https URL or a data: URL (data:image/png;base64,…)",
            code="unsupported_value",
            param=f"{at}.file_id",
        )
    image = fields.required(part, "image_url", f"{at}.image_url")
    if kind == "image_url" and isinstance(image, dict):
        return fields.required_string(image, "url", f"{at}.image_url.url"), image
    if not isinstance(image, str):
        expected = "an object" if kind == "image_url" else "a string"
        raise fields.type_error(f"{at}.image_url", expected, image)
    return image, image


def parts_of(
    content: Any,
    where: str,
    *,
    media: bool = True,
    named: tuple[str, ...] = CHAT_PARTS,
    key: str = "content",
) -> tuple[str, list[str], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(text, image urls, file/audio parts, every part in order) of a message's content. The
    ordered parts are in the shape providers take (`text`, `image_url` with its `detail` when
    sent, `file`, `input_audio`), as the client sent them: none merged or moved. None for plain
    string content. A part this server cannot pass on is refused by name, never dropped: an
    unknown type naming `where.key[j].type` and listing the types `named` (the route's own).
    `key`: the field holding the parts (a function_call_output's `output`)."""
    if content is None:
        return "", [], [], None
    if isinstance(content, str):
        return content, [], [], None
    if not isinstance(content, list):
        raise fields.type_error(f"{where}.{key}", "one of a string or array of objects", content)
    texts: list[str] = []
    images: list[str] = []
    media_parts: list[dict[str, Any]] = []
    ordered: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.{key}[{j}]"
        fields.obj(part, at, nullable=False)
        kind = fields.required_string(part, "type", f"{at}.type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            text_key = "refusal" if kind == "refusal" and "text" not in part else "text"
            text = fields.required_string(part, text_key, f"{at}.{text_key}")
            texts.append(text)
            ordered.append({"type": "text", "text": text})
        elif kind in ("image_url", "input_image"):
            url, image = image_url_of(part, kind, at)
            problem = image_url_problem(url)
            if problem is not None:
                raise bad_request(f"{at}: {problem}", f"{where}.{key}", code="invalid_image_url")
            if kind == "image_url":
                detail = image.get("detail") if isinstance(image, dict) else None
                detail = fields.one_of(detail, f"{at}.image_url.detail", IMAGE_DETAILS)
            else:
                detail = fields.one_of(part.get("detail"), f"{at}.detail", INPUT_IMAGE_DETAILS)
            images.append(url)
            ordered.append(
                {"type": "image_url", "image_url": {"url": url, "detail": detail} if detail else {"url": url}}
            )
        elif kind in MEDIA_PARTS and media:
            media_parts.append(media_part(part, at))
            ordered.append(media_parts[-1])
        elif kind in MEDIA_PARTS:
            raise bad_request(
                f"{at}: unsupported content part '{kind}': only user messages may carry files and audio",
                f"{where}.{key}",
                code="unsupported_content_part",
            )
        else:
            raise bad_request(
                f"{at}: unsupported content part {fields.shown(kind)} (supported: {', '.join(named)})",
                f"{at}.type",
                code="unsupported_content_part",
            )
    return join_texts(texts), images, media_parts, ordered


TEXT_PARTS_SEPARATOR = "\n\n"


def join_texts(texts: list[str]) -> str:
    """The text of a message whose content has several text parts, where one string must carry it
    (system, developer, assistant and tool messages reach the model as one string): the parts
    joined by a blank line, never glued (as several trailing user messages are joined); empty
    parts add nothing. One part is its text as sent."""
    if len(texts) == 1:
        return texts[0]
    return TEXT_PARTS_SEPARATOR.join(t for t in texts if t)


def no_images(where: str, role: str, param: str, part: str = "image_url") -> ApiError:
    """An image where only users may send one: refused by name (`part`: as the client's API calls
    it, `input_image` in Responses), never dropped."""
    return bad_request(
        f"{where}: unsupported content part '{part}' in a {role} message: only user messages may carry images",
        param,
        code="unsupported_content_part",
    )


def check_media(server: Server, agent: AgentRecord, parts: list[dict[str, Any]], param: str) -> None:
    """Refuse (400, by type) the file/audio parts the agent's provider cannot take: OpenAI-compatible
    upstreams take `file` and `input_audio` parts, Anthropic takes PDFs (as a `document`), echo
    neither. Nothing is dropped silently."""
    if not parts:
        return
    try:
        kind = server.providers.resolve(agent.model)[0].kind
    except Exception:  # a misconfigured provider fails the turn with its own error
        return
    for part in parts:
        if kind == "openai":
            continue
        data = part.get("file", {}).get("file_data") if part["type"] == "file" else None
        if kind == "anthropic" and isinstance(data, str) and data.startswith("data:application/pdf;base64,"):
            continue
        takes = (
            "PDF files sent as file_data (data:application/pdf;base64,…)"
            if kind == "anthropic"
            else "text and images only"
        )
        raise bad_request(
            f"unsupported content part '{part['type']}': agent {agent.name} runs on {agent.model}, which takes {takes}",
            param,
            code="unsupported_content_part",
        )


def check_format(server: Server, agent: AgentRecord, response_format: dict[str, Any] | None, param: str) -> None:
    """Refuse (400 `unsupported_parameter`) structured output the agent's provider cannot give: the
    anthropic kind's Messages API has no response format, and free text in its place would reach
    a client expecting JSON. Before the turn starts (the provider refuses it too, once it runs)."""
    fmt = structured_format(response_format)
    if fmt is None:
        return
    try:
        kind = server.providers.resolve(agent.model)[0].kind
    except Exception:  # a misconfigured provider fails the turn with its own error
        return
    if kind == "anthropic":
        raise bad_request(
            f"Unsupported parameter: '{param}' of type '{fmt}': agent {agent.name} runs on {agent.model}, an "
            "anthropic-kind provider, whose Messages API has no structured output; ask for JSON in the "
            "instructions instead, or use an agent on an openai-kind provider",
            param,
            code="unsupported_parameter",
        )


def view_of_messages(messages: Any) -> tuple[list[ViewItem], list[str]]:
    """(view items, system/developer texts) of a chat `messages` array."""
    if messages is None:
        raise fields.missing("messages")
    fields.array(messages, "messages", nullable=False)
    if not messages:
        raise fields.empty_array("messages")
    items: list[ViewItem] = []
    instructions: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        fields.obj(m, where, nullable=False)
        role = fields.one_of(fields.required(m, "role", f"{where}.role"), f"{where}.role", ROLES, nullable=False)
        assert role is not None
        if role in NAMED_ROLES:  # an optional participant name (not passed on): a string, as OpenAI types it
            fields.string(m.get("name"), f"{where}.name")
        if role == "assistant":
            fields.string(m.get("refusal"), f"{where}.refusal")
        if role in CONTENT_REQUIRED:  # every message of the transcript, not only the new input
            content = fields.required(m, "content", f"{where}.content")
            if not isinstance(content, str | list):
                raise fields.type_error(f"{where}.content", "one of a string or array of objects", content)
        elif role == "function":  # required too, but a string or null
            fields.string(fields.required(m, "content", f"{where}.content"), f"{where}.content")
        if m.get("content") == []:  # OpenAI's content arrays have minItems 1
            raise fields.empty_array(f"{where}.content")
        text, images, media, ordered = parts_of(m.get("content"), where, media=role == "user")
        if images and role != "user":
            raise no_images(where, role, "messages")
        if role in ("system", "developer"):
            items.append(ViewItem("system", text))
            if text.strip():
                instructions.append(text)
        elif role == "user":
            items.append(ViewItem("user", text, images, parts=media, content=ordered))
        elif role == "assistant":
            calls = []
            raw_calls = fields.array(m.get("tool_calls"), f"{where}.tool_calls") or []
            for k, c in enumerate(raw_calls):
                calls.append(history_call(c, f"{where}.tool_calls[{k}]"))
            legacy = legacy_function_call(m.get("function_call"), where)
            if legacy is not None:
                calls.append(legacy)
            items.append(ViewItem("assistant", text, calls=calls))
        elif role == "tool":
            # "" is schema-valid; as new input it matches no call
            call_id = fields.required_string(m, "tool_call_id", f"{where}.tool_call_id")
            items.append(ViewItem("tool", text, call_id=call_id))
        else:  # function: the legacy result of an assistant `function_call`, which it answers by name
            name = fields.required_string(m, "name", f"{where}.name")  # "" is schema-valid, as a tool_call_id
            items.append(ViewItem("tool", text, call_id=LEGACY_CALL_ID + name))
    return merge_assistants(items), instructions


def refuse_stray_results(items: list[ViewItem], prefix: list[ViewItem], results: list[ViewItem]) -> None:
    """400 `unknown_tool_call` for a tool message that answers no call of an assistant message
    before it (placed before the message that made its call, say), and for a legacy `function`
    answer that names another function than the call the last reply showed: dropped or matched
    by name to a call the client was never shown, it would answer the wrong call or none."""
    made: set[str] = set()
    unmade: list[ViewItem] = []  # tool items whose call no assistant item before them made
    for item in items:
        if item.kind == "assistant":
            made.update(c["id"] for c in item.calls)
        elif item.kind == "tool" and item.call_id not in made:
            unmade.append(item)
    # of those, the ones a later assistant item makes the call of (one never made is left as before)
    stray = [t.call_id or "" for t in unmade if t.call_id in made]
    shown = {c["id"] for c in prefix[-1].calls} if prefix else set()
    stray += [r.call_id or "" for r in results if legacy_name(r.call_id or "") is not None and r.call_id not in shown]
    if stray:
        named = [f"function {legacy_name(c)}" if legacy_name(c) is not None else c for c in stray]
        raise bad_request(
            f"the tool messages for {', '.join(dict.fromkeys(named))} answer no tool call of the assistant message "
            "before them (a tool message follows the assistant message that made its call; a function message "
            "names the function_call of the assistant message before it)",
            "messages",
            code="unknown_tool_call",
        )


# roles whose `content` OpenAI requires (an assistant's may be null or absent: tool calls only)
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


# the `type` of an assistant message's tool call (required: OpenAI's schema tells the two apart by it)
TOOL_CALL_TYPES = ("function", "custom")


def history_call(c: Any, at: str) -> dict[str, Any]:
    """A function call of an assistant message, checked as OpenAI checks it (`type`, `id`, and
    `function.name` and `function.arguments` as strings). A malformed call is refused, never
    dropped or coerced: a call without `type` is no function call by default. A custom tool call,
    well-formed for OpenAI, is refused as `unsupported_tool`, as a custom tool in `tools` is:
    no custom tool runs here, and dropping it would hide a call the model made (and leave a
    `tool` message answering it answering nothing)."""
    if not isinstance(c, dict):
        raise fields.type_error(at, "an object", c)
    call_id = fields.string(fields.required(c, "id", f"{at}.id"), f"{at}.id", nullable=False)
    kind = fields.one_of(fields.required(c, "type", f"{at}.type"), f"{at}.type", TOOL_CALL_TYPES, nullable=False)
    if kind == "custom":  # checked as OpenAI's schema has it first: a malformed one is named as such
        custom = fields.obj(fields.required(c, "custom", f"{at}.custom"), f"{at}.custom", nullable=False)
        assert custom is not None
        fields.required_string(custom, "name", f"{at}.custom.name")
        fields.required_string(custom, "input", f"{at}.custom.input")
        raise bad_request(
            f"{at}: custom tool calls are not supported (only function tools are)",
            f"{at}.type",
            code="unsupported_tool",
        )
    fn = fields.obj(fields.required(c, "function", f"{at}.function"), f"{at}.function", nullable=False)
    assert fn is not None and call_id is not None
    name = fields.string(fields.required(fn, "name", f"{at}.function.name"), f"{at}.function.name", nullable=False)
    args = fields.string(
        fields.required(fn, "arguments", f"{at}.function.arguments"), f"{at}.function.arguments", nullable=False
    )
    return {"id": call_id, "name": name, "arguments": args}


def legacy_function_call(value: Any, where: str) -> dict[str, Any] | None:
    """A deprecated assistant `function_call` ({name, arguments}) as a call of the history."""
    call = fields.obj(value, f"{where}.function_call")
    if call is None:
        return None
    name = fields.required_string(call, "name", f"{where}.function_call.name")
    args = fields.required_string(call, "arguments", f"{where}.function_call.arguments")
    return {"id": LEGACY_CALL_ID + str(name), "name": name, "arguments": args}


FUNCTIONS_MAX = 128


def legacy_tools(body: dict[str, Any]) -> tuple[list[ToolSpec], Any]:
    """(tools, tool_choice) of a request in the deprecated shape: `functions` are function tools,
    `function_call` ("none", "auto" or {"name": …}) is the tool choice. Not both shapes at once.
    The functions are checked where the client sent them: errors name `functions[i].name`."""
    for newer, older in (("tools", "functions"), ("tool_choice", "function_call")):
        if body.get(newer) is not None and body.get(older) is not None:
            raise bad_request(
                f"use either '{newer}' or the deprecated '{older}', not both", older, code="conflicting_parameters"
            )
    functions = fields.array(body.get("functions"), "functions", nullable=False)
    assert functions is not None
    if not 1 <= len(functions) <= FUNCTIONS_MAX:  # OpenAI's minItems 1, maxItems 128
        raise ApiError(
            400,
            f"Invalid 'functions': an array of {len(functions)} functions; expected 1 to {FUNCTIONS_MAX}.",
            code="empty_array" if not functions else "array_above_max_length",
            param="functions",
        )
    for i, f in enumerate(functions):
        fields.obj(f, f"functions[{i}]", nullable=False)
    specs = function_specs([(f, f"functions[{i}]") for i, f in enumerate(functions)], "functions")
    return specs, legacy_choice(body.get("function_call"))


def legacy_choice(call: Any) -> Any:
    """The deprecated `function_call` ("none", "auto" or {"name": …}) as a tool choice."""
    if isinstance(call, dict):
        name = fields.required_string(call, "name", "function_call.name")
        if not name:
            raise empty_name("function_call.name", "a function")
        return {"type": "function", "function": {"name": name}}
    if call is not None and not isinstance(call, str):
        raise fields.type_error("function_call", "one of 'none', 'auto' or an object", call)
    return fields.one_of(call, "function_call", ("none", "auto"))


def check_legacy_choice(choice: Any, names: set[str]) -> None:
    """A legacy `function_call` naming a function (`legacy_choice`'s tool choice) must name one the
    request offers (its `functions`, or the agent's own tools, as a `tool_choice` may): refused
    naming `function_call`, the field the client sent, before it is checked as a tool choice."""
    if not isinstance(choice, dict):
        return
    name = choice["function"]["name"]
    if name not in names:
        offered = ", ".join(sorted(names)) or "none"
        raise bad_request(
            f"Invalid 'function_call': function {fields.shown(name)} is not among the functions offered ({offered})",
            "function_call",
            code="invalid_tool_choice",
        )


def refuse_choice_without_functions(choice: Any) -> None:
    """A legacy `function_call` without `functions`, typed (`legacy_choice`): "none" and "auto" ask
    for nothing (clients send them as defaults), but {"name": …} forces a call of a function the
    request does not give, refused as OpenAI refuses it ("'function_call' is only allowed when
    'functions' are specified"), as a `tool_choice` naming no offered tool is, never dropped."""
    if isinstance(choice, dict):
        raise bad_request(
            "Invalid 'function_call': 'function_call' naming a function is only allowed when 'functions' are "
            f"specified (it names {fields.shown(choice['function']['name'])})",
            "function_call",
            code="invalid_tool_choice",
        )


def client_tools_of(tools: Any) -> list[ToolSpec]:
    """`tools`: each a `ChatCompletionTool`, whose `type` is required (left out 400
    `missing_required_parameter`, null or another JSON type `invalid_type`, as on Responses), a
    function the only kind taken here."""
    if fields.array(tools, "tools") is None:
        return []
    functions: list[tuple[dict[str, Any], str]] = []
    for i, t in enumerate(tools):
        fields.obj(t, f"tools[{i}]", nullable=False)
        fields.required_string(t, "type", f"tools[{i}].type")
        if t["type"] != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", "tools", code="unsupported_tool")
        at = f"tools[{i}].function"
        fn = fields.obj(fields.required(t, "function", at), at, nullable=False)
        assert fn is not None
        functions.append((fn, at))
    return function_specs(functions, "tools")


def function_specs(functions: list[tuple[dict[str, Any], str]], param: str) -> list[ToolSpec]:
    """The client's functions, each a `FunctionObject` at its path in the request (`tools[i].function`,
    or the legacy `functions[i]`): every error names that path (`param` a duplicate's field), never
    a field the client did not send."""
    out: list[ToolSpec] = []
    names: set[str] = set()
    for fn, at in functions:
        name = fields.function_name(fields.required(fn, "name", f"{at}.name"), f"{at}.name")
        fields.string(fn.get("description"), f"{at}.description")
        fields.boolean(fn.get("strict"), f"{at}.strict")
        if "parameters" in fn:
            fields.obj(fn["parameters"], f"{at}.parameters", nullable=False)
        if name in names:
            entry = at.removesuffix(".function")
            raise bad_request(
                f"{entry}: a second function named {fields.shown(name)}; function names must be unique",
                param,
                code="duplicate_function_name",
            )
        names.add(name)
        params = fn.get("parameters")
        strict = fn.get("strict")
        out.append(
            ToolSpec(
                name,
                str(fn.get("description") or ""),
                params if isinstance(params, dict) else {"type": "object", "properties": {}},
                strict if isinstance(strict, bool) else None,
            )
        )
    return out


# OpenAI's ranges; a value outside is the client's error (400 with `param`), not an upstream one.
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
MAX_OUTPUT_TOKENS = 10_000_000  # the most any agent may set (agent_admin.py); more is surely a mistake


def number_options(body: dict[str, Any], max_key: tuple[str, ...]) -> dict[str, Any]:
    """temperature, top_p and the output token limit, type- and range-checked."""
    opts: dict[str, Any] = {}
    for key, (low, high) in RANGES.items():
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise fields.type_error(key, "a number", v)
            if not low <= v <= high:
                code = "decimal_below_min_value" if v < low else "decimal_above_max_value"
                raise bad_request(f"Invalid '{key}': {v} is outside the range [{low:g}, {high:g}]", key, code=code)
            opts[key] = float(v)
    for key in max_key:
        v = body.get(key)
        if v is not None:
            v = fields.integer(v, key, nullable=False)
            assert v is not None
            if v < 1:
                raise bad_request(f"'{key}' must be a positive integer", key, code="integer_below_min_value")
            if v > MAX_OUTPUT_TOKENS:
                raise bad_request(
                    f"Invalid '{key}': {v} is too large; at most {MAX_OUTPUT_TOKENS}",
                    key,
                    code="integer_above_max_value",
                )
            opts["max_tokens"] = v
    return opts


def tool_names(server: Server, agent: AgentRecord, client: list[ToolSpec]) -> set[str]:
    """Every function a model call of this agent may be offered: its own tools and the client's."""
    return {t.name for t in server.tools.offered(agent)} | {t.name for t in client}


def own_tool_names(server: Server, agent: AgentRecord, client: list[ToolSpec]) -> set[str]:
    """The agent's own tools a model call is offered: those no client tool of the request shadows."""
    return {t.name for t in server.tools.offered(agent)} - {t.name for t in client}


CHOOSABLE = "only function tools (and this agent's own, as mcp) can be chosen"


def tool_choice_of(
    value: Any, names: set[str], agent: AgentRecord, own: set[str] | None = None, *, nested: bool = False
) -> Any:
    """A request's tool_choice, checked against the tools a call offers (`own`: those of them that
    are the agent's own), in the Chat Completions shape the providers take (Responses shapes are
    converted). None: not given. `nested`: the route's function choice holds its name under
    `function` (Chat Completions), so a choice with neither names `tool_choice.function` as missing
    (Responses: `tool_choice.name`)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(
                f"Invalid 'tool_choice': {fields.shown(value)}; use none, auto, required or a function",
                "tool_choice",
                code="invalid_tool_choice",
            )
        if value == "required" and not names:
            raise bad_request(
                "'tool_choice' is required but no tools are offered", "tool_choice", code="invalid_tool_choice"
            )
        return value
    if not isinstance(value, dict):
        raise bad_request("'tool_choice' must be a string or an object", "tool_choice", code="invalid_tool_choice")
    kind = fields.required_string(value, "type", "tool_choice.type")
    mine = own or set()
    if kind == "allowed_tools":
        spec, listed, where = allowed_tools_of(value)
        picked: list[str] = []
        for i, t in enumerate(listed):
            at = f"{where}.tools[{i}]"
            entry_kind = fields.required_string(t, "type", f"{at}.type")
            picked += [n for n in chosen_tools(t, at, entry_kind, names, agent, mine, nested=nested) if n not in picked]
        tools = [{"type": "function", "function": {"name": n}} for n in picked]
        return {"type": "allowed_tools", "allowed_tools": {"mode": spec["mode"], "tools": tools}}
    picked = chosen_tools(value, "tool_choice", kind, names, agent, mine, nested=nested)
    if len(picked) == 1:  # one tool: the plain function choice, which every provider takes
        return {"type": "function", "function": {"name": picked[0]}}
    # an mcp choice without a name: one of the agent's own tools must be called, never a client
    # function (which "required" over every offered tool would let the model pick)
    tools = [{"type": "function", "function": {"name": n}} for n in picked]
    return {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": tools}}


def chosen_tools(
    value: dict[str, Any], at: str, kind: str, names: set[str], agent: AgentRecord, own: set[str], *, nested: bool
) -> list[str]:
    """The functions a choice of type `kind` picks, `value` being the choice (`at` "tool_choice") or
    one tool of an allowed_tools choice (`at` "tool_choice.tools[i]"), both checked alike: a
    function by its name among `names`; an `mcp` one naming this agent (id or name), by its name
    among `own`, or without one every tool of `own`; another type is `unsupported_tool`."""
    if kind == "function":
        name = function_choice_name(value, at, nested=nested)
        if name not in names:
            offered = ", ".join(sorted(names)) or "none"
            raise bad_request(
                f"Invalid '{at}': function {fields.shown(name)} is not among the tools offered ({offered})",
                "tool_choice",
                code="invalid_tool_choice",
            )
        return [name]
    if kind != "mcp":
        raise bad_request(
            f"unsupported '{at}' type {fields.shown(kind)}: {CHOOSABLE}", "tool_choice", code="unsupported_tool"
        )
    label = fields.required_string(value, "server_label", f"{at}.server_label")
    if label not in (agent.id, agent.name):
        raise bad_request(
            f"'{at}' names MCP server {fields.shown(label)}; this agent's label is {agent.id} "
            f"(or its name, {fields.shown(agent.name)})",
            "tool_choice",
            code="unsupported_tool",
        )
    mcp_name = fields.string(value.get("name"), f"{at}.name")  # optional: any of the agent's tools
    if mcp_name is None:
        if not own:
            raise bad_request(
                f"Invalid '{at}': MCP server {label} offers no tools of its own on this request "
                "(none, or every one shadowed by a client tool of the same name)",
                "tool_choice",
                code="invalid_tool_choice",
            )
        return sorted(own)
    if not mcp_name:
        raise empty_name(f"{at}.name", "an mcp")
    if mcp_name not in own:
        # the server's own tools only (OpenAI refuses a name its MCP server lacks), never a client function
        mine = ", ".join(sorted(own)) or "none"
        raise bad_request(
            f"Invalid '{at}': MCP server {label} has no tool {fields.shown(mcp_name)} (its tools offered: {mine})",
            "tool_choice",
            code="invalid_tool_choice",
        )
    return [mcp_name]


def function_choice_name(value: dict[str, Any], at: str, *, nested: bool) -> str:
    """The name a function choice at `at` names: Chat's `function.name`, or Responses' `name` beside
    `type` (each route takes both). Left out: `missing_required_parameter` naming the route's own
    field (`at.function` on Chat, `at.name` on Responses); null or another type `invalid_type` and
    `""` `invalid_value`, naming the field, as every required string of a request is checked.
    Where both are given, the route's own shape names the tool (an allowed_tools entry is a tool
    definition that may carry other keys: a Responses one's `name` is its name)."""
    if "function" in value and (nested or "name" not in value):
        fn = fields.obj(value["function"], f"{at}.function", nullable=False)
        assert fn is not None
        param = f"{at}.function.name"
        name = fields.required_string(fn, "name", param)
    else:
        param = f"{at}.name" if "name" in value or not nested else f"{at}.function"
        if "name" not in value:
            shape = '{"type": "function", "function": {"name": …}}' if nested else '{"type": "function", "name": …}'
            raise ApiError(
                400,
                f"Missing required parameter: '{param}' (a function choice names its function: {shape}).",
                code="missing_required_parameter",
                param=param,
            )
        name = fields.required_string(value, "name", param)
    if not name:
        raise empty_name(param, "a function")
    return name


def empty_name(param: str, kind: str) -> ApiError:
    """A tool's name given as "": a name no tool has (never taken as "no name")."""
    return ApiError(
        400,
        f"Invalid '{param}': an empty string; {kind} choice names one of the tools offered.",
        code="invalid_value",
        param=param,
    )


def allowed_tools_of(value: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """(the object holding `mode` and `tools`, the listed tools, the path of that object) of an
    allowed_tools choice: Chat Completions nests them under `allowed_tools`, Responses puts them
    beside `type`. Both are required; the list names at least one tool, each an object with a
    `type` (checked by `chosen_tools` as a choice of its type)."""
    nested = "allowed_tools" in value
    spec = fields.obj(value.get("allowed_tools"), "tool_choice.allowed_tools", nullable=False) if nested else value
    assert spec is not None
    where = "tool_choice.allowed_tools" if nested else "tool_choice"
    if spec.get("mode") is None or spec.get("tools") is None:
        missing = "mode" if spec.get("mode") is None else "tools"
        raise bad_request(
            f"Missing required parameter: '{where}.{missing}' (an allowed_tools choice needs mode and tools)",
            "tool_choice",
            code="missing_required_parameter",
        )
    fields.one_of(spec["mode"], f"{where}.mode", ("auto", "required"), nullable=False)
    listed = fields.array(spec["tools"], f"{where}.tools", nullable=False)
    assert listed is not None
    if not listed:
        raise bad_request(
            f"Invalid '{where}.tools': an allowed_tools choice must list at least one tool",
            "tool_choice",
            code="invalid_tool_choice",
        )
    for i, t in enumerate(listed):
        fields.obj(t, f"{where}.tools[{i}]", nullable=False)
    return spec, listed, where


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
RESPONSE_FORMATS = ("text", "json_schema", "json_object")


def response_format_of(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    """Chat's `response_format`: text, json_object or json_schema (with json_schema.name)."""
    fmt = fields.obj(value, param)
    if fmt is None:
        return None
    fields.one_of(fields.required(fmt, "type", f"{param}.type"), f"{param}.type", RESPONSE_FORMATS, nullable=False)
    if fmt["type"] == "json_schema":
        inner = fields.obj(
            fields.required(fmt, "json_schema", f"{param}.json_schema"), f"{param}.json_schema", nullable=False
        )
        assert inner is not None
        schema_fields(inner, f"{param}.json_schema")
    return fmt


def schema_fields(fmt: dict[str, Any], param: str) -> None:
    """name (required, a function-like name), schema (an object), strict, description."""
    name = fields.required_string(fmt, "name", f"{param}.name")
    if not fields.FUNCTION_NAME.fullmatch(name or ""):  # an upstream would refuse it after the turn began
        raise bad_request(
            f"Invalid '{param}.name': {fields.shown(name)} does not match pattern. Expected a string that matches "
            "the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
            f"{param}.name",
            code="invalid_value",
        )
    fields.obj(fmt.get("schema"), f"{param}.schema")
    fields.boolean(fmt.get("strict"), f"{param}.strict")
    fields.string(fmt.get("description"), f"{param}.description")


STOP_MAX = 4  # stop sequences OpenAI takes at most


def sampling_options(body: dict[str, Any], *, max_key: tuple[str, ...]) -> dict[str, Any]:
    opts = number_options(body, max_key)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise fields.type_error("stop", "one of a string or array of strings", stop)
        fields.strings(stop, "stop")
        if not 1 <= len(stop) <= STOP_MAX:  # OpenAI's StopConfiguration: minItems 1, maxItems 4
            raise ApiError(
                400,
                "Invalid 'stop': empty array. Expected an array with minimum length 1, but got an empty array instead."
                if not stop
                else f"Invalid 'stop': array too long. Expected an array with maximum length {STOP_MAX}, "
                f"but got an array with length {len(stop)} instead.",
                code="empty_array" if not stop else "array_above_max_length",
                param="stop",
            )
        opts["stop"] = stop
    if response_format_of(body.get("response_format")) is not None:
        opts["response_format"] = body["response_format"]
    if fields.one_of(body.get("reasoning_effort"), "reasoning_effort", REASONING_EFFORTS) is not None:
        opts["reasoning_effort"] = body["reasoning_effort"]
    if fields.boolean(body.get("parallel_tool_calls"), "parallel_tool_calls") is not None:
        opts["parallel_tool_calls"] = body["parallel_tool_calls"]
    return opts


def user_and_metadata(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    user = fields.string(body.get("user"), "user")
    return fields.plain_text(user, "user"), dict(fields.metadata(body.get("metadata")) or {})


SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
VERBOSITY = ("low", "medium", "high")
MODERATION_KEYS = ("model", "policy")
MODERATION_POLICY_KEYS = ("input", "output")
MODERATION_MODES = ("score", "block")
SEARCH_CONTEXT_SIZES = ("low", "medium", "high")
LOCATION_KEYS = ("country", "region", "city", "timezone")


def shared_param_types(body: dict[str, Any], service_tiers: tuple[str, ...] = SERVICE_TIERS) -> None:
    """Fields both routes accept (used or ignored), checked against the types OpenAI gives them."""
    fields.integer(body.get("top_logprobs"), "top_logprobs", low=0, high=20)
    fields.string(body.get("safety_identifier"), "safety_identifier", max_length=64)
    fields.string(body.get("prompt_cache_key"), "prompt_cache_key")
    fields.one_of(body.get("prompt_cache_retention"), "prompt_cache_retention", ("in_memory", "24h"))
    fields.one_of(body.get("service_tier"), "service_tier", service_tiers)


def chat_param_types(body: dict[str, Any]) -> tuple[bool, bool]:
    """Type checks of the chat fields not checked where they are used; (stream, include_usage)."""
    shared_param_types(body)
    n = fields.integer(body.get("n"), "n", low=1, high=128)
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported: an agent gives one reply per turn", "n", code="unsupported_value")
    stream = bool(fields.boolean(body.get("stream"), "stream"))
    stream_options = fields.obj(body.get("stream_options"), "stream_options")
    if stream_options is not None and not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            code="invalid_stream_options",
        )
    options = stream_options or {}
    include_usage = (
        fields.boolean(options.get("include_usage"), "stream_options.include_usage", nullable=False)
        if ("include_usage" in options)
        else False
    )
    if "include_obfuscation" in options:
        fields.boolean(options["include_obfuscation"], "stream_options.include_obfuscation", nullable=False)
    fields.boolean(body.get("logprobs"), "logprobs")
    fields.boolean(body.get("store"), "store")
    for key in ("frequency_penalty", "presence_penalty"):
        fields.number(body.get(key), key, low=-2.0, high=2.0)
    fields.integer(body.get("seed"), "seed")
    fields.logit_bias(body.get("logit_bias"))
    refuse_audio_output(fields.strings(body.get("modalities"), "modalities", ("text", "audio")), body.get("audio"))
    fields.one_of(body.get("verbosity"), "verbosity", VERBOSITY)
    if body.get("functions") is None and body.get("function_call") is not None:
        refuse_choice_without_functions(legacy_choice(body["function_call"]))  # with them: legacy_tools
    prediction_of(body.get("prediction"))
    moderation_of(body.get("moderation"), refuse_unknown_keys=False)
    refuse_web_search(body.get("web_search_options"))
    return stream, bool(include_usage)


def prediction_of(value: Any) -> None:
    """`prediction` (Predicted Outputs: a speed-up, never a change to the answer): `type`
    "content" and a `content` that is a string or text parts. Accepted, not used; other keys are
    accepted, as chat accepts unknown nested keys."""
    prediction = fields.obj(value, "prediction")
    if prediction is None:
        return
    fields.one_of(
        fields.required(prediction, "type", "prediction.type"), "prediction.type", ("content",), nullable=False
    )
    content = fields.required(prediction, "content", "prediction.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise fields.type_error("prediction.content", "one of a string or array of objects", content)
    if not content:
        raise fields.empty_array("prediction.content")
    for i, part in enumerate(content):
        at = f"prediction.content[{i}]"
        fields.obj(part, at, nullable=False)
        fields.one_of(fields.required(part, "type", f"{at}.type"), f"{at}.type", ("text",), nullable=False)
        fields.string(fields.required(part, "text", f"{at}.text"), f"{at}.text", nullable=False)


def moderation_of(value: Any, *, refuse_unknown_keys: bool = True) -> None:
    """`moderation`: a `model` (a string, required) and a `policy` (an object or null), typed down to
    each `mode` as OpenAI's `ModerationParam` types it. Accepted, not used (both routes): this server
    runs no moderation. Another key is refused on Responses, accepted on chat, as each route treats
    unknown nested keys."""
    moderation = fields.obj(value, "moderation")
    if moderation is None:
        return
    if refuse_unknown_keys:
        fields.known_keys(moderation, "moderation", MODERATION_KEYS)
    fields.required_string(moderation, "model", "moderation.model")
    policy = fields.obj(moderation.get("policy"), "moderation.policy")
    if policy is None:
        return
    if refuse_unknown_keys:
        fields.known_keys(policy, "moderation.policy", MODERATION_POLICY_KEYS)
    for side in MODERATION_POLICY_KEYS:
        moderation_config_of(policy.get(side), f"moderation.policy.{side}", refuse_unknown_keys=refuse_unknown_keys)


def moderation_config_of(value: Any, at: str, *, refuse_unknown_keys: bool) -> None:
    """A policy's `input` / `output` (`ModerationConfigParam`, or null): its required `mode` one of
    `score` / `block`. `block` asks for flagged text to be stopped, which a server that runs no
    moderation cannot do: refused (400 `unsupported_value`), never dropped, so nobody counts on a
    block that never happens. `score` asks only for scores, which simply do not come."""
    config = fields.obj(value, at)
    if config is None:
        return
    if refuse_unknown_keys:
        fields.known_keys(config, at, ("mode",))
    mode = fields.one_of(fields.required(config, "mode", f"{at}.mode"), f"{at}.mode", MODERATION_MODES, nullable=False)
    if mode == "block":
        raise bad_request(
            f"Unsupported value: '{at}.mode' 'block': this server runs no moderation, so it cannot block "
            "flagged text; leave the policy out (or use 'score', which is accepted and gives no scores)",
            f"{at}.mode",
            code="unsupported_value",
        )


def refuse_web_search(value: Any) -> None:
    """`web_search_options` asks for a web search before the answer, which this server never
    does: typed as OpenAI types it, then refused (400 `unsupported_parameter`) as hosted tools
    are, never dropped (the answer would read as searched when it was not)."""
    options = fields.obj(value, "web_search_options")
    if options is None:
        return
    fields.one_of(options.get("search_context_size"), "web_search_options.search_context_size", SEARCH_CONTEXT_SIZES)
    location = fields.obj(options.get("user_location"), "web_search_options.user_location")
    if location is not None:
        at = "web_search_options.user_location"
        fields.one_of(fields.required(location, "type", f"{at}.type"), f"{at}.type", ("approximate",), nullable=False)
        approximate = fields.required(location, "approximate", f"{at}.approximate")
        fields.obj(approximate, f"{at}.approximate", nullable=False)
        for key in LOCATION_KEYS:
            if key in approximate:
                fields.string(approximate[key], f"{at}.approximate.{key}")
    raise bad_request(
        "Unsupported parameter: 'web_search_options': this server does no web search (its agents answer with "
        "their own tools only); leave it out",
        "web_search_options",
        code="unsupported_parameter",
    )


def refuse_audio_output(modalities: list[str] | None, audio: Any) -> None:
    """Spoken answers (`modalities` with "audio", an `audio` output setting) are refused, never
    answered with text alone as if they had been heard: this server answers with text only."""
    if modalities and "audio" in modalities:
        raise bad_request(
            "Unsupported value: 'modalities' includes 'audio': this server answers with text only (use [\"text\"])",
            "modalities",
            code="unsupported_value",
        )
    if audio is not None:
        raise bad_request(
            "Unsupported parameter: 'audio': this server answers with text only, never with audio",
            "audio",
            code="unsupported_parameter",
        )


def turn_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """Client tools as a turn record keeps them."""
    return [t.to_record() for t in tools]


def blank_input(content: str | list[dict[str, Any]] | None) -> bool:
    """New input with nothing to answer, by the rule the kernel's submit refuses it with: text that
    is empty or only whitespace, or parts that are all blank text parts (no image or file). The
    routes refuse it (400 `missing_input`) before a conversation is placed or created."""
    return content is None or kernel_blank_input(content)


def new_content(users: list[ViewItem]) -> str | list[dict[str, Any]] | None:
    """The kernel input of the trailing user messages: their texts joined (plain text), else every
    message's parts in the order sent."""
    if not users:
        return None
    return users_content(users)


def show_reasoning(agent: AgentRecord) -> bool:
    """The agent's presentation policy for reasoning on HTTP (params.reasoning = hidden turns it off)."""
    return str(agent.params.get("reasoning", "shown")) != "hidden"


def calls_unanswered(call_ids: list[str]) -> ApiError:
    """New user input while the turn waits for tool results or an approval: OpenAI's own 400."""
    return bad_request(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. "
        f"The following tool_call_ids did not have response messages: {', '.join(call_ids)}",
        "messages",
        code="tool_calls_unanswered",
    )


# ---------------------------------------------------------------- rendering


def blocks_after(snap: TurnSnapshot, run: TurnRun) -> list[dict[str, Any]]:
    return [b for _, b in new_blocks(snap, run)]


def render_text(blocks: list[dict[str, Any]], kind: str = "text", *, refusal: bool = False) -> str:
    """The text of the blocks of `kind`; of text blocks, the answer's or (`refusal`) the refusal's."""
    return "\n\n".join(
        b["text"] for b in blocks if b["type"] == kind and b["text"] and bool(b.get("refusal")) == refusal
    )


def usage_of(snap: TurnSnapshot, base: dict[str, int] | None = None) -> dict[str, Any]:
    """The usage of this request's model calls (`base`: the turn's when the request resumed it)."""
    u = request_usage(snap.usage, base)
    prompt, completion = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))},
        "completion_tokens_details": {"reasoning_tokens": int(u.get("reasoning_tokens", 0))},
    }


def finish_of(snap: TurnSnapshot) -> str:
    if snap.status == "awaiting":
        return "tool_calls"
    return FINISH.get(snap.stop_reason or "end_turn", "stop")


def turn_cancelled(snap: TurnSnapshot) -> ApiError:
    """The answer to a request whose turn was cancelled before it showed any text (a WebSocket
    client's `cancel`; a queued input dropped, its error kind `withdrawn`): chat has no finish
    reason for it, and an empty `stop` would read as the agent's whole reply. 409, never retried by
    the SDKs: the cancel was someone's decision (Responses answers `status: "cancelled"`)."""
    err = snap.error or {}
    dropped = err.get("kind") == "withdrawn"
    why = (
        "this input was withdrawn from the queue before it started; nothing of it was written to the conversation"
        if dropped
        else "the turn was cancelled before it produced a reply"
    )
    return ApiError(409, why, code="turn_cancelled", headers={"x-should-retry": "false"})


def ends_reply(snap: TurnSnapshot) -> bool:
    """A pause a chat reply ends at: client tool calls end the request; an approval waits for a
    WebSocket client (or the timeout). A repeat after a crash ends where its first reply did."""
    return bool(client_pending(snap))


def tool_calls_of(snap: TurnSnapshot) -> list[dict[str, Any]]:
    return [
        {"id": p["call_id"], "type": "function", "function": {"name": p["name"], "arguments": p["arguments"] or ""}}
        for p in client_pending(snap)
    ]


# ---------------------------------------------------------------- the route


class ChatCompletions:
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

    async def post(self, request: Request) -> Response:
        principal = principal_of(request)
        body, _ = await read_json(request)
        # a read, which may wait for the writer (a lock held elsewhere): a revoke meanwhile ends it
        agent, model_id = await until_credential_ends(request, resolve_model(self.server, principal, body.get("model")))
        stream, include_usage = chat_param_types(body)
        items, instructions = view_of_messages(body.get("messages"))
        check_call_ids(items, "messages")
        items = for_agent(items, agent)
        legacy = body.get("functions") is not None  # the deprecated function calling, still OpenAI's
        tools, raw_choice = (
            legacy_tools(body) if legacy else (client_tools_of(body.get("tools")), body.get("tool_choice"))
        )
        options = sampling_options(body, max_key=("max_tokens", "max_completion_tokens"))
        if legacy:
            options["parallel_tool_calls"] = False  # a legacy reply holds one function_call
            check_legacy_choice(raw_choice, tool_names(self.server, agent, tools))
        choice = tool_choice_of(
            raw_choice,
            tool_names(self.server, agent, tools),
            agent,
            own_tool_names(self.server, agent, tools),
            nested=True,
        )
        if choice is not None:
            options["tool_choice"] = choice
        if instructions:
            options["instructions"] = instructions
        # the request carries its whole transcript (its system messages instruct this turn): the
        # system messages the conversation keeps (a Responses request's) stay out of its view
        options[OWN_SYSTEM] = True
        user, metadata = user_and_metadata(body)
        # the request sends its whole transcript: a tool round before its new user message is history
        prefix, new = split_after_results(*split_new_input(items), "messages")
        users = [i for i in new if i.kind == "user"]
        results = [i for i in new if i.kind == "tool"]
        if not users and not results:
            raise bad_request(
                "the last message must be a user message or tool results", "messages", code="missing_input"
            )
        if users and results:
            stray = results_without_call(items)
            if stray:  # not a mix: these results answer nothing (as new input alone they would be refused so)
                raise bad_request(
                    f"the tool messages for {', '.join(stray)} answer no tool call of an assistant message before them",
                    "messages",
                    code="unknown_tool_call",
                )
            raise bad_request(
                "send tool results and a new user message in separate requests", "messages", code="mixed_input"
            )
        refuse_stray_results(items, prefix, results)
        content = new_content(users)  # computed once: checked here, submitted below
        if users and blank_input(content):  # the kernel's rule, before anything is placed
            raise bad_request(
                "the new user input is empty: there is nothing to answer", "messages", code="missing_input"
            )
        unanswered = unanswered_calls(items, answering=not users)
        if unanswered:
            raise calls_unanswered(unanswered)
        # every user message's parts, the history's too (seeded into a new conversation, they reach the model)
        check_media(self.server, agent, [p for u in items if u.kind == "user" for p in u.parts], "messages")
        check_format(self.server, agent, options.get("response_format"), "response_format")
        given = [Decision(r.call_id or "", "result", output=r.text) for r in results]
        answers = (
            Answers([d.call_id for d in given], turn_tools(tools), options, "messages", given=given)
            if results
            else None
        )
        if answers is not None and legacy:
            answers.shown, answers.shown_results = legacy_round(prefix)

        idem, replay = await Idempotency.begin(self.server, request, principal, "chat.completions", body)
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
                await idem.earlier([d.call_id for d in given], ends=ends_reply) if idem is not None else (None, None)
            )
            if earlier is not None:
                run = earlier  # this key's turn, accepted before the server stopped: follow it
            else:
                seat.take(options, answering=not users)  # past the cap: 429 before anything is written
                ns = conversation_namespace(principal)
                header = request.headers.get(HEADER)
                # Placing the input reads (and may write) the store, which may keep it waiting
                # (a lock): a credential revoked meanwhile ends the request (401) there. A keyed
                # repeat of a turn that answered nothing re-runs it where it ran (`by_rerun`), one
                # answering calls too; legacy `function` results, which name no call, are placed
                # as ever (only a transcript's round tells which calls they answer).
                legacy_answers = any(legacy_name(d.call_id) is not None for d in given)
                rerun = None if legacy_answers else rerun_unnamed(key, header)
                if rerun is not None:
                    place = await until_credential_ends(request, self.matcher.by_rerun(agent, ns, rerun))
                if place is not None:
                    pass  # its turn's conversation
                elif header:
                    place = await until_credential_ends(
                        request, self.matcher.by_header(agent, ns, header, prefix, user, metadata, answers)
                    )
                else:
                    place = await until_credential_ends(
                        request,
                        self.matcher.by_prefix(
                            agent, ns, prefix, user, metadata, answers, while_pending=calls_unanswered
                        ),
                    )
                decisions = await until_credential_ends(
                    request, named_answers(self.server, place, given, answers.shown if answers else [])
                )
                target, resumed = await until_credential_ends(
                    request,
                    self._answer_point(
                        agent, ns, place, decisions, answers, user, metadata, answer_settings(options, tools), key
                    ),
                )
                place = target  # a fork when other requests answered the round first (released below)
                run = resumed or await start_turn(
                    self.server,
                    agent,
                    target.conversation_id,
                    content=content,
                    decisions=decisions,
                    client_tools=tools,
                    options=options,
                    source={"kind": "openai_chat", "user": user} if user else {"kind": "openai_chat"},
                    overlap_accept=not stream,  # a non-stream reply acknowledges only once the turn settled
                    while_pending=calls_unanswered,
                    answers_param="messages",
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
        if not stream:
            # Let the turn's worker run up to its model call before this request sets up its wait:
            # that setup then overlaps the wait for the model instead of delaying the call.
            await asyncio.sleep(0)
        prefix_hash = chain(prefix)
        ctx = _Ctx(self, agent, model_id, run, idem, new, prefix_hash, show_reasoning(agent), legacy)
        if stream:
            return ctx.stream_response(include_usage, request)
        return await ctx.complete(request)

    async def _answer_point(
        self,
        agent: AgentRecord,
        ns: str | None,
        place: Placement,
        decisions: list[Decision],
        answers: Answers | None,
        user: str | None,
        metadata: dict[str, Any],
        settings: TurnSettings,
        idempotency: tuple[str, str] | None = None,
    ) -> tuple[Placement, TurnRun | None]:
        """Answers placed at the head of a conversation paused at their calls: applied there (the
        resumed turn, its model calls from then on with the request's `settings`), or, when other
        requests answered that round first (on another server of a
        cluster, where this server's claim does not reach), a fork from the point to answer them
        in, as the second of two racing on one server forks (docs/openai.md "Racing requests").
        (place, None): start_turn answers, in `place`, as ever."""
        turn = place.paused_turn
        if turn is None or answers is None:
            return place, None
        resumed = await answer_paused(self.server, place.conversation_id, turn, decisions, settings, idempotency)
        if resumed is not None or not await round_answered(self.server, turn, decisions):
            return place, resumed
        fork = await self.matcher.fork_lost(
            agent, ns, place, answers, user=user, metadata=metadata, while_pending=calls_unanswered
        )
        return fork, None


_MARK = "\x00text\x00"  # stands for the text while a text delta's frame is split around it


class _Ctx:
    def __init__(
        self,
        route: ChatCompletions,
        agent: AgentRecord,
        model_id: str,
        run: TurnRun,
        idem: Idempotency | None,
        new: list[ViewItem],
        prefix_hash: str,
        reasoning: bool,
        legacy: bool = False,
    ) -> None:
        self.legacy = legacy  # the request used `functions`: a call is answered as `function_call`
        self.route = route
        self.server = route.server
        self.agent = agent
        self.model_id = model_id
        self.run = run
        self.idem = idem
        self.new = new
        self.prefix_hash = prefix_hash
        self.reasoning = reasoning
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self._content_frame: tuple[str, str] | None = None  # chunk(): a text delta's frame around its text
        # stream_options.include_usage: every chunk but the last (the usage chunk) has "usage": null
        self.include_usage = False
        self.created = int(time.time())
        self.headers = {HEADER: run.conversation_id}
        self.keepalive = float(self.server.config.limits.sse_keepalive_s)
        self.steps_note = max_steps_note(self.server, agent)

    def settled(self, snap: TurnSnapshot) -> bool:
        if snap.status in TERMINAL_STATUSES:
            return True
        return snap.status == "awaiting" and ends_reply(snap) and snap.revision > self.run.after_revision

    async def record_point(self, snap: TurnSnapshot, text: str, calls: list[dict[str, Any]]) -> None:
        if failed_answer(snap):
            return
        reply = ViewItem(
            "assistant",
            text,
            calls=[
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
            ],
        )
        await self.route.matcher.record(
            self.agent.id,
            self.run.conversation_id,
            chain([*self.new, reply], self.prefix_hash),
            self.run.handle.controller.last_message_id,  # the reply's own id: no read, no race
        )

    # -------------------------------------------------------- non-stream

    async def complete(self, request: Request) -> Response:
        try:
            snap = await settle_or_cancel(request, self.run, self.settled)
            blocks = blocks_after(snap, self.run)
            text = render_text(blocks)
            refusal = render_text(blocks, refusal=True)
            if failed_answer(snap):
                # Cut short (the upstream broke off, the store could not keep it, the server
                # running it stopped): a part of a reply is no reply, whatever text came before.
                # What was shown stays in the history.
                raise await turn_error(self.server, self.agent.id, snap.error)
            if snap.status == "cancelled" and not (text or refusal):
                raise turn_cancelled(snap)  # an empty `stop` would read as the agent's whole reply
            if snap.stop_reason == "max_steps":
                text = f"{text}\n\n{self.steps_note}" if text else self.steps_note
            calls = self.reply_calls(snap)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if (text or not (calls or refusal)) else None,
                "refusal": refusal or None,
                "annotations": [],
            }
            if calls and self.legacy:  # the deprecated shape: no id (a `function` message answers it)
                message["function_call"] = dict(calls[0]["function"])
            elif calls:
                message["tool_calls"] = calls
            if self.reasoning:
                thought = render_text(blocks, "reasoning")
                if thought:
                    message["reasoning_content"] = thought
            body = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model_id,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish(snap)}],
                "usage": usage_of(snap, self.run.base_usage),
            }
        except BaseException as exc:
            if self.idem is not None:
                await self.idem.abandon()
            if isinstance(exc, ApiError):  # the turn was accepted: its input is in this conversation
                exc.headers.setdefault(HEADER, self.run.conversation_id)
            raise
        data = dumps(body)
        await self.commit_point(snap, text, calls)
        if self.idem is not None:
            await keep_or_free(self.idem, snap, data, self.run.conversation_id)
        return JSONReply(data, self.headers)

    async def commit_point(self, snap: TurnSnapshot, text: str, calls: list[dict[str, Any]]) -> None:
        """The reply's history point, committed before the reply (a stream's last chunk) goes out:
        the client's next request, on this server or another of a cluster, after a kill -9 too,
        finds it and continues this conversation (answers to the reply's calls resume its paused
        turn). It is part of what the reply acknowledges. A store failing now does not take the
        reply back (the turn is committed already): the reply goes out, one line is logged, and
        the client's next request forks or starts a conversation seeded with its transcript."""
        try:
            await self.record_point(snap, text, calls)
        except StoreUnavailable as exc:  # the database is away: one line
            log.warning("could not record the history point of conversation %s: %s", self.run.conversation_id, exc)
        except Exception:
            log.exception("could not record the history point of conversation %s", self.run.conversation_id)

    def reply_calls(self, snap: TurnSnapshot) -> list[dict[str, Any]]:
        """The client calls the reply shows, the same in a stream and non-stream: those its turn
        waits for; of a reply that ended otherwise (the token limit or the content filter cut it
        off mid-call), the calls the model began in it, their arguments as far as they came, as
        OpenAI returns them. The turn ended and closed those: an answer to one is a 400
        `already_resolved` (`refuse_closed_calls`)."""
        if snap.status == "awaiting":
            return self.shown(tool_calls_of(snap))
        return self.shown(
            [
                {
                    "id": b["call_id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": b.get("arguments") or ""},
                }
                for b in blocks_after(snap, self.run)
                if b["type"] == "tool_call" and b.get("executor") == "client"
            ]
        )

    def shown(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The open calls the reply shows: all, or with the deprecated `functions` the first only
        (a legacy message holds one `function_call`; the next comes back once it is answered). The
        history point holds the same, so the client's answer continues this conversation."""
        return calls[:1] if self.legacy else calls

    def finish(self, snap: TurnSnapshot) -> str:
        reason = finish_of(snap)
        return "function_call" if self.legacy and reason == "tool_calls" else reason

    def call_delta(self, index: int, call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
        """A stream delta of a client call: `tool_calls`, or the deprecated `function_call`."""
        if self.legacy:
            return {
                "function_call": {"name": name, "arguments": arguments}
                if name is not None
                else {"arguments": arguments}
            }
        if name is not None:
            return {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                ]
            }
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}

    # -------------------------------------------------------- stream

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        if finish is None and len(delta) == 1:
            text = delta.get("content")
            if type(text) is str:  # a text delta, most chunks of a stream: only the text is encoded
                head, tail = self._content_frame or self._split_content_frame()
                return head + dumps(text) + tail
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model_id,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            body["usage"] = None
        return dumps(body)

    def _split_content_frame(self) -> tuple[str, str]:
        """The chunk of a text delta around its text: the same bytes `dumps` writes for the whole."""
        whole = self.chunk({"content": _MARK, "_": None})  # two keys: the general path
        head, _, tail = whole.partition(dumps(_MARK) + ',"_":null')
        self._content_frame = (head, tail)
        return head, tail

    def stream_response(self, include_usage: bool, request: Request) -> Response:
        metrics = self.route.metrics
        self.include_usage = include_usage  # before the first chunk: the text frame is cut from one
        finished = False
        direct = DirectWrites()  # frames the turn's task writes itself (the tap below)

        async def produce() -> AsyncIterator[str | None]:
            nonlocal finished
            metrics.active_streams.inc()
            stopping = self.route.stopping
            watcher = watch_credential(request, stopping)  # its end ends the stream (credential_end.py)
            try:
                # The role chunk goes out at once (it says the input was accepted), before it is
                # known whether the reply is text, a refusal or tool calls: it carries no `content`,
                # so a refusal's (or tool calls') message accumulates `content` null, as OpenAI's
                # streams and the non-stream answer have it, and a text's its text.
                yield self.chunk({"role": "assistant"})
                sent: dict[int, int] = {}  # block index → characters sent
                call_index: dict[str, int] = {}
                any_text = False
                any_refusal = False
                last: TurnSnapshot | None = None
                me = asyncio.current_task()

                def tap(index: int, kind: str, refusal: bool, text: str) -> bool:
                    """A delta continuing block `index` (all of it shown before), while this stream
                    waits: its chunk written at once (`DirectWrites.write_now`), as the loop below
                    would write it; False leaves it to the loop."""
                    if kind == "reasoning" and not self.reasoning:
                        return True  # not shown: nothing to write
                    done = sent.get(index)
                    if done is None or stopping.stopped or stopping.ended(me):
                        return False  # (a block's first piece goes the usual way: it may need "\n\n")
                    write = direct.write_now
                    if write is None:
                        return False
                    if kind == "text" and not refusal:  # the usual token: `chunk`'s own text frame
                        head, tail = self._content_frame or self._split_content_frame()
                        frame = head + dumps(text) + tail
                    elif refusal:
                        frame = self.chunk({"refusal": text})
                    elif kind == "reasoning":
                        frame = self.chunk({"reasoning_content": text})
                    else:
                        return False
                    if not write(frame):
                        return False
                    sent[index] = done + len(text)
                    return True

                # The hand is only for blocks numbered as the controller numbers them (a new turn).
                hand = tap if self.run.base_blocks == 0 else None
                async for snap in self.run.snapshots(self.keepalive, self.route.stopping, hand):
                    if snap is None:
                        yield None
                        continue
                    last = snap
                    blocks = blocks_after(snap, self.run)
                    for i, b in enumerate(blocks):
                        if b["type"] == "text" or (b["type"] == "reasoning" and self.reasoning):
                            full = b["text"]
                            done = sent.get(i, 0)
                            if len(full) > done:
                                piece = full[done:]
                                if b.get("refusal"):
                                    any_refusal = True
                                    yield self.chunk({"refusal": piece})  # OpenAI's field for it
                                elif b["type"] == "text":
                                    if done == 0 and any_text:
                                        piece = "\n\n" + piece
                                    any_text = True
                                    yield self.chunk({"content": piece})
                                else:
                                    yield self.chunk({"reasoning_content": piece})
                                sent[i] = len(full)
                        elif b["type"] == "tool_call" and b.get("executor") == "client":
                            cid = b["call_id"]
                            args = b.get("arguments") or ""
                            if cid not in call_index:
                                if self.legacy and call_index:
                                    continue  # a legacy reply shows one call
                                call_index[cid] = len(call_index)
                                sent[i] = 0
                                yield self.chunk(self.call_delta(call_index[cid], cid, b["name"], ""))
                            done = sent.get(i, 0)
                            if len(args) > done:
                                yield self.chunk(self.call_delta(call_index[cid], cid, None, args[done:]))
                                sent[i] = len(args)
                    if self.settled(snap):
                        break
                    if snap.status == "awaiting" and approval_pending(snap):
                        continue  # waiting for an approval from a WebSocket client, with keepalives
                if self.run.handle.unreadable and (last is None or not self.settled(last)):
                    # its end cannot be read here (cut off from the cluster): no failure, which it
                    # may not have had, but the 503 a retry with the key answers (`unread_answer`)
                    err = unread_answer(self.run)
                    yield dumps(error_body(err.status, err.message, code=err.code))
                    yield "[DONE]"
                    return
                if last is None or not self.settled(last):  # the server stops, or the credential ended
                    # An error event the SDKs raise, as for a failed turn; no replay is stored.
                    ended = stopping.ended(asyncio.current_task())
                    if ended is not None:  # its turn is cancelled, as when its client leaves
                        await self.run.cancel()
                    else:
                        await self.run.withdraw_if_queued()  # a turn that never started does not run later
                    err = ended or shutting_down()
                    yield dumps(error_body(err.status, err.message, code=err.code))
                    yield "[DONE]"
                    return
                if failed_answer(last):  # after text too: the stream ends in an error, not `stop`
                    err = await turn_error(self.server, self.agent.id, last.error)
                    yield dumps(error_body(err.status, err.message, code=err.code))
                    yield "[DONE]"
                    # not `finished`: a failed or interrupted turn is no answer (NOT_ANSWERS), its
                    # key is freed and a retry runs anew, as the non-stream answer and Responses do
                    return
                if last.status == "cancelled" and not (
                    render_text(blocks_after(last, self.run)) or render_text(blocks_after(last, self.run), refusal=True)
                ):  # cancelled before it showed any text: no reply, not an empty `stop`
                    err = turn_cancelled(last)
                    yield dumps(error_body(err.status, err.message, code=err.code))
                    yield "[DONE]"
                    return  # not `finished`: a cancelled turn keeps no answer for its key
                if last.stop_reason == "max_steps":
                    yield self.chunk({"content": f"\n\n{self.steps_note}" if any_text else self.steps_note})
                    any_text = True
                calls = self.reply_calls(last)
                if not (any_text or any_refusal or calls or call_index):
                    yield self.chunk({"content": ""})  # an empty reply: content "", as non-stream
                for c in calls:  # calls made before this request (not streamed above)
                    if c["id"] not in call_index and not (self.legacy and call_index):
                        call_index[c["id"]] = len(call_index)
                        fn = c["function"]
                        yield self.chunk(self.call_delta(call_index[c["id"]], c["id"], fn["name"], fn["arguments"]))
                shown = render_text(blocks_after(last, self.run))
                if last.stop_reason == "max_steps":
                    shown = f"{shown}\n\n{self.steps_note}" if shown else self.steps_note
                await self.commit_point(last, shown, calls)  # before the finish chunk and [DONE]
                yield self.chunk({}, self.finish(last))
                if include_usage:
                    yield dumps(
                        {
                            "id": self.id,
                            "object": "chat.completion.chunk",
                            "created": self.created,
                            "model": self.model_id,
                            "choices": [],
                            "usage": usage_of(last, self.run.base_usage),
                        }
                    )
                yield "[DONE]"
                finished = last.status not in NOT_ANSWERS  # a cancelled turn's text frees the key
            finally:
                metrics.active_streams.dec()
                if watcher is not None:
                    watcher.cancel()
                    stopping.forget(asyncio.current_task())

        on_close = stream_replay(self.idem, self.run.conversation_id, lambda: finished)
        return SSEResponse(  # type: ignore[return-value]
            produce(), headers=self.headers, on_disconnect=self.run.cancel, on_close=on_close, direct=direct
        )
