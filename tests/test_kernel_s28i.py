"""Session 28 (i), from an outside tester's findings, through a real `appserver serve` on loopback, the
real `openai` SDK and a recording fake OpenAI-compatible upstream (tests/fakes/openai_upstream.py).

1. The SDK's automatic retry after a timeout, into a pinned conversation (chat with
   `X-Conversation-Id`, with or without `Idempotency-Key`; Responses `conversation=`), put the
   user's input in the model's context twice: the first attempt's turn was cancelled when its
   client left, but kept its input, and the retry added it again. A turn cancelled because its
   HTTP client went away before it showed or did anything now leaves nothing in the history (its
   input withdrawn, as a queued input's is: cancelled, error kind `withdrawn`, which WebSocket
   watchers see too, and which a restart after a kill -9 honours from the saved cancel). A turn
   that showed text keeps its input and that text, as before.
2. Tool results of one round reached the upstream in the order they finished (a server tool's
   before the client's answer to an earlier call); they go in the order of the calls now.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appserver.agent.context import context_view
from appserver.runtime import SubmitRequest
from appserver.runtime.settle import cancel_ack
from appserver.server import Server
from appserver.store.records import MessageRecord, TurnRecord
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, tool_delta
from tests.support.cli import cli_env, run_cli
from tests.support.kernel import open_server
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

T = 30.0
SLOW_S = 4.0  # the first call of a SLOWONCE input: past the SDK's timeout
SDK_TIMEOUT_S = 1.5
STALL_S = 6.0  # a STALL reply's pause after its first words


def _last_user_text(body: dict[str, Any]) -> str:
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    content = users[-1]["content"] if users else ""
    if isinstance(content, str):
        return content
    return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))


class Model:
    """The fake model: `SLOWONCE <tag>` answers its first call late (past the client's timeout),
    `STALL` streams a few words then pauses, `PAR a,b` calls a and b at once; a request ending with
    tool results is answered "done"; anything else "ok: <text>"."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slowed: set[str] = set()

    def __call__(self, req: RecordedRequest) -> Reply:
        body = req.json
        msgs = body.get("messages", [])
        if msgs and msgs[-1].get("role") == "tool":
            return Reply(pieces=[openai_sse([chunk(role="assistant", content="done"), chunk(finish_reason="stop")])])
        text = _last_user_text(body)
        words = text.split()
        if words[:1] == ["SLOWONCE"]:
            with self.lock:
                first = words[1] not in self.slowed
                self.slowed.add(words[1])
            answer = openai_sse([chunk(role="assistant", content=f"ok: {text}"), chunk(finish_reason="stop")])
            return Reply(pieces=[answer], initial_delay_s=SLOW_S if first else 0.0)
        if words[:1] == ["STALL"]:
            head = openai_sse([chunk(role="assistant", content="partial words")], done=False)
            tail = openai_sse([chunk(content=" never shown"), chunk(finish_reason="stop")])
            return Reply(pieces=[head, tail], delay_s=STALL_S)
        if words[:1] == ["PAR"]:
            names = words[1].split(",")
            calls = [tool_delta(i, id=f"call_{i}_{words[2]}", name=n, arguments="{}") for i, n in enumerate(names)]
            return Reply(
                pieces=[openai_sse([chunk(role="assistant", tool_calls=calls), chunk(finish_reason="tool_calls")])]
            )
        return Reply(pieces=[openai_sse([chunk(role="assistant", content=f"ok: {text}"), chunk(finish_reason="stop")])])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI) -> None:
        self.sp, self.fake = sp, fake

    def sent(self, tag: str) -> list[dict[str, Any]]:
        """The bodies of the upstream calls that carried `tag`."""
        return [r.json for r in list(self.fake.requests) if tag.encode() in r.body]

    def client(self, **headers: str) -> openai.AsyncOpenAI:
        """The SDK as an application uses it: a timeout, and one automatic retry after it."""
        return openai.AsyncOpenAI(
            base_url=f"{self.sp.url}/v1",
            api_key="unused",
            timeout=SDK_TIMEOUT_S,
            max_retries=1,
            default_headers=headers,
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeOpenAI() as fake:
        fake.responder = Model()
        home: Path = tmp_path_factory.mktemp("s28i") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        made = run_cli(home, "agents", "create", "--name", "fa", "--model", "fake:m1", env=cli)
        assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake)


