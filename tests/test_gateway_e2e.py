"""The channel gateway end to end (issue 15): a real `appserver serve --channels fakechat`, its
supervised gateway child, the fakechat user plugin and the loopback fake platform.

One server serves the tests that do not break anything (each uses chats of its own); the crash
tests (tests/test_gateway_crash.py) start their own.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.envelope import AGENT_NOTE
from tests.fakes.fakechat import FakeChat
from tests.support.gateway import (
    ChannelServer,
    channel_server,
    fakechat_home,
    store_turns,
)
from tests.support.wait import eventually

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, chat: FakeChat) -> Iterator[ChannelServer]:
    home = fakechat_home(tmp_path_factory.mktemp("gw") / "home", chat)
    with channel_server(home) as server:
        yield server


def test_a_message_is_answered_once_and_readyz_lists_the_account(srv: ChannelServer, chat: FakeChat) -> None:
    mid = chat.inject("basic", "hello there", sender="ann", sender_name="Ann")
    reply = chat.wait_for_text("basic", lambda t: t == "echo: hello there", timeout=15)
    assert reply.text == "echo: hello there"
    assert chat.is_acked(mid)
    check = srv.channels_check()
    assert check["status"] == "ok" and "fakechat:main running" in check["detail"], check
    assert store_turns(srv.home, 'message_id="' + mid + '"') == 1
    # The agent saw the envelope, escaped, with who wrote it, and, once per conversation, the note
    # saying what these tags are.
    assert store_turns(srv.home, 'sender="ann" sender_name="Ann"') >= 1
    second = chat.inject("basic", "again <b>&", sender="ann")
    chat.wait_for_text("basic", lambda t: t == "echo: again <b>&", timeout=15)
    assert (
        store_turns(srv.home, f'{AGENT_NOTE}\n\n<channel-message channel="fakechat" account="main" chat="basic"') == 1
    )
    assert store_turns(srv.home, f'message_id="{second}"') == 1
    assert store_turns(srv.home, "again &lt;b&gt;&amp;</channel-message>") == 1


def test_a_streamed_reply_grows_by_edits_about_once_a_second(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("stream", "/slow 40")
    words = " ".join(f"w{i}" for i in range(1, 41))
    message = chat.wait_for_text("stream", lambda t: t == words, timeout=30)
    assert len(chat.messages("stream")) == 1, chat.messages("stream")
    assert message.edits >= 1, "a 2 s reply should have grown in place"
    times = [c.t for c in chat.calls(chat="stream") if c.method in ("sendMessage", "editMessageText")]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # About one edit per second, never a burst; the last (exact) one waits at most half the pace.
    assert all(g >= 0.9 for g in gaps[:-1]) and gaps[-1] >= 0.45, gaps
    assert message.history[-1] == words  # the last edit is exact


def test_a_long_reply_with_code_fences_splits_at_the_limit(srv: ChannelServer, chat: FakeChat) -> None:
    block = "```python\n" + "\n".join(f"print({i})  # line {i}" for i in range(250)) + "\n```"
    text = "\n\n".join(f"Paragraph {i}. " + "words " * 60 + "\n\n" + block for i in range(3))
    assert len(text) > 10_000
    chat.inject("long", text)
    expected_tail = "```"
    chat.wait_for(
        lambda: len(chat.messages("long")) >= 3 and chat.messages("long")[-1].text.endswith(expected_tail) or None,
        timeout=30,
        what="a split reply",
    )
    parts = [m.text for m in chat.messages("long")]
    assert all(len(p) <= 4096 for p in parts), [len(p) for p in parts]
    for p in parts:  # every part has balanced fences: a fence is closed and reopened across parts
        assert len(re.findall(r"^```", p, flags=re.M)) % 2 == 0, p[:200]
    joined = "".join(parts)
    for i in range(250):
        assert f"print({i})  # line {i}" in joined


def test_429_retry_after_is_honoured_and_nothing_is_lost(srv: ChannelServer, chat: FakeChat) -> None:
    chat.fail_next("sendMessage", status=429, retry_after=2.0)
    chat.inject("limited", "first")
    chat.wait_for_text("limited", lambda t: t == "echo: first", timeout=20)
    sends = chat.calls("sendMessage", chat="limited")
    assert [c.status for c in sends][:2] == [429, 200], [c.status for c in sends]
    assert sends[1].t - sends[0].t >= 2.0, sends[1].t - sends[0].t
    assert len(chat.messages("limited")) == 1


def test_message_channel_sends_to_another_chat_and_refuses_an_exact_repeat(srv: ChannelServer, chat: FakeChat) -> None:
    chat.inject("elsewhere", "hi bot")  # a chat the account has heard from can be reached
    chat.wait_for_text("elsewhere", "echo: hi bot", timeout=15)
    args = json.dumps({"action": "send", "target": "fakechat:main:elsewhere", "text": "hello from the agent"})
    stranger = json.dumps({"action": "send", "target": "fakechat:main:nowhere", "text": "spam"})
    chat.inject(
        "tooling", f"/call message_channel {args}\n/call message_channel {args}\n/call message_channel {stranger}"
    )
    chat.wait_for(lambda: chat.messages("tooling") or None, timeout=20, what="the turn's reply")
    final = chat.wait_for_text("tooling", lambda t: "message_channel ->" in t and "…" not in t, timeout=20)
    assert [m.text for m in chat.messages("elsewhere")] == ["echo: hi bot", "hello from the agent"]
    assert "sent to fakechat:main:elsewhere" in final.text
    assert "not sent: this is an exact repeat" in final.text
    assert "not sent: fakechat:main:nowhere is not a chat this account has talked to" in final.text
    assert chat.messages("nowhere") == []


def test_a_chat_with_a_route_of_its_own_goes_to_that_agent(srv: ChannelServer, chat: FakeChat, tmp_path: Path) -> None:
    from gateway.db import default_path, open_db
    from gateway.routing import RouteKey, Router

    conn = open_db(default_path(srv.home))
    try:
        Router(conn).add(RouteKey.parse("fakechat:main:routed:__root__"), "nobody-by-this-name")
    finally:
        conn.close()
    chat.inject("routed", "hi")
    notice = chat.wait_for_text("routed", lambda t: "Could not start" in t, timeout=20)
    assert "agent" in notice.text


def test_cron_deliver_sends_the_runs_reply_to_a_chat_and_logs_it(srv: ChannelServer, chat: FakeChat) -> None:
    from tests.support.cli import run_cli
    from tests.support.wait import wait_for

    add = run_cli(srv.home, "cron", "add", "--name", "brief", "--agent", "assistant", "--every", "1d",
                  "--prompt", "morning brief", "--deliver", "fakechat:main:cronchat", "--json")  # fmt: skip
    assert add.code == 0, add.err
    task_id = add.json()["id"]
    run = run_cli(srv.home, "cron", "run", task_id)
    assert run.code == 0, run.err
    message = chat.wait_for_text("cronchat", lambda t: "morning brief" in t, timeout=30)
    assert message.text.startswith("echo:")
    runs = srv.home / "cron-runs" / f"{task_id}.jsonl"
    delivered = wait_for(
        lambda: [r for r in map(json.loads, runs.read_text().splitlines()) if r.get("event") == "delivered"],
        timeout=10,
        what="a delivered record",
    )
    assert delivered[0]["target"] == "fakechat:main:cronchat"
    assert delivered[0]["remote_ids"] == [message.id]


def test_an_empty_message_starts_no_turn(srv: ChannelServer, chat: FakeChat) -> None:
    from gateway.db import default_path
    from gateway.ledger import Ledger, UpdateKey
    from tests.support.wait import wait_for

    empty = chat.inject("empty", "   ")  # a pin notice, a join, a sticker alone: nothing to answer
    chat.inject("empty", "after it")
    chat.wait_for_text("empty", "echo: after it", timeout=15)

    def reason() -> str | None:
        ledger = Ledger.open(default_path(srv.home))
        try:
            entry = ledger.get(UpdateKey("fakechat", "main", empty))
            return None if entry is None else f"{entry.state}: {entry.reason}"
        finally:
            ledger.close()

    assert wait_for(reason, timeout=5, what="the ledger row") == "denied: empty message (no text and no files)"
    assert [m.text for m in chat.messages("empty")] == ["echo: after it"]


def test_a_message_channel_send_the_platform_refuses_counts_in_status(srv: ChannelServer, chat: FakeChat) -> None:
    """A failed `message_channel` send was told to the model only: `channels status` counted no
    failure and showed no reason (cron deliveries, counted since, go the same way)."""
    from tests.support.cli import run_cli

    chat.inject("refusing", "hi bot")
    chat.wait_for_text("refusing", "echo: hi bot", timeout=15)

    def failures() -> int:
        return int(run_cli(srv.home, "channels", "status", "--json").json()["accounts"][0]["failures"])

    # an earlier test's failure may still be on its way (the counters are flushed about once a
    # second): counted from when two reads 1.2 s apart agree
    before, seen = failures(), -1
    for _ in range(8):
        if before == seen:
            break
        time.sleep(1.2)
        before, seen = failures(), before
    args = json.dumps({"action": "send", "target": "fakechat:main:refusing", "text": "blocked now"})
    chat.fail_next("sendMessage", status=403)
    chat.inject("tooling-refused", f"/call message_channel {args}")
    final = chat.wait_for_text("tooling-refused", lambda t: "message_channel ->" in t, timeout=20)
    assert "blocked" in final.text, final.text

    # the gateway flushes its counters about once a second: the status may lag the reply a moment
    def counted() -> dict | None:
        account = run_cli(srv.home, "channels", "status", "--json").json()["accounts"][0]
        return account if account["failures"] > before else None

    status = eventually(counted, timeout=10) or run_cli(srv.home, "channels", "status", "--json").json()["accounts"][0]
    assert status["failures"] == before + 1, status
    assert "message_channel send failed" in status["last_failure"]["reason"], status
