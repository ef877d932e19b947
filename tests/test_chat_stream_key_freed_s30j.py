"""Session 30, helper J: a Chat Completions stream that ends without an answer frees its
Idempotency-Key (docs/openai.md: "Only an answer is kept: after an error (… a failed or cancelled
turn …) the key is free again and a repeat runs anew"; after `turn_interrupted` "a retry with the
same Idempotency-Key runs it anew").

Found by an outside tester: a streamed chat whose turn failed (`/error 400`), or whose turn was
interrupted (the server running it killed: the stream on another server of the cluster ended with
`turn_interrupted`), was stored under its key, and a retry with the key got that error stream
replayed (`Idempotent-Replayed: true`) instead of running again. The non-stream chat and the
Responses stream freed the key. Now every end of a chat stream that is no answer (failed,
cancelled, interrupted) frees it; an answer is still kept and replayed.

Real `appserver serve` processes (SQLite; PostgreSQL for the cluster), the real openai SDK, kill -9.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

T = 30.0  # every wait's bound; none is reached when the server works
WORDS = 40  # `/slow 40`: 40 words, 50 ms apart (2 s)
FULL = " ".join(f"w{i}" for i in range(1, WORDS + 1))


def _serve(home: Path, port: int, **env: str) -> ServeProcess:
    """`serve` on `port`, or the next ones of 54000-54499 while one is taken."""
    return start_serve_at(home, port, cli_env(home, **env), last=54490, step=11)


def _sdk(sp: ServeProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=T)


def _statuses(home: Path, text: str) -> list[str]:
    """The statuses of the turns whose input was `text`, oldest first: the turn that wrote it and
    those that re-ran it (a keyed retry's, which writes no user message of its own)."""
    db = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "WITH wrote AS (SELECT turn_id FROM messages WHERE role = 'user' AND content = ?)"
            " SELECT t.status FROM turns t WHERE t.id IN (SELECT turn_id FROM wrote)"
            " OR json_extract(t.input, '$.rerun_of') IN (SELECT turn_id FROM wrote) ORDER BY t.seq",
            (json.dumps(text),),
        ).fetchall()
    finally:
        db.close()
    return [r[0] for r in rows]


class Streamed:
    """What one SDK stream gave: its headers, its text, its finish and the error it raised."""

    def __init__(self) -> None:
        self.headers: Mapping[str, str] = {}
        self.text = ""
        self.finish: str | None = None
        self.error: openai.APIError | None = None


async def _stream(
    client: openai.AsyncOpenAI, text: str, key: str, conv: str | None = None, seen: Streamed | None = None
) -> Streamed:
    """`text` streamed with Idempotency-Key `key` (into conversation `conv`) to its end."""
    out = seen or Streamed()
    headers = {"Idempotency-Key": key, **({"X-Conversation-Id": conv} if conv else {})}
    stream = await client.chat.completions.create(
        model="assistant", messages=[{"role": "user", "content": text}], stream=True, extra_headers=headers
    )
    out.headers = stream.response.headers
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                out.text += choice.delta.content or ""
                out.finish = choice.finish_reason or out.finish
    except openai.APIError as exc:  # an error event in the stream (the SDK raises it)
        out.error = exc
    return out


async def _until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(T):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "home"


# ---------------------------------------------------------------- one server (SQLite)


async def test_a_failed_chat_stream_frees_its_key(home: Path) -> None:
    sp = _serve(home, 54000)
    try:
        client = _sdk(sp)
        first = await _stream(client, "/error 400", "fail-key")
        assert first.error is not None and first.error.code == "upstream_invalid_request", first.error
        again = await _stream(client, "/error 400", "fail-key")
        # before: the first error stream, replayed (`Idempotent-Replayed: true`), nothing ran
        assert again.headers.get("idempotent-replayed") is None, dict(again.headers)
        assert again.error is not None and again.error.code == "upstream_invalid_request", again.error
        assert _statuses(home, "/error 400") == ["failed", "failed"]  # the retry ran anew
    finally:
        stop_all(sp)