async def watched_conversation(ws: WS) -> str:
    """A new conversation of `fa`, this socket subscribed to it."""
    made = await ws.request({"type": "create_conversation", "agent": "fa"}, T)
    assert made["type"] == "conversation_state", made
    conv = made["conversation"]["id"]
    sub = await ws.request({"type": "subscribe", "conversation": conv}, T)
    assert sub["type"] == "conversation_state", sub
    return str(conv)


async def history(ws: WS, conv: str) -> list[dict[str, Any]]:
    got = await ws.request({"type": "get_history", "conversation": conv, "limit": 1000}, T)
    assert got["type"] == "history", got
    return list(got["messages"])


def _content(m: dict[str, Any]) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else " ".join(str(p.get("text", "")) for p in c or [])


def ended_turns(ws: WS) -> dict[str, dict[str, Any]]:
    """The terminal snapshot of each turn the socket saw end, by turn id."""
    return {
        f["snapshot"]["turn_id"]: f["snapshot"]
        for f in ws.seen
        if f["type"] == "turn_updated" and f["snapshot"]["status"] in ("completed", "cancelled", "failed")
    }


async def ended(ws: WS, n: int) -> dict[str, dict[str, Any]]:
    """Wait until the socket saw `n` turns end."""
    while len(ended_turns(ws)) < n:
        await ws.recv(T)
    return ended_turns(ws)


def assert_sent_once(env: Env, tag: str, text: str) -> None:
    """The upstream was called twice for `tag` (the cut-off attempt, the retry), and the retry's
    request holds the input once."""
    sent = env.sent(tag)
    assert len(sent) == 2, [[m.get("content") for m in b["messages"]] for b in sent]
    users = [m for m in sent[-1]["messages"] if m["role"] == "user"]
    assert [_content(m) for m in users] == [text]


def assert_one_user_message(msgs: list[dict[str, Any]], text: str) -> None:
    assert [(m["role"], _content(m)) for m in msgs] == [("user", text), ("assistant", f"ok: {text}")]


def assert_saved_as_withdrawn(env: Env, conv: str) -> None:
    """The cut-off attempt's turn is stored cancelled, error kind `withdrawn`, and the cancel saved
    with it before that (`turns.cancel_ack`) says `withdraw`: a kill -9 before the turn's end was
    written withdraws it at the restart too."""
    db = sqlite3.connect(f"file:{env.sp.home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT error, cancel_ack, input_committed FROM turns WHERE conversation_id=? AND status='cancelled'",
            (conv,),
        ).fetchall()
    finally:
        db.close()
    [(error, ack, committed)] = rows
    assert json.loads(error)["kind"] == "withdrawn" and not committed
    assert json.loads(ack).get("withdraw") is True


