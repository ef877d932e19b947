"""Issue 4 acceptance checks through a real `appserver serve` subprocess.

tests/test_security_guard.py proves the guard's rules around a tiny app; here the same rules are
checked where they matter: the real app (OpenAI routes, the /ws protocol, the CLI-made tokens and
config.toml), started as `appserver serve`. Checks 1, 2/5/6 (compact), 4, 8 and 10.
"""

from __future__ import annotations

import asyncio
import base64
import math
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jwt
import openai
import pytest
from websockets.exceptions import ConnectionClosed

from appserver.auth import TokenStore, fingerprint
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0  # every wait here is bounded
EVIL = "https://evil.example"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def serve_output(sp: ServeProcess) -> str:
    """Stop the server (exit 0 expected) and return everything it wrote to stdout and stderr."""
    assert sp.stop() == 0
    assert sp.proc.stdout is not None and sp.proc.stderr is not None
    return sp.proc.stdout.read() + sp.proc.stderr.read()


def create_token(home: Path, *args: str) -> str:
    """`appserver token create … --json` as a user would run it; returns the plaintext."""
    r = run_cli(home, "token", "create", *args, "--json")
    assert r.code == 0, r.err
    return str(r.json()["token"])


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ── check 1: a non-loopback bind needs auth ───────────────────────────────────────────────────


def test_wildcard_bind_needs_auth(home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    r = run_cli(home, "serve", "--listen", f"0.0.0.0:{free}", timeout=T)
    assert r.code != 0
    assert "refusing to listen on 0.0.0.0" in r.err
    for flag in (f"--listen 127.0.0.1:{free}", "--auth token", "--auth jwt"):
        assert flag in r.err, flag

    token = create_token(home, "--name", "net")
    sp = start_serve(home, "--listen", "0.0.0.0:0", "--auth", "token")
    try:
        assert sp.url.startswith("http://0.0.0.0:")
        base = f"http://127.0.0.1:{port_of(sp.url)}"
        with httpx.Client(base_url=base, timeout=T) as c:
            assert c.get("/healthz").json() == {"status": "ok"}
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers=bearer(token)).status_code == 200
    finally:
        out = serve_output(sp)
    assert token not in out


# ── a token-mode server with agents a and b ───────────────────────────────────────────────────


@dataclass
class TokenServer:
    sp: ServeProcess
    scoped: str  # agents=a, scopes=openai,ws (made with the CLI)
    full: str  # every agent, scopes openai,ws,admin
    http_only: str  # scopes=openai
    conv_a: str
    conv_b: str

    @property
    def url(self) -> str:
        return self.sp.url


async def _create_conversation(url: str, token: str, agent: str) -> str:
    ws = await WS.open(url, headers=bearer(token), open_timeout=T)
    try:
        reply = await ws.request({"type": "create_conversation", "agent": agent}, T)
        assert reply["type"] == "conversation_state", reply
        return str(reply["conversation"]["id"])
    finally:
        await ws.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenServer]:
    home = tmp_path_factory.mktemp("sec_e2e") / "home"
    env = cli_env(home)
    for name in ("a", "b"):
        r = run_cli(home, "agents", "create", "--name", name, "--json", env=env)
        assert r.code == 0, r.err
    scoped = create_token(home, "--name", "scoped", "--agents", "a", "--scopes", "openai,ws")
    store = TokenStore(home)
    full = store.create(name="full", scopes="openai,ws,admin")[1]
    http_only = store.create(name="http-only", scopes="openai")[1]
    sp = start_serve(home, "--auth", "token", env=env)
    try:
        conv_a = asyncio.run(_create_conversation(sp.url, full, "a"))
        conv_b = asyncio.run(_create_conversation(sp.url, full, "b"))
        yield TokenServer(sp, scoped, full, http_only, conv_a, conv_b)
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(T)


# ── checks 2, 5, 6 (and coarse scopes) through the real app ───────────────────────────────────

