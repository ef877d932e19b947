"""Several `appserver serve` processes on one PostgreSQL database (issue 21), continued from
tests/test_cluster.py (split off so that neither file alone bounds the suite's wall time): a
server stopped, or cut off from the database, past its timeout is judged gone and stays fenced; an
outage of the whole database fences nobody; an answer sent as the holder dies reaches whoever
takes over."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
import websockets

from appserver.providers.echo import SLOW_WORD_INTERVAL_S
from tests.support.cli import run_cli
from tests.support.pg import require_postgres, temp_database, url_for
from tests.support.serve import ServeProcess
from tests.support.ws import WS
from tests.test_cluster import _create, _env, _instances, _start, _submit, _turns

pytestmark = pytest.mark.timeout(120)


async def _until_refused(client: openai.AsyncOpenAI, conversation_id: str, within_s: float = 15) -> None:
    """Send to the conversation through `client` until the server refuses as fenced (503
    `server_unavailable`); fails if it still takes requests after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        assert time.monotonic() < deadline, "the server still takes requests"
        try:
            await client.chat.completions.create(
                model="assistant",
                messages=[{"role": "user", "content": "to A"}],
                extra_headers={"X-Conversation-Id": conversation_id},
            )
        except openai.APIStatusError as exc:
            if exc.status_code == 503 and exc.code == "server_unavailable":
                return
        await asyncio.sleep(0.2)


