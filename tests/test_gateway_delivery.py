"""gateway/delivery.py: what a chat sees of a turn, the per-chat outbox, the per-turn reply sink and
the per-chat order of replies, against an in-memory adapter that implements the plugin contract."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.delivery import (
    BACKOFF_S,
    NO_REPLY,
    TRANSIENT_ATTEMPTS,
    ChatOrder,
    DeliveryFailed,
    Outbox,
    ReplySink,
    visible_text,
)
from gateway.ratelimit import ChatRateLimiter
from plugins.contract import Adapter, DeliveryError, Limits, Target

HERE = Target("chat1")


class FakeClock:
    """Time that moves only when someone sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class MemoryAdapter:
    """A platform in memory: messages by id, every call recorded with the clock's time, and
    errors queued to be raised by the next calls."""

    def __init__(self, max_length: int = 4096, *, can_edit: bool = True, clock: FakeClock | None = None) -> None:
        self.limits = Limits(max_length=max_length, can_edit=can_edit, can_react=True)
        self.messages: dict[str, str] = {}
        self.calls: list[tuple[str, str, str]] = []  # (op, message id, text)
        self.times: list[float] = []
        self.errors: list[BaseException] = []
        self.clock = clock or FakeClock()
        self._n = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    @property
    def is_running(self) -> bool:
        return True

    def _next_error(self) -> None:
        self.times.append(self.clock())
        if self.errors:
            raise self.errors.pop(0)

    async def send(self, target: Target, text: str) -> list[str]:
        self._next_error()
        assert len(text) <= self.limits.max_length, "the gateway sent more than the platform accepts"
        self._n += 1
        message_id = f"m{self._n}"
        self.messages[message_id] = text
        self.calls.append(("send", message_id, text))
        return [message_id]

    async def edit(self, target: Target, message_id: str, text: str) -> None:
        self._next_error()
        assert message_id in self.messages, f"edit of unknown message {message_id}"
        assert len(text) <= self.limits.max_length
        self.messages[message_id] = text
        self.calls.append(("edit", message_id, text))

    async def react(self, target: Target, message_id: str, emoji: str) -> None:
        self._next_error()
        self.calls.append(("react", message_id, emoji))


def outbox_for(adapter: MemoryAdapter, *, rate: float = 100.0, burst: int = 100) -> tuple[Outbox, list[float]]:
    clock = adapter.clock
    limiter = ChatRateLimiter(rate, burst, clock=clock, sleep=clock.sleep)
    backoffs: list[float] = []

    async def backoff_sleep(seconds: float) -> None:
        backoffs.append(seconds)
        await clock.sleep(seconds)

    return Outbox(adapter, limiter, backoff_sleep), backoffs


def sink_for(adapter: MemoryAdapter, **kw: Any) -> ReplySink:
    outbox, _ = outbox_for(adapter)
    return ReplySink(outbox, HERE, clock=adapter.clock, **kw)


def test_memory_adapter_satisfies_the_contract() -> None:
    assert isinstance(MemoryAdapter(), Adapter)


# ---------------------------------------------------------------- visible_text


def snap(status: str, *blocks: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"status": status, "blocks": list(blocks), **extra}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def tool(name: str, status: str = "streaming") -> dict[str, Any]:
    return {"type": "tool_call", "name": name, "status": status}


def test_reasoning_is_never_shown() -> None:
    s = snap("completed", {"type": "reasoning", "text": "secret thoughts"}, text("Hello"), text(" world "))
    assert visible_text(s) == "Hello\n\nworld"
    assert visible_text(snap("running", {"type": "reasoning", "text": "hmm"})) == ""


def test_tool_status_line_while_a_tool_runs_and_only_then() -> None:
    running = snap("running", text("Let me look."), tool("search", "completed"), tool("fetch"))
    assert visible_text(running) == "Let me look.\n\n⚙ fetch…"
    assert visible_text(running, tool_status=False) == "Let me look."
    done = snap("running", text("Found it."), tool("fetch", "completed"), tool("other", "failed"))
    assert visible_text(done) == "Found it."
    # A terminal snapshot never shows the status line, even with a block left unfinished.
    assert visible_text(snap("completed", text("Done."), tool("fetch"))) == "Done."
    assert visible_text(snap("running", tool("x", "streaming") | {"name": None})) == "⚙ tool…"


