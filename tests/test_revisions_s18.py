"""Revisions of a turn strictly increase, also across a restart and a takeover (docs/protocol.md
"Ordering and delivery guarantees"): a client that keeps the highest revision it saw of each turn
across reconnects, and ignores any snapshot not above it, misses nothing and never shows a turn
running forever.

Real `appserver serve` processes killed with SIGKILL and started again on the same store (SQLite,
and PostgreSQL, where the restarted server takes the dead one's conversations over), a raw
WebSocket client; the client library's own reconnect; PostgreSQL's `turns.revision` migrated to
BIGINT (schema version 4).
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from appserver.client import ProtocolClient
from appserver.serverinfo import read_live_server
from appserver.store.pgschema import MIGRATIONS
from appserver.store.postgres import PostgresStore
from appserver.store.records import TurnCommit
from tests.support.cli import careful_home, cli_env
from tests.support.pg import temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import TERMINAL, WS

pytestmark = pytest.mark.timeout(90)

FILLERS = 30  # queued inputs cancelled ahead of the watched one: each moves it up a place


class Highest:
    """What a client keeps across reconnects: the highest revision it saw of each turn."""

    def __init__(self) -> None:
        self.revision: dict[str, int] = {}

    def note(self, frames: list[dict[str, Any]]) -> None:
        for snap in _snapshots(frames):
            turn_id = snap["turn_id"]
            self.revision[turn_id] = max(self.revision.get(turn_id, -1), snap["revision"])


def _snapshots(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for f in frames:
        if f.get("type") == "turn_updated":
            out.append(f["snapshot"])
        elif f.get("type") == "conversation_state" and f.get("active_turn"):
            out.append(f["active_turn"])
    return out


async def _read_for(ws: WS, seconds: float) -> None:
    """Take what the server sends for `seconds` (a running turn streams all along: no quiet)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            await ws.recv(left)
        except TimeoutError:
            return


def _kill(sp: ServeProcess) -> None:
    sp.proc.send_signal(signal.SIGKILL)
    sp.proc.wait(10)


def _shown_after(before: Highest, frames: list[dict[str, Any]], turn_id: str, *, strict: bool = True) -> None:
    """What was shown of `turn_id` after the restart, to a client that keeps the highest revision
    it saw before and ignores any snapshot not above it: its end is above (else the turn would
    run forever there), and so is every snapshot (`strict`), or every one but a mirror's view of
    the turn still running, read from the store while the dead server was not yet judged gone (its
    queue place or its last draft checkpoint: older than what was seen, and shown at the older
    revision it had, so a client ignores it)."""
    low = before.revision[turn_id]
    shown = [s for s in _snapshots(frames) if s["turn_id"] == turn_id]
    assert shown and shown[-1]["status"] in TERMINAL, shown
    assert shown[-1]["revision"] > low, (low, shown[-1])
    checked = [s for s in shown if strict or s["status"] != "running"]
    assert all(s["revision"] > low for s in checked), (low, [(s["revision"], s["phase"]) for s in shown])


async def _conversation(ws: WS, agent: str = "assistant") -> str:
    reply = await ws.request({"type": "create_conversation", "agent": agent})
    conv = str(reply["conversation"]["id"])
    state = await ws.request({"type": "subscribe", "conversation": conv})
    assert state["type"] == "conversation_state", state
    return conv


async def _submit(ws: WS, conv: str, text: str, agent: str = "assistant", **extra: Any) -> dict[str, Any]:
    ack = await ws.request({"type": "submit_input", "agent": agent, "conversation": conv, "input": text, **extra})
    assert ack["type"] == "ack", ack
    return ack


async def _queued_turn_before_kill(ws: WS, conv: str) -> dict[str, str]:
    """A running turn and one queued behind it, moved up FILLERS places (a revision each) by
    cancelling the inputs queued ahead of it: revisions the store never holds. Both sent with an
    idempotency key (turn id -> key: "running", "watched" name them in this order)."""
    keys = {}
    running = await _submit(ws, conv, "/slow 400", idempotency_key=(key := "run-" + uuid.uuid4().hex[:8]))
    keys[running["turn_id"]] = key
    await ws.expect(
        lambda f: (
            f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == running["turn_id"] and f["snapshot"]["blocks"]
        ),
        timeout=15,
    )
    fillers = [(await _submit(ws, conv, "/slow 3"))["turn_id"] for _ in range(FILLERS)]
    watched = await _submit(ws, conv, "/slow 8", idempotency_key=(key := "watched-" + uuid.uuid4().hex[:8]))
    keys[watched["turn_id"]] = key
    for turn_id in fillers:
        reply = await ws.request({"type": "cancel", "conversation": conv, "turn_id": turn_id})
        assert reply["type"] != "error", reply
    await _read_for(ws, 0.5)
    places = [s["queue_position"] for s in _snapshots(ws.seen) if s["turn_id"] == watched["turn_id"]]
    assert places and places[-1] == 1, places
    return keys


