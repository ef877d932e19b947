"""A /v1/responses turn the server's graceful stop (SIGTERM) ends while an agent tool call runs or
an approval request waits behind it: through a real `appserver serve` on loopback, raw SSE read
with httpx (every event validated against OpenAI's published schema), then a restart.

1. A running call: the stream ended `output_item.added, mcp_call_arguments.*, mcp_call.in_progress,
   response.failed`, the body's `mcp_call` `in_progress` (never closed). Now it is closed first:
   `response.mcp_call.failed`, then `output_item.done` with the item the body holds, `failed`,
   its error saying the stop ended it; `GET` after the restart shows the same item.
2. An approval request not yet shown behind the running call: the failed body held an
   `mcp_approval_request` no event announced, and after the restart answering it was a 409
   `not_awaiting` (docs: 400 `already_resolved` for a call of a turn that ended) and an
   `item_reference` to it a 400 `item_not_found`. Now every item of the body is announced and
   closed in order: the call the stop left unrun is a failed `mcp_call` (as the kernel keeps it,
   and as `GET` shows it after the restart), and an answer to it is a 400 `already_resolved`, with
   `previous_response_id` or `conversation`.
3. An approval request shown before the stop stays one in the failed body (as its events closed
   it); after the restart an answer to it is a 400 `already_resolved` and an `item_reference` to it
   resolves (to the call it became).
4. The non-stream route under the stop: a 503 `server_shutting_down` naming the conversation,
   which continues after the restart (no call left open).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from appserver.cli.serve import DRAIN_S, GRACE_S
from tests.openai_schema import require_conformance, sse_lines, validate
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(150)

RUNNING = '/call shell {"command": "sleep 30; echo hi"}'
BEHIND = '/call shell {"command": "sleep 30"}\n/call clock {}'  # the approval request after the call
BEFORE = '/call clock {}\n/call shell {"command": "sleep 30"}'  # the approval request shown first


@dataclass
class Streamed:
    conversation: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    running: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def body(self) -> dict[str, Any]:
        return dict(self.events[-1]["response"])


@dataclass
class Stopped:
    home: Path
    env: dict[str, str]
    streams: dict[str, Streamed]
    plain: httpx.Response


async def _stream(client: httpx.AsyncClient, text: str, out: Streamed) -> None:
    async with client.stream("POST", "/v1/responses", json={"model": "sh", "input": text, "stream": True}) as r:
        assert r.status_code == 200
        out.conversation = r.headers["x-conversation-id"]
        buf = b""
        async for chunk in r.aiter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                lines = sse_lines(frame)
                kinds = [ln[len("event: ") :] for ln in lines if ln.startswith("event: ")]
                data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
                if not data:
                    continue
                event = json.loads(data[0])
                assert kinds == [event["type"]], frame
                out.events.append(event)
                if event["type"] == "response.mcp_call.in_progress":
                    out.running.set()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    """Three streams and a non-stream request, each with an agent tool call running, when the
    server is stopped (SIGTERM); then the server is started again."""
    require_conformance()
    home = tmp_path_factory.mktemp("s20b") / "home"
    env = cli_env(home)
    made = run_cli(home, "agents", "create", "--name", "sh", "--tool", "shell=allow", "--tool", "clock=ask", env=env)
    assert made.code == 0, made.err
    sp = start_serve(home, env=env)

    async def go() -> Stopped:
        streams = {name: Streamed() for name in ("running", "behind", "before")}
        async with httpx.AsyncClient(base_url=sp.url, timeout=60) as client:
            plain = asyncio.create_task(client.post("/v1/responses", json={"model": "sh", "input": RUNNING}))
            tasks = [
                asyncio.create_task(_stream(client, text, streams[name]))
                for name, text in (("running", RUNNING), ("behind", BEHIND), ("before", BEFORE))
            ]
            await asyncio.wait_for(asyncio.gather(*(s.running.wait() for s in streams.values())), 20)
            await asyncio.sleep(0.3)  # the tools run (the shell sleeps)
            sp.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), GRACE_S + DRAIN_S + 20)
            return Stopped(home, env, streams, await plain)

    try:
        result = asyncio.run(go())
        assert sp.proc.wait(GRACE_S + DRAIN_S + 10) == 0
    finally:
        sp.kill()
    yield result


@pytest.fixture(scope="module")
def restarted(stopped: Stopped) -> Iterator[ServeProcess]:
    sp = start_serve(stopped.home, env=stopped.env)
    try:
        yield sp
    finally:
        sp.stop()


@pytest.fixture
def http(restarted: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=restarted.url, timeout=30) as c:
        yield c


def _consistent(s: Streamed) -> list[dict[str, Any]]:
    """Every event valid; the stream ends with `response.failed` (the stop), and every item of its
    body was announced (`output_item.added`) and closed (`output_item.done`) first, in order, the
    body's agent tool items exactly as their `output_item.done` closed them. The body's output."""
    for e in s.events:
        validate("ResponseStreamEvent", e)
    assert [e["sequence_number"] for e in s.events] == list(range(len(s.events)))
    last = s.events[-1]
    assert last["type"] == "response.failed", [e["type"] for e in s.events]
    body = s.body
    assert body["status"] == "failed" and "server_shutting_down" in body["error"]["message"]
    output = list(body["output"])
    added = [e for e in s.events if e["type"] == "response.output_item.added"]
    done = [e for e in s.events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == list(range(len(output))), [e["type"] for e in s.events]
    assert [e["output_index"] for e in done] == list(range(len(output)))
    assert [e["item"]["id"] for e in added] == [o["id"] for o in output]
    assert [e["item"]["id"] for e in done] == [o["id"] for o in output]
    for e, item in zip(done, output, strict=True):
        if item["type"] in ("mcp_call", "mcp_approval_request"):
            assert e["item"] == item
        index = e["output_index"]
        # nothing of the item after its output_item.done
        after = [x for x in s.events[s.events.index(e) + 1 :] if x.get("output_index") == index]
        assert after == [], after
    for item in output:
        assert item.get("status") != "in_progress", item  # a failed response shows nothing still running
    return output


def _mcp_events(s: Streamed, item_id: str) -> list[str]:
    return [e["type"] for e in s.events if e.get("item_id") == item_id and e["type"].startswith("response.mcp_call")]


def _failed_call(item: dict[str, Any], name: str, why: str) -> None:
    assert item["type"] == "mcp_call" and item["name"] == name and item["status"] == "failed", item
    assert item["output"] is None
    assert item["error"]["type"] == "mcp_tool_execution_error"
    assert why in item["error"]["content"][0]["text"], item


def _answer(http: httpx.Client, call_item_id: str, **where: Any) -> httpx.Response:
    call_id = call_item_id.split("_", 1)[1]  # mcp_<call id> / mcpr_<call id>
    answer = {"type": "mcp_approval_response", "approval_request_id": f"mcpr_{call_id}", "approve": True}
    return http.post("/v1/responses", json={"model": "sh", "input": [answer], **where})


def _already_resolved(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "already_resolved", r.text
    assert r.json()["error"]["param"] == "input"


# ---------------------------------------------------------------- 1. a running call


def test_a_running_call_is_closed_as_failed_before_response_failed(stopped: Stopped) -> None:
    s = stopped.streams["running"]
    (item,) = _consistent(s)
    _failed_call(item, "shell", "stopped before it returned a result")
    assert _mcp_events(s, item["id"]) == [
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.in_progress",
        "response.mcp_call.failed",
    ]
    kinds = [e["type"] for e in s.events]
    assert kinds[-3:] == ["response.mcp_call.failed", "response.output_item.done", "response.failed"], kinds


def test_after_the_restart_get_shows_the_call_as_the_stream_closed_it(stopped: Stopped, http: httpx.Client) -> None:
    s = stopped.streams["running"]
    r = http.get(f"/v1/responses/{s.body['id']}")
    assert r.status_code == 200, r.text
    validate("Response", r.json())
    kept = r.json()
    assert kept["status"] == "failed" and kept["error"] == s.body["error"]
    assert kept["output"] == s.body["output"]
    # continuing after it: nothing waits for an answer
    nxt = http.post("/v1/responses", json={"model": "sh", "input": "next", "previous_response_id": kept["id"]})
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["status"] == "completed"


# ---------------------------------------------------------------- 2. an approval request behind it


def test_an_approval_request_behind_a_running_call_is_announced_as_a_call_the_stop_left_unrun(
    stopped: Stopped,
) -> None:
    s = stopped.streams["behind"]
    shell, clock = _consistent(s)
    _failed_call(shell, "shell", "stopped before it returned a result")
    _failed_call(clock, "clock", "not executed")
    assert not any(o["type"] == "mcp_approval_request" for o in s.body["output"])
    assert _mcp_events(s, clock["id"]) == [
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.failed",  # it never ran: no in_progress
    ]


def test_after_the_restart_the_unrun_call_is_shown_referenced_and_refused_as_resolved(
    stopped: Stopped, http: httpx.Client
) -> None:
    s = stopped.streams["behind"]
    rid = s.body["id"]
    kept = http.get(f"/v1/responses/{rid}").json()
    validate("Response", kept)
    assert kept["output"] == s.body["output"]
    clock = s.body["output"][1]
    _already_resolved(_answer(http, clock["id"], previous_response_id=rid))
    _already_resolved(_answer(http, clock["id"], conversation=s.conversation))
    _already_resolved(_answer(http, clock["id"], previous_response_id=rid))  # refused again: nothing written
    for item in s.body["output"]:
        ref = http.post(
            "/v1/responses",
            json={
                "model": "sh",
                "input": [{"type": "item_reference", "id": item["id"]}, {"role": "user", "content": "x"}],
            },
        )
        assert ref.status_code == 200, ref.text
    nxt = http.post("/v1/responses", json={"model": "sh", "input": "/recall", "previous_response_id": rid})
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["status"] == "completed"


# ---------------------------------------------------------------- 3. an approval request shown first


def test_an_approval_request_shown_before_the_stop_stays_one_and_its_answer_is_refused(
    stopped: Stopped, http: httpx.Client
) -> None:
    s = stopped.streams["before"]
    request, shell = _consistent(s)
    assert request["type"] == "mcp_approval_request" and request["id"].startswith("mcpr_"), request
    _failed_call(shell, "shell", "stopped before it returned a result")
    rid = s.body["id"]
    kept = http.get(f"/v1/responses/{rid}").json()
    validate("Response", kept)
    # after the restart: the turn as the conversation kept it, the request a call it never ran
    assert [o["id"] for o in kept["output"]] == [f"mcp_{request['id'].removeprefix('mcpr_')}", shell["id"]]
    _failed_call(kept["output"][0], "clock", "not executed")
    assert kept["output"][1] == shell
    _already_resolved(_answer(http, request["id"], previous_response_id=rid))
    _already_resolved(_answer(http, request["id"], conversation=s.conversation))
    ref = http.post(
        "/v1/responses",
        json={
            "model": "sh",
            "input": [{"type": "item_reference", "id": request["id"]}, {"role": "user", "content": "x"}],
        },
    )
    assert ref.status_code == 200, ref.text


# ---------------------------------------------------------------- 4. the non-stream route


def test_a_non_stream_request_the_stop_ends_is_a_503_and_its_conversation_continues(
    stopped: Stopped, http: httpx.Client
) -> None:
    r = stopped.plain
    assert r.status_code == 503, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert r.headers["x-should-retry"] == "false"
    conv = r.headers["x-conversation-id"]
    nxt = http.post("/v1/responses", json={"model": "sh", "input": "/recall", "conversation": conv})
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["status"] == "completed"
    text = "".join(c["text"] for o in nxt.json()["output"] if o["type"] == "message" for c in o["content"])
    assert text.startswith(RUNNING), text  # the stopped turn's input is in its history
