"""gateway/routing.py: route keys, the thread → chat → default_agent fallback, and conversations
bound per route, all stored in gateway.db."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.db import open_db
from gateway.routing import ROOT, RouteKey, Router


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "channels" / "gateway.db"


def test_route_key_text_round_trips() -> None:
    k = RouteKey.of("slack", "work", "C123", None)
    assert str(k) == "slack:work:C123:__root__" and k.thread == ROOT
    assert RouteKey.parse("slack:work:C123") == k
    t = RouteKey.parse("slack:work:C123:1700000000.0001")
    assert t.thread == "1700000000.0001" and t.root == k
    for bad in ("slack:work", "a:b:c:d:e", "slack::C1", "slack:work:C1:"):
        with pytest.raises(ValueError):
            RouteKey.parse(bad)
    with pytest.raises(ValueError):
        RouteKey("slack", "work", "C:1")


def test_lookup_order_thread_then_chat_then_default(db: Path) -> None:
    router = Router(open_db(db))
    chat = RouteKey("telegram", "main", "-100")
    thread = RouteKey("telegram", "main", "-100", "42")
    other = RouteKey("telegram", "main", "-200")

    assert router.resolve(chat) is None  # nothing routes it: the gateway sends a notice
    fallback = router.resolve(other, default_agent="helper")
    assert fallback is not None and (fallback.agent, fallback.source) == ("helper", "default")

    router.add(chat, "coder", conversation="conv_chat")
    root = router.resolve(chat, default_agent="helper")
    assert root is not None and (root.agent, root.conversation, root.source) == (
        "coder",
        "conv_chat",
        "route",
    )
    # A thread without its own route uses the chat's agent but not the chat's conversation.
    in_thread = router.resolve(thread, default_agent="helper")
    assert in_thread is not None
    assert (in_thread.agent, in_thread.conversation, in_thread.source) == ("coder", None, "chat")
    router.bind(thread, "conv_thread")
    bound = router.resolve(thread)
    assert bound is not None and bound.conversation == "conv_thread"

    router.add(thread, "reviewer")
    own = router.resolve(thread)
    assert own is not None and (own.agent, own.source, own.conversation) == (
        "reviewer",
        "route",
        None,
    )


def test_routes_persist_and_list_by_channel_and_account(db: Path) -> None:
    conn = open_db(db)
    router = Router(conn)
    router.add(RouteKey("telegram", "main", "1"), "a")
    router.add(RouteKey("telegram", "main", "2", "t"), "b", "conv_b")
    router.add(RouteKey("telegram", "mainly", "3"), "c")
    router.add(RouteKey("slack", "main", "4"), "d")
    router.add(RouteKey("telegram", "main", "1"), "a2")  # replace
    conn.close()

    router = Router(open_db(db))
    assert [str(r.key) for r in router.routes()] == [
        "slack:main:4:__root__",
        "telegram:main:1:__root__",
        "telegram:main:2:t",
        "telegram:mainly:3:__root__",
    ]
    main = router.routes("telegram", "main")
    assert [(r.agent, r.conversation) for r in main] == [("a2", None), ("b", "conv_b")]
    assert len(router.routes("telegram")) == 3
    assert router.remove(RouteKey("telegram", "main", "1")) is True
    assert router.remove(RouteKey("telegram", "main", "1")) is False
    assert router.get(RouteKey("telegram", "main", "1")) is None


def test_new_conversation_and_route_changes_drop_the_binding(db: Path) -> None:
    router = Router(open_db(db))
    key = RouteKey("discord", "bot", "chan")
    router.bind(key, "conv_1")
    first = router.resolve(key, default_agent="helper")
    assert first is not None and first.conversation == "conv_1"
    router.bind(key, "conv_2")  # /new: the gateway binds the conversation it just opened
    second = router.resolve(key, default_agent="helper")
    assert second is not None and second.conversation == "conv_2"
    assert router.forget(key) is True
    third = router.resolve(key, default_agent="helper")
    assert third is not None and third.conversation is None
    router.bind(key, "conv_3")
    router.add(key, "coder")  # a new route starts clean
    routed = router.resolve(key)
    assert routed is not None and (routed.agent, routed.conversation) == ("coder", None)
