"""Frames written straight to the socket (57da7b8: `Connection._write_now`, the edge's `write_frame`,
snapshots framed once in `hub.publish`), attacked from outside with real sockets against a real
`appserver serve`: frame integrity checked by a strict raw reader (RSV bits, masking, minimal length
encoding, UTF-8) and by the `websockets` client, reply order under pipelining beside a streaming
turn, clients that leave in every way mid-fan-out, permessage-deflate and plain clients side by side,
wss, a slow consumer's 4408 behind its backlog, keepalive pings among direct frames, SIGTERM with
500 subscribers, and a text frame that is not UTF-8 (close 1007 without a traceback in the log)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import websockets

from appserver.cli.serve import DRAIN_S, GRACE_S
from tests.support.certs import self_signed
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import TERMINAL, WS

# A stop held by a connection waits out uvicorn's whole grace (GRACE_S + DRAIN_S, 8 s); a quick one
# takes about 1 s, over 5 s on a loaded CI machine.
STOP_HELD_S = GRACE_S + DRAIN_S - 0.5

# ── a real server whose stderr is read as it comes (a full pipe would stall its event loop) ────────


class Served:
    def __init__(self, sp: ServeProcess) -> None:
        self.sp = sp
        self.url = sp.url
        self._err: list[str] = []
        assert sp.proc.stderr is not None
        self._reader = threading.Thread(target=self._drain, args=(sp.proc.stderr,), daemon=True)
        self._reader.start()

    def _drain(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self._err.append(line)

    def stop(self) -> tuple[int, float]:
        """SIGTERM; the exit code and how long the stop took."""
        t0 = time.monotonic()
        code = self.sp.stop(signal.SIGTERM, timeout=20)
        return code, time.monotonic() - t0

    def stderr(self) -> str:
        self._reader.join(5)
        return "".join(self._err)


@contextlib.contextmanager
def served(tmp_path: Path, *extra: str, **env: str) -> Iterator[Served]:
    home = tmp_path / "home"
    srv = Served(start_serve(home, *extra, env=cli_env(home, **env)))
    try:
        yield srv
    finally:
        srv.sp.kill()


def assert_quiet(stderr: str) -> None:
    """No traceback and no ERROR line: every client here misbehaves only in ways the server expects."""
    bad = [line for line in stderr.splitlines() if "Traceback" in line or "ERROR" in line]
    assert not bad, stderr[-4000:]


# ── a strict raw WebSocket client (no library between the test and the bytes) ─────────────────────


class Closed(Exception):
    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason


class RawWS:
    """Reads every server frame strictly: FIN set, no RSV bit (nothing was negotiated), known opcode,
    unmasked, the shortest length encoding, text that is UTF-8 and one JSON object. Answers pings
    unless told not to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        self.reader = reader
        self.writer = writer
        self.head = head
        self.answer_pings = True
        self.pings = 0
        self.lengths: list[int] = []  # payload length of every text frame read
        self.seen: list[dict[str, Any]] = []

    @classmethod
    async def open(
        cls, http_url: str, *, rcvbuf: int | None = None, limit: int = 1 << 20, offer_deflate: bool = False
    ) -> RawWS:
        host, port = http_url.removeprefix("http://").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        key = base64.b64encode(os.urandom(16)).decode()
        offer = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if offer_deflate else ""
        writer.write(
            (
                f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{offer}\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer, head)

    def send_frame(self, payload: bytes, opcode: int = 1, fin: bool = True) -> None:
        mask = os.urandom(4)
        n = len(payload)
        b0 = (0x80 if fin else 0) | opcode
        if n < 126:
            header = bytes((b0, 0x80 | n))
        elif n < 65536:
            header = bytes((b0, 0x80 | 126)) + struct.pack("!H", n)
        else:
            header = bytes((b0, 0x80 | 127)) + struct.pack("!Q", n)
        key = (mask * (n // 4 + 1))[:n]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big") if n else b""
        self.writer.write(header + mask + masked)

    def send(self, frame: dict[str, Any]) -> None:
        self.send_frame(json.dumps(frame, ensure_ascii=False).encode())

    async def frame(self) -> tuple[int, bytes]:
        b0, b1 = await self.reader.readexactly(2)
        assert b0 & 0x80, f"a fragmented server frame: {b0:#04x}"
        assert b0 & 0x70 == 0, f"RSV bits set on a connection that negotiated nothing: {b0:#04x}"
        opcode = b0 & 0x0F
        assert opcode in (0x1, 0x8, 0x9, 0xA), f"unexpected opcode {opcode:#x}"
        assert not b1 & 0x80, "a masked server frame"
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", await self.reader.readexactly(2))[0]
            assert n >= 126, f"16-bit length {n} for a payload that fits 7 bits"
        elif n == 127:
            n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
            assert 65536 <= n < 1 << 63, f"64-bit length {n} for a payload that fits 16 bits"
        payload = await self.reader.readexactly(n)
        if opcode == 0x1:
            self.lengths.append(n)
        return opcode, payload

    async def recv(self, timeout: float = 10) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                opcode, payload = await self.frame()
                if opcode == 0x1:
                    frame = json.loads(payload.decode("utf-8"))  # strict UTF-8
                    assert isinstance(frame, dict) and isinstance(frame.get("type"), str), frame
                    self.seen.append(frame)
                    return frame
                if opcode == 0x9:
                    self.pings += 1
                    if self.answer_pings:
                        self.send_frame(payload, opcode=0xA)
                elif opcode == 0x8:
                    code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                    raise Closed(code, payload[2:].decode("utf-8"))

    async def until_closed(self, timeout: float = 10) -> Closed:
        """Read every frame up to the close frame, and then to EOF: nothing may follow a close."""
        try:
            while True:
                await self.recv(timeout)
        except Closed as closed:
            try:  # a server that closes on its own ends TCP at once
                after = await asyncio.wait_for(self.reader.read(65536), 0.5)
            except TimeoutError:  # it waits for the client's close frame, as RFC 6455 asks
                self.send_frame(struct.pack("!H", closed.code) if closed.code else b"", opcode=0x8)
                after = await asyncio.wait_for(self.reader.read(65536), timeout)
            assert after == b"", f"{len(after)} bytes after the close frame: {after[:80]!r}"
            return closed

    def abort_with_rst(self) -> None:
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


# ── what every subscriber's stream must look like ────────────────────────────────────────────────


def check_turns(frames: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Revisions of a turn strictly increase and its terminal snapshot is its last turn_updated;
    returns each turn's last snapshot."""
    last: dict[str, dict[str, Any]] = {}
    for f in frames:
        if f["type"] != "turn_updated":
            continue
        snap = f["snapshot"]
        before = last.get(snap["turn_id"])
        if before is not None:
            assert before["status"] not in TERMINAL, f"turn_updated after the terminal one: {snap['revision']}"
            assert snap["revision"] > before["revision"], (before["revision"], snap["revision"])
        last[snap["turn_id"]] = snap
    return last


async def conversation(boss: WS) -> str:
    reply = await boss.request({"type": "create_conversation", "agent": "assistant"})
    return str(reply["conversation"]["id"])


async def submit(boss: WS, conv: str, text: str) -> str:
    ack = await boss.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": text})
    assert ack["type"] == "ack", ack
    return str(ack["turn_id"])


async def raw_subscriber(url: str, conv: str, **kw: Any) -> RawWS:
    raw = await RawWS.open(url, **kw)
    raw.send({"type": "hello", "protocol": 1, "request_id": "hello"})
    raw.send({"type": "subscribe", "conversation": conv, "request_id": "subscribe"})
    assert (await raw.recv())["type"] == "welcome"
    assert (await raw.recv())["type"] == "conversation_state"
    return raw


# ── the tests ─────────────────────────────────────────────────────────────────────────────────────

BIG_TEXT = " ".join(f"é😀{'ß' * 20}{i}" for i in range(2500))  # ~120 KB of UTF-8: its snapshots need 64-bit lengths


async def _integrity_and_order(url: str, compression: bool) -> None:
    boss = await WS.open(url, compression=None)
    conv = await conversation(boss)
    plain = await WS.open(url, compression=None)
    deflate = await WS.open(url)  # the websockets client offers permessage-deflate by default
    offered = deflate.conn.response.headers.get("Sec-WebSocket-Extensions", "")
    assert ("permessage-deflate" in offered) == compression, offered
    for ws in (plain, deflate):
        await ws.request({"type": "subscribe", "conversation": conv})
    raw = await raw_subscriber(url, conv)

    raw.send({"type": "ping", "request_id": ""})
    assert (await raw.recv())["type"] == "pong"
    pong_base = raw.lengths[-1]  # the payload of a pong with an empty request id
    big = await submit(boss, conv, BIG_TEXT)
    # Pipelined behind it on the raw connection, while that turn and the next one stream to it: pongs
    # whose payloads are every length around the 7/16-bit and 16/64-bit boundaries of the header,
    # and history replies.
    sizes = [*range(120, 132), *range(65530, 65542)]
    rids = []
    for i, size in enumerate(sizes):
        rids.append(f"p{i:02d}" + "a" * (size - pong_base - 3))
        raw.send({"type": "ping", "request_id": rids[-1]})
        if i % 4 == 3:
            rids.append(f"p{i:02d}" + "ü" * (100 * i))
            raw.send({"type": "get_history", "conversation": conv, "request_id": rids[-1]})
    slow = await submit(boss, conv, "/slow 8")

    answered: list[str] = []

    def ended() -> set[str]:
        return {t for t, s in check_turns(raw.seen).items() if s["status"] in TERMINAL}

    while len(answered) < len(rids) or {big, slow} - ended():
        frame = await raw.recv(20)
        if frame.get("request_id", "").startswith("p"):
            answered.append(frame["request_id"])
    assert answered == rids  # replies in request order, among direct and queued frames
    for ws in (plain, deflate):
        await ws.terminal(slow, timeout=20)
    for frames in (raw.seen, plain.seen, deflate.seen):
        last = check_turns(frames)
        assert last[big]["status"] == "completed" and last[big]["blocks"][-1]["text"] == "echo: " + BIG_TEXT
        assert last[slow]["status"] == "completed"
    assert set(sizes) <= set(raw.lengths), sorted(set(sizes) - set(raw.lengths))
    # The boss read none of the frames of its turns: its client stopped reading at its queue limit and
    # would not see the server's close frame (a close that waits out the client's 10 s close_timeout).
    await boss.terminal(slow, timeout=20)
    for ws in (boss, plain, deflate):
        await ws.close()


async def test_big_non_ascii_frames_and_pipelined_replies_arrive_whole_and_in_order(tmp_path: Path) -> None:
    """Plain clients only write directly; with compression on, a deflate client beside them takes the
    queue's way on the same conversation."""
    with served(tmp_path / "plain") as srv:
        await _integrity_and_order(srv.url, compression=False)
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())
    with served(tmp_path / "deflate", APPSERVER_SERVER__WS_COMPRESSION="true") as srv:
        await _integrity_and_order(srv.url, compression=True)
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())


async def test_clients_leaving_mid_fan_out_disturb_no_one(tmp_path: Path) -> None:
    """70 subscribers (a paced conversation) read a streaming turn while 48 others leave in every
    way during it: RST, close without a close frame, half-close, a close frame, an oversized frame
    (1009). The readers get every frame in order and the terminal one last; the server logs no
    error and stops at once."""
    with served(tmp_path, APPSERVER_LIMITS__WS_FRAME_MAX_BYTES="4096") as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        readers = await asyncio.gather(*(WS.open(srv.url, compression=None) for _ in range(70)))
        for ws in readers:
            await ws.request({"type": "subscribe", "conversation": conv})
        leavers = [await raw_subscriber(srv.url, conv) for _ in range(48)]
        turn = await submit(boss, conv, "/slow 24")
        await asyncio.sleep(0.3)
        for i, raw in enumerate(leavers):
            for _ in range(3):  # replies in flight as it goes
                raw.send({"type": "get_history", "conversation": conv})
            kind = i % 6
            if kind == 0:
                raw.abort_with_rst()
            elif kind == 1:
                raw.writer.close()
            elif kind == 2:
                raw.writer.write_eof()
            elif kind == 3:
                raw.send_frame(struct.pack("!H", 1000) + b"bye", opcode=0x8)
            elif kind == 4:
                raw.send_frame(b'{"type":"ping","pad":"' + b"x" * 5000 + b'"}')
            else:
                raw.send_frame(b'{"type":"ping",', fin=False)  # leaves mid-message
                raw.abort_with_rst()
            if i % 8 == 7:
                await asyncio.sleep(0.05)
        closes = []
        for i, raw in enumerate(leavers):
            if i % 6 in (3, 4):
                closes.append((await raw.until_closed()).code)
            raw.writer.transport.abort()
        assert closes == [1000, 1009] * 8
        snaps = await asyncio.gather(*(ws.terminal(turn, timeout=20) for ws in readers))
        assert all(s["status"] == "completed" and s["blocks"][-1]["text"].endswith("w24") for s in snaps)
        for ws in readers:
            assert check_turns(ws.seen)[turn]["status"] == "completed"
        again = await submit(boss, conv, "after the leavers")
        await asyncio.gather(*(ws.terminal(again) for ws in readers))
        code, took = srv.stop()
        assert code == 0 and took < STOP_HELD_S, (code, took)
        assert_quiet(srv.stderr())


async def test_sigterm_with_500_subscribers_mid_stream(tmp_path: Path) -> None:
    """Each of 500 subscribers of a streaming turn gets `server_stopping`, then close 1012 and
    nothing after it (the raw ones read to EOF), with every frame before it whole and in order; the
    server is gone well within its grace time (8 s)."""
    with served(tmp_path, APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT="0") as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        subs: list[WS] = []
        for _ in range(9):
            subs += await asyncio.gather(*(WS.open(srv.url, compression=None) for _ in range(50)))
        for ws in subs:
            await ws.send({"type": "subscribe", "conversation": conv})
        for ws in subs:
            assert (await ws.recv())["type"] == "conversation_state"
        raws = [await raw_subscriber(srv.url, conv) for _ in range(50)]
        await submit(boss, conv, "/slow 200")

        async def ws_reads(ws: WS) -> int | None:
            try:
                while True:
                    await ws.recv(20)
            except websockets.ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None

        readers = [asyncio.create_task(ws_reads(ws)) for ws in subs]
        raw_readers = [asyncio.create_task(raw.until_closed(20)) for raw in raws]
        await asyncio.sleep(0.8)
        code, took = await asyncio.to_thread(srv.stop)
        assert code == 0 and took < STOP_HELD_S, (code, took)
        assert await asyncio.gather(*readers) == [1012] * len(subs)
        assert [c.code for c in await asyncio.gather(*raw_readers)] == [1012] * len(raws)
        for frames in [ws.seen for ws in subs] + [raw.seen for raw in raws]:
            check_turns(frames)
            names = [f["name"] for f in frames if f["type"] == "event"]
            assert names == ["server_stopping"], names
        assert_quiet(srv.stderr())


async def test_a_slow_consumer_gets_its_backlog_then_4408_and_nothing_after(tmp_path: Path) -> None:
    """A raw client that stops reading while big replies pile up: the others keep receiving, and when
    it reads again it finds whole frames, its replies in order, the close 4408 last and then EOF."""
    with served(tmp_path, APPSERVER_LIMITS__WS_OUTBOUND_MAX="8") as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        await boss.terminal(await submit(boss, conv, " ".join(["é" * 99] * 2000)))  # ~400 KB history replies
        readers = await asyncio.gather(*(WS.open(srv.url, compression=None) for _ in range(3)))
        for ws in readers:
            await ws.request({"type": "subscribe", "conversation": conv})
        stalled = await raw_subscriber(srv.url, conv, rcvbuf=4096, limit=4096)
        rids = [f"r{i}" for i in range(30)]
        for i, rid in enumerate(rids):
            kind = "get_history" if i % 2 == 0 else "ping"
            stalled.send({"type": kind, "conversation": conv, "request_id": rid})
        await asyncio.sleep(0.3)
        turn = await submit(boss, conv, "/slow 10")
        await asyncio.gather(*(ws.terminal(turn) for ws in readers))
        for ws in readers:
            assert (await ws.request({"type": "ping"}))["type"] == "pong"
        closed = await stalled.until_closed(15)
        assert closed.code == 4408 and "not reading" in closed.reason, (closed.code, closed.reason)
        got = [f["request_id"] for f in stalled.seen if f.get("request_id", "").startswith("r")]
        assert got == rids[: len(got)] and len(got) < len(rids), got
        check_turns(stalled.seen)
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())


async def test_keepalive_pings_go_out_among_direct_frames(tmp_path: Path) -> None:
    """While a turn streams (frames written directly), pings still go out between whole frames: a
    client that answers them stays, one that does not is closed with 1011 mid-stream."""
    with served(tmp_path, APPSERVER_LIMITS__WS_PING_INTERVAL_S="0.2", APPSERVER_LIMITS__WS_PING_TIMEOUT_S="0.6") as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        polite = await raw_subscriber(srv.url, conv)
        silent = await raw_subscriber(srv.url, conv)
        silent.answer_pings = False
        turn = await submit(boss, conv, "/slow 30")

        async def polite_reads() -> None:
            while check_turns(polite.seen).get(turn, {}).get("status") not in TERMINAL:
                await polite.recv(10)

        reading = asyncio.create_task(polite_reads())
        closed = await silent.until_closed(10)
        assert closed.code == 1011 and closed.reason == "keepalive ping timeout"
        assert any(f["type"] == "turn_updated" for f in silent.seen)
        assert not reading.done()  # closed mid-stream
        await reading
        assert check_turns(polite.seen)[turn]["status"] == "completed"
        assert polite.pings >= 3, polite.pings
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())


