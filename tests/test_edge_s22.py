"""Edge fixes of session 22, against real `appserver serve` processes on loopback.

1. Under TLS (`--tls-cert/--tls-key`), connections that never finish their handshake used to be
   invisible to the edge: asyncio's TLS layer shows a connection to its protocol only after the
   handshake, so they were neither counted by the connection cap nor timed (asyncio's 60 s
   handshake timeout only), and a few hundred ran the server out of descriptors. Now they count
   from their accept (at the cap they are closed at once, or an older unauthenticated one gives up
   its slot) and the handshake has `head_timeout_s`.
2. In token/jwt mode, WebSockets that never send `hello` filled their address's
   `connections_per_client` slots, and a browser-style client of that address (it authenticates in
   `hello`) got 429 at its upgrade. Now such sockets wait in a bucket of their own, where a
   newcomer takes the place of the oldest (closed 4401), never refused.
3. In jwt mode a valid JWT over 8192 characters was refused as `invalid_api_key` "malformed bearer
   token"; JWTs may now have 16384 characters, and a longer one is `invalid_token` naming the limit.
   `exp: true` is an invalid claim, not "JWT has expired".
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import jwt
import pytest
import websockets

from tests.support.certs import self_signed
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

T = 10.0  # the longest any single wait may take


def _address(srv: ServeProcess) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed (or reset) this connection, which never sent a byte."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ── 1. TLS handshakes count from accept and are timed ──────────────────────────────────────────


CAP = 8


@pytest.fixture
def tls_home(tmp_path: Path) -> tuple[Path, Path, Path]:
    cert, key = self_signed(tmp_path)
    return tmp_path / "home", cert, key


def _tls_serve(home: Path, cert: Path, key: Path, loop: str, **limits: str) -> AbstractContextManager[ServeProcess]:
    env = cli_env(
        home,
        APPSERVER_SERVER__EVENT_LOOP=loop,
        **{f"APPSERVER_LIMITS__{k.upper()}": v for k, v in limits.items()},
    )
    return serving(home, "--tls-cert", str(cert), "--tls-key", str(key), env=env)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tls_connections_without_handshake_are_capped(tls_home: tuple[Path, Path, Path], loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    home, cert, key = tls_home
    client_tls = ssl.create_default_context(cafile=str(cert))
    limits = {"max_connections": str(CAP), "head_timeout_s": "10", "keepalive_timeout_s": "30"}
    with _tls_serve(home, cert, key, loop, **limits) as srv:
        assert srv.url.startswith("https://")
        # Twice the cap of connections that never send a ClientHello: the server keeps at most the
        # cap of them (the rest closed at accept, or older ones evicted), at once, not after the
        # 60 s asyncio's handshake timeout gave them.
        stalled = [socket.create_connection(_address(srv), timeout=T) for _ in range(2 * CAP)]
        try:
            wait_for(
                lambda: sum(_closed_by_server(s) for s in stalled) >= CAP,
                T,
                f"the server to close all but {CAP} of {2 * CAP} connections in their TLS handshake",
            )
            # A real client still gets in: the slot of one that waited past the grace (1 s) is its.
            time.sleep(1.2)
            r = httpx.get(srv.url + "/healthz", verify=client_tls, timeout=T)
            assert r.status_code == 200, r.text

            async def over_wss() -> str:
                url = srv.url.replace("https://", "wss://", 1) + "/ws"
                async with websockets.connect(url, ssl=client_tls, open_timeout=T) as ws:
                    await ws.send(json.dumps({"type": "hello", "protocol": 1, "request_id": "h"}))
                    return str(json.loads(await asyncio.wait_for(ws.recv(), T))["type"])

            # another newcomer, and a WebSocket through the edge's own TLS
            assert asyncio.run(over_wss()) == "welcome"
        finally:
            for s in stalled:
                s.close()
        assert srv.stop() == 0
        assert srv.proc.stderr is not None
        log = srv.proc.stderr.read()
        assert f"connection limit {CAP} reached" in log, log[-3000:]
        assert "Too many open files" not in log


def test_tls_handshake_times_out(tls_home: tuple[Path, Path, Path]) -> None:
    home, cert, key = tls_home
    client_tls = ssl.create_default_context(cafile=str(cert))
    with _tls_serve(home, cert, key, "asyncio", head_timeout_s="2", keepalive_timeout_s="30") as srv:
        silent = socket.create_connection(_address(srv), timeout=T)
        partial = socket.create_connection(_address(srv), timeout=T)
        partial.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello cut short
        opened = time.monotonic()
        try:
            wait_for(
                lambda: _closed_by_server(silent) and _closed_by_server(partial),
                8,
                "the server to end TLS handshakes not done within head_timeout_s (2 s)",
            )
            took = time.monotonic() - opened
            assert took >= 1.5, f"closed after {took:.1f} s, before the handshake timeout"
        finally:
            silent.close()
            partial.close()
        # a handshake done in time is served as ever
        r = httpx.get(srv.url + "/healthz", verify=client_tls, timeout=T)
        assert r.status_code == 200, r.text


# ── 2 and 3: auth mode jwt ──────────────────────────────────────────────────────────────────


PER_CLIENT = 4


@pytest.fixture(scope="module")
def jwt_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str]]:
    home = tmp_path_factory.mktemp("s22-jwt") / "home"
    home.mkdir()
    secret = base64.b64encode(secrets.token_bytes(36)).decode()
    (home / "jwt.secret").write_text(secret + "\n")
    (home / "jwt.secret").chmod(0o600)
    (home / "config.toml").write_text(
        '[auth]\nmode = "jwt"\njwt_secret_file = "jwt.secret"\njwt_algorithms = ["HS256"]\n'
        f"[limits]\nconnections_per_client = {PER_CLIENT}\n"
    )
    with serving(home) as srv:
        yield srv, secret


def _jwt(secret: str, sub: str, **claims: object) -> str:
    return jwt.encode({"sub": sub, "exp": int(time.time()) + 600, **claims}, secret, algorithm="HS256")


def _ws_url(srv: ServeProcess) -> str:
    return srv.url.replace("http://", "ws://", 1) + "/ws"


async def _hello(ws: websockets.ClientConnection, token: str) -> dict[str, object]:
    await ws.send(json.dumps({"type": "hello", "protocol": 1, "token": token, "request_id": "h"}))
    frame: dict[str, object] = json.loads(await asyncio.wait_for(ws.recv(), T))
    return frame


async def _closed(ws: websockets.ClientConnection, timeout: float) -> bool:
    try:
        await asyncio.wait_for(ws.wait_closed(), timeout)
    except TimeoutError:
        return False
    return True


async def test_pending_websockets_do_not_starve_a_hello_client(jwt_srv: tuple[ServeProcess, str]) -> None:
    srv, secret = jwt_srv
    url = _ws_url(srv)
    # An address's every slot held by WebSockets that never send `hello`…
    hogs = [await websockets.connect(url, open_timeout=T) for _ in range(PER_CLIENT)]
    more: list[websockets.ClientConnection] = []
    try:
        # …does not keep out a client of that address that authenticates in `hello` (a browser).
        async with websockets.connect(url, open_timeout=T) as victim:
            welcome = await _hello(victim, _jwt(secret, "victim"))
            assert welcome["type"] == "welcome", welcome
            assert welcome["subject"] == "jwt:victim"
            # the socket that waited longest without a hello gave its place up, closed 4401
            assert await _closed(hogs[0], T), "the oldest unauthenticated socket was not closed"
            assert hogs[0].close_code == 4401, (hogs[0].close_code, hogs[0].close_reason)
            assert hogs[0].close_reason is not None and hogs[0].close_reason.startswith("authentication timeout")
            assert not any([await _closed(h, 0.2) for h in hogs[1:]])

            # The address still holds at most PER_CLIENT such sockets: each newer one closes the oldest.
            more = [await websockets.connect(url, open_timeout=T) for _ in range(PER_CLIENT)]
            for old in hogs[1:]:
                assert await _closed(old, T), "an older unauthenticated socket was kept past the bound"
                assert old.close_code == 4401
            assert not any([await _closed(h, 0.2) for h in more])

            # The victim's authenticated socket works throughout.
            await victim.send(json.dumps({"type": "ping", "request_id": "p"}))
            assert json.loads(await asyncio.wait_for(victim.recv(), T))["type"] == "pong"
    finally:
        for ws in hogs + more:
            await ws.close()


def test_jwt_length_limit_is_16k_and_named(jwt_srv: tuple[ServeProcess, str]) -> None:
    srv, secret = jwt_srv
    groups = [f"group-{i:05d}" for i in range(700)]  # a JWT of ~13,000 characters
    big = _jwt(secret, "many-groups", groups=groups)
    assert 8192 < len(big) <= 16384
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {big}"}, timeout=T)
    assert r.status_code == 200, r.text

    async def hello_with_big() -> object:
        async with websockets.connect(_ws_url(srv), open_timeout=T) as ws:
            return (await _hello(ws, big))["type"]

    assert asyncio.run(hello_with_big()) == "welcome"

    huge = _jwt(secret, "too-many-groups", groups=groups * 2)
    assert len(huge) > 16384
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {huge}"}, timeout=T)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["code"] == "invalid_token", error
    assert "16384" in error["message"] and "malformed" not in error["message"], error


def test_jwt_exp_of_the_wrong_type_is_an_invalid_claim(jwt_srv: tuple[ServeProcess, str]) -> None:
    srv, secret = jwt_srv
    for exp in (True, "1"):
        token = jwt.encode({"sub": "odd", "exp": exp}, secret, algorithm="HS256")
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=T)
        assert r.status_code == 401
        error = r.json()["error"]
        assert error["code"] == "invalid_token", (exp, error)
        assert "exp" in error["message"] and "expired" not in error["message"], (exp, error)
    expired = jwt.encode({"sub": "old", "exp": int(time.time()) - 3600}, secret, algorithm="HS256")
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {expired}"}, timeout=T)
    assert r.status_code == 401 and r.json()["error"]["code"] == "token_expired"
