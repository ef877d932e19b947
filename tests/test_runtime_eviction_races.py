"""Eviction races: `Kernel.runtime` must never hand out a runtime that `_trim_idle` dropped.

A caller that finds another caller loading the conversation's runtime waits on that load's future;
the loader inserts the runtime and returns at once, but the waiter resumes a few loop passes
later. If another conversation is loaded in between, the fresh (still idle) runtime is trimmed.
Before the fix the waiter got that dropped runtime: a watch (the WS hub's subscriptions) pinned a
dead runtime and heard of no later turn, and a submit queued on it ran beside the live runtime's
turns (two turns of one conversation at once, FIFO broken). Now `runtime()` looks again after the
wait. With SQLite reads never yield, so loads are never shared; with PostgreSQL every read is a
real await (here a gate on `list_turns` stands in for one, to make the interleaving certain).
Found by an outside test on PostgreSQL with `idle_runtimes_max=1`: 200 stale runtimes handed out,
60 submits queued on one, 110 overlaps or FIFO breaks over 20 conversations.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from appserver.runtime import Kernel, SubmitRequest, TurnHandle
from appserver.store.base import Store
from tests.support.kernel import open_server


async def _settled_conversation(kernel: Kernel, text: str = "seed") -> str:
    sub = await kernel.submit(SubmitRequest(agent="assistant", input=text, conversation="new"))
    snap = await sub.wait(10)
    assert snap.status == "completed", snap
    return sub.conversation_id


async def _load_another(kernel: Kernel) -> None:
    """Load a new conversation's runtime: with idle_runtimes_max=1 every idle runtime is trimmed."""
    agent = await kernel.resolve_agent("assistant")
    conv = await kernel.resolve_conversation(agent, "new")
    await kernel.runtime(conv.id)


def _gate_loads(store: Store, conversation_id: str) -> list[asyncio.Event]:
    """Each event appended holds one runtime load of `conversation_id` (its `list_turns` read) until
    set, as a PostgreSQL read would."""
    gates: list[asyncio.Event] = []
    real = store.list_turns

    async def list_turns(cid: str, **kw):  # type: ignore[no-untyped-def]
        if cid == conversation_id and gates:
            await gates.pop(0).wait()
        return await real(cid, **kw)

    store.list_turns = list_turns  # type: ignore[method-assign]
    return gates


async def test_a_watch_opened_during_anothers_load_hears_of_turns(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "home", APPSERVER_LIMITS__IDLE_RUNTIMES_MAX="1")
    kernel = server.kernel
    try:
        conv = await _settled_conversation(kernel)
        await _settled_conversation(kernel)
        assert conv not in kernel.runtimes
        gate = asyncio.Event()
        _gate_loads(server.store, conv).append(gate)
        loader = asyncio.create_task(kernel.awaiting(conv))  # any caller that loads and leaves it idle
        await asyncio.sleep(0)
        assert conv in kernel._loading
        seen: list[TurnHandle] = []
        opening = asyncio.create_task(kernel.open_watch(conv, seen.append))  # waits on that load
        await asyncio.sleep(0)
        gate.set()
        await asyncio.sleep(0)
        assert loader.done()  # loaded and inserted; the watch has not resumed yet
        await _load_another(kernel)  # another conversation churns in: the idle runtime is trimmed
        watch = await opening
        try:
            sub = await kernel.submit(SubmitRequest(agent="assistant", input="hello", conversation=conv))
            assert (await sub.wait(10)).status == "completed"
            assert [h.turn_id for h in seen] == [sub.turn_id]
        finally:
            watch.close()
    finally:
        await server.close()


async def test_two_submits_to_one_conversation_never_run_at_once(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "home", APPSERVER_LIMITS__IDLE_RUNTIMES_MAX="1")
    kernel = server.kernel
    try:
        conv = await _settled_conversation(kernel)
        await _settled_conversation(kernel)
        gates = _gate_loads(server.store, conv)
        first_load, second_load = asyncio.Event(), asyncio.Event()
        gates.append(first_load)
        asyncio.create_task(kernel.awaiting(conv))
        await asyncio.sleep(0)
        slow = asyncio.create_task(kernel.submit(SubmitRequest(agent="assistant", input="/slow 10", conversation=conv)))
        await asyncio.sleep(0)  # the submit waits on the load in flight
        first_load.set()
        await asyncio.sleep(0)
        gates.append(second_load)
        await _load_another(kernel)  # trims the runtime the submit is about to get
        asyncio.create_task(kernel.awaiting(conv))  # a second load is in flight at the re-check
        for _ in range(3):
            await asyncio.sleep(0)
        assert conv in kernel._loading and not slow.done()
        second_load.set()
        await asyncio.sleep(0)
        await _load_another(kernel)  # and trims again what the re-check gets
        first = await slow
        second = await kernel.submit(SubmitRequest(agent="assistant", input="second", conversation=conv))
        # Acknowledged second, so it must queue behind the slow turn and run after it.
        snap = await second.wait(10)
        assert snap.status == "completed"
        assert first.handle.controller.snapshot().terminal, "the later turn ended while the earlier one still ran"
        assert second.queue_position == 1
        await first.wait(10)
    finally:
        await server.close()
