"""Approvals answered through a server that does not hold the conversation (docs/protocol.md
`approval_response`, `approval_resolved`; docs/scale-out.md "Answers anywhere"): real PostgreSQL,
two real `appserver serve` processes, real WebSocket clients.

A submits on node 0, which holds the conversation and pauses its turn for three approvals; B
subscribes through node 1 and is shown them. Then B's answer loses a race:

- to A's cancel sent at the same moment: B got an error frame `not_awaiting` (node 1 read the calls
  while node 0, which took the turn out of its pause at once, was still writing their results)
  instead of its `ack` with `accepted: false, error: "already_resolved"` per call;
- to A's cancel (or approval) answered just before: B, shown the requests, often got no
  `approval_resolved` (a snapshot settling them arrived while its answer was in flight and left
  them to it; a losing answer told nobody, and the ended turn was no longer followed).

Every round checks the whole contract: B's ack has one result per call, accepted or
`already_resolved`; each connection shown a call gets exactly one `approval_resolved` for it,
except the one whose answer settled it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(150)

CALLS = 3  # calls in the paused turn: a cancel writes their results one by one (the race's window)
ROUNDS = 4
WAIT_S = 30.0
TOLD_WAIT_S = 20.0  # an approval_resolved comes with the snapshot settling its call, or with the ack


def _env(home: Path, url: str) -> dict[str, str]:
    # nothing here kills a server: a long instance timeout keeps a loaded machine from fencing one
    return cli_env(
        home, APPSERVER_STORE__URL=url, APPSERVER_STORE__HEARTBEAT_S="0.2", APPSERVER_STORE__INSTANCE_TIMEOUT_S="20"
    )


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("s22")
    with temp_database("s22_approvals") as url:
        admin = tmp / "admin"
        made = run_cli(admin, "agents", "create", "--name", "ops", "--tool", "clock=ask", env=_env(admin, url))
        assert made.code == 0, made.err
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                started.append(start_serve(home, env=_env(home, url)))
            yield started
        finally:
            for sp in started:
                try:
                    sp.stop(timeout=10)
                except Exception:
                    pass
                sp.kill()


def _logs(nodes: list[ServeProcess]) -> str:
    return "".join(
        f"--- node{i}\n{sp.proc.stderr.so_far()[-4000:]}"  # type: ignore[union-attr]
        for i, sp in enumerate(nodes)
        if sp.proc.stderr is not None
    )


async def _seen_or_next(ws: WS, pred: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S) -> dict[str, Any]:
    for f in ws.seen:
        if pred(f):
            return f
    return await ws.expect(pred, timeout)


def _resolved(ws: WS, conv: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in ws.seen:
        if f["type"] == "approval_resolved" and f["conversation_id"] == conv:
            out.setdefault(f["call_id"], []).append(f)
    return out


async def _told(ws: WS, conv: str, calls: list[str], who: str) -> None:
    """Wait (bounded) until `ws` got an approval_resolved for each of `calls`."""
    for call_id in calls:
        try:
            await _seen_or_next(
                ws,
                lambda f, c=call_id: (
                    f["type"] == "approval_resolved" and f["conversation_id"] == conv and f["call_id"] == c
                ),
                timeout=TOLD_WAIT_S,
            )
        except TimeoutError:
            got = {c: [f["status"] for f in frames] for c, frames in _resolved(ws, conv).items()}
            raise AssertionError(
                f"{who} got no approval_resolved for {call_id} in {TOLD_WAIT_S:.0f} s; for calls {calls} it got {got}"
            ) from None


async def _paused(nodes: list[ServeProcess]) -> tuple[WS, WS, str, str, list[str]]:
    """A on node 0 (the holder) with a turn paused for CALLS approvals; B on node 1 shown them all."""
    a = await WS.open(nodes[0].url)
    b = await WS.open(nodes[1].url)
    text = "\n".join(["/call clock {}"] * CALLS)
    ack = await a.request({"type": "submit_input", "agent": "ops", "conversation": "new", "input": text})
    assert ack["type"] == "ack", ack
    conv, turn = ack["conversation_id"], ack["turn_id"]
    snap = await a.expect(
        lambda f: (
            f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == turn and f["snapshot"]["status"] != "running"
        ),
        timeout=WAIT_S,
    )
    assert snap["snapshot"]["status"] == "awaiting", snap
    calls = [p["call_id"] for p in snap["snapshot"]["pending"]]
    assert len(calls) == CALLS, snap
    state = await b.request({"type": "subscribe", "conversation": conv}, timeout=WAIT_S)
    assert state["type"] == "conversation_state", state
    for call_id in calls:  # A (the submitter) and B (a subscriber elsewhere) are shown every call
        for ws in (a, b):
            await _seen_or_next(ws, lambda f, c=call_id: f["type"] == "approval_request" and f["call_id"] == c)
    return a, b, conv, turn, calls


async def _check_told_once(
    a: WS, b: WS, conv: str, turn: str, calls: list[str], won_by_a: set[str], won_by_b: set[str], why: str
) -> None:
    """Every connection shown a call gets one approval_resolved for it, but the one whose answer won it."""
    await a.terminal(turn, timeout=WAIT_S)
    await b.terminal(turn, timeout=WAIT_S)
    await _told(a, conv, [c for c in calls if c not in won_by_a], f"{why}: A")
    await _told(b, conv, [c for c in calls if c not in won_by_b], f"{why}: B")
    await a.drain(0.3)
    await b.drain(0.3)
    for name, ws, won in (("A", a, won_by_a), ("B", b, won_by_b)):
        told = _resolved(ws, conv)
        for call_id in calls:
            frames = told.get(call_id, [])
            expected = 0 if call_id in won else 1
            assert len(frames) == expected, (why, name, call_id, frames)
            for f in frames:
                assert f["turn_id"] == turn, (why, name, f)


def _check_ack(reply: dict[str, Any], calls: list[str], why: str) -> set[str]:
    """B's ack: one result per call, accepted or already_resolved. The calls it won."""
    assert reply["type"] == "ack", (why, reply)
    results = {r["call_id"]: r for r in reply["results"]}
    assert sorted(results) == sorted(calls), (why, reply)
    for r in results.values():
        assert r["accepted"] is True or r.get("error") == "already_resolved", (why, reply)
    return {c for c, r in results.items() if r["accepted"] is True}