def test_an_instance_judged_gone_while_stopped_runs_and_writes_nothing_more(tmp_path: Path) -> None:
    """A stopped for longer than instance_timeout_s (a frozen VM, a paused container) while its turn
    runs: B takes the conversation over and settles the turn as interrupted. A, resumed, went on:
    it wrote the turn a second time (completed, after interrupted), ran inputs sent to it beside
    B, and said ready. Judged gone, it now writes nothing of the turn, refuses requests with 503
    and fails /readyz."""
    require_postgres()
    with temp_database("cluster_fenced") as url:
        nodes = _start(tmp_path, url, 2)
        try:

            async def go() -> None:
                a = await WS.open(nodes[0].url)
                conv = await _create(a)
                running = await _submit(a, conv, "/slow 60")  # 3 s of output: it runs when A stops
                await a.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15)
                nodes[0].proc.send_signal(signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 20
                    while [r["status"] for r in _turns(url, conv)] != ["interrupted"]:
                        assert time.monotonic() < deadline, _turns(url, conv)
                        await asyncio.sleep(0.1)
                finally:
                    nodes[0].proc.send_signal(signal.SIGCONT)
                    resumed_at = time.monotonic()
                # A's turn goes on to its end (3 s in all) and tries to write it
                on_a = openai.AsyncOpenAI(base_url=nodes[0].url + "/v1", api_key="x", max_retries=0, timeout=30)
                await _until_refused(on_a, conv)
                async with httpx.AsyncClient() as http:
                    assert (await http.get(nodes[0].url + "/readyz")).status_code == 503
                    assert (await http.get(nodes[1].url + "/readyz")).status_code == 200
                # A's turn has ended by now: 5 s since A resumed (its whole 3 s turn and 2 s more)
                await asyncio.sleep(max(0.0, resumed_at + 5 - time.monotonic()))
                on_b = openai.AsyncOpenAI(base_url=nodes[1].url + "/v1", api_key="x", max_retries=0, timeout=30)
                reply = await on_b.chat.completions.create(
                    model="assistant",
                    messages=[{"role": "user", "content": "to B"}],
                    extra_headers={"X-Conversation-Id": conv},
                )
                assert reply.choices[0].message.content == "echo: to B"
                rows = _turns(url, conv)
                assert [(r["id"], r["status"]) for r in rows][0] == (running["turn_id"], "interrupted"), rows
                assert [r["status"] for r in rows] == ["interrupted", "completed"], rows
                with psycopg.connect(url) as c:
                    written = c.execute(
                        "SELECT count(*) FROM messages WHERE turn_id = %s AND role = 'assistant'", (running["turn_id"],)
                    ).fetchone()
                assert written is not None and written[0] <= 1, written  # the interrupted text, once at most
                await a.close()
                await on_a.close()
                await on_b.close()

            asyncio.run(go())
        finally:
            for sp in nodes:
                sp.proc.send_signal(signal.SIGCONT)
                sp.kill()


SLOW_WORDS = 100  # A's turn: 5 s of model output (the echo model's /slow)


def _sessions_of(url: str, role: str) -> list[int]:
    """The cluster sessions (not the pool's connections) the role `role` has in the database."""
    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pid FROM pg_stat_activity WHERE usename = %s AND application_name LIKE 'appserver serve inst_%%'",
            (role,),
        ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.parametrize("cut", ["every connection", "its session only"])
def test_an_instance_cut_off_from_the_database_comes_back_fenced(tmp_path: Path, cut: str) -> None:
    """A (on a role of its own) loses its connections and cannot reconnect for longer than 2.5
    heartbeats while its turn runs: B judges it gone, deletes its row and takes the conversation
    over. A reconnected and put its row back, live again beside B, and ran inputs sent to it;
    with only its session cut (its pool still connected) it went on running and writing turns
    the whole time. Now it refuses requests once its session is away longer than the grace, its
    turn is not written twice, and back it learns it was judged gone."""
    require_postgres()
    role = f"fenced_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with temp_database("cluster_cut") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"CREATE ROLE {role} LOGIN")
            c.execute(f"GRANT ALL ON SCHEMA public TO {role}")
        try:
            b = _start(tmp_path / "b", url, 1)[0]  # creates the schema
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
                c.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
            a = _start(tmp_path / "a", url.replace("postgres@", f"{role}@", 1), 1)[0]
            try:

                async def go() -> None:
                    ws = await WS.open(a.url)
                    conv = await _create(ws)
                    running = await _submit(ws, conv, f"/slow {SLOW_WORDS}")
                    # when A's model has streamed every word (A then ends its turn, or would)
                    streamed_at = time.monotonic() + SLOW_WORDS * SLOW_WORD_INTERVAL_S
                    await ws.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15)
                    with psycopg.connect(url, autocommit=True) as c:
                        c.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
                        only = (
                            " AND application_name LIKE 'appserver serve inst_%%'" if cut != "every connection" else ""
                        )
                        c.execute(
                            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s{only}", (role,)
                        )
                    on_a = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0, timeout=30)

                    try:
                        deadline = time.monotonic() + 20
                        while [r["status"] for r in _turns(url, conv)] != ["interrupted"]:
                            assert time.monotonic() < deadline, _turns(url, conv)
                            await asyncio.sleep(0.1)
                        if cut == "its session only":  # its pool still reaches the database
                            await _until_refused(on_a, conv)  # cut off: it refuses by itself
                    finally:
                        with psycopg.connect(url, autocommit=True) as c:
                            c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                    # back: it learns it was judged gone, and stays fenced (its session is back
                    # within a few of its 0.2 s retries; 2 s at most, as a fixed wait did)
                    back_by = time.monotonic() + 2
                    while not _sessions_of(url, role) and time.monotonic() < back_by:
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(min(0.5, max(0.0, back_by - time.monotonic())))
                    await _until_refused(on_a, conv)
                    # A's turn has ended by now (its model done for 2 s: any write of it has come)
                    await asyncio.sleep(max(0.0, streamed_at + 2 - time.monotonic()))
                    rows = _turns(url, conv)
                    assert [(r["id"], r["status"]) for r in rows] == [(running["turn_id"], "interrupted")], rows
                    assert len(_instances(url)) == 1  # A did not put its row back
                    # Read what A sent meanwhile: a client that stopped reading at its queue limit would
                    # not see A's close frame, and its close would wait out its 10 s close_timeout.
                    # Judged gone, A closes its sockets (1012) once their followed turns ended.
                    with contextlib.suppress(websockets.ConnectionClosed):
                        await ws.drain()
                    await ws.close()
                    await on_a.close()

                asyncio.run(go())
            finally:
                for sp in (a, b):
                    sp.kill()
        finally:
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                c.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
                c.execute(f"DROP OWNED BY {role}")
                c.execute(f"DROP ROLE {role}")


def _until_all_ready(nodes: list[ServeProcess], within: float = 20.0) -> None:
    """Until every server answers /readyz 200 (its session back); fails at once when one says it
    was judged gone (a fenced server never is ready again), or after `within` s."""
    deadline = time.monotonic() + within
    while True:
        ready = [httpx.get(sp.url + "/readyz", timeout=10) for sp in nodes]
        if all(r.status_code == 200 for r in ready):
            return
        assert time.monotonic() < deadline and not any("judged gone" in r.text for r in ready), [
            (r.status_code, r.text[:300]) for r in ready
        ]
        time.sleep(0.1)


