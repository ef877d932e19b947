"""What a client without a valid credential can make a real `appserver serve` log is bounded: made-up
tokens on the API, on `/readyz` and `/healthz` (never refused there), in a WebSocket `hello`, and
sockets that never say hello. Each refusal is one line of the guard's refusal log, only the first
10 of every 10 s are written and the rest counted (docs/security.md): the authenticator wrote a
`rejected capability token` line per request outside that limit, a JWT with an 11,500-character
`alg` one 11.7 KB line per request, and each refused socket a `closing websocket` line besides.
A refused `hello` whose reason holds multi-byte characters is closed with 4401, not 1006 (its
reason was cut to 120 characters, over the 123 bytes a close frame holds).

Raw clients (httpx, websockets) on loopback; the server's log read after it stops.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from appserver.auth import fingerprint
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import ws_url

pytestmark = pytest.mark.timeout(60)

T = 10.0  # every wait here is bounded
PER_INTERVAL, INTERVAL_S = 10, 10.0  # docs/security.md: the first 10 refusals of every 10 s
LINE_MAX = 600  # no line a client can cause is longer (a path or a reason: 120 characters of it)
HTTP_N, PUBLIC_N, HELLO_N, IDLE_N = 100, 20, 30, 30
HELD = re.compile(r"(\d+) more refused request\(s\) were not logged")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt_with_alg(alg: str) -> str:
    return _b64(json.dumps({"alg": alg, "typ": "JWT"}).encode()) + "." + _b64(b'{"sub":"x"}') + ".c2ln"


def _made_up(i: int) -> str:
    return f"aps_{i:040d}"


def _log_after_stop(sp: ServeProcess) -> str:
    assert sp.stop() == 0
    assert sp.proc.stderr is not None and sp.proc.stdout is not None
    return sp.proc.stdout.read() + sp.proc.stderr.read()


def _check_bounded(log: str, events: int, elapsed_s: float) -> list[str]:
    """Every refusal is a shown line or counted; at most PER_INTERVAL shown per interval begun;
    no line longer than LINE_MAX. → the shown lines."""
    lines = log.splitlines()
    long = [line[:200] for line in lines if len(line) > LINE_MAX]
    assert not long, long
    assert "rejected capability token" not in log and "rejected JWT" not in log, log[-3000:]
    assert "closing websocket" not in log, [line for line in lines if "closing websocket" in line][:3]
    shown = [line for line in lines if "refused http" in line or "refused websocket" in line or "ignored the" in line]
    held = sum(int(n) for n in HELD.findall(log))
    assert len(shown) + held == events, (len(shown), held, events)
    intervals = math.floor(elapsed_s / INTERVAL_S) + 1
    assert len(shown) <= PER_INTERVAL * intervals, (len(shown), intervals, shown)
    return shown


async def _hello(url: str, token: str) -> tuple[dict[str, object], int | None, str]:
    """A socket whose hello carries `token`: → (the error frame, the close code, the close reason)."""
    async with websockets.connect(ws_url(url), max_size=None, close_timeout=1) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol": 1, "token": token, "request_id": "h"}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), T))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), T)
    rcvd = closed.value.rcvd
    return frame, (rcvd.code if rcvd else None), (rcvd.reason if rcvd else "")


async def _idle(url: str) -> int | None:
    """A socket that never says hello: → its close code (the hello window is 5 s)."""
    async with websockets.connect(ws_url(url), close_timeout=1) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), T)
    rcvd = closed.value.rcvd
    return rcvd.code if rcvd else None


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp


@pytest.fixture
def jwt_server(tmp_path: Path) -> Iterator[ServeProcess]:
    home = tmp_path / "home"
    home.mkdir(parents=True)
    (home / "jwt.secret").write_bytes(base64.b64encode(secrets.token_bytes(36)) + b"\n")
    (home / "jwt.secret").chmod(0o600)
    (home / "config.toml").write_text(
        '[auth]\nmode = "jwt"\njwt_secret_file = "jwt.secret"\njwt_algorithms = ["HS256"]\n'
    )
    with serving(home, env=cli_env(home)) as sp:
        yield sp


async def test_made_up_tokens_write_a_bounded_log(token_server: ServeProcess) -> None:
    sp = token_server
    started = time.monotonic()
    idle = [asyncio.create_task(_idle(sp.url)) for _ in range(IDLE_N)]
    async with httpx.AsyncClient(base_url=sp.url, timeout=T) as client:
        for i in range(HTTP_N):
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {_made_up(i)}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for i in range(PUBLIC_N):  # a probe is never refused for its credential
            r = await client.get(("/readyz", "/healthz")[i % 2], headers={"Authorization": f"Bearer {_made_up(i)}"})
            assert r.status_code in (200, 503), r.text
    hellos = await asyncio.gather(*(_hello(sp.url, _made_up(1000 + i)) for i in range(HELLO_N)))
    for frame, code, _ in hellos:
        assert frame["type"] == "error" and frame["code"] == "invalid_api_key", frame
        assert code == 4401
    assert await asyncio.gather(*idle) == [4401] * IDLE_N
    elapsed = time.monotonic() - started
    log = _log_after_stop(sp)
    shown = _check_bounded(log, HTTP_N + PUBLIC_N + HELLO_N + IDLE_N, elapsed)
    # what is shown still names the rejected credential, as `token list` would fingerprint it
    assert f"capability token {fingerprint(_made_up(0))}" in shown[0] or any(
        fingerprint(_made_up(i)) in line for line in shown for i in range(HTTP_N)
    ), shown
    assert _made_up(0) not in log


async def test_a_huge_jwt_alg_is_cut_in_answers_and_log_and_a_multibyte_reason_closes_4401(
    jwt_server: ServeProcess,
) -> None:
    sp = jwt_server
    started = time.monotonic()
    huge = _jwt_with_alg("A" * 11500)
    async with httpx.AsyncClient(base_url=sp.url, timeout=T) as client:
        for _ in range(HTTP_N):
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {huge}"})
            assert r.status_code == 401
            message = r.json()["error"]["message"]
            assert len(message) < 200 and "11502 characters" in message, message[:300]
        r = await client.get("/readyz", headers={"Authorization": f"Bearer {huge}"})
        assert r.status_code in (200, 503)
    for alg in ("é" * 300, "A" * 300, "\x1b[31m\n" * 50):
        frame, code, reason = await _hello(sp.url, _jwt_with_alg(alg))
        assert frame["type"] == "error" and frame["code"] == "invalid_token", frame
        assert len(str(frame["message"])) < 200, frame
        assert code == 4401, (alg[:3], code)
        assert reason.startswith("JWT algorithm") and len(reason.encode()) <= 123, reason
    elapsed = time.monotonic() - started
    log = _log_after_stop(sp)
    _check_bounded(log, HTTP_N + 1 + 3, elapsed)
    assert "\x1b" not in log
