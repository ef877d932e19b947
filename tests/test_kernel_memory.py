"""What a settled conversation leaves in memory: runtimes free by reference counting (no cycles for
the garbage collector to walk), and at most `idle_runtimes_max` idle ones stay loaded."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from appserver import fastjson
from appserver.http.app import build_app
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.services import build_services
from appserver.store.integrity import read_position, write_position
from tests.support.kernel import open_server


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    s = await open_server(tmp_path / "home", APPSERVER_LIMITS__IDLE_RUNTIMES_MAX="10")
    yield s
    await s.close()


async def _turn(server: Server, text: str, conversation: str = "new") -> str:
    sub = await server.kernel.submit(SubmitRequest(agent="assistant", input=text, conversation=conversation))
    snap = await sub.wait(60)  # a big turn under tracemalloc takes seconds on a loaded machine
    assert snap.status == "completed", snap
    return sub.conversation_id


@pytest.mark.parametrize("text", ["hello", "/call clock {}"], ids=["text", "server-tool"])
async def test_an_evicted_runtime_is_freed_without_the_garbage_collector(server: Server, text: str) -> None:
    conv = await _turn(server, text)
    await _turn(server, "again", conv)
    ref = weakref.ref(server.kernel.runtimes[conv])
    await asyncio.sleep(0)  # let the turn's task finish its last step
    gc.disable()
    try:
        assert server.kernel.evict_idle(0) >= 1
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())] if ref() else None
    finally:
        gc.enable()


async def test_idle_runtimes_beyond_the_limit_go_least_recently_used_first(server: Server) -> None:
    kept = await _turn(server, "first")
    others = [await _turn(server, f"n{i}") for i in range(9)]
    await _turn(server, "used again", kept)  # now the most recently used
    more = [await _turn(server, f"m{i}") for i in range(3)]
    loaded = server.kernel.runtimes
    assert len(loaded) <= 10
    assert kept in loaded and all(c in loaded for c in more)
    assert others[0] not in loaded
    # An evicted conversation is loaded again from the store, history intact.
    sub = await server.kernel.submit(SubmitRequest(agent="assistant", input="back", conversation=others[0]))
    await sub.wait(5)
    assert others[0] in server.kernel.runtimes
    history = await server.store.list_messages(others[0])
    assert [m.role for m in history] == ["user", "assistant", "user", "assistant"]


async def test_a_busy_runtime_is_never_trimmed(tmp_path: Path) -> None:
    server = await open_server(tmp_path / "home", APPSERVER_LIMITS__IDLE_RUNTIMES_MAX="2")
    try:
        await server.agents.update("assistant", tools={"clock": "ask"})
        waiting = await server.kernel.submit(
            SubmitRequest(agent="assistant", input="/call clock {}", conversation="new")
        )
        snap = await waiting.wait(5)
        assert snap.status == "awaiting"
        for i in range(5):
            await _turn(server, f"x{i}")
        assert waiting.conversation_id in server.kernel.runtimes  # its approval is still answerable
        assert (await server.kernel.awaiting(waiting.conversation_id)) is not None
    finally:
        await server.close()


@pytest.mark.parametrize("text", ["hello", "/call clock {}"], ids=["text", "server-tool"])
async def test_turns_leave_no_cyclic_garbage(server: Server, text: str) -> None:
    """Cyclic garbage waits for a full collection, whose pause grows with everything in memory:
    a turn must not leave any (a runtime's callbacks, a turn's work holding itself, ...)."""
    await _turn(server, "warm up")
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            await _turn(server, text)
        await asyncio.sleep(0)
        server.kernel.evict_idle(0)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(garbage) < 20, sorted(garbage)


def test_recording_the_store_position_leaves_no_cyclic_garbage(tmp_path: Path) -> None:
    """The checkpointer records the position about every second under load (a thread of the same
    process): garbage it leaves lands in the collections that every turn's pause depends on."""
    gc.collect()
    gc.disable()
    try:
        write_position(tmp_path / "store.db", 42)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert garbage == []
    assert read_position(tmp_path / "store.db") == 42


# ---------------------------------------------------------------- a big input, then the turn settled

# A pasted file of short words: echo answers it word by word, so the turn streams 200k deltas.
BIG_TEXT = ("a " * 200_000).strip()


async def _retained_by(run: Callable[[], Awaitable[object]]) -> int:
    """Bytes allocated by `run` that are still alive once it returned (tracemalloc, one frame)."""
    gc.collect()
    tracemalloc.start(1)
    try:
        await run()
        await asyncio.sleep(0)  # let the turn's task finish its last step
        gc.collect()
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


async def test_a_big_input_costs_its_size_not_a_string_per_streamed_piece(server: Server) -> None:
    """The settled turn's runtime holds its messages (the reply, 0.4 MB) and nothing per delta: the
    snapshot shares the reply's string. One string per delta held ~35 times the input."""
    conv: list[str] = []

    async def big_turn() -> None:
        conv.append(await _turn(server, BIG_TEXT))

    retained = await _retained_by(big_turn)
    assert conv[0] in server.kernel.runtimes
    history = await server.store.list_messages(conv[0])
    assert history[-1].content == f"echo: {BIG_TEXT}"
    assert retained < 1.5 * len(BIG_TEXT), (
        f"{retained / 1e6:.1f} MB kept by a turn of a {len(BIG_TEXT) / 1e6:.1f} MB input"
    )


async def test_a_big_paste_over_http_is_held_once_until_eviction(server: Server) -> None:
    """The non-stream chat route with the input a client pastes: what stays until the runtime is
    evicted is the conversation's two messages (the input and echo's reply), and then nothing."""
    app = build_app(server, build_services(server))
    body = fastjson.dumps({"model": "assistant", "messages": [{"role": "user", "content": BIG_TEXT}]}).encode()

    async def post() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            reply = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 200, reply.text[:300]
        assert reply.json()["choices"][0]["message"]["content"] == f"echo: {BIG_TEXT}"

    gc.collect()
    tracemalloc.start(1)
    try:
        await post()
        await asyncio.sleep(0)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        assert server.kernel.runtime_count == 1
        assert server.kernel.evict_idle(0) == 1
        gc.collect()
        after_eviction = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2.5 * len(BIG_TEXT), f"{held / 1e6:.1f} MB kept by a request of a {len(BIG_TEXT) / 1e6:.1f} MB input"
    # What the first request of a server leaves (~64 KB of caches and pools), not a message's worth.
    assert after_eviction < 0.25 * len(BIG_TEXT), f"{after_eviction / 1e6:.2f} MB still held after eviction"