async def test_a_slow_steady_reader_gets_the_latest_snapshot_not_a_backlog(tmp_path: Path) -> None:
    """A subscriber reading 100 KB/s while 25 turns stream one after another: the writer task handed
    its whole queue to the socket in one pass and the kernel's send buffer took megabytes of snapshots
    (every one delivered, every ping behind them: half a minute late, so the reader was cut by its
    own keepalive). Only each turn's latest snapshot may wait for it, and pings go out meanwhile."""
    with served(tmp_path, APPSERVER_LIMITS__WS_PING_INTERVAL_S="0.3", APPSERVER_LIMITS__WS_PING_TIMEOUT_S="3") as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        reader = await raw_subscriber(srv.url, conv, rcvbuf=8192, limit=8192)
        text = " ".join(f"word{i:05d}" for i in range(1500))
        turns: list[str] = []

        async def busy() -> None:
            for _ in range(25):
                turns.append(await submit(boss, conv, text))
                await boss.terminal(turns[-1])

        async def slow_reads() -> None:
            while not turns or check_turns(reader.seen).get(turns[-1], {}).get("status") not in TERMINAL:
                await reader.recv(10)  # a close (Closed) fails the test
                await asyncio.sleep(reader.lengths[-1] / 100_000)

        async with asyncio.timeout(60):
            await asyncio.gather(busy(), slow_reads())
        last = check_turns(reader.seen)
        assert last[turns[-1]]["status"] == "completed"
        assert all(s["status"] == "completed" and s["blocks"][-1]["text"] == f"echo: {text}" for s in last.values())
        reader.send({"type": "ping", "request_id": "after"})
        assert (await reader.recv())["type"] == "pong"
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())


