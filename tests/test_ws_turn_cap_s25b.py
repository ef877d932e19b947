"""The open-turn cap (`[limits] open_turns_per_client`) and idempotency keys together
(docs/protocol.md, `submit_input`):

- a resend answered at the cap is held to the same rule as one below it: a token rotated under an
  `admin` token's name (same keys, no `admin`) was acked, at its cap, with the admin's turn in a
  conversation it may not see and shown its snapshot ("echo: SECRET …");
- copies of one input sent at once on several sockets are one turn and cost one place: each copy
  took a place before the duplicate was found (8 copies with no turn open, cap 5: 3 refused
  `too_many_open_turns`), and copies to `new` each made a conversation (left empty).

A real `appserver serve --auth token` with the cap at 3, real tokens, real `websockets` clients,
one socket per copy, and the echo model's slow replies (`/slow N`: N words, 50 ms apart).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from appserver.auth import TokenStore
from tests.support.cli import cli_env
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS

pytestmark = pytest.mark.timeout(60)

T = 10.0
CAP = 3
COPIES = 8
SLOW = "/slow 1000"  # 50 s: open until cancelled
NAMES = ("below", "atcap", "atcapconv", "orphans")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path_factory.mktemp("turncapb") / "home"
    home.mkdir(parents=True)
    store = TokenStore(home)
    tokens = {name: store.create(name=name)[1] for name in NAMES}
    tokens["rot-admin"] = store.create(name="rot", scopes="openai,ws,admin")[1]
    tokens["gateway"] = store.mint_gateway("gateway")[1]
    env = cli_env(home, APPSERVER_LIMITS__OPEN_TURNS_PER_CLIENT=str(CAP))
    with serving(home, "--auth", "token", env=env) as sp:
        yield sp, tokens


async def _open(sp: ServeProcess, token: str) -> WS:
    return await WS.open(sp.url, headers={"Authorization": f"Bearer {token}"}, open_timeout=T)


def _submit(text: str, conversation: str = "new", **extra: Any) -> dict[str, Any]:
    return {"type": "submit_input", "agent": "assistant", "conversation": conversation, "input": text, **extra}


async def _accepted(ws: WS, text: str = SLOW, conversation: str = "new", **extra: Any) -> dict[str, Any]:
    ack = await ws.request(_submit(text, conversation, **extra), T)
    assert ack["type"] == "ack" and not ack["duplicate"], ack
    return ack


async def _refused(ws: WS) -> None:
    err = await ws.request(_submit(SLOW), T)
    assert err["type"] == "error" and err["code"] == "too_many_open_turns", err


async def _cancel_all(ws: WS, acks: list[dict[str, Any]]) -> None:
    for ack in acks:
        frame = {"type": "cancel", "conversation": ack["conversation_id"], "turn_id": ack["turn_id"]}
        assert (await ws.request(frame, T))["type"] == "ack"
    for ack in acks:
        await ws.terminal(ack["turn_id"], T)


async def _read_for(ws: WS, seconds: float) -> None:
    """Read what arrives for `seconds` (into `ws.seen`); the slow turns stream on meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            await ws.recv(left)
        except TimeoutError:
            return


async def _copies_at_once(socks: list[WS], frame: dict[str, Any]) -> list[dict[str, Any]]:
    """The same frame sent on every socket at once; all must be acked with one turn, once new."""
    acks = await asyncio.gather(*(ws.request(frame, T) for ws in socks))
    assert all(a["type"] == "ack" for a in acks), [a for a in acks if a["type"] != "ack"]
    assert len({(a["turn_id"], a["conversation_id"]) for a in acks}) == 1, acks
    assert sorted(a["duplicate"] for a in acks) == [False] + [True] * (len(socks) - 1), acks
    return acks


