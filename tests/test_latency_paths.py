"""The latency shortcuts of a non-stream chat completion keep their guarantees: an accept that
commits while the model call is in flight (visible only once committed, nothing written when it
fails), the lean transport's prepared requests, the pre-encoded tools JSON and cached estimates."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from pathlib import Path

import httpx

from appserver.agent.context import ToolEstimates, estimate_tools
from appserver.config import ProviderConfig, load_config
from appserver.providers.base import ChatMessage, ProviderRequest, ToolSpec
from appserver.providers.fasttransport import LeanClient, LeanTransport
from appserver.providers.openai_compat import OpenAICompatProvider, _encode_body
from appserver.runtime import SubmitRequest
from appserver.server import Server
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chunk, cut, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.kernel import open_server
from tests.support.net import read_request
from tests.support.serve import start_serve

REFUSE_TURNS = "CREATE TRIGGER refuse_turns BEFORE INSERT ON turns BEGIN SELECT RAISE(ABORT, 'disk is full'); END"


async def open_remote(home: Path, base_url: str) -> Server:
    """A server whose agent `remote` talks to the fake upstream at `base_url`."""
    server = await open_server(home, f'[providers.fake]\nkind = "openai"\nbase_url = "{base_url}"\n')
    await server.agents.create("remote", "fake:m")
    return server


async def until(check, what: str, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_the_accept_commits_while_the_model_call_is_in_flight_and_only_then_shows(
    tmp_path: Path,
) -> None:
    release = threading.Event()
    async with FakeOpenAI() as fake:

        def held(_request: object) -> Reply:  # the model "thinks" until the test lets it answer
            release.wait(10)
            return Reply(pieces=cut(openai_sse([chunk(content="Hello"), chunk(finish_reason="stop")])))

        fake.responder = held
        server = await open_remote(tmp_path / "home", fake.base_url)
        try:
            seen: list[str] = []
            at_insert: list[tuple[str, str, bool]] = []
            store = server.store
            mine: dict[str, object] = {}

            def trace(sql: str) -> None:  # where the submitted turn stands when its row is written
                if sql.startswith("INSERT INTO turns"):
                    handle, rt = mine["handle"], mine["rt"]
                    at_insert.append((handle.controller.phase, rt.lifecycle.state, handle.turn_id in rt.handles))  # type: ignore[attr-defined]

            store.db.set_trace_callback(trace)
            sub = await server.kernel.submit(
                SubmitRequest(agent="remote", input="hi", conversation="new", overlap_accept=True)
            )
            rt = server.kernel.runtimes[sub.conversation_id]
            mine.update(handle=sub.handle, rt=rt)
            rt.watchers.append(lambda handle: seen.append(handle.turn_id))
            assert sub.turn_id not in rt.handles and not seen  # not visible before its accept commits
            await until(lambda: len(fake.requests) == 1, "the model call")
            other = sqlite3.connect(str(store.path))
            try:
                # The model has not answered, yet the turn is durably accepted and visible.
                await until(
                    lambda: (
                        other.execute("SELECT status FROM turns WHERE id=?", (sub.turn_id,)).fetchone() == ("running",)
                    ),
                    "the accept",
                )
                await until(lambda: seen == [sub.turn_id], "the watchers")
                assert rt.handles[sub.turn_id] is sub.handle
                # The turn had started (past `queued`) and was invisible when its row was written.
                assert at_insert == [("reasoning", "active", False)]
                release.set()
                snap = await sub.wait(10)
                assert snap.status == "completed" and snap.text() == "Hello"
                rows = other.execute(
                    "SELECT role, content FROM messages WHERE turn_id=? ORDER BY id", (sub.turn_id,)
                ).fetchall()
                assert rows == [("user", '"hi"'), ("assistant", '"Hello"')]
            finally:
                other.close()
        finally:
            release.set()
            store.db.set_trace_callback(None)
            await server.close()


async def test_a_turn_whose_overlapped_accept_fails_is_never_shown_nor_written(
    tmp_path: Path,
) -> None:
    async with FakeOpenAI() as fake:
        fake.responder = lambda _r: Reply(pieces=[openai_sse([chunk(content="lost"), chunk(finish_reason="stop")])])
        server = await open_remote(tmp_path / "home", fake.base_url)
        try:
            server.store.db.execute(REFUSE_TURNS)
            seen: list[str] = []
            sub = await server.kernel.submit(
                SubmitRequest(agent="remote", input="hi", conversation="new", overlap_accept=True)
            )
            rt = server.kernel.runtimes[sub.conversation_id]
            rt.watchers.append(lambda handle: seen.append(handle.turn_id))
            snap = await sub.wait(10)
            assert snap.status == "failed" and snap.error is not None and snap.error["kind"] == "store"
            assert "disk is full" in snap.error["message"]
            assert not seen and sub.turn_id not in rt.handles and rt.lifecycle.state == "idle"
            db = server.store.db
            assert db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 0
            assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
            # The conversation works on once the store does.
            db.execute("DROP TRIGGER refuse_turns")
            again = await server.kernel.submit(
                SubmitRequest(
                    agent="remote",
                    input="hi",
                    conversation=sub.conversation_id,
                    overlap_accept=True,
                )
            )
            assert (await again.wait(10)).text() == "lost"
            assert (
                db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id=?", (sub.conversation_id,)).fetchone()[
                    0
                ]
                == 2
            )
        finally:
            await server.close()


def test_a_non_stream_reply_the_store_could_not_accept_is_an_error_not_its_text(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "list", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        db = sqlite3.connect(str(load_config(home, environ={}).db_path))
        db.execute(REFUSE_TURNS)
        db.commit()
        body = {"model": "assistant", "messages": [{"role": "user", "content": "hello"}]}
        with httpx.Client(base_url=sp.url, timeout=30) as http:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 500, r.text
            assert (
                r.json()["error"]["code"] == "internal_error" and "could not be saved" in r.json()["error"]["message"]
            )
            assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
            db.execute("DROP TRIGGER refuse_turns")
            db.commit()
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        db.close()
    finally:
        sp.stop()


# ---------------------------------------------------------------- wire and encoding


async def test_post_stream_writes_what_httpx_writes_and_reuses_the_connection() -> None:
    heads: list[bytes] = []
    connections = 0
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                head, body = await read_request(reader)
                heads.append(head + body)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 5\r\n\r\nhello")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            closed.set()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions?x=1"
    headers = {
        "Accept": "text/event-stream",
        "Content-Type": "application/json",
        "Authorization": "Bearer k",
    }
    timeout = httpx.Timeout(5)
    try:
        async with LeanClient(timeout=timeout, transport=LeanTransport()) as client:
            async with client.stream("POST", url, content=b'{"a":1}', headers=headers, timeout=timeout) as r:
                assert await r.aread() == b"hello"
            for _ in range(2):
                async with client.post_stream(url, b'{"a":1}', headers, timeout) as r:
                    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
                    assert b"".join([part async for part in r.aiter_bytes()]) == b"hello"
        await asyncio.wait_for(closed.wait(), 5)  # the client closed its one connection
    finally:
        srv.close()
    assert heads[1] == heads[0] and heads[2] == heads[0]
    assert connections == 1


def _request(specs: list[ToolSpec], **extra: object) -> ProviderRequest:
    return ProviderRequest(
        model="m",
        messages=[ChatMessage("user", "hé\u2028")],
        tools=specs,
        temperature=0.5,
        extra=dict(extra),
    )


def test_encoded_body_is_the_json_of_build_body_byte_for_byte() -> None:
    provider = OpenAICompatProvider(
        ProviderConfig("fake", kind="openai", base_url="http://127.0.0.1:1/v1", api_key_env=None)
    )
    schema = {"type": "object", "properties": {"q": {"type": "string", "description": "ünïcode"}}}
    tools = [ToolSpec("search", "Find things.", schema), ToolSpec("clock")]
    for request in (
        _request([]),
        _request(tools),
        _request(tools),  # the cached tools JSON
        _request(tools, tools=[{"type": "function", "function": {"name": "x"}}]),  # extra wins
        _request([ToolSpec("search", "Find other things.", schema)]),  # same schema, new text
    ):
        assert provider.encode_body(request) == _encode_body(provider.build_body(request)).encode()
    # An input that carries the placeholder is encoded the long way, never spliced wrongly.
    marker = provider._tools_json.marker
    tricky = ProviderRequest(model="m", messages=[ChatMessage("user", marker)], tools=tools)
    assert provider.encode_body(tricky) == _encode_body(provider.build_body(tricky)).encode()
    assert json.loads(provider.encode_body(tricky))["messages"][0]["content"] == marker


def test_cached_tool_estimates_equal_fresh_ones() -> None:
    cache = ToolEstimates(limit=2)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    sets = [
        [ToolSpec("a", "first", schema)],
        [ToolSpec("a", "first", schema), ToolSpec("b", "", {"type": "object", "properties": {}})],
        [ToolSpec("a", "a much longer description than before", schema)],
        [ToolSpec("c", "x" * 400, {"type": "object", "properties": {"z": {"enum": list(range(50))}}})],
    ]
    for _ in range(2):
        for tools in sets:
            assert cache(tools) == estimate_tools(tools)


async def test_no_tool_runs_before_an_overlapped_accept_has_committed(tmp_path: Path) -> None:
    """echo answers a `/call` at once, faster than the accept commits: the shell must wait, and
    must never run for a turn the store refused."""
    server = Server(load_config(tmp_path / "home", environ={}))
    await server.open()
    marker = tmp_path / "side-effect"
    try:
        await server.agents.create("actor", "echo", tools={"shell": "allow"})
        server.store.db.execute(REFUSE_TURNS)
        call = "/call shell " + json.dumps({"command": f"touch {marker}"})
        sub = await server.kernel.submit(
            SubmitRequest(agent="actor", input=call, conversation="new", overlap_accept=True)
        )
        snap = await sub.wait(10)
        assert snap.status == "failed" and snap.error is not None and "disk is full" in snap.error["message"]
        await asyncio.sleep(0.2)
        assert not marker.exists(), "a tool ran for a turn that was never accepted"
        server.store.db.execute("DROP TRIGGER refuse_turns")
        sub = await server.kernel.submit(
            SubmitRequest(agent="actor", input=call, conversation="new", overlap_accept=True)
        )
        snap = await sub.wait(10)
        assert snap.status == "completed" and marker.exists()
    finally:
        await server.close()
