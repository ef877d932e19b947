"""Replies of one conversation keep their order across a gateway kill -9 (session 31).

Found from outside: the platform answered the first reply's send 429 (retry after 4 s), so message
A's row sat `finished` while the later message B's turn ran (`submitted`). Killed then, the restarted
gateway followed every `submitted` row before every `finished` one; each follower takes its
conversation's reply ticket as it starts, so B's reply reached the chat before A's. Now both are
followed in arrival order. Real `appserver serve` with the fakechat channel; the gateway killed for real.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import default_path
from gateway.ledger import Ledger, UpdateKey
from tests.fakes.fakechat import FakeChat
from tests.support.gateway import channel_server, fakechat_home
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


def _state(home: Path, message_id: str) -> str | None:
    ledger = Ledger.open(default_path(home))
    try:
        entry = ledger.get(UpdateKey("fakechat", "main", message_id))
        return entry.state if entry is not None else None
    finally:
        ledger.close()


def test_an_earlier_finished_reply_goes_out_before_a_later_running_turns_reply(tmp_path: Path, chat: FakeChat) -> None:
    home = fakechat_home(tmp_path / "home", chat)
    with channel_server(home) as srv:
        chat.fail_next("sendMessage", 429, retry_after=5.0, count=1)  # A's reply waits on the platform
        first = chat.inject("room", "first question")
        second = chat.inject("room", "/slow 60")  # about 3 s of words, queued behind A
        wait_for(
            lambda: _state(home, first) == "finished" and _state(home, second) == "submitted",
            30,
            "A finished (its reply held by the 429) while B's turn runs",
        )
        old_pid = srv.gateway_pid()
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: srv.gateway_pid() != old_pid, 60, "the supervisor to restart the gateway")
        wait_for(
            lambda: _state(home, first) == "delivered" and _state(home, second) == "delivered",
            60,
            "both replies delivered",
        )
        texts = [m.text for m in chat.messages("room")]
        assert texts, texts
        assert texts[0] == "echo: first question", texts
        assert texts[-1].endswith(" w60"), texts
