"""gateway/recent.py: the gateway's short memories (one notice per chat per 10 minutes, one pairing
answer per burst) forget what no longer matters, so a long-running gateway does not keep an entry
for every chat and sender it ever met."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.recent import Recent
from tests.fakes.fakechat import FakeChat
from tests.support.gateway import channel_server, fakechat_home


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_value_lasts_for_the_window_only() -> None:
    clock = Clock()
    seen: Recent[str] = Recent(60.0, clock)
    seen.put("ann", "CODE1234")
    clock.now += 59.9
    assert seen.get("ann") == "CODE1234" and seen.get("bob") is None
    clock.now += 0.1
    assert seen.get("ann") is None


def test_old_entries_are_swept_as_new_keys_come() -> None:
    """A stranger or a chat a minute (or a second) for days: the map holds about one window's keys."""
    clock = Clock()
    seen: Recent[bool] = Recent(600.0, clock)
    for i in range(20_000):
        seen.put(f"chat-{i}", True)
        clock.now += 1.0
        assert len(seen) <= 2 * 600 + Recent.SWEEP_MIN
    assert seen.get("chat-19999") is True and seen.get("chat-0") is None


@pytest.mark.timeout(120)
def test_a_chat_without_a_route_gets_one_notice_for_many_messages(tmp_path: Path) -> None:
    """The notice memory is the gateway's (`Gateway._notices`): several messages to an unrouted chat
    get one notice, and another chat gets its own."""
    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, default_agent=None)
        with channel_server(home):
            for i in range(3):
                chat.inject("lost", f"hello {i}")
            chat.inject("lost-too", "hello")
            chat.wait_for_text("lost", lambda t: "not connected to an agent" in t, timeout=15)
            chat.wait_for_text("lost-too", lambda t: "not connected to an agent" in t, timeout=15)
            time.sleep(1.0)
            assert [m.text for m in chat.messages("lost")] == ["This chat is not connected to an agent yet."]
