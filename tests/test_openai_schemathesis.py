"""Check 10: schemathesis (positive mode, fixed seed, ~25 examples per operation) over
listModels, createChatCompletion and createResponse: no 5xx and no schema violation.

Bodies are generated from OpenAI's own schema, so each is valid; `model` always names the echo
agent. A body is sent as generated, where a 4xx must carry one of the ALLOWED_REFUSALS, and, when
it holds such a trigger, once more "aimed": the same body (still schema-valid, checked) without the
triggers (a trailing user message when the transcript has no new user input, only client function
tools and no deprecated `functions`, `n` = 1, token limits 1..10^7, no file/audio parts (echo takes
none), no hosted-tool input items or item references, no forced/named `tool_choice`, no
`stream_options` without `stream`, integers clamped to 64 bits, no `background`;
`previous_response_id` and `conversation` pointed at objects this run created), so that the rest
of it (sampling, formats, tools, images,
metadata, …) runs a real turn, and nearly all aimed requests must succeed. A second, smaller run
does the same with `stream: true`, validating every SSE chunk / Responses event and how each
stream ends.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.openai_schema import document, require_conformance, sse_lines, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

schemathesis = pytest.importorskip("schemathesis")

SEED = 20260830
EXAMPLES = 25
STREAM_EXAMPLES = 12
MIN_SUCCESS_SHARE = 0.9  # of the aimed POST requests; all succeed with these seeds (and seeds 1–18)
OPERATIONS = {
    ("GET", "/models"): "listModels",
    ("POST", "/chat/completions"): "createChatCompletion",
    ("POST", "/responses"): "createResponse",
}
REQUEST_SCHEMA = {
    "createChatCompletion": "CreateChatCompletionRequest",
    "createResponse": "CreateResponse",
}
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
NUDGE = "schemathesis says hello"

# Every 4xx a schema-valid body may get, and why the server is right to refuse it.
ALLOWED_REFUSALS: dict[tuple[int, str], str] = {
    # an agent turn answers new user input: a transcript ending with an assistant, system or
    # developer message, an empty user text or an absent/empty `input` leaves nothing to answer
    (400, "missing_input"): "no new user input",
    # tool results resume a paused turn, new user text starts one: both at once is ambiguous
    (400, "mixed_input"): "tool results and a user message together",
    # tool results / function_call_output for calls this server never made: no turn waits for them
    (409, "not_awaiting"): "tool results with no paused turn",
    # a tool result item without a call id cannot be matched to any call (call_id is nullable)
    (400, "missing_call_id"): "function_call_output without call_id",
    # issue 3: `n` other than 1 → 400 (an agent gives one reply per turn)
    (400, "unsupported_value"): "n != 1",
    # custom, hosted and MCP tools cannot be honoured: the agent's own tools run on the server,
    # only client function tools are passed through
    (400, "unsupported_tool"): "non-function client tool",
    # the schema sets no minimum on max_tokens / max_completion_tokens / max_output_tokens;
    # a limit below 1 cannot be met (OpenAI refuses it with this same code)
    (400, "integer_below_min_value"): "token limit below 1, or max_tool_calls below 0",
    # a function name outside ^[a-zA-Z0-9_-]{1,64}$ (FunctionObject.name says so in words, so the
    # generator does not know it): OpenAI refuses it too
    (400, "invalid_function_name"): "function name not of a-z, A-Z, 0-9, _ and -, at most 64",
    # generated ids name nothing on this server
    (404, "previous_response_not_found"): "unknown previous_response_id",
    (404, "conversation_not_found"): "unknown conversation",
    # OpenAI refuses previous_response_id together with conversation too
    (400, "conflicting_parameters"): "previous_response_id and conversation",
    # background responses need a job queue this server does not have
    (400, "unsupported_parameter"): "background: true",
    # issue 13.2: tool results that answer no call of the assistant message before them
    (400, "unknown_tool_call"): "tool results for calls the history does not make",
    # issue 13.8: out of OpenAI's ranges (no maximum in the schema for token limits), a
    # tool_choice naming a tool that is not offered, stream_options without stream
    (400, "integer_above_max_value"): "token limit above 10,000,000",
    (400, "decimal_above_max_value"): "temperature / top_p above range",
    (400, "decimal_below_min_value"): "temperature / top_p below range",
    (400, "invalid_tool_choice"): "tool_choice naming no offered tool",
    (400, "invalid_stream_options"): "stream_options without stream",
    # issue 13.9: echo takes no files or audio, and they are never dropped silently
    (400, "unsupported_content_part"): "file / audio part for the echo model",
    (400, "invalid_content_part"): "file part without file_data or file_id",
    # issue 13.10 / 13.13: generated ids name no stored item; hosted-tool items have no tool here
    (400, "item_not_found"): "item_reference to nothing stored",
    (400, "unsupported_item_type"): "input item of a hosted tool this server does not run",
    # integers beyond 64 bits cannot be parsed faithfully (appserver/strictjson.py)
    (400, "invalid_json"): "integer outside the 64-bit range",
    # a call of the transcript that no later tool result answers: OpenAI refuses it (the schema
    # cannot say so), and it would reach the model with a made-up result
    (400, "tool_calls_unanswered"): "a tool call the history leaves unanswered",
    # a json_schema format name outside ^[a-zA-Z0-9_-]{1,64}$ (said in words only): OpenAI refuses it
    (400, "invalid_value"): "response format name not of a-z, A-Z, 0-9, _ and -, at most 64",
    # an assistant reply that makes two tool calls with one id: a result could not say which it answers
    (400, "duplicate_tool_call_id"): "repeated tool call ids in one reply",
    # a field the Responses API does not know, top-level or in a nested object (`reasoning.x`,
    # `text.format.x`; the schema does not close the objects, but OpenAI refuses unknown
    # parameters, and a dropped one would go unnoticed)
    (400, "unknown_parameter"): "a field CreateResponse (or an object in it) does not have",
}
MAX_TOKENS = 10_000_000
INT64 = (-(2**63), 2**63 - 1)
SUPPORTED_ITEMS = {
    "message",
    "function_call",
    "function_call_output",
    "mcp_approval_response",
    "mcp_approval_request",
    "mcp_call",
    "mcp_list_tools",
    "reasoning",
}


@dataclass
class Tally:
    """What one run saw: status counts per (variant, operation), failures, ids to continue from."""

    statuses: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    continued: int = 0  # aimed requests sent with a previous_response_id or conversation of this run
    response_ids: list[str] = field(default_factory=list)
    conversation_ids: list[str] = field(default_factory=list)

    def share_2xx(self, op_id: str) -> float:
        ok = sum(n for k, n in self.statuses.items() if k.startswith(f"aimed:{op_id}:2"))
        total = sum(n for k, n in self.statuses.items() if k.startswith(f"aimed:{op_id}:"))
        return ok / total if total else 0.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("schemathesis") / "home"
    env = cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="1000")
    assert run_cli(home, "agents", "list", env=env).code == 0
    with serving(home, env=env) as sp:
        yield sp


@pytest.fixture(scope="module")
def schema(srv: ServeProcess) -> Any:
    raw = document("openai-openapi.json")
    paths = {p: {m: op for m, op in item.items() if (m.upper(), p) in OPERATIONS} for p, item in raw["paths"].items()}
    spec = dict(raw, paths={p: ops for p, ops in paths.items() if ops}, servers=[{"url": srv.url + "/v1"}])
    return schemathesis.openapi.from_dict(spec)


def has_user_text(item: Any) -> bool:
    """A user message with text or an image in it: new input a turn can answer."""
    if not isinstance(item, dict) or item.get("role") != "user" or item.get("type", "message") != "message":
        return False
    content = item.get("content")
    if isinstance(content, str):
        return content != ""
    return isinstance(content, list) and any(
        isinstance(p, dict) and (p.get("text") or p.get("image_url")) for p in content
    )


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def keep_function_tools(body: dict[str, Any], named: Callable[[dict[str, Any]], Any]) -> None:
    """Only function tools, named as OpenAI takes a function name."""
    if isinstance(body.get("tools"), list):
        body["tools"] = [
            t
            for t in body["tools"]
            if isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(named(t), str)
            and FUNCTION_NAME.fullmatch(named(t))
        ]


def new_user_turn(items: list[Any], answered: Callable[[Any], bool], results: Callable[[Any], bool]) -> None:
    """Make `items` end with a user message that starts a turn: tool results after the last
    assistant item are closed by an assistant reply (they become history), then a user message."""
    last = max((i for i, it in enumerate(items) if answered(it)), default=-1)
    if any(results(it) for it in items[last + 1 :]):
        items.append({"role": "assistant", "content": "noted"})
    if not has_user_text(items[-1]):
        items.append({"role": "user", "content": NUDGE})


def clamp_ints(node: Any) -> Any:
    """Integers beyond 64 bits (the schema allows them in free-form objects) clamped into range."""
    if isinstance(node, dict):
        return {k: clamp_ints(v) for k, v in node.items()}
    if isinstance(node, list):
        return [clamp_ints(v) for v in node]
    if isinstance(node, int) and not isinstance(node, bool):
        return min(max(node, INT64[0]), INT64[1])
    return node


def text_and_images(content: Any, kinds: tuple[str, ...], text_type: str) -> Any:
    """A content part list without the parts echo cannot take (files, audio); never empty."""
    if isinstance(content, list):
        kept = [p for p in content if not (isinstance(p, dict) and p.get("type") in kinds)]
        return kept or [{"type": text_type, "text": "a file was here"}]
    return content


def common_aim(out: dict[str, Any], max_keys: tuple[str, ...], stream: bool) -> None:
    for key in max_keys:
        v = out.get(key)  # an integer as JSON Schema counts one: 2e7 too
        if isinstance(v, int | float) and not isinstance(v, bool) and v > MAX_TOKENS:
            del out[key]
    if out.get("stream_options") is not None and not stream:
        del out["stream_options"]
    if out.get("tool_choice") not in (None, "none", "auto"):
        del out["tool_choice"]  # a named/forced choice needs tools this body may not offer
    calls = out.get("max_tool_calls")  # no minimum in the schema; a negative count means nothing
    if isinstance(calls, int | float) and not isinstance(calls, bool) and calls < 0:
        del out["max_tool_calls"]


def unique_ids(calls: list[Any], key: str) -> None:
    """Give repeated tool call ids a suffix (a reply may not make two calls with one id)."""
    seen: set[str] = set()
    for n, call in enumerate(calls):
        if isinstance(call, dict) and isinstance(call.get(key), str) and call[key]:
            while call[key] in seen:
                call[key] = f"{call[key]}_{n}"
            seen.add(call[key])


def answered_only(items: list[Any], calls_key: str | None, call_id: Callable[[Any], Any], result_id: str) -> None:
    """Drop the calls no later result answers (OpenAI refuses a transcript that leaves one open):
    from an assistant message's `calls_key` list, or (None) the call items themselves."""
    for n in range(len(items) - 1, -1, -1):
        later = {it.get(result_id) for it in items[n + 1 :] if isinstance(it, dict)}
        item = items[n]
        if not isinstance(item, dict):
            continue
        if calls_key is None:
            if item.get("type") == "function_call" and call_id(item) not in later:
                del items[n]
        elif isinstance(item.get(calls_key), list):
            item[calls_key] = [c for c in item[calls_key] if call_id(c) in later]
            if not item[calls_key]:
                del item[calls_key]


