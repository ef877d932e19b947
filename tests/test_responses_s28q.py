"""System/developer input items kept by a conversation never make it unusable; blank ones are no
message; a withdrawn response says so and continues nothing (session 28, an outside tester's
findings on the commit that made Responses system/developer items conversation state).

Through a real `appserver serve` on loopback with the real `openai` SDK, agents on loopback fakes of
an OpenAI-compatible upstream (whose `small` model has a window it enforces, as a real one does:
"context_length_exceeded") and of Anthropic's Messages API (which refuses blank system text):

- a request whose own developer item cannot fit beside the agent's lead is refused 400
  `context_length_exceeded` before anything is sent, its error naming the system/developer
  messages, and the conversation keeps none of them: every later turn (Responses, WebSocket) works;
- a stateful conversation whose every turn brings some developer context keeps working however long
  it runs: the kept ones stay verbatim while they fit, the oldest are folded into the summary;
- a blank developer/system item reaches no upstream and is not kept;
- a response whose stream client left before anything was shown (its turn withdrawn) is stored
  `cancelled` with an error saying so, and `previous_response_id` naming it is a 400.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appserver.agent.context import Budget, cannot_shrink, context_view
from appserver.store.records import MessageRecord
from tests.fakes.anthropic_upstream import FakeAnthropic, anthropic_error, anthropic_sse, messages_problem, text_answer
from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_error, openai_sse
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving
from tests.support.wait import wait_for
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(180)

AGENT_SYSTEM = "You are the recording agent."
WINDOW = 1_500  # the `small` model's, in the fake and in config.toml alike
CHARS_PER_TOKEN = 3.5  # how the fake counts a prompt (the server's own estimate: no slack either way)
SUMMARISING = "compacting a long conversation"


class Model:
    """The fake OpenAI-compatible upstream: records every call; `small` refuses a prompt over
    WINDOW; a summary request is answered with the CTX markers its transcript holds (the gist of
    what was folded); an input marked SLOW waits 30 s first; anything else gets "ok"."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, req: RecordedRequest) -> Reply:
        body = req.json
        messages = body["messages"]
        size = sum(len(_text(m.get("content"))) for m in messages) / CHARS_PER_TOKEN
        with self._lock:
            self.calls.append(body)
        if body.get("model") == "small" and size > WINDOW:
            with self._lock:
                self.refused.append(body)
            message = (
                f"This model's maximum context length is {WINDOW} tokens. "
                f"However, your messages resulted in {math.ceil(size)} tokens."
            )
            error = json.dumps(openai_error(message, code="context_length_exceeded")).encode()
            return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
        if any(m["role"] == "system" and SUMMARISING in _text(m.get("content")) for m in messages):
            markers = sorted(set(re.findall(r"CTX-\d+", _text(messages[-1].get("content")))))
            text = f"Summary: developer context {' '.join(markers) or 'none'}; the user asked questions."
        else:
            text = "ok"
        slow = any(m["role"] == "user" and "SLOW" in _text(m.get("content")) for m in messages[-1:])
        pieces = [openai_sse([chunk(role="assistant", content=text), chunk(finish_reason="stop")])]
        return Reply(pieces=pieces, initial_delay_s=30 if slow else 0)

    def answered(self) -> list[dict[str, Any]]:
        with self._lock:
            return [b for b in self.calls if b not in self.refused]


def anthropic_answer(req: RecordedRequest) -> Reply:
    """The Messages API's own rules, and blank system text refused as it refuses a blank text block."""
    problem = messages_problem(req.json)
    system = req.json.get("system")
    if problem is None and isinstance(system, str) and not system.strip():
        problem = "system: text content blocks must contain non-whitespace text"
    if problem is not None:
        error = json.dumps(anthropic_error("invalid_request_error", problem)).encode()
        return Reply(status=400, pieces=[error], content_type="application/json", chunked=False)
    return Reply(pieces=[anthropic_sse(text_answer("arr"))])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def shown(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["role"], _text(m.get("content"))) for m in body["messages"]]


def tag() -> str:
    return uuid.uuid4().hex[:10]


class Env:
    def __init__(self, sp: ServeProcess, fake: FakeOpenAI, model: Model, anth: FakeAnthropic) -> None:
        self.sp, self.fake, self.model, self.anth = sp, fake, model, anth


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    model = Model()
    with FakeOpenAI() as fake, FakeAnthropic() as anth:
        fake.responder = model
        anth.responder = anthropic_answer
        home: Path = tmp_path_factory.mktemp("s28q") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
            f'context_windows = {{ "small" = {WINDOW} }}\n'
            f'[providers.anth]\nkind = "anthropic"\nbase_url = "{anth.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        cli = cli_env(home)
        for args in (
            ("--name", "small", "--model", "fake:small", "--system", AGENT_SYSTEM),
            ("--name", "rec", "--model", "fake:m", "--system", AGENT_SYSTEM),
            ("--name", "claude", "--model", "anth:claude-fake"),  # no system prompt: a blank one would be all
        ):
            made = run_cli(home, "agents", "create", *args, env=cli)
            assert made.code == 0, made.err
        with serving(home, env=cli) as sp:
            yield Env(sp, fake, model, anth)


