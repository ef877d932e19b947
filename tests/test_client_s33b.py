"""The client library around a reconnect: outcomes and re-sent requests.

A real `serve`, a `ProtocolClient` (reconnect=True) through a loopback TCP proxy that drops its
connection at a chosen moment while the server runs on, and a second client straight to the server.

* A followed turn that ended while the connection was down is reported as the server has it
  (`get_turn`): a failed 429 `rate_limit`, retryable, and a turn cancelled while awaiting approval
  `cancelled` (was: rebuilt from the history, both `failed` with `error.kind` `unknown`).
* A `cancel` without `turn_id` whose connection dropped before its ack is not sent again: it fails
  with `Closed` `connection_lost` (was: re-sent, it stopped the next turn, another client's input).
* A re-sent `approval_response` whose first send was applied reports the caller's own decision as
  accepted, marked `resent` (was: `accepted: false, error: already_resolved`, as if somebody else
  answered first).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from appserver.client import TERMINAL, Closed, ProtocolClient
from appserver.client.connection import own_answers
from tests.support.cli import careful_home, cli_env
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

T = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One server for every test: each opens its own conversations (agent `careful`: clock=ask)."""
    home = careful_home(tmp_path_factory.mktemp("s33b"))
    with serving(home, env=cli_env(home), graceful=False) as sp:
        yield sp


class Proxy:
    """A loopback TCP proxy to the server. `cut()` drops every connection (no close frame: 1006)
    and refuses new ones until `open` is set again (a network outage, the server up). `hold()`
    lets the client's next bytes through and then forwards nothing more from the server, so that
    what the server answers to them never reaches the client before the cut."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.open = True
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._armed = False
        self._holding = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer, upstream=True), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                if not upstream and self._holding:
                    continue  # the server's answer is lost with the connection
                writer.write(data)
                await writer.drain()
                if upstream and self._armed:
                    self._armed, self._holding = False, True
        except OSError:
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)

    def hold(self) -> None:
        self._armed = True

    def cut(self) -> None:
        self.open = self._armed = self._holding = False
        for writer in list(self._writers):
            writer.transport.abort()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _port(sp: ServeProcess) -> int:
    return int(sp.url.rsplit(":", 1)[1].split("/")[0])


async def _until(direct: ProtocolClient, test: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The next frame of `direct` that passes `test`."""
    while True:
        frame = await direct.next_frame(T)
        if test(frame):
            return frame


def _snap_of(turn_id: str, *statuses: str) -> Callable[[dict[str, Any]], bool]:
    def test(frame: dict[str, Any]) -> bool:
        snap = frame.get("snapshot") or {}
        return frame.get("type") == "turn_updated" and snap.get("turn_id") == turn_id and snap.get("status") in statuses

    return test


async def _turn(direct: ProtocolClient, conv: str, turn_id: str) -> dict[str, Any]:
    reply = await direct.request({"type": "get_turn", "conversation": conv, "turn_id": turn_id}, timeout=T)
    snap: dict[str, Any] = reply["snapshot"]
    return snap


async def _reconnected(lib: ProtocolClient) -> None:
    """Wait until `lib` is connected again, then until the server handled what it sent before."""
    async with asyncio.timeout(T):
        while lib.reconnects < 1:
            await asyncio.sleep(0.02)
    await lib.request({"type": "ping"}, timeout=T)


async def _outcomes(lib: ProtocolClient, turns: set[str]) -> dict[str, dict[str, Any]]:
    """The terminal snapshot `lib` delivers for each of `turns`, whatever their order."""
    got: dict[str, dict[str, Any]] = {}
    while set(got) != turns:
        frame = await lib.next_frame(T)
        snap = frame.get("snapshot") or {}
        if frame.get("type") == "turn_updated" and snap.get("turn_id") in turns and snap.get("status") in TERMINAL:
            got[snap["turn_id"]] = snap
    return got


def _outcome(snap: dict[str, Any]) -> tuple[Any, ...]:
    return snap["status"], snap["stop_reason"], snap["error"]


@asynccontextmanager
async def _clients(server: ServeProcess, **options: Any) -> AsyncIterator[tuple[Proxy, ProtocolClient, ProtocolClient]]:
    """The library through a proxy that can drop its connection, and a second client connected directly."""
    proxy = Proxy(_port(server))
    await proxy.start()
    lib = await ProtocolClient.connect(proxy.url, reconnect=True, reconnect_s=T, **options)
    direct = await ProtocolClient.connect(server.url)
    try:
        yield proxy, lib, direct
    finally:
        await lib.close()
        await direct.close()
        await proxy.close()