def assert_withdrawn_then_completed(seen: dict[str, dict[str, Any]]) -> None:
    """What a watcher saw: the cut-off attempt's turn cancelled as withdrawn, the retry's completed."""
    by_status = sorted((s["status"], (s.get("error") or {}).get("kind")) for s in seen.values())
    assert by_status == [("cancelled", "withdrawn"), ("completed", None)], seen
    [gone] = [s for s in seen.values() if s["status"] == "cancelled"]
    assert gone["blocks"] == [] and "went away" in gone["error"]["message"]


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "idempotency-key"])
async def test_chat_sdk_retry_after_a_timeout_sends_the_input_once(env: Env, keyed: bool) -> None:
    ws = await WS.open(env.sp.url)
    try:
        conv = await watched_conversation(ws)
        tag = uuid.uuid4().hex[:10]
        text = f"SLOWONCE {tag}"
        headers = {"X-Conversation-Id": conv}
        if keyed:
            headers["Idempotency-Key"] = f"k-{tag}"
        async with env.client(**headers) as c:
            r = await c.chat.completions.create(model="fa", messages=[{"role": "user", "content": text}])
        assert r.choices[0].message.content == f"ok: {text}"
        assert_sent_once(env, tag, text)
        assert_withdrawn_then_completed(await ended(ws, 2))
        assert_one_user_message(await history(ws, conv), text)
        assert_saved_as_withdrawn(env, conv)
        # a later turn sees it once too
        async with env.client(**{"X-Conversation-Id": conv}) as c:
            await c.chat.completions.create(model="fa", messages=[{"role": "user", "content": f"after {tag}"}])
        later = env.sent(f"after {tag}")[-1]["messages"]
        assert [_content(m) for m in later if m["role"] == "user"] == [text, f"after {tag}"]
    finally:
        await ws.close()


async def test_responses_sdk_retry_after_a_timeout_sends_the_input_once(env: Env) -> None:
    ws = await WS.open(env.sp.url)
    try:
        conv = await watched_conversation(ws)
        tag = uuid.uuid4().hex[:10]
        text = f"SLOWONCE {tag}"
        async with env.client() as c:
            r = await c.responses.create(model="fa", input=text, conversation=conv)
        assert r.output_text == f"ok: {text}"
        assert_sent_once(env, tag, text)
        assert_withdrawn_then_completed(await ended(ws, 2))
        assert_one_user_message(await history(ws, conv), text)
    finally:
        await ws.close()


async def test_a_client_leaving_after_text_was_shown_keeps_its_input_and_text(env: Env) -> None:
    ws = await WS.open(env.sp.url)
    try:
        conv = await watched_conversation(ws)
        text = f"STALL {uuid.uuid4().hex[:10]}"
        body = {"model": "fa", "messages": [{"role": "user", "content": text}], "stream": True}
        async with (
            httpx.AsyncClient(timeout=T) as http,
            http.stream(
                "POST", f"{env.sp.url}/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}
            ) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if "partial words" in line:
                    break  # the client leaves once it was shown text
        [snap] = (await ended(ws, 1)).values()
        assert snap["status"] == "cancelled" and snap["error"] is None
        msgs = await history(ws, conv)
        assert [(m["role"], _content(m), m["completion_status"]) for m in msgs] == [
            ("user", text, "completed"),
            ("assistant", "partial words", "cancelled"),
        ]
    finally:
        await ws.close()


async def test_tool_results_reach_the_upstream_in_the_order_of_their_calls(env: Env) -> None:
    """A client tool called first, a server tool second: the server tool's result exists first,
    the client's answer comes with the next request; the upstream gets them in call order."""
    tag = uuid.uuid4().hex[:10]
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    async with openai.AsyncOpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=T) as c:
        first = await c.responses.create(model="fa", input=f"PAR lookup,clock {tag}", tools=tools)  # type: ignore[arg-type]
        [call] = [o for o in first.output if o.type == "function_call"]
        assert call.name == "lookup"
        done = await c.responses.create(
            model="fa",
            previous_response_id=first.id,
            tools=tools,  # type: ignore[arg-type]
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "LOOKUP-RESULT"}],
        )
        assert done.output_text == "done"
    last = env.sent(tag)[-1]["messages"]
    [asked] = [m for m in last if m["role"] == "assistant" and m.get("tool_calls")]
    assert [t["function"]["name"] for t in asked["tool_calls"]] == ["lookup", "clock"]
    results = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [f"call_0_{tag}", f"call_1_{tag}"]
    assert results[0]["content"] == "LOOKUP-RESULT"
    assert last[-2:] == results  # right after their calls, nothing between


