"""Loopback ports for tests that must name a port before the server binds it, the SSL context
the tests' HTTP calls share, and a scripted raw HTTP/1.1 server for client-side tests."""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import httpx

# httpx builds a new SSL context for every client, and so for every top-level httpx.get/post; that
# reads the CA bundle (~50 ms of CPU each time). Helpers and polling loops pass this one, made the
# same way once: what they verify is unchanged (and on plain http:// it is never used).
SSL = httpx.create_ssl_context()


def share_default_ssl_context() -> None:
    """Let every httpx client of this process that verifies as by default (no `verify=`, no `cert=`)
    share one context made that way, as if each had been given `verify=SSL`: the suite makes thousands
    of clients (top-level httpx calls, `openai.OpenAI()`, polling loops), each reading the CA bundle.
    The same for httpx2, the fork the `openai` SDK's clients are built on.

    Keyed by the variables both read (SSL_CERT_FILE / SSL_CERT_DIR), so a test that sets one gets a
    context that trusts what it names. httpcore sets a context's ALPN on every connection from the
    client's http2 flag; nothing in the suite uses HTTP/2, so the shared context's ALPN never varies."""
    for name in ("httpx._transports.default", "httpx2._transports.default"):
        try:
            transports = importlib.import_module(name)
        except ImportError:
            continue
        transports.create_ssl_context = _shared_default(transports.create_ssl_context)


def _shared_default(made: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    @functools.lru_cache(maxsize=8)
    def default_context(trust_env: bool, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
        return made(verify=True, cert=None, trust_env=trust_env)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        if not trust_env:
            return default_context(False, None, None)
        return default_context(True, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))

    return create_ssl_context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    """Something accepts connections on `port`. A port in the ephemeral range with no listener
    can still "accept": Linux may give the probing socket that very port as its own, and the
    socket then connects to itself (TCP simultaneous open). That is not a listener."""
    with socket.socket() as s:
        s.settimeout(0.5)
        if s.connect_ex(("127.0.0.1", port)) != 0:
            return False
        return s.getsockname() != s.getpeername()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request with a Content-Length body off a loopback fake's stream: (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


# A scripted reply: request body → what to write back, piece by piece; a float is a pause (so the
# pieces arrive apart).
Reply = Callable[[bytes], Iterable[bytes | float]]


class ScriptedServer:
    """Answers each request on a connection with the next scripted reply; keeps the request heads
    and bodies and counts connections. `close_after`: close the connection after each reply."""

    def __init__(self, replies: list[Reply], *, close_after: bool = False) -> None:
        self.replies = replies
        self.close_after = close_after
        self.connections = 0
        self.closed = 0  # connections that ended (the client hung up, or close_after)
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head, body = await read_request(reader)
                self.heads.append(head)
                self.bodies.append(body)
                for piece in self.replies.pop(0)(body):
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


@asynccontextmanager
async def serving(server: ScriptedServer) -> AsyncIterator[str]:
    """`server` on an ephemeral loopback port: its base URL."""
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()
