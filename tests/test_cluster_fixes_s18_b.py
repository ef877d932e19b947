"""Cluster fixes (docs/scale-out.md), continued from tests/test_cluster_fixes_s18.py: the tests that
start clusters of their own (real PostgreSQL databases, real `appserver serve` processes).

- A server judged gone while stopped tells its clients how their turns really ended (the one the
  survivor completed: completed), not a failure of each; a survivor ends a killed server's turn
  above every revision its clients saw, with the text kept.
- Servers starting together on a new database make one default agent.
- `run --approve` of a turn copied into PostgreSQL while it awaited an approval waits for its outcome.
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import start_serve
from tests.support.ws import WS
from tests.test_cluster_fixes_s18 import FAST, _create, _env, _start, _stop_all, _submit, _text_shown, _turns

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ 2: a fenced server's clients


def test_a_server_judged_gone_tells_its_client_how_its_turns_really_ended(tmp_path: Path) -> None:
    """Two inputs through A's WebSocket, the second queued behind the first; A stopped long enough
    to be judged gone; B interrupts the first and runs the second to completion. A, resumed, told
    its client both had failed (`taken_over`), the completed one too (a client then sends it
    again). Now it tells the outcome the database holds: interrupted, and completed with B's reply."""
    require_postgres()
    with temp_database("s18_fenced") as url:
        nodes = _start(tmp_path, url, 2, FAST)
        try:

            async def go() -> None:
                a = await WS.open(nodes[0].url)
                conv = await _create(a)
                first = await _submit(a, conv, "/slow 100")
                await _text_shown(a, first["turn_id"])
                second = await _submit(a, conv, "second")
                nodes[0].proc.send_signal(signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 30
                    while [t["status"] for t in _turns(url, conv)] != ["interrupted", "completed"]:
                        assert time.monotonic() < deadline, _turns(url, conv)
                        await asyncio.sleep(0.1)
                finally:
                    nodes[0].proc.send_signal(signal.SIGCONT)
                done = await a.terminal(second["turn_id"], timeout=20)
                assert done["status"] == "completed", done
                assert done["blocks"][-1]["text"] == "echo: second", done
                cut = await a.terminal(first["turn_id"], timeout=20)
                assert cut["status"] == "cancelled" and (cut["error"] or {}).get("kind") == "interrupted", cut
                rows = _turns(url, conv)
                assert [t["status"] for t in rows] == ["interrupted", "completed"], rows
                assert all(t["owner"] != rows[0]["owner"] or t is rows[0] for t in rows)  # B ran the second
                await a.close()

            asyncio.run(go())
        finally:
            _stop_all(nodes)


def test_a_survivor_ends_a_killed_servers_turn_with_its_text_at_a_higher_revision(tmp_path: Path) -> None:
    """A client watching through B a turn A runs; A is killed (-9); B settles it interrupted. Its
    end came at the revision stored when the turn started + 1 (below what the client had seen, so a
    client keeping the newest revision dropped it) and with no blocks (wiping the partial reply
    that history keeps). Now: above every revision seen, with the kept text."""
    require_postgres()
    with temp_database("s18_survivor") as url:
        nodes = _start(tmp_path, url, 2, FAST)
        try:

            async def go() -> None:
                a = await WS.open(nodes[0].url)
                conv = await _create(a)
                b = await WS.open(nodes[1].url)
                await b.request({"type": "subscribe", "conversation": conv})
                ack = await _submit(a, conv, "/slow 200")
                await b.expect(
                    lambda f: (
                        f["type"] == "turn_updated"
                        and f["snapshot"]["turn_id"] == ack["turn_id"]
                        and "w12" in "".join(x.get("text") or "" for x in f["snapshot"]["blocks"])
                    ),
                    timeout=20,
                )
                await asyncio.sleep(0.6)  # a draft checkpoint (draft_interval_s) holds some text
                nodes[0].kill()
                end = await b.terminal(ack["turn_id"], timeout=30)
                seen = max(s["revision"] for s in b.snapshots(ack["turn_id"]) if s is not end)
                assert end["status"] == "cancelled" and (end["error"] or {}).get("kind") == "interrupted", end
                assert end["revision"] > seen, (end["revision"], seen)
                text = "".join(x.get("text") or "" for x in end["blocks"] if x["type"] == "text")
                assert text.startswith("w1 w2") and "w12" in text, end["blocks"]
                history = await b.request({"type": "get_history", "conversation": conv})
                kept = [m for m in history["messages"] if m["role"] == "assistant"]
                assert kept and text.startswith(kept[-1]["content"][:20]), (kept, text)
                await a.close()
                await b.close()

            asyncio.run(go())
        finally:
            _stop_all(nodes)


def test_servers_starting_together_on_a_new_database_make_one_default_agent(tmp_path: Path) -> None:
    """Three servers started at once on an empty database: each found no agent and created one, so
    `assistant` named three agents and every request for it was refused as ambiguous."""
    require_postgres()
    for round_ in range(2):
        with temp_database(f"s18_first{round_}") as url:
            homes = [tmp_path / f"r{round_}n{i}" for i in range(3)]
            with ThreadPoolExecutor(3) as pool:
                started = list(pool.map(lambda h: start_serve(h, env=_env(h, url, **FAST)), homes))
            try:
                with psycopg.connect(url) as c:
                    names = [r[0] for r in c.execute("SELECT name FROM agents").fetchall()]
                assert names == ["assistant"], names
            finally:
                _stop_all(started)


def test_run_approve_of_a_copied_awaiting_turn_waits_for_its_outcome(tmp_path: Path) -> None:
    """An approval left waiting in a SQLite home, the home copied into PostgreSQL, two servers on
    it, `run --approve` through the second: the server that took the turn over re-sent its waiting
    state at a higher revision, and `run` printed that (still "awaiting approval", exit 0) as the
    outcome of the answer it had just given. It waits for the state in which the call is answered."""
    require_postgres()
    home = tmp_path / "sqlite-home"
    env = cli_env(home)
    assert run_cli(home, "agents", "create", "--name", "ops", "--tool", "clock=ask", env=env).code == 0
    sp = start_serve(home, env=env)
    try:
        paused = run_cli(home, "run", "--json", "--agent", "ops", "--conversation", "new", "/call clock {}", env=env)
    finally:
        sp.stop(timeout=10)
    assert paused.code == 0, paused.err
    conv, call = paused.json()["conversation_id"], paused.json()["pending"][0]["call_id"]
    with temp_database("s18_copied") as url:
        copied = run_cli(home, "store", "copy", "--to", url, env=env)
        assert copied.code == 0, copied.err
        nodes = _start(tmp_path, url, 2, FAST)
        try:
            second = nodes[1].home
            r = run_cli(second, "run", "--json", "--agent", "ops", "--conversation", conv, "--approve", call,
                        env=_env(second, url), timeout=60)  # fmt: skip
            assert r.code == 0, (r.code, r.out, r.err)
            out = r.json()
            assert out["status"] == "completed" and out["pending"] == [], out
            assert out["text"].startswith("clock -> "), out
        finally:
            _stop_all(nodes)