@pytest.fixture
def client(env: Env) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{env.sp.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


async def _ws(url: str, conv: str, agent: str, text: str | None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A WebSocket turn in `conv` (none when `text` is None): its terminal snapshot, then the history."""
    ws = await WS.open(url)
    try:
        snap = None
        if text is not None:
            await ws.request({"type": "subscribe", "conversation": conv})
            ack = await ws.request({"type": "submit_input", "agent": agent, "conversation": conv, "input": text})
            assert ack["type"] == "ack", ack
            snap = await ws.terminal(ack["turn_id"], 60)
        history = await ws.request({"type": "get_history", "conversation": conv})
        return snap, list(history["messages"])
    finally:
        await ws.close()


def ws_turn(env: Env, conv: str, agent: str, text: str | None = None) -> tuple[dict[str, Any] | None, list[Any]]:
    return asyncio.run(_ws(env.sp.url, conv, agent, text))


def lorem(marker: str, chars: int) -> str:
    words = "lorem ipsum dolor sit amet "
    return f"{marker} " + (words * (chars // len(words) + 1))[:chars]


# ---------------------------------------------------------------- an over-window developer item


@pytest.mark.parametrize("how", ["conversation", "previous_response_id"])
def test_a_developer_item_that_cannot_fit_is_refused_before_anything_is_sent_and_never_kept(
    env: Env, client: openai.OpenAI, how: str
) -> None:
    t = tag()
    raw = client.responses.with_raw_response.create(model="small", input=f"hi {t}")
    r1, conv = raw.parse(), raw.headers["x-conversation-id"]
    where: dict[str, Any] = {"conversation": conv} if how == "conversation" else {"previous_response_id": r1.id}
    sent = len(env.model.calls)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="small",
            input=[{"role": "developer", "content": lorem(f"HUGE {t}", 20_000)}, {"role": "user", "content": f"q {t}"}],
            **where,
        )
    assert caught.value.code == "context_length_exceeded"
    message = str(caught.value.message)
    assert "system/developer messages of this request's input" in message, message
    assert "not keep them" in message and "newest messages" not in message, message
    assert len(env.model.calls) == sent  # nothing sent: no pointless compaction, no refused request
    _, history = ws_turn(env, conv, "small")
    assert not [m for m in history if m["role"] == "system"], history  # the item is not kept
    # the conversation stays usable, every way in
    after = client.responses.create(model="small", conversation=conv, input=f"after {t}")
    assert after.status == "completed" and after.output_text == "ok"
    snap, history = ws_turn(env, conv, "small", f"ws after {t}")
    assert snap is not None and snap["status"] == "completed", snap
    assert not any(f"HUGE {t}" in json.dumps(b) for b in env.model.calls[sent:])


# ---------------------------------------------------------------- kept items never brick a conversation


def test_developer_context_sent_with_every_turn_never_makes_the_conversation_unusable(
    env: Env, client: openai.OpenAI
) -> None:
    """~1,200 characters of developer context per turn (a third of the window each) with
    previous_response_id: every turn answers; the newest stays verbatim, the oldest are folded
    into the summary, whose gist the model still gets."""
    t = tag()
    raw = client.responses.with_raw_response.create(model="small", input=f"hi {t}")
    r, conv = raw.parse(), raw.headers["x-conversation-id"]
    for i in range(8):
        r = client.responses.create(
            model="small",
            previous_response_id=r.id,
            input=[
                {"role": "developer", "content": lorem(f"CTX-{i} {t}", 1_200)},
                {"role": "user", "content": f"question {i} {t}"},
            ],
        )
        assert r.status == "completed" and r.output_text == "ok", (i, r.error)
    raw = client.responses.with_raw_response.create(model="small", previous_response_id=r.id, input=f"plain {t}")
    assert raw.parse().status == "completed" and raw.headers["x-conversation-id"] == conv
    assert not any(t in json.dumps(b) for b in env.model.refused)  # never a request the model refused
    ours = [b for b in env.model.answered() if t in json.dumps(b)]
    summaries = [b for b in ours if SUMMARISING in _text(b["messages"][0].get("content"))]
    assert summaries, "the conversation was compacted"
    # the folded developer context went into a summary as what it was
    assert any(f"[Developer]\nCTX-0 {t}" in _text(b["messages"][-1]["content"]) for b in summaries)
    last = next(b for b in reversed(ours) if f"plain {t}" in _text(b["messages"][-1].get("content")))
    roles = shown(last)
    system = [text for role, text in roles if role == "system"]
    assert any(text.startswith(f"CTX-7 {t}") for text in system), roles  # the newest verbatim
    assert not any(text.startswith(f"CTX-0 {t}") for text in system)  # the oldest folded...
    assert any("CTX-0" in text for role, text in roles if role == "user" and text.startswith("[Summary"))  # its gist
    # a WebSocket turn of the conversation too
    snap, history = ws_turn(env, conv, "small", f"ws {t}")
    assert snap is not None and snap["status"] == "completed", snap
    # every developer item is still in the history (append-only): folded only in what the model sees
    assert sum(1 for m in history if m["role"] == "system" and t in m["content"]) == 8


def test_the_view_leaves_out_the_system_messages_a_compaction_folded() -> None:
    s1 = MessageRecord(role="system", content="old rule", id=1)
    u1, a1 = MessageRecord(role="user", content="u1", id=2), MessageRecord(role="assistant", content="a1", id=3)
    s2 = MessageRecord(role="system", content="new rule", id=4)
    u2, a2 = MessageRecord(role="user", content="u2", id=5), MessageRecord(role="assistant", content="a2", id=6)
    summary = MessageRecord(role="compaction", content="summary", id=7, meta={"kept": 2, "system_folded": 1})
    assert context_view([s1, u1, a1, s2, u2, a2, summary]) == [summary, s2, u2, a2]
    both = MessageRecord(role="compaction", content="summary", id=7, meta={"kept": 2, "system_folded": 2})
    assert context_view([s1, u1, a1, s2, u2, a2, both]) == [both, u2, a2]


def test_a_refusal_compaction_cannot_answer_names_the_kept_system_messages() -> None:
    error = cannot_shrink(Budget(1_500, 375), 100, 900, "too long", 400, system=700)
    assert "system/developer messages the conversation keeps take about 700" in error.message
    assert "newest messages (never folded) about 200" in error.message


# ---------------------------------------------------------------- blank system text


def test_a_blank_developer_item_reaches_no_upstream_and_is_not_kept(env: Env, client: openai.OpenAI) -> None:
    t = tag()
    raw = client.responses.with_raw_response.create(model="claude", input=f"hi {t}")
    r1, conv = raw.parse(), raw.headers["x-conversation-id"]
    r2 = client.responses.create(
        model="claude",
        previous_response_id=r1.id,
        input=[{"role": "developer", "content": " \n "}, {"role": "user", "content": f"hi2 {t}"}],
    )
    assert r2.status == "completed" and r2.output_text == "arr"
    snap, history = ws_turn(env, conv, "claude", f"ws {t}")
    assert snap is not None and snap["status"] == "completed", snap
    assert not [m for m in history if m["role"] == "system"], history
    stateless = client.responses.create(
        model="claude", input=[{"role": "system", "content": "\t"}, {"role": "user", "content": f"stateless {t}"}]
    )
    assert stateless.status == "completed"
    for marker in (f"hi2 {t}", f"ws {t}", f"stateless {t}"):
        body = next(r.json for r in list(env.anth.requests) if marker.encode() in r.body)
        assert "system" not in body, body
    # on an OpenAI-compatible agent it is not kept either
    raw = client.responses.with_raw_response.create(
        model="rec", input=[{"role": "developer", "content": "  "}, {"role": "user", "content": f"oa {t}"}]
    )
    _, history = ws_turn(env, raw.headers["x-conversation-id"], "rec")
    assert [m["role"] for m in history] == ["user", "assistant"]


# ---------------------------------------------------------------- a withdrawn response


def test_a_withdrawn_response_says_so_and_previous_response_id_naming_it_is_refused(
    env: Env, client: openai.OpenAI
) -> None:
    t = tag()
    raw = client.responses.with_raw_response.create(
        model="rec", input=[{"role": "developer", "content": f"D0 {t}"}, {"role": "user", "content": f"first {t}"}]
    )
    r0, conv = raw.parse(), raw.headers["x-conversation-id"]
    rid = None
    with client.responses.create(
        model="rec",
        previous_response_id=r0.id,
        input=[{"role": "developer", "content": f"DGONE {t}"}, {"role": "user", "content": f"SLOW {t}"}],
        stream=True,
    ) as stream:
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
                break
    assert rid is not None
    # the model call began; the client left before anything was shown: the turn is withdrawn
    wait_for(lambda: any(f"SLOW {t}".encode() in r.body for r in list(env.fake.requests)), 20, "the model call")

    def settled() -> bool:
        return client.responses.retrieve(rid).status != "in_progress"

    wait_for(settled, 20, "the response to be stored as its turn ended")
    gone = client.responses.retrieve(rid)
    assert gone.status == "cancelled"
    assert gone.error is not None and gone.error.code == "server_error"
    assert gone.error.message.endswith("[input_withdrawn]") and "went away" in gone.error.message
    _, before = ws_turn(env, conv, "rec")
    assert not any(t in m["content"] and ("SLOW" in m["content"] or "DGONE" in m["content"]) for m in before)
    sent = len(env.fake.requests)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="rec", previous_response_id=rid, input=f"after {t}")
    assert caught.value.param == "previous_response_id"
    assert caught.value.code == "previous_response_withdrawn"
    assert r0.id in str(caught.value.message) and "went away" in str(caught.value.message)
    time.sleep(0.2)
    assert len(env.fake.requests) == sent  # nothing ran
    _, after = ws_turn(env, conv, "rec")
    assert after == before  # nothing written
    # continuing from the response before it works, as the error says
    again = client.responses.create(model="rec", previous_response_id=r0.id, input=f"again {t}")
    assert again.status == "completed"
