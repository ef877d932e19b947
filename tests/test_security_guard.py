"""SecurityGuard around a tiny Starlette app, served by a real uvicorn on loopback (issue 4)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from appserver.auth import Authenticator, AuthError, TokenStore, fingerprint
from appserver.config import Config
from appserver.logredact import SecretRedactor
from appserver.security import SecurityGuard
from tests.fakes.loopback import QuickServer
from tests.support.certs import self_signed

T = 5.0  # every wait in these tests is bounded


# ── the app under the guard ───────────────────────────────────────────────────────────────────


async def models(request: Request) -> JSONResponse:
    p = request.state.principal
    return JSONResponse({"object": "list", "data": [], "subject": p.subject})


async def chat(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"received": len(body)})


async def healthz(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def ws_endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    if websocket.state.auth_pending:
        try:
            hello = json.loads(await websocket.receive_text())
            websocket.state.authenticate_hello(hello.get("token"))
        except AuthError as exc:
            await websocket.send_json({"type": "error", "code": exc.code})
            await websocket.close(4401, exc.code)
            return
        except WebSocketDisconnect:
            return
    await websocket.send_json({"type": "welcome", "subject": websocket.state.principal.subject})
    try:
        while True:
            await websocket.send_text(await websocket.receive_text())
    except WebSocketDisconnect:
        pass


def make_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/healthz", healthz),
            WebSocketRoute("/ws", ws_endpoint),
        ]
    )


def make_config(home: Path, mode: str = "token", **server: Any) -> Config:
    cfg = Config(home=home)
    cfg.auth.mode = mode
    cfg.limits.body_max_bytes = 1024
    cfg.limits.ws_frame_max_bytes = 1024
    for k, v in server.items():
        setattr(cfg.server, k, v)
    return cfg


def guarded(cfg: Config, authenticator: Authenticator | None = None) -> SecurityGuard:
    return SecurityGuard(make_app(), cfg, authenticator or Authenticator(cfg))


# ── a real uvicorn in a thread ────────────────────────────────────────────────────────────────


@contextmanager
def live_server(app: Any, host: str = "127.0.0.1", **kwargs: Any) -> Iterator[int]:
    """Serve `app` with uvicorn on an ephemeral port (the socket is bound here: no race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=2,
        **kwargs,
    )
    server = QuickServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["param"] is None
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture
def token_env(tmp_path: Path) -> Iterator[tuple[int, str, Config]]:
    cfg = make_config(tmp_path)
    _, tok = TokenStore(tmp_path).create(name="full", scopes="openai,ws,admin")
    with live_server(guarded(cfg)) as port:
        yield port, tok, cfg


def url(port: int, path: str = "/v1/models") -> str:
    return f"http://127.0.0.1:{port}{path}"


# ── check 2: capability tokens ────────────────────────────────────────────────────────────────


def test_token_auth_http(token_env: tuple[int, str, Config]) -> None:
    port, tok, cfg = token_env
    with httpx.Client(timeout=T) as c:
        r = c.get(url(port))
        assert_openai_error(r, 401, "missing_api_key")
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert_openai_error(c.get(url(port), headers={"Authorization": "Bearer aps_wrongwrongwrong"}), 401)
        assert_openai_error(c.get(url(port), headers={"Authorization": f"Basic {tok}"}), 401)
        ok = c.get(url(port), headers={"Authorization": f"Bearer {tok}"})
        assert ok.status_code == 200 and ok.json()["subject"] == "token:full"
        for param in ("token", "access_token", "api_key"):
            r = c.get(url(port) + f"?{param}={tok}")
            assert_openai_error(r, 401, "credentials_in_url")
            # even together with a valid header: the URL credential is already leaked
            r = c.get(url(port) + f"?{param}={tok}", headers={"Authorization": f"Bearer {tok}"})
            assert_openai_error(r, 401, "credentials_in_url")
        assert c.get(url(port, "/healthz")).status_code == 200  # public path
        assert c.get(url(port, "/readyz")).status_code == 404  # public but unknown here: no 401
        assert_openai_error(c.get(url(port, "/other")), 401)  # unknown routes are covered too


