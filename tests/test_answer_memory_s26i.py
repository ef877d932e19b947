"""A runaway answer stopped by `answer_max_bytes` costs the server a few times the cap, not eight
(outside tester's finding, session 26).

An upstream that streams 1 KB deltas forever is stopped at `answer_max_bytes`, the turn fails
with 502 `upstream_protocol_error` and keeps the text shown as an incomplete reply. The server's
peak memory grew by 8-11 times the cap while it did so: the Anthropic parser kept a copy of every
text delta; each draft (the crash checkpoint, every `draft_interval_s`) encoded the whole text
again, and SQLite's statement cache kept the last one bound for good; the stored reply was
encoded to a JSON `str` and bound beside it; glibc kept freed copies in its heap. Now the reply
and what clients were shown are the two copies in memory, and writing the reply to SQLite adds
its two (the bound value and the row): about 4 times the cap, measured here as the growth of the
real `serve` process's VmHWM (peak RSS, from /proc) over one turn, for both provider kinds,
streamed and not. Drafts are saved every 50 ms here, as a longer answer would have them.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.store import AgentRecord, ConversationRecord, MessageRecord, SQLiteStore, TurnCommit, TurnRecord
from appserver.store.rows import dump_json
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

CAP = 16 * 1024 * 1024
BIG_TEXT = 1024 * 1024  # appserver/store/sqlite.py: where a reply is written the big way
# A line of text as a model writes it (escaped in JSON: quotes, a backslash, a newline), 1000 bytes.
PIECE = ('The "answer" goes on \\ and on, as a looping model writes it.' + "x" * 938 + "\n")[:1000]


def _sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj).encode() + b"\n\n"


class EndlessUpstream:
    """Chat Completions (`/v1/chat/completions`) and Messages (`/v1/messages`) on one loopback
    port: each answer streams PIECE deltas until the client goes away (a model without an end)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> EndlessUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            try:
                self._answer(conn)
            except OSError:
                pass  # the server closed the connection: the cap stopped the answer

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = conn.recv(65536)
            if not got:
                return
            buf += got
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.decode("latin-1").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        while len(body) < length:
            got = conn.recv(65536)
            if not got:
                return
            body += got
        anthropic = b"/messages" in head.split(b"\r\n", 1)[0]
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )
        if anthropic:
            message = {"id": "m1", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 3}}
            first = _sse({"type": "message_start", "message": message}, "message_start") + _sse(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            )
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": PIECE}}
            event = _sse(delta, "content_block_delta")
        else:
            first = _sse({"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]})
            event = _sse(
                {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": PIECE}}]}
            )
        conn.sendall(b"%x\r\n%s\r\n" % (len(first), first))
        frame = b"%x\r\n%s\r\n" % (len(event), event)
        batch = frame * 64  # a read's worth: several events per network read, as a fast model sends
        while True:
            conn.sendall(batch)


@pytest.fixture(scope="module")
def up() -> Iterator[EndlessUpstream]:
    with EndlessUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def home(up: EndlessUpstream, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("answermem") / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[providers.o]\nkind = "openai"\nbase_url = "{up.url}/v1"\napi_key_env = ""\nmax_attempts = 1\n'
        f"answer_max_bytes = {CAP}\n"
        f'[providers.a]\nkind = "anthropic"\nbase_url = "{up.url}"\napi_key_env = ""\nmax_attempts = 1\n'
        f"answer_max_bytes = {CAP}\n"
    )
    for name, model in (("o", "o:m"), ("a", "a:claude-test")):
        r = run_cli(home, "agents", "create", "--name", name, "--model", model, "--json", env=_env(home))
        assert r.code == 0, r.err
    return home


def _env(home: Path) -> dict[str, str]:
    return cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.05", APPSERVER_LIMITS__IDLE_EVICT_S="0.1")


@pytest.fixture
def srv(home: Path) -> Iterator[ServeProcess]:
    """A server of its own per turn: its memory before the turn is that of an idle server."""
    with serving(home, env=_env(home)) as sp:
        yield sp


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    """VmHWM from now on (5: reset the peak resident set size, Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _run_turn(srv: ServeProcess, model: str, stream: bool) -> str:
    """One runaway turn; the error message it ends with."""
    body = {"model": model, "messages": [{"role": "user", "content": "go on forever"}], "stream": stream}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "new"}) as r:
            if not stream:
                r.read()
                assert r.status_code == 502, r.text[:300]
                err = r.json()["error"]
                assert err["code"] == "upstream_protocol_error", err
                return str(err["message"])
            assert r.status_code == 200
            message = ""
            for line in r.iter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    message = json.loads(line[6:])["error"]["message"]
            return message


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["o", "a"])
def test_a_runaway_answer_costs_a_few_times_the_cap(srv: ServeProcess, model: str, stream: bool) -> None:
    pid = srv.proc.pid
    _reset_peak(pid)
    before = _status_mib(pid, "VmRSS")
    message = _run_turn(srv, model, stream)
    assert f"[providers.{model}] answer_max_bytes" in message, message
    grown = _status_mib(pid, "VmHWM") - before
    cap_mib = CAP / 1024 / 1024
    # Measured: about 4.2 times (was 8 to 11); the bound leaves room for the process's own noise.
    assert grown <= 5 * cap_mib, f"peak RSS grew by {grown:.0f} MiB for a {cap_mib:.0f} MiB answer"
    # Once its conversation is evicted (idle_evict_s = 0.1 here, swept every 0.5 s), the memory
    # goes back: nothing else holds the reply (SQLite's statements kept their last big binding;
    # glibc, the freed copies).
    deadline = time.monotonic() + 30
    while _status_mib(pid, "VmRSS") - before > cap_mib and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _status_mib(pid, "VmRSS") - before
    assert left <= cap_mib, f"{left:.0f} MiB more than before the turn stayed resident"


# ---------------------------------------------------------------- the store: the big way reads back the same


async def test_a_big_reply_and_its_drafts_are_stored_as_before(tmp_path: Path) -> None:
    """A reply past BIG_TEXT goes through the big path (encoded as SQLite binds it, then SQLite's
    copy dropped): its row holds the same TEXT the usual path writes, and reads back equal. Its
    drafts are written again only once they grew by a quarter (each rewrites the whole text:
    every half second, a long answer's drafts were quadratic)."""
    line = 'a "quoted" line \\ with é, € and 😀\n'
    text = line * (3 * BIG_TEXT // len(line))
    store = SQLiteStore(tmp_path / "store.db")
    await store.open()
    try:
        await store.create_agent(AgentRecord(id="agt_1", name="a1"))
        await store.create_conversation(ConversationRecord(id="conv_1", agent_id="agt_1"))
        await store.accept_turn(TurnRecord(id="turn_1", conversation_id="conv_1", agent_id="agt_1", status="running"))

        async def draft() -> Any:
            turn = await store.get_turn("turn_1")
            assert turn is not None
            return turn.draft

        first = {"text": text[: BIG_TEXT + 10], "revision": 1}
        await store.save_draft("turn_1", first)
        assert await draft() == first
        await store.save_draft("turn_1", {"text": text[: BIG_TEXT * 6 // 5], "revision": 2})
        assert await draft() == first  # grown by a fifth: not yet
        later = {"text": text[: BIG_TEXT * 3 // 2], "revision": 3}
        await store.save_draft("turn_1", later)
        assert await draft() == later

        calls = [{"id": "c1", "name": "f", "arguments": json.dumps({"x": text[:1000]}), "executor": "server"}]
        reply = MessageRecord(role="assistant", content=text, reasoning=text[:5000], tool_calls=calls)
        small = MessageRecord(role="assistant", content=text[:100])
        commit = TurnCommit("turn_1", "failed", "error", [reply, small], usage={}, revision=4)
        await store.commit_turn("conv_1", commit)
        stored = await store.list_messages("conv_1")
        assert [(m.content, m.reasoning, m.tool_calls) for m in stored] == [
            (text, text[:5000], calls),
            (text[:100], None, []),
        ]
        assert await draft() is None
    finally:
        await store.close()
    with closing(sqlite3.connect(tmp_path / "store.db")) as db:
        rows = db.execute("SELECT content, typeof(content), typeof(reasoning) FROM messages ORDER BY id").fetchall()
    assert rows == [(dump_json(text), "text", "text"), (dump_json(text[:100]), "text", "null")]