def test_a_turn_that_ended_while_disconnected_gets_the_servers_outcome(server: ServeProcess) -> None:
    async def go() -> None:
        async with _clients(server) as (proxy, lib, direct):
            slow = await lib.submit("careful", "/slow 400", conversation="new")
            conv = slow["conversation_id"]
            limited = await lib.submit("careful", "/error 429", conversation=conv)
            paused = await lib.submit("careful", "/call clock {}", conversation=conv)
            await direct.request({"type": "subscribe", "conversation": conv}, timeout=T)
            await _until(direct, _snap_of(slow["turn_id"], "running"))

            proxy.cut()  # the library's connection drops (it keeps trying); the server runs on
            cancel = {"type": "cancel", "conversation": conv, "turn_id": slow["turn_id"]}
            assert (await direct.request(cancel, timeout=T))["cancelled"] is True
            await _until(direct, _snap_of(limited["turn_id"], *TERMINAL))
            await _until(direct, _snap_of(paused["turn_id"], "awaiting"))
            cancel = {"type": "cancel", "conversation": conv, "turn_id": paused["turn_id"]}
            assert (await direct.request(cancel, timeout=T))["cancelled"] is True
            await _until(direct, _snap_of(paused["turn_id"], *TERMINAL))
            proxy.open = True

            outcomes = await _outcomes(lib, {ack["turn_id"] for ack in (slow, limited, paused)})
            for ack in (limited, paused, slow):
                got = outcomes[ack["turn_id"]]
                stored = await _turn(direct, conv, ack["turn_id"])
                assert _outcome(got) == _outcome(stored), (got, stored)
                assert "resumed_from" not in got, got
            assert lib.reconnects == 1
            error = (await _turn(direct, conv, limited["turn_id"]))["error"]
            assert (error["kind"], error["status"], error["retryable"]) == ("rate_limit", 429, True), error
            assert (await _turn(direct, conv, paused["turn_id"]))["status"] == "cancelled"

    asyncio.run(go())


def test_a_cancel_without_turn_id_is_not_sent_again_after_a_reconnect(server: ServeProcess) -> None:
    async def go() -> None:
        async with _clients(server) as (proxy, lib, direct):
            mine = await lib.submit("careful", "/slow 400", conversation="new")
            conv = mine["conversation_id"]
            other = await direct.submit("careful", "/slow 400 another client's input", conversation=conv)
            await _until(direct, _snap_of(mine["turn_id"], "running"))

            proxy.hold()  # the cancel reaches the server; its ack never reaches the library
            cancel = asyncio.ensure_future(lib.request({"type": "cancel", "conversation": conv}, timeout=T))
            await _until(direct, _snap_of(mine["turn_id"], *TERMINAL))
            proxy.cut()
            proxy.open = True
            with pytest.raises(Closed) as lost:
                await cancel
            assert lost.value.code == "connection_lost" and "may or may not have been applied" in lost.value.message
            await _reconnected(lib)
            assert (await _turn(direct, conv, mine["turn_id"]))["status"] == "cancelled"
            assert (await _turn(direct, conv, other["turn_id"]))["status"] == "running"  # the next turn runs on
            await direct.request({"type": "cancel", "conversation": conv, "turn_id": other["turn_id"]}, timeout=T)

    asyncio.run(go())


def test_a_resent_approval_answer_that_was_applied_is_reported_as_accepted(server: ServeProcess) -> None:
    async def go() -> None:
        async with _clients(server, client="desk") as (proxy, lib, direct):
            ack = await lib.submit("careful", "/call clock {}", conversation="new")
            conv = ack["conversation_id"]
            paused = await lib.wait_turn(ack["turn_id"], settled=True, timeout=T)
            call_id = paused["pending"][0]["call_id"]
            await direct.request({"type": "subscribe", "conversation": conv}, timeout=T)

            proxy.hold()  # the answer reaches the server; its ack never reaches the library
            answer = {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "deny"}],
            }
            sent = asyncio.ensure_future(lib.request(answer, timeout=T))
            await _until(direct, _snap_of(ack["turn_id"], *TERMINAL))
            proxy.cut()
            proxy.open = True
            reply = await sent
            assert reply["results"] == [{"call_id": call_id, "accepted": True, "status": "denied", "resent": True}]
            assert lib.reconnects == 1
            done = await _turn(direct, conv, ack["turn_id"])
            assert "denied" in str(done["blocks"]), done

    asyncio.run(go())


def test_a_resent_answer_lost_to_another_decision_stays_already_resolved() -> None:
    sent = {"type": "approval_response", "decisions": [{"call_id": "c1", "decision": "approve"}]}
    lost = {"call_id": "c1", "accepted": False, "error": "already_resolved", "status": "denied", "message": "…"}
    assert own_answers(sent, {"type": "ack", "results": [lost]})["results"] == [lost]
