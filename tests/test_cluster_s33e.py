"""Two answers alike, from two clients of the same name through two servers, to a call whose
holder was killed: one wins, the other is told `already_resolved` (docs/scale-out.md "Answers
anywhere"), as with the holder alive. Real PostgreSQL, real `appserver serve` processes, real
WebSocket clients.

Found by an outside tester: each answer passed on to the dead holder counts as one that may have
been applied there, and an answer then found `already_resolved` was taken for its own earlier run
when the call was settled with its decision and its decider's name. Two copies of one app (every
client here says `hello` as "test") answering approve through two survivors were both acked
`accepted: true`. An answer now knows its own runs by their keys, which the holder notes.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve, stop_all
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

PAUSED = 2  # conversations paused on the holder when it is killed, each answered twice


def _env(home: Path, url: str) -> dict[str, str]:
    # The killed holder is judged gone within seconds, but not before both answers reach it:
    # each is passed on to it first (its copy may be applied there, as far as its sender knows).
    return cli_env(
        home, APPSERVER_STORE__URL=url, APPSERVER_STORE__HEARTBEAT_S="1", APPSERVER_STORE__INSTANCE_TIMEOUT_S="5"
    )


def _query(url: str, query: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


async def _paused(holder: WS) -> tuple[str, str, str]:
    ack = await holder.request(
        {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock"}, timeout=20
    )
    assert ack["type"] == "ack", ack
    turn = ack["turn_id"]
    req = await holder.expect(lambda f: f["type"] == "approval_request" and f["turn_id"] == turn, timeout=20)
    return ack["conversation_id"], turn, str(req["call_id"])


async def _approve(ws: WS, conv: str, call_id: str) -> dict[str, Any]:
    frame = {
        "type": "approval_response",
        "conversation": conv,
        "decisions": [{"call_id": call_id, "decision": "approve"}],
    }
    reply = await ws.request(frame, timeout=60)
    assert reply["type"] == "ack", reply
    return dict(reply["results"][0])


def test_two_alike_answers_through_two_survivors_of_a_killed_holder_have_one_winner(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("s33e_alike") as url:
        admin = tmp_path / "admin"
        made = run_cli(admin, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(admin, url))
        assert made.code == 0, made.err
        nodes: list[ServeProcess] = []
        try:
            for i in range(3):
                nodes.append(start_serve(tmp_path / f"node{i}", env=_env(tmp_path / f"node{i}", url)))

            async def go() -> None:
                holder = await WS.open(nodes[0].url)
                paused = [await _paused(holder) for _ in range(PAUSED)]
                # per conversation, a client on each survivor (one socket answers one at a time)
                pairs = [(await WS.open(nodes[1].url), await WS.open(nodes[2].url)) for _ in paused]
                for (conv, _, _), pair in zip(paused, pairs, strict=True):
                    for ws in pair:  # following the turn, as the apps would
                        assert (await ws.request({"type": "subscribe", "conversation": conv}))["type"] != "error"
                nodes[0].proc.send_signal(signal.SIGKILL)
                nodes[0].proc.wait(10)
                answers = [
                    _approve(ws, conv, call_id)
                    for (conv, _, call_id), pair in zip(paused, pairs, strict=True)
                    for ws in pair
                ]
                results = await asyncio.gather(*answers)
                for n, ((conv, turn, call_id), (b, c)) in enumerate(zip(paused, pairs, strict=True)):
                    acks = results[2 * n : 2 * n + 2]
                    won = [r for r in acks if r.get("accepted") is True]
                    lost = [r for r in acks if r.get("error") == "already_resolved"]
                    assert len(won) == 1 and len(lost) == 1, acks
                    assert (await b.terminal(turn, timeout=30))["status"] == "completed"
                    ran = _query(
                        url,
                        "SELECT count(*) FROM messages WHERE conversation_id = %s AND tool_call_id = %s "
                        "AND role = 'tool'",
                        (conv, call_id),
                    )
                    assert ran == [(1,)], ran
                    await b.close()
                    await c.close()

            asyncio.run(go())
        finally:
            stop_all(*nodes)