def test_token_scopes_expiry_and_revocation(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    store = TokenStore(tmp_path)
    _, ws_only = store.create(name="wsonly", scopes="ws")
    _, short = store.create(name="short", expires=1.0)
    rec, doomed = store.create(name="doomed")
    with live_server(guarded(cfg)) as port, httpx.Client(timeout=T) as c:
        assert_openai_error(
            c.get(url(port), headers={"Authorization": f"Bearer {ws_only}"}),
            403,
            "insufficient_scope",
        )
        assert c.get(url(port), headers={"Authorization": f"Bearer {doomed}"}).status_code == 200
        store.revoke(rec.id)
        assert_openai_error(c.get(url(port), headers={"Authorization": f"Bearer {doomed}"}), 401)
        time.sleep(1.1)
        assert_openai_error(c.get(url(port), headers={"Authorization": f"Bearer {short}"}), 401)


async def test_token_auth_websocket(token_env: tuple[int, str, Config]) -> None:
    port, tok, _ = token_env
    ws_url = f"ws://127.0.0.1:{port}/ws"
    # header at upgrade
    async with ws_connect(ws_url, additional_headers={"Authorization": f"Bearer {tok}"}, open_timeout=T) as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), T))["type"] == "welcome"
        await ws.send("ping")
        assert await asyncio.wait_for(ws.recv(), T) == "ping"
    # wrong header: refused at the handshake with a real HTTP status
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(ws_url, additional_headers={"Authorization": "Bearer nope-nope-nope"}, open_timeout=T):
            pass
    assert info.value.response.status_code == 401
    assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"
    # token in the URL: refused
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(ws_url + f"?token={tok}", open_timeout=T):
            pass
    assert info.value.response.status_code == 401
    # no header: token in hello
    async with ws_connect(ws_url, open_timeout=T) as ws:
        await ws.send(json.dumps({"type": "hello", "token": tok}))
        assert json.loads(await asyncio.wait_for(ws.recv(), T))["type"] == "welcome"
    # no header, bad hello: error frame and close
    async with ws_connect(ws_url, open_timeout=T) as ws:
        await ws.send(json.dumps({"type": "hello", "token": "aps_bad_bad_bad"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), T))["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), T)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


async def test_ws_hello_timeout_and_frame_limit(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    _, tok = TokenStore(tmp_path).create(name="t")
    auth = Authenticator(cfg)
    auth.hello_timeout_s = 0.5
    with live_server(guarded(cfg, auth)) as port:
        async with ws_connect(f"ws://127.0.0.1:{port}/ws", open_timeout=T) as ws:
            started = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), T)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
            assert "authentication timeout" in closed.value.rcvd.reason
            assert time.monotonic() - started < 3
        headers = {"Authorization": f"Bearer {tok}"}
        async with ws_connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers, open_timeout=T) as ws:
            await asyncio.wait_for(ws.recv(), T)  # welcome
            await ws.send("x" * 2000)  # > ws_frame_max_bytes (1024)
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), T)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_auth_none_mode_gives_local_principal(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, mode="none")
    with live_server(guarded(cfg)) as port, httpx.Client(timeout=T) as c:
        r = c.get(url(port))
        assert r.status_code == 200 and r.json()["subject"] == "local"


def test_auth_none_refuses_non_loopback_listen(tmp_path: Path) -> None:
    from appserver.config import ConfigError

    cfg = make_config(tmp_path, mode="none", listen="0.0.0.0:8770")
    with pytest.raises(ConfigError, match="--listen"):
        guarded(cfg)


# ── body limit ────────────────────────────────────────────────────────────────────────────────


def test_body_limit(token_env: tuple[int, str, Config]) -> None:
    port, tok, _ = token_env
    h = {"Authorization": f"Bearer {tok}"}
    with httpx.Client(timeout=T) as c:
        r = c.post(url(port, "/v1/chat/completions"), headers=h, content=b"x" * 1000)
        assert r.status_code == 200 and r.json() == {"received": 1000}
        assert_openai_error(
            c.post(url(port, "/v1/chat/completions"), headers=h, content=b"x" * 5000),
            413,
            "request_too_large",
        )

    def chunks() -> Iterator[bytes]:
        for _ in range(3):
            yield b"y" * 600

    with httpx.Client(timeout=T) as c:  # chunked: no Content-Length, the stream trips the limit
        r = c.post(url(port, "/v1/chat/completions"), headers=h, content=chunks())
        assert_openai_error(r, 413, "request_too_large")
    with httpx.Client(timeout=T) as c:
        assert c.get(url(port, "/healthz")).status_code == 200


