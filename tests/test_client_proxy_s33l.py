"""A proxy of the environment that fails the CONNECT is blamed in one line, by its masked URL and
for what it did, never with a traceback: one that closes the connection after reading the CONNECT
(websockets fed its reader the end twice, and asyncio printed `Exception in callback …` and a
traceback ending in `EOFError: stream ended`), one that answers 407, one that answers 502 (both were
`no WebSocket server answered at ws://…`, blaming the server). Its own reason phrase, which a proxy
may fill with anything (here a header of the request), is not shown. Real CLI, real loopback proxy."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli

pytestmark = pytest.mark.timeout(60)

SECRET = "PR0XYpw9"
LEAKED_REASON = "EchoedHeaderX"
ANSWERS = {
    "close": b"",
    "407": b"HTTP/1.1 407 " + LEAKED_REASON.encode() + b"\r\nProxy-Authenticate: Basic\r\nContent-Length: 0\r\n\r\n",
    "502": b"HTTP/1.1 502 " + LEAKED_REASON.encode() + b"\r\nContent-Length: 0\r\n\r\n",
}
SAID = {
    "close": "closed the connection",
    "407": "HTTP 407 Proxy Authentication Required",
    "502": "HTTP 502 Bad Gateway",
}


def _serve(listener: socket.socket, answer: bytes) -> None:
    """Read each connection's CONNECT request, send `answer` (nothing: just close), close."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                if answer:
                    conn.sendall(answer)
            except OSError:
                pass


@pytest.fixture(scope="module")
def proxies() -> Iterator[dict[str, int]]:
    """One loopback proxy per kind of answer: its port."""
    listeners: dict[str, socket.socket] = {}
    for mode, answer in ANSWERS.items():
        listener = socket.create_server(("127.0.0.1", 0))
        listeners[mode] = listener
        threading.Thread(target=_serve, args=(listener, answer), daemon=True).start()
    yield {mode: listener.getsockname()[1] for mode, listener in listeners.items()}
    for listener in listeners.values():
        listener.close()


@pytest.mark.parametrize("mode", list(ANSWERS))
@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_failing_proxy_is_blamed_in_one_line(home: Path, proxies: dict[str, int], mode: str, command: str) -> None:
    proxy = f"http://bob:{SECRET}@127.0.0.1:{proxies[mode]}"
    env = {**cli_env(home), "HTTP_PROXY": proxy, "http_proxy": proxy}
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    url = "http://127.0.0.1:9"
    if command == "run":
        r = run_cli(home, "run", "--reconnect-wait", "0", "--url", url, "hi", env=env, timeout=30)
    else:
        r = run_cli(home, "chat", "--url", url, env=env, stdin="", timeout=30)
    assert r.code != 0, r
    assert "Traceback" not in r.err and "Exception in callback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1, r.err
    assert f"the proxy http://bob:***@127.0.0.1:{proxies[mode]}" in lines[0], r.err
    assert SAID[mode] in lines[0], r.err
    assert "no WebSocket server answered" not in r.err, r.err
    assert SECRET not in r.err + r.out and LEAKED_REASON not in r.err, r.err
