"""A permessage-deflate bomb (outside finding): with `[server] ws_compression = true`, frames of
~4 KB that each inflate to just under the frame limit were all inflated and queued in one socket
read before uvicorn's pause took effect: ~400 MB for 60 frames (250 KB on the wire) from one
client. The edge now feeds a compressed connection's reads to the parser a slice at a time and
stops while a message waits for the app. Real `serve`, raw frames on a real socket."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(90)

FRAMES = 60


@pytest.fixture
def sp(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home, APPSERVER_SERVER__WS_COMPRESSION="true")) as server:
        yield server


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def compressed_text_frame(message: bytes) -> bytes:
    """A masked (zero mask) text frame with RSV1 set: the message deflated on its own, without
    the trailing 00 00 ff ff (RFC 7692)."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = (squeeze.compress(message) + squeeze.flush(zlib.Z_SYNC_FLUSH))[:-4]
    assert len(payload) < 65536
    return struct.pack("!BBH", 0x80 | 0x40 | 0x1, 0x80 | 126, len(payload)) + b"\0\0\0\0" + payload


class FrameReader:
    """The server's messages, inflated (its compression context carries over between them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.inflate = zlib.decompressobj(-15)

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def next_message(self) -> bytes:
        first, second = self._take(2)
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", self._take(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", self._take(8))
        payload = self._take(size)
        if first & 0x40:
            payload = self.inflate.decompress(payload + b"\x00\x00\xff\xff")
        return payload


def upgraded(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Extensions: permessage-deflate; client_no_context_takeover\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101") and b"permessage-deflate" in head, head
    return s


def test_frames_that_inflate_to_the_limit_are_inflated_one_at_a_time(sp: ServeProcess) -> None:
    port = int(sp.url.rsplit(":", 1)[1])
    pid = sp.proc.pid
    filler = "a" * (4 * 1024 * 1024 - 200)  # under the 4 MiB frame limit once inflated
    frame = compressed_text_frame(json.dumps({"type": "ping", "request_id": "bomb", "pad": filler}).encode())
    before = rss_mb(pid)
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    s = upgraded(port)
    try:
        reader = FrameReader(s)  # after hello: before it, a message inflating past 64 KiB is refused (1009)
        s.sendall(compressed_text_frame(b'{"type": "hello", "protocol": 1, "request_id": "h"}'))
        assert b'"welcome"' in reader.next_message()
        s.sendall(frame * FRAMES)  # ~250 KB: one or two socket reads on the server
        answers = 0
        deadline = time.monotonic() + 60
        while answers < FRAMES and time.monotonic() < deadline:
            answers += b'"bomb"' in reader.next_message()
    finally:
        done.set()
        watcher.join(5)
        s.close()
    assert answers == FRAMES, f"{answers} of {FRAMES} pings answered"
    grown = max(peak) - before
    # one message in the app's hands at a time (its text and its parse: some tens of MB), not 60
    assert grown < 120, f"the server grew by {grown:.0f} MB for {len(frame) * FRAMES / 1e3:.0f} KB sent"
