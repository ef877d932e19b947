"""Another process holds gateway.db's write lock past the gateway's busy timeout (a backup tool,
an `sqlite3` shell) while the gateway has bookkeeping to write: the write is tried again until it
goes through, nothing that writes it dies.

A reply whose progress could not be noted killed its follower ("Task exception was never
retrieved ... database is locked"): its row stayed `finished` with the reply in the chat, and the
next restart sent it again, after the replies that came since. The status flush died the same way
and never saved the counters again, and so did the pairing watch (no approval acted on until a
restart). Now a reply's note is written (retried) before anything more goes out, its `delivered`
before the chat's next reply, the flush tries again after a backoff, and the watch is run again
(gateway/replies.py `write_until_done`, `ReplyNotes`; gateway/app.py `_flush_status_forever`,
`_keep_running`).

Real parts: `appserver serve --channels telegram` with python-telegram-bot against the loopback fake
Bot API (tests/fakes/telegram_api.py); the lock is a `BEGIN IMMEDIATE` from this process's own
sqlite3 connection, taken the moment the fake has put the reply in the chat (before the gateway
reads the answer), or while an account change waits to be saved.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.db import default_path
from tests.fakes.telegram_api import Call, FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.wait import eventually, wait_for

pytestmark = pytest.mark.timeout(180)

# gateway.db's busy timeout for the gateway under test (5 s unless set): how long each write waits
# for the lock before it is refused and tried again.
BUSY_TIMEOUT_S = 1.0
# The lock is held until the gateway logs that the write under test was refused (each attempt waits
# out the busy timeout, and the pairing watch's own writes take turns with it), at most this long.
HOLD_MAX_S = 40.0
NOTE_REFUSED = "gateway.db refused a note of the reply's progress"
FLUSH_REFUSED = "could not save the accounts' status to gateway.db"
WATCH_STOPPED = "acting on pairing decisions stopped on an error"
USER = 7301
# This file's ports (50010-50499), a hundred per xdist worker; one taken (an ephemeral port of some
# other connection) is passed over.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 4
_PORTS = iter(range(50010 + 100 * _WORKER, 50110 + 100 * _WORKER))


def _port() -> int:
    for port in _PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port left in this file's range")


def _home(tmp_path: Path, tg: FakeTelegram, dm_policy: str) -> Path:
    home = tmp_path / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "default_agent": "assistant",
                "dm_policy": dm_policy}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    return home


@contextmanager
def _server(tmp_path: Path, tg: FakeTelegram, port: int, dm_policy: str = "open") -> Iterator[ChannelServer]:
    home = _home(tmp_path, tg, dm_policy)
    env = cli_env(
        home,
        TG_TOKEN=tg.token,
        APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2",
        APPSERVER_GATEWAY_DB_BUSY_TIMEOUT_S=str(BUSY_TIMEOUT_S),
    )
    with channel_server(home, "--channels", "telegram", "--listen", f"127.0.0.1:{port}", env=env) as srv:
        yield srv


def _read(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _states(db: Path) -> dict[str, str]:
    return {
        str(text): str(state) for text, state in _read(db, "SELECT json_extract(payload, '$.text'), state FROM ledger")
    }


def _saved_counts(db: Path) -> tuple[object, ...] | None:
    rows = _read(db, "SELECT messages_in, replies FROM account_status WHERE channel='telegram' AND account='main'")
    return rows[0] if rows else None


def test_a_reply_noted_while_the_ledger_is_locked_is_recorded_and_never_sent_again(tmp_path: Path) -> None:
    with FakeTelegram(port=_port()) as tg, _server(tmp_path, tg, _port()) as srv:
        db = default_path(srv.home)
        holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        held = threading.Event()

        def lock_once_sent(call: Call) -> None:
            # the reply is in the chat, its answer not read yet: the gateway's next write finds the lock
            if call.method == "sendMessage" and "echo: first" in str(call.params.get("text")) and not held.is_set():
                holder.execute("BEGIN IMMEDIATE")
                held.set()

        tg.on_answer = lock_once_sent
        try:
            tg.dm("first", user_id=USER)
            assert held.wait(60), "the first reply was never sent"
            eventually(lambda: NOTE_REFUSED in srv.log(), HOLD_MAX_S, interval=0.2)
        finally:
            if holder.in_transaction:
                holder.execute("ROLLBACK")
            holder.close()
            tg.on_answer = None
        tg.wait_for_text(USER, "echo: first", 30)

        tg.dm("second", user_id=USER)
        tg.wait_for_text(USER, "echo: second", 60)
        # its own row settled too (a kill before that is the crash window docs/channels.md owns)
        wait_for(lambda: _states(db).get("second") == "delivered", 30, "the second reply recorded delivered")

        gateway = srv.gateway_pid()
        os.kill(gateway, signal.SIGKILL)
        wait_for(lambda: srv.gateway_pid() != gateway, 30, "the gateway child to be restarted")
        srv.wait_channels_ready()
        tg.dm("third", user_id=USER)
        tg.wait_for_text(USER, "echo: third", 60)

        texts = [m.text for m in tg.messages(USER)]
        assert texts == ["echo: first", "echo: second", "echo: third"], texts
        states = eventually(lambda: set(_states(db).values()) == {"delivered"} and _states(db), 30)
        assert states, _states(db)
        log = srv.log()
        assert NOTE_REFUSED in log and "the reply's progress is noted now" in log
        assert "never retrieved" not in log


def test_the_status_flush_outlives_a_locked_ledger(tmp_path: Path) -> None:
    with FakeTelegram(port=_port()) as tg, _server(tmp_path, tg, _port()) as srv:
        db = default_path(srv.home)
        tg.dm("one", user_id=USER)
        tg.wait_for_text(USER, "echo: one", 60)
        wait_for(lambda: _saved_counts(db) == (1, 1), 30, "the counters of the first message saved")

        holder = sqlite3.connect(db, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            tg.other_poller(True)  # the account goes `conflict`: a change the flush must save, under the lock
            wait_for(lambda: any(c.status == 409 for c in tg.calls("getUpdates")), 30, "a refused poll")
            eventually(lambda: FLUSH_REFUSED in srv.log(), HOLD_MAX_S, interval=0.2)
        finally:
            tg.other_poller(False)
            if holder.in_transaction:
                holder.execute("ROLLBACK")
            holder.close()

        tg.dm("two", user_id=USER)
        tg.wait_for_text(USER, "echo: two", 90)
        counts = eventually(lambda: _saved_counts(db) == (2, 2), 30)
        assert counts, f"the flush stopped saving: saved {_saved_counts(db)}, want (2, 2)\n{srv.log()[-3000:]}"
        log = srv.log()
        assert FLUSH_REFUSED in log
        assert "never retrieved" not in log


def test_pairing_decisions_are_acted_on_after_a_locked_ledger(tmp_path: Path) -> None:
    """The pairing watch writes every second (it claims the decisions to act on): it died on the
    first "database is locked", and no approval was acted on again until a restart."""
    with FakeTelegram(port=_port()) as tg, _server(tmp_path, tg, _port(), dm_policy="pairing") as srv:
        db = default_path(srv.home)
        tg.dm("hello", user_id=USER)
        prompt = tg.wait_for_text(USER, lambda t: "pairing code" in t.lower(), 60)
        code = re.search(r"approve (\w+)", prompt.text)
        assert code, prompt.text

        holder = sqlite3.connect(db, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            eventually(lambda: WATCH_STOPPED in srv.log(), HOLD_MAX_S, interval=0.2)
        finally:
            holder.execute("ROLLBACK")
            holder.close()

        approved = run_cli(srv.home, "pairing", "approve", code.group(1))
        assert approved.code == 0, approved.err
        tg.wait_for_text(USER, "echo: hello", 60)  # the kept message is the first turn
        assert "never retrieved" not in srv.log()


def test_a_new_chats_conversation_bound_while_the_ledger_is_locked_is_answered_in_order(tmp_path: Path) -> None:
    """The server made a new chat's conversation while gateway.db was locked: binding it to the chat
    failed, the message was left `allowed` with no follower and unanswered, the next message was
    answered in another new conversation, and a restart answered the first one last."""
    with FakeTelegram(port=_port()) as tg, _server(tmp_path, tg, _port()) as srv:
        db = default_path(srv.home)
        server_db = sqlite3.connect(srv.home / "appserver.db", isolation_level=None, check_same_thread=False)
        holder = sqlite3.connect(db, isolation_level=None)
        try:
            server_db.execute("BEGIN IMMEDIATE")  # the conversation's creation waits for it
            tg.dm("first", user_id=USER)
            wait_for(lambda: _states(db).get("first") == "allowed", 30, "the first message let in")
            holder.execute("BEGIN IMMEDIATE")
            server_db.execute("ROLLBACK")  # the conversation is made now; its binding finds the lock
            eventually(lambda: "gateway.db refused the write" in srv.log(), HOLD_MAX_S, interval=0.2)
        finally:
            for conn in (server_db, holder):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.close()
        tg.wait_for_text(USER, "echo: first", 60)
        tg.dm("second", user_id=USER)
        tg.wait_for_text(USER, "echo: second", 60)
        assert [m.text for m in tg.messages(USER)] == ["echo: first", "echo: second"]
        conversations = run_cli(srv.home, "conversations", "list", "--json")
        assert conversations.code == 0, conversations.err
        assert len(json.loads(conversations.out)) == 1, conversations.out  # both in the chat's one conversation
        assert "processing a message failed" not in srv.log()