def valid_format_name(fmt: Any) -> None:
    """A json_schema format whose name OpenAI would refuse gets one it takes."""
    if isinstance(fmt, dict) and isinstance(fmt.get("name"), str) and not VALID_NAME.fullmatch(fmt["name"]):
        fmt["name"] = "schema"


VALID_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def top_level_fields(schema_name: str) -> set[str]:
    """The properties a request schema (and the schemas it composes with allOf) names."""
    schemas = document("openai-openapi.json")["components"]["schemas"]
    found: set[str] = set()
    pending = [schemas[schema_name]]
    while pending:
        node = pending.pop()
        if "$ref" in node:
            pending.append(schemas[node["$ref"].rsplit("/", 1)[-1]])
            continue
        found.update(node.get("properties", {}))
        pending.extend(node.get("allOf", []))
    return found


# The nested objects of CreateResponse whose unknown keys the server refuses, and their schemas.
CLOSED_OBJECTS = {
    "reasoning": "Reasoning",
    "text": "ResponseTextParam",
    "stream_options": "ResponseStreamOptions",
    "prompt_cache_options": "PromptCacheOptionsParam",
    "moderation": "ModerationParam",
    "conversation": "ConversationParam-2",
}


def schema_keys(schema_name: str) -> set[str]:
    """The properties a schema names (through $ref, allOf, anyOf, oneOf)."""
    schemas = document("openai-openapi.json")["components"]["schemas"]
    found: set[str] = set()
    pending = [schemas[schema_name]]
    while pending:
        node = pending.pop()
        if "$ref" in node:
            pending.append(schemas[node["$ref"].rsplit("/", 1)[-1]])
            continue
        found.update(node.get("properties", {}))
        for key in ("allOf", "anyOf", "oneOf"):
            pending.extend(node.get(key, []))
    return found


