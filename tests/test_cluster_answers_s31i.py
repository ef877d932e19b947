"""An answer given to one server for a turn another server holds reaches it, and is applied once
(docs/scale-out.md "Answers anywhere"): real PostgreSQL, real `appserver serve` processes, real
WebSocket clients.

Found by an outside tester: node 1 passes an approval to node 0 (the holder) as a NOTIFY with a
reply, and a notification is lost while a server's database session (its LISTEN) is being taken
again. A request lost so left the approval pending and the turn paused for good, its sender told
`outcome_unknown` ("do not send it again"); a reply lost so was `outcome_unknown` although the
answer was applied, or, once the request was passed on again, `already_resolved` by its own
answer. And an answer to a holder stopped (SIGSTOP) past the 10 s reply timeout was never applied
by the server that took the conversation over once the holder was judged gone.

The losses are made without timing luck: the test ends a server's session and holds that
server's instance lock itself for a moment, so the session cannot be taken again (nobody listens
on its channel) while the server still counts as live (its lock is held, its heartbeat fresh).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from appserver.store.cluster import INSTANCE_LOCK_CLASS
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

HELD_S = 1.0  # how long a session is kept away: under the 2.5 heartbeats after which its server is fenced


def _env(home: Path, url: str, heartbeat_s: str, timeout_s: str) -> dict[str, str]:
    return cli_env(
        home,
        APPSERVER_STORE__URL=url,
        APPSERVER_STORE__HEARTBEAT_S=heartbeat_s,
        APPSERVER_STORE__INSTANCE_TIMEOUT_S=timeout_s,
    )


def _cluster(tmp: Path, url: str, heartbeat_s: str, timeout_s: str) -> list[ServeProcess]:
    admin = tmp / "admin"
    made = run_cli(
        admin, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(admin, url, "1", "10")
    )
    assert made.code == 0, made.err
    nodes: list[ServeProcess] = []
    try:
        for i in range(2):
            home = tmp / f"node{i}"
            nodes.append(start_serve(home, env=_env(home, url, heartbeat_s, timeout_s)))
    except BaseException:
        stop_all(*nodes)
        raise
    return nodes


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[ServeProcess]]]:
    """Two servers; nothing here stops one, so a long timeout keeps a loaded machine from fencing."""
    require_postgres()
    with temp_database("s31i_answers") as url:
        nodes = _cluster(tmp_path_factory.mktemp("s31i"), url, "1", "10")
        try:
            yield url, nodes
        finally:
            stop_all(*nodes)


def _logs(nodes: list[ServeProcess]) -> str:
    return "".join(
        f"--- node{i}\n{sp.proc.stderr.so_far()[-3000:]}"  # type: ignore[union-attr]
        for i, sp in enumerate(nodes)
        if sp.proc.stderr is not None
    )


def _query(url: str, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


class SessionAway:
    """A server's database session ended, and its new one kept from listening: it takes its
    instance lock again (the server counts as live throughout) and then waits on the row lock this
    test holds on its `instances` row, before its LISTEN. Nobody hears that server's channel."""

    def __init__(self, url: str, node: ServeProcess) -> None:
        self.url = url
        self.conn = psycopg.connect(url)  # a transaction holding the row lock
        row = self.conn.execute("SELECT id, lock_key FROM instances WHERE pid = %s", (node.proc.pid,)).fetchone()
        assert row is not None, "the server's instance row"
        self.conn.rollback()
        self.instance, self.lock_key = str(row[0]), int(row[1])

    def _lock_holder(self) -> int | None:
        rows = self.conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s AND objid = %s "
            "AND objsubid = 2",
            (INSTANCE_LOCK_CLASS, self.lock_key),
        ).fetchall()
        return int(rows[0][0]) if rows else None

    def __enter__(self) -> SessionAway:
        self.conn.execute("SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (self.instance,))
        old = self._lock_holder()
        ended = self.conn.execute("SELECT pg_terminate_backend(%s, 5000)", (old,)).fetchall()
        assert ended == [(True,)], ended
        deadline = time.monotonic() + 10
        while self._lock_holder() in (None, old):  # its new session holds the lock, its LISTEN waits
            assert time.monotonic() < deadline, "the server did not take its lock again"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        """Let the new session go on, once what was sent to the server's channel meanwhile is lost
        for good: PostgreSQL starts a new LISTEN at the furthest any listener of the database has
        read, which may be behind a notification sent while nobody listened (delivered late after
        all). Another connection listens and reads past it first."""
        try:
            with psycopg.connect(self.url, autocommit=True) as skip:
                skip.execute("LISTEN s31i_skip")
                skip.execute("NOTIFY s31i_skip")
                assert any(True for _ in skip.notifies(timeout=5, stop_after=1)), "its own notification"
                self.conn.rollback()  # the session's LISTEN follows
                time.sleep(0.5)  # (this listener stays until it did)
        finally:
            self.conn.close()


async def _paused(nodes: list[ServeProcess]) -> tuple[WS, WS, str, str, str]:
    """A on node 0 (the holder) with a turn paused for one approval; B on node 1 subscribed."""
    a = await WS.open(nodes[0].url)
    b = await WS.open(nodes[1].url)
    ack = await a.request(
        {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock"}, timeout=20
    )
    assert ack["type"] == "ack", ack
    conv, turn = ack["conversation_id"], ack["turn_id"]
    req = await a.expect(lambda f: f["type"] == "approval_request" and f["turn_id"] == turn, timeout=20)
    state = await b.request({"type": "subscribe", "conversation": conv}, timeout=20)
    assert state["type"] == "conversation_state", state
    return a, b, conv, turn, str(req["call_id"])


def _approve(conv: str, call_id: str) -> dict[str, Any]:
    return {
        "type": "approval_response",
        "conversation": conv,
        "decisions": [{"call_id": call_id, "decision": "approve"}],
    }


def _ran_once(url: str, conv: str, call_id: str) -> None:
    status = _query(url, "SELECT status FROM pending_calls WHERE call_id = %s", (call_id,))
    assert status == [("approved",)], status
    results = _query(
        url,
        "SELECT count(*) FROM messages WHERE conversation_id = %s AND tool_call_id = %s AND role = 'tool'",
        (conv, call_id),
    )
    assert results == [(1,)], results


def test_an_answer_sent_while_the_holders_session_is_away_is_applied(pair: tuple[str, list[ServeProcess]]) -> None:
    """The request's notification is lost (the holder's session is being taken again): it is sent
    again until the holder answers, which applies it; the sender's ack says accepted."""
    url, nodes = pair

    async def go() -> None:
        a, b, conv, turn, call_id = await _paused(nodes)
        with SessionAway(url, nodes[0]):
            answer = asyncio.ensure_future(b.request(_approve(conv, call_id), timeout=30))
            await asyncio.sleep(HELD_S)
        reply = await answer
        assert reply["type"] == "ack", reply
        assert reply["results"][0]["accepted"] is True, reply
        assert (await b.terminal(turn, timeout=20))["status"] == "completed"
        _ran_once(url, conv, call_id)
        await a.close()
        await b.close()

    try:
        asyncio.run(go())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_logs(nodes)}") from None


def test_an_answer_whose_reply_is_lost_is_acked_accepted(pair: tuple[str, list[ServeProcess]]) -> None:
    """The holder applies the answer, and its reply is lost (the sender's session is being taken
    again): the request sent again is answered with the first run's reply, not run again (which
    found the call `already_resolved` by this very answer), and not `outcome_unknown`."""
    url, nodes = pair

    async def go() -> None:
        a, b, conv, turn, call_id = await _paused(nodes)
        with SessionAway(url, nodes[1]):
            answer = asyncio.ensure_future(b.request(_approve(conv, call_id), timeout=30))
            await asyncio.sleep(HELD_S)
        reply = await answer
        assert reply["type"] == "ack", reply
        assert reply["results"][0]["accepted"] is True, reply
        assert (await b.terminal(turn, timeout=20))["status"] == "completed"
        _ran_once(url, conv, call_id)
        await a.close()
        await b.close()

    try:
        asyncio.run(go())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_logs(nodes)}") from None


