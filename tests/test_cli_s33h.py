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
    assert "conversations list" not in result.err, result.err  # it lists this home's server, not --url's
    assert took < 25, f"waited {took:.1f} s for an ack with --timeout 2"


def test_channels_add_edits_a_config_toml_saved_with_a_byte_order_mark(tmp_path: Path) -> None:
    """load_config reads a config.toml with a UTF-8 byte-order mark (Windows editors write one);
    `channels add` refused it as "not valid TOML"."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_bytes(b'\xef\xbb\xbf[server]\r\nlisten = "127.0.0.1:8770"\r\n')
    added = run_cli(home, "channels", "add", "telegram", "main", "--secret", "token=env:TG_TOKEN")
    assert added.code == 0, added.err
    listed = run_cli(home, "channels", "list")
    assert listed.code == 0 and "telegram" in listed.out, (listed.out, listed.err)
    assert not list(home.glob("config.toml.corrupt-*"))
