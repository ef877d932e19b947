"""OpenAI surface fidelity, from an outside tester's findings with real clients (round 18).

Through a real `appserver serve` with the real `openai` SDK (httpx where the raw bytes matter):
`assistant` runs on echo, `remote` on a loopback fake OpenAI upstream that answers "fine" and
records what it was sent. Bodies, chunks and events are validated against OpenAI's OpenAPI document.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.openai_upstream import FakeOpenAI, RecordedRequest, Reply, chunk, openai_sse, usage_chunk
from tests.openai_schema import require_conformance, sse_payloads, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving

pytestmark = pytest.mark.timeout(60)

IMG1 = "data:image/png;base64,iVBORw0KGgo="
IMG2 = "data:image/png;base64,R0lGODlhAQABAAAAACw="
HEADER = "x-conversation-id"


def upstream_model(req: RecordedRequest) -> Reply:
    sse = openai_sse([chunk(role="assistant", content="fine"), chunk(finish_reason="stop"), usage_chunk(5, 1)])
    return Reply(pieces=[sse])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, FakeOpenAI]]:
    require_conformance()
    with FakeOpenAI() as fake:
        fake.responder = upstream_model
        home = tmp_path_factory.mktemp("fidelity18") / "home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\napi_key_env = ""\nmax_attempts = 1\n'
        )
        env = cli_env(home)
        assert run_cli(home, "agents", "list", env=env).code == 0  # creates `assistant`
        r = run_cli(home, "agents", "create", "--name", "remote", "--model", "fake:m", "--json", env=env)
        assert r.code == 0, r.err
        with serving(home, env=env) as sp:
            yield sp, fake


@pytest.fixture
def client(srv: tuple[ServeProcess, FakeOpenAI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def http(srv: tuple[ServeProcess, FakeOpenAI]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv[0].url, timeout=30) as c:
        yield c


@pytest.fixture
def fake(srv: tuple[ServeProcess, FakeOpenAI]) -> FakeOpenAI:
    srv[1].requests.clear()
    return srv[1]


def last_user_content(fake: FakeOpenAI) -> Any:
    return [m for m in fake.requests[-1].json["messages"] if m["role"] == "user"][-1]["content"]


def user_contents(fake: FakeOpenAI) -> list[Any]:
    return [m["content"] for m in fake.requests[-1].json["messages"] if m["role"] == "user"]


# ---------------------------------------------------------------- F1 content parts kept as sent

PARTS_R = [
    {"type": "input_text", "text": "First image:"},
    {"type": "input_image", "image_url": IMG1, "detail": "low"},
    {"type": "input_text", "text": "Second image:"},
    {"type": "input_image", "image_url": IMG2, "detail": "high"},
]
PARTS_UPSTREAM = [
    {"type": "text", "text": "First image:"},
    {"type": "image_url", "image_url": {"url": IMG1, "detail": "low"}},
    {"type": "text", "text": "Second image:"},
    {"type": "image_url", "image_url": {"url": IMG2, "detail": "high"}},
]


def test_responses_parts_reach_the_model_in_order_with_their_detail(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    first = http.post("/v1/responses", json={"model": "remote", "input": [{"role": "user", "content": PARTS_R}]})
    assert first.status_code == 200, first.text
    validate("Response", first.json())
    assert last_user_content(fake) == PARTS_UPSTREAM
    items = client.responses.input_items.list(first.json()["id"])
    listed = items.model_dump()["data"][0]["content"]
    assert [(p["type"], p.get("text"), p.get("image_url"), p.get("detail")) for p in listed] == [
        ("input_text", "First image:", None, None),
        ("input_image", None, IMG1, "low"),
        ("input_text", "Second image:", None, None),
        ("input_image", None, IMG2, "high"),
    ]
    # a stateless client resends the whole history: the same conversation, nothing duplicated
    again = http.post(
        "/v1/responses",
        json={
            "model": "remote",
            "input": [
                {"role": "user", "content": PARTS_R},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "and now?"},
            ],
        },
    )
    assert again.status_code == 200, again.text
    assert again.headers[HEADER] == first.headers[HEADER]
    assert user_contents(fake) == [PARTS_UPSTREAM, "and now?"]
    # an image without detail is echoed `auto` and reaches the upstream without one
    r = http.post(
        "/v1/responses",
        json={"model": "remote", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMG1}]}]},
    )
    assert last_user_content(fake) == [{"type": "image_url", "image_url": {"url": IMG1}}]
    got = http.get(f"/v1/responses/{r.json()['id']}/input_items").json()["data"][0]["content"]
    assert got == [{"type": "input_image", "image_url": IMG1, "detail": "auto"}]


def test_chat_text_parts_stay_apart_and_images_keep_detail(http: httpx.Client, fake: FakeOpenAI) -> None:
    parts = [{"type": "text", "text": "Translate this"}, {"type": "text", "text": "into French"}]
    first = http.post(
        "/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": parts}]}
    )
    assert first.status_code == 200, first.text
    assert last_user_content(fake) == parts
    again = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "thanks"},
            ],
        },
    )
    assert again.headers[HEADER] == first.headers[HEADER]
    assert user_contents(fake) == [parts, "thanks"]
    mixed = [
        {"type": "image_url", "image_url": {"url": IMG1, "detail": "high"}},
        {"type": "text", "text": "what is this?"},
    ]
    http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": mixed}]})
    assert last_user_content(fake) == mixed
    # a detail OpenAI does not know is refused by name
    bad = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMG1, "detail": "x"}}]}
            ],
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[0].image_url.detail"


def test_echo_answers_text_parts_one_per_line(client: openai.OpenAI) -> None:
    c = client.chat.completions.create(
        model="assistant",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Translate this"}, {"type": "text", "text": "into French"}],
            }
        ],
    )
    assert c.choices[0].message.content == "echo: Translate this\ninto French"


def test_plain_text_stays_plain_and_matches_as_before(http: httpx.Client, fake: FakeOpenAI) -> None:
    first = http.post(
        "/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": "plain s18"}]}
    )
    assert last_user_content(fake) == "plain s18"
    # one text part is the same message as its string: the history continues the conversation
    again = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "plain s18"}]},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": [{"type": "text", "text": "next"}]},
            ],
        },
    )
    assert again.headers[HEADER] == first.headers[HEADER]
    assert user_contents(fake) == ["plain s18", "next"]
    # text then an image of detail auto: keyed as before, so points recorded earlier keep matching
    img = [{"type": "text", "text": "look s18"}, {"type": "image_url", "image_url": {"url": IMG1}}]
    first = http.post("/v1/chat/completions", json={"model": "remote", "messages": [{"role": "user", "content": img}]})

    def resend(content: list[dict[str, Any]]) -> httpx.Response:
        return http.post(
            "/v1/chat/completions",
            json={
                "model": "remote",
                "messages": [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": "fine"},
                    {"role": "user", "content": "more"},
                ],
            },
        )

    # the same parts in another order are another message: not this conversation (it stays at that point)
    assert resend(list(reversed(img))).headers[HEADER] != first.headers[HEADER]
    auto = [{"type": "text", "text": "look s18"}, {"type": "image_url", "image_url": {"url": IMG1, "detail": "auto"}}]
    assert resend(auto).headers[HEADER] == first.headers[HEADER]


# ---------------------------------------------------------------- F2 usage null on every chunk


def stream_chunks(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines()]
    return [json.loads(p) for p in sse_payloads(lines) if p != "[DONE]"]


def test_include_usage_puts_usage_null_on_every_other_chunk(http: httpx.Client) -> None:
    body = {"model": "assistant", "messages": [{"role": "user", "content": "a b c"}], "stream": True}
    chunks = stream_chunks(http, {**body, "stream_options": {"include_usage": True}})
    assert len(chunks) > 3
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # without it, no usage key at all (as OpenAI)
    assert all("usage" not in c for c in stream_chunks(http, body))


# ---------------------------------------------------------------- F3 array bounds


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": []}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"functions": []}, "functions"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ],
)
def test_array_bounds_of_the_spec_are_checked(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"model": "assistant", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param


def test_four_stop_sequences_are_taken(http: httpx.Client, fake: FakeOpenAI) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d"]},
    )
    assert r.status_code == 200, r.text
    assert fake.requests[-1].json["stop"] == ["a", "b", "c", "d"]


# ---------------------------------------------------------------- F4 cancel


def test_cancel_is_a_route_refusing_non_background_responses(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(model="assistant", input="hi")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.cancel(r.id)
    err = bad.value.body
    assert isinstance(err, dict) and "background" in err["message"]
    assert bad.value.response.json()["error"]["type"] == "invalid_request_error"
    validate("ErrorResponse", bad.value.response.json())
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 32)
    unstored = client.responses.create(model="assistant", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(unstored.id)
    assert client.responses.retrieve(r.id).status == "completed"  # nothing changed
    assert http.get(f"/v1/responses/{r.id}/cancel").status_code == 405


# ---------------------------------------------------------------- F5 prompt


@pytest.mark.parametrize("prompt", [{"id": "pmpt_123", "variables": {"x": "y"}}, 5, "pmpt_123"])
def test_a_prompt_template_is_refused(http: httpx.Client, prompt: Any) -> None:
    r = http.post("/v1/responses", json={"model": "assistant", "input": "hi", "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "unsupported_parameter"


def test_a_null_prompt_is_fine(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": "assistant", "input": "hi", "prompt": None})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- F6 text.format echo


def test_json_schema_format_is_echoed_with_strict(client: openai.OpenAI, http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
    r = http.post("/v1/responses", json={"model": "assistant", "input": "hi", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    shown = r.json()["text"]["format"]
    # strict as OpenAI defaults it; description only when sent: OpenAI's document types it a string
    # (Open Responses wants it present, null allowed: the two documents cannot both hold here)
    assert shown == {**fmt, "strict": False}
    validate("Response", r.json())
    got = http.get(f"/v1/responses/{r.json()['id']}").json()["text"]["format"]
    assert got == shown
    sent = {**fmt, "strict": True, "description": "an x"}
    r2 = client.responses.create(model="assistant", input="hi", text={"format": sent})  # type: ignore[typeddict-item]
    assert r2.text.format is not None and r2.text.format.model_dump(by_alias=True) == sent


# ---------------------------------------------------------------- round 2: call ids, text parts, detail

F_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def tool_round(question: str, call_id: str, result: str = "result") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def test_a_tool_history_under_call_ids_never_issued_is_seeded_and_answered(client: openai.OpenAI) -> None:
    """The view leaves call ids out: the same history under other ids lands on the point a first
    one left. Answers to calls made there continue or fork it; answers to other ids are a history
    this server never issued: a new conversation seeded with it and answered, never a 400."""
    first = client.chat.completions.with_raw_response.create(
        model="assistant", tools=F_TOOL, messages=tool_round("imported r2", "call_AAA")
    )
    second = client.chat.completions.with_raw_response.create(
        model="assistant", tools=F_TOOL, messages=tool_round("imported r2", "call_BBB")
    )
    assert first.parse().choices[0].message.content == "f -> result"
    assert second.parse().choices[0].message.content == "f -> result"
    assert second.headers[HEADER] != first.headers[HEADER]
    # the same ids again: the point call_AAA was answered at (moved past): a fork of it, answered
    again = client.chat.completions.with_raw_response.create(
        model="assistant", tools=F_TOOL, messages=tool_round("imported r2", "call_AAA", "other")
    )
    assert again.parse().choices[0].message.content == "f -> other"
    assert again.headers[HEADER] not in (first.headers[HEADER], second.headers[HEADER])

    # the server's own call: its answer continues the paused turn; a regenerate forks where it was open
    asked = client.chat.completions.with_raw_response.create(
        model="assistant", tools=F_TOOL, messages=[{"role": "user", "content": "/call f {}"}]
    )
    calls = asked.parse().choices[0].message.tool_calls
    assert calls and calls[0].id not in ("call_AAA", "call_BBB")
    own = [
        {"role": "user", "content": "/call f {}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": calls[0].id, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "42"},
    ]
    answered = client.chat.completions.with_raw_response.create(model="assistant", tools=F_TOOL, messages=own)
    assert answered.headers[HEADER] == asked.headers[HEADER]
    assert answered.parse().choices[0].message.content == "f -> 42"
    regen = client.chat.completions.with_raw_response.create(model="assistant", tools=F_TOOL, messages=own)
    assert regen.headers[HEADER] not in (asked.headers[HEADER],)
    assert regen.parse().choices[0].message.content == "f -> 42"
    # the same history with a call id the server never issued there: seeded anew, answered
    foreign = [*own[:1], {**own[1], "tool_calls": [{**own[1]["tool_calls"][0], "id": "call_mine"}]}]
    foreign.append({"role": "tool", "tool_call_id": "call_mine", "content": "7"})
    mine = client.chat.completions.with_raw_response.create(model="assistant", tools=F_TOOL, messages=foreign)
    assert mine.parse().choices[0].message.content == "f -> 7"
    assert mine.headers[HEADER] not in (asked.headers[HEADER], regen.headers[HEADER])
    # results that answer no call of the assistant message before them are still refused
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="assistant", tools=F_TOOL, messages=[*foreign[:2], {**foreign[2], "tool_call_id": "call_none"}]
        )
    assert err.value.code == "unknown_tool_call"


def test_responses_history_under_call_ids_never_issued_is_seeded(client: openai.OpenAI) -> None:
    def items(call_id: str) -> list[Any]:
        return [
            {"role": "user", "content": "imported responses r2"},
            {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "done"},
        ]

    tools: Any = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    a = client.responses.with_raw_response.create(model="assistant", tools=tools, input=items("call_r2a"))
    b = client.responses.with_raw_response.create(model="assistant", tools=tools, input=items("call_r2b"))
    assert a.parse().output_text == b.parse().output_text == "f -> done"
    assert a.headers[HEADER] != b.headers[HEADER]


def test_text_parts_of_other_roles_reach_the_model_apart(http: httpx.Client, fake: FakeOpenAI) -> None:
    """System, developer, assistant and tool messages reach the model as one string each (the
    provider layer carries a string for them): their text parts are joined by a blank line, never
    glued; and a client resending that history continues the conversation."""

    def text(*words: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": w} for w in words]

    history: list[dict[str, Any]] = [
        {"role": "system", "content": text("Be brief.", "Answer in French.")},
        {"role": "developer", "content": text("D1", "D2")},
        {"role": "user", "content": "q r2"},
        {
            "role": "assistant",
            "content": text("Hello", "world"),
            "tool_calls": [{"id": "call_r2", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_r2", "content": text("line one", "line two")},
    ]
    first = http.post("/v1/chat/completions", json={"model": "remote", "tools": F_TOOL, "messages": history})
    assert first.status_code == 200, first.text
    sent = fake.requests[-1].json["messages"]
    assert [m for m in sent if m["role"] == "system"][-2:] == [
        {"role": "system", "content": "Be brief.\n\nAnswer in French."},
        {"role": "system", "content": "D1\n\nD2"},
    ]
    assert [m["content"] for m in sent if m["role"] == "assistant"] == ["Hello\n\nworld"]
    assert [m["content"] for m in sent if m["role"] == "tool"] == ["line one\n\nline two"]
    # one text part, or a string, is its text as sent
    http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "messages": [{"role": "system", "content": text("One.")}, {"role": "user", "content": "x"}],
        },
    )
    assert [m for m in fake.requests[-1].json["messages"] if m["role"] == "system"][-1]["content"] == "One."
    # the client resends the same history with the reply and new input: the same conversation
    again = http.post(
        "/v1/chat/completions",
        json={
            "model": "remote",
            "tools": F_TOOL,
            "messages": [*history, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}],
        },
    )
    assert again.status_code == 200, again.text
    assert again.headers[HEADER] == first.headers[HEADER]


def test_responses_assistant_parts_stay_apart_in_input_items(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "input_text", "text": "S1"}, {"type": "input_text", "text": "S2"}]},
        {"role": "user", "content": "hi r2"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "x"}, {"type": "output_text", "text": "y"}]},
        {"role": "user", "content": "go on"},
    ]
    r = http.post("/v1/responses", json={"model": "remote", "input": history})
    assert r.status_code == 200, r.text
    sent = fake.requests[-1].json["messages"]
    assert [m["content"] for m in sent if m["role"] == "assistant"] == ["x\n\ny"]
    assert [m for m in sent if m["role"] == "system"][-1]["content"] == "S1\n\nS2"
    listed = client.responses.input_items.list(r.json()["id"], order="asc").model_dump()["data"]
    validate("ResponseItemList", http.get(f"/v1/responses/{r.json()['id']}/input_items").json())
    assert [[p["text"] for p in i["content"]] for i in listed if i["role"] in ("system", "assistant")] == [
        ["S1", "S2"],
        ["x", "y"],
    ]
    assert [p["type"] for p in listed[2]["content"]] == ["output_text", "output_text"]
    # resent with the reply and new input: continues that conversation
    again = http.post(
        "/v1/responses",
        json={
            "model": "remote",
            "input": [*history, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "!"}],
        },
    )
    assert again.headers[HEADER] == r.headers[HEADER]


def test_original_image_detail_goes_to_a_chat_upstream_as_high(
    client: openai.OpenAI, http: httpx.Client, fake: FakeOpenAI
) -> None:
    """Chat Completions takes detail auto|low|high: Responses' `original` is sent as `high`, on this
    turn and every later one of the conversation; input_items still echoes what was sent."""
    content = [
        {"type": "input_text", "text": "see r2"},
        {"type": "input_image", "image_url": IMG1, "detail": "original"},
    ]
    upstream = [{"type": "text", "text": "see r2"}, {"type": "image_url", "image_url": {"url": IMG1, "detail": "high"}}]
    first = http.post("/v1/responses", json={"model": "remote", "input": [{"role": "user", "content": content}]})
    assert first.status_code == 200, first.text
    assert last_user_content(fake) == upstream
    for m in fake.requests[-1].json["messages"]:
        validate("ChatCompletionRequestMessage", m)
    got = http.get(f"/v1/responses/{first.json()['id']}/input_items").json()["data"][0]["content"]
    assert got[1] == {"type": "input_image", "image_url": IMG1, "detail": "original"}
    later = client.responses.create(model="remote", previous_response_id=first.json()["id"], input="and?")
    assert later.status == "completed"
    assert user_contents(fake) == [upstream, "and?"]
