"""A WebSocket upgrade the guard refuses (a foreign `Origin`, a path without a WebSocket endpoint)
is answered with a clean 403 and the OpenAI error JSON, and the server logs it once, as a refusal:
uvicorn used to add "ASGI callable returned without completing handshake." at ERROR for every one,
since it does not count an answer made with the `websocket.http.response` extension as the
handshake's end (appserver/security/edge.py, `EdgeWebSocketProtocol.send`). A real `appserver
serve`, raw sockets, its log read after it stops."""

from __future__ import annotations

import base64
import json
import os
import socket
from pathlib import Path

from tests.support.cli import run_cli
from tests.support.serve import serving
from tests.test_edge_pipelined_refusals import T, Wire


def _upgrade(host: str, path: str, origin: str | None) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    extra = f"Origin: {origin}\r\n" if origin else ""
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


def test_a_refused_upgrade_is_a_clean_403_without_an_error_in_the_log(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    cases = [
        ("/ws", "http://evil.example", "origin_not_allowed"),
        ("/ws", "null", "origin_not_allowed"),
        ("/elsewhere", None, "websocket_refused"),
    ]
    with serving(home) as srv:
        host = srv.url.split("//")[1].split("/")[0]
        name, port = host.rsplit(":", 1)
        for path, origin, code in cases:
            with socket.create_connection((name, int(port)), timeout=T) as s:
                wire = Wire(s)
                s.sendall(_upgrade(host, path, origin))
                status, headers, body = wire.response()
                assert status == 403, body
                assert headers["content-type"] == "application/json"
                assert headers["x-request-id"].startswith("req_")
                assert json.loads(body)["error"]["code"] == code
                assert wire.closed_within(T)
                assert wire.buf == b""
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        log = srv.proc.stderr.read()
    assert "refused websocket '/ws': 403 origin_not_allowed" in log  # the log is the server's
    assert "without completing handshake" not in log, log
    assert "ERROR" not in log, log
