"""System and developer input items of /v1/responses are conversation state, as on OpenAI (session 28):

    r1 = responses.create(input=[{"role": "developer", "content": "Talk like a pirate."}, {"role": "user", ...}])
    r2 = responses.create(previous_response_id=r1.id, input=[{"role": "user", "content": "and now?"}])

r2's model call still sees the developer message, in its place before r1's user message (it
instructed r1's turn only). Through a real `appserver serve` on loopback with the real `openai`
SDK, agents on loopback fakes of an OpenAI-compatible upstream and of Anthropic's Messages API that
record what each model call got: continuations, a third turn, forks, developer items before the
new input (`added`), a stateless client resending its transcript (seen once per request, never
twice), chat completions over such a conversation (its own transcript is the truth: the kept ones
stay out), a WebSocket turn, the history and CLI showing them as what they are, a kill -9 mid-turn
(the system message survives with the interrupted turn's user message), Anthropic's top-level
`system`, and compaction keeping them verbatim.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appserver.agent.context import anchor_basis, context_view, estimate_request, to_chat_message
from appserver.config import load_config
from appserver.providers.base import ChatMessage, ProviderRequest
from appserver.runtime import SubmitRequest
from appserver.server import Server
from appserver.store.records import MessageRecord
from tests.fakes.anthropic_upstream import FakeAnthropic, anthropic_error, anthropic_sse, messages_problem, text_answer
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse
from tests.fakes.windowed_model import WindowedModel
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(120)

AGENT_SYSTEM = "You are the recording agent."


def answer(req: RecordedRequest) -> Reply:
    """The fake OpenAI-compatible model: "ok", slowly for a newest message marked SLOW (a kill lands
    meanwhile). Only the newest: a later turn whose history holds the SLOW turn is answered at once."""
    messages = (req.json or {}).get("messages") or [{}]
    slow = "SLOW" in str(messages[-1].get("content"))
    body = openai_sse([chunk(role="assistant", content="ok"), chunk(finish_reason="stop")])
    return Reply(pieces=[body], initial_delay_s=30 if slow else 0)


def anthropic_answer(req: RecordedRequest) -> Reply:
    problem = messages_problem(req.json)
    if problem is not None:
        error = json.dumps(anthropic_error("invalid_request_error", problem)).encode()
        return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
    return Reply(pieces=[anthropic_sse(text_answer("arr"))])


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, anth: FakeAnthropic, cli: dict[str, str]) -> None:
        self.sp, self.fake, self.anth, self.cli = sp, fake, anth, cli

    def call(self, marker: str, fake: FakeOpenAI | FakeAnthropic | None = None) -> dict[str, Any]:
        """The body of the one model call whose newest user message holds `marker`."""
        found = [b for b in bodies(fake or self.fake) if marker in _text(b["messages"][-1].get("content"))]
        assert len(found) == 1, (marker, found)
        return found[0]


def bodies(fake: FakeOpenAI | FakeAnthropic) -> list[dict[str, Any]]:
    return [r.json for r in list(fake.requests) if r.body]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def shown(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of each message a model call got."""
    return [(m["role"], _text(m.get("content"))) for m in body["messages"]]


def tag() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with FakeOpenAI() as fake, FakeAnthropic() as anth:
        fake.responder = answer
        anth.responder = anthropic_answer
        home: Path = tmp_path_factory.mktemp("s28g") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
            f'[providers.anth]\nkind = "anthropic"\nbase_url = "{anth.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for name, model in (("rec", "fake:m"), ("claude", "anth:claude-fake")):
            args = ("--name", name, "--model", model, "--system", AGENT_SYSTEM)
            made = run_cli(home, "agents", "create", *args, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, anth, cli)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def pirate(client: openai.OpenAI, t: str, model: str = "rec") -> tuple[Any, str]:
    """r1 of OpenAI's pattern; (the response, its conversation id)."""
    raw = client.responses.with_raw_response.create(
        model=model,
        input=[
            {"role": "developer", "content": f"Talk like a pirate {t}."},
            {"role": "user", "content": f"hi {t}"},
        ],
    )
    return raw.parse(), raw.headers["x-conversation-id"]


