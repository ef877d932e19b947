"""The send timeout (`[limits] send_timeout_s`, appserver/security/edge.py) through a real
`appserver serve`: clients that ask for a big reply and never read it are cut off once the timeout
passes, so they hold neither a connection (the cap: 503 for everyone else) nor a per-client slot,
whether the reply was written whole (then the idle close waited for the buffer, forever) or is an
SSE stream blocked on flow control (its turn sees the disconnect)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.serve import ServeProcess, serving
from tests.test_edge_pipelined_refusals import T, Wire, chat, connect
from tests.test_edge_pipelining import _address, _home, _limits

pytestmark = pytest.mark.timeout(90)

SEND_S = 1.0


@pytest.fixture
def cutting(tmp_path: Path) -> Iterator[ServeProcess]:
    home = _home(tmp_path)
    env = _limits(
        home,
        APPSERVER_LIMITS__CONNECTIONS_PER_CLIENT="2",
        APPSERVER_LIMITS__MAX_CONNECTIONS="2",
        APPSERVER_LIMITS__SEND_TIMEOUT_S=str(SEND_S),
    )
    with serving(home, env=env) as sp:
        yield sp


def _both_places_free(srv: ServeProcess, within: float) -> list[int]:
    """Two chat requests on two connections at once (all the cap allows), repeated until both are
    answered 200 or `within` seconds pass: the last statuses (0: cut at accept, a 503)."""
    deadline = time.monotonic() + within
    while True:
        statuses = []
        socks = [connect(srv), connect(srv)]
        try:
            for s in socks:  # both open: each holds a place from its accept on
                try:
                    s.sendall(chat("probe"))
                    statuses.append(Wire(s).response()[0])
                except OSError:  # a 503 at accept, maybe cut by the close
                    statuses.append(0)
        finally:
            for s in socks:
                s.close()
        if statuses == [200, 200] or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole-reply", "sse-stream"])
def test_clients_that_never_read_are_cut_off_and_free_their_places(cutting: ServeProcess, stream: bool) -> None:
    """Both connections the cap allows ask for a 5 MB echo and read nothing. After the send timeout
    they are aborted: a new client is served (before, every one got 503 server_busy for as long as
    the silent clients kept their sockets open), and the server says why it cut them (each with
    its own request id: the two replies need not stall at the same moment)."""
    flood = chat(("x" * 99 + " ") * 50_000, stream=stream)  # ~5 MB back: more than the socket buffers
    socks = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(T)
            s.connect(_address(cutting))
            s.sendall(flood)
            socks.append(s)
        assert _both_places_free(cutting, within=2 * SEND_S + 20) == [200, 200]
    finally:
        for s in socks:
            s.close()
    cutting.stop()
    assert cutting.proc.stderr is not None
    log = cutting.proc.stderr.read()
    assert log.count("took no byte of its reply for 1 s ([limits] send_timeout_s)") == 2, log[-3000:]
