"""kill -9 at the worst moments (issue 15): the gateway child mid-turn, the child after the platform
delivered an update but before the ledger recorded it, and the server itself. Each time the
message is answered exactly once: one turn in the store, one reply at the fake platform."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest

from tests.fakes.fakechat import FakeChat
from tests.support.concurrent import run_concurrently
from tests.support.gateway import (
    channel_server,
    fakechat_home,
    gateway_children,
    store_turns,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

WORDS_60 = " ".join(f"w{i}" for i in range(1, 61))


def _home(tmp_path: Path, chat: FakeChat) -> Path:
    return fakechat_home(tmp_path / "home", chat)


def test_kill_9_of_the_gateway_and_of_the_server_each_answer_once(tmp_path: Path) -> None:
    """The three crashes side by side, each with its own fake platform and server: they spend their
    time waiting on restarts and quiet windows, so the file waits once instead of three times."""
    run_concurrently(
        functools.partial(_kill_9_of_the_gateway_mid_turn_answers_once, tmp_path / "mid-turn"),
        functools.partial(_kill_9_after_the_platform_delivered_but_before_the_ledger_write, tmp_path / "delivered"),
        functools.partial(_kill_9_of_the_server_ends_the_child_and_a_restart_delivers_once, tmp_path / "server"),
    )


def _kill_9_of_the_gateway_mid_turn_answers_once(tmp_path: Path) -> None:
    with FakeChat() as chat, channel_server(_home(tmp_path, chat)) as srv:
        first = srv.gateway_pid()
        mid = chat.inject("c", "/slow 60")
        chat.wait_for(lambda: chat.messages("c") or None, timeout=20, what="the first streamed text")
        wait_for(lambda: _noted(srv.home, mid), timeout=10, what="the reply's id in the ledger")
        os.kill(first, signal.SIGKILL)
        message = chat.wait_for_text("c", lambda t: t == WORDS_60, timeout=40)
        second = srv.gateway_pid()
        assert second != first, "the supervisor restarted the child"
        assert len(chat.messages("c")) == 1, chat.messages("c")  # the restarted child kept editing it
        assert message.text == WORDS_60
        assert store_turns(srv.home, f'message_id="{mid}"') == 1
        assert "the child exited with code -9" in srv.log()


def _kill_9_after_the_platform_delivered_but_before_the_ledger_write(tmp_path: Path) -> None:
    with FakeChat() as chat, channel_server(_home(tmp_path, chat)) as srv:
        first = srv.gateway_pid()
        chat.crash_next_delivery()
        mid = chat.inject("c", "once please")
        wait_for(lambda: first not in gateway_children(srv.proc.pid), timeout=20, what="the child to die")
        chat.wait_for_text("c", lambda t: t == "echo: once please", timeout=40)
        time.sleep(1.0)  # a duplicate would show up by now
        assert [m.text for m in chat.messages("c")] == ["echo: once please"]
        assert store_turns(srv.home, f'message_id="{mid}"') == 1
        assert chat.is_acked(mid)


def _kill_9_of_the_server_ends_the_child_and_a_restart_delivers_once(tmp_path: Path) -> None:
    with FakeChat() as chat:
        home = _home(tmp_path, chat)
        with channel_server(home) as srv:
            child = srv.gateway_pid()
            mid = chat.inject("c", "/slow 60")
            chat.wait_for(lambda: chat.messages("c") or None, timeout=20, what="the first streamed text")
            wait_for(lambda: _noted(home, mid), timeout=10, what="the reply's id in the ledger")
            srv.proc.kill()
            srv.proc.wait(10)
            # The child notices stdin EOF and exits: nothing is orphaned.
            wait_for(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), timeout=15, what="child exit")
        with channel_server(home) as srv2:
            # The turn was interrupted by the crash: the message the chat already showed is finished
            # in place, keeping its text and saying what happened.
            final = chat.wait_for_text("c", lambda t: "interrupted" in t, timeout=40)
            time.sleep(1.5)
            assert len(chat.messages("c")) == 1, chat.messages("c")
            assert final.text.startswith("w1"), final.text  # what the chat showed stays
            assert final.text.endswith("⚠ The reply was interrupted (the server stopped while it was being written).")
            assert store_turns(srv2.home, f'message_id="{mid}"') == 1
            from gateway.db import default_path
            from gateway.ledger import Ledger, UpdateKey

            ledger = Ledger.open(default_path(home))
            try:
                entry = ledger.get(UpdateKey("fakechat", "main", mid))
            finally:
                ledger.close()
            assert entry is not None and entry.state == "delivered", entry


def _noted(home: Path, message_id: str) -> bool:
    """The ledger recorded the platform id of the streamed reply (past the one-write crash window
    that docs/channels.md documents, where a kill would legitimately repeat the send)."""
    from gateway.db import default_path
    from gateway.ledger import Ledger, UpdateKey

    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return entry is not None and bool(entry.remote_ids)
    finally:
        ledger.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
