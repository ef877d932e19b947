"""Session 28, helper S: a server that takes a conversation over shows the turns it had followed
(docs/scale-out.md, "Live views").

Found by an outside tester: when server B followed a turn of a conversation A held (an input
accepted through B and queued there, or a paused turn a stream on B waited on) and then took the
conversation over after A's kill -9, B's mirror of that turn was never pointed at the turn's
handle in B's own runtime. Its stream got the text only from the stored draft (in ~2 s steps) or
as one piece at the end, and `conversation_state` counted the turn twice (`queued` one too high).
Now each mirror of a turn the server comes to hold follows that turn's handle there, and leaves
the mirrors. Real PostgreSQL, real `appserver serve` processes, kill -9, real clients.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, cut, one_call_sse, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.net import SSL
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(150)

T = 60.0
WORDS = 80  # `/slow 80`: 80 words, 50 ms apart (4 s): some 60 of them a second before the last


@pytest.fixture
def db() -> Iterator[str]:
    require_postgres()
    with temp_database("fixs28_handover") as url:
        yield url


# A killed holder is judged gone once its lock is free and its heartbeat older than 2.5 heartbeats:
# 0.625 s at 0.25 s heartbeats (5 s at the default 2 s). The instance timeout (a live server's
# heartbeat missed) stays the default 30 s: nothing here stops a live server, and a live server
# holds its lock (a late heartbeat of a loaded one is no reason to judge it gone).
FAST_BEAT = {"APPSERVER_STORE__HEARTBEAT_S": "0.25"}


def _serve(home: Path, port: int, url: str) -> ServeProcess:
    """`serve` on `port`, or the next ones of 37000-37199 while one is taken."""
    return start_serve_at(home, port, cli_env(home, APPSERVER_STORE__URL=url, **FAST_BEAT), last=37190, step=9)


def _early(times: list[float], before_end_s: float = 1.0) -> int:
    """How many of these arrivals came at least `before_end_s` before the last one."""
    return sum(1 for t in times if t <= times[-1] - before_end_s)


def _beat_since_joined(url: str, holder: ServeProcess, joined: ServeProcess) -> float | None:
    """`holder`'s last heartbeat renewal, if it came after `joined`'s row was written."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT h.heartbeat_at FROM instances h, instances j "
            "WHERE h.pid = %s AND j.pid = %s AND h.heartbeat_at > j.started_at",
            (holder.proc.pid, joined.proc.pid),
        ).fetchone()
    return float(row[0]) if row else None


async def _running_beside(url: str, owner: WS, turn_id: str, a: ServeProcess, b: ServeProcess) -> None:
    """`turn_id` runs on A (its first words came), and A has counted B among its peers (it renewed
    its heartbeat after B joined, which counts them, and then again): what a wait of a few
    heartbeats made sure of."""
    await owner.expect(
        lambda f: (
            f["type"] == "turn_updated"
            and f["snapshot"]["turn_id"] == turn_id
            and any(k["type"] == "text" and k.get("text") for k in f["snapshot"]["blocks"])
        ),
        T,
    )
    beats: set[float] = set()
    deadline = time.monotonic() + T
    while len(beats) < 2:
        assert time.monotonic() < deadline, "A did not renew its heartbeat after B joined"
        beat = await asyncio.to_thread(_beat_since_joined, url, a, b)
        if beat is not None:
            beats.add(beat)
        await asyncio.sleep(0.1)


async def _chat_stream(
    url: str, conv: str, text: str, opened: asyncio.Event | None = None
) -> tuple[str, list[float], str | None]:
    began = time.monotonic()
    arrivals: list[float] = []
    content = ""
    finish: str | None = None
    async with httpx.AsyncClient(timeout=T * 2, verify=SSL) as http:
        async with http.stream(
            "POST",
            url + "/v1/chat/completions",
            headers={"X-Conversation-Id": conv},
            json={"model": "assistant", "stream": True, "messages": [{"role": "user", "content": text}]},
        ) as stream:
            assert stream.status_code == 200
            if opened is not None:
                opened.set()  # the input was accepted (through B: queued behind A's turn)
            async for line in stream.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                assert "error" not in data, data
                for choice in data.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        arrivals.append(time.monotonic() - began)
                        content += piece
                    finish = choice.get("finish_reason") or finish
    return content, arrivals, finish