def format_keys(kind: Any) -> set[str]:
    """The keys of a `text.format` of type `kind` (each format's own schema)."""
    schemas = document("openai-openapi.json")["components"]["schemas"]
    for ref in schemas["TextResponseFormatConfiguration"]["oneOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        if kind in (schemas[name]["properties"]["type"].get("enum") or []):
            return schema_keys(name)
    return {"type"}


def close_objects(out: dict[str, Any]) -> None:
    """Drop the keys of nested objects their schemas do not name (the generator adds some)."""

    def close(value: Any, keys: set[str]) -> None:
        if isinstance(value, dict):
            for key in set(value) - keys:
                del value[key]

    for name, schema_name in CLOSED_OBJECTS.items():
        close(out.get(name), schema_keys(schema_name))
    text = out.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        close(text["format"], format_keys(text["format"].get("type")))
    for entry in out.get("context_management") or []:
        close(entry, schema_keys("ContextManagementParam"))


def aim(op_id: str, body: dict[str, Any], tally: Tally) -> dict[str, Any]:
    """The generated body, still schema-valid, without the parts listed in ALLOWED_REFUSALS, so
    that everything else in it (sampling, formats, client tools, metadata, images…) runs a turn."""
    out = clamp_ints(copy.deepcopy(body))
    common_aim(out, ("max_tokens", "max_completion_tokens", "max_output_tokens"), bool(out.get("stream")))
    if op_id == "createChatCompletion":
        for m in out["messages"]:
            if isinstance(m, dict) and m.get("role") == "user":
                m["content"] = text_and_images(m.get("content"), ("file", "input_audio"), "text")
        new_user_turn(
            out["messages"],
            lambda m: m.get("role") == "assistant",
            lambda m: m.get("role") in ("tool", "function"),
        )
        for m in out["messages"]:
            if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
                unique_ids(m["tool_calls"], "id")
        answered_only(
            out["messages"], "tool_calls", lambda c: c.get("id") if isinstance(c, dict) else None, "tool_call_id"
        )
        for n, m in enumerate(out["messages"]):  # a legacy function_call is answered by name
            call = m.get("function_call") if isinstance(m, dict) else None
            if isinstance(call, dict) and not any(
                isinstance(r, dict) and r.get("role") == "function" and r.get("name") == call.get("name")
                for r in out["messages"][n + 1 :]
            ):
                del m["function_call"]
        fmt = out.get("response_format")
        if isinstance(fmt, dict):
            valid_format_name(fmt.get("json_schema"))
        if out.get("n") not in (None, 1):
            out["n"] = 1
        out.pop("audio", None)  # this server answers with text only: audio output is refused, never dropped
        out.pop("web_search_options", None)  # this server does no web search: refused, never dropped
        if isinstance(out.get("modalities"), list):
            out["modalities"] = [m for m in out["modalities"] if m != "audio"]
        bias = out.get("logit_bias")
        if isinstance(bias, dict):  # token ids of digits, biases -100..100 (said in words only): as OpenAI
            out["logit_bias"] = {k: max(-100, min(100, v)) for k, v in bias.items() if k.isascii() and k.isdigit()}
        keep_function_tools(out, lambda t: t["function"].get("name"))
        # the deprecated `functions` / `function_call` are served (test_openai_fidelity checks them);
        # generated beside `tools`, or with names OpenAI refuses, they are refused as OpenAI does
        out.pop("functions", None)
        out.pop("function_call", None)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(out.get(key), int) and out[key] < 1:
                del out[key]
        return out
    out.pop("prompt", None)  # a stored prompt template: refused (the server keeps none)
    for name in set(out) - top_level_fields("CreateResponse"):  # unknown parameters are refused
        del out[name]
    close_objects(out)  # in nested objects too
    inp = out.get("input")
    if isinstance(inp, list):
        inp[:] = [
            it
            for it in inp
            if isinstance(it, dict)
            and ("type" in it or "role" in it)  # with neither it is no item (refused, as by OpenAI)
            and it.get("type", "message") in SUPPORTED_ITEMS
            and not (it.get("type") == "function_call_output" and not it.get("call_id"))
            # no approval of this run waits for an answer: one answers nothing (then beside the
            # nudge, the body is refused as mixing answers with new input)
            and it.get("type") != "mcp_approval_response"
        ]
        for it in inp:
            if it.get("type", "message") == "message" and it.get("role") == "user":
                it["content"] = text_and_images(it.get("content"), ("input_file", "input_audio"), "input_text")
    if isinstance(inp, list):
        unique_ids([it for it in inp if it.get("type") == "function_call"], "call_id")
    if not inp:
        out["input"] = NUDGE
    elif isinstance(inp, list):
        kinds = ("function_call_output", "mcp_approval_response")
        new_user_turn(
            inp,
            lambda it: it.get("role") == "assistant" or it.get("type") == "function_call",
            lambda it: it.get("type") in kinds,
        )
    if isinstance(out.get("input"), list):
        answered_only(out["input"], None, lambda it: it.get("call_id"), "call_id")
    text = out.get("text")
    if isinstance(text, dict):
        valid_format_name(text.get("format"))
    keep_function_tools(out, lambda t: t.get("name"))
    if isinstance(out.get("max_output_tokens"), int) and out["max_output_tokens"] < 1:
        del out["max_output_tokens"]
    if out.get("background"):
        del out["background"]
    for key in ("previous_response_id", "conversation"):  # an empty id names nothing: not given
        value = out.get(key)
        if key in out and not (value.get("id") if isinstance(value, dict) else value):
            del out[key]
    if out.get("previous_response_id") and out.get("conversation"):
        del out["conversation"]
    if out.get("previous_response_id") and tally.response_ids:
        out["previous_response_id"] = tally.response_ids[-1]  # continues, or forks an older one
        tally.continued += 1
    conv = out.get("conversation")
    if conv and tally.conversation_ids:
        out["conversation"] = (
            {"id": tally.conversation_ids[-1]} if isinstance(conv, dict) else tally.conversation_ids[-1]
        )
        tally.continued += 1
    return out


def check_chat_stream(body: dict[str, Any], payloads: list[str]) -> tuple[dict[str, Any], str]:
    """Every chunk valid, one id, one finish_reason on the last choice chunk, the usage chunk when
    asked for, then [DONE]: (last chunk, streamed text)."""
    assert payloads and payloads[-1] == "[DONE]", f"chat stream does not end with [DONE]: {payloads[-2:]}"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for ch in chunks:
        validate("CreateChatCompletionStreamResponse", ch)
    assert len({ch["id"] for ch in chunks}) == 1, "chunks of one completion carry different ids"
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finishes and finishes[-1] is not None and all(f is None for f in finishes[:-1]), finishes
    if ((body.get("stream_options") or {}).get("include_usage")) is True:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] is not None, chunks[-1]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    return chunks[-1], text


