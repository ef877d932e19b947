"""Context management fixes (s21): a provider's count anchors an estimate only when it describes the
request as sent again; upstream wordings of "context too long"; text parts clipped; media estimated."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from appserver.agent.context import (
    IMAGE_TOKENS,
    Budget,
    clip_oversized,
    estimate_message,
    estimate_request,
)
from appserver.config import load_config
from appserver.providers.base import ChatMessage, ProviderRequest, error_from_status
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.records import MessageRecord
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, openai_error
from tests.fakes.windowed_model import WindowedModel, _json_reply

LOREM = "the quarterly report mentions budgets, hiring plans, a product launch in spring and several open risks"
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


async def _server(home: Path, base_url: str, window: int | None = 2_000) -> Server:
    home.mkdir(parents=True, exist_ok=True)
    windows = f"\ncontext_windows = {{ small = {window} }}\n" if window else "\n"
    (home / "config.toml").write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{base_url}"\napi_key_env = ""{windows}'
    )
    server = Server(load_config(home, environ={"APPSERVER_LIMITS__RETRY_BASE_MS": "5"}))
    await server.open()
    return server


async def _turn(server: Server, agent: str, text: Any, conv: str = "new", **options: Any) -> tuple[str, Any]:
    sub = await server.kernel.submit(SubmitRequest(agent=agent, input=text, conversation=conv, options=options))
    return sub.conversation_id, await sub.wait(30)


# ---------------------------------------------------------------- bug 1: the anchor


async def test_turns_after_an_oversized_user_message_are_estimated_with_it_whole(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small", system="You are terse.")
            huge = "turn 1: " + " ".join(f"word{i}" for i in range(5_000))
            conv, snap = await _turn(server, "small", huge)
            assert snap.status == "completed", snap.error
            first = len(model.seen)
            for i in range(2, 5):
                conv, snap = await _turn(server, "small", f"turn {i}: short", conv)
                assert snap.status == "completed" and snap.text().startswith(f"Acknowledged turn {i}"), snap.error
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    later = model.seen[first:]
    # Turn 2 counted the paste whole, so it compacted first: no request was refused as too long.
    assert not [s for s in later if s["rejected"]], [(s["tokens"], s["summary"]) for s in later]
    assert any(s["summary"] for s in later)
    assert [m.role for m in history].count("compaction") == 1
    # The reply to the clipped request keeps the provider's count, but not as an anchor.
    first_reply = next(m for m in history if m.role == "assistant")
    assert first_reply.meta.get("context_tokens") and "context_basis" not in first_reply.meta
    assert all("context_basis" in m.meta for m in history if m.role == "assistant" and m is not first_reply)


def _refuses_long_strings(model: WindowedModel, limit: int) -> Any:
    """OpenAI's per-string cap (`string_above_max_length`): not a context error, never retried."""

    def responder(request: RecordedRequest) -> Reply:
        for i, m in enumerate(request.json["messages"]):
            content = m.get("content")
            if isinstance(content, str) and len(content) > limit:
                model.seen.append({"tokens": -1, "summary": False, "rejected": True, "body": None})
                return _json_reply(
                    400,
                    openai_error(
                        f"Invalid 'messages[{i}].content': string too long. Expected a string with maximum "
                        f"length {limit}, but got a string with length {len(content)} instead.",
                        code="string_above_max_length",
                    ),
                )
        return model(request)

    return responder