def test_failed_cancelled_and_interrupted_lines() -> None:
    failed = snap("failed", text("Partial"), error={"kind": "provider_error", "message": "upstream\nsaid   no"})
    assert visible_text(failed) == "Partial\n\n⚠ The turn failed: upstream said no"
    assert visible_text(snap("failed", error={"kind": "timeout"})) == "⚠ The turn failed: timeout"
    long = visible_text(snap("failed", error={"message": "x" * 500}))
    assert long.endswith("…") and len(long) < 260
    for status, kind in (("failed", "interrupted"), ("failed", "unknown"), ("cancelled", "interrupted")):
        # a server stop reaches clients as `cancelled` with an `interrupted` error: nobody cancelled it
        line = visible_text(snap(status, error={"kind": kind, "message": "ignored"}))
        assert line == "⚠ The reply was interrupted (the server stopped while it was being written).", status
    assert visible_text(snap("cancelled", error={"kind": "unknown"})) == "⏹ Cancelled."
    filtered = snap("completed", text("Part"), stop_reason="content_filter")
    assert visible_text(filtered) == "Part\n\n⚠ The model provider's content filter stopped this reply."
    assert visible_text(snap("completed", text("Done."), stop_reason="end_turn")) == "Done."
    assert visible_text(snap("cancelled", text("Half"), tool("fetch"))) == "Half\n\n⏹ Cancelled."


def test_approval_waiting_line() -> None:
    s = snap(
        "awaiting",
        text("I need to run it."),
        tool("shell", "pending_approval"),
        pending=[{"kind": "approval", "name": "shell"}, {"kind": "client", "name": "message_channel"}],
    )
    assert visible_text(s) == "I need to run it.\n\n⚙ shell…\n\n⏸ waiting for approval of shell"
    assert visible_text(s, tool_status=False) == "I need to run it.\n\n⏸ waiting for approval of shell"
    only_client = snap("awaiting", text("x"), pending=[{"kind": "client", "name": "message_channel"}])
    assert visible_text(only_client, tool_status=False) == "x"


# ---------------------------------------------------------------- ReplySink


async def test_streaming_shows_then_finish_is_exact() -> None:
    adapter = MemoryAdapter()
    sink = sink_for(adapter)
    assert await sink.show("Hel") == ["m1"]
    assert await sink.show("Hello\n\n⚙ search…") == ["m1"]
    assert adapter.messages["m1"] == "Hello\n\n⚙ search…"
    assert await sink.finish("Hello world") == ["m1"]
    assert adapter.messages == {"m1": "Hello world"}
    assert [c[0] for c in adapter.calls] == ["send", "edit", "edit"]


async def test_no_op_edits_are_skipped() -> None:
    adapter = MemoryAdapter()
    sink = sink_for(adapter)
    await sink.show("same")
    await sink.show("same")
    await sink.show("   ")  # blank: nothing to show
    await sink.finish("same")
    assert adapter.calls == [("send", "m1", "same")]


async def test_long_reply_splits_and_growth_edits_the_right_part() -> None:
    adapter = MemoryAdapter(max_length=40)
    sink = sink_for(adapter)
    first = "a" * 30
    second = "b" * 30
    ids = await sink.show(f"{first}\n\n{second}")
    assert ids == ["m1", "m2"]
    assert adapter.messages == {"m1": first, "m2": second}
    adapter.calls.clear()
    ids = await sink.show(f"{first}\n\n{second} more")
    assert ids == ["m1", "m2"]
    assert adapter.calls == [("edit", "m2", f"{second} more")]  # the first part is untouched
    adapter.calls.clear()
    third = "c" * 30
    ids = await sink.finish(f"{first}\n\n{second} more\n\n{third}")
    assert ids == ["m1", "m2", "m3"]
    assert adapter.calls == [("send", "m3", third)]
    assert all(len(t) <= 40 for t in adapter.messages.values())


