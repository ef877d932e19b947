"""A stop (SIGTERM) while OpenAI requests wait on turns: every client gets an OpenAI error, never
uvicorn's plain-text "Internal Server Error" or a stream cut mid-body (DESIGN §5), the turns are
kept (interrupted, or still paused for their approval) for the next start, and the server still
exits 0 in time.

One real `appserver serve`, one stop, many requests waiting at once: on a server-side shell tool
(`sleep 30`), on the model (echo's `/slow`), on an approval (chat waits for a WebSocket client), on
every route and mode (chat and responses, non-stream and stream), and a WebSocket client whose
turn runs the tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets

from appserver.cli.serve import DRAIN_S, GRACE_S
from appserver.http.stopping import Stopping
from tests.openai_schema import validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

SLEEP = '/call shell {"command": "sleep 30"}'
ASK = '/call shell {"command": "echo asked"}'
SLOW = "/slow 2000"  # 2,000 words, 50 ms apart: still streaming when the server stops

# conversation id → (agent, route, stream, prompt)
CASES: dict[str, tuple[str, str, bool, str]] = {
    "tool-chat": ("tooler", "chat", False, SLEEP),
    "tool-chat-stream": ("tooler", "chat", True, SLEEP),
    "tool-resp": ("tooler", "responses", False, SLEEP),
    "tool-resp-stream": ("tooler", "responses", True, SLEEP),
    "model-chat": ("tooler", "chat", False, SLOW),
    "model-chat-stream": ("tooler", "chat", True, SLOW),
    "model-resp-stream": ("tooler", "responses", True, SLOW),
    "approval-chat": ("asker", "chat", False, ASK),
    "approval-chat-stream": ("asker", "chat", True, ASK),
}
WS_CASE = "the WebSocket client's"  # its conversation id is the server's: stopped["ws"]["conversation"]
QUEUE_CONV = "queue-front"  # a slow turn runs here, and one request's input waits queued behind it


def _db(home: Path) -> sqlite3.Connection:
    return contextlib.closing(sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True))  # type: ignore[return-value]


def turns(home: Path) -> dict[str, list[dict[str, Any]]]:
    """conversation id → its turns (oldest first)."""
    with _db(home) as db:  # type: ignore[attr-defined]
        rows = db.execute("SELECT conversation_id, status, stop_reason, error FROM turns ORDER BY rowid").fetchall()
    out: dict[str, list[dict[str, Any]]] = {}
    for conv, status, stop_reason, error in rows:
        out.setdefault(conv, []).append({"status": status, "stop_reason": stop_reason, "error": error})
    return out


def messages(home: Path, conversation_id: str) -> list[dict[str, Any]]:
    with _db(home) as db:  # type: ignore[attr-defined]
        rows = db.execute(
            "SELECT role, content, tool_calls, is_error, completion_status FROM messages"
            " WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
    return [
        {
            "role": r,
            "content": json.loads(c),
            "tool_calls": json.loads(t) if t else [],
            "is_error": bool(e),
            "status": s,
        }
        for r, c, t, e, s in rows
    ]


def ready(home: Path, conversation_id: str, prompt: str) -> bool:
    """The conversation's turn is where the case wants it when the stop comes."""
    try:
        ts = turns(home).get(conversation_id) or []
        if not ts:
            return False
        if prompt == ASK:
            return ts[-1]["status"] == "awaiting"
        if ts[-1]["status"] != "running":
            return False
        if prompt == SLEEP:  # the call is checkpointed just before the shell runs
            return any(m["tool_calls"] for m in messages(home, conversation_id))
        return True
    except sqlite3.Error:
        return False


async def run_case(client: openai.AsyncOpenAI, conv: str, case: tuple[str, str, bool, str], seen: dict) -> dict:
    agent, route, stream, prompt = case
    headers = {"X-Conversation-Id": conv}
    out: dict[str, Any] = {"events": []}
    try:
        if route == "chat" and not stream:
            await client.chat.completions.create(
                model=agent, messages=[{"role": "user", "content": prompt}], extra_headers=headers
            )
        elif route == "chat":
            async for c in await client.chat.completions.create(
                model=agent, messages=[{"role": "user", "content": prompt}], stream=True, extra_headers=headers
            ):
                out["events"].append(c)
                seen[conv] = True
        elif not stream:
            await client.responses.create(model=agent, input=prompt, extra_headers=headers)
        else:
            async for e in await client.responses.create(model=agent, input=prompt, stream=True, extra_headers=headers):
                out["events"].append(e)
                if e.type == "response.output_text.delta":
                    seen[conv] = True
        out["ok"] = True
    except Exception as exc:  # what the SDK raised is the result
        out["exc"] = exc
    return out