def test_an_answer_to_a_stopped_holder_is_applied_once_it_is_taken_over(tmp_path: Path) -> None:
    """The holder is stopped past the 10 s reply timeout (instance_timeout_s 11): the sender is
    told `outcome_unknown` (the holder may have got it), and the answer is applied once the holder
    is judged gone, by the server that takes the conversation over; the holder, continued, is
    fenced and applies nothing."""
    require_postgres()
    with temp_database("s31i_stopped") as url:
        nodes = _cluster(tmp_path, url, "0.5", "11")

        async def go() -> None:
            a, b, conv, turn, call_id = await _paused(nodes)
            nodes[0].proc.send_signal(signal.SIGSTOP)
            try:
                reply = await b.request(_approve(conv, call_id), timeout=30)
                accepted = reply["type"] == "ack" and reply["results"][0]["accepted"] is True
                assert accepted or reply.get("code") == "outcome_unknown", reply
                end = await b.terminal(turn, timeout=20)
                assert end["status"] == "completed", end
            finally:
                nodes[0].proc.send_signal(signal.SIGCONT)
            _ran_once(url, conv, call_id)
            await b.close()
            await a.conn.close()

        try:
            asyncio.run(go())
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_logs(nodes)}") from None
        finally:
            stop_all(*nodes)
