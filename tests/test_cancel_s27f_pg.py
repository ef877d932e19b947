"""Session 27 (f), on a PostgreSQL store: a cancel acknowledged `cancelled: true` holds across a
kill -9 right after it (tests/test_cancel_s27f.py has the finding and the SQLite cases).

A PostgreSQL server is a member of a cluster (of one here): the restarted server takes the killed
one's conversations over once it is judged gone (a few seconds), a running turn through the sweep
(`Kernel._take_over`), a paused one whose cancel was saved as its conversation is found orphaned
too (`Cluster.orphaned_conversations`), and ends each cancelled. The store is held busy (a table
lock) as the cancels arrive: the acknowledgement waits for the cancel's own write.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from appserver.runtime.settle import CANCELLED_UNANSWERED
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import start_serve
from tests.support.ws import WS
from tests.test_cancel_s27f import ASK, OPEN, SLOW, Hold, cancel_then_kill, start_turns, wait_paused, wait_streaming

pytestmark = pytest.mark.timeout(120)

SETTLE_S = 60.0  # the killed server is judged gone first (~7 s), then its turns are taken over


def hold_pg(url: str) -> Hold:
    """A lock on the turns table that keeps every write of a turn waiting (not its reads)."""

    def hold() -> Callable[[], None]:
        conn = psycopg.connect(url)
        conn.execute("LOCK TABLE turns IN EXCLUSIVE MODE")
        return conn.close  # (rolls the transaction back)

    return hold


def settled(url: str, turn_ids: list[str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The turns' rows once none is open, and their messages."""
    deadline = time.monotonic() + SETTLE_S
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        while True:
            rows = {r["id"]: r for r in conn.execute("SELECT * FROM turns WHERE id = ANY(%s)", (turn_ids,))}
            if all(r["status"] not in OPEN for r in rows.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        messages = conn.execute("SELECT * FROM messages WHERE turn_id = ANY(%s) ORDER BY id", (turn_ids,)).fetchall()
    return rows, messages


def test_acknowledged_cancels_of_paused_and_running_turns_hold_across_a_kill_9_on_postgresql(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("cancel27f") as url:
        home = tmp_path / "home"
        # heartbeats of 0.5 s: the restarted server takes the killed one's turns over in under 2 s
        # (3.5 heartbeats up, the killed one's heartbeat 2.5 old), not 7 s (the instance timeout stays 30 s)
        env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_STORE__HEARTBEAT_S="0.5")
        made = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=env)
        assert made.code == 0, made.err
        sp = start_serve(home, env=env)

        async def go() -> tuple[dict[str, str], set[str]]:
            ws = await WS.open(sp.url)
            try:
                paused = await start_turns(ws, ASK, 4)
                running = await start_turns(ws, SLOW, 4)
                await wait_paused(ws, paused)
                await wait_streaming(ws, running)

                # killed once a paused and a running turn are acknowledged (PostgreSQL's ordered writer
                # saves their cancels in one group once the lock goes: all acks come at once)
                def both(acked: set[str]) -> bool:
                    return bool(acked & paused.keys() and acked - paused.keys())

                turns = {**paused, **running}
                return await cancel_then_kill(ws, sp, turns, busy=hold_pg(url), enough=both), set(paused)
            finally:
                await ws.close()

        try:
            acked, paused = asyncio.run(go())
        finally:
            sp.kill()
        assert acked, "no cancel was acknowledged"
        restarted = start_serve(home, env=env)
        try:
            rows, messages = settled(url, list(acked))
        finally:
            restarted.stop()
        assert {t: r["status"] for t, r in rows.items()} == {t: "cancelled" for t in acked}
        assert all(r["error"] is None for r in rows.values())
        for turn_id, seen in acked.items():
            mine = [m for m in messages if m["turn_id"] == turn_id]
            if turn_id in paused:  # the unanswered call: cancelled, never run
                tools = [(m["name"], json.loads(m["content"]), m["is_error"]) for m in mine if m["role"] == "tool"]
                assert tools == [("clock", CANCELLED_UNANSWERED, True)], mine
            else:  # the reply so far, kept as cancelled text
                replies = [m for m in mine if m["role"] == "assistant"]
                assert [r["completion_status"] for r in replies] == ["cancelled"], mine
                assert seen and json.loads(replies[0]["content"]).startswith(seen), (replies, seen)
