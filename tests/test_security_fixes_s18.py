"""Security fixes of round 18, each through a real `appserver serve` (sockets, files, subprocesses):

* F1: an approval given after the operator switched the tool to `deny` does not run the call (the
  policy of the agent NOW decides, not the one the call was asked under); a switch to `allow`
  while the call waits still lets the approval run it.
* F2: the channel gateway's token names (`gateway`, `gateway@…`) are reserved: `token create`
  refuses them; a token of that name an older appserver made cannot reach the gateway's
  conversations; `serve --channels` never revokes it without a word.
* F3: what an upstream echoes in an error (the API key it was sent, a `base_url` query secret)
  never reaches the client or the stored turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import channel_server, write_config
from tests.support.net import free_port
from tests.support.serve import ServeProcess, serving
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

T = 15.0


def shell_call(marker: Path) -> str:
    return "/call shell " + json.dumps({"command": f"touch {marker}"})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def create_token(home: Path, *args: str) -> str:
    r = run_cli(home, "token", "create", *args, "--json")
    assert r.code == 0, r.err
    return str(r.json()["token"])


def tokens_json(home: Path) -> list[dict[str, Any]]:
    data = json.loads((home / "auth" / "tokens.json").read_text())
    return list(data["tokens"])


def add_token_as_an_older_appserver_did(home: Path, name: str, scopes: list[str], agents: list[str] | None) -> str:
    """A token entry written the way an appserver before the reservation wrote one (`tok_…` id,
    any name): what `token create --name gateway` used to leave in tokens.json."""
    plaintext = "aps_" + hashlib.sha256(f"older-{name}-{time.time_ns()}".encode()).hexdigest()[:43]
    path = home / "auth" / "tokens.json"
    data = json.loads(path.read_text()) if path.exists() else {"version": 1, "tokens": []}
    data["tokens"].append(
        {
            "id": "tok_" + hashlib.sha256(plaintext.encode()).hexdigest()[:12],
            "name": name,
            "hash": hashlib.sha256(plaintext.encode()).hexdigest(),
            "agents": agents,
            "scopes": scopes,
            "created_at": time.time(),
            "expires_at": None,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    return plaintext


# ── F1: the policy of now decides whether an approved call runs ───────────────────────────────


@dataclass
class AskServer:
    sp: ServeProcess
    home: Path
    token: str

    @property
    def url(self) -> str:
        return self.sp.url

    def set_shell(self, policy: str) -> None:
        r = run_cli(self.home, "agents", "update", "alpha", "--tool", f"shell={policy}")
        assert r.code == 0, r.err


@pytest.fixture(scope="module")
def ask_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AskServer]:
    home = tmp_path_factory.mktemp("s18_policy") / "home"
    env = cli_env(home)
    r = run_cli(home, "agents", "create", "--name", "alpha", "--tool", "shell=ask", env=env)
    assert r.code == 0, r.err
    token = create_token(home, "--name", "ta", "--agents", "alpha", "--scopes", "openai,ws")
    with serving(home, "--auth", "token", env=env) as sp:
        yield AskServer(sp, home, token)


async def _ask_then(srv: AskServer, marker: Path, policy_meanwhile: str) -> dict[str, Any]:
    """A shell call under `ask`; the operator sets `policy_meanwhile`; the client approves.
    Returns the turn's terminal snapshot."""
    ws = await WS.open(srv.url, headers=bearer(srv.token), open_timeout=T)
    try:
        conv = (await ws.request({"type": "create_conversation", "agent": "alpha"}))["conversation"]["id"]
        ack = await ws.request(
            {
                "type": "submit_input",
                "agent": "alpha",
                "conversation": conv,
                "input": shell_call(marker),
            }
        )
        assert ack["type"] == "ack", ack
        req = await ws.expect(lambda f: f["type"] == "approval_request", T)
        await asyncio.to_thread(srv.set_shell, policy_meanwhile)
        answer = await ws.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": req["call_id"], "decision": "approve"}],
            }
        )
        assert answer["results"][0]["accepted"] is True, answer
        return await ws.terminal(ack["turn_id"], T)
    finally:
        await ws.close()
        await asyncio.to_thread(srv.set_shell, "ask")