async def test_a_client_that_reads_nothing_for_now_is_still_heard(tmp_path: Path) -> None:
    """A client whose downlink is full (it took nothing of a big turn's snapshots) presses stop: its
    `cancel` is read and acted on. The server stopped reading from any client over the high-water
    mark (a ping flood's bound), so the cancel waited until the client had read everything."""
    with served(tmp_path) as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        stalled = await raw_subscriber(srv.url, conv, rcvbuf=4096, limit=4096)
        await boss.terminal(await submit(boss, conv, BIG_TEXT))  # fills the stalled client's socket
        slow = await submit(boss, conv, "/slow 200")  # ten seconds
        await asyncio.sleep(0.3)
        stalled.send({"type": "cancel", "conversation": conv, "request_id": "stop"})
        snap = await boss.terminal(slow, 5)
        assert snap["status"] == "cancelled", snap["status"]
        code, _ = srv.stop()
        assert code == 0


async def test_wss_fan_out_with_compression_side_by_side_and_a_slow_consumer(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with served(
        tmp_path,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        APPSERVER_SERVER__WS_COMPRESSION="true",
        APPSERVER_LIMITS__WS_OUTBOUND_MAX="8",
    ) as srv:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        wss = srv.url.replace("https://", "wss://", 1) + "/ws"

        async def client(**kw: Any) -> WS:
            ws = WS(await websockets.connect(wss, ssl=ctx, max_size=None, **kw))
            assert (await ws.request({"type": "hello", "protocol": 1}))["type"] == "welcome"
            return ws

        boss = await client(compression=None)
        conv = await conversation(boss)
        subs = [await client(compression=None if i % 2 else "deflate") for i in range(6)]
        for ws in subs:
            await ws.request({"type": "subscribe", "conversation": conv})
        host, port = srv.url.removeprefix("https://").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        stalled = await websockets.connect(
            wss, ssl=ctx, sock=sock, server_hostname="127.0.0.1", max_queue=1, max_size=None, ping_interval=None
        )
        await stalled.send('{"type":"hello","protocol":1}')

        big = await submit(boss, conv, BIG_TEXT)
        for ws in subs:  # pipelined while the big turn streams to them
            for i in range(4):
                await ws.send({"type": "get_history" if i % 2 else "ping", "conversation": conv, "request_id": f"q{i}"})
        await boss.terminal(big)
        for _ in range(30):  # ~250 KB each, now that the big turn is in the history
            await stalled.send(json.dumps({"type": "get_history", "conversation": conv}))
        slow = await submit(boss, conv, "/slow 8")
        for ws in subs:
            await ws.terminal(slow, timeout=20)
            last = check_turns(ws.seen)
            assert last[big]["blocks"][-1]["text"] == "echo: " + BIG_TEXT and last[slow]["status"] == "completed"
            replies = [f["request_id"] for f in ws.seen if f.get("request_id", "").startswith("q")]
            assert replies == ["q0", "q1", "q2", "q3"]

        async def read_to_close() -> websockets.ConnectionClosed:
            try:
                while True:
                    await stalled.recv()
            except websockets.ConnectionClosed as exc:
                return exc

        closed = await asyncio.wait_for(read_to_close(), 15)
        assert closed.rcvd is not None and closed.rcvd.code == 4408, closed
        for ws in (boss, *subs):
            await ws.close()
        code, took = srv.stop()
        assert code == 0 and took < STOP_HELD_S, (code, took)
        assert_quiet(srv.stderr())


async def test_a_text_frame_that_is_not_utf8_is_closed_1007_without_a_traceback(tmp_path: Path) -> None:
    """Any client could fill the server's log: uvicorn logged every such frame as an ERROR with a
    traceback (and a server whose stderr is a pipe nobody drains fast enough stalls on it). A
    multi-byte character split across continuation frames is still one valid message."""
    with served(tmp_path) as srv:
        watcher = await WS.open(srv.url, compression=None)
        conv = await conversation(watcher)
        await watcher.request({"type": "subscribe", "conversation": conv})
        for _ in range(3):
            bad = await raw_subscriber(srv.url, conv)
            bad.send_frame(b'{"type":"ping","x":"\xff\xfe"}')
            assert (await bad.until_closed()).code == 1007
        split = await raw_subscriber(srv.url, conv)
        text = '{"type":"ping","request_id":"é😀"}'.encode()
        cut = text.index("😀".encode()) + 2  # inside the 4-byte character
        split.send_frame(text[:cut], fin=False)
        split.send_frame(text[cut:], opcode=0x0)
        assert await split.recv() == {"type": "pong", "request_id": "é😀"}
        split.send_frame(b'{"type":"ping","x":"\xf0\x9f', fin=False)
        split.send_frame(b'"}', opcode=0x0)  # the character never completes
        assert (await split.until_closed()).code == 1007
        turn = await submit(watcher, conv, "still here")
        assert (await watcher.terminal(turn))["status"] == "completed"
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())