async def ws_submit(url: str) -> tuple[WS, str]:
    """A WebSocket client whose turn runs the shell tool: (the client, its conversation id)."""
    ws = await WS.open(url)
    state = await ws.request({"type": "create_conversation", "agent": "tooler"})
    conv = state["conversation"]["id"]
    ack = await ws.request({"type": "submit_input", "agent": "tooler", "conversation": conv, "input": SLEEP})
    assert ack["type"] == "ack", ack
    return ws, conv


async def ws_until_closed(ws: WS) -> dict[str, Any]:
    frames: list[dict[str, Any]] = []
    try:
        while True:
            frames.append(await ws.recv(30))
    except websockets.ConnectionClosed as exc:
        return {"frames": frames, "code": exc.rcvd.code if exc.rcvd else None}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("shutdown") / "home"
    env = cli_env(home)
    for name, tool in (("tooler", "shell=allow"), ("asker", "shell=ask")):
        r = run_cli(home, "agents", "create", "--name", name, "--tool", tool, env=env)
        assert r.code == 0, r.err
    sp = start_serve(home, env=env)
    try:
        yield asyncio.run(scenario(sp))
    finally:
        sp.kill()


async def scenario(sp: ServeProcess) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", timeout=60)  # default retries
    seen: dict[str, bool] = {}
    ws, ws_conv = await ws_submit(sp.url)
    tasks = {conv: asyncio.create_task(run_case(client, conv, case, seen)) for conv, case in CASES.items()}
    front = asyncio.create_task(run_case(client, QUEUE_CONV, ("tooler", "chat", True, SLOW), seen))
    deadline = time.monotonic() + 20
    while not ready(sp.home, QUEUE_CONV, SLOW):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    queued = asyncio.create_task(run_case(client, QUEUE_CONV, ("tooler", "chat", False, "after the stop"), seen))
    want = {**{c: case[3] for c, case in CASES.items()}, ws_conv: SLEEP}
    while not (
        all(ready(sp.home, c, p) for c, p in want.items())
        and all(seen.get(c) for c, case in CASES.items() if case[2] and case[3] == SLOW)
        and [t["status"] for t in turns(sp.home).get(QUEUE_CONV, [])] == ["running", "queued"]
    ):
        assert time.monotonic() < deadline, {c: turns(sp.home).get(c) for c in want}
        for conv, t in tasks.items():
            assert not t.done(), (conv, t.result())
        await asyncio.sleep(0.05)
    started = time.monotonic()
    sp.proc.send_signal(signal.SIGTERM)
    ws_task = asyncio.create_task(ws_until_closed(ws))
    code = await asyncio.to_thread(sp.proc.wait, 30)
    took = time.monotonic() - started
    results = {conv: await t for conv, t in tasks.items()}
    results["front"], results["queued"] = await front, await queued
    ws_result = {**await ws_task, "conversation": ws_conv}
    await client.close()
    stderr = sp.proc.stderr.read() if sp.proc.stderr else ""
    return {"home": sp.home, "code": code, "took": took, "results": results, "ws": ws_result, "stderr": stderr}


def test_the_server_exits_0_in_time_and_cancels_nothing_into_a_500(stopped: dict[str, Any]) -> None:
    assert stopped["code"] == 0, stopped["stderr"][-3000:]
    # the graceful wait, then the answers: well before uvicorn would cancel what is left
    assert stopped["took"] < GRACE_S + DRAIN_S, stopped["took"]
    err = stopped["stderr"]
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err[-3000:]
    assert "timeout graceful shutdown exceeded" not in err, err[-3000:]  # nothing left for uvicorn to cut
    assert "503 server_shutting_down" in err, err[-3000:]


@pytest.mark.parametrize("conv", [c for c, case in CASES.items() if not case[2]])
def test_a_waiting_non_stream_request_gets_a_503_error_object(stopped: dict[str, Any], conv: str) -> None:
    exc = stopped["results"][conv].get("exc")
    assert isinstance(exc, openai.APIStatusError), stopped["results"][conv]
    assert exc.status_code == 503, exc
    body = exc.response.json()
    validate("ErrorResponse", body)
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "server_shutting_down", body
    assert exc.response.headers["x-should-retry"] == "false"  # the SDK did not resend the input


@pytest.mark.parametrize("conv", [c for c, case in CASES.items() if case[2] and case[1] == "chat"])
def test_a_waiting_chat_stream_ends_in_an_error_the_sdk_raises(stopped: dict[str, Any], conv: str) -> None:
    result = stopped["results"][conv]
    exc = result.get("exc")
    assert isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIConnectionError), result
    assert exc.body["code"] == "server_shutting_down" and exc.body["type"] == "server_error", exc.body  # type: ignore[index]
    validate("ErrorResponse", {"error": exc.body})
    assert all(c.choices[0].finish_reason is None for c in result["events"] if c.choices)  # never a `stop`


