"""An HTTP/1.0 client (nginx proxies as 1.0 by default; `curl -0`) asking for a stream.

uvicorn answered it with `Transfer-Encoding: chunked`, which HTTP/1.0 does not have (RFC 9112 §7.1:
a server must not send it to a 1.0 client): the client read chunk-size lines inside the SSE body.
Now a reply of unknown length goes to a 1.0 client as written, ended by closing the connection.
Through a real `appserver serve`, over a raw loopback socket.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.support.cli import run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("http10") / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    with serving(home) as sp:
        yield sp


def _exchange(sp: ServeProcess, method: str, path: str, body: dict[str, object] | None, version: str) -> bytes:
    """Send one request and read until the server closes the connection (a 1.0 reply's end)."""
    host, port = sp.url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/{version}\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n" if body is not None else ""
    head += "Connection: close\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(head.encode() + data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _split(reply: bytes) -> tuple[dict[str, str], bytes]:
    head, _, payload = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}, payload


def test_a_stream_to_an_http10_client_is_not_chunked(srv: ServeProcess) -> None:
    body = {"model": "a", "messages": [{"role": "user", "content": "hello there"}], "stream": True}
    headers, payload = _split(_exchange(srv, "POST", "/v1/chat/completions", body, "1.0"))
    assert "transfer-encoding" not in headers, headers
    assert headers.get("connection") == "close" and "content-length" not in headers
    lines = [ln for ln in payload.decode().split("\n") if ln]
    assert lines and all(ln.startswith("data: ") for ln in lines), lines[:5]  # no chunk-size lines
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        (json.loads(ln[6:])["choices"][0]["delta"].get("content") or "") for ln in lines[:-1] if ln[6:].startswith("{")
    )
    assert text == "echo: hello there"


def test_http10_replies_of_known_length_and_http11_streams_are_unchanged(srv: ServeProcess) -> None:
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
    headers, payload = _split(_exchange(srv, "POST", "/v1/chat/completions", body, "1.0"))
    assert int(headers["content-length"]) == len(payload) and "transfer-encoding" not in headers
    assert json.loads(payload)["choices"][0]["message"]["content"] == "echo: hi"
    headers, _ = _split(_exchange(srv, "POST", "/v1/chat/completions", {**body, "stream": True}, "1.1"))
    assert headers.get("transfer-encoding") == "chunked"