WS_UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(),
    "Sec-WebSocket-Version": "13",
}

# (id, method, path, credential, extra headers, expected status, expected error code)
# credential: a TokenServer attribute name, a literal bearer value, or None; `{full}` in the path
# is replaced by the full token. One case per rule, through the real app; the variants (Basic,
# duplicate headers, preflight, allowed origins, Host allow-lists) are in test_security_guard.py.
REFUSALS = [
    ("no-header", "GET", "/v1/models", None, {}, 401, "missing_api_key"),
    ("wrong-token", "GET", "/v1/models", "aps_not_a_real_token", {}, 401, "invalid_api_key"),
    ("token-in-query", "GET", "/v1/models?token={full}", None, {}, 401, "credentials_in_url"),
    ("query-and-header", "GET", "/v1/models?api_key={full}", "full", {}, 401, "credentials_in_url"),
    # `;` separates parameters for many proxies and frameworks (parse_qsl splits on `&` only)
    ("token-after-semicolon", "GET", "/v1/models?x=1;token={full}", "full", {}, 401, "credentials_in_url"),
    ("origin-get", "GET", "/v1/models", "full", {"Origin": EVIL}, 403, "origin_not_allowed"),
    (
        "origin-post",
        "POST",
        "/v1/chat/completions",
        "full",
        {"Origin": EVIL},
        403,
        "origin_not_allowed",
    ),
    ("host", "GET", "/v1/models", "full", {"Host": "attacker.example"}, 421, "host_not_allowed"),
    ("admin-scope", "GET", "/admin/agents", "scoped", {}, 403, "insufficient_scope"),
    # server-wide counts (every tenant's turns and requests) are the operator's
    ("metrics-scope", "GET", "/metrics", "scoped", {}, 403, "insufficient_scope"),
    ("ws-token-in-query", "GET", "/ws?token={full}", None, WS_UPGRADE, 401, "credentials_in_url"),
    ("ws-origin", "GET", "/ws", "full", {**WS_UPGRADE, "Origin": EVIL}, 403, "origin_not_allowed"),
    (
        "ws-host",
        "GET",
        "/ws",
        "full",
        {**WS_UPGRADE, "Host": "attacker.example"},
        421,
        "host_not_allowed",
    ),
    ("ws-scope", "GET", "/ws", "http_only", WS_UPGRADE, 403, "insufficient_scope"),
    ("ws-wrong-token", "GET", "/ws", "aps_not_a_real_token", WS_UPGRADE, 401, "invalid_api_key"),
]


@pytest.mark.parametrize(
    ("method", "path", "cred", "headers", "status", "code"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_refusals(
    srv: TokenServer,
    method: str,
    path: str,
    cred: str | None,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    h = dict(headers)
    if cred is not None:
        h.update(bearer(getattr(srv, cred, cred)))
    with httpx.Client(base_url=srv.url, timeout=T) as c:
        r = c.request(method, path.replace("{full}", srv.full), headers=h)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["message"]
        # the refusal was about that request: the server keeps serving a proper one
        assert c.get("/v1/models", headers=bearer(srv.full)).status_code == 200


def test_loopback_hosts_and_right_token_are_served(srv: TokenServer) -> None:
    port = port_of(srv.url)
    with httpx.Client(base_url=srv.url, timeout=T) as c:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            r = c.get("/v1/models", headers={**bearer(srv.full), "Host": host})
            assert r.status_code == 200, host
        # an admin-scoped credential passes the guard on /admin (no such route exists yet: 404)
        assert c.get("/admin/agents", headers=bearer(srv.full)).status_code != 403
        metrics = c.get("/metrics", headers=bearer(srv.full))
        assert metrics.status_code == 200 and "appserver_turns_total" in metrics.text


# ── check 4: a token scoped to agent a ────────────────────────────────────────────────────────


def test_scoped_token_openai_sdk(srv: TokenServer) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.scoped, max_retries=0, timeout=T)
    assert [m.id for m in client.models.list()] == ["a"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("b")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    # agent a's chat works, but not inside b's conversation
    done = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}])
    assert done.choices[0].message.content == "echo: hi"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Conversation-Id": srv.conv_b},
        )
    assert info.value.code == "conversation_not_found"
    # the unrestricted token sees both (the filter is the token's, not a missing agent)
    full = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.full, max_retries=0, timeout=T)
    assert {"a", "b"} <= {m.id for m in full.models.list()}


