"""A notice whose post a kill -9 of the gateway child cut off after Discord performed it is not posted
a second time by the restarted child: it is said under a key of its own, so Discord's nonce answers
the repeat with the message it has (`Outboxes.say_once`).

* a stranger's pairing code, which the ledger owes (`notice_key`): the owed notice itself (s35 j)
  made the repeat; without the key, the stranger saw their code twice;
* "✅ You're approved", which the pairing decision owes until it is handled (s35 k K3: it showed
  twice, with the reply between the two)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.requests import Request

from gateway.db import default_path
from gateway.ledger import Ledger
from tests.fakes.discord_api import FakeDiscord
from tests.support.cli import run_cli
from tests.support.gateway import READY_LINE, ChannelServer, discord_server
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(120)

STRANGER = "7350001"
NEWCOMER = "7350002"
CODE_TEXT = "Your pairing code is"
APPROVED_TEXT = "You're approved"


class Fake(FakeDiscord):
    """The fake, calling `on_post` once a post whose text holds `post_marker` is recorded, before it
    is answered."""

    def __init__(self) -> None:
        super().__init__()
        self.post_marker = ""
        self.on_post: Callable[[], None] | None = None

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        answer = super()._handle(request, method, parts, body, kind)
        hook = self.on_post
        marked = kind == "POST messages" and self.post_marker in str((body or {}).get("content") or "")
        if hook is not None and marked and answer[0] == 200:
            self.on_post = None
            hook()
        return answer

    def kill_at_post(self, marker: str, pid: int) -> None:
        """Kill -9 the gateway child `pid` as the next post holding `marker` is performed."""
        self.post_marker = marker
        self.on_post = lambda: os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fake() -> Iterator[Fake]:
    with Fake() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: Fake) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("notices_s35m") / "home"
    with discord_server(home, fake, dm_policy="pairing") as server:
        yield server


def test_a_pairing_code_posted_as_the_child_was_killed_is_not_posted_again(srv: ChannelServer, fake: Fake) -> None:
    starts = _restarted(srv, 0)
    pid = srv.gateway_pid()
    assert pid is not None
    fake.kill_at_post(CODE_TEXT, pid)  # performed, its answer never read
    fake.inject_dm(STRANGER, "hello, may I come in?", name="zed")
    _restarted(srv, starts, pid)
    told = eventually(lambda: _noted_said(srv), 30)
    assert told, srv.log()[-3000:]
    codes = [m.content for m in fake.messages(fake.dm_channel(STRANGER)) if CODE_TEXT in m.content]
    assert len(codes) == 1, f"the stranger was told {len(codes)} times: {codes}"


def test_an_approval_notice_posted_as_the_child_was_killed_is_not_posted_again(srv: ChannelServer, fake: Fake) -> None:
    starts = _restarted(srv, 0)
    fake.inject_dm(NEWCOMER, "hi, it's me", name="amy")
    dm = fake.dm_channel(NEWCOMER)
    shown = fake.wait_for(lambda: [m.content for m in fake.messages(dm) if CODE_TEXT in m.content], 30, "the code")
    code = re.search(r"approve (\w+)", shown[0])
    assert code, shown
    pid = srv.gateway_pid()
    assert pid is not None
    fake.kill_at_post(APPROVED_TEXT, pid)
    approved = run_cli(srv.home, "pairing", "approve", code.group(1))
    assert approved.code == 0, approved.err
    _restarted(srv, starts, pid)
    fake.wait_for_text(dm, lambda t: t.startswith("echo: hi, it's me"), timeout=30)  # the kept message, answered
    handled = eventually(lambda: _handled(srv, code.group(1)), 30)
    assert handled, srv.log()[-3000:]
    notices = [m.content for m in fake.messages(dm) if APPROVED_TEXT in m.content]
    assert len(notices) == 1, f"the newcomer was told {len(notices)} times: {[m.content for m in fake.messages(dm)]}"


def _restarted(srv: ChannelServer, starts: int, pid: int | None = None) -> int:
    """Wait for the gateway child (a new one than `pid`) to be ready; the number of starts so far."""
    if pid is not None:
        eventually(lambda: srv.gateway_pid() not in (None, pid), 30)
    srv.wait_channels_ready(30, restarts=max(0, starts))
    return srv.log().count(READY_LINE)


def _handled(srv: ChannelServer, code: str) -> bool:
    conn = sqlite3.connect(f"file:{default_path(srv.home)}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT handled FROM pairing_codes WHERE code=?", (code,)).fetchone()
    finally:
        conn.close()
    return bool(row and row[0])


def _noted_said(srv: ChannelServer) -> bool:
    """The restarted child went through the owed notice (the ledger row no longer owes it)."""
    ledger = Ledger.open(default_path(srv.home))
    try:
        return not ledger.to_tell()
    finally:
        ledger.close()