async def test_a_reply_that_shrinks_blanks_the_surplus_parts_at_the_end() -> None:
    adapter = MemoryAdapter(max_length=40)
    sink = sink_for(adapter)
    await sink.show(f"{'a' * 30}\n\n⚙ {'x' * 30}…")
    assert len(sink.ids) == 2
    assert await sink.finish("a" * 30) == ["m1", "m2"]
    assert adapter.messages == {"m1": "a" * 30, "m2": "…"}


async def test_platform_without_edit_gets_only_the_final_text_once() -> None:
    adapter = MemoryAdapter(max_length=40, can_edit=False)
    sink = sink_for(adapter)
    assert await sink.show("partial") == []
    assert await sink.show("partial and more") == []
    assert adapter.calls == []
    final = f"{'a' * 30}\n\n{'b' * 30}"
    assert await sink.finish(final) == ["m1", "m2"]
    assert await sink.finish(final) == ["m1", "m2"]  # a second finish sends nothing again
    assert adapter.calls == [("send", "m1", "a" * 30), ("send", "m2", "b" * 30)]


async def test_stream_off_sends_the_final_text_once_even_where_edits_work() -> None:
    adapter = MemoryAdapter()
    sink = sink_for(adapter, stream=False)
    assert await sink.show("partial") == []
    assert await sink.finish("final") == ["m1"]
    assert adapter.calls == [("send", "m1", "final")]


async def test_resumed_sink_re_edits_the_messages_sent_before_a_restart() -> None:
    adapter = MemoryAdapter(max_length=40)
    adapter.messages.update({"old1": "a" * 30, "old2": "stale"})
    outbox, _ = outbox_for(adapter)
    sink = ReplySink.resumed(outbox, HERE, ("old1", "old2"), clock=adapter.clock)
    assert sink.ids == ["old1", "old2"]
    # Content unknown after a restart: re-edited even where the text happens to be the same.
    assert await sink.show(f"{'a' * 30}\n\n{'b' * 20}") == ["old1", "old2"]
    assert adapter.calls == [("edit", "old1", "a" * 30), ("edit", "old2", "b" * 20)]
    adapter.calls.clear()
    assert await sink.finish(f"{'a' * 30}\n\n{'b' * 20}") == ["old1", "old2"]
    assert adapter.calls == []


async def test_resumed_sink_on_a_platform_without_edit_sends_only_the_rest() -> None:
    adapter = MemoryAdapter(max_length=40, can_edit=False)
    outbox, _ = outbox_for(adapter)
    sink = ReplySink.resumed(outbox, HERE, ("old1",), clock=adapter.clock)
    assert await sink.finish(f"{'a' * 30}\n\n{'b' * 20}") == ["old1", "m1"]
    assert adapter.calls == [("send", "m1", "b" * 20)]


async def test_empty_final_text() -> None:
    adapter = MemoryAdapter()
    sink = sink_for(adapter)
    assert await sink.finish("  ") == []
    assert adapter.calls == []
    sink = sink_for(adapter)
    await sink.show("thinking aloud")
    assert await sink.finish("") == ["m1"]
    assert adapter.messages["m1"] == NO_REPLY


async def test_format_is_applied_to_what_is_sent() -> None:
    class Upper(MemoryAdapter):
        def format(self, text: str) -> str:
            return text.upper()

    adapter = Upper()
    sink = sink_for(adapter)
    await sink.show("hi")
    await sink.finish("hi there")
    assert adapter.calls == [("send", "m1", "HI"), ("edit", "m1", "HI THERE")]


async def test_pace_of_in_place_updates() -> None:
    adapter = MemoryAdapter()
    sink = sink_for(adapter, interval=1.0)
    assert sink.due() == 0.0
    await sink.show("a")
    assert sink.due() == pytest.approx(1.0)
    assert sink.final_due() == pytest.approx(0.5)
    adapter.clock.now += 0.75
    assert sink.due() == pytest.approx(0.25)
    assert sink.final_due() == 0.0


