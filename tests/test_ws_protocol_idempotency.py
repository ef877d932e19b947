"""Issue 14.3: an input submitted to "new" and re-sent after a reconnect to the conversation id its
ack named, with the same idempotency key, is one turn (docs/protocol.md, Reconnect).

Through a real `appserver serve --auth token`, for a namespaced credential and for an admin one
(whose keys are not namespaced), with real `websockets` clients that really disconnect.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from appserver.auth import TokenStore
from tests.support.serve import ServeProcess, serving
from tests.support.ws import WS, db_messages

pytestmark = pytest.mark.timeout(60)

T = 10.0


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    home = tmp_path_factory.mktemp("idem") / "home"
    store = TokenStore(home)
    toks = {"plain": store.create(name="plain")[1], "admin": store.create(name="boss", scopes="openai,ws,admin")[1]}
    with serving(home, "--auth", "token") as sp:
        yield sp, toks


def frame(conversation: str, key: str, text: str = "run me once") -> dict[str, Any]:
    return {
        "type": "submit_input",
        "agent": "assistant",
        "conversation": conversation,
        "input": text,
        "idempotency_key": key,
    }


@pytest.mark.parametrize("who", ["plain", "admin"])
async def test_new_then_real_id_with_the_same_key_is_one_turn(
    tokens: tuple[ServeProcess, dict[str, str]], who: str
) -> None:
    sp, toks = tokens
    headers = {"Authorization": f"Bearer {toks[who]}"}
    key = f"k-{who}"
    first = await WS.open(sp.url, headers=headers, open_timeout=T)
    ack = await first.request(frame("new", key), T)
    assert ack["duplicate"] is False
    conv, turn = ack["conversation_id"], ack["turn_id"]
    await first.terminal(turn, T)
    await first.close()  # the client lost its connection and comes back

    again = await WS.open(sp.url, headers=headers, open_timeout=T)
    resent = await again.request(frame(conv, key), T)
    assert resent["type"] == "ack", resent
    assert (resent["turn_id"], resent["conversation_id"], resent["duplicate"]) == (turn, conv, True)
    snap = await again.terminal(turn, T)  # the earlier turn's result is shown again
    assert snap["status"] == "completed"
    # and "new" with the key still names that turn, while another key runs
    assert (await again.request(frame("new", key), T))["turn_id"] == turn
    other = await again.request(frame(conv, f"{key}-2", "a different input"), T)
    assert other["duplicate"] is False and other["turn_id"] != turn
    await again.terminal(other["turn_id"], T)
    users = [content for role, content, _ in db_messages(sp.home, conv) if role == "user"]
    assert users == ['"run me once"', '"a different input"'], users
    await again.close()


async def test_a_key_with_a_control_character_is_refused(tokens: tuple[ServeProcess, dict[str, str]]) -> None:
    """The server builds its own keys with a control character (a namespace's prefix, a cron
    occurrence's key): a client's key never holds one, so it can never take one of them."""
    sp, toks = tokens
    ws = await WS.open(sp.url, headers={"Authorization": f"Bearer {toks['admin']}"}, open_timeout=T)
    for key in ("cron\x1ftask_1:1", "a\x00b", "tab\there", "del\x7f"):
        refused = await ws.request(frame("new", key), T)
        assert refused["type"] == "error" and refused["param"] == "idempotency_key", refused
    ok = await ws.request(frame("new", "cron:task_1:1"), T)  # printable: a key like any other
    assert ok["type"] == "ack" and ok["duplicate"] is False
    await ws.close()
