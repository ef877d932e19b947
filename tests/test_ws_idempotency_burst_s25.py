"""Copies of one input sent at once with one idempotency key (a client's resend racing its
original, two relays of one message) are one turn: every copy is acknowledged with that turn, none
is refused as over the queue limit, and the copies in flight hold no queue place that a different
input then misses (docs/protocol.md, `submit_input`).

Through a real `appserver serve` with `limits.queue_max` small, real `websockets` clients, one
connection per copy so that the copies really arrive together.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS, db_messages

pytestmark = pytest.mark.timeout(60)

T = 10.0
COPIES = 10


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("burst") / "home"
    env = {**cli_env(home), "APPSERVER_LIMITS__QUEUE_MAX": "2"}
    with serving(home, env=env) as sp:
        yield sp


def submit(conversation: str, text: str, key: str) -> dict[str, Any]:
    return {
        "type": "submit_input",
        "agent": "assistant",
        "conversation": conversation,
        "input": text,
        "idempotency_key": key,
    }


async def test_copies_sent_at_once_are_one_turn_and_never_queue_full(srv: ServeProcess) -> None:
    clients = [await WS.open(srv.url, open_timeout=T) for _ in range(COPIES + 1)]
    try:
        created = await clients[0].request({"type": "create_conversation", "agent": "assistant"}, T)
        conv = created["conversation"]["id"]
        for attempt in range(3):  # the copies' accepts overlap more or less each time
            key = f"k-{uuid.uuid4().hex}"
            text = f"copy {attempt}"
            acks = await asyncio.gather(*(c.request(submit(conv, text, key), T) for c in clients[:COPIES]))
            assert all(a["type"] == "ack" for a in acks), [a for a in acks if a["type"] != "ack"]
            assert len({a["turn_id"] for a in acks}) == 1, acks
            assert sorted(a["duplicate"] for a in acks) == [False] + [True] * (COPIES - 1), acks
            await clients[0].terminal(acks[0]["turn_id"], T)
        users = [content for role, content, _ in db_messages(srv.home, conv) if role == "user"]
        assert users == ['"copy 0"', '"copy 1"', '"copy 2"'], users
    finally:
        for c in clients:
            await c.close()


async def test_copies_in_flight_hold_no_place_of_another_input(srv: ServeProcess) -> None:
    """queue_max 2: ten copies of one input and one other input, all at once, fit."""
    clients = [await WS.open(srv.url, open_timeout=T) for _ in range(COPIES + 1)]
    try:
        created = await clients[0].request({"type": "create_conversation", "agent": "assistant"}, T)
        conv = created["conversation"]["id"]
        key = f"k-{uuid.uuid4().hex}"
        frames = [submit(conv, "the copy", key) for _ in range(COPIES)] + [submit(conv, "another", f"{key}-2")]
        acks = await asyncio.gather(*(c.request(f, T) for c, f in zip(clients, frames, strict=True)))
        assert all(a["type"] == "ack" for a in acks), [a for a in acks if a["type"] != "ack"]
        assert len({a["turn_id"] for a in acks}) == 2, acks
        for turn in {a["turn_id"] for a in acks}:
            await clients[0].terminal(turn, T)
        users = sorted(content for role, content, _ in db_messages(srv.home, conv) if role == "user")
        assert users == ['"another"', '"the copy"'], users
    finally:
        for c in clients:
            await c.close()
