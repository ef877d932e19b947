"""A turn looked up by id (`get_turn`), and the client library's resume that uses it; no secret of a
server URL in an error line. Real `appserver serve` processes, the real client library and CLI:

* `get_turn` answers one turn's current snapshot (queued, or withdrawn from the queue: no message
  in the history), with get_history's visibility (`conversation_not_found`) and `turn_not_found`;
  in a cluster any server answers for a turn the other one runs;
* a `ProtocolClient` whose queued turn another client withdrew while it was disconnected reports
  it `cancelled` (was: `failed` kind `lost`, "no record of this turn"), also with another input
  queued behind it (was: no outcome at all, `wait_turn` until its timeout);
* `run` / `chat --url` with a password or a token in the URL never echo it (a refused URL, one no
  parser takes, a server out of reach, an upgrade the server refused).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from appserver.auth import TokenStore
from appserver.client import ConnectError, ProtocolClient
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 8.0
SECRET = "HUNTER2PW"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str, str]]:
    """A server that needs a token; two `ws` tokens (two namespaces)."""
    home = tmp_path_factory.mktemp("s31w") / "home"
    tokens = TokenStore(home)
    one = tokens.create(name="one", scopes="ws")[1]
    two = tokens.create(name="two", scopes="ws")[1]
    with serving(home, "--auth", "token", env=cli_env(home)) as sp:
        yield sp, one, two


async def _ws(url: str, token: str) -> WS:
    return await WS.open(url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


async def _busy(ws: WS) -> str:
    """A new conversation with a long turn running: what is submitted next waits in its queue."""
    ack = await ws.request({"type": "submit_input", "agent": "assistant", "conversation": "new", "input": "/slow 400"})
    assert ack["type"] == "ack", ack
    return str(ack["conversation_id"])


async def _get_turn(ws: WS, conv: str, turn_id: str) -> dict[str, Any]:
    return await ws.request({"type": "get_turn", "conversation": conv, "turn_id": turn_id}, T)


async def test_get_turn_answers_a_turn_by_id_as_get_history_answers_its_conversation(
    server: tuple[ServeProcess, str, str],
) -> None:
    sp, one, two = server
    a, other = await _ws(sp.url, one), await _ws(sp.url, two)
    try:
        conv = await _busy(a)
        queued = await a.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "q"})
        reply = await _get_turn(a, conv, queued["turn_id"])
        assert reply["type"] == "turn", reply
        snap = reply["snapshot"]
        assert (snap["turn_id"], snap["status"], snap["phase"], snap["queue_position"]) == (
            queued["turn_id"],
            "running",
            "queued",
            1,
        ), snap
        cancel = await a.request({"type": "cancel", "conversation": conv, "turn_id": queued["turn_id"]})
        assert cancel["cancelled"] is True, cancel
        ended = (await _get_turn(a, conv, queued["turn_id"]))["snapshot"]
        assert ended["status"] == "cancelled" and ended["error"]["kind"] == "withdrawn", ended
        assert ended["revision"] > snap["revision"], (snap, ended)
        history = await a.request({"type": "get_history", "conversation": conv})
        assert queued["turn_id"] not in {m.get("turn_id") for m in history["messages"]}  # nothing of it kept
        # an unknown id, and a turn of another conversation, are unknown in this one
        missing = await _get_turn(a, conv, "turn_0000000000000000")
        assert (missing["type"], missing["code"], missing["param"]) == ("error", "turn_not_found", "turn_id"), missing
        elsewhere = await _busy(a)
        crossed = await _get_turn(a, elsewhere, queued["turn_id"])
        assert crossed.get("code") == "turn_not_found", crossed
        # another credential's conversation is as unknown as one that does not exist
        foreign = await _get_turn(other, conv, queued["turn_id"])
        assert foreign.get("code") == "conversation_not_found", foreign
        for c in (conv, elsewhere):
            await a.request({"type": "cancel", "conversation": c})
    finally:
        await a.close()
        await other.close()


async def _withdrawn_while_down(sp: ServeProcess, token: str, behind: bool) -> dict[str, Any]:
    """The outcome a reconnecting `ProtocolClient` reports for its queued turn, withdrawn by
    another client of the same token while the library's connection was down."""
    other = await _ws(sp.url, token)
    try:
        conv = await _busy(other)
        async with await ProtocolClient.connect(sp.url, token=token, reconnect=True, reconnect_s=T) as client:
            ack = await client.submit("assistant", "queued one", conversation=conv)
            assert ack["queue_position"] == 1, ack
            if behind:
                later = {"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "/slow 400"}
                assert (await other.request(later))["queue_position"] == 2
            client.ws.transport.pause_reading()  # the turn's end is never read on this connection
            cancel = await other.request({"type": "cancel", "conversation": conv, "turn_id": ack["turn_id"]})
            assert cancel["cancelled"] is True, cancel
            await other.expect(
                lambda f: (
                    f["type"] == "turn_updated"
                    and f["snapshot"]["turn_id"] == ack["turn_id"]
                    and f["snapshot"]["status"] == "cancelled"
                )
            )
            client.ws.transport.abort()  # the connection drops (1006): the library reconnects
            snap = await client.wait_turn(ack["turn_id"], timeout=T)
            assert client.reconnects == 1
        await other.request({"type": "cancel", "conversation": conv})
        return snap
    finally:
        await other.close()


async def test_a_followed_queued_turn_withdrawn_while_disconnected_is_reported_cancelled(
    server: tuple[ServeProcess, str, str],
) -> None:
    """Nothing else queued: it was reported `failed` kind `lost` ("no record of this turn")."""
    sp, one, _ = server
    snap = await _withdrawn_while_down(sp, one, behind=False)
    assert (snap["status"], snap["error"]["kind"]) == ("cancelled", "withdrawn"), snap


async def test_a_followed_queued_turn_withdrawn_while_disconnected_with_inputs_behind_gets_its_outcome(
    server: tuple[ServeProcess, str, str],
) -> None:
    """Another input queued behind it: the library took it for still queued and never delivered an
    outcome (`wait_turn` ran into its timeout; `appserver chat` showed nothing, for ever)."""
    sp, one, _ = server
    snap = await _withdrawn_while_down(sp, one, behind=True)
    assert (snap["status"], snap["error"]["kind"]) == ("cancelled", "withdrawn"), snap


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[ServeProcess, ServeProcess]]:
    """Two servers of one cluster (one PostgreSQL database)."""
    require_postgres()
    with temp_database("s31w") as url:
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp_path / f"node{i}"
                env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_STORE__HEARTBEAT_S="0.2")
                started.append(start_serve(home, env=env))
            yield started[0], started[1]
        finally:
            for sp in started:
                sp.kill()