async def test_an_admin_limited_to_some_agents_cannot_list_or_decide_pairings(srv: TokenServer) -> None:
    """A pairing lets a chat sender reach every agent its channel account routes to: an admin token
    limited with `--agents` approved a stranger onto an agent it may not use (found by an outside
    test). Both pairing frames need an admin credential for every agent."""
    limited = TokenStore(srv.sp.home).create(name="admin-of-a", scopes="admin,ws", agents="a")[1]
    ws = await WS.open(srv.url, headers=bearer(limited), open_timeout=T)
    try:
        for frame in ({"type": "pairing_list"}, {"type": "pairing_decide", "code": "ABCDEFGH", "decision": "approve"}):
            reply = await ws.request(frame, T)
            assert reply["type"] == "error" and reply["code"] == "forbidden", (frame, reply)
            assert "every agent" in reply["message"], reply
    finally:
        await ws.close()
    ws = await WS.open(srv.url, headers=bearer(srv.full), open_timeout=T)
    try:  # an admin for every agent is let through (no channels here: an empty list)
        listed = await ws.request({"type": "pairing_list"}, T)
        assert listed["type"] == "ack" and listed["results"] == [], listed
    finally:
        await ws.close()


async def test_scoped_token_websocket(srv: TokenServer) -> None:
    ws = await WS.open(srv.url, headers=bearer(srv.scoped), open_timeout=T)
    try:
        agents = await ws.request({"type": "list_agents"}, T)
        assert [a["name"] for a in agents["agents"]] == ["a"]
        mine = await ws.request({"type": "create_conversation", "agent": "a"}, T)
        mine_id = mine["conversation"]["id"]
        convs = await ws.request({"type": "list_conversations"}, T)
        assert srv.conv_b not in {c["id"] for c in convs["conversations"]}
        # its own conversation, not the admin's conversation of agent a (credential namespaces)
        assert mine_id in {c["id"] for c in convs["conversations"]}
        assert srv.conv_a not in {c["id"] for c in convs["conversations"]}
        refused = [
            ({"type": "subscribe", "conversation": srv.conv_b}, "conversation_not_found"),
            ({"type": "subscribe", "conversation": "default", "agent": "b"}, "forbidden"),
            ({"type": "submit_input", "agent": "b", "input": "hi"}, "forbidden"),
            ({"type": "get_history", "conversation": srv.conv_b}, "conversation_not_found"),
            ({"type": "create_conversation", "agent": "b"}, "forbidden"),
            ({"type": "cancel", "conversation": srv.conv_b}, "conversation_not_found"),
            ({"type": "list_conversations", "agent": "b"}, "forbidden"),
        ]
        for frame, code in refused:
            reply = await ws.request(frame, T)
            assert reply["type"] == "error" and reply["code"] == code, (frame, reply)
        # agent management needs `admin` (cron_run: the cron engineer's frame, issue 6)
        reply = await ws.request({"type": "cron_run", "task": "any"}, T)
        assert reply["type"] == "error" and reply["code"] == "forbidden"
        assert "admin" in reply["message"]
        # agent a with b's conversation: the kernel refuses the mismatch
        reply = await ws.request({"type": "submit_input", "agent": "a", "conversation": srv.conv_b, "input": "x"}, T)
        assert reply["type"] == "error" and reply["code"] == "conversation_not_found"
        # the connection survived every refusal and still works for agent a
        state = await ws.request({"type": "subscribe", "conversation": mine_id}, T)
        assert state["type"] == "conversation_state"
        assert state["conversation"]["id"] == mine_id
        assert (await ws.request({"type": "ping"}, T))["type"] == "pong"
    finally:
        await ws.close()


