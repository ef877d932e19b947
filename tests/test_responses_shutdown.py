"""A /v1/responses stream told its client the response id (`response.created`): however the stream
ends, `GET /v1/responses/{id}` finds the response, with how it ended, also after a restart.

A stream stopped by the server's stop ended with `response.failed` and stored nothing (404 after the
restart); one whose client left stored nothing either. Now the stop stores the `failed` body the
event carried (appserver/http/responses.py `keep_unfinished`), and a client that leaves gets the
response stored as its turn ended (`cancelled`). A real `appserver serve`, SIGTERM, a restart, the
`openai` SDK.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appserver.cli.serve import DRAIN_S, GRACE_S
from tests.support.cli import cli_env, run_cli
from tests.support.serve import ServeProcess, start_serve

pytestmark = pytest.mark.timeout(90)

SLOW = "/slow 2000"  # echo: 2,000 words 50 ms apart, still streaming when the stop comes


def client_for(sp: ServeProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def until_text(events: AsyncIterator[Any], seen: list[Any]) -> str:
    """Read events until the first text delta; the response id `response.created` announced."""
    rid = ""
    async for e in events:
        seen.append(e)
        if e.type == "response.created":
            rid = e.response.id
        if e.type == "response.output_text.delta":
            return rid
    raise AssertionError(f"the stream ended before any text: {seen}")


async def test_a_stream_stopped_by_the_server_is_stored_as_it_ended(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(home)
    made = await asyncio.to_thread(run_cli, home, "agents", "create", "--name", "slow", env=env)
    assert made.code == 0, made.err
    sp = await asyncio.to_thread(start_serve, home, env=env)
    try:
        client = client_for(sp)
        stream = await client.responses.create(model="slow", input=SLOW, stream=True)
        seen: list[Any] = []
        rid = await until_text(stream.__aiter__(), seen)
        assert rid.startswith("resp_")

        # a second stream whose client leaves: the response is kept as its turn ended
        left = await client.responses.create(model="slow", input=SLOW, stream=True)
        left_id = await until_text(left.__aiter__(), [])
        await left.close()
        # stored in progress from response.created on; cancelled once the cancel lands
        deadline = time.monotonic() + 10
        while (gone := await client.responses.retrieve(left_id)).status == "in_progress":
            assert time.monotonic() < deadline, "the left stream's response never left in_progress"
            await asyncio.sleep(0.05)
        assert gone.status == "cancelled", gone

        sp.proc.send_signal(signal.SIGTERM)
        async for e in stream:
            seen.append(e)
        assert seen[-1].type == "response.failed", seen[-1]
        failed = seen[-1].response
        assert failed.id == rid and failed.error is not None and "server_shutting_down" in failed.error.message
        assert await asyncio.to_thread(sp.proc.wait, GRACE_S + DRAIN_S + 10) == 0
        await client.close()
    finally:
        sp.kill()

    sp = await asyncio.to_thread(start_serve, home, env=env)
    try:
        client = client_for(sp)
        kept = await client.responses.retrieve(rid)
        assert kept.status == "failed" and kept.id == rid, kept
        assert kept.error is not None and kept.error.message == failed.error.message
        assert (await client.responses.retrieve(left_id)).status == "cancelled"
        items = await client.responses.input_items.list(rid)
        assert [i.type for i in items.data] == ["message"]  # its input is listed as for any response
        await client.close()
    finally:
        sp.stop()


async def test_a_streaming_response_is_stored_in_progress_from_response_created(tmp_path: Path) -> None:
    """The id `response.created` announces names the response at once: GET answers it in progress
    while it streams, continuing from it is refused until it completed (409), and one deleted
    while it streams stays deleted when the stream ends."""
    home = tmp_path / "home"
    sp = start_serve(home, env=cli_env(home))
    try:
        client = client_for(sp)
        seen: list[Any] = []
        stream = await client.responses.create(model="assistant", input="/slow 30", stream=True)
        rid = await until_text(stream, seen)
        live = await client.responses.retrieve(rid)
        assert live.status == "in_progress" and live.id == rid
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(model="assistant", input="next", previous_response_id=rid)
        assert refused.value.status_code == 409
        assert refused.value.body["code"] == "previous_response_in_progress"  # type: ignore[index]
        async for e in stream:
            seen.append(e)
        assert seen[-1].type == "response.completed"
        done = await client.responses.retrieve(rid)
        assert done.status == "completed" and done.output_text == seen[-1].response.output_text
        nxt = await client.responses.create(model="assistant", input="next", previous_response_id=rid)
        assert nxt.status == "completed"

        stream = await client.responses.create(model="assistant", input="/slow 30", stream=True)
        gone = await until_text(stream, [])
        await client.responses.delete(gone)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone)
        await client.close()
    finally:
        sp.stop()
