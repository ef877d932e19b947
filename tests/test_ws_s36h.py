"""Found by an outside test of the WebSocket protocol and `appserver chat` (session 36, attacker B):

* F4: `get_history` pages ignored `source` in their ~8 MiB budget: inputs each with a 3.9 MB
  `source` made one `history` reply of 23 MB (50 of them: 195 MB, server RSS +0.9 GB). `source` is
  now at most 256 KiB as JSON (`bad_frame`, `param` `source`, nothing stored), and a page's budget
  counts every column a message row holds (`source` and `meta` too), so stored data with a big
  `source` (written before the cap) is read page by page.
* F3: frames of many tiny arrays or numbers (1.3 million `[]`, 2 million `0`, valid and under the
  frame limit) cost 0.4-0.6 s of the event loop each; objects were already counted. A frame over
  64 KiB now holds at most as many arrays as objects (32,768) and 4 times as many values.
* F1: a piped `chat --conversation X` took its first line as the answer (deny) to another client's
  pending approval, and never sent it; an empty pipe denied it too. A script answers only its own
  turns' approvals: another client's call waits for that client, the script's line is queued.
* F2: a piped chat exited 1 because another client's turn failed, though its own line ran.

A real `appserver serve`, raw `websockets` clients, and the real `appserver chat` with piped stdin.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.support.cli import ROOT, cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve_at, stop_all
from tests.support.zygote_client import appserver_popen

pytestmark = pytest.mark.timeout(120)

T = 20.0  # seconds any one wait may take
PAGE = 8 * 1024 * 1024  # the page budget of docs/protocol.md get_history


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("ws_s36h") / "home"
    # provider retries of half a second and more: a failing turn runs for a few seconds (F2)
    env = cli_env(home, APPSERVER_LIMITS__RETRY_BASE_MS="500")
    assert run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env).code == 0
    sp = start_serve_at(home, 22600, env, last=22699, step=1)
    try:
        yield sp
    finally:
        stop_all(sp)


def ws_url(sp: ServeProcess) -> str:
    return sp.url.replace("http://", "ws://") + "/ws"


async def client(sp: ServeProcess, name: str) -> ClientConnection:
    ws = await asyncio.wait_for(connect(ws_url(sp), max_size=None, compression=None), T)
    await ws.send(json.dumps({"type": "hello", "protocol": 1, "client": name, "request_id": "hello"}))
    welcome = await recv(ws)
    assert welcome["type"] == "welcome", welcome
    return ws


async def recv(ws: ClientConnection, timeout: float = T) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return frame


async def until(ws: ClientConnection, want: Any, seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The first frame `want(frame)` is true of; every frame read is added to `seen`."""
    deadline = time.monotonic() + T
    while True:
        frame = await recv(ws, max(0.1, deadline - time.monotonic()))
        if seen is not None:
            seen.append(frame)
        if want(frame):
            return frame


