"""Adversarial findings on the HTTP edge and the WebSocket protocol (issue 11 items 4, 10, 18),
each through a real `appserver serve` on loopback:

* a WebSocket frame full of tiny items (150,000 client tools in 3 MiB) held the event loop for
  seconds per frame (4 in parallel: 33 s, health checks timed out): frames now have the same item
  and object caps as HTTP bodies, checked before the frame models run;
* WebSocket upgrade refusals made below the app (a bad `Sec-WebSocket-Version`, no key) or by the
  router (an upgrade on an HTTP-only path) answered `text/plain` without `x-request-id`;
* the 64 KiB head cap did not count the method, the protocol version and the final empty line, so
  a head of 64 KiB + 1 byte was accepted.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import pytest

from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

HEAD_MAX = 64 * 1024


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One server for the module: every test here only reads, refuses or opens its own conversation."""
    with serving(tmp_path_factory.mktemp("wsedge") / "home") as sp:
        yield sp


def _port(serve: ServeProcess) -> int:
    return int(serve.url.rsplit(":", 1)[1])


def _exchange(serve: ServeProcess, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", _port(serve)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    length = [ln for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
                    if length and len(body) >= int(length[0].split(b":")[1]):
                        break
        except TimeoutError:
            pass
    return out


def _split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


UPGRADE = (
    b"Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


@pytest.mark.parametrize(
    ("name", "request_bytes", "status"),
    [
        ("bad version", b"GET /ws HTTP/1.1\r\n" + UPGRADE + b"Sec-WebSocket-Version: 99\r\n\r\n", 400),
        (
            "no key",
            b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n",
            400,
        ),
        ("http-only path", b"GET /v1/models HTTP/1.1\r\n" + UPGRADE + b"Sec-WebSocket-Version: 13\r\n\r\n", 403),
        ("unknown path", b"GET /nope HTTP/1.1\r\n" + UPGRADE + b"Sec-WebSocket-Version: 13\r\n\r\n", 403),
    ],
)
def test_every_websocket_upgrade_refusal_has_a_request_id_and_json(
    serve: ServeProcess, name: str, request_bytes: bytes, status: int
) -> None:
    got, headers, body = _split(_exchange(serve, request_bytes))
    assert got == status, (name, got, body)
    assert headers.get("x-request-id", "").startswith("req_"), (name, headers)
    assert headers.get("content-type", "").startswith("application/json"), (name, headers)
    err = json.loads(body)["error"]
    assert err["code"] and err["message"], err


def _head_of_size(total: int) -> bytes:
    start = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
    end = b"\r\n\r\n"
    pad = total - len(start) - len(end)
    return start + b"a" * pad + end


def test_head_cap_is_exact(serve: ServeProcess) -> None:
    """The cap is on the request line and headers as sent, to the byte."""
    at, _, _ = _split(_exchange(serve, _head_of_size(HEAD_MAX)))
    assert at == 200
    over, headers, body = _split(_exchange(serve, _head_of_size(HEAD_MAX + 1)))
    assert over == 431, body
    assert headers.get("x-request-id", "").startswith("req_")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def _frame_caps(url: str) -> None:
    ws = await WS.open(url)
    try:
        too_many_tools = [{"name": f"t{i}"} for i in range(129)]
        r = await ws.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": "new",
                "input": "hi",
                "client_tools": too_many_tools,
            }
        )
        assert (r["type"], r["code"], r.get("param")) == ("error", "bad_frame", "client_tools"), r
        r = await ws.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": "new",
                "input": [{"type": "text", "text": "x"}] * 2049,
            }
        )
        assert (r["type"], r["code"], r.get("param")) == ("error", "bad_frame", "input"), r
        r = await ws.request(
            {
                "type": "approval_response",
                "conversation": "c",
                "decisions": [{"call_id": "c", "decision": "approve"}] * 2049,
            }
        )
        assert (r["type"], r["code"], r.get("param")) == ("error", "bad_frame", "decisions"), r
        # 150,000 tiny objects in 3 MiB: refused after a bounded parse, not validated one by one.
        flood = {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "new",
            "input": "hi",
            "client_tools": [{"name": f"t{i}"} for i in range(150_000)],
        }
        r = await ws.request(flood, 30)
        assert (r["type"], r["code"]) == ("error", "bad_frame"), r
        # the parser's count stopped it (of values before the parse, or of objects in it), not validation
        assert "JSON objects" in r["message"] or "JSON values" in r["message"], r
        # Within the caps, frames still work, and the connection survived the refusals.
        ok = await ws.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": "new",
                "input": [{"type": "text", "text": "x"}] * 2048,
                "client_tools": too_many_tools[:128],
            }
        )
        assert ok["type"] == "ack", ok
        assert (await ws.request({"type": "ping"}))["type"] == "pong"
    finally:
        await ws.close()


def test_websocket_frames_have_item_and_object_caps(serve: ServeProcess) -> None:
    asyncio.run(_frame_caps(serve.url))
