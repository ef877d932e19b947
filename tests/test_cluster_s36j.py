"""An HTTP request whose turn's end its server, cut off from its cluster, cannot read gets a bounded 503.

A (on a role of its own) runs a turn with two HTTP requests queued behind it (a non-stream one and
a stream, each with an Idempotency-Key) when it is cut off from the database for longer than the
bound: its running turn's end cannot be written, so the turns become mirrors read from the store
(tests/test_cluster_s36c.py). B takes the conversation over and runs the queued ones, but A's HTTP
clients heard nothing until A reached the database again (the whole cut, or their own timeout). Now
each is answered 503 `store_unavailable` once A could not read the end in time (`Cluster.unread_in`:
until the others may have taken it over, then a read wait), and the keyed retry on B answers with
the turn B ran, not a second run (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve_at
from tests.support.ws import WS
from tests.test_cluster import FAST, _create, _submit, _turns

pytestmark = pytest.mark.timeout(150)

PORTS = (23300, 23399)  # this file's listen ports (a cluster member is reached at its address)
CONNECT_TIMEOUT_S = "1"  # A's running turn's end fails within a few seconds of the cut
CUT_S = 40.0  # longer than the bound by far
# The bound at these timings: the write's connect wait (1 s, after the 2 s turn ended), the grace
# (0.5 s, gone by then), a read wait (5 s, READ_WAIT_MIN_S); with room for a loaded host.
ANSWERED_WITHIN_S = 20.0


def _serve(home: Path, url: str, port: int, timings: dict[str, str] = FAST) -> ServeProcess:
    env = cli_env(home, APPSERVER_STORE__URL=url, APPSERVER_STORE__CONNECT_TIMEOUT_S=CONNECT_TIMEOUT_S, **timings)
    return start_serve_at(home, port, env, last=PORTS[1], step=2)


@contextlib.contextmanager
def _pair(
    tmp_path: Path, role: str, timings: dict[str, str] = FAST
) -> Iterator[tuple[str, ServeProcess, ServeProcess]]:
    """(url, B, A): two servers on a new database, A on a role of its own (cut off by `_cut`)."""
    with temp_database("cluster_s36j") as url:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(f"CREATE ROLE {role} LOGIN")
            c.execute(f"GRANT ALL ON SCHEMA public TO {role}")
        nodes: list[ServeProcess] = []
        try:
            b = _serve(tmp_path / "b", url, PORTS[0], timings)  # creates the schema
            nodes.append(b)
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
                c.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
            a = _serve(tmp_path / "a", url.replace("postgres@", f"{role}@", 1), PORTS[0] + 1, timings)
            nodes.append(a)
            yield url, b, a
        finally:
            for sp in nodes:
                sp.kill()
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
                c.execute(f"DROP OWNED BY {role}")
                c.execute(f"DROP ROLE {role}")


def _cut(url: str, role: str, limit: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"ALTER ROLE {role} CONNECTION LIMIT {limit}")
        if limit == 0:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))


def _body(text: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "assistant", "messages": [{"role": "user", "content": text}], "stream": stream}


async def _non_stream(url: str, conv: str, key: str, text: str = "queued ns") -> tuple[float, Any]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=CUT_S + 30)
    headers = {"X-Conversation-Id": conv, "Idempotency-Key": key}
    try:
        reply = await client.chat.completions.create(**_body(text), extra_headers=headers)
        return time.monotonic(), ("ok", reply.choices[0].message.content)
    except openai.APIStatusError as exc:
        return time.monotonic(), (exc.status_code, exc.body)
    finally:
        await client.close()


async def _stream(url: str, conv: str, key: str) -> tuple[float, list[dict[str, Any]]]:
    headers = {"X-Conversation-Id": conv, "Idempotency-Key": key}
    chunks: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=CUT_S + 30) as client:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=_body("queued sse", stream=True), headers=headers
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return time.monotonic(), chunks


def _inputs(url: str, conv: str, text: str) -> list[str]:
    """The statuses of the conversation's turns that ran `text`."""
    rows = _turns(url, conv)
    return [r["status"] for r in rows if json.loads(r["input"]).get("content") == text]


