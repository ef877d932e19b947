"""The local owner cannot be borrowed (s39 attacker B), through a real `appserver serve` on loopback:

* another Unix user that sends a whole request and hangs up at once (TCP_CORK then close: its
  socket in TIME_WAIT, which the kernel reports as root's; or SO_LINGER 0: reset, no socket left)
  was the owner in auth mode none, and its turn ran. The peer the kernel says is closed or gone is
  nobody's now: nothing runs.
  Nor is an owner's listener the kernel finds on a gone peer's port instead of the peer.
* `X-Forwarded-For: 127.0.0.1` sent by a peer that is not a trusted proxy was believed once
  `trusted_proxies` was set (uvicorn had left the peer in place, and the guard took the agreement
  of the two for a proxy's word): 403 forwarded_needs_auth. And another Unix user sending the
  headers itself to a server trusting a proxy on loopback is not that proxy: 403 other_user.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from appserver.netaddr import PEER_GONE, kernel_tells_peers, tcp_peer_uid
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.test_security_s38m import AS_OTHER_USER, T, _skip_unless_root_on_linux

HANG_UP = r"""
import json, socket, struct, sys
port, marker, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
body = json.dumps({"model": "assistant", "input": marker}).encode()
if how == "cork":
    body = b" " * 3000 + body  # request and FIN arrive together: the socket is in TIME_WAIT at once
head = b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
s = socket.create_connection(("127.0.0.1", port), timeout=10)
if how == "cork":
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
else:  # close() resets the connection: no socket left when the server looks
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
s.close()
"""

AS_ITSELF = r"""
import socket, sys
port, path, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3]
upgrade = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
upgrade += "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}{upgrade if path == '/ws' else ''}\r\n".encode())
got = b""
while b"\r\n\r\n" not in got:
    chunk = s.recv(65536)
    if not chunk:
        break
    got += chunk
print(got.split(b"\r\n", 1)[0].decode(), got.split(b"\r\n\r\n", 1)[-1][:300].decode(errors="replace"))
"""


def _port(sp: ServeProcess) -> int:
    return int(sp.url.rsplit(":", 1)[1])


def _stored(home: Path, marker: str) -> int:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT count(*) FROM messages WHERE content LIKE ?", (f"%{marker}%",)).fetchone()
    return int(row[0])


def _as_other_user(script: str, *args: str) -> str:
    run = subprocess.run(
        [*AS_OTHER_USER, sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _raw(port: int, path: str, extra: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got.decode(errors="replace")


def test_another_user_hanging_up_at_once_is_not_the_owner(tmp_path: Path) -> None:
    _skip_unless_root_on_linux()
    home = tmp_path / "home"
    with serving(home, env=cli_env(home)) as sp:
        markers = {how: f"hung-up-{how}-{uuid.uuid4().hex}" for how in ("cork", "rst")}
        for how, marker in markers.items():
            for _ in range(3):
                _as_other_user(HANG_UP, str(_port(sp)), marker, how)
        owner = httpx.post(sp.url + "/v1/responses", json={"model": "assistant", "input": "mine"}, timeout=30)
        assert owner.status_code == 200, owner.text
        time.sleep(1.0)  # a turn the guard let through would have been stored by now (the owner's was)
        assert _stored(home, "mine") >= 1
        assert {how: _stored(home, marker) for how, marker in markers.items()} == {"cork": 0, "rst": 0}


def test_forwarding_headers_from_a_peer_that_is_no_trusted_proxy_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with serving(home, env=cli_env(home, APPSERVER_SERVER__TRUSTED_PROXIES="127.0.0.9")) as sp:
        for header in ("X-Forwarded-For: 127.0.0.1\r\n", "X-Forwarded-For: 127.0.0.1, 127.0.0.1\r\n"):
            got = _raw(_port(sp), "/v1/models", header)
            assert got.startswith("HTTP/1.1 403") and "forwarded_needs_auth" in got, (header, got[:400])
        assert _raw(_port(sp), "/v1/models", "").startswith("HTTP/1.1 200")


def test_another_user_posing_as_a_trusted_proxy_on_loopback_is_refused(tmp_path: Path) -> None:
    _skip_unless_root_on_linux()
    home = tmp_path / "home"
    with serving(home, env=cli_env(home, APPSERVER_SERVER__TRUSTED_PROXIES="127.0.0.1")) as sp:
        for header in ("X-Forwarded-For: 127.0.0.1\r\n", "Forwarded: for=127.0.0.1\r\n", "X-Real-IP: 127.0.0.1\r\n"):
            for path in ("/v1/models", "/ws"):
                got = _as_other_user(AS_ITSELF, str(_port(sp)), path, header)
                assert got.startswith("HTTP/1.1 403") and "other_user" in got, (header, path, got)
        # the owner's own proxy (the server's own user, or root) still forwards the owner
        assert _raw(_port(sp), "/v1/models", "X-Forwarded-For: 127.0.0.1\r\n").startswith("HTTP/1.1 200")
        readyz = json.loads(_raw(_port(sp), "/readyz", "X-Forwarded-For: 127.0.0.1\r\n").split("\r\n\r\n", 1)[1])
        assert readyz["status"] == "ready"


def test_a_listener_on_a_gone_peers_port_is_not_that_peer() -> None:
    """Once the socket asked about is gone, the kernel's lookup falls back to a listener on the same
    address and port (an owner's service that started there): it was read as the peer's user."""
    _skip_unless_linux()
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as other:
        gone_peer = ("127.0.0.1", other.getsockname()[1])  # nobody connects from there: only a listener
        assert tcp_peer_uid(gone_peer, server.getsockname()) == PEER_GONE
        with socket.create_connection(server.getsockname(), timeout=T):
            accepted, _ = server.accept()
            with accepted:
                assert tcp_peer_uid(accepted.getpeername(), accepted.getsockname()) == os.geteuid()
        assert kernel_tells_peers()


def test_an_ipv4_client_on_a_dual_stack_socket_is_found() -> None:
    _skip_unless_linux()
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_INET6) as client:
        client.settimeout(T)
        client.connect(("::ffff:127.0.0.1", server.getsockname()[1]))
        accepted, _ = server.accept()
        with accepted:
            assert tcp_peer_uid(accepted.getpeername(), accepted.getsockname()) == os.geteuid()


def _skip_unless_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the kernel is asked whose a connection is on Linux only")