# ── check 5: Origin ───────────────────────────────────────────────────────────────────────────


async def test_origin_refused_and_allowed(tmp_path: Path) -> None:
    _, tok = TokenStore(tmp_path).create(name="t")
    h = {"Authorization": f"Bearer {tok}", "Origin": "https://evil.example"}
    auth_only = {"Authorization": f"Bearer {tok}"}
    with live_server(guarded(make_config(tmp_path))) as port:
        async with httpx.AsyncClient(timeout=T) as c:
            assert_openai_error(await c.get(url(port), headers=h), 403, "origin_not_allowed")
            r = await c.post(url(port, "/v1/chat/completions"), headers=h, content=b"{}")
            assert_openai_error(r, 403, "origin_not_allowed")
            assert_openai_error(await c.get(url(port, "/healthz"), headers=h), 403)
            assert_openai_error(await c.get(url(port), headers={**h, "Origin": "null"}), 403)
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(
                f"ws://127.0.0.1:{port}/ws",
                origin="https://evil.example",
                additional_headers=auth_only,
                open_timeout=T,
            ):
                pass
        assert info.value.response.status_code == 403

    cfg = make_config(tmp_path, allowed_origins=["https://evil.example"])
    with live_server(guarded(cfg)) as port:
        async with httpx.AsyncClient(timeout=T) as c:
            r = await c.get(url(port), headers=h)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "https://evil.example"
            r = await c.post(url(port, "/v1/chat/completions"), headers=h, content=b"{}")
            assert r.status_code == 200
            pre = await c.options(
                url(port, "/v1/chat/completions"),
                headers={
                    "Origin": "https://evil.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            assert pre.status_code == 204
            assert "authorization" in pre.headers["access-control-allow-headers"]
            other = await c.get(url(port), headers={**h, "Origin": "https://other.example"})
            assert_openai_error(other, 403)
        async with ws_connect(
            f"ws://127.0.0.1:{port}/ws",
            origin="https://evil.example",
            additional_headers=auth_only,
            open_timeout=T,
        ) as ws:
            assert json.loads(await asyncio.wait_for(ws.recv(), T))["type"] == "welcome"


# ── check 6: Host ─────────────────────────────────────────────────────────────────────────────


def raw_request(port: int, data: bytes, host: str = "127.0.0.1", family: int = socket.AF_INET) -> bytes:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(T)
        s.connect((host, port))
        s.sendall(data)
        out = b""
        try:
            while b"\r\n\r\n" not in out:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            pass
        return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


def test_host_header(tmp_path: Path) -> None:
    _, tok = TokenStore(tmp_path).create(name="t")
    h = {"Authorization": f"Bearer {tok}"}
    cfg = make_config(tmp_path, allowed_hosts=["agents.internal", "proxy.example:8443"])
    with live_server(guarded(cfg)) as port, httpx.Client(timeout=T) as c:
        r = c.get(url(port), headers={**h, "Host": "attacker.example"})
        assert_openai_error(r, 421, "host_not_allowed")
        assert_openai_error(c.get(url(port, "/healthz"), headers={"Host": f"attacker.example:{port}"}), 421)
        for good in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            "localhost",
            "agents.internal",
            "proxy.example:8443",
        ):
            assert c.get(url(port), headers={**h, "Host": good}).status_code == 200, good
        assert_openai_error(c.get(url(port), headers={**h, "Host": "proxy.example:9999"}), 421)
        assert_openai_error(c.get(url(port), headers={**h, "Host": "bad host!"}), 400, "invalid_host")
        # the WebSocket upgrade is checked the same way
        handshake = (
            "GET /ws HTTP/1.1\r\nHost: attacker.example\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {tok}\r\n\r\n"
        ).encode()
        assert status_of(raw_request(port, handshake)) == 421


# ── check 7: malformed requests and half-open connections ─────────────────────────────────────


@pytest.mark.parametrize("http_impl", ["httptools", "h11"])
def test_malformed_requests_and_half_open(tmp_path: Path, http_impl: str) -> None:
    cfg = make_config(tmp_path)
    _, tok = TokenStore(tmp_path).create(name="t")
    with live_server(guarded(cfg), http=http_impl) as port, httpx.Client(timeout=T) as c:
        healthz = url(port, "/healthz")
        bad = [
            b"GARBAGE\r\n\r\n",
            b"GET / HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nThisHeaderHasNoColon\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: \xff\xfe\xfd\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xe9\xe9\xe9\r\n\r\n",
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: \xff\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
            b"GET /%ff%00?\xff=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        ]
        for data in bad:
            raw = raw_request(port, data)
            assert status_of(raw) == 400, (data, raw[:200])
            assert c.get(healthz).status_code == 200
        tls_hello = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64  # TLS on plain HTTP
        assert status_of(raw_request(port, tls_hello)) in (0, 400)
        assert c.get(healthz).status_code == 200
        # an authenticated request with a malformed token value
        assert (
            status_of(
                raw_request(
                    port,
                    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer a b c\r\n\r\n",
                )
            )
            == 401
        )

        socks: list[socket.socket] = []
        try:
            for i in range(200):
                s = socket.create_connection(("127.0.0.1", port), timeout=T)
                if i % 2:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
                socks.append(s)
                if i % 50 == 0:
                    assert c.get(healthz).status_code == 200
            for _ in range(5):
                assert c.get(healthz).status_code == 200
            r = c.get(url(port), headers={"Authorization": f"Bearer {tok}"})
            assert r.status_code == 200
        finally:
            for s in socks:
                s.close()


# ── check 9: IPv6 loopback and TLS ────────────────────────────────────────────────────────────


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_loopback_listen(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, mode="none", listen="[::1]:8770")
    with live_server(guarded(cfg), host="::1") as port, httpx.Client(timeout=T) as c:
        assert c.get(f"http://[::1]:{port}/healthz").text == "ok"
        assert c.get(f"http://[::1]:{port}/v1/models").json()["subject"] == "local"
        r = c.get(f"http://[::1]:{port}/v1/models", headers={"Host": "attacker.example"})
        assert r.status_code == 421


def test_tls_listen(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    cfg = make_config(tmp_path, tls_cert=str(cert), tls_key=str(key))
    _, tok = TokenStore(tmp_path).create(name="t")
    with live_server(guarded(cfg), ssl_certfile=str(cert), ssl_keyfile=str(key)) as port:
        ctx = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(timeout=T, verify=ctx) as c:
            assert c.get(f"https://127.0.0.1:{port}/healthz").text == "ok"
            assert c.get(f"https://localhost:{port}/healthz").text == "ok"
            r = c.get(f"https://localhost:{port}/v1/models", headers={"Authorization": f"Bearer {tok}"})
            assert r.status_code == 200
        with httpx.Client(timeout=T) as c, pytest.raises(httpx.ConnectError):
            c.get(f"https://127.0.0.1:{port}/healthz")  # untrusted self-signed cert: refused by default


# ── check 3 (over HTTP) and check 8: JWT ──────────────────────────────────────────────────────


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture
def rsa_env(tmp_path: Path) -> tuple[Config, rsa.RSAPrivateKey]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = tmp_path / "jwt.pub.pem"
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    cfg = make_config(tmp_path, mode="jwt")
    cfg.auth.jwt_algorithms = ["RS256"]
    cfg.auth.jwt_public_key_file = str(pub)
    cfg.auth.jwt_issuer = "https://issuer.example"
    cfg.auth.jwt_audience = "appserver"
    return cfg, key


def test_jwt_over_http(rsa_env: tuple[Config, rsa.RSAPrivateKey]) -> None:
    cfg, key = rsa_env
    now = int(time.time())
    base = {
        "sub": "alice",
        "iss": "https://issuer.example",
        "aud": "appserver",
        "exp": now + 300,
        "iat": now,
    }
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub_pem = Path(cfg.auth.jwt_public_key_file or "").read_bytes()
    signing_input = _b64(b'{"alg":"HS256","typ":"JWT"}') + "." + _b64(json.dumps(base).encode())
    confused = signing_input + "." + _b64(hmac.new(pub_pem, signing_input.encode(), hashlib.sha256).digest())
    none_token = _b64(b'{"alg":"none","typ":"JWT"}') + "." + _b64(json.dumps(base).encode()) + "."
    bad = {
        "expired": jwt.encode({**base, "exp": now - 120}, key, algorithm="RS256"),
        "nbf": jwt.encode({**base, "nbf": now + 300}, key, algorithm="RS256"),
        "aud": jwt.encode({**base, "aud": "someone-else"}, key, algorithm="RS256"),
        "iss": jwt.encode({**base, "iss": "https://evil.example"}, key, algorithm="RS256"),
        "none": none_token,
        "hs256-confusion": confused,
        "other-key": jwt.encode(base, other, algorithm="RS256"),
        "no-exp": jwt.encode({k: v for k, v in base.items() if k != "exp"}, key, algorithm="RS256"),
    }
    with live_server(guarded(cfg)) as port, httpx.Client(timeout=T) as c:
        good = jwt.encode(base, key, algorithm="RS256")
        r = c.get(url(port), headers={"Authorization": f"Bearer {good}"})
        assert r.status_code == 200 and r.json()["subject"] == "jwt:alice"
        for why, tok in bad.items():
            r = c.get(url(port), headers={"Authorization": f"Bearer {tok}"})
            assert r.status_code == 401, why
            assert_openai_error(r, 401)
        scoped = jwt.encode({**base, "scope": "ws"}, key, algorithm="RS256")
        assert_openai_error(
            c.get(url(port), headers={"Authorization": f"Bearer {scoped}"}),
            403,
            "insufficient_scope",
        )


async def test_ws_closed_when_jwt_expires(rsa_env: tuple[Config, rsa.RSAPrivateKey]) -> None:
    cfg, key = rsa_env
    cfg.auth.jwt_leeway_s = 0  # a live socket lasts until exp + leeway (tests/test_security_e2e.py)

    async def expires(port: int, hello: bool) -> None:
        claims = {
            "sub": "bob",
            "iss": "https://issuer.example",
            "aud": "appserver",
            "exp": int(time.time()) + 2,
        }
        tok = jwt.encode(claims, key, algorithm="RS256")
        headers = {} if hello else {"Authorization": f"Bearer {tok}"}
        async with ws_connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers, open_timeout=T) as ws:
            if hello:
                await ws.send(json.dumps({"type": "hello", "token": tok}))
            assert json.loads(await asyncio.wait_for(ws.recv(), T))["subject"] == "jwt:bob"
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await ws.send("still here")
                    await asyncio.wait_for(ws.recv(), T)
                    await asyncio.sleep(0.1)
            closed_at = time.time()
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 4401 and "expired" in closed.value.rcvd.reason
            assert claims["exp"] - 0.5 <= closed_at < claims["exp"] + 2

    with live_server(guarded(cfg)) as port:
        # The header and the hello credential at once, on two sockets: their expiries are waited together.
        await asyncio.gather(expires(port, hello=False), expires(port, hello=True))


# ── check 10: no secret in the log ────────────────────────────────────────────────────────────


def test_log_of_a_run_has_no_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_config(tmp_path)
    _, tok = TokenStore(tmp_path).create(name="t")
    redactor = SecretRedactor()
    caplog.handler.addFilter(redactor)
    caplog.set_level(logging.DEBUG)
    try:
        with live_server(guarded(cfg)) as port, httpx.Client(timeout=T) as c:
            c.get(url(port) + f"?token={tok}")  # lands in uvicorn's access log line
            c.get(url(port), headers={"Authorization": f"Bearer {tok}x"})  # rejected: auth logs it
            c.get(url(port), headers={"Authorization": f"Bearer {tok}"})
            logging.getLogger("appserver.test").warning("client sent Authorization: Bearer %s", tok)
    finally:
        caplog.handler.removeFilter(redactor)
    text = caplog.text
    assert "/v1/models?token=" in text  # the access line was captured...
    assert tok not in text  # ...without the token
    assert fingerprint(tok) in text


# ── direct ASGI calls: cases a real server rarely produces ────────────────────────────────────


async def call_asgi(
    app: Any,
    path: str = "/v1/models",
    headers: list[tuple[bytes, bytes]] | None = None,
    client: str = "127.0.0.1",
) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers if headers is not None else [(b"host", b"127.0.0.1:8770")],
        "client": (client, 50000),
        "server": ("127.0.0.1", 8770),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), T)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start.get("headers") or []), body