def test_approval_after_switch_to_deny_is_refused_over_websocket(ask_server: AskServer, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    snap = asyncio.run(_ask_then(ask_server, marker, "deny"))
    time.sleep(0.3)
    assert not marker.exists(), "the approved call ran although the tool's policy is now deny"
    assert snap["status"] == "completed", snap
    text = json.dumps(snap["blocks"])
    assert "the agent's policy denies this tool" in text, text


def test_approval_after_switch_to_allow_still_runs(ask_server: AskServer, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    snap = asyncio.run(_ask_then(ask_server, marker, "allow"))
    assert snap["status"] == "completed", snap
    wait_for(marker.exists, timeout=10, what="the approved shell call")


def test_approval_after_switch_to_deny_is_refused_over_http_responses(ask_server: AskServer, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    url = ask_server.url + "/v1/responses"
    headers = bearer(ask_server.token)
    try:
        first = httpx.post(
            url,
            headers=headers,
            json={"model": "alpha", "input": shell_call(marker)},
            timeout=T,
        )
        assert first.status_code == 200, first.text
        request = first.json()["output"][0]
        assert request["type"] == "mcp_approval_request", first.json()
        ask_server.set_shell("deny")
        second = httpx.post(
            url,
            headers=headers,
            json={
                "model": "alpha",
                "previous_response_id": first.json()["id"],
                "input": [{"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}],
            },
            timeout=T,
        )
        assert second.status_code == 200, second.text
        time.sleep(0.3)
        assert not marker.exists(), "the approved call ran although the tool's policy is now deny"
        assert "the agent's policy denies this tool" in second.text, second.text
    finally:
        ask_server.set_shell("ask")


# ── F2: the gateway's token names are its own ─────────────────────────────────────────────────


@pytest.mark.parametrize("name", ["gateway", "gateway@host-0123456789", " gateway "])
def test_token_create_refuses_the_gateways_names(tmp_path: Path, name: str) -> None:
    home = tmp_path / "home"
    r = run_cli(home, "token", "create", "--name", name)
    assert r.code == 2, (r.code, r.out, r.err)
    assert "reserved for the channel gateway" in r.err, r.err
    assert "aps_" not in r.out
    assert not (home / "auth" / "tokens.json").exists() or tokens_json(home) == []
    # names that only look alike are anyone's
    assert run_cli(home, "token", "create", "--name", "gateway-alice").code == 0
    assert run_cli(home, "token", "create", "--name", "my-gateway").code == 0


def test_an_older_token_named_gateway_does_not_see_the_gateways_conversations(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "alpha", env=env).code == 0
    store = TokenStore(home)
    gw_record, gw_token, _ = store.mint_gateway("gateway")  # what serve gives the gateway child
    assert gw_record.id.startswith("gwt_")
    with serving(home, "--auth", "token", env=env) as sp:

        async def as_gateway() -> str:
            ws = await WS.open(sp.url, headers=bearer(gw_token), open_timeout=T)
            try:
                conv = (await ws.request({"type": "create_conversation", "agent": "alpha"}))["conversation"]["id"]
                ack = await ws.request(
                    {"type": "submit_input", "agent": "alpha", "conversation": conv, "input": "my bank PIN is 4321"}
                )
                await ws.terminal(ack["turn_id"], T)
                return str(conv)
            finally:
                await ws.close()

        conv = asyncio.run(as_gateway())
        # The gateway's credential ends (serve revokes it when the child stops); a token named
        # `gateway` made by an older appserver is in the file.
        store.revoke(gw_record.id)
        older = add_token_as_an_older_appserver_did(home, "gateway", ["openai", "ws"], ["alpha"])

        async def as_older() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
            ws = await WS.open(sp.url, headers=bearer(older), open_timeout=T)
            try:
                listed = await ws.request({"type": "list_conversations", "agent": "alpha"})
                history = await ws.request({"type": "get_history", "conversation": conv})
                submit = await ws.request(
                    {"type": "submit_input", "agent": "alpha", "conversation": conv, "input": "/recall"}
                )
                return [c["id"] for c in listed["conversations"]], history, submit
            finally:
                await ws.close()

        ids, history, submit = asyncio.run(as_older())
        assert conv not in ids
        assert history.get("code") == "conversation_not_found" or history.get("error") == "conversation_not_found", (
            history
        )
        assert "4321" not in json.dumps(history)
        assert "conversation_not_found" in json.dumps(submit), submit
        r = httpx.post(
            sp.url + "/v1/chat/completions",
            headers={**bearer(older), "X-Conversation-Id": conv},
            json={"model": "alpha", "messages": [{"role": "user", "content": "/recall"}]},
            timeout=T,
        )
        assert r.status_code == 404 and "4321" not in r.text, r.text
        # it still works, in a namespace of its own
        mine = httpx.post(
            sp.url + "/v1/chat/completions",
            headers=bearer(older),
            json={"model": "alpha", "messages": [{"role": "user", "content": "hello"}]},
            timeout=T,
        )
        assert mine.status_code == 200, mine.text


def _webhook_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    settings = {"listen": f"127.0.0.1:{free_port()}", "secret_env": "WH_SECRET", "default_agent": "assistant"}
    write_config(home, {"webhook": {"main": settings}}, ["webhook"])
    with (home / "config.toml").open("a") as f:
        f.write('\n[auth]\nmode = "token"\n')
    return home, cli_env(home, WH_SECRET="s3cret-for-tests-0123")


def test_serve_with_channels_never_revokes_a_users_token_named_gateway(tmp_path: Path) -> None:
    home, env = _webhook_home(tmp_path)
    older = add_token_as_an_older_appserver_did(home, "gateway", ["openai", "ws"], ["assistant"])
    before = tokens_json(home)
    with channel_server(home, env=env, ready=False) as srv:
        wait_for(lambda: srv.channels_check()["status"] == "fail" and "reserved" in str(srv.channels_check()), 20)
        assert "revoke it" in srv.channels_check().get("detail", ""), srv.channels_check()
        assert tokens_json(home) == before  # not revoked, nothing minted in its place
        assert "reserved for the channel gateway" in srv.log()
        r = httpx.get(srv.url + "/v1/models", headers=bearer(older), timeout=T)
        assert r.status_code == 200, r.text  # it keeps working


def test_serve_with_channels_replaces_an_older_gateways_leftover_credential(tmp_path: Path) -> None:
    home, env = _webhook_home(tmp_path)
    add_token_as_an_older_appserver_did(home, "gateway", ["ws"], None)  # what an older, killed server left
    (left,) = tokens_json(home)
    with channel_server(home, env=env) as srv:
        now = [t for t in tokens_json(home) if t["name"] == "gateway"]
        assert len(now) == 1 and now[0]["id"].startswith("gwt_") and now[0]["id"] != left["id"], now
        assert left["id"] in srv.log()  # said so, naming the token it revoked
        srv.stop()
    assert [t for t in tokens_json(home) if t["name"] == "gateway"] == []


# ── F3: upstream error text is redacted before clients and the store see it ───────────────────

UP_KEY = "sk-server-secret-key-0123456789abcdef"
AN_KEY = "an-server-secret-0123456789"
QUERY_SECRET = "QUERYSECRET0123"


class EchoingUpstream:
    """An upstream that answers 401 quoting what it was sent: its auth headers and its path."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                said = (
                    f"Incorrect API key provided: {self.headers.get('authorization', '')} "
                    f"{self.headers.get('x-api-key', '')} path={self.path}"
                )
                if "/messages" in self.path:
                    body = {"type": "error", "error": {"type": "authentication_error", "message": said}}
                else:
                    body = {"error": {"message": said, "type": "invalid_request_error"}}
                data = json.dumps(body).encode()
                self.send_response(401)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("agent", ["up", "an"])
def test_upstream_error_echoing_secrets_is_redacted(tmp_path: Path, agent: str) -> None:
    upstream = EchoingUpstream()
    try:
        home = tmp_path / "home"
        home.mkdir()
        base = f"http://127.0.0.1:{upstream.port}"
        (home / "config.toml").write_text(
            f"""
[auth]
mode = "token"
[providers.up]
kind = "openai"
base_url = "{base}/v1?api-key={QUERY_SECRET}"
api_key_env = "S18_UP_KEY"
[providers.an]
kind = "anthropic"
base_url = "{base}"
api_key_env = "S18_AN_KEY"
"""
        )
        env = cli_env(home, S18_UP_KEY=UP_KEY, S18_AN_KEY=AN_KEY)
        model = {"up": "up:gpt-4o", "an": "an:claude-x"}[agent]
        assert run_cli(home, "agents", "create", "--name", agent, "--model", model, env=env).code == 0
        token = create_token(home, "--name", "client", "--agents", agent)
        with serving(home, env=env) as sp:
            r = httpx.post(
                sp.url + "/v1/chat/completions",
                headers=bearer(token),
                json={"model": agent, "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert r.status_code >= 400, r.text
            assert "Incorrect API key provided" in r.text, r.text  # the upstream's words still reach it
            assert "[redacted" in r.text, r.text
            for secret in (UP_KEY, AN_KEY, QUERY_SECRET):
                assert secret not in r.text, r.text

            async def over_ws() -> dict[str, Any]:
                ws = await WS.open(sp.url, headers=bearer(token), open_timeout=T)
                try:
                    ack = await ws.request({"type": "submit_input", "agent": agent, "input": "hi"})
                    return await ws.terminal(ack["turn_id"], 30)
                finally:
                    await ws.close()

            snap = asyncio.run(over_ws())
            assert snap["status"] == "failed", snap
            for secret in (UP_KEY, AN_KEY, QUERY_SECRET):
                assert secret not in json.dumps(snap)
        with sqlite3.connect(home / "appserver.db") as db:
            errors = [row[0] for row in db.execute("SELECT error FROM turns WHERE error IS NOT NULL")]
        assert errors and all("[redacted" in e for e in errors), errors
        for secret in (UP_KEY, AN_KEY, QUERY_SECRET):
            assert not [e for e in errors if secret in e], errors
    finally:
        upstream.close()