async def test_a_cancelled_chat_stream_frees_its_key_and_an_answer_is_kept(home: Path) -> None:
    sp = _serve(home, 54100)
    try:
        client = _sdk(sp)
        text = f"/slow {WORDS}"
        seen = Streamed()
        streaming = asyncio.create_task(_stream(client, text, "cancel-key", seen=seen))
        await _until(lambda: len(seen.text) > 5 or streaming.done(), "the stream showed no text")
        ws = await WS.open(sp.url)
        try:
            conv = seen.headers["x-conversation-id"]
            ack = await ws.request({"type": "cancel", "conversation": conv}, T)
            assert ack.get("cancelled") is True, ack
        finally:
            await ws.close()
        cut = await asyncio.wait_for(streaming, T)
        assert cut.text != FULL and FULL.startswith(cut.text), cut.text
        again = await _stream(client, text, "cancel-key")
        assert again.headers.get("idempotent-replayed") is None, dict(again.headers)
        assert (again.text, again.finish, again.error) == (FULL, "stop", None)
        assert _statuses(home, text) == ["cancelled", "completed"]
        kept = await _stream(client, text, "cancel-key")  # an answer: replayed, nothing runs
        assert kept.headers.get("idempotent-replayed") == "true"
        assert (kept.text, kept.finish) == (FULL, "stop")
        assert _statuses(home, text) == ["cancelled", "completed"]
    finally:
        stop_all(sp)


async def test_a_chat_stream_cut_by_kill_9_runs_anew_after_the_restart(home: Path) -> None:
    sp = _serve(home, 54200)
    text = f"/slow {WORDS}"
    try:
        seen = Streamed()
        streaming = asyncio.create_task(_stream(_sdk(sp), text, "kill-key", seen=seen))
        await _until(lambda: len(seen.text) > 5 or streaming.done(), "the stream showed no text")
        sp.proc.kill()  # kill -9 mid-stream
        sp.proc.wait(10)
        try:
            await asyncio.wait_for(streaming, T)
        except (openai.APIConnectionError, httpx.TransportError):
            pass  # the connection broke off (or it just ended: no finish either way)
        assert seen.finish is None and seen.text != FULL, (seen.finish, seen.text)
    finally:
        stop_all(sp)
    sp = _serve(home, 54200)
    try:
        again = await _stream(_sdk(sp), text, "kill-key")
        assert again.headers.get("idempotent-replayed") is None, dict(again.headers)
        assert (again.text, again.finish, again.error) == (FULL, "stop", None)
        assert _statuses(home, text) == ["interrupted", "completed"]
    finally:
        stop_all(sp)


# ---------------------------------------------------------------- a cluster (PostgreSQL)


@pytest.fixture
def pg_url() -> Iterator[str]:
    require_postgres()
    with temp_database("s30j_key") as url:
        yield url


async def test_a_chat_stream_ended_by_turn_interrupted_frees_its_key(tmp_path: Path, pg_url: str) -> None:
    """B streams a turn that runs on A (A holds the conversation); A is killed: B's stream ends with
    `turn_interrupted`, and a retry with the key runs the request anew (before: that error stream
    was replayed)."""
    fast = {"APPSERVER_STORE__URL": pg_url, "APPSERVER_STORE__HEARTBEAT_S": "0.2"}
    a = _serve(tmp_path / "a", 54300, **fast, APPSERVER_STORE__INSTANCE_TIMEOUT_S="3")
    b = _serve(tmp_path / "b", 54400, **fast, APPSERVER_STORE__INSTANCE_TIMEOUT_S="3")
    try:
        on_a, on_b = _sdk(a), _sdk(b)
        held = await on_a.chat.completions.with_raw_response.create(
            model="assistant", messages=[{"role": "user", "content": "hello"}]
        )
        conv = held.headers["x-conversation-id"]  # A runs this conversation's turns
        text = "/slow 100"  # 5 s: still running on A when A is killed (and run whole again by the retry)
        seen = Streamed()
        streaming = asyncio.create_task(_stream(on_b, text, "interrupted-key", conv, seen))
        await _until(lambda: len(seen.text) > 5 or streaming.done(), "the stream through B showed no text")
        a.proc.kill()  # kill -9 of the server running the turn
        a.proc.wait(10)
        cut = await asyncio.wait_for(streaming, T * 2)
        assert cut.error is not None and cut.error.code == "turn_interrupted", (cut.error, cut.text[-80:])
        again = await _stream(on_b, text, "interrupted-key", conv)
        # before: the `turn_interrupted` stream, replayed
        assert again.headers.get("idempotent-replayed") is None, dict(again.headers)
        assert again.error is None and again.finish == "stop", again.error
        assert again.text == " ".join(f"w{i}" for i in range(1, 101))
    finally:
        stop_all(b, a)
