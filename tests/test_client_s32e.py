"""The client library after a reconnect, and secrets of a server URL in error lines.

* A `ProtocolClient` (reconnect=True) following a turn whose conversation the server will not
  subscribe it to again (its agent was deleted while the connection was down) reports the turn
  `failed`, `error.kind` `lost`, saying why (was: a local `error` frame only, `wait_turn` until its
  timeout, `appserver run` for its whole --timeout). A real `serve`, a TCP proxy that drops the
  client's connection while the server keeps running, `appserver agents delete`.
* A transient answer to the resubscribe (`store_unavailable`) is tried again, not taken as the end
  of the turns (was: they were forgotten). A scripted WebSocket peer gives that answer once.
* `run --url` with a password holding `/`, `#` or `?` (pasted unencoded), or a token in a fragment,
  never shows it (was: the URL whole, and urllib's message quoting the "port", the password); nor
  a proxy URL of the environment (was: a traceback quoting it whole).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from appserver.client import ConnectError, ProtocolClient, shown_url
from tests.support.cli import CLIResult, cli_env, run_cli
from tests.support.serve import serving

pytestmark = pytest.mark.timeout(60)

T = 10.0
SECRET = "s3cr3tPW"


class Proxy:
    """A loopback TCP proxy to `target_port` that can drop every connection through it and refuse
    new ones (closing them at once) until it is opened again: a network outage, the server up."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.open = True
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)

    def cut(self) -> None:
        """Drop every connection (no close frame: 1006) and refuse new ones."""
        self.open = False
        for writer in list(self._writers):
            writer.transport.abort()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _turn_running(client: ProtocolClient, turn_id: str) -> None:
    while True:
        frame = await client.next_frame(T)
        snap = frame.get("snapshot") or {}
        if frame.get("type") == "turn_updated" and snap.get("turn_id") == turn_id and snap.get("status") == "running":
            return


async def _next_local_error(client: ProtocolClient) -> dict[str, Any]:
    while True:
        frame = await client.next_frame(T)
        if frame.get("type") == "error" and frame.get("local"):
            return frame


def test_a_followed_turn_whose_conversation_was_deleted_while_disconnected_gets_an_outcome(
    home: Path, cli: Callable[..., CLIResult]
) -> None:
    assert cli("agents", "create", "--name", "doomed").code == 0
    with serving(home, graceful=False) as sp:
        port = int(sp.url.rsplit(":", 1)[1].split("/")[0])

        async def go() -> tuple[dict[str, Any], dict[str, Any], ProtocolClient]:
            proxy = Proxy(port)
            await proxy.start()
            try:
                url = f"http://127.0.0.1:{proxy.port}"
                async with await ProtocolClient.connect(url, reconnect=True, reconnect_s=T) as client:
                    ack = await client.submit("doomed", "/slow 400", conversation="new")
                    await _turn_running(client, ack["turn_id"])
                    proxy.cut()  # the client loses its connection; the server runs on
                    deleted = await asyncio.to_thread(cli, "agents", "delete", "doomed")
                    assert deleted.code == 0, deleted
                    proxy.open = True  # the client reconnects: its conversation is gone
                    snap = await client.wait_turn(ack["turn_id"], timeout=T)
                    said = await _next_local_error(client)
                    assert not client.gone and client.reconnects == 1
                    return ack, snap, said
            finally:
                await proxy.close()

        ack, snap, said = asyncio.run(go())
    assert (snap["turn_id"], snap["status"], snap["error"]["kind"]) == (ack["turn_id"], "failed", "lost"), snap
    assert "conversation_not_found" in snap["error"]["message"], snap
    assert "refused to subscribe to its conversation again" in snap["error"]["message"], snap
    assert said["code"] == "conversation_not_found" and ack["conversation_id"] in said["message"], said


def _welcome(rid: str) -> dict[str, Any]:
    return {"type": "welcome", "request_id": rid, "protocol": 1, "server": "scripted", "client_id": "c"}


def _completed(revision: int) -> dict[str, Any]:
    return {
        "turn_id": "turn_1",
        "conversation_id": "conv_x",
        "agent_id": "agt_x",
        "revision": revision,
        "status": "completed",
        "phase": "finalizing",
        "stop_reason": "end_turn",
        "blocks": [{"type": "text", "text": "done"}],
        "pending": [],
        "usage": {},
        "error": None,
        "queue_position": 0,
        "attempt": 1,
        "updated_at": 1.0,
    }


