"""A server cut off from the database tells its subscribers no turn failed that it could not write.

A (on a role of its own) runs a turn, with another queued behind it (sent through B), when its
connections are ended and it cannot reconnect for longer than its write waits: its turn's end could
not be written, and A told its WebSocket subscribers the turn `failed` (`store_unavailable`), and
the queued one too when its start could not be written, while B had taken the conversation over:
the running turn interrupted, the queued one run and completed. A client told so sends its input
again, and it runs twice. Now A's subscribers hear nothing of those turns while A cannot write,
and then the ends the database holds (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import websockets

from appserver.providers.echo import SLOW_WORD_INTERVAL_S
from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve_at
from tests.support.ws import WS
from tests.test_cluster import FAST, _create, _submit, _turns

pytestmark = pytest.mark.timeout(150)

PORTS = (22230, 22299)  # this file's listen ports (a cluster member is reached at its address)
SLOW_WORDS = 40  # A's turn: 2 s of model output, ended while A is cut off
# A's write waits: a connection within 1 s (the least `[store] connect_timeout_s` allows), so its
# turn's end fails within a few seconds of the cut (10 s by default).
CONNECT_TIMEOUT_S = "1"
CUT_S = 9.0  # long past both of A's failed writes: the running turn's end, the queued turn's start


def _serve(home: Path, url: str, port: int) -> ServeProcess:
    env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_STORE__CONNECT_TIMEOUT_S=CONNECT_TIMEOUT_S, **FAST)
    return start_serve_at(home, port, env, last=PORTS[1], step=2)


def _cut(url: str, role: str, limit: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"ALTER ROLE {role} CONNECTION LIMIT {limit}")
        if limit == 0:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))


def _ends(ws: WS, turn_id: str) -> list[dict[str, Any]]:
    return [s for s in ws.snapshots(turn_id) if s["status"] in ("completed", "cancelled", "failed")]


def test_a_cut_off_server_tells_its_subscribers_the_ends_the_database_holds(tmp_path: Path) -> None:
    require_postgres()
    role = f"cut_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with temp_database("cluster_s36c") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"CREATE ROLE {role} LOGIN")
            c.execute(f"GRANT ALL ON SCHEMA public TO {role}")
        nodes: list[ServeProcess] = []
        try:
            b = _serve(tmp_path / "b", url, PORTS[0])  # creates the schema
            nodes.append(b)
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
                c.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
            a = _serve(tmp_path / "a", url.replace("postgres@", f"{role}@", 1), PORTS[0] + 1)
            nodes.append(a)

            async def go() -> None:
                on_a, on_b = await WS.open(a.url), await WS.open(b.url)
                conv = await _create(on_a)
                for ws in (on_a, on_b):
                    reply = await ws.request({"type": "subscribe", "conversation": conv})
                    assert reply["type"] != "error", reply
                running = (await _submit(on_a, conv, f"/slow {SLOW_WORDS}"))["turn_id"]
                await on_a.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15)
                queued = (await _submit(on_b, conv, "queued via b"))["turn_id"]
                # A holds the conversation: it queued B's input behind its running turn
                await on_a.expect(
                    lambda f: f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == queued, timeout=15
                )
                cut_at = time.monotonic()
                _cut(url, role, 0)
                try:
                    # B takes the conversation over: A's turn interrupted, the queued one run there
                    assert (await on_b.terminal(running, timeout=20))["status"] == "cancelled"
                    assert (await on_b.terminal(queued, timeout=20))["status"] == "completed"
                    assert [r["status"] for r in _turns(url, conv)] == ["interrupted", "completed"]
                    # A's turn ended meanwhile, and A could not write its end
                    assert CUT_S > SLOW_WORDS * SLOW_WORD_INTERVAL_S + 4
                    with contextlib.suppress(TimeoutError):
                        await on_a.expect(lambda f: False, timeout=max(0.1, cut_at + CUT_S - time.monotonic()))
                    told = [(s["status"], s.get("error")) for s in _ends(on_a, running) + _ends(on_a, queued)]
                    assert not told, told  # was: failed, store_unavailable (the turn could not be saved)
                finally:
                    _cut(url, role, -1)
                # Back, A reads how the turns ended: the ends the database holds, never a failure
                got: dict[str, dict[str, Any]] = {}
                with contextlib.suppress(websockets.ConnectionClosed):  # A, judged gone, closes (1012) after
                    got[running] = await on_a.terminal(running, timeout=40)
                    got[queued] = await on_a.terminal(queued, timeout=40)
                assert [s["status"] for s in _ends(on_a, running)] == ["cancelled"], _ends(on_a, running)
                assert [s["status"] for s in _ends(on_a, queued)] == ["completed"], _ends(on_a, queued)
                assert got[queued]["blocks"][-1]["text"] == "echo: queued via b"
                for ws in (on_a, on_b):
                    with contextlib.suppress(websockets.ConnectionClosed):
                        await ws.close()

            asyncio.run(go())
        finally:
            for sp in nodes:
                sp.kill()
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                c.execute(f"DROP OWNED BY {role}")
                c.execute(f"DROP ROLE {role}")
