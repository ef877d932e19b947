"""Pairing and threads (docs/channels.md, "Pairing" and "Routes"): a stranger's kept messages are
released per conversation once approved. A thread is a conversation of its own, so what was written
in a thread is answered there, and what was written on the main line is answered on the main line."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.cli import run_cli
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

CODE = r"[A-HJ-NP-Z2-9]{4}-[A-HJ-NP-Z2-9]{4}"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("pairing-threads") / "home"
    fakechat_home(home, chat, dm_policy="pairing")
    with channel_server(home) as server:
        yield server


def _entries(home: Path, *message_ids: str) -> list[tuple[str, str | None]]:
    """(state, conversation) of each message in the gateway's ledger, as it is now."""
    ledger = Ledger.open(default_path(home))
    try:
        out = []
        for mid in message_ids:
            entry = ledger.get(UpdateKey("fakechat", "main", mid))
            out.append(("not recorded yet", None) if entry is None else (entry.state, entry.conversation))
        return out
    finally:
        ledger.close()


def _user_turns(home: Path) -> list[str]:
    """The text of every user message in the store (one per turn)."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = [str(content) for (content,) in conn.execute("SELECT content FROM messages WHERE role='user'")]
    finally:
        conn.close()
    out = []
    for content in rows:
        value = json.loads(content)
        if isinstance(value, list):
            value = "".join(str(p.get("text") or "") for p in value if isinstance(p, dict))
        out.append(str(value))
    return out


def test_kept_messages_of_a_thread_are_answered_in_that_thread(srv: ChannelServer, chat: FakeChat) -> None:
    first = chat.inject("dm-tia", "main one", sender="tia")
    prompt = chat.wait_for_text("dm-tia", lambda t: "pairing code" in t, timeout=15)
    in_thread = chat.inject("dm-tia", "thread one", sender="tia", thread="t-7")
    second = chat.inject("dm-tia", "main two", sender="tia")
    wait_for(lambda: all(s == "held" for s, _ in _entries(srv.home, first, in_thread, second)), 10, "kept")
    found = re.search(CODE, prompt.text)
    assert found, prompt.text
    approved = run_cli(srv.home, "pairing", "approve", found.group(0).replace("-", ""))
    assert approved.code == 0, approved.err

    # Each conversation's kept messages are its first turn, answered where they were written.
    chat.wait_for_text("dm-tia", lambda t: t == "echo: thread one", thread="t-7", timeout=15)
    chat.wait_for_text("dm-tia", lambda t: t == "echo: main two", timeout=15)
    wait_for(lambda: all(s == "delivered" for s, _ in _entries(srv.home, first, in_thread, second)), 15, "delivered")
    root_echoes = [m.text for m in chat.messages("dm-tia") if m.thread is None and m.text.startswith("echo:")]
    thread_echoes = [m.text for m in chat.messages("dm-tia", "t-7") if m.text.startswith("echo:")]
    assert root_echoes == ["echo: main two"], root_echoes
    assert thread_echoes == ["echo: thread one"], thread_echoes

    # Two turns in two conversations: the main line's a batch of its two messages in order, the thread's its one.
    (_, main_conv), (_, thread_conv), (_, second_conv) = _entries(srv.home, first, in_thread, second)
    assert main_conv == second_conv and main_conv != thread_conv
    turns = [t for t in _user_turns(srv.home) if "main one" in t or "thread one" in t]
    assert len(turns) == 2, turns
    main_turn = next(t for t in turns if "main one" in t)
    assert "thread one" not in main_turn
    assert main_turn.index("main one") < main_turn.index("main two")
    assert 'batch="2" batch_index="1">main one' in main_turn and 'batch="2" batch_index="2">main two' in main_turn
