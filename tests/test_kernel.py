"""Kernel behaviour in-process: ordering, concurrency, idempotency, cancel, approvals, timeouts, providers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from appserver.errors import AgentGone, InvalidInput, NotFound, QueueFull
from appserver.runtime import Decision, SubmitRequest
from appserver.server import Server
from tests.fakes.openai_upstream import FakeOpenAI, chunk, openai_sse, tool_delta, usage_chunk
from tests.support.kernel import open_server


@pytest.fixture
async def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = await open_server(tmp_path / "home")
    yield s
    await s.close()


async def test_turns_of_one_conversation_never_overlap_but_conversations_run_concurrently(server: Server) -> None:
    events: list[tuple[str, str, str]] = []
    convs = {}
    for name in ("A", "B"):
        sub = await server.kernel.submit(SubmitRequest(agent="assistant", input=f"{name}0", conversation="new"))
        convs[name] = sub.conversation_id
        await sub.wait(5)

    async def track(name: str, sub) -> None:  # type: ignore[no-untyped-def]
        ctl = sub.handle.controller
        seen = -1
        started = False
        while True:
            snap = await ctl.next_snapshot(seen, 10)
            seen = snap.revision
            if not started and snap.phase != "queued":
                started = True
                events.append((name, sub.turn_id, "start"))
            if snap.terminal:
                events.append((name, sub.turn_id, "end"))
                return

    subs = []
    for i in range(3):
        for name in ("A", "B"):
            sub = await server.kernel.submit(
                SubmitRequest(agent="assistant", input=f"/slow {3 + i}", conversation=convs[name])
            )
            assert sub.queue_position == i
            subs.append((name, sub))
    await asyncio.gather(*(track(n, s) for n, s in subs))
    for name in ("A", "B"):
        mine = [(t, e) for n, t, e in events if n == name]
        order = [t for n, s in subs if n == name for t in (s.turn_id, s.turn_id)]
        assert [t for t, _ in mine] == order, "turns of one conversation ran out of order or overlapped"
        assert [e for _, e in mine] == ["start", "end"] * 3
    # concurrency: B's first turn started before A's first turn ended
    idx = {(n, e, t): i for i, (n, t, e) in enumerate(events)}
    a_first, b_first = subs[0][1].turn_id, subs[1][1].turn_id
    assert idx[("B", "start", b_first)] < idx[("A", "end", a_first)]


async def test_idempotency_key_gives_one_turn(server: Server) -> None:
    first = await server.kernel.submit(
        SubmitRequest(agent="assistant", input="hi", conversation="new", idempotency_key="msg-1")
    )
    again = await server.kernel.submit(
        SubmitRequest(agent="assistant", input="hi", conversation="new", idempotency_key="msg-1")
    )
    assert again.duplicate and again.turn_id == first.turn_id and again.conversation_id == first.conversation_id
    await first.wait(5)
    later = await server.kernel.submit(
        SubmitRequest(agent="assistant", input="hi", conversation=first.conversation_id, idempotency_key="msg-2")
    )
    await later.wait(5)
    replay = await server.kernel.submit(
        SubmitRequest(agent="assistant", input="hi", conversation=first.conversation_id, idempotency_key="msg-2")
    )
    assert replay.duplicate and replay.turn_id == later.turn_id
    assert (await replay.wait(5)).text() == "echo: hi"
    turns = await server.store.list_turns(first.conversation_id)
    assert len(turns) == 2
    assert len(await server.store.list_messages(first.conversation_id)) == 4


async def test_cancel_keeps_partial_text(server: Server) -> None:
    sub = await server.kernel.submit(SubmitRequest(agent="assistant", input="/slow 300", conversation="new"))
    ctl = sub.handle.controller
    seen = -1
    while "w3" not in ctl.visible_text():
        seen = (await ctl.next_snapshot(seen, 5)).revision
    assert await server.kernel.cancel(sub.conversation_id)
    snap = await sub.wait(5)
    assert snap.status == "cancelled" and snap.stop_reason == "cancelled"
    msgs = await server.store.list_messages(sub.conversation_id)
    assert msgs[-1].role == "assistant" and msgs[-1].completion_status == "cancelled"
    assert msgs[-1].text().startswith("w1 w2 w3")
    nxt = await server.kernel.submit(
        SubmitRequest(agent="assistant", input="/recall", conversation=sub.conversation_id)
    )
    assert (await nxt.wait(5)).text() == "/slow 300"


async def test_queue_is_bounded(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "h", APPSERVER_LIMITS__QUEUE_MAX="2")
    try:
        first = await server.kernel.submit(SubmitRequest(agent="assistant", input="/slow 100", conversation="new"))
        conv = first.conversation_id
        await first.handle.controller.next_snapshot(0, 5)  # it left the queue and runs
        for _ in range(2):
            await server.kernel.submit(SubmitRequest(agent="assistant", input="x", conversation=conv))
        with pytest.raises(QueueFull):
            await server.kernel.submit(SubmitRequest(agent="assistant", input="y", conversation=conv))
        await server.kernel.cancel(conv)
    finally:
        await server.close()


async def test_input_while_awaiting_waits_in_queue_and_approval_times_out(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "h", APPSERVER_LIMITS__APPROVAL_TIMEOUT_S="0.5")
    try:
        await server.agents.update("assistant", tools={"clock": "ask"})
        paused = await server.kernel.submit(
            SubmitRequest(agent="assistant", input="/call clock {}", conversation="new")
        )
        snap = await paused.wait(5)
        assert snap.status == "awaiting" and snap.pending[0]["kind"] == "approval"
        queued = await server.kernel.submit(
            SubmitRequest(agent="assistant", input="after", conversation=paused.conversation_id)
        )
        assert queued.queue_position == 1
        final = await paused.handle.wait_settled(5, after_revision=snap.revision)
        assert final.status == "completed"
        assert "timed out" in final.text() and "not denied by a person" in final.text()
        assert (await queued.wait(5)).text() == "echo: after"
    finally:
        await server.close()


async def test_deny_policy_and_unknown_tool_give_readable_results(server: Server) -> None:
    await server.agents.update("assistant", tools={"clock": "deny"})
    snap = await (
        await server.kernel.submit(SubmitRequest(agent="assistant", input="/call clock {}", conversation="new"))
    ).wait(5)
    assert snap.status == "completed" and "policy denies" in snap.text()
    snap = await (
        await server.kernel.submit(SubmitRequest(agent="assistant", input="/call nosuch {}", conversation="new"))
    ).wait(5)
    assert "not available" in snap.text()


async def test_client_tool_pauses_and_result_resumes(server: Server) -> None:
    from appserver.providers.base import ToolSpec

    sub = await server.kernel.submit(
        SubmitRequest(
            agent="assistant", input='/call lookup {"q":"x"}', conversation="new", client_tools=[ToolSpec("lookup")]
        )
    )
    snap = await sub.wait(5)
    assert snap.status == "awaiting" and snap.stop_reason == "requires_client_tool"
    call = snap.pending[0]
    assert call["kind"] == "client" and call["arguments"] == '{"q":"x"}'
    with pytest.raises(InvalidInput, match="client tool call"):
        await server.kernel.respond(sub.conversation_id, [Decision(call["call_id"], "approve")])
    res = await server.kernel.respond(sub.conversation_id, [Decision(call["call_id"], "result", output="found it")])
    assert res[0]["accepted"]
    final = await sub.handle.wait_settled(5, after_revision=snap.revision)
    assert final.text() == "lookup -> found it"


async def test_max_steps_and_error_stop_reasons(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "h")
    try:
        await server.agents.update("assistant", params={"max_steps": 1})
        snap = await (
            await server.kernel.submit(SubmitRequest(agent="assistant", input="/call clock {}", conversation="new"))
        ).wait(5)
        assert snap.stop_reason == "max_steps" and snap.status == "completed"
        snap = await (
            await server.kernel.submit(SubmitRequest(agent="assistant", input="/error 401", conversation="new"))
        ).wait(5)
        assert snap.status == "failed" and snap.stop_reason == "error"
        assert snap.error["kind"] == "auth" and snap.error["retryable"] is False
        snap = await (
            await server.kernel.submit(SubmitRequest(agent="assistant", input="/error 503", conversation="new"))
        ).wait(10)
        assert snap.status == "failed" and snap.error["kind"] == "server" and snap.attempt == 4
    finally:
        await server.close()


async def test_unknown_agent_and_conversation(server: Server) -> None:
    with pytest.raises(NotFound):
        await server.kernel.submit(SubmitRequest(agent="nobody", input="x"))
    with pytest.raises(NotFound):
        await server.kernel.submit(SubmitRequest(agent="assistant", input="x", conversation="conv_missing"))


async def test_openai_kind_through_the_kernel(tmp_path: Path) -> None:
    async with FakeOpenAI() as fake:
        home = tmp_path / "h"
        home.mkdir()
        (home / "config.toml").write_text(f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\n')
        server = await open_server(home)
        try:
            await server.agents.create("remote", "fake:test-model", system="be brief", tools={"clock": "allow"})
            fake.script(
                openai_sse(
                    [
                        chunk(role="assistant", content="Hel"),
                        chunk(content="lo"),
                        chunk(finish_reason="stop"),
                        usage_chunk(7, 2),
                    ]
                )
            )
            snap = await (
                await server.kernel.submit(SubmitRequest(agent="remote", input="hi", conversation="new"))
            ).wait(10)
            assert snap.text() == "Hello" and snap.stop_reason == "end_turn"
            assert snap.usage["input_tokens"] == 7 and snap.usage["output_tokens"] == 2
            body = fake.requests[-1].json
            assert body["model"] == "test-model" and body["messages"][0] == {"role": "system", "content": "be brief"}
            # one tool call whose arguments arrive in several chunks, then the final answer
            fake.script(
                openai_sse(
                    [
                        chunk(tool_calls=[tool_delta(0, id="call_1", name="clock")]),
                        chunk(tool_calls=[tool_delta(0, arguments='{"time')]),
                        chunk(tool_calls=[tool_delta(0, arguments='zone": "Eur')]),
                        chunk(tool_calls=[tool_delta(0, arguments='ope/Paris"}')]),
                        chunk(finish_reason="tool_calls"),
                    ]
                )
            )
            fake.script(openai_sse([chunk(content="It is late."), chunk(finish_reason="stop")]))
            snap = await (
                await server.kernel.submit(SubmitRequest(agent="remote", input="time?", conversation="new"))
            ).wait(10)
            assert snap.text() == "It is late."
            call = [b for b in snap.blocks if b["type"] == "tool_call"][0]
            assert call["arguments"] == '{"timezone": "Europe/Paris"}' and call["status"] == "completed"
            assert "(Europe/Paris)" in call["output"]
            second = fake.requests[-1].json["messages"]
            assert second[-2]["tool_calls"][0]["function"]["arguments"] == '{"timezone": "Europe/Paris"}'
            assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_1"
        finally:
            await server.close()


async def test_an_input_accepted_after_its_agent_was_deleted_is_not_found(server: Server) -> None:
    """Another process (`appserver agents delete`) deletes the agent, and its conversations with
    it, while this server still holds the conversation's runtime: the accept's foreign key fails.
    Every front end hears "not found" (AgentGone, a NotFound), not an internal error, and nothing
    of the input is written."""
    agent = await server.agents.create("victim")
    first = await server.kernel.submit(SubmitRequest(agent=agent.id, input="hello", conversation="new"))
    await first.wait(5)
    conv = first.conversation_id
    assert conv in server.kernel.runtimes  # loaded: the next submit goes straight to its queue
    assert await server.store.delete_agent(agent.id)
    with pytest.raises(AgentGone) as caught:
        await server.kernel.submit(SubmitRequest(agent=agent.id, input="again", conversation=conv, resolved=agent))
    assert caught.value.http_status == 404 and caught.value.param == "agent" and "victim" in caught.value.message
    assert await server.store.get_conversation(conv) is None

    after = await server.kernel.submit(SubmitRequest(agent="assistant", input="hi", conversation="new"))
    assert (await after.wait(5)).text() == "echo: hi"  # the kernel goes on


def test_a_snapshot_rebuilt_from_the_store_keeps_a_refusal_apart_from_the_answer() -> None:
    from appserver.runtime.snapshot import TurnController
    from appserver.store.records import MessageRecord

    c = TurnController("turn_1", "conv_1", "agt_1")
    c.load_messages(
        [
            MessageRecord(role="user", content="x"),
            MessageRecord(role="assistant", content="Sure. No.", meta={"refusal": "No."}),
        ]
    )
    blocks = list(c.snapshot().blocks)
    assert blocks == [{"type": "text", "text": "Sure. "}, {"type": "text", "text": "No.", "refusal": True}], blocks
