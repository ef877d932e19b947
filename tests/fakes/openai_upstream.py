"""A loopback fake of an OpenAI-compatible Chat Completions server (and the generic fake upstream).

A real HTTP server on 127.0.0.1 (ephemeral port) in a background thread, so provider code runs its
real httpx path. Replies are scripted in order; an SSE body can be cut at chosen byte offsets, each
piece sent as its own HTTP chunk and flushed (TCP_NODELAY), which is how the split-anywhere
guarantees are exercised over a socket. Every request is recorded for assertions.

    with FakeOpenAI() as fake:
        fake.script(openai_sse([delta_chunk(content="hi"), finish_chunk("stop")]), splits=[3, 10])
        ... OpenAICompatProvider(ProviderConfig("fake", base_url=fake.base_url, api_key_env=None))
        assert fake.requests[0].json["stream"] is True
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(slots=True)
class Reply:
    """One scripted answer."""

    status: int = 200
    pieces: list[bytes] = field(default_factory=list)  # body, already cut where it must be cut
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/event-stream"
    delay_s: float = 0.0  # pause between pieces
    initial_delay_s: float = 0.0  # pause before the status line (timeouts)
    drop_after: int | None = None  # abort the connection after this many body bytes
    chunked: bool = True
    # Hold the body open this long after its last piece before ending it (a proxy that keeps the
    # stream after `[DONE]`), sending `hold_beat` as a chunk every `hold_beat_s` meanwhile (`: keep-alive`
    # comments). The hold ends early when the client closes the connection or writes on it; how it
    # ended is recorded in `FakeUpstream.holds` ("client_closed", "client_wrote", "ran_out").
    hold_s: float = 0.0
    hold_beat: bytes = b""
    hold_beat_s: float = 0.05


@dataclass(slots=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def cut(body: bytes, splits: Iterable[int] = (), chunk_size: int | None = None) -> list[bytes]:
    """Cut `body` at the given byte offsets (and/or every `chunk_size` bytes)."""
    offsets = set(o for o in splits if 0 < o < len(body))
    if chunk_size:
        offsets.update(range(chunk_size, len(body), chunk_size))
    pieces: list[bytes] = []
    start = 0
    for off in sorted(offsets):
        pieces.append(body[start:off])
        start = off
    pieces.append(body[start:])
    return [p for p in pieces if p]


class FakeUpstream:
    """Generic scripted HTTP upstream; subclasses only decide the base URL."""

    path_prefix = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replies: deque[Reply] = deque()
        self.requests: list[RecordedRequest] = []
        self.holds: list[str] = []  # how each held body ended (Reply.hold_s)
        # Answers requests when nothing is scripted: a model that computes its reply from the request.
        self.responder: Callable[[RecordedRequest], Reply] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> FakeUpstream:
        handler = _make_handler(self)
        self._server = _QuietServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeUpstream:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "fake upstream not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path_prefix}"

    # ------------------------------------------------------------ scripting

    def script(
        self,
        body: bytes | str | Sequence[bytes],
        *,
        splits: Iterable[int] = (),
        chunk_size: int | None = None,
        status: int = 200,
        headers: dict[str, str] | None = None,
        content_type: str = "text/event-stream",
        delay_s: float = 0.0,
        initial_delay_s: float = 0.0,
        drop_after: int | None = None,
        hold_s: float = 0.0,
        hold_beat: bytes = b"",
    ) -> Reply:
        """Queue a reply. `body` as bytes/str is cut at `splits`; a sequence is sent as given."""
        if isinstance(body, str):
            body = body.encode()
        pieces = cut(body, splits, chunk_size) if isinstance(body, bytes) else list(body)
        reply = Reply(
            status=status,
            pieces=pieces,
            headers=dict(headers or {}),
            content_type=content_type,
            delay_s=delay_s,
            initial_delay_s=initial_delay_s,
            drop_after=drop_after,
            hold_s=hold_s,
            hold_beat=hold_beat,
        )
        with self._lock:
            self._replies.append(reply)
        return reply

    def fail(self, status: int, body: Any = None, *, headers: dict[str, str] | None = None) -> Reply:
        """Queue an HTTP error; dict/list bodies are sent as JSON."""
        if isinstance(body, dict | list):
            raw, ctype = json.dumps(body).encode(), "application/json"
        else:
            raw, ctype = (body or "").encode(), "text/plain"
        reply = Reply(
            status=status,
            pieces=[raw],
            headers=dict(headers or {}),
            content_type=ctype,
            chunked=False,
        )
        with self._lock:
            self._replies.append(reply)
        return reply

    def _next(self, request: RecordedRequest | None = None) -> Reply:
        with self._lock:
            if self._replies:
                return self._replies.popleft()
        if self.responder is not None and request is not None:
            return self.responder(request)
        body = json.dumps({"error": {"message": "fake upstream: no scripted reply"}}).encode()
        return Reply(status=500, pieces=[body], content_type="application/json", chunked=False)

    def _record(self, req: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(req)

    def clear(self) -> None:
        """Forget the replies still queued, the requests recorded and the holds (one test's leftovers)."""
        with self._lock:
            self._replies.clear()
            self.requests.clear()
            self.holds.clear()

    def _held(self, outcome: str) -> None:
        with self._lock:
            self.holds.append(outcome)


class _QuietServer(ThreadingHTTPServer):
    """Clients hanging up (timeouts, dropped streams) are expected here, not worth a traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def _make_handler(fake: FakeUpstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            request = RecordedRequest(
                method=self.command,
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
            )
            fake._record(request)
            reply = fake._next(request)
            try:
                self._send(reply)
            except OSError:
                self.close_connection = True  # the client went away (timeouts): fine

        def _send(self, reply: Reply) -> None:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if reply.initial_delay_s:
                time.sleep(reply.initial_delay_s)
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            if not reply.chunked:
                data = b"".join(reply.pieces)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            self.wfile.flush()
            sent = 0
            for piece in reply.pieces:
                if reply.drop_after is not None and sent + len(piece) > reply.drop_after:
                    piece = piece[: reply.drop_after - sent]
                    if piece:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                sent += len(piece)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
            if reply.drop_after is not None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if reply.hold_s and not self._hold(reply):
                return
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _hold(self, reply: Reply) -> bool:
            """Keep the body open (Reply.hold_s); False when the client ended the hold first."""
            deadline = time.monotonic() + reply.hold_s
            while (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([self.connection], [], [], min(left, reply.hold_beat_s))
                if ready:  # the client closed, or sent a request on a connection whose answer never ended
                    try:
                        wrote = bool(self.connection.recv(1, socket.MSG_PEEK))
                    except OSError:
                        wrote = False
                    fake._held("client_wrote" if wrote else "client_closed")
                    self.close_connection = True
                    return False
                if reply.hold_beat:
                    try:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(reply.hold_beat), reply.hold_beat))
                        self.wfile.flush()
                    except OSError:
                        fake._held("client_closed")
                        self.close_connection = True
                        return False
            fake._held("ran_out")
            return True

    return Handler


# ---------------------------------------------------------------- OpenAI wire helpers


class FakeOpenAI(FakeUpstream):
    """Chat Completions fake: `base_url` ends in /v1 like a real server's."""

    path_prefix = "/v1"


def openai_sse(chunks: Iterable[dict[str, Any] | str], *, done: bool = True, crlf: bool = False) -> bytes:
    """SSE body from completion chunks (dicts are JSON-encoded, strings sent raw as data)."""
    nl = "\r\n" if crlf else "\n"
    out = []
    for c in chunks:
        data = c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)
        out.append(f"data: {data}{nl}{nl}")
    if done:
        out.append(f"data: [DONE]{nl}{nl}")
    return "".join(out).encode()


