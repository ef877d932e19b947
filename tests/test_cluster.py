"""Several `appserver serve` processes on one PostgreSQL database (issue 21): any instance takes any
request; a conversation runs on one instance at a time, in order; everyone sees its turns live;
answers given anywhere resume it where it runs; a killed instance's work is taken over.
(Servers stopped or cut off past their timeout, and outages of the whole database: test_cluster_b.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest

from tests.openai_schema import sse_payloads
from tests.support.cli import cli_env, run_cli
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, start_serve
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

# Fast heartbeats so that failover happens within seconds in a test (defaults: 2 s and 30 s).
FAST = {"APPSERVER_STORE__HEARTBEAT_S": "0.2", "APPSERVER_STORE__INSTANCE_TIMEOUT_S": "3"}
QUEUE_MAX = 12  # the module cluster's [limits] queue_max


@dataclass
class Cluster:
    url: str
    nodes: list[ServeProcess]


def _env(home: Path, url: str) -> dict[str, str]:
    return cli_env(home, APPSERVER_STORE__URL=url, **FAST)


def _start(tmp: Path, url: str, n: int, **env: str) -> list[ServeProcess]:
    nodes = []
    for i in range(n):
        home = tmp / f"node{i}"
        nodes.append(start_serve(home, env={**_env(home, url), **env}))
    return nodes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("cluster")
    with temp_database("cluster") as url:
        home = tmp / "admin"
        r = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask", env=_env(home, url))
        assert r.code == 0, r.err
        # Nothing here kills a server: a longer instance timeout keeps a loaded machine's late
        # heartbeat from fencing one (3 s did, when the suite shared two cores with much else), and
        # nothing waits for a failover, so a heartbeat a second (not 0.2 s): the three servers and
        # the database do a fifth of the beats (notifications, the sweep and catch-up run as fast).
        nodes = _start(
            tmp,
            url,
            3,
            APPSERVER_LIMITS__QUEUE_MAX=str(QUEUE_MAX),
            APPSERVER_STORE__HEARTBEAT_S="1",
            APPSERVER_STORE__INSTANCE_TIMEOUT_S="15",
        )
        try:
            yield Cluster(url, nodes)
        finally:
            for sp in nodes:
                sp.stop()
            for sp in nodes:
                sp.kill()


def _turns(url: str, conversation_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c:
        c.row_factory = psycopg.rows.dict_row
        return c.execute(
            "SELECT id, status, owner, started_at, ended_at, input FROM turns WHERE conversation_id = %s ORDER BY seq",
            (conversation_id,),
        ).fetchall()


def _all_turns(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c:
        c.row_factory = psycopg.rows.dict_row
        return c.execute("SELECT id, status, input FROM turns ORDER BY seq").fetchall()


def _instances(url: str) -> list[str]:
    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("SELECT id FROM instances ORDER BY started_at").fetchall()]


def _logs(cluster: Cluster) -> str:
    """The servers' log lines so far, for a failing test's message."""
    return "".join(
        f"--- node{i}\n{sp.proc.stderr.so_far()}"  # type: ignore[attr-defined]
        for i, sp in enumerate(cluster.nodes)
        if sp.proc.stderr is not None
    )


async def _create(ws: WS, agent: str = "assistant") -> str:
    reply = await ws.request({"type": "create_conversation", "agent": agent})
    assert "conversation" in reply, reply
    return str(reply["conversation"]["id"])


async def _submit(ws: WS, conversation: str, text: str, agent: str = "assistant") -> dict[str, Any]:
    ack = await ws.request({"type": "submit_input", "agent": agent, "conversation": conversation, "input": text})
    assert ack["type"] == "ack", ack
    return ack


def test_submits_through_three_instances_run_one_at_a_time_in_order(cluster: Cluster) -> None:
    async def go() -> None:
        socks = [await WS.open(sp.url) for sp in cluster.nodes]
        conv = await _create(socks[0])
        acks = []
        for i in range(9):  # round robin; each ack before the next submit: that is the order
            acks.append(await _submit(socks[i % 3], conv, "/slow 4"))
        finals = [await socks[i % 3].terminal(a["turn_id"], timeout=60) for i, a in enumerate(acks)]
        statuses = [f["status"] for f in finals]
        if statuses != ["completed"] * 9:
            pytest.fail(f"{statuses} {[f.get('error') for f in finals]}\n{_logs(cluster)}", pytrace=False)
        assert all(f["blocks"][-1]["text"] == "w1 w2 w3 w4" for f in finals)
        turns = {t["id"]: t for t in _turns(cluster.url, conv)}
        ordered = [turns[a["turn_id"]] for a in acks]
        for before, after in zip(ordered, ordered[1:], strict=False):
            assert after["started_at"] >= before["ended_at"], (before, after)  # one at a time, in order
        assert len({t["owner"] for t in ordered}) == 1  # all ran where the conversation lives
        for s in socks:
            await s.close()

    asyncio.run(go())


def test_a_subscriber_on_c_sees_the_turn_that_runs_on_a(cluster: Cluster) -> None:
    a_url, c_url = cluster.nodes[0].url, cluster.nodes[2].url

    async def go() -> None:
        a, c = await WS.open(a_url), await WS.open(c_url)
        conv = await _create(a)
        warm = await _submit(a, conv, "hi")  # A takes the conversation
        await a.terminal(warm["turn_id"])
        sub = await c.request({"type": "subscribe", "conversation": conv})
        assert sub["type"] != "error", sub
        ack = await _submit(a, conv, "/slow 20")
        on_a = await a.terminal(ack["turn_id"], timeout=30)
        on_c = await c.terminal(ack["turn_id"], timeout=30)
        assert on_c["blocks"] == on_a["blocks"] and on_c["status"] == "completed"
        seen = [
            f["snapshot"] for f in c.seen if f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == ack["turn_id"]
        ]
        revisions = [s["revision"] for s in seen]
        assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
        partial = [s for s in seen if s["status"] == "running" and s["blocks"]]
        assert len(partial) >= 3, "C saw the reply grow, not only its end"
        assert all(on_a["blocks"][-1]["text"].startswith(s["blocks"][-1]["text"]) for s in partial)
        rows = _turns(cluster.url, conv)
        assert rows[-1]["owner"] == rows[0]["owner"]  # both ran where the conversation lives
        await a.close()
        await c.close()

    asyncio.run(go())


def test_an_approval_answered_on_b_resumes_the_turn_on_a(cluster: Cluster) -> None:
    a_url, b_url = cluster.nodes[0].url, cluster.nodes[1].url

    async def go() -> None:
        a, b = await WS.open(a_url), await WS.open(b_url)
        conv = await _create(a, "careful")
        await b.request({"type": "subscribe", "conversation": conv})
        ack = await _submit(a, conv, "/call clock {}", agent="careful")
        request = await b.expect(lambda f: f["type"] == "approval_request", timeout=15)
        assert request["turn_id"] == ack["turn_id"]
        answer = await b.request(
            {
                "type": "approval_response",
                "conversation": conv,
                "decisions": [{"call_id": request["call_id"], "decision": "approve"}],
            }
        )
        assert answer["type"] == "ack" and answer["results"][0]["accepted"] is True, answer
        final = await a.terminal(ack["turn_id"], timeout=20)
        assert final["status"] == "completed"
        tool = [blk for blk in final["blocks"] if blk["type"] == "tool_call"]
        assert tool and tool[0]["status"] == "completed"
        assert (await b.terminal(ack["turn_id"], timeout=20))["status"] == "completed"
        row = _turns(cluster.url, conv)[0]
        assert row["status"] == "completed"
        # it ran and resumed on A: the instance that accepted it and holds the conversation
        with psycopg.connect(cluster.url) as db:
            holder = db.execute(
                "SELECT instance_id FROM conversation_owners WHERE conversation_id = %s", (conv,)
            ).fetchone()
        assert holder is not None and row["owner"] == holder[0]
        await a.close()
        await b.close()

    asyncio.run(go())


def test_kill9_of_the_instance_running_a_turn_is_taken_over(tmp_path: Path) -> None:
    require_postgres()
    with temp_database("cluster_kill") as url:
        nodes = _start(tmp_path, url, 2)
        try:

            async def go() -> None:
                a, b = await WS.open(nodes[0].url), await WS.open(nodes[1].url)
                conv = await _create(a)
                running = await _submit(a, conv, "/slow 400")
                await a.expect(
                    lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15
                )  # it runs on A
                queued = await _submit(b, conv, "after the kill")  # accepted by B, queued behind it
                # OpenAI clients on B following turns that run on A (conversations A holds)
                followed = []
                for _ in range(2):
                    held = await _create(a)
                    await a.terminal((await _submit(a, held, "take it"))["turn_id"])
                    followed.append(held)
                on_b_http = httpx.AsyncClient(base_url=nodes[1].url, timeout=30)
                slow = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 300"}]}
                plain = asyncio.ensure_future(
                    on_b_http.post("/v1/chat/completions", json=slow, headers={"X-Conversation-Id": followed[0]})
                )

                async def streamed() -> list[str]:
                    body, pinned = {**slow, "stream": True}, {"X-Conversation-Id": followed[1]}
                    async with on_b_http.stream("POST", "/v1/chat/completions", json=body, headers=pinned) as r:
                        return sse_payloads([line async for line in r.aiter_lines()])

                stream = asyncio.ensure_future(streamed())
                # and an OpenAI client whose request (with an Idempotency-Key) runs on A
                key = {"Idempotency-Key": f"k-{time.monotonic_ns()}"}
                body = {"model": "assistant", "messages": [{"role": "user", "content": "/slow 30"}]}
                on_a = openai.AsyncOpenAI(base_url=nodes[0].url + "/v1", api_key="x", max_retries=0)
                first = asyncio.ensure_future(on_a.chat.completions.create(**body, extra_headers=key))  # type: ignore[call-overload]

                def running_on_a() -> int:  # the `/slow 30` sent to A and the two `/slow 300` on B
                    return len([r for r in _all_turns(url) if "/slow 30" in r["input"] and r["status"] == "running"])

                while running_on_a() < 3:
                    await asyncio.sleep(0.02)
                nodes[0].proc.send_signal(signal.SIGKILL)
                nodes[0].proc.wait(10)
                started = time.monotonic()
                with contextlib.suppress(openai.APIError):
                    await first
                # the client retries at once, on B: the turn it follows died with A, so it runs again
                on_b = openai.AsyncOpenAI(base_url=nodes[1].url + "/v1", api_key="x", max_retries=0, timeout=30)
                retried = await on_b.chat.completions.create(**body, extra_headers=key)  # type: ignore[call-overload]
                assert retried.choices[0].message.content == " ".join(f"w{i}" for i in range(1, 31))
                again = await on_b.chat.completions.create(**body, extra_headers=key)  # type: ignore[call-overload]
                assert again.id == retried.id  # and from then on that answer is the key's
                # no answer, no cancel: the followed turns were interrupted (503, not a short `stop`)
                answer = await asyncio.wait_for(plain, 30)
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "turn_interrupted", answer.text
                payloads = await asyncio.wait_for(stream, 30)
                assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["error"]["code"] == "turn_interrupted"
                assert not any('"finish_reason":"stop"' in p.replace(" ", "") for p in payloads)
                await on_b_http.aclose()
                settled = await b.terminal(running["turn_id"], timeout=30)
                assert settled["status"] == "cancelled" and settled["error"]["kind"] == "interrupted"
                answered = await b.terminal(queued["turn_id"], timeout=30)
                assert answered["status"] == "completed" and answered["blocks"][-1]["text"] == "echo: after the kill"
                # ... and B's client heard them end in the order they ran: the killed turn's end
                # (numbered from the store, below what A published) was not taken as stale
                ends = [
                    f["snapshot"]["turn_id"]
                    for f in b.seen
                    if f["type"] == "turn_updated" and f["snapshot"]["status"] in ("completed", "cancelled")
                ]
                assert ends.index(running["turn_id"]) < ends.index(queued["turn_id"]), ends
                assert len(ends) == len(set(ends)), ends  # and each end once
                assert time.monotonic() - started < 30
                rows = {r["id"]: r for r in _turns(url, conv)}
                assert rows[running["turn_id"]]["status"] == "interrupted"
                assert rows[queued["turn_id"]]["status"] == "completed"
                assert len(_instances(url)) == 1  # the dead one's row is gone
                slow_30 = sorted(r["status"] for r in _all_turns(url) if '"/slow 30"' in r["input"])
                assert slow_30 == ["completed", "interrupted"], slow_30
                await b.close()
                await on_a.close()
                await on_b.close()

            asyncio.run(go())
        finally:
            for sp in nodes:
                sp.kill()


def _cron_doc(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as c:
        row = c.execute("SELECT doc FROM cron_state WHERE id = 1").fetchone()
    return json.loads(row[0]) if row and row[0].strip() else {}


def _cron_turns(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as c:
        c.row_factory = psycopg.rows.dict_row
        rows = c.execute("SELECT id, status, owner, source FROM turns ORDER BY seq").fetchall()
    return [r for r in rows if r["source"] and json.loads(r["source"]).get("kind") == "cron_prompt"]


def test_a_cron_task_due_during_a_failover_fires_exactly_once(tmp_path: Path) -> None:
    """The cron tasks live in the database: one scheduler across the cluster (its lease names an
    instance); kill -9 of that instance just before a task is due: the survivor takes the lease
    and fires it, once."""
    require_postgres()
    with temp_database("cluster_cron") as url:
        admin = tmp_path / "admin"
        tick = {"APPSERVER_CRON_TICK_S": "0.3"}
        nodes = []
        try:
            for i in range(2):
                home = tmp_path / f"node{i}"
                nodes.append(start_serve(home, env={**_env(home, url), **tick}))
            deadline = time.monotonic() + 15
            while not (_cron_doc(url).get("scheduler_owner") or {}).get("instance"):
                assert time.monotonic() < deadline, "no instance took the scheduler lease"
                time.sleep(0.1)
            holder = _cron_doc(url)["scheduler_owner"]["instance"]
            add = run_cli(admin, "cron", "add", "--name", "soon", "--agent", "assistant",
                          "--in", "3s", "--exact", "--prompt", "wake up", "--json", env=_env(admin, url))  # fmt: skip
            assert add.code == 0, add.err
            assert [t["name"] for t in _cron_doc(url)["tasks"]] == ["soon"]  # in the database, not a home
            with psycopg.connect(url) as c:
                pids = dict(c.execute("SELECT id, pid FROM instances").fetchall())
            victim = next(sp for sp in nodes if sp.proc.pid == pids[holder])
            survivor = next(sp for sp in nodes if sp is not victim)
            time.sleep(1.5)
            assert _cron_turns(url) == []  # not due yet
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            deadline = time.monotonic() + 20
            while not [t for t in _cron_turns(url) if t["status"] == "completed"]:
                assert time.monotonic() < deadline, "the survivor never fired the task"
                time.sleep(0.1)
            time.sleep(1.0)  # a few more ticks: nothing fires again
            fired = _cron_turns(url)
            assert len(fired) == 1, fired
            with psycopg.connect(url) as c:
                survivor_id = c.execute("SELECT id FROM instances WHERE pid = %s", (survivor.proc.pid,)).fetchone()[0]
            assert fired[0]["owner"] == survivor_id
            assert _cron_doc(url)["scheduler_owner"]["instance"] == survivor_id
            # the database ends every session (a restart): the scheduler keeps going, and fires the next task
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            time.sleep(1.0)
            add = run_cli(admin, "cron", "add", "--name", "later", "--agent", "assistant",
                          "--in", "2s", "--exact", "--prompt", "again", "--json", env=_env(admin, url))  # fmt: skip
            assert add.code == 0, add.err
            deadline = time.monotonic() + 20
            while len([t for t in _cron_turns(url) if t["status"] == "completed"]) < 2:
                assert time.monotonic() < deadline, "the scheduler stopped after the database ended its session"
                time.sleep(0.1)
            assert len(_cron_turns(url)) == 2
        finally:
            for sp in nodes:
                sp.kill()


def test_tokens_are_shared_and_a_revoke_reaches_every_instance(tmp_path: Path) -> None:
    """With `[auth] mode = "token"` the tokens live in the database: one minted through the CLI
    works on every instance, and a revoke stops it on all of them within seconds."""
    import httpx

    require_postgres()
    with temp_database("cluster_tokens") as url:
        admin = tmp_path / "admin"
        auth = {"APPSERVER_AUTH__MODE": "token"}
        nodes = []
        try:
            for i in range(2):
                home = tmp_path / f"node{i}"
                nodes.append(start_serve(home, env={**_env(home, url), **auth}))
            made = run_cli(admin, "token", "create", "--name", "shared", "--json", env={**_env(admin, url), **auth})
            assert made.code == 0, made.err
            token = json.loads(made.out)["token"]
            body = {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"Authorization": f"Bearer {token}"}
            for sp in nodes:
                r = httpx.post(sp.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
                assert r.status_code == 200, r.text
                assert httpx.post(sp.url + "/v1/chat/completions", json=body, timeout=10).status_code == 401
            gone = run_cli(admin, "token", "revoke", "shared", env={**_env(admin, url), **auth})
            assert gone.code == 0, gone.err
            # each server looks for changes at least every second: refused by each once 1.5 s have
            # passed (asked until then, not only then: an earlier refusal ends the wait)
            revoked_at = time.monotonic()
            for sp in nodes:
                while True:
                    sent_at = time.monotonic()
                    r = httpx.post(sp.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
                    if r.status_code == 401 or sent_at - revoked_at >= 1.5:
                        break
                    time.sleep(0.1)
                assert r.status_code == 401, r.text
            assert not (admin / "auth" / "tokens.json").exists()  # nothing in a home
        finally:
            for sp in nodes:
                sp.kill()


def test_a_channel_account_moves_to_a_survivor_and_its_next_message_is_answered_once(tmp_path: Path) -> None:
    """Both servers configure the same account; one gateway runs it (its server holds the
    account's lease); kill -9 of that server: the other takes the lease, starts the account, and
    the next message is answered once."""
    from tests.fakes.fakechat import FakeChat
    from tests.support.gateway import fakechat_home, gateway_children, start_channel_server

    require_postgres()
    with temp_database("cluster_channels") as url, FakeChat() as chat:
        nodes = []
        try:
            for i in range(2):
                home = fakechat_home(tmp_path / f"node{i}" / "home", chat)
                nodes.append(start_channel_server(home, env=_env(home, url)))
            for sp in nodes:
                sp.wait_channels_ready()
            chat.inject("before", "hello")
            chat.wait_for_text("before", "echo: hello", timeout=20)
            with psycopg.connect(url) as c:
                holder = c.execute("SELECT instance_id FROM channel_owners WHERE account = 'fakechat:main'").fetchone()
                pids = dict(c.execute("SELECT id, pid FROM instances").fetchall())
            assert holder is not None
            victim = next(sp for sp in nodes if sp.proc.pid == pids[holder[0]])
            survivor = next(sp for sp in nodes if sp is not victim)
            assert gateway_children(victim.proc.pid) and not gateway_children(survivor.proc.pid)
            assert "runs in instance" in survivor.channels_check()["detail"]
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            deadline = time.monotonic() + 30
            while "fakechat:main running" not in survivor.channels_check()["detail"]:
                assert time.monotonic() < deadline, survivor.channels_check()
                time.sleep(0.2)
            chat.inject("after", "still there?")
            chat.wait_for_text("after", "echo: still there?", timeout=20)
            time.sleep(1.0)
            assert [m.text for m in chat.messages("after")] == ["echo: still there?"]
            with psycopg.connect(url) as c:
                owner = c.execute("SELECT instance_id FROM channel_owners WHERE account = 'fakechat:main'").fetchone()
            assert owner is not None and owner[0] != holder[0]
        finally:
            for sp in nodes:
                sp.kill()
                for pid in gateway_children(sp.proc.pid):
                    os.kill(pid, signal.SIGKILL)


def test_openai_clients_on_any_instance_share_conversations_and_idempotency_keys(cluster: Cluster) -> None:
    """The real `openai` SDK: a conversation A runs is continued through B, streamed through C;
    an Idempotency-Key used on A and retried on B replays A's answer, one turn."""
    import openai

    a, b, c = (openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0) for sp in cluster.nodes)
    first = a.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": "/slow 3"}]
    )
    conv = first.headers["x-conversation-id"]
    assert first.parse().choices[0].message.content == "w1 w2 w3"
    on_b = b.chat.completions.create(
        model="assistant",
        messages=[{"role": "user", "content": "through b"}],
        extra_headers={"X-Conversation-Id": conv},
    )
    assert on_b.choices[0].message.content == "echo: through b"
    chunks = c.chat.completions.create(
        model="assistant",
        messages=[{"role": "user", "content": "/slow 12"}],
        extra_headers={"X-Conversation-Id": conv},
        stream=True,
    )
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == " ".join(f"w{i}" for i in range(1, 13))
    assert len([p for p in pieces if p]) >= 3  # it streamed through C, not one final blob
    rows = _turns(cluster.url, conv)
    assert [r["status"] for r in rows] == ["completed"] * 3
    assert len({r["owner"] for r in rows}) == 1  # one instance ran the conversation's turns

    key = {"Idempotency-Key": f"k-{time.monotonic_ns()}"}
    body = {"model": "assistant", "messages": [{"role": "user", "content": "exactly once please"}]}
    once = a.chat.completions.with_raw_response.create(**body, extra_headers=key)  # type: ignore[arg-type]
    again = b.chat.completions.with_raw_response.create(**body, extra_headers=key)  # type: ignore[arg-type]
    assert again.parse().id == once.parse().id
    assert again.parse().choices[0].message.content == once.parse().choices[0].message.content
    with psycopg.connect(cluster.url) as db:
        n = db.execute(
            "SELECT count(*) FROM messages WHERE role = 'user' AND content LIKE %s", ("%exactly once please%",)
        ).fetchone()
    assert n == (1,)


