"""OpenAI surface fixes from outside testers' findings (round 20), through a real `appserver serve`
on loopback with the `openai` SDK (httpx where the raw answer matters), the built-in echo model.

1. A /v1/responses stream the server's graceful stop (SIGTERM) ends mid-turn: its `response.failed`
   carries what the turn showed (the message, `incomplete`), after `output_item.done`; after the
   restart `GET` holds the message the conversation kept, and `previous_response_id` naming it
   continues after its turn (it forked from before it).
2. Whitespace-only new input is refused (400 `missing_input`, `param` the route's own field) before
   any conversation is placed or created: nothing is written.
3. An `item_reference` to a server tool item (`mcp_…`, `mcpr_…`) resolves without
   previous_response_id, as msg_/fc_/rs_ items do.
4. A trailing slash on a route is a 404 error object, not a 307 with an empty body.
5. `previous_response_id: ""` is a 404, as a blank one is (never taken as "none" and echoed).
6. An `item_reference` without an `id`, or with a non-string one, is a field error naming it.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appserver.cli.serve import DRAIN_S, GRACE_S
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, serving, start_serve

pytestmark = pytest.mark.timeout(120)


def _conversations(home: Path) -> int:
    with sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True, timeout=5) as db:
        return int(db.execute("SELECT count(*) FROM conversations").fetchone()[0])


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    home = tmp_path_factory.mktemp("s20") / "home"
    env = cli_env(home)
    for args in (("--name", "runs", "--tool", "clock=allow"), ("--name", "asks", "--tool", "clock=ask")):
        made = run_cli(home, "agents", "create", *args, env=env)
        assert made.code == 0, made.err
    with serving(home, env=env, graceful=False) as sp:
        yield sp


@pytest.fixture
def http(srv: ServeProcess) -> Any:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


# ---------------------------------------------------------------- 1. a graceful stop mid-stream


async def test_a_stream_the_server_stops_keeps_its_output_and_continues_after_its_turn(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    sp = await asyncio.to_thread(start_serve, home, env=env)
    try:
        client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        alpha = await client.responses.create(model="assistant", input="alpha")
        stream = await client.responses.create(
            model="assistant", input="/slow 2000", previous_response_id=alpha.id, stream=True
        )
        seen: list[Any] = []
        deltas = 0
        async for e in stream:
            seen.append(e)
            if e.type == "response.output_text.delta":
                deltas += 1
                if deltas == 3:
                    sp.proc.send_signal(signal.SIGTERM)
        rid = seen[0].response.id
        assert seen[-1].type == "response.failed", seen[-1]
        failed = seen[-1].response
        assert failed.error is not None and "server_shutting_down" in failed.error.message
        # the message it streamed is in the failed response, closed as incomplete
        assert [o.type for o in failed.output] == ["message"], failed.output
        assert failed.output[0].status == "incomplete"
        shown = failed.output[0].content[0].text  # type: ignore[union-attr]
        assert shown.startswith("w1 w2 w3"), shown
        done = [e for e in seen if e.type == "response.output_item.done"]
        assert len(done) == 1 and done[0].item.status == "incomplete"
        assert done[0].item.content[0].text == shown
        streamed = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert streamed == shown
        assert await asyncio.to_thread(sp.proc.wait, GRACE_S + DRAIN_S + 10) == 0
        await client.close()
    finally:
        sp.kill()

    sp = await asyncio.to_thread(start_serve, home, env=env)
    try:
        client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        kept = await client.responses.retrieve(rid)
        assert kept.status == "failed" and kept.error is not None
        assert kept.error.message == failed.error.message
        assert [o.type for o in kept.output] == ["message"] and kept.output[0].status == "incomplete"
        text = kept.output[0].content[0].text  # type: ignore[union-attr]
        assert text.startswith(shown), (text, shown)  # what the conversation kept: at least what was shown
        again = await client.responses.retrieve(rid)
        assert again.output == kept.output
        raw = await client.responses.with_raw_response.create(
            model="assistant", input="/recall", previous_response_id=rid
        )
        nxt = raw.parse()
        assert nxt.output_text == "alpha | /slow 2000", nxt.output_text
        # continued, not forked: the same conversation as the stopped turn's
        prev = await client.responses.with_raw_response.retrieve(rid)
        assert raw.headers["x-conversation-id"] == prev.headers["x-conversation-id"]
        await client.close()
    finally:
        sp.stop()


# ---------------------------------------------------------------- 2. blank input writes nothing


BLANKS: list[Any] = ["   ", "\n\t", [{"type": "text", "text": " "}, {"type": "text", "text": "\n"}], ""]


@pytest.mark.parametrize("blank", BLANKS)
def test_blank_chat_input_is_refused_before_anything_is_written(
    srv: ServeProcess, http: httpx.Client, blank: Any
) -> None:
    before = _conversations(srv.home)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "echo: hi"}]
    for headers in ({}, {"X-Conversation-Id": f"conv-blank-{time.monotonic_ns()}"}):
        for messages in ([{"role": "user", "content": blank}], [*history, {"role": "user", "content": blank}]):
            r = http.post("/v1/chat/completions", json={"model": "assistant", "messages": messages}, headers=headers)
            assert r.status_code == 400, r.text
            err = _error(r)
            assert err["code"] == "missing_input" and err["param"] == "messages", err
            assert "x-conversation-id" not in r.headers
    time.sleep(0.1)  # a new conversation's row is committed with a short delay (group commit)
    assert _conversations(srv.home) == before


@pytest.mark.parametrize("blank", BLANKS)
def test_blank_responses_input_is_refused_before_anything_is_written(
    srv: ServeProcess, http: httpx.Client, blank: Any
) -> None:
    before = _conversations(srv.home)
    parts = [{"type": "input_text", "text": p["text"]} for p in blank] if isinstance(blank, list) else blank
    new = {"role": "user", "content": parts}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "echo: hi"}]
    for headers in ({}, {"X-Conversation-Id": f"conv-blank-{time.monotonic_ns()}"}):
        for inp in ([new], [*history, new]):
            r = http.post("/v1/responses", json={"model": "assistant", "input": inp}, headers=headers)
            assert r.status_code == 400, r.text
            err = _error(r)
            assert err["code"] == "missing_input" and err["param"] == "input", err
    time.sleep(0.1)
    assert _conversations(srv.home) == before
    # the check counts: an answered request is written
    ok = http.post("/v1/responses", json={"model": "assistant", "input": [*history, {"role": "user", "content": "x"}]})
    assert ok.status_code == 200, ok.text
    deadline = time.monotonic() + 5
    while _conversations(srv.home) == before:
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ---------------------------------------------------------------- 3. server tool items by reference


def test_item_references_to_server_tool_items_resolve_without_previous_response_id(http: httpx.Client) -> None:
    ran = http.post("/v1/responses", json={"model": "runs", "input": "/call clock {}"})
    assert ran.status_code == 200, ran.text
    call = next(o for o in ran.json()["output"] if o["type"] == "mcp_call")
    asked = http.post("/v1/responses", json={"model": "asks", "input": "/call clock {}"})
    assert asked.status_code == 200, asked.text
    request = next(o for o in asked.json()["output"] if o["type"] == "mcp_approval_request")
    assert request["id"].startswith("mcpr_")

    for model, ref in (("runs", call["id"]), ("asks", request["id"])):
        r = http.post(
            "/v1/responses",
            json={
                "model": model,
                "input": [
                    {"role": "user", "content": "before"},
                    {"type": "item_reference", "id": ref},
                    {"role": "user", "content": "after"},
                ],
            },
        )
        assert r.status_code == 200, r.text
        items = http.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in items] == ["message", "message"]
        # another agent's item is not found
        other = "asks" if model == "runs" else "runs"
        r = http.post(
            "/v1/responses",
            json={"model": other, "input": [{"type": "item_reference", "id": ref}, {"role": "user", "content": "x"}]},
        )
        assert r.status_code == 400 and _error(r)["code"] == "item_not_found", r.text

    # an index record is no response: not readable, not a previous response
    for path in (f"/v1/responses/{call['id']}",):
        assert http.get(path).status_code == 404
    # a deleted response's items are not found any more
    assert http.delete(f"/v1/responses/{ran.json()['id']}").status_code == 200
    r = http.post(
        "/v1/responses",
        json={
            "model": "runs",
            "input": [{"type": "item_reference", "id": call["id"]}, {"role": "user", "content": "x"}],
        },
    )
    assert r.status_code == 400 and _error(r)["code"] == "item_not_found", r.text


# ---------------------------------------------------------------- 4. trailing slashes


def test_a_trailing_slash_is_a_404_error_object(http: httpx.Client) -> None:
    made = http.post("/v1/responses", json={"model": "assistant", "input": "hi"}).json()["id"]
    body = {"model": "assistant", "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
    for method, path in (
        ("POST", "/v1/responses/"),
        ("POST", "/v1/chat/completions/"),
        ("GET", f"/v1/responses/{made}/"),
        ("DELETE", f"/v1/responses/{made}/"),
        ("GET", f"/v1/responses/{made}/input_items/"),
        ("GET", "/v1/models/assistant/"),
    ):
        r = http.request(method, path, json=body if method == "POST" else None)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert "location" not in r.headers
        err = _error(r)
        assert err["type"] == "invalid_request_error" and err["message"], err
    assert http.get(f"/v1/responses/{made}").status_code == 200  # not deleted by the DELETE above


# ---------------------------------------------------------------- 5. previous_response_id ""


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_previous_response_id_is_not_found(http: httpx.Client, stream: bool) -> None:
    for prev in ("", "  "):
        r = http.post(
            "/v1/responses",
            json={"model": "assistant", "input": "hi", "previous_response_id": prev, "stream": stream},
        )
        assert r.status_code == 404, r.text
        err = _error(r)
        assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id", err


# ---------------------------------------------------------------- 6. item_reference without an id


def test_an_item_reference_without_a_string_id_is_a_field_error(http: httpx.Client) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"type": "item_reference"}, "missing_required_parameter"),
        ({"type": "item_reference", "id": None}, "invalid_type"),
        ({"type": "item_reference", "id": 7}, "invalid_type"),
        ({"type": "item_reference", "id": ["msg_x"]}, "invalid_type"),
    ]
    for ref, code in cases:
        r = http.post(
            "/v1/responses",
            json={
                "model": "assistant",
                "input": [{"role": "user", "content": "a"}, ref, {"role": "user", "content": "b"}],
            },
        )
        assert r.status_code == 400, r.text
        err = _error(r)
        assert err["code"] == code and err["param"] == "input[1].id", err
        assert "None" not in err["message"]