def check_responses_stream(payloads: list[str]) -> dict[str, Any]:
    """Every event valid and numbered in order, from response.created to one terminal event."""
    events = [json.loads(p) for p in payloads]
    assert events and events[0]["type"] == "response.created", events[:1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        validate("ResponseStreamEvent", e)
    kinds = [e["type"] for e in events]
    assert kinds[-1] in TERMINAL_EVENTS and not set(kinds[:-1]) & set(TERMINAL_EVENTS), kinds
    response: dict[str, Any] = events[-1]["response"]
    assert response["id"] == events[0]["response"]["id"]
    return response


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        c["text"]
        for item in response["output"]
        if item["type"] == "message"
        for c in item["content"]
        if c["type"] == "output_text"
    )


# Objects the schema leaves open (any keys) whose description says what each is: an allowed_tools
# entry is "a tool definition", which names its `type` (a generated `{}` there is refused).
OPEN_ENTRIES = ("tool_choice.allowed_tools.tools[", "tool_choice.tools[")


def open_entry_refused(error: dict[str, Any]) -> bool:
    """A 400 naming a field inside one of OPEN_ENTRIES: explained by the entry's description."""
    param = str(error.get("param") or "")
    return error.get("code") in ("missing_required_parameter", "invalid_type", "invalid_value") and param.startswith(
        OPEN_ENTRIES
    )