async def _after_restart(url: str, conv: str, keys: dict[str, str], before: Highest, *, strict: bool) -> None:
    """Subscribe again, look each turn up by its idempotency key, follow it to its end."""
    running, watched = keys
    ws = await WS.open(url)
    try:
        await ws.request({"type": "subscribe", "conversation": conv})
        texts = {running: "/slow 400", watched: "/slow 8"}
        for turn_id, key in keys.items():
            again = await _submit(ws, conv, texts[turn_id], idempotency_key=key)
            assert again["duplicate"] is True and again["turn_id"] == turn_id, again
        assert (await ws.terminal(watched, timeout=30))["status"] == "completed"
        assert (await ws.terminal(running, timeout=10))["status"] == "cancelled"  # interrupted
        await _read_for(ws, 0.3)
        for turn_id in keys:
            _shown_after(before, ws.seen, turn_id, strict=strict)
    finally:
        await ws.close()


def test_a_queued_turns_revisions_rise_across_kill9_and_restart(tmp_path: Path) -> None:
    """The tester's F3: a queued turn's revisions went back to 0 after a restart (requeued with a
    fresh controller), so a client keeping the highest revision dropped its updates and its end."""
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1")
    sp = start_serve(home, env=env)
    try:

        async def go() -> None:
            nonlocal sp
            ws = await WS.open(sp.url)
            conv = await _conversation(ws)
            keys = await _queued_turn_before_kill(ws, conv)
            before = Highest()
            before.note(ws.seen)
            assert before.revision[list(keys)[1]] >= FILLERS, before.revision
            _kill(sp)
            await ws.close()
            sp = start_serve(home, env=env)
            await _after_restart(sp.url, conv, keys, before, strict=True)

        asyncio.run(go())
    finally:
        sp.kill()


def test_a_paused_turns_revisions_rise_across_kill9_and_restart(tmp_path: Path) -> None:
    """A paused turn shows each answer as it comes (a revision the store does not hold); adopted
    again after a restart, its snapshots go on above them."""
    home = careful_home(tmp_path)
    env = cli_env(home)
    sp = start_serve(home, env=env)
    try:

        async def go() -> None:
            nonlocal sp
            ws = await WS.open(sp.url)
            conv = await _conversation(ws, "careful")
            calls = "\n".join(["/call clock {}"] * 3)
            turn = (await _submit(ws, conv, calls, agent="careful"))["turn_id"]
            requests = [await ws.expect(lambda f: f["type"] == "approval_request", timeout=10) for _ in range(3)]
            for r in requests[:2]:
                reply = await ws.request(
                    {
                        "type": "approval_response",
                        "conversation": conv,
                        "decisions": [{"call_id": r["call_id"], "decision": "approve"}],
                    }
                )
                assert reply["type"] != "error", reply
            await ws.expect(
                lambda f: (
                    f["type"] == "turn_updated"
                    and f["snapshot"]["turn_id"] == turn
                    and len(f["snapshot"]["pending"]) == 1
                ),
                timeout=10,
            )
            await _read_for(ws, 0.5)
            before = Highest()
            before.note(ws.seen)
            _kill(sp)
            await ws.close()
            sp = start_serve(home, env=env)
            ws = await WS.open(sp.url)
            try:
                state = await ws.request({"type": "subscribe", "conversation": conv})
                assert state["active_turn"]["turn_id"] == turn and state["active_turn"]["status"] == "awaiting", state
                reply = await ws.request(
                    {
                        "type": "approval_response",
                        "conversation": conv,
                        "decisions": [{"call_id": requests[2]["call_id"], "decision": "approve"}],
                    }
                )
                assert reply["type"] != "error", reply
                end = await ws.terminal(turn, timeout=20)
                assert end["status"] == "completed", end
                _shown_after(before, ws.seen, turn, strict=True)
            finally:
                await ws.close()

        asyncio.run(go())
    finally:
        sp.kill()


