"""Frames that used to end a /ws connection without an answer (1006, nothing logged), and what a
frame may name: against a real `appserver serve` with real `websockets` clients.

* An integer of more than 4,300 digits (Python's `int` limit) in a small frame: strictjson refused
  it, then the look for the refused frame's `request_id` (`json.loads`) raised ValueError past the
  frame's error handling (appserver/ws/routes.py `_peek_request_id`).
* A lone surrogate escape in `request_id`: the error frame echoed it, and the sender died on the
  text it could not encode as UTF-8. Neither a refusal nor any frame the server sends may end the
  connection: a lone surrogate that reaches a frame from elsewhere (an upstream's reply) goes out
  as U+FFFD (appserver/ws/connection.py `encode`), and a frame that still cannot be sent is
  replaced by an `internal_error` (`Connection.run_sender`).
* `subscribe`/`get_history` with an `agent` and a conversation id of another agent: refused as
  `submit_input` refuses it (conversation_not_found), not silently handed over.
* The welcome says how big a frame may be (`max_frame_bytes`), so a client refuses a bigger one
  itself; an image URL with a leading space is refused like any URL without a known scheme.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from appserver.ws.connection import Connection, encode
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chunk, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(90)

T = 10.0
FRAME_MAX = 256 * 1024
BIG_INT = "1" + "0" * 5000  # more digits than sys.get_int_max_str_digits() (4,300)


@dataclass
class Srv:
    sp: ServeProcess
    fake: FakeOpenAI

    async def ws(self, *, hello: bool = True) -> WS:
        return await WS.open(self.sp.url, hello=hello, open_timeout=T)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    with FakeOpenAI() as fake:
        home = tmp_path_factory.mktemp("hostile") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home, APPSERVER_LIMITS__WS_FRAME_MAX_BYTES=str(FRAME_MAX))
        for name, model in (("ops", "echo"), ("remote", "fake:m")):  # `assistant` comes with the home
            made = run_cli(home, "agents", "create", "--name", name, "--model", model, env=env)
            assert made.code == 0, made.err
        with serving(home, env=env) as sp:
            yield Srv(sp, fake)


async def _still_open(ws: WS) -> None:
    pong = await ws.request({"type": "ping"}, T)
    assert pong["type"] == "pong", pong


async def _refusal(ws: WS, text: str) -> dict[str, Any]:
    await ws.send(text)
    return await ws.recv(T)


async def test_an_integer_too_long_for_python_is_bad_json_and_the_connection_stays(srv: Srv) -> None:
    for greeted in (False, True):
        ws = await srv.ws(hello=greeted)
        frame = '{"type":"ping","request_id":"big","x":' + BIG_INT + "}"
        assert len(frame) < 64 * 1024  # parsed again to find the request_id (not looked for)
        err = await _refusal(ws, frame)
        assert err["type"] == "error" and err["code"] == "bad_json", err
        assert err["request_id"] == "big" and "too many digits" in err["message"], err
        err = await _refusal(ws, '{"type":"ping","x":' + BIG_INT + "}")
        assert err["code"] == "bad_json" and "request_id" not in err, err
        err = await _refusal(ws, '{"type":"list_conversations","request_id":"lc","limit":' + BIG_INT + "}")
        assert err["code"] == "bad_json" and err["request_id"] == "lc", err
        if greeted:
            await _still_open(ws)
        else:
            assert (await ws.request({"type": "ping"}, T))["code"] == "hello_required"
            assert (await ws.request({"type": "hello", "protocol": 1}, T))["type"] == "welcome"
            await _still_open(ws)
        await ws.close()


async def test_a_lone_surrogate_request_id_is_refused_without_echoing_it(srv: Srv) -> None:
    for greeted in (False, True):
        ws = await srv.ws(hello=greeted)
        for text in (
            '{"type":"ping","request_id":"\\ud800"}',
            '{"type":"ping","request_id":"\\udc00x"}',
            '{"type":"nope","request_id":"\\ud83d"}',  # an unknown type too
            '{"type":"submit_input","agent":"assistant","input":"hi","request_id":"\\ud800"}',
        ):
            err = await _refusal(ws, text)
            assert err["type"] == "error" and err["code"] == "bad_json", (text, err)
            assert "request_id" not in err and "surrogate" in err["message"], (text, err)
        if not greeted:
            assert (await ws.request({"type": "hello", "protocol": 1}, T))["type"] == "welcome"
        await _still_open(ws)
        # a surrogate *pair* is a character like any other: echoed
        pong = await _refusal(ws, '{"type":"ping","request_id":"\\ud83d\\ude00"}')
        assert pong == {"type": "pong", "request_id": "\U0001f600"}
        await ws.close()


async def test_a_frame_holding_a_lone_surrogate_from_upstream_does_not_end_the_connection(srv: Srv) -> None:
    """An upstream may stream a lone surrogate escape (the standard parser takes it): the snapshot
    showing it goes out with U+FFFD in its place, and the connection stays."""
    srv.fake.script(openai_sse([json.dumps(chunk(role="assistant", content="a\ud800b")), chunk(finish_reason="stop")]))
    ws = await srv.ws()
    ack = await ws.request({"type": "submit_input", "agent": "remote", "conversation": "new", "input": "hi"}, T)
    assert ack["type"] == "ack", ack
    snap = await ws.terminal(ack["turn_id"], T)
    texts = [f["snapshot"]["blocks"] for f in ws.seen if f.get("type") == "turn_updated"]
    assert any(b.get("text") == "a\ufffdb" for blocks in texts for b in blocks), texts
    assert snap["status"] in ("completed", "failed")
    await _still_open(ws)
    await ws.close()
    srv.fake.responder = lambda _req: Reply(pieces=[openai_sse([chunk(content="ok"), chunk(finish_reason="stop")])])


def test_encode_never_yields_text_that_utf8_cannot_carry() -> None:
    assert encode({"type": "pong", "request_id": "x"}) == '{"type":"pong","request_id":"x"}'
    # orjson refuses these; the standard library writes them, the surrogates as U+FFFD
    text = encode({"type": "event", "name": "n", "data": {"a": "x\ud800y", "big": 1 << 70}})
    assert json.loads(text) == {"type": "event", "name": "n", "data": {"a": "x\ufffdy", "big": 1 << 70}}
    text.encode("utf-8")


async def test_a_frame_the_socket_cannot_take_is_replaced_by_an_error_and_the_sender_goes_on() -> None:
    sent: list[str] = []

    async def send_text(text: str) -> None:
        if "\ud800" in text:
            text.encode("utf-8")  # raises, as the WebSocket library does
        sent.append(text)

    conn = Connection(send_text, outbound_max=10, send_timeout_s=5)
    sender = asyncio.get_running_loop().create_task(conn.run_sender())
    conn.send_encoded('{"type":"turn_updated","snapshot":"\ud800"}')
    conn.send({"type": "pong", "request_id": "after"})
    for _ in range(100):
        if len(sent) == 2:
            break
        await asyncio.sleep(0.01)
    assert not sender.done()
    first = json.loads(sent[0])
    assert first["type"] == "error" and first["code"] == "internal_error" and "turn_updated" in first["message"]
    assert json.loads(sent[1]) == {"type": "pong", "request_id": "after"}
    conn.kill(1000, "done")
    await asyncio.wait_for(sender, 5)


async def test_the_welcome_says_how_big_a_frame_may_be(srv: Srv) -> None:
    ws = await srv.ws(hello=False)
    welcome = await ws.request({"type": "hello", "protocol": 1}, T)
    assert welcome["max_frame_bytes"] == FRAME_MAX, welcome
    await ws.close()


async def test_an_agent_named_with_a_conversation_id_must_be_its_agent(srv: Srv) -> None:
    ws = await srv.ws()
    created = await ws.request({"type": "create_conversation", "agent": "assistant"}, T)
    conv = created["conversation"]["id"]
    for kind in ("subscribe", "get_history"):
        err = await ws.request({"type": kind, "conversation": conv, "agent": "ops"}, T)
        assert err["type"] == "error" and err["code"] == "conversation_not_found", (kind, err)
        assert err["param"] == "conversation" and err["message"] == f"unknown conversation '{conv}' for agent ops"
        # an unknown id with that agent reads the same: the mismatch tells nothing more
        nope = await ws.request({"type": kind, "conversation": "conv_nope", "agent": "ops"}, T)
        assert nope["message"] == "unknown conversation 'conv_nope' for agent ops", nope
        unknown = await ws.request({"type": kind, "conversation": conv, "agent": "ghost"}, T)
        assert unknown["code"] == "agent_not_found", unknown
        for agent in ("assistant", None):
            frame = {"type": kind, "conversation": conv, **({"agent": agent} if agent else {})}
            ok = await ws.request(frame, T)
            assert ok["type"] in ("conversation_state", "history"), (frame, ok)
    # as submit_input does
    err = await ws.request({"type": "submit_input", "agent": "ops", "conversation": conv, "input": "x"}, T)
    assert err["code"] == "conversation_not_found", err
    await ws.close()


async def test_an_image_url_with_a_leading_space_is_refused(srv: Srv) -> None:
    ws = await srv.ws()
    for url in (" https://example.com/a.png", "\thttp://example.com/a.png", " data:image/png;base64,iVBORw0KGgo="):
        err = await ws.request(
            {"type": "submit_input", "agent": "assistant", "input": [{"type": "image", "url": url}]}, T
        )
        assert err["code"] == "bad_frame" and err["param"] == "input[0].url", (url, err)
    ok = await ws.request(
        {
            "type": "submit_input",
            "agent": "assistant",
            "conversation": "new",
            "input": [{"type": "image", "url": "HTTPS://example.com/a.png"}],
        },
        T,
    )
    assert ok["type"] == "ack", ok
    await ws.close()