def test_two_clients_continuing_one_response_on_two_instances_each_get_their_own(cluster: Cluster) -> None:
    """Client 1 continues a response on A (its turn runs there); client 2 continues the same
    response on B meanwhile. As on one server, client 2 forks from the response: its reply must not
    see client 1's input (B looked only at its own runtimes, found the conversation idle and
    queued client 2's input behind client 1's)."""

    async def go() -> None:
        a = openai.AsyncOpenAI(base_url=cluster.nodes[0].url + "/v1", api_key="x", max_retries=0, timeout=60)
        b = openai.AsyncOpenAI(base_url=cluster.nodes[1].url + "/v1", api_key="x", max_retries=0, timeout=60)
        first = await a.responses.create(model="assistant", input="first")
        one = asyncio.ensure_future(
            a.responses.create(model="assistant", input="/slow 21", previous_response_id=first.id)
        )
        deadline = time.monotonic() + 15
        while not [r for r in _all_turns(cluster.url) if "/slow 21" in r["input"] and r["status"] == "running"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        two = await b.responses.create(model="assistant", input="/recall", previous_response_id=first.id)
        assert two.output_text == "first", two.output_text  # the fork holds what came before, not client 1's input
        done = await one
        assert done.output_text == " ".join(f"w{i}" for i in range(1, 22))
        await a.close()
        await b.close()

    asyncio.run(go())


def test_the_example_balancer_spreads_one_conversation_over_the_instances(cluster: Cluster) -> None:
    """examples/cluster/balancer.py in front of the three instances (docs/scale-out.md): one
    conversation through it lands on every instance and stays one ordered history."""
    import subprocess
    import sys

    import openai

    from tests.support.cli import ROOT
    from tests.support.net import free_port

    port = free_port()
    backends = [sp.url.removeprefix("http://") for sp in cluster.nodes]
    lb = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "cluster" / "balancer.py"), f"127.0.0.1:{port}", *backends],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert lb.stdout is not None and "balancing" in lb.stdout.readline()
        conv = ""
        for i in range(6):  # a client per request: a new connection, so the next instance
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            extra = {"X-Conversation-Id": conv} if conv else {}
            r = client.chat.completions.with_raw_response.create(
                model="assistant", messages=[{"role": "user", "content": f"m{i}"}], extra_headers=extra
            )
            conv = conv or r.headers["x-conversation-id"]
            assert r.parse().choices[0].message.content == f"echo: m{i}"
            client.close()
        with psycopg.connect(cluster.url) as db:
            said = [
                json.loads(row[0])
                for row in db.execute(
                    "SELECT content FROM messages WHERE conversation_id = %s AND role = 'user' ORDER BY id", (conv,)
                ).fetchall()
            ]
        assert said == [f"m{i}" for i in range(6)]
    finally:
        lb.kill()
        lb.wait(10)


