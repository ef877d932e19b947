"""Images and the server's frame limit on Slack and Discord (twentieth session's outside tests).

An image travels to the server base64-encoded (4 bytes for every 3) in the turn's one frame of at
most 4 MiB. A 3.5 MiB image, and two 2 MiB images of one message, used to make that frame too big:
the whole message failed (`frame_too_large`) and its text was lost. Now an image bigger than the
budget is not fetched and is named as too big, and images that fit alone but not together leave the
biggest out, named: the text always reaches the agent. A real `appserver serve --channels
slack,discord` against the loopback fakes.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack
from tests.support.cli import cli_env
from tests.support.gateway import ChannelServer, channel_server, write_config
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _png(size: int, fill: bytes) -> bytes:
    head = b"\x89PNG\r\n\x1a\n"
    return head + fill * (size - len(head))


@pytest.fixture(scope="module")
def slack() -> Iterator[FakeSlack]:
    with FakeSlack(ack_timeout=3.0) as fake:
        yield fake


@pytest.fixture(scope="module")
def discord() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, slack: FakeSlack, discord: FakeDiscord) -> Iterator[ChannelServer]:
    home = tmp_path_factory.mktemp("s20-media") / "home"
    accounts: dict[str, dict[str, dict[str, Any]]] = {
        "slack": {"main": {"api_url": slack.url, "bot_token_env": "SLACK_BOT", "app_token_env": "SLACK_APP",
                           "dm_policy": "open", "default_agent": "assistant"}},
        "discord": {"main": {"api_url": discord.api_url, "gateway_url": discord.gateway_url,
                             "token_env": "DISCORD_BOT_TOKEN", "dm_policy": "open", "default_agent": "assistant"}},
    }  # fmt: skip
    write_config(home, accounts, ["slack", "discord"])
    env = cli_env(home, SLACK_BOT=slack.bot_token, SLACK_APP=slack.app_token, DISCORD_BOT_TOKEN=discord.token)
    with channel_server(home, "--channels", "slack,discord", env=env) as server:
        yield server


def _images_with(home: Path, fragment: str) -> int:
    conn = sqlite3.connect(f"file:{home / 'appserver.db'}?mode=ro", uri=True)
    try:
        rows = [json.loads(c) for (c,) in conn.execute("SELECT content FROM messages WHERE role='user'")]
    finally:
        conn.close()
    mine = [r for r in rows if fragment in json.dumps(r)]
    assert mine, f"no stored input with {fragment!r}"
    last = mine[-1]
    if not isinstance(last, list):
        return 0
    return sum(1 for p in last if isinstance(p, dict) and p.get("type") in ("image", "image_url"))


def _states(home: Path, chat: str) -> list[str]:
    conn = sqlite3.connect(f"file:{home / 'channels' / 'gateway.db'}?mode=ro", uri=True)
    try:
        return [str(s) for (s,) in conn.execute("SELECT state FROM ledger WHERE chat=? ORDER BY id", (chat,))]
    finally:
        conn.close()


def test_slack_images_too_big_for_the_frame_are_named_and_the_text_goes_on(
    srv: ChannelServer, slack: FakeSlack
) -> None:
    chat = "D-s20-big"
    slack.add_channel(chat)
    big = _png(3 * MIB + 512 * 1024, b"a")  # 4.7 MiB of base64 alone
    slack.inject_dm("U1", "one big picture", channel=chat, files=[slack.add_file("big.png", big)])
    reply = slack.wait_for_text(chat, lambda t: "one big picture" in t, timeout=30)
    assert "too big to pass on" in reply.text and "big.png" in reply.text, reply.text
    assert _images_with(srv.home, "one big picture") == 0

    two = [slack.add_file("p1.png", _png(2 * MIB, b"b")), slack.add_file("p2.png", _png(2 * MIB + 4096, b"c"))]
    slack.inject_dm("U1", "two pictures", channel=chat, files=two)
    reply = slack.wait_for_text(chat, lambda t: "two pictures" in t, timeout=30)
    assert "too big to pass on" in reply.text and "p2.png" in reply.text and "p1.png" not in reply.text, reply.text
    assert _images_with(srv.home, "two pictures") == 1
    wait_for(lambda: _states(srv.home, chat) == ["delivered", "delivered"], 10, "both delivered")


def test_discord_images_too_big_for_the_frame_are_named_and_the_text_goes_on(
    srv: ChannelServer, discord: FakeDiscord
) -> None:
    user = "7201"
    dm = discord.dm_channel(user)
    big = _png(3 * MIB + 512 * 1024, b"d")
    discord.inject_dm(user, "one big picture", attachments=[discord.add_attachment("big.png", big)])
    reply = discord.wait_for_text(dm, lambda t: "one big picture" in t, timeout=30)
    assert "too big to pass on" in reply.content and "big.png" in reply.content, reply.content
    assert _images_with(srv.home, "one big picture") == 0

    two = [
        discord.add_attachment("p1.png", _png(2 * MIB, b"e")),
        discord.add_attachment("p2.png", _png(2 * MIB + 4096, b"f")),
    ]
    discord.inject_dm(user, "two pictures", attachments=two)
    reply = discord.wait_for_text(dm, lambda t: "two pictures" in t, timeout=30)
    assert "too big to pass on" in reply.content and "p2.png" in reply.content and "p1.png" not in reply.content, (
        reply.content
    )
    assert _images_with(srv.home, "two pictures") == 1
    wait_for(lambda: _states(srv.home, dm) == ["delivered", "delivered"], 10, "both delivered")
