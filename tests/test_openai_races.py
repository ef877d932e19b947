"""Requests racing on one history, through a real `appserver serve` with the real `openai` SDK.

Two (or more) clients send the same stateless history at once: an SDK retry while the first is
still running, two tabs, a double click. Each must be answered on exactly that history: the first
continues the conversation, the others fork from the same point. None may queue into the
conversation behind another and see its input in its history (DESIGN §5: nothing duplicated).
`/recall` makes the history each turn saw observable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import require_conformance, sse_lines, sse_payloads, validate
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

N = 6


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    require_conformance()
    home = tmp_path_factory.mktemp("races") / "home"
    with serving(home) as sp:
        yield sp


@pytest.fixture
def client(srv: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def race(fn: Callable[[], tuple[str, str]]) -> list[tuple[str, str]]:
    """`fn` run N times at once (released together): [(conversation id, reply text)]."""
    gate = threading.Barrier(N)

    def one(_: int) -> tuple[str, str]:
        gate.wait()
        return fn()

    with ThreadPoolExecutor(N) as pool:
        return list(pool.map(one, range(N)))


def check(results: list[tuple[str, str]], base: str, original: str) -> None:
    texts = [t for _, t in results]
    assert texts == [base] * N, f"a racing request saw another's input in its history: {texts}"
    convs = [c for c, _ in results]
    assert len(set(convs)) == N, f"racing requests shared a conversation: {convs}"
    assert convs.count(original) == 1  # one continued it, the others forked


def test_racing_chat_requests_with_one_history_each_get_their_own_turn(
    client: openai.OpenAI, srv: ServeProcess
) -> None:
    base = f"chat {time.time()}"
    first = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": base}]
    )
    conv = first.headers["x-conversation-id"]
    history: list[Any] = [
        {"role": "user", "content": base},
        {"role": "assistant", "content": first.parse().choices[0].message.content},
        {"role": "user", "content": "/recall"},
    ]

    def call() -> tuple[str, str]:
        r = client.chat.completions.with_raw_response.create(model="assistant", messages=history)
        validate("CreateChatCompletionResponse", r.http_response.json())
        return r.headers["x-conversation-id"], str(r.parse().choices[0].message.content)

    check(race(call), base, conv)

    # streams race the same way
    base = f"stream {time.time()}"
    first = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": base}]
    )
    conv = first.headers["x-conversation-id"]
    history = [
        {"role": "user", "content": base},
        {"role": "assistant", "content": first.parse().choices[0].message.content},
        {"role": "user", "content": "/recall"},
    ]

    def stream() -> tuple[str, str]:
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"model": "assistant", "stream": True, "messages": history},
            timeout=30,
        )
        text = ""
        for p in sse_payloads(sse_lines(r.content)):
            if p != "[DONE]":
                chunk = httpx.Response(200, content=p).json()
                validate("CreateChatCompletionStreamResponse", chunk)
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        return r.headers["x-conversation-id"], text

    check(race(stream), base, conv)


def test_racing_responses_requests_fork_instead_of_queueing(client: openai.OpenAI) -> None:
    # stateless: the whole history resent
    base = f"responses {time.time()}"
    first = client.responses.with_raw_response.create(model="assistant", input=base)
    conv = first.headers["x-conversation-id"]
    items: list[Any] = [
        {"role": "user", "content": base},
        {"role": "assistant", "content": first.parse().output_text},
        {"role": "user", "content": "/recall"},
    ]

    def stateless() -> tuple[str, str]:
        r = client.responses.with_raw_response.create(model="assistant", input=items)
        validate("Response", r.http_response.json())
        return r.headers["x-conversation-id"], r.parse().output_text

    check(race(stateless), base, conv)

    # previous_response_id: one continues the response's conversation, the others fork from it
    base = f"previous {time.time()}"
    first = client.responses.with_raw_response.create(model="assistant", input=base)
    conv = first.headers["x-conversation-id"]
    prev = first.parse().id

    def chained() -> tuple[str, str]:
        r = client.responses.with_raw_response.create(model="assistant", input="/recall", previous_response_id=prev)
        validate("Response", r.http_response.json())
        return r.headers["x-conversation-id"], r.parse().output_text

    check(race(chained), base, conv)


def test_a_sequential_stateless_client_still_continues_one_conversation(client: openai.OpenAI) -> None:
    """The claim that makes racers fork must not make a client that waits for each answer fork."""
    history: list[Any] = []
    convs = set()
    for i in range(5):
        history.append({"role": "user", "content": f"seq{i}" if i < 4 else "/recall"})
        r = client.chat.completions.with_raw_response.create(model="assistant", messages=history)
        convs.add(r.headers["x-conversation-id"])
        history.append({"role": "assistant", "content": r.parse().choices[0].message.content})
    assert len(convs) == 1
    assert history[-1]["content"] == "seq0 | seq1 | seq2 | seq3"


def test_a_reply_point_is_the_reply_even_when_a_queued_turn_commits_right_after(client: openai.OpenAI) -> None:
    """Two requests pinned to one conversation (X-Conversation-Id): one runs, the other, queued,
    runs at once after it. Each client then resends only what it saw, [its input, its reply,
    /recall]. The one that ran first must fork at its own reply and never see the other's turn:
    its history point is its reply's message, not whatever the conversation's newest message was
    when the point was written (the other turn may have committed by then)."""
    for i in range(8):
        pinned = f"pinned-{time.time_ns()}-{i}"
        texts = [f"A{i} {time.time()}", f"B{i} {time.time()}"]

        def pinned_call(text: str, pinned: str = pinned) -> str:
            r = client.chat.completions.create(
                model="assistant",
                messages=[{"role": "user", "content": text}],
                extra_headers={"X-Conversation-Id": pinned},
            )
            return str(r.choices[0].message.content)

        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(pinned_call, texts))
        clean = 0
        for mine, reply, other in ((texts[0], replies[0], texts[1]), (texts[1], replies[1], texts[0])):
            follow = client.chat.completions.create(
                model="assistant",
                messages=[
                    {"role": "user", "content": mine},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "/recall"},
                ],
            )
            seen = str(follow.choices[0].message.content)
            assert mine in seen, seen
            clean += other not in seen
        assert clean == 1, "the follow-up of the turn that ran first saw the turn queued behind it"