async def test_a_stream_queued_through_b_shows_its_reply_as_it_grows_after_b_takes_over(
    db: str, tmp_path: Path
) -> None:
    a = _serve(tmp_path / "a", 37001, db)
    b = _serve(tmp_path / "b", 37002, db)
    try:
        owner = await WS.open(a.url)
        try:
            first = await owner.request(
                {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 1000"}, T
            )
            conv = first["conversation_id"]
            await _running_beside(db, owner, first["turn_id"], a, b)
            opened = asyncio.Event()
            queued = asyncio.ensure_future(_chat_stream(b.url, conv, f"/slow {WORDS}", opened))
            await asyncio.wait_for(opened.wait(), T)  # accepted through B, queued behind A's turn
            await asyncio.sleep(0.2)  # (its stream waiting on B's mirror of it)
            a.kill()
            text, arrivals, finish = await asyncio.wait_for(queued, T)
        finally:
            await owner.close()
        assert text == " ".join(f"w{i}" for i in range(1, WORDS + 1))
        assert finish == "stop"
        # as the words come (50 ms apart), not from the draft B read every 2 s (3 or 4 pieces)
        assert _early(arrivals) >= 20, arrivals
    finally:
        stop_all(b, a)


async def test_the_new_holder_counts_each_queued_turn_once(db: str, tmp_path: Path) -> None:
    a = _serve(tmp_path / "a", 37011, db)
    b = _serve(tmp_path / "b", 37012, db)
    try:
        owner = await WS.open(a.url)
        ws = await WS.open(b.url)
        try:
            first = await owner.request(
                {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 1000"}, T
            )
            conv = first["conversation_id"]
            await _running_beside(db, owner, first["turn_id"], a, b)
            state = await ws.request({"type": "subscribe", "conversation": conv}, T)  # B follows A's turns
            assert state["queued"] == 0, state
            one = await ws.request(  # 3 s of output: the poll below (0.2 s apart) sees it run
                {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 60"}, T
            )
            two = await ws.request(
                {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "last"}, T
            )
            assert (one["queue_position"], two["queue_position"]) == (1, 2), (one, two)
            state = await ws.request({"type": "subscribe", "conversation": conv}, T)
            assert state["queued"] == 2, state
            a.kill()
            # B takes the conversation over: A's turn ends interrupted, `one` runs, `two` waits
            deadline = time.monotonic() + T
            while True:
                state = await ws.request({"type": "subscribe", "conversation": conv}, T)
                if (state.get("active_turn") or {}).get("turn_id") == one["turn_id"]:
                    break
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.2)
            assert state["state"] == "active", state
            assert state["queued"] == 1, state
            end = await ws.terminal(two["turn_id"], T)
            assert end["status"] == "completed", end
            state = await ws.request({"type": "subscribe", "conversation": conv}, T)
            assert (state["state"], state["queued"]) == ("idle", 0), state
        finally:
            await ws.close()
            await owner.close()
    finally:
        stop_all(b, a)


# ------------------------------------------------------------------ a paused turn answered through B

AFTER = "after" + "".join(f" a{i}" for i in range(1, 31))


def _model(req: RecordedRequest) -> Reply:
    messages = req.json["messages"]
    if messages[-1]["role"] == "tool":  # the answer: 31 pieces, 0.1 s apart
        sse = openai_sse(
            [chunk(role="assistant", content="after")]
            + [chunk(content=f" a{i}") for i in range(1, 31)]
            + [chunk(finish_reason="stop")]
        )
        return Reply(pieces=cut(sse, chunk_size=150), delay_s=0.1)
    return Reply(pieces=[one_call_sse("call_" + uuid.uuid4().hex[:10], "lookup", '{"q":"x"}')])


async def test_a_paused_turn_answered_through_b_after_the_holder_died_streams_as_it_grows(
    db: str, tmp_path: Path
) -> None:
    with FakeOpenAI() as fake:
        fake.responder = _model
        for home in (tmp_path / "a", tmp_path / "b"):
            home.mkdir()
            (home / "config.toml").write_text(
                f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
            )
        made = run_cli(
            tmp_path / "a",
            "agents",
            "create",
            "--name",
            "gpt",
            "--model",
            "fake:m",
            env=cli_env(tmp_path / "a", APPSERVER_STORE__URL=db),
        )
        assert made.code == 0, made.err
        a = _serve(tmp_path / "a", 37021, db)
        b = _serve(tmp_path / "b", 37022, db)
        try:
            tools = [
                {
                    "type": "function",
                    "name": "lookup",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                }
            ]
            async with httpx.AsyncClient(timeout=T * 2, verify=SSL) as http:
                r = await http.post(
                    a.url + "/v1/responses",
                    json={"model": "gpt", "input": "call it", "tools": tools, "tool_choice": "required"},
                )
                assert r.status_code == 200, r.text
                paused = r.json()
                call = next(o for o in paused["output"] if o["type"] == "function_call")
                a.kill()  # the holder of the paused turn
                body: dict[str, Any] = {
                    "model": "gpt",
                    "previous_response_id": paused["id"],
                    "tools": tools,
                    "stream": True,
                    "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "42"}],
                }
                began = time.monotonic()
                arrivals: list[float] = []
                text = ""
                final: dict[str, Any] | None = None
                async with http.stream("POST", b.url + "/v1/responses", json=body) as stream:
                    assert stream.status_code == 200
                    async for line in stream.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        assert event.get("type") != "error", event
                        if event.get("type") == "response.output_text.delta":
                            arrivals.append(time.monotonic() - began)
                            text += event["delta"]
                        if event.get("type") in ("response.completed", "response.failed", "response.incomplete"):
                            final = event["response"]
            assert final is not None and final["status"] == "completed", final
            assert text == AFTER
            # as the upstream streams it (31 pieces over ~3 s), not in one delta at the end
            assert len(arrivals) >= 10 and _early(arrivals) >= 5, arrivals
        finally:
            stop_all(b, a)
