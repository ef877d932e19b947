"""`appserver run` against a server that welcomes the client but never confirms the submitted
input: `--timeout` bounds that wait too (it waited a fixed 30 s whatever `--timeout` said), and
the error says the input was not confirmed, so a turn may have started there (it said "the turn
did not settle", as if the turn were known)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.sync.server import ServerConnection, serve

from tests.support.cli import run_cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_server() -> Iterator[tuple[str, list[str]]]:
    """A /ws server that answers `hello` and nothing else; the frame types it got."""
    seen: list[str] = []

    def handler(ws: ServerConnection) -> None:
        for raw in ws:
            frame = json.loads(raw)
            seen.append(frame["type"])
            if frame["type"] == "hello":
                welcome = {"protocol": 1, "server": "x", "connection_id": "wsc_1", "subject": "local"}
                ws.send(json.dumps({"type": "welcome", "request_id": frame["request_id"], **welcome}))

    with serve(handler, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        host, port = server.socket.getsockname()[:2]
        try:
            yield f"http://{host}:{port}", seen
        finally:
            server.shutdown()
            thread.join(5)


def test_run_waits_for_the_ack_no_longer_than_its_timeout_and_says_a_turn_may_have_started(
    tmp_path: Path, silent_server: tuple[str, list[str]]
) -> None:
    url, seen = silent_server
    started = time.monotonic()
    result = run_cli(tmp_path / "home", "run", "--url", url, "--timeout", "2", "hi", timeout=50)
    took = time.monotonic() - started
    assert "submit_input" in seen
    assert result.code == 1, (result.code, result.err)
    assert "did not confirm the input within 2 s" in result.err, result.err
    assert "a turn may have started there" in result.err, result.err
    assert "did not settle" not in result.err, result.err
    assert took < 25, f"waited {took:.1f} s for an ack with --timeout 2"