def test_the_queue_bound_holds_across_instances(cluster: Cluster) -> None:
    """Many clients on all three instances submit to one busy conversation at once: no more than
    `queue_max` inputs are accepted behind the running turn, the rest are refused (queue_full)."""

    async def go() -> None:
        # (these clients read only their replies: a short close timeout, as their unread frames block it)
        socks = [await WS.open(sp.url, close_timeout=0.2) for sp in cluster.nodes for _ in range(7)]
        conv = await _create(socks[0])
        running = await _submit(socks[0], conv, "/slow 80")
        await socks[0].expect(lambda f: f["type"] == "turn_updated" and f["snapshot"]["blocks"], timeout=15)

        async def one(ws: WS) -> dict[str, Any]:
            return await ws.request({"type": "submit_input", "agent": "assistant", "conversation": conv, "input": "q"})

        replies = await asyncio.gather(*(one(ws) for ws in socks))
        accepted = [r for r in replies if r["type"] == "ack"]
        refused = [r for r in replies if r["type"] == "error"]
        assert len(accepted) == QUEUE_MAX, [r.get("code") for r in refused]
        assert len(refused) == len(socks) - QUEUE_MAX and {r["code"] for r in refused} == {"queue_full"}, refused
        queued = [t for t in _turns(cluster.url, conv) if t["status"] == "queued"]
        assert len(queued) == QUEUE_MAX
        await socks[0].request({"type": "cancel", "conversation": conv, "turn_id": running["turn_id"]})
        for ws in socks:
            await ws.close()

    asyncio.run(go())


