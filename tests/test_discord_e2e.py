"""The Discord channel end to end (issue 19): a real `appserver serve --channels discord`, its gateway
child running plugins/discord with the real discord.py client, against the loopback fake of Discord's
REST API and gateway (tests/fakes/discord_api.py). One server for the module; the kill -9 test runs
last (it restarts the gateway child)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugins.discord import MAX_LENGTH, nonce_for
from tests.fakes.discord_api import BotMessage, FakeDiscord
from tests.support.cli import run_cli
from tests.support.concurrent import run_concurrently
from tests.support.gateway import ChannelServer, discord_server, store_turns

pytestmark = pytest.mark.timeout(120)

GENERAL = "300000000000000001"
APPROVALS = "300000000000000002"  # routed to `careful` (clock=ask)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as f:
        yield f


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, fake: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("discord") / "home"
    with discord_server(home, fake, {APPROVALS: "approvals"}, careful_in=APPROVALS) as server:
        yield server


def test_a_dm_grows_by_edits_and_a_guild_mention_is_answered(srv: ChannelServer, fake: FakeDiscord) -> None:
    mid = fake.inject_dm("601", "/slow 30")
    dm = fake.dm_channel("601")
    words = " ".join(f"w{i}" for i in range(1, 31))
    message = fake.wait_for_text(dm, words, timeout=30)
    assert len(fake.messages(dm)) == 1
    assert message.edits >= 1, "a 1.5 s reply should have grown by edits"
    assert message.history[-1] == words and message.reference is None  # no reply reference in a DM
    assert store_turns(srv.home, f'message_id="{mid}"') == 1
    asked = fake.inject_guild_message("602", "hello guild", mention=True)
    reply = fake.wait_for_text(GENERAL, "echo: hello guild", timeout=20)
    assert reply.reference == asked and reply.nonce == nonce_for(f"discord:main:{asked}:0")
    assert "discord:main running" in srv.channels_check()["detail"]


def test_a_long_reply_is_split_and_everyone_does_not_ping(srv: ChannelServer, fake: FakeDiscord) -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "word and more " * 40 for i in range(8))
    assert len(text) > 2 * MAX_LENGTH
    fake.inject_dm("603", "@everyone " + text)
    dm = fake.dm_channel("603")

    def whole() -> list[BotMessage] | None:
        parts = fake.messages(dm)
        return parts if "".join(p.content for p in parts).count("word and more") == 8 * 40 else None

    parts = fake.wait_for(whole, timeout=30, what="the whole reply, split")
    assert len(parts) >= 3 and all(len(p.content) <= 2000 for p in parts), [len(p.content) for p in parts]
    assert parts[0].content.startswith("echo: @everyone Paragraph 0:")
    assert all(p.allowed_mentions == {"parse": []} for p in parts)  # nobody is pinged
    edits = [c for c in fake.calls("PATCH messages", channel=dm)]
    assert all(c.body.get("allowed_mentions") == {"parse": []} for c in edits)


def test_429_retry_after_is_honoured(srv: ChannelServer, fake: FakeDiscord) -> None:
    fake.fail_next("POST messages", status=429, retry_after=1.5)
    fake.inject_dm("604", "slowly please")
    dm = fake.dm_channel("604")
    fake.wait_for_text(dm, "echo: slowly please", timeout=20)
    calls = fake.wait_for(lambda: (c := fake.calls("POST messages", channel=dm))[1:] and c, timeout=5, what="2 posts")
    assert [c.status for c in calls][:2] == [429, 200], [c.status for c in calls]
    assert calls[1].t - calls[0].t >= 1.5, calls[1].t - calls[0].t
    assert len(fake.messages(dm)) == 1


def test_an_approval_is_answered_by_a_button(srv: ChannelServer, fake: FakeDiscord) -> None:
    channel = APPROVALS
    fake.inject_guild_message("605", "/call clock {}", channel=channel, mention=True)

    def prompt() -> BotMessage | None:
        return next((m for m in fake.messages(channel) if m.components), None)

    shown = fake.wait_for(prompt, timeout=20, what="the approval prompt with buttons")
    assert shown.content.startswith("🔐")
    short = re.search(r"/approve (\w+)", shown.content)
    assert short, shown
    iid = fake.click("605", channel, shown.id, f"approve:{short.group(1)}", name="ann")
    decided = fake.wait_for_text(channel, lambda t: t.startswith("🔐") and "Approved by" in t, timeout=20)
    assert decided.components == []  # the buttons are gone
    assert [b.get("type") for i, b in fake.interaction_callbacks() if i == iid] == [6]
    fake.wait_for_text(channel, lambda t: t.startswith("clock -> "), timeout=20)


def test_a_drop_resumes_and_each_message_is_answered_once(srv: ChannelServer, fake: FakeDiscord) -> None:
    resumes = fake.resumes
    assert fake.drop()
    mid = fake.inject_dm("606", "during the drop")
    dm = fake.dm_channel("606")
    fake.wait_for_text(dm, "echo: during the drop", timeout=20)
    assert fake.resumes >= resumes + 1
    time.sleep(0.5)
    assert len(fake.messages(dm)) == 1 and store_turns(srv.home, f'message_id="{mid}"') == 1


def test_an_event_discord_py_cannot_read_is_skipped_and_the_session_goes_on(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    """A MESSAGE_UPDATE or MESSAGE_CREATE missing fields raised out of discord.py's websocket loop:
    the session dropped and a message arriving during the reconnect was lost. Now it is skipped
    (logged), the connection stays, and the next message is answered."""
    identifies, resumes, connections = fake.identifies, fake.resumes, fake.connections
    fake.dispatch_raw("MESSAGE_UPDATE", {"id": "1", "channel_id": "400000000000000999", "content": "edited"})
    fake.dispatch_raw("MESSAGE_CREATE", {"id": "garbage"})
    fake.inject_dm("615", "after the junk")
    fake.wait_for_text(fake.dm_channel("615"), "echo: after the junk", timeout=20)
    assert (fake.identifies, fake.resumes, fake.connections) == (identifies, resumes, connections)
    assert "skipped a MESSAGE_UPDATE event that could not be read" in srv.log()
    assert "skipped a MESSAGE_CREATE event that could not be read" in srv.log()


def test_an_invalid_session_reidentifies_and_catches_up_once(srv: ChannelServer, fake: FakeDiscord) -> None:
    first = fake.inject_dm("607", "before the outage")
    dm = fake.dm_channel("607")
    fake.wait_for_text(dm, "echo: before the outage", timeout=20)
    identifies = fake.identifies
    fake.hold()
    assert fake.invalidate()
    fake.wait_for(lambda: not fake.connected, timeout=10, what="the session to end")
    missed = [fake.inject_dm("607", f"missed {i}") for i in range(3)]
    fake.release()
    for i in range(3):
        fake.wait_for_text(dm, f"echo: missed {i}", timeout=30)
    assert fake.identifies == identifies + 1
    time.sleep(1.0)  # a duplicate would show up by now
    assert [m.content for m in fake.messages(dm)] == ["echo: before the outage"] + [
        f"echo: missed {i}" for i in range(3)
    ]
    for mid in [first, *missed]:
        assert store_turns(srv.home, f'message_id="{mid}"') == 1


def test_message_channel_reaches_no_other_channel_or_dm_through_the_thread_part(
    srv: ChannelServer, fake: FakeDiscord
) -> None:
    """A Discord thread is a channel of its own: `discord:main:<chat>:<any channel id>` posted into a
    channel that never talked to the bot, or DMed a stranger. Now a thread must be one of that chat."""
    secret = fake.add_text_channel("300000000000000077", "admins-only")
    stranger = fake.dm_channel("688")
    thread = fake.add_thread(GENERAL)
    fake.inject_guild_message("609", "hello general", mention=True)
    fake.wait_for_text(GENERAL, "echo: hello general", timeout=20)
    targets = [
        f"discord:main:{GENERAL}:{secret}",
        f"discord:main:{GENERAL}:{stranger}",
        f"discord:main:{GENERAL}:{thread}",
    ]
    calls = [json.dumps({"action": "send", "target": t, "text": f"to {t}"}) for t in targets]
    fake.inject_dm("609", "\n".join(f"/call message_channel {c}" for c in calls))
    dm = fake.dm_channel("609")
    final = fake.wait_for_text(dm, lambda t: t.count("message_channel ->") == 3 and "…" not in t, timeout=30)
    for refused in targets[:2]:
        assert f"not sent: {refused} is not a chat this account has talked to or routes" in final.content
    assert f"sent to {targets[2]}" in final.content
    assert fake.messages(secret) == [] and fake.messages(stranger) == []
    assert [m.content for m in fake.messages(thread)] == [f"to {targets[2]}"]


def test_kill_9_between_the_send_and_the_ledger_write_keeps_one_message(srv: ChannelServer, fake: FakeDiscord) -> None:
    pid = srv.gateway_pid()
    dm = fake.dm_channel("608")
    fake.delay_next_post(5.0)  # the POST is accepted at once, its answer held: the ledger cannot note it
    mid = fake.inject_dm("608", "once please")
    fake.wait_for(lambda: fake.calls("POST messages", channel=dm) or None, timeout=20, what="the first send")
    os.kill(pid, signal.SIGKILL)
    fake.wait_for(lambda: srv.gateway_pid() != pid or None, timeout=20, what="the restarted child")
    fake.wait_for(lambda: len(fake.calls("POST messages", channel=dm)) >= 2 or None, timeout=40, what="the resend")
    fake.wait_for_text(dm, "echo: once please", timeout=20)
    time.sleep(1.0)  # a duplicate would show up by now
    posts = fake.calls("POST messages", channel=dm)
    assert len({c.body.get("nonce") for c in posts}) == 1 and posts[0].body.get("enforce_nonce") is True
    assert [m.content for m in fake.messages(dm)] == ["echo: once please"]
    assert store_turns(srv.home, f'message_id="{mid}"') == 1


def _status(srv: ChannelServer) -> dict[str, Any]:
    out = run_cli(srv.home, "channels", "status", "--json")
    assert out.code == 0, out.err
    [account] = [a for a in out.json()["accounts"] if a.get("channel") == "discord"]
    return dict(account)


def test_a_refused_token_or_intent_is_state_error_without_a_hot_loop(tmp_path: Path) -> None:
    """Both refusals at once, each with its own fake and server: the quiet window is waited once."""
    run_concurrently(*(functools.partial(_refused, tmp_path / case.replace(" ", "-"), case) for case in REFUSALS))


REFUSALS = ("bad token", "no message content intent")


def _refused(tmp_path: Path, case: str) -> None:
    with FakeDiscord(message_content=case == "bad token") as f:
        token = "not-the-token" if case == "bad token" else f.token
        with discord_server(tmp_path / "home", f, token=token, ready=False) as srv:
            # The gateway creates gateway.db before it starts accounts; `channels status` is polled after
            # that (a status racing the gateway's first migration reports the half-made file as corrupt).
            f.wait_for(lambda: "discord:main: starting" in srv.log() or None, timeout=30, what="the account start")
            status = f.wait_for(lambda: (s := _status(srv)).get("state") == "error" and s, timeout=30, what="error")
            reason = str(status["reason"])
            if case == "bad token":
                assert "DISCORD_BOT_TOKEN" in reason, reason
            else:
                assert "Message Content" in reason and f.identifies == 0, reason
            logins = len(f.calls("GET users"))
            time.sleep(3.0)
            assert len(f.calls("GET users")) == logins  # no retry loop