async def test_a_paste_over_the_upstreams_string_cap_does_not_brick_later_turns(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = _refuses_long_strings(model, 20_000)
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small")
            paste = "turn 1: summarise this log\n" + "\n".join(f"line {i} ok" for i in range(4_000))
            conv, snap = await _turn(server, "small", paste)
            assert snap.status == "completed", snap.error
            for i in (2, 3):
                conv, snap = await _turn(server, "small", f"turn {i}: thanks", conv)
                assert snap.status == "completed", (i, snap.error)
                assert snap.text().startswith(f"Acknowledged turn {i}")
        finally:
            await server.close()
    assert not [s for s in model.seen if s["rejected"]]


async def test_instructions_added_later_are_counted_beside_the_anchor(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small")
            conv = "new"
            for i in (1, 2):
                conv, snap = await _turn(server, "small", f"turn {i}: " + " ".join([LOREM] * 8), conv)
                assert snap.status == "completed"
            first = len(model.seen)
            # Instructions of ~750 estimated tokens (700 of the model's) after a measured reply of
            # ~750: the anchor alone says the request fits, with the instructions it does not.
            long_rules = " ".join(f"rule{i}." for i in range(350))
            conv, snap = await _turn(server, "small", "turn 3: " + " ".join([LOREM] * 8), conv, instructions=long_rules)
        finally:
            await server.close()
    assert snap.status == "completed", snap.error
    later = model.seen[first:]
    assert not [s for s in later if s["rejected"]], [(s["tokens"], s["summary"]) for s in later]
    assert any(s["summary"] for s in later)  # the estimate saw the instructions and compacted


def _view_and_request(system: str, model: str, basis: dict[str, Any] | None) -> tuple[list[MessageRecord], Any]:
    meta: dict[str, Any] = {"context_tokens": 50}
    if basis is not None:
        meta["context_basis"] = basis
    view = [
        MessageRecord(role="user", content="x" * 3_500),
        MessageRecord(role="assistant", content="ok", meta=meta),
        MessageRecord(role="user", content="y" * 35),
    ]
    messages = [ChatMessage("system", system), *(ChatMessage(m.role, m.text()) for m in view)]  # type: ignore[arg-type]
    return view, ProviderRequest(model=model, messages=messages)


def test_an_anchor_is_used_only_for_the_same_model_and_corrected_for_a_changed_lead() -> None:
    system = "s" * 70
    view, request = _view_and_request(system, "m1", None)
    pure = estimate_request(request, view)
    assert pure > 1_000  # no basis (a clipped request, or a reply stored before bases): not an anchor
    lead = estimate_message(ChatMessage("system", system))
    view, request = _view_and_request(system, "m1", {"model": "m1", "lead": lead})
    anchored = estimate_request(request, view)
    assert anchored == 50 + estimate_message(ChatMessage("user", "y" * 35))
    view, request = _view_and_request(system, "m2", {"model": "m1", "lead": lead})
    assert estimate_request(request, view) == pure  # another model's tokenizer counted it
    view, request = _view_and_request("s" * 7_000, "m1", {"model": "m1", "lead": lead})
    grown = estimate_message(ChatMessage("system", "s" * 7_000)) - lead
    assert estimate_request(request, view) == anchored + grown


# ---------------------------------------------------------------- bug 2: classification

LLAMA_CPP = {
    "error": {
        "code": 400,
        "type": "exceed_context_size_error",
        "message": "request (1037 tokens) exceeds the available context size (1000 tokens), try increasing it",
        "n_prompt_tokens": 1037,
        "n_ctx": 1000,
    }
}


@pytest.mark.parametrize(
    ("status", "message", "body", "kind"),
    [
        (400, LLAMA_CPP["error"]["message"], LLAMA_CPP, "context_overflow"),
        (400, "request too big", {"error": {"type": "exceed_context_size_error"}}, "context_overflow"),
        (
            400,
            "The input token count (1200293) exceeds the maximum number of tokens allowed (1048576).",
            None,
            "context_overflow",
        ),
        (
            400,
            "This model's maximum prompt length is 131072 but the request contains 150000 tokens.",
            None,
            "context_overflow",
        ),
        (
            400,
            "Prompt contains 40000 tokens, too large for model with 32768 maximum context length",
            None,
            "context_overflow",
        ),
        (
            400,
            "This endpoint's maximum context length is 8192 tokens. However, you requested about 9000 tokens",
            None,
            "context_overflow",
        ),
        (
            400,
            "input length and `max_tokens` exceed context limit: 199759 + 8192 > 200000, decrease input length or "
            "`max_tokens` and try again",
            None,
            "context_overflow",
        ),
        (
            400,
            "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 4096 "
            "tokens and your request has 3500 input tokens (1000 > 4096 - 3500).",
            None,
            "context_overflow",
        ),
        (
            400,
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the "
            "messages, 1000 in the completion). Please reduce the length of the messages or completion.",
            None,
            "context_overflow",
        ),
        # the reply alone cannot fit: compacting the prompt would not help
        (
            400,
            "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 "
            "tokens and your request has 2778 input tokens (8000 > 4096 - 2778).",
            None,
            "invalid_request",
        ),
        (
            400,
            "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens (1000 in the "
            "messages, 8000 in the completion). Please reduce the length of the messages or completion.",
            None,
            "invalid_request",
        ),
        (
            400,
            "max_tokens is too large: 100000. This model supports at most 16384 completion tokens, whereas you "
            "provided 100000.",
            openai_error("max_tokens is too large", code="invalid_value"),
            "invalid_request",
        ),
        (
            400,
            "max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens",
            None,
            "invalid_request",
        ),
        (400, "Invalid 'logit_bias': too many tokens given (max 300).", None, "invalid_request"),
        (429, "Rate limit reached: too many tokens per minute; prompt is too long for your tier", None, "rate_limit"),
    ],
)
def test_upstream_wordings_of_context_overflow(status: int, message: str, body: Any, kind: str) -> None:
    assert error_from_status(status, message, body=body).kind == kind


async def test_llama_cpp_overflow_compacts_and_retries(tmp_path: Path) -> None:
    model = WindowedModel(window=100_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url, window=None)  # default window: no preflight
        try:
            await server.agents.create("local", "fake:small")
            conv = "new"
            for i in range(1, 7):
                conv, snap = await _turn(server, "local", f"turn {i}: {LOREM}", conv)
                assert snap.status == "completed"
            fake.fail(400, LLAMA_CPP)
            conv, snap = await _turn(server, "local", "turn 7: final words", conv)
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    assert snap.status == "completed" and snap.text().startswith("Acknowledged turn 7"), snap.error
    assert [m.role for m in history].count("compaction") == 1


# ---------------------------------------------------------------- bug 3: parts


@pytest.mark.parametrize("with_image", [False, True])
async def test_an_oversized_text_part_is_clipped_beside_an_image(tmp_path: Path, with_image: bool) -> None:
    model = WindowedModel(window=2_000)
    big = "turn 1: " + " ".join(f"word{i}" for i in range(3_000))
    parts: list[dict[str, Any]] = [{"type": "text", "text": big}]
    if with_image:
        parts.append({"type": "image_url", "image_url": {"url": PNG}})
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small")
            conv, snap = await _turn(server, "small", parts)
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    assert snap.status == "completed", snap.error
    assert not [s for s in model.seen if s["rejected"]]
    sent = model.seen[-1]["body"]["messages"][-1]["content"]
    assert isinstance(sent, list) and "characters omitted" in sent[0]["text"]
    assert sent[0]["text"].startswith("turn 1: word0") and sent[0]["text"].endswith("word2999")
    assert [p["type"] for p in sent] == [p["type"] for p in parts]  # the image stays
    stored = next(m for m in history if m.role == "user")
    assert "omitted" not in stored.text() and len(stored.text()) == len(big)


def test_clip_keeps_short_text_parts_and_shares_the_rest() -> None:
    short = "keep me whole"
    parts = [
        {"type": "text", "text": short},
        {"type": "text", "text": "a" * 20_000},
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "text", "text": "b" * 30_000},
    ]
    request = ProviderRequest(model="m", messages=[ChatMessage("user", parts)])
    budget = Budget.for_window(10_000, None, None)
    assert clip_oversized(request, budget) == 1
    out = request.messages[0].content
    assert isinstance(out, list) and out[0]["text"] == short and out[2] == parts[2]
    assert "omitted" in out[1]["text"] and "omitted" in out[3]["text"]
    assert estimate_message(request.messages[0]) <= budget.limit // 4
    assert parts[1]["text"] == "a" * 20_000  # the caller's parts are not edited
    # A message that fits is left alone.
    small = ProviderRequest(model="m", messages=[ChatMessage("user", [{"type": "text", "text": short}])])
    assert clip_oversized(small, budget) == 0


def test_files_and_audio_are_estimated_from_their_data() -> None:
    pdf = "data:application/pdf;base64," + base64.b64encode(b"%" * 160_000).decode()
    wav = base64.b64encode(b"\0" * 500_000).decode()
    file_part = ChatMessage("user", [{"type": "file", "file": {"file_data": pdf, "filename": "a.pdf"}}])
    audio_part = ChatMessage("user", [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}])
    by_id = ChatMessage("user", [{"type": "file", "file": {"file_id": "file-1"}}])
    assert 9_000 <= estimate_message(file_part) <= 11_000  # ~1 token per 16 bytes
    assert 900 <= estimate_message(audio_part) <= 1_100  # ~1 token per 500 bytes
    assert estimate_message(by_id) >= IMAGE_TOKENS