async def test_get_turn_in_a_cluster_answers_for_a_turn_the_other_server_runs(
    pair: tuple[ServeProcess, ServeProcess],
) -> None:
    holder, other = pair
    a, b = await WS.open(holder.url, open_timeout=T), await WS.open(other.url, open_timeout=T)
    try:
        conv = await _busy(a)
        queued = await a.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "q"})
        seen = await _get_turn(b, conv, queued["turn_id"])
        assert seen["type"] == "turn" and seen["snapshot"]["status"] == "running", seen
        assert (await a.request({"type": "cancel", "conversation": conv, "turn_id": queued["turn_id"]}))["cancelled"]
        ended = (await _get_turn(b, conv, queued["turn_id"]))["snapshot"]
        assert (ended["status"], ended["error"]["kind"]) == ("cancelled", "withdrawn"), ended
        await a.request({"type": "cancel", "conversation": conv})
    finally:
        await a.close()
        await b.close()


# ───────────────────────────────────────────────────────────── no secret of a URL in an error line


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (("run", "--url", f"http://alice:{SECRET}@127.0.0.1:9", "hi"), "http://alice:***@127.0.0.1:9"),
        (("chat", "--url", f"http://alice:{SECRET}@127.0.0.1:9"), "http://alice:***@127.0.0.1:9"),
        (("run", "--url", f"https://alice:{SECRET}@[::1", "hi"), "https://alice:***@[::1"),
        (("run", "--url", f"http://127.0.0.1:{{port}}/?token=aps_{SECRET}", "hi"), "/?token=***"),
        (("chat", "--url", f"http://127.0.0.1:{{port}}/?token=aps_{SECRET}"), "/?token=***"),
    ],
)
def test_run_and_chat_never_echo_a_secret_of_the_url(tmp_path: Path, args: tuple[str, ...], shown: str) -> None:
    import socket

    with socket.socket() as closed:  # a port nothing listens on (bound, never listening)
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        argv = [a.replace("{port}", str(port)) for a in args]
        out = run_cli(tmp_path / "home", *argv, timeout=30, stdin="")
    assert out.code != 0, out
    assert SECRET not in out.out + out.err, out.err
    assert shown in out.err, out.err


async def test_the_library_never_echoes_a_token_of_the_url(server: tuple[ServeProcess, str, str]) -> None:
    """An upgrade refused for its missing token names the server without the URL's query."""
    sp, _, _ = server
    with pytest.raises(ConnectError) as refused:
        await asyncio.wait_for(ProtocolClient.connect(f"{sp.url}/?token=aps_{SECRET}", token=lambda: None), T)
    assert refused.value.status == 401, refused.value.message
    assert SECRET not in refused.value.message and "?token=***" in refused.value.message, refused.value.message
