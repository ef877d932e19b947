"""What each connection is shown of a paused turn while other things happen around it, on both stores
(found by an outside test on PostgreSQL, whose queries suspend the hub where SQLite's do not):

* approval_resolved reaches every connection shown the request: a snapshot of a turn queued behind
  the paused one took the call's viewers out of `announced` while it read the store, and a subscribe
  meanwhile left the earlier viewers out of it for good;
* an answer naming an unknown call (it republishes the paused turn) never shows a connection the
  same approval_request again: the paused turn's round found the call's viewers taken out and
  announced it to everyone once more;
* a turn's revisions strictly rise on a connection, also after an `unsubscribe` and a submit (or a
  subscribe) that joins it again: the paused turn's snapshot it had was sent again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import temp_database
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp(f"ws_hub_{request.param}") / "home"

    def start(env: dict[str, str]) -> Iterator[ServeProcess]:
        r = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env)
        assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp

    if request.param == "sqlite":
        yield from start(cli_env(home))
        return
    with temp_database("ws_hub_s21") as url:
        yield from start(cli_env(home, APPSERVER_STORE__URL=url))


def violations(ws: WS) -> list[str]:
    """What a connection must never see: a turn's revision that does not rise, an approval_request
    shown twice within one join (a `subscribe` repeats them; a join after an `unsubscribe` shows
    them again), approval_resolved of a call it was not shown, or twice."""
    bad: list[str] = []
    revision: dict[str, int] = {}
    shown: dict[str, int] = {}
    ever: set[str] = set()
    resolved: set[str] = set()
    for f in ws.seen:
        kind = f["type"]
        if kind == "conversation_state" or (
            kind == "ack" and any("was_subscribed" in r for r in f.get("results") or [])
        ):
            shown = {}
        elif kind == "turn_updated":
            snap = f["snapshot"]
            before = revision.get(snap["turn_id"])
            if before is not None and snap["revision"] <= before:
                bad.append(f"{snap['turn_id']}: revision {snap['revision']} after {before} ({snap['status']})")
            revision[snap["turn_id"]] = snap["revision"]
        elif kind == "approval_request":
            shown[f["call_id"]] = shown.get(f["call_id"], 0) + 1
            ever.add(f["call_id"])
            if shown[f["call_id"]] > 1:
                bad.append(f"approval_request {f['call_id']} again within one join")
        elif kind == "approval_resolved":
            if f["call_id"] not in ever:
                bad.append(f"approval_resolved {f['call_id']} never shown")
            if f["call_id"] in resolved:
                bad.append(f"approval_resolved {f['call_id']} twice")
            resolved.add(f["call_id"])
    return bad


def count(ws: WS, kind: str, call_id: str) -> int:
    return sum(1 for f in ws.seen if f["type"] == kind and f.get("call_id") == call_id)


async def answers(ws: WS, n: int) -> list[dict[str, Any]]:
    """The next `n` replies (frames with a request_id), whatever comes between them."""
    return [await ws.expect(lambda f: "request_id" in f) for _ in range(n)]


@pytest.mark.parametrize("around", ["queued turns and subscribes", "answers to unknown calls and subscribes"])
def test_viewers_of_a_paused_turn_are_shown_its_approval_once_and_told_once(server: ServeProcess, around: str) -> None:
    async def go() -> None:
        owner = await WS.open(server.url)
        first = await owner.request(
            {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
        )
        conv, turn = first["conversation_id"], first["turn_id"]
        call_id = (await owner.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        watchers = [await WS.open(server.url) for _ in range(3)]
        for w in watchers:
            await w.request({"type": "subscribe", "conversation": conv})
        q, again, z = await WS.open(server.url), await WS.open(server.url), await WS.open(server.url)
        late = [await WS.open(server.url) for _ in range(8)]

        def submit(i: int) -> dict[str, Any]:
            return {"type": "submit_input", "agent": "careful", "conversation": conv, "input": f"hi {i}"}

        subscribe = {"type": "subscribe", "conversation": conv}
        if around == "queued turns and subscribes":
            # Turns queued behind the paused one (each one's snapshot is settled against the calls
            # shown, reading the store) while a connection subscribes again and again and others
            # subscribe (each subscribe adds it to the call's viewers).
            n = 8
            await asyncio.gather(
                *(q.send({**submit(i), "request_id": f"q{i}"}) for i in range(n)),
                *(again.send({**subscribe, "request_id": f"r{i}"}) for i in range(40)),
                *(s.send({**subscribe, "request_id": "s"}) for s in late),
            )
            queued = [ack["turn_id"] for ack in await answers(q, n)]
            assert len(await answers(again, 40)) == 40
        else:
            # Turns queued behind the paused one, then at once: answers naming a call nobody has
            # (each republishes the paused turn) and new connections subscribing.
            queued = [(await q.request(submit(i)))["turn_id"] for i in range(3)]
            for tid in queued:  # published: the hub holds their snapshots besides the paused one's
                await watchers[0].expect(
                    lambda f, tid=tid: f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == tid
                )
            unknown = {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": "call_nobody_has_this", "decision": "approve"}],
            }
            await asyncio.gather(
                *(z.send({**unknown, "request_id": f"u{i}"}) for i in range(5)),
                *(s.send({**subscribe, "request_id": "s"}) for s in late),
            )
            for reply in await answers(z, 5):
                assert reply["results"][0]["error"] == "unknown_call", reply
            await again.request(subscribe)
        for s in late:
            state = (await answers(s, 1))[0]
            assert [p["call_id"] for p in state["pending_approvals"]] == [call_id], state

        won = await owner.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": call_id, "decision": "approve"}],
            }
        )
        assert won["results"][0]["accepted"] is True, won
        viewers = [*watchers, q, *late]
        for ws in [owner, again, *viewers]:
            assert (await ws.terminal(turn))["status"] == "completed"  # after the approval_resolved
            # and everything after it: the queued turns run in turn, the last one ends last
            assert (await ws.terminal(queued[-1]))["status"] == "completed"
        # each viewer: shown once (`again`: once per subscribe), told once; the winner by its ack only
        told = [count(ws, "approval_resolved", call_id) for ws in [again, *viewers]]
        shown = [count(ws, "approval_request", call_id) for ws in viewers]
        assert (told, shown) == ([1] * (1 + len(viewers)), [1] * len(viewers))
        for ws in [owner, again, *viewers]:
            assert violations(ws) == []
        assert (count(owner, "approval_request", call_id), count(owner, "approval_resolved", call_id)) == (1, 0)
        assert [f for f in z.seen if f["type"] in ("approval_request", "approval_resolved", "turn_updated")] == []
        for ws in [owner, z, again, *viewers]:
            await ws.close()

    asyncio.run(go())


def test_revisions_rise_on_a_connection_that_leaves_and_joins_again(server: ServeProcess) -> None:
    async def go() -> None:
        a = await WS.open(server.url)
        first = await a.request(
            {"type": "submit_input", "agent": "careful", "conversation": "new", "input": "/call clock {}"}
        )
        conv, turn = first["conversation_id"], first["turn_id"]
        call_id = (await a.expect(lambda f: f["type"] == "approval_request"))["call_id"]
        # leave (the watch may be released: nobody else watches), then join again by a submit that
        # queues behind the paused turn: shown the request again, not the snapshot it has
        assert (await a.request({"type": "unsubscribe", "conversation": conv}))["results"][0]["was_subscribed"]
        second = await a.request({"type": "submit_input", "agent": "careful", "conversation": conv, "input": "hi"})
        assert second["queue_position"] == 1, second
        await a.expect(lambda f: f["type"] == "approval_request" and f["call_id"] == call_id)
        # and again by a subscribe: the state answers it, no older turn_updated follows
        assert (await a.request({"type": "unsubscribe", "conversation": conv}))["results"][0]["was_subscribed"]
        state = await a.request({"type": "subscribe", "conversation": conv})
        assert state["active_turn"]["turn_id"] == turn and state["active_turn"]["status"] == "awaiting", state
        await a.expect(lambda f: f["type"] == "approval_request" and f["call_id"] == call_id)
        denied = await a.request(
            {"type": "approval_response", "conversation": conv, "decisions": [{"call_id": call_id, "decision": "deny"}]}
        )
        assert denied["results"][0]["accepted"] is True, denied
        assert (await a.terminal(turn))["status"] == "completed"
        assert (await a.terminal(second["turn_id"]))["status"] == "completed"
        assert violations(a) == []
        assert [s["status"] for s in a.snapshots(turn)].count("awaiting") == 1, a.snapshots(turn)
        await a.close()

    asyncio.run(go())