async def test_asgi_host_rules_for_non_loopback_binds(tmp_path: Path) -> None:
    _, tok = TokenStore(tmp_path).create(name="t")
    auth = (b"authorization", f"Bearer {tok}".encode())
    specific = guarded(make_config(tmp_path, listen="192.168.1.10:8770"))
    assert (await call_asgi(specific, headers=[(b"host", b"192.168.1.10:8770"), auth]))[0] == 200
    assert (await call_asgi(specific, headers=[(b"host", b"10.9.9.9"), auth]))[0] == 421
    wildcard = guarded(make_config(tmp_path, listen="0.0.0.0:8770"))
    assert (await call_asgi(wildcard, headers=[(b"host", b"10.9.9.9:8770"), auth]))[0] == 200
    assert (await call_asgi(wildcard, headers=[(b"host", b"[fe80::1]:8770"), auth]))[0] == 200
    assert (await call_asgi(wildcard, headers=[(b"host", b"rebind.attacker.example"), auth]))[0] == 421
    assert (await call_asgi(wildcard, headers=[(b"host", b"127.0.0.1"), (b"bad",), auth]))[0] == 400  # type: ignore[list-item]
    anyhost = guarded(make_config(tmp_path, allowed_hosts=["*"]))
    assert (await call_asgi(anyhost, headers=[(b"host", b"whatever.example"), auth]))[0] == 200


