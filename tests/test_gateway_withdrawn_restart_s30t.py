"""A turn `/cancel` withdrew just before the gateway was killed still ends after the restart (session 30).

`/cancel` withdraws the sender's turn queued on the server (the server drops it: nothing of it is
written, no snapshot of it ever comes again), and the gateway fails its row as its follower sees the
end. Killed in between (gateway.db held by another process, so the row stayed `submitted`), the
restarted gateway picked the turn back up, found it neither active nor in the history while the
conversation was busy, took it for queued and waited for snapshots that never came: the row stayed
`submitted` forever, and its follower kept the conversation's order ticket, so no later reply of the
conversation reached the chat. Now a resumed turn ends as the server says it did (`get_turn`: cancelled,
withdrawn; a server without that frame: no trace of it, asked again to be sure), its row failed with
the withdraw reason and no reply, and the later reply arrives.
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
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, fakechat_home
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

WITHDRAWN = "withdrawn by /cancel before its turn started"


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    """One server for the file: each test kills its gateway child (the supervisor restarts it) in a
    room of its own, with a secret of its own.
    A group: Alice's /cancel withdraws her queued turn but may not stop Bob's running one, so the
    conversation is still busy when the gateway comes back (a turn not in the history then looked queued)."""
    home = fakechat_home(tmp_path_factory.mktemp("withdrawn") / "home", chat, group_policy="open")
    # While the test holds gateway.db, each of the gateway's writes (Bob's reply noted as it streams,
    # the status flush) blocks its loop for the busy timeout before it is refused and tried again: at
    # the default 5 s a few of them kept the /cancel's withdraw from reaching the server within the
    # test's 15 s on a loaded machine. Refused all the same, sooner: the rows stay unwritten.
    with channel_server(home, env=cli_env(home, APPSERVER_GATEWAY_DB_BUSY_TIMEOUT_S="1")) as server:
        yield server


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


def _in_history(home: Path, word: str) -> int:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        return sum(word in content for (content,) in conn.execute("SELECT content FROM messages"))
    finally:
        conn.close()


def _withdraw_then_kill(
    srv: ChannelServer, chat: FakeChat, room: str, text: str, bob_words: int
) -> tuple[str, int, str]:
    """Bob runs a long turn (`/slow bob_words`, 0.05 s a word: many times what the scenario up to the
    restarted gateway's verdict takes on a quiet machine, ~1-1.6 s, and a loaded one needs more than
    12 s, so the conversation stays busy through it); Alice's `text` queues behind it and her
    /cancel withdraws it on the server, gateway.db held so its row cannot say so; the gateway is
    killed then. (her message id, the old pid, the room). The lock is taken by polling for the
    /cancel's `sending` mark: on a loaded machine the gateway can write the withdrawn row first, and
    then the scenario runs again in a new room."""
    for attempt in range(4):
        done = _try_withdraw_then_kill(srv, chat, f"{room}-{attempt}", text, bob_words)
        if done is not None:
            return done
    raise AssertionError("the window between the withdraw and its row was missed four times")


def _try_withdraw_then_kill(
    srv: ChannelServer, chat: FakeChat, room: str, text: str, bob_words: int
) -> tuple[str, int, str] | None:
    first_pid = srv.gateway_pid()
    chat.inject(room, f"/slow {bob_words}", sender="bob", chat_type="group")
    chat.wait_for(lambda: chat.messages(room) or None, timeout=15, what="Bob's reply to start")
    secret = chat.inject(room, text, sender="alice", chat_type="group")
    wait_for(lambda: _entry(srv.home, secret)[0] == "submitted", 15, "the secret to be queued on the server")
    turn_id = _entry(srv.home, secret)[2]
    assert turn_id is not None

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
        wait_for(lambda: _turn_status(srv.home, turn_id) == "cancelled", 15, "the server to drop the turn")
        state = lock.execute("SELECT state FROM ledger WHERE message_id=?", (secret,)).fetchone()
        if state != ("submitted",):
            return None  # the window was missed: the gateway had already failed the row
        os.kill(first_pid, signal.SIGKILL)
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()

    return secret, first_pid, room


def _end_bobs_turn(chat: FakeChat, room: str) -> None:
    """Bob's `/cancel` of his long turn once the verdict on the withdrawn one is in: it kept the
    conversation busy through the restart as it had to, and the later reply the test waits for would
    otherwise queue behind the rest of its 25 s. The withdrawn turn's row and order ticket are the
    later reply's business either way (were the cancel refused, his turn would simply run out)."""
    chat.inject(room, "/cancel", sender="bob", chat_type="group")


def test_turn_withdrawn_before_a_kill_ends_and_the_next_reply_arrives(srv: ChannelServer, chat: FakeChat) -> None:
    room = "room"
    secret, first_pid, room = _withdraw_then_kill(srv, chat, room, "my password is SECRET-w-1", 500)  # 25 s
    wait_for(lambda: srv.gateway_pid() != first_pid, 60, "the supervisor to restart the gateway")
    # the withdrawn turn's row ends (its follower does not wait forever), failed and unanswered
    wait_for(lambda: _entry(srv.home, secret)[0] == "failed", 30, "the withdrawn turn's row to end")
    assert _entry(srv.home, secret)[:2] == ("failed", WITHDRAWN)
    _end_bobs_turn(chat, room)
    # and the conversation's later replies are not held behind it
    chat.inject(room, "after restart", sender="alice", chat_type="group")
    chat.wait_for_text(room, "echo: after restart", timeout=60)
    texts = [m.text for m in chat.messages(room)]
    assert not any("SECRET" in t for t in texts)
    assert not any("interrupted" in t for t in texts), texts  # nothing said for the withdrawn turn
    assert _in_history(srv.home, "SECRET-w-1") == 0


def test_a_turn_withdrawn_before_two_kills_in_a_row_still_ends_withdrawn(srv: ChannelServer, chat: FakeChat) -> None:
    """The first restart's notice ended the /cancel's own row; at the second restart only that row said
    the turn was withdrawn, and the turn was told "interrupted" (the server never stopped)."""
    room = "room2"
    secret, first_pid, room = _withdraw_then_kill(srv, chat, room, "my password is SECRET-w-2", 500)  # 25 s
    wait_for(lambda: srv.gateway_pid() != first_pid, 60, "the supervisor to restart the gateway")
    # Something queued: against a server without `get_turn` the withdrawn turn's follower waits while
    # the queue is not empty, and the second kill finds its row still `submitted`; this server says
    # at once that the turn was withdrawn, so the row may have ended already. Either way it ends so.
    queued = chat.inject(room, "/slow 20", sender="carol", chat_type="group")
    wait_for(lambda: _entry(srv.home, queued)[0] == "submitted", 30, "Carol's message to be queued")
    second_pid = srv.gateway_pid()
    os.kill(second_pid, signal.SIGKILL)
    wait_for(lambda: srv.gateway_pid() != second_pid, 60, "the supervisor to restart the gateway again")
    wait_for(lambda: _entry(srv.home, secret)[0] == "failed", 120, "the withdrawn turn's row to end")
    assert _entry(srv.home, secret)[:2] == ("failed", WITHDRAWN)
    _end_bobs_turn(chat, room)
    chat.wait_for_text(room, lambda t: t.endswith(" w20"), timeout=120)  # Carol's turn ran and was answered
    texts = [m.text for m in chat.messages(room)]
    assert not any("SECRET" in t for t in texts)
    assert not any("interrupted (the server stopped" in t for t in texts), texts
