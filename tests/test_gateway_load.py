"""Load through the whole channel path (issue 15): 200 messages/s across 20 chats for 4 s through
the fake chat platform, a real `appserver serve --channels fakechat` and the `echo` agent. Nothing
lost, nothing twice, every chat's replies in the order its messages were sent.

4 s (800 messages, 40 a chat): the rate and the chats are what the check is about (each chat's next
message arrives 100 ms after the last, whatever its turn is doing); more seconds only make the same
run longer. bench/gateway_ingress.py takes the numbers over longer runs.

Timings are printed, never asserted (bench/gateway_ingress.py reports them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.fakechat import FakeChat
from tests.support.gateway import (
    channel_server,
    fakechat_home,
    store_turns,
)
from tests.support.gateway_load import run_load

pytestmark = pytest.mark.timeout(240)


def test_200_messages_a_second_across_20_chats_lose_nothing_and_keep_order(tmp_path: Path) -> None:
    with FakeChat() as chat:
        # The platform here has no rate limit of its own; the per-chat budget is raised so the test
        # measures the gateway, not the 1/s default meant for real platforms.
        home = fakechat_home(tmp_path / "home", chat, chat_rate=100)
        with channel_server(home) as srv:
            result = run_load(chat, home, rate=200, seconds=4, chats=20)
            print(
                f"\n{result.sent} messages in {result.inject_s:.1f} s, all replies after {result.drain_s:.1f} s more;"
                f" inbound→submit p50 {result.p50_ms:.1f} ms p99 {result.p99_ms:.1f} ms"
            )
            assert result.lost == [], f"{len(result.lost)} lost, e.g. {result.lost[:5]}"
            assert result.duplicated == [], result.duplicated[:5]
            assert result.out_of_order == [], result.out_of_order
            assert result.replies == result.sent == 800
            assert len(result.submit_ms) == 800  # every message became exactly one turn
            assert store_turns(srv.home, "<channel-message") == 800
