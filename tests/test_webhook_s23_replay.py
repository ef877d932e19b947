"""Webhook fixes (session 23): a replayed signed request earns its connection no protection.

A captured signed request passes the signature and timestamp checks until `tolerance_s` has passed.
Sent on every connection from several loopback addresses, it made each of them "authenticated"
(never evicted), so the listener's slots stayed full and every fresh signed sender got 503 for up to
`tolerance_s`. Only a request signed for the first time proves the sender holds the secret now.
Real adapter, real sockets on loopback; the gateway is a recorder of the messages handed over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from plugins.contract import Account, AdapterContext, InboundMessage
from plugins.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookAdapter, create_adapter, sign

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-for-s23-webhook"
MAX_CONNECTIONS = 8
PER_CLIENT = 2
ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")  # 4 x 2 = every slot


@pytest.fixture
async def adapter(tmp_path: Path) -> AsyncIterator[WebhookAdapter]:
    got: list[InboundMessage] = []

    async def on_message(msg: InboundMessage) -> None:
        got.append(msg)

    settings = {
        "listen": "127.0.0.1:0",
        "max_connections": MAX_CONNECTIONS,
        "connections_per_client": PER_CLIENT,
    }
    context = AdapterContext(
        on_message=on_message,
        report=lambda state, reason: None,
        data_dir=tmp_path,
        log=logging.getLogger("test.webhook.s23"),
    )
    hook = create_adapter(Account("webhook", "hooks", settings, {"secret": SECRET}), context)
    assert isinstance(hook, WebhookAdapter)
    await hook.start()
    try:
        yield hook
    finally:
        await hook.stop()


def signed_request(message_id: str, timestamp: str | None = None) -> bytes:
    """A complete keep-alive HTTP request carrying a signed message."""
    body = json.dumps({"id": message_id, "chat": "c", "sender": "s", "text": "hi"}).encode()
    ts = timestamp or str(int(time.time()))
    head = (
        "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{TIMESTAMP_HEADER}: {ts}\r\n{SIGNATURE_HEADER}: {sign(SECRET, ts, body)}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Conn:
    """One client connection from a chosen loopback address."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, source: str) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        return cls(reader, writer)

    async def ask(self, request: bytes) -> tuple[int, dict[str, Any]]:
        self.writer.write(request)
        await self.writer.drain()
        return await self.answer()

    async def answer(self) -> tuple[int, dict[str, Any]]:
        """The next response's status and JSON body (status 0 when the server closed instead)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 5)
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        body = await asyncio.wait_for(self.reader.readexactly(length), 5)
        return int(head.split(b" ", 2)[1]), json.loads(body)

    async def finish(self) -> None:
        """End the connection through an error answer, which the server closes: once the close is
        read, the server has let go of its slot (it releases it before closing the socket)."""
        assert (await self.ask(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 405
        assert await asyncio.wait_for(self.reader.read(), 5) == b""

    def close(self) -> None:
        self.writer.close()


async def answer_or_none(conn: Conn) -> tuple[int, dict[str, Any]] | None:
    """An answer already sent on `conn` (an eviction's 503), or None when none comes."""
    try:
        return await asyncio.wait_for(conn.answer(), 1.0)
    except TimeoutError:
        return None


async def fill_with_replays(port: int, captured: bytes) -> list[Conn]:
    """Every slot held by a keep-alive connection that sent `captured` (each answered 202)."""
    conns = []
    for source in ATTACKERS:
        for _ in range(PER_CLIENT):
            conn = await Conn.open(port, source)
            status, body = await conn.ask(captured)
            assert status == 202, body  # served: the ledger, not the listener, drops a repeated id
            conns.append(conn)
    return conns


async def test_a_replayed_request_does_not_lock_fresh_signed_senders_out(adapter: WebhookAdapter) -> None:
    port = adapter.bound_port
    assert port is not None
    replays = await fill_with_replays(port, signed_request("captured-1"))
    fresh: list[Conn] = []
    try:
        # A fresh signed sender takes a slot held by a replay (before the fix: 503, max_connections).
        sender = await Conn.open(port, "127.0.0.1")
        fresh.append(sender)
        status, body = await sender.ask(signed_request("fresh-1"))
        assert status == 202, body
        for n, source in enumerate(("127.0.0.6", "127.0.0.7")):
            other = await Conn.open(port, source)
            fresh.append(other)
            status, body = await other.ask(signed_request(f"fresh-other-{n}"))
            assert status == 202, body
        # Each newcomer took a replay's slot, which was answered 503 and closed.
        evicted = [answer for answer in await asyncio.gather(*(answer_or_none(r) for r in replays)) if answer]
        assert len(evicted) == 3, evicted
        assert all(s == 503 and "evicted to make room" in b["error"] for s, b in evicted), evicted
    finally:
        for conn in [*replays, *fresh]:
            conn.close()


async def test_a_genuine_retry_of_the_same_id_is_served_and_a_freshly_signed_one_protected(
    adapter: WebhookAdapter,
) -> None:
    port = adapter.bound_port
    assert port is not None
    first = signed_request("retry-1", str(int(time.time()) - 2))
    sender = await Conn.open(port, "127.0.0.1")
    try:
        assert (await sender.ask(first))[0] == 202
        assert (await sender.ask(first))[0] == 202  # the same bytes again (a retry after a timeout)
        await sender.finish()
    finally:
        sender.close()
    replays = await fill_with_replays(port, first)  # its replays: unprotected
    retry = await Conn.open(port, "127.0.0.1")
    newcomers: list[Conn] = []
    try:
        # The same id signed anew (a later timestamp) is served, and keeps its slot: newcomers take
        # the replays' slots, and once only signed senders are left the next newcomer is refused.
        status, body = await retry.ask(signed_request("retry-1"))
        assert status == 202 and body["id"] == "retry-1", body
        for n in range(MAX_CONNECTIONS):
            newcomer = await Conn.open(port, f"127.0.1.{n + 1}")
            newcomers.append(newcomer)
            status, body = await newcomer.ask(signed_request(f"other-{n}"))
            if n < MAX_CONNECTIONS - 1:
                assert status == 202, (n, body)
            else:
                assert status == 503 and "max_connections" in body["error"], body
        assert (await retry.ask(signed_request("retry-2")))[0] == 202
    finally:
        for conn in [retry, *newcomers, *replays]:
            conn.close()


def test_the_memory_of_seen_signatures_is_bounded_and_forgets_expired_ones() -> None:
    from plugins.webhook.adapter import SeenSignatures  # here: the socket tests run without it too

    seen = SeenSignatures(tolerance_s=300, capacity=64)
    now = 1_767_322_800.0
    ts = str(int(now))
    assert seen.first_use(ts, b"a", now) and not seen.first_use(ts, b"a", now)
    for n in range(10_000):  # a flood of distinct signed requests: never more than the capacity
        seen.first_use(ts, b"%d" % n, now)
        assert len(seen) <= 64
    assert not seen.first_use(ts, b"9999", now)  # the latest are remembered
    later = now + 301  # every timestamp above has left the window: forgotten
    assert seen.first_use(str(int(later)), b"b", later) and len(seen) == 1
