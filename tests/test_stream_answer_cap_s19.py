"""A streamed model answer is bounded as a whole, and a user and password in `base_url` reach the
upstream whichever transport sends the request (outside tester's findings, round 19).

1. `answer_max_bytes` caps one model call's streamed answer: its text, reasoning and tool-call
   arguments together, in UTF-8 bytes. A runaway upstream (here one that would stream 16 MB of
   1 KB deltas) is stopped once the answer passes the cap (20000 bytes here): the upstream
   connection is closed (the upstream's next writes fail long before its end), the turn fails as a
   protocol error naming `[providers.X] answer_max_bytes`, and the text shown so far is kept as an
   incomplete reply, at most the cap. Through a real `appserver serve` and the `openai` SDK, for
   both provider kinds; an answer under the cap is untouched.
2. `http://user:pw@host/v1`: the lean transport sends the same `Authorization: Basic` header as
   httpx's (percent-decoded), and neither puts the user part in the request line or the Host.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from appserver.config import ProviderConfig
from appserver.providers.anthropic import AnthropicProvider, AnthropicStreamParser
from appserver.providers.base import ChatMessage, ProviderError, ProviderRequest, Text
from appserver.providers.openai_compat import OpenAICompatProvider, OpenAIStreamParser
from appserver.providers.upstream import ITEM_BYTES
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(120)

CAP = 20000
DELTA = 1000  # bytes of content per streamed event
PLANNED = 16 * 1024 * 1024  # what a runaway upstream would stream (bytes of content)
SMALL = 15000  # an answer under the cap


# ---------------------------------------------------------------- a raw loopback upstream


@dataclass
class Served:
    """One request the upstream answered, and how its answer went."""

    path: str
    headers: dict[str, str]  # lower-case names
    request_line: str
    mode: str
    sent: int = 0  # content bytes written to the socket
    outcome: str = "running"  # complete | disconnected
    done: threading.Event = field(default_factory=threading.Event)


def _last_user_text(body: dict[str, Any]) -> str:
    for m in reversed(body.get("messages") or []):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            return str(c or "")
    return ""


def _openai_event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _anthropic_event(obj: dict[str, Any]) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"


class RawUpstream:
    """OpenAI (`/v1/chat/completions`) and Anthropic (`/v1/messages`) on one loopback port, each
    request in its own thread. `MODE:<what>-<size>` in the last user text picks the answer:
    `text`, `reasoning` or `args` (a tool call's arguments), `grow` (PLANNED bytes) or `small`
    (SMALL bytes), in DELTA-byte deltas, written one event per chunk with a small send buffer, so
    a client that goes away is seen at once: the next writes fail."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.served: list[Served] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                self._one(conn)
            except OSError:
                pass

    def _one(self, conn: socket.socket) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = conn.recv(65536)
            if not got:
                return
            buf += got
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            got = conn.recv(65536)
            if not got:
                return
            body += got
        text = _last_user_text(json.loads(body or b"{}"))
        mode = text.split("MODE:")[1].split()[0] if "MODE:" in text else "ok"
        path = lines[0].split(" ")[1]
        rec = Served(path, headers, lines[0], mode)
        self.served.append(rec)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )

        def send(data: bytes) -> None:
            conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))

        try:
            if path.endswith("/messages"):
                self._anthropic(rec, send)
            else:
                self._openai(rec, send)
            conn.sendall(b"0\r\n\r\n")
            rec.outcome = "complete"
        except OSError:
            rec.outcome = "disconnected"
        finally:
            rec.done.set()

    @staticmethod
    def _plan(mode: str) -> tuple[str, int]:
        what, _, size = mode.partition("-")
        return what, {"grow": PLANNED, "small": SMALL}.get(size, 0)

    def _openai(self, rec: Served, send: Any) -> None:
        what, total = self._plan(rec.mode)
        piece = "x" * (DELTA - 1) + " "
        if what == "args":
            send(
                _openai_event(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "nope", "arguments": ""},
                            }
                        ]
                    }
                )
            )
        if total == 0:
            send(_openai_event({"role": "assistant", "content": "ok"}))
        while rec.sent < total:
            if what == "text":
                send(_openai_event({"content": piece}))
            elif what == "reasoning":
                send(_openai_event({"reasoning_content": piece}))
            else:
                send(_openai_event({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
            rec.sent += DELTA
        send(_openai_event({}, "tool_calls" if what == "args" else "stop"))
        send(b"data: [DONE]\n\n")

    def _anthropic(self, rec: Served, send: Any) -> None:
        what, total = self._plan(rec.mode)
        piece = "x" * (DELTA - 1) + " "
        message = {"id": "m1", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 3}}
        send(_anthropic_event({"type": "message_start", "message": message}))
        block = {
            "text": {"type": "text", "text": ""},
            "reasoning": {"type": "thinking", "thinking": ""},
            "args": {"type": "tool_use", "id": "toolu_1", "name": "nope", "input": {}},
        }.get(what, {"type": "text", "text": "ok"})
        send(_anthropic_event({"type": "content_block_start", "index": 0, "content_block": block}))
        delta = {
            "text": lambda: {"type": "text_delta", "text": piece},
            "reasoning": lambda: {"type": "thinking_delta", "thinking": piece},
            "args": lambda: {"type": "input_json_delta", "partial_json": piece},
        }.get(what)
        while delta is not None and rec.sent < total:
            send(_anthropic_event({"type": "content_block_delta", "index": 0, "delta": delta()}))
            rec.sent += DELTA
        send(_anthropic_event({"type": "content_block_stop", "index": 0}))
        stop = "tool_use" if what == "args" else "end_turn"
        send(_anthropic_event({"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 5}}))
        send(_anthropic_event({"type": "message_stop"}))


# ---------------------------------------------------------------- a server on it


@pytest.fixture(scope="module")
def up() -> Iterator[RawUpstream]:
    with RawUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def srv(up: RawUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("answercap") / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[providers.o]\nkind = "openai"\nbase_url = "{up.url}/v1"\napi_key_env = ""\nmax_attempts = 1\n'
        f"answer_max_bytes = {CAP}\n"
        f'[providers.a]\nkind = "anthropic"\nbase_url = "{up.url}"\napi_key_env = ""\nmax_attempts = 1\n'
        f"answer_max_bytes = {CAP}\n"
    )
    env = cli_env(home)
    for name, model in (("o", "o:m"), ("a", "a:claude-test")):
        r = run_cli(home, "agents", "create", "--name", name, "--model", model, "--json", env=env)
        assert r.code == 0, r.err
    with serving(home, env=env) as sp:
        yield sp


def _served(up: RawUpstream, mode: str, path_end: str) -> Served:
    rec = next(r for r in reversed(up.served) if r.mode == mode and r.path.endswith(path_end))
    assert rec.done.wait(30), f"the upstream is still streaming {mode}: its client never went away"
    return rec


def _assert_stopped(rec: Served) -> None:
    """The upstream's writes failed: the server closed the connection once the answer passed the
    cap, with the stream far from its end (what it wrote: the cap, plus what socket buffers took)."""
    assert rec.outcome == "disconnected", f"the upstream streamed all {rec.sent} bytes"
    assert rec.sent < 4 * 1024 * 1024, rec.sent


def _history(srv: ServeProcess, conversation: str) -> list[dict[str, Any]]:
    r = run_cli(srv.home, "conversations", "history", "--json", conversation, env=cli_env(srv.home))
    assert r.code == 0, r.err
    out = r.json()
    return out["messages"] if isinstance(out, dict) else out


def _error_says_cap(message: str, provider: str) -> None:
    assert "answer_max_bytes" in message and f"({CAP} bytes" in message, message
    assert f"[providers.{provider}] answer_max_bytes" in message and "max_tokens" in message, message


def test_streamed_text_past_the_cap_is_stopped_and_kept_incomplete(srv: ServeProcess, up: RawUpstream) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    shown = ""
    started = time.monotonic()
    with client.chat.completions.with_streaming_response.create(
        model="o",
        messages=[{"role": "user", "content": "MODE:text-grow"}],
        stream=True,
        extra_headers={"X-Conversation-Id": "new"},
    ) as raw:
        conversation = raw.headers["x-conversation-id"]
        with pytest.raises(openai.APIError) as caught:
            for ev in raw.parse():
                for choice in ev.choices:
                    shown += choice.delta.content or ""
    assert time.monotonic() - started < 30
    _error_says_cap(str(caught.value), "o")
    assert 0 < len(shown) <= CAP
    _assert_stopped(_served(up, "text-grow", "/chat/completions"))
    # What was shown is kept, marked incomplete, and no more than the cap.
    last = _history(srv, conversation)[-1]
    assert last["role"] == "assistant" and last.get("completion_status") == "incomplete", last
    assert 0 < len(last["content"].encode()) <= CAP and last["content"] == shown


@pytest.mark.parametrize(
    ("model", "mode", "path_end"),
    [
        ("o", "reasoning-grow", "/chat/completions"),
        ("o", "args-grow", "/chat/completions"),
        ("a", "text-grow", "/messages"),
        ("a", "reasoning-grow", "/messages"),
        ("a", "args-grow", "/messages"),
    ],
)
def test_every_part_of_an_answer_counts(
    srv: ServeProcess, up: RawUpstream, model: str, mode: str, path_end: str
) -> None:
    """Reasoning and tool-call arguments count as text does, on both provider kinds: the call fails
    (502 `upstream_protocol_error`, as the other answer size limits) and the upstream is cut off."""
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": f"MODE:{mode}"}]},
            headers={"X-Conversation-Id": "new"},
        )
    assert r.status_code == 502, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "upstream_protocol_error", err
    _error_says_cap(err["message"], model)
    _assert_stopped(_served(up, mode, path_end))


@pytest.mark.parametrize(("model", "path_end"), [("o", "/chat/completions"), ("a", "/messages")])
def test_an_answer_under_the_cap_is_untouched(srv: ServeProcess, up: RawUpstream, model: str, path_end: str) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "MODE:text-small"}])
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content == ("x" * (DELTA - 1) + " ") * (SMALL // DELTA)
    assert _served(up, "text-small", path_end).outcome == "complete"


def test_the_cli_run_says_why(srv: ServeProcess, up: RawUpstream) -> None:
    """`appserver run` (in-process, no server): the turn fails with the cap's error, its text kept."""
    r = run_cli(
        srv.home, "run", "--agent", "a", "--conversation", "new", "--json", "MODE:text-grow", env=cli_env(srv.home)
    )
    out = r.json()
    assert out["status"] == "failed", out
    _error_says_cap(out["error"]["message"], "a")
    assert 0 < len(out["text"]) <= CAP


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("transport", ["lean", "httpx"])
async def test_either_transport_closes_the_upstream(kind: str, transport: str) -> None:
    """In the provider itself: the text handed out stays within the cap, the call raises the cap's
    protocol error, and the upstream's connection is closed whichever transport carries it."""
    with RawUpstream() as upstream:
        base = upstream.url + ("/v1" if kind == "openai" else "")
        cfg = ProviderConfig(
            name="p", kind=kind, base_url=base, api_key_env=None, transport=transport, answer_max_bytes=CAP
        )
        provider = OpenAICompatProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)
        text = ""
        with pytest.raises(ProviderError) as caught:
            try:
                async for chunk in provider.stream(ProviderRequest("m", [ChatMessage("user", "MODE:text-grow")])):
                    if isinstance(chunk, Text):
                        text += chunk.text
            finally:
                await provider.aclose()
        assert caught.value.kind == "protocol"
        _error_says_cap(caught.value.message, "p")
        assert CAP - DELTA - ITEM_BYTES < len(text) <= CAP  # (a block costs ITEM_BYTES too)
        # The event loop must run for asyncio to close the socket: wait for the upstream off it.
        rec = upstream.served[-1]
        await asyncio.to_thread(rec.done.wait, 30)
        _assert_stopped(_served(upstream, "text-grow", "/messages" if kind == "anthropic" else "/completions"))


# ---------------------------------------------------------------- the parsers: UTF-8 bytes


def test_the_cap_counts_utf8_bytes_not_characters() -> None:
    """1000 `é` are 2000 bytes: within a 2048-byte cap; 30 more pass it (as characters, they
    would not). The event that passes it yields nothing."""
    o = OpenAIStreamParser(2048, "o")
    assert o.feed_chunk({"choices": [{"index": 0, "delta": {"content": "é" * 1000}}]}) == [Text("é" * 1000)]
    with pytest.raises(ProviderError) as caught:
        o.feed_chunk({"choices": [{"index": 0, "delta": {"content": "é" * 30}}]})
    assert caught.value.kind == "protocol" and "[providers.o] answer_max_bytes" in caught.value.message
    a = AnthropicStreamParser("a", 2048)
    a.feed_event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    assert a.feed_event(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "é" * 1000}}
    )
    with pytest.raises(ProviderError, match=r"\[providers\.a\] answer_max_bytes"):
        a.feed_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "é" * 30}})
    # Without a cap (tests, offline replay) nothing is counted against.
    assert OpenAIStreamParser().feed_chunk({"choices": [{"index": 0, "delta": {"content": "é" * 5000}}]})