async def test_asgi_none_mode_refuses_remote_clients(tmp_path: Path) -> None:
    g = guarded(make_config(tmp_path, mode="none"))
    assert (await call_asgi(g, client="127.0.0.1"))[0] == 200
    assert (await call_asgi(g, client="::1"))[0] == 200
    status, _, body = await call_asgi(g, client="203.0.113.7")
    assert status == 403 and json.loads(body)["error"]["code"] == "loopback_only"
    assert (await call_asgi(g, path="/healthz", client="203.0.113.7"))[0] == 200


async def test_asgi_per_client_concurrency_limit(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.wait_for(release.wait(), T)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    cfg = make_config(tmp_path, mode="none")
    cfg.limits.connections_per_client = 2
    g = SecurityGuard(slow, cfg, Authenticator(cfg))
    first = [asyncio.create_task(call_asgi(g)) for _ in range(2)]
    await asyncio.sleep(0.05)
    status, _, body = await call_asgi(g)
    assert status == 429 and json.loads(body)["error"]["type"] == "rate_limit_error"
    other = asyncio.create_task(call_asgi(g, client="127.0.0.2"))  # another address: its own budget
    await asyncio.sleep(0.05)
    assert not other.done()  # admitted, waiting in the app
    release.set()
    assert [r[0] for r in await asyncio.gather(*first, other)] == [200, 200, 200]
    assert (await call_asgi(g))[0] == 200  # budget returned


async def test_asgi_slots_belong_to_the_credential_and_health_probes_take_none(tmp_path: Path) -> None:
    """On a local server every client has one address: a credential's requests count against
    that credential (was: the address, so one token, or sockets nobody authenticated, could hold
    every slot and lock out the others), and /healthz and /readyz answer however full it is."""
    release = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] not in ("/healthz", "/readyz"):
            await asyncio.wait_for(release.wait(), T)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    cfg = make_config(tmp_path, mode="token")
    cfg.limits.connections_per_client = 2
    store = TokenStore(tmp_path)
    host = (b"host", b"127.0.0.1:8770")
    a = [host, (b"authorization", f"Bearer {store.create(name='a')[1]}".encode())]
    b = [host, (b"authorization", f"Bearer {store.create(name='b')[1]}".encode())]
    g = SecurityGuard(slow, cfg, Authenticator(cfg))
    first = [asyncio.create_task(call_asgi(g, headers=a)) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert (await call_asgi(g, headers=a))[0] == 429  # a's own slots are full
    other = asyncio.create_task(call_asgi(g, headers=b))  # b, from the same address: its own
    await asyncio.sleep(0.05)
    assert not other.done()
    for path in ("/healthz", "/readyz"):
        assert (await call_asgi(g, path=path, headers=a))[0] == 200
    release.set()
    assert [r[0] for r in await asyncio.gather(*first, other)] == [200, 200, 200]


async def test_asgi_lifespan_passes_through(tmp_path: Path) -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    cfg = make_config(tmp_path, mode="none")
    await SecurityGuard(app, cfg, Authenticator(cfg))({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]
