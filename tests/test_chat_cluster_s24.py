"""Chat Completions across the servers of a cluster, and a reply's history point.

1. Answers to one paused chat turn (the resent transcript with its tool result) sent at the same
   moment to two servers sharing one PostgreSQL store: each is answered, as on one server (the
   first applied continues the conversation, the other forks from the point before the answer;
   docs/openai.md "Racing requests"). Before, the second got 409 `not_awaiting` or "has no turn
   waiting for an answer", or an empty 200 for the same answer. With the deprecated `functions`
   (a `function` message answers its call by name) the loser still got 409 "has no turn waiting
   for tool results" in some rounds: the name was looked up among the calls still waiting, none
   once the other server had answered; it is now the call made at the transcript's point.
2. A reply's history point is committed before the reply (a stream's finish chunk and [DONE])
   goes out. Before, it was written after the reply: a client's next request reaching another
   server at once, or the same server restarted after a kill -9, found no point, and its transcript
   (a tool result, or a plain continuation) started a new conversation while the original waited.
3. A round answered in parts on the server that does not run the paused turn replies at once,
   naming the calls still open, as on the server that runs it. Before, it hung: the owner publishes
   no new snapshot for a partial answer, and the request waited for one.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.cli import cli_env
from tests.support.pg import require_postgres, temp_database
from tests.support.serve import ServeProcess, serving, start_serve

pytestmark = pytest.mark.timeout(90)

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
LEGACY_F = {"name": "f", "parameters": {"type": "object"}}
ROUNDS = 4
WAIT_S = 30.0  # every wait's bound; none is reached when the server works
PARTIAL_WAIT_S = 10.0  # a partial answer's reply (it came in well under a second; it used to hang)
POINTS_SQL = "SELECT count(*) FROM history_points WHERE conversation_id=?"


class Cluster:
    def __init__(self, url: str, bases: list[str]) -> None:
        self.url = url  # the shared PostgreSQL database
        self.bases = bases  # each server's /v1

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_postgres()
    tmp = tmp_path_factory.mktemp("s24_chat")
    with temp_database("s24_chat") as url:
        started: list[ServeProcess] = []
        try:
            for i in range(2):
                home = tmp / f"node{i}"
                env = cli_env(
                    home,
                    APPSERVER_STORE__URL=url,
                    APPSERVER_STORE__HEARTBEAT_S="0.2",
                    APPSERVER_STORE__INSTANCE_TIMEOUT_S="20",
                )
                started.append(start_serve(home, env=env))
            yield Cluster(url, [sp.url + "/v1" for sp in started])
        finally:
            for sp in started:
                try:
                    sp.stop(timeout=10)
                except Exception:
                    pass
                sp.kill()


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "assistant", "messages": messages, "tools": [F], **extra}


def _message(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    message: dict[str, Any] = r.json()["choices"][0]["message"]
    return message


async def _paused(c: httpx.AsyncClient, base: str) -> tuple[list[dict[str, Any]], str, str]:
    """A chat turn of `base` paused at a call of the client's tool f: the transcript the client
    then holds, the call's id and the conversation."""
    asked = [{"role": "user", "content": "/call f {}"}]
    r = await c.post(base + "/chat/completions", json=_chat(asked))
    message = _message(r)
    call = message["tool_calls"][0]
    transcript = [*asked, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return transcript, call["id"], r.headers["x-conversation-id"]


async def _race(cluster: Cluster, outputs: tuple[str, str]) -> None:
    async with httpx.AsyncClient(timeout=WAIT_S) as c:
        for n in range(ROUNDS):
            transcript, call, original = await _paused(c, cluster.bases[n % 2])
            sends = [
                c.post(base + "/chat/completions", json=_chat([*transcript, _result(call, out)]))
                for base, out in zip(cluster.bases, outputs, strict=True)
            ]
            replies = await asyncio.gather(*sends)
            assert [_message(r)["content"] for r in replies] == [f"f -> {out}" for out in outputs]
            convs = [r.headers["x-conversation-id"] for r in replies]
            assert original in convs and len(set(convs)) == 2  # one continued it, the other forked
            fork = next(cid for cid in convs if cid != original)
            assert cluster.rows("SELECT forked_from FROM conversations WHERE id=%s", fork) == [(original,)]
            for cid, out in zip(convs, outputs, strict=True):  # each conversation holds its own answer
                results = cluster.rows("SELECT content FROM messages WHERE conversation_id=%s AND role='tool'", cid)
                assert len(results) == 1 and out in results[0][0], (cid, results)
                turns = cluster.rows("SELECT status FROM turns WHERE conversation_id=%s", cid)
                assert {s for (s,) in turns} == {"completed"}, (cid, turns)


def _result(call: str, output: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "content": output}


async def test_different_answers_to_one_paused_chat_turn_on_two_servers_are_each_answered(cluster: Cluster) -> None:
    await _race(cluster, ("RA", "RB"))


async def test_the_same_answer_to_one_paused_chat_turn_on_two_servers_is_answered_by_both(cluster: Cluster) -> None:
    await _race(cluster, ("RS", "RS"))


# ------------------------------------------------------------------ the point before the reply


class PointsLocked:
    """The `history_points` table locked against writes by another session (SHARE mode: reads go
    on): a point the server writes waits until `release`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url)
        self.conn.execute("LOCK TABLE history_points IN SHARE MODE")

    def point_write_waits(self) -> bool:
        """A session waits for the lock: the server is writing a point now."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'history_points' AND NOT l.granted"
            ).fetchone()
        return bool(row and row[0])

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def _points(url: str, conversation_id: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM history_points WHERE conversation_id=%s", (conversation_id,)
        ).fetchone()
    return int(row[0]) if row else 0