def test_tool_calls_count_with_their_ids_names_and_number() -> None:
    """A model looping on tool calls with long ids and no arguments (or on empty blocks) is stopped
    as one looping on text is: each call or block costs its id, its name and ITEM_BYTES (was: only
    arguments counted, so 300 calls of 700-byte ids passed a 1 KiB cap)."""
    o = OpenAIStreamParser(4096, "o")
    with pytest.raises(ProviderError, match=r"\[providers\.o\] answer_max_bytes"):
        for i in range(300):
            call = {"id": f"call_{i}_" + "x" * 700, "type": "function", "function": {"name": "clock"}}
            o.feed_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    o = OpenAIStreamParser(4096, "o")
    with pytest.raises(ProviderError):
        for i in range(300):  # short ids, no index, no arguments: the number of calls alone
            call = {"id": f"c{i}", "function": {"name": "clock", "arguments": ""}}
            o.feed_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    a = AnthropicStreamParser("a", 4096)
    with pytest.raises(ProviderError, match=r"\[providers\.a\] answer_max_bytes"):
        for i in range(300):
            block = {"type": "tool_use", "id": f"toolu_{i}", "name": "clock", "input": {}}
            a.feed_event({"type": "content_block_start", "index": i, "content_block": block})
    few = OpenAIStreamParser(4096, "o")  # a handful of real calls stays far below
    for i in range(5):
        call = {"index": i, "id": f"call_{i}", "function": {"name": "clock", "arguments": "{}"}}
        few.feed_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})