def send(
    client: httpx.Client,
    op_id: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    variant: str,
    tally: Tally,
) -> None:
    """One request; records its status and any failure (5xx, schema violation, unexplained 4xx)."""
    stream = bool(body and body.get("stream"))
    r = client.request(method, path, json=body)  # a stream is read to its end
    raw = r.content
    tally.statuses[f"{variant}:{op_id}:{r.status_code}"] += 1
    where = f"{variant} {op_id} {r.status_code}"
    if r.status_code >= 500:
        tally.failures.append(f"{where}: {raw[:300]!r} for {json.dumps(body)[:500]}")
        return
    try:
        if r.status_code >= 400:
            payload = json.loads(raw)
            validate("ErrorResponse", payload)
            reason = (r.status_code, payload["error"]["code"])
            tally.refusals[f"{variant}:{op_id}:{reason}"] += 1
            if reason not in ALLOWED_REFUSALS and not open_entry_refused(payload["error"]):
                raise AssertionError(
                    f"unexplained refusal {reason}: {payload['error']['message'][:200]} for {json.dumps(body)[:500]}"
                )
            return
        assert r.status_code == 200, f"unexpected status for {json.dumps(body)[:300]}"
        if op_id == "listModels":
            validate("ListModelsResponse", json.loads(raw))
            return
        final: dict[str, Any]
        if op_id == "createChatCompletion" and stream:
            final, text = check_chat_stream(body or {}, sse_payloads(sse_lines(raw)))
        elif op_id == "createChatCompletion":
            final = json.loads(raw)
            validate("CreateChatCompletionResponse", final)
            text = final["choices"][0]["message"]["content"] or ""
        else:
            final = check_responses_stream(sse_payloads(sse_lines(raw))) if stream else json.loads(raw)
            validate("Response", final)
            text = output_text(final)
            if final["store"]:
                tally.response_ids.append(final["id"])
            tally.conversation_ids.append(r.headers["x-conversation-id"])
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers["content-type"]
        assert final["model"] == "assistant", final["model"]
        assert text.startswith("echo:"), f"the echo agent did not answer the user message: {text[:200]!r}"
    except (AssertionError, ValueError, KeyError) as exc:
        tally.failures.append(f"{where}: {type(exc).__name__}: {str(exc)[:1500]}")


