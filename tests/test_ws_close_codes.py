"""docs/protocol.md lists exactly the WebSocket close codes the server sends.

The list lacked 1012 (the server stops: `serve` tells each connection `server_stopping`, then
uvicorn closes it with 1012) and the codes the WebSocket layer sends for a malformed frame (1002)
or a text frame that is not UTF-8 (1007). The application's own codes come from appserver/ws/codes.py
and appserver/security/ws_session.py; the layer's are observed here against a real `appserver
serve`, with a raw client that answers no ping (so the keepalive's 1011 comes too).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import websockets

from appserver.security import ws_session
from appserver.ws import codes
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
APP_CODES = {
    codes.CLOSE_AUTH,
    codes.CLOSE_PROTOCOL,
    codes.CLOSE_SLOW_CONSUMER,
    codes.CLOSE_TOO_BIG,
    codes.CLOSE_TOO_MANY,  # a `hello` whose credential is at its connection cap
    codes.CLOSE_TRY_AGAIN,  # a `hello` the token store could not answer (tests/test_pg_tokens_s21.py)
    ws_session.WS_CLOSE_AUTH,
    ws_session.WS_CLOSE_TOO_BIG,
}
LAYER_CODES = {1002, 1007, 1011, 1012}  # uvicorn / websockets: observed below
T = 10.0


def documented() -> set[int]:
    text = DOC.read_text("utf-8")
    m = re.search(r"^Close codes.*?(?=\n\n)", text, re.MULTILINE | re.DOTALL)
    assert m, "docs/protocol.md has no 'Close codes' paragraph"
    return {int(c) for c in re.findall(r"\b(1\d{3}|4\d{3})\b", m.group(0))}


def test_the_doc_lists_exactly_the_codes_the_server_sends() -> None:
    assert documented() == APP_CODES | LAYER_CODES


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("closecodes") / "home"
    # a ping every 0.2 s, a silent peer closed after 1 s
    env = cli_env(home, APPSERVER_LIMITS__WS_PING_INTERVAL_S="0.2", APPSERVER_LIMITS__WS_PING_TIMEOUT_S="1.2")
    with serving(home, env=env) as sp:
        yield sp


async def _open_raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket upgrade by hand: the client then writes whatever frames it likes."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET /ws HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), T)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def _frame(opcode: int, payload: bytes, *, rsv: int = 0, masked: bool = True) -> bytes:
    mask = os.urandom(4) if masked else b""
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if masked else payload
    return bytes([0x80 | rsv | opcode, (0x80 if masked else 0) | len(payload)]) + mask + body


async def _close_code(reader: asyncio.StreamReader) -> int:
    """Read frames (pings unanswered) until the server's close frame: its code."""
    while True:
        b0, b1 = await asyncio.wait_for(reader.readexactly(2), T)
        size = b1 & 0x7F
        if size == 126:
            size = int.from_bytes(await reader.readexactly(2), "big")
        elif size == 127:
            size = int.from_bytes(await reader.readexactly(8), "big")
        payload = await reader.readexactly(size)
        if b0 & 0x0F == 0x8:
            return int.from_bytes(payload[:2], "big")


async def _after(url: str, raw: bytes) -> int:
    reader, writer = await _open_raw(url)
    try:
        if raw:
            writer.write(raw)
        return await _close_code(reader)
    finally:
        writer.close()


async def test_the_server_sends_the_layer_codes_the_doc_lists(srv: ServeProcess) -> None:
    observed = {
        "malformed frame": await _after(srv.url, _frame(0x1, b"hi", rsv=0x40)),
        "unmasked frame": await _after(srv.url, _frame(0x1, b"hi", masked=False)),
        "not UTF-8": await _after(srv.url, _frame(0x1, b"\xff\xfe")),
        "no pong": await _after(srv.url, b""),
    }
    assert observed == {"malformed frame": 1002, "unmasked frame": 1002, "not UTF-8": 1007, "no pong": 1011}
    # the stop: `server_stopping`, then 1012 (a client that answers pings, as a real one does)
    ws = await WS.open(srv.url, open_timeout=T)
    srv.proc.send_signal(signal.SIGTERM)
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await ws.recv(T)
    code = closed.value.rcvd.code if closed.value.rcvd is not None else None
    assert code == 1012, closed.value
    assert srv.proc.wait(T) == 0
    assert set(observed.values()) | {code} == LAYER_CODES
    assert LAYER_CODES <= documented()
