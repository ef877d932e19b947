"""Debounce through the real gateway (issue 16): a burst becomes one turn, a steady stream is
flushed at max_wait_ms, max_items flushes at once, and a kill -9 inside the window loses nothing."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.fakechat import FakeChat
from tests.support.gateway import (
    ChannelServer,
    channel_server,
    fakechat_home,
)

pytestmark = pytest.mark.timeout(120)

SETTINGS = {"debounce_ms": 700, "max_wait_ms": 2500, "max_items": 6}


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("debounce") / "home", chat, **SETTINGS)
    with channel_server(home) as server:
        yield server


def _turn_inputs(home: Path, chat_name: str) -> list[str]:
    """The user messages (turn inputs) of one chat, oldest first."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT content FROM messages WHERE role='user' ORDER BY id").fetchall()
    finally:
        conn.close()
    return [str(c) for (c,) in rows if f'chat=\\"{chat_name}\\"' in str(c) or f'chat="{chat_name}"' in str(c)]


def _indexes(text: str) -> list[tuple[str, str]]:
    return re.findall(r'batch="(\d+)" batch_index="(\d+)"', text.replace('\\"', '"'))


def test_a_burst_becomes_one_turn_with_the_messages_in_order(srv: ChannelServer, chat: FakeChat) -> None:
    for i in range(5):
        chat.inject("burst", f"part {i}", sender="ann")
    chat.wait_for_text("burst", "echo: part 4", timeout=15)
    time.sleep(1.5)
    inputs = _turn_inputs(srv.home, "burst")
    assert len(inputs) == 1, inputs
    assert _indexes(inputs[0]) == [("5", str(i)) for i in range(1, 6)]
    bodies = re.findall(r">(part \d)<", inputs[0])
    assert bodies == [f"part {i}" for i in range(5)]
    assert [m.text for m in chat.messages("burst")] == ["echo: part 4"]


def test_a_steady_stream_is_flushed_at_max_wait(srv: ChannelServer, chat: FakeChat) -> None:
    start = time.monotonic()
    for i in range(9):  # one every 0.4 s: never quiet for 0.7 s, so only max_wait flushes
        chat.inject("stream", f"tick {i}", sender="bob")
        time.sleep(0.4)
    first = chat.wait_for(lambda: chat.messages("stream") or None, timeout=15, what="a first flush")
    assert first[0].t_sent - start < 4.0
    chat.wait_for_text("stream", "echo: tick 8", timeout=15)
    inputs = _turn_inputs(srv.home, "stream")
    assert 2 <= len(inputs) <= 3, inputs
    flat = [b for text in inputs for b in re.findall(r">(tick \d)<", text)]
    assert flat == [f"tick {i}" for i in range(9)]  # nothing lost, nothing reordered


def test_max_items_flushes_at_once(srv: ChannelServer, chat: FakeChat) -> None:
    for i in range(8):
        chat.inject("many", f"item {i}", sender="cy")
    chat.wait_for_text("many", "echo: item 7", timeout=15)
    inputs = _turn_inputs(srv.home, "many")
    assert [len(re.findall(r">(item \d)<", t)) for t in inputs] == [6, 2], inputs


def test_kill_9_inside_the_window_answers_the_messages_once(tmp_path: Path) -> None:
    with FakeChat() as chat:
        slow = {**SETTINGS, "debounce_ms": 3000, "max_wait_ms": 6000}
        home = fakechat_home(tmp_path / "home", chat, **slow)
        with channel_server(home) as srv:
            child = srv.gateway_pid()
            ids = [chat.inject("window", f"kept {i}", sender="dee") for i in range(3)]
            for mid in ids:
                chat.wait_acked(mid, timeout=15)
            os.kill(child, signal.SIGKILL)  # inside the 3 s window: nothing was submitted yet
            _answered_once(chat, srv, home, "window", 60)


def test_a_crash_between_two_access_decisions_still_answers_the_burst_once(tmp_path: Path) -> None:
    """The gateway died after deciding m1 and m2 but not m3: the next one resumed m3 (received)
    before m1 and m2 (allowed), so m3 named the batch while m1 came first in it, and the reply
    followed a batch member that carries no delivery: the turn ran, nobody was answered."""
    from gateway.db import default_path
    from gateway.ledger import Ledger, UpdateKey

    with FakeChat() as chat:
        home = fakechat_home(tmp_path / "home", chat, **{**SETTINGS, "debounce_ms": 300, "max_wait_ms": 1000})
        ledger = Ledger.open(default_path(home))
        for i in range(3):
            payload = {"text": f"kept {i}", "chat_type": "dm", "ts": time.time(), "images": [], "attachments": []}
            ledger.record(UpdateKey("fakechat", "main", f"m{i}"), chat="crash", sender="eve", payload=payload)
        for i in range(2):
            ledger.decide(UpdateKey("fakechat", "main", f"m{i}"), "allow", "dm: open")
        ledger.close()
        with channel_server(home) as srv:
            _answered_once(chat, srv, home, "crash", 30)


def _answered_once(chat: FakeChat, srv: ChannelServer, home: Path, where: str, timeout: float) -> None:
    """`kept 0` … `kept 2` in `where` went to the agent as one turn, answered by one message."""
    try:
        chat.wait_for_text(where, "echo: kept 2", timeout=timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n--- serve log ---\n{srv.log()[-6000:]}") from None
    time.sleep(1.0)
    assert [m.text for m in chat.messages(where)] == ["echo: kept 2"]
    inputs = _turn_inputs(home, where)
    assert len(inputs) == 1 and re.findall(r">(kept \d)<", inputs[0]) == ["kept 0", "kept 1", "kept 2"]