async def answer(
    ws: ClientConnection, frame: dict[str, Any], rid: str, seen: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    await ws.send(json.dumps({**frame, "request_id": rid}))
    return await until(ws, lambda f: f.get("request_id") == rid, seen)


async def new_conversation(ws: ClientConnection, agent: str = "assistant") -> str:
    made = await answer(ws, {"type": "create_conversation", "agent": agent}, "create")
    conv: str = made["conversation"]["id"]
    return conv


async def run_turn(ws: ClientConnection, conv: str, name: str, **extra: Any) -> dict[str, Any]:
    """Submit `name` (or `input`) to `conv` and wait for the turn's end."""
    frame = {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": name, **extra}
    ack = await answer(ws, frame, f"submit-{name}")
    assert ack["type"] == "ack", ack
    return await until(
        ws,
        lambda f: (
            f["type"] == "turn_updated"
            and f["snapshot"]["turn_id"] == ack["turn_id"]
            and f["snapshot"]["status"] in ("completed", "failed", "cancelled")
        ),
    )


async def history_pages(ws: ClientConnection, conv: str) -> list[tuple[int, dict[str, Any]]]:
    """Every page of the conversation's history, newest first: (the reply's size, the reply)."""
    pages: list[tuple[int, dict[str, Any]]] = []
    before: int | None = None
    while True:
        frame: dict[str, Any] = {"type": "get_history", "conversation": conv, "limit": 1000, "request_id": "h"}
        if before is not None:
            frame["before"] = before
        await ws.send(json.dumps(frame))
        raw = await asyncio.wait_for(ws.recv(), T)
        reply = json.loads(raw)
        assert reply["type"] == "history", reply
        pages.append((len(raw), reply))
        if not reply["has_more"]:
            return pages
        before = reply["messages"][0]["id"]


def db(sp: ServeProcess) -> sqlite3.Connection:
    return sqlite3.connect(sp.home / "appserver.db", timeout=10)


# ───────────────────────────────────────────────────────────── F4: `source` and the history page budget


async def test_a_source_over_256_kib_is_refused_naming_the_field_and_nothing_is_stored(server: ServeProcess) -> None:
    ws = await client(server, "big-source")
    try:
        conv = await new_conversation(ws)
        frame = {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "m0"}
        refused = await answer(ws, {**frame, "source": {"blob": "s" * 3_900_000}}, "big")
        assert refused["type"] == "error" and refused["code"] == "bad_frame", refused
        assert refused["param"] == "source" and "262144 bytes" in refused["message"], refused
        pages = await history_pages(ws, conv)
        assert pages[0][1]["messages"] == [], pages  # nothing stored
        # up to the limit it is taken, and given back by get_history
        done = await run_turn(ws, conv, "m1", source={"blob": "s" * (256 * 1024 - 20)})
        assert done["snapshot"]["status"] == "completed", done
        (_, page), *_ = await history_pages(ws, conv)
        assert len(page["messages"][0]["source"]["blob"]) == 256 * 1024 - 20, page["messages"][0].keys()
    finally:
        await ws.close()


async def test_history_pages_count_the_source_of_each_message(server: ServeProcess) -> None:
    """40 inputs with a 250 KB `source` each (10 MB of sources): the page stops at ~8 MiB."""
    ws = await client(server, "sources")
    try:
        conv = await new_conversation(ws)
        for i in range(40):
            done = await run_turn(ws, conv, f"n{i}", source={"blob": "s" * 250_000})
            assert done["snapshot"]["status"] == "completed", done
        pages = await history_pages(ws, conv)
        assert len(pages) >= 2, [size for size, _ in pages]
        for size, page in pages:
            assert size <= PAGE + 300_000, (size, len(page["messages"]))
        texts = [m["content"] for _, page in reversed(pages) for m in page["messages"] if m["role"] == "user"]
        assert texts == [f"n{i}" for i in range(40)]
    finally:
        await ws.close()


async def test_stored_messages_with_a_huge_source_are_read_page_by_page(server: ServeProcess) -> None:
    """Data stored before the cap (a 3.9 MB `source` on each of 6 inputs): every page stays within
    the budget plus one message, and every message is read."""
    ws = await client(server, "legacy")
    try:
        conv = await new_conversation(ws)
        for i in range(6):
            await run_turn(ws, conv, f"m{i}")
        with db(server) as con:
            con.execute(
                "UPDATE messages SET source=? WHERE conversation_id=? AND role='user'",
                (json.dumps({"blob": "s" * 3_900_000}), conv),
            )
        pages = await history_pages(ws, conv)
        sizes = [size for size, _ in pages]
        assert len(pages) >= 2 and max(sizes) <= PAGE + 4_000_000, sizes
        messages = [m for _, page in reversed(pages) for m in page["messages"]]
        assert [m["content"] for m in messages if m["role"] == "user"] == [f"m{i}" for i in range(6)]
        assert all(len(m["source"]["blob"]) == 3_900_000 for m in messages if m["role"] == "user")
    finally:
        await ws.close()


# ───────────────────────────────────────────────────────────── F3: arrays and values counted


def ping(items: str, count: int) -> str:
    return '{"type":"ping","request_id":"p","x":[' + ",".join([items] * count) + "]}"


@pytest.mark.parametrize(
    ("frame", "said"),
    [
        (ping("[]", 1_300_000), "1300001 JSON arrays, more than 32768"),
        (ping("0", 2_000_000), "JSON values, more than 131072"),
        (ping("1.5", 1_000_000), "JSON values, more than 131072"),
        (ping('""', 1_300_000), "more than 131072 JSON values"),
    ],
    ids=["arrays", "ints", "floats", "strings"],
)
async def test_frames_of_many_tiny_arrays_or_values_are_refused(server: ServeProcess, frame: str, said: str) -> None:
    ws = await client(server, "many-values")
    try:
        await ws.send(frame)
        refused = await recv(ws)
        assert refused["type"] == "error" and refused["code"] == "bad_frame", refused
        assert said in refused["message"] and refused.get("request_id") == "p", refused
        pong = await answer(ws, {"type": "ping"}, "after")  # the connection goes on
        assert pong["type"] == "pong", pong
    finally:
        await ws.close()


async def test_the_counts_refuse_only_what_is_over_them(server: ServeProcess) -> None:
    """One array over the limit is refused; a big text full of commas and brackets (a pasted CSV
    or source file), 2,048 input parts, and arrays and values up to the limits are taken."""
    ws = await client(server, "legit")
    try:
        refused = await answer(ws, {"type": "ping", "x": [[i] for i in range(32_768)]}, "over")
        assert refused["type"] == "error" and "32769 JSON arrays, more than 32768" in refused["message"], refused
        text = 'a,[b],{c},"d",\\e\n' * 180_000  # 3.8 MB as JSON; 1.3 million , [ { in the string
        pong = await answer(ws, {"type": "ping", "x": text}, "csv")
        assert pong["type"] == "pong", pong
        pong = await answer(ws, {"type": "ping", "x": [[i] for i in range(32_000)]}, "arrays")
        assert pong["type"] == "pong", pong
        pong = await answer(ws, {"type": "ping", "x": list(range(130_000))}, "ints")
        assert pong["type"] == "pong", pong
        conv = await new_conversation(ws)
        parts = [{"type": "text", "text": f"part {i}, [x]"} for i in range(2048)]
        done = await run_turn(ws, conv, "parts", input=parts)
        assert done["snapshot"]["status"] == "completed", done
    finally:
        await ws.close()


# ───────────────────────────────────────────────────────────── F1/F2: piped chat and other clients' turns


def start_chat(sp: ServeProcess, conv: str, agent: str, stdin: str) -> subprocess.Popen[str]:
    proc = appserver_popen(
        ["chat", "--url", sp.url, "--agent", agent, "--conversation", conv],
        env=cli_env(sp.home),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


def output(proc: subprocess.Popen[str]) -> str:
    """What the chat wrote (it is killed first if it still runs)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    assert proc.stdout is not None
    return proc.stdout.read()


async def chat_ended(proc: subprocess.Popen[str], timeout: float = T) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"chat did not end: {output(proc)}")
        await asyncio.sleep(0.05)
    return proc.returncode, output(proc)


def user_inputs(sp: ServeProcess, conv: str) -> list[str]:
    with db(sp) as con:
        rows = con.execute("SELECT input FROM turns WHERE conversation_id=? ORDER BY created_at", (conv,)).fetchall()
    return [json.loads(r[0]).get("content") for r in rows]


async def waiting_desktop(sp: ServeProcess) -> tuple[ClientConnection, str, dict[str, Any]]:
    """A desktop client whose turn in a new conversation of `careful` waits for its approval."""
    ws = await client(sp, "desktop")
    await ws.send(
        json.dumps(
            {
                "type": "submit_input",
                "agent": "careful",
                "conversation": "new",
                "input": "/call clock {}",
                "request_id": "s",
            }
        )
    )
    asked = await until(ws, lambda f: f["type"] == "approval_request")
    return ws, asked["conversation_id"], asked


async def approve_and_finish(ws: ClientConnection, asked: dict[str, Any], seen: list[dict[str, Any]]) -> None:
    results = await answer(
        ws,
        {
            "type": "approval_response",
            "conversation": asked["conversation_id"],
            "decisions": [{"call_id": asked["call_id"], "decision": "approve"}],
        },
        "yes",
        seen,
    )
    assert results["results"][0].get("accepted"), results
    await until(
        ws,
        lambda f: (
            f["type"] == "turn_updated"
            and f["snapshot"]["turn_id"] == asked["turn_id"]
            and f["snapshot"]["status"] == "completed"
        ),
        seen,
    )
    # nobody answered before (else the approval is refused `already_resolved`), nor after
    assert [f for f in seen if f["type"] == "approval_resolved"] == [], seen


async def test_a_piped_chat_leaves_another_clients_approval_and_sends_its_line(server: ServeProcess) -> None:
    ws, conv, asked = await waiting_desktop(server)
    seen: list[dict[str, Any]] = []
    try:
        chat = start_chat(server, conv, "careful", "hello\n")
        deadline = time.monotonic() + T
        while "hello" not in user_inputs(server, conv):  # the script's line is queued behind the paused turn
            assert chat.poll() is None and time.monotonic() < deadline, output(chat)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        turn = await answer(ws, {"type": "get_turn", "conversation": conv, "turn_id": asked["turn_id"]}, "t", seen)
        assert turn["snapshot"]["status"] == "awaiting", turn  # still the desktop's to answer
        await approve_and_finish(ws, asked, seen)
        code, out = await chat_ended(chat)
        assert code == 0, out
        assert "echo: hello" in out and "waits for its approval" in out, out
        assert "approve? [y/N]" not in out, out
    finally:
        await ws.close()


async def test_a_chat_with_an_empty_pipe_leaves_another_clients_approval_pending(server: ServeProcess) -> None:
    """… and a script still answers the approvals of its own turns."""
    ws, conv, asked = await waiting_desktop(server)
    seen: list[dict[str, Any]] = []
    try:
        code, out = await chat_ended(start_chat(server, conv, "careful", ""))
        assert code == 0, out
        assert "deny" not in out, out
        turn = await answer(ws, {"type": "get_turn", "conversation": conv, "turn_id": asked["turn_id"]}, "t", seen)
        assert turn["snapshot"]["status"] == "awaiting", turn
        await approve_and_finish(ws, asked, seen)
    finally:
        await ws.close()
    # the approvals of its own turns: the next line answers, no line left denies (as before)
    code, out = await chat_ended(start_chat(server, conv, "careful", "/call clock {}\ny\nfour\n"))
    assert code == 0, out
    assert "approve? [y/N] y" in out and "[clock completed:" in out and "echo: four" in out, out
    code, out = await chat_ended(start_chat(server, conv, "careful", "/call clock {}\n"))
    assert code == 0, out
    assert "(no input left: deny)" in out, out


async def test_a_piped_chat_exits_0_when_only_another_clients_turn_failed(server: ServeProcess) -> None:
    ws = await client(server, "desktop")
    try:
        conv = await new_conversation(ws)
        ack = await answer(
            ws, {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/error 500"}, "s"
        )
        await until(ws, lambda f: f["type"] == "turn_updated" and f["snapshot"]["status"] == "running")
        chat = start_chat(server, conv, "assistant", "hi\n")
        failed = await until(
            ws,
            lambda f: (
                f["type"] == "turn_updated"
                and f["snapshot"]["turn_id"] == ack["turn_id"]
                and f["snapshot"]["status"] in ("failed", "completed")
            ),
        )
        assert failed["snapshot"]["status"] == "failed", failed
        code, out = await chat_ended(chat)
        assert code == 0, out
        assert "echo: hi" in out, out
        assert user_inputs(server, conv) == ["/error 500", "hi"]
    finally:
        await ws.close()