# ---------------------------------------------------------------- Outbox


async def test_retry_after_waits_at_least_that_long_then_succeeds() -> None:
    adapter = MemoryAdapter()
    outbox, backoffs = outbox_for(adapter)
    adapter.errors.append(DeliveryError("slow down", retry_after=7.0))
    assert await outbox.send(HERE, "hi") == ["m1"]
    assert len(adapter.times) == 2
    assert adapter.times[1] - adapter.times[0] >= 7.0
    assert backoffs == []  # the platform's wait, not the transient backoff


async def test_retry_after_in_real_time() -> None:
    adapter = MemoryAdapter()
    outbox = Outbox(adapter, ChatRateLimiter(100.0, 100), asyncio.sleep)
    adapter.errors.append(DeliveryError("slow down", retry_after=0.15))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await outbox.send(HERE, "hi") == ["m1"]
    assert loop.time() - t0 >= 0.15


async def test_retry_after_for_ever_ends_in_delivery_failed() -> None:
    adapter = MemoryAdapter()
    outbox, _ = outbox_for(adapter)
    adapter.errors.extend(DeliveryError("429", retry_after=2.0) for _ in range(20))
    with pytest.raises(DeliveryFailed, match="rate limited"):
        await outbox.send(HERE, "hi")
    assert adapter.calls == []
    # a short retry_after gets the transient budget (about a minute), each wait at least its value
    # and at least the backoff step (s21: five answers of Retry-After lost a reply within seconds)
    assert len(adapter.times) == TRANSIENT_ATTEMPTS
    gaps = [b - a for a, b in zip(adapter.times, adapter.times[1:], strict=False)]
    assert all(g >= 2.0 for g in gaps)
    assert adapter.times[-1] - adapter.times[0] >= sum(BACKOFF_S[: TRANSIENT_ATTEMPTS - 1])


async def test_a_long_retry_after_is_waited_out_five_times() -> None:
    adapter = MemoryAdapter()
    outbox, _ = outbox_for(adapter)
    adapter.errors.extend(DeliveryError("429", retry_after=40.0) for _ in range(20))
    with pytest.raises(DeliveryFailed, match="rate limited"):
        await outbox.send(HERE, "hi")
    assert len(adapter.times) == 5
    gaps = [b - a for a, b in zip(adapter.times, adapter.times[1:], strict=False)]
    assert all(g >= 40.0 for g in gaps)


async def test_permanent_error_fails_at_once() -> None:
    adapter = MemoryAdapter()
    outbox, backoffs = outbox_for(adapter)
    adapter.errors.append(DeliveryError("chat not found", permanent=True, retry_after=30.0))
    with pytest.raises(DeliveryFailed, match="chat not found"):
        await outbox.send(HERE, "hi")
    assert len(adapter.times) == 1
    assert backoffs == []
    assert adapter.clock.sleeps == []


async def test_transient_errors_are_retried_with_backoff() -> None:
    adapter = MemoryAdapter()
    outbox, backoffs = outbox_for(adapter)
    adapter.errors.extend(DeliveryError("502") for _ in range(TRANSIENT_ATTEMPTS - 1))
    assert await outbox.send(HERE, "hi") == ["m1"]
    assert backoffs == list(BACKOFF_S[: TRANSIENT_ATTEMPTS - 1])


async def test_transient_errors_in_the_end_fail_with_the_reason() -> None:
    adapter = MemoryAdapter()
    outbox, backoffs = outbox_for(adapter)
    adapter.errors.extend(DeliveryError(f"502 #{i}") for i in range(TRANSIENT_ATTEMPTS))
    with pytest.raises(DeliveryFailed, match=f"502 #{TRANSIENT_ATTEMPTS - 1}"):
        await outbox.edit(HERE, "m0", "x")
    assert len(adapter.times) == TRANSIENT_ATTEMPTS
    assert len(backoffs) == TRANSIENT_ATTEMPTS - 1


