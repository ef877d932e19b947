"""Context management (issue 7, check 6): windows, estimates, compaction, overflow retry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appserver.agent.context import (
    Budget,
    choose_cut,
    context_view,
    default_window,
    estimate_message,
    to_chat_message,
)
from appserver.config import load_config
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.records import MessageRecord
from tests.fakes.openai_upstream import FakeOpenAI, openai_error
from tests.fakes.windowed_model import WindowedModel

LOREM = "the quarterly report mentions budgets, hiring plans, a product launch in spring and several open risks"


def msg(role: str, text: str = "x", **kw: Any) -> MessageRecord:
    return MessageRecord(role=role, content=text, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- pure parts


def test_default_windows_and_budget() -> None:
    assert default_window("gpt-4o-mini") == 128_000
    assert default_window("openai/gpt-4.1-nano") == 1_047_576
    assert default_window("claude-sonnet-4") == 200_000
    assert default_window("some-local-thing") == 32_768
    b = Budget.for_window(2_000, None, None)
    assert (b.window, b.reserve, b.limit) == (2_000, 500, 1_500)
    assert Budget.for_window(2_000, None, 800).reserve == 800  # room for the configured reply length
    assert Budget.for_window(200_000, None, None).reserve == 8_192


def test_view_applies_the_last_compaction_and_skips_older_ones() -> None:
    history = [msg("user", "u1"), msg("assistant", "a1"), msg("user", "u2"), msg("assistant", "a2")]
    c1 = msg("compaction", "S1", meta={"kept": 2})
    history.append(c1)
    history += [msg("user", "u3"), msg("assistant", "a3")]
    assert [m.text() for m in context_view(history)] == ["S1", "u2", "a2", "u3", "a3"]
    c2 = msg("compaction", "S2", meta={"kept": 3})  # kept a2, u3, a3: walks past the older compaction
    history.append(c2)
    assert [m.text() for m in context_view(history)] == ["S2", "a2", "u3", "a3"]


def test_cut_never_separates_a_tool_call_from_its_result() -> None:
    call = msg("assistant", "", tool_calls=[{"id": "c1", "name": "clock", "arguments": "{}"}])
    view = [
        msg("user", "u1"),
        msg("assistant", "a1"),
        msg("user", "u2"),
        call,
        msg("tool", "r1", tool_call_id="c1", name="clock"),
        msg("assistant", "a2"),
    ]
    sizes = [10] * len(view)
    # Budget for 2 messages would start the kept part on the tool result: the cut moves past it.
    cut = choose_cut(view, sizes, keep_tokens=20)
    assert cut is not None and view[cut].role != "tool"
    for keep in range(0, 70, 5):
        cut = choose_cut(view, sizes, keep)
        if cut is not None:
            assert view[cut].role != "tool", keep
            kept_ids = {c["id"] for m in view[cut:] for c in m.tool_calls}
            results = {m.tool_call_id for m in view[cut:] if m.role == "tool"}
            assert results <= kept_ids and kept_ids <= results
    # Only a summary and the newest message: nothing left to fold.
    assert choose_cut([msg("compaction", "S"), msg("user", "big")], [10, 5000], 100) is None


def test_estimate_counts_images_and_tool_calls() -> None:
    plain = estimate_message(to_chat_message(msg("user", "hello there")))
    with_image = estimate_message(
        to_chat_message(
            msg("user", [{"type": "text", "text": "hello there"}, {"type": "image_url", "image_url": {"url": "data:"}}])
        )
    )
    assert with_image >= plain + 1_000
    call = msg("assistant", "", tool_calls=[{"id": "c", "name": "shell", "arguments": '{"cmd": "' + "x" * 350 + '"}'}])
    assert estimate_message(to_chat_message(call)) > 100


# ---------------------------------------------------------------- against a windowed fake model


async def _server(home: Path, base_url: str, window: int | None = 2_000) -> Server:
    home.mkdir(parents=True, exist_ok=True)
    windows = f"\ncontext_windows = {{ small = {window} }}\n" if window else "\n"
    (home / "config.toml").write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{base_url}"\napi_key_env = ""{windows}'
    )
    server = Server(load_config(home, environ={"APPSERVER_LIMITS__RETRY_BASE_MS": "5"}))
    await server.open()
    return server


def _assert_pairs_intact(body: dict[str, Any]) -> None:
    """Every tool result follows its call in the same request, and every call has its result."""
    open_calls: set[str] = set()
    for m in body["messages"]:
        if m["role"] == "tool":
            assert m["tool_call_id"] in open_calls, f"orphan tool result {m['tool_call_id']}"
            open_calls.discard(m["tool_call_id"])
            continue
        assert not open_calls, f"calls without results: {open_calls}"
        open_calls = {c["id"] for c in m.get("tool_calls") or []}
    assert not open_calls


async def test_sixty_turns_in_a_2000_token_window(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create(
                "small", "fake:small", system="You are a careful note taker.", tools={"clock": "allow"}
            )
            conv = None
            for i in range(1, 61):
                text = f"use clock for turn {i}" if i % 6 == 0 else f"turn {i}: please remember that {LOREM} (item {i})"
                sub = await server.kernel.submit(SubmitRequest(agent="small", input=text, conversation=conv or "new"))
                conv = sub.conversation_id
                snap = await sub.wait(20)
                assert snap.status == "completed" and snap.stop_reason == "end_turn", (i, snap.error)
                assert (f"turn {i}" in snap.text()) or ("clock said" in snap.text()), snap.text()
                if i == 60:
                    last_snapshot = snap
            history = await server.store.list_messages(conv)  # type: ignore[arg-type]
        finally:
            await server.close()
    compactions = [m for m in history if m.role == "compaction"]
    assert len(compactions) >= 2, "60 turns of ~60 tokens cannot fit 2,000 tokens without compaction"
    assert all(
        m.meta.get("kept", 0) >= 1 and m.meta.get("tokens_after", 10**9) < m.meta["tokens_before"] for m in compactions
    )
    assert not [s for s in model.seen if s["rejected"]], "a request exceeded the window"
    assert max(s["tokens"] for s in model.seen) <= 2_000
    turn_requests = [s for s in model.answered() if not s["summary"]]
    assert len(turn_requests) >= 70  # 60 turns + the clock follow-ups
    for s in turn_requests:
        _assert_pairs_intact(s["body"])
    # Later turns see the summary, not the early turns verbatim.
    final = turn_requests[-1]["body"]["messages"]
    assert any("[Summary of the earlier conversation]" in str(m.get("content")) for m in final)
    assert not any("(item 1)" in str(m.get("content")) for m in final)
    # The summary came from the same provider, and each compaction shows in a snapshot or history.
    assert any(s["summary"] for s in model.answered())
    assert all(c.text().startswith("Summary: the user sent turns") for c in compactions)
    assert last_snapshot.status == "completed"


async def test_compaction_shows_in_the_snapshot_of_the_turn_that_compacted(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small")
            conv = "new"
            compacted_snapshot = None
            for i in range(1, 40):
                sub = await server.kernel.submit(
                    SubmitRequest(agent="small", input=f"turn {i}: {LOREM}", conversation=conv)
                )
                conv = sub.conversation_id
                snap = await sub.wait(20)
                if any(b["type"] == "compaction" for b in snap.blocks):
                    compacted_snapshot = snap
                    break
        finally:
            await server.close()
    assert compacted_snapshot is not None, "no turn reported a compaction"
    block = next(b for b in compacted_snapshot.blocks if b["type"] == "compaction")
    assert "Summary" in str(block)
    assert compacted_snapshot.text().startswith("Acknowledged turn")


async def test_context_too_long_from_the_provider_compacts_once_and_retries(tmp_path: Path) -> None:
    model = WindowedModel(window=100_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url, window=None)  # default window: no preflight compaction
        try:
            await server.agents.create("big", "fake:small")
            conv = "new"
            for i in range(1, 9):
                sub = await server.kernel.submit(
                    SubmitRequest(agent="big", input=f"turn {i}: {LOREM}", conversation=conv)
                )
                conv = sub.conversation_id
                assert (await sub.wait(20)).status == "completed"
            before = len(fake.requests)
            fake.fail(
                400,
                openai_error(
                    "This model's maximum context length is 300 tokens. However, your messages resulted in 900 tokens.",
                    code="context_length_exceeded",
                ),
            )
            sub = await server.kernel.submit(SubmitRequest(agent="big", input="turn 9: final words", conversation=conv))
            snap = await sub.wait(20)
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    assert snap.status == "completed" and snap.text().startswith("Acknowledged turn 9"), snap.error
    assert [m.role for m in history].count("compaction") == 1
    after = [r.json for r in fake.requests[before:]]
    # Only OpenAI's own fields reach the upstream (a real one refuses unknown parameters).
    assert not any("purpose" in body for body in after)
    # refused, then the summary (in pieces when the smaller budget needs it), then the retried turn
    assert len(after) >= 3 and all(
        not r.get("tools") and "summary" in r["messages"][0]["content"].lower() for r in after[1:-1]
    )
    assert len(after[-1]["messages"]) < len(after[0]["messages"])
    assert "[Summary of the earlier conversation]" in after[-1]["messages"][0]["content"]


async def test_a_second_overflow_fails_the_turn_with_a_readable_error(tmp_path: Path) -> None:
    model = WindowedModel(window=100_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url, window=None)
        try:
            await server.agents.create("big", "fake:small")
            conv = "new"
            for i in range(1, 6):
                sub = await server.kernel.submit(
                    SubmitRequest(agent="big", input=f"turn {i}: {LOREM}", conversation=conv)
                )
                conv = sub.conversation_id
                await sub.wait(20)
            too_long = openai_error("maximum context length is 10 tokens", code="context_length_exceeded")
            fake.responder = None  # from now on the upstream refuses everything as too long
            for _ in range(4):
                fake.fail(400, too_long)
            sub = await server.kernel.submit(SubmitRequest(agent="big", input="turn 6", conversation=conv))
            snap = await sub.wait(20)
        finally:
            await server.close()
    assert snap.status == "failed"
    assert snap.error is not None and snap.error["kind"] == "context_overflow" and snap.error["retryable"] is False


async def test_echo_agent_with_a_small_window_compacts_and_recalls_through_the_summary(tmp_path: Path) -> None:
    server = Server(load_config(tmp_path / "h", environ={}))
    await server.open()
    try:
        await server.agents.create("tiny", "echo", params={"context_window": 600})
        conv = "new"
        for i in range(1, 41):
            sub = await server.kernel.submit(SubmitRequest(agent="tiny", input=f"note {i}: {LOREM}", conversation=conv))
            conv = sub.conversation_id
            snap = await sub.wait(10)
            assert snap.text() == f"echo: note {i}: {LOREM}"
        recall = await (
            await server.kernel.submit(SubmitRequest(agent="tiny", input="/recall", conversation=conv))
        ).wait(10)
        history = await server.store.list_messages(conv)
    finally:
        await server.close()
    assert any(m.role == "compaction" for m in history)
    text = recall.text()
    assert "summary: users said note 1:" in text  # the oldest notes live on in the summary
    assert text.endswith(f"note 40: {LOREM}")  # the newest ones verbatim
    assert len([m for m in history if m.role == "user"]) == 41  # the stored history keeps everything


async def test_a_tool_output_bigger_than_the_window_is_clipped_in_the_request_not_in_history(tmp_path: Path) -> None:
    model = WindowedModel(window=2_000)
    async with FakeOpenAI() as fake:
        fake.responder = model
        server = await _server(tmp_path / "h", fake.base_url)
        try:
            await server.agents.create("small", "fake:small", tools={"shell": "allow"})
            sub = await server.kernel.submit(SubmitRequest(agent="small", input="turn 1: hello", conversation="new"))
            await sub.wait(20)
            big = "python3 -c \"print(' '.join('word%d' % i for i in range(4000)))\""
            sub = await server.kernel.submit(
                SubmitRequest(agent="small", input=f"use shell: {big}", conversation=sub.conversation_id)
            )
            snap = await sub.wait(20)
            history = await server.store.list_messages(sub.conversation_id)
        finally:
            await server.close()
    assert snap.status == "completed" and snap.text().startswith("The clock said word0"), snap.error
    assert not [s for s in model.seen if s["rejected"]] and max(s["tokens"] for s in model.seen) <= 2_000
    tool_in_request = [m for m in model.seen[-1]["body"]["messages"] if m["role"] == "tool"][0]["content"]
    assert "characters omitted" in tool_in_request and tool_in_request.startswith("word0 word1")
    assert tool_in_request.rstrip().endswith("word3999")
    stored = [m for m in history if m.role == "tool"][0].text()
    assert len(stored) > 30_000 and "omitted" not in stored  # the history keeps it whole