def test_a_cut_off_servers_http_requests_get_a_503_in_bounded_time_and_a_keyed_retry_elsewhere(tmp_path: Path) -> None:
    require_postgres()
    role = f"cutj_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with _pair(tmp_path, role) as (url, b, a):
        if True:

            async def go() -> None:
                on_a = await WS.open(a.url)
                conv = await _create(on_a)
                reply = await on_a.request({"type": "subscribe", "conversation": conv})
                assert reply["type"] != "error", reply
                running = (await _submit(on_a, conv, "/slow 40"))["turn_id"]  # 2 s
                await on_a.expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15)
                ns_key, sse_key = f"ns-{role}", f"sse-{role}"
                ns = asyncio.ensure_future(_non_stream(a.url, conv, ns_key))
                sse = asyncio.ensure_future(_stream(a.url, conv, sse_key))
                # and one whose own turn runs on A when it is cut off (its conversation a new one)
                own_conv, own_key = f"own-{role}", f"own-{role}"
                own = asyncio.ensure_future(_non_stream(a.url, own_conv, own_key, "/slow 40"))
                deadline = time.monotonic() + 15
                while len(_turns(url, conv)) < 3 or not _turns(url, own_conv):  # both queued (A holds it)
                    assert time.monotonic() < deadline and not ns.done() and not sse.done()
                    await asyncio.sleep(0.05)
                cut_at = time.monotonic()
                _cut(url, role, 0)
                try:
                    ns_at, ns_got = await asyncio.wait_for(ns, CUT_S - 2)
                    sse_at, sse_got = await asyncio.wait_for(sse, CUT_S - 2)
                    own_at, own_got = await asyncio.wait_for(own, CUT_S - 2)
                    assert own_at - cut_at < ANSWERED_WITHIN_S, (own_at - cut_at, own_got)
                    assert own_got[0] == 503 and own_got[1]["code"] == "store_unavailable", own_got
                    # was: nothing until A reached the database again (the whole cut)
                    assert ns_at - cut_at < ANSWERED_WITHIN_S, (ns_at - cut_at, ns_got)
                    assert sse_at - cut_at < ANSWERED_WITHIN_S, (sse_at - cut_at, sse_got)
                    assert ns_got[0] == 503, ns_got
                    assert ns_got[1]["code"] == "store_unavailable", ns_got
                    assert "Idempotency-Key" in ns_got[1]["message"], ns_got
                    errors = [c["error"] for c in sse_got if "error" in c]
                    assert [e["code"] for e in errors] == ["store_unavailable"], sse_got
                    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in sse_got)
                    # B took the conversation over: the running turn interrupted, the queued ones run there
                    deadline = time.monotonic() + 20
                    while [r["status"] for r in _turns(url, conv)] != ["interrupted", "completed", "completed"]:
                        assert time.monotonic() < deadline, _turns(url, conv)
                        await asyncio.sleep(0.2)
                    # the keyed retry on B answers with the turn B ran: no second run
                    again_at, again = await _non_stream(b.url, conv, ns_key)
                    assert again == ("ok", "echo: queued ns"), again
                    assert _inputs(url, conv, "queued ns") == ["completed"], _turns(url, conv)
                    assert _inputs(url, conv, "queued sse") == ["completed"], _turns(url, conv)
                    assert running == _turns(url, conv)[0]["id"]
                    # its own turn interrupted by B's take-over: the keyed retry on B runs it anew, the input kept once
                    again_at, again = await _non_stream(b.url, own_conv, own_key, "/slow 40")
                    assert again[0] == "ok" and again[1], again
                    assert _inputs(url, own_conv, "/slow 40") == ["interrupted", "completed"], _turns(url, own_conv)
                finally:
                    _cut(url, role, -1)
                with contextlib.suppress(Exception):
                    await on_a.close()

            asyncio.run(go())


def test_the_turn_queued_behind_one_not_saved_is_heard_ending_after_it(tmp_path: Path) -> None:
    """A cut off for less than the grace (2.5 s, default heartbeats: nobody takes it over) while its
    turn ends, another queued behind: the first turn's end could not be written, so both are read
    from the store; back, A runs the queued one and settles the first. Its clients heard the queued
    turn complete seconds before the first one's end; now in the conversation's order."""
    require_postgres()
    role = f"cutk_{os.getpid()}_{time.monotonic_ns() % 100000}"
    with _pair(tmp_path, role, {}) as (url, b, a):

        async def go() -> None:
            on_a, on_b = await WS.open(a.url), await WS.open(b.url)
            conv = await _create(on_a)
            for ws in (on_a, on_b):
                reply = await ws.request({"type": "subscribe", "conversation": conv})
                assert reply["type"] != "error", reply
            first = (await _submit(on_a, conv, "/slow 40"))["turn_id"]
            second = (await _submit(on_a, conv, "queued on a"))["turn_id"]
            await asyncio.sleep(0.8)
            _cut(url, role, 0)
            try:
                await asyncio.sleep(2.5)
            finally:
                _cut(url, role, -1)
            for ws in (on_a, on_b):
                await ws.terminal(first, timeout=40)
                await ws.terminal(second, timeout=40)
                ends = [
                    f["snapshot"]["turn_id"]
                    for f in ws.seen
                    if f["type"] == "turn_updated" and f["snapshot"]["status"] in ("completed", "cancelled", "failed")
                ]
                assert ends == [first, second], (ends, first, second)
            for ws in (on_a, on_b):
                with contextlib.suppress(Exception):
                    await ws.close()

        asyncio.run(go())