def test_an_input_accepted_elsewhere_first_runs_first(cluster: Cluster) -> None:
    """A holds an idle conversation; X is accepted through B, then Y through A at once: X runs
    before Y, every time (acceptance order is the database's, not the holder's own queue)."""
    a_url, b_url = cluster.nodes[0].url, cluster.nodes[1].url

    async def go() -> None:
        a, b = await WS.open(a_url), await WS.open(b_url)
        conv = await _create(a)
        await a.terminal((await _submit(a, conv, "warm"))["turn_id"])  # A holds it
        pairs = []
        for i in range(8):
            x = await _submit(b, conv, f"x{i}")
            y = await _submit(a, conv, f"y{i}")
            pairs.append((x["turn_id"], y["turn_id"]))
            await a.terminal(y["turn_id"], timeout=20)
        rows = {t["id"]: t for t in _turns(cluster.url, conv)}
        for x, y in pairs:
            assert rows[x]["status"] == rows[y]["status"] == "completed"
            assert rows[x]["ended_at"] <= rows[y]["started_at"], (rows[x], rows[y])
        await a.close()
        await b.close()

    asyncio.run(go())


def test_a_follower_sees_a_turn_larger_than_a_notification_as_it_grows(cluster: Cluster) -> None:
    """Snapshots past NOTIFY's size go through the database (one row per turn): a subscriber on B
    sees a 30 KB reply end as promptly as A, not from its fallback reading of the store."""
    a_url, b_url = cluster.nodes[0].url, cluster.nodes[1].url

    async def go() -> None:
        a, b = await WS.open(a_url), await WS.open(b_url)
        conv = await _create(a)
        await a.terminal((await _submit(a, conv, "warm"))["turn_id"])
        await b.request({"type": "subscribe", "conversation": conv})
        await asyncio.sleep(0.3)  # B's interest reaches A
        text = " ".join(f"word{i:05d}" for i in range(3000))
        ack = await _submit(a, conv, text)
        on_a = await a.terminal(ack["turn_id"], timeout=20)
        seen_a = time.monotonic()
        on_b = await b.terminal(ack["turn_id"], timeout=20)
        assert time.monotonic() - seen_a < 1.0, "B heard of the end through the store, late"
        assert on_b["blocks"] == on_a["blocks"] and len(on_b["blocks"][-1]["text"]) > 30_000
        with psycopg.connect(cluster.url) as db:
            rows = db.execute("SELECT count(*) FROM cluster_mail WHERE id = %s", ("turn:" + ack["turn_id"],)).fetchone()
        assert rows == (1,)  # one row for the whole turn, not one per revision
        await a.close()
        await b.close()

    asyncio.run(go())


