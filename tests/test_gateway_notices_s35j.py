"""A notice that follows a recorded access decision or a refused submit is not lost when the gateway
child dies before it went out (outside finding s35 b F1): the ledger owes it from the decision's
own write on, and the restarted child says it (`Ledger.to_tell`, `Gateway._tell_decision`).

A real `appserver serve --channels telegram` against the loopback fake Bot API. Each test kills the
child with -9 as the notice's sendMessage arrives, and the fake refuses that call (429), so the
notice is certainly not in the chat:

* a stranger's pairing code is posted after the restart, once, and it is the code `pairing list` shows;
* a code denied while the child was down is no longer true: nothing is posted;
* a refused submit's "⚠ Could not start a turn" reaches the chat after the restart;
* a stranger's press on someone else's approval button still gets its refusal after the restart.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.db import default_path
from gateway.ledger import Entry, Ledger, UpdateKey
from tests.fakes.telegram_api import FakeTelegram
from tests.support.cli import cli_env, run_cli
from tests.support.gateway import ChannelServer, channel_server, gateway_children, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

ANN, BOB = 3501, 3502  # Ann is on `allow`; Bob is not
STRANGER, DENIED_STRANGER = 3510, 3511
GROUP = -1003520  # routed to `careful`, whose clock tool asks for approval
CODE_TEXT = "Your pairing code is"
COULD_NOT_START = "⚠ Could not start a turn"
NOT_YOURS = "Only the person who started this, or an admin, can answer it."


@pytest.fixture(scope="module")
def tg() -> Iterator[FakeTelegram]:
    with FakeTelegram() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tg: FakeTelegram) -> Iterator[ChannelServer]:
    """Strangers pair in DMs; listed senders' DMs go to `ghost`, an agent the server does not know
    (every submit is refused: agent_not_found); the group goes to `careful`."""
    home = tmp_path_factory.mktemp("notices") / "home"
    settings = {"api_url": tg.url, "poll_timeout": 1, "token_env": "TG_TOKEN", "dm_policy": "pairing",
                "allow": [str(ANN)], "group_policy": "open", "default_agent": "ghost"}  # fmt: skip
    write_config(home, {"telegram": {"main": settings}}, ["telegram"])
    created = run_cli(home, "agents", "create", "--name", "careful", "--tool", "clock=ask")
    assert created.code == 0, created.err
    routed = run_cli(home, "channels", "route", "add", f"telegram:main:{GROUP}:__root__", "careful")
    assert routed.code == 0, routed.err
    env = cli_env(home, TG_TOKEN=tg.token, APPSERVER_GATEWAY_RESTART_BACKOFF_S="0.2")
    with channel_server(home, "--channels", "telegram", env=env) as server:
        yield server


class KillAtSend:
    """Kills the gateway child with -9 when the first sendMessage to `chat` arrives, and has the fake
    refuse that call (429: not performed). `then` runs after the kill, while the fake waits for it."""

    def __init__(self, srv: ChannelServer, tg: FakeTelegram, chat: int, then: Callable[[], None] | None = None) -> None:
        srv.wait_channels_ready()
        self.srv, self.tg, self.chat, self.then = srv, tg, chat, then
        self.pid = srv.gateway_pid()
        self.done = threading.Event()

    def __enter__(self) -> KillAtSend:
        self.tg.on_request = self._on_request
        return self

    def __exit__(self, *exc: object) -> None:
        self.tg.on_request = None

    def _on_request(self, method: str, params: dict[str, Any]) -> None:
        if self.done.is_set() or method != "sendMessage" or str(params.get("chat_id")) != str(self.chat):
            return
        self.done.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.tg.fail_next("sendMessage", 429, retry_after=1)  # taken by this very call: not performed
        if self.then is not None:
            self.then()

    def wait_restarted(self) -> None:
        wait_for(self.done.is_set, timeout=20, what="the notice's send (the child is killed at it)")
        wait_for(lambda: self.pid not in gateway_children(self.srv.proc.pid), timeout=20, what="the child to die")
        wait_for(lambda: gateway_children(self.srv.proc.pid), timeout=20, what="the restarted child")


def _row(srv: ChannelServer, message_id: str) -> Entry | None:
    ledger = Ledger.open(default_path(srv.home))
    try:
        return ledger.get(UpdateKey("telegram", "main", message_id))
    finally:
        ledger.close()


def _told(srv: ChannelServer, message_id: str) -> Entry:
    """The row once it owes no notice any more (said, or no longer worth saying): its mark is gone."""
    row: Entry = wait_for(
        lambda: (e := _row(srv, message_id)) is not None and e.state != "received" and e.sending is None and e,
        timeout=30,
        what=f"{message_id}'s notice noted as said",
    )
    return row


def _pending_codes(srv: ChannelServer, sender: int) -> list[str]:
    conn = sqlite3.connect(f"file:{default_path(srv.home)}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT code FROM pairing_codes WHERE sender=? AND status='pending'", (str(sender),)
        ).fetchall()
    finally:
        conn.close()
    return [code for (code,) in rows]


def test_a_pairing_code_cut_off_by_a_kill_is_posted_after_the_restart_once(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    with KillAtSend(srv, tg, STRANGER) as kill:
        sent = tg.dm("hello there", user_id=STRANGER, first_name="Zed")
        kill.wait_restarted()
    posted = tg.wait_for_text(STRANGER, lambda t: CODE_TEXT in t, timeout=30)
    row = _told(srv, f"{STRANGER}:{sent.message_id}")
    assert row.state == "held", row
    codes = _pending_codes(srv, STRANGER)
    assert len(codes) == 1 and codes[0] in posted.text, (codes, posted.text)
    assert [m.text for m in tg.messages(STRANGER)] == [posted.text]  # once: the refused send never landed
    listed = run_cli(srv.home, "pairing", "list")
    assert codes[0] in listed.out, listed.out


def test_a_pairing_code_denied_while_the_child_was_down_is_not_posted(srv: ChannelServer, tg: FakeTelegram) -> None:
    denied: list[tuple[list[str], int]] = []

    def deny_the_code() -> None:  # the child is dead, its successor waits for the fake: decided meanwhile
        codes = _pending_codes(srv, DENIED_STRANGER)
        denied.append((codes, run_cli(srv.home, "pairing", "deny", *codes[:1]).code))

    with KillAtSend(srv, tg, DENIED_STRANGER, then=deny_the_code) as kill:
        sent = tg.dm("hello", user_id=DENIED_STRANGER, first_name="Dee")
        kill.wait_restarted()
    assert len(denied) == 1 and len(denied[0][0]) == 1 and denied[0][1] == 0, denied
    srv.wait_channels_ready()
    row = _told(srv, f"{DENIED_STRANGER}:{sent.message_id}")
    assert row.state in ("held", "denied"), row
    assert tg.messages(DENIED_STRANGER) == []


def test_a_refused_submits_notice_cut_off_by_a_kill_reaches_the_chat_after_the_restart(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    with KillAtSend(srv, tg, ANN) as kill:
        sent = tg.dm("hello", user_id=ANN)
        kill.wait_restarted()
    notice = tg.wait_for_text(ANN, lambda t: t.startswith(COULD_NOT_START), timeout=30)
    assert "ghost" in notice.text, notice.text
    row = _told(srv, f"{ANN}:{sent.message_id}")
    assert row.state == "failed" and row.reason is not None and "agent_not_found" in row.reason, row
    assert [m.text for m in tg.messages(ANN)] == [notice.text]


def _prompt_posted(srv: ChannelServer) -> bool:
    conn = sqlite3.connect(f"file:{default_path(srv.home)}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT message_ids FROM approval_prompts").fetchall()
    finally:
        conn.close()
    return any(ids not in (None, "[]") for (ids,) in rows)


def test_a_strangers_press_is_still_refused_after_a_kill_cut_off_the_refusal(
    srv: ChannelServer, tg: FakeTelegram
) -> None:
    ann, bob = tg.user(ANN, "Ann", "ann"), tg.user(BOB, "Bob", "bob")
    tg.inject(GROUP, "/call clock {}", kind="supergroup", sender=ann)
    wait_for(lambda: _prompt_posted(srv), timeout=30, what="the approval prompt posted and noted")
    prompt = next(m for m in tg.messages(GROUP) if m.reply_markup)
    found = re.search(r"/approve (\w+)", prompt.text)
    assert found is not None, prompt.text
    before = [m.text for m in tg.messages(GROUP)]
    with KillAtSend(srv, tg, GROUP) as kill:
        tg.press(GROUP, prompt.message_id, f"approve:{found.group(1)}", sender=bob)
        kill.wait_restarted()
    tg.wait_for_text(GROUP, NOT_YOURS, timeout=30)
    assert [m.text for m in tg.messages(GROUP) if m.text not in before] == [NOT_YOURS]