def test_an_answer_elsewhere_racing_a_cancel_gets_its_ack(nodes: list[ServeProcess]) -> None:
    """A cancels on the holder while B answers through node 1 at the same moment: B gets its ack
    (each call `already_resolved`, or accepted if its answer got there first), never a
    `not_awaiting` error; A and B are each told every call they did not settle, once."""

    async def go() -> None:
        for n in range(ROUNDS):
            why = f"round {n}"
            a, b, conv, turn, calls = await _paused(nodes)
            answer = {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": c, "decision": "approve"} for c in calls],
            }
            cancelled, reply = await asyncio.gather(
                a.request({"type": "cancel", "conversation": conv}, timeout=WAIT_S), b.request(answer, timeout=WAIT_S)
            )
            assert cancelled["type"] == "ack", (why, cancelled)
            won_by_b = _check_ack(reply, calls, why)
            await _check_told_once(a, b, conv, turn, calls, set(), won_by_b, why)
            await a.close()
            await b.close()

    try:
        asyncio.run(go())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_logs(nodes)}") from None


def test_a_losing_answer_elsewhere_is_told_how_each_call_was_settled(nodes: list[ServeProcess]) -> None:
    """B's answer through node 1 comes just after A's cancel (or A's own approval) on the holder:
    its ack says `already_resolved` per call, and B, shown the requests, gets one
    `approval_resolved` per call (`cancelled`, or `approved` by A); A gets none for the calls its
    own answer settled, and one per call the cancel closed."""

    async def go() -> None:
        for n in range(ROUNDS):
            first = "cancel" if n % 2 == 0 else "approve"
            why = f"round {n}: {first} on the holder, then B's answer elsewhere"
            a, b, conv, turn, calls = await _paused(nodes)
            if first == "cancel":
                done = await a.request({"type": "cancel", "conversation": conv}, timeout=WAIT_S)
                assert done["type"] == "ack" and done["cancelled"] is True, (why, done)
                won_by_a: set[str] = set()
            else:
                done = await a.request(
                    {
                        "type": "approval_response",
                        "conversation": conv,
                        "decisions": [{"call_id": c, "decision": "approve"} for c in calls],
                    },
                    timeout=WAIT_S,
                )
                assert done["type"] == "ack" and all(r["accepted"] for r in done["results"]), (why, done)
                won_by_a = set(calls)
            reply = await b.request(
                {
                    "type": "approval_response",
                    "conversation": conv,
                    "decisions": [{"call_id": c, "decision": "deny"} for c in calls],
                },
                timeout=WAIT_S,
            )
            assert _check_ack(reply, calls, why) == set(), (why, reply)
            await _check_told_once(a, b, conv, turn, calls, won_by_a, set(), why)
            expected = "cancelled" if first == "cancel" else "approved"
            for call_id, frames in _resolved(b, conv).items():
                assert [f["status"] for f in frames] == [expected], (why, call_id, frames)
            await a.close()
            await b.close()

    try:
        asyncio.run(go())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_logs(nodes)}") from None