def test_an_outage_of_the_whole_database_fences_no_server(tmp_path: Path) -> None:
    """The database refuses every connection for longer than 2.5 heartbeats (a restart), three
    times: every heartbeat is stale and no lock held when it is back, and the first server back
    judged the others gone before their sessions were back too (all of them fenced, a cluster that
    answers nothing until restarted). Each server back judges the others by the timeout only."""
    require_postgres()
    with temp_database("cluster_outage") as url:
        db = url.rsplit("/", 1)[1]
        # A 6 s timeout (0.2 s heartbeats): what is judged here is the lock-free grace of 2.5
        # heartbeats, never reached; with 3 s, a server whose session a loaded machine (CI beside
        # other work) brought back 2 s after the first one's was past its timeout, rightly gone.
        nodes = _start(tmp_path, url, 3, APPSERVER_STORE__INSTANCE_TIMEOUT_S="6")
        try:
            for _ in range(3):
                with psycopg.connect(url_for("postgres"), autocommit=True) as c:
                    c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
                    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))
                    time.sleep(1.0)  # 5 heartbeats: every heartbeat stale and every lock free when it is back
                    c.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
                _until_all_ready(nodes)
                assert len(_instances(url)) == 3
            for sp in nodes:
                reply = httpx.post(
                    sp.url + "/v1/chat/completions",
                    json={"model": "assistant", "messages": [{"role": "user", "content": "after"}]},
                    timeout=30,
                )
                assert reply.status_code == 200, reply.text
        finally:
            for sp in nodes:
                sp.kill()


def test_an_answer_sent_as_the_holder_dies_reaches_whoever_takes_over_and_subscribers_see_it(tmp_path: Path) -> None:
    """A turn paused on A; A is killed; at once B gets the approval and C an input for the same
    conversation: whichever of them takes the conversation over, the approval is applied once,
    both turns run, and a subscriber on B sees both (also when B itself took it over)."""
    require_postgres()
    with temp_database("cluster_answer") as url:
        admin = tmp_path / "admin"
        r = run_cli(admin, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(admin, url))
        assert r.code == 0, r.err
        nodes = _start(tmp_path, url, 3)
        try:

            async def go() -> None:
                a, b, c = [await WS.open(sp.url) for sp in nodes]
                conv = await _create(a, "careful")
                await b.request({"type": "subscribe", "conversation": conv})
                paused = await _submit(a, conv, "/call clock {}", agent="careful")
                request = await b.expect(lambda f: f["type"] == "approval_request", timeout=15)
                nodes[0].proc.send_signal(signal.SIGKILL)
                nodes[0].proc.wait(10)
                started = time.monotonic()
                answer, later = await asyncio.gather(
                    b.request(
                        {
                            "type": "approval_response",
                            "conversation": conv,
                            "decisions": [{"call_id": request["call_id"], "decision": "approve"}],
                        },
                        timeout=40,
                    ),
                    _submit(c, conv, "and then this", agent="careful"),
                )
                assert answer["type"] == "ack" and answer["results"][0]["accepted"] is True, answer
                assert time.monotonic() - started < 30
                done = await b.terminal(paused["turn_id"], timeout=30)
                assert done["status"] == "completed"
                assert [blk["status"] for blk in done["blocks"] if blk["type"] == "tool_call"] == ["completed"]
                after = await b.terminal(later["turn_id"], timeout=30)  # the subscriber on B sees it too
                assert after["status"] == "completed" and after["blocks"][-1]["text"] == "echo: and then this"
                rows = {t["id"]: t for t in _turns(url, conv)}
                assert [rows[paused["turn_id"]]["status"], rows[later["turn_id"]]["status"]] == ["completed"] * 2
                for ws in (b, c):
                    await ws.close()

            asyncio.run(go())
        finally:
            for sp in nodes:
                sp.kill()
        for sp in nodes[1:]:
            log = sp.proc.stderr.read() if sp.proc.stderr else ""
            assert "Traceback" not in log, log[-3000:]
