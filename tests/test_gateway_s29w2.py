"""An operator's pin is kept or refused, never silently replaced (session 29).

`route add KEY AGENT --conversation ID` took any ID: pinned to another agent's conversation or to
none at all, the gateway met `conversation_not_found`, opened a new conversation, bound it, and from
then on resolved to that binding (still marked pinned), so `/new` claimed the operator had pinned a
conversation the operator never saw, and `route list` showed the old ID. Now the CLI checks the ID
(it exists and is the route agent's), and the gateway fails a message whose pin is not found with a
notice in the chat and a ledger reason (`channels status`), keeping the pin as the operator wrote it.
Real `appserver serve` with the fakechat channel; the route written by hand goes through Router.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path, open_db
from gateway.routing import RouteKey, Router
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("s29w2") / "home", chat)
    with channel_server(home) as server:
        yield server


def _conversation_of(chat: FakeChat, chat_id: str) -> str:
    """The conversation the gateway opened for `chat_id` (after a first message), from `/status`."""
    chat.inject(chat_id, "/status")
    status = chat.wait_for_text(chat_id, lambda t: "Conversation conv_" in t, timeout=15).text
    found = re.search(r"conv_\w+", status)
    assert found, status
    return found.group(0)


def _routes(home: Path) -> dict[str, str | None]:
    conn = open_db(default_path(home))
    try:
        return {str(r.key): r.conversation for r in Router(conn).routes("fakechat", "main")}
    finally:
        conn.close()


def test_route_add_refuses_an_unknown_conversation_or_another_agents(srv: ChannelServer, chat: FakeChat) -> None:
    created = run_cli(srv.home, "agents", "create", "--name", "other")
    assert created.code == 0, created.err
    assert run_cli(srv.home, "channels", "route", "add", "fakechat:main:oth-src", "other").code == 0
    chat.inject("oth-src", "hello other")
    chat.wait_for_text("oth-src", "echo: hello other", timeout=15)
    others = _conversation_of(chat, "oth-src")

    missing = run_cli(
        srv.home, "channels", "route", "add", "fakechat:main:cli-pin", "assistant", "--conversation", "conv_nope"
    )
    assert missing.code != 0
    assert "no conversation conv_nope" in missing.err and "nothing written" in missing.err, missing.err
    assert len(missing.err.strip().splitlines()) == 1, missing.err

    theirs = run_cli(
        srv.home, "channels", "route", "add", "fakechat:main:cli-pin", "assistant", "--conversation", others
    )
    assert theirs.code != 0
    assert f"conversation {others} belongs to agent" in theirs.err and "nothing written" in theirs.err, theirs.err

    assert "fakechat:main:cli-pin:__root__" not in _routes(srv.home)
    # the agent's own conversation is a pin it takes
    assert (
        run_cli(srv.home, "channels", "route", "add", "fakechat:main:cli-pin", "other", "--conversation", others).code
        == 0
    )
    assert _routes(srv.home)["fakechat:main:cli-pin:__root__"] == others


def test_a_pin_the_server_does_not_find_fails_the_message_and_stays(srv: ChannelServer, chat: FakeChat) -> None:
    key = RouteKey("fakechat", "main", "gone")
    conn = open_db(default_path(srv.home))
    try:
        Router(conn).add(key, "assistant", "conv_gone")  # written by hand, or its conversation deleted since
    finally:
        conn.close()

    chat.inject("gone", "hello there")
    notice = chat.wait_for_text("gone", lambda t: "pinned" in t or "echo:" in t, timeout=15).text
    assert "pinned by the operator to conversation conv_gone" in notice, notice
    assert "ask the operator to fix the route" in notice

    chat.inject("gone", "/new")
    answer = chat.wait_for_text("gone", lambda t: t.startswith("📌"), timeout=15).text
    assert "conv_gone" in answer, answer  # the operator's pin, not one the gateway opened

    assert _routes(srv.home)[str(key)] == "conv_gone"
    assert not any(m.text.startswith("echo: hello there") for m in chat.messages("gone"))
    status = run_cli(srv.home, "channels", "status", "--json")
    assert status.code == 0, status.err
    last = next(a for a in status.json()["accounts"] if a["account"] == "main")["last_failure"]
    assert last is not None and "pinned to conversation conv_gone" in last["reason"], last


@pytest.mark.parametrize("pin", ["new", " Default "])
def test_a_pin_to_a_keyword_is_no_conversation(srv: ChannelServer, chat: FakeChat, pin: str) -> None:
    """Re-attack: a pin `new` (route add took it before this session's check) opened a new
    conversation for every message, and `default` took the agent's default: refused as not found."""
    where = f"kw{len(pin)}"
    conn = open_db(default_path(srv.home))
    try:
        Router(conn).add(RouteKey("fakechat", "main", where), "assistant", pin)
    finally:
        conn.close()
    chat.inject(where, "hello there")
    notice = chat.wait_for_text(where, lambda t: "pinned" in t or "echo:" in t, timeout=15).text
    assert "pinned by the operator to conversation" in notice, notice
    assert not any(m.text.startswith("echo:") for m in chat.messages(where))


def test_a_pinned_route_resolves_to_its_pin_over_a_stale_binding(tmp_path: Path) -> None:
    """A gateway.db from before this fix may hold a binding the gateway made on a pinned key."""
    conn = open_db(default_path(tmp_path))
    try:
        router = Router(conn)
        key = RouteKey("fakechat", "main", "c")
        router.add(key, "assistant", "conv_pin")
        router.bind(key, "conv_opened_by_the_gateway")
        resolution = router.resolve(key)
        assert resolution is not None
        assert (resolution.conversation, resolution.pinned) == ("conv_pin", True)
        router.add(key, "assistant")  # unpinned: a binding is what it continues
        router.bind(key, "conv_bound")
        resolution = router.resolve(key)
        assert resolution is not None
        assert (resolution.conversation, resolution.pinned) == ("conv_bound", False)
    finally:
        conn.close()
