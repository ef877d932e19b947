"""The client of the `/ws` protocol, as its own package (DESIGN §13).

It imports nothing of the server (tests/test_client_package.py checks), so the CLI's remote
commands, the examples and the gateway child process can speak the protocol exactly as a desktop
app would, without loading the kernel. `ProtocolClient` is the connection (reconnect with backoff,
resubscribe, resume); `frames` holds the frame types; `ProtocolError` (a refused frame),
`ConnectError` (a bad URL, an upgrade the server refused: 401/403) and `Closed` are what it raises;
network failures are `OSError`.

    from appserver.client import ProtocolClient

    async with await ProtocolClient.connect("http://127.0.0.1:8770", reconnect=True) as c:
        ack = await c.submit("assistant", "hi")
        snapshot = await c.wait_turn(ack["turn_id"])
"""

from __future__ import annotations

from appserver.client import frames
from appserver.client.auth import TokenSource, check_url, shown_url, ws_url
from appserver.client.buffer import FrameBuffer
from appserver.client.connection import ProtocolClient, encode_frame, resendable
from appserver.client.errors import Closed, ConnectError, ProtocolError
from appserver.client.frames import PROTOCOL_VERSION, TERMINAL, ClientFrame, ServerFrame, Snapshot
from appserver.client.resume import lost_snapshot, settled_from_history

__all__ = [
    "PROTOCOL_VERSION",
    "TERMINAL",
    "ClientFrame",
    "Closed",
    "ConnectError",
    "FrameBuffer",
    "ProtocolClient",
    "ProtocolError",
    "ServerFrame",
    "Snapshot",
    "TokenSource",
    "check_url",
    "encode_frame",
    "frames",
    "lost_snapshot",
    "resendable",
    "settled_from_history",
    "shown_url",
    "ws_url",
]
