"""A resumed turn withdrawn before a gateway kill ends at once, by `get_turn`, in a busy group (session 31).

`/cancel` withdraws the sender's turn queued on the server (nothing of it is written to the
history, and no snapshot of it comes again); killed before its row said so, the restarted gateway
picked it back up. With no per-turn lookup in the protocol it could only guess: it took a turn
neither active nor in the history for still queued while any input waited in the conversation's
queue, so in a busy group the withdrawn turn ended only once the queue emptied, and its follower
held every later reply of the conversation (`ChatOrder`) until then: a busy group waited a minute
or more. Now the resumed follower asks the server for its turn by id (`get_turn`), is told it was
withdrawn, and ends at once, failed with the withdraw reason and unanswered; the next member's
reply streams while another member's message still waits in the queue behind it.
Real `appserver serve` with the fakechat channel; gateway.db locked and the gateway killed for real.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.support.wait import eventually, wait_for

pytestmark = pytest.mark.timeout(180)

WITHDRAWN = "withdrawn by /cancel before its turn started"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


def _entry(home: Path, message_id: str) -> tuple[str | None, str | None, str | None]:
    """(state, reason, turn id) of an inbound message's ledger row."""
    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return (entry.state, entry.reason, entry.turn_id) if entry is not None else (None, None, None)
    finally:
        ledger.close()


def _turn_status(home: Path, turn_id: str) -> str | None:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT status FROM turns WHERE id=?", (turn_id,)).fetchone()
        return str(row[0]) if row else None
    finally:
        conn.close()


def _queued(srv: ChannelServer, message_id: str) -> str:
    """The turn id of `message_id` once it is submitted and waits in the server's queue."""
    wait_for(lambda: _entry(srv.home, message_id)[0] == "submitted", 15, f"{message_id} to be submitted")
    turn_id = _entry(srv.home, message_id)[2]
    assert turn_id is not None
    assert _turn_status(srv.home, turn_id) == "queued"
    return turn_id


def _try_withdraw_then_kill(srv: ChannelServer, chat: FakeChat, room: str) -> tuple[str, str, str, int] | None:
    """Bob runs a long turn; Alice's secret, then Carol's long turn and Dave's message, queue behind
    it; Alice's /cancel withdraws her secret on the server with gateway.db held so its row cannot say
    so, and the gateway is killed then. (secret, Carol's, Dave's message ids, the old pid); None when
    the gateway wrote the withdrawn row before the lock was taken, or the lock held it before it sent
    the withdraw (a loaded machine)."""
    first_pid = srv.gateway_pid()
    # about 7 s of words: ten times what the scenario takes up to the kill on a quiet machine (~0.7 s)
    chat.inject(room, "/slow 140", sender="bob", chat_type="group")
    chat.wait_for(lambda: chat.messages(room) or None, timeout=15, what="Bob's reply to start")
    secret = chat.inject(room, "my password is SECRET-g-1", sender="alice", chat_type="group")
    secret_turn = _queued(srv, secret)
    # about 6 s of words: her reply shows (its first word) while Dave's turn still waits behind hers
    carol = chat.inject(room, "/slow 120", sender="carol", chat_type="group")
    _queued(srv, carol)
    dave = chat.inject(room, "hello from dave", sender="dave", chat_type="group")
    _queued(srv, dave)

    lock = sqlite3.connect(str(default_path(srv.home)), timeout=30, isolation_level=None)
    try:
        cancel = chat.inject(room, "/cancel", sender="alice", chat_type="group")
        # hold gateway.db as soon as /cancel is taken: the withdraw reaches the server, its row cannot be written
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            row = lock.execute("SELECT sending FROM ledger WHERE message_id=?", (cancel,)).fetchone()
            if row and row[0]:
                break
        lock.execute("BEGIN IMMEDIATE")
        if not eventually(lambda: _turn_status(srv.home, secret_turn) == "cancelled", 15):
            # the lock came before the gateway's step that sends the withdraw (a slow, loaded
            # machine: CI with six workers on two cores): this round missed its window too
            return None
        state = lock.execute("SELECT state FROM ledger WHERE message_id=?", (secret,)).fetchone()
        if state != ("submitted",):
            return None
        os.kill(first_pid, signal.SIGKILL)
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
    return secret, carol, dave, first_pid


def test_a_withdrawn_turn_in_doubt_ends_at_once_and_the_next_reply_streams_while_the_queue_is_busy(
    tmp_path: Path, chat: FakeChat
) -> None:
    # a group: Alice's /cancel withdraws her queued turn but may not stop Bob's running one nor touch
    # Carol's and Dave's queued behind it, so the conversation's queue is not empty after the restart
    home = fakechat_home(tmp_path / "home", chat, group_policy="open")
    with channel_server(home) as srv:
        for attempt in range(4):
            room = f"room-{attempt}"
            done = _try_withdraw_then_kill(srv, chat, room)
            if done is not None:
                break
        else:
            raise AssertionError("the window between the withdraw and its row was missed four times")
        secret, carol, dave, first_pid = done
        dave_turn = _entry(srv.home, dave)[2]
        assert dave_turn is not None
        wait_for(lambda: srv.gateway_pid() != first_pid, 60, "the supervisor to restart the gateway")

        # Carol's reply (ordered after the withdrawn turn's) shows, or Dave's turn leaves the queue first
        def carol_shown_or_dave_started() -> tuple[bool, str | None] | None:
            shown = any(m.reply_to == carol for m in chat.messages(room))
            status = _turn_status(srv.home, dave_turn)
            return (shown, status) if shown or status != "queued" else None

        shown, dave_status = wait_for(carol_shown_or_dave_started, 90, "Carol's reply or Dave's turn to start")
        # Dave still waits in the queue: the withdrawn turn did not wait for it to empty
        assert (shown, dave_status) == (True, "queued")
        assert _entry(srv.home, secret)[:2] == ("failed", WITHDRAWN)
        chat.wait_for_text(room, "echo: hello from dave", timeout=60)  # the rest of the queue is answered
        chat.wait_for_text(room, lambda t: t.endswith(" w120") and t.startswith("w1 "), timeout=5)
        texts = [m.text for m in chat.messages(room)]
        assert not any("SECRET" in t for t in texts), texts
        assert not any("interrupted" in t for t in texts), texts  # nothing said for the withdrawn turn