async def test_a_resend_at_the_cap_never_shows_a_conversation_the_credential_may_not_see(
    srv: tuple[ServeProcess, dict[str, str]],
) -> None:
    sp, tokens = srv
    admin = await _open(sp, tokens["rot-admin"])
    try:
        secret = await _accepted(admin, "SECRET admin text", idempotency_key="K")
        assert (await admin.terminal(secret["turn_id"], T))["status"] == "completed"
    finally:
        await admin.close()
    store = TokenStore(sp.home)
    store.revoke("rot")  # rotated: the same name (and keys), without `admin`
    rotated = store.create(name="rot")[1]
    socks = [await _open(sp, rotated) for _ in range(COPIES)]
    ws = socks[0]
    resend = _submit("SECRET admin text", idempotency_key="K")
    try:
        below = await ws.request(resend, T)
        assert below["type"] == "error" and below["code"] == "invalid_request", below
        held = [await _accepted(ws) for _ in range(CAP)]
        at_cap = await ws.request(resend, T)  # one resend at the cap
        assert at_cap["type"] == "error" and at_cap["code"] == "invalid_request", at_cap
        assert at_cap["param"] == "idempotency_key", at_cap
        copies = await asyncio.gather(*(s.request(resend, T) for s in socks))  # and copies of it at once
        assert all(r["type"] == "error" and r["code"] == "invalid_request" for r in copies), copies
        await asyncio.gather(*(_read_for(s, 0.5) for s in socks))
        for s in socks:
            shown = [f for f in s.seen if "SECRET" in json.dumps(f) or secret["conversation_id"] in json.dumps(f)]
            assert shown == [], shown
        await _cancel_all(ws, held)
    finally:
        for s in socks:
            await s.close()


@pytest.mark.parametrize(("name", "held"), [("below", 0), ("atcap", CAP - 1)])
async def test_copies_sent_at_once_are_one_turn_and_take_one_place(
    srv: tuple[ServeProcess, dict[str, str]], name: str, held: int
) -> None:
    """With no turn open (8 copies, cap 3) and with one place left: every copy acked, one place."""
    sp, tokens = srv
    socks = [await _open(sp, tokens[name]) for _ in range(COPIES)]
    ws = socks[0]
    try:
        for _ in range(3):  # the copies' submits overlap more or less each time
            open_turns = [await _accepted(ws) for _ in range(held)]
            acks = await _copies_at_once(socks, _submit(SLOW, idempotency_key=f"k-{uuid.uuid4().hex}"))
            open_turns.append(acks[0])
            while len(open_turns) < CAP:  # the copies used exactly one place: the rest are free
                open_turns.append(await _accepted(ws))
            await _refused(ws)
            await _cancel_all(ws, open_turns)
    finally:
        for s in socks:
            await s.close()


async def test_copies_to_a_conversation_at_the_cap_are_acked(srv: tuple[ServeProcess, dict[str, str]]) -> None:
    sp, tokens = srv
    socks = [await _open(sp, tokens["atcapconv"]) for _ in range(COPIES)]
    ws = socks[0]
    try:
        first = await _accepted(ws, "hi")
        await ws.terminal(first["turn_id"], T)
        for _ in range(3):
            held = [await _accepted(ws) for _ in range(CAP - 1)]
            frame = _submit(SLOW, first["conversation_id"], idempotency_key=f"k-{uuid.uuid4().hex}")
            acks = await _copies_at_once(socks, frame)
            await _refused(ws)
            await _cancel_all(ws, [*held, acks[0]])
    finally:
        for s in socks:
            await s.close()


@pytest.mark.parametrize("name", ["orphans", "gateway"])
async def test_copies_to_new_sent_at_once_make_one_conversation(
    srv: tuple[ServeProcess, dict[str, str]], name: str
) -> None:
    """Counted or not (the channel gateway's credential is not), no copy makes a conversation."""
    sp, tokens = srv
    socks = [await _open(sp, tokens[name]) for _ in range(COPIES)]
    ws = socks[0]
    try:
        for round_ in range(3):  # the copies' submits overlap more or less each time
            frame = _submit(f"hello {round_}", idempotency_key=f"k-{uuid.uuid4().hex}")
            replies = await asyncio.gather(*(s.request(frame, T) for s in socks))
            listed = await ws.request({"type": "list_conversations", "agent": "assistant", "limit": 100}, T)
            assert listed["type"] == "conversations", listed
            assert len(listed["conversations"]) == round_ + 1, listed["conversations"]  # none left empty
            assert all(r["type"] == "ack" for r in replies), replies
            assert {r["conversation_id"] for r in replies} == {listed["conversations"][0]["id"]}, replies
            assert (await ws.terminal(replies[0]["turn_id"], T))["status"] == "completed"
    finally:
        for s in socks:
            await s.close()