# ---------------------------------------------------------------- user and password in base_url


async def _call(provider: OpenAICompatProvider | AnthropicProvider) -> str:
    text = ""
    try:
        async for chunk in provider.stream(ProviderRequest("m", [ChatMessage("user", "hi")])):
            if isinstance(chunk, Text):
                text += chunk.text
    finally:
        await provider.aclose()
    return text


USER, PASSWORD = "us@er", "p:w d%x"  # both need percent-encoding in a URL
USERINFO = "us%40er:p%3Aw%20d%25x"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("key", [None, "sk-provider-key-0123456789"])
async def test_userinfo_in_base_url_is_sent_alike_by_both_transports(
    kind: str, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if key:
        monkeypatch.setenv("S19_KEY", key)
    seen: dict[str, Served] = {}
    with RawUpstream() as up:
        for transport in ("lean", "httpx"):
            base = f"http://{USERINFO}@127.0.0.1:{up.port}" + ("/v1" if kind == "openai" else "")
            cfg = ProviderConfig(
                name="u", kind=kind, base_url=base, api_key_env="S19_KEY" if key else None, transport=transport
            )
            provider = OpenAICompatProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)
            assert await _call(provider) == "ok"
            seen[transport] = up.served[-1]
    lean, plain = seen["lean"], seen["httpx"]
    # httpx sends the URL's user and password as Basic auth, decoded; with an `openai` API key too,
    # its Authorization header gives way to them (httpx's BasicAuth sets the header). Same on lean.
    assert plain.headers.get("authorization") == BASIC, plain.headers
    assert lean.headers.get("authorization") == plain.headers.get("authorization")
    assert lean.headers.get("x-api-key") == plain.headers.get("x-api-key")
    for rec in (lean, plain):
        assert "us%40er" not in rec.request_line and "@" not in rec.request_line, rec.request_line
        assert rec.headers["host"] == f"127.0.0.1:{up.port}"


async def test_userinfo_never_appears_in_a_transport_error() -> None:
    """A call to a closed port fails with an error that does not quote the URL's user part."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the call: connection refused
    for transport in ("lean", "httpx"):
        cfg = ProviderConfig(
            name="u",
            base_url=f"http://{USERINFO}@127.0.0.1:{port}/v1",
            api_key_env=None,
            transport=transport,
            max_attempts=1,
        )
        with pytest.raises(ProviderError) as caught:
            await _call(OpenAICompatProvider(cfg))
        said = f"{caught.value.message} {caught.value!r}"
        for secret in (USER, PASSWORD, USERINFO, "p%3Aw", "us%40er"):
            assert secret not in said, said