# ---------------------------------------------------------------- a kill -9 after the cancel

DEAD_OWNER = "999999999:1"  # no such process


@pytest.fixture
async def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = await open_server(tmp_path / "home")
    yield s
    await s.close()


async def left_running(server: Server, turn_id: str) -> TurnRecord:
    """A turn a dead process accepted and began, then died."""
    first = await server.kernel.submit(SubmitRequest(agent="assistant", input="hello", conversation="new"))
    await first.wait(5)
    turn = TurnRecord(
        id=turn_id,
        conversation_id=first.conversation_id,
        agent_id=first.agent_id,
        status="running",
        owner=DEAD_OWNER,
        input={"content": f"input of {turn_id}"},
        source={"kind": "openai_chat"},
    )
    await server.store.accept_turn(turn)
    return turn


async def test_a_restart_withdraws_a_turn_whose_client_left_before_it_showed_anything(server: Server) -> None:
    """The cancel of a turn whose client left before it showed anything was saved (`withdraw` in
    its ack), then the server died before the turn's end was written: the restart drops its input
    as that server would have; a cancel saved without it keeps the input (cancelled), as before."""
    left = await left_running(server, "turn_left")
    named = await left_running(server, "turn_named")
    await server.store.record_cancel(left.id, {**cancel_ack(None), "withdraw": True}, reason="cancelled")
    await server.store.record_cancel(named.id, cancel_ack(None), reason="cancelled")
    seen: dict[str, Any] = {}
    server.kernel.on_settled(lambda record, snap: seen.__setitem__(record.id, snap))
    assert await server.kernel.settle_crashed(requeue=False) == 2
    stored = await server.store.get_turn(left.id)
    assert stored is not None and stored.status == "cancelled"
    assert stored.error is not None and stored.error["kind"] == "withdrawn" and not stored.input_committed
    assert (seen[left.id].status, (seen[left.id].error or {}).get("kind")) == ("cancelled", "withdrawn")
    texts = [m.text() for m in await server.store.list_messages(left.conversation_id)]
    assert "input of turn_left" not in texts
    kept = await server.store.get_turn(named.id)
    assert kept is not None and kept.status == "cancelled" and kept.error is None
    assert "input of turn_named" in [m.text() for m in await server.store.list_messages(named.conversation_id)]
    # settled once: a second start finds nothing left to settle
    assert await server.kernel.settle_crashed(requeue=False) == 0


def test_the_view_puts_each_rounds_results_in_the_order_of_its_calls() -> None:
    """The one place requests and estimates take the history from (`context_view`): each round's
    results in call order, a result that answers none of its calls in its place, the stored
    history untouched, the same records (one request message each)."""
    calls = [{"id": i, "name": f"tool_{i}", "arguments": "{}"} for i in ("a", "b", "c")]
    asked = MessageRecord(role="assistant", content="", tool_calls=calls)
    a, b, c = (MessageRecord(role="tool", content=i, tool_call_id=i) for i in ("a", "b", "c"))
    stray = MessageRecord(role="tool", content="x", tool_call_id="x")
    first, then = MessageRecord(role="user", content="go"), MessageRecord(role="user", content="next")
    history = [first, asked, c, stray, a, b, then]
    view = context_view(history)
    assert [m.content for m in view] == ["go", "", "a", "x", "b", "c", "next"]
    assert all(any(v is m for m in history) for v in view)
    assert [m.content for m in history] == ["go", "", "c", "x", "a", "b", "next"]
    # the round kept by a compaction (stored after the messages it kept), too
    summary = MessageRecord(role="compaction", content="earlier", meta={"kept": 5})
    view = context_view([MessageRecord(role="user", content="old"), *history[1:-1], summary, then])
    assert [m.content for m in view] == ["earlier", "", "a", "x", "b", "c", "next"]