async def _scripted(ws: ServerConnection, opened: list[int]) -> None:
    """A server that runs turn_1; on the second connection the store is down (`store_unavailable`
    to subscribe); on the third the turn has ended (`get_turn` gives its outcome)."""
    opened.append(1)
    nth = len(opened)
    async for raw in ws:
        frame = json.loads(raw)
        rid, kind = frame.get("request_id"), frame.get("type")
        reply: dict[str, Any]
        if kind == "hello":
            reply = _welcome(rid)
        elif kind == "submit_input":
            reply = {"type": "ack", "request_id": rid, "turn_id": "turn_1", "conversation_id": "conv_x"}
            await ws.send(json.dumps(reply))
            await ws.close(1012, "restarting")  # the client reconnects
            return
        elif kind == "subscribe" and nth == 2:
            reply = {"type": "error", "request_id": rid, "code": "store_unavailable", "message": "the store is down"}
        elif kind == "subscribe":
            conv = {"id": "conv_x", "agent_id": "agt_x"}
            reply = {"type": "conversation_state", "request_id": rid, "conversation": conv, "active_turn": None}
        elif kind == "get_history":
            reply = {"type": "history", "request_id": rid, "conversation_id": "conv_x", "messages": []}
        elif kind == "get_turn":
            reply = {"type": "turn", "request_id": rid, "snapshot": _completed(5)}
        else:
            reply = {"type": "error", "request_id": rid, "code": "unknown_type", "message": kind}
        await ws.send(json.dumps(reply))


async def test_a_transient_refusal_to_resubscribe_is_tried_again_not_the_end_of_the_turn() -> None:
    opened: list[int] = []
    async with serve(lambda ws: _scripted(ws, opened), "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        client = await ProtocolClient.connect(f"http://127.0.0.1:{port}", reconnect=True, reconnect_s=T)
        try:
            await client.submit("agt_x", "hi", conversation="conv_x")
            snap = await client.wait_turn("turn_1", timeout=T)
        finally:
            await client.close()
    assert (snap["status"], snap["blocks"]) == ("completed", [{"type": "text", "text": "done"}]), snap
    assert len(opened) == 3 and client.reconnects == 1, opened


URLS = (
    f"http://alice:{SECRET}/pw@127.0.0.1:9",
    f"http://alice:{SECRET}#pw@127.0.0.1:9",
    f"http://alice:{SECRET}?pw@127.0.0.1:9",
    f"http://{SECRET}/x@127.0.0.1:9",
    f"http://127.0.0.1:9/#access_token={SECRET}",
    f"http://127.0.0.1:9/#{SECRET}",
    f"alice:{SECRET}@127.0.0.1:9",  # no scheme
    f"http:/alice:{SECRET}@127.0.0.1:9",  # one slash
)


def test_a_url_password_or_fragment_token_is_never_shown(cli: Callable[..., CLIResult]) -> None:
    for url in URLS:
        assert SECRET not in shown_url(url), url
        r = cli("run", "--url", url, "hi")
        assert r.code == 2 and "invalid server URL" in r.err and "Traceback" not in r.err, (url, r)
        assert SECRET not in r.err + r.out, (url, r.err)
    # the library says it in the same words
    for url in URLS:
        with pytest.raises(ConnectError) as caught:
            asyncio.run(ProtocolClient.connect(url))
        assert caught.value.code == "invalid_url" and SECRET not in str(caught.value), caught.value
    # what is wrong is still said, in our words (no parser's text: it quotes what it could not read)
    r = cli("run", "--url", f"http://alice:{SECRET}/pw@127.0.0.1:9", "hi")
    assert "credentials do not go in the URL" in r.err, r.err
    r = cli("run", "--url", "http://127.0.0.1:port", "hi")
    assert "its port is not a number from 0 to 65535" in r.err and "cast" not in r.err, r.err


def test_a_proxy_url_of_the_environment_is_shown_masked(home: Path) -> None:
    proxy = f"foo://bob:{SECRET}@proxy.invalid:1"
    env = {**cli_env(home), "https_proxy": proxy, "http_proxy": proxy, "all_proxy": proxy}
    r = run_cli(home, "run", "--url", "http://example.invalid:9", "hi", env=env)
    assert r.code != 0 and "Traceback" not in r.err and "invalid proxy URL" in r.err, r
    assert SECRET not in r.err + r.out and "bob:***@proxy.invalid" in r.err, r.err