def chunk(
    *,
    content: str | None = None,
    reasoning_content: str | None = None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    role: str | None = None,
    model: str = "fake-model",
) -> dict[str, Any]:
    """One `chat.completion.chunk` with choice 0."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    if reasoning is not None:
        delta["reasoning"] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def tool_delta(
    index: int | None,
    *,
    id: str | None = None,
    name: str | None = None,
    arguments: str | None = None,
) -> dict[str, Any]:
    """One entry of `delta.tool_calls`."""
    tc: dict[str, Any] = {}
    if index is not None:
        tc["index"] = index
    if id is not None:
        tc["id"] = id
        tc["type"] = "function"
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if arguments is not None:
        fn["arguments"] = arguments
    if fn:
        tc["function"] = fn
    return tc


def one_call_sse(call_id: str, name: str, arguments: str, finish: str = "tool_calls") -> bytes:
    """A streamed reply that is one tool call and its finish reason."""
    return openai_sse(
        [
            chunk(role="assistant", tool_calls=[tool_delta(0, id=call_id, name=name, arguments=arguments)]),
            chunk(finish_reason=finish),
        ]
    )


def usage_chunk(prompt: int, completion: int, *, reasoning: int = 0, cached: int = 0) -> dict[str, Any]:
    """The usage-only final chunk (`choices: []`) sent with stream_options.include_usage."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [],
        "usage": usage,
    }


def openai_error(message: str, *, type: str = "invalid_request_error", code: str | None = None) -> dict[str, Any]:
    """An OpenAI error body."""
    return {"error": {"message": message, "type": type, "param": None, "code": code}}