def test_the_client_delivers_one_terminal_snapshot_for_a_turn_interrupted_by_a_restart(tmp_path: Path) -> None:
    """appserver.client rebuilds a followed turn's end from history after a reconnect; the server's
    own (sent when the input is resent with its idempotency key) must not follow it: the terminal
    snapshot is the turn's last `turn_updated`, and revisions only rise on the connection."""
    home = tmp_path / "home"
    env = cli_env(home, APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1")
    sp = start_serve(home, env=env)

    def where() -> str | None:
        info = read_live_server(home / "server.json")
        return str(info["url"]) if info else None

    try:

        async def go() -> None:
            nonlocal sp
            c = await ProtocolClient.connect(sp.url, reconnect=True, reconnect_s=30, url_source=where)
            frames: list[dict[str, Any]] = []
            key = "lib-" + uuid.uuid4().hex[:8]
            ack = await c.submit("assistant", "/slow 400", conversation="new", idempotency_key=key)
            turn, conv = ack["turn_id"], ack["conversation_id"]

            async def read() -> None:
                async for f in c.frames():
                    frames.append(f)

            reader = asyncio.create_task(read())
            try:
                for _ in range(200):
                    if any(s["turn_id"] == turn and s["blocks"] for s in _snapshots(frames)):
                        break
                    await asyncio.sleep(0.05)
                _kill(sp)
                sp = start_serve(home, env=env)
                for _ in range(300):
                    if any(f.get("name") == "reconnected" for f in frames):
                        break
                    await asyncio.sleep(0.05)
                again = await c.submit("assistant", "/slow 400", conversation=conv, idempotency_key=key)
                assert again["duplicate"] is True and again["turn_id"] == turn, again
                await asyncio.sleep(1.0)
            finally:
                reader.cancel()
                await c.close()
            mine = [s for s in _snapshots(frames) if s["turn_id"] == turn]
            ends = [s for s in mine if s["status"] in TERMINAL]
            assert len(ends) == 1, [(s["revision"], s["status"], s.get("resumed_from")) for s in ends]
            assert mine[-1] is ends[0]
            revisions = [s["revision"] for s in mine]
            assert revisions == sorted(set(revisions)), revisions

        asyncio.run(go())
    finally:
        sp.kill()


# ------------------------------------------------------------------ PostgreSQL


def _v3(url: str) -> None:
    """A database as a server of schema version 3 left it, with a turn in it."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version, script in MIGRATIONS:
            if version > 3:
                break
            c.execute(script)  # type: ignore[arg-type]
            c.execute("INSERT INTO schema_version VALUES (%s)", (version,))
        c.execute("INSERT INTO agents(id, name, model, created_at, updated_at) VALUES ('agt_x', 'x', 'echo', 1, 1)")
        c.execute("INSERT INTO conversations(id, agent_id, created_at, updated_at) VALUES ('conv_x', 'agt_x', 1, 1)")
        c.execute(
            "INSERT INTO turns(id, conversation_id, agent_id, status, revision, created_at) "
            "VALUES ('turn_x', 'conv_x', 'agt_x', 'queued', 7, 1)"
        )


def _revision_type(url: str) -> str:
    with psycopg.connect(url) as c:
        row = c.execute(
            "SELECT data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'turns' AND column_name = 'revision'"
        ).fetchone()
    assert row is not None
    return str(row[0])


def test_postgres_revision_column_migrates_to_bigint_and_keeps_clock_revisions() -> None:
    """Schema version 4: `turns.revision` is a BIGINT. Several servers starting at once on a
    version 3 database migrate it once; a revision above 2**31 is stored and read back."""
    with temp_database("rev_bigint") as url:
        _v3(url)
        assert _revision_type(url) == "integer"
        stores = [PostgresStore(url) for _ in range(3)]

        async def go() -> None:
            await asyncio.gather(*(s.open() for s in stores))
            try:
                store = stores[0]
                before = await store.get_turn("turn_x")
                assert before is not None and before.revision == 7
                big = 1_800_000_000_000_123  # a clock revision (restore.py): microseconds since 1970
                await store.mark_turn_running("turn_x", "inst_test", big)
                running = await stores[1].get_turn("turn_x")
                assert running is not None and running.revision == big
                end = 2**53 - 1
                await store.commit_turn("conv_x", TurnCommit("turn_x", "completed", "end_turn", [], revision=end))
                done = await stores[2].get_turn("turn_x")
                assert done is not None and (done.status, done.revision) == ("completed", end)
            finally:
                for s in stores:
                    await s.close()

        asyncio.run(go())
        assert _revision_type(url) == "bigint"
        with psycopg.connect(url) as c:
            versions = [r[0] for r in c.execute("SELECT version FROM schema_version ORDER BY 1").fetchall()]
        assert versions == [v for v, _ in MIGRATIONS]


def test_postgres_queued_turn_taken_over_after_kill9_goes_on_above_what_was_shown(tmp_path: Path) -> None:
    """On PostgreSQL the restarted server is a new instance: it takes the dead one's conversation
    over (the cluster's sweep), settles the running turn and requeues the queued one, which runs
    from a clock revision, stored as it starts (a BIGINT)."""
    with temp_database("rev_takeover") as url:
        home = tmp_path / "home"
        env = cli_env(
            home,
            APPSERVER_STORE__URL=url,
            APPSERVER_STORE__HEARTBEAT_S="0.2",
            APPSERVER_STORE__INSTANCE_TIMEOUT_S="2",
            APPSERVER_LIMITS__DRAFT_INTERVAL_S="0.1",
        )
        sp = start_serve(home, env=env)  # creates the agent `assistant` on a database with none
        watched = ""
        try:

            async def go() -> None:
                nonlocal sp, watched
                ws = await WS.open(sp.url)
                conv = await _conversation(ws)
                keys = await _queued_turn_before_kill(ws, conv)
                watched = list(keys)[1]
                before = Highest()
                before.note(ws.seen)
                _kill(sp)
                await ws.close()
                sp = start_serve(home, env=env)
                await _after_restart(sp.url, conv, keys, before, strict=False)

            asyncio.run(go())
            with psycopg.connect(url) as c:
                row = c.execute("SELECT status, revision FROM turns WHERE id = %s", (watched,)).fetchone()
            assert row is not None and row[0] == "completed" and row[1] > 2**31, row
        finally:
            sp.kill()
