"""Issue 14.8-14.10: docs/protocol.md and the server agree on error codes, unknown fields, image
URLs and the texts of errors.

The error code table is read from the document and every code in it is provoked against a real
`appserver serve` (token mode, plus a JWT-mode server for the JWT codes), with real `websockets`
clients; a code the server sends that the table lacks fails too.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
import websockets

from appserver.auth import TokenStore
from appserver.ws import frames as F
from cron.schedule import ScheduleSpec
from cron.store import CronStore, make_task
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 10.0
DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
# Documented, but no real `serve` can be made to send them: a bug, and a server run without the cron
# service (serve always runs it).
NOT_PROVOKABLE = {
    "internal_error": "a bug in the server",
    "cron_unavailable": "serve always runs the cron service",
    "server_unavailable": "a fenced server of a cluster (tests/test_cluster.py provokes it)",
    "store_unavailable": "PostgreSQL ending every connection (tests/test_postgres_serve_attack.py provokes it)",
    "too_many_connections": "a hello over the credential's connection cap (tests/test_ws_fixes_s18.py provokes it)",
    "too_many_open_turns": "a credential over its open-turn cap (tests/test_ws_turn_cap_s25.py provokes it)",
    "outcome_unknown": "a cluster holder that does not answer in time (tests/test_cluster_fixes_s18.py provokes it)",
    "ledger_unavailable": "a corrupt gateway.db a running gateway holds (tests/test_gateway_channels_e2e.py)",
    "storage_error": "a state file the disk refuses to write (tests/test_cron_s28j.py provokes it)",
}
LOOKUP = {"name": "lookup", "description": "a client tool", "parameters": {"type": "object", "properties": {}}}


def documented_codes() -> set[str]:
    text = DOC.read_text("utf-8")
    table = text[text.index("## Error codes") : text.index("Close codes:")]
    codes: set[str] = set()
    for row in re.findall(r"^\|([^|\n]*)\|", table, re.MULTILINE):
        codes.update(re.findall(r"`([a-z_]+)`", row))
    return codes


@dataclass
class Srv:
    sp: ServeProcess
    full: str  # openai,ws,admin
    scoped: str  # ws only, agent assistant only
    http_only: str  # openai only
    careful_id: str  # one of two agents named "careful" (clock=ask)

    async def ws(self, token: str | None = None, *, hello: bool = True) -> WS:
        """A socket authenticated at the upgrade (with the admin token unless told otherwise)."""
        headers = {"Authorization": f"Bearer {token or self.full}"}
        return await WS.open(self.sp.url, hello=hello, headers=headers, open_timeout=T)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    home = tmp_path_factory.mktemp("wserr") / "home"
    env = cli_env(home, APPSERVER_LIMITS__QUEUE_MAX="1", APPSERVER_LIMITS__CLIENT_TOOL_TIMEOUT_S="0.5")
    ids = []
    for _ in range(2):  # two agents share the name "careful": the name is ambiguous
        r = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", "--json", env=env)
        assert r.code == 0, r.err
        ids.append(r.json()["id"])
    tokens = TokenStore(home)
    full = tokens.create(name="full", scopes="openai,ws,admin")[1]
    scoped = tokens.create(name="scoped", scopes="ws", agents="assistant")[1]
    http_only = tokens.create(name="http", scopes="openai")[1]
    now = datetime.now(UTC)  # a task whose conversation does not exist: its run cannot be submitted
    CronStore(home).add(
        make_task(
            name="broken",
            agent=ids[0],
            schedule=ScheduleSpec("in", "2h", "UTC"),
            prompt="p",
            now=now,
            conversation="conv_missing",
        )
    )
    with serving(home, "--auth", "token", env=env) as sp:
        yield Srv(sp, full, scoped, http_only, ids[0])


async def _auth_refusal(srv: Srv, token: str | None) -> str:
    """A socket without credentials at the upgrade sends `hello` with `token`: the error code, after
    which the server closes with 4401."""
    ws = await WS.open(srv.sp.url, hello=False, open_timeout=T)
    hello: dict[str, Any] = {"type": "hello", "protocol": 1}
    if token is not None:
        hello["token"] = token
    err = await ws.request(hello, T)
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await ws.recv(T)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    return str(err["code"])


async def _provoke_token_server(srv: Srv) -> set[str]:
    seen: set[str] = set()

    async def error(ws: WS, frame: dict[str, Any] | str) -> str:
        if isinstance(frame, str):
            await ws.send(frame)
            reply = await ws.recv(T)
        else:
            reply = await ws.request(frame, T)
        assert reply["type"] == "error", (frame, reply)
        seen.add(reply["code"])
        return str(reply["code"])

    ws = await srv.ws()
    assert await error(ws, "nope {") == "bad_json"
    assert await error(ws, {"type": 5}) == "bad_frame"
    assert await error(ws, {"type": "teleport"}) == "unknown_type"
    assert await error(ws, {"type": "hello", "protocol": 1}) == "already_greeted"
    assert await error(ws, {"type": "submit_input", "agent": "nobody", "input": "x"}) == "agent_not_found"
    assert await error(ws, {"type": "submit_input", "agent": "careful", "input": "x"}) == "agent_ambiguous"
    assert await error(ws, {"type": "subscribe", "conversation": "conv_nope"}) == "conversation_not_found"
    assert await error(ws, {"type": "cron_run", "task": "no-such-task"}) == "not_found"
    assert await error(ws, {"type": "cron_run", "task": "broken"}) == "fire_failed"
    assert await error(ws, {"type": "submit_input", "agent": "assistant", "input": "   "}) == "invalid_request"
    assert await error(ws, {"type": "tool_result", "call_id": "call_nope", "output": "x"}) == "unknown_call"
    # queue_full: one running, one queued (limits.queue_max = 1), the third is refused
    busy = await ws.request(
        {"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 100"}, T
    )
    conv = busy["conversation_id"]
    assert (
        await ws.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "queued"}, T)
    )["queue_position"] == 1
    assert (
        await error(ws, {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "one too many"})
        == "queue_full"
    )
    await ws.request({"type": "cancel", "conversation": conv}, T)
    # not_awaiting: an answer for a conversation with nothing paused
    idle = (await ws.request({"type": "create_conversation", "agent": "assistant"}, T))["conversation"]["id"]
    assert await error(ws, {"type": "get_turn", "conversation": idle, "turn_id": "turn_nope"}) == "turn_not_found"
    assert (
        await error(
            ws,
            {
                "type": "approval_response",
                "conversation": idle,
                "decisions": [{"call_id": "call_x", "decision": "approve"}],
            },
        )
        == "not_awaiting"
    )
    # already_resolved: in the ack of a late approval answer, never an error frame
    ack = await ws.request(
        {"type": "submit_input", "agent": srv.careful_id, "conversation": "new", "input": "/call clock {}"}, T
    )
    req = await ws.expect(lambda f: f["type"] == "approval_request", T)
    answer = {
        "type": "approval_response",
        "conversation": ack["conversation_id"],
        "decisions": [{"call_id": req["call_id"], "decision": "approve"}],
    }
    assert (await ws.request(answer, T))["results"][0]["accepted"] is True
    late = await ws.request(answer, T)
    assert late["type"] == "ack" and late["results"][0]["error"] == "already_resolved"
    seen.add(late["results"][0]["error"])
    await ws.close()

    fresh = await srv.ws(hello=False)
    assert await error(fresh, {"type": "list_agents"}) == "hello_required"
    await fresh.close()
    scoped = await srv.ws(srv.scoped)
    assert await error(scoped, {"type": "submit_input", "agent": srv.careful_id, "input": "x"}) == "forbidden"
    await scoped.close()
    old = await srv.ws(hello=False)
    assert await error(old, {"type": "hello", "protocol": 2}) == "unsupported_protocol"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await old.recv(T)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4406
    two = await srv.ws(hello=False)  # the upgrade carries `full`; hello names another credential
    assert await error(two, {"type": "hello", "protocol": 1, "token": srv.scoped}) == "conflicting_credentials"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await two.recv(T)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401

    for token, code in (
        (None, "missing_api_key"),
        ("aps_not_a_token", "invalid_api_key"),
        (srv.http_only, "insufficient_scope"),
    ):
        assert await _auth_refusal(srv, token) == code
        seen.add(code)
    return seen


async def _provoke_jwt_server(home: Path) -> set[str]:
    home.mkdir(parents=True, exist_ok=True)
    secret = base64.b64encode(secrets.token_bytes(36)).decode()
    (home / "jwt.secret").write_text(secret + "\n")
    (home / "config.toml").write_text(
        '[auth]\nmode = "jwt"\njwt_secret_file = "jwt.secret"\njwt_algorithms = ["HS256"]\n'
    )
    sp = start_serve(home)
    try:
        srv = Srv(sp, "", "", "", "")
        expired = jwt.encode({"sub": "old", "exp": int(time.time()) - 3600}, secret, algorithm="HS256")
        forged = jwt.encode(
            {"sub": "eve", "exp": int(time.time()) + 3600}, "another secret of 32 bytes or more!", algorithm="HS256"
        )
        return {await _auth_refusal(srv, expired), await _auth_refusal(srv, forged)}
    finally:
        sp.stop()


async def test_every_documented_error_code_is_what_the_server_sends(srv: Srv, tmp_path: Path) -> None:
    documented = documented_codes()
    assert {"invalid_token", "token_expired", "invalid_api_key", "missing_api_key", "unknown_call"} <= documented
    assert set(NOT_PROVOKABLE) <= documented
    seen = await _provoke_token_server(srv)
    jwt_codes = await _provoke_jwt_server(tmp_path / "jwt-home")
    assert jwt_codes == {"token_expired", "invalid_token"}
    seen |= jwt_codes
    assert seen - documented == set(), "the server sends codes the document does not list"
    assert documented - seen == set(NOT_PROVOKABLE), "documented codes nobody could provoke"


async def test_tool_result_after_the_client_tool_timed_out_is_unknown_call(srv: Srv) -> None:
    ws = await srv.ws()
    ack = await ws.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "new",
            "input": "/call lookup {}",
            "client_tools": [LOOKUP],
        },
        T,
    )
    call = await ws.expect(lambda f: f["type"] == "tool_call_request", T)
    snap = await ws.terminal(ack["turn_id"], T)  # nobody answered within limits.client_tool_timeout_s
    assert "did not return a result" in snap["blocks"][-1]["text"]
    err = await ws.request({"type": "tool_result", "call_id": call["call_id"], "output": "too late"}, T)
    assert err["type"] == "error" and err["code"] == "unknown_call" and err["param"] == "call_id"
    assert "no longer waiting" in err["message"]
    await ws.close()


async def test_unknown_fields_are_ignored_unknown_types_refused(srv: Srv) -> None:
    ws = await srv.ws(hello=False)
    welcome = await ws.request(
        {"type": "hello", "protocol": 1, "client": "future/9", "capabilities": {"compression": True}}, T
    )
    assert welcome["type"] == "welcome"
    frame = {
        "type": "submit_input",
        "agent": "assistant",
        "input": [{"type": "text", "text": "from the future", "cache_control": {"type": "ephemeral"}}],
        "priority": "high",
        "client_tools": [{**LOOKUP, "strict": True}],
    }
    ack = await ws.request(frame, T)
    assert ack["type"] == "ack", ack
    assert (await ws.terminal(ack["turn_id"], T))["status"] == "completed"
    err = await ws.request({"type": "teleport", "to": "mars"}, T)
    assert err["code"] == "unknown_type" and err["param"] == "type"
    await ws.close()


async def test_documented_details_hold(srv: Srv) -> None:
    """submit_input without `conversation` goes to the default conversation; the unsubscribe ack
    carries `results`; image URLs: https, http and data:image are taken, other schemes refused."""
    ws = await srv.ws()
    ack = await ws.request({"type": "submit_input", "agent": "assistant", "input": "no conversation given"}, T)
    state = await ws.request({"type": "subscribe", "conversation": "default", "agent": "assistant"}, T)
    assert state["conversation"]["id"] == ack["conversation_id"] and state["conversation"]["default"] is True
    await ws.terminal(ack["turn_id"], T)
    reply = await ws.request({"type": "unsubscribe", "conversation": ack["conversation_id"]}, T)
    assert reply == {
        "type": "ack",
        "request_id": reply["request_id"],
        "conversation_id": ack["conversation_id"],
        "results": [{"subscribed": False, "was_subscribed": True}],
    }
    again = await ws.request({"type": "unsubscribe", "conversation": ack["conversation_id"]}, T)
    assert again["results"] == [{"subscribed": False, "was_subscribed": False}]
    for url in ("https://example.com/a.png", "http://example.com/a.png", "data:image/png;base64,iVBORw0KGgo="):
        ok = await ws.request(
            {
                "type": "submit_input",
                "agent": "assistant",
                "conversation": "new",
                "input": [{"type": "text", "text": "see"}, {"type": "image", "url": url}],
            },
            T,
        )
        assert ok["type"] == "ack", (url, ok)
    for url in ("file:///etc/passwd", "/tmp/a.png", "ftp://example.com/a.png", "data:image/png;base64,AA!A"):
        err = await ws.request(
            {"type": "submit_input", "agent": "assistant", "input": [{"type": "image", "url": url}]}, T
        )
        assert err["code"] == "bad_frame" and err["param"] == "input[0].url", (url, err)
    await ws.close()


async def test_error_texts_say_what_is_wrong(srv: Srv) -> None:
    ws = await srv.ws(hello=False)
    err = await ws.request({"type": 5}, T)
    assert err["code"] == "bad_frame" and err["param"] == "type"
    assert "missing" not in err["message"] and "must be a non-empty string" in err["message"]
    err = await ws.request({"request_id": "x"}, T)
    assert err["message"] == "missing field 'type'"
    # protocol is an integer: the string "1" is refused (and the connection stays usable)
    err = await ws.request({"type": "hello", "protocol": "1"}, T)
    assert err["code"] == "bad_frame" and err["param"] == "protocol" and "integer" in err["message"]
    assert (await ws.request({"type": "hello", "protocol": 1}, T))["type"] == "welcome"
    err = await ws.request({"type": "submit_input", "agent": "assistant", "input": [{"type": "video", "url": "x"}]}, T)
    assert err["code"] == "bad_frame" and err["param"] == "input[0].type"
    assert "unknown type 'video'" in err["message"] and "'text'" in err["message"] and "input.str" not in err["message"]
    err = await ws.request({"type": "submit_input", "agent": "assistant", "input": [{"type": "text"}]}, T)
    assert err["message"] == "missing field 'input[0].text'"
    err = await ws.request({"type": "submit_input", "agent": "assistant", "input": 5}, T)
    assert err["param"] == "input" and "a string or a list of parts" in err["message"]
    for frame, param in (
        ({"type": "list_conversations", "limit": "5"}, "limit"),
        ({"type": "tool_result", "call_id": "c", "output": "o", "is_error": "false"}, "is_error"),
    ):
        err = await ws.request(frame, T)
        assert err["code"] == "bad_frame" and err["param"] == param, err
    await ws.close()


def test_doc_client_examples_use_only_fields_the_server_knows() -> None:
    """Client frames ignore unknown fields now, so validation alone no longer catches a typo in an
    example of the document: check the fields against the models."""
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", DOC.read_text("utf-8"), re.DOTALL)]
    models = {m.model_fields["type"].annotation.__args__[0]: m for m in F.ClientFrame.__origin__.__args__}  # type: ignore[attr-defined]
    checked = 0
    for ex in blocks:
        model = models.get(ex["type"])
        if model is None:
            continue
        assert set(ex) <= set(model.model_fields), (ex["type"], set(ex) - set(model.model_fields))
        checked += 1
    assert checked == len(models)


async def test_history_pages_stop_at_a_size_and_say_more_remain(srv: Srv) -> None:
    """A conversation bigger than one reply should hold (a thousand 4 MiB messages were gigabytes
    read and encoded at once, stalling every client): pages of about 8 MiB, `has_more`, and
    paging back with `before` reaches every message exactly once."""
    ws = await srv.ws()
    big = "x" * (1024 * 1024)
    conv = "new"
    for i in range(5):  # 5 turns: 5 inputs of 1 MiB and 5 echoes of them, ~10 MiB
        ack = await ws.request(
            {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": f"{i}{big}"}, T
        )
        assert ack["type"] == "ack", ack
        conv = ack["conversation_id"]
        await ws.terminal(ack["turn_id"], T)
    first = await ws.request({"type": "get_history", "conversation": conv, "limit": 1000}, T)
    assert first["has_more"] is True and 0 < len(first["messages"]) < 10, len(first["messages"])
    assert sum(len(m["content"]) for m in first["messages"]) <= 9 * 1024 * 1024
    seen = [m["id"] for m in first["messages"]]
    page = first
    while page["has_more"]:
        page = await ws.request(
            {"type": "get_history", "conversation": conv, "limit": 1000, "before": page["messages"][0]["id"]}, T
        )
        seen = [m["id"] for m in page["messages"]] + seen
    assert len(seen) == 10 and seen == sorted(set(seen))
    small = await ws.request({"type": "get_history", "conversation": conv, "limit": 2}, T)
    assert len(small["messages"]) == 2 and small["has_more"] is True
    await ws.close()