async def test_replies_to_slow_steady_readers_keep_their_order(tmp_path: Path) -> None:
    """Clients that read slowly but keep asking: each socket fills and drains over and over, so
    replies switch between the queue (while it is full) and the direct way (once it drains), and
    requests land just as it drains. A reply written directly must never overtake a queued one (a
    check of `Connection._write_now` from outside; it catches dropping its queue check most runs)."""
    with served(tmp_path) as srv:
        boss = await WS.open(srv.url, compression=None)
        conv = await conversation(boss)
        await boss.terminal(await submit(boss, conv, " ".join(["é" * 99] * 300)))  # ~60 KB history replies

        async def slow_steady_reader(n: int) -> None:
            raw = await raw_subscriber(srv.url, conv, rcvbuf=8192, limit=8192)
            rids: list[str] = []
            got: list[str] = []
            for batch in range(40):
                for i in range(16):  # one write: the server reads them all in one pass
                    rids.append(f"r{batch}.{i}")
                    kind = "get_history" if i % 4 == 0 else "ping"
                    raw.send({"type": kind, "conversation": conv, "request_id": rids[-1]})
                for _ in range(10 + n % 3):  # then read a little: the server's socket drains as they land
                    frame = await raw.recv(20)
                    if frame.get("request_id", "").startswith("r"):
                        got.append(frame["request_id"])
                await asyncio.sleep(0.001 * (1 + n % 4))
            while len(got) < len(rids):
                frame = await raw.recv(20)
                if frame.get("request_id", "").startswith("r"):
                    got.append(frame["request_id"])
            assert got == rids, f"reader {n}: {next(f'{a} != {b}' for a, b in zip(got, rids, strict=True) if a != b)}"
            raw.writer.close()

        await asyncio.gather(*(slow_steady_reader(n) for n in range(6)))
        code, _ = srv.stop()
        assert code == 0
        assert_quiet(srv.stderr())
