"""A streamed token shown by the turn's own task (`TurnController.next_snapshot_tapped`, the chat
stream's tap, the edge's `write_body`): the same frames as the snapshot path, every token, in order,
kept for a replay; other consumers of the turn (a WebSocket's watch) still see every change; a
change the tap does not take, the keepalive clock and a cancel wake the stream as before."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appserver.agent.events import PhaseChanged, ReasoningDelta, TextDelta, ToolCallStarted
from appserver.config import load_config
from appserver.runtime import Quiet, TurnController
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

TOKENS = [f"t{i} " for i in range(12)]

# ---------------------------------------------------------------- the controller


def _controller() -> TurnController:
    c = TurnController("turn_1", "conv_1", "agent_1")
    c.apply(PhaseChanged("responding"))
    return c


async def test_a_tapped_consumer_sleeps_through_the_deltas_it_shows_and_wakes_for_the_rest() -> None:
    c = _controller()
    c.apply(TextDelta("a"))  # the block's first piece: a consumer reads it from the snapshot
    seen = c.revision
    shown: list[tuple[int, str, bool, str]] = []

    def tap(index: int, kind: str, refusal: bool, text: str) -> bool:
        shown.append((index, kind, refusal, text))
        return True

    quiet = Quiet(60)
    waiting = asyncio.create_task(c.next_snapshot_tapped(seen, quiet, tap))
    await asyncio.sleep(0)
    for piece in ("b", "c", "d"):
        c.apply(TextDelta(piece))
        await asyncio.sleep(0)
    assert not waiting.done() and shown == [(0, "text", False, p) for p in "bcd"]
    # another consumer (a WebSocket's watch) sees every change the tap took
    assert c.snapshot().blocks[0]["text"] == "abcd" and c.snapshot().revision == seen + 3
    c.apply(ToolCallStarted("call_1", "f", "server"))  # not a text delta: it wakes
    snap, now = await asyncio.wait_for(waiting, 5)
    assert snap is not None and snap.revision == now == c.revision
    assert [b["type"] for b in snap.blocks] == ["text", "tool_call"]
    assert not c._taps
    quiet.close()


async def test_a_declined_delta_a_new_block_and_a_consumer_behind_all_wake() -> None:
    c = _controller()
    c.apply(TextDelta("a"))
    quiet = Quiet(60)

    def no(index: int, kind: str, refusal: bool, text: str) -> bool:
        return False

    waiting = asyncio.create_task(c.next_snapshot_tapped(c.revision, quiet, no))
    await asyncio.sleep(0)
    c.apply(TextDelta("b"))
    snap, _ = await asyncio.wait_for(waiting, 5)
    assert snap is not None and snap.blocks[0]["text"] == "ab"

    calls: list[str] = []

    def yes(index: int, kind: str, refusal: bool, text: str) -> bool:
        calls.append(text)
        return True

    waiting = asyncio.create_task(c.next_snapshot_tapped(c.revision, quiet, yes))
    await asyncio.sleep(0)
    c.apply(ReasoningDelta("r"))  # a new block (and phase): never offered
    snap, _ = await asyncio.wait_for(waiting, 5)
    assert snap is not None and calls == [] and snap.blocks[-1] == {"type": "reasoning", "text": "r"}

    # behind (a revision it has not read): no wait, the snapshot at once, nothing offered
    c.apply(ReasoningDelta("s"))
    snap, _ = await asyncio.wait_for(c.next_snapshot_tapped(c.revision - 1, quiet, yes), 5)
    assert snap is not None and calls == []
    quiet.close()


async def test_the_end_of_the_turn_wakes_a_tapped_consumer_and_a_cancel_leaves_no_hand() -> None:
    c = _controller()
    c.apply(TextDelta("a"))
    quiet = Quiet(60)
    waiting = asyncio.create_task(c.next_snapshot_tapped(c.revision, quiet, lambda *_: True))
    await asyncio.sleep(0)
    c.finish("completed", "end_turn")
    snap, _ = await asyncio.wait_for(waiting, 5)
    assert snap is not None and snap.status == "completed"

    c = _controller()
    c.apply(TextDelta("a"))
    waiting = asyncio.create_task(c.next_snapshot_tapped(c.revision, quiet, lambda *_: True))
    await asyncio.sleep(0)
    assert len(c._taps) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not c._taps and quiet.waiter is None
    c.apply(TextDelta("b"))  # nobody is offered it
    quiet.close()


async def test_the_keepalive_falls_due_only_after_a_quiet_interval_of_shown_deltas() -> None:
    c = _controller()
    c.apply(TextDelta("a"))
    seen = c.revision
    quiet = Quiet(0.15)
    waiting = asyncio.create_task(c.next_snapshot_tapped(seen, quiet, lambda *_: True))
    for _ in range(4):  # a delta every 0.05 s pushes the keepalive back
        await asyncio.sleep(0.05)
        c.apply(TextDelta("x"))
        assert not waiting.done()
    snap, shown = await asyncio.wait_for(waiting, 5)
    assert snap is None and shown == c.revision == seen + 4  # a keepalive: nothing new to read
    quiet.close()


async def test_a_tap_that_raises_wakes_its_consumer_and_the_turn_goes_on() -> None:
    c = _controller()
    c.apply(TextDelta("a"))
    quiet = Quiet(60)

    def broken(index: int, kind: str, refusal: bool, text: str) -> bool:
        raise RuntimeError("boom")

    waiting = asyncio.create_task(c.next_snapshot_tapped(c.revision, quiet, broken))
    await asyncio.sleep(0)
    c.apply(TextDelta("b"))
    snap, _ = await asyncio.wait_for(waiting, 5)
    assert snap is not None and snap.blocks[0]["text"] == "ab"
    quiet.close()


# ---------------------------------------------------------------- through `appserver serve`


def gapped(_req: RecordedRequest) -> Reply:
    events = [chunk(role="assistant", content="")] + [chunk(content=t) for t in TOKENS]
    pieces = [openai_sse([e], done=False) for e in events]
    pieces.append(openai_sse([chunk(finish_reason="stop")]))
    return Reply(pieces=pieces, delay_s=0.03)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with FakeOpenAI() as fake:
        fake.responder = gapped
        home = tmp_path_factory.mktemp("tap") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        r = run_cli(home, "agents", "create", "--name", "remote", "--model", "fake:m", "--json", env=env)
        assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp


def _events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    return [e.removeprefix(b"data: ").decode() for e in raw[:-2].split(b"\n\n") if not e.startswith(b":")]


BODY = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_every_token_is_its_own_chunk_in_order_and_a_replay_has_them_all(srv: ServeProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        headers = {"Idempotency-Key": "tap-replay-1"}
        parts: list[bytes] = []
        with http.stream("POST", "/v1/chat/completions", json=BODY, headers=headers) as r:
            assert r.status_code == 200
            for part in r.iter_raw():
                parts.append(part)
        raw = b"".join(parts)
        events = _events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
        assert contents == TOKENS  # one chunk per token, none joined, none lost
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all("usage" not in c for c in chunks)
        # the frames as the snapshot path writes them (same keys, same order, compact JSON)
        first = events[2]
        assert first == json.dumps(chunks[2], separators=(",", ":"))
        # the whole stream, kept for its key, comes back byte for byte
        again = http.post("/v1/chat/completions", json=BODY, headers=headers)
        assert again.status_code == 200 and again.content == raw


def test_a_stream_left_mid_way_cancels_its_turn_and_keeps_what_was_shown(srv: ServeProcess) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
            conversation = r.headers["x-conversation-id"]
            got = b""
            for part in r.iter_raw():
                got += part
                if got.count(b'"content"') >= 3:
                    break
    # the client is gone: the turn ends cancelled, the text it had shown kept
    db = sqlite3.connect(str(load_config(srv.home, environ={}).db_path))
    try:
        for _ in range(200):
            row = db.execute("SELECT status FROM turns WHERE conversation_id=?", (conversation,)).fetchone()
            if row is not None and row[0] not in ("queued", "running"):
                break
            time.sleep(0.05)
        assert row is not None and row[0] == "cancelled", row
        kept = db.execute(
            "SELECT content FROM messages WHERE conversation_id=? AND role='assistant'", (conversation,)
        ).fetchone()
        assert kept is not None
        text = json.loads(kept[0])
        assert text.startswith("t0 t1 ") and len(text) < len("".join(TOKENS)), text
    finally:
        db.close()


def test_tokens_reach_the_stream_and_a_second_turn_of_the_conversation_streams_too(
    srv: ServeProcess, tmp_path: Path
) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json=BODY)
        conversation = first.headers["x-conversation-id"]
        second = http.post("/v1/chat/completions", json=BODY, headers={"X-Conversation-Id": conversation})
        for r in (first, second):
            events = _events(r.content)
            contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-2]]
            assert contents == TOKENS