def run_operations(schema: Any, client: httpx.Client, *, stream: bool, examples: int, op_ids: list[str]) -> Tally:
    """Both runs use a fixed seed; the stream run another one, so that it sees other bodies."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    tally = Tally()

    def make(op_id: str) -> Callable[[], None]:
        operation = schema.find_operation_by_id(op_id)

        @seed(SEED + 1 if stream else SEED)
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            method, path = case.method.upper(), case.formatted_path
            if op_id == "listModels":
                send(client, op_id, method, path, None, "aimed", tally)
                return
            generated = dict(case.body, model="assistant", stream=stream)
            aimed = aim(op_id, generated, tally)
            validate(REQUEST_SCHEMA[op_id], aimed)  # aiming keeps the body valid
            if aimed != generated:
                send(client, op_id, method, path, generated, "generated", tally)
            send(client, op_id, method, path, aimed, "aimed", tally)

        return run  # type: ignore[no-any-return]

    for op_id in op_ids:
        make(op_id)()
    return tally


def report(name: str, tally: Tally) -> None:
    print(f"\n{name} statuses:", dict(sorted(tally.statuses.items())))
    print(f"{name} refusals:", dict(sorted(tally.refusals.items())))
    print(f"{name} continued from this run's responses/conversations:", tally.continued)


@pytest.mark.timeout(120)
def test_schemathesis_positive(srv: ServeProcess, schema: Any) -> None:
    with httpx.Client(base_url=srv.url + "/v1", timeout=30) as client:
        tally = run_operations(schema, client, stream=False, examples=EXAMPLES, op_ids=list(OPERATIONS.values()))
    report("non-stream", tally)
    assert not tally.failures, "\n".join(tally.failures[:5])
    for op_id in OPERATIONS.values():
        assert sum(n for k, n in tally.statuses.items() if k.startswith(f"aimed:{op_id}:")) >= 10, tally.statuses
    for op_id in ("createChatCompletion", "createResponse"):
        assert tally.share_2xx(op_id) >= MIN_SUCCESS_SHARE, (
            op_id,
            tally.share_2xx(op_id),
            tally.refusals,
        )
    assert tally.continued, "no request continued a response or conversation of this run"
    assert any(k.startswith("generated:") for k in tally.refusals), (
        "no generated body was refused: the allow-list went unchecked"
    )


@pytest.mark.timeout(120)
def test_schemathesis_positive_stream(srv: ServeProcess, schema: Any) -> None:
    with httpx.Client(base_url=srv.url + "/v1", timeout=30) as client:
        tally = run_operations(
            schema,
            client,
            stream=True,
            examples=STREAM_EXAMPLES,
            op_ids=["createChatCompletion", "createResponse"],
        )
    report("stream", tally)
    assert not tally.failures, "\n".join(tally.failures[:5])
    for op_id in ("createChatCompletion", "createResponse"):
        assert tally.share_2xx(op_id) >= MIN_SUCCESS_SHARE, (
            op_id,
            tally.share_2xx(op_id),
            tally.refusals,
        )