async def test_an_unexpected_adapter_exception_becomes_delivery_failed() -> None:
    adapter = MemoryAdapter()
    outbox, backoffs = outbox_for(adapter)
    adapter.errors.extend(ConnectionResetError("peer reset") for _ in range(TRANSIENT_ATTEMPTS))
    with pytest.raises(DeliveryFailed, match="peer reset"):
        await outbox.send(HERE, "hi")
    assert len(backoffs) == TRANSIENT_ATTEMPTS - 1
    adapter.errors.append(OSError("once"))
    assert await outbox.send(HERE, "hi") == ["m1"]


async def test_sends_pass_the_per_chat_rate_limit() -> None:
    adapter = MemoryAdapter()
    outbox, _ = outbox_for(adapter, rate=1.0, burst=2)
    for _ in range(4):
        await outbox.send(HERE, "x")
    await outbox.send(Target("other"), "y")
    assert adapter.times == pytest.approx([1000.0, 1000.0, 1001.0, 1002.0, 1002.0])


async def test_react_where_the_adapter_cannot() -> None:
    adapter = MemoryAdapter()
    outbox, _ = outbox_for(adapter)
    await outbox.react(HERE, "m9", "👍")
    assert adapter.calls == [("react", "m9", "👍")]

    class NoReact:
        limits = Limits(max_length=100)

        async def send(self, target: Target, text: str) -> list[str]:
            return ["1"]

    plain = Outbox(NoReact(), ChatRateLimiter(), asyncio.sleep)  # type: ignore[arg-type]
    assert not plain.can_edit
    with pytest.raises(DeliveryFailed, match="cannot react"):
        await plain.react(HERE, "1", "👍")


# ---------------------------------------------------------------- ChatOrder


async def test_chat_order_releases_in_ticket_order() -> None:
    order = ChatOrder()
    done: list[str] = []

    async def reply(name: str, chat: str, delay: float) -> None:
        before, mine = order.ticket(chat)
        try:
            await asyncio.sleep(delay)
            if before is not None:
                await before.wait()
            done.append(name)
        finally:
            order.release(chat, mine)

    # Tickets are taken in this order (each task runs up to its first await when created in turn);
    # the later replies of chat a are ready sooner but must wait.
    tasks = []
    for name, chat, delay in [("a1", "a", 0.03), ("a2", "a", 0.0), ("b1", "b", 0.01), ("a3", "a", 0.0)]:
        tasks.append(asyncio.ensure_future(reply(name, chat, delay)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert [n for n in done if n.startswith("a")] == ["a1", "a2", "a3"]
    assert done.index("b1") < done.index("a1")  # another chat does not wait
    assert order.ticket("a")[0] is None  # the chain was released completely


async def test_chat_order_keeps_the_tail_when_an_earlier_reply_releases() -> None:
    order = ChatOrder()
    _, first = order.ticket("c")
    before2, second = order.ticket("c")
    assert before2 is first
    order.release("c", first)
    before3, _ = order.ticket("c")
    assert before3 is second


async def test_parts_fit_the_limit_after_format() -> None:
    # `max_length` counts after `format`: markup that grows the text must not push a part over.
    class Escaping(MemoryAdapter):
        def format(self, text: str) -> str:
            return text.replace("&", "&amp;")

    adapter = Escaping(max_length=100)
    sink = sink_for(adapter)
    words = [f"w{i}" for i in range(40)]
    body = " & ".join(words)  # 198 characters, 358 once formatted
    ids = await sink.finish(body)
    assert len(ids) >= 4
    assert all(len(t) <= 100 for t in adapter.messages.values())  # the adapter asserts it on each call too
    assert " ".join(adapter.messages[i] for i in ids).replace("&amp;", "&") == body
    # Growth at the end leaves the earlier parts alone.
    adapter.calls.clear()
    await sink.finish(body + " & more")
    assert {c[1] for c in adapter.calls} <= {ids[-1], f"m{len(ids) + 1}"}
