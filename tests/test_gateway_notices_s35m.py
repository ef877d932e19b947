"""A notice the ledger owes (a stranger's pairing code) whose post a kill -9 of the gateway child cut
off after Discord performed it is not posted a second time by the restarted child: it is said under
the row's notice key (`notice_key`), so Discord's nonce answers the repeat with the message it has
(`Outboxes.say_once`). The owed notice itself (s35 j) made the repeat; without the key, the stranger
saw their code twice."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.requests import Request

from gateway.db import default_path
from gateway.ledger import Ledger
from tests.fakes.discord_api import FakeDiscord
from tests.support.gateway import ChannelServer, discord_server
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(120)

STRANGER = "7350001"
CODE_TEXT = "Your pairing code is"


class Fake(FakeDiscord):
    """The fake, calling `on_code_post` once a post of a pairing code is recorded, before it is answered."""

    def __init__(self) -> None:
        super().__init__()
        self.on_code_post: Callable[[], None] | None = None

    def _handle(
        self, request: Request, method: str, parts: list[str], body: Any, kind: str
    ) -> tuple[int, Any, dict[str, str] | None, float]:
        answer = super()._handle(request, method, parts, body, kind)
        hook = self.on_code_post
        is_code = kind == "POST messages" and CODE_TEXT in str((body or {}).get("content") or "")
        if hook is not None and is_code and answer[0] == 200:
            self.on_code_post = None
            hook()
        return answer


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
    srv.wait_channels_ready()
    pid = srv.gateway_pid()
    fake.on_code_post = lambda: os.kill(pid, signal.SIGKILL)  # performed, its answer never read
    fake.inject_dm(STRANGER, "hello, may I come in?", name="zed")
    dm = fake.dm_channel(STRANGER)
    fake.wait_for(lambda: srv.gateway_pid() not in (None, pid) or None, 30, "the restarted gateway child")
    srv.wait_channels_ready(30, restarts=1)
    told = eventually(lambda: _noted_said(srv), 30)
    assert told, srv.log()[-3000:]
    codes = [m.content for m in fake.messages(dm) if CODE_TEXT in m.content]
    assert len(codes) == 1, f"the stranger was told {len(codes)} times: {codes}"


def _noted_said(srv: ChannelServer) -> bool:
    """The restarted child went through the owed notice (the ledger row no longer owes it)."""
    ledger = Ledger.open(default_path(srv.home))
    try:
        return not ledger.to_tell()
    finally:
        ledger.close()
