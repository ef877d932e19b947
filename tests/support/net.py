"""Loopback ports for tests that must name a port before the server binds it, and the SSL context
the tests' HTTP calls share."""

from __future__ import annotations

import asyncio
import socket

import httpx

# httpx builds a new SSL context for every client, and so for every top-level httpx.get/post; that
# reads the CA bundle (~50 ms of CPU each time). Helpers and polling loops pass this one, made the
# same way once: what they verify is unchanged (and on plain http:// it is never used).
SSL = httpx.create_ssl_context()


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