@pytest.mark.parametrize("conv", [c for c, case in CASES.items() if case[2] and case[1] == "responses"])
def test_a_waiting_responses_stream_ends_with_response_failed(stopped: dict[str, Any], conv: str) -> None:
    result = stopped["results"][conv]
    assert result.get("ok"), result  # ended as a stream does, not cut (the SDK would raise)
    events = result["events"]
    for i, e in enumerate(events):
        assert e.sequence_number == i, events
        validate("ResponseStreamEvent", e.model_dump(mode="json", exclude_unset=True))
    last = events[-1]
    assert last.type == "response.failed", last
    assert last.response.error.code == "server_error" and "server_shutting_down" in last.response.error.message


def test_an_input_still_queued_is_dropped_so_the_retry_it_is_told_to_make_is_no_duplicate(
    stopped: dict[str, Any],
) -> None:
    """The 503 says "retry once the server is back": the queued input behind a running turn must
    not run after the restart as well (it did, and a retry answered it twice). It names the
    conversation its input went into."""
    exc = stopped["results"]["queued"].get("exc")
    assert isinstance(exc, openai.APIStatusError) and exc.status_code == 503, stopped["results"]["queued"]
    assert exc.response.headers["x-conversation-id"] == QUEUE_CONV
    statuses = [t["status"] for t in turns(stopped["home"])[QUEUE_CONV]]
    assert statuses == ["interrupted", "cancelled"], statuses  # the front one kept, the queued one dropped


def test_a_websocket_client_is_told_and_closed_with_1012(stopped: dict[str, Any]) -> None:
    ws = stopped["ws"]
    assert {"type": "event", "name": "server_stopping", "data": {"reason": "shutdown"}} in ws["frames"], ws
    assert ws["code"] == 1012, ws  # docs/protocol.md: reconnect with backoff


@pytest.fixture(scope="module")
def restarted(stopped: dict[str, Any]) -> Iterator[tuple[ServeProcess, dict[str, Any]]]:
    home = stopped["home"]
    with serving(home, env=cli_env(home)) as sp:
        yield sp, stopped


@pytest.mark.parametrize("conv", [*(c for c, case in CASES.items() if case[3] != ASK), WS_CASE])
def test_the_interrupted_turn_is_kept_and_the_conversation_goes_on(
    restarted: tuple[ServeProcess, dict[str, Any]], conv: str
) -> None:
    sp, stopped = restarted
    if conv == WS_CASE:
        conv = stopped["ws"]["conversation"]
    (turn,) = turns(sp.home)[conv]
    assert turn["status"] == "interrupted", turn
    # it says why, as a turn a crash interrupted does (a cron run's log and every client show it)
    assert json.loads(turn["error"])["message"] == "the server stopped while this turn was running", turn
    rows = messages(sp.home, conv)
    assert rows[0]["role"] == "user"
    if CASES.get(conv, ("", "", False, SLEEP))[3] == SLEEP:
        # the call the tool was running, closed with a synthetic error result: a valid history
        assert rows[1]["tool_calls"] and rows[1]["tool_calls"][0]["name"] == "shell", rows
        assert rows[2]["role"] == "tool" and rows[2]["is_error"], rows
    elif CASES[conv][2]:  # streamed text: kept, marked interrupted
        assert rows[-1]["role"] == "assistant" and rows[-1]["content"].startswith("w1 w2"), rows
        assert rows[-1]["status"] == "interrupted", rows
    client = openai.OpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="tooler", messages=[{"role": "user", "content": "again"}], extra_headers={"X-Conversation-Id": conv}
    )
    assert reply.choices[0].message.content == "echo: again"


@pytest.mark.parametrize("conv", [c for c, case in CASES.items() if case[3] == ASK])
def test_a_turn_waiting_for_an_approval_still_waits_after_the_restart(
    restarted: tuple[ServeProcess, dict[str, Any]], conv: str
) -> None:
    sp, _ = restarted
    (turn,) = turns(sp.home)[conv]
    assert turn["status"] == "awaiting", turn  # pending calls live in the store: nothing lost


# ---------------------------------------------------------------- the guard itself


async def test_stopping_converts_only_its_own_cancellation() -> None:
    stopping = Stopping()
    entered = asyncio.Event()

    async def guarded() -> str:  # as api_route and TurnRun.snapshots guard their waits
        if stopping.stopped:
            return "stopped"
        task = stopping.enter()
        entered.set()
        try:
            await asyncio.sleep(30)
            return "slept"
        except asyncio.CancelledError:
            if stopping.caught(task):
                return "stopped"
            raise
        finally:
            stopping.leave(task)

    mine = asyncio.create_task(guarded())
    await entered.wait()
    assert stopping.stop() == 1
    assert await mine == "stopped" and mine.cancelling() == 0

    entered.clear()
    stopping = Stopping()
    other = asyncio.create_task(guarded())  # cancelled by someone else: not converted
    await entered.wait()
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other

    late = asyncio.create_task(guarded())  # coming after the stop: answered at once
    stopping.stop()
    assert await asyncio.wait_for(late, 5) == "stopped"
    assert not stopping._waiting and not stopping._cancelled  # nothing held
