"""`[server]` options of `serve`: the event loop, WebSocket compression."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest
import uvloop
import websockets

from appserver.cli.serve import event_loop_factory
from appserver.config import ConfigError, load_config
from tests.support.cli import cli_env
from tests.support.serve import start_serve
from tests.support.ws import ws_url


def test_auto_and_uvloop_choose_uvloop_and_asyncio_the_standard_loop() -> None:
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None


def test_the_default_loop_is_the_standard_one(tmp_path: Path) -> None:
    assert event_loop_factory(load_config(tmp_path / "home", environ={}).server.event_loop) is None


def test_an_unknown_loop_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "home", environ={"APPSERVER_SERVER__EVENT_LOOP": "tokio"})
    assert "event_loop" in str(err.value) and "asyncio" in str(err.value)


@pytest.mark.parametrize("setting", [None, "true"])
async def test_websocket_compression_is_off_unless_configured(tmp_path: Path, setting: str | None) -> None:
    """A client offering permessage-deflate gets it only with `[server] ws_compression = true`."""
    home = tmp_path / "home"
    extra = {"APPSERVER_SERVER__WS_COMPRESSION": setting} if setting else {}
    sp = start_serve(home, env=cli_env(home, **extra))
    try:
        conn = await websockets.connect(ws_url(sp.url), compression="deflate")
        try:
            assert conn.response is not None
            negotiated = conn.response.headers.get("sec-websocket-extensions") or ""
        finally:
            await conn.close()
    finally:
        sp.stop()
    assert ("permessage-deflate" in negotiated) == (setting == "true"), negotiated


def test_a_second_sigterm_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home))
    sp.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    sp.proc.send_signal(signal.SIGTERM)
    code = sp.proc.wait(15)
    err = sp.proc.stderr.read() if sp.proc.stderr else ""
    assert code == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert not (home / "server.json").exists()


def test_signals_until_the_very_end_still_exit_cleanly(tmp_path: Path) -> None:
    """SIGTERM after SIGTERM, every few milliseconds until the process is gone: whichever lands
    after uvicorn let go of the signals (server.json removed, the loop closing, the interpreter
    ending) finds the stop already under way; none kills the process with -15."""
    home = tmp_path / "home"
    codes = []
    for _ in range(3):
        sp = start_serve(home, env=cli_env(home))
        deadline = time.monotonic() + 15
        while sp.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                sp.proc.send_signal(signal.SIGTERM)
            time.sleep(0.002)
        code = sp.proc.wait(15)
        err = sp.proc.stderr.read() if sp.proc.stderr else ""
        assert "Traceback" not in err, err
        codes.append(code)
    assert codes == [0, 0, 0]


def test_a_stream_still_running_when_the_graceful_wait_ends_is_no_error_in_the_log(tmp_path: Path) -> None:
    """A reply still streaming when the stop's graceful wait (5 s) ends is cancelled: that is the
    stop doing its job, not "Exception in ASGI application" with a CancelledError traceback."""
    import socket

    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home))
    host, port = sp.url.split("//", 1)[1].rsplit(":", 1)
    body = b'{"model": "assistant", "stream": true, "messages": [{"role": "user", "content": "/slow 100000"}]}'
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert b"data: " in conn.recv(65536)  # streaming
        sp.proc.send_signal(signal.SIGTERM)
        code = sp.proc.wait(30)
    err = sp.proc.stderr.read() if sp.proc.stderr else ""
    assert code == 0, err
    assert "Exception in ASGI application" not in err and "CancelledError" not in err, err
