"""A message with an image is not overtaken by the same person's next message (Slack and Discord).

slack_sdk and discord.py handle each platform event in its own task; the adapters download an
image before handing the message over. Without a per-chat order, the text sent right after an image
reached the gateway first: recorded first, batched with an earlier buffered text, answered first.
A real `appserver serve --channels slack,discord` against the loopback fakes, whose file servers
answer slowly here; the order checked is the one the agent saw (the store) and the ledger's.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config

pytestmark = pytest.mark.timeout(120)

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 2048
DEBOUNCE_MS = 1500


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=3.0) as fake:  # Slack's own 3 s
        yield fake


@pytest.fixture(scope="module")
def discord() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack, discord: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("media-order") / "home"
    accounts: dict[str, dict[str, dict[str, Any]]] = {
        "slack": {"main": {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                           "dm_policy": "open", "default_agent": "assistant", "debounce_ms": DEBOUNCE_MS}},
        "discord": {"main": {"api_url": discord.api_url, "gateway_url": discord.gateway_url,
                             "token_env": "DISCORD_BOT_TOKEN", "dm_policy": "open", "default_agent": "assistant"}},
    }  # fmt: skip
    write_config(home, accounts, ["slack", "discord"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token, DISCORD_BOT_TOKEN=discord.token)
    with channel_server(home, "--channels", "slack,discord", env=env) as server:
        yield server


def agent_saw(home: Path, chat: str) -> list[list[str]]:
    """The message ids of `chat` in each user message the agent got, in the order it got them."""
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT content FROM messages WHERE role='user' ORDER BY id").fetchall()
    finally:
        conn.close()
    out = []
    for (content,) in rows:
        ids = []
        for tag in re.findall(r"<channel-message ([^>]*)>", _text(content)):
            attrs = dict(re.findall(r'(\w+)="([^"]*)"', tag))
            if attrs.get("chat") == chat:
                ids.append(attrs["message_id"].rsplit(":", 1)[-1])
        if ids:
            out.append(ids)
    return out


def _text(content: str) -> str:
    value = json.loads(content)
    if isinstance(value, list):
        return "".join(str(p.get("text") or "") for p in value if isinstance(p, dict))
    return str(value)


def ledger_order(home: Path, chat: str) -> list[str]:
    conn = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT message_id FROM ledger WHERE chat = ? ORDER BY id", (chat,)).fetchall()
    finally:
        conn.close()
    return [str(r[0]).rsplit(":", 1)[-1] for r in rows]


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def turns_of(home: Path, chat: str, count: int) -> list[list[str]]:
    def enough() -> list[list[str]] | None:
        saw = agent_saw(home, chat)
        return saw if sum(len(t) for t in saw) >= count else None

    return wait_for(enough) or agent_saw(home, chat)


def test_slack_a_slow_image_is_not_overtaken_by_the_next_text(srv: ChannelServer, slack: FakeSlack) -> None:
    """Debounced DMs: 'before' is buffered, the image flushes it, 'after' comes after the image."""
    chat = "D-order1"
    slack.add_channel(chat)
    slack.slow_files(1.0)
    try:
        t1 = slack.inject_dm("U1", "before media", channel=chat)
        t2 = slack.inject_dm("U1", "with a picture", channel=chat, files=[slack.add_file("a.png", PNG)])
        t3 = slack.inject_dm("U1", "after media", channel=chat)
        saw = turns_of(srv.home, chat, 3)
    finally:
        slack.slow_files(0)
    assert ledger_order(srv.home, chat) == [t1, t2, t3]
    assert saw == [[t1], [t2], [t3]], f"the agent saw {saw}"
    assert all(slack.acked(slack.event_id_of(ts)) for ts in (t1, t2, t3))


def test_slack_text_right_after_an_image_comes_second(srv: ChannelServer, slack: FakeSlack) -> None:
    chat = "D-order2"
    slack.add_channel(chat)
    slack.slow_files(1.0)
    try:
        t1 = slack.inject_dm("U2", "look at this", channel=chat, files=[slack.add_file("b.png", PNG)])
        t2 = slack.inject_dm("U2", "what is in it?", channel=chat)
        saw = turns_of(srv.home, chat, 2)
    finally:
        slack.slow_files(0)
    assert ledger_order(srv.home, chat) == [t1, t2]
    assert saw == [[t1], [t2]], f"the agent saw {saw}"
    assert "image_url" in _user_contents(srv.home, f"{chat}:{t1}")


def test_slack_a_download_that_times_out_does_not_hold_the_chat(srv: ChannelServer, slack: FakeSlack) -> None:
    """The file server never answers in time: the image is named as a file, the order holds, and the
    next message is still acknowledged within Slack's 3 s (no redelivery)."""
    chat = "D-order3"
    slack.add_channel(chat)
    slack.slow_files(6.0)
    try:
        t1 = slack.inject_dm("U3", "a stuck picture", channel=chat, files=[slack.add_file("c.png", PNG)])
        t2 = slack.inject_dm("U3", "and text", channel=chat)
        saw = turns_of(srv.home, chat, 2)
    finally:
        slack.slow_files(0)
    assert ledger_order(srv.home, chat) == [t1, t2]
    assert saw == [[t1], [t2]], f"the agent saw {saw}"
    for ts in (t1, t2):
        deliveries = slack.deliveries(slack.event_id_of(ts))
        assert [d.retry_attempt for d in deliveries] == [0], f"{ts} was redelivered: {deliveries}"
    assert "image_url" not in _user_contents(srv.home, f"{chat}:{t1}")


def test_discord_a_slow_image_is_not_overtaken_by_the_next_text(srv: ChannelServer, discord: FakeDiscord) -> None:
    discord.slow_attachments(1.0)
    try:
        for user in ("701", "702"):
            dm = discord.dm_channel(user)
            m1 = discord.inject_dm(user, "look at this picture", attachments=[discord.add_attachment("a.png", PNG)])
            m2 = discord.inject_dm(user, "what is in it?")
            saw = turns_of(srv.home, dm, 2)
            assert ledger_order(srv.home, dm) == [m1, m2]
            assert saw == [[m1], [m2]], f"the agent saw {saw}"
            assert "image_url" in _user_contents(srv.home, m1)
    finally:
        discord.slow_attachments(0)


def _user_contents(home: Path, fragment: str) -> str:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT content FROM messages WHERE role='user' ORDER BY id").fetchall()
    finally:
        conn.close()
    return "\n".join(c for (c,) in rows if fragment in c)