def test_a_follower_sees_turns_from_the_start_after_the_conversation_moved(tmp_path: Path) -> None:
    """B follows a conversation A holds; A lets it go when idle; C takes it with the next input:
    C knows (from the database) that B follows it and publishes the new turn from its start."""
    require_postgres()
    with temp_database("cluster_moved") as url:
        nodes = _start(tmp_path, url, 3, APPSERVER_LIMITS__IDLE_EVICT_S="1")
        try:

            async def go() -> None:
                a, b, c = [await WS.open(sp.url) for sp in nodes]
                conv = await _create(a)
                await a.terminal((await _submit(a, conv, "warm"))["turn_id"])  # A holds it
                await b.request({"type": "subscribe", "conversation": conv})
                await a.close()  # nobody on A watches it any more
                deadline = time.monotonic() + 10
                while True:  # A drops the idle runtime and its lease
                    with psycopg.connect(url) as db:
                        if (
                            db.execute(
                                "SELECT 1 FROM conversation_owners WHERE conversation_id = %s", (conv,)
                            ).fetchone()
                            is None
                        ):
                            break
                    assert time.monotonic() < deadline, "A never let the idle conversation go"
                    await asyncio.sleep(0.1)
                ack = await _submit(c, conv, "/slow 30")  # C takes it
                on_c = await c.terminal(ack["turn_id"], timeout=20)
                on_b = await b.terminal(ack["turn_id"], timeout=20)
                assert on_b["blocks"] == on_c["blocks"]
                seen = [
                    f["snapshot"]
                    for f in b.seen
                    if f["type"] == "turn_updated" and f["snapshot"]["turn_id"] == ack["turn_id"]
                ]
                growing = [s for s in seen if s["status"] == "running" and s["blocks"]]
                assert len(growing) >= 5, [len(s["blocks"][-1]["text"]) for s in growing]
                assert len(growing[0]["blocks"][-1]["text"]) < 30, "B missed the start of the reply"
                for ws in (b, c):
                    await ws.close()

            asyncio.run(go())
        finally:
            for sp in nodes:
                sp.kill()