def _wait_until(check: Any, what: str) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        done.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _reply_with_points_locked(cluster: Cluster, body: dict[str, Any], stream: bool) -> None:
    """Send `body` while points cannot be written: once the server is seen writing the reply's
    point, a reply that has arrived (a stream's [DONE]) must find it committed, which it cannot
    be while the lock is held; then the lock goes and the reply (and its point) must come."""
    replies: list[tuple[str, bool]] = []  # (conversation, the whole reply arrived)

    def send() -> None:
        with httpx.Client(timeout=WAIT_S) as c:
            if not stream:
                r = c.post(cluster.bases[0] + "/chat/completions", json=body)
                _message(r)
                replies.append((r.headers["x-conversation-id"], True))
                return
            with c.stream("POST", cluster.bases[0] + "/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == "data: [DONE]":  # the client has its whole reply (before the stream closes)
                        replies.append((r.headers["x-conversation-id"], True))

    locked = PointsLocked(cluster.url)
    sender = threading.Thread(target=send)
    try:
        sender.start()
        _wait_until(locked.point_write_waits, "the server to write the reply's point")
        sender.join(0.5)  # a reply sent ahead of its point arrives meanwhile
        for conversation_id, whole in replies:
            assert not whole or _points(cluster.url, conversation_id), "the reply came before its point"
    finally:
        locked.release()
        sender.join(WAIT_S)
    assert replies and replies[0][1]
    assert _points(cluster.url, replies[0][0]) >= 1


def test_a_reply_is_sent_only_once_its_history_point_is_committed(cluster: Cluster) -> None:
    _reply_with_points_locked(cluster, _chat([{"role": "user", "content": "hi"}]), stream=False)


def test_a_stream_ends_only_once_its_history_point_is_committed(cluster: Cluster) -> None:
    _reply_with_points_locked(cluster, _chat([{"role": "user", "content": "/call f {}"}]), stream=True)


async def test_a_fast_client_continues_its_conversation_on_the_other_server(cluster: Cluster) -> None:
    """The reply on A, the next request at once on B (a plain continuation, then a tool result):
    both continue the conversation A answered."""
    async with httpx.AsyncClient(timeout=WAIT_S) as c:
        for n in range(ROUNDS):
            a, b = cluster.bases[n % 2], cluster.bases[1 - n % 2]
            said = [{"role": "user", "content": f"hello {n}"}]
            r = await c.post(a + "/chat/completions", json=_chat(said))
            conv = r.headers["x-conversation-id"]
            said += [
                {"role": "assistant", "content": _message(r)["content"]},
                {"role": "user", "content": "/call f {}"},
            ]
            r = await c.post(b + "/chat/completions", json=_chat(said))
            assert r.headers["x-conversation-id"] == conv
            call = _message(r)["tool_calls"][0]
            said += [{"role": "assistant", "content": None, "tool_calls": [call]}, _result(call["id"], "R")]
            r = await c.post(a + "/chat/completions", json=_chat(said))
            assert _message(r)["content"] == "f -> R"
            assert r.headers["x-conversation-id"] == conv


# ------------------------------------------------------------------ SQLite: kill -9 after the reply


def _points_in_file(db: Path, conversation_id: str) -> int:
    """Read by a connection of its own, as a restarted server would find it."""
    conn = sqlite3.connect(db, timeout=WAIT_S)
    try:
        row = conn.execute(POINTS_SQL, (conversation_id,)).fetchone()
    finally:
        conn.close()
    return int(row[0])


def _stream_reply(c: httpx.Client, base: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(conversation, the streamed message: content and tool calls) once [DONE] arrived."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    with c.stream("POST", base + "/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        conv = r.headers["x-conversation-id"]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        delta = json.loads(line)["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"type": "function", "function": {"arguments": ""}})
            call["id"] = tc.get("id") or call.get("id")
            fn = tc.get("function") or {}
            call["function"]["name"] = fn.get("name") or call["function"].get("name")
            call["function"]["arguments"] += fn.get("arguments") or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return conv, message


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_reply_s_point_survives_a_kill_9_right_after_it(tmp_path: Path, stream: bool) -> None:
    """SQLite: the reply's point is in the file when the reply (a stream's [DONE]) arrives; the
    server killed then and started again, the transcript resent with the tool result continues
    the original conversation and completes its paused turn."""
    home = tmp_path / "home"
    asked = [{"role": "user", "content": "/call f {}"}]
    with httpx.Client(timeout=WAIT_S) as c:
        sp = start_serve(home, env=cli_env(home))
        try:
            base = sp.url + "/v1"
            if stream:
                conv, reply = _stream_reply(c, base, _chat(asked))
            else:
                r = c.post(base + "/chat/completions", json=_chat(asked))
                conv, reply = r.headers["x-conversation-id"], {**_message(r), "content": None}
            sp.proc.kill()  # kill -9 right after the reply
            sp.proc.wait(WAIT_S)
        finally:
            sp.kill()
        assert _points_in_file(home / "appserver.db", conv) >= 1
        call = reply["tool_calls"][0]
        transcript = [*asked, {"role": "assistant", "content": None, "tool_calls": [call]}, _result(call["id"], "R")]
        with serving(home, env=cli_env(home)) as again:
            r = c.post(again.url + "/v1/chat/completions", json=_chat(transcript))
            assert _message(r)["content"] == "f -> R"
            assert r.headers["x-conversation-id"] == conv
    conn = sqlite3.connect(home / "appserver.db", timeout=WAIT_S)
    try:
        turns = conn.execute("SELECT status FROM turns WHERE conversation_id=?", (conv,)).fetchall()
    finally:
        conn.close()
    assert {s for (s,) in turns} == {"completed"}  # the paused turn was answered, not left waiting


# ------------------------------------------------------------------ legacy `functions`, racing


def _legacy(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "assistant", "messages": messages, "functions": [LEGACY_F]}


def _legacy_result(output: str) -> dict[str, Any]:
    return {"role": "function", "name": "f", "content": output}


async def _legacy_paused(c: httpx.AsyncClient, base: str, n: int) -> tuple[list[dict[str, Any]], str]:
    """A legacy chat turn of `base` paused at its `function_call`: the transcript and the
    conversation. Its own arguments: a legacy answer names no call id, so a transcript the same as
    another conversation's (one of the tests above left paused at `f {}`) could continue that one."""
    asked = [{"role": "user", "content": f'/call f {{"round": {n}}}'}]
    r = await c.post(base + "/chat/completions", json=_legacy(asked))
    call = _message(r)["function_call"]
    return [*asked, {"role": "assistant", "content": None, "function_call": call}], r.headers["x-conversation-id"]


def _check_fork(cluster: Cluster, original: str, convs: list[str], outputs: tuple[str, ...]) -> None:
    """One request continued `original`, the other forked from it; each holds its own answer."""
    assert original in convs and len(set(convs)) == 2, convs
    fork = next(cid for cid in convs if cid != original)
    assert cluster.rows("SELECT forked_from FROM conversations WHERE id=%s", fork) == [(original,)]
    for cid, out in zip(convs, outputs, strict=True):
        results = cluster.rows("SELECT content FROM messages WHERE conversation_id=%s AND role='tool'", cid)
        assert len(results) == 1 and out in results[0][0], (cid, results)
        turns = cluster.rows("SELECT status FROM turns WHERE conversation_id=%s", cid)
        assert {s for (s,) in turns} == {"completed"}, (cid, turns)


async def test_legacy_function_answers_racing_on_two_servers_are_each_answered(cluster: Cluster) -> None:
    """`function` messages (answering by name) sent to both servers at once, the same answer and
    different ones, round after round: both 200, one continues, the other forks."""
    async with httpx.AsyncClient(timeout=WAIT_S) as c:
        for n in range(2 * ROUNDS):
            outputs = ("LS", "LS") if n % 2 else (f"LA{n}", f"LB{n}")
            transcript, original = await _legacy_paused(c, cluster.bases[n % 2], n)
            sends = [
                c.post(base + "/chat/completions", json=_legacy([*transcript, _legacy_result(out)]))
                for base, out in zip(cluster.bases, outputs, strict=True)
            ]
            replies = await asyncio.gather(*sends)
            assert [_message(r)["content"] for r in replies] == [f"f -> {out}" for out in outputs], n
            _check_fork(cluster, original, [r.headers["x-conversation-id"] for r in replies], outputs)


# ------------------------------------------------------------------ a round answered in parts elsewhere


async def _three_calls(c: httpx.AsyncClient, base: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """A chat turn of `base` paused at three parallel calls of f: transcript, call ids, conversation."""
    asked = [{"role": "user", "content": "/call f {}\n/call f {}\n/call f {}"}]
    r = await c.post(base + "/chat/completions", json=_chat(asked))
    calls = _message(r)["tool_calls"]
    assert len(calls) == 3
    transcript = [*asked, {"role": "assistant", "content": None, "tool_calls": calls}]
    return transcript, [call["id"] for call in calls], r.headers["x-conversation-id"]


async def _stream_calls(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> tuple[str, list[str], str]:
    """A streamed reply: (conversation, the ids of the calls it shows, its finish reason)."""
    ids: list[str] = []
    finish = ""
    async with c.stream("POST", base + "/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids += [tc["id"] for tc in choice["delta"].get("tool_calls") or [] if tc.get("id")]
            finish = choice.get("finish_reason") or finish
        return r.headers["x-conversation-id"], ids, finish


@pytest.mark.parametrize("rest_on", [0, 1], ids=["rest_on_owner", "rest_on_other"])
async def test_a_round_answered_in_parts_on_the_other_server_names_the_calls_still_open(
    cluster: Cluster, rest_on: int
) -> None:
    """Three calls made on server 0; server 1 gets the transcript with one result, then with two
    (the first resent, as stateless clients do), then a stream of the same: each reply names the
    calls still open, at once. The last result, on either server, completes the turn."""
    owner, other = cluster.bases
    async with httpx.AsyncClient(timeout=PARTIAL_WAIT_S) as c:
        transcript, ids, conv = await _three_calls(c, owner)
        results = [_result(cid, f"r{i}") for i, cid in enumerate(ids)]
        one = await c.post(other + "/chat/completions", json=_chat([*transcript, results[0]]))
        assert [tc["id"] for tc in _message(one)["tool_calls"]] == ids[1:]
        assert one.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert one.headers["x-conversation-id"] == conv
        two = await c.post(other + "/chat/completions", json=_chat([*transcript, *results[:2]]))
        assert [tc["id"] for tc in _message(two)["tool_calls"]] == ids[2:]
        assert two.headers["x-conversation-id"] == conv
        streamed = await _stream_calls(c, other, _chat([*transcript, *results[:2]]))  # nothing new: as it waits
        assert streamed == (conv, ids[2:], "tool_calls")
        rest = await c.post(cluster.bases[rest_on] + "/chat/completions", json=_chat([*transcript, *results]))
        assert _message(rest)["content"] == "f -> r0\nf -> r1\nf -> r2"
        assert rest.headers["x-conversation-id"] == conv
    turns = cluster.rows("SELECT status FROM turns WHERE conversation_id=%s", conv)
    assert {s for (s,) in turns} == {"completed"}, turns


async def test_a_streamed_partial_answer_on_the_other_server_names_the_calls_still_open(cluster: Cluster) -> None:
    owner, other = cluster.bases
    async with httpx.AsyncClient(timeout=PARTIAL_WAIT_S) as c:
        transcript, ids, conv = await _three_calls(c, owner)
        results = [_result(cid, f"s{i}") for i, cid in enumerate(ids)]
        assert await _stream_calls(c, other, _chat([*transcript, results[0]])) == (conv, ids[1:], "tool_calls")
        rest = await c.post(owner + "/chat/completions", json=_chat([*transcript, *results]))
        assert _message(rest)["content"] == "f -> s0\nf -> s1\nf -> s2"


async def test_a_responses_partial_answer_on_the_other_server_names_the_call_still_open(cluster: Cluster) -> None:
    """The same for Responses (its answers take the same path): the resent input with one output,
    on the server that does not run the turn, lists the other call; the rest then completes it."""
    owner, other = cluster.bases
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    asked = {"role": "user", "content": "/call f {}\n/call f {}"}
    async with httpx.AsyncClient(timeout=PARTIAL_WAIT_S) as c:
        r = await c.post(owner + "/responses", json={"model": "assistant", "input": [asked], "tools": [tool]})
        assert r.status_code == 200, r.text
        calls = [{k: o[k] for k in ("type", "call_id", "name", "arguments")} for o in r.json()["output"]]
        assert [o["type"] for o in calls] == ["function_call", "function_call"]
        outputs = [
            {"type": "function_call_output", "call_id": o["call_id"], "output": f"o{i}"} for i, o in enumerate(calls)
        ]
        body = {"model": "assistant", "input": [asked, *calls, outputs[0]], "tools": [tool]}
        part = await c.post(other + "/responses", json=body)
        assert part.status_code == 200, part.text
        assert [(o["type"], o.get("call_id")) for o in part.json()["output"]] == [
            ("function_call", calls[1]["call_id"])
        ]
        rest = await c.post(other + "/responses", json={**body, "input": [asked, *calls, *outputs]})
        assert rest.status_code == 200, rest.text
        assert rest.json()["output"][-1]["content"][0]["text"] == "f -> o0\nf -> o1"