# ── check 10 (token server): the log of everything above holds no token ───────────────────────


def test_token_server_output_has_no_token(srv: TokenServer) -> None:
    """Runs last in this module: it stops the shared server to read what it printed.

    Also sends a revoked token, so the log has a line about a presented token to get wrong.
    """
    rec, revoked = TokenStore(srv.sp.home).create(name="revoked")
    assert run_cli(srv.sp.home, "token", "revoke", rec.id).code == 0
    with httpx.Client(base_url=srv.url, timeout=T) as c:
        assert c.get("/v1/models", headers=bearer(revoked)).status_code == 401
        assert c.get(f"/v1/models?token={srv.scoped}").status_code == 401
    out = serve_output(srv.sp)
    # the rejection was logged, by fingerprint, unless the refusal lines of this module's earlier
    # attacks had used up the 10 of these 10 s: then it is in the count of the rest
    assert fingerprint(revoked) in out or "were not logged" in out
    for tok in (revoked, srv.scoped, srv.full, srv.http_only):
        assert tok not in out
        assert tok.removeprefix("aps_") not in out


# ── check 8: a WebSocket opened with a JWT is closed when the JWT (plus leeway) expires ───────


LEEWAY_S = 1


@pytest.fixture
def jwt_server(home: Path) -> Iterator[tuple[ServeProcess, bytes]]:
    """`[auth] mode = "jwt"` with an HS256 secret file, as docs/security.md describes it."""
    home.mkdir(parents=True, exist_ok=True)
    secret = base64.b64encode(secrets.token_bytes(36))  # 48 ASCII bytes
    (home / "jwt.secret").write_bytes(secret + b"\n")
    (home / "jwt.secret").chmod(0o600)
    (home / "config.toml").write_text(
        f'[auth]\nmode = "jwt"\njwt_secret_file = "jwt.secret"\njwt_algorithms = ["HS256"]\n'
        f'jwt_audience = "appserver"\njwt_leeway_s = {LEEWAY_S}\n'
    )
    sp = start_serve(home)
    try:
        yield sp, secret
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(T)


async def test_ws_closed_when_jwt_expires(jwt_server: tuple[ServeProcess, bytes]) -> None:
    sp, secret = jwt_server
    key = secret.decode()
    now = time.time()
    lasting = jwt.encode({"sub": "alice", "aud": "appserver", "exp": int(now) + 300}, key, algorithm="HS256")
    exp = math.ceil(now + 2)  # expires in 2-3 s
    short = jwt.encode({"sub": "bob", "aud": "appserver", "exp": exp}, key, algorithm="HS256")
    async with httpx.AsyncClient(base_url=sp.url, timeout=T) as c:
        assert (await c.get("/v1/models", headers=bearer(lasting))).status_code == 200
        r = await c.get("/v1/models", headers=bearer(short + "x"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"

    ws = await WS.open(sp.url, headers=bearer(short), open_timeout=T)
    try:
        assert (await ws.request({"type": "list_agents"}, T))["type"] == "agents"
        # past exp but within the leeway: still served (a new request would be accepted too)
        await asyncio.sleep(max(0.0, exp + 0.2 - time.time()))
        assert (await ws.request({"type": "ping"}, T))["type"] == "pong"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv(exp + LEEWAY_S + 3 - time.time())
        closed_at = time.time()
    finally:
        await ws.close()
    rcvd = closed.value.rcvd
    assert rcvd is not None, "the server closed without a close frame"
    assert rcvd.code == 4401 and rcvd.reason == "credential expired"
    assert exp + LEEWAY_S - 0.3 <= closed_at < exp + LEEWAY_S + 2

    out = serve_output(sp)
    assert "closing websocket 4401: credential expired" in out
    for s in (key, lasting, short):
        assert s not in out