def test_the_developer_message_of_the_first_turn_stays_in_place_for_later_turns(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    r1, conv = pirate(client, t)
    assert r1.status == "completed"
    # r1 itself saw it once, before its user message, after the agent's own system prompt
    assert shown(env.call(f"hi {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"Talk like a pirate {t}."),
        ("user", f"hi {t}"),
    ]
    r2 = client.responses.create(
        model="rec", previous_response_id=r1.id, input=[{"role": "user", "content": f"and now? {t}"}]
    )
    assert r2.status == "completed"
    assert shown(env.call(f"and now? {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"Talk like a pirate {t}."),
        ("user", f"hi {t}"),
        ("assistant", "ok"),
        ("user", f"and now? {t}"),
    ]
    # a third turn, with per-request `instructions` on the second: those stay per request
    r3 = client.responses.create(
        model="rec", previous_response_id=r2.id, instructions=f"be brief {t}", input=f"third {t}"
    )
    r4 = client.responses.create(model="rec", previous_response_id=r3.id, input=f"fourth {t}")
    third, fourth = shown(env.call(f"third {t}")), shown(env.call(f"fourth {t}"))
    assert third[:3] == [("system", AGENT_SYSTEM), ("system", f"be brief {t}"), ("system", f"Talk like a pirate {t}.")]
    assert fourth == [
        ("system", AGENT_SYSTEM),
        ("system", f"Talk like a pirate {t}."),
        ("user", f"hi {t}"),
        ("assistant", "ok"),
        ("user", f"and now? {t}"),
        ("assistant", "ok"),
        ("user", f"third {t}"),
        ("assistant", "ok"),
        ("user", f"fourth {t}"),
    ]
    assert r4.status == "completed"
    # input_items lists the developer item as sent, as OpenAI does
    items = client.responses.input_items.list(r1.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "developer"), ("message", "user")]  # type: ignore[union-attr]
    # the conversation keeps it as a system message marked developer, shown as such (never user/assistant)
    listed = run_cli(env.sp.home, "conversations", "history", conv, "--json", env=env.cli)
    assert listed.code == 0, listed.err
    kept = [m for m in listed.json() if m["role"] == "system"]
    assert [(m["content"], m.get("meta")) for m in kept] == [(f"Talk like a pirate {t}.", {"role": "developer"})]
    plain = run_cli(env.sp.home, "conversations", "history", conv, env=env.cli)
    assert f"developer: Talk like a pirate {t}." in plain.out, plain.out


def test_forks_of_the_first_response_each_see_it(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    r1, _ = pirate(client, t)
    a = client.responses.create(model="rec", previous_response_id=r1.id, input=f"branch a {t}")
    b = client.responses.create(model="rec", previous_response_id=r1.id, input=f"branch b {t}")
    assert a.status == b.status == "completed"
    for branch in ("a", "b"):
        assert shown(env.call(f"branch {branch} {t}")) == [
            ("system", AGENT_SYSTEM),
            ("system", f"Talk like a pirate {t}."),
            ("user", f"hi {t}"),
            ("assistant", "ok"),
            ("user", f"branch {branch} {t}"),
        ]


def test_a_stateless_client_resending_its_developer_message_gets_it_once_and_the_conversation_keeps_it(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    dev = {"role": "developer", "content": f"Be terse {t}."}
    first = client.responses.create(model="rec", input=[dev, {"role": "user", "content": f"one {t}"}])
    second = client.responses.create(
        model="rec",
        input=[
            dev,
            {"role": "user", "content": f"one {t}"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": f"two {t}"},
        ],
    )
    assert first.status == second.status == "completed"
    # the transcript is the client's: its developer text instructs each request, once
    for marker in (f"one {t}", f"two {t}"):
        texts = [text for _, text in shown(env.call(marker))]
        assert texts.count(f"Be terse {t}.") == 1, shown(env.call(marker))
    assert shown(env.call(f"two {t}"))[-3:] == [("user", f"one {t}"), ("assistant", "ok"), ("user", f"two {t}")]
    # ... and the conversation kept it where it was sent: a continuation by id sees it in its place
    client.responses.create(model="rec", previous_response_id=second.id, input=f"three {t}")
    assert shown(env.call(f"three {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"Be terse {t}."),
        ("user", f"one {t}"),
        ("assistant", "ok"),
        ("user", f"two {t}"),
        ("assistant", "ok"),
        ("user", f"three {t}"),
    ]


def test_a_stateless_transcript_seeded_into_a_new_conversation_keeps_its_developer_message_in_place(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    seeded = client.responses.create(
        model="rec",
        input=[
            {"role": "user", "content": f"imported q {t}"},
            {"role": "assistant", "content": f"imported a {t}"},
            {"role": "developer", "content": f"From here on, rhyme {t}."},
            {"role": "user", "content": f"imported q2 {t}"},
            {"role": "assistant", "content": f"imported a2 {t}"},
            {"role": "user", "content": f"new {t}"},
        ],
    )
    client.responses.create(model="rec", previous_response_id=seeded.id, input=f"later {t}")
    assert shown(env.call(f"later {t}")) == [
        ("system", AGENT_SYSTEM),
        ("user", f"imported q {t}"),
        ("assistant", f"imported a {t}"),
        ("system", f"From here on, rhyme {t}."),
        ("user", f"imported q2 {t}"),
        ("assistant", f"imported a2 {t}"),
        ("user", f"new {t}"),
        ("assistant", "ok"),
        ("user", f"later {t}"),
    ]


def test_a_developer_message_among_messages_added_after_a_previous_response_stays_in_place(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    r1 = client.responses.create(model="rec", input=f"start {t}")
    r2 = client.responses.create(
        model="rec",
        previous_response_id=r1.id,
        input=[
            {"role": "developer", "content": f"Answer in French {t}."},
            {"role": "user", "content": f"example q {t}"},
            {"role": "assistant", "content": f"example a {t}"},
            {"role": "user", "content": f"real q {t}"},
        ],
    )
    expected = [
        ("system", AGENT_SYSTEM),
        ("user", f"start {t}"),
        ("assistant", "ok"),
        ("system", f"Answer in French {t}."),
        ("user", f"example q {t}"),
        ("assistant", f"example a {t}"),
        ("user", f"real q {t}"),
    ]
    assert shown(env.call(f"real q {t}")) == expected
    client.responses.create(model="rec", previous_response_id=r2.id, input=f"after {t}")
    assert shown(env.call(f"after {t}")) == [*expected, ("assistant", "ok"), ("user", f"after {t}")]


def test_chat_completions_over_such_a_conversation_leaves_the_kept_ones_out_and_they_stay_kept(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    _, conv = pirate(client, t)
    done = client.chat.completions.create(
        model="rec",
        messages=[{"role": "system", "content": f"chat rules {t}"}, {"role": "user", "content": f"via chat {t}"}],
        extra_headers={"X-Conversation-Id": conv},
    )
    assert done.choices[0].message.content == "ok"
    # the chat request's transcript is the truth: its own system message, none the conversation kept
    assert shown(env.call(f"via chat {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"chat rules {t}"),
        ("user", f"hi {t}"),
        ("assistant", "ok"),
        ("user", f"via chat {t}"),
    ]
    # a request continuing the conversation by id sees the kept one again (and nothing of chat's)
    client.responses.create(model="rec", conversation=conv, input=f"by conversation {t}")
    assert shown(env.call(f"by conversation {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"Talk like a pirate {t}."),
        ("user", f"hi {t}"),
        ("assistant", "ok"),
        ("user", f"via chat {t}"),
        ("assistant", "ok"),
        ("user", f"by conversation {t}"),
    ]


def test_a_websocket_turn_after_a_responses_turn_sees_it_and_the_history_shows_it_as_system(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    _, conv = pirate(client, t)

    async def ws_turn() -> list[dict[str, Any]]:
        ws = await WS.open(env.sp.url)
        try:
            await ws.request({"type": "subscribe", "conversation": conv})
            ack = await ws.request({"type": "submit_input", "agent": "rec", "conversation": conv, "input": f"ws {t}"})
            assert ack["type"] == "ack", ack
            snap = await ws.terminal(ack["turn_id"], 30)
            assert snap["status"] == "completed", snap
            history = await ws.request({"type": "get_history", "conversation": conv})
            return list(history["messages"])
        finally:
            await ws.close()

    messages = asyncio.run(ws_turn())
    assert shown(env.call(f"ws {t}")) == [
        ("system", AGENT_SYSTEM),
        ("system", f"Talk like a pirate {t}."),
        ("user", f"hi {t}"),
        ("assistant", "ok"),
        ("user", f"ws {t}"),
    ]
    assert [(m["role"], m["content"], m.get("meta")) for m in messages] == [
        ("system", f"Talk like a pirate {t}.", {"role": "developer"}),
        ("user", f"hi {t}", None),
        ("assistant", "ok", None),
        ("user", f"ws {t}", None),
        ("assistant", "ok", None),
    ]
    assert messages[0]["turn_id"] == messages[1]["turn_id"]  # kept with the turn whose input it was


def test_an_anthropic_agent_gets_the_kept_developer_message_in_its_top_level_system(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    r1, _ = pirate(client, t, model="claude")
    r2 = client.responses.create(model="claude", previous_response_id=r1.id, input=f"and now? {t}")
    assert r2.status == "completed" and r2.output_text == "arr"
    body = env.call(f"and now? {t}", env.anth)
    assert body["system"] == f"{AGENT_SYSTEM}\n\nTalk like a pirate {t}."
    assert [(m["role"], _text(m["content"])) for m in body["messages"]] == [
        ("user", f"hi {t}"),
        ("assistant", "arr"),
        ("user", f"and now? {t}"),
    ]


@pytest.mark.timeout(180)
def test_kill9_mid_turn_keeps_the_system_message_with_the_interrupted_turns_input(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with FakeOpenAI() as fake:
        fake.responder = answer
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        assert run_cli(home, "agents", "create", "--name", "rec", "--model", "fake:m", env=env).code == 0
        t = tag()
        sp = start_serve(home, env=env)
        try:
            with httpx.Client(base_url=sp.url, timeout=60) as http:
                r1 = http.post("/v1/responses", json={"model": "rec", "input": f"first {t}"})
                assert r1.status_code == 200, r1.text
                conv = r1.headers["x-conversation-id"]
                body = {
                    "model": "rec",
                    "previous_response_id": r1.json()["id"],
                    "input": [
                        {"role": "system", "content": f"kept rule {t}"},
                        {"role": "user", "content": f"SLOW {t}"},
                    ],
                }
                thread = threading.Thread(target=_post_ignoring_errors, args=(sp.url, body), daemon=True)
                thread.start()
                wait_for(lambda: any(b"SLOW" in r.body for r in list(fake.requests)), 20, "the model call")
                sp.proc.kill()  # SIGKILL, mid-turn
                sp.proc.wait(10)
                thread.join(20)
        finally:
            sp.kill()
        with serving(home, env=env) as sp2:
            history = run_cli(home, "conversations", "history", conv, "--json", env=env)
            assert history.code == 0, history.err
            messages = history.json()
            second = [m for m in messages if m["turn_id"] == messages[-1]["turn_id"]]
            assert [(m["role"], m["content"]) for m in second] == [("system", f"kept rule {t}"), ("user", f"SLOW {t}")]
            # the next turn continues after the interrupted one and sees the rule in its place
            with httpx.Client(base_url=sp2.url, timeout=60) as http:
                r = http.post("/v1/responses", json={"model": "rec", "conversation": conv, "input": f"resumed {t}"})
                assert r.status_code == 200, r.text
            last = [r.json for r in list(fake.requests) if f"resumed {t}".encode() in r.body]
            assert len(last) == 1
            assert shown(last[0]) == [
                ("user", f"first {t}"),
                ("assistant", "ok"),
                ("system", f"kept rule {t}"),
                ("user", f"SLOW {t}"),
                ("user", f"resumed {t}"),
            ]


def _post_ignoring_errors(url: str, body: dict[str, Any]) -> None:
    try:
        httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    except httpx.HTTPError:
        pass  # the server was killed under it


def test_the_view_keeps_system_messages_verbatim_past_a_compaction() -> None:
    sys_ = MessageRecord(role="system", content="rule", id=1)
    u1, a1 = MessageRecord(role="user", content="u1", id=2), MessageRecord(role="assistant", content="a1", id=3)
    u2, a2 = MessageRecord(role="user", content="u2", id=4), MessageRecord(role="assistant", content="a2", id=5)
    summary = MessageRecord(role="compaction", content="summary", id=6, meta={"kept": 2})
    assert context_view([sys_, u1, a1, u2, a2, summary]) == [sys_, summary, u2, a2]
    # the same messages kept, whether the system messages are in the list or not
    assert context_view([u1, a1, u2, a2, summary]) == [summary, u2, a2]
    s2 = MessageRecord(role="system", content="rule 2", id=7)
    assert context_view([sys_, u1, a1, s2, u2, a2, summary]) == [sys_, summary, s2, u2, a2]


async def test_compaction_never_folds_a_kept_system_message(tmp_path: Path) -> None:
    """A long conversation on a small window: the system message its first turn kept reaches every
    later model call verbatim, never folded into a summary."""
    model = WindowedModel(window=2_000)
    lorem = "the quick brown fox jumps over the lazy dog " * 12
    async with FakeOpenAI() as fake:
        fake.responder = model
        home = tmp_path / "h"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\n'
        )
        server = Server(load_config(home, environ={"APPSERVER_LIMITS__RETRY_BASE_MS": "5"}))
        await server.open()
        try:
            await server.agents.create("small", "fake:small")
            conv = "new"
            for i in range(1, 31):
                system = [{"role": "developer", "text": "PINNED RULE: always answer politely."}] if i == 1 else []
                sub = await server.kernel.submit(
                    SubmitRequest(agent="small", input=f"turn {i}: {lorem}", conversation=conv, system=system)
                )
                conv = sub.conversation_id
                snap = await sub.wait(20)
                assert snap.status == "completed", (i, snap.error)
            history = await server.store.list_messages(conv)
        finally:
            await server.close()
    assert [m.role for m in history].count("compaction") >= 2
    calls = [s["body"] for s in model.answered() if not s["summary"]]
    assert len(calls) == 30
    for body in calls:
        assert ("system", "PINNED RULE: always answer politely.") in shown(body)
    # never summarised: no summary request was sent the rule
    assert not any("PINNED RULE" in json.dumps(s["body"]) for s in model.answered() if s["summary"])


def test_a_count_made_without_the_kept_system_messages_never_anchors_a_view_with_them() -> None:
    """A chat turn's model call (the kept system messages left out) measured the context; a later
    turn that shows them must not take that count as describing its messages before the reply."""
    rule = MessageRecord(role="system", content="a long kept rule " * 200, id=1)
    user = MessageRecord(role="user", content="hi", id=2)
    lead = [ChatMessage("system", "agent")]
    measured_request = ProviderRequest(model="m", messages=[*lead, to_chat_message(user)])
    basis = anchor_basis(measured_request, 1, lambda _tools: 0, [user])
    reply = MessageRecord(role="assistant", content="ok", id=3, meta={"context_tokens": 20, "context_basis": basis})
    view = [rule, user, reply]
    request = ProviderRequest(model="m", messages=[*lead, *(to_chat_message(m) for m in view)])
    # the pure estimate: the rule's ~1,000 tokens counted, not the 20 measured without it
    assert estimate_request(request, view) > 900
    # without the rule in view the count still anchors (what it describes is sent again)
    anchored = ProviderRequest(model="m", messages=[*lead, to_chat_message(user), to_chat_message(reply)])
    assert estimate_request(anchored, [user, reply]) < 40


def test_a_developer_item_among_a_seeded_transcripts_tool_round_goes_after_its_results(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    seeded = client.responses.create(
        model="rec",
        input=[
            {"role": "user", "content": f"weather? {t}"},
            {"type": "function_call", "call_id": f"call_{t}", "name": "get_weather", "arguments": "{}"},
            {"role": "developer", "content": f"Use Celsius {t}."},
            {"type": "function_call_output", "call_id": f"call_{t}", "output": "20C"},
            {"role": "assistant", "content": f"It is 20C {t}"},
            {"role": "user", "content": f"thanks {t}"},
        ],
    )
    client.responses.create(model="rec", previous_response_id=seeded.id, input=f"bye {t}")
    body = env.call(f"bye {t}")
    assert [m["role"] for m in body["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "system",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert body["messages"][3]["tool_call_id"] == f"call_{t}"
    assert body["messages"][4]["content"] == f"Use Celsius {t}."
