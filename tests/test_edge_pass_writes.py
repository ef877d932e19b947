"""`PassWrites` (appserver/security/edge.py): the writes one event-loop pass makes to a connection go
out as one send, and nothing is held past that pass, a close or an abort. Driven on a recording
transport (what asyncio's socket transport is asked to do) and through a real server."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

from appserver.security.edge import PassWrites
from tests.support.cli import run_cli
from tests.support.serve import serving


class RecordingTransport(asyncio.Transport):
    """The calls a socket transport gets, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append(("eof", b""))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_writes_of_one_pass_leave_as_one_send_when_the_pass_ends() -> None:
    raw = RecordingTransport()
    t = PassWrites(raw, asyncio.get_running_loop())
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    t.write(bytearray(b"{}"))
    assert raw.calls == []  # held for the rest of this pass
    assert t.get_write_buffer_size() == 7 + 40
    await asyncio.sleep(0)
    assert raw.calls == [("write", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")]
    t.write(b"data: 1\n\n")  # a later pass: a send of its own
    await asyncio.sleep(0)
    assert raw.calls[1:] == [("write", b"data: 1\n\n")]
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the socket's


async def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    raw = RecordingTransport()
    t = PassWrites(raw, loop)
    t.write(b"head")
    t.write(b"body")
    t.close()
    assert raw.calls == [("write", b"headbody"), ("close", b"")]
    t.write(b"late")  # after close: straight to the socket, which drops it as asyncio does
    await asyncio.sleep(0)
    assert raw.calls[2:] == [("write", b"late")]

    raw2 = RecordingTransport()
    t2 = PassWrites(raw2, loop)
    t2.write(b"never")
    t2.abort()
    await asyncio.sleep(0)
    assert raw2.calls == [("abort", b"")]

    raw3 = RecordingTransport()
    t3 = PassWrites(raw3, loop)
    t3.write(b"last")
    t3.write_eof()
    assert raw3.calls == [("write", b"last"), ("eof", b"")]


class Replies:
    """HTTP/1.1 replies read off one socket, bytes of the next kept for it (pipelining)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> None:
        got = self.sock.recv(65536)
        assert got, f"the server closed the connection: {self.buf!r}"
        self.buf += got

    def next(self) -> tuple[bytes, bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        while len(rest) < length:
            self._more()
            head, _, rest = self.buf.partition(b"\r\n\r\n")
        self.buf = rest[length:]
        return head, rest[:length]


def test_replies_keep_flowing_on_a_kept_alive_connection(tmp_path: Path) -> None:
    """Many replies, pipelined and one by one, on one connection: each whole, in order."""
    home = tmp_path / "home"
    assert run_cli(home, "agents", "create", "--name", "a", "--model", "echo").code == 0
    with serving(home) as srv:
        host, port = srv.url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            bodies = [json.dumps({"model": "a", "messages": [{"role": "user", "content": f"n{i}"}]}) for i in range(6)]
            reqs = [
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(b)}\r\n\r\n{b}".encode()
                for b in bodies
            ]
            replies = Replies(s)
            s.sendall(b"".join(reqs[:3]))  # pipelined
            got = [replies.next() for _ in range(3)]
            for r in reqs[3:]:
                s.sendall(r)
                got.append(replies.next())
            assert replies.buf == b""
        for i, (head, body) in enumerate(got):
            assert head.startswith(b"HTTP/1.1 200"), head
            assert f"n{i}" in json.loads(body)["choices"][0]["message"]["content"]


def test_a_reply_sent_before_a_websocket_upgrade_stays_before_the_101(tmp_path: Path) -> None:
    """A request and a WebSocket upgrade in one write: the request's reply (held for the end of its
    loop pass) still reaches the client before the 101 and the first frame."""
    import base64
    import os
    import re

    home = tmp_path / "home"
    with serving(home) as srv:
        host, port = srv.url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            key = base64.b64encode(os.urandom(16))
            s.sendall(
                f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
                + f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n".encode()
                + b"Sec-WebSocket-Key: "
                + key
                + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            got = b""
            while b"101 Switching Protocols" not in got or not got.split(b"101 Switching Protocols", 1)[1].count(
                b"\r\n\r\n"
            ):
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
    statuses = re.findall(rb"HTTP/1.1 (\d+)", got)
    assert statuses[:2] == [b"200", b"101"], got[:300]
    first = got.index(b"HTTP/1.1 200")
    body_end = got.index(b"HTTP/1.1 101")
    assert b"\r\n\r\n" in got[first:body_end]  # the whole 200 reply came before the 101
